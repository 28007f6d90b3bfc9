"""Failures that strike after some stages have stepped (issue 26): the failure point `at`.

A failure scripted by iteration strikes at a fraction `at` of its iteration's simulated
timeline (the event's own `at`, else `failures.at`, else half-way); the ops completed by then,
the optimizer steps that finished included, run before it (ftbench.loop, `_point`). The
iteration in flight is then redone, so every survivor whose replica already stepped in it goes
back to the iteration's start by undoing that step (ftbench.engine.undo, done by the engine
when it abandons the iteration: no strategy holds undo logic). Near the end of an iteration
(at 0.9 and later) most stages have stepped: the in-place strategies (elastic-horovod,
recycle, oobleck, bamboo) must still train the fault-free model, and without the undo they
would not (test_without_the_undo_training_differs_from_fault_free).
"""
import re

import pytest

from conftest import LOCAL, compose, run, seeded_failures
from ftbench.errors import ConfigError
from ftbench.failures import ITERATION_EVENT_FRACTION, build_failure_script
from ftbench.metrics import read_metrics

# Setups of the in-place strategies that work with gpt-tiny (as in their own test files),
# each with a node whose failure in iteration 3 leaves survivors that stepped.
IN_PLACE = {
    "elastic-horovod": ("strategy=elastic-horovod", "strategy.every=2"),  # pp 4 x dp 2
    "recycle": ("strategy=recycle", "strategy.plan_cache=null"),  # pp 4 x dp 2
    "oobleck": ("strategy=oobleck", "hardware.memory_gb=0.006", "cluster.pp=2", "cluster.dp=4"),
    "bamboo": ("strategy=bamboo", "cluster.pp=3", "cluster.dp=2"),
}
POINTS = [0.9, 0.97, 0.999]
# The run's own check against fault-free training, in float32 (the dtype users train in): an undone
# step gives the state back to its rounding, which the check allows to its measured noise floor.
CHECKED = ("report.check_fault_free=true", "train.iterations=6", "backend.dtype=float32")


def _fails(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "fail"]


# -- (a) the setting ---------------------------------------------------------------------------

def _script(*overrides, nodes: int = 8):
    return build_failure_script(compose(*overrides).failures, nodes, 0)


def test_each_event_strikes_at_its_own_point_else_the_groups_else_half_way():
    two = "failures.events=[{iteration:3,node:1,at:0.97},{iteration:4,node:2}]"
    assert [e.at for e in _script(two).by_iteration] == [0.97, 0.5]  # conf/failures/scripted.yaml: at 0.5
    assert [e.at for e in _script(two, "failures.at=0.9").by_iteration] == [0.97, 0.9]
    assert [e.at for e in _script(two, "failures.at=0").by_iteration] == [0.97, 0.0]
    # failures.at left unset (the schema's None, as a config without the yaml's 0.5 has it): the loop's default
    from ftbench.config import FailureEventConfig, FailuresConfig

    events = build_failure_script(FailuresConfig(kind="scripted", events=[FailureEventConfig(node=1, iteration=2)]),
                                  4, 0).by_iteration
    assert events[0].at is None and ITERATION_EVENT_FRACTION == 0.5
    # a join is no strike: it takes no point
    assert _script("failures.events=[{iteration:3,node:1},{iteration:5,node:1,kind:join}]",
                   "failures.at=0.9").by_iteration[1].at is None


@pytest.mark.parametrize("overrides,setting", [
    (("failures.at=1",), "failures.at"),  # the iteration would be over: that is the next one's start
    (("failures.at=-0.1",), "failures.at"),
    (("failures.at=1.5",), "failures.at"),
    (("failures.events=[{iteration:3,node:1},{iteration:4,node:2,at:1.0}]",), "failures.events[1].at"),
    (("failures.events=[{iteration:3,node:1,at:-0.5}]",), "failures.events[0].at"),
    (("failures.events=[{time_s:3,node:1,at:0.5}]",), "failures.events[0].at"),  # a timed event strikes at its time
    (("failures.events=[{iteration:3,node:1},{iteration:5,node:1,kind:join,at:0.5}]",), "failures.events[1].at"),
    (("failures=poisson", "failures.at=0.9"), "failures.at"),  # only scripted events by iteration have one
])
def test_bad_points_name_the_setting(overrides, setting):
    with pytest.raises(ConfigError) as err:
        _script(*overrides)
    assert err.value.setting == setting, str(err.value)


