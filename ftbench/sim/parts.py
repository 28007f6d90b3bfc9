"""Identical parts of a schedule, so the simulator times one of each.

Pipelines that run only their own ops are deduplicated pipeline by pipeline (simulator
`_replica_classes`). When workers run ops of other pipelines (ReCycle re-routes a failed
worker's micro-batches to its peers), they are grouped into *parts*: the workers linked by the
micro-batches they pass on (a flow: one (pipeline, micro-batch) through the stages). Parts
share only the gradient all-reduces, whose start is the latest input anywhere, so two parts
that are the same up to renaming workers, pipelines and micro-batches, with the same costs,
time out identically and one stands for the other.

A part is relabelled canonically: its pipelines by how many of its flows they own (most
first), then by id; micro-batches in order within a pipeline; workers by their relabelled op
sequence. Its key adds what decides timing and memory besides the ops: each local pipeline's
layer split, which workers share a node, and each worker's static state.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ftbench.schedule import NO_MICROBATCH, Op
from ftbench.union_find import DisjointSets


@dataclass
class PartCopy:
    workers: dict[int, int]  # representative's worker -> this copy's worker
    flows: dict[tuple[int, int], tuple[int, int]]  # representative's (pipeline, micro-batch) -> this copy's

    def rename(self, op: Op) -> Op:
        d, m = self.flows[(op.pipeline, op.microbatch)]
        return Op(op.kind, op.stage, m, d)


def part_copies(schedule, costs, workers) -> list[PartCopy]:
    """Copies of identical parts among `workers` (the workers that run other pipelines' ops,
    and the workers of those pipelines), each mapped onto its representative. Costs objects
    without a `plan` get none."""
    plan = getattr(costs, "plan", None)
    if plan is None or not workers:
        return []
    ops = {w: schedule.ops[w] if not hasattr(schedule.ops, "read") else schedule.ops.read(w) for w in workers}
    sets = DisjointSets()  # workers and the flows they run: ("w", worker), ("f", pipeline, micro-batch)
    for w, worker_ops in ops.items():
        for d, m in {(op[3], op[2]) for op in worker_ops}:  # its flows (an optimizer step: its own pipeline)
            sets.union(("f", d, m if m != NO_MICROBATCH else "own"), ("w", w))
    parts = defaultdict(list)
    for w in ops:
        parts[sets.find(("w", w))].append(w)

    first: dict[tuple, tuple[list[int], dict]] = {}
    out = []
    for members in parts.values():
        key, order, flows = _canonical(members, ops, plan, costs)
        if key not in first:
            first[key] = (order, flows)
            continue
        rep_order, rep_flows = first[key]
        inverse = {local: real for real, local in rep_flows.items()}
        out.append(PartCopy(dict(zip(rep_order, order)),
                            {inverse[local]: real for real, local in flows.items()}))
    return out


def _canonical(members: list[int], ops: dict, plan, costs):
    """(key, workers in canonical order, real (pipeline, micro-batch) -> local) of one part."""
    count = defaultdict(set)
    for w in members:
        for _, _, m, d in ops[w]:
            count[d].add(m)  # NO_MICROBATCH too: a pipeline seen only through its optimizer steps
    for d in count:
        count[d].discard(NO_MICROBATCH)
    pipelines = sorted(count, key=lambda d: (-len(count[d]), d))
    flows = {}
    for p, d in enumerate(pipelines):
        flows[(d, NO_MICROBATCH)] = (p, NO_MICROBATCH)
        for j, m in enumerate(sorted(count[d])):
            flows[(d, m)] = (p, j)
    local = flows.__getitem__
    sequence = {w: tuple([(k, st, local((d, m))) for k, st, m, d in ops[w]]) for w in members}
    order = sorted(members, key=lambda w: (sequence[w], w))
    nodes = {}
    for w in order:
        nodes.setdefault(plan.node_of[w], len(nodes))
    key = (tuple(sequence[w] for w in order),
           tuple(plan.partition[d] for d in pipelines),
           tuple(nodes[plan.node_of[w]] for w in order),
           tuple(costs.static_bytes(w) for w in order))
    return key, order, flows
