"""`train.overlap_grad_reduce`: the gradient all-reduce in per-layer buckets during the last
micro-batch's backward (Megatron-LM's --overlap-grad-reduce). Off (the default) every number
is today's; on, a fragment's all-reduce ends max_j end_j + max(a/n, a - t_j(n-1)/n) after its
inputs (ftbench.sim.simulator.overlapped_sync_s), in the simulator, in Varuna's re-timing and
in both ReCycle planners alike."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from conftest import compose, run
from test_planner_milp import brute_force
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.planning import milp
from ftbench.planning.heuristic import list_schedule_timed
from ftbench.planning.problem import PlanningProblem, StageTimes, evaluate, problem_for
from ftbench.schedule import BW, W, generate
from ftbench.sim.simulator import Simulation, overlapped_sync_s, simulate
from ftbench.sim.unit_costs import UnitCosts

GPT3_MEDIUM_DP8 = ("backend=sim", "strategy=none", "failures=none", "model=gpt3-medium", "cluster.dp=8",
                   "train.iterations=3", "wandb.mode=disabled", "report.gantt=false")


@dataclasses.dataclass
class Tiny(UnitCosts):
    """Unit costs with the overlap switch and a bucket count per stage's all-reduce."""
    overlap: bool | None = None  # None: no attribute at all (a costs object from before the setting)
    buckets: int = 1

    def __getattr__(self, name):
        if name == "overlap_grad_reduce" and self.overlap is not None:
            return self.overlap
        raise AttributeError(name)

    def grad_buckets(self, sync) -> int:
        return self.buckets


def _tiny(allreduce: float, overlap: bool | None, buckets: int = 4) -> Tiny:
    # F 1 s, fused BW 2 s, step 0.5 s, free sends
    return Tiny(forward=1.0, backward_input=1.0, backward_weight=1.0, optimizer=0.5, allreduce=allreduce,
                overlap=overlap, buckets=buckets)


def _rows(result):
    return sorted(result.ops, key=lambda r: (r[0], r[2])), [(a, tuple(m), s, e) for a, m, s, e in result.allreduces]


# -- the formula ------------------------------------------------------------------------------

def test_the_formula_in_both_regimes_and_without_buckets():
    # compute-bound (t >= a): only the last bucket is left after the backward
    assert overlapped_sync_s(1.0, 4, 2.0) == 0.25
    # link-bound (t < a): the link runs from the first layer's gradients on, a - t(n-1)/n
    assert overlapped_sync_s(6.0, 4, 2.0) == 4.5
    # one bucket: no overlap at all
    assert overlapped_sync_s(6.0, 1, 2.0) == 6.0
    rng = random.Random(3)
    for _ in range(200):
        a, t, n = rng.uniform(0, 5), rng.uniform(0, 5), rng.randint(1, 30)
        c = overlapped_sync_s(a, n, t)
        assert a / n - 1e-12 <= c <= a + 1e-12
        # bucket by bucket: bucket k's gradients at e - t + k t/n, a/n each on the link, in order
        finish = -math.inf
        for k in range(1, n + 1):
            finish = max(finish, -t + k * t / n) + a / n
        assert c == pytest.approx(finish, abs=1e-9)


# -- (a) off: today's numbers -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
def test_off_is_todays_simulation(name):
    """overlap_grad_reduce=False and a costs object without the attribute time alike, row for row."""
    schedule = generate(name, 2, 2, 2)
    before, off = simulate(schedule, _tiny(6.0, None)), simulate(schedule, _tiny(6.0, False))
    assert off.iteration_time == before.iteration_time
    assert _rows(off) == _rows(before)


def test_off_is_the_all_reduce_after_the_last_backward():
    """pp 2 x dp 2, 1F1B, 2 micro-batches: stage 0's last BW ends at 9 s (F 1, BW 2), then all of
    its all-reduce, then the step."""
    for a in (1.0, 6.0):
        result = simulate(generate("1f1b", 2, 2, 2), _tiny(a, False))
        last_bw = max(e for _, op, _, e in result.ops if op.kind == BW and op.stage == 0)
        assert last_bw == 9.0
        assert result.iteration_time == 9.0 + a + 0.5
        stage0 = [(s, e) for sync, _, s, e in result.allreduces if sync.stage == 0]
        assert stage0 == [(9.0, 9.0 + a)] * len(stage0)


