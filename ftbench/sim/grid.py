"""Generated grids timed from one pipeline of each kind.

A plan built as the regular pp x dp grid of generated templates (ftbench.plan.generated_grid_plan,
or grid_plan of a generated schedule) has pipelines that differ only in their micro-batch count
and in which of their hops stay within a node. The simulator already times one representative
per kind (simulator._grid_classes), but finding the kinds, the all-reduce members and every
worker's figures goes over all workers, and the strategies that reshape after each failure
(elastic-horovod, varuna) make a new plan of up to 16,384 workers thousands of times a run.

Here the representatives alone (the first pipeline of each kind, on their own workers and
nodes) form a small plan whose all-reduces are charged as over the whole grid: dp members per
fragment, on one node only if all of the grid's are. The simulator then does the same float
operations on the same inputs as for the whole grid (pipelines meet only in the all-reduces,
whose start is the latest of the representatives' inputs either way), so the iteration time
and each representative's figures are the grid's, and every other worker takes those of its
kind's representative at its stage. The small plan is compiled once per set of kinds and
timed again for each all-reduce charge from its all-reduces on (Simulation.iteration_time:
plans with another pipeline count but the same kinds), its memory figures kept (they follow
each worker's order only); busy times come from simulating it with the plan's charges, when
first read. So do op and all-reduce rows (Gantt charts, failure points), from simulating the
whole grid.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from itertools import chain, islice, repeat
from operator import eq

from ftbench.costs import PlanCosts
from ftbench.layers import fragment_layout
from ftbench.plan import Plan
from ftbench.schedule import GridOps, Schedule
from ftbench.sim.simulator import SimResult, Simulation, simulate

KEEP_KINDS = 64  # small plans kept, least recently used first out
KEEP_TIMES = 64  # per small plan, iteration times kept per all-reduce charges
PEAKS = ("peak_stash", "peak_activation_bytes", "peak_memory_bytes")  # per-worker figures timing leaves alone


class GridTimer:
    """SimResults of generated grids from their kinds' small plan (one cost model)."""

    def __init__(self, cost_model):
        self.cost_model = cost_model
        self._kinds: OrderedDict[tuple, _Kinds] = OrderedDict()

    def __call__(self, plan: Plan) -> SimResult | None:
        """What simulate(plan.schedule, PlanCosts(cost_model, plan)) gives (busy times and op
        rows made when read), or None for a plan that is not a generated grid."""
        shape = _GridShape.of(plan)
        if shape is None:
            return None
        key = shape.key()
        kinds = self._kinds.get(key)
        if kinds is None:
            kinds = self._kinds[key] = _Kinds(shape, self.cost_model)
            if len(self._kinds) > KEEP_KINDS:
                self._kinds.popitem(last=False)
        else:
            self._kinds.move_to_end(key)
        return GridResult(plan, self.cost_model, kinds, shape)


