"""Discrete-event simulation of one iteration of a schedule.

Each worker runs its ops in order; an op starts when the worker is free and every
dependency has finished and its output has arrived (producer end + transfer time). The
optimizer step of a stage waits for the gradient all-reduces of the layer fragments it
holds, each starting when the last weight gradient of that fragment is ready, wherever it
was computed. Ops are visited in a
topological order of the dependency graph plus each worker's own order
(ftbench.schedule.topological_order), so one iteration costs O(ops).

`costs` is anything with: op_time(op), transfer_time(src_worker, dst_worker),
allreduce_time(stage, pipeline, workers), stash_bytes(op), weight_stash_bytes(op) and
static_bytes(worker) (see ftbench.costs.PlanCosts; tests pass simpler ones), and optionally
recompute_bytes(op) (activation recomputation: what a backward rebuilds and holds while it
runs; 0 when absent). A costs object
that knows the plan's layers also has `partition` and sync_time(sync, workers): then the
all-reduce is cut into layer fragments (ftbench.layers) and each is charged by its own bytes
and members; without them, stage s of same-length pipelines is one all-reduce.

Release times: a schedule with `released` (ftbench.release.Releases: ReCycle's adapted plans)
starts no op before released.of(worker, op); with a staggered optimizer, round r's releases
come r fault-free periods later.

Gradient all-reduce overlap: `costs.overlap_grad_reduce` (absent: false; the cost model sets
it from `train.overlap_grad_reduce`, after Megatron-LM's --overlap-grad-reduce). Off, a
fragment's all-reduce starts when its last input (the last W or fused BW of that fragment,
on any worker) ends and takes its `a` seconds: DeepSpeed's pipeline engine, which reduces
after the last micro-batch (the ReCycle paper's baseline). On, the last micro-batch's backward
hands its gradients to the link bucket by bucket, one per layer unit of the fragment, and the
all-reduce ends `overlapped_sync_s` after that input (see there; `costs.grad_buckets(sync)`,
where present, gives the bucket count instead of the fragment's units). Its row in
`SimResult.allreduces` then starts `a` before it ends: the link's total busy time, drawn
ending when the gradients are reduced (in the link-bound case exactly the first bucket's start).
"""
from __future__ import annotations

from collections import defaultdict
from itertools import chain
from collections.abc import Mapping

from ftbench.layers import Layout, fragment_layout, stage_layout
from ftbench.sim.parts import PartCopy, bound_copies, part_copies
from ftbench.schedule import (B, OP_KINDS, OPT, GradientSync, GridOps, Op, PartFlows, Schedule, dependency_graph,
                              identity, indexed_graph, kahn_order, read_ops, sync_inputs, topological_order)


_MEMORY = {kind: row.memory for kind, row in OP_KINDS.items()}
_RECEIVES_STATE = frozenset(kind for kind, row in OP_KINDS.items() if row.receives == "state")


def overlapped_sync_s(allreduce_s: float, buckets: int, backward_s: float) -> float:
    """Seconds from the end of a fragment's last gradient op to the end of its all-reduce when
    it overlaps that op (train.overlap_grad_reduce): max(a/n, a - t(n-1)/n) for an all-reduce
    of `a` seconds cut into n = `buckets` buckets (the fragment's layer units) and an op of
    t = `backward_s` seconds (the last W or BW).

    Derivation: the op ending at e produces the final gradients of bucket k = 1..n at
    r_k = e - t + k t/n (evenly over its duration, the last layer first: reverse order is
    how a backward meets them, and each bucket is then complete); each bucket takes a/n on
    the link, in order, so bucket k ends at f_k = max(r_k, f_{k-1}) + a/n and
    f_n = max_k (r_k + (n - k + 1) a/n). That is linear in k, so its maximum is at an end:
    k = n gives e + a/n (compute-bound, t >= a: only the last bucket remains after the
    backward), k = 1 gives e - t + t/n + a = e + a - t(n-1)/n (link-bound, t < a: the link
    runs without a gap from the first layer's gradients on). With n = 1 it is `a`, as
    without overlap; it is never more than `a` and never less than a/n. With several inputs
    (one per worker and micro-batch), bucket k is ready when every input's is, so the
    all-reduce ends at max over inputs j of end_j + overlapped_sync_s(a, n, t_j). Earlier
    micro-batches' ops on a worker never bind: the worker's last one ends at least t_last
    after them, and t + max(a/n, a - t(n-1)/n) >= a >= the overlap of any earlier op."""
    if buckets <= 1:
        return allreduce_s
    return max(allreduce_s / buckets, allreduce_s - backward_s * (buckets - 1) / buckets)