def test_gpt3_medium_default_is_unchanged(tmp_path):
    """The config default is off, and off times GPT-3 Medium dp 8 as without the setting."""
    assert compose(*GPT3_MEDIUM_DP8).train.overlap_grad_reduce is False
    default = run(tmp_path / "default", *GPT3_MEDIUM_DP8)
    off = run(tmp_path / "off", *GPT3_MEDIUM_DP8, "train.overlap_grad_reduce=false")
    assert default["status"] == off["status"] == "ok"
    assert default["iteration_time_s"] == off["iteration_time_s"]
    ctx = RunContext.from_config(compose(*GPT3_MEDIUM_DP8))
    plan = ctx.grid_plan(4, 8)
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    # today's rule: every sync starts at its last input's end and lasts its sync_time
    ends = {op: e for _, op, _, e in result.ops}
    costs = PlanCosts(ctx.cost_model, plan)
    for sync, members, s, e in result.allreduces:
        inputs = [op for op in ends if op.kind in (W, BW) and (op.pipeline, op.stage) in sync.holders]
        assert s == max(ends[op] for op in inputs)
        assert e == s + costs.sync_time(sync, members)
    assert result.iteration_time == default["iteration_time_s"]


# -- (b) on: hand-computed ----------------------------------------------------------------------

@pytest.mark.parametrize("a,expected_sync", [(1.0, 0.25), (6.0, 4.5)], ids=["compute-bound", "link-bound"])
def test_on_by_hand(a, expected_sync):
    """The same grid with 4 buckets per stage: stage 0's last BW (2 s) ends at 9 s; its
    all-reduce ends max(a/4, a - 2 x 3/4) after it (0.25 s for a = 1, 4.5 s for a = 6), drawn
    as `a` seconds ending there; the compute ops do not move."""
    schedule = generate("1f1b", 2, 2, 2)
    off, on = simulate(schedule, _tiny(a, False)), simulate(schedule, _tiny(a, True))
    assert on.iteration_time == 9.0 + expected_sync + 0.5
    assert [r for r in _rows(on)[0] if r[1].kind != "OPT"] == [r for r in _rows(off)[0] if r[1].kind != "OPT"]
    for sync, _, s, e in on.allreduces:
        last = 9.0 if sync.stage == 0 else 7.0  # stage 1's last BW ends at 7 s
        assert e == last + overlapped_sync_s(a, 4, 2.0) and s == e - a
    # one bucket: no overlap
    assert simulate(schedule, _tiny(a, True, buckets=1)).iteration_time == off.iteration_time


def test_sync_rows_follow_the_formula_on_gpt3_medium():
    """Every fragment's all-reduce ends at max over its inputs of end + overlapped_sync_s(a, units, t)."""
    ctx = RunContext.from_config(compose(*GPT3_MEDIUM_DP8, "train.overlap_grad_reduce=true"))
    plan = ctx.grid_plan(4, 8)
    costs = PlanCosts(ctx.cost_model, plan)
    assert costs.overlap_grad_reduce
    result = simulate(plan.schedule, costs)
    rows = {op: (s, e) for _, op, s, e in result.ops}
    for sync, members, s, e in result.allreduces:
        a = costs.sync_time(sync, members)
        n = sync.units[1] - sync.units[0]
        inputs = [op for op in rows if op.kind in (W, BW) and (op.pipeline, op.stage) in sync.holders]
        assert e == max(rows[op][1] + overlapped_sync_s(a, n, costs.op_time(op)) for op in inputs)
        assert s == e - a


# -- (c) never slower; faster on GPT-3 Medium ---------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("staggered", [False, True])
def test_overlap_is_never_slower(name, staggered):
    rng = random.Random(7)
    for _ in range(15):
        pp, dp, m = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)
        costs = dict(forward=rng.uniform(0.2, 2), backward_input=rng.uniform(0.2, 2),
                     backward_weight=rng.uniform(0.2, 2), optimizer=rng.uniform(0, 1),
                     allreduce=rng.uniform(0, 8), transfer=rng.uniform(0, 0.5))
        schedule = generate(name, pp, m, dp)
        buckets = rng.randint(1, 12)
        off = simulate(schedule, Tiny(**costs, overlap=False, buckets=buckets), staggered=staggered)
        on = simulate(schedule, Tiny(**costs, overlap=True, buckets=buckets), staggered=staggered)
        assert on.iteration_time <= off.iteration_time + 1e-9
        if buckets == 1:
            assert on.iteration_time == pytest.approx(off.iteration_time, rel=1e-12)


