"""`varuna`: Varuna's job morphing (Athlur et al., EuroSys 2022).

Checkpoints as checkpoint restart does, but a failure does not wait for a replacement: the
job restarts in the (pp, dp) shape that trains fastest on the workers that survive, keeping
the global batch, and reloads the checkpoint into the new partition (checkpoints are kept
per parameter, so any partition can read them). The shape is chosen the way Varuna does,
by simulating each candidate with the cost model; candidates that do not fit in memory are
skipped. When nodes come back and a bigger shape would train faster, the job checkpoints at
the iteration boundary and restarts in that shape ("morphs up"), losing no iterations.

Checkpoints follow the Oobleck artifact's Varuna (its simulator, the Varuna column of
Oobleck's Table 2): every `every` iterations (the artifact: 10), and also right after the
first iteration that completes after each restart or morph (`checkpoint_after_change`), so
a job hit again soon after a restart keeps its progress whatever the interval. Each is a
normal save; `strategy.save_s` can give its stall as the artifact measured it.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from ftbench.actions import FILE, RestartJob, RestoreCheckpoint, SaveCheckpoint
from ftbench.cluster import Cluster
from ftbench.errors import ConfigError, TooFewNodes
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent
from ftbench.layers import GradientSync
from ftbench.plan import Plan, grid_plan
from ftbench.schedule import generate
from ftbench.sim.simulator import Simulation
from ftbench.strategies.base import Recovery, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointConfig, CheckpointRestart, every_drawn


@dataclass
class VarunaConfig(CheckpointConfig):
    """Varuna: checkpoint restart in the fastest shape on the survivors."""
    name: str = "varuna"
    start: str = "configured"  # configured (the grid cluster.pp x cluster.dp) | fastest (its fastest shape that fits on the job's GPUs, as Varuna's own planner picks)


@register
class Varuna(CheckpointRestart):
    name = "varuna"
    config = VarunaConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "failure then join", "reshape and grow back"),
                          random=every_drawn(1, 2, 3, 4), dist=("strategy.every=2",))
    checkpoint_mode = FILE
    checkpoint_after_change = True  # a checkpoint once one iteration completes in the new shape

    @staticmethod
    def sized_by_membership(cfg) -> bool:
        """With start=fastest its first shape comes from the live GPUs (ftbench.job.sized_by_membership)."""
        return cfg.get("start", "configured") == "fastest"

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self._estimates: dict[tuple[int, int, int], float] = {}
        self._kinds: dict[tuple, tuple[Simulation, bool]] = {}  # a kind of pipeline -> its simulation alone, fits?
        self.configured_pp = None

    def plan(self, cluster: Cluster) -> Plan:
        if self.configured_pp is None:
            self.configured_pp = cluster.pp
        start = self.cfg.get("start", "configured")
        if start not in ("configured", "fastest"):
            raise ConfigError("strategy.start", f"unknown start '{start}'", "use configured or fastest")
        if start == "fastest" and not getattr(self, "_started", False):
            alive = self.alive_workers(cluster)
            best = self.best_shape(len(alive), cluster.gpus_per_node)
            if best is None:  # on a trace, the run loop waits for joins that bring more GPUs
                raise TooFewNodes("strategy.start", f"no (pp, dp) shape of {self.ctx.spec.name} fits in memory on "
                                  f"{len(alive)} GPUs", "use more GPUs, a GPU with more memory, or recompute")
            self._started = True  # later plans (a checkpoint restart's) are the morphs' business
            return self._morph(cluster, best, alive)
        return super().plan(cluster)

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        alive = self.alive_workers(cluster)
        best = self.best_shape(len(alive), cluster.gpus_per_node)
        # Too few GPUs for any shape: the job stops, its checkpoint on storage, until the
        # trace brings enough nodes back (resume).
        if not alive:
            return Recovery(unrecoverable=f"node {event.node} was the last node up: no worker is left to restart on "
                            "(varuna morphs onto the survivors and asks for no replacements)", wait=True)
        if best is None:
            return Recovery(unrecoverable=f"no (pp, dp) shape of {self.ctx.spec.name} fits in memory on the "
                            f"{len(alive)} surviving workers", wait=True)
        return Recovery(actions=[RestartJob(), RestoreCheckpoint(FILE)], plan=self._morph(cluster, best, alive),
                        shape=best)

    def resume(self, cluster: Cluster, iteration: int) -> Recovery:
        """After a wait for nodes: restart in the fastest shape on the live GPUs from the last
        checkpoint (TooFewNodes while no shape fits)."""
        alive = self.alive_workers(cluster)
        best = self.best_shape(len(alive), cluster.gpus_per_node)
        if best is None:
            raise TooFewNodes("strategy.start", f"no (pp, dp) shape of {self.ctx.spec.name} fits in memory on "
                              f"{len(alive)} GPUs", "wait for the trace's joins")
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
        self.current = self.grid_on(cluster, pp, dp, alive[:pp * dp])
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
            if (pp, dp, gpus_per_node) not in self._estimates and self._busy_bound(pp, -(-micro // dp)) >= best_time:
                continue  # its busiest worker alone takes as long as the best so far: it cannot be faster
            t = self._iteration_time(pp, dp, gpus_per_node)
            if t < best_time:
                best, best_time = (pp, dp), t
        return best

    def _busy_bound(self, pp: int, microbatches: int) -> float:
        """A lower bound on _iteration_time(pp, dp, ...) when its largest pipelines run
        `microbatches`, without simulating. On the grid, stage s's worker runs its stage's F
        and B and W (or BW) of every micro-batch, and its step, one after another, so the
        iteration lasts at least the float sum of those ops' seconds in that order, whatever
        the all-reduces do. For n ops that sum is at least (1 - n 2^-53) times the exact one,
        and the sum computed here is within a few 2^-53 of the exact one: the factor 1 - 1e-9
        covers both for n below a million. best_shape skips, this way, deep candidates that
        cannot beat a shallower one (at 16,384 GPUs Varuna's 32-stage pipelines run 256
        micro-batches each, a quarter of a second per new count to simulate)."""
        model = self.ctx.cost_model
        if 3 * microbatches + 1 >= 1_000_000:
            return 0.0  # past the margin's reach: no bound
        busiest = 0.0
        for stage, layers in enumerate(model.balanced_partition(pp)):
            c = model.stage(layers, stage == 0, stage == pp - 1)
            busiest = max(busiest, microbatches * (c.forward_s + c.backward_input_s + c.backward_weight_s)
                          + model.optimizer_s(c.params))
        return busiest * (1 - 1e-9)

    def _iteration_time(self, pp: int, dp: int, gpus_per_node: int) -> float:
        """The simulated iteration time of ctx.grid_plan(pp, dp, gpus_per_node), inf where it
        does not fit in memory.

        On that grid (worker d * pp + s on node worker // gpus_per_node) pipeline d differs
        from another only in its micro-batch count (the first `total % dp` take one more) and
        in where its stages fall on nodes, which repeats every gpus_per_node / gcd(pp,
        gpus_per_node) pipelines; everything else (layers, stages, orders) is the same.
        Pipelines meet only in the gradient all-reduces, each of which starts when the last
        pipeline's gradients of its layers are ready. So each kind of pipeline is simulated
        once, alone, on the nodes it has in the grid (every transfer costs what it costs
        there), and the grid's iteration is those timelines with each all-reduce starting at
        the latest of the kinds' starts and charged as over all dp pipelines: the same
        iteration time and peak memory as simulating the grid."""
        key = (pp, dp, gpus_per_node)
        if key not in self._estimates:
            total = self.ctx.global_batch // self.ctx.microbatch_size
            extra = total % dp  # ctx.split_microbatches: pipelines d < extra take one more
            period = gpus_per_node // gcd(pp, gpus_per_node)
            kinds = {(total // dp + (1 if d < extra else 0), d * pp % gpus_per_node)
                     for d in [*range(min(extra, period)), *range(extra, min(dp, extra + period))]}
            alone = [self._alone(pp, gpus_per_node, *kind) for kind in sorted(kinds)]
            if not all(fits for _, fits in alone):
                self._estimates[key] = float("inf")
            else:
                starts: dict = {}
                for simulation, _ in alone:
                    for units, t in simulation.sync_starts().items():
                        if units not in starts or t > starts[units]:
                            starts[units] = t
                sync_time = _GridSyncTime(self.ctx.cost_model, pp, dp, gpus_per_node)
                self._estimates[key] = max(simulation.iteration_time(sync_time, starts) for simulation, _ in alone)
        return self._estimates[key]

    def _alone(self, pp: int, gpus_per_node: int, microbatches: int, phase: int) -> tuple[Simulation, bool]:
        """One pipeline of `microbatches` whose first stage sits `phase` GPUs into a node,
        simulated alone (kept: the same kind recurs as dp changes), and whether it fits in memory."""
        kind = (pp, gpus_per_node, microbatches, phase)
        if kind not in self._kinds:
            schedule = generate(self.ctx.schedule_name, pp, microbatches, 1)
            plan = grid_plan(schedule, self.ctx.cost_model.balanced_partition(pp), pp, gpus_per_node,
                             node_of=lambda w: (phase + w) // gpus_per_node)
            simulation = Simulation(plan.schedule, PlanCosts(self.ctx.cost_model, plan))
            peak = max(simulation.result().peak_memory_bytes.values())
            self._kinds[kind] = (simulation, peak <= self.ctx.cost_model.memory_bytes)
        return self._kinds[kind]


class _GridSyncTime:
    """Seconds of a fragment's ring all-reduce over the grid (pp, dp) on gpus_per_node-GPU
    nodes: its members are workers d * pp + s, d < dp (one per pipeline), on one node only if
    the first and the last are (node = worker // gpus_per_node)."""

    def __init__(self, model, pp: int, dp: int, gpus_per_node: int):
        self.model, self.pp, self.dp, self.gpus_per_node = model, pp, dp, gpus_per_node

    def __call__(self, sync: GradientSync, workers: list[int]) -> float:
        s, g = sync.stage, self.gpus_per_node
        one_node = s // g == ((self.dp - 1) * self.pp + s) // g
        return self.model.allreduce_s(self.model.unit_params(sync.units), self.dp, one_node)