class SimResult:
    """One simulated iteration. With deduplicated pipelines only the representatives' op
    timings are kept; `ops` and `previous_ops` name every worker's, built on first read
    (they are for Gantt charts and failure points; the per-worker dicts are always whole)."""

    def __init__(self, iteration_time: float,
                 ops: list[tuple[int, Op, float, float]],  # (worker, op, start, end), in start order per worker
                 allreduces: list[tuple[GradientSync, list[int], float, float]],  # (node, member workers, start, end)
                 busy: dict[int, float],  # compute seconds per worker
                 peak_stash: dict[int, int],  # most micro-batches forwarded but not yet backpropagated (B/BW)
                 peak_activation_bytes: dict[int, float],  # stash, plus a recomputing backward's transient
                 peak_memory_bytes: dict[int, float],  # static state + peak activations
                 previous_ops: list | None = None,  # staggered: the iteration before, for timelines
                 schedule: Schedule | None = None,  # what was simulated, and its fragments: for ops_completed_at
                 layout: Layout | None = None):
        self.iteration_time = iteration_time
        self.allreduces, self.busy = allreduces, busy
        self.peak_stash, self.peak_activation_bytes, self.peak_memory_bytes = \
            peak_stash, peak_activation_bytes, peak_memory_bytes
        self._ops, self._previous_ops = ops, [] if previous_ops is None else previous_ops
        self.schedule, self.layout = schedule, layout
        self._replicas: _Replicas | None = None  # copies whose rows are not built yet

    @property
    def ops(self) -> list[tuple[int, Op, float, float]]:
        self._build_copies()
        return self._ops

    @property
    def previous_ops(self) -> list:
        self._build_copies()
        return self._previous_ops

    def simulated_ops(self) -> list[tuple[int, Op, float, float]]:
        """The rows of the workers actually simulated, without building the copies' (each copy
        worker's rows are its representative's, same kinds, stages, micro-batches and times, the
        pipeline renamed): for readers that want extremes over every worker, e.g. the earliest
        start of each (kind, stage, micro-batch) (ftbench.release). Where copied parts rename
        micro-batches too (re-routed plans), every row."""
        if self._replicas is not None and self._replicas.parts:
            return self.ops
        return self._ops

    def _build_copies(self) -> None:
        replicas, self._replicas = self._replicas, None
        if replicas is not None:
            self._ops = replicas.every_worker(self._ops, sorted_by_worker=True)
            self._previous_ops = replicas.every_worker(self._previous_ops, sorted_by_worker=False)

    @property
    def workers(self) -> list[int]:
        return sorted(self.busy)

    def bubble_fraction(self) -> float:
        """Idle share of the workers' time in one iteration."""
        total = self.iteration_time * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total > 0 else 0.0

    def timeline(self) -> list[dict]:
        """Entries for ftbench.gantt.plot_gantt, all-reduces drawn on their member workers."""
        rows = [{"worker": w, "kind": op.kind, "stage": op.stage, "pipeline": op.pipeline,
                 "microbatch": None if op.kind == OPT else op.microbatch, "start": s, "end": e}
                for w, op, s, e in self.previous_ops + self.ops]
        for ar, members, s, e in self.allreduces:
            if e > s:
                rows += [{"worker": w, "kind": "AR", "stage": ar.stage, "pipeline": -1,
                          "microbatch": None, "start": s, "end": e} for w in members]
        return rows


