"""`recycle`: ReCycle (Gandhi et al., SOSP 2024; first published as SlipStream).

No spare servers and no restart. When worker (d, s) fails, its micro-batches at stage s are
re-routed to the surviving data-parallel peers (d', s) of the same stage (adaptive
pipelining); the global batch and the optimizer semantics are unchanged, so training stays
exactly the same model. The extra work is absorbed by the pipeline's bubbles, helped by
  - decoupled backprop: B (input gradient) and W (weight gradient) are separate ops, and W
    is deferred into bubbles, off the critical path of the re-routed micro-batches;
  - the staggered optimizer: each stage steps as soon as its own gradients are reduced, with
    no barrier across stages, so the next iteration's warm-up overlaps this one's cool-down.
With no failure ReCycle runs the configured schedule (`schedule=`, 1F1B unless set) exactly as
`none` does. An adapted plan adds work to that schedule, it does not replace it: each
surviving worker keeps its own micro-batches' F and B (or fused BW) in their fault-free order,
none starting before its fault-free start, and steps no earlier than the fault-free step; the
re-routed micro-batches and the deferred W passes fill its bubbles (release times,
ftbench.release). So a failure never makes an iteration shorter than fault-free. Plans for every
normalised failure configuration up to `plan_ahead` failed nodes are made before training (MILP
for small instances, list-scheduling heuristic for large ones; ftbench.planning) and cached on
disk; a failure only switches to a stored plan.

Plans respect the GPU's memory: each worker's stash and W-deferral caps follow from the cost
model's memory (weights, gradients and Adam state, stashed activations, recomputation), so
a stored plan never exceeds it. A returning node copies its stage's weights and optimizer
state from a peer and the plan for the smaller failure set resumes. When some stage loses
every replica, or no re-routed plan fits in memory, re-routing cannot help: the run is
`unrecoverable`, or with `fallback: checkpoint` it restarts from the periodic checkpoint like
checkpoint restart.

`level` switches the mechanisms on one by one, for the paper's breakdown: `reroute`
(re-routing on 1F1B with a fused backward), `decoupled` (+ decoupled backprop), `staggered`
(+ staggered optimizer).

Global-norm gradient clipping would need every stage's gradients before any stage steps,
which is the barrier the staggered optimizer removes. This harness trains without clipping,
so stepping each stage as soon as its all-reduce ends is exactly the synchronous update.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from itertools import repeat
from typing import Optional

from ftbench.actions import FILE, Rendezvous, SyncFromPeers
from ftbench.cluster import Cluster
from ftbench.costs import PlanCosts
from ftbench.errors import ConfigError
from ftbench.folders import inside, relative_setting
from ftbench.failures import FailureEvent
from ftbench.placement import grid_nodes
from ftbench.plan import Plan, SameTiming, grid_replicas
from ftbench.release import releases_of
from ftbench.planning.library import METHODS, PlanLibrary, forms_up_to
from ftbench.planning.problem import (NORMALISE, PlanningError, Renaming, canonical_failed, form_of, normalise,
                                      problem_for, rename_onto)
from ftbench.planning.whole import WholeRenamings
from ftbench.schedule import NO_MICROBATCH, OPT, GridOps, Op, PartFlows, Schedule, grid_worker
from ftbench.sim.simulator import simulate
from ftbench.transfers import peer_copies
from ftbench.strategies.base import Recovery, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointConfig, CheckpointRestart

LEVELS = ("reroute", "decoupled", "staggered")
FALLBACKS = ("none", "checkpoint")
# ReCycle checkpoints only with strategy.fallback=checkpoint; without it these do nothing.
FALLBACK_FIELDS = ("every", "mtbf_hours", "keep", "save_s")


@dataclass
class ReCycleConfig(CheckpointConfig):
    """ReCycle; `every`, `mtbf_hours`, `keep` and `save_s` apply only with fallback: checkpoint."""
    name: str = "recycle"
    level: str = "staggered"  # reroute (1F1B, fused backward) | decoupled (+ B/W split) | staggered (+ staggered optimizer)
    planner: str = "heuristic"  # heuristic (list scheduling) | milp (pulp/CBC, warm-started by the heuristic) | auto (MILP for small instances)
    plan_ahead: int = 2  # plan every failure configuration of up to this many failed nodes before training
    normalise: str = "stage"  # stage (a plan per count of failed workers at each stage) | pipeline (per configuration up to renaming pipelines)
    plan_ahead_s: Optional[float] = 10.0  # at most this many seconds of planning ahead (fewest failures first); the rest is planned when a failure reaches it (null: no limit)
    whole_above_ops: Optional[int] = 50000  # normalise=stage: where one failed worker's re-routed micro-batches would couple more ops than this, plan its most failed workers of a stage as whole failed pipelines (null: never)
    milp_time_limit_s: float = 30.0  # CBC time limit per plan; the best plan found by then is used
    plan_cache: Optional[str] = "plan-cache"  # folder of cached plans inside the sweep folder (a single run: the run folder); null: memory only
    fallback: str = "none"  # none (no re-routing possible, or none fits in memory, ends the run) | checkpoint (restart from checkpoints)


def _random_settings(rng: random.Random, setup: dict) -> list[str]:
    """A seeded random script's ReCycle: with or without the checkpoint fallback."""
    fallback = rng.choice(FALLBACKS)
    settings = [f"strategy.fallback={fallback}", "strategy.plan_cache=null"]
    if fallback == "checkpoint":
        settings.append(f"strategy.every={rng.randint(1, 4)}")
    return settings


