"""A planning problem cut into independent parts, each planned once per shape.

Within one iteration, surviving workers interact only through the micro-batches they pass on
(a micro-batch of pipeline d flows through one runner per stage) and through the gradient
all-reduce at the end. Workers linked by flows form a *part*; parts share only the all-reduce,
whose start is the latest weight gradient anywhere. Most parts of a large grid look alike: every
pipeline untouched by re-routing is one, and a peer that takes one re-routed micro-batch is
another. Relabelled (pipelines by how many of their micro-batches the part runs, then by id;
micro-batches in order within a pipeline), parts with the same ops, transfer times and caps are
one *shape*: the list scheduler plans each shape once and every part of it copies that order.

The relabelling keeps what the scheduler looks at (ready times, priorities, and the order of
(micro-batch, pipeline) among ties), so copying a shape's order is exactly what scheduling that
part on its own gives.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from operator import itemgetter

from ftbench.planning.problem import PlanningProblem, Position
from ftbench.plan import grid_replicas
from ftbench.schedule import B, BW, F, W, Op, identity
from ftbench.union_find import DisjointSets


@dataclass
class Part:
    workers: list[Position]  # real positions
    local: dict[Position, Position]  # real position -> position in the shape
    pipeline_of: list[int]  # local pipeline -> real pipeline
    microbatches: tuple[tuple[int, ...], ...]  # per local pipeline, local micro-batch j -> real micro-batch
    key: tuple  # the shape

    @property
    def microbatch_of(self) -> dict[tuple[int, int], int]:
        """(local pipeline, local micro-batch) -> real micro-batch."""
        return {(p, j): k for p, ks in enumerate(self.microbatches) for j, k in enumerate(ks)}


class PartProblem:
    """One shape as a planning problem with the interface the list scheduler uses: local
    positions and ops, the parent's durations, transfer times, caps and dependency rule."""

    def __init__(self, parent: PlanningProblem, part: Part, ops: dict[Position, list[Op]]):
        self.parent, self.part = parent, part
        self.workers = sorted(ops)
        self._ops = ops
        self._real = {v: k for k, v in part.local.items()}
        self.stages, self.pp, self.decoupled = parent.stages, parent.pp, parent.decoupled

    def ops_of(self, pos: Position) -> list[Op]:
        return self._ops[pos]

    def dependencies(self, op: Op) -> list[Op]:
        return self.parent.dependencies(op)  # a rule on (kind, stage, micro-batch, pipeline) only

    def duration(self, op: Op) -> float:
        return self.parent.duration(op)

    def transfer_s(self, src: Position, dst: Position) -> float:
        return self.parent.transfer_s(self._real[src], self._real[dst])

    def stash_cap(self, pos: Position) -> int:
        return self.parent.stash_cap(self._real[pos])

    # A worker's own pipeline is local pipeline pos[0], with its micro-batches unrenamed (a
    # surviving worker runs all of them: local j is real j), so releases read as they are.
    def release_of(self, pos: Position, op: Op):
        return self.parent.release_of(pos, op)

    def own_chain(self, pos: Position):
        return self.parent.own_chain(pos)

    def step_release(self, stage: int) -> float:
        return self.parent.step_release(stage)

    def defer_cap(self, pos: Position) -> int:
        return self.parent.defer_cap(self._real[pos])


def split(problem: PlanningProblem) -> list[tuple[PartProblem, list[Part]]]:
    """The problem's parts grouped by shape: (the shape as a problem, the parts of that shape).
    Computed once per problem."""
    cached = problem.__dict__.get("_parts")
    if cached is None:
        cached = problem.__dict__["_parts"] = _split(problem)
    return cached


def _split(problem: PlanningProblem) -> list[tuple[PartProblem, list[Part]]]:
    if _whole_pipelines(problem):
        return _split_pipelines(problem)
    pp, m, rerouted = problem.pp, problem.microbatches, problem.rerouted
    touched = sorted({d for d, _, _ in rerouted} | set(rerouted.values()))
    shapes: dict[tuple, tuple[PartProblem, list[Part]]] = {}
    # A pipeline that neither lost a worker nor takes a re-routed micro-batch is a part of its
    # own; such pipelines differ at most in which of their hops stay within a node.
    touched_set = set(touched)
    for d in range(problem.dp):
        if d not in touched_set:
            _add(shapes, problem, [(d, s) for s in range(pp)], {(d, k): [d] * pp for k in range(m)})
    # The others: workers linked by the flows they run, found with union-find.
    routes = {(d, k): [rerouted.get((d, s, k), d) for s in range(pp)] for d in touched for k in range(m)}
    sets = DisjointSets()
    for route in routes.values():
        sets.find((route[0], 0))  # a one-stage route is a set of its own
        for s in range(pp - 1):
            sets.union((route[s], s), (route[s + 1], s + 1))
    members, part_routes = defaultdict(list), defaultdict(dict)
    for pos, root in sets.items():
        members[root].append(pos)
    for flow, route in routes.items():
        part_routes[sets.find((route[0], 0))][flow] = route
    for root, workers in members.items():
        _add(shapes, problem, workers, part_routes[root])
    return list(shapes.values())