def test_a_bad_point_is_a_setting_error_of_the_run(tmp_path):
    s = run(tmp_path, "backend=sim", "model=gpt-tiny", "strategy=recycle", "cluster.pp=2", "cluster.dp=2",
            "failures.events=[{iteration:3,node:1,at:1}]")
    assert s["status"] == "error" and "failures.events[0].at" in s["error"], s["error"]


# -- (b) every in-place strategy trains the fault-free model after steps ---------------------------

# The default tier strikes each strategy at one point, each point at least once; `full` the rest.
DEFAULT_POINT = {"elastic-horovod": 0.9, "recycle": 0.97, "oobleck": 0.999, "bamboo": 0.97}


@pytest.mark.parametrize("strategy,at", [
    pytest.param(strategy, at, id=f"{strategy}-{at}", marks=() if at == DEFAULT_POINT[strategy] else pytest.mark.full)
    for strategy in IN_PLACE for at in POINTS])
def test_a_failure_after_steps_trains_the_fault_free_model(tmp_path, strategy, at):
    """Node 1 fails at `at` of iteration 3 on local (float32): the run's own check compares
    losses and weights with fault-free training. From 0.97 on, optimizer steps had completed
    before the strike (`stepped`, resolved from the plan's timeline) and survivors undid theirs
    (`undone`): the line of the fail event says so."""
    s = run(tmp_path, *LOCAL, *IN_PLACE[strategy], *CHECKED, f"failures.events=[{{iteration:3,node:1,at:{at}}}]")
    assert s["status"] == "ok" and s["matches_fault_free"] is True, s["error"]
    (fail,) = _fails(tmp_path)
    assert fail["iteration"] == 3 and fail["stepped"] >= 0 and fail["undone"] >= 0
    if at >= 0.97:
        assert fail["stepped"] > 0 and fail["undone"] > 0, fail
    if strategy != "elastic-horovod":  # it rolls back to its last commit; the others redo only the iteration in flight
        assert all(r["lost_iterations"] == 0 for r in s["recoveries"])


def test_a_failure_half_way_strikes_before_any_step(tmp_path):
    s = run(tmp_path, *LOCAL, *IN_PLACE["recycle"], "train.iterations=5", "failures.events=[{iteration:3,node:1}]")
    assert s["status"] == "ok", s["error"]
    (fail,) = _fails(tmp_path)
    assert fail["stepped"] == 0 and fail["undone"] == 0


@pytest.mark.parametrize("strategy", ["recycle", "oobleck", "bamboo"])
def test_without_the_undo_training_differs_from_fault_free(tmp_path, monkeypatch, strategy):
    """The control: with the undo made a no-op, survivors that stepped before the strike step
    again when the iteration is redone, and the run's own check finds the difference. So the
    strike at 0.97 does come after steps, and it is the undo that makes the tests above pass.
    (elastic-horovod is not here: it reloads its in-memory commit, which undoes everything.)"""
    from ftbench.engine.undo import StepUndo

    monkeypatch.setattr(StepUndo, "undo", StepUndo.clear)
    s = run(tmp_path, *LOCAL, *IN_PLACE[strategy], *CHECKED, "failures.events=[{iteration:3,node:1,at:0.97}]")
    assert s["status"] == "diverged" and s["matches_fault_free"] is False, (s["status"], s["error"])


