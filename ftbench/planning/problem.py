"""A scheduling problem for one failure configuration of a pp x dp grid (ReCycle, SOSP 2024).

Workers are grid positions (pipeline d, stage s). When (d, s) has failed, each of its
micro-batches at stage s runs on a surviving peer (d', s) of the same stage: pipeline d's
stage s-1 sends the activation there, the peer sends its output on to (d, s+1), and the
backward goes the reverse way. Which peer takes which micro-batch is fixed here (balanced,
round-robin); the planners (list-scheduling heuristic, MILP) decide each worker's op order.

The timing semantics are the simulator's (ftbench.sim.simulator): an op starts when its
worker is free and every input has arrived (producer end + transfer between workers); the
optimizer step of a stage follows the all-reduce over the survivors of that stage. With
`overlap_grad_reduce` (train.overlap_grad_reduce) that all-reduce runs in one bucket per
layer unit of the stage during its last weight-gradient op, and ends `sync_s(stage)` after
that op (ftbench.sim.simulator.overlapped_sync_s).
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
from itertools import filterfalse, repeat
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property
from operator import itemgetter

from ftbench.layers import stage_units
from ftbench.placement import node_of
from ftbench.release import Releases
from ftbench.schedule import B, BW, F, NO_MICROBATCH, OPT, W, Op, Schedule, grid_worker
from ftbench.sim.simulator import overlapped_sync_s

Position = tuple[int, int]  # (pipeline, stage) on the grid

# Bump when the planners' output for the same problem changes: cached plans then recompute.
PLANNER_VERSION = 3


class PlanningError(RuntimeError):
    """No plan exists (a stage lost every replica) or a planner could not finish one."""


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one stage's ops for one micro-batch, and of its optimizer step and all-reduce."""
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    optimizer_s: float = 0.0
    allreduce_s: float = 0.0
    # Memory of one worker of the stage (bytes; ftbench.costs): weights, gradients and Adam
    # state; what one micro-batch keeps from F until its backward (B or BW), and from B until
    # W; the transient working set of one backward (activation recomputation).
    static_bytes: float = 0.0
    activation_bytes: float = 0.0
    weight_stash_bytes: float = 0.0
    recompute_bytes: float = 0.0
    # Layer units the stage holds (ftbench.layers): its all-reduce's buckets under overlap.
    # Part of the plan key only with overlap_grad_reduce (keys without it stay as they were).
    units: int = 1


