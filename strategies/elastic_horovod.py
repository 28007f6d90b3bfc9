"""`elastic-horovod`: Elastic Horovod's commit / roll back / shrink (Horovod >= 0.20).

Every `every` iterations each worker commits its state in its own memory (no storage). When
a worker fails, the survivors meet again (rendezvous, no process restart), roll back to the
last commit and go on with as many full pipelines as the surviving workers form, keeping the
global batch (its micro-batches are re-split over fewer pipelines). State a worker lacks for
its new place is copied from a surviving peer's commit. No replacement is needed; when fewer
than `pp` workers survive, or every copy of some stage is gone, training cannot go on. When
nodes come back, the job grows again (up to the configured dp) at the next iteration
boundary: the new workers receive the current state from their stage's peers, nothing is
rolled back.
"""
from __future__ import annotations

from ftbench.actions import MEMORY, Rendezvous, RestoreCheckpoint, SyncFromPeers
from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from ftbench.transfers import peer_copies
from ftbench.strategies.base import Recovery
from ftbench.strategies.checkpoint import CheckpointRestart


class ElasticHorovod(CheckpointRestart):
    name = "elastic-horovod"
    checkpoint_mode = MEMORY

    def plan(self, cluster: Cluster):
        self.max_dp = cluster.dp  # Elastic Horovod's max_np: it never grows past the configured size
        self.placement = list(range(cluster.pp * cluster.dp))
        return super().plan(cluster)

    def _reshape(self, cluster: Cluster, placement: list[int]):
        pp = cluster.pp
        dp = len(placement) // pp
        self.placement = placement[:dp * pp]
        self.current = self.ctx.grid_plan(pp, dp, cluster.gpus_per_node).on_workers(self.placement, cluster.node_of)
        return self.current

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        pp = cluster.pp
        held = {stage for w, replicas in self.current.holds.items() if cluster.is_alive(cluster.node_of(w))
                for _, stage in replicas}
        lost = sorted(set(range(pp)) - held)
        if lost:
            return Recovery(unrecoverable=f"every replica of stage {lost[0]} failed, and its in-memory commit with "
                            "it; elastic-horovod keeps no copy elsewhere (use checkpoint or varuna)")
        alive = self.alive_workers(cluster)
        dp = min(len(alive) // pp, self.ctx.global_batch // self.ctx.microbatch_size)
        if dp == 0:
            return Recovery(unrecoverable=f"only {len(alive)} workers survive, fewer than one pipeline of "
                            f"pp={pp} stages; elastic-horovod cannot shrink below one pipeline")
        old = self.current
        new = self._reshape(cluster, alive[:dp * pp])
        copies = peer_copies(old, new, lambda w: cluster.is_alive(cluster.node_of(w)), self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), RestoreCheckpoint(MEMORY, copies)], plan=new)

    def on_join(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        pp, dp = cluster.pp, len(self.placement) // cluster.pp
        idle = [w for w in self.alive_workers(cluster) if w not in self.placement]
        grow = min(len(idle) // pp, self.max_dp - dp, self.ctx.global_batch // self.ctx.microbatch_size - dp)
        if grow <= 0:
            return Recovery()
        # Workers in place keep their stages; the new pipelines are synced from them.
        old = self.current
        plan = self._reshape(cluster, self.placement + idle[:grow * pp])
        copies = peer_copies(old, plan, lambda w: cluster.is_alive(cluster.node_of(w)), self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=plan)
