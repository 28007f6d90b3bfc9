"""ReCycle: re-routing trains the fault-free model; plans are valid, planned ahead, cached;
the ablation levels order as the mechanisms say."""
import json

import pytest

from conftest import LOCAL, assert_matches_fault_free, compose, run
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.planning import heuristic, library as library_module
from ftbench.planning.library import PlanLibrary, forms_up_to
from ftbench.planning.problem import (PlanningError, PlanningProblem, ProblemCosts, StageTimes, normalise,
                                      canonical_failed)
from ftbench.schedule import validate
from ftbench.sim.simulator import simulate
from ftbench.strategies import build_strategy

RECYCLE = ("strategy=recycle", "strategy.plan_cache=null")


def _events(*events) -> tuple:
    body = ",".join("{" + ",".join(f"{k}:{v}" for k, v in e.items()) + "}" for e in events)
    return ("failures=scripted", f"failures.events=[{body}]")


# pp=4: node = pipeline * 4 + stage (one GPU per node).
SCRIPTS = {
    "one failure": ((), _events(dict(iteration=5, node=5))),
    "two failures in one stage": (("cluster.dp=3",), _events(dict(iteration=3, node=1), dict(iteration=6, node=5))),
    "two stages, one iteration": ((), _events(dict(iteration=4, node=1), dict(iteration=4, node=6))),
    "failure then rejoin": ((), _events(dict(iteration=3, node=5), dict(iteration=6, node=5, kind="join"))),
    "whole pipeline lost": (("cluster.dp=3",), _events(*(dict(iteration=2, node=n) for n in (4, 5, 6, 7)))),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_rerouted_training_matches_fault_free(tmp_path, script):
    setup, faults = SCRIPTS[script]
    s = assert_matches_fault_free(tmp_path, setup=setup, faults=(*RECYCLE, *faults))
    fails = sum(1 for e in faults[1].split("{")[1:] if "join" not in e)
    assert s["failures"] == fails
    assert all(r["lost_iterations"] == 0 for r in s["recoveries"])  # only the iteration in flight is redone
    if script == "failure then rejoin":
        assert s["recoveries"][-1]["actions"] == ["Rendezvous", "SyncFromPeers"]
        assert s["recoveries"][-1]["plan"] == "recycle (fault-free, 1f1b)"  # back on the configured schedule


@pytest.mark.parametrize("level", ["reroute", "decoupled"])
def test_every_ablation_level_matches_fault_free(tmp_path, level):
    setup, faults = SCRIPTS["two stages, one iteration"]
    assert_matches_fault_free(tmp_path, setup=setup, faults=(*RECYCLE, f"strategy.level={level}", *faults))


def test_a_stage_without_replicas_is_unrecoverable_or_falls_back(tmp_path):
    faults = _events(dict(iteration=3, node=1), dict(iteration=6, node=5))  # both replicas of stage 1
    s = run(tmp_path / "none", *LOCAL, *RECYCLE, *faults)
    assert s["status"] == "unrecoverable" and "last replica of stage 1" in s["error"]
    s = assert_matches_fault_free(tmp_path, faults=(*RECYCLE, "strategy.fallback=checkpoint", "strategy.every=4",
                                                    *faults))
    first, second = s["recoveries"]
    assert first["actions"] == ["Rendezvous"] and first["lost_iterations"] == 0
    assert second["actions"] == ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    assert second["restored_iteration"] == 4 and second["lost_iterations"] == 2


def test_joins_are_logged_and_charged_in_the_simulator(tmp_path):
    s = run(tmp_path, "backend=sim", "model=gpt3-medium", "train.iterations=40", *RECYCLE,
            *_events(dict(iteration=10, node=5), dict(iteration=20, node=5, kind="join")))
    assert s["status"] == "ok" and s["iterations"] == 40
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("fail", "join")] == ["fail", "join"]
    fail, join = s["recoveries"]
    assert fail["actions"] == ["Rendezvous"] and join["actions"] == ["Rendezvous", "SyncFromPeers"]
    # The returning worker receives its stage's weights and Adam state over the network.
    assert join["recovery_s"] > fail["recovery_s"]


# -- plans --------------------------------------------------------------------------------

def _library(decoupled: bool, pp=4, dp=4, m=8, cache=None) -> PlanLibrary:
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", f"cluster.pp={pp}", f"cluster.dp={dp}",
                                         f"train.microbatches={m}"))
    from ftbench.planning.problem import problem_for
    return PlanLibrary(problem_for(ctx, pp, dp, 1, decoupled=decoupled), "heuristic", cache_dir=cache)


@pytest.mark.parametrize("decoupled", [True, False])
def test_every_plan_up_to_two_failures_is_valid(decoupled):
    lib = _library(decoupled)
    forms = forms_up_to(2, 4, 4, 1)
    # 1 fault-free + 4 (one failure) + 6 (two in one pipeline) + 10 (two pipelines, any stages)
    assert len(forms) == 21
    for form in forms:
        problem = lib.problem(form)
        plan = lib.get(form)
        schedule = problem.to_schedule(plan.orders, "x")
        validate(schedule)
        result = simulate(schedule, ProblemCosts(problem), dedupe=False)
        for w, peak in result.peak_stash.items():
            assert peak <= problem.stash_cap(divmod(w, 4))
        failed_workers = {d * 4 + s for d, s in problem.failed}
        assert not failed_workers & set(schedule.ops)  # nothing runs on a failed worker


