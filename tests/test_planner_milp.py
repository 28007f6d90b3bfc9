"""The MILP planner (ftbench.planning.milp): optimal against exhaustive search on tiny grids,
valid and no worse than a generator-built warm start on larger ones, and 1F1B's makespan
where 1F1B is known to be optimal."""
from __future__ import annotations

import itertools

import pytest

from ftbench.cli import compose
from ftbench.context import RunContext
from ftbench.planning import milp
from ftbench.planning.heuristic import RULES, schedule_once
from ftbench.planning.milp import solve
from ftbench.planning.problem import PlanningProblem, StageTimes, evaluate
from ftbench.schedule import B, BW, F, OPT, W, ScheduleError, grid_worker, one_f_one_b, validate, zb_h1

# Binary fractions, so equal makespans compare equal; stages differ and boundary sends cost
# something (two GPUs per node: some sends are intra-node, some inter-node).
TIMES = (StageTimes(1.0, 2.0, 1.5, 0.5, 1.25), StageTimes(1.5, 2.5, 0.75, 0.25, 1.0),
         StageTimes(1.0, 2.0, 1.0, 0.5, 1.0), StageTimes(1.25, 2.0, 1.25, 0.5, 1.0))
RANK = {F: 0, B: 1, BW: 1, W: 2}


def problem(pp, dp, m, decoupled, failed=()) -> PlanningProblem:
    return PlanningProblem(pp, dp, m, TIMES[:pp], failed=frozenset(failed), decoupled=decoupled,
                           intra_node_s=0.25, inter_node_s=0.5, gpus_per_node=2)


def worker_orders(p: PlanningProblem, pos) -> list[list]:
    """Every order of a worker's ops that the planners consider: each (kind, pipeline) in
    micro-batch order, a micro-batch's F before its B before its W, the stash and deferral caps kept."""
    cap, defer = p.stash_cap(pos), p.defer_cap(pos)

    def must_wait(op, others):
        return any(o.pipeline == op.pipeline and (
            (o.kind == op.kind and o.microbatch < op.microbatch)
            or (o.microbatch == op.microbatch and RANK[o.kind] < RANK[op.kind])) for o in others)

    out = []

    def extend(order, left, stash, deferred):
        if not left:
            out.append(list(order))
        for op in left:
            if must_wait(op, left) or (op.kind == F and stash >= cap) or (op.kind == B and deferred >= defer):
                continue
            order.append(op)
            extend(order, [o for o in left if o != op], stash + {F: 1, B: -1, BW: -1}.get(op.kind, 0),
                   deferred + {B: 1, W: -1}.get(op.kind, 0))
            order.pop()

    extend([], p.ops_of(pos), 0, 0)
    return out


def brute_force(p: PlanningProblem) -> float:
    """The least simulated iteration time over all combinations of worker orders."""
    per_worker = {pos: worker_orders(p, pos) for pos in p.workers}
    best = float("inf")
    for combo in itertools.product(*per_worker.values()):
        try:
            best = min(best, evaluate(p, dict(zip(per_worker, combo))).iteration_time)
        except ScheduleError:  # the orders wait on each other
            continue
    return best


def generator_orders(p: PlanningProblem) -> dict:
    """A valid, slow warm start: each survivor runs its own pipeline's ZB-H1 (or 1F1B) order,
    then the micro-batches re-routed to it in the failed worker's order."""
    schedule = (zb_h1 if p.decoupled else one_f_one_b)(p.pp, p.microbatches, p.dp)
    orders = {}
    for d, s in p.workers:
        mine = set(p.ops_of((d, s)))
        own = [op for op in schedule.ops[grid_worker(d, s, p.pp)] if op in mine]
        rerouted = [op for e in range(p.dp) if (e, s) in p.failed
                    for op in schedule.ops[grid_worker(e, s, p.pp)] if op in mine]
        orders[(d, s)] = own + rerouted
    return orders


def check_result(p: PlanningProblem, result: milp.MilpResult) -> None:
    """Orders that run every op once, keep the caps, and time out as reported, under the objective."""
    validate(p.to_schedule(result.orders, "milp"))
    assert set(result.orders) == set(p.workers)
    for pos, order in result.orders.items():
        assert sorted(order) == sorted(p.ops_of(pos))
    sim = evaluate(p, result.orders)
    assert sim.iteration_time == result.makespan
    for pos in p.workers:
        assert sim.peak_stash[grid_worker(*pos, p.pp)] <= p.stash_cap(pos)
    assert result.makespan <= result.objective * (1 + 1e-6)  # CBC's feasibility tolerance
    assert result.bound <= result.objective * (1 + 1e-9)
    assert result.status in ("optimal", "feasible")


