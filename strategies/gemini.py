"""`gemini`: checkpoints in CPU memory, on the node and on its peers (Wang et al., SOSP 2023).

Every `memory_every` iterations (Gemini: every iteration) each GPU's state goes to host
memory held outside the training processes, on its own node and on every other node of its
placement group of `group` nodes (ftbench.plan.host_groups). The traffic is interleaved with
training traffic in the network's idle time, spread over the iterations between two
checkpoints: the modelled clock charges only what does not fit
(recovery_costs.interleaved_checkpoint_stall_s). Files on remote storage are the fallback,
every `every` iterations (null: Young/Daly, as checkpoint restart tunes its own).

When a node fails, a standby or a new node takes its place and every training process
restarts (Gemini does not keep the processes); each worker then loads the newest in-memory
checkpoint: from its own node's host memory, or, on the replacement, from a peer of its
group over the network. At most the iterations since that checkpoint are redone. When every
node of some group has lost its host memory (they failed before a checkpoint refilled it),
the job restarts from the files instead, as checkpoint restart does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from ftbench.actions import (CHECKPOINT_BYTES_PER_PARAM, FILE, HOST, CheckpointTier, InterleavedCheckpoint,
                             RestartJob, RestoreCheckpoint, Transfer)
from ftbench.cluster import Cluster
from ftbench.errors import ConfigError
from ftbench.failures import FailureEvent
from ftbench.plan import host_groups
from ftbench.recovery_costs import most_replica_bytes
from ftbench.strategies.base import Recovery, StrategyConfig, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointRestart


@dataclass
class GeminiConfig(StrategyConfig):
    """Gemini: in-memory checkpoints on the node and its group's peers, files as the fallback."""
    name: str = "gemini"
    memory_every: int = 1  # iterations between in-memory checkpoints (Gemini: every iteration)
    group: int = 2  # nodes of a placement group, each holding every member's checkpoint (Gemini's m)
    every: Optional[int] = None  # iterations between checkpoint files (null: Young/Daly, as checkpoint restart)
    mtbf_hours: Optional[float] = None  # one node's MTBF for Young/Daly (null: from the failure model)
    keep: int = 2  # checkpoints kept, in files and in each node's host memory (local and dist backends)
    save_s: Optional[float] = None  # fixed file save stall in seconds (null: bytes over hardware.storage_gbps)


def _random_settings(rng: random.Random, setup: dict) -> list[str]:
    return [f"strategy.memory_every={rng.choice((1, 2, 3))}", f"strategy.group={rng.choice((1, 2, 3))}",
            f"strategy.every={rng.choice((2, 3, 4))}"]


@register
class Gemini(CheckpointRestart):
    name = "gemini"
    config = GeminiConfig
    tests = StrategyTests(conformance=("strategy.every=3",),
                          conformance_scripts=("one failure", "two in one iteration", "standby used up"),
                          random=_random_settings, dist=("strategy.every=3",))

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.memory_every, self.group = cfg.memory_every, cfg.group
        for setting, value, what in (("strategy.memory_every", self.memory_every, "iterations"),
                                     ("strategy.group", self.group, "nodes")):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(setting, f"must be at least 1, got {value!r}", f"set {setting} to a whole "
                                  f"number of {what} (Gemini: memory_every=1, group=2)")
        # node -> the iteration in flight when it failed: its host memory is empty until the
        # next in-memory checkpoint after that (each node is in until then; at the start, none)
        self.emptied: dict[int, int] = {}

    def checkpoint_tiers(self):
        return (CheckpointTier(HOST, self.memory_every, self.group), CheckpointTier(FILE))

    def iteration_work(self, plan):
        return (InterleavedCheckpoint(self.memory_every, self.group),)

    def extra_memory(self, plan) -> tuple[None, float]:
        """Host memory per GPU (the sim's report): its own checkpoint and those of the group's
        other nodes' GPUs, `group` copies of a GPU's state."""
        return None, self.group * most_replica_bytes(plan, self.ctx.cost_model)

    def _holds_checkpoint(self, node: int, iteration: int) -> bool:
        """Whether `node`'s host memory holds the newest in-memory checkpoint while iteration
        `iteration` runs: one was saved (after a multiple of memory_every) since the node's
        memory was last emptied. A restore from host memory goes back to the newest multiple at
        or before the failure, so the first save after it is at the next multiple; a restore
        from files goes back further, and counting from the failure is then the safe side."""
        every = self.memory_every
        return iteration // every > self.emptied.get(node, 0) // every

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        self.emptied[event.node] = iteration
        self.emptied = {n: i for n, i in self.emptied.items() if not self._holds_checkpoint(n, iteration)}
        groups = host_groups(self.nodes_in_use(), self.group)
        empty = set(self.emptied)
        lost = [g for g in groups if empty.issuperset(g)]
        if iteration < self.memory_every or lost:  # no in-memory checkpoint yet, or a whole group lost
            # the files go back further than host memory may reach (what it kept newer is
            # dropped with the abandoned timeline): no node counts on it until the next save
            self.emptied = dict.fromkeys(self.nodes_in_use(), iteration)
            return Recovery(actions=[RestartJob(), RestoreCheckpoint(FILE)], plan=self.current, replace=(event.node,))
        copies = self._copies([g for g in groups if empty.intersection(g)], empty)
        return Recovery(actions=[RestartJob(), RestoreCheckpoint(HOST, copies)], plan=self.current,
                        replace=(event.node,))

    def _copies(self, groups, empty: set[int]) -> tuple[Transfer, ...]:
        """Each worker of a node whose host memory is empty gets its state from the host memory
        of a node of its group that holds it (named by a worker there, the sender)."""
        plan, cost_model = self.current, self.ctx.cost_model
        on_node: dict[int, list[int]] = {}
        for w in plan.holds:
            on_node.setdefault(plan.node_of[w], []).append(w)
        copies = []
        for group in groups:
            holders = [n for n in group if n not in empty]
            for k, node in enumerate(n for n in group if n in empty):
                src = on_node[holders[k % len(holders)]][0]
                for w in on_node.get(node, ()):
                    for pipeline, stage in plan.holds[w]:
                        layers, first, last = plan.layers(pipeline, stage), stage == 0, plan.is_last_stage(pipeline, stage)
                        nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(layers, first, last).params
                        copies.append(Transfer(layers, first, last, src, w, nbytes))
        return tuple(copies)
