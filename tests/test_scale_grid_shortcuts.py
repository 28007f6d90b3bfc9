"""The per-stage shortcuts taken for plans built as regular grids (Plan.grid) give exactly what
the per-worker computations give: plans, keys, recovery costs, peer-copy decisions, memory
checks and Varuna's choice of shape. Each shortcut is compared with the general path on
small grids, including workers out of order and plans that are no grid any more. No timing
asserts: speed is benchmarks/sim_scale.py's business."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from conftest import compose
from ftbench.actions import FILE, MEMORY, SNAPSHOT, RestoreCheckpoint
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.plan import checkpoint_writers, generated_grid_plan, grid_plan
from ftbench.recovery_costs import _node_bytes, action_seconds, most_replica_bytes, replica_bytes, save_cost
from ftbench.schedule import generate
from ftbench.sim.backend import SimBackend


def _ctx(*overrides: str) -> RunContext:
    return RunContext.from_config(compose("model=gpt3-medium", "cluster.gpus_per_node=4", *overrides))


def _counts(total: int, dp: int) -> tuple[int, ...]:
    return tuple(total // dp + (1 if d < total % dp else 0) for d in range(dp))


def _not_a_grid(plan):
    """The same plan with holds that are equal but not the grid's own: every shortcut is off."""
    other = dataclasses.replace(plan, holds=dict(plan.holds))
    assert other.grid() is None
    return other


# (schedule, pp, micro-batches per pipeline, workers): sorted, shifted, with gaps, out of order
CASES = [
    ("1f1b", 4, _counts(30, 7), [w + 4 for w in range(28)]),
    ("zb-h1", 3, _counts(20, 5), [w * 2 + 1 for w in range(15)]),
    ("gpipe", 2, (3, 3, 3), list(range(6))),
    ("1f1b", 4, _counts(17, 6), [w for w in range(40) if w % 5 != 2][:24]),
    ("1f1b", 2, (4, 4, 3, 3), [9, 8, 7, 6, 0, 1, 2, 3, 10, 11]),
    ("zb-h1", 1, (2, 2, 1), [5, 3, 4]),
    ("1f1b", 3, (2, 3, 2, 3), list(range(20))),  # counts alternating; more workers than needed
]


@pytest.mark.parametrize("schedule,pp,counts,workers", CASES)
def test_generated_grid_plan_is_grid_plan_of_the_generated_schedule(schedule, pp, counts, workers):
    ctx = _ctx()
    node_of = lambda w: w // 3  # noqa: E731
    layers = ctx.cost_model.balanced_partition(pp)
    fast = generated_grid_plan(schedule, pp, counts, layers, workers, node_of)
    plain = grid_plan(generate(schedule, pp, counts, len(counts)), layers, pp, 4, node_of=node_of, workers=workers)
    assert fast.schedule.ops.regular() == plain.schedule.ops.regular() == pp
    assert fast.key() == plain.key() == _not_a_grid(plain).key()
    assert list(fast.holds.items()) == list(plain.holds.items())
    assert list(fast.node_of.items()) == list(plain.node_of.items())
    assert list(fast.schedule.ops.of.items()) == list(plain.schedule.ops.of.items())
    assert fast.schedule.ops.templates == plain.schedule.ops.templates
    assert fast.grid() is not None and plain.grid() is not None
    assert fast.grid().workers == list(fast.holds)
    assert fast == plain  # last: comparing the ops hands out every worker's list


