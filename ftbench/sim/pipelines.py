"""Heterogeneous pipelines (Oobleck's plans, ftbench.plan.pipelines_plan) timed from one
pipeline of each kind.

Oobleck re-instantiates its pipelines after every failure, so a run at scale times thousands
of plans of thousands of pipelines, each a generated pipeline of its own template (layer cut)
and micro-batch count. The simulator's replica classes already time one pipeline of each
kind, but building the classes, the dependency graph and the all-reduce members goes over
every worker and op, plan after plan. Here the kinds are timed alone, once per run:

A pipeline's ops up to its optimizer steps wait only for ops of the same pipeline, so their
times depend only on its kind: its stage and micro-batch counts, its cut and which of its
hops stay within a node. Each worker's optimizer step comes last in its order and waits for
the gradient all-reduces of the fragments its stage holds (the cut of the layer units at
every kind's stage boundaries); a fragment's all-reduce starts when the last of its inputs,
anywhere, ends (with train.overlap_grad_reduce, it ends at the latest input end plus that
input's overlapped_sync_s) and takes the ring all-reduce over every pipeline's holder. So
per kind and stage the lone pipeline gives: when the worker is free for its step, when its
gradient inputs end (and how long they take), the step's seconds, the compute before it and
the memory figures. A plan then costs a pass over its pipelines to find their kinds and one
over fragments and kinds for the all-reduces and steps: the simulator's float operations on
the same inputs (max is exact in any order, and `max(x) + c` equals `max(x + c)` since
rounding is monotone), so the iteration time and every worker's figures are the simulator's.
Op and all-reduce rows (Gantt charts, failure points) come from simulating the whole plan,
when first read.

A plan made from the one timed before (pipelines_plan's `like`, Oobleck after most failures)
names the pipelines that changed: only their kinds are found again, and its per-worker memory
figures are the earlier plan's with those pipelines' workers updated. Coverage (`covered`,
asked by the cache instead of check_coverage) is checked once per shape of pipeline.
"""
from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from itertools import chain, islice, repeat
from operator import eq, sub

from ftbench.costs import PlanCosts
from ftbench.layers import model_layers, stage_units
from ftbench.plan import Plan, grid_plan
from ftbench.schedule import BW, OPT, W, ScheduleError, check_coverage, generate
from ftbench.sim.grid import ComposedResult
from ftbench.sim.simulator import SimResult, overlapped_sync_s, simulate

KEEP_KINDS = 4096  # kinds' figures kept, least recently used first out
FIGURES = ("busy", "peak_stash", "peak_activation_bytes", "peak_memory_bytes")  # SimResult's per-worker dicts


class _Kind:
    """One kind of pipeline timed alone: per stage (its worker), the figures the plan's
    composition needs."""

    def __init__(self, stages: int):
        self.free = [0.0] * stages  # when the worker's last op before its step ends
        self.inputs: list[list[tuple[float, float]]] = [[] for _ in range(stages)]  # (seconds, latest end) of
        # the stage's gradient inputs (its W, or BW), one entry per length
        self.step_s = [0.0] * stages  # the optimizer step's seconds
        self.busy = [0.0] * stages  # compute seconds before the step
        self.peak_stash, self.peak_activation_bytes, self.peak_memory_bytes = [], [], []


class _Classes:
    """A plan's pipelines by kind: per pipeline its kind's key (stages, micro-batches, id of
    its cut, which hops stay within a node: () throughout when none of the plan's do) and
    index; per kind its figures, cut and how many pipelines have it (a kind left with none
    is no part of the plan)."""

    def __init__(self, keys: list[tuple], hops: bool):
        self.keys, self.hops = keys, hops
        self.index: dict[tuple, int] = {}
        self.kinds: list[_Kind] = []
        self.cuts: list[tuple] = []
        self.kind_of: list[int] = []
        self.count: list[int] = []

    def derived(self, keys: list[tuple]) -> "_Classes":
        """A copy for a plan whose pipelines have these keys (some changed)."""
        other = _Classes(keys, self.hops)
        other.index, other.kinds, other.cuts = dict(self.index), list(self.kinds), list(self.cuts)
        other.kind_of, other.count = list(self.kind_of), list(self.count)
        return other


