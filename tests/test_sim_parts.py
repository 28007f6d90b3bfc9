"""The simulator times one of each identical part of a re-routed plan: the same result as
simulating every worker."""
import pytest

from conftest import compose
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.sim.parts import part_copies
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
def test_deduplicated_parts_time_out_as_every_worker(pp, dp, gpus_per_node, nodes, level, staggered):
    plan, costs = _plan(pp, dp, gpus_per_node, nodes, level)
    fast = simulate(plan.schedule, costs, dedupe=True, staggered=staggered)
    full = simulate(plan.schedule, costs, dedupe=False, staggered=staggered)
    assert fast.iteration_time == full.iteration_time
    assert fast.peak_memory_bytes == full.peak_memory_bytes and fast.busy == full.busy
    rows = lambda r: sorted((w, tuple(op), round(s, 12), round(e, 12)) for w, op, s, e in r.ops)  # noqa: E731
    assert rows(fast) == rows(full)
    assert sorted(m for _, m, _, _ in fast.allreduces) == sorted(m for _, m, _, _ in full.allreduces)


def test_a_whole_failed_pipeline_gives_one_part_shape():
    plan, costs = _plan(4, 16, 1, (4, 5, 6, 7), "decoupled")
    ops = plan.schedule.ops
    tangled = sorted(ops._lists)
    copies = part_copies(plan.schedule, costs, tangled)
    assert len(copies) == 7  # 8 peers carry one re-routed micro-batch each: one simulated, 7 copied
