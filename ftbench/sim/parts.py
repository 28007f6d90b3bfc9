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
from operator import itemgetter

from ftbench.schedule import NO_MICROBATCH, OPT, Op, PartFlows, identity
from ftbench.union_find import DisjointSets


@dataclass
class PartCopy:
    workers: dict[int, int]  # representative's worker -> this copy's worker
    flows: dict[tuple[int, int], tuple[int, int]]  # representative's (pipeline, micro-batch) -> this copy's

    def rename(self, op: Op) -> Op:
        d, m = self.flows[(op.pipeline, op.microbatch)]
        return Op(op.kind, op.stage, m, d)


    def absent(self, microbatches) -> tuple[list[int], list[tuple[int, tuple[int, ...]]]]:
        """(pipelines whose every flow this copy runs, [(pipeline, its other micro-batches this
        copy runs)]): left out of the simulated all-reduce inputs."""
        some = defaultdict(list)
        for d, m in self.flows.values():
            some[d].append(m)
        return [], [(d, tuple(ms)) for d, ms in some.items()]


class BoundCopy:
    """A copy of a bound part (ftbench.schedule.GridOps.parts): a PartCopy whose flows are
    renamed through the representative's PartFlows and its own, built only when asked."""

    def __init__(self, workers: dict[int, int], rep: PartFlows, own: PartFlows, inverse: dict):
        self.workers = workers  # representative's worker -> this copy's worker
        self._rep, self._own = rep, own
        self._inverse = inverse  # the representative's real (pipeline, micro-batch) -> local; shared, filled once

    def _local(self) -> dict:
        if not self._inverse:
            pipes, mbs = self._rep
            for p, d in enumerate(pipes):
                self._inverse[(d, NO_MICROBATCH)] = (p, NO_MICROBATCH)
                self._inverse.update(((d, m), (p, j)) for j, m in enumerate(mbs[p]))
        return self._inverse

    def _real(self, p: int, j: int) -> tuple[int, int]:
        return self._own.pipelines[p], j if j == NO_MICROBATCH else self._own.microbatches[p][j]

    @property
    def flows(self) -> dict[tuple[int, int], tuple[int, int]]:
        return {real: self._real(*local) for real, local in self._local().items()}

    def rename(self, op: Op) -> Op:
        d, m = self._real(*self._local()[(op.pipeline, op.microbatch)])
        return Op(op.kind, op.stage, m, d)

    def absent(self, microbatches) -> tuple[list[int], list[tuple[int, tuple[int, ...]]]]:
        whole, some = [], []
        for d, ks in zip(*self._own):
            if len(ks) == microbatches[d] and ks == identity(len(ks)):
                whole.append(d)
            else:
                some.append((d, ks))
        return whole, some


def bound_copies(parts, costs, templates) -> tuple[list[BoundCopy], list[PartFlows]] | None:
    """(copies of identical bound parts (GridOps.parts), each mapped onto its representative;
    the representatives' flows): parts with the same templates, the same layer split per local
    pipeline, the same node-sharing pattern and the same kept state worker for worker time out
    alike. None for costs objects without a `plan`."""
    plan = getattr(costs, "plan", None)
    if plan is None:
        return None
    first: dict[tuple, tuple] = {}
    out = []
    for key, workers, flows in keyed_parts(parts, plan, templates):
        rep = first.get(key)
        if rep is None:
            first[key] = (workers, flows, {})
        else:
            out.append(BoundCopy(dict(zip(rep[0], workers)), rep[1], flows, rep[2]))
    return out, [flows for _, flows, _ in first.values()]


def keyed_parts(parts, plan, templates):
    """Per bound part, in order: (what decides its timing and memory besides its flows'
    names: (its templates' number, each local pipeline's split, its node-sharing pattern,
    its workers' kept state where it is not just the replica each steps, else None), its
    workers ordered by template (the shape's order), its PartFlows). Parts with equal keys
    time out alike, worker for worker in that order."""
    node_of, partition, holds = plan.node_of, plan.partition, plan.holds
    split_id: dict[int, int] = {}  # id of a pipeline's partition (alive with the plan) -> a small number
    split_of = [split_id.setdefault(id(layers), len(split_id)) for layers in partition]
    one_split = len(split_id) == 1  # every pipeline cut alike (a grid): each local pipeline's split is 0
    sequences = _Sequences(templates)
    same_node = {}  # workers per part -> the pattern of one node for all
    no_splits = {}  # local pipelines -> (0, ...): every pipeline cut alike
    known = sequences.found
    for flows, members in parts:
        found = known.get(tuple(map(_template, members)))
        order, templates_id, step_pipes, step_stages = found if found is not None else sequences.of(members)
        if order is not None:
            members = [members[i] for i in order]  # by template: its place in the shape
        workers = tuple(map(_worker, members))
        nodes = list(map(node_of.__getitem__, workers))
        if nodes.count(nodes[0]) == len(nodes):
            pattern = same_node.get(len(nodes)) or same_node.setdefault(len(nodes), (0,) * len(nodes))
        elif len(set(nodes)) == len(nodes):  # a node each (one GPU per node): numbered in order
            pattern = identity(len(nodes))
        else:
            relabel: dict[int, int] = {}
            pattern = tuple([relabel.setdefault(n, len(relabel)) for n in nodes])
        pipes = flows.pipelines
        # The state each worker keeps: usually exactly the replica it steps, which its template
        # and the part's pipelines already fix; else each replica by its layers.
        # (each ((pipes[p], st),) made in bulk: zip of one iterable gives one-tuples)
        if list(map(holds.get, workers)) == list(zip(zip(map(pipes.__getitem__, step_pipes), step_stages))):
            forms = None
        else:
            forms = tuple(tuple((split_id.setdefault(id(partition[d]), len(split_id)), s) for d, s in holds.get(w, ()))
                          for w in workers)
        if one_split:
            splits = no_splits.get(len(pipes)) or no_splits.setdefault(len(pipes), (0,) * len(pipes))
        else:
            splits = tuple(map(split_of.__getitem__, pipes))
        yield (templates_id, splits, pattern, forms), workers, flows


class _Sequences:
    """Per sequence of template ids (a part's members in worker order), worked out once: the
    order that sorts the members by template (None: already sorted), a number for the sorted
    template ids (equal for equal ones: a short stand-in in the part's key), and each one's
    optimizer step as two columns, local pipelines and stages ((-1, -1) where a template has
    no single step: never a plain grid replica). Parts of one shape share their sequence."""

    def __init__(self, templates):
        self.templates = templates
        self.found: dict[tuple, tuple] = {}
        self.number: dict[tuple, int] = {}
        self.step: dict[int, tuple] = {}

    def of(self, members) -> tuple:
        tids = tuple(map(_template, members))
        found = self.found.get(tids)
        if found is None:
            ranked = sorted(tids)
            # (a stable sort of the members by template, as sorted(members, key=_template))
            order = None if list(tids) == ranked else sorted(range(len(tids)), key=tids.__getitem__)
            number = self.number.setdefault(tuple(ranked), len(self.number))
            steps = [self.steps_of(t) for t in ranked]
            found = self.found[tids] = (order, number, tuple(p for p, _ in steps), tuple(st for _, st in steps))
        return found

    def steps_of(self, tid: int) -> tuple:
        found = self.step.get(tid)
        if found is None:
            steps = [(op[3], op[1]) for op in self.templates[tid] if op[0] == OPT]
            found = self.step[tid] = steps[0] if len(steps) == 1 else (-1, -1)
        return found


_worker, _template = itemgetter(0), itemgetter(1)


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
