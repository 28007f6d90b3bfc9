"""A plan: which worker holds which layers, where workers sit, and the iteration's schedule.

Strategies produce plans; backends execute them. A plan is data, so it can be hashed
(the simulator memoises per plan), drawn, validated and compared.
"""
from __future__ import annotations

import pickle
import weakref
from array import array
from collections import defaultdict
from itertools import accumulate, chain, compress, repeat
from dataclasses import dataclass, field
from functools import lru_cache
from operator import is_not, ne, or_

from ftbench.schedule import OPT, GridOps, Schedule, generate, grid_worker, int64_bytes, key_bytes, read_ops

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
    node_of: dict | None = None  # the plan's node_of, as its builder made it from `nodes`:
    nodes: list[int] | None = None  # the node of each of `workers` (None: not kept)

    def node_list(self, node_of: dict) -> list[int]:
        """node_of[w] for each of `workers`: the builder's list while node_of is its dict."""
        if self.nodes is not None and self.node_of is node_of:
            return self.nodes
        return list(map(node_of.__getitem__, self.workers))


@dataclass(eq=False)
class PipelinesLayout:
    """A plan built by pipelines_plan (Oobleck's heterogeneous pipelines): pipeline d runs on
    workers[bounds[d]:bounds[d + 1]] in stage order, each worker keeping exactly its own
    stage ((d, s),) and running the order of its stage in one generated pipeline of its
    stage and micro-batch counts. Lets the simulator time such a plan from one pipeline of
    each kind (ftbench.sim.pipelines) without looking at every worker's ops."""
    workers: list[int]
    bounds: list[int]
    records: dict  # the objects it describes (Plan.pipelines checks they are still the plan's):
    size: int  # the GridOps records, with this many workers,
    holds: dict
    partition: tuple
    stages: tuple[int, ...]
    lists: list[list[int]]  # each pipeline's workers (workers, cut up), as pipelines_plan was given them
    counts: tuple[int, ...]  # each pipeline's micro-batches
    # Made from an earlier plan's layout (pipelines_plan's `like`): it (a weak reference, or
    # None), and the pipelines that differ from its own at the same index (workers, shape, or
    # cut object; every other is the same), for readers that update what they found for it.
    parent: weakref.ref | None = None
    changed: list[int] | None = None

    def changed_from(self, earlier: "PipelinesLayout") -> list[int] | None:
        """The pipelines that differ from `earlier`'s at the same index, where this layout was
        made from it; None otherwise."""
        return self.changed if self.parent is not None and self.parent() is earlier else None