@dataclass(frozen=True)
class PlanningProblem:
    pp: int
    dp: int
    microbatches: int  # per pipeline; the global batch never changes
    stages: tuple[StageTimes, ...]  # one per stage
    failed: frozenset = field(default_factory=frozenset)  # failed (pipeline, stage) positions
    decoupled: bool = True  # B and W separate (W can fill bubbles) or one fused BW
    intra_node_s: float = 0.0  # boundary send between workers on one node
    inter_node_s: float = 0.0  # boundary send between nodes
    gpus_per_node: int = 1
    placement: str = "pipeline"  # ftbench.placement: which node holds each position
    memory_bytes: float = math.inf  # one GPU's memory: the stash caps follow from it
    overlap_grad_reduce: bool = False  # train.overlap_grad_reduce: all-reduce in buckets during the last backward
    # The original schedule's slots (ftbench.release): each worker's own F and B/BW in their
    # fault-free order and no earlier than there, its step no earlier than the fault-free
    # step; None: every op free (no original schedule to keep).
    released: Releases | None = None

    def __post_init__(self):
        object.__setattr__(self, "failed", frozenset(tuple(p) for p in self.failed))
        if len(self.stages) != self.pp:
            raise ValueError(f"{len(self.stages)} stage timings for pp={self.pp}")
        for d, s in self.failed:
            if not (0 <= d < self.dp and 0 <= s < self.pp):
                raise ValueError(f"failed position {(d, s)} is outside the {self.pp} x {self.dp} grid")
        lost = [s for s in range(self.pp) if not self.survivors(s)]
        if lost:
            raise PlanningError(f"every replica of stage {lost[0]} has failed: its micro-batches cannot be re-routed")

    # -- the grid -----------------------------------------------------------------------
    def survivors(self, stage: int) -> list[int]:
        """Pipelines whose worker at `stage` is alive."""
        return self._survivors[stage]

    @cached_property
    def _survivors(self) -> list[list[int]]:
        lost = self._lost
        return [list(filterfalse(set(lost[s]).__contains__, range(self.dp))) for s in range(self.pp)]

    @cached_property
    def _lost(self) -> list[list[int]]:
        """Per stage, the failed pipelines in order (one pass over the failed positions: a plan
        of whole failed pipelines at scale has thousands)."""
        lost: list[list[int]] = [[] for _ in range(self.pp)]
        for d, s in sorted(self.failed):
            lost[s].append(d)
        return lost

    @cached_property
    def workers(self) -> list[Position]:
        return [(d, s) for d in range(self.dp) for s in range(self.pp) if (d, s) not in self.failed]

    def node(self, pos: Position) -> int:
        return node_of(grid_worker(pos[0], pos[1], self.pp), self.pp, self.dp, self.gpus_per_node, self.placement)

    def transfer_s(self, src: Position, dst: Position) -> float:
        if src == dst:
            return 0.0
        return self.intra_node_s if self.node(src) == self.node(dst) else self.inter_node_s

    @cached_property
    def rerouted(self) -> dict[tuple[int, int, int], int]:
        """(pipeline, stage, micro-batch) -> the peer pipeline whose stage-s worker runs it, for
        the micro-batches of failed positions. They go to the stage's survivors, the least
        loaded first, starting with the next pipeline (so two failures in one stage do not pile
        onto one peer)."""
        return {(d, s, k): peer for s, flows in enumerate(self.stage_routes) for (d, k), peer in flows.items()}

    @cached_property
    def stage_routes(self) -> list[dict[tuple[int, int], int]]:
        """Per stage, (failed pipeline, micro-batch) -> the peer that runs it there (`rerouted`
        by stage). Stages that lost the same pipelines share one dict: whole failed pipelines
        (a node per pipeline) re-route alike at every stage."""
        out, memo = [], {}
        for s in range(self.pp):
            failed = tuple(self._lost[s])
            if failed not in memo:
                memo[failed] = _reroute(failed, self.survivors(s), self.microbatches, self.dp)
            out.append(memo[failed])
        return out

    @cached_property
    def assignment(self) -> dict[tuple[int, int, int], int]:
        """(pipeline, stage, micro-batch) -> the pipeline whose stage-s worker runs it (every
        micro-batch; `rerouted` holds only the moved ones)."""
        out = {(d, s, k): d for d, s in self.workers for k in range(self.microbatches)}
        out.update(self.rerouted)
        return out

    @cached_property
    def load(self) -> dict[Position, int]:
        """Micro-batches each surviving worker runs."""
        out = {pos: self.microbatches for pos in self.workers}
        extra = {}  # one count per distinct stage routing
        for s, flows in enumerate(self.stage_routes):
            if id(flows) not in extra:
                extra[id(flows)] = Counter(flows.values())
            for e, n in extra[id(flows)].items():
                out[(e, s)] += n
        return out

    def load_of(self, pos: Position) -> int:
        """`load[pos]` without building the whole dict."""
        return self.microbatches + self._extra[pos[1]].get(pos[0], 0)

    @cached_property
    def _extra(self) -> list[Counter]:
        """Per stage, the re-routed micro-batches each peer takes (one Counter per distinct routing)."""
        counts: dict[int, Counter] = {}  # (counted once per distinct dict: stages share one at scale)
        for flows in self.stage_routes:
            if id(flows) not in counts:
                counts[id(flows)] = Counter(flows.values())
        return [counts[id(flows)] for flows in self.stage_routes]

    def stash_cap(self, pos: Position) -> int:
        """Most micro-batches a worker may hold forwarded but not yet backpropagated (B or BW).

        Derived from memory: with `defer_cap` micro-batches waiting for their W, the worker's
        peak is static + cap x activation + defer_cap x weight stash + one backward's
        recompute working set, which must fit in `memory_bytes`; never more than its load."""
        return self._caps_at(pos[1], self.load_of(pos))[0]

    def defer_cap(self, pos: Position) -> int:
        """Most micro-batches a worker may hold between B and W (decoupled only; 0 fused). W
        fills bubbles, but each deferred W keeps its weight stash: deferral gets the memory
        that 1F1B's stash (min(load, pp - s) micro-batches) leaves, and all of the load when
        that is enough."""
        return self._caps_at(pos[1], self.load_of(pos))[1]

    def _caps_at(self, stage: int, load: int) -> tuple[int, int]:
        """(stash cap, deferral cap) of a worker of `stage` running `load` micro-batches: they
        depend on nothing else, so each pair is computed once."""
        memo = self.__dict__.setdefault("_caps_memo", {})
        caps = memo.get((stage, load))
        if caps is None:
            caps = memo[(stage, load)] = self._caps_of(stage, load)
        return caps

    def _caps_of(self, stage: int, load: int) -> tuple[int, int]:
        t = self.stages[stage]
        free = self.memory_bytes - t.static_bytes - t.recompute_bytes
        defer = 0
        if self.decoupled:
            target = min(load, self.pp - stage)
            defer = max(1, _fits(free - target * t.activation_bytes, t.weight_stash_bytes, load))
        return _fits(free - defer * t.weight_stash_bytes, t.activation_bytes, load), defer

    def memory_shortfall(self) -> str | None:
        """Why no schedule of this problem fits in memory (None: one does)."""
        return self._shortfall

    @cached_property
    def _shortfall(self) -> str | None:
        # (worked out once: each priority rule of the list scheduler asks)
        m = self.microbatches
        loads = [{m + n for n in extra.values()} | ({m} if len(self.survivors(s)) > len(extra) else set())
                 for s, extra in enumerate(self._extra)]  # the loads that occur, per stage
        if all(self._caps_at(s, load)[0] >= 1 for s, of_stage in enumerate(loads) for load in of_stage):
            return None
        for pos in self.workers:  # name the first worker that cannot hold one micro-batch
            if self.stash_cap(pos) < 1:
                t = self.stages[pos[1]]
                need = t.static_bytes + t.activation_bytes + t.recompute_bytes + (
                    t.weight_stash_bytes if self.decoupled else 0.0)
                return (f"worker {pos} (pipeline {pos[0]}, stage {pos[1]}) cannot hold one micro-batch: it needs "
                        f"{need / 1e9:.1f} GB of {self.memory_bytes / 1e9:.1f} GB "
                        f"({t.static_bytes / 1e9:.1f} GB weights and optimizer state)")
        return None

    # -- ops ----------------------------------------------------------------------------
    def ops_of(self, pos: Position) -> list[Op]:
        """The F/B/W (or BW) ops a worker runs, by owner pipeline and micro-batch (OPT excluded)."""
        return list(self._ops_by_worker.get(pos, ()))

    @cached_property
    def _ops_by_worker(self) -> dict[Position, list[Op]]:
        kinds = (F, B, W) if self.decoupled else (F, BW)
        out: dict[Position, list[Op]] = {pos: [] for pos in self.workers}
        for (d, s, k), e in sorted(self.assignment.items()):
            out[(e, s)] += [Op(kind, s, k, d) for kind in kinds]
        return out

    def sync_s(self, stage: int) -> float:
        """Seconds from the end of a stage's last weight-gradient op (W, or BW fused) to the end
        of its all-reduce: the all-reduce (free with one survivor, as in ProblemCosts), or with
        overlap_grad_reduce what is left of it after that op, overlapped_sync_s(a, units, t)
        (every W/BW of a stage lasts the same t, so the latest one binds: the simulator's max
        over inputs of end + overlapped_sync_s is the latest end plus this)."""
        t = self.stages[stage]
        a = t.allreduce_s if len(self.survivors(stage)) > 1 else 0.0
        if not self.overlap_grad_reduce:
            return a
        back = t.backward_weight_s if self.decoupled else t.backward_input_s + t.backward_weight_s
        return overlapped_sync_s(a, t.units, back)

    def duration(self, op: Op) -> float:
        t = self.stages[op.stage]
        return {F: t.forward_s, B: t.backward_input_s, W: t.backward_weight_s,
                BW: t.backward_input_s + t.backward_weight_s, OPT: t.optimizer_s}[op.kind]

    def dependencies(self, op: Op) -> list[Op]:
        """Inputs of an F/B/W/BW op (the same rule as ftbench.schedule.dependencies)."""
        kind, s, k, d = op
        back = B if self.decoupled else BW
        if kind == F:
            return [Op(F, s - 1, k, d)] if s > 0 else []
        if kind in (B, BW):
            return [Op(F, s, k, d)] + ([Op(back, s + 1, k, d)] if s < self.pp - 1 else [])
        if kind == W:
            return [Op(B, s, k, d)]
        raise ValueError(f"no dependencies for {op}")

    def release_of(self, pos: Position, op: Op) -> float | None:
        """The earliest start of `op` on worker `pos` (None: no release)."""
        return None if self.released is None else self.released.of_position(pos[0], op)

    def own_chain(self, pos: Position) -> list[Op] | None:
        """The worker's own F and B/BW ops in their fault-free order (None without releases:
        then its own ops are free like any other)."""
        if self.released is None:
            return None
        d, s = pos
        return [Op(kind, s, k, d) for kind, k in self.released.own_order(s, self.decoupled)]

    def step_release(self, stage: int) -> float:
        """The earliest start of a stage's optimizer step (0.0 without releases)."""
        found = self.release_of((0, stage), Op(OPT, stage, NO_MICROBATCH, 0))
        return 0.0 if found is None else found

    def runner_of(self, op: Op) -> Position:
        return (self.assignment[(op.pipeline, op.stage, op.microbatch)], op.stage)

    def to_schedule(self, orders: dict[Position, list[Op]], name: str) -> Schedule:
        """Per-worker orders of F/B/W ops -> a Schedule on grid worker ids, each survivor
        stepping its own stage replica last."""
        ops = {}
        for (d, s), order in orders.items():
            ops[grid_worker(d, s, self.pp)] = list(order) + [Op(OPT, s, NO_MICROBATCH, d)]
        return Schedule(ops, stages=(self.pp,) * self.dp, microbatches=(self.microbatches,) * self.dp, name=name,
                        released=self.released)

    # -- identity -----------------------------------------------------------------------
    def key(self) -> str:
        """Everything a plan depends on, hashed: the on-disk cache key."""
        data = asdict(self)
        if data["placement"] == "pipeline":
            del data["placement"]  # keys from before placement was a setting stay valid
        if not data["overlap_grad_reduce"]:  # likewise keys from before overlap was a setting
            del data["overlap_grad_reduce"]
            for stage in data["stages"]:
                del stage["units"]
        data["failed"] = sorted(self.failed)
        if data["released"] is None:
            del data["released"]  # keys from before release times stay valid
        else:
            data["released"] = self.released.key()
        data["version"] = PLANNER_VERSION
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def _reroute(failed: tuple[int, ...], survivors: list[int], m: int, dp: int) -> dict[tuple[int, int], int]:
    """(failed pipeline, micro-batch) -> peer for one stage: each failed pipeline in turn hands
    its micro-batches, in order, to the least loaded survivor, the nearest after it along the
    ring first (a heap of (load, ring distance, peer) popped and pushed back one by one gives
    the same). Loads never differ by more than one, so the survivors at the lowest load are
    kept sorted by id and each failed pipeline takes the next ones after itself, wrapping."""
    out = {}
    low, high = list(survivors), []  # peers at the lowest load, and at one more
    for d in failed:
        k = 0
        while k < m:
            start, r = bisect.bisect_right(low, d), min(m - k, len(low))
            # the r nearest after d along the ring: a run of `low` from `start`, wrapping
            if start + r <= len(low):
                take, rest = low[start:start + r], low[:start] + low[start + r:]
            else:
                wrap = start + r - len(low)
                take, rest = low[start:] + low[:wrap], low[wrap:start]
            out.update(zip(zip(repeat(d), range(k, k + r)), take))
            k += r
            if rest:
                low, high = rest, high + take
            else:
                low, high = sorted(high + take), []
    return out


