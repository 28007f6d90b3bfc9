"""Schedule IR: the ops of one training iteration, per worker, in execution order.

An `Op` names *what* is computed (kind, stage, micro-batch, and the data-parallel pipeline
that owns the micro-batch); the `Schedule` says *who* computes it and in which order.
Dependencies are implied by the op names (see `dependencies`), so a backend needs no
strategy knowledge: it runs each worker's list in order and waits for producers.

Generators: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021) and
ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), which splits the backward into
B (input gradient) and W (weight gradient) and defers W into the cool-down bubbles.
"""
from __future__ import annotations

import marshal
import struct
from array import array
from collections import Counter, defaultdict, deque
from itertools import chain
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import lru_cache, partial
from operator import eq, itemgetter
from typing import NamedTuple

from ftbench.layers import GradientSync, Layout, stage_layout

F, B, W, BW, OPT = "F", "B", "W", "BW", "OPT"
RF, RSYNC = "RF", "RSYNC"  # Bamboo's redundant forward, and its redundant layers' refresh
NO_MICROBATCH = -1  # OPT (and RSYNC) ops act on a whole stage


class Op(NamedTuple):
    kind: str  # one of KINDS (the op-kind table below)
    stage: int
    microbatch: int  # NO_MICROBATCH for OPT
    pipeline: int  # the data-parallel replica that owns the micro-batch (or the weights, for OPT)

    def __str__(self) -> str:
        mb = "" if self.microbatch == NO_MICROBATCH else f",m{self.microbatch}"
        return f"{self.kind}(s{self.stage}{mb},p{self.pipeline})"


# Op(kind, stage, microbatch, pipeline) without the named tuple's Python-level __new__: the
# same object, built in C (for loops that build hundreds of thousands of ops).
_op = partial(tuple.__new__, Op)


class OpKind(NamedTuple):
    """One row of the op-kind table: everything a backend needs to know about a kind.

    `cost`: which of its stage's costs the op takes (ftbench.costs.PlanCosts.op_time):
    "forward", "backward_input", "backward_weight", "backward" (B + W), "step" (the
    optimizer) or "copy" (writing a stage's weights and optimizer state into memory).
    `memory`: what it does to its worker's activation memory (ftbench.sim.simulator):
    "stash" (keeps the stage's activations until the backward), "stash_to_end" (keeps them
    until the iteration ends), "unstash" (frees the stash, keeps what W needs when the
    backward is split), "unstash_weight" (frees what W needed), or "" (nothing).
    `receives`: what reaches it from the worker of the op it waits for: "boundary" (an
    activation or its gradient), "state" (a stage's weights and optimizer state) or "".
    `redundant`: it computes nothing the iteration needs (Bamboo's redundancy), so coverage
    does not count it."""
    cost: str
    memory: str
    receives: str
    redundant: bool = False


OP_KINDS: dict[str, OpKind] = {
    F: OpKind("forward", "stash", "boundary"),
    B: OpKind("backward_input", "unstash", "boundary"),
    W: OpKind("backward_weight", "unstash_weight", ""),
    BW: OpKind("backward", "unstash", "boundary"),
    OPT: OpKind("step", "", ""),
    # Bamboo: RF(s, m, d) runs stage s's forward of micro-batch m on the worker of stage s-1
    # (which holds a redundant copy of stage s), on that worker's own output; its activations
    # stay until the iteration ends, for a backward after a failover.
    RF: OpKind("forward", "stash_to_end", "", redundant=True),
    # Bamboo: RSYNC(s, -, d) loads the weights and optimizer state that stage s's worker sends
    # after its step into the redundant copy its predecessor holds.
    RSYNC: OpKind("copy", "", "state", redundant=True),
}
KINDS = tuple(OP_KINDS)
REDUNDANT = frozenset(k for k, row in OP_KINDS.items() if row.redundant)


class ScheduleError(ValueError):
    """A schedule that cannot be executed: missing, duplicated or deadlocking ops."""


Template = tuple[tuple, ...]  # one worker's order: (kind, stage, micro-batch) per op, or bound (see PartFlows)


class PartFlows(NamedTuple):
    """The real flows of a *part* whose workers run bound templates: a bound template's ops are
    (kind, stage, j, p), micro-batch j of local pipeline p, and for its worker local pipeline
    p is `pipelines[p]` and its micro-batch j is `microbatches[p][j]`. The workers of one part
    share one PartFlows object, and a part runs every op of the flows it names (ReCycle: a
    peer pipeline with the micro-batches re-routed to it), so parts of one shape share their
    templates however many there are."""
    pipelines: tuple[int, ...]
    microbatches: tuple[tuple[int, ...], ...]


def identity(n: int) -> tuple[int, ...]:
    """(0, 1, ..., n-1), one shared tuple per n: the micro-batches of a whole local pipeline."""
    found = _IDENTITY.get(n)
    if found is None:
        found = _IDENTITY[n] = tuple(range(n))
    return found


_IDENTITY: dict[int, tuple[int, ...]] = {}


def bound_flows(template, flows: PartFlows) -> list:
    pipes, mbs = flows
    return [_op((k, s, j if j == NO_MICROBATCH else mbs[p][j], pipes[p])) for k, s, j, p in template]


