"""`recycle`: ReCycle (Gandhi et al., SOSP 2024; first published as SlipStream).

No spare servers and no restart. When worker (d, s) fails, its micro-batches at stage s are
re-routed to the surviving data-parallel peers (d', s) of the same stage (adaptive
pipelining); the global batch and the optimizer semantics are unchanged, so training stays
exactly the same model. The extra work is absorbed by the pipeline's bubbles, helped by
  - decoupled backprop: B (input gradient) and W (weight gradient) are separate ops, and W
    is deferred into bubbles, off the critical path of the re-routed micro-batches;
  - the staggered optimizer: each stage steps as soon as its own gradients are reduced, with
    no barrier across stages, so the next iteration's warm-up overlaps this one's cool-down.
Schedules for every normalised failure configuration up to `plan_ahead` failed nodes are
planned before training (MILP for small instances, list-scheduling heuristic for large ones;
ftbench.planning) and cached on disk; a failure only switches to a stored plan.

A returning node copies its stage's weights and optimizer state from a peer and the plan
for the smaller failure set (the fault-free one when none is left) resumes. When some stage
loses every replica, re-routing cannot help: the run is `unrecoverable`, or with
`fallback: checkpoint` it restarts from the periodic checkpoint like checkpoint restart.

`level` switches the mechanisms on one by one, for the paper's breakdown: `reroute`
(re-routing on 1F1B with a fused backward), `decoupled` (+ decoupled backprop), `staggered`
(+ staggered optimizer).

Global-norm gradient clipping would need every stage's gradients before any stage steps,
which is the barrier the staggered optimizer removes. This harness trains without clipping,
so stepping each stage as soon as its all-reduce ends is exactly the synchronous update.
"""
from __future__ import annotations

from ftbench.actions import FILE, Rendezvous, SyncFromPeers
from ftbench.cluster import Cluster
from ftbench.errors import ConfigError
from ftbench.failures import FailureEvent
from ftbench.plan import Plan, holds_from_schedule
from ftbench.planning.library import METHODS, PlanLibrary, forms_up_to
from ftbench.planning.problem import normalise, problem_for
from ftbench.schedule import NO_MICROBATCH, OPT, Op, Schedule, grid_worker
from ftbench.transfers import peer_copies
from ftbench.strategies.base import Recovery
from ftbench.strategies.checkpoint import CheckpointRestart

LEVELS = ("reroute", "decoupled", "staggered")
FALLBACKS = ("none", "checkpoint")