class _Replicas:
    """Identical self-contained pipelines: each copy pipeline times out exactly as its
    representative, worker for worker in stage order."""

    def __init__(self, copies: dict[int, int], ordered: dict[int, tuple[int, ...]], parts: list[PartCopy] = (),
                 simulated: list[PartFlows] | None = None):
        self.simulated = simulated  # bound parts: the representatives' flows (every other flow is copied)
        self.copies = copies  # copy pipeline -> its representative
        self.ordered = ordered  # self-contained pipeline -> its workers in stage order (tuples of ints: the
        # garbage collector stops tracking them, so thousands kept cost no collection time)
        self.parts = list(parts)  # copies of parts whose workers run other pipelines' ops (ftbench/sim/parts.py)
        self.rep_of_worker = {wc: wr for d, r in copies.items() for wc, wr in zip(ordered[d], ordered[r])}
        for part in self.parts:  # (in bulk: a large grid's plan has thousands of copied parts)
            self.rep_of_worker.update(zip(part.workers.values(), part.workers))
        self.copies_of_worker = defaultdict(list)  # a part's representative worker -> its copies
        by_rep = defaultdict(list)  # a representative's workers -> its copies' workers, copy by copy
        for part in self.parts:
            by_rep[tuple(part.workers)].append(part.workers.values())
        for reps, copied in by_rep.items():
            for wr, wcs in zip(reps, zip(*copied)):
                self.copies_of_worker[wr].extend(wcs)
        self.absent_pipelines: set[int] = set()  # every flow of them runs in copied parts
        self.only: dict[int, list[int]] = {}  # other pipelines with flows in copied parts -> their other flows

    def leave_out(self, microbatches) -> None:
        """Fill absent_pipelines and `only` (the schedule's micro-batch counts)."""
        if self.simulated is not None:  # from the few simulated parts, not the thousands of copies
            whole, some = set(), defaultdict(list)
            for flows in self.simulated:
                for d, ks in zip(*flows):
                    if len(ks) == microbatches[d] and ks == identity(len(ks)):
                        whole.add(d)
                    else:
                        some[d] += ks
            self.absent_pipelines = set(range(len(microbatches))) - whole - set(some)
            self.only = {d: sorted(ks) for d, ks in some.items() if d not in whole}
            return
        absent = defaultdict(set)
        for part in self.parts:
            whole, some = part.absent(microbatches)
            self.absent_pipelines.update(whole)
            for d, ms in some:
                absent[d].update(ms)
        self.only = {d: [m for m in range(microbatches[d]) if m not in ms] for d, ms in absent.items()}

    def rows(self, rep_rows: list) -> list:
        """The rows of every copy worker, from its representative's (in their order)."""
        by_worker = defaultdict(list)
        for row in rep_rows:
            by_worker[row[0]].append(row)
        out = []
        for d, r in self.copies.items():
            for w_copy, w_rep in zip(self.ordered[d], self.ordered[r]):
                out += [(w_copy, op._replace(pipeline=d), s, e) for _, op, s, e in by_worker[w_rep]]
        for part in self.parts:
            for w_rep, w_copy in part.workers.items():
                out += [(w_copy, part.rename(op), s, e) for _, op, s, e in by_worker[w_rep]]
        return out

    def every_worker(self, rep_rows: list, sorted_by_worker: bool) -> list:
        """`rep_rows` plus the copies'; with `sorted_by_worker`, rep_rows are sorted by
        (worker, start) and so is the result (each worker's rows come from one source, so
        this is the order a stable sort of all rows gives)."""
        if not sorted_by_worker:
            return rep_rows + self.rows(rep_rows)
        by_worker = defaultdict(list)
        for row in rep_rows + self.rows(rep_rows):
            by_worker[row[0]].append(row)
        return [row for w in sorted(by_worker) for row in by_worker[w]]


def _replica_classes(schedule: Schedule, costs) -> _Replicas:
    """Which pipelines time out identically, and each self-contained pipeline's workers.

    A pipeline is self-contained when its workers run only its own ops and nobody else runs
    them; two self-contained pipelines with the same op orders (up to the pipeline index)
    and the same costs (`costs.pipeline_signature`, which also fixes each worker's static
    memory) interact only through the all-reduce, whose start is the same max either way, so
    one of them stands for both. Costs objects without `pipeline_signature` get no
    deduplication. Workers of a lazily held grid (GridOps) are compared by template, without
    building their ops.
    """
    signature_of = getattr(costs, "pipeline_signature", None)
    if signature_of is None:
        return _Replicas({}, {})
    ops = schedule.ops
    parts = ops.parts() if isinstance(ops, GridOps) else None
    if parts is not None:  # bound parts (ReCycle's plans): compared by templates and flows
        found = bound_copies(parts, costs, ops.templates)
        return _Replicas({}, {}, *found) if found is not None else _Replicas({}, {})
    if isinstance(ops, GridOps) and ops.regular() is not None:
        fast = _grid_classes(schedule, costs, ops.regular())
        if fast is not None:
            return fast
    owners = defaultdict(list)  # pipeline -> (lowest stage, worker, order form) of the workers running its ops
    mixed = set()
    given = ops
    read = read_ops(schedule)
    if isinstance(ops, GridOps):  # a worker's order form is its template id, unless it must be read
        low_of = [min(op[1] for op in t) for t in ops.templates]
        lazy, given = ops.split_forms()
        for w, (tid, d) in lazy.items():
            owners[d].append((low_of[tid], w, tid))
    for w in given:
        worker_ops = read(w)
        if not worker_ops:
            continue
        pipelines = {op.pipeline for op in worker_ops}
        if len(pipelines) > 1:
            mixed |= pipelines
        entry = (min(op.stage for op in worker_ops), w, tuple((op.kind, op.stage, op.microbatch) for op in worker_ops))
        for d in pipelines:
            owners[d].append(entry)
    ordered, first_with, copies = {}, {}, {}
    for d, entries in owners.items():
        if d in mixed:
            continue
        entries.sort()  # stage order (workers are distinct, so forms are never compared)
        workers = ordered[d] = tuple([e[1] for e in entries])
        key = (tuple([e[2] for e in entries]), signature_of(d, workers))
        r = first_with.setdefault(key, d)
        if r != d:
            copies[d] = r
    # Workers of the pipelines that share workers: identical parts of them, once each.
    tangled = sorted({e[1] for d in mixed for e in owners[d]})
    return _Replicas(copies, ordered, part_copies(schedule, costs, tangled))