class GridOps(MutableMapping):
    """`Schedule.ops` of a generated grid, built lazily: each worker runs one *template* (a
    fixed order of (kind, stage, micro-batch)) for one pipeline, so thousands of identical
    pipelines cost one small record per worker until someone reads a worker's list.

    Reading `ops[w]` builds the worker's list of Ops once and hands out that list (a caller
    may change it, as with a plain dict). Readers that only look (the simulator, keys,
    coverage) use `form(w)`, which says (template, pipeline) for a worker whose list was never
    handed out, and `read(w)`, which builds the ops without handing them out.
    """

    def __init__(self, templates: tuple[Template, ...], of: dict[int, tuple[int, int | PartFlows]],
                 lists: dict[int, list[Op]] | None = None, run: int | None = None, packed: bytes | None = None,
                 plain: bool | None = None):
        self.templates = templates  # template id -> its order
        # worker -> (template id, pipeline), or (template id, PartFlows) for a bound template;
        # every worker of the schedule, in order
        self.of = of
        self._parts: list | None = None
        self._lists: dict[int, list[Op]] = {} if lists is None else lists  # handed out (maybe changed)
        # A generated grid: `of` is pipelines 0, 1, ... in turn, each `run` workers in stage
        # order whose templates depend only on the pipeline's micro-batch count (None: unknown).
        self.run = run
        # Every record's (template id, pipeline), packed as Schedule.key packs them, where the
        # builder had them packed already (plan.generated_grid_plan); None once `of` changes.
        self.packed = packed
        self._plain = plain  # every record's pipeline a plain int (no PartFlows)? None: not known yet

    def __getitem__(self, w: int) -> list[Op]:
        ops = self._lists.get(w)
        if ops is None:
            ops = self._lists[w] = self._build(w)
        return ops

    def _build(self, w: int) -> list[Op]:
        tid, d = self.of[w]
        if type(d) is int:
            return [_op((k, s, m, d)) for k, s, m in self.templates[tid]]
        return bound_flows(self.templates[tid], d)

    def __setitem__(self, w: int, ops: list[Op]) -> None:
        self._lists[w] = ops
        self.packed = self._plain = None
        if w not in self.of:
            self.of[w] = (-1, -1)
            self.run = None

    def __delitem__(self, w: int) -> None:
        del self.of[w]
        self.packed = self._plain = None
        self._lists.pop(w, None)
        self.run = self._parts = None

    def split_forms(self) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """({worker: (template id, pipeline)} of the workers still held as plain templates,
        [the other workers]: lists handed out, or bound templates), for readers that take the
        plain ones by template and read the others op by op."""
        if self._plain is None:  # (checked in bulk, once: keys and coverage ask for 16,384 workers at scale)
            self._plain = set(map(type, map(itemgetter(1), self.of.values()))) <= {int}
        if not self._lists and not self._parts and self._plain:
            return self.of, []
        lazy, other = {}, []
        for w, record in self.of.items():
            if w in self._lists or type(record[1]) is not int:
                other.append(w)
            else:
                lazy[w] = record
        return lazy, other

    def set_parts(self, parts: list[tuple[PartFlows, list[tuple[int, int]]]]) -> None:
        """Give `parts()` as the builder knows it: each part's records by worker, parts by their
        first worker (the order parts() finds them in)."""
        self._parts = parts

    def parts(self) -> list[tuple[PartFlows, list[tuple[int, int]]]] | None:
        """When every worker runs a bound template and no list was handed out: the parts, as
        (their PartFlows, [(worker, template id)]) in the order first met; else None."""
        if self._lists:
            return None
        if self._parts is None:
            groups: dict[int, tuple[PartFlows, list]] = {}
            for w, (tid, flows) in self.of.items():
                if type(flows) is not PartFlows:
                    return None
                group = groups.get(id(flows))
                if group is None:
                    group = groups[id(flows)] = (flows, [])
                group[1].append((w, tid))
            self._parts = list(groups.values())
        return self._parts

    def regular(self) -> int | None:
        """`run` while it holds: a generated grid none of whose lists was handed out."""
        return None if self._lists else self.run

    def __iter__(self):
        return iter(self.of)

    def __len__(self) -> int:
        return len(self.of)

    def __contains__(self, w) -> bool:
        return w in self.of

    def __repr__(self) -> str:
        return f"GridOps({len(self.of)} workers, {len(self.templates)} templates)"

    def form(self, w: int) -> tuple[int, int] | None:
        """(template id, pipeline) of a worker whose list was never handed out, else None."""
        return None if w in self._lists else self.of[w]

    def read(self, w: int):
        """The worker's ops, for reading only (not handed out: `form` stays valid)."""
        ops = self._lists.get(w)
        return ops if ops is not None else self._build(w)

    def renamed(self, to: dict[int, int]) -> "GridOps":
        """The same ops with worker w run by to[w] (lists already handed out are shared)."""
        return GridOps(self.templates, {to[w]: f for w, f in self.of.items()},
                       {to[w]: ops for w, ops in self._lists.items()}, self.run)


def key_bytes(value) -> bytes:
    """`value` (nested tuples of numbers and strings) as bytes for a key: marshal's format 2,
    which writes equal values alike. Formats 3 and later write an object met twice as a
    back-reference only when something else also holds it, so equal keys could differ with
    what caches happen to share (seen: a grid plan's key unequal to its own rebuild's)."""
    return marshal.dumps(value, 2)