class PipelinesTimer:
    """SimResults of heterogeneous pipelines plans from their kinds (one cost model)."""

    def __init__(self, cost_model):
        self.cost_model = cost_model
        self._kinds: OrderedDict[tuple, _Kind | None] = OrderedDict()
        self._covered: dict[tuple, bool] = {}  # (generator, shape) -> its pipeline covers it
        self._checked: weakref.ref | None = None  # the last layout found covered
        # the last plan timed: its layout, its classes and its result (weakly), for a plan made from it
        self._last: tuple | None = None

    def covered(self, plan: Plan) -> bool:
        """Whether `plan` was built by pipelines_plan and each of its pipelines covers its
        shape, as check_coverage checks a plan pipeline by pipeline: pipelines_plan gives each
        pipeline the orders of one generated pipeline of its shape, so each shape is checked
        once, as such a pipeline. False: check it as any other plan."""
        layout = plan.pipelines()
        if layout is None or 0 in layout.stages:
            return False
        name = plan.schedule.name
        earlier = self._checked() if self._checked is not None else None
        changed = layout.changed_from(earlier) if earlier is not None else None  # (the others were checked)
        shapes = zip(layout.stages, layout.counts) if changed is None else \
            [(layout.stages[d], layout.counts[d]) for d in changed]
        for shape in dict.fromkeys(shapes):
            ok = self._covered.get((name, shape))
            if ok is None:  # (pipelines_plan gives a pipeline of this shape these orders)
                try:
                    check_coverage(generate(name, *shape))
                    ok = True
                except ScheduleError:
                    ok = False
                self._covered[(name, shape)] = ok
            if not ok:
                return False
        self._checked = weakref.ref(layout)
        return True

    def __call__(self, plan: Plan) -> SimResult | None:
        """What simulate(plan.schedule, PlanCosts(cost_model, plan)) gives (the op rows built
        when read), or None for a plan that pipelines_plan did not build."""
        layout = plan.pipelines()
        if layout is None or plan.staggered_optimizer or plan.schedule.released is not None or not layout.workers:
            return None
        last = self._last
        earlier = last[0]() if last is not None else None
        changed = layout.changed_from(earlier) if earlier is not None else None
        classes = self._reclassify(plan, layout, last[1], changed) if changed is not None else None
        if classes is None:
            changed = None
            classes = self._classify(plan, layout)
        if classes is None:
            return None
        iteration_time, busy = self._compose(plan, layout, classes)
        figures = {"busy": busy, **{name: [getattr(kind, name) for kind in classes.kinds] for name in FIGURES[1:]}}
        before = last[2]() if changed is not None else None
        result = PipelinesResult(plan, self.cost_model, iteration_time, figures, layout.workers, classes.kind_of,
                                 (before, earlier, changed) if before is not None else None)
        self._last = (weakref.ref(layout), classes, weakref.ref(result))
        return result

    def _classify(self, plan: Plan, layout) -> _Classes | None:
        """The kinds of every pipeline."""
        schedule = plan.schedule
        workers, bounds = layout.workers, layout.bounds
        nodes = list(map(plan.node_of.__getitem__, workers))
        same = list(map(eq, nodes, islice(nodes, 1, None)))  # worker i and i + 1 share a node
        # per pipeline, which of its hops stay within a node (() where none of the plan's do)
        hops = any(same)
        runs = map(tuple, map(same.__getitem__, map(slice, bounds, map(sub, islice(bounds, 1, None), repeat(1))))) \
            if hops else repeat(())
        classes = _Classes(list(zip(schedule.stages, schedule.microbatches, map(id, plan.partition), runs)), hops)
        first = dict(zip(reversed(classes.keys), range(len(classes.keys) - 1, -1, -1)))  # kind -> its first pipeline
        for key in sorted(first, key=first.__getitem__):
            if self._add_kind(plan, classes, key, first[key]) is None:
                return None
        classes.kind_of = list(map(classes.index.__getitem__, classes.keys))
        counted = Counter(classes.kind_of)
        classes.count = [counted[k] for k in range(len(classes.kinds))]
        return classes

    def _reclassify(self, plan: Plan, layout, earlier: _Classes, changed: list[int]) -> _Classes | None:
        """The kinds of a plan's pipelines from those of the plan it was made from, where only
        the `changed` ones differ; None where a changed pipeline has a hop within a node and
        the earlier plan had none (then every pipeline is looked at)."""
        schedule, node_of = plan.schedule, plan.node_of
        keys = list(earlier.keys)
        for d in changed:
            if earlier.hops:
                nodes = list(map(node_of.__getitem__, layout.lists[d]))
                hops = tuple(map(eq, nodes, islice(nodes, 1, None)))
            else:
                hops = ()
                nodes = list(map(node_of.__getitem__, layout.lists[d]))
                if any(map(eq, nodes, islice(nodes, 1, None))):
                    return None
            keys[d] = (schedule.stages[d], schedule.microbatches[d], id(plan.partition[d]), hops)
        classes = earlier.derived(keys)
        for d in changed:
            k = classes.index.get(keys[d])
            if k is None:
                k = self._add_kind(plan, classes, keys[d], d)
                if k is None:
                    return None
                classes.count.append(0)
            classes.count[classes.kind_of[d]] -= 1
            classes.count[k] += 1
            classes.kind_of[d] = k
        return classes

    def _add_kind(self, plan: Plan, classes: _Classes, key: tuple, d: int) -> int | None:
        """Index a new kind, that of pipeline d (None where it cannot be timed alone)."""
        schedule = plan.schedule
        hops = key[3] or (False,) * (schedule.stages[d] - 1)
        kind = self._kind((schedule.name, schedule.stages[d], schedule.microbatches[d], plan.partition[d], hops))
        if kind is None:
            return None
        classes.index[key] = len(classes.kinds)
        classes.kinds.append(kind)
        classes.cuts.append(plan.partition[d])
        return classes.index[key]

    def _kind(self, key: tuple) -> _Kind | None:
        found = self._kinds.get(key)
        if found is None and key not in self._kinds:
            found = self._kinds[key] = _time_alone(self.cost_model, *key)
            if len(self._kinds) > KEEP_KINDS:
                self._kinds.popitem(last=False)
        else:
            self._kinds.move_to_end(key)
        return found

    def _compose(self, plan: Plan, layout, classes: _Classes) -> tuple[float, list[list[float] | None]]:
        """(iteration time, per kind and stage the worker's compute seconds): the fragments'
        all-reduces, then every stage's optimizer step."""
        model = self.cost_model
        kinds = [k for k, count in enumerate(classes.count) if count]  # those of some pipeline
        cuts = [classes.cuts[k] for k in kinds]
        n = model_layers(cuts)
        units = [[stage_units(layers, s == 0, s == len(cut) - 1, n) for s, layers in enumerate(cut)] for cut in cuts]
        bounds = sorted({c for ranges in units for lo_hi in ranges for c in lo_hi})
        pipelines = len(classes.kind_of)
        holder_at = [0] * len(classes.kinds)  # per kind, the stage holding the fragment at hand (fragments in order)
        done = {k: [[] for _ in ranges] for k, ranges in zip(kinds, units)}  # per kind and stage: its all-reduces' ends
        latest = 0.0
        for lo, hi in zip(bounds, islice(bounds, 1, None)):
            for k, ranges in zip(kinds, units):
                while ranges[holder_at[k]][1] <= lo:
                    holder_at[k] += 1
            one_node = _one_node(plan, layout, holder_at, classes.kind_of)
            seconds = model.allreduce_s(model.unit_params((lo, hi)), pipelines, one_node)
            inputs = [(t, end) for k in kinds for t, end in classes.kinds[k].inputs[holder_at[k]]]
            if model.overlap_grad_reduce:  # in buckets, one per unit, during the last backward
                finish = max(end + overlapped_sync_s(seconds, hi - lo, t) for t, end in inputs)
            else:
                finish = max(end for _, end in inputs) + seconds
            latest = max(latest, finish)
            for k in kinds:
                done[k][holder_at[k]].append(finish)
        busy: list[list[float] | None] = [None] * len(classes.kinds)
        for k in kinds:
            kind, busy[k] = classes.kinds[k], []
            for s, syncs in enumerate(done[k]):
                start = max(kind.free[s], *syncs)
                finish = start + kind.step_s[s]
                busy[k].append(kind.busy[s] + (finish - start))
                latest = max(latest, finish, kind.free[s])
        return latest, busy