def _grid_classes(schedule: Schedule, costs, run: int) -> _Replicas | None:
    """_replica_classes of a generated grid (GridOps.regular): pipeline d is the d-th run of
    `run` workers, in stage order, its templates set by its micro-batch count, so pipelines
    with equal counts and equal `costs.run_signatures` time out alike. None when the costs
    cannot tell signatures in bulk (then pipeline by pipeline)."""
    bulk = getattr(costs, "run_signatures", None)
    workers = list(schedule.ops.of)
    if bulk is None or len(workers) != run * len(schedule.stages) or min(schedule.stages) != max(schedule.stages):
        return None
    signatures = bulk(workers, run)
    if signatures is None:
        return None
    ordered, first_with, copies = {}, {}, {}
    for d, (count, signature) in enumerate(zip(schedule.microbatches, signatures)):
        ordered[d] = tuple(workers[d * run:(d + 1) * run])
        r = first_with.setdefault((count, signature), d)
        if r != d:
            copies[d] = r
    return _Replicas(copies, ordered)


class _Simulated:
    """What `_summarise` reads of a schedule: the ops of the workers actually simulated."""

    def __init__(self, ops: dict):
        self.ops = ops


# Iterations simulated back to back for a staggered optimizer: the period between the last
# two is the steady-state iteration time (worker-order coupling settles within a few).
STAGGER_ROUNDS = 4


def layout_of(schedule: Schedule, costs) -> Layout:
    """The plan's fragments when `costs` knows its partition, else one sync per stage."""
    partition = getattr(costs, "partition", None)
    if partition is None:
        return stage_layout(schedule.stages)
    return _uniform_layout(schedule.stages, partition) or fragment_layout(schedule.stages, partition)


def _uniform_layout(stages: tuple[int, ...], partition) -> Layout | None:
    """fragment_layout of pipelines that all cut the layers alike (a grid), from one pipeline's
    fragments held by every pipeline; None for any other partition."""
    dp = len(stages)
    if dp < 2 or len(partition) < dp or len(set(stages)) != 1:
        return None
    first = partition[0]
    if not all(p is first or p == first for p in partition[:dp]):
        return None
    key = (dp, stages[0], first)
    if key not in _UNIFORM:  # the same grid's layout, plan after plan: built once
        if len(_UNIFORM) >= 8:
            _UNIFORM.pop(next(iter(_UNIFORM)))
        _UNIFORM[key] = _uniform(dp, stages, partition)
    return _UNIFORM[key]


_UNIFORM: dict[tuple, Layout] = {}


def _uniform(dp: int, stages: tuple[int, ...], partition) -> Layout:
    one = fragment_layout(stages[:1], partition[:1])
    layout = Layout.__new__(Layout)  # what Layout(syncs) builds, without a list per position
    layout.syncs = [GradientSync(sync.units, tuple((d, s) for d in range(dp) for _, s in sync.holders))
                    for sync in one.syncs]
    layout.of_position = _GridPositions(dp, layout.syncs, one)
    return layout


class _GridPositions(Mapping):
    """Layout.of_position of pipelines that all cut the layers alike: (pipeline, stage) -> the
    syncs its step waits for, each list built when asked (equal to Layout's dict, same order)."""

    def __init__(self, dp: int, syncs: list[GradientSync], one: Layout):
        self.dp, self.syncs = dp, syncs
        index = {id(sync): i for i, sync in enumerate(one.syncs)}
        self.of_stage = {s: [index[id(sync)] for sync in of] for (_, s), of in one.of_position.items()}

    def __getitem__(self, position) -> list[GradientSync]:
        d, s = position
        if not (isinstance(d, int) and 0 <= d < self.dp) or s not in self.of_stage:
            raise KeyError(position)
        return [self.syncs[i] for i in self.of_stage[s]]

    def __iter__(self):
        seen = set()
        for sync in self.syncs:
            for position in sync.holders:
                if position not in seen:
                    seen.add(position)
                    yield position

    def __len__(self) -> int:
        return self.dp * len(self.of_stage)


