"""ReCycle's per-stage normal form (strategy.normalise=stage): a plan per count of failed workers at
each stage, renamed onto the real workers stage by stage; no slower than the plan of the
configuration up to renaming pipelines (strategy.normalise=pipeline), and training the same model."""
import random

import pytest

from conftest import assert_matches_fault_free
from ftbench.planning import library as library_module
from ftbench.planning.normal_check import check_grid
from ftbench.planning.problem import (LAYOUT_LIMIT, StageForm, canonical_failed, normalise, rename_onto, stage_form,
                                      stage_layouts)
from ftbench.schedule import grid_worker


def test_a_stage_form_counts_failed_workers_per_stage():
    assert stage_form({(0, 1), (2, 3), (3, 1)}, 4) == StageForm((0, 2, 0, 1))
    assert stage_form({(3, 1), (1, 1), (0, 3)}, 4) == stage_form({(0, 1), (2, 3), (3, 1)}, 4)


def test_small_forms_are_planned_on_every_layout_large_ones_packed_and_spread():
    one_each = stage_layouts(StageForm((0, 1, 1, 0)), 4)  # the two failures in one pipeline, or in two
    assert one_each[0] == normalise({(0, 1), (0, 2)}, 4, 4)[0]  # packed first
    assert sorted(one_each) == sorted({normalise({(0, 1), (0, 2)}, 4, 4)[0], normalise({(0, 1), (1, 2)}, 4, 4)[0]})
    many = stage_layouts(StageForm((1,) * 8), 16)  # far more than LAYOUT_LIMIT ways to place 8 failures
    assert len(many) == 2 and many[0] == normalise({(0, s) for s in range(8)}, 16, 8)[0]
    assert sorted(map(len, map(canonical_failed, many))) == [8, 8]
    assert LAYOUT_LIMIT >= 2


@pytest.mark.parametrize("seed", range(40))
def test_renaming_stage_by_stage_puts_the_canonical_failures_on_the_real_ones(seed):
    rng = random.Random(seed)
    pp, dp = rng.randint(1, 6), rng.randint(2, 7)
    positions = [(d, s) for d in range(dp) for s in range(pp)]
    failed = set(rng.sample(positions, rng.randint(1, min(len(positions) - 1, 6))))
    layouts = stage_layouts(stage_form(failed, pp), dp)
    layout = rng.choice(layouts)
    r = rename_onto(failed, layout, dp, pp)
    assert r.failed == canonical_failed(layout)
    for s in range(pp):
        assert sorted(r.at[s]) == list(range(dp))  # a permutation at every stage
    assert {(r.at[s][i], s) for i, s in r.failed} == failed  # canonical failures onto the real ones
    owners = r.owners(pp)
    for (i, s) in set(positions) - r.failed:  # every survivor runs one canonical pipeline's chain
        w = grid_worker(r.at[s][i], s, pp)
        assert owners.get(w, w // pp) == r.labels[i]
    if normalise(failed, dp, pp)[0] == layout:  # its own pipeline form: whole pipelines renamed, no owners
        assert not owners


def _sample(k):
    return lambda sets: random.Random(3).sample(sets, min(k, len(sets)))


def test_the_per_stage_plan_is_never_slower_on_the_small_grid():
    # Every failure set of 1-3 failed workers on pp 4 x dp 4, one simulated per pipeline form.
    check = check_grid("gpt3-medium", 4, 4, 8)
    assert check.sets == 696 and check.exact_forms == 68 and check.stage_forms == 34
    assert check.worst[0] <= 1e-9, check.worst  # never slower (its own layout is among those tried)
    assert not check.mismatched and check.no_plan == (0, 0)


def test_one_pair_of_plans_per_pipeline_form_stands_for_every_failure_set():
    # The renamed plans time out alike on every set of a pipeline form (all hops leave the node).
    per_form = check_grid("gpt3-medium", 4, 4, 8, sample=_sample(80))
    per_set = check_grid("gpt3-medium", 4, 4, 8, sample=_sample(80), every_set=True)
    assert per_set.simulated == 80 and per_form.ratios == pytest.approx(per_set.ratios, abs=1e-12)


@pytest.mark.full
def test_the_per_stage_plan_is_never_slower_on_the_tables_grids():
    for setup in (("gpt3-3.35b", 4, 4, 8), ("gpt3-6.7b", 8, 4, 16)):
        check = check_grid(*setup)
        assert check.worst[0] <= 1e-9, (setup, check.worst)


def test_a_plan_renamed_stage_by_stage_trains_the_fault_free_model(tmp_path, monkeypatch):
    # Only the packed layout (both failures in pipeline 0): the real failures, in pipelines 0 and
    # 1, take it renamed stage by stage, pipeline 0's stage-2 worker running pipeline 1's
    # micro-batches as its own.
    monkeypatch.setattr(library_module, "stage_layouts", lambda form, dp: stage_layouts(form, dp)[:1])
    faults = ("strategy=recycle", "strategy.plan_cache=null", "failures=scripted",
              "failures.events=[{iteration:4,node:1},{iteration:4,node:6}]")  # (0, 1) and (1, 2): pp 4, one GPU per node
    s = assert_matches_fault_free(tmp_path, faults=faults)
    assert s["failures"] == 2


@pytest.mark.parametrize("events", [
    "[{iteration:3,node:1},{iteration:5,node:6}]",  # (0, 1), then (1, 2): one whole pipeline, idle workers
    "[{iteration:3,node:1},{iteration:5,node:5},{iteration:7,node:1,kind:join}]",  # two then back to one
])
def test_whole_failed_pipelines_with_idle_workers_train_the_fault_free_model(tmp_path, events):
    # strategy.whole_above_ops=1: every configuration planned as whole failed pipelines; the
    # workers of those pipelines that are alive idle, stepping with the reduced gradient, and
    # take up work again in later plans with the current weights.
    faults = ("strategy=recycle", "strategy.plan_cache=null", "strategy.whole_above_ops=1", "failures=scripted",
              f"failures.events={events}")
    s = assert_matches_fault_free(tmp_path, setup=("cluster.dp=3",), faults=faults)
    assert s["failures"] == 2


def test_whole_failed_pipelines_simulate_alike_deduplicated_or_not_and_renamed():
    from conftest import compose
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.costs import PlanCosts
    from ftbench.failures import FailureEvent
    from ftbench.schedule import check_coverage, validate
    from ftbench.sim.cache import SimCache
    from ftbench.sim.simulator import simulate
    from ftbench.strategies import build_strategy

    cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=null",
                  "strategy.whole_above_ops=1", "cluster.pp=4", "cluster.dp=6", "train.microbatches=8")
    ctx, cluster = RunContext.from_config(cfg), Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    assert strategy.whole
    cache = SimCache(ctx.cost_model)
    idle_counts = []
    for node in (5, 14, 3, 22):  # (1, 1), (3, 2), (0, 3), (5, 2)
        cluster.fail(node)
        plan = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1).plan
        validate(plan.schedule)
        check_coverage(plan.schedule)
        assert node not in plan.schedule.ops
        idle_counts.append(sum(len(plan.schedule.ops.read(w)) == 1 for w in plan.schedule.ops))
        fast = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=True)
        full = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=True, dedupe=False)
        assert fast.iteration_time == full.iteration_time and fast.busy == full.busy
        assert fast.peak_memory_bytes == full.peak_memory_bytes
        # The run's cache times the plan from its reference (Plan.same_timing), renamed: the same figures.
        cached = cache(plan)
        assert type(cached).__name__ == "RenamedResult"
        assert cached.iteration_time == full.iteration_time
        for name in ("busy", "peak_memory_bytes", "peak_stash", "peak_activation_bytes"):
            assert getattr(cached, name) == getattr(full, name), name
        assert cached.peak_columns() == (list(full.peak_memory_bytes), list(full.peak_memory_bytes.values()))
        assert sorted(cached.ops) == sorted(full.ops)
    assert idle_counts == [3, 2, 1, 4]  # 1 whole pipeline (3 idle), 1 (2), 1 (1), then 2 (4)
    assert cache.distinct_plans == 2  # one reference per count of whole pipelines


