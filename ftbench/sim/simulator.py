"""Discrete-event simulation of one iteration of a schedule.

Each worker runs its ops in order; an op starts when the worker is free and every
dependency has finished and its output has arrived (producer end + transfer time). The
optimizer step of a stage waits for the gradient all-reduce across its replicas, which
starts when the last replica's last weight gradient is ready. Ops are visited in a
topological order of the dependency graph plus each worker's own order (Kahn), so one
iteration costs O(ops).

`costs` is anything with: op_time(op), transfer_time(src_worker, dst_worker),
allreduce_time(stage, pipeline, workers), stash_bytes(op), weight_stash_bytes(op) and
static_bytes(worker) (see ftbench.costs.PlanCosts; tests pass simpler ones).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from ftbench.schedule import (B, BW, F, OPT, W, Op, Schedule, ScheduleError, dependencies,
                              replica_pipelines, weight_gradient_ops)


@dataclass(frozen=True)
class AllReduce:
    """Virtual node: the gradient all-reduce of one stage over its replica pipelines."""
    stage: int
    replicas: tuple[int, ...]


@dataclass
class SimResult:
    iteration_time: float
    ops: list[tuple[int, Op, float, float]]  # (worker, op, start, end), in start order per worker
    allreduces: list[tuple[AllReduce, list[int], float, float]]  # (node, member workers, start, end)
    busy: dict[int, float]  # compute seconds per worker
    peak_stash: dict[int, int]  # most micro-batches forwarded but not yet backpropagated (B/BW)
    peak_activation_bytes: dict[int, float]
    peak_memory_bytes: dict[int, float]  # static state + peak activations

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
                for w, op, s, e in self.ops]
        for ar, members, s, e in self.allreduces:
            if e > s:
                rows += [{"worker": w, "kind": "AR", "stage": ar.stage, "pipeline": -1,
                          "microbatch": None, "start": s, "end": e} for w in members]
        return rows


def _graph(schedule: Schedule):
    """Dependencies of every op (OPT depends on its stage's all-reduce node)."""
    deps: dict = {}
    allreduce_inputs: dict[AllReduce, list[Op]] = {}
    for ops in schedule.ops.values():
        for op in ops:
            if op.kind == OPT:
                node = AllReduce(op.stage, tuple(replica_pipelines(schedule, op.pipeline)))
                if node not in allreduce_inputs:
                    allreduce_inputs[node] = weight_gradient_ops(schedule, op.stage, op.pipeline)
                deps[op] = [node]
            else:
                deps[op] = dependencies(schedule, op)
    deps.update(allreduce_inputs)
    return deps, allreduce_inputs


def simulate(schedule: Schedule, costs) -> SimResult:
    where = schedule.index()
    deps, allreduce_inputs = _graph(schedule)
    missing = [(op, d) for op, ds in deps.items() for d in ds
               if not isinstance(d, AllReduce) and d not in where]
    if missing:
        op, d = missing[0]
        raise ScheduleError(f"{op} depends on {d}, which no worker runs")

    # In-degree counts graph dependencies plus the previous op on the same worker.
    waiting = {node: len(ds) for node, ds in deps.items()}
    dependents = defaultdict(list)
    for node, ds in deps.items():
        for d in ds:
            dependents[d].append(node)
    next_on_worker = {}
    for ops in schedule.ops.values():
        for a, b in zip(ops, ops[1:]):
            waiting[b] += 1
            next_on_worker[a] = b

    end: dict = {}
    worker_free = defaultdict(float)
    ready = deque(node for node, n in waiting.items() if n == 0)
    ops_out, ar_out = [], []
    while ready:
        node = ready.popleft()
        if isinstance(node, AllReduce):
            members = sorted({where[o] for o in allreduce_inputs[node]})
            start = max(end[o] for o in allreduce_inputs[node])
            finish = start + costs.allreduce_time(node.stage, node.replicas[0], members)
            ar_out.append((node, members, start, finish))
        else:
            w = where[node]
            start = worker_free[w]
            for d in deps[node]:
                arrival = end[d] if isinstance(d, AllReduce) else end[d] + costs.transfer_time(where[d], w)
                start = max(start, arrival)
            finish = start + costs.op_time(node)
            worker_free[w] = finish
            ops_out.append((w, node, start, finish))
            nxt = next_on_worker.get(node)
            if nxt is not None:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
        end[node] = finish
        for child in dependents.get(node, ()):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)

    if len(end) < len(deps):
        stuck = [op for op in deps if op not in end and not isinstance(op, AllReduce)]
        raise ScheduleError(f"schedule deadlocks: {len(stuck)} ops never become ready, e.g. {stuck[0]}")
    return _summarise(schedule, costs, ops_out, ar_out)


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