def test_gpt3_medium_dp8_is_faster_with_overlap(tmp_path):
    off = run(tmp_path / "off", *GPT3_MEDIUM_DP8)
    on = run(tmp_path / "on", *GPT3_MEDIUM_DP8, "train.overlap_grad_reduce=true")
    assert off["status"] == on["status"] == "ok"
    assert on["iteration_time_s"] < off["iteration_time_s"]


def test_cost_model_key_tells_the_two_apart():
    off = RunContext.from_config(compose(*GPT3_MEDIUM_DP8)).cost_model
    on = RunContext.from_config(compose(*GPT3_MEDIUM_DP8, "train.overlap_grad_reduce=true")).cost_model
    assert off.key() != on.key() and on.overlap_grad_reduce and not off.overlap_grad_reduce


def test_retimed_with_overlap_equals_a_fresh_simulation():
    """Simulation.iteration_time(sync_time) applies the same formula with a = sync_time(...)."""
    ctx = RunContext.from_config(compose(*GPT3_MEDIUM_DP8, "train.overlap_grad_reduce=true"))
    sched = generate("zb-h1", 4, 6, 8)
    from ftbench.plan import grid_plan
    plan = grid_plan(sched, ctx.cost_model.balanced_partition(4), 4, 4)

    class Slow(PlanCosts):
        def sync_time(self, sync, workers):
            return 0.037 * sync.stage + 0.001

    simulation = Simulation(plan.schedule, PlanCosts(ctx.cost_model, plan))
    assert simulation.iteration_time() == simulation.result().iteration_time
    slow = Slow(ctx.cost_model, plan)
    assert simulation.iteration_time(slow.sync_time) == simulate(plan.schedule, slow).iteration_time


@pytest.mark.parametrize("gpus_per_node,global_batch", [(8, 2048), (4, 1000)])
def test_varuna_candidate_times_equal_the_whole_grid_with_overlap(gpus_per_node, global_batch):
    from ftbench.strategies.varuna import Varuna

    cfg = compose("model=gpt3-medium", "strategy=varuna", "backend=sim", "hardware=a100-80gb",
                  f"cluster.gpus_per_node={gpus_per_node}", "cluster.pp=4", "cluster.dp=4",
                  f"train.global_batch={global_batch}", "train.overlap_grad_reduce=true")
    ctx = RunContext.from_config(cfg)
    varuna = Varuna(cfg.strategy, ctx)
    varuna.configured_pp = 4
    for pp, dp in ((1, 7), (2, 13), (4, 9), (6, 5), (12, 2)):
        plan = ctx.grid_plan(pp, dp, gpus_per_node)
        result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
        fits = max(result.peak_memory_bytes.values()) <= ctx.cost_model.memory_bytes
        assert varuna._iteration_time(pp, dp, gpus_per_node) == (result.iteration_time if fits else math.inf)


# -- (d) planners agree with the simulator --------------------------------------------------------

def _recycle_problem(overlap: bool, decoupled: bool, failed=((0, 1),), dp=4) -> PlanningProblem:
    overrides = ["train.overlap_grad_reduce=true"] if overlap else []
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "failures=none",
                                         f"cluster.dp={dp}", *overrides))
    return problem_for(ctx, 4, dp, 1, failed=frozenset(failed), decoupled=decoupled)


def test_default_plan_keys_are_unchanged_and_overlap_keys_differ():
    off = _recycle_problem(False, True)
    on = _recycle_problem(True, True)
    assert not off.overlap_grad_reduce and on.overlap_grad_reduce
    # the units are filled either way (the balanced partition's blocks, plus the embeddings on
    # the first stage and the head on the last: 7, 7, 7 and 3 blocks of GPT-3 Medium's 24), but
    # enter the key only with overlap
    assert [t.units for t in off.stages] == [8, 7, 7, 4]
    assert off.key() == dataclasses.replace(off, stages=tuple(dataclasses.replace(t, units=1)
                                                              for t in off.stages)).key()
    assert on.key() != off.key()


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("failed", [(), ((0, 1),), ((0, 1), (1, 2))])
def test_heuristic_times_its_plan_as_the_simulator_with_overlap(decoupled, failed):
    problem = _recycle_problem(True, decoupled, failed)
    orders, planned = list_schedule_timed(problem)
    sim = evaluate(problem, orders)
    assert planned == pytest.approx(sim.iteration_time, rel=1e-12)
    plain = _recycle_problem(False, decoupled, failed)
    assert planned < list_schedule_timed(plain)[1]  # GPT-3 Medium's all-reduces are link-bound: overlap helps


