"""ReCycle's part-based plans timed from one part of each class, compiled once per run.

An adapted plan (every worker on a bound template, GridOps.parts) is a few thousand parts at
scale: peer pipelines with the micro-batches re-routed to them. The simulator times one
representative per class of identical parts (ftbench.sim.parts.bound_copies), but it compiles
their graph (dependencies, topological order, op and transfer times) for every new plan, and
a run at 16,384 GPUs makes hundreds, one per new failure count, from a dozen sets of classes.

A part meets the rest only in the gradient all-reduces, and its timeline depends on its
templates, which of its workers share a node, each op's release time, the layer split (one
for every pipeline here) and the all-reduce seconds. So the representatives are laid out on
canonical workers and pipelines (class j's local pipeline p is pipeline base_j + p, its
workers numbered in template order, its node pattern kept) and compiled once per set of such
classes; a plan then costs the pass that finds its classes and the timed rounds, with each
fragment's all-reduce charged as over the whole plan (its members are the representatives'
members times their class sizes). The simulator does the same float operations on the same
inputs as for the whole plan (max is exact in any order, a worker's ops are summed in its
own order either way), so the iteration time and every worker's figures are the simulator's
(tests/test_sim_parts_timer.py). Op and all-reduce rows come from simulating the whole plan,
when first read.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict

from ftbench.costs import PlanCosts
from ftbench.plan import Plan
from ftbench.schedule import OPT, GridOps, PartFlows, Schedule, bound_flows, identity
from ftbench.sim.grid import PEAKS, ComposedResult
from ftbench.sim.parts import keyed_parts
from ftbench.sim.simulator import STAGGER_ROUNDS, SimResult, Simulation, simulate

KEEP_COMPILED = 32  # sets of classes kept compiled, least recently used first out


class PartsTimer:
    """SimResults of bound-part plans from their classes' compiled canonical plan."""

    def __init__(self, cost_model):
        self.cost_model = cost_model
        self._compiled: OrderedDict[tuple, _Compiled] = OrderedDict()

    def __call__(self, plan: Plan) -> SimResult | None:
        """What simulate(plan.schedule, PlanCosts(cost_model, plan), staggered=...) gives, or
        None for a plan this does not time (not bound parts, pipelines cut or sized
        differently, kept state other than each worker's stepped replica)."""
        classes = _Classes.of(plan)
        if classes is None:
            return None
        key = classes.key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = _Compiled(key, self.cost_model)
            if len(self._compiled) > KEEP_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return PartsResult(plan, self.cost_model, compiled, classes)


class _Classes:
    """A plan's bound parts by class (ftbench.sim.parts.keyed_parts): per part its class and
    workers (in template order); per class its representative's workers and flows."""

    def __init__(self, plan: Plan, pp: int):
        self.plan, self.pp = plan, pp
        ops = plan.schedule.ops
        first: dict[tuple, int] = {}
        self.reps: list[tuple[tuple[int, ...], PartFlows]] = []
        self.class_of: list[int] = []
        self.workers: list[tuple[int, ...]] = []
        self.stable = True  # every class's kept state is the replica each worker steps
        for key, workers, flows in keyed_parts(ops.parts(), plan, ops.templates):
            j = first.get(key)
            if j is None:
                j = first[key] = len(self.reps)
                self.reps.append((workers, flows))
                self.stable = self.stable and key[3] is None
            self.class_of.append(j)
            self.workers.append(workers)
        self.patterns = [key[2] for key in first]
        self.sizes = [self.class_of.count(j) for j in range(len(self.reps))]

    @classmethod
    def of(cls, plan: Plan) -> "_Classes | None":
        schedule, ops = plan.schedule, plan.schedule.ops
        if not isinstance(ops, GridOps) or plan.logged or plan.host or ops.parts() is None:
            return None
        stages, partition, n = schedule.stages, plan.partition, len(schedule.stages)
        if n < 2 or stages.count(stages[0]) != n or len(partition) < n \
                or not all(p is partition[0] or p == partition[0] for p in partition[:n]):
            return None
        classes = cls(plan, stages[0])
        return classes if classes.stable and sum(len(flows.pipelines) for _, flows in classes.reps) >= 2 else None

    def key(self) -> tuple:
        """What the canonical plan is made of: per class its templates, node pattern, local
        micro-batch counts and each op's release time; the shared cut, stage count, optimizer
        and release period."""
        plan = self.plan
        schedule, ops = plan.schedule, plan.schedule.ops
        released = schedule.released
        of, templates = ops.of, ops.templates
        parts = []
        for (workers, flows), pattern in zip(self.reps, self.patterns):
            shape = tuple(templates[of[w][0]] for w in workers)
            releases = None
            if released is not None:
                releases = tuple(tuple(map(released.of, [w] * len(t), bound_flows(t, flows))) for w, t in zip(workers, shape))
            parts.append((shape, pattern, tuple(map(len, flows.microbatches)), releases))
        period = released.period if released is not None else None
        return (tuple(parts), plan.partition[0], self.pp, plan.staggered_optimizer, period)