def simulate(schedule: Schedule, costs, dedupe: bool = True, staggered: bool = False) -> SimResult:
    """One iteration of `schedule`. With `staggered` (ReCycle's staggered optimizer) there is
    no barrier between iterations: each worker starts the next iteration as soon as its own
    optimizer step is done, so one stage's warm-up overlaps another's cool-down. Iterations
    then run back to back and the iteration time is the steady-state period.

    With `dedupe`, one representative of each class of identical self-contained pipelines is
    simulated (see _replica_classes); the copies' ops are neither built nor linked, their
    per-worker figures are their representative's, and their op rows are built only when
    `SimResult.ops` is read."""
    return Simulation(schedule, costs, dedupe).result(staggered)


class Simulation:
    """`simulate` in two steps: the schedule compiled once (replica classes, dependency graph,
    op and transfer times), then timed. `iteration_time(sync_time)` times it again with every
    gradient all-reduce charged `sync_time(sync, members)` seconds instead of the costs' own,
    redoing only what waits for an all-reduce: for callers that time one plan shape under
    several all-reduce costs (Varuna's candidate shapes, whose replica count changes)."""

    def __init__(self, schedule: Schedule, costs, dedupe: bool = True):
        self.schedule, self.costs = schedule, costs
        self.replicas = replicas = _replica_classes(schedule, costs) if dedupe else _Replicas({}, {})
        replicas.leave_out(schedule.microbatches)
        read = read_ops(schedule)
        self.run = run = {w: read(w) for w in schedule.ops if w not in replicas.rep_of_worker}  # simulated workers
        where = {op: w for w, ops in run.items() for op in ops}
        present = set(range(len(schedule.stages))) - set(replicas.copies) - replicas.absent_pipelines
        self.layout = layout_of(schedule, costs)
        # Every op of a present pipeline runs on a simulated worker, so `where` answers for them.
        deps = dependency_graph(schedule, present, self.layout, workers=run, has=where.__contains__,
                                only=replicas.only)
        self.graph = _Graph(schedule, costs, deps, run, where, _sync_costs(schedule, costs, deps, where, replicas))
        self._first_end: list[float] | None = None  # every node's end in a lone iteration
        self._sync_starts: dict | None = None

    def result(self, staggered: bool = False) -> SimResult:
        schedule, replicas = self.schedule, self.replicas
        worker_free = defaultdict(float)
        period = schedule.released.period if schedule.released is not None else 0.0
        rounds = [self.graph.one_round(worker_free, r * period) for r in range(STAGGER_ROUNDS if staggered else 1)]
        if not staggered and self._first_end is None:
            self._first_end = self.graph.last_end  # a lone iteration: what iteration_time re-times
        ops_out, ar_out = rounds[-1]
        previous = []
        if staggered:
            # Shown from the start of the previous iteration; the period is the distance between
            # the ends of the last two.
            prev_ops, prev_ar = rounds[-2]
            t0 = min(s for _, _, s, _ in prev_ops)
            end_prev = max([e for *_, e in prev_ops] + [e for *_, e in prev_ar])
            end_last = max([e for *_, e in ops_out] + [e for *_, e in ar_out])
            period = end_last - end_prev
            shift = lambda rows: [(w, op, s - t0, e - t0) for w, op, s, e in rows]  # noqa: E731
            previous = shift(prev_ops)
            ops_out, ar_out = shift(ops_out), shift(ar_out)
        result = _summarise(_Simulated(self.run), self.costs, ops_out, ar_out)
        if replicas.rep_of_worker:
            # A copy's figures are its representative's (same orders, same costs, same static state).
            rep = replicas.rep_of_worker.get
            workers = list(schedule.ops)
            source = list(map(rep, workers, workers))
            every = lambda values: dict(zip(workers, map(values.__getitem__, source)))  # noqa: E731
            result.busy, result.peak_stash = every(result.busy), every(result.peak_stash)
            result.peak_activation_bytes = every(result.peak_activation_bytes)
            result.peak_memory_bytes = every(result.peak_memory_bytes)
            result._replicas = replicas
        result._previous_ops = previous
        result.schedule, result.layout = schedule, self.layout
        if staggered:
            result.iteration_time = period
        return result

    def iteration_time(self, sync_time=None, not_before: dict | None = None) -> float:
        """A lone iteration's time (as `result().iteration_time`), each all-reduce charged
        `sync_time(sync, members)` seconds when given, and starting no earlier than
        `not_before[sync.units]` where given (gradients of pipelines simulated elsewhere, as
        `sync_starts` gives them; with overlap such a gradient counts as an input ending then,
        as long as the shortest of the sync's own inputs)."""
        first_end = self._lone_round()
        if sync_time is None and not not_before:
            return max(first_end, default=0.0)
        return self.graph.retimed(first_end, sync_time, not_before)

    def sync_starts(self) -> dict:
        """fragment units -> when its gradients are ready in a lone iteration (its last input's
        end: where its all-reduce starts; with overlap, it ends overlapped_sync_s after that)."""
        if self._sync_starts is None:
            end = self._lone_round()
            self._sync_starts = {node.units: max(end[j] for j in ins)
                                 for _, node, w, _, ins, _ in self.graph.steps if w is None}
        return self._sync_starts

    def _lone_round(self) -> list[float]:
        if self._first_end is None:
            self.graph.one_round(defaultdict(float))
            self._first_end = self.graph.last_end
        return self._first_end


