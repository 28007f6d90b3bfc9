"""The simulator at scale stays exact: deduplicated simulation (one representative per class
of identical pipelines, copies never built) equals the full one, grids give the same
per-pipeline figures whatever their dp, and the shortcuts strategies take (Varuna's candidate
shapes, lazily held grids) agree with the plain computation. No timing asserts: speed is
benchmarks/sim_scale.py's business."""
from __future__ import annotations

import math

import pytest

from conftest import compose
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.layers import fragment_layout
from ftbench.plan import Plan, grid_plan, holds_from_schedule
from ftbench.schedule import (B, BW, F, NO_MICROBATCH, OPT, W, GridOps, Op, Schedule, check_coverage, generate,
                              grid_worker, validate)
from ftbench.sim.simulator import Simulation, layout_of, simulate


def _ctx(*overrides: str) -> RunContext:
    return RunContext.from_config(compose("model=gpt3-medium", "cluster.gpus_per_node=4", *overrides))


def _grid(ctx: RunContext, schedule: str, pp: int, dp: int, microbatches, gpus_per_node: int) -> Plan:
    """The pp x dp grid (lazily held ops) with `microbatches` per pipeline, layers balanced."""
    return grid_plan(generate(schedule, pp, microbatches, dp), ctx.cost_model.balanced_partition(pp), pp,
                     gpus_per_node)


def _same(fast, full) -> None:
    assert fast.iteration_time == full.iteration_time
    assert fast.peak_memory_bytes == full.peak_memory_bytes
    assert fast.peak_activation_bytes == full.peak_activation_bytes
    assert fast.peak_stash == full.peak_stash
    assert fast.busy == full.busy
    assert list(fast.busy) == list(full.busy)  # same order: sums over them agree to the last bit
    assert fast.bubble_fraction() == full.bubble_fraction()
    assert fast.ops == full.ops
    assert [(a, tuple(m), s, e) for a, m, s, e in fast.allreduces] == \
        [(a, tuple(m), s, e) for a, m, s, e in full.allreduces]


def _mixed_plan(ctx: RunContext, pp: int, dp: int, gpus_per_node: int) -> Plan:
    """A 1F1B grid where pipelines 1 and 2 swap one micro-batch at stage 1 (so neither is
    self-contained any more) and pipeline 4 runs GPipe: a few odd pipelines among many
    identical ones."""
    grid = _grid(ctx, "1f1b", pp, dp, 6, gpus_per_node)
    ops = {w: list(grid.schedule.ops[w]) for w in grid.schedule.ops}
    gpipe = generate("gpipe", pp, 6, 1).ops
    for s in range(pp):
        ops[grid_worker(4, s, pp)] = [op._replace(pipeline=4) for op in gpipe[s]]
    a, b = grid_worker(1, 1, pp), grid_worker(2, 1, pp)
    m = 5  # the last micro-batch of pipeline 1's stage 1 moves to pipeline 2's worker
    moved = [op for op in ops[a] if op.microbatch == m and op.kind != OPT]
    ops[a] = [op for op in ops[a] if op not in moved]
    ops[b] = [op for op in ops[b] if op.kind != OPT] + moved + [Op(OPT, 1, NO_MICROBATCH, 2)]
    schedule = Schedule(ops, grid.schedule.stages, grid.schedule.microbatches, "mixed")
    validate(schedule)
    return Plan(schedule=schedule, partition=grid.partition, holds=holds_from_schedule(schedule),
                node_of=dict(grid.node_of), name="mixed")