class _Released:
    """Release times of the canonical plan's ops, as the real plan's releases give them."""

    def __init__(self, period: float, table: dict):
        self.period, self._table = period, table

    def of(self, worker: int, op):
        return self._table.get((worker, op))


class _Compiled:
    """The classes' representatives on canonical workers and pipelines, compiled once."""

    def __init__(self, key: tuple, cost_model):
        parts, cut, pp, staggered, period = key
        self.pp, self.staggered = pp, staggered
        template_id: dict[tuple, int] = {}
        of, members, node_of, holds, table = {}, [], {}, {}, {}
        self.workers: list[tuple[int, ...]] = []  # per class, its canonical workers in template order
        pipelines = nodes = 0
        counts = []
        for shape, pattern, local_counts, releases in parts:
            flows = PartFlows(tuple(range(pipelines, pipelines + len(local_counts))), tuple(map(identity, local_counts)))
            records = []
            for k, template in enumerate(shape):
                w = len(of)
                tid = template_id.setdefault(template, len(template_id))
                of[w], node_of[w] = (tid, flows), nodes + pattern[k]
                steps = [(op[3], op[1]) for op in template if op[0] == OPT]
                holds[w] = ((flows.pipelines[steps[0][0]], steps[0][1]),)
                if releases is not None:
                    table.update(((w, op), at) for op, at in zip(bound_flows(template, flows), releases[k]) if at is not None)
                records.append((w, tid))
            self.workers.append(tuple(w for w, _ in records))
            members.append((flows, records))
            counts += local_counts
            pipelines += len(local_counts)
            nodes += max(pattern) + 1
        grid = GridOps(tuple(template_id), of)
        grid.set_parts(members)
        released = _Released(period, table) if period is not None else None
        schedule = Schedule(grid, stages=(pp,) * pipelines, microbatches=tuple(counts), name="parts",
                            released=released)
        self.plan = Plan(schedule=schedule, partition=(cut,) * pipelines, holds=holds,
                         node_of=node_of, name="parts", staggered_optimizer=staggered)
        self.costs = PlanCosts(cost_model, self.plan)
        self.simulation = Simulation(schedule, self.costs, dedupe=False)
        self._steps = self.simulation.graph.steps  # as compiled: each sync's members (canonical)
        self.syncs = [(node.units, members) for _, node, w, _, _, members in self._steps if w is None]
        self.place = {w: (j, k) for j, workers in enumerate(self.workers) for k, w in enumerate(workers)}
        first = self.simulation.result(staggered)  # (its all-reduce charges do not move memory)
        self.peaks = {name: getattr(first, name) for name in PEAKS}

    def timed(self, seconds: dict) -> tuple[float, dict[int, float]]:
        """(iteration time, busy seconds per canonical worker) with fragment `units`' all-reduce
        taking seconds[units]: Simulation.result's rounds and figures, without its memory pass
        (`peaks`: memory follows each worker's order only) nor its rows."""
        graph = self.simulation.graph
        graph.steps = [step if step[2] is not None else (step[0], step[1], None, seconds[step[1].units], *step[4:])
                       for step in self._steps]
        released = self.plan.schedule.released
        period = released.period if released is not None else 0.0
        worker_free = defaultdict(float)
        rounds = [graph.one_round(worker_free, r * period) for r in range(STAGGER_ROUNDS if self.staggered else 1)]
        ops_out, ar_out = rounds[-1]
        busy = dict.fromkeys(self.plan.schedule.ops, 0.0)
        if not self.staggered:
            for w, _, start, end in ops_out:
                busy[w] += end - start
            return max([e for *_, e in ops_out] + [e for *_, e in ar_out], default=0.0), busy
        # staggered: the period between the ends of the last two rounds; rows shifted to the
        # start of the one before (as the simulator shows them, and sums busy times from)
        prev_ops, prev_ar = rounds[-2]
        t0 = min(s for _, _, s, _ in prev_ops)
        end_prev = max([e for *_, e in prev_ops] + [e for *_, e in prev_ar])
        end_last = max([e for *_, e in ops_out] + [e for *_, e in ar_out])
        for w, _, start, end in ops_out:
            busy[w] += (end - t0) - (start - t0)
        return end_last - end_prev, busy