def _sync_costs(schedule: Schedule, costs, deps: dict, where: dict, replicas: _Replicas) -> dict:
    """id(sync) -> (member workers, all-reduce seconds). Members are the workers that produce
    the fragment's weight gradients, over every pipeline: the simulated ones' from `deps`, a
    copy's those of its representative's workers at the same places in stage order."""
    fragment_time = getattr(costs, "sync_time", None)
    copies, ordered = replicas.copies, replicas.ordered
    places: dict[tuple[int, int], list[int]] = {}  # (representative, stage) -> indices in its stage order

    def at(r: int, stage: int) -> list[int]:
        key = (r, stage)
        if key not in places:
            index = {w: i for i, w in enumerate(ordered[r])}
            places[key] = sorted({index[where[o]] for o in sync_inputs(schedule, GradientSync((), ((r, stage),)),
                                                                       has=where.__contains__)})
        return places[key]

    copies_of = defaultdict(list)  # representative -> its copies, in pipeline order
    for d, r in sorted(copies.items()):
        copies_of[r].append(d)
    every_pipeline = {}  # stage -> ((0, stage), (1, stage), ...): a fragment held by that stage of every pipeline
    out = {}
    for node in deps:
        if isinstance(node, GradientSync):
            members = {where[o] for o in deps[node]}
            if replicas.parts:  # a copied part's members at its representative's places
                of_worker = replicas.copies_of_worker
                members.update(chain.from_iterable([of_worker[w] for w in members if w in of_worker]))
            stage = node.holders[0][1]
            if copies and len(node.holders) == len(schedule.stages) and stage not in every_pipeline:
                every_pipeline[stage] = tuple((d, stage) for d in range(len(schedule.stages)))
            if copies and len(node.holders) == len(schedule.stages) and node.holders == every_pipeline[stage]:
                for r, ds in copies_of.items():  # each copy at its representative's places
                    for i in places.get((r, stage)) or at(r, stage):
                        members.update([ordered[d][i] for d in ds])
            elif copies:
                extra = []
                for d, stage in node.holders:
                    r = copies.get(d)
                    if r is not None:
                        workers, spots = ordered[d], places.get((r, stage)) or at(r, stage)
                        if len(spots) == 1:
                            extra.append(workers[spots[0]])
                        else:
                            extra += [workers[i] for i in spots]
                members.update(extra)
            members = sorted(members)
            seconds = fragment_time(node, members) if fragment_time is not None \
                else costs.allreduce_time(node.stage, node.pipeline, members)
            out[id(node)] = (members, seconds)  # by identity: a sync's hash covers all its holders
    return out