class ReCycle(CheckpointRestart):
    name = "recycle"

    def __init__(self, cfg, ctx):
        self.level, self.planner = cfg.level, cfg.planner
        if self.level not in LEVELS:
            raise ConfigError("strategy.level", f"unknown level '{self.level}'", f"choose one of {', '.join(LEVELS)}")
        if self.planner not in METHODS:
            raise ConfigError("strategy.planner", f"unknown planner '{self.planner}'",
                              f"choose one of {', '.join(METHODS)}")
        if cfg.fallback not in FALLBACKS:
            raise ConfigError("strategy.fallback", f"unknown fallback '{cfg.fallback}'",
                              f"choose one of {', '.join(FALLBACKS)}")
        if cfg.plan_ahead < 0:
            raise ConfigError("strategy.plan_ahead", f"must not be negative, got {cfg.plan_ahead}",
                              "give the number of failed nodes to plan for ahead (0: plan at the failure)")
        if cfg.milp_time_limit_s <= 0:
            raise ConfigError("strategy.milp_time_limit_s", f"must be positive, got {cfg.milp_time_limit_s}",
                              "give the MILP's time limit in seconds, e.g. 30")
        self.fallback = cfg.fallback
        self.checkpoint_mode = FILE if self.fallback == "checkpoint" else None
        super().__init__(cfg, ctx)
        self.failed: set[tuple[int, int]] = set()  # failed grid positions (pipeline, stage)
        self.library: PlanLibrary | None = None
        self.planned_ahead = 0

    def _needs_mtbf(self) -> bool:
        return self.fallback == "checkpoint"

    # -- plans --------------------------------------------------------------------------
    def plan(self, cluster: Cluster) -> Plan:
        self.cluster = cluster
        base = problem_for(self.ctx, cluster.pp, cluster.dp, cluster.gpus_per_node,
                           decoupled=self.level != "reroute", placement=cluster.placement)
        self.library = PlanLibrary(base, self.planner, self.cfg.milp_time_limit_s, self.cfg.plan_cache)
        forms = forms_up_to(self.cfg.plan_ahead, cluster.pp, cluster.dp, cluster.gpus_per_node, cluster.placement)
        self.library.precompute(forms)
        self.planned_ahead = len(forms)
        self.current = self._plan_for(cluster)
        return self.current

    def _plan_for(self, cluster: Cluster) -> Plan:
        """The stored plan of the current failure set's normal form, renamed onto the real pipelines."""
        pp, dp = cluster.pp, cluster.dp
        form, order = normalise(self.failed, dp, pp)
        stored = self.library.get(form)
        real = lambda op: op._replace(pipeline=order[op.pipeline])  # noqa: E731 canonical -> real pipeline
        ops = {}
        for (i, s), canonical in stored.orders.items():
            d = order[i]
            ops[grid_worker(d, s, pp)] = [real(op) for op in canonical] + [Op(OPT, s, NO_MICROBATCH, d)]
        schedule = Schedule(ops, stages=(pp,) * dp, microbatches=(self.ctx.microbatches,) * dp,
                            name=f"recycle-{self.level}")
        label = "fault-free" if not self.failed else f"{len(self.failed)} re-routed"
        return Plan(schedule=schedule, partition=(self.ctx.cost_model.balanced_partition(pp),) * dp,
                    holds=holds_from_schedule(schedule), node_of={w: cluster.node_of(w) for w in ops},
                    name=f"recycle-{self.level} ({label})", staggered_optimizer=self.level == "staggered")

    def nodes_in_use(self) -> set[int]:
        return set(self.current.node_of.values())

    # -- membership ---------------------------------------------------------------------
    def _positions(self, cluster: Cluster, node: int) -> set[tuple[int, int]]:
        grid = cluster.pp * cluster.dp
        return {divmod(w, cluster.pp) for w in cluster.workers_on(node) if w < grid}

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        hit = self._positions(cluster, event.node)
        failed = self.failed | hit
        lost = [s for s in range(cluster.pp) if all((d, s) in failed for d in range(cluster.dp))]
        if lost:
            if self.fallback == "checkpoint":
                return self._restart(event, cluster, hit)
            return Recovery(unrecoverable=(
                f"node {event.node} took the last replica of stage {lost[0]}: no data-parallel peer is left to "
                "re-route its micro-batches to (set strategy.fallback=checkpoint to restart from checkpoints then)"))
        self.failed = failed
        self.current = self._plan_for(cluster)
        return Recovery(actions=[Rendezvous()], plan=self.current)

    def _restart(self, event: FailureEvent, cluster: Cluster, hit) -> Recovery:
        """Checkpoint restart with a replacement for the node that took the stage's last replica;
        nodes already down stay re-routed around."""
        recovery = super().on_failure(event, cluster, 0)  # replacement, restart, reload
        self.failed -= hit
        self.current = self._plan_for(cluster)
        return Recovery(actions=recovery.actions, plan=self.current, replace=recovery.replace)

    def on_join(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        back = self._positions(cluster, event.node) & self.failed
        if not back:
            return Recovery()  # a node that held nothing: nothing changes
        self.failed -= back
        old, self.current = self.current, self._plan_for(cluster)
        # The returning workers copy their stage's weights and optimizer state from a peer.
        copies = peer_copies(old, self.current, lambda w: cluster.is_alive(cluster.node_of(w)), self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=self.current)

    def on_event(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        if event.kind == "join":
            return self.on_join(event, cluster, iteration)
        if not self._positions(cluster, event.node) - self.failed:
            return Recovery()  # an idle node, or one already re-routed around
        return self.on_failure(event, cluster, iteration)