def int64_bytes(values: list) -> bytes:
    """array("q", values).tobytes() of a list of integers, packed in one call (a few times
    faster for the 16,384 workers of a plan at scale); OverflowError where a value does not
    fit (or is no integer)."""
    try:
        return struct.pack(f"{len(values)}q", *values)
    except struct.error as err:
        raise OverflowError(str(err)) from None


def read_ops(schedule: "Schedule"):
    """w -> the worker's ops for reading, without building lazily held lists for good."""
    return getattr(schedule.ops, "read", schedule.ops.__getitem__)


@dataclass
class Schedule:
    """Per worker, the ordered ops of one iteration.

    `stages[d]` and `microbatches[d]` give the shape of pipeline d, so pipelines may differ
    (heterogeneous pipelines). The optimizer step of a stage waits for the gradient syncs of
    the layer fragments it holds (ftbench.layers); without a plan's partition, stage s of the
    pipelines with the same number of stages are taken as replicas.
    """
    ops: dict[int, list[Op]]
    stages: tuple[int, ...]
    microbatches: tuple[int, ...]
    name: str = ""
    # Release times (ftbench.release.Releases, ReCycle's adapted plans): no op starts before
    # released.of(worker, op); None for every other schedule.
    released: object = field(default=None, repr=False)
    _index: dict[Op, int] | None = field(default=None, repr=False, compare=False)

    @property
    def workers(self) -> list[int]:
        return sorted(self.ops)

    def index(self) -> dict[Op, int]:
        """op -> the worker that runs it (built once; schedules are not mutated after use)."""
        if self._index is None:
            read = read_ops(self)
            self._index = {o: w for w in self.ops for o in read(w)}
        return self._index

    def worker_of(self, op: Op) -> int:
        return self.index()[op]

    def has(self, op: Op) -> bool:
        return op in self.index()

    def backward_input_op(self, stage: int, microbatch: int, pipeline: int) -> Op:
        """The op producing the input gradient of (stage, micro-batch): B if split, else BW."""
        op = Op(B, stage, microbatch, pipeline)
        return op if self.has(op) else Op(BW, stage, microbatch, pipeline)

    def key(self) -> tuple:
        """Hashable identity, for memoising simulations of the same plan. A lazily held grid
        (GridOps) is keyed by its templates and (worker, template, pipeline) records, packed
        into bytes: exact and small, without building its ops."""
        if self.released is not None:
            return ("released", self.released.key(), self._ops_key())
        return self._ops_key()

    def _ops_key(self) -> tuple:
        ops = self.ops
        parts = ops.parts() if isinstance(ops, GridOps) else None
        if parts is not None:  # bound templates: per part its flows, and (worker, template) records
            flows = _flows_bytes(parts)
            members = list(map(_second, parts))
            records = array("q", chain.from_iterable(chain.from_iterable(members)))
            sizes = array("q", list(map(len, members)))
            return ("parts", key_bytes((self.stages, self.microbatches, ops.templates)), flows,
                    sizes.tobytes(), records.tobytes())
        if isinstance(ops, GridOps):
            lazy, other = ops.split_forms()
            given = tuple((w, tuple(tuple(op) for op in ops.read(w))) for w in sorted(other))
            try:  # the records as three arrays of integers: workers, template ids, pipelines
                pairs = ops.packed if lazy is ops.of and ops.packed is not None else \
                    array("q", chain.from_iterable(lazy.values())).tobytes()
                records = b"|".join((int64_bytes(list(lazy)), pairs))
            except (TypeError, OverflowError):
                records = key_bytes(tuple(lazy.items()))
            return ("grid", key_bytes((self.stages, self.microbatches, ops.templates, given)), records)
        return (self.stages, self.microbatches,
                tuple((w, tuple(self.ops[w])) for w in self.workers))


def _flows_bytes(parts) -> bytes:
    """key_bytes of every part's flows as plain tuples, (pipelines, micro-batches per
    pipeline). Where they are tuples already (ReCycle's parts: thousands a plan at scale), each
    PartFlows made a plain tuple is that value, converted in bulk; marshal writes equal values
    alike (key_bytes), so the bytes are the same."""
    flows = list(map(_first, parts))
    pipelines, microbatches = list(map(_first, flows)), list(map(_second, flows))
    if set(map(type, pipelines)) | set(map(type, microbatches)) | set(map(type, chain.from_iterable(microbatches))) \
            <= {tuple}:
        return key_bytes(tuple(map(tuple, flows)))
    return key_bytes(tuple((tuple(f.pipelines), tuple(map(tuple, f.microbatches))) for f in flows))


