"""`jit-checkpoint`: just-in-time checkpointing (Gupta et al., EuroSys 2024).

No periodic checkpoints in the steady state: only the initial one (and, with `every`, files at
that interval as the fallback for a failure no survivor can cover). When a node that runs a
worker fails, the surviving data-parallel replicas hold every stage's state as of the
interrupted iteration's start (a replica that had already stepped undoes its step,
ftbench/engine/undo.py), so they save it to files at once: one live replica per stage writes
its stage. Then the job restarts as checkpoint restart does (a standby or a new node takes the
failed node's place, every process restarts) and reloads that checkpoint: at most the
interrupted iteration is redone. When a failure takes every replica of some stage, nothing
can be saved just in time and the job restarts from the newest periodic file (the initial
state without `every`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ftbench.actions import FILE, RestartJob, RestoreCheckpoint, SaveCheckpoint
from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from ftbench.strategies.base import Recovery, StrategyConfig, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointRestart, every_drawn


@dataclass
class JitCheckpointConfig(StrategyConfig):
    """Just-in-time checkpoints: saved by the survivors when a failure strikes."""
    name: str = "jit-checkpoint"
    every: Optional[int] = None  # iterations between fallback files (null: none, only the initial state)
    keep: int = 2  # checkpoints kept on storage (local and dist backends)
    save_s: Optional[float] = None  # fixed save stall in seconds (null: bytes over hardware.storage_gbps)


@register
class JitCheckpoint(CheckpointRestart):
    name = "jit-checkpoint"
    config = JitCheckpointConfig
    tests = StrategyTests(conformance=(),
                          conformance_scripts=("one failure", "standby used up"),
                          random=every_drawn("null", 3), dist=())

    def checkpoint_interval(self, iteration_s: float, stall_s: float, persist_s: float) -> int:
        """`every`, or one interval as long as the run: the initial checkpoint only."""
        return self.every if self.every is not None else max(1, self.ctx.iterations)

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        # The run loop makes the survivors' save before the replacement takes the failed
        # node's place (ftbench/loop.py); every stage must keep a live replica to be saved.
        actions = [SaveCheckpoint(FILE)] if self._every_stage_survives(cluster) else []
        return Recovery(actions=[*actions, RestartJob(), RestoreCheckpoint(FILE)], plan=self.current,
                        replace=(event.node,))

    def _every_stage_survives(self, cluster: Cluster) -> bool:
        """Whether each stage of the plan keeps a replica on a live node. Only the workers of
        the plan's nodes that are down now are looked at (a few at a time, at any scale)."""
        plan = self.current
        dead = [w for node in self.nodes_in_use() - cluster.alive for w in cluster.workers_on(node) if w in plan.holds]
        lost: dict[int, int] = {}
        for w in dead:
            for _, stage in plan.holds[w]:
                lost[stage] = lost.get(stage, 0) + 1
        if not lost:
            return True
        grid = plan.grid()
        if grid is not None:  # every stage has one replica per pipeline
            return max(lost.values()) < len(grid.workers) // grid.pp
        replicas: dict[int, int] = {}
        for held in plan.holds.values():
            for _, stage in held:
                replicas[stage] = replicas.get(stage, 0) + 1
        return all(count < replicas[stage] for stage, count in lost.items())
