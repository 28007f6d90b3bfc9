"""`varuna`: Varuna's job morphing (Athlur et al., EuroSys 2022).

Checkpoints as checkpoint restart does, but a failure does not wait for a replacement: the
job restarts in the (pp, dp) shape that trains fastest on the workers that survive, keeping
the global batch, and reloads the checkpoint into the new partition (checkpoints are kept
per parameter, so any partition can read them). The shape is chosen the way Varuna does,
by simulating each candidate with the cost model; candidates that do not fit in memory are
skipped. When nodes come back and a bigger shape would train faster, the job checkpoints at
the iteration boundary and restarts in that shape ("morphs up"), losing no iterations.
"""
from __future__ import annotations

from ftbench.actions import FILE, RestartJob, RestoreCheckpoint, SaveCheckpoint
from ftbench.cluster import Cluster
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.plan import Plan
from ftbench.sim.simulator import simulate
from ftbench.strategies.base import Recovery
from ftbench.strategies.checkpoint import CheckpointRestart


class Varuna(CheckpointRestart):
    name = "varuna"
    checkpoint_mode = FILE

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self._estimates: dict[tuple[int, int, int], float] = {}
        self.configured_pp = None

    def plan(self, cluster: Cluster) -> Plan:
        if self.configured_pp is None:
            self.configured_pp = cluster.pp
        return super().plan(cluster)

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        alive = self.alive_workers(cluster)
        best = self.best_shape(len(alive), cluster.gpus_per_node)
        if not alive:
            return Recovery(unrecoverable=f"node {event.node} was the last node up: no worker is left to restart on "
                            "(varuna morphs onto the survivors and does not wait for replacements)")
        if best is None:
            return Recovery(unrecoverable=f"no (pp, dp) shape of {self.ctx.spec.name} fits in memory on the "
                            f"{len(alive)} surviving workers")
        return Recovery(actions=[RestartJob(), RestoreCheckpoint(FILE)], plan=self._morph(cluster, best, alive),
                        shape=best)

    def on_join(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        alive = self.alive_workers(cluster)
        best = self.best_shape(len(alive), cluster.gpus_per_node)
        now = self._iteration_time(cluster.pp, cluster.dp, cluster.gpus_per_node)
        if best is None or self._iteration_time(*best, cluster.gpus_per_node) >= now:
            return Recovery()  # the current shape is still the best: the node waits
        return Recovery(actions=[SaveCheckpoint(FILE), RestartJob(), RestoreCheckpoint(FILE)],
                        plan=self._morph(cluster, best, alive), shape=best)

    def _morph(self, cluster: Cluster, shape: tuple[int, int], alive: list[int]) -> Plan:
        pp, dp = shape
        self.current = self.ctx.grid_plan(pp, dp, cluster.gpus_per_node).on_workers(alive[:pp * dp], cluster.node_of)
        return self.current

    def best_shape(self, workers: int, gpus_per_node: int) -> tuple[int, int] | None:
        """The fastest (pp, dp) with pp*dp <= workers that fits in memory, by simulation.
        Pipeline depths are those that split the layers evenly (Varuna's cut-points), plus
        the configured depth."""
        micro = self.ctx.global_batch // self.ctx.microbatch_size
        layers = self.ctx.spec.layers
        depths = sorted({p for p in range(1, layers + 1) if layers % p == 0} | {self.configured_pp})
        best, best_time = None, float("inf")
        for pp in (p for p in depths if p <= workers):
            dp = min(workers // pp, micro)
            t = self._iteration_time(pp, dp, gpus_per_node)
            if t < best_time:
                best, best_time = (pp, dp), t
        return best

    def _iteration_time(self, pp: int, dp: int, gpus_per_node: int) -> float:
        key = (pp, dp, gpus_per_node)
        if key not in self._estimates:
            plan: Plan = self.ctx.grid_plan(pp, dp, gpus_per_node)
            result = simulate(plan.schedule, PlanCosts(self.ctx.cost_model, plan))
            fits = max(result.peak_memory_bytes.values()) <= self.ctx.cost_model.memory_bytes
            self._estimates[key] = result.iteration_time if fits else float("inf")
        return self._estimates[key]