def normalise(failed, dp: int, pp: int) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
    """A failure configuration up to renaming pipelines: (per pipeline, its failed stages, in a
    canonical pipeline order) and `order`, where canonical pipeline i is real pipeline order[i].
    Configurations with the same form share one plan."""
    stages_of = defaultdict(list)
    for e, s in failed:
        stages_of[e].append(s)
    none = ()
    by_pipeline = {d: tuple(sorted(stages_of[d])) if d in stages_of else none for d in range(dp)}
    # Most failed stages first, then by the stages themselves; stable in the real pipeline id.
    order = sorted(range(dp), key=lambda d: (-len(by_pipeline[d]), by_pipeline[d], d))
    return tuple(by_pipeline[d] for d in order), order


class StageForm(tuple):
    """A failure configuration up to renaming the workers of each stage: its number of failed
    workers per stage. The workers of a stage hold the same weights, so which pipelines lost
    them is renamed away (ReCycle's "Failure Normalization" as we read it). Its plan is the
    fastest of its layouts' (`stage_layouts`), renamed onto the real workers stage by stage
    (`rename_onto`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"StageForm{tuple(self)}"


NORMALISE = ("stage", "pipeline")  # strategy.normalise
# A per-stage form is planned on every one of its layouts (pipeline forms with its counts) when it
# has at most this many, found among at most LAYOUT_FAILURES failed workers; else on two: the
# failures packed into the first pipelines, and spread one per pipeline.
LAYOUT_LIMIT = 8
LAYOUT_FAILURES = 6


def stage_form(failed, pp: int) -> StageForm:
    """The per-stage normal form of a failure configuration: failed workers per stage."""
    counts = Counter(map(itemgetter(1), failed))  # (counted in C: asked at every failure, thousands at scale)
    if not counts.keys() <= set(range(pp)):
        raise ValueError(f"failed stages {sorted(counts)} outside a pipeline of {pp} stages")
    return StageForm(map(counts.__getitem__, range(pp)))


def form_of(failed, dp: int, pp: int, by: str = "stage"):
    """The normal form of a failure configuration: `by` "stage" (stage_form) or "pipeline"
    (normalise: renaming whole pipelines)."""
    if by == "stage":
        return stage_form(failed, pp)
    if by != "pipeline":
        raise ValueError(f"unknown normalisation {by!r}: choose one of {', '.join(NORMALISE)}")
    return normalise(failed, dp, pp)[0]


def stage_layouts(form: StageForm, dp: int) -> list[tuple[tuple[int, ...], ...]]:
    """Pipeline normal forms with the per-stage counts `form`: all of them when there are at
    most LAYOUT_LIMIT (and at most LAYOUT_FAILURES failed workers), else two: packed (stage s's
    failures in pipelines 0 .. count - 1, so equal counts are whole failed pipelines) and spread
    (each failure in a pipeline of its own, as far as dp allows). Packed first."""
    pp = len(form)
    packed = normalise({(i, s) for s, c in enumerate(form) for i in range(c)}, dp, pp)[0]
    spread_set, nxt = set(), 0
    for s, c in enumerate(form):
        for _ in range(c):
            while (nxt % dp, s) in spread_set:
                nxt += 1
            spread_set.add((nxt % dp, s))
            nxt += 1
    spread = normalise(spread_set, dp, pp)[0]
    few = _every_layout(form, dp) if sum(form) <= LAYOUT_FAILURES else None
    if few is None:
        return list(dict.fromkeys((packed, spread)))
    return [packed] + sorted(f for f in few if f != packed)


def _every_layout(form: StageForm, dp: int):
    """Every pipeline normal form with these counts, or None when there are more than LAYOUT_LIMIT."""
    pp, found = len(form), set()

    def place(s: int, sets: tuple) -> bool:
        if s == pp:
            found.add(normalise({(d, st) for d, stages in enumerate(sets) for st in stages}, dp, pp)[0])
            return len(found) <= LAYOUT_LIMIT
        c = form[s]
        for fresh in range(c + 1):
            old = c - fresh
            if old > len(sets) or len(sets) + fresh > dp:
                continue
            for chosen in itertools.combinations(range(len(sets)), old):
                grown = tuple(st + (s,) if i in chosen else st for i, st in enumerate(sets)) + ((s,),) * fresh
                if not place(s + 1, tuple(sorted(grown))):
                    return False
        return True

    return found if place(0, ()) else None


@dataclass(frozen=True)
class Renaming:
    """A normal form's canonical grid on the real one: canonical position (i, s) is run by the
    worker of real pipeline at[s][i] at stage s, and canonical pipeline i's micro-batches are real
    pipeline labels[i]'s. Renaming pipelines uses one order at every stage; renaming stage by
    stage may give a worker another pipeline's micro-batches as its own (`owners`)."""
    at: tuple[tuple[int, ...], ...]  # per stage: canonical pipeline -> real pipeline of its worker
    labels: tuple[int, ...]  # canonical pipeline -> the real pipeline its micro-batches belong to
    failed: frozenset = frozenset()  # the canonical failed positions

    def owners(self, pp: int) -> dict[int, int]:
        """Grid worker -> the real pipeline whose micro-batches it runs as its own, for the
        surviving workers where that is not the worker's own pipeline (release times follow it)."""
        out = {}
        labels, failed = self.labels, self.failed
        for s, at in enumerate(self.at):
            if at is labels:
                continue  # renamed as a whole pipeline: every worker runs its own
            for i, d in enumerate(at):
                if labels[i] != d and (i, s) not in failed:
                    out[grid_worker(d, s, pp)] = labels[i]
        return out


