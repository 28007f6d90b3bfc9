"""`torchft`: torchft's replica groups (meta-pytorch/torchft 0.2).

Each data-parallel pipeline of the pp x dp grid is a replica group: its own processes, its
own samples of every step. A per-step quorum decides which groups take part. When a worker
fails, the step in flight is not committed (torchft's `should_commit` fails) and every group
the failure touched drops out: the others agree on the smaller quorum (a rendezvous of the
survivors in their own processes) and redo the step without it, then go on. Nothing is rolled
back and no checkpoint is read, but the global batch is smaller while a group is out: its
samples are dropped, and the run's samples ledger says which (ftbench.samples).

Under LocalSGD or DiLoCo (train.data_parallel) a step ties no group to another: the quorum
is taken at the sync. A failure then leaves the groups it does not touch alone: they finish
the iteration's local step and its sync among themselves, nothing of theirs undone, and the
quorum without the failed group is agreed at the iteration's end (`finishes_local_step`,
ftbench.loop.RunLoop._finish_without).

The failed node's replacement (a standby, else a new node after `cluster.replacement_s`)
starts the group's processes (`hardware.restart_s`) while training goes on, then joins
(`Recovery.later`). A group whose nodes are all up again rejoins at the next step: a new
quorum, and its workers heal from a live group's replicas of their stages (weights and AdamW
state), after which it trains its own samples again.

What this reading fixes, since the sources leave it open:
- The redone step trains the same samples, its surviving groups' share of the iteration's
  numbering (samples are fixed by (seed, step) here; torchft's groups draw from their own
  data loaders, which move on).
- The heal is charged as a stall of every group (a rendezvous and the peer copy over the
  links). torchft overlaps it with the healthy groups' step, so this is an upper bound.
- No per-step quorum cost is charged (torchft's Lighthouse round trip), for want of a
  measured figure.
- When every group has lost a worker there is no live replica to heal from and no
  checkpoint: the run ends unrecoverable (torchft users keep checkpoints for this case).
"""
from __future__ import annotations

from dataclasses import dataclass

from ftbench.actions import Rendezvous, SyncFromPeers
from ftbench.cluster import ClusterView
from ftbench.failures import FailureEvent
from ftbench.local_sgd import heal_source
from ftbench.plan import Plan, generated_grid_plan
from ftbench.samples import pipeline_offsets
from ftbench.strategies.base import Recovery, Strategy, StrategyConfig, StrategyTests, register
from ftbench.transfers import group_copies, peer_copies


def _random_algorithm(rng, setup: dict) -> list[str]:
    """The seeded random scripts draw torchft's data parallelism too: synchronous, LocalSGD or
    DiLoCo, syncing every 1 to 4 steps (ftbench.local_sgd)."""
    algorithm = rng.choice(("synchronous", "localsgd", "diloco"))
    if algorithm == "synchronous":
        return []
    return [f"train.data_parallel={algorithm}", f"train.sync_every={rng.randint(1, 4)}"]


@dataclass
class TorchftConfig(StrategyConfig):
    """torchft: replica groups that drop out of the step and heal from a live peer; no settings."""
    name: str = "torchft"


@register
class Torchft(Strategy):
    name = "torchft"
    config = TorchftConfig
    keeps_global_batch = False
    trains_local_steps = True  # torchft's LocalSGD and DiLoCo (ftbench.local_sgd)
    finishes_local_step = True  # between syncs no group waits on another (torchft's quorum is at the sync)
    tests = StrategyTests(conformance_scripts=("one failure", "failure then join", "reshape and grow back",
                                               "standby used up"),
                          random=lambda rng, setup: _random_algorithm(rng, setup),
                          dist=("cluster.spares=1",))

    def plan(self, cluster: ClusterView) -> Plan:
        ctx = self.ctx
        self.full = ctx.grid_plan(cluster.pp, cluster.dp, cluster.gpus_per_node, node_of=cluster.node_of)
        pp, dp = cluster.pp, cluster.dp
        groups = [[0] * pp for _ in range(dp)]
        for w, held in self.full.holds.items():
            for d, s in held:
                groups[d][s] = w
        self.groups = groups  # replica group d: its workers in stage order
        self.group_nodes = [frozenset(map(self.full.node_of.__getitem__, g)) for g in groups]
        self.groups_of: dict[int, list[int]] = {}  # node -> the groups with a worker on it
        for d, nodes in enumerate(self.group_nodes):
            for node in nodes:
                self.groups_of.setdefault(node, []).append(d)
        self.offsets = pipeline_offsets(self.full)
        self.active = frozenset(range(dp))
        self.current = self.full
        return self.full

    def _plan_of(self, active: frozenset) -> Plan:
        """The grid of the groups in `active`, each on its own workers with its own samples."""
        if len(active) == len(self.groups):
            return self.full
        ds = sorted(active)
        counts = self.full.schedule.microbatches
        workers = [w for d in ds for w in self.groups[d]]
        plan = generated_grid_plan(self.ctx.schedule_name, len(self.groups[0]), tuple(counts[d] for d in ds),
                                   self.ctx.cost_model.balanced_partition(len(self.groups[0])), workers,
                                   self.full.node_of.__getitem__)
        plan.sample_offsets = tuple(self.offsets[d] for d in ds)
        return plan

    def on_event(self, event: FailureEvent, cluster: ClusterView, iteration: int) -> Recovery:
        touched = self.groups_of.get(event.node)
        if touched is None:  # a node no group runs on (a new one): it waits as a standby
            return Recovery(standby=(event.node,)) if event.kind == "join" else Recovery()
        if event.kind == "join":
            return self._rejoin(cluster)
        out = self.active.intersection(touched)
        if not out:  # a node of a group that is out already: it needs its replacement too
            return Recovery(later=(event.node,))
        active = self.active - out
        if not active:
            return Recovery(unrecoverable="every replica group lost a worker: torchft heals a group only from a "
                            "live one, and this run keeps no checkpoint to fall back to")
        self.active, self.current = active, self._plan_of(active)
        return Recovery(actions=[Rendezvous()], plan=self.current, later=(event.node,))

    def _rejoin(self, cluster: ClusterView) -> Recovery:
        """Groups out of the step whose nodes are all up again join the quorum, healed from a
        live group's replicas."""
        ready = [d for d in range(len(self.groups)) if d not in self.active and self.group_nodes[d] <= cluster.alive]
        if not ready:
            return Recovery()
        old, source = self.current, heal_source(self.active)
        self.active = self.active.union(ready)
        self.current = self._plan_of(self.active)
        if self.ctx.local_steps is not None:  # replicas differ between syncs: all from one group
            copies = group_copies(self.full, source, ready, self.ctx.cost_model)
        else:
            live = frozenset(old.holds)
            copies = peer_copies(old, self.current, live.__contains__, self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), SyncFromPeers(tuple(copies))], plan=self.current)
