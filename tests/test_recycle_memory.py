"""ReCycle plans within the GPU's memory, and fault-free parity with the configured schedule."""
import random

import pytest

from conftest import compose, run
from ftbench.context import RunContext
from ftbench.planning.heuristic import list_schedule_timed
from ftbench.planning.milp import solve
from ftbench.planning.parts import split
from ftbench.planning.problem import PlanningError, evaluate, problem_for, stash_peaks

RECYCLE = ("strategy=recycle", "strategy.plan_cache=null")


def _problem(model: str, hardware: str, pp: int, dp: int, m: int, failed, decoupled=True, recompute="none"):
    ctx = RunContext.from_config(compose("backend=sim", f"model={model}", f"hardware={hardware}", f"cluster.pp={pp}",
                                         f"cluster.dp={dp}", f"train.microbatches={m}", f"train.recompute={recompute}"))
    return problem_for(ctx, pp, dp, 1, failed, decoupled=decoupled)


@pytest.mark.parametrize("decoupled", [True, False])
def test_plans_never_exceed_the_gpu_memory(decoupled):
    """Random failure sets of a memory-tight grid (GPT-3 6.7B, pp 4 on 80 GB): every plan's
    simulated peak memory fits, and the caps it was planned under hold."""
    rng = random.Random(11)
    for _ in range(6):
        failed = set()
        while len(failed) < rng.randint(1, 5):
            failed.add((rng.randrange(8), rng.randrange(4)))
        if any(all((d, s) in failed for d in range(8)) for s in range(4)):
            continue
        problem = _problem("gpt3-6.7b", "a100-80gb", 4, 8, 16, failed, decoupled)
        orders, planned = list_schedule_timed(problem)
        sim = evaluate(problem, orders)
        assert planned == pytest.approx(sim.iteration_time, rel=1e-9)  # the planner's own timing is the simulator's
        assert max(sim.peak_memory_bytes.values()) <= problem.memory_bytes
        for pos, order in orders.items():
            held, deferred = stash_peaks(order)
            assert held <= problem.stash_cap(pos)
            assert not decoupled or deferred <= problem.defer_cap(pos)


def test_the_cap_follows_memory_not_the_pipeline_depth():
    """A peer with twice the load may stash more than 1F1B's pp - s only when memory allows."""
    roomy = _problem("gpt3-medium", "a100-80gb", 4, 2, 8, {(0, 0)})
    tight = _problem("gpt3-6.7b", "a100-80gb", 4, 2, 8, {(0, 0)})
    assert roomy.stash_cap((1, 0)) == roomy.load[(1, 0)] == 16  # everything fits
    assert 1 <= tight.stash_cap((1, 0)) < tight.load[(1, 0)]
    t = tight.stages[0]
    peak = (t.static_bytes + t.recompute_bytes + tight.stash_cap((1, 0)) * t.activation_bytes
            + tight.defer_cap((1, 0)) * t.weight_stash_bytes)
    assert peak <= tight.memory_bytes


def test_a_grid_where_nothing_fits_says_why():
    problem = _problem("gpt3-6.7b", "v100-16gb", 4, 2, 8, {(0, 1)})
    with pytest.raises(PlanningError, match="does not fit|cannot hold one micro-batch"):
        list_schedule_timed(problem)


def test_milp_keeps_the_memory_caps():
    problem = _problem("gpt3-xl", "a100-40gb", 2, 2, 3, {(0, 1)})
    assert problem.stash_cap((1, 1)) < problem.load[(1, 1)]  # the cap binds
    result = solve(problem, time_limit_s=10)
    for pos, order in result.orders.items():
        held, deferred = stash_peaks(order)
        assert held <= problem.stash_cap(pos) and deferred <= problem.defer_cap(pos)
    assert max(evaluate(problem, result.orders).peak_memory_bytes.values()) <= problem.memory_bytes


def test_identical_parts_are_planned_once():
    """A failed pipeline's micro-batches spread one per peer: every peer is one shape."""
    problem = _problem("gpt3-medium", "a100-40gb", 4, 16, 8, {(0, s) for s in range(4)})
    shapes = split(problem)
    assert sum(len(parts) for _, parts in shapes) == 15  # 8 peers carry one each, 7 untouched
    assert len(shapes) == 2
    orders, _ = list_schedule_timed(problem)
    assert set(orders) == set(problem.workers)


@pytest.mark.parametrize("model", ["gpt3-3.35b", "gpt3-6.7b"])
def test_paper_scale_grids_run_to_the_end_without_oom(tmp_path, model):
    """GPT-3 3.35B/6.7B at pp 4 x dp 8 on A100 80 GB: these ended `oom` after 1 to 9 failures
    when the stash cap was a multiple of 1F1B's."""
    events = ",".join(f"{{iteration:{2 + 2 * i},node:{n}}}" for i, n in enumerate((5, 9, 14, 22, 27, 3)))
    s = run(tmp_path, "backend=sim", f"model={model}", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=8",
            "train.microbatches=16", "train.iterations=20", *RECYCLE, "strategy.plan_ahead=0",
            "failures=scripted", f"failures.events=[{events}]", "report.gantt=false")
    assert s["status"] == "ok", s.get("error")
    assert s["failures"] == 6
    assert max(s["peak_memory_bytes"]) <= 80e9


def test_fault_free_schedule_is_the_configured_schedule(tmp_path):
    """With no failure ReCycle runs the configured schedule exactly as `none` does, 1F1B or ZB-H1."""
    base = ("backend=sim", "model=gpt3-medium", "cluster.dp=4", "train.iterations=5", "failures=none",
            "report.gantt=false")
    for schedule in ("1f1b", "zb-h1"):
        recycle = run(tmp_path / schedule, *base, *RECYCLE, f"schedule={schedule}")
        reference = run(tmp_path / f"none-{schedule}", *base, "strategy=none", f"schedule={schedule}")
        assert recycle["iteration_time_s"] == reference["iteration_time_s"]
        assert recycle["plan_segments"][0]["plan"] == f"recycle (fault-free, {schedule})"


@pytest.mark.parametrize("fallback", ["none", "checkpoint"])
def test_recycle_says_so_when_no_rerouting_fits(fallback):
    """With too little memory for any re-routed plan, a failure ends the run with the reason,
    or restarts from checkpoints with the fallback; never a plan that runs into `oom`. (The
    fault-free run is the configured schedule, not planned, so the failure is where it shows.)"""
    from ftbench.cluster import Cluster
    from ftbench.failures import FailureEvent
    from ftbench.strategies import build_strategy

    overrides = ("backend=sim", "model=gpt3-medium", "hardware.memory_gb=1", *RECYCLE, "strategy.plan_ahead=0",
                 f"strategy.fallback={fallback}", *(("strategy.every=5",) if fallback == "checkpoint" else ()))
    cfg = compose(*overrides)
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    cluster.fail(5)
    recovery = strategy.on_event(FailureEvent(5, iteration=1), cluster, 1)
    if fallback == "none":
        assert recovery.plan is None and "does not fit" in recovery.unrecoverable
        assert "cannot hold one micro-batch" in recovery.unrecoverable
    else:
        assert recovery.unrecoverable is None and "RestartJob" in [type(a).__name__ for a in recovery.actions]