def rename_onto(failed, layout, dp: int, pp: int, normal=None) -> Renaming:
    """The Renaming of a plan made for the pipeline form `layout` onto the real failure set
    `failed` with the same failed workers per stage. When `failed` has that pipeline form itself,
    pipelines are renamed whole (normalise's order). Else stage by stage: canonical pipeline i's
    micro-batches stay real pipeline i's, each canonical failed worker that is really alive
    trades places with a real failed one that is canonically alive (in order), and every other
    worker is itself. `normal`: normalise(failed, dp, pp), where the caller has it."""
    form, order = normal or normalise(failed, dp, pp)
    if form == layout:
        order = tuple(order)
        return Renaming((order,) * pp, order, canonical_failed(layout))
    canonical = canonical_failed(layout)
    down, up = defaultdict(set), defaultdict(set)
    for d, s in failed:
        down[s].add(d)
    for i, s in canonical:
        up[s].add(i)
    identity = tuple(range(dp))
    at = []
    for s in range(pp):
        if down[s] == up[s]:
            at.append(identity)
            continue
        if len(down[s]) != len(up[s]):
            raise ValueError(f"stage {s}: {len(down[s])} failed workers, but the layout has {len(up[s])}")
        row = list(identity)
        for i, d in zip(sorted(up[s] - down[s]), sorted(down[s] - up[s])):
            row[i], row[d] = d, i
        at.append(tuple(row))
    return Renaming(tuple(at), identity, canonical)