def dependencies(schedule: Schedule, op: Op, layout: Layout | None = None, has=None) -> list:
    """Ops (and, for OPT, gradient syncs) that must finish before `op` may start, not counting
    the worker's own order. `layout`: the plan's fragments (default: stage_layout). `has(op)`:
    whether the schedule runs op (default `schedule.has`; a caller that knows every op of op's
    pipeline may pass a smaller index's test)."""
    kind, s, m, d = op
    last = schedule.stages[d] - 1
    if kind == F:
        return [_op((F, s - 1, m, d))] if s > 0 else []
    if kind in (B, BW):
        deps = [_op((F, s, m, d))]
        if s < last:
            if has is None:
                deps.append(schedule.backward_input_op(s + 1, m, d))
            else:
                b = _op((B, s + 1, m, d))
                deps.append(b if has(b) else _op((BW, s + 1, m, d)))
        return deps
    if kind == W:
        return [_op((B, s, m, d))]
    if kind == OPT:
        layout = layout or stage_layout(schedule.stages)
        return list(layout.of_position[(d, s)])
    if kind == RF:  # the predecessor's own forward output (stage 0: the micro-batch itself)
        return [_op((F, s - 1, m, d))] if s > 0 else []
    if kind == RSYNC:  # the stage's worker sends its state once it has stepped
        return [_op((OPT, s, NO_MICROBATCH, d))]
    raise ScheduleError(f"unknown op kind {kind!r} in {op}")


def replica_pipelines(schedule: Schedule, pipeline: int) -> list[int]:
    """Pipelines whose stages are replicas of `pipeline`'s (same stage count)."""
    return [d for d, n in enumerate(schedule.stages) if n == schedule.stages[pipeline]]


def sync_inputs(schedule: Schedule, sync: GradientSync, present=None, has=None, only=None) -> list[Op]:
    """Every op producing a weight gradient of the sync's fragment (of the `present` pipelines;
    default all): the all-reduce's inputs. `has`: as in `dependencies`. `only`: pipeline -> the
    only micro-batches of it to count (the simulator times one copy of identical parts, and
    leaves the copies' flows out)."""
    has = has or schedule.has
    ops = []
    for d, stage in sync.holders:
        if present is None or d in present:
            for m in (only.get(d, range(schedule.microbatches[d])) if only else range(schedule.microbatches[d])):
                w = _op((W, stage, m, d))
                ops.append(w if has(w) else _op((BW, stage, m, d)))
    return ops


# -- validation -------------------------------------------------------------------------