@register
class ReCycle(CheckpointRestart):
    name = "recycle"
    config = ReCycleConfig
    tests = StrategyTests(conformance=("strategy.fallback=checkpoint", "strategy.every=2", "strategy.plan_cache=null"),
                          conformance_scripts=("one failure", "after the optimizer steps", "two in one stage",
                                               "already down, idle and new nodes"),
                          random=_random_settings)

    @classmethod
    def check_settings(cls, cfg) -> None:
        if cfg.get("fallback") == "checkpoint":
            return
        defaults = {f.name: f.default for f in dataclasses.fields(ReCycleConfig)}
        for key in FALLBACK_FIELDS:
            if key in cfg and cfg.get(key) != defaults[key]:
                raise ConfigError(f"strategy.{key}", "recycle writes checkpoints only with strategy.fallback="
                                  "checkpoint, and ignores it otherwise",
                                  f"add strategy.fallback=checkpoint, or drop strategy.{key}")

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
        if cfg.plan_cache is not None:
            relative_setting("strategy.plan_cache", cfg.plan_cache)  # a folder inside the run (or sweep) folder
        if cfg.plan_ahead < 0:
            raise ConfigError("strategy.plan_ahead", f"must not be negative, got {cfg.plan_ahead}",
                              "give the number of failed nodes to plan for ahead (0: plan at the failure)")
        if cfg.milp_time_limit_s <= 0:
            raise ConfigError("strategy.milp_time_limit_s", f"must be positive, got {cfg.milp_time_limit_s}",
                              "give the MILP's time limit in seconds, e.g. 30")
        if cfg.normalise not in NORMALISE:
            raise ConfigError("strategy.normalise", f"unknown normalisation '{cfg.normalise}'",
                              f"choose one of {', '.join(NORMALISE)}")
        if cfg.plan_ahead_s is not None and cfg.plan_ahead_s < 0:
            raise ConfigError("strategy.plan_ahead_s", f"must not be negative, got {cfg.plan_ahead_s}",
                              "give the seconds of planning allowed before training (null: no limit)")
        if cfg.whole_above_ops is not None and cfg.whole_above_ops < 1:
            raise ConfigError("strategy.whole_above_ops", f"must be positive, got {cfg.whole_above_ops}",
                              "give a number of ops, e.g. 50000 (null: never plan whole pipelines)")
        self.normalise = cfg.normalise
        self.fallback = cfg.fallback
        self.checkpoint_mode = FILE if self.fallback == "checkpoint" else None
        super().__init__(cfg, ctx)
        self.failed: set[tuple[int, int]] = set()  # failed grid positions (pipeline, stage)
        self.library: PlanLibrary | None = None
        self.planned_ahead = 0
        self._references: dict = {}  # whole-pipeline form -> its _Reference

    def _plan_cache(self):
        """The plan cache's folder: inside the sweep's folder (its jobs share plans) or the run's;
        None (memory only) when unset or when the run has no folder (a planner's what-if)."""
        root = self.ctx.shared_dir or self.ctx.run_dir
        if self.cfg.plan_cache is None or root is None:
            return None
        return inside(root, "strategy.plan_cache", self.cfg.plan_cache)

    # -- plans --------------------------------------------------------------------------
    def plan(self, cluster: Cluster) -> Plan:
        self.cluster = cluster
        self.fault_free = self.ctx.grid_plan(cluster.pp, cluster.dp, cluster.gpus_per_node, node_of=cluster.node_of)
        # The original schedule's slots, from its fault-free timeline under the run's costs.
        timeline = simulate(self.fault_free.schedule, PlanCosts(self.ctx.cost_model, self.fault_free))
        self.releases = releases_of(timeline, cluster.pp)
        base = problem_for(self.ctx, cluster.pp, cluster.dp, cluster.gpus_per_node,
                           decoupled=self.level != "reroute", placement=cluster.placement, released=self.releases)
        self.library = PlanLibrary(base, self.planner, self.cfg.milp_time_limit_s, self._plan_cache(),
                                   rank=self._layout_time)
        # Per-stage forms rename workers stage by stage: only where no hop of a pipeline stays
        # within a node (else a renamed hop could leave it, and the plan would time otherwise).
        self.by = self.normalise if self.normalise == "pipeline" or not _hops_within_nodes(cluster) else "pipeline"
        # Large grids: a failed worker's micro-batches would couple too many ops into one part
        # (every peer that takes one of them): plan whole failed pipelines (see _whole_form).
        limit = self.cfg.whole_above_ops
        self.whole = self.by == "stage" and limit is not None and _coupled_ops(base) > limit
        forms = forms_up_to(self.cfg.plan_ahead, cluster.pp, cluster.dp, cluster.gpus_per_node, cluster.placement,
                            self.by)
        if self.whole:
            forms = sorted({_whole_form(max(form), cluster.dp, cluster.pp) for form in forms},
                           key=lambda form: (len(canonical_failed(form)), form))
        forms = [form for form in forms if canonical_failed(form)]  # the fault-free grid runs the configured schedule
        self.planned_ahead = self.library.precompute(forms, budget_s=self.cfg.plan_ahead_s)
        self.current = self._plan_for(cluster)
        return self.current

    def _plan_for(self, cluster: Cluster) -> Plan:
        """The plan of the current failure set: the configured schedule's grid when nothing is
        down, else the stored plan of the set's normal form, renamed onto the real workers
        (ftbench.planning.problem.Renaming), with the fault-free slots as release times. Raises
        PlanningError when no plan fits in memory."""
        if not self.failed:
            return dataclasses.replace(self.fault_free, name=f"recycle (fault-free, {self.fault_free.schedule.name})")
        pp, dp = cluster.pp, cluster.dp
        label = f"{len(self.failed)} re-routed"
        if self.by == "pipeline":  # (normalised once: the form and the order)
            normal = normalise(self.failed, dp, pp)
            stored = self.library.get(normal[0])
            return self._renamed(stored, rename_onto(self.failed, stored.form, dp, pp, normal), label)
        form = form_of(self.failed, dp, pp, self.by)
        if not self.whole:
            stored = self.library.get(form)
            return self._renamed(stored, rename_onto(self.failed, stored.form, dp, pp), label)
        # Whole pipelines: as many as the stage with the most failed workers has (see _whole_form).
        most = max(form)
        stored = self.library.get(_whole_form(most, dp, pp))
        if stored.shaped is not None:
            return self._whole_plan(stored, most, label)
        # (a plan held op by op, from the MILP or the disk cache: renamed as it is, the first
        # surviving workers of each stage that lost fewer idle)
        down = set(self.failed)
        for s, count in enumerate(form):
            spare = (d for d in range(dp) if (d, s) not in self.failed)
            down.update((next(spare), s) for _ in range(most - count))
        return self._renamed(stored, rename_onto(down, stored.form, dp, pp), label, idle=down - self.failed)

    def _whole_plan(self, stored, most: int, label: str) -> Plan:
        """The plan of `most` whole failed pipelines (canonically pipelines 0 .. most - 1) on
        the real failure set: at each stage a real failed worker beyond them trades places with
        a canonically failed one that is alive (in order), and the alive ones left over among
        them idle, stepping their replica. Every such plan times out as one reference, renamed
        (Plan.same_timing): each hop leaves its node (one GPU per node), each all-reduce counts
        the workers that make gradients (the same number), and an idle worker's step ends no
        later than those of its stage's workers that run ops. So the simulator times the
        reference once, and each plan is the reference's, patched where workers moved."""
        ref = self._reference(stored, most)
        tables = ref.renamings.tables(self.failed)  # (patched from the last set's: ftbench.planning.whole)
        # (its parts are left for GridOps.parts to find when someone reads them: the cache times
        # the plan as its reference, so most renamed plans are never split into parts)
        grid = GridOps(ref.plan.schedule.ops.templates, tables.of)
        schedule = Schedule(grid, stages=ref.plan.schedule.stages, microbatches=ref.plan.schedule.microbatches,
                            name=ref.plan.schedule.name, released=self.releases.with_owners(tables.owners))
        plan = Plan(schedule=schedule, partition=ref.plan.partition, holds=tables.holds, node_of=tables.node_of,
                    name=f"recycle-{self.level} ({label})", staggered_optimizer=ref.plan.staggered_optimizer)
        plan.same_timing = SameTiming(ref.plan, tables.renamed, tables.absent, schedule, tables.holds, tables.node_of)
        return plan

    def _reference(self, stored, most: int) -> "_Reference":
        """The plan of `most` whole failed pipelines on the canonical workers, every one of
        theirs idle: the reference its renamings time out as (kept for the last few counts)."""
        found = self._references.get(stored.form)
        if found is None or found.stored is not stored:
            pp, dp = self.cluster.pp, self.cluster.dp
            identity = tuple(range(dp))
            dead = canonical_failed(stored.form)
            plan = self._renamed(stored, Renaming((identity,) * pp, identity, dead), f"{most} whole pipelines",
                                 idle=dead)
            found = self._references[stored.form] = _Reference(stored, plan, most)
            while len(self._references) > 4:
                self._references.pop(next(iter(self._references)))
        return found

    def _renamed(self, stored, renaming: Renaming, label: str, idle=frozenset()) -> Plan:
        """A stored plan on the real workers as `renaming` says; the `idle` (pipeline, stage)
        positions, alive but canonically failed, only step their stage replica with the reduced
        gradient (so that they hold the current weights whenever a later plan uses them)."""
        pp, dp = self.cluster.pp, self.cluster.dp
        idle_labels = {}  # grid worker -> the canonical pipeline whose replica it steps
        if idle:
            inverse = {s: {d: i for i, d in enumerate(renaming.at[s])} for s in {s for _, s in idle}}
            idle_labels = {grid_worker(d, s, pp): renaming.labels[inverse[s][d]] for d, s in idle}
        ops = _grid_ops(stored, renaming, pp, idle_labels) if stored.shaped is not None else \
            _listed_ops(stored, renaming, pp, idle_labels)
        owners = renaming.owners(pp)
        schedule = Schedule(ops, stages=(pp,) * dp, microbatches=(self.ctx.microbatches,) * dp,
                            name=f"recycle-{self.level}", released=self.releases.with_owners(owners))
        replicas = grid_replicas(pp, dp)  # every survivor keeps (and steps) its own stage replica
        holds = {w: replicas[w] for w in ops}
        # (a worker renamed stage by stage steps its replica under the name of the pipeline whose
        # micro-batches it runs as its own: the same layers, so the same state)
        holds.update((w, ((d, w % pp),)) for w, d in owners.items())
        holds.update((w, ((d, w % pp),)) for w, d in idle_labels.items())
        nodes = grid_nodes(*self.cluster.layout, self.cluster.gpus_per_node, self.cluster.placement)  # per worker
        return Plan(schedule=schedule, partition=(self.ctx.cost_model.balanced_partition(pp),) * dp,
                    holds=holds, node_of=dict(zip(ops, map(nodes.__getitem__, ops))),
                    name=f"recycle-{self.level} ({label})", staggered_optimizer=self.level == "staggered")

    def _layout_time(self, stored) -> float:
        """A per-stage form's candidate layout's plan as the run times it (on its own canonical
        workers, the run's costs and optimizer): how the library ranks layouts."""
        pp, dp = self.cluster.pp, self.cluster.dp
        identity = tuple(range(dp))
        plan = self._renamed(stored, Renaming((identity,) * pp, identity, canonical_failed(stored.form)), "layout")
        return simulate(plan.schedule, PlanCosts(self.ctx.cost_model, plan),
                        staggered=plan.staggered_optimizer).iteration_time

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
        before, self.failed = self.failed, failed
        try:
            self.current = self._plan_for(cluster)
        except PlanningError as error:  # no re-routed plan fits in memory
            self.failed = before
            if self.fallback == "checkpoint":
                return self._restart(event, cluster, hit)
            return Recovery(unrecoverable=(
                f"node {event.node} failed and re-routing its micro-batches does not fit: {error} "
                "(set strategy.fallback=checkpoint to restart from checkpoints then, or train.recompute=full)"))
        return Recovery(actions=[Rendezvous()], plan=self.current)

    def _restart(self, event: FailureEvent, cluster: Cluster, hit) -> Recovery:
        """Checkpoint restart with a replacement for the failed node (it took a stage's last replica, or
        re-routing around it does not fit in memory);
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
        try:
            plan = self._plan_for(cluster)
        except PlanningError:  # no plan of the smaller failure set fits: the node stays idle
            self.failed |= back
            return Recovery()
        old, self.current = self.current, plan
        # The returning workers copy their stage's weights and optimizer state from a peer.
        copies = peer_copies(old, self.current, lambda w: cluster.is_alive(cluster.node_of(w)), self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=self.current)

    def on_event(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        if event.kind == "join":
            return self.on_join(event, cluster, iteration)
        if not self._positions(cluster, event.node) - self.failed:
            return Recovery()  # an idle node, or one already re-routed around
        return self.on_failure(event, cluster, iteration)


def _hops_within_nodes(cluster: Cluster) -> bool:
    """Whether some pipeline passes activations between two stages on one node."""
    nodes = grid_nodes(*cluster.layout, cluster.gpus_per_node, cluster.placement)
    pp = cluster.pp
    return any(nodes[w] == nodes[w + 1] for w in range(len(nodes) - 1) if (w + 1) % pp)


class _Reference:
    """A reference plan of whole failed pipelines (ReCycle._reference), the stored plan it
    renames, and its renamings onto the real failure sets."""

    def __init__(self, stored, plan: Plan, most: int):
        self.stored, self.plan = stored, plan
        self.renamings = WholeRenamings(plan.schedule.ops.of, plan.holds, plan.node_of, plan.schedule.stages[0], most)


def _coupled_ops(problem) -> int:
    """Ops of the part one failed worker's re-routed micro-batches couple at the most: its
    pipeline and every peer that takes one of them (one per micro-batch, at most dp - 1)."""
    m = problem.microbatches
    return problem.pp * m * (1 + min(m, problem.dp - 1)) * (3 if problem.decoupled else 2)


def _whole_form(failed_pipelines: int, dp: int, pp: int):
    """The pipeline normal form of the first `failed_pipelines` pipelines lost whole.

    With strategy.normalise=stage on a large grid (strategy.whole_above_ops), a failure
    configuration whose stages lost at most k workers each is planned as k whole failed
    pipelines: their micro-batches run whole on peer pipelines (parts of one pipeline each,
    planned once per shape), and where a stage lost fewer than k, its first surviving workers
    idle, stepping their replica with the reduced gradient. A failed worker's micro-batches alone
    would couple its pipeline with every peer that takes one (sixty-five pipelines of ops to
    schedule and simulate as one for each new configuration, at 64 micro-batches).

    Written out, not normalised (this is asked at every failure): normalise puts the pipelines
    with the most failed stages first, so the lost ones lead and the whole ones follow."""
    return (tuple(range(pp)),) * failed_pipelines + ((),) * (dp - failed_pipelines)


def _listed_ops(stored, renaming: Renaming, pp: int, idle: dict[int, int]) -> dict[int, list[Op]]:
    """A stored plan's orders on the real workers (canonical position (i, s) is the worker of
    real pipeline renaming.at[s][i], canonical pipeline i's micro-batches real pipeline
    renaming.labels[i]'s), each worker stepping the stage replica it runs as its own last (the
    replica of labels[i]: the same layers as its own pipeline's)."""
    ops, at, label = {}, renaming.at, renaming.labels
    for (i, s), canonical in stored.orders.items():
        ops[grid_worker(at[s][i], s, pp)] = [op._replace(pipeline=label[op.pipeline]) for op in canonical] + \
            [Op(OPT, s, NO_MICROBATCH, label[i])]
    ops.update((w, [Op(OPT, w % pp, NO_MICROBATCH, d)]) for w, d in idle.items())  # idle workers only step
    return dict(sorted(ops.items()))