def _whole_pipelines(problem: PlanningProblem) -> bool:
    """Whether every failed position's pipeline lost all of its stages (a node per pipeline):
    then every re-routed micro-batch stays on one peer at every stage, and every part is one
    surviving pipeline with the foreign micro-batches it took."""
    # (failed positions are distinct and inside the grid: a pipeline lost all of its stages
    # when pp of them name it, counted in C)
    return all(count == problem.pp for count in Counter(map(itemgetter(0), problem.failed)).values())


def _split_pipelines(problem: PlanningProblem) -> list[tuple[PartProblem, list[Part]]]:
    """`_split` when whole pipelines failed, in O(pipelines + re-routed micro-batches): the
    same parts, keys and order as the general path, without tracing each flow's route (a
    large grid has a hundred thousand flows, and this runs at every failure)."""
    pp, m, dp = problem.pp, problem.microbatches, problem.dp
    routes = problem.stage_routes[0] if problem.failed else {}  # the same at every stage
    failed = sorted({d for d, _ in problem.failed})
    # The re-routed flows by failed pipeline, then micro-batch (how `_reroute` lists them).
    peers = list(routes.values())
    fs, ks = [f for f, _ in routes], [k for _, k in routes]
    taken_f, taken_k = defaultdict(list), defaultdict(list)  # peer -> its foreign flows' pipelines, micro-batches
    for peer, f, k in zip(peers, fs, ks):
        taken_f[peer].append(f)
        taken_k[peer].append(k)
    # Parts in the order the general path finds them: untouched pipelines, then by first touch
    # (a failed pipeline touches its peers in micro-batch order, a touched survivor itself).
    failed_set = set(failed)
    order = [d for d in range(dp) if d not in failed_set and d not in taken_f]
    touches, chunk = [], {d: i for i, d in enumerate(failed)}
    for d in sorted(failed_set | set(taken_f)):
        i = chunk.get(d)
        if i is None:
            touches.append(d)
        else:
            touches += peers[i * m:(i + 1) * m]
    order += dict.fromkeys(touches)
    hop_class, hop_times = pipeline_hops(problem)
    own = identity(m)  # one shared tuple: every pipeline's own micro-batches
    one = [(k,) for k in range(m)]  # a single re-routed micro-batch k
    at = [tuple((p, s) for s in range(pp)) for p in range(len(failed) + 1)]  # local positions of local pipeline p
    replicas = grid_replicas(pp, dp)  # grid worker -> ((pipeline, stage),), shared by every plan
    shapes: dict[tuple, tuple[PartProblem, list[Part]]] = {}
    # (local pipeline, flow counts, hop class, load) -> the shape's key and its entry in `shapes`
    # (a key is long: hashing it once per part would cost more than the rest)
    known: dict[tuple, tuple[tuple, list[Part]]] = {}
    for e in order:
        foreign = taken_f.get(e)
        if foreign is None:
            pipelines, p, counts, microbatches, load = [e], 0, (m,), (own,), m
        elif m > 1 and len(set(foreign)) == len(foreign):  # one micro-batch from each: own pipeline first
            pipelines, p, counts, load = [e, *foreign], 0, (m,) + (1,) * len(foreign), m + len(foreign)
            microbatches = (own, *map(one.__getitem__, taken_k[e]))
        else:
            mbs = defaultdict(list)  # foreign pipeline -> its micro-batches here, in order
            for f, k in zip(foreign, taken_k[e]):
                mbs[f].append(k)
            mbs[e] = own
            pipelines = sorted(mbs, key=lambda d: (-len(mbs[d]), d))
            p = pipelines.index(e)
            counts = tuple(len(mbs[d]) for d in pipelines)
            microbatches = tuple(tuple(mbs[d]) for d in pipelines)
            load = m + len(foreign)
        stand_in = (p, counts, hop_class[e], load)
        workers = list(map(itemgetter(0), replicas[e * pp:(e + 1) * pp]))  # each holds one replica: its own
        found = known.get(stand_in)
        if found is None:
            caps = tuple((at[p][s], *problem._caps_at(s, load)) for s in range(pp))
            key = (len(pipelines), counts, ((at[p], hop_times[hop_class[e]]),) * sum(counts), caps)
            part = Part(workers, dict(zip(workers, at[p])), pipelines, microbatches, key)
            if key not in shapes:
                shapes[key] = (PartProblem(problem, part, _shape_ops(problem, part, list(at[p]))), [])
            found = known[stand_in] = (key, shapes[key][1])
            found[1].append(part)
            continue
        found[1].append(Part(workers, dict(zip(workers, at[p])), pipelines, microbatches, found[0]))
    return list(shapes.values())


