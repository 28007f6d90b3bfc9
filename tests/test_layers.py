"""Model state keyed by layers: heterogeneous pipelines (different stage partitions and
micro-batch counts, one global batch) all-reduce every layer across every holder, train
exactly what single-process training trains, and are timed with their fragment syncs; failure
points may fall between one stage's optimizer step and another's."""
import pytest
import torch

from conftest import LOCAL, compose
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.engine.local import LocalEngine
from ftbench.engine.reference import train_single_process
from ftbench.equivalence import compare, noise_floor
from ftbench.layers import fragment_layout, stage_layout, stage_units, unit_of
from ftbench.plan import Plan, holds_from_schedule
from ftbench.schedule import OPT, Op, Schedule, dependency_graph, gpipe, one_f_one_b, validate, zb_h1
from ftbench.sim.simulator import ops_completed_at, simulate
from ftbench.models.data import make_source

# gpt-tiny has 8 blocks. Units: 0 embeddings, 1..8 blocks, 9 final LayerNorm + head.
PARTITION = (((0, 4), (4, 8)),
             ((0, 3), (3, 6), (6, 8)),
             ((0, 2), (2, 4), (4, 6), (6, 8)))
MICROBATCHES = (5, 4, 3)  # 12 samples, pipeline 0 first
GENERATORS = (gpipe, one_f_one_b, zb_h1)  # one of each op mix (BW, BW, B + W)


