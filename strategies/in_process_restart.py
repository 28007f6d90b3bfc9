"""`in-process-restart`: NVIDIA nvidia-resiliency-ext's in-process restart (0.7) on top of
checkpoint restart.

Checkpoints are files every `every` iterations, as checkpoint restart writes them. When a node
that runs a worker fails, the surviving processes are not ended: the training loop restarts
inside them. A reserve worker already started (`cluster.spares`: NVRx's pre-initialised
reserve workers) takes the failed node's place at once, or a new node comes up after
`cluster.replacement_s`; the survivors and the newcomer rebuild their communicators (a
rendezvous in the same processes) and every worker reloads the newest checkpoint that
verifies, then redoes the iterations since. What it saves against checkpoint restart is the
restart of every process (job launch, interpreter, imports, CUDA and process-group set-up):
`hardware.restart_s` on the simulator, the processes ended and started again on `dist`.
"""
from __future__ import annotations

from dataclasses import dataclass
from ftbench.actions import FILE, Rendezvous, RestoreCheckpoint
from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from ftbench.strategies.base import Recovery, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointConfig, CheckpointRestart, every_drawn


@dataclass
class InProcessRestartConfig(CheckpointConfig):
    """In-process restart: checkpoint restart's settings, survivors restarted inside their processes."""
    name: str = "in-process-restart"


@register
class InProcessRestart(CheckpointRestart):
    name = "in-process-restart"
    config = InProcessRestartConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "standby used up"),
                          random=every_drawn(1, 2, 3, 4), dist=("strategy.every=2",))

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        # The run loop brings the replacement (a reserve worker at once, else a new node after
        # cluster.replacement_s); no process of the survivors restarts.
        return Recovery(actions=[Rendezvous(), RestoreCheckpoint(FILE)], plan=self.current, replace=(event.node,))
