"""A plan: which worker holds which layers, where workers sit, and the iteration's schedule.

Strategies produce plans; backends execute them. A plan is data, so it can be hashed
(the simulator memoises per plan), drawn, validated and compared.
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from itertools import chain
from dataclasses import dataclass, field

from ftbench.schedule import OPT, GridOps, Schedule, grid_worker

LayerRange = tuple[int, int]  # [first, end) transformer blocks


@dataclass
class Plan:
    schedule: Schedule
    partition: tuple[tuple[LayerRange, ...], ...]  # per pipeline, per stage: its layer range
    holds: dict[int, tuple[tuple[int, int], ...]]  # worker -> (pipeline, stage) replicas whose weights and optimizer state it keeps
    node_of: dict[int, int]  # worker -> node (placement; decides intra- or inter-node links)
    name: str = ""
    staggered_optimizer: bool = False  # no barrier between iterations (ReCycle): the sim times the steady state
    _key: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def workers(self) -> list[int]:
        return self.schedule.workers

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
                    staggered_optimizer=self.staggered_optimizer)

    def key(self) -> tuple:
        """Hashable identity (the simulator memoises per key). The per-worker parts are packed
        into bytes: exact, and small next to thousands of tuples."""
        if self._key is None:
            self._key = (self.schedule.key(), self.partition, _pack_holds(self.holds), _pack_nodes(self.node_of),
                         self.staggered_optimizer)
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


def holds_from_schedule(schedule: Schedule) -> dict[int, tuple[tuple[int, int], ...]]:
    """By default a worker keeps the state of every replica it steps the optimizer of."""
    ops = schedule.ops
    if isinstance(ops, GridOps):  # from the templates, without building the ops
        steps = [tuple(s for k, s, _ in t if k == OPT) for t in ops.templates]
        out, given = {}, ops._lists
        for w, (tid, d) in ops.of.items():
            if w in given:
                out[w] = tuple((op.pipeline, op.stage) for op in given[w] if op.kind == OPT)
            else:
                stages = steps[tid]
                out[w] = ((d, stages[0]),) if len(stages) == 1 else tuple((d, s) for s in stages)
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
    return Plan(schedule=schedule, partition=(stage_layers,) * dp,
                holds=holds_from_schedule(schedule),
                node_of={w: node_of(w) for w in placed} if node_of else {w: w // gpus_per_node for w in placed},
                name=name or schedule.name)


def checkpoint_writers(plan: Plan) -> dict[int, int]:
    """stage -> the worker that writes its shard: one replica per stage, taken from a
    different pipeline for each stage so the writes spread over nodes (as distributed
    checkpointing does) instead of all landing on pipeline 0's nodes."""
    holders: dict[int, list[int]] = defaultdict(list)
    for w in sorted(plan.holds):
        for _, stage in plan.holds[w]:
            holders[stage].append(w)
    return {stage: ws[stage % len(ws)] for stage, ws in sorted(holders.items())}