@pytest.mark.parametrize("seed", range(6))
def test_whole_pipeline_plans_patched_from_their_reference_time_as_simulated(seed):
    # Random failures and rejoins on pp 4 x dp 8: each plan, patched from its reference where
    # workers moved, is a valid schedule and its cached figures are those of simulating it.
    from conftest import compose
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.costs import PlanCosts
    from ftbench.failures import FailureEvent
    from ftbench.schedule import check_coverage, validate
    from ftbench.sim.cache import SimCache
    from ftbench.sim.simulator import simulate
    from ftbench.strategies import build_strategy

    cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=null",
                  "strategy.whole_above_ops=1", "cluster.pp=4", "cluster.dp=8", "train.microbatches=8")
    ctx, cluster = RunContext.from_config(cfg), Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    cache, rng, down = SimCache(ctx.cost_model), random.Random(seed), []
    for _ in range(10):
        if down and rng.random() < 0.3:
            node = down.pop(rng.randrange(len(down)))
            cluster.join(node)
            recovery = strategy.on_event(FailureEvent(node, iteration=1, kind="join"), cluster, 1)
        else:
            node = rng.choice([n for n in range(32) if n not in down])
            cluster.fail(node)
            recovery = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1)
            if recovery.unrecoverable:
                break
            down.append(node)
        plan = recovery.plan or strategy.current
        validate(plan.schedule)
        check_coverage(plan.schedule)
        full = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer)
        cached = cache(plan)
        assert cached.iteration_time == full.iteration_time
        for name in ("busy", "peak_memory_bytes", "peak_stash"):
            assert getattr(cached, name) == getattr(full, name), name


def test_whole_failed_pipelines_from_the_disk_cache_or_the_milp(tmp_path):
    # Plans held op by op (read back from the plan cache, or the MILP's) take the general
    # renaming, idle workers and all, and simulate as their own ops say.
    from conftest import compose
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.costs import PlanCosts
    from ftbench.failures import FailureEvent
    from ftbench.schedule import check_coverage, validate
    from ftbench.sim.cache import SimCache
    from ftbench.sim.simulator import simulate
    from ftbench.strategies import build_strategy

    times = []
    for run in ("first", "cached"):
        cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=plan-cache",
                      "strategy.whole_above_ops=1", "cluster.pp=4", "cluster.dp=6", "train.microbatches=8")
        ctx, cluster = RunContext.from_config(cfg), Cluster.from_config(cfg.cluster)
        ctx.run_dir = tmp_path
        strategy = build_strategy(cfg.strategy, ctx)
        strategy.plan(cluster)
        for node in (5, 14):
            cluster.fail(node)
            plan = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1).plan
        validate(plan.schedule)
        check_coverage(plan.schedule)
        assert (plan.same_timing is None) == (run == "cached")  # read back: held op by op
        full = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=True)
        assert SimCache(ctx.cost_model)(plan).iteration_time == full.iteration_time
        times.append(full.iteration_time)
    assert times[0] == times[1]