def canonical_failed(form) -> frozenset:
    """The failed positions of a normal form, with canonical pipeline ids."""
    if isinstance(form, StageForm):
        return frozenset((i, s) for s, count in enumerate(form) for i in range(count))
    return frozenset((i, s) for i, stages in enumerate(form) for s in stages)


def _fits(free: float, per_microbatch: float, load: int) -> int:
    """How many micro-batches of `per_microbatch` bytes fit in `free`, at most `load`."""
    if free < 0:
        return 0
    if per_microbatch <= 0 or math.isinf(free):
        return load
    return min(load, int(free // per_microbatch))


def stash_peaks(order) -> tuple[int, int]:
    """(most micro-batches between F and B/BW, most between B and W) over a worker's order."""
    held = deferred = peak_held = peak_deferred = 0
    for op in order:
        if op.kind == F:
            held += 1
        elif op.kind in (B, BW):
            held -= 1
            deferred += op.kind == B
        elif op.kind == W:
            deferred -= 1
        peak_held, peak_deferred = max(peak_held, held), max(peak_deferred, deferred)
    return peak_held, peak_deferred


class ProblemCosts:
    """The simulator's cost interface over a planning problem, so planners' orders are timed
    by the one simulator, and their memory counted in the cost model's bytes."""

    def __init__(self, problem: PlanningProblem):
        self.problem = problem

    def _pos(self, worker: int) -> Position:
        return divmod(worker, self.problem.pp)

    def op_time(self, op: Op) -> float:
        return self.problem.duration(op)

    def transfer_time(self, src: int, dst: int) -> float:
        return self.problem.transfer_s(self._pos(src), self._pos(dst))

    def allreduce_time(self, stage: int, pipeline: int, workers) -> float:
        return self.problem.stages[stage].allreduce_s if len(set(workers)) > 1 else 0.0

    @property
    def overlap_grad_reduce(self) -> bool:
        return self.problem.overlap_grad_reduce

    def grad_buckets(self, sync) -> int:
        """Buckets of a stage's overlapped all-reduce: its layer units (the simulator's syncs
        here are per stage, without a partition)."""
        return self.problem.stages[sync.stage].units

    def stash_bytes(self, op: Op) -> float:
        return self.problem.stages[op.stage].activation_bytes

    def weight_stash_bytes(self, op: Op) -> float:
        return self.problem.stages[op.stage].weight_stash_bytes

    def recompute_bytes(self, op: Op) -> float:
        return self.problem.stages[op.stage].recompute_bytes

    def static_bytes(self, worker: int) -> float:
        return self.problem.stages[worker % self.problem.pp].static_bytes


def evaluate(problem: PlanningProblem, orders: dict[Position, list[Op]]):
    """Simulate one iteration of per-worker orders: a ftbench.sim.simulator.SimResult."""
    from ftbench.sim.simulator import simulate

    return simulate(problem.to_schedule(orders, "candidate"), ProblemCosts(problem), dedupe=False)


def stage_times(cost_model, partition, dp: int) -> tuple[StageTimes, ...]:
    """Per-stage op times and memory of a layer partition from the cost model (all-reduce over
    dp replicas across nodes: the conservative case)."""
    from ftbench.costs import ADAM_STATE_BYTES_PER_PARAM

    pp = len(partition)
    out = []
    for s, layers in enumerate(partition):
        c = cost_model.stage(layers, s == 0, s == pp - 1)
        lo, hi = stage_units(layers, s == 0, s == pp - 1, partition[-1][1])
        out.append(StageTimes(c.forward_s, c.backward_input_s, c.backward_weight_s,
                              cost_model.optimizer_s(c.params), cost_model.allreduce_s(c.params, dp, False),
                              static_bytes=float(ADAM_STATE_BYTES_PER_PARAM * c.params),
                              activation_bytes=c.activation_bytes, weight_stash_bytes=c.weight_stash_bytes,
                              recompute_bytes=getattr(c, "recompute_bytes", 0.0), units=hi - lo))
    return tuple(out)


def problem_for(ctx, pp: int, dp: int, gpus_per_node: int, failed=frozenset(), decoupled: bool = True,
                placement: str = "pipeline", released: Releases | None = None) -> PlanningProblem:
    """The planning problem of a run's grid (ftbench.context.RunContext) under `failed`, with
    the GPU's memory from the hardware profile and the cost model's all-reduce overlap."""
    model = ctx.cost_model
    return PlanningProblem(pp=pp, dp=dp, microbatches=ctx.microbatches,
                           stages=stage_times(model, model.balanced_partition(pp), dp), failed=frozenset(failed),
                           decoupled=decoupled, intra_node_s=model.boundary_s(True),
                           inter_node_s=model.boundary_s(False), gpus_per_node=gpus_per_node, placement=placement,
                           memory_bytes=model.memory_bytes,
                           overlap_grad_reduce=getattr(model, "overlap_grad_reduce", False), released=released)