# Binary fractions. Stage 0's all-reduce is compute-bound against its W and BW (1 s < 1.5 s),
# stage 1's link-bound against both (4 s > 3.25 s), stage 2's compute-bound against W, stage
# 3's link-bound.
TIMES = (StageTimes(1.0, 2.0, 1.5, 0.5, 1.0, units=4), StageTimes(1.5, 2.5, 0.75, 0.25, 4.0, units=2),
         StageTimes(1.0, 2.0, 1.0, 0.5, 0.75, units=4), StageTimes(1.25, 2.0, 1.25, 0.5, 5.0, units=8))


def _tiny_problem(pp, dp, m, decoupled, failed=(), overlap=True) -> PlanningProblem:
    return PlanningProblem(pp, dp, m, TIMES[:pp], failed=frozenset(failed), decoupled=decoupled,
                           intra_node_s=0.25, inter_node_s=0.5, gpus_per_node=2, overlap_grad_reduce=overlap)


@pytest.mark.parametrize("decoupled", [True, False])
def test_heuristic_agrees_in_both_regimes(decoupled):
    for failed in ((), ((0, 1),), ((1, 3),)):
        problem = _tiny_problem(4, 3, 4, decoupled, failed)
        orders, planned = list_schedule_timed(problem)
        assert planned == evaluate(problem, orders).iteration_time
        # and each stage's sync ends sync_s after its last weight gradient
        sim = evaluate(problem, orders)
        for sync, _, _, e in sim.allreduces:
            last = max(end for _, op, _, end in sim.ops if op.kind in (W, BW) and op.stage == sync.stage)
            assert e == last + problem.sync_s(sync.stage)


@pytest.mark.parametrize("pp,dp,m,decoupled,failed", [  # small enough to try every order
    (2, 2, 2, True, ()),
    (2, 2, 2, False, ((0, 1),)),
    (3, 2, 1, True, ((0, 1),)),
    (3, 2, 2, False, ((0, 1),)),
], ids=str)
def test_milp_makespan_is_the_simulated_time_of_its_orders(pp, dp, m, decoupled, failed):
    problem = _tiny_problem(pp, dp, m, decoupled, failed)
    result = milp.solve(problem, time_limit_s=20)
    sim = evaluate(problem, result.orders)
    assert result.makespan == sim.iteration_time
    assert result.makespan <= result.objective * (1 + 1e-6)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(result.makespan, rel=1e-6)
    assert result.bound == pytest.approx(result.objective, rel=1e-9)
    # and it is the optimum: no combination of worker orders simulates faster
    assert result.makespan == pytest.approx(brute_force(problem), rel=1e-9)
    # overlap never makes the optimum slower
    plain = milp.solve(_tiny_problem(pp, dp, m, decoupled, failed, overlap=False), time_limit_s=20)
    assert result.makespan <= plain.makespan + 1e-9


# -- the ablation with --overlap -------------------------------------------------------------------

def test_ablation_with_overlap_keeps_the_levels_order_and_speeds_up_1f1b():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "recycle_ablation.py"
    spec = importlib.util.spec_from_file_location("recycle_ablation", path)
    ablation = importlib.util.module_from_spec(spec)
    ablation = sys.modules.setdefault("recycle_ablation", ablation)  # dataclasses look their module up there
    if not hasattr(ablation, "table_setups"):
        spec.loader.exec_module(ablation)
    failed = [(0, 1)]
    plain = next(s for s in ablation.table_setups() if s.model == "gpt3-medium")
    setup = dataclasses.replace(plain, overlap=True)
    assert ablation.config(setup, 4).train.overlap_grad_reduce is True
    on = ablation.measure(setup, 4, [failed])
    off = ablation.measure(plain, 4, [failed])
    times = [on.failed(level, failed).time for level in ("reroute", "decoupled", "staggered")]
    assert times[0] >= times[1] * (1 - 1e-12) and times[1] >= times[2] * (1 - 1e-12)
    assert min(times) >= on.reference.time * (1 - 1e-12)  # a failure never makes an iteration faster
    # the fused-BW reference hides more of its all-reduce than the W-ending re-routed plans
    assert on.reference.time < off.reference.time
    for level in ("reroute", "decoupled", "staggered"):
        assert on.failed(level, failed).time <= off.failed(level, failed).time * (1 + 1e-12)
    limit = ablation.staggering_limit(on.failed("staggered", failed).result, 4)
    assert limit.span == pytest.approx(times[2], rel=1e-6)
    assert limit.allreduce_input is not None