class _Graph:
    """The simulated ops and syncs in a topological order (of the dependency graph plus each
    worker's own order), compiled once into plain lists for the inner loop: per node its
    worker, its seconds and what it waits for (with the transfer delay of each input)."""

    def __init__(self, schedule: Schedule, costs, deps: dict, run: dict, where: dict, sync_cost: dict):
        nodes, preds, chains = indexed_graph(schedule, deps, workers=run)
        order = kahn_order(preds, chains)
        if len(order) < len(nodes):
            topological_order(schedule, deps, workers=run)  # raises, naming where each worker waits
        transfer, op_time = costs.transfer_time, costs.op_time
        # ops that receive a stage's state (a costs object without it charges a plain hop)
        state_transfer = getattr(costs, "state_transfer_time", lambda src, dst, op: transfer(src, dst))
        self.n, self.steps = len(nodes), []
        released = schedule.released
        # node index -> its release time (ops only; None when the schedule has none)
        self.release: dict[int, float] | None = None if released is None else {}
        # train.overlap_grad_reduce: per sync node, (buckets, [(input op seconds, the inputs
        # of that length)]), the inputs grouped by length (max_j(end_j + c) = max_j(end_j) + c
        # exactly: rounding is monotone, so the groups give the same floats as input by input)
        self.overlap: dict[int, tuple[int, list[tuple[float, list[int]]]]] | None = \
            {} if getattr(costs, "overlap_grad_reduce", False) else None
        buckets_of = getattr(costs, "grad_buckets", None)
        seconds_of = {}  # node index -> op seconds (overlap only)
        for i in order:
            node = nodes[i]
            if isinstance(node, GradientSync):
                members, seconds = sync_cost[id(node)]
                self.steps.append((i, node, None, seconds, preds[i], members))
                if self.overlap is not None:
                    groups: dict[float, list[int]] = {}
                    for j in preds[i]:
                        groups.setdefault(seconds_of[j], []).append(j)
                    n = buckets_of(node) if buckets_of is not None else node.units[1] - node.units[0]
                    self.overlap[i] = (n, sorted(groups.items()))
            else:
                w = where[node]
                if node.kind in _RECEIVES_STATE:
                    ins = [(j, state_transfer(where[nodes[j]], w, node)) for j in preds[i]]
                else:
                    ins = [(j, None if isinstance(nodes[j], GradientSync) else transfer(where[nodes[j]], w))
                           for j in preds[i]]
                t = op_time(node)
                self.steps.append((i, node, w, t, ins, None))
                if released is not None:
                    at = released.of(w, node)
                    if at is not None:
                        self.release[i] = at
                if self.overlap is not None:
                    seconds_of[i] = t
        self.preds, self.chains = preds, chains
        self.last_end: list[float] = []
        self._after_syncs: list | None = None

    def _overlapped_end(self, i: int, end: list[float], seconds: float, floor: float | None = None) -> float:
        """When sync node i's all-reduce of `seconds` ends under overlap: max over its inputs j
        of end_j + overlapped_sync_s(seconds, buckets, t_j); `floor` (not_before: gradients of
        pipelines simulated elsewhere) counts as an input of the shortest length here."""
        n, groups = self.overlap[i]
        finish = max(max(end[j] for j in js) + overlapped_sync_s(seconds, n, t) for t, js in groups)
        if floor is not None:
            finish = max(finish, floor + overlapped_sync_s(seconds, n, groups[0][0]))
        return finish

    def retimed(self, first_end: list[float], sync_time=None, not_before: dict | None = None) -> float:
        """The iteration time of a lone round (whose node ends were `first_end`) with each sync
        charged sync_time(sync, members) seconds (default: its own) and starting no earlier
        than not_before[sync.units] (where given): only the nodes that wait, directly or
        through their worker's order, for a sync are timed again."""
        if self._after_syncs is None:
            previous = {b: a for chain in self.chains for a, b in zip(chain, chain[1:])}
            later = [False] * self.n
            self._after_syncs = []
            for step in self.steps:
                i = step[0]
                p = previous.get(i)
                if step[2] is None or any(later[j] for j in self.preds[i]) or (p is not None and later[p]):
                    later[i] = True
                    self._after_syncs.append((step, p))
            # the latest end of everything else, which no all-reduce can move
            self._before_syncs_end = (first_end, max((e for i, e in enumerate(first_end) if not later[i]),
                                                     default=None))
        if self._before_syncs_end[0] is not first_end:
            raise ValueError("retimed() must be given the same lone round every time")
        end = first_end.copy()
        latest = self._before_syncs_end[1]
        for (i, node, w, seconds, ins, members), p in self._after_syncs:
            if w is None:
                start = max(end[j] for j in ins)
                floor = not_before.get(node.units) if not_before else None
                a = seconds if sync_time is None else sync_time(node, members)
                if self.overlap is not None:
                    finish = self._overlapped_end(i, end, a, floor)
                else:
                    if floor is not None and floor > start:
                        start = floor
                    finish = start + a
            else:
                start = 0.0 if p is None else end[p]  # the worker is free when its previous op ends
                if self.release is not None:
                    start = max(start, self.release.get(i, 0.0))
                for j, delay in ins:
                    arrival = end[j] if delay is None else end[j] + delay
                    if arrival > start:
                        start = arrival
                finish = start + seconds
            end[i] = finish
            if latest is None or finish > latest:
                latest = finish
        return 0.0 if latest is None else latest

    def one_round(self, worker_free, shift: float = 0.0) -> tuple[list, list]:
        """Time one iteration; `worker_free` carries over between rounds. Any order that
        respects dependencies and worker orders gives the same times: an op starts when its
        worker is free, its inputs have arrived and (release times) `shift` after its release."""
        end = [0.0] * self.n
        ops_out, ar_out = [], []
        overlap = self.overlap
        release = self.release or {}
        for i, node, w, seconds, ins, members in self.steps:
            if w is None:  # a gradient sync: starts when its last input is ready
                if overlap is None:
                    start = max(end[j] for j in ins)
                    finish = start + seconds
                else:  # in buckets during the last backward: drawn as its `seconds` ending at finish
                    finish = self._overlapped_end(i, end, seconds)
                    start = finish - seconds
                ar_out.append((node, members, start, finish))
            else:
                start = worker_free[w]
                if i in release and release[i] + shift > start:
                    start = release[i] + shift
                for j, delay in ins:
                    arrival = end[j] if delay is None else end[j] + delay
                    if arrival > start:
                        start = arrival
                finish = start + seconds
                worker_free[w] = finish
                ops_out.append((w, node, start, finish))
            end[i] = finish
        self.last_end = end
        return ops_out, ar_out