def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every micro-batch is forwarded and backpropagated exactly
    once per stage, every stage is stepped, and the per-worker order cannot deadlock."""
    check_coverage(schedule)
    topological_order(schedule, dependency_graph(schedule))


def check_coverage(schedule: Schedule) -> None:
    """The first half of `validate`: every op present exactly once, none outside the shape."""
    problems = _coverage_problems(schedule)
    if problems:
        raise ScheduleError("invalid schedule: " + "; ".join(problems[:10])
                            + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))


def _coverage_problems(schedule: Schedule) -> list[str]:
    if isinstance(schedule.ops, GridOps):
        parts = schedule.ops.parts()
        if parts is not None:
            return [] if parts_cover(schedule, parts) else part_coverage_problems(schedule, parts)
        if _grid_covered(schedule):
            return []
        if schedule.ops.split_forms()[1]:
            return _mixed_coverage_problems(schedule)
    read = read_ops(schedule)
    return _problems_of(schedule, Counter(op for w in schedule.ops for op in read(w)), range(len(schedule.stages)))


def _mixed_coverage_problems(schedule: Schedule) -> list[str]:
    """A lazy grid with some lists (ReCycle's re-routed workers): pipelines whose ops all sit
    in untouched templates are checked by template, once per distinct one, the others op by op."""
    ops = schedule.ops
    lazy, other = ops.split_forms()
    listed = {op.pipeline for w in other for op in ops.read(w)}
    templated = defaultdict(list)
    for tid, d in lazy.values():
        templated[d].append(tid)
    mixed = listed | {d for d in range(len(schedule.stages)) if d not in templated}
    checked: dict[tuple, bool] = {}
    for d, tids in templated.items():
        if d in mixed:
            continue
        key = (tuple(tids), schedule.stages[d], schedule.microbatches[d])
        if key not in checked:
            one = Schedule({i: [Op(k, s, m, 0) for k, s, m in ops.templates[t]] for i, t in enumerate(key[0])},
                           stages=(key[1],), microbatches=(key[2],))
            checked[key] = not _coverage_problems(one)
        if not checked[key]:
            return _problems_of(schedule, Counter(op for w in ops for op in ops.read(w)), range(len(schedule.stages)))
    counts = Counter(op for w in ops if w not in lazy or ops.of[w][1] in mixed for op in ops.read(w))
    stepped = {(s, d) for d in templated if d not in mixed for s in range(schedule.stages[d])}
    return _problems_of(schedule, counts, sorted(mixed), stepped)


def parts_cover(schedule: Schedule, parts) -> bool:
    """Whether part_coverage_problems finds nothing wrong with these bound parts: True only
    where it would find no problem, False where it would (then it says what). The same checks,
    with the steps gathered per shape of part and the flows counted in bulk (a large plan has
    thousands of parts and tens of thousands of flows)."""
    n = len(schedule.stages)
    stages, counts_of, templates = schedule.stages, schedule.microbatches, schedule.ops.templates
    uniform = stages.count(stages[0]) == n if n else True
    local_ok: dict[tuple, tuple[list[str], list]] = {}
    ranked: dict[tuple, tuple] = {}
    stage_rows: dict[int, tuple] = {}
    named_by: dict[int, list] = {}  # id of a shape's (problems, steps) -> the pipelines of its parts
    flow_pipes, flow_mbs = [], []
    for flows, members in parts:
        pipes, mbs = flows
        if len(set(pipes)) != len(pipes) or len(mbs) != len(pipes) or min(pipes) < 0 or max(pipes) >= n:
            return False
        tids = tuple(map(_second, members))
        order = ranked.get(tids) or ranked.setdefault(tids, tuple(sorted(tids)))
        if uniform:
            row = stage_rows.get(len(pipes)) or stage_rows.setdefault(len(pipes), tuple(map(stages.__getitem__, pipes)))
        else:
            row = tuple(map(stages.__getitem__, pipes))
        shape = (order, row, tuple(map(len, mbs)))
        found = local_ok.get(shape)
        if found is None:
            found = local_ok[shape] = _shape_coverage(templates, *shape)
            if found[0]:
                return False
            named_by[id(found)] = []
        named_by[id(found)].append(pipes)
        flow_pipes += pipes
        flow_mbs += mbs
    # each stage of each pipeline stepped once, by one of its replicas (a pipeline of its length);
    # per stage the pipelines stepping it, as plain ints (no pair per step: 16,384 at scale)
    stepped: dict[int, list[int]] = defaultdict(list)
    for found in local_ok.values():
        named = named_by[id(found)]
        for p, st in found[1]:
            stepped[st] += map(itemgetter(p), named)
    if any(len(set(ds)) != len(ds) for ds in stepped.values()):
        return False
    at = {(stages[d], st) for st, ds in stepped.items() for d in ds} if len(set(stages)) > 1 else \
        {(stages[0], st) for st in stepped}
    if any((count, st) not in at for count in set(stages) for st in range(count)):
        return False
    # every flow run once: a whole pipeline by one part, or each of its micro-batches by one
    full = list(map(eq, map(len, flow_mbs), map(counts_of.__getitem__, flow_pipes)))
    wholes, shared = set(), defaultdict(list)
    for d, ks, whole in zip(flow_pipes, flow_mbs, full):
        if whole and ks == identity(len(ks)):
            if d in wholes:
                return False
            wholes.add(d)
        else:
            shared[d] += ks
    for d, ks in shared.items():
        if d in wholes and ks or d not in wholes and sorted(ks) != list(identity(counts_of[d])):
            return False
    return len(wholes) + len(shared.keys() - wholes) == n


def part_coverage_problems(schedule: Schedule, parts) -> list[str]:
    """Coverage of bound parts (GridOps.parts): each shape (its templates, with each local
    pipeline's stage and micro-batch counts) runs each of its local flows whole, checked once
    as a small schedule; then every real flow belongs to exactly one part (a whole pipeline at
    once where a part names all of its micro-batches in order), and each stage of each
    pipeline is stepped once by one of its replicas."""
    ops, n = schedule.ops, len(schedule.stages)
    problems: list[str] = []
    local_ok: dict[tuple, tuple[list[str], list]] = {}  # shape -> (its problems, its steps (local pipeline, stage))
    ranked: dict[tuple, tuple] = {}  # a part's template ids in worker order -> sorted
    wholes, stepped_list = [], []
    flow_pipes, flow_mbs = [], []  # every part's (pipeline, micro-batches), in part order
    stages_of, counts_of = schedule.stages.__getitem__, schedule.microbatches
    uniform = schedule.stages.count(schedule.stages[0]) == n if n else True
    stage_rows: dict[int, tuple] = {}  # local pipelines -> their stage counts (every pipeline alike)
    for flows, members in parts:
        pipes, mbs = flows
        if len(set(pipes)) != len(pipes) or len(mbs) != len(pipes) or min(pipes) < 0 or max(pipes) >= n:
            problems.append(f"part of workers {[w for w, _ in members][:4]} names pipelines {pipes[:8]}: "
                            "each must be a distinct pipeline of the schedule")
            continue
        tids = tuple(map(_second, members))
        order = ranked.get(tids) or ranked.setdefault(tids, tuple(sorted(tids)))
        if uniform:
            row = stage_rows.get(len(pipes)) or stage_rows.setdefault(len(pipes), tuple(map(stages_of, pipes)))
        else:
            row = tuple(map(stages_of, pipes))
        shape = (order, row, tuple(map(len, mbs)))
        found = local_ok.get(shape)
        if found is None:
            found = local_ok[shape] = _shape_coverage(ops.templates, *shape)
        if found[0]:
            problems += found[0]
            continue
        flow_pipes += pipes
        flow_mbs += mbs
        stepped_list.extend([(pipes[p], st) for p, st in found[1]])
    # A flow list naming all of its pipeline's micro-batches in order runs it whole (counted
    # in bulk: a large plan has tens of thousands of such lists).
    full = list(map(eq, map(len, flow_mbs), map(counts_of.__getitem__, flow_pipes)))
    shared = defaultdict(list)
    for d, ks, whole in zip(flow_pipes, flow_mbs, full):
        if whole and ks == identity(len(ks)):
            wholes.append(d)
        else:
            shared[d] += ks
    whole = Counter(wholes)
    problems += [f"pipeline {d} is run whole by {times} parts" for d, times in whole.items() if times > 1]
    for d, ks in shared.items():  # pipelines whose micro-batches several parts share
        if d in whole or sorted(ks) != list(identity(counts_of[d])):
            problems += _flow_problems(d, ks, counts_of[d], whole[d])
    problems += [f"micro-batches {list(range(counts_of[d]))[:4]} of pipeline {d} are run by no part"
                 for d in range(n) if d not in whole and d not in shared]
    if len(set(stepped_list)) != len(stepped_list):
        problems += [f"{Op(OPT, st, NO_MICROBATCH, d)} appears {times} times"
                     for (d, st), times in Counter(stepped_list).items() if times > 1]
    # each stage of each pipeline stepped by one of its replicas (a pipeline of the same length)
    stepped_at = {(schedule.stages[d], st) for d, st in set(stepped_list)} if len(set(schedule.stages)) > 1 else \
        {(schedule.stages[0], st) for st in set(map(itemgetter(1), stepped_list))}
    for d, count in enumerate(schedule.stages):
        problems += [f"stage {st} of pipeline {d} has no optimizer step" for st in range(count)
                     if (count, st) not in stepped_at]
    return problems


_first, _second = itemgetter(0), itemgetter(1)


def _flow_problems(d: int, ks: list[int], count: int, whole: int) -> list[str]:
    """What is wrong with the micro-batches `ks` of pipeline d that parts name one by one
    (`whole`: how many parts run all of d as well)."""
    times = Counter(ks)
    problems = [f"micro-batch {m} of pipeline {d} is outside the schedule's shape" for m in times if not 0 <= m < count]
    problems += [f"micro-batch {m} of pipeline {d} is run by {n + whole} parts" for m, n in times.items()
                 if 0 <= m < count and n + whole > 1]
    missing = [m for m in range(count) if m not in times] if not whole else []
    if missing:
        problems.append(f"micro-batches {missing[:4]} of pipeline {d} are run by no part")
    return problems


def _shape_coverage(templates, tids, stages, microbatches) -> tuple[list[str], list[tuple[int, int]]]:
    """(problems, steps as (local pipeline, stage)) of one shape of bound part: its templates
    `tids` as a small schedule of local pipelines with these stage and micro-batch counts, in
    which every local flow must run whole (steps are checked across parts)."""
    problems, steps = _shape_problems(tuple(templates[t] for t in tids), stages, microbatches)
    return [f"{problem} (local, in a part of shape {tids[:4]})" for problem in problems], steps


@lru_cache(maxsize=256)
def _shape_problems(orders: tuple, stages, microbatches) -> tuple[list[str], list[tuple[int, int]]]:
    """_shape_coverage of a shape given by its templates' orders (kept: a run's plans repeat a
    few shapes, each plan a new numbering of its templates). Callers do not change the lists."""
    one = Schedule({i: [Op(*op) for op in order] for i, order in enumerate(orders)},
                   stages=stages, microbatches=microbatches)
    stepped = {(st, p) for p, count in enumerate(stages) for st in range(count)}
    problems = _problems_of(one, Counter(op for w in one.ops for op in one.ops[w]), range(len(stages)), stepped)
    steps = [(op.pipeline, op.stage) for w in one.ops for op in one.ops[w] if op.kind == OPT]
    return problems, steps


_SPLIT, _FUSED = {F, B, W}, {F, BW}


def _problems_of(schedule: Schedule, counts: Counter, pipelines, stepped=frozenset()) -> list[str]:
    """Coverage problems of `pipelines`, given every op that may belong to them, counted;
    `stepped`: (stage, pipeline) known to step elsewhere (checked by template)."""
    problems = [f"{op} appears {n} times" for op, n in counts.items() if n > 1]
    for op in counts:
        d = op.pipeline
        if op.kind not in KINDS or not 0 <= d < len(schedule.stages) \
                or not 0 <= op.stage < schedule.stages[d] \
                or (op.kind not in (OPT, RSYNC) and not 0 <= op.microbatch < schedule.microbatches[d]):
            problems.append(f"{op} is outside the schedule's shape")
    kinds_of = defaultdict(set)  # (stage, micro-batch, pipeline) -> the kinds run for it
    for kind, st, m, d in counts:
        if kind in REDUNDANT:  # extra work (Bamboo); it must only sit inside the shape
            if (kind == RSYNC) != (m == NO_MICROBATCH):
                problems.append(f"{Op(kind, st, m, d)} is outside the schedule's shape")
            continue
        kinds_of[(st, m, d)].add(kind)
    for d in pipelines:
        stages, mbs = schedule.stages[d], schedule.microbatches[d]
        replicas = replica_pipelines(schedule, d)
        for s in range(stages):
            if not any(OPT in kinds_of.get((s, NO_MICROBATCH, e), ()) or (s, e) in stepped for e in replicas):
                problems.append(f"stage {s} of pipeline {d} has no optimizer step")
            for m in range(mbs):
                kinds = kinds_of.get((s, m, d), set())
                if kinds == _SPLIT or kinds == _FUSED:
                    continue  # the usual cases, checked at once
                if F not in kinds:
                    problems.append(f"missing {Op(F, s, m, d)}")
                split = B in kinds or W in kinds
                fused = BW in kinds
                if split and fused:
                    problems.append(f"micro-batch {m} of pipeline {d} is backpropagated twice at stage {s}")
                elif split and not (B in kinds and W in kinds):
                    problems.append(f"stage {s} micro-batch {m} pipeline {d} has B without W or W without B")
                elif not split and not fused:
                    problems.append(f"missing backward of stage {s} micro-batch {m} pipeline {d}")
    return problems


def _grid_covered(schedule: Schedule) -> bool:
    """A lazily held grid whose lists were never handed out covers its shape when each
    pipeline's templates do: checked once per distinct (templates, stages, micro-batches), as
    a one-pipeline schedule (which must step each stage itself). False: look op by op."""
    ops = schedule.ops
    if ops.split_forms()[1]:
        return False
    run = ops.regular()
    if run is not None and len(ops.of) == run * len(schedule.stages):
        # a generated grid: pipeline d is the d-th run of workers, its templates set by its count
        records = list(ops.of.values())
        shapes = list(zip(schedule.stages, schedule.microbatches))
        first = {shape: shapes.index(shape) for shape in dict.fromkeys(shapes)}  # the first pipeline of each shape
        by_pipeline = {d: [tid for tid, _ in records[d * run:(d + 1) * run]] for d in first.values()}
    else:
        by_pipeline = defaultdict(list)
        for tid, d in ops.of.values():
            by_pipeline[d].append(tid)
        if set(by_pipeline) != set(range(len(schedule.stages))):
            return False
    checked: dict[tuple, bool] = {}
    for d, tids in by_pipeline.items():
        key = (tuple(tids), schedule.stages[d], schedule.microbatches[d])
        ok = checked.get(key)
        if ok is None:
            ok = checked[key] = _pipeline_covered(tuple(ops.templates[t] for t in key[0]), key[1], key[2])
        if not ok:
            return False
    return True


@lru_cache(maxsize=256)
def _pipeline_covered(orders: tuple[Template, ...], stages: int, microbatches: int) -> bool:
    """Whether one pipeline whose workers run `orders` covers its shape (kept: strategies that
    reshape after every failure check the same few pipelines plan after plan)."""
    one = Schedule({i: [Op(k, s, m, 0) for k, s, m in order] for i, order in enumerate(orders)},
                   stages=(stages,), microbatches=(microbatches,))
    return not _coverage_problems(one)


def dependency_graph(schedule: Schedule, present: set[int] | None = None,
                     layout: Layout | None = None, workers=None, has=None, only=None) -> dict:
    """node -> the nodes it waits for, for every op and every GradientSync some step waits
    for. A sync waits for the weight gradients of the `present` pipelines only (default: all).
    `layout`: the plan's fragments (ftbench.layers.fragment_layout; default: stage_layout).
    `workers`: only the ops of these workers (default: all), which must run every op of the
    `present` pipelines; `has`: as in `dependencies`."""
    layout = layout or stage_layout(schedule.stages)
    deps: dict = {}
    done: set[int] = set()  # ids of the syncs already in deps (a sync's hash covers all its holders)
    read = read_ops(schedule)
    for w in (schedule.ops if workers is None else workers):
        for op in read(w):
            deps[op] = dependencies(schedule, op, layout, has)
            if op.kind == OPT:
                for sync in deps[op]:
                    if id(sync) not in done and sync not in deps:
                        deps[sync] = sync_inputs(schedule, sync, present, has, only)
                    done.add(id(sync))
    return deps


def topological_order(schedule: Schedule, deps: dict, skip_workers=frozenset(), workers=None) -> list:
    """The nodes of `deps` in an order that respects both the dependencies and each worker's
    own order (Kahn's algorithm, O(ops)); ScheduleError when some worker can never go on.
    Workers in `skip_workers`, or not in `workers` when given, are left out (their ops must
    not be in `deps`)."""
    nodes, preds, chains = indexed_graph(schedule, deps, skip_workers, workers)
    order = kahn_order(preds, chains)
    if len(order) < len(nodes):
        _raise_deadlock(schedule, deps, {nodes[i] for i in order}, skip_workers, workers)
    return [nodes[i] for i in order]


def indexed_graph(schedule: Schedule, deps: dict, skip_workers=frozenset(), workers=None):
    """`deps` over node indices, for loops that should not hash ops (or fragment syncs, whose
    hash covers every holder) again and again: (nodes in `deps`' order, per node the indices
    it waits for, per worker its nodes' indices in order). ScheduleError when a node waits
    for one that no worker runs."""
    nodes = list(deps)
    index = {node: i for i, node in enumerate(nodes)}
    synced = {id(node): i for i, node in enumerate(nodes) if isinstance(node, GradientSync)}  # no rehashing
    preds = []
    for node, ds in deps.items():
        ins = [synced[id(d)] if id(d) in synced else index.get(d, -1) for d in ds]
        if -1 in ins:
            raise ScheduleError(f"{node} depends on {ds[ins.index(-1)]}, which no worker runs")
        preds.append(ins)
    read = read_ops(schedule)
    chains = [[index[op] for op in read(w)] for w in (schedule.ops if workers is None else workers)
              if w not in skip_workers]
    return nodes, preds, chains


def kahn_order(preds: list[list[int]], chains: list[list[int]]) -> list[int]:
    """Kahn's algorithm over node indices: `preds[i]` the nodes i waits for, `chains` each
    worker's nodes in its order. Shorter than `preds` when some node can never run."""
    n = len(preds)
    waiting = [len(ins) for ins in preds]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, ins in enumerate(preds):
        for j in ins:
            dependents[j].append(i)
    for run in chains:
        for a, b in zip(run, run[1:]):
            waiting[b] += 1
            dependents[a].append(b)
    ready = deque(i for i in range(n) if waiting[i] == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for child in dependents[i]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    return order


def _raise_deadlock(schedule: Schedule, deps: dict, done: set, skip_workers, workers=None) -> None:
    heads = []
    read = read_ops(schedule)
    for w in (schedule.ops if workers is None else workers):
        head = next((op for op in read(w) if op not in done), None)
        if w in skip_workers or head is None:
            continue
        waiting = next((d for d in deps[head] if d not in done), None)
        heads.append(f"worker {w} waits at {head}" + (f" for {waiting}" if waiting else " for its turn"))
    raise ScheduleError("schedule deadlocks: " + ", ".join(heads[:6]) + (" ..." if len(heads) > 6 else ""))


# -- generators -------------------------------------------------------------------------

def grid_worker(pipeline: int, stage: int, pp: int) -> int:
    """Worker id on the regular grid: pipeline * pp + stage."""
    return pipeline * pp + stage


def _stage_order(stage: int, pp: int, m: int, pipeline: int, *, warmup: int,
                 split: bool, defer: int) -> list[Op]:
    """One worker's order: `warmup` forwards, then one-forward-one-backward, then the rest
    of the backwards. With `split`, each W runs once more than `defer` Ws are pending."""
    ops = [Op(F, stage, j, pipeline) for j in range(warmup)]
    next_f, pending_w = warmup, deque()
    for j in range(m):
        if next_f < m:
            ops.append(Op(F, stage, next_f, pipeline))
            next_f += 1
        ops.append(Op(B if split else BW, stage, j, pipeline))
        if split:
            pending_w.append(j)
            if len(pending_w) > defer:
                ops.append(Op(W, stage, pending_w.popleft(), pipeline))
    ops += [Op(W, stage, j, pipeline) for j in pending_w]
    return ops + [Op(OPT, stage, NO_MICROBATCH, pipeline)]


def _per_pipeline(m, dp: int) -> tuple[int, ...]:
    """Micro-batches per pipeline: one count for all, or one per pipeline (an uneven split
    keeps the global batch when it does not divide by the pipeline count)."""
    counts = (m,) * dp if isinstance(m, int) else tuple(m)
    if len(counts) != dp or min(counts) < 1:
        raise ScheduleError(f"need {dp} positive micro-batch counts, got {counts}")
    return counts


def _grid(pp: int, m, dp: int, name: str, order) -> Schedule:
    """Worker (d, s) runs `order(s, d, counts[d])`. Every pipeline with the same micro-batch
    count runs the same orders up to the pipeline index, so each (stage, count) is generated
    once, as a template, and the ops are held lazily (GridOps)."""
    counts = _per_pipeline(m, dp)
    tid: dict[tuple[int, int], int] = {}  # (stage, micro-batches) -> template id
    templates: list[Template] = []
    for c in sorted(set(counts)):
        for s in range(pp):
            ops = order(s, 0, c)
            if any(op.pipeline != 0 for op in ops):  # an order that mixes pipelines: hold it as it is
                return Schedule({grid_worker(d, s, pp): order(s, d, counts[d]) for d in range(dp) for s in range(pp)},
                                stages=(pp,) * dp, microbatches=counts, name=name)
            tid[(s, c)] = len(templates)
            templates.append(tuple((k, st, mb) for k, st, mb, _ in ops))
    row = {c: [tid[(s, c)] for s in range(pp)] for c in set(counts)}  # count -> template id per stage
    of = {d * pp + s: (row[c][s], d) for d, c in enumerate(counts) for s in range(pp)}  # grid_worker(d, s, pp)
    return Schedule(GridOps(tuple(templates), of, run=pp), stages=(pp,) * dp, microbatches=counts, name=name)


def gpipe(pp: int, m, dp: int = 1) -> Schedule:
    """All forwards, then all backwards (last micro-batch first)."""
    def order(s, d, m):
        return ([Op(F, s, j, d) for j in range(m)] + [Op(BW, s, j, d) for j in reversed(range(m))]
                + [Op(OPT, s, NO_MICROBATCH, d)])
    return _grid(pp, m, dp, "gpipe", order)


def one_f_one_b(pp: int, m, dp: int = 1) -> Schedule:
    """1F1B: stage s runs pp-s-1 warm-up forwards, so at most pp-s micro-batches are stashed."""
    return _grid(pp, m, dp, "1f1b", lambda s, d, m: _stage_order(
        s, pp, m, d, warmup=min(pp - s - 1, m), split=False, defer=0))


def zb_h1(pp: int, m, dp: int = 1) -> Schedule:
    """ZB-H1: 1F1B's warm-up (so 1F1B's activation memory), B and W split, and stage s lets
    s weight-gradient passes wait: downstream stages have that much slack at the end, so the
    deferred Ws fill the cool-down bubble instead of delaying the B chain."""
    return _grid(pp, m, dp, "zb-h1", lambda s, d, m: _stage_order(
        s, pp, m, d, warmup=min(pp - s - 1, m), split=True, defer=s))


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}


def generate(name: str, pp: int, m, dp: int = 1) -> Schedule:
    """`m`: micro-batches per pipeline, one int for all or a tuple with one per pipeline."""
    from ftbench.errors import ConfigError

    if name not in GENERATORS:
        raise ConfigError("schedule", f"unknown schedule '{name}'", f"choose one of {', '.join(GENERATORS)}")
    return GENERATORS[name](pp, m, dp)
