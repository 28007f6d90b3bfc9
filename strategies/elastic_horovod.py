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

from dataclasses import dataclass
from itertools import cycle
from typing import Optional

from ftbench.actions import MEMORY, Rendezvous, RestoreCheckpoint, SyncFromPeers
from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from ftbench.plan import Plan
from ftbench.recovery_costs import most_replica_bytes
from ftbench.transfers import peer_copies
from ftbench.strategies.base import Recovery, StrategyConfig, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointRestart, every_drawn


@dataclass
class ElasticHorovodConfig(StrategyConfig):
    """Elastic Horovod: commits in each worker's memory, no files (so no `keep`)."""
    name: str = "elastic-horovod"
    every: Optional[int] = None  # iterations between commits (null: Young/Daly from the failure model)
    mtbf_hours: Optional[float] = None  # one node's MTBF for Young/Daly (null: failures.mtbf_hours, or failures.job_mtbf_hours x nodes)
    save_s: Optional[float] = None  # fixed commit stall in seconds (null: bytes over hardware.host_gbps)


@register
class ElasticHorovod(CheckpointRestart):
    name = "elastic-horovod"
    config = ElasticHorovodConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "failure then join", "reshape and grow back",
                                               "already down, idle and new nodes"),
                          random=every_drawn(1, 2, 3, 4))
    checkpoint_mode = MEMORY

    def plan(self, cluster: Cluster):
        self.max_dp = cluster.dp  # Elastic Horovod's max_np: it never grows past the configured size
        self.placement = list(range(cluster.pp * cluster.dp))
        return super().plan(cluster)

    def _reshape(self, cluster: Cluster, placement: list[int]):
        pp = cluster.pp
        dp = len(placement) // pp
        self.placement = placement[:dp * pp]
        self.current = self.grid_on(cluster, pp, dp, self.placement)
        return self.current

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        pp = cluster.pp
        alive = self.alive_workers(cluster)
        up = set(alive)
        lost = sorted(set(range(pp)) - self._held_stages(up, pp))
        if lost:
            return Recovery(unrecoverable=f"every replica of stage {lost[0]} failed, and its in-memory commit with "
                            "it; elastic-horovod keeps no copy elsewhere (use checkpoint or varuna)")
        dp = min(len(alive) // pp, self.ctx.global_batch // self.ctx.microbatch_size)
        if dp == 0:
            return Recovery(unrecoverable=f"only {len(alive)} workers survive, fewer than one pipeline of "
                            f"pp={pp} stages; elastic-horovod cannot shrink below one pipeline")
        old = self.current
        new = self._reshape(cluster, alive[:dp * pp])
        return Recovery(actions=[Rendezvous(), RestoreCheckpoint(MEMORY, self._copies(old, new, up))], plan=new)

    def on_join(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        pp, dp = cluster.pp, len(self.placement) // cluster.pp
        alive = self.alive_workers(cluster)
        placed = set(self.placement)
        idle = [w for w in alive if w not in placed]
        grow = min(len(idle) // pp, self.max_dp - dp, self.ctx.global_batch // self.ctx.microbatch_size - dp)
        if grow <= 0:
            return Recovery()
        # Workers in place keep their stages; the new pipelines are synced from them.
        old = self.current
        plan = self._reshape(cluster, self.placement + idle[:grow * pp])
        return Recovery(actions=[Rendezvous(), SyncFromPeers(self._copies(old, plan, set(alive)))], plan=plan)

    def extra_memory(self, plan: Plan) -> tuple[None, float]:
        """Elastic Horovod's commit: a copy of each worker's state in host memory (the sim's report)."""
        return None, most_replica_bytes(plan, self.ctx.cost_model)

    def _held_stages(self, up: set[int], pp: int) -> set[int]:
        """Stages some live worker of the current plan holds (looking no further once all pp are)."""
        held, every = set(), set(range(pp))
        for w, replicas in self.current.holds.items():
            if w in up:
                held.update(stage for _, stage in replicas)
                if len(held) >= pp and every <= held:
                    break
        return held

    def _copies(self, old: Plan, new: Plan, up: set[int]):
        """peer_copies(old, new) with the live workers `up`, () when there is none. Between
        grids peer_copies goes stage by stage; otherwise () at once when every worker of `new`
        is live and already holds each of its stages in `old` (as happens when whole pipelines
        go: survivors keep their stage), which is what peer_copies would find."""
        if old.grid() is None or new.grid() is None:
            if _keeps_stages(old, new, up):
                return ()
        return peer_copies(old, new, up.__contains__, self.ctx.cost_model) or ()


def _keeps_stages(old: Plan, new: Plan, up: set[int]) -> bool:
    """Whether every worker of `new` is in `up` and held, in `old`, a replica of each stage it
    holds in `new`, both plans cutting the layers one way for all their pipelines of one depth
    (so a replica's layers are its stage's): then no state needs to move."""
    stages = set(old.schedule.stages) | set(new.schedule.stages)
    if len(stages) != 1:
        return False
    cut = old.partition[0]
    if any(plan.partition.count(cut) != len(plan.partition) for plan in (old, new)):  # each p is cut or == cut
        return False
    was, now = old.grid(), new.grid()
    if was is not None and now is not None:
        # Grids: a worker keeps one replica, of the stage its place gives (its index mod pp),
        # so compare stages place by place without a Python loop over the workers.
        pp, workers = now.pp, now.workers
        stage_before = dict(zip(was.workers, cycle(range(pp))))
        return up.issuperset(workers) and list(map(stage_before.get, workers)) == list(range(pp)) * (len(workers) // pp)
    before = old.holds
    for w, held in new.holds.items():
        had = before.get(w)
        if had is None or w not in up:
            return False
        if len(held) == 1 and len(had) == 1:
            if held[0][1] != had[0][1]:
                return False
        elif not {s for _, s in held} <= {s for _, s in had}:
            return False
    return True