@pytest.mark.parametrize("pp,dp,gpus_per_node", [(4, 24, 4), (3, 16, 4)])
def test_deduplicated_equals_full_with_a_few_odd_pipelines(pp, dp, gpus_per_node):
    ctx = _ctx()
    plan = _mixed_plan(ctx, pp, dp, gpus_per_node)
    costs = PlanCosts(ctx.cost_model, plan)
    fast, full = simulate(plan.schedule, costs), simulate(plan.schedule, costs, dedupe=False)
    _same(fast, full)
    # The odd pipelines really ran: the GPipe pipeline stashes every micro-batch, 1F1B pp - s.
    assert fast.peak_stash[grid_worker(4, 0, pp)] == 6
    assert fast.peak_stash[grid_worker(0, 0, pp)] == min(pp, 6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_deduplicated_equals_full_on_grids_and_after_a_reshape(schedule):
    ctx = _ctx()
    for pp, dp in ((4, 12), (3, 10), (2, 7)):
        grid = _grid(ctx, schedule, pp, dp, tuple(5 + (d < 3) for d in range(dp)), 4)
        # survivors after a failure: another worker numbering, pipelines straddling nodes
        moved = grid.on_workers([w + 3 for w in range(pp * dp)], lambda w: w // 4)
        for plan in (grid, moved):
            costs = PlanCosts(ctx.cost_model, plan)
            _same(simulate(plan.schedule, costs), simulate(plan.schedule, costs, dedupe=False))
            staggered = simulate(plan.schedule, costs, staggered=True)
            _same(staggered, simulate(plan.schedule, costs, dedupe=False, staggered=True))
            assert sorted(staggered.previous_ops) == \
                sorted(simulate(plan.schedule, costs, dedupe=False, staggered=True).previous_ops)


def test_grid_figures_do_not_depend_on_dp_beyond_the_all_reduce():
    """Every pipeline of a uniform grid times out the same whatever dp: only the all-reduce
    grows with dp, so with it free the iteration time is the one pipeline's."""
    ctx = _ctx()

    class FreeAllReduce(PlanCosts):
        def sync_time(self, sync, workers):
            return 0.0

    results = {}
    for dp in (1, 2, 5, 64, 200):
        plan = _grid(ctx, "1f1b", 4, dp, 8, 4)  # the same micro-batches per pipeline at every dp
        results[dp] = simulate(plan.schedule, FreeAllReduce(ctx.cost_model, plan))
        with_ring = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
        assert with_ring.iteration_time >= results[dp].iteration_time
    one = results[1]
    for dp, result in results.items():
        assert result.iteration_time == one.iteration_time
        for d in range(dp):  # each pipeline's workers: the same figures as pipeline 0's at dp=1
            for s in range(4):
                w = grid_worker(d, s, 4)
                assert result.busy[w] == one.busy[s]
                assert result.peak_memory_bytes[w] == one.peak_memory_bytes[s]
                assert result.peak_stash[w] == one.peak_stash[s]


def test_lazily_held_grid_behaves_like_its_ops():
    schedule = generate("zb-h1", 4, (3, 3, 2), 3)
    assert isinstance(schedule.ops, GridOps)
    plain = Schedule({w: list(schedule.ops.read(w)) for w in schedule.ops}, schedule.stages, schedule.microbatches)
    check_coverage(schedule)
    validate(schedule)
    assert all(schedule.ops.form(w) is not None for w in schedule.ops)  # reading built no list for good
    assert holds_from_schedule(schedule) == holds_from_schedule(plain)
    assert schedule.index() == plain.index()
    assert dict(schedule.ops) == plain.ops and list(schedule.ops) == list(plain.ops)
    ops = schedule.ops[5]  # handed out: a caller may change it, and coverage then looks op by op
    assert schedule.ops.form(5) is None and schedule.ops[5] is ops
    assert holds_from_schedule(schedule) == holds_from_schedule(plain)
    ops.remove(next(op for op in ops if op.kind in (B, W, BW, F)))
    with pytest.raises(Exception, match="missing|without"):
        check_coverage(schedule)


def test_plan_keys_tell_plans_apart_and_equal_plans_alike():
    ctx = _ctx()
    a, b = _grid(ctx, "1f1b", 4, 6, 3, 4), _grid(ctx, "1f1b", 4, 6, 3, 4)
    assert a.key() == b.key() and hash(a.key()) == hash(b.key())
    assert _grid(ctx, "1f1b", 4, 5, 3, 4).key() != a.key()
    assert _grid(ctx, "gpipe", 4, 6, 3, 4).key() != a.key()
    assert _grid(ctx, "1f1b", 4, 6, (3, 3, 3, 3, 3, 4), 4).key() != a.key()
    moved = a.on_workers([w + 4 for w in range(24)], lambda w: w // 4)
    assert moved.key() != a.key()
    elsewhere = a.on_workers([w + 4 for w in range(24)], lambda w: w // 2)
    assert elsewhere.key() != moved.key()
    other_holds = Plan(schedule=a.schedule, partition=a.partition, holds={**a.holds, 0: ((0, 0), (1, 0))},
                       node_of=a.node_of)
    assert other_holds.key() != a.key()


def test_uniform_layout_equals_fragment_layout():
    ctx = _ctx()
    for pp, dp in ((4, 2), (4, 9), (1, 3), (6, 5)):
        plan = _grid(ctx, "1f1b", pp, dp, 2, 4)
        full = fragment_layout(plan.schedule.stages, plan.partition)
        fast = layout_of(plan.schedule, PlanCosts(ctx.cost_model, plan))
        assert fast.syncs == full.syncs
        assert dict(fast.of_position) == full.of_position and list(fast.of_position) == list(full.of_position)


def test_retimed_all_reduce_equals_a_fresh_simulation():
    """Simulation.iteration_time(sync_time) equals simulating with those all-reduce costs."""
    ctx = _ctx()
    plan = _grid(ctx, "zb-h1", 4, 8, 6, 4)

    class Slow(PlanCosts):
        def sync_time(self, sync, workers):
            return 0.37 * sync.stage + 0.01

    simulation = Simulation(plan.schedule, PlanCosts(ctx.cost_model, plan))
    assert simulation.iteration_time() == simulation.result().iteration_time
    slow = Slow(ctx.cost_model, plan)
    assert simulation.iteration_time(slow.sync_time) == simulate(plan.schedule, slow).iteration_time


@pytest.mark.parametrize("gpus_per_node,global_batch", [(8, 2048), (4, 1000), (3, 996)])
def test_varuna_candidate_times_equal_simulating_the_whole_grid(gpus_per_node, global_batch):
    """Varuna times a candidate shape from one pipeline of each kind; simulating the whole
    grid gives the same time (and the same verdict on memory)."""
    from ftbench.strategies.varuna import Varuna

    cfg = compose("model=gpt3-medium", "strategy=varuna", "backend=sim", "hardware=a100-80gb",
                  f"cluster.gpus_per_node={gpus_per_node}", "cluster.pp=4", "cluster.dp=4",
                  f"train.global_batch={global_batch}")
    ctx = RunContext.from_config(cfg)
    varuna = Varuna(cfg.strategy, ctx)
    varuna.configured_pp = 4
    for pp, dp in ((1, 7), (2, 13), (3, 11), (4, 9), (6, 5), (8, 3), (12, 2), (4, 10), (4, 11)):
        plan = ctx.grid_plan(pp, dp, gpus_per_node)
        result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
        fits = max(result.peak_memory_bytes.values()) <= ctx.cost_model.memory_bytes
        expected = result.iteration_time if fits else math.inf
        assert varuna._iteration_time(pp, dp, gpus_per_node) == expected, (pp, dp)


def test_bulk_signatures_equal_one_by_one():
    """The grid shortcut of replica classes (GridOps.regular + PlanCosts.run_signatures) gives
    what pipeline_signature gives pipeline by pipeline."""
    ctx = _ctx()
    for pp, dp, g in ((4, 6, 4), (3, 7, 4), (2, 5, 3)):
        grid = _grid(ctx, "1f1b", pp, dp, 3, g)
        for plan in (grid, grid.on_workers([w * 2 + 1 for w in range(pp * dp)], lambda w: w // g)):
            costs = PlanCosts(ctx.cost_model, plan)
            workers = list(plan.schedule.ops)
            bulk = costs.run_signatures(workers, pp)
            assert bulk == [costs.pipeline_signature(d, workers[d * pp:(d + 1) * pp]) for d in range(dp)]


def test_grid_placed_on_workers_is_the_grid_moved_onto_them():
    ctx = _ctx()
    workers = [w * 3 + 2 for w in range(40)]
    node_of = lambda w: w // 5  # noqa: E731
    moved = _grid(ctx, "zb-h1", 4, 9, 2, 4).on_workers(workers, node_of)
    direct = grid_plan(generate("zb-h1", 4, 2, 9), ctx.cost_model.balanced_partition(4), 4, 4, node_of=node_of,
                       workers=workers)
    assert direct == moved and direct.key() == moved.key()
    assert list(direct.holds.items()) == list(moved.holds.items())
    assert list(direct.node_of.items()) == list(moved.node_of.items())
    assert list(direct.schedule.ops.of.items()) == list(moved.schedule.ops.of.items())


def test_the_scale_benchmark_measures_each_strategy_in_its_own_process_and_stops_it_at_the_limit():
    """benchmarks/sim_scale.py: a run's peak memory is its own process's; a run past the limit
    is stopped with SIGTERM and still says how far it got (its summary survives)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sim_scale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    base = ["experiment=sim-6.7b-1024gpu", "report.progress=false", "wandb.mode=disabled"]
    done = sim_scale.measure("checkpoint", base + ["train.max_hours=24"], limit_s=120)
    assert done["status"] == "ok" and not done["stopped"] and done["iterations"] > 0
    assert 0 < done["rss_gb"] < 4 and done["sim_s"] >= 0 and done["strategy_s"] >= 0
    # ReCycle at 16,384 GPUs, one per node, runs for minutes (3,000 failures): stopped, its summary kept
    cut = sim_scale.measure("recycle", ["experiment=sim-6.7b-16k", *base[1:], "cluster.gpus_per_node=1"], limit_s=8)
    assert cut["stopped"] and cut["status"] == "interrupted" and "SIGTERM" in cut["error"], cut.get("error")
    assert "stopped at" in sim_scale.row("recycle", cut)
