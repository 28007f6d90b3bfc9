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
static_bytes(worker) (see ftbench.costs.PlanCosts; tests pass simpler ones). A costs object
that knows the plan's layers also has `partition` and sync_time(sync, workers): then the
all-reduce is cut into layer fragments (ftbench.layers) and each is charged by its own bytes
and members; without them, stage s of same-length pipelines is one all-reduce.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ftbench.layers import Layout, fragment_layout, stage_layout
from ftbench.schedule import (B, BW, F, OPT, W, GradientSync, Op, Schedule, dependency_graph, sync_inputs,
                              topological_order)


@dataclass
class SimResult:
    iteration_time: float
    ops: list[tuple[int, Op, float, float]]  # (worker, op, start, end), in start order per worker
    allreduces: list[tuple[GradientSync, list[int], float, float]]  # (node, member workers, start, end)
    busy: dict[int, float]  # compute seconds per worker
    peak_stash: dict[int, int]  # most micro-batches forwarded but not yet backpropagated (B/BW)
    peak_activation_bytes: dict[int, float]
    peak_memory_bytes: dict[int, float]  # static state + peak activations
    previous_ops: list = field(default_factory=list)  # staggered: the iteration before, for timelines
    schedule: Schedule | None = None  # what was simulated, and its fragments: for ops_completed_at
    layout: Layout | None = None

    @property
    def workers(self) -> list[int]:
        return sorted(self.busy)

    def bubble_fraction(self) -> float:
        """Idle share of the workers' time in one iteration."""
        total = self.iteration_time * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total > 0 else 0.0

    def timeline(self) -> list[dict]:
        """Entries for ftbench.report.plot_gantt, all-reduces drawn on their member workers."""
        rows = [{"worker": w, "kind": op.kind, "stage": op.stage, "pipeline": op.pipeline,
                 "microbatch": None if op.kind == OPT else op.microbatch, "start": s, "end": e}
                for w, op, s, e in self.previous_ops + self.ops]
        for ar, members, s, e in self.allreduces:
            if e > s:
                rows += [{"worker": w, "kind": "AR", "stage": ar.stage, "pipeline": -1,
                          "microbatch": None, "start": s, "end": e} for w in members]
        return rows


def _replica_classes(schedule: Schedule, costs) -> tuple[dict[int, int], dict[int, set[int]]]:
    """(pipeline -> a representative pipeline that times out identically, pipeline -> its workers).

    A pipeline is self-contained when its workers run only its own ops and nobody else runs
    them; two self-contained pipelines with the same op orders (up to the pipeline index)
    and the same costs (`costs.pipeline_signature`) interact only through the all-reduce,
    whose start is the same max either way, so one of them stands for both. Costs objects
    without `pipeline_signature` get no deduplication.
    """
    owners = defaultdict(set)  # pipeline -> workers running its ops
    mixed = set()
    for w, ops in schedule.ops.items():
        pipelines = {op.pipeline for op in ops}
        mixed |= pipelines if len(pipelines) > 1 else set()
        for d in pipelines:
            owners[d].add(w)
    signature_of = getattr(costs, "pipeline_signature", None)
    if signature_of is None:
        return {}, owners
    rep_of, first_with = {}, {}
    for d, workers in owners.items():
        if d in mixed:
            continue
        ordered = _stage_order(schedule, workers)
        orders = tuple(tuple((op.kind, op.stage, op.microbatch) for op in schedule.ops[w]) for w in ordered)
        key = (orders, signature_of(d, ordered))
        rep_of[d] = first_with.setdefault(key, d)
    return {d: r for d, r in rep_of.items() if d != r}, owners


def _stage_order(schedule: Schedule, workers) -> list[int]:
    return sorted(workers, key=lambda w: (min(op.stage for op in schedule.ops[w]), w))


# Iterations simulated back to back for a staggered optimizer: the period between the last
# two is the steady-state iteration time (worker-order coupling settles within a few).
STAGGER_ROUNDS = 4


def layout_of(schedule: Schedule, costs) -> Layout:
    """The plan's fragments when `costs` knows its partition, else one sync per stage."""
    partition = getattr(costs, "partition", None)
    return stage_layout(schedule.stages) if partition is None else fragment_layout(schedule.stages, partition)