@dataclass(eq=False)
class SameTiming:
    """Says that a plan times out as `reference` does, its worker w as the reference's worker
    renamed.get(w, w): the same iteration time and per-worker figures (ftbench.sim.cache). The
    plan's workers are the reference's but `absent`, in the same order. It holds for the plan
    whose schedule, holds and node_of it was made with, and is ignored once one is replaced."""
    reference: "Plan"
    renamed: dict  # the plan's worker -> the reference's, where they differ
    absent: frozenset  # the reference's workers that the plan does not have
    schedule: object
    holds: object
    node_of: object

    def applies_to(self, plan: "Plan") -> bool:
        return plan.schedule is self.schedule and plan.holds is self.holds and plan.node_of is self.node_of


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
    # Replicas of `holds` kept in host memory, not on the device, as (worker, pipeline, stage):
    # held (and kept in step) all the same, but the device's memory does not count them
    # (Bamboo's lazy copy of the next stage; ftbench.costs.PlanCosts.static_bytes).
    host: frozenset = frozenset()
    # Per pipeline, its first micro-batch in the iteration's sample numbering (ftbench.samples);
    # None: consecutive, pipeline by pipeline. Replica groups that go on while others are out
    # (torchft) keep their own samples.
    sample_offsets: tuple[int, ...] | None = None
    # SameTiming: a plan that times out exactly as this one, worker for worker renamed (ReCycle's
    # plans renamed onto the real workers); the simulator's cache times that one once instead
    same_timing: object = field(default=None, repr=False, compare=False)
    _key: tuple | None = field(default=None, repr=False, compare=False)
    _grid: GridLayout | None = field(default=None, repr=False, compare=False)  # see grid()
    _pipelines: PipelinesLayout | None = field(default=None, repr=False, compare=False)  # see pipelines()

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

    def pipelines(self) -> PipelinesLayout | None:
        """The heterogeneous pipelines this plan was built as (pipelines_plan); None for any
        other plan, or once its ops, holds, partition or stage counts were replaced or a
        worker's op list was handed out (it may have been changed)."""
        p, ops = self._pipelines, self.schedule.ops
        if p is None or p.holds is not self.holds or p.partition is not self.partition \
                or p.stages is not self.schedule.stages or not isinstance(ops, GridOps) or ops.of is not p.records \
                or len(ops.of) != p.size or ops._lists:
            return None
        return p

    def nodes(self) -> frozenset:
        """The nodes it runs on, kept (a plan is not changed once made; the run loop and the
        strategy both ask, for 16,384 workers after each failure at scale)."""
        found = self.__dict__.get("_nodes")
        if found is None or found[0] is not self.node_of:
            found = self._nodes = (self.node_of, frozenset(self.node_of.values()))
        return found[1]

    def layers(self, pipeline: int, stage: int) -> LayerRange:
        return self.partition[pipeline][stage]

    def is_last_stage(self, pipeline: int, stage: int) -> bool:
        return stage == self.schedule.stages[pipeline] - 1

    @property
    def shape(self) -> str:
        """'pp=4 dp=2' (stage counts per pipeline when pipelines differ)."""
        return _shape(tuple(self.schedule.stages))

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
                    staggered_optimizer=self.staggered_optimizer, logged=self.logged,
                    host=frozenset((to[w], d, s) for w, d, s in self.host), sample_offsets=self.sample_offsets)

    def with_logging(self, logged) -> "Plan":
        """The same plan with these boundaries logged (its grid layout kept: the same objects)."""
        plan = Plan(schedule=self.schedule, partition=self.partition, holds=self.holds, node_of=self.node_of,
                    name=self.name, staggered_optimizer=self.staggered_optimizer, logged=frozenset(logged),
                    host=self.host, sample_offsets=self.sample_offsets)
        plan._grid = self._grid
        return plan

    def key(self) -> tuple:
        """Hashable identity (the simulator memoises per key). The per-worker parts are packed
        into bytes: exact, and small next to thousands of tuples."""
        if self._key is None and self.pipelines() is not None:
            self._key = _pipelines_key(self, self.pipelines())
        if self._key is None:
            grid = self.grid()
            holds = _pack_grid_holds(grid) if grid is not None else None
            nodes = _pack_grid_nodes(grid, self.node_of) if holds is not None else None
            holds = holds or _pack_replica_holds(self.holds, self.schedule.stages) or _pack_holds(self.holds)
            self._key = (self.schedule.key(), self.partition, holds,
                         nodes or _pack_nodes(self.node_of), self.staggered_optimizer, tuple(sorted(self.logged)))
            if self.host:
                self._key += (tuple(sorted(self.host)),)
        return self._key


def _pipelines_key(plan: Plan, layout: PipelinesLayout) -> tuple | None:
    """Plan.key of a plan of pipelines_plan, from what fixes its ops, holds and placement:
    the generator, each pipeline's stage and micro-batch counts and cut (by index into its
    distinct cuts), its workers in stage order, and node_of (its workers and their nodes, in
    its order); None where these cannot be packed (then the usual key)."""
    schedule, partition = plan.schedule, plan.partition
    ids = list(map(id, partition))
    cuts: dict[tuple, int] = {}  # distinct cuts (by content) -> their index
    index = {i: cuts.setdefault(partition[ids.index(i)], len(cuts)) for i in dict.fromkeys(ids)}
    try:
        shape = key_bytes((schedule.name, schedule.stages, schedule.microbatches, tuple(cuts)))
        # pickled lists (of integers): exact, and made in bulk (array() converts one by one)
        packed = [pickle.dumps(part, 5) for part in (layout.workers, list(plan.node_of), list(plan.node_of.values()),
                                                      list(map(index.__getitem__, ids)))]
    except (ValueError, TypeError, AttributeError, pickle.PicklingError):
        return None
    return ("pipelines", shape, *packed, plan.staggered_optimizer, tuple(sorted(plan.logged)))