class _GridShape:
    """A generated grid's kinds of pipeline: kind_of[d] for each pipeline d, the first
    pipeline of each kind (its representative), and each fragment's all-reduce charge: its
    units, its members (every pipeline's holder), whether all of them share one node."""

    def __init__(self, plan: Plan, pp: int, workers: list[int], nodes: list[int]):
        self.plan, self.pp, self.workers = plan, pp, workers
        same = bytes(map(eq, nodes, islice(nodes, 1, None)))  # 1 where worker i and i + 1 share a node
        # as the simulator's classes: a pipeline's micro-batch count and which of its hops stay on a node
        hops = repeat(bytes(pp - 1)) if 1 not in same else [same[i:i + pp - 1] for i in range(0, len(nodes), pp)]
        kinds_of = list(zip(plan.schedule.microbatches, hops))
        self.kinds = list(dict.fromkeys(kinds_of))
        index = {kind: k for k, kind in enumerate(self.kinds)}
        self.kind_of = list(map(index.__getitem__, kinds_of))
        self.reps = [kinds_of.index(kind) for kind in self.kinds]  # the first pipeline of each kind
        dp = len(self.kind_of)
        # a stage on one node: its dp workers' nodes all the first one's (counted, not collected)
        on_one = [nodes[s::pp].count(nodes[s]) == dp for s in range(pp)]
        self.charges = tuple((units, dp * len(stages), all(on_one[s] for s in stages)
                              and len({nodes[s] for s in stages}) == 1)
                             for units, stages in _fragments(pp, plan.partition[0]))

    @classmethod
    def of(cls, plan: Plan) -> "_GridShape | None":
        grid, schedule = plan.grid(), plan.schedule
        ops = schedule.ops
        if grid is None or plan.staggered_optimizer or schedule.released is not None or not isinstance(ops, GridOps):
            return None
        pp, workers, dp = grid.pp, grid.workers, len(schedule.stages)
        # GridOps.regular: pipeline d is the d-th run of pp workers, its templates set by its count
        if dp < 2 or ops.regular() != pp or len(workers) != pp * dp or len(ops.of) != pp * dp:
            return None
        if plan.partition.count(plan.partition[0]) != dp or list(ops.of) != workers:
            return None
        return cls(plan, pp, workers, grid.node_list(plan.node_of))

    def key(self) -> tuple:
        """What the kinds' small plan is made of (not its all-reduce charges)."""
        ops, pp, workers = self.plan.schedule.ops, self.pp, self.workers
        tids = tuple(tuple(ops.of[w][0] for w in workers[d * pp:(d + 1) * pp]) for d in self.reps)
        return (ops.templates, pp, self.plan.partition[0], tuple(self.kinds), tids)


class _Kinds:
    """The representatives of a grid's kinds as a small plan (on their own workers and nodes),
    compiled once for the simulator; its figures by kind, in stage order."""

    def __init__(self, shape: _GridShape, cost_model):
        plan, pp, workers = shape.plan, shape.pp, shape.workers
        records = plan.schedule.ops.of
        of, holds, node_of = {}, {}, {}
        for j, d in enumerate(shape.reps):
            for s in range(pp):
                w = workers[d * pp + s]
                of[w], holds[w], node_of[w] = (records[w][0], j), ((j, s),), plan.node_of[w]
        k = len(shape.reps)
        schedule = Schedule(GridOps(plan.schedule.ops.templates, of, run=pp), stages=(pp,) * k,
                            microbatches=tuple(plan.schedule.microbatches[d] for d in shape.reps),
                            name=plan.schedule.name)
        self.plan = Plan(schedule=schedule, partition=(plan.partition[0],) * k, holds=holds, node_of=node_of,
                         name=plan.name)
        self.cost_model, self.pp, self.k = cost_model, pp, k
        self.simulation = Simulation(schedule, _WholeGridSyncs(cost_model, self.plan, shape.charges))
        self.peaks = self._by_kind(self.simulation.result(), PEAKS)  # memory follows each worker's order only
        self._times: OrderedDict[tuple, float] = OrderedDict()

    def _by_kind(self, result: SimResult, names) -> dict[str, list[list]]:
        order = list(self.plan.schedule.ops)  # kind by kind, in stage order
        pp = self.pp
        return {name: [[getattr(result, name)[w] for w in order[j * pp:(j + 1) * pp]] for j in range(self.k)]
                for name in names}

    def iteration_time(self, charges: tuple) -> float:
        """With each all-reduce charged as `charges` say: the compiled plan timed again from its
        all-reduces on (Simulation.iteration_time), kept per charges."""
        found = self._times.get(charges)
        if found is None:
            seconds = _WholeGridSyncs.seconds(self.cost_model, charges)
            found = self._times[charges] = self.simulation.iteration_time(lambda sync, _: seconds[sync.units])
            if len(self._times) > KEEP_TIMES:
                self._times.popitem(last=False)
        return found

    def busy(self, charges: tuple) -> list[list[float]]:
        """Per kind, its representative's compute seconds (a float sum of op ends less starts,
        which depend on the all-reduces), from simulating the small plan with these charges."""
        return self._by_kind(simulate(self.plan.schedule, _WholeGridSyncs(self.cost_model, self.plan, charges)),
                             ("busy",))["busy"]