def heterogeneous_plan() -> Plan:
    """Pipelines of 2, 3 and 4 stages, each from its own generator, on renumbered workers."""
    ops, base = {}, 0
    for d, (layers, m, generate) in enumerate(zip(PARTITION, MICROBATCHES, GENERATORS)):
        one = generate(len(layers), m)
        for w, worker_ops in one.ops.items():
            ops[base + w] = [op._replace(pipeline=d) for op in worker_ops]
        base += len(layers)
    schedule = Schedule(ops, stages=tuple(len(p) for p in PARTITION), microbatches=MICROBATCHES, name="hetero")
    validate(schedule)
    return Plan(schedule=schedule, partition=PARTITION, holds=holds_from_schedule(schedule),
                node_of={w: w // 2 for w in ops}, name="hetero")


def _ctx():
    # dp 3 x 4 micro-batches of 1 sample: the 12-sample global batch the plan splits 5/4/3.
    return compose(*LOCAL, "cluster.dp=3", "train.microbatches=4", "backend.dtype=float64")


def test_fragments_cut_at_every_pipelines_boundaries():
    layout = fragment_layout((2, 3, 4), PARTITION)
    assert [s.units for s in layout.syncs] == [(0, 3), (3, 4), (4, 5), (5, 7), (7, 10)]
    by_units = {s.units: s.holders for s in layout.syncs}
    # Stage 0 of every pipeline shares the embeddings and blocks 0-1.
    assert by_units[(0, 3)] == ((0, 0), (1, 0), (2, 0))
    assert by_units[(5, 7)] == ((0, 1), (1, 1), (2, 2))  # blocks 4-5 sit at different stage indices
    assert layout.of_position[(0, 0)] == [s for s in layout.syncs if s.units in ((0, 3), (3, 4), (4, 5))]
    assert stage_units((0, 8), True, True, 8) == (0, 10)
    assert [unit_of(n, 8) for n in ("transformer.wte.weight", "transformer.h.3.mlp.c_fc.bias",
                                     "lm_head.weight")] == [0, 4, 9]


def test_a_regular_grid_has_one_fragment_per_stage():
    grid = ((0, 2), (2, 4), (4, 6), (6, 8))
    layout = fragment_layout((4, 4), (grid, grid))
    assert [s.holders for s in layout.syncs] == [((0, s), (1, s)) for s in range(4)]
    assert [s.holders for s in stage_layout((4, 4)).syncs] == [s.holders for s in layout.syncs]


def test_heterogeneous_pipelines_train_the_single_process_model(tmp_path):
    """In float32, the dtype users train in: pipelines of 2, 3 and 4 stages sum gradients in
    another order than one process does, which the check allows to its measured noise floor
    (single-process float32 training against the same in float64, ftbench/equivalence.py)."""
    cfg = _ctx()
    ctx = RunContext.from_config(cfg)
    assert ctx.global_batch == sum(MICROBATCHES) * ctx.microbatch_size
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    engine = LocalEngine(ctx, data, cfg.train.lr, 0.0, store=None, dtype="float32")
    engine.build(heterogeneous_plan())
    iterations = 3
    losses = [engine.run_iteration(i).loss for i in range(iterations)]
    ref32, ref64 = (train_single_process(ctx.spec, ctx.seed, data, iterations, ctx.global_batch,
                                         ctx.microbatch_size, cfg.train.lr, dtype=dtype)
                    for dtype in (torch.float32, torch.float64))
    assert compare(losses, engine.final_state(), *ref32, noise_floor(*ref32, *ref64)) is None
    # Replicas are keyed by layers: pipeline 2's stage 1 worker holds blocks 2-3 only.
    assert list(engine.workers[6].replicas) == [(2, 4)]


def test_the_simulator_charges_cross_pipeline_fragment_syncs():
    ctx = RunContext.from_config(_ctx())
    plan = heterogeneous_plan()
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    syncs = {ar.units: (members, start, end) for ar, members, start, end in result.allreduces}
    assert set(syncs) == {(0, 3), (3, 4), (4, 5), (5, 7), (7, 10)}
    layout = fragment_layout(plan.schedule.stages, plan.partition)
    for units, (members, start, end) in syncs.items():
        # Members come from all three pipelines (every fragment is held by each of them).
        assert len(members) == 3 and len({plan.node_of[w] for w in members}) > 1 and end > start
    for _, op, start, _ in result.ops:
        if op.kind == OPT:  # a step waits for every fragment it holds
            assert start >= max(syncs[s.units][2] for s in layout.of_position[(op.pipeline, op.stage)])
    assert result.iteration_time >= max(end for _, _, end in syncs.values())
    # The bigger a fragment, the longer its all-reduce over the same kind of links.
    assert syncs[(5, 7)][2] - syncs[(5, 7)][1] > syncs[(3, 4)][2] - syncs[(3, 4)][1]


class _StageKeyed:
    """PlanCosts without the fragment view: the simulator's per-stage all-reduce."""

    def __init__(self, costs):
        self._costs = costs

    def __getattr__(self, name):
        if name in ("partition", "sync_time"):
            raise AttributeError(name)
        return getattr(self._costs, name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_homogeneous_grid_times_as_before(schedule):
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", f"schedule={schedule}",
                                         "cluster.pp=4", "cluster.dp=4"))
    plan = ctx.grid_plan(4, 4, gpus_per_node=4)
    costs = PlanCosts(ctx.cost_model, plan)
    fragments, stages = simulate(plan.schedule, costs), simulate(plan.schedule, _StageKeyed(costs))
    assert len(fragments.allreduces) == 4
    assert sorted(ar.holders for ar, *_ in fragments.allreduces) == [tuple((d, s) for d in range(4)) for s in range(4)]
    assert fragments.iteration_time == stages.iteration_time
    assert [row[1:] for row in fragments.allreduces] == [row[1:] for row in stages.allreduces]


def _grid_engine():
    cfg = compose(*LOCAL, "backend.dtype=float64")
    ctx = RunContext.from_config(cfg)
    engine = LocalEngine(ctx, make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed), cfg.train.lr, 0.0,
                         store=None, dtype="float64")
    plan = ctx.grid_plan(cfg.cluster.pp, cfg.cluster.dp)
    engine.build(plan)
    return ctx, engine, plan


def _is_closed(plan, completed) -> bool:
    deps = dependency_graph(plan.schedule)
    for ops in plan.schedule.ops.values():
        if any(b in completed and a not in completed for a, b in zip(ops, ops[1:])):
            return False
    for op in completed:
        for d in deps[op]:
            inputs = deps[d] if d in deps and not hasattr(d, "kind") else [d]
            if any(x not in completed for x in inputs):
                return False
    return True