def test_time_based_failures_strike_where_they_fall_steps_included(tmp_path):
    """On the modelled clock a timed failure strikes at its instant inside the iteration in
    flight, resolved like a scripted point: 0.98 of an iteration into iteration 3 is after
    optimizer steps, which the survivors undo."""
    setup = (*IN_PLACE["recycle"], "train.iterations=6", "backend.clock=model")
    T = run(tmp_path / "sim", "backend=sim", *LOCAL[1:], *setup, "failures=none")["iteration_time_s"]
    s = run(tmp_path / "local", *LOCAL, *setup, "report.check_fault_free=true", f"failures.events=[{{time_s:{3.98 * T},node:1}}]")
    assert s["status"] == "ok" and s["matches_fault_free"] is True, s["error"]
    (fail,) = _fails(tmp_path / "local")
    assert fail["iteration"] == 3 and fail["stepped"] > 0 and fail["undone"] > 0, fail


# -- the engine's side: what a strike leaves on the survivors ----------------------------------------

def _engine(tmp_path, *overrides):
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.assembly.local_engine import local_engine
    from ftbench.strategies import build_strategy

    cfg = compose(*LOCAL, *overrides)
    ctx = RunContext.from_config(cfg)
    strategy = build_strategy(cfg.strategy, ctx)
    engine = local_engine(cfg, ctx, strategy, tmp_path)
    return engine, strategy.plan(Cluster.from_config(cfg.cluster).view())


def _states(engine) -> dict:
    return {(w, layers): r.shard() for w, worker in engine.workers.items() if worker.alive
            for layers, r in worker.replicas.items()}


def _assert_back(before: dict, after: dict) -> None:
    """Every replica in `after` holds what it held in `before`, to the undo's rounding
    (tests/test_undo.py: a few ulps of the tensor's largest value; the step count exactly)."""
    import torch

    for key, shard in after.items():
        for name, p in shard["model"].items():
            torch.testing.assert_close(p, before[key]["model"][name], rtol=0, atol=1e-13 * (1 + p.abs().max().item()))
        assert shard["optim"].keys() == before[key]["optim"].keys(), key
        for name, state in shard["optim"].items():
            for k, v in state.items():
                ref = before[key]["optim"][name][k]
                torch.testing.assert_close(v, ref, rtol=0, atol=1e-13 * (1 + ref.abs().max().item()))


@pytest.mark.parametrize("strategy", ["recycle", "bamboo"])
def test_a_strike_after_every_step_leaves_the_survivors_at_the_iterations_start(tmp_path, strategy):
    """The local backend's strike (LocalBackend.strike) with every op of iteration 2 completed
    (all optimizer steps, and Bamboo's refreshes of its redundant copies): every surviving
    replica, redundant copies included, holds its state from before the iteration again, the
    undo records are gone, and a load or a destroy forgets a record."""
    from ftbench.engine.backend import LocalBackend
    from ftbench.sim.cache import SimCache
    from ftbench.sim.simulator import ops_completed_at

    engine, plan = _engine(tmp_path, *IN_PLACE[strategy])
    backend = LocalBackend(engine, realtime=False)
    backend.start(plan)
    for it in range(2):
        backend.run_iteration(plan, it)
    assert all(not r.undo.recorded for w in engine.workers.values() for r in w.replicas.values())  # committed
    before = _states(engine)
    everything = ops_completed_at(SimCache(engine.ctx.cost_model)(plan), 1.0, stop_before_optimizer=False)
    dead = [w for w, node in plan.node_of.items() if node == 1]
    replicas = sum(len(engine.workers[w].replicas) for w in engine.workers if w not in dead)
    undone = backend.strike(plan, 2, everything, dead)
    assert undone == replicas  # every survivor's replica had stepped (or, a copy, been refreshed)
    after = _states(engine)
    assert set(after) == {k for k in before if k[0] not in dead}
    _assert_back(before, after)
    assert all(not r.undo.recorded for w in engine.workers.values() if w.alive for r in w.replicas.values())
    # a load replaces the state a record would undo; a destroyed replica keeps nothing
    survivor = next(r for w in engine.workers.values() if w.alive for r in w.replicas.values())
    for p in survivor.module.parameters():
        p.grad = p.detach().clone()
    survivor.undo.step()
    assert survivor.undo.recorded and survivor.undo.bytes() > 0
    shard = survivor.shard()
    survivor.load(shard["model"], shard["optim"])
    assert not survivor.undo.recorded
    survivor.undo.step()
    survivor.destroy()
    assert survivor._undo is None