@pytest.mark.parametrize("schedule,pp,counts,workers", CASES)
def test_recovery_costs_of_a_grid_equal_the_per_worker_ones(schedule, pp, counts, workers):
    ctx = _ctx()
    model = ctx.cost_model
    plan = generated_grid_plan(schedule, pp, counts, model.balanced_partition(pp), workers, lambda w: w // 3)
    general = _not_a_grid(plan)
    assert most_replica_bytes(plan, model) == max(replica_bytes(general, model).values())
    assert list(_node_bytes(plan, model).items()) == list(_node_bytes(general, model).items())
    assert checkpoint_writers(plan) == checkpoint_writers(general)
    for mode in (FILE, SNAPSHOT, MEMORY):
        assert save_cost(mode, plan, model) == save_cost(mode, general, model)
    for source in (FILE, MEMORY):
        action = RestoreCheckpoint(source)
        assert action_seconds(action, plan, plan, model) == action_seconds(action, general, general, model)


@pytest.mark.parametrize("schedule,pp,counts,workers", CASES)
def test_bulk_signatures_of_a_grid_equal_one_by_one(schedule, pp, counts, workers):
    ctx = _ctx()
    plan = generated_grid_plan(schedule, pp, counts, ctx.cost_model.balanced_partition(pp), workers, lambda w: w // 3)
    for each in (plan, _not_a_grid(plan)):
        costs = PlanCosts(ctx.cost_model, each)
        placed = list(each.schedule.ops)
        assert costs.run_signatures(placed, pp) == \
            [costs.pipeline_signature(d, placed[d * pp:(d + 1) * pp]) for d in range(len(counts))]


def test_a_worker_named_twice_gives_what_grid_plan_gives():
    ctx = _ctx()
    layers = ctx.cost_model.balanced_partition(2)
    workers = [0, 1, 1, 2, 3, 4]
    fast = generated_grid_plan("1f1b", 2, (2, 2, 2), layers, workers, lambda w: w)
    plain = grid_plan(generate("1f1b", 2, (2, 2, 2), 3), layers, 2, 4, node_of=lambda w: w, workers=workers)
    assert fast.grid() is None and plain.grid() is None
    assert fast.key() == plain.key()
    assert list(fast.holds.items()) == list(plain.holds.items())


def test_a_plan_whose_holds_were_replaced_is_no_grid():
    ctx = _ctx()
    plan = ctx.grid_plan(2, 3, 4)
    assert plan.grid() is not None
    moved = dataclasses.replace(plan, holds={**plan.holds, 0: ((0, 0), (1, 0))})
    assert moved.grid() is None
    assert max(replica_bytes(moved, ctx.cost_model).values()) == most_replica_bytes(moved, ctx.cost_model)
    assert most_replica_bytes(moved, ctx.cost_model) > most_replica_bytes(plan, ctx.cost_model)


def test_elastic_horovod_keeps_stages_on_grids_as_worker_by_worker():
    from ftbench.strategies.elastic_horovod import _keeps_stages

    ctx = _ctx()
    layers = ctx.cost_model.balanced_partition(4)

    def plan(workers, dp):
        return generated_grid_plan("1f1b", 4, _counts(24, dp), layers, workers, lambda w: w // 4)

    old = plan(list(range(24)), 6)
    cases = [
        (plan(list(range(4, 24)), 5), set(range(4, 24))),  # a whole pipeline gone: stages kept
        (plan(list(range(4, 24)), 5), set(range(5, 24))),  # one of them is not live
        (plan(list(range(2, 22)), 5), set(range(24))),  # shifted by two stages: they move
        (plan(list(range(24)), 6), set(range(24))),  # the same grid
        (plan(list(range(20)) + [24, 25, 26, 27], 6), set(range(28))),  # a new worker
        (plan([4, 5, 6, 7, 0, 1, 2, 3] + list(range(8, 24)), 6), set(range(24))),  # pipelines swapped
    ]
    for new, up in cases:
        assert _keeps_stages(old, new, up) == _keeps_stages(_not_a_grid(old), _not_a_grid(new), up)
    assert [_keeps_stages(old, new, up) for new, up in cases] == [True, False, False, True, False, True]


def test_peak_memory_is_kept_per_worker_as_before():
    ctx = _ctx()
    backend = SimBackend(ctx)
    memory = ctx.cost_model.memory_bytes
    rounds = [{0: 3.0, 1: 5.0, 2: 5.0, 3: 1.0}, {2: 7.0, 3: 0.5, 4: 0.0, 5: -1.0}, {1: 5.0, 6: 2.0, 0: 3.0}]
    kept: dict = {}
    for peaks in rounds:
        result = SimpleNamespace(peak_memory_bytes=peaks, peak_activation_bytes={w: 0.0 for w in peaks})
        assert backend.check_memory(None, result) is None
        kept.update({w: max(kept.get(w, 0.0), p) for w, p in peaks.items()})
        assert list(backend.peak_memory().items()) == list(kept.items())
    # out of memory: the first worker at the largest peak is named, as max(items, key=) picks it
    over = {0: memory / 2, 1: memory * 2, 2: memory * 2, 3: memory}
    result = SimpleNamespace(peak_memory_bytes=over, peak_activation_bytes={w: 1e9 for w in over})
    problem = backend.check_memory(None, result)
    worker = max(over.items(), key=lambda kv: kv[1])[0]
    assert problem is not None and f"worker {worker} needs" in problem


def _varuna(schedule: str = "1f1b", recompute: str = "none", global_batch: int = 128):
    from ftbench.strategies.varuna import Varuna

    cfg = compose("model=gpt3-medium", "strategy=varuna", "backend=sim", "hardware=a100-80gb",
                  "cluster.gpus_per_node=4", "cluster.pp=4", "cluster.dp=4", f"schedule={schedule}",
                  f"train.recompute={recompute}", f"train.global_batch={global_batch}")
    varuna = Varuna(cfg.strategy, RunContext.from_config(cfg))
    varuna.configured_pp = 4
    return varuna


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("zb-h1", "none"), ("gpipe", "full")])
def test_varuna_busy_bound_is_below_every_simulated_time(schedule, recompute):
    varuna = _varuna(schedule, recompute)
    micro = varuna.ctx.global_batch // varuna.ctx.microbatch_size
    for pp in (1, 2, 3, 4, 6, 8, 12, 24):
        for dp in (1, 3, 16):
            t = varuna._iteration_time(pp, dp, 4)
            if math.isfinite(t):
                assert varuna._busy_bound(pp, -(-micro // dp)) <= t, (pp, dp)


def test_varuna_best_shape_is_the_same_without_the_bound():
    skipped = 0
    for schedule, global_batch in (("1f1b", 128), ("zb-h1", 64), ("gpipe", 48)):
        pruned, full = _varuna(schedule, global_batch=global_batch), _varuna(schedule, global_batch=global_batch)
        full._busy_bound = lambda pp, microbatches: 0.0  # never skips a candidate
        for workers in (1, 2, 5, 13, 31, 64):
            assert pruned.best_shape(workers, 4) == full.best_shape(workers, 4), (schedule, workers)
        skipped += len(full._estimates) - len(pruned._estimates)
    assert skipped > 0  # some deep candidates were never simulated


def test_keys_of_equal_schedules_are_equal_whatever_their_objects_share():
    """marshal's formats 3 and later write an object met twice as a back-reference only when
    something else holds it too: keys are written in format 2, so equal schedules key alike
    however their templates are shared (a cache holding them changed the bytes in a full test
    run)."""
    from ftbench.schedule import GridOps, Schedule

    one = (("F", 0, 0),)  # a template: one op
    records = {0: (0, 0), 1: (1, 1)}
    shared = Schedule(GridOps((one, one), records, run=1), stages=(1, 1), microbatches=(1, 1))
    apart = Schedule(GridOps(((("F", 0, 0),), (("F", 0, 0),)), records, run=1), stages=(1, 1), microbatches=(1, 1))
    assert shared.key() == apart.key()