TINY = [  # (pp, dp, m, decoupled, failed): a few thousand combinations of orders at most
    (2, 1, 3, True, ()),
    (3, 1, 2, True, ()),
    (2, 2, 2, True, ()),
    (2, 2, 3, False, ()),
    (2, 2, 2, False, {(0, 1)}),
    (2, 2, 2, False, {(0, 0)}),
    (2, 2, 1, True, {(0, 1)}),
    (3, 2, 1, True, {(0, 1)}),
    (3, 2, 2, False, {(0, 1)}),
    (2, 3, 2, False, {(0, 1)}),
]


@pytest.mark.parametrize("case", TINY, ids=str)
def test_matches_brute_force(case):
    p = problem(*case)
    result = milp.solve(p, time_limit_s=20)
    check_result(p, result)
    assert result.status == "optimal"
    assert result.makespan == pytest.approx(brute_force(p), rel=1e-9)
    assert result.objective == pytest.approx(result.makespan, rel=1e-6)
    assert result.bound == pytest.approx(result.objective, rel=1e-9)


def test_brute_force_cases_need_the_solver():
    """Some tiny cases start from list schedules that are not optimal, so the brute-force test
    checks the MILP's search, not only its starting point."""
    def start(p):
        return min(schedule_once(p, rule)[1] for rule in RULES.values())

    beaten = [case for case in TINY if start(problem(*case)) > brute_force(problem(*case))]
    assert len(beaten) >= 3


@pytest.mark.parametrize("pp", [3, 4])
def test_reroutes_validly_and_beats_the_warm_start(pp):
    p = problem(pp, 2, 4, True, {(0, 1)})
    warm = generator_orders(p)
    validate(p.to_schedule(warm, "warm"))
    warm_time = evaluate(p, warm).iteration_time
    result = milp.solve(p, warm_start=warm, time_limit_s=20)
    check_result(p, result)
    assert result.makespan < warm_time  # the warm start serialises the re-routed micro-batches
    assert result.status == "optimal"  # in about a second


def test_keeps_an_optimal_warm_start():
    p = problem(3, 2, 2, False, {(0, 1)})
    first = milp.solve(p, time_limit_s=20)
    again = milp.solve(p, warm_start=first.orders, time_limit_s=20)
    check_result(p, again)
    assert again.makespan <= first.makespan
    assert again.status == "optimal"


def test_reproduces_1f1b_on_uniform_stages():
    pp, dp, m = 4, 2, 6
    f, bw, opt, allreduce = 1.0, 2.0, 0.5, 1.5
    stages = tuple(StageTimes(f, 1.25, bw - 1.25, opt, allreduce) for _ in range(pp))
    p = PlanningProblem(pp, dp, m, stages, decoupled=False)
    expected = (m + pp - 1) * (f + bw) + allreduce + opt
    reference = {pos: [op for op in one_f_one_b(pp, m, dp).ops[grid_worker(*pos, pp)] if op.kind != OPT]
                 for pos in p.workers}
    assert evaluate(p, reference).iteration_time == expected
    result = milp.solve(p, time_limit_s=20)
    check_result(p, result)
    assert result.status == "optimal"
    assert result.makespan == pytest.approx(expected, rel=1e-9)
    assert result.bound == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("failed", [set(), {(0, 1)}, {(0, 0), (1, 2)}, {(0, 1), (0, 2)}])
def test_milp_optimum_is_never_slower_than_the_heuristic(failed, decoupled):
    """Solved without the heuristic's warm start and proved optimal, the MILP's plan is at
    least as fast as the list-scheduling heuristic's on every small instance."""
    from ftbench.planning.heuristic import list_schedule
    from ftbench.planning.problem import problem_for

    ctx = RunContext.from_config(compose(["backend=sim", "model=gpt3-medium", "cluster.pp=3", "cluster.dp=2",
                                          "train.microbatches=3"]))
    problem = problem_for(ctx, 3, 2, 1, failed, decoupled=decoupled)
    heuristic = evaluate(problem, list_schedule(problem)).iteration_time
    result = solve(problem, time_limit_s=20)
    assert result.status == "optimal"
    assert result.makespan <= heuristic * (1 + 1e-9)


def test_cbc_runs_without_its_threaded_search():
    """CBC 2.10 asked for `-threads 1` runs its threaded branch and bound, whose main thread
    sometimes waits for a worker that never starts until the time limit (coin-or/Cbc#640):
    Oobleck's 3-variable batch split took the full 10 s in about 1 solve in 300. On `dist`
    that made one rank 10 s late into a recovery. Without the option CBC searches in one
    thread, as deterministically."""
    from ftbench.planning.milp import cbc_solver

    assert "threads" not in cbc_solver(10.0, None).optionsDict
