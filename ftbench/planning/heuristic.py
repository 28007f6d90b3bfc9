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
from typing import NamedTuple

from ftbench.planning.parts import copy_orders, split
from ftbench.planning.problem import PlanningError, PlanningProblem, Position
from ftbench.schedule import B, BW, F, W, Op

# Lower runs first. "backward-first" is 1F1B's rule; "forward-first" fills the pipeline
# before any backward, when the stash cap allows (GPipe-like warm-up, then 1F1B).
BACKWARD_FIRST = {B: 0, BW: 0, F: 1, W: 2}
FORWARD_FIRST = {F: 0, B: 1, BW: 1, W: 2}


class Rule(NamedTuple):
    priority: dict[str, int]  # among ops that can start alike, by kind
    # Bubbles only: with an original schedule (releases), work not of the worker's own chain
    # runs only where it ends before the own chain's next op could start, or while that op's
    # start is unknown (its inputs are still on the way and its release has passed).
    fit: bool = False
    # One pipeline at a time: a worker starts a forward of a pipeline only when every pipeline
    # of lower id it runs has finished its forwards and backwards. Every worker takes them in
    # the same order, so no two wait on each other, and each holds at most one pipeline's
    # stash beside nothing else: the plan of last resort when the stash caps stall the others
    # (a lone survivor of a stage taking three failed pipelines' flows, each neighbour in its
    # fault-free warm-up).
    serial: bool = False


RULES = {"bubbles": Rule(BACKWARD_FIRST, fit=True),
         "backward-first": Rule(BACKWARD_FIRST),
         "forward-first": Rule(FORWARD_FIRST)}
SERIAL = Rule(BACKWARD_FIRST, serial=True)  # tried only when every rule above stalls


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
    best, best_time, stalled = None, float("inf"), None
    for rule in rules:
        if RULES[rule].fit and problem.released is None:
            continue  # no original schedule: the same as backward-first
        try:
            shaped, time = _schedule_shapes(problem, RULES[rule])
        except PlanningError as error:  # this rule found no order within the caps; another may
            stalled = error
            continue
        if time < best_time - 1e-12:
            best, best_time = shaped, time
    if best is None and stalled is not None:
        best, best_time = _schedule_shapes(problem, SERIAL)  # raises when even that stalls
    return best, best_time


def schedule_once(problem: PlanningProblem, rule: Rule) -> tuple[dict[Position, list[Op]], float]:
    """One list-scheduling pass: (orders, iteration time under the simulator's rules)."""
    shaped, time = _schedule_shapes(problem, rule)
    return copy_shaped(shaped), time


def _schedule_shapes(problem: PlanningProblem, rule: Rule):
    """Each shape of independent part (ftbench.planning.parts) scheduled once: ([(shape,
    its orders, its parts)], the iteration time of the whole problem)."""
    shortfall = problem.memory_shortfall()
    if shortfall is not None:
        raise PlanningError(f"no re-routed schedule fits in memory: {shortfall}")
    shaped = []
    last_grad: dict[int, float] = defaultdict(float)
    latest: dict[int, float] = defaultdict(float)  # per stage, its workers' last op end
    for shape, parts in split(problem):
        shape_orders, shape_grad, shape_free = _schedule_shape(problem, shape, rule)
        for s, t in shape_grad.items():
            last_grad[s] = max(last_grad[s], t)
        for (_, s), t in shape_free.items():  # every part of the shape ends alike
            latest[s] = max(latest[s], t)
        shaped.append((shape, shape_orders, parts))
    return shaped, _iteration_time(problem, last_grad, latest)


def _schedule_shape(problem: PlanningProblem, shape, rule: Rule):
    """_schedule_part of a shape, remembered across problems of one grid: a shape's key holds
    its flows, transfer times and caps, and with the grid's op times that decides its schedule
    (after each failure of a large grid most parts keep shapes already planned)."""
    released = None if problem.released is None else problem.released.key()
    key = (problem.stages, problem.decoupled, problem.pp, tuple(sorted(rule.priority.items())), rule.fit,
           rule.serial, released, shape.part.key)
    found = _SHAPE_PLANS.get(key)
    if found is None:
        found = _schedule_part(shape, rule)
        _SHAPE_PLANS[key] = found
        global _shape_ops_kept
        _shape_ops_kept += _ops_in(found)
        while (len(_SHAPE_PLANS) > SHAPE_PLANS_KEPT or _shape_ops_kept > SHAPE_OPS_KEPT) and len(_SHAPE_PLANS) > 1:
            _shape_ops_kept -= _ops_in(_SHAPE_PLANS.pop(next(iter(_SHAPE_PLANS))))  # the oldest
    return found