# -- (c) seeded random scripts that draw the point -------------------------------------------------

SEEDED = {  # strategy -> (nodes, failures), the cluster of IN_PLACE[strategy] (+ extra settings)
    "elastic-horovod": (8, 1, ()),
    "recycle": (12, 2, ("cluster.dp=3",)),
    "oobleck": (8, 2, ()),
    "bamboo": (6, 3, ()),
}


def test_seeded_scripts_draw_the_point_uniformly_and_keep_their_nodes_and_iterations():
    plain = seeded_failures("recycle-at-1", 12, 2)
    drawn = seeded_failures("recycle-at-1", 12, 2, draw_at=True)
    assert ",at:" not in plain and re.sub(r",at:[0-9.]+", "", drawn) == plain
    events = build_failure_script(compose("failures=scripted", drawn).failures, 12, 0).by_iteration
    assert all(0 <= e.at < 1 for e in events)
    points = [float(part.split("}")[0]) for tag in range(200)
              for part in seeded_failures(f"t{tag}", 8, 2, draw_at=True).split(",at:")[1:]]
    assert all(0 <= p < 1 for p in points) and min(points) < 0.05 and max(points) > 0.95


@pytest.mark.parametrize("strategy", list(SEEDED))
def test_seeded_random_failures_at_drawn_points_train_the_fault_free_model(tmp_path, strategy):
    nodes, count, extra = SEEDED[strategy]
    faults = seeded_failures(f"{strategy}-at", nodes, count, draw_at=True)
    s = run(tmp_path, *LOCAL, *IN_PLACE[strategy], *extra, "report.check_fault_free=true", faults)
    assert s["status"] == "ok" and s["matches_fault_free"] is True, (faults, s["error"])
    assert s["failures"] == count


def _point(faults: str) -> float:
    return float(faults.split(",at:")[1].split("}")[0])


def test_a_seeded_point_after_steps_trains_the_fault_free_model(tmp_path):
    """Drawn uniformly, about a tenth of the points land after some optimizer steps (the last
    tenth or so of a 1F1B iteration): the first seeded one-failure script of recycle's that
    does (tags recycle-late-0, -1, ...) trains the fault-free model too."""
    scripts = (seeded_failures(f"recycle-late-{k}", 8, 1, draw_at=True) for k in range(100))
    faults = next(f for f in scripts if _point(f) >= 0.9)
    s = run(tmp_path, *LOCAL, *IN_PLACE["recycle"], "report.check_fault_free=true", faults)
    assert s["status"] == "ok" and s["matches_fault_free"] is True, s["error"]
    assert _fails(tmp_path)[0]["undone"] > 0


# -- (d) dist ---------------------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.full  # CI undoes steps on dist in test_dist_swift (a failure at 0.97 of an iteration; extended tier)
def test_dist_failure_after_steps_trains_the_fault_free_model(tmp_path):
    """backend=dist: node 1's process is SIGKILLed at 0.97 of iteration 3, after optimizer
    steps; the survivors undo theirs (StepUndo, no copy of their state) and ReCycle redoes the
    iteration re-routed, in float32: fault-free training to the check's measured noise floor (the run's own check)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_dist_failures import SETUP, run_dist

    summary, lines = run_dist(tmp_path, "strategy=recycle", "cluster.gpus_per_node=1",
                              "failures.events=[{iteration:3,node:1,at:0.97}]", setup=SETUP)
    assert summary["matches_fault_free"] is True
    (fail,) = [r for r in lines if r["event"] == "fail"]
    assert fail["stepped"] > 0 and fail["undone"] > 0, fail
    (recovery,) = summary["recoveries"]
    assert recovery["lost_iterations"] == 0
    assert [r["iteration"] for r in lines if r["event"] == "iteration"] == list(range(6))