def _summarise(schedule, costs, ops_out, ar_out) -> SimResult:
    iteration_time = max([e for *_, e in ops_out] + [e for *_, e in ar_out], default=0.0)
    busy = {w: 0.0 for w in schedule.ops}
    for w, _, s, e in ops_out:
        busy[w] += e - s
    peak_stash, peak_act, peak_mem = {}, {}, {}
    # Activation recomputation: a backward first rebuilds its micro-batch's activations, held
    # on top of the stash until it ends (absent on simple cost objects: nothing rebuilt).
    recompute_bytes = getattr(costs, "recompute_bytes", None)
    for w, ops in schedule.ops.items():
        stash = peak = 0
        act = act_peak = 0.0
        for op in ops:  # a worker's memory depends only on its own order, not on timing
            effect = _MEMORY[op.kind]  # the op-kind table's memory effect
            if effect == "stash":
                stash += 1
                act += costs.stash_bytes(op)
            elif effect == "unstash":
                if recompute_bytes is not None:
                    act_peak = max(act_peak, act + recompute_bytes(op))
                stash -= 1
                act -= costs.stash_bytes(op) - (costs.weight_stash_bytes(op) if op.kind == B else 0.0)
            elif effect == "unstash_weight":
                act -= costs.weight_stash_bytes(op)
            elif effect == "stash_to_end":  # held until the iteration ends (Bamboo's redundant forward)
                act += costs.stash_bytes(op)
            peak, act_peak = max(peak, stash), max(act_peak, act)
        peak_stash[w], peak_act[w] = peak, act_peak
        peak_mem[w] = costs.static_bytes(w) + act_peak
    ops_out.sort(key=lambda row: (row[0], row[2]))
    return SimResult(iteration_time, ops_out, ar_out, busy, peak_stash, peak_act, peak_mem)



def ops_completed_at(result: SimResult, fraction: float, stop_before_optimizer: bool = True) -> frozenset:
    """The ops every worker has finished by `fraction` of the simulated iteration: where a
    failure striking then cuts the iteration, the same on every backend. The set is closed
    under dependencies (a step only with its fragments' syncs, hence every input of them)
    and under each worker's order. By default the failure strikes before any optimizer step
    (no OPT, nor anything after one); with stop_before_optimizer=False some stages may have
    stepped while others have not: where the run loop cuts failures (ftbench.loop, `_point`),
    the survivors that stepped undo it (ftbench.engine.undo)."""
    if result.schedule is None:
        raise ValueError("this SimResult does not carry its schedule (not made by simulate)")
    schedule = result.schedule
    start = min((s for _, _, s, _ in result.ops), default=0.0)  # staggered: shifted timelines
    cutoff = start + fraction * result.iteration_time
    # Finished-by-time is already closed: an op starts no earlier than its producers' (and
    # syncs') ends and its worker's previous end, and float max/+ never go below an operand.
    finished = {op for _, op, _, e in result.ops if e <= cutoff}
    if not stop_before_optimizer:
        return frozenset(finished)
    after_step = set()  # ops a worker runs after its own optimizer step (rare)
    for ops in schedule.ops.values():
        stepped = False
        for op in ops:
            if stepped and op in finished:
                after_step.add(op)
            stepped = stepped or op.kind == OPT
    if not after_step:
        return frozenset(op for op in finished if op.kind != OPT)
    return _closed_without_steps(schedule, result.layout, finished)


def _closed_without_steps(schedule: Schedule, layout: Layout | None, finished: set) -> frozenset:
    """`finished` less every OPT and everything that waits, directly or not, for one."""
    previous = {b: a for ops in schedule.ops.values() for a, b in zip(ops, ops[1:])}
    deps = dependency_graph(schedule, layout=layout)
    done: set = set()
    for node in topological_order(schedule, deps):
        if isinstance(node, GradientSync):
            if all(d in done for d in deps[node]):
                done.add(node)
        elif node in finished and node.kind != OPT and all(d in done for d in deps[node]) \
                and (node not in previous or previous[node] in done):
            done.add(node)
    return frozenset(n for n in done if not isinstance(n, GradientSync))
