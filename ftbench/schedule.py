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

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ftbench.layers import GradientSync, Layout, stage_layout

F, B, W, BW, OPT = "F", "B", "W", "BW", "OPT"
KINDS = (F, B, W, BW, OPT)
NO_MICROBATCH = -1  # OPT ops act on a whole stage


class Op(NamedTuple):
    kind: str  # F | B | W | BW | OPT
    stage: int
    microbatch: int  # NO_MICROBATCH for OPT
    pipeline: int  # the data-parallel replica that owns the micro-batch (or the weights, for OPT)

    def __str__(self) -> str:
        mb = "" if self.microbatch == NO_MICROBATCH else f",m{self.microbatch}"
        return f"{self.kind}(s{self.stage}{mb},p{self.pipeline})"


class ScheduleError(ValueError):
    """A schedule that cannot be executed: missing, duplicated or deadlocking ops."""


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
    _index: dict[Op, int] | None = field(default=None, repr=False, compare=False)

    @property
    def workers(self) -> list[int]:
        return sorted(self.ops)

    def index(self) -> dict[Op, int]:
        """op -> the worker that runs it (built once; schedules are not mutated after use)."""
        if self._index is None:
            self._index = {o: w for w, ops in self.ops.items() for o in ops}
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
        """Hashable identity, for memoising simulations of the same plan."""
        return (self.stages, self.microbatches,
                tuple((w, tuple(self.ops[w])) for w in self.workers))


def dependencies(schedule: Schedule, op: Op, layout: Layout | None = None) -> list:
    """Ops (and, for OPT, gradient syncs) that must finish before `op` may start, not counting
    the worker's own order. `layout`: the plan's fragments (default: stage_layout)."""
    kind, s, m, d = op
    last = schedule.stages[d] - 1
    if kind == F:
        return [Op(F, s - 1, m, d)] if s > 0 else []
    if kind in (B, BW):
        deps = [Op(F, s, m, d)]
        if s < last:
            deps.append(schedule.backward_input_op(s + 1, m, d))
        return deps
    if kind == W:
        return [Op(B, s, m, d)]
    if kind == OPT:
        layout = layout or stage_layout(schedule.stages)
        return list(layout.of_position[(d, s)])
    raise ScheduleError(f"unknown op kind {kind!r} in {op}")


def replica_pipelines(schedule: Schedule, pipeline: int) -> list[int]:
    """Pipelines whose stages are replicas of `pipeline`'s (same stage count)."""
    return [d for d, n in enumerate(schedule.stages) if n == schedule.stages[pipeline]]


def sync_inputs(schedule: Schedule, sync: GradientSync, present=None) -> list[Op]:
    """Every op producing a weight gradient of the sync's fragment (of the `present` pipelines;
    default all): the all-reduce's inputs."""
    ops = []
    for d, stage in sync.holders:
        if present is None or d in present:
            for m in range(schedule.microbatches[d]):
                w = Op(W, stage, m, d)
                ops.append(w if schedule.has(w) else Op(BW, stage, m, d))
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
    counts = Counter(op for ops in schedule.ops.values() for op in ops)
    problems = [f"{op} appears {n} times" for op, n in counts.items() if n > 1]
    for op in counts:
        d = op.pipeline
        if op.kind not in KINDS or not 0 <= d < len(schedule.stages) \
                or not 0 <= op.stage < schedule.stages[d] \
                or (op.kind != OPT and not 0 <= op.microbatch < schedule.microbatches[d]):
            problems.append(f"{op} is outside the schedule's shape")
    for d, (stages, mbs) in enumerate(zip(schedule.stages, schedule.microbatches)):
        for s in range(stages):
            if not any(Op(OPT, s, NO_MICROBATCH, e) in counts for e in replica_pipelines(schedule, d)):
                problems.append(f"stage {s} of pipeline {d} has no optimizer step")
            for m in range(mbs):
                if Op(F, s, m, d) not in counts:
                    problems.append(f"missing {Op(F, s, m, d)}")
                split = Op(B, s, m, d) in counts or Op(W, s, m, d) in counts
                fused = Op(BW, s, m, d) in counts
                if split and fused:
                    problems.append(f"micro-batch {m} of pipeline {d} is backpropagated twice at stage {s}")
                elif split and not (Op(B, s, m, d) in counts and Op(W, s, m, d) in counts):
                    problems.append(f"stage {s} micro-batch {m} pipeline {d} has B without W or W without B")
                elif not split and not fused:
                    problems.append(f"missing backward of stage {s} micro-batch {m} pipeline {d}")
    return problems


def dependency_graph(schedule: Schedule, present: set[int] | None = None,
                     layout: Layout | None = None) -> dict:
    """node -> the nodes it waits for, for every op and every GradientSync some step waits
    for. A sync waits for the weight gradients of the `present` pipelines only (default: all).
    `layout`: the plan's fragments (ftbench.layers.fragment_layout; default: stage_layout)."""
    layout = layout or stage_layout(schedule.stages)
    deps: dict = {}
    for ops in schedule.ops.values():
        for op in ops:
            deps[op] = dependencies(schedule, op, layout)
            if op.kind == OPT:
                for sync in deps[op]:
                    if sync not in deps:
                        deps[sync] = sync_inputs(schedule, sync, present)
    return deps


def topological_order(schedule: Schedule, deps: dict, skip_workers=frozenset()) -> list:
    """The nodes of `deps` in an order that respects both the dependencies and each worker's
    own order (Kahn's algorithm, O(ops)); ScheduleError when some worker can never go on.
    Workers in `skip_workers` are left out (their ops must not be in `deps`)."""
    missing = next(((op, d) for op, ds in deps.items() for d in ds if d not in deps), None)
    if missing:
        raise ScheduleError(f"{missing[0]} depends on {missing[1]}, which no worker runs")
    waiting = {node: len(ds) for node, ds in deps.items()}
    dependents = defaultdict(list)
    for node, ds in deps.items():
        for d in ds:
            dependents[d].append(node)
    for w, ops in schedule.ops.items():
        if w not in skip_workers:
            for a, b in zip(ops, ops[1:]):
                waiting[b] += 1
                dependents[a].append(b)
    ready = deque(node for node, n in waiting.items() if n == 0)
    order = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for child in dependents.get(node, ()):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if len(order) < len(deps):
        _raise_deadlock(schedule, deps, set(order), skip_workers)
    return order


def _raise_deadlock(schedule: Schedule, deps: dict, done: set, skip_workers) -> None:
    heads = []
    for w, ops in schedule.ops.items():
        head = next((op for op in ops if op not in done), None)
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
    counts = _per_pipeline(m, dp)
    ops = {grid_worker(d, s, pp): order(s, d, counts[d]) for d in range(dp) for s in range(pp)}
    return Schedule(ops, stages=(pp,) * dp, microbatches=counts, name=name)


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
