"""The fast planner: list scheduling of a re-routed iteration (ReCycle's heuristic).

Every surviving worker runs, whenever it is free, the most urgent op whose inputs have
arrived: a backward (B or fused BW) first, since it releases stashed activations and
unblocks the stage before; then a forward, if the worker's stash is under its cap; then a
deferred weight-gradient pass W, which therefore lands in the bubbles. Among ops of one
class the one whose inputs arrived first goes first. Ops of the same kind and owner
pipeline keep micro-batch order on a worker (the MILP uses the same restriction).

Time is advanced event by event with a heap of each worker's next possible start, so a
plan for pp=8 x dp=16 x 32 micro-batches takes well under a second. Two priority rules are
tried (backward-first and forward-first for the warm-up) and the faster plan is kept.
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque

from ftbench.planning.problem import PlanningError, PlanningProblem, Position
from ftbench.schedule import B, BW, F, W, Op

# Lower runs first. "backward-first" is 1F1B's rule; "forward-first" fills the pipeline
# before any backward, when the stash cap allows (GPipe-like warm-up, then 1F1B).
RULES = {"backward-first": {B: 0, BW: 0, F: 1, W: 2},
         "forward-first": {F: 0, B: 1, BW: 1, W: 2}}


def list_schedule(problem: PlanningProblem, rules=tuple(RULES)) -> dict[Position, list[Op]]:
    """Per surviving worker, its F/B/W ops in order: the best of the priority `rules`."""
    best, best_time = None, float("inf")
    for rule in rules:
        orders, time = schedule_once(problem, RULES[rule])
        if time < best_time - 1e-12:
            best, best_time = orders, time
    return best


def schedule_once(problem: PlanningProblem, priority: dict[str, int]) -> tuple[dict[Position, list[Op]], float]:
    """One list-scheduling pass: (orders, iteration time under the simulator's rules)."""
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
    stash = {pos: 0 for pos in problem.workers}
    cap = {pos: problem.stash_cap(pos) for pos in problem.workers}
    orders: dict[Position, list[Op]] = {pos: [] for pos in problem.workers}
    version = {pos: 0 for pos in problem.workers}

    def choose(pos):
        """(start, rank, op) of the op this worker would run next, or None."""
        best = None
        for chain in chains[pos].values():
            if not chain:
                continue
            op = chain[0]
            if op not in ready_at or (op.kind == F and stash[pos] >= cap[pos]):
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
    return orders, _iteration_time(problem, end, free)


def _iteration_time(problem: PlanningProblem, end: dict[Op, float], free: dict[Position, float]) -> float:
    """Each stage's all-reduce starts after its last weight gradient anywhere; a worker steps
    after that and its own last op (ftbench.sim.simulator's rules, without simulating again)."""
    last_grad = defaultdict(float)
    for op, t in end.items():
        if op.kind in (W, BW):
            last_grad[op.stage] = max(last_grad[op.stage], t)
    time = 0.0
    for pos in problem.workers:
        s = pos[1]
        sync = last_grad[s] + (problem.stages[s].allreduce_s if len(problem.survivors(s)) > 1 else 0.0)
        time = max(time, max(free[pos], sync) + problem.stages[s].optimizer_s)
    return time
