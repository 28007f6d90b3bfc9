"""Schedule IR: generators, validation, and the textbook bubble fractions in the simulator."""
import pytest

from ftbench.schedule import (BW, F, OPT, NO_MICROBATCH, Op, Schedule, ScheduleError, gpipe,
                              one_f_one_b, validate, zb_h1)
from ftbench.sim.simulator import simulate
from ftbench.sim.unit_costs import UnitCosts

GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 4, 8, 16, 32)]


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble_is_textbook(generator, p, m):
    result = simulate(generator(p, m, dp=2), UnitCosts(forward=1.0, fused_backward=1.0))
    assert result.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.iteration_time == pytest.approx(2 * (m + p - 1))


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p and p > 1])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    costs = UnitCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    zb, ofob = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    idle = lambda r: r.iteration_time - sum(r.busy.values()) / len(r.busy)  # noqa: E731
    # Zero-bubble paper: ZB-H1 idles (p-1)(T_F+T_B-T_W) per worker, 1F1B (p-1)(T_F+T_B+T_W).
    assert idle(zb) == pytest.approx(p - 1)
    assert idle(ofob) == pytest.approx(3 * (p - 1))
    assert zb.iteration_time == pytest.approx(3 * m + p - 1)


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_stashes_min_p_m_on_stage_0(p, m):
    result = simulate(one_f_one_b(p, m), UnitCosts())
    assert result.peak_stash[0] == min(p, m)
    assert result.peak_stash[p - 1] == 1
    assert simulate(gpipe(p, m), UnitCosts()).peak_stash[0] == m


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_keeps_1f1b_activation_memory(p, m):
    zb, ofob = simulate(zb_h1(p, m), UnitCosts()), simulate(one_f_one_b(p, m), UnitCosts())
    assert zb.peak_stash == ofob.peak_stash


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, zb_h1])
@pytest.mark.parametrize("p,m,dp", [(1, 1, 1), (4, 8, 2), (3, 5, 3), (8, 4, 1)])
def test_generated_schedules_validate(generator, p, m, dp):
    schedule = generator(p, m, dp)
    validate(schedule)
    assert len(schedule.workers) == p * dp


def _copy(schedule: Schedule, ops: dict) -> Schedule:
    return Schedule(ops, schedule.stages, schedule.microbatches)


def test_validate_rejects_missing_op():
    s = one_f_one_b(2, 4)
    ops = {w: list(o) for w, o in s.ops.items()}
    ops[1].remove(Op(F, 1, 2, 0))
    with pytest.raises(ScheduleError, match=r"missing F\(s1,m2,p0\)"):
        validate(_copy(s, ops))


def test_validate_rejects_missing_backward_and_optimizer():
    s = one_f_one_b(2, 4)
    ops = {w: [op for op in o if op != Op(BW, 0, 3, 0) and op.kind != OPT or op.stage == 1]
           for w, o in s.ops.items()}
    with pytest.raises(ScheduleError) as err:
        validate(_copy(s, ops))
    assert "missing backward of stage 0 micro-batch 3" in str(err.value)
    assert "stage 0 of pipeline 0 has no optimizer step" in str(err.value)


def test_validate_rejects_duplicated_op():
    s = gpipe(2, 2)
    ops = {w: list(o) for w, o in s.ops.items()}
    ops[0].insert(1, Op(F, 0, 0, 0))
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(_copy(s, ops))


def test_validate_rejects_op_outside_shape():
    s = gpipe(2, 2)
    ops = {w: list(o) for w, o in s.ops.items()}
    ops[0].append(Op(F, 0, 7, 0))
    with pytest.raises(ScheduleError, match="outside the schedule's shape"):
        validate(_copy(s, ops))


def test_validate_rejects_deadlocking_order():
    # Stage 1 wants the backward of micro-batch 1 before it forwarded micro-batch 0, while
    # stage 0 forwards micro-batch 0 first: a cycle through worker orders.
    s = gpipe(2, 2)
    ops = {0: [Op(F, 0, 0, 0), Op(F, 0, 1, 0), Op(BW, 0, 0, 0), Op(BW, 0, 1, 0), Op(OPT, 0, NO_MICROBATCH, 0)],
           1: [Op(F, 1, 1, 0), Op(BW, 1, 1, 0), Op(BW, 1, 0, 0), Op(F, 1, 0, 0), Op(OPT, 1, NO_MICROBATCH, 0)]}
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(_copy(s, ops))
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(_copy(s, ops), UnitCosts())


def test_all_reduce_waits_for_every_replica_and_delays_the_optimizer():
    costs = UnitCosts(forward=1.0, fused_backward=2.0, optimizer=0.5, allreduce=3.0)
    result = simulate(one_f_one_b(2, 2, dp=2), costs)
    ar_end = {ar.stage: end for ar, _, _, end in result.allreduces}
    opt = {(w, op.stage): (s, e) for w, op, s, e in result.ops if op.kind == OPT}
    for (w, stage), (start, end) in opt.items():
        assert start == pytest.approx(ar_end[stage])
        assert end - start == pytest.approx(0.5)
    assert result.iteration_time == pytest.approx(max(e for s, e in opt.values()))


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, zb_h1])
def test_replica_deduplication_is_exact(generator):
    """Simulating one representative of identical data-parallel pipelines gives exactly the
    full simulation: same iteration time, per-op timings, memory and all-reduces."""
    from conftest import compose
    from ftbench.context import RunContext
    from ftbench.costs import PlanCosts

    ctx = RunContext.from_config(compose("model=gpt3-medium", "cluster.gpus_per_node=2"))
    for pp, dp in ((4, 4), (3, 5)):
        # pp=3 on 2-GPU nodes: pipelines straddle nodes differently, so not all may merge
        plan = ctx.grid_plan(pp, dp, gpus_per_node=2)
        plan.schedule = generator(pp, 8, dp)
        costs = PlanCosts(ctx.cost_model, plan)
        fast, full = simulate(plan.schedule, costs), simulate(plan.schedule, costs, dedupe=False)
        assert fast.iteration_time == full.iteration_time
        assert sorted(fast.ops) == sorted(full.ops)
        assert fast.peak_memory_bytes == full.peak_memory_bytes and fast.busy == full.busy
        assert sorted((a.stage, tuple(m), s, e) for a, m, s, e in fast.allreduces) == \
            sorted((a.stage, tuple(m), s, e) for a, m, s, e in full.allreduces)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p])
def test_zb_h1_peak_activation_bytes_equal_1f1b(p, m):
    """Deferred Ws keep only the linear layers' inputs; that never lifts any stage above
    stage 0's 1F1B peak of p micro-batches, so the pipeline's peak is 1F1B's."""
    costs = UnitCosts(stash=1.0, weight_stash=0.3)
    zb, ofob = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert max(zb.peak_activation_bytes.values()) == pytest.approx(max(ofob.peak_activation_bytes.values()))
    assert max(zb.peak_activation_bytes.values()) == pytest.approx(p * 1.0)