def simulate(schedule: Schedule, costs, dedupe: bool = True, staggered: bool = False) -> SimResult:
    """One iteration of `schedule`. With `staggered` (ReCycle's staggered optimizer) there is
    no barrier between iterations: each worker starts the next iteration as soon as its own
    optimizer step is done, so one stage's warm-up overlaps another's cool-down. Iterations
    then run back to back and the iteration time is the steady-state period."""
    copies, owners = _replica_classes(schedule, costs) if dedupe else ({}, {})
    copied_workers = {w for d in copies for w in owners[d]}
    present = set(range(len(schedule.stages))) - set(copies)
    layout = layout_of(schedule, costs)
    deps = dependency_graph(schedule, present, layout)
    for w in copied_workers:
        for op in schedule.ops[w]:
            del deps[op]
    order = topological_order(schedule, deps, copied_workers)
    sync_cost = _sync_costs(schedule, costs, deps)
    worker_free = defaultdict(float)
    rounds = [_one_round(schedule, costs, deps, order, worker_free, sync_cost)
              for _ in range(STAGGER_ROUNDS if staggered else 1)]
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
        shift = lambda rows: [(*r[:2], r[2] - t0, r[3] - t0) for r in rows]  # noqa: E731
        previous = shift(prev_ops + _copy_replicas(schedule, copies, owners, prev_ops))
        ops_out, ar_out = shift(ops_out), shift(ar_out)
    ops_out += _copy_replicas(schedule, copies, owners, ops_out)
    result = _summarise(schedule, costs, ops_out, ar_out)
    result.schedule, result.layout = schedule, layout
    if staggered:
        result.iteration_time, result.previous_ops = period, previous
    return result


def _sync_costs(schedule: Schedule, costs, deps: dict) -> dict:
    """sync -> (member workers, all-reduce seconds). Members are the workers that produce
    the fragment's weight gradients, over every pipeline (deduplicated ones included)."""
    where = schedule.index()
    fragment_time = getattr(costs, "sync_time", None)
    out = {}
    for node in deps:
        if isinstance(node, GradientSync):
            members = sorted({where[o] for o in sync_inputs(schedule, node)})
            seconds = fragment_time(node, members) if fragment_time is not None \
                else costs.allreduce_time(node.stage, node.pipeline, members)
            out[node] = (members, seconds)
    return out


def _one_round(schedule: Schedule, costs, deps: dict, order: list, worker_free, sync_cost) -> tuple[list, list]:
    """Time one iteration in topological `order`; `worker_free` carries over between rounds."""
    where = schedule.index()
    end: dict = {}
    ops_out, ar_out = [], []
    # Any order that respects dependencies and worker orders gives the same times: an op
    # starts when its worker is free and its inputs have arrived.
    for node in order:
        if isinstance(node, GradientSync):
            members, seconds = sync_cost[node]
            start = max(end[o] for o in deps[node])
            finish = start + seconds
            ar_out.append((node, members, start, finish))
        else:
            w = where[node]
            start = worker_free[w]
            for d in deps[node]:
                arrival = end[d] if isinstance(d, GradientSync) else end[d] + costs.transfer_time(where[d], w)
                start = max(start, arrival)
            finish = start + costs.op_time(node)
            worker_free[w] = finish
            ops_out.append((w, node, start, finish))
        end[node] = finish
    return ops_out, ar_out


def _copy_replicas(schedule: Schedule, copies: dict[int, int], owners, ops_out) -> list:
    """Timings of each deduplicated pipeline: its representative's, renamed."""
    by_worker = defaultdict(list)
    for row in ops_out:
        by_worker[row[0]].append(row)
    rows = []
    for d, r in copies.items():
        for w_copy, w_rep in zip(_stage_order(schedule, owners[d]), _stage_order(schedule, owners[r])):
            rows += [(w_copy, op._replace(pipeline=d), s, e) for _, op, s, e in by_worker[w_rep]]
    return rows


def _summarise(schedule, costs, ops_out, ar_out) -> SimResult:
    iteration_time = max([e for *_, e in ops_out] + [e for *_, e in ar_out], default=0.0)
    busy = {w: 0.0 for w in schedule.ops}
    for w, _, s, e in ops_out:
        busy[w] += e - s
    peak_stash, peak_act, peak_mem = {}, {}, {}
    for w, ops in schedule.ops.items():
        stash = peak = 0
        act = act_peak = 0.0
        for op in ops:  # a worker's memory depends only on its own order, not on timing
            if op.kind == F:
                stash += 1
                act += costs.stash_bytes(op)
            elif op.kind in (B, BW):
                stash -= 1
                act -= costs.stash_bytes(op) - (costs.weight_stash_bytes(op) if op.kind == B else 0.0)
            elif op.kind == W:
                act -= costs.weight_stash_bytes(op)
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
    stepped while others have not."""
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
