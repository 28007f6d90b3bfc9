"""The fast planner: list scheduling of a re-routed iteration (ReCycle's heuristic).

Every surviving worker runs, whenever it is free, the most urgent op whose inputs have
arrived: a backward (B or fused BW) first, since it releases stashed activations and
unblocks the stage before; then a forward, if the worker's stash is under its cap; then a
deferred weight-gradient pass W, which therefore lands in the bubbles (a B waits for a W
when the deferral cap is reached). Both caps come from the GPU's memory
(PlanningProblem.stash_cap and defer_cap), so no plan exceeds it. Among ops of one
class the one whose inputs arrived first goes first. Ops of the same kind and owner
pipeline keep micro-batch order on a worker (the MILP uses the same restriction).

Time is advanced event by event with a heap of each worker's next possible start. Workers
that exchange no micro-batch are scheduled apart, and each shape of such a part once
(ftbench.planning.parts): on a large grid most pipelines are alike, so planning grows with
the failures, not with dp. Two priority rules are
tried (backward-first and forward-first for the warm-up) and the faster plan is kept.
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque

from ftbench.planning.parts import copy_orders, split
from ftbench.planning.problem import PlanningError, PlanningProblem, Position
from ftbench.schedule import B, BW, F, W, Op

# Lower runs first. "backward-first" is 1F1B's rule; "forward-first" fills the pipeline
# before any backward, when the stash cap allows (GPipe-like warm-up, then 1F1B).
RULES = {"backward-first": {B: 0, BW: 0, F: 1, W: 2},
         "forward-first": {F: 0, B: 1, BW: 1, W: 2}}


def list_schedule(problem: PlanningProblem, rules=tuple(RULES)) -> dict[Position, list[Op]]:
    """Per surviving worker, its F/B/W ops in order: the best of the priority `rules`."""
    return list_schedule_timed(problem, rules)[0]


def list_schedule_timed(problem: PlanningProblem, rules=tuple(RULES)) -> tuple[dict[Position, list[Op]], float]:
    """(the best of the priority `rules`' orders, its iteration time under the simulator's rules)."""
    shaped, time = list_schedule_shaped(problem, rules)
    return copy_shaped(shaped), time


def list_schedule_shaped(problem: PlanningProblem, rules=tuple(RULES)) -> tuple[list, float]:
    """As list_schedule_timed, with the orders per shape: [(shape, its orders, its parts)]
    (ftbench.planning.parts; copy_shaped gives every worker's)."""
    best, best_time = None, float("inf")
    for rule in rules:
        shaped, time = _schedule_shapes(problem, RULES[rule])
        if time < best_time - 1e-12:
            best, best_time = shaped, time
    return best, best_time


def schedule_once(problem: PlanningProblem, priority: dict[str, int]) -> tuple[dict[Position, list[Op]], float]:
    """One list-scheduling pass: (orders, iteration time under the simulator's rules)."""
    shaped, time = _schedule_shapes(problem, priority)
    return copy_shaped(shaped), time


def _schedule_shapes(problem: PlanningProblem, priority: dict[str, int]):
    """Each shape of independent part (ftbench.planning.parts) scheduled once: ([(shape,
    its orders, its parts)], the iteration time of the whole problem)."""
    shortfall = problem.memory_shortfall()
    if shortfall is not None:
        raise PlanningError(f"no re-routed schedule fits in memory: {shortfall}")
    shaped = []
    last_grad: dict[int, float] = defaultdict(float)
    latest: dict[int, float] = defaultdict(float)  # per stage, its workers' last op end
    for shape, parts in split(problem):
        shape_orders, shape_grad, shape_free = _schedule_shape(problem, shape, priority)
        for s, t in shape_grad.items():
            last_grad[s] = max(last_grad[s], t)
        for (_, s), t in shape_free.items():  # every part of the shape ends alike
            latest[s] = max(latest[s], t)
        shaped.append((shape, shape_orders, parts))
    return shaped, _iteration_time(problem, last_grad, latest)


def _schedule_shape(problem: PlanningProblem, shape, priority: dict[str, int]):
    """_schedule_part of a shape, remembered across problems of one grid: a shape's key holds
    its flows, transfer times and caps, and with the grid's op times that decides its schedule
    (after each failure of a large grid most parts keep shapes already planned)."""
    key = (problem.stages, problem.decoupled, problem.pp, tuple(sorted(priority.items())), shape.part.key)
    found = _SHAPE_PLANS.get(key)
    if found is None:
        found = _schedule_part(shape, priority)
        if len(_SHAPE_PLANS) >= SHAPE_PLANS_KEPT:
            _SHAPE_PLANS.pop(next(iter(_SHAPE_PLANS)))  # the oldest
        _SHAPE_PLANS[key] = found
    return found


SHAPE_PLANS_KEPT = 512
_SHAPE_PLANS: dict[tuple, tuple] = {}


def copy_shaped(shaped) -> dict[Position, list[Op]]:
    """Every worker's order from per-shape orders."""
    orders: dict[Position, list[Op]] = {}
    for shape, shape_orders, parts in shaped:
        for part in parts:
            orders.update(copy_orders(shape, shape_orders, part))
    return orders


def _schedule_part(problem, priority: dict[str, int]):
    """List-schedule one part: (orders, latest weight gradient per stage, when each worker is free)."""
    runner = {}
    chains: dict[Position, dict[tuple, deque]] = {}
    for pos in problem.workers:
        heads = defaultdict(deque)
        for op in sorted(problem.ops_of(pos), key=lambda o: o.microbatch):
            heads[(op.kind, op.pipeline)].append(op)
            runner[op] = pos
        chains[pos] = heads
    deps = {op: problem.dependencies(op) for op in runner}
    dependents = defaultdict(list)
    waiting = {}
    for op, ds in deps.items():
        waiting[op] = len(ds)
        for d in ds:
            dependents[d].append(op)
    ready_at = {op: 0.0 for op, n in waiting.items() if n == 0}
    end: dict[Op, float] = {}
    free = {pos: 0.0 for pos in problem.workers}
    stash = {pos: 0 for pos in problem.workers}  # between F and B/BW
    deferred = {pos: 0 for pos in problem.workers}  # between B and W
    cap = {pos: problem.stash_cap(pos) for pos in problem.workers}
    defer = {pos: problem.defer_cap(pos) for pos in problem.workers}
    orders: dict[Position, list[Op]] = {pos: [] for pos in problem.workers}
    version = {pos: 0 for pos in problem.workers}

    def choose(pos):
        """(start, rank, op) of the op this worker would run next, or None."""
        best = None
        for chain in chains[pos].values():
            if not chain:
                continue
            op = chain[0]
            if op not in ready_at or (op.kind == F and stash[pos] >= cap[pos]) \
                    or (op.kind == B and deferred[pos] >= defer[pos]):
                continue
            start = max(free[pos], ready_at[op])
            key = (start, priority[op.kind], ready_at[op], op.microbatch, op.pipeline)
            if best is None or key < best[0]:
                best = (key, op)
        return best

    heap = []

    def push(pos):
        version[pos] += 1
        chosen = choose(pos)
        if chosen is not None:
            heapq.heappush(heap, (chosen[0], version[pos], pos, chosen[1]))

    for pos in problem.workers:
        push(pos)
    scheduled, total = 0, len(runner)
    while heap:
        key, v, pos, op = heapq.heappop(heap)
        if v != version[pos]:
            continue  # stale: the worker's situation changed since this entry
        start = key[0]
        chains[pos][(op.kind, op.pipeline)].popleft()
        end[op] = start + problem.duration(op)
        free[pos] = end[op]
        orders[pos].append(op)
        scheduled += 1
        if op.kind == F:
            stash[pos] += 1
        elif op.kind in (B, BW):
            stash[pos] -= 1
            deferred[pos] += op.kind == B
        else:
            deferred[pos] -= 1
        touched = {pos}
        for child in dependents[op]:
            waiting[child] -= 1
            if waiting[child] == 0:
                where = runner[child]
                ready_at[child] = max(end[d] + problem.transfer_s(runner[d], where) for d in deps[child])
                touched.add(where)
        for p in touched:
            push(p)
    if scheduled < total:
        stuck = [pos for pos in problem.workers if any(chains[pos].values())]
        raise PlanningError(f"list scheduling stalled with {total - scheduled} ops left (workers {stuck[:4]}): "
                            "the stash caps leave no runnable op")
    last_grad = defaultdict(float)
    for op, t in end.items():
        if op.kind in (W, BW):
            last_grad[op.stage] = max(last_grad[op.stage], t)
    return orders, last_grad, free


def _iteration_time(problem: PlanningProblem, last_grad: dict[int, float], latest: dict[int, float]) -> float:
    """Each stage's all-reduce ends problem.sync_s(s) after its last weight gradient anywhere
    (all of it without overlap; with train.overlap_grad_reduce what is left after that W/BW,
    the simulator's overlapped_sync_s: every W/BW of a stage lasts the same, so the latest
    binds); a worker steps after that and its own last op (ftbench.sim.simulator's rules,
    without simulating again). `latest`: per stage, the last end of any of its workers' ops
    (max(x, sync) + c is monotone in x, so the latest worker of a stage binds)."""
    time = 0.0
    for s in latest:
        sync = last_grad[s] + problem.sync_s(s)
        time = max(time, max(latest[s], sync) + problem.stages[s].optimizer_s)
    return time
