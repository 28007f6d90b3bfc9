"""ReCycle's bound-part plans timed from their classes' compiled canonical plan
(ftbench.sim.parts_timer): the same figures as simulating the plan, plan after plan."""
import pytest

from conftest import compose
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.sim.cache import SimCache
from ftbench.sim.parts_timer import PartsResult, PartsTimer
from ftbench.sim.simulator import simulate
from ftbench.strategies import build_strategy

FIGURES = ("busy", "peak_stash", "peak_activation_bytes", "peak_memory_bytes")


def _plans(pp, dp, gpus_per_node, nodes, level, *extra):
    """The strategy's plan after each failure (and the context)."""
    cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=null",
                  f"strategy.level={level}", "strategy.plan_ahead=0", f"cluster.pp={pp}", f"cluster.dp={dp}",
                  f"cluster.gpus_per_node={gpus_per_node}", "train.microbatches=8", *extra)
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    plans = []
    for node in nodes:
        cluster.fail(node)
        plan = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1).plan
        if plan is not None:
            plans.append(plan)
    return plans, ctx


def _assert_same(result, plan, model):
    full = simulate(plan.schedule, PlanCosts(model, plan), dedupe=False, staggered=plan.staggered_optimizer)
    assert result.iteration_time == full.iteration_time
    for name in FIGURES:
        assert getattr(result, name) == getattr(full, name), name
        assert list(getattr(result, name)) == list(getattr(full, name))  # in the plan's worker order
    assert result.peak_columns() == (list(full.peak_memory_bytes), list(full.peak_memory_bytes.values()))


@pytest.mark.parametrize("pp,dp,gpus_per_node,nodes,level,extra", [
    (4, 16, 1, (4, 5, 6, 7, 8, 9, 10, 11, 2, 13), "staggered", ()),  # whole pipelines, then single workers
    (4, 16, 1, (4, 5, 6, 7, 8, 9, 10, 11), "decoupled", ()),
    (4, 8, 4, (1, 6, 3), "staggered", ()),  # nodes of 4 GPUs
    (4, 6, 2, (0, 3), "reroute", ()),
    (4, 12, 4, (0, 2, 5), "staggered", ("train.overlap_grad_reduce=true",)),
    (2, 8, 1, (1, 4, 6), "staggered", ("strategy.normalise=pipeline",)),
])
def test_the_parts_timer_gives_the_simulators_figures(pp, dp, gpus_per_node, nodes, level, extra):
    plans, ctx = _plans(pp, dp, gpus_per_node, nodes, level, *extra)
    timer = PartsTimer(ctx.cost_model)
    timed = 0
    for plan in plans:
        result = timer(plan)
        if result is None:
            continue
        timed += 1
        assert isinstance(result, PartsResult)
        _assert_same(result, plan, ctx.cost_model)
        # the rows come from simulating the whole plan
        assert len(result.ops) == sum(len(plan.schedule.ops.read(w)) for w in plan.schedule.ops)
    assert timed


def test_plans_of_one_set_of_classes_compile_once():
    """A whole failed pipeline after another: the later plans reuse a compiled set of classes
    with other all-reduce charges, and still time out as simulated."""
    plans, ctx = _plans(4, 32, 4, tuple(range(10)), "staggered")
    timer = PartsTimer(ctx.cost_model)
    for plan in plans:
        _assert_same(timer(plan), plan, ctx.cost_model)
    assert len(timer._compiled) < len(plans)


def test_the_cache_times_recycle_plans_with_it():
    plans, ctx = _plans(4, 16, 1, (4, 5, 6, 7), "staggered")
    cache = SimCache(ctx.cost_model)
    assert isinstance(cache(plans[-1]), PartsResult)
    plain = SimCache(ctx.cost_model, enabled=False)(plans[-1])
    assert cache(plans[-1]).iteration_time == plain.iteration_time
