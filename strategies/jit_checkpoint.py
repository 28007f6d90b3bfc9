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
        alive = cluster.alive
        node_of = self.worker_nodes(cluster)
        held = set()
        for w, replicas in self.current.holds.items():
            if node_of[w] in alive:
                held.update(stage for _, stage in replicas)
        actions = [SaveCheckpoint(FILE)] if held >= set(range(max(self.current.schedule.stages))) else []
        return Recovery(actions=[*actions, RestartJob(), RestoreCheckpoint(FILE)], plan=self.current,
                        replace=(event.node,))