def _ops_in(found) -> int:
    return sum(map(len, found[0].values()))


# Shapes remembered: at most this many, holding at most this many ops in all (with one GPU
# per node a part of a large grid spans dozens of pipelines, a hundred thousand ops).
SHAPE_PLANS_KEPT = 512
SHAPE_OPS_KEPT = 2_000_000
_SHAPE_PLANS: dict[tuple, tuple] = {}
_shape_ops_kept = 0


def copy_shaped(shaped) -> dict[Position, list[Op]]:
    """Every worker's order from per-shape orders."""
    orders: dict[Position, list[Op]] = {}
    for shape, shape_orders, parts in shaped:
        for part in parts:
            orders.update(copy_orders(shape, shape_orders, part))
    return orders


def _schedule_part(problem, rule: Rule):
    """List-schedule one part: (orders, latest weight gradient per stage, when each worker is free).

    Ops are numbered and their inputs, durations and transfer times looked up once, so the
    event loop touches only lists (a part of a large grid with one GPU per node has a hundred
    thousand ops). With an original schedule (problem.released) a worker's own F and B/BW are
    one chain in their fault-free order, none ready before its release."""
    workers = problem.workers
    index = {pos: i for i, pos in enumerate(workers)}
    ops: list[Op] = []
    runner: list[int] = []
    chains: list[list[deque]] = []  # per worker: (kind, owner pipeline) chains in micro-batch order
    own: list[deque | None] = []  # per worker: its own chain (also in `chains`), or None
    own_peak = [0] * len(workers)  # most own micro-batches its fault-free order holds stashed
    for w, pos in enumerate(workers):
        heads = defaultdict(deque)
        mine = problem.own_chain(pos)
        members = set(mine or ())
        held = 0
        for op in mine or ():
            held += 1 if op.kind == F else -1
            own_peak[w] = max(own_peak[w], held)
        if mine:
            heads["own"] = deque()
            for op in mine:
                heads["own"].append(len(ops))
                ops.append(op)
                runner.append(w)
        for op in sorted(problem.ops_of(pos), key=lambda o: o.microbatch):
            if op in members:
                continue
            heads[(op.kind, op.pipeline)].append(len(ops))
            ops.append(op)
            runner.append(w)
        chains.append(list(heads.values()))
        own.append(heads["own"] if mine else None)
    number = {op: i for i, op in enumerate(ops)}
    durations = {}
    duration = [durations.get(op[:2]) or durations.setdefault(op[:2], problem.duration(op)) for op in ops]
    kind_of = [op.kind for op in ops]
    priority = rule.priority
    rank = [priority[k] for k in kind_of]
    release = [problem.release_of(workers[runner[i]], op) for i, op in enumerate(ops)]
    inputs: list[list[tuple[int, float]]] = []  # per op, (input op, transfer time to this op's worker)
    dependents: list[list[int]] = [[] for _ in ops]
    transfer: dict[tuple[int, int], float] = {}
    for i, op in enumerate(ops):
        here, mine = runner[i], []
        for dep in problem.dependencies(op):
            j = number[dep]
            there = runner[j]
            t = transfer.get((there, here))
            if t is None:
                t = transfer[(there, here)] = problem.transfer_s(workers[there], workers[here])
            mine.append((j, t))
            dependents[j].append(i)
        inputs.append(mine)
    waiting = [len(x) for x in inputs]
    ready_at: list[float | None] = [(release[i] or 0.0) if n == 0 else None for i, n in enumerate(waiting)]
    end = [0.0] * len(ops)
    n = len(workers)
    free = [0.0] * n
    stash = [0] * n  # between F and B/BW
    deferred = [0] * n  # between B and W
    cap = [problem.stash_cap(pos) for pos in workers]
    defer = [problem.defer_cap(pos) for pos in workers]
    for w, pos in enumerate(workers):
        if own[w] is not None and own_peak[w] > cap[w]:
            raise PlanningError(f"worker {pos} cannot keep its fault-free order: it stashes {own_peak[w]} "
                                f"micro-batches there, and its memory holds {cap[w]} with its re-routed load")

    serial = rule.serial
    left: list[dict[int, int]] = [defaultdict(int) for _ in workers]  # per worker: pipeline -> its F, B, BW to run
    for i, op in enumerate(ops):
        if kind_of[i] != W:
            left[runner[i]][op.pipeline] += 1

    def turn(w) -> int:
        """The pipeline whose forwards the worker may start (serial rule): its lowest with work left."""
        return min(p for p, count in left[w].items() if count)

    def own_ahead(w) -> int:
        """Forwards at the head of the worker's own chain, before its next backward: the stash
        it needs to reach that backward (another pipeline's forward must leave room for them,
        else the own chain could wait on a full stash that only it would free)."""
        count = 0
        for i in own[w]:
            if kind_of[i] != F:
                break
            count += 1
        return count

    orders: list[list[Op]] = [[] for _ in workers]
    version = [0] * n
    heap = []
    fit = rule.fit

    def push(w):
        """Enter the op this worker would run next (start, rank, arrival, micro-batch, pipeline)."""
        version[w] += 1
        best, chosen = None, None
        at, full, held = free[w], stash[w] >= cap[w], deferred[w] >= defer[w]
        bound = None  # bubbles only: other work must end by then
        mine = own[w]
        if fit and mine:
            i = mine[0]
            blocked = (full and kind_of[i] == F) or (held and kind_of[i] == B)
            if ready_at[i] is not None and not blocked:
                bound = at if at > ready_at[i] else ready_at[i]
            elif not blocked and release[i] is not None and release[i] > at:
                bound = release[i]  # on its way: at least its release leaves room
        for chain in chains[w]:
            if not chain:
                continue
            i = chain[0]
            ready = ready_at[i]
            if ready is None:
                continue
            kind = kind_of[i]
            if (full and kind == F) or (held and kind == B):
                continue
            if serial:
                if kind == F and ops[i].pipeline != turn(w):
                    continue
            elif kind == F and chain is not mine and mine is not None and stash[w] + 1 + own_ahead(w) > cap[w]:
                continue  # the own chain's next forwards need that room
            start = at if at > ready else ready
            if bound is not None and chain is not mine and start + duration[i] > bound + 1e-12:
                continue  # does not fit in the bubble before the own chain's next op
            op = ops[i]
            key = (start, rank[i], ready, op.microbatch, op.pipeline)
            if best is None or key < best:
                best, chosen = key, chain
        if best is not None:
            heapq.heappush(heap, (best, version[w], workers[w], w, chosen))

    for w in range(n):
        push(w)
    scheduled = 0
    while heap:
        key, v, _, w, chain = heapq.heappop(heap)
        if v != version[w]:
            continue  # stale: the worker's situation changed since this entry
        i = chain.popleft()
        done = end[i] = key[0] + duration[i]
        free[w] = done
        orders[w].append(ops[i])
        scheduled += 1
        kind = kind_of[i]
        if kind != W:
            left[w][ops[i].pipeline] -= 1
        if kind == F:
            stash[w] += 1
        elif kind == W:
            deferred[w] -= 1
        else:  # B or BW
            stash[w] -= 1
            deferred[w] += kind == B
        touched = {workers[w]}  # pushed in the order of a set of positions, as always (same versions)
        for child in dependents[i]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready_at[child] = max([end[j] + t for j, t in inputs[child]] + [release[child] or 0.0])
                touched.add(workers[runner[child]])
        for pos in touched:
            push(index[pos])
    if scheduled < len(ops):
        stuck = [pos for pos, heads in zip(workers, chains) if any(heads)]
        raise PlanningError(f"list scheduling stalled with {len(ops) - scheduled} ops left (workers {stuck[:4]}): "
                            "the stash caps leave no runnable op")
    last_grad = defaultdict(float)
    for i, op in enumerate(ops):
        if op.kind in (W, BW):
            last_grad[op.stage] = max(last_grad[op.stage], end[i])
    return dict(zip(workers, orders)), last_grad, dict(zip(workers, free))


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
        time = max(time, max(latest[s], sync, problem.step_release(s)) + problem.stages[s].optimizer_s)
    return time