@lru_cache(maxsize=64)
def _fragments(pp: int, layers: tuple) -> tuple[tuple[tuple[int, int], tuple[int, ...]], ...]:
    """(units, the stages holding them) of each fragment of a pipeline cut as `layers`."""
    return tuple((sync.units, tuple(sorted({s for _, s in sync.holders})))
                 for sync in fragment_layout((pp,), (layers,)).syncs)


class _WholeGridSyncs(PlanCosts):
    """The small plan's costs, each fragment's all-reduce charged as over the whole grid
    (PlanCosts.sync_time with its members and nodes)."""

    def __init__(self, model, plan: Plan, charges: tuple):
        super().__init__(model, plan)
        self._seconds = self.seconds(model, charges)

    @staticmethod
    def seconds(model, charges: tuple) -> dict:
        return {units: model.allreduce_s(model.unit_params(units), members, one_node)
                for units, members, one_node in charges}

    def sync_time(self, sync, workers) -> float:
        return self._seconds[sync.units]


class ComposedResult(SimResult):
    """A SimResult put together from a few simulated pipelines (GridResult here, and
    ftbench.sim.pipelines.PipelinesResult): subclasses set `schedule`, `_plan`, `_model`,
    `_whole = None` and give `_per_worker(name)`; op and all-reduce rows come from simulating
    the whole plan, once, when first read."""

    busy = property(lambda self: self._per_worker("busy"))
    peak_stash = property(lambda self: self._per_worker("peak_stash"))
    peak_activation_bytes = property(lambda self: self._per_worker("peak_activation_bytes"))
    peak_memory_bytes = property(lambda self: self._per_worker("peak_memory_bytes"))

    def whole(self) -> SimResult:
        """The whole plan simulated (its rows)."""
        if self._whole is None:
            self._whole = simulate(self.schedule, PlanCosts(self._model, self._plan))
        return self._whole

    ops = property(lambda self: self.whole().ops)
    previous_ops = property(lambda self: self.whole().previous_ops)
    allreduces = property(lambda self: self.whole().allreduces)
    layout = property(lambda self: self.whole().layout)


class GridResult(ComposedResult):
    """A grid's SimResult from its kinds' small plan: per-worker dicts made when first read
    (each worker takes its kind's representative's figure at its stage), op and all-reduce
    rows from simulating the whole grid when first read."""

    def __init__(self, plan: Plan, cost_model, kinds: _Kinds, shape: _GridShape):
        self.iteration_time = kinds.iteration_time(shape.charges)
        self.schedule = plan.schedule
        self.worker_count = len(shape.workers)
        self._plan, self._model, self._kinds, self._shape = plan, cost_model, kinds, shape
        self._dicts: dict[str, dict] = {}
        self._whole: SimResult | None = None

    def _per_worker(self, name: str) -> dict:
        found = self._dicts.get(name)
        if found is None:
            shape = self._shape
            per_kind = self._kinds.busy(shape.charges) if name == "busy" else self._kinds.peaks[name]
            found = self._dicts[name] = dict(zip(shape.workers, chain.from_iterable(map(per_kind.__getitem__,
                                                                                         shape.kind_of))))
        return found

    def peak_columns(self) -> tuple[list[int], list[float]]:
        """(workers, peak_memory_bytes of each), without making the dict."""
        shape, per_kind = self._shape, self._kinds.peaks["peak_memory_bytes"]
        return shape.workers, list(chain.from_iterable(map(per_kind.__getitem__, shape.kind_of)))