def pipeline_hops(problem: PlanningProblem) -> tuple[list[int], list[tuple[float, ...]]]:
    """(per pipeline, its class; per class, the transfer time of each hop from stage s to s + 1):
    pipelines whose hops stay on or leave a node alike share a class. Fixed by the grid, so
    computed once per grid, not per failure."""
    key = (problem.pp, problem.dp, problem.gpus_per_node, problem.placement, problem.intra_node_s,
           problem.inter_node_s)
    if key not in _HOPS:
        _HOPS.clear()  # one grid at a time
        classes: dict[tuple, int] = {}
        of = [classes.setdefault(tuple(problem.transfer_s((d, s), (d, s + 1)) for s in range(problem.pp - 1)),
                                 len(classes)) for d in range(problem.dp)]
        _HOPS[key] = (of, list(classes))
    return _HOPS[key]


_HOPS: dict[tuple, tuple] = {}


def _shape_ops(problem: PlanningProblem, part: Part, route: list[Position]) -> dict[Position, list[Op]]:
    """A single-pipeline shape's ops: every flow runs along `route` (the local positions)."""
    kinds = (F, B, W) if problem.decoupled else (F, BW)
    ops = {pos: [] for pos in route}
    for p, j in ((p, j) for p, ks in enumerate(part.microbatches) for j in range(len(ks))):
        for pos in route:
            ops[pos] += [Op(kind, pos[1], j, p) for kind in kinds]
    return ops


def _add(shapes: dict, problem: PlanningProblem, workers: list[Position], routes: dict) -> None:
    """Relabel one part (its workers and its flows' routes: the runner pipeline per stage) and
    file it under its shape."""
    count = defaultdict(int)
    for d, _ in routes:
        count[d] += 1
    pipelines = sorted(count, key=lambda d: (-count[d], d))
    local_pipe = {d: i for i, d in enumerate(pipelines)}
    local = {(e, s): (local_pipe.get(e, len(pipelines) + e), s) for e, s in workers}
    microbatch_of, signature = {}, []
    for d in pipelines:
        p = local_pipe[d]
        for j, k in enumerate(sorted(k for e, k in routes if e == d)):
            microbatch_of[(p, j)] = k
            route = routes[(d, k)]
            # A flow's route: where it runs at each stage, and the sends between them.
            signature.append((tuple(local[(e, s)] for s, e in enumerate(route)),
                              tuple(problem.transfer_s((e, s), (route[s + 1], s + 1))
                                    for s, e in enumerate(route[:-1]))))
    caps = tuple(sorted((local[pos], problem.stash_cap(pos), problem.defer_cap(pos)) for pos in workers))
    # Flows in (local pipeline, micro-batch) order; the counts say where one pipeline's end (two
    # parts whose flows look alike may split them between their pipelines differently).
    key = (len(pipelines), tuple(count[d] for d in pipelines), tuple(signature), caps)
    microbatches = tuple(tuple(microbatch_of[(p, j)] for j in range(count[d])) for p, d in enumerate(pipelines))
    part = Part(sorted(workers), local, pipelines, microbatches, key)
    if key not in shapes:
        kinds = (F, B, W) if problem.decoupled else (F, BW)
        ops = {local[pos]: [] for pos in workers}
        for (p, j), (route, _) in zip(sorted(microbatch_of), signature):
            for pos in route:
                ops[pos] += [Op(kind, pos[1], j, p) for kind in kinds]
        for order in ops.values():
            order.sort(key=lambda o: (o.pipeline, o.microbatch))
        shapes[key] = (PartProblem(problem, part, ops), [])
    shapes[key][1].append(part)


def copy_orders(shape: PartProblem, orders: dict[Position, list[Op]], part: Part) -> dict[Position, list[Op]]:
    """A shape's orders renamed onto one of its parts (real positions, pipelines, micro-batches)."""
    real_pos = {v: k for k, v in part.local.items()}
    pipes, mbs = part.pipeline_of, part.microbatches
    return {real_pos[pos]: [Op(op.kind, op.stage, mbs[op.pipeline][op.microbatch], pipes[op.pipeline])
                            for op in order]
            for pos, order in orders.items()}