def _grid_ops(stored, renaming: Renaming, pp: int, idle: dict[int, int]) -> GridOps:
    """The same from a plan kept per shape of part (ftbench.planning.parts): each shape's
    orders become bound templates, once, and each part only names its real flows
    (PartFlows), so a large grid's thousands of parts, re-routed or not, are never built op
    by op. Every worker steps its own stage replica last."""
    templates, of, members = [], {}, []
    at, label = renaming.at, renaming.labels
    for shape, orders, parts in stored.shaped:
        ids = {}
        for pos, order_ in orders.items():
            ids[pos] = len(templates)
            templates.append(tuple((op.kind, op.stage, op.microbatch, op.pipeline) for op in order_)
                             + ((OPT, pos[1], NO_MICROBATCH, pos[0]),))
        tids_of: dict[tuple, list[int]] = {}  # a part's local positions -> their templates (shared by its shape)
        for part in parts:
            flows = PartFlows(tuple(map(label.__getitem__, part.pipeline_of)), part.microbatches)
            local = part.local
            places = tuple(local.values())
            tids = tids_of.get(places) or tids_of.setdefault(places, [ids[pos] for pos in places])
            # (grid_worker written out: sixteen thousand workers at every failure of a large grid)
            workers = [at[s][i] * pp + s for i, s in local]
            records = sorted(zip(workers, tids))
            of.update(zip(workers, zip(tids, repeat(flows))))
            members.append((flows, records))
    steps = {}  # an idle worker's template, per stage: its step alone, a part of its own
    for w, d in idle.items():
        s = w % pp
        if s not in steps:
            steps[s] = len(templates)
            templates.append(((OPT, s, NO_MICROBATCH, 0),))
        flows = PartFlows((d,), ((),))
        of[w] = (steps[s], flows)
        members.append((flows, [(w, steps[s])]))
    ops = GridOps(tuple(templates), {w: of[w] for w in sorted(of)})  # (by worker: sorting ints, not records)
    members.sort(key=lambda part: part[1][0][0])
    ops.set_parts(members)  # what GridOps.parts would find, known here already
    return ops