def _one_node(plan: Plan, layout, holder_at: list[int], kind_of: list[int]) -> bool:
    """Whether every pipeline's holder of a fragment (stage holder_at[kind]) sits on one node."""
    node_of, first = plan.node_of, None
    for workers, k in zip(layout.lists, kind_of):
        node = node_of[workers[holder_at[k]]]
        if first is None:
            first = node
        elif node != first:
            return False
    return True


def _time_alone(cost_model, name: str, pp: int, count: int, cut: tuple, hops: tuple) -> _Kind | None:
    """A kind's figures from simulating one pipeline of it on its own (None where its orders
    are not ops then one optimizer step per worker: the composition would not hold)."""
    node = [0]
    for shared in hops:
        node.append(node[-1] if shared else node[-1] + 1)
    plan = grid_plan(generate(name, pp, count), cut, pp, 1, node_of=node.__getitem__)  # (its own orders only)
    costs = PlanCosts(cost_model, plan)
    result = simulate(plan.schedule, costs)
    kind = _Kind(pp)
    rows: list[list] = [[] for _ in range(pp)]
    for w, op, start, end in result.ops:  # by worker, in its order
        rows[w].append((op, start, end))
    for s, ops in enumerate(rows):
        if [op.kind for op, _, _ in ops].count(OPT) != 1 or ops[-1][0].kind != OPT:
            return None
        kind.step_s[s] = costs.op_time(ops[-1][0])
        producers = {}  # micro-batch -> its gradient input: W where there is one, else BW
        busy = 0.0
        for op, start, end in ops[:-1]:
            busy += end - start
            if op.kind == W or (op.kind == BW and op.microbatch not in producers):
                producers[op.microbatch] = (costs.op_time(op), end)
        kind.busy[s], kind.free[s] = busy, ops[-2][2] if len(ops) > 1 else 0.0
        by_length: dict[float, float] = {}
        for t, end in producers.values():
            by_length[t] = max(by_length.get(t, end), end)
        kind.inputs[s] = sorted(by_length.items())
        kind.peak_stash.append(result.peak_stash[s])
        kind.peak_activation_bytes.append(result.peak_activation_bytes[s])
        kind.peak_memory_bytes.append(result.peak_memory_bytes[s])
    return kind


