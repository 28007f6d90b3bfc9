"""ReCycle adds work to the original schedule: a failure never makes an iteration faster.

With no failure ReCycle runs the configured schedule exactly as `none` does. With failed
workers each survivor keeps its own ops in their fault-free order and slots (release times,
ftbench.release) and the re-routed work fills bubbles, so an adapted iteration is at least the
fault-free one. A property test over seeded random grids (pp 2-8, dp 2-8, 2-16 micro-batches),
failure sets, every level, both planners and two memory regimes checks it as the sim backend
times plans (the steady-state period with the staggered optimizer)."""
import random

import pytest

from conftest import compose
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.planning.problem import PlanningError
from ftbench.schedule import grid_worker
from ftbench.sim.simulator import simulate
from ftbench.strategies import build_strategy

LEVELS = ("reroute", "decoupled", "staggered")
CASES = 10  # seeded random grids per level and memory regime (heuristic)
MILP_CASES = 3  # per level, on small grids (the MILP's size)
# Float tolerance of "at least": times are sums of the same op lengths in another order.
REL = 1e-9


def _setup(model, pp, dp, m, level, *extra):
    cfg = compose("backend=sim", "failures=none", "strategy=recycle", f"strategy.level={level}",
                  "strategy.plan_ahead=0", "strategy.plan_cache=null", f"model={model}", "hardware=a100-80gb",
                  f"cluster.pp={pp}", f"cluster.dp={dp}", "cluster.gpus_per_node=1", f"train.microbatches={m}",
                  *extra)
    ctx = RunContext.from_config(cfg)
    return ctx, Cluster.from_config(cfg.cluster), build_strategy(cfg.strategy, ctx)


def _time(ctx, plan, costs=PlanCosts) -> float:
    """The plan's iteration time as the sim backend times it (the steady-state period when staggered)."""
    return simulate(plan.schedule, costs(ctx.cost_model, plan), staggered=plan.staggered_optimizer).iteration_time


def _fail(strategy, cluster, positions, pp: int):
    """Fail the workers at `positions` in turn as a run would: the plan after each failure."""
    plans = []
    for d, s in positions:
        node = cluster.node_of(grid_worker(d, s, pp))
        cluster.fail(node)
        recovery = strategy.on_event(FailureEvent(node=node, kind="fail", iteration=1), cluster, 1)
        if recovery.unrecoverable is not None:
            return plans, recovery.unrecoverable
        plans.append(recovery.plan)
    return plans, None


def _drawn_case(rng: random.Random, small: bool):
    """A grid and a failure set drawn from `rng`: 1 to 3 failed workers, each stage keeping a replica."""
    pp, dp = (rng.randint(2, 3), rng.randint(2, 3)) if small else (rng.randint(2, 8), rng.randint(2, 8))
    m = rng.randint(2, 4) if small else rng.randint(2, 16)
    positions = [(d, s) for d in range(dp) for s in range(pp)]
    while True:
        failed = rng.sample(positions, rng.randint(1, 3))
        if all(any((d, s) not in failed for d in range(dp)) for s in range(pp)):
            return pp, dp, m, failed


def _check(case_seed: str, level: str, planner: str, tight: bool) -> str:
    rng = random.Random(case_seed)
    pp, dp, m, failed = _drawn_case(rng, small=planner == "milp")
    extra = [f"strategy.planner={planner}", "strategy.milp_time_limit_s=2"]
    ctx, cluster, strategy = _setup("gpt3-medium", pp, dp, m, level, *extra)
    if tight:  # what the fault-free schedule needs plus 10 %: the caps bind for the loaded peers
        peak = max(simulate(ctx.grid_plan(pp, dp, 1).schedule,
                            PlanCosts(ctx.cost_model, ctx.grid_plan(pp, dp, 1))).peak_memory_bytes.values())
        ctx, cluster, strategy = _setup("gpt3-medium", pp, dp, m, level, *extra,
                                        f"hardware.memory_gb={peak * 1.1 / 1e9}")
    fault_free = strategy.plan(cluster)
    none = ctx.grid_plan(pp, dp, 1, node_of=cluster.node_of)
    reference = _time(ctx, none)
    # the configured schedule, not a plan of its own
    assert fault_free.schedule.released is None and fault_free.schedule.name == none.schedule.name
    assert all(fault_free.schedule.ops[w] == none.schedule.ops[w] for w in none.schedule.ops)
    assert _time(ctx, fault_free) == reference
    try:
        plans, unrecoverable = _fail(strategy, cluster, failed, pp)
    except PlanningError as error:  # nothing fits: a result, not a speed-up
        return f"no plan: {error}"
    for plan in plans:
        t = _time(ctx, plan)
        assert t >= reference * (1 - REL), (pp, dp, m, failed, t, reference)
        if tight:
            sim = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer)
            assert max(sim.peak_memory_bytes.values()) <= ctx.cost_model.memory_bytes
    return unrecoverable or f"{len(plans)} plans"


@pytest.mark.parametrize("tight", [False, True], ids=["ample-memory", "tight-memory"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_failure_never_makes_the_heuristics_plans_faster(level, tight):
    outcomes = [_check(f"heuristic-{level}-{tight}-{i}", level, "heuristic", tight) for i in range(CASES)]
    assert sum(o.endswith("plans") for o in outcomes) >= CASES // 2, outcomes  # most cases re-routed


@pytest.mark.parametrize("level", LEVELS)
def test_a_failure_never_makes_the_milps_plans_faster(level):
    for i in range(MILP_CASES):
        _check(f"milp-{level}-{i}", level, "milp", tight=i % 2 == 1)


@pytest.mark.parametrize("level", LEVELS)
def test_a_plan_that_fits_in_the_bubbles_costs_nothing(level):
    """GPT-3 6.7B, pp 8 x dp 4, 16 micro-batches: 1F1B's fill and drain leave a stage-1 peer
    room for a third of a failed worker's micro-batches once B and W are split, so one failure
    costs nothing at the decoupled and staggered levels, while the fused `reroute` level pays."""
    ctx, cluster, strategy = _setup("gpt3-6.7b", 8, 4, 16, level)
    reference = _time(ctx, strategy.plan(cluster))
    (plan,), _ = _fail(strategy, cluster, [(0, 1)], 8)
    t = _time(ctx, plan)
    if level == "reroute":
        assert t > reference * 1.01
    else:
        assert t == pytest.approx(reference, rel=1e-9)


def test_the_tables_recycle_cells_fall_below_fault_free_as_failures_grow(tmp_path):
    """The ReCycle table's GPT-3 Medium row, 12 simulated hours per cell: fault-free ReCycle is
    DeepSpeed's 1F1B exactly, and each failure column is slower than the one before."""
    from conftest import run

    def cell(strategy, column):
        s = run(tmp_path / f"{strategy}-{column}", "+experiment=recycle-table", "model=gpt3-medium",
                f"strategy={strategy}", f"table.column={column}", "train.max_hours=12", "seed=0",
                "strategy.plan_cache=null" if strategy == "recycle" else "report.gantt=false")
        assert s["status"] == "ok", s.get("error")
        assert (s["failures"] > 0) == (column != "fault-free")
        return s["throughput"]

    deepspeed = cell("none", "fault-free")
    assert cell("recycle", "fault-free") == deepspeed
    previous = deepspeed
    for column in ("2h", "30m"):
        throughput = cell("recycle", column)
        assert throughput < previous, (column, throughput, previous)
        previous = throughput
