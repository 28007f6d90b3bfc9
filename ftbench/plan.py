"""A plan: which worker holds which layers, where workers sit, and the iteration's schedule.

Strategies produce plans; backends execute them. A plan is data, so it can be hashed
(the simulator memoises per plan), drawn, validated and compared.
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from itertools import chain
from dataclasses import dataclass, field
from functools import lru_cache

from ftbench.schedule import OPT, GridOps, Schedule, generate, grid_worker, read_ops

LayerRange = tuple[int, int]  # [first, end) transformer blocks


@dataclass(eq=False)
class GridLayout:
    """A plan that is the regular pp x dp grid: `workers[i]` keeps exactly the replica
    (i // pp, i % pp) and `holds` lists them in that order; every pipeline has pp stages,
    all cut alike. At scale a plan has tens of thousands of workers and strategies make one
    after every failure, so per-plan figures (bytes per worker or node, keys, the stage a
    worker kept) are computed from this, per stage, without a Python loop per worker."""
    pp: int
    workers: list[int]  # in grid order
    holds: dict  # the objects it describes (Plan.grid checks they are still the plan's)
    partition: tuple
    stages: tuple[int, ...]


@dataclass
class Plan:
    schedule: Schedule
    partition: tuple[tuple[LayerRange, ...], ...]  # per pipeline, per stage: its layer range
    holds: dict[int, tuple[tuple[int, int], ...]]  # worker -> (pipeline, stage) replicas whose weights and optimizer state it keeps
    node_of: dict[int, int]  # worker -> node (placement; decides intra- or inter-node links)
    name: str = ""
    staggered_optimizer: bool = False  # no barrier between iterations (ReCycle): the sim times the steady state
    # Boundaries whose tensors are logged (Swift): (pipeline, s) is the edge between stages s
    # and s + 1 of that pipeline, both ways (s's activations, s + 1's input gradients).
    logged: frozenset = frozenset()
    _key: tuple | None = field(default=None, repr=False, compare=False)
    _grid: GridLayout | None = field(default=None, repr=False, compare=False)  # see grid()

    @property
    def workers(self) -> list[int]:
        return self.schedule.workers

    def grid(self) -> GridLayout | None:
        """The regular grid this plan was built as (grid_plan), for figures computed per stage
        instead of per worker; None for any other plan, or once its holds, partition or stage
        counts were replaced (dataclasses.replace)."""
        g = self._grid
        if g is None or g.holds is not self.holds or g.partition is not self.partition \
                or g.stages is not self.schedule.stages:
            return None
        return g

    def layers(self, pipeline: int, stage: int) -> LayerRange:
        return self.partition[pipeline][stage]

    def is_last_stage(self, pipeline: int, stage: int) -> bool:
        return stage == self.schedule.stages[pipeline] - 1

    @property
    def shape(self) -> str:
        """'pp=4 dp=2' (stage counts per pipeline when pipelines differ)."""
        stages = set(self.schedule.stages)
        pp = stages.pop() if len(stages) == 1 else "/".join(map(str, self.schedule.stages))
        return f"pp={pp} dp={len(self.schedule.stages)}"

    def on_workers(self, workers: list[int], node_of) -> "Plan":
        """The same plan with grid worker i placed on `workers[i]` (survivors, after a reshape)."""
        old = self.workers
        if len(workers) < len(old):
            raise ValueError(f"{len(old)} workers needed, {len(workers)} given")
        to = dict(zip(old, workers))
        current = self.schedule.ops
        ops = current.renamed(to) if isinstance(current, GridOps) else {to[w]: ops for w, ops in current.items()}
        schedule = Schedule(ops, self.schedule.stages, self.schedule.microbatches, self.schedule.name)
        return Plan(schedule=schedule, partition=self.partition,
                    holds={to[w]: h for w, h in self.holds.items()},
                    node_of={to[w]: node_of(to[w]) for w in old}, name=self.name,
                    staggered_optimizer=self.staggered_optimizer, logged=self.logged)

    def with_logging(self, logged) -> "Plan":
        """The same plan with these boundaries logged (its grid layout kept: the same objects)."""
        plan = Plan(schedule=self.schedule, partition=self.partition, holds=self.holds, node_of=self.node_of,
                    name=self.name, staggered_optimizer=self.staggered_optimizer, logged=frozenset(logged))
        plan._grid = self._grid
        return plan

    def key(self) -> tuple:
        """Hashable identity (the simulator memoises per key). The per-worker parts are packed
        into bytes: exact, and small next to thousands of tuples."""
        if self._key is None:
            grid = self.grid()
            holds = _pack_grid_holds(grid) if grid is not None else None
            self._key = (self.schedule.key(), self.partition, holds or _pack_holds(self.holds),
                         _pack_nodes(self.node_of), self.staggered_optimizer, tuple(sorted(self.logged)))
        return self._key


def _by_worker(mapping: dict) -> dict:
    """`mapping` in worker order (as it usually is already)."""
    workers = list(mapping)
    return mapping if workers == sorted(workers) else {w: mapping[w] for w in sorted(workers)}


def _pack_nodes(node_of: dict) -> bytes | tuple:
    """worker -> node, by worker, as bytes (exact for integers)."""
    node_of = _by_worker(node_of)
    try:
        return b"n" + array("q", node_of).tobytes() + array("q", node_of.values()).tobytes()
    except (TypeError, OverflowError):  # not plain integers: keep them as they are
        return tuple(node_of.items())


def _pack_holds(holds: dict) -> bytes | tuple:
    """worker -> its (pipeline, stage) replicas, by worker, as bytes: the workers, how many
    replicas each, then every pipeline and stage (exact for integers)."""
    holds = _by_worker(holds)
    try:
        return b"h" + b"|".join((array("q", [len(holds)]).tobytes(), array("q", holds).tobytes(),
                                 array("q", map(len, holds.values())).tobytes(),
                                 array("q", chain.from_iterable(chain.from_iterable(holds.values()))).tobytes()))
    except (TypeError, OverflowError):
        return tuple(holds.items())


def _pack_grid_holds(grid: GridLayout) -> bytes | None:
    """_pack_holds(grid.holds) when the grid's workers are in increasing order (then its
    holds are already by worker, and their replicas are (0, 0), (0, 1), ...), from the
    shared tables; None otherwise."""
    workers = grid.workers
    if workers != sorted(workers):
        return None
    n = len(workers)
    try:
        ids = array("q", workers).tobytes()
    except (TypeError, OverflowError):
        return None
    return b"h" + b"|".join((array("q", [n]).tobytes(), ids, (array("q", [1]) * n).tobytes(),
                             _grid_tables(grid.pp, n // grid.pp)[1][:16 * n]))


# Per pp, the grid's replicas in grid order, as far as the largest dp asked for so far: the
# tuples are shared by every grid plan, so none is built (nor freed) per plan and worker.
_REPLICAS: dict[int, list[tuple[tuple[int, int]]]] = {}  # pp -> ((d, s),) in grid order
_PAIRS: dict[int, bytes] = {}  # pp -> d, s in grid order, as _pack_holds packs them
# Per pipeline's row of template ids, its records (template id, pipeline) in grid order.
_RECORDS: dict[tuple[int, ...], list[tuple[int, int]]] = {}


def _grid_tables(pp: int, dp: int) -> tuple[list, bytes]:
    """(_REPLICAS[pp], _PAIRS[pp]), extended to at least dp pipelines."""
    replicas = _REPLICAS.setdefault(pp, [])
    have = len(replicas) // pp
    if have < dp:
        replicas.extend(((d, s),) for d in range(have, dp) for s in range(pp))
        _PAIRS[pp] = array("q", chain.from_iterable(chain.from_iterable(replicas))).tobytes()
    return replicas, _PAIRS[pp]


def grid_replicas(pp: int, dp: int) -> list[tuple[tuple[int, int]]]:
    """Grid worker w -> ((pipeline, stage),) of the regular pp x dp grid (w = pipeline * pp +
    stage): holds tuples shared by every plan, as long as the list is not changed."""
    return _grid_tables(pp, dp)[0]


def _records(row: tuple[int, ...], first: int, end: int) -> list[tuple[int, int]]:
    """The records of pipelines first..end-1 whose workers run the templates `row`."""
    records = _RECORDS.setdefault(row, [])
    have = len(records) // len(row)
    if have < end:
        records.extend((tid, d) for d in range(have, end) for tid in row)
    return records[first * len(row):end * len(row)]


@lru_cache(maxsize=64)
def _template_rows(generator: str, pp: int, counts: tuple[int, ...]) -> tuple[Schedule, dict] | None:
    """generate(generator, pp, counts, len(counts)), one pipeline per distinct micro-batch
    count, and count -> the template ids its pipeline's workers run (in stage order); None
    unless it is a generated grid in which the worker at place s steps exactly stage s."""
    one = generate(generator, pp, counts, len(counts))
    ops = one.ops
    if not isinstance(ops, GridOps) or ops.regular() != pp or len(ops.of) != pp * len(counts):
        return None
    if list(holds_from_schedule(one).values()) != _grid_tables(pp, len(counts))[0][:pp * len(counts)]:
        return None
    records = list(ops.of.values())
    rows = {}
    for k, count in enumerate(counts):
        run = records[k * pp:(k + 1) * pp]
        if any(d != k for _, d in run):
            return None
        rows[count] = tuple(tid for tid, _ in run)
    return one, rows


def holds_from_schedule(schedule: Schedule) -> dict[int, tuple[tuple[int, int], ...]]:
    """By default a worker keeps the state of every replica it steps the optimizer of."""
    ops = schedule.ops
    if isinstance(ops, GridOps):  # from the templates, without building the ops
        steps = [tuple((op[1], op[3] if len(op) == 4 else 0) for op in t if op[0] == OPT) for t in ops.templates]
        out, given = {}, ops._lists
        for w, (tid, d) in ops.of.items():
            if w in given:
                out[w] = tuple((op.pipeline, op.stage) for op in given[w] if op.kind == OPT)
            elif type(d) is int:
                stages = steps[tid]
                out[w] = ((d, stages[0][0]),) if len(stages) == 1 else tuple((d, s) for s, _ in stages)
            else:  # a bound template (PartFlows): local pipeline p is d.pipelines[p]
                out[w] = tuple((d.pipelines[p], s) for s, p in steps[tid])
        return out
    return {w: tuple((op.pipeline, op.stage) for op in ops if op.kind == OPT)
            for w, ops in schedule.ops.items()}


def grid_plan(schedule: Schedule, stage_layers: tuple[LayerRange, ...], pp: int,
              gpus_per_node: int, name: str = "", node_of=None, workers: list[int] | None = None) -> Plan:
    """The regular pp x dp grid: worker = pipeline * pp + stage, on the node `node_of(worker)`
    gives (default: the pipeline placement, node = worker // gpus_per_node). With `workers`,
    grid worker i runs on workers[i] instead (and node_of is asked about workers[i]): the
    same plan as `grid_plan(...).on_workers(workers, node_of)`, built in one go."""
    dp = len(schedule.stages)
    if workers is not None:
        if len(workers) < dp * pp:
            raise ValueError(f"{dp * pp} workers needed, {len(workers)} given")
        to = dict(zip(range(dp * pp), workers))
        ops = schedule.ops
        ops = ops.renamed(to) if isinstance(ops, GridOps) else {to[w]: o for w, o in ops.items()}
        schedule = Schedule(ops, schedule.stages, schedule.microbatches, schedule.name)
    placed = range(dp * pp) if workers is None else workers[:dp * pp]  # in grid order
    partition, holds = (stage_layers,) * dp, holds_from_schedule(schedule)
    grid = None
    if dp and schedule.stages.count(pp) == dp and list(holds.values()) == _grid_tables(pp, dp)[0][:dp * pp]:
        grid = GridLayout(pp, list(holds), holds, partition, schedule.stages)
    return Plan(schedule=schedule, partition=partition, holds=holds,
                node_of={w: node_of(w) for w in placed} if node_of else {w: w // gpus_per_node for w in placed},
                name=name or schedule.name, _grid=grid)


def generated_grid_plan(generator: str, pp: int, microbatches: tuple[int, ...], stage_layers: tuple[LayerRange, ...],
                        workers: list[int], node_of) -> Plan:
    """grid_plan(generate(generator, pp, microbatches, dp), stage_layers, pp, ..., node_of=node_of,
    workers=workers), dp = len(microbatches), built without a Python loop per worker (Elastic
    Horovod and Varuna place tens of thousands after every failure at scale): the templates
    come from one pipeline per distinct micro-batch count, and every pipeline's records and
    replicas are slices of tables shared by all plans."""
    dp, counts = len(microbatches), tuple(microbatches)
    placed = list(workers[:dp * pp])
    kinds = tuple(sorted(set(counts)))
    known = _template_rows(generator, pp, kinds) if kinds and kinds[0] >= 1 else None
    holds = dict(zip(placed, _grid_tables(pp, dp)[0])) if known is not None else {}
    if known is None or len(holds) < dp * pp:  # (too few workers, or one named twice): as grid_plan has it
        return grid_plan(generate(generator, pp, counts, dp), stage_layers, pp, 1, node_of=node_of, workers=workers)
    one, rows = known
    first = 0  # pipelines with equal counts in a row share one slice of records
    runs = []
    for d in range(1, dp + 1):
        if d == dp or counts[d] != counts[first]:
            runs.append(_records(rows[counts[first]], first, d))
            first = d
    schedule = Schedule(GridOps(one.ops.templates, dict(zip(placed, chain.from_iterable(runs))), run=pp),
                        stages=(pp,) * dp, microbatches=counts, name=one.name)
    partition = (stage_layers,) * dp
    return Plan(schedule=schedule, partition=partition, holds=holds, node_of={w: node_of(w) for w in placed},
                name=schedule.name, _grid=GridLayout(pp, placed, holds, partition, schedule.stages))


def checkpoint_writers(plan: Plan) -> dict[int, int]:
    """stage -> the worker that writes its shard: one replica per stage, taken from a
    different pipeline for each stage so the writes spread over nodes (as distributed
    checkpointing does) instead of all landing on pipeline 0's nodes."""
    grid = plan.grid()
    if grid is not None and grid.workers == sorted(grid.workers):
        # stage s is held by workers[d * pp + s], d = 0, 1, ..., already in worker order
        pp, workers = grid.pp, grid.workers
        dp = len(workers) // pp
        return {stage: workers[stage % dp * pp + stage] for stage in range(pp)}
    holders: dict[int, list[int]] = defaultdict(list)
    for w in sorted(plan.holds):
        for _, stage in plan.holds[w]:
            holders[stage].append(w)
    return {stage: ws[stage % len(ws)] for stage, ws in sorted(holders.items())}


def pipelines_plan(generator: str, pipelines: list[tuple[list[int], tuple[LayerRange, ...], int]], node_of,
                   name: str = "") -> Plan:
    """Heterogeneous pipelines (Oobleck): pipeline d runs on `workers` (one per stage, in stage
    order) with its own layer cut and micro-batch count, each under `generator`'s order; the
    pipelines share one global batch (pipeline d's micro-batches follow pipeline d-1's)."""
    ops: dict[int, list] = {}
    stages, counts, partition = [], [], []
    for d, (workers, cut, microbatches) in enumerate(pipelines):
        if len(workers) != len(cut):
            raise ValueError(f"pipeline {d}: {len(cut)} stages on {len(workers)} workers")
        one = generate(generator, len(cut), microbatches)
        read = read_ops(one)
        for s, w in enumerate(workers):
            if w in ops:
                raise ValueError(f"worker {w} is in two pipelines")
            ops[w] = [op._replace(pipeline=d) for op in read(grid_worker(0, s, len(cut)))]
        stages.append(len(cut))
        counts.append(microbatches)
        partition.append(tuple(cut))
    schedule = Schedule(ops, stages=tuple(stages), microbatches=tuple(counts), name=generator)
    return Plan(schedule=schedule, partition=tuple(partition), holds=holds_from_schedule(schedule),
                node_of={w: node_of(w) for w in ops}, name=name or generator)
