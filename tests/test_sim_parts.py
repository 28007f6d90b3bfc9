"""The simulator times one of each identical part of a re-routed plan: the same result as
simulating every worker."""
import dataclasses
import re

import pytest

from conftest import compose
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.schedule import GridOps, PartFlows, Schedule, ScheduleError, check_coverage
from ftbench.sim.parts import bound_copies, part_copies
from ftbench.sim.simulator import simulate
from ftbench.strategies import build_strategy


def _plan(pp, dp, gpus_per_node, nodes, level):
    cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=null",
                  f"strategy.level={level}", "strategy.plan_ahead=0", f"cluster.pp={pp}", f"cluster.dp={dp}",
                  f"cluster.gpus_per_node={gpus_per_node}", "train.microbatches=8")
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    for node in nodes:
        cluster.fail(node)
        plan = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1).plan
    return plan, PlanCosts(ctx.cost_model, plan)


@pytest.mark.parametrize("pp,dp,gpus_per_node,nodes,level", [
    (4, 16, 1, (4, 5, 6, 7), "decoupled"),  # a whole pipeline: 8 peers take one micro-batch each
    (4, 8, 4, (1, 6), "staggered"),  # nodes of 4 GPUs, two failures
    (4, 6, 2, (0, 3), "reroute"),
])
@pytest.mark.parametrize("staggered", [False, True])
@pytest.mark.parametrize("form", ["bound", "handed", "listed"])
def test_deduplicated_parts_time_out_as_every_worker(pp, dp, gpus_per_node, nodes, level, staggered, form):
    plan, costs = _plan(pp, dp, gpus_per_node, nodes, level)
    assert plan.schedule.ops.parts() is not None  # ReCycle's plans: every worker runs a bound template
    if form == "handed":  # a backend took one worker's list (dist does): bound workers are read op by op
        plan.schedule.ops[next(iter(plan.schedule.ops))]
        assert plan.schedule.ops.parts() is None
        check_coverage(plan.schedule)
        hash(plan.schedule.key())  # keyed with the bound workers' ops read out
    if form == "listed":  # the same ops as plain lists: parts found by following the flows
        plan, costs = _listed(plan, costs)
    fast = simulate(plan.schedule, costs, dedupe=True, staggered=staggered)
    full = simulate(plan.schedule, costs, dedupe=False, staggered=staggered)
    assert fast.iteration_time == full.iteration_time
    assert fast.peak_memory_bytes == full.peak_memory_bytes and fast.busy == full.busy
    rows = lambda r: sorted((w, tuple(op), round(s, 12), round(e, 12)) for w, op, s, e in r.ops)  # noqa: E731
    assert rows(fast) == rows(full)
    assert sorted(m for _, m, _, _ in fast.allreduces) == sorted(m for _, m, _, _ in full.allreduces)


def _listed(plan, costs):
    schedule = plan.schedule
    listed = Schedule({w: list(schedule.ops.read(w)) for w in schedule.ops}, schedule.stages, schedule.microbatches)
    plan = dataclasses.replace(plan, schedule=listed)
    return plan, PlanCosts(costs.model, plan)


def test_a_whole_failed_pipeline_gives_one_part_shape():
    plan, costs = _plan(4, 16, 1, (4, 5, 6, 7), "decoupled")
    # 15 surviving pipelines: 8 peers carry one re-routed micro-batch each, 7 carry none; one
    # part of each shape is simulated, the other 13 copied
    assert len(bound_copies(plan.schedule.ops.parts(), costs, plan.schedule.ops.templates)[0]) == 13
    plan, costs = _listed(plan, costs)
    tangled = sorted(w for w, ops in plan.schedule.ops.items() if len({op.pipeline for op in ops}) > 1)
    assert len(tangled) == 8 * 4
    assert len(part_copies(plan.schedule, costs, tangled)) == 7


def test_bound_parts_cover_exactly_once():
    """The coverage check of bound parts finds a flow run twice, one run by no part, and a
    stage nobody steps."""
    plan, _ = _plan(4, 16, 1, (4, 5, 6, 7), "decoupled")
    check_coverage(plan.schedule)
    ops = plan.schedule.ops
    parts = ops.parts()
    peer = next(flows for flows, _ in parts if len(flows.pipelines) == 2)
    other = next(flows for flows, _ in parts if len(flows.pipelines) == 2 and flows is not peer)

    def broken(change):
        changed = {id(flows): change(flows) for _, flows in ops.of.values()}  # one object per part, as a plan has
        of = {w: (tid, changed[id(flows)]) for w, (tid, flows) in ops.of.items()}
        return Schedule(GridOps(ops.templates, of), plan.schedule.stages, plan.schedule.microbatches)

    # another peer runs this peer's re-routed micro-batch instead of its own
    moved = broken(lambda f: PartFlows(f.pipelines, (f.microbatches[0], peer.microbatches[1])) if f is other else f)
    with pytest.raises(ScheduleError, match=r"micro-batch \d+ of pipeline 1 is run by 2 parts") as error:
        check_coverage(moved)
    assert re.search(r"micro-batches \[\d+\] of pipeline 1 are run by no part", str(error.value))
    dropped = Schedule(GridOps(ops.templates, {w: r for w, r in ops.of.items() if w != 0}),
                       plan.schedule.stages, plan.schedule.microbatches)
    with pytest.raises(ScheduleError, match=r"missing F\(s0,m0,p0\)"):
        check_coverage(dropped)