def test_failure_points_are_closed_and_stop_before_the_optimizer_by_default():
    ctx, _, plan = _grid_engine()
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    everything = {op for ops in plan.schedule.ops.values() for op in ops}
    sizes = []
    for f in (0.0, 0.25, 0.5, 0.75, 0.99, 1.0):
        cut = ops_completed_at(result, f)
        assert _is_closed(plan, cut) and not any(op.kind == OPT for op in cut)
        sizes.append(len(cut))
    assert sizes == sorted(sizes) and 0 < sizes[2] < len(everything)
    assert ops_completed_at(result, 1.0, stop_before_optimizer=False) == everything


def test_a_failure_between_one_stages_step_and_anothers():
    ctx, engine, plan = _grid_engine()
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    # The latest point at which some stages have stepped and others not (1F1B: the last stage
    # finishes its backward, hence its all-reduce and step, first).
    cuts = [ops_completed_at(result, f / 1000, stop_before_optimizer=False) for f in range(900, 1001)]
    cut = next(c for c in reversed(cuts) if 0 < sum(op.kind == OPT for op in c) < 8)
    assert _is_closed(plan, cut)
    steps = {plan.schedule.worker_of(op) for op in cut if op.kind == OPT}
    before = {w: {n: p.detach().clone() for r in worker.replicas.values() for n, p in r.named_parameters().items()}
              for w, worker in engine.workers.items()}
    out = engine.run_iteration(0, completed=cut)
    assert not out.complete and out.ops_run == len(cut)
    for w, worker in engine.workers.items():
        replica, = worker.replicas.values()
        changed = any(not torch.equal(p, before[w][n]) for n, p in replica.named_parameters().items())
        assert changed == (w in steps)
        if w not in steps:  # not stepped: its gradient is still there
            assert any(p.grad is not None for p in replica.module.parameters())
    engine.abandon_iteration()
    assert engine.run_iteration(1).complete  # the engine goes on after the cut


def test_a_failure_point_leaves_out_work_after_a_step():
    """One worker holding both stages of a pipeline steps stage 1 before stage 0's backward:
    a default failure point drops that step and everything after it on the worker."""
    from ftbench.schedule import BW, F, NO_MICROBATCH

    ctx = RunContext.from_config(_ctx())
    order = [Op(F, 0, 0, 0), Op(F, 1, 0, 0), Op(F, 0, 1, 0), Op(F, 1, 1, 0), Op(BW, 1, 0, 0), Op(BW, 1, 1, 0),
             Op(OPT, 1, NO_MICROBATCH, 0), Op(BW, 0, 0, 0), Op(BW, 0, 1, 0), Op(OPT, 0, NO_MICROBATCH, 0)]
    schedule = Schedule({0: order}, stages=(2,), microbatches=(2,))
    validate(schedule)
    plan = Plan(schedule, ((((0, 4), (4, 8))),), {0: ((0, 0), (0, 1))}, {0: 0})
    result = simulate(schedule, PlanCosts(ctx.cost_model, plan))
    assert ops_completed_at(result, 1.0) == frozenset(order[:6])
    assert ops_completed_at(result, 1.0, stop_before_optimizer=False) == frozenset(order)


def test_heterogeneous_checkpoints_write_every_parameter_once_and_restore_anywhere(tmp_path):
    from ftbench.actions import FILE
    from ftbench.checkpoint import CheckpointStore

    cfg = _ctx()
    ctx = RunContext.from_config(cfg)
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    engine = LocalEngine(ctx, data, cfg.train.lr, 0.0, store=CheckpointStore(tmp_path / "ckpt"), dtype="float64")
    engine.build(heterogeneous_plan())
    engine.run_iteration(0)
    names = [n for wr in engine._writers() for n in engine._shard(wr)["model"]]
    assert len(names) == len(set(names)) == len(engine.final_state())
    engine.save(1, FILE)
    # Into the regular 4 x 3 grid: every replica gets the heterogeneous run's weights.
    grid = LocalEngine(ctx, data, cfg.train.lr, 0.0, store=CheckpointStore(tmp_path / "ckpt"), dtype="float64")
    assert grid.restore(FILE, ctx.grid_plan(4, 3)) == 1
    trained, restored = engine.final_state(), grid.final_state()
    assert all(torch.equal(trained[n], restored[n]) for n in trained)
