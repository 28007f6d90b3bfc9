"""A plan: which worker holds which layers, where workers sit, and the iteration's schedule.

Strategies produce plans; backends execute them. A plan is data, so it can be hashed
(the simulator memoises per plan), drawn, validated and compared.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ftbench.schedule import OPT, Schedule, grid_worker

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
        ops = {to[w]: ops for w, ops in self.schedule.ops.items()}
        schedule = Schedule(ops, self.schedule.stages, self.schedule.microbatches, self.schedule.name)
        return Plan(schedule=schedule, partition=self.partition,
                    holds={to[w]: h for w, h in self.holds.items()},
                    node_of={to[w]: node_of(to[w]) for w in old}, name=self.name,
                    staggered_optimizer=self.staggered_optimizer)

    def key(self) -> tuple:
        if self._key is None:
            holds = tuple(sorted(self.holds.items()))
            self._key = (self.schedule.key(), self.partition, holds,
                         tuple(sorted(self.node_of.items())), self.staggered_optimizer)
        return self._key


def holds_from_schedule(schedule: Schedule) -> dict[int, tuple[tuple[int, int], ...]]:
    """By default a worker keeps the state of every replica it steps the optimizer of."""
    return {w: tuple((op.pipeline, op.stage) for op in ops if op.kind == OPT)
            for w, ops in schedule.ops.items()}


def grid_plan(schedule: Schedule, stage_layers: tuple[LayerRange, ...], pp: int,
              gpus_per_node: int, name: str = "", node_of=None) -> Plan:
    """The regular pp x dp grid: worker = pipeline * pp + stage, on the node `node_of(worker)`
    gives (default: the pipeline placement, node = worker // gpus_per_node)."""
    dp = len(schedule.stages)
    workers = [grid_worker(d, s, pp) for d in range(dp) for s in range(pp)]
    return Plan(schedule=schedule, partition=(stage_layers,) * dp,
                holds=holds_from_schedule(schedule),
                node_of={w: node_of(w) if node_of else w // gpus_per_node for w in workers},
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
