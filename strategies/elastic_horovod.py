"""`elastic-horovod`: Elastic Horovod's commit / roll back / shrink (Horovod >= 0.20).

Every `every` iterations each worker commits its state in its own memory (no storage). When
a worker fails, the survivors meet again (rendezvous, no process restart), roll back to the
last commit and go on with as many full pipelines as the surviving workers form, keeping the
global batch (its micro-batches are re-split over fewer pipelines). State a worker lacks for
its new place is copied from a surviving peer's commit. No replacement is needed; when fewer
than `pp` workers survive, or every copy of some stage is gone, training cannot go on.
"""
from __future__ import annotations

from ftbench.actions import MEMORY, Rendezvous, RestoreCheckpoint
from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from strategies.base import Recovery
from strategies.checkpoint import CheckpointRestart


class ElasticHorovod(CheckpointRestart):
    name = "elastic-horovod"
    checkpoint_mode = MEMORY

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        pp = cluster.pp
        held = {stage for w, replicas in self.current.holds.items() if cluster.is_alive(cluster.node_of(w))
                for _, stage in replicas}
        lost = sorted(set(range(pp)) - held)
        if lost:
            return Recovery(unrecoverable=f"every replica of stage {lost[0]} failed, and its in-memory commit with "
                            "it; elastic-horovod keeps no copy elsewhere (use checkpoint or varuna)")
        alive = [w for w in range(cluster.workers) if cluster.is_alive(cluster.node_of(w))]
        dp = min(len(alive) // pp, self.ctx.global_batch // self.ctx.microbatch_size)
        if dp == 0:
            return Recovery(unrecoverable=f"only {len(alive)} workers survive, fewer than one pipeline of "
                            f"pp={pp} stages; elastic-horovod cannot shrink below one pipeline")
        self.current = self.ctx.grid_plan(pp, dp, cluster.gpus_per_node).on_workers(alive[:dp * pp], cluster.node_of)
        return Recovery(actions=[Rendezvous(), RestoreCheckpoint(MEMORY)], plan=self.current)