class PartsResult(ComposedResult):
    """A bound-part plan's SimResult from its classes' canonical plan: each worker takes its
    class representative's figures at its place; rows from simulating the whole plan when read."""

    def __init__(self, plan: Plan, cost_model, compiled: _Compiled, classes: _Classes):
        self.schedule = plan.schedule
        self.worker_count = len(plan.schedule.ops)
        self._plan, self._model, self._classes, self._compiled = plan, cost_model, classes, compiled
        self._dicts: dict[str, dict] = {}
        self._whole: SimResult | None = None
        self.iteration_time, self._busy = compiled.timed(_charges(plan, cost_model, compiled, classes))

    def _canonical_of(self) -> dict[int, int]:
        """Real worker -> the canonical worker whose figures it takes."""
        found = self._dicts.get("")
        if found is None:
            found = self._dicts[""] = {}
            workers = self._compiled.workers
            for j, real in zip(self._classes.class_of, self._classes.workers):
                found.update(zip(real, workers[j]))
        return found

    def _per_worker(self, name: str) -> dict:
        found = self._dicts.get(name)
        if found is None:
            values = self._busy if name == "busy" else self._compiled.peaks[name]
            canonical = self._canonical_of()
            workers = list(self.schedule.ops)
            found = self._dicts[name] = dict(zip(workers, map(values.__getitem__, map(canonical.__getitem__, workers))))
        return found

    def peak_columns(self) -> tuple[list[int], list[float]]:
        """(workers, peak_memory_bytes of each)."""
        peaks = self._per_worker("peak_memory_bytes")
        return list(peaks), list(peaks.values())

    def whole(self) -> SimResult:
        """The plan itself simulated (its rows), with its own optimizer (staggered or not)."""
        if self._whole is None:
            self._whole = simulate(self.schedule, PlanCosts(self._model, self._plan),
                                   staggered=self._plan.staggered_optimizer)
        return self._whole


def _charges(plan: Plan, model, compiled: _Compiled, classes: _Classes) -> dict:
    """units -> its all-reduce's seconds over the whole plan: its members are the canonical
    members' real counterparts (a class's every part, at the representative's places), on one
    node only if all of them share one."""
    sizes, node_of, where = classes.sizes, plan.node_of, compiled.place
    seconds = {}
    for units, members in compiled.syncs:
        count = sum(sizes[where[w][0]] for w in members)
        seconds[units] = model.allreduce_s(model.unit_params(units), count, count <= 1 or _one_node(
            members, where, classes, node_of))
    return seconds


def _one_node(members: list[int], where: dict, classes: _Classes, node_of: dict) -> bool:
    """Whether every real member of a sync sits on one node (stops at the first other node)."""
    at = set((where[w] for w in members))
    first = None
    for real, j in zip(classes.workers, classes.class_of):
        for j_k in at:
            if j_k[0] == j:
                node = node_of[real[j_k[1]]]
                if first is None:
                    first = node
                elif node != first:
                    return False
    return True