def test_renamed_failure_sets_share_one_plan():
    a, order_a = normalise({(0, 1), (2, 3)}, 4, 4)
    b, order_b = normalise({(3, 1), (1, 3)}, 4, 4)
    assert a == b and order_a != order_b
    assert canonical_failed(a) == frozenset({(0, 1), (1, 3)})


def test_plans_are_cached_on_disk_keyed_by_what_they_depend_on(tmp_path, monkeypatch):
    form = normalise({(0, 1)}, 4, 2)[0]
    first = _library(True, dp=2, cache=tmp_path).get(form)
    assert not first.cached and len(list(tmp_path.glob("*.json"))) == 1

    def no_planning(*_a, **_k):
        raise AssertionError("planned again although the plan is on disk")
    monkeypatch.setattr(library_module, "list_schedule_timed", no_planning)
    monkeypatch.setattr(library_module, "list_schedule_shaped", no_planning)
    again = _library(True, dp=2, cache=tmp_path).get(form)
    assert again.cached and again.orders == first.orders
    with pytest.raises(AssertionError, match="planned again"):  # other micro-batch count: other key
        _library(True, dp=2, m=6, cache=tmp_path).get(form)


def test_no_planning_on_the_critical_path(monkeypatch):
    cfg = compose("backend=sim", *RECYCLE, "cluster.dp=4")
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)

    def no_planning(*_a, **_k):
        raise AssertionError("a failure within plan_ahead ran the planner")
    monkeypatch.setattr(library_module, "list_schedule_timed", no_planning)
    monkeypatch.setattr(library_module, "list_schedule_shaped", no_planning)
    for node in (5, 10):  # two failures: within plan_ahead=2
        cluster.fail(node)
        recovery = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1)
        validate(recovery.plan.schedule)
        assert node not in recovery.plan.node_of
    cluster.fail(3)  # a third failure is beyond the threshold: planned now (and it needs the planner)
    with pytest.raises(AssertionError, match="ran the planner"):
        strategy.on_event(FailureEvent(3, iteration=1), cluster, 1)


def test_a_stage_with_no_survivor_has_no_plan():
    t = StageTimes(1.0, 1.0, 1.0)
    with pytest.raises(PlanningError, match="stage 1"):
        PlanningProblem(pp=2, dp=2, microbatches=2, stages=(t, t), failed={(0, 1), (1, 1)})


def test_rerouted_microbatches_are_spread_over_the_peers():
    t = StageTimes(1.0, 1.0, 1.0)
    p = PlanningProblem(pp=2, dp=4, microbatches=6, stages=(t, t), failed={(0, 1), (1, 1)})
    assert p.load[(2, 1)] == p.load[(3, 1)] == 12 and p.load[(2, 0)] == 6
    assert sum(p.load.values()) == 2 * 4 * 6  # the global batch is unchanged


# -- the staggered optimizer and the ablation ---------------------------------------------

def test_staggered_optimizer_overlaps_the_iteration_boundary():
    # pp=2, one micro-batch, a slow optimizer step on stage 1. With the barrier, stage 0's
    # next forward waits for stage 1's step (F0 F1 BW1 BW0 | OPT1 = 3 + 10); staggered, the
    # period is stage 1's own cycle F1 + BW1 + OPT1 = 12.
    slow = StageTimes(1.0, 1.0, 0.0, optimizer_s=10.0)
    fast = StageTimes(1.0, 1.0, 0.0)
    p = PlanningProblem(pp=2, dp=1, microbatches=1, stages=(fast, slow), decoupled=False)
    schedule = p.to_schedule(heuristic.list_schedule(p), "x")
    assert simulate(schedule, ProblemCosts(p)).iteration_time == pytest.approx(13.0)
    assert simulate(schedule, ProblemCosts(p), staggered=True).iteration_time == pytest.approx(12.0)


def _iteration_time(level: str, *, fail_node=None, dp=4) -> float:
    cfg = compose("backend=sim", "model=gpt3-medium", *RECYCLE, f"strategy.level={level}", "strategy.plan_ahead=1",
                  f"cluster.dp={dp}", "train.microbatches=8")
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    plan = strategy.plan(cluster)
    if fail_node is not None:
        cluster.fail(fail_node)
        plan = strategy.on_event(FailureEvent(fail_node, iteration=1), cluster, 1).plan
    return simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer).iteration_time


@pytest.mark.parametrize("node", [1, 2])  # a worker of stage 1, of stage 2
def test_ablation_levels_order_and_beat_dropping_the_pipeline(node):
    reroute, decoupled, staggered = (_iteration_time(level, fail_node=node)
                                     for level in ("reroute", "decoupled", "staggered"))
    assert reroute >= decoupled * (1 - 1e-12) and decoupled >= staggered * (1 - 1e-12)  # (sums in another order)
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", "cluster.dp=4", "train.microbatches=8"))
    drop = ctx.grid_plan(4, 3, 1)  # 3 pipelines carry the global batch, on the configured 1F1B
    dropped = simulate(drop.schedule, PlanCosts(ctx.cost_model, drop)).iteration_time
    for level, time in (("reroute", reroute), ("decoupled", decoupled), ("staggered", staggered)):
        assert time < dropped, (level, time, dropped)
    # Re-routing never gains: the peers do a third more work in 1F1B's slots.
    assert staggered >= _iteration_time("staggered")