class PipelinesResult(ComposedResult):
    """A pipelines plan's SimResult from its kinds' figures: per-worker dicts built when first
    read (from the same dict of the result of the plan it was made from, where that one was
    built: its workers less those gone, the changed pipelines' workers updated), op and
    all-reduce rows from simulating the whole plan when first read."""

    def __init__(self, plan: Plan, cost_model, iteration_time: float, figures: dict, workers: list[int],
                 kind_of: list[int], earlier: tuple | None = None):
        self.iteration_time = iteration_time
        self.schedule = plan.schedule
        self.worker_count = len(workers)
        self._plan, self._model = plan, cost_model
        self._figures, self._workers, self._kind_of = figures, workers, kind_of
        # (the result of the plan this one's was made from, that plan's layout, the pipelines that changed)
        self._earlier = (weakref.ref(earlier[0]), weakref.ref(earlier[1]), earlier[2]) if earlier is not None else None
        self._dicts: dict[str, dict] = {}
        self._whole: SimResult | None = None

    def _per_worker(self, name: str) -> dict:
        found = self._dicts.get(name)
        if found is None:
            found = self._dicts[name] = self._from_earlier(name) or self._built(name)
        return found

    def _built(self, name: str) -> dict:
        per_kind = self._figures[name]
        return dict(zip(self._workers, chain.from_iterable(map(per_kind.__getitem__, self._kind_of))))

    def _from_earlier(self, name: str) -> dict | None:
        """The figure's dict from the earlier result's, where it was built (busy waits on every
        all-reduce: it is built whole)."""
        if self._earlier is None or name == "busy":
            return None
        earlier, layout, changed = self._earlier[0](), self._earlier[1](), self._earlier[2]
        before = earlier._dicts.get(name) if earlier is not None else None
        if before is None or layout is None:
            return None
        now, per_kind = self._plan.pipelines(), self._figures[name]
        found = before.copy()
        for d in changed:
            kept = set(now.lists[d])
            for w in layout.lists[d]:
                if w not in kept:
                    del found[w]
            found.update(zip(now.lists[d], per_kind[self._kind_of[d]]))
        return found