@lru_cache(maxsize=16)
def _shape(stages: tuple[int, ...]) -> str:
    """Plan.shape (kept: a run's records name the shape of each plan a few times, and Oobleck's
    plans have thousands of pipelines)."""
    distinct = set(stages)
    pp = distinct.pop() if len(distinct) == 1 else "/".join(map(str, stages))
    return f"pp={pp} dp={len(stages)}"


def _by_worker(mapping: dict) -> dict:
    """`mapping` in worker order (as it usually is already)."""
    workers = list(mapping)
    return mapping if workers == sorted(workers) else {w: mapping[w] for w in sorted(workers)}


def _pack_nodes(node_of: dict) -> bytes | tuple:
    """worker -> node, by worker, as bytes (exact for integers)."""
    node_of = _by_worker(node_of)
    try:
        return b"n" + int64_bytes(list(node_of)) + int64_bytes(list(node_of.values()))
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


def _pack_replica_holds(holds: dict, stages: tuple[int, ...]) -> bytes | None:
    """_pack_holds(holds) where workers 0 .. n - 1, in order, each hold their grid replica (as
    ReCycle's reference plans at scale do, the canonically failed workers idle): from the
    shared tables, without a pass over each worker's tuples; None otherwise."""
    n = len(holds)
    if not n or not stages or stages.count(stages[0]) != len(stages) or n > stages[0] * len(stages):
        return None
    pp = stages[0]
    replicas, pairs = _grid_tables(pp, -(-n // pp))
    if list(holds) != list(range(n)) or list(holds.values()) != replicas[:n]:
        return None
    return b"h" + b"|".join((array("q", [n]).tobytes(), array("q", range(n)).tobytes(),
                             (array("q", [1]) * n).tobytes(), pairs[:16 * n]))


def _pack_grid_holds(grid: GridLayout) -> bytes | None:
    """_pack_holds(grid.holds) when the grid's workers are in increasing order (then its
    holds are already by worker, and their replicas are (0, 0), (0, 1), ...), from the
    shared tables; None otherwise."""
    workers = grid.workers
    if workers != sorted(workers):
        return None
    n = len(workers)
    try:
        ids = int64_bytes(workers)
    except (TypeError, OverflowError):
        return None
    return b"h" + b"|".join((array("q", [n]).tobytes(), ids, (array("q", [1]) * n).tobytes(),
                             _grid_tables(grid.pp, n // grid.pp)[1][:16 * n]))


def _pack_grid_nodes(grid: GridLayout, node_of: dict) -> bytes | None:
    """_pack_nodes(node_of) of a grid whose workers are in increasing order (as
    _pack_grid_holds found them), from the nodes its builder kept when node_of is the
    builder's dict (its keys are the workers, in order); None otherwise."""
    if grid.nodes is None or grid.node_of is not node_of:
        return None
    try:
        return b"n" + int64_bytes(grid.workers) + int64_bytes(grid.nodes)
    except (TypeError, OverflowError):
        return None


# Per pp, the grid's replicas in grid order, as far as the largest dp asked for so far: the
# tuples are shared by every grid plan, so none is built (nor freed) per plan and worker.
_REPLICAS: dict[int, list[tuple[tuple[int, int]]]] = {}  # pp -> ((d, s),) in grid order
_PAIRS: dict[int, bytes] = {}  # pp -> d, s in grid order, as _pack_holds packs them
# Per pipeline's row of template ids, its records (template id, pipeline) in grid order.
_RECORDS: dict[tuple[int, ...], list[tuple[int, int]]] = {}
_PACKED: dict[tuple[int, ...], bytes] = {}  # the same, packed as Schedule.key packs records


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


def _packed_records(row: tuple[int, ...], first: int, end: int) -> bytes:
    """_records(row, first, end) (called first) packed as Schedule.key packs them, a slice of
    one table per row: a plan's key packs no record of its own."""
    records, packed = _RECORDS[row], _PACKED.get(row)
    if packed is None or len(packed) < 16 * len(records):
        packed = _PACKED[row] = array("q", chain.from_iterable(records)).tobytes()
    return packed[16 * first * len(row):16 * end * len(row)]


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
    runs, packed = [], []
    for d in range(1, dp + 1):
        if d == dp or counts[d] != counts[first]:
            runs.append(_records(rows[counts[first]], first, d))
            packed.append(_packed_records(rows[counts[first]], first, d))
            first = d
    ops = GridOps(one.ops.templates, _same_keys(holds, zip(placed, chain.from_iterable(runs))), run=pp,
                  packed=b"".join(packed), plain=True)
    schedule = Schedule(ops, stages=(pp,) * dp, microbatches=counts, name=one.name)
    partition = (stage_layers,) * dp
    nodes = list(map(node_of, placed))
    nodes_of = _same_keys(holds, zip(placed, nodes))
    return Plan(schedule=schedule, partition=partition, holds=holds, node_of=nodes_of, name=schedule.name,
                _grid=GridLayout(pp, placed, holds, partition, schedule.stages, nodes_of, nodes))


def _same_keys(like: dict, pairs) -> dict:
    """dict(pairs) for pairs whose keys are exactly those of `like`, in its order: a copy of
    `like` updated, which at 16,384 workers takes half the time of building a dict."""
    out = like.copy()
    out.update(pairs)
    return out


def host_groups(nodes, size: int) -> list[tuple[int, ...]]:
    """Gemini's group placement (Wang et al., SOSP 2023): the job's nodes, in order,
    cut into groups of `size`; every node of a group holds the checkpoints of all its members
    in host memory. Where the nodes do not divide evenly the last few join the group before
    them (the paper's mixed placement puts them in a ring instead; either way each node's
    checkpoint is on at least `size` nodes). Fewer nodes than `size`: one group of them all."""
    nodes = sorted(set(nodes))
    if size < 1:
        raise ValueError(f"a placement group has at least 1 node, got {size}")
    groups = [tuple(nodes[k:k + size]) for k in range(0, len(nodes), size)]
    if len(groups) > 1 and len(groups[-1]) < size:
        last = groups.pop()
        groups[-1] += last
    return groups


def checkpoint_writers(plan: Plan, alive=None) -> dict[int, int]:
    """stage -> the worker that writes its shard: one replica per stage, taken from a
    different pipeline for each stage so the writes spread over nodes (as distributed
    checkpointing does) instead of all landing on pipeline 0's nodes.

    `alive` (a predicate on workers, or None: all): the writers of a save made after a
    failure, before anything is rebuilt (just-in-time checkpoints): a stage whose usual
    writer died is written by the next live replica of it in the same order; a stage with
    no live replica is left out (the caller decides what that means)."""
    grid = plan.grid()
    if alive is None and grid is not None and grid.workers == sorted(grid.workers):
        # stage s is held by workers[d * pp + s], d = 0, 1, ..., already in worker order
        pp, workers = grid.pp, grid.workers
        dp = len(workers) // pp
        return {stage: workers[stage % dp * pp + stage] for stage in range(pp)}
    holders: dict[int, list[int]] = defaultdict(list)
    for w in sorted(plan.holds):
        for _, stage in plan.holds[w]:
            holders[stage].append(w)
    if alive is None:
        return {stage: ws[stage % len(ws)] for stage, ws in sorted(holders.items())}
    out = {}
    for stage, ws in sorted(holders.items()):
        first = stage % len(ws)
        live = next((w for w in ws[first:] + ws[:first] if alive(w)), None)
        if live is not None:
            out[stage] = live
    return out


def pipelines_plan(generator: str, pipelines: list[tuple[list[int], tuple[LayerRange, ...], int]], node_of,
                   name: str = "", like: Plan | None = None) -> Plan:
    """Heterogeneous pipelines (Oobleck): pipeline d runs on `workers` (one per stage, in stage
    order) with its own layer cut and micro-batch count, each under `generator`'s order; the
    pipelines share one global batch (pipeline d's micro-batches follow pipeline d-1's).

    The ops are held lazily (GridOps): a worker's order is that of its stage in one pipeline
    of its stage and micro-batch counts, made once per such pipeline, so a plan over
    thousands of pipelines (one after every failure at scale) builds no op.

    `like`: an earlier plan of pipelines_plan, whose node_of agrees with `node_of` on every
    worker both have. Where the pipelines are like's, in the same order, each on the same
    workers or on its workers less some (Oobleck after most failures: one pipeline shorter,
    a few micro-batch counts moved), the plan is like's tables copied and changed only at the
    pipelines that differ: the same plan, tables in the same order, without a pass over every
    worker."""
    lists, cuts, counts = map(list, zip(*pipelines)) if pipelines else ([], [], [])
    return pipelines_plan_of(generator, lists, cuts, counts, node_of, name, like)


def pipelines_plan_of(generator: str, lists: list[list[int]], cuts: list[tuple[LayerRange, ...]], counts, node_of,
                      name: str = "", like: Plan | None = None) -> Plan:
    """pipelines_plan with the pipelines given as columns: each one's workers, cut and
    micro-batch count."""
    stages, counts = tuple(map(len, cuts)), tuple(counts)
    if list(map(len, lists)) != list(stages):
        _first_error(list(zip(lists, cuts, counts)))
    partition = tuple(map(tuple, cuts))
    tables = _tables_like(like, generator, lists, stages, counts, partition) if like is not None else None
    parent = changed = None
    if tables is None:
        shapes = list(zip(stages, counts))
        templates, rows = _numbered_orders(generator, dict.fromkeys(shapes))
        lists = list(map(list, lists))  # kept by the layout: the caller's may change
        workers = list(chain.from_iterable(lists))
        # (template id, pipeline) per worker, and its kept replica ((pipeline, stage),), pipeline by pipeline
        records = map(zip, map(rows.__getitem__, shapes), map(repeat, range(len(shapes))))
        of = dict(zip(workers, chain.from_iterable(records)))
        if len(of) != len(workers):
            _first_error(list(zip(lists, cuts, counts)))
        holds = dict(zip(workers, chain.from_iterable(map(_own_replicas, range(len(stages)), stages))))
        placed = dict(zip(workers, map(node_of, workers)))
    else:
        templates, workers, of, holds, placed, changed, lists = tables
        parent = weakref.ref(like.pipelines())
    schedule = Schedule(GridOps(templates, of), stages=stages, microbatches=counts, name=generator)
    layout = PipelinesLayout(workers, [0, *accumulate(stages)], of, len(of), holds, partition, stages, lists, counts,
                             parent, changed)
    return Plan(schedule=schedule, partition=partition, holds=holds, node_of=placed, name=name or generator,
                _pipelines=layout)


def _tables_like(like: Plan, generator: str, lists: list[list[int]], stages: tuple[int, ...], counts: tuple[int, ...],
                 partition: tuple) -> tuple | None:
    """(orders, workers, records, holds, node_of, the pipelines that differ, each pipeline's
    workers) of pipelines_plan made from `like`'s (see there); None where the pipelines are
    not like's, each the same or less some workers, or the orders were numbered again."""
    was = like.pipelines()
    if was is None or like.schedule.name != generator or len(was.lists) != len(lists):
        return None
    differ = map(or_, map(or_, map(ne, lists, was.lists), map(ne, stages, was.stages)),  # (in bulk: thousands)
                 map(or_, map(ne, counts, was.counts), map(is_not, partition, like.partition)))
    changed = list(compress(range(len(lists)), differ))
    templates, rows = _numbered_orders(generator, [(stages[d], counts[d]) for d in changed])
    numbered = like.schedule.ops.templates
    if numbered != templates[:len(numbered)]:
        return None
    workers, of, holds, placed = was.workers.copy(), was.records.copy(), was.holds.copy(), like.node_of.copy()
    for d in changed:
        now, before = lists[d], was.lists[d]
        if now != before:
            kept = set(now)
            gone = [w for w in before if w not in kept]
            if len(kept) != len(now) or len(before) - len(gone) != len(now) or [w for w in before if w in kept] != now:
                return None  # not the same workers less some, in order
            for w in gone:
                workers.remove(w)
                del of[w], holds[w], placed[w]
            holds.update(zip(now, _own_replicas(d, len(now))))
        of.update(zip(now, zip(rows[(stages[d], counts[d])], repeat(d))))
    kept_lists = was.lists.copy()  # like's copies where the same, copies of the caller's where not
    for d in changed:
        kept_lists[d] = list(lists[d])
    return templates, workers, of, holds, placed, changed, kept_lists


def _numbered_orders(generator: str, shapes) -> tuple[tuple, dict]:
    """(every order of pipelines of `generator` numbered so far, by id; (stages, micro-batches)
    -> the template id of each of its stages), numbering the orders of new `shapes`. Ids are
    kept from plan to plan (equal orders share one), so a plan made from an earlier one keeps
    its workers' records; past ORDERS_KEPT orders the numbering starts again."""
    orders, ids, rows = _ORDERS.setdefault(generator, ([], {}, {}))
    shapes = list(dict.fromkeys(shapes))
    new = [shape for shape in shapes if shape not in rows]
    if new and len(orders) > ORDERS_KEPT:
        orders.clear(), ids.clear(), rows.clear()
        new = shapes
    for shape in new:
        row = []
        for order in _pipeline_orders(generator, *shape):
            if order not in ids:
                ids[order] = len(orders)
                orders.append(order)
            row.append(ids[order])
        rows[shape] = tuple(row)
    return tuple(orders), rows


ORDERS_KEPT = 2048
_ORDERS: dict[str, tuple[list, dict, dict]] = {}  # generator -> (orders by id, order -> id, shape -> row)


def _first_error(pipelines) -> None:
    """Raise what is wrong with the first pipeline that has too few or too many workers, or
    names a worker named before."""
    seen: set[int] = set()
    for d, (workers, cut, _) in enumerate(pipelines):
        if len(workers) != len(cut):
            raise ValueError(f"pipeline {d}: {len(cut)} stages on {len(workers)} workers")
        for w in workers:
            if w in seen:
                raise ValueError(f"worker {w} is in two pipelines")
            seen.add(w)


@lru_cache(maxsize=256)
def _pipeline_orders(generator: str, pp: int, microbatches: int) -> tuple[tuple, ...]:
    """Per stage, the order of (kind, stage, micro-batch) one pipeline of `pp` stages runs."""
    read = read_ops(generate(generator, pp, microbatches))
    return tuple(tuple((k, s, m) for k, s, m, _ in read(grid_worker(0, stage, pp))) for stage in range(pp))


@lru_cache(maxsize=1 << 16)
def _own_replicas(pipeline: int, stages: int) -> tuple[tuple[tuple[int, int]], ...]:
    """Per stage s, ((pipeline, s),): what the worker stepping it keeps (holds_from_schedule)."""
    return tuple(((pipeline, s),) for s in range(stages))
