"""`bamboo`: redundant computation (Thorpe et al., NSDI 2023).

Pipelines of S stages (cluster.pp), one node per stage, as many as the job's nodes hold
(cluster.pp x cluster.dp / cluster.gpus_per_node nodes, or cluster.nodes). Every worker also holds a redundant
copy of the next stage of its pipeline, (s+1) mod S, weights and optimizer state. The copy is
kept in step the way Bamboo's engine is written to: after its optimizer step, the worker of
stage s+1 sends that stage's weights and optimizer state to its predecessor (RSYNC in the
schedule IR, ftbench.schedule), so the copy equals the original exactly. With several GPUs
per node, GPU j of S consecutive nodes forms one pipeline (lane j), so stage s and its copy
are never on one node.

`strategy.recovery` is Bamboo's mode (its engine's `eager_recovery`, default False):

- *lazy* (the default, as Bamboo's code): the copy's weights and Adam state sit in host
  memory (Plan.host: the device's memory does not count them; the host's does, with the
  stage's outputs Bamboo keeps there for every micro-batch), and no redundant forward runs.
  At a failover the predecessor first loads the copy onto its GPU (LoadFromHost: the copy's
  weights and Adam state over hardware.host_gbps).
- *eager*: the copy is on the GPU, and worker s runs stage s+1's forward of micro-batch m on
  its own output (RF in the IR) just before it waits for that micro-batch's gradient,
  keeping the activations until the iteration ends. The last worker holds stage 0's copy
  but runs no redundant forward (as in Bamboo's engine, whose last stage never waits for a
  gradient). The redundant backward is lazy: nothing runs it until a failover.

The copy's placement changes only memory and the failover's time: on local and dist the
copy is a replica in the worker's process either way (what the simulator counts).

*Failover*: when the worker of stage s+1 fails, worker s runs both stages of that pipeline
from its copy (lazy: once loaded onto the GPU); only the iteration in flight is lost (Bamboo
finishes it from the stashed redundant forwards or the outputs kept in host memory; here it
is run again). Stage s+1 then has no copy left, nor does s+2 (its copy was on the failed
worker).

*Reconfiguration*: a failure is fatal to the pipeline when the failed worker already ran
two stages or its stage has no live copy (its predecessor failed before). Then the live
nodes are regrouped into floor(nodes / S) pipelines (each node one stage again, every copy
restored), the global batch kept (more micro-batches per pipeline); each worker copies the
layers it lacks from a live holder, original or copy, and the nodes left over wait. Joined
nodes wait too, until a reconfiguration uses them: when another whole pipeline fits, or when
there are at least as many waiting nodes as overloaded ones (nodes running two stages), as
in Bamboo's simulator. `strategy.overload` (Bamboo's simulator: 0.05) also reconfigures at a
failover once 2 x overloaded / live nodes exceeds it, if a whole pipeline still forms. Fewer
than S live nodes, or a layer no survivor holds, is unrecoverable.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from ftbench.actions import LoadFromHost, Rendezvous, SyncFromPeers
from ftbench.costs import ADAM_STATE_BYTES_PER_PARAM
from ftbench.errors import ConfigError, TooFewNodes
from ftbench.failures import FailureEvent
from ftbench.plan import Plan
from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM
from ftbench.schedule import (B, BW, F, NO_MICROBATCH, OP_KINDS, RF, RSYNC, Op, Schedule, generate, grid_worker,
                              read_ops)
from ftbench.strategies.base import Recovery, Strategy, StrategyConfig, StrategyTests, register
from ftbench.transfers import peer_copies


RECOVERY_MODES = ("lazy", "eager")  # strategy.recovery: Bamboo's eager_recovery False / True


@dataclass
class BambooConfig(StrategyConfig):
    """Bamboo: redundant copies of the next stage (host memory, or the GPU with an eager redundant forward), failover, reconfiguration."""
    name: str = "bamboo"
    recovery: str = "lazy"  # lazy (Bamboo's default: the copy in host memory, no redundant forward) | eager (the copy on the GPU, its forward run redundantly)
    overload: Optional[float] = None  # reconfigure at a failover once 2 x overloaded nodes / live nodes exceeds this (Bamboo's simulator: 0.05; null: never)


def _random_settings(rng: random.Random, setup: dict) -> list[str]:
    """A seeded random script's Bamboo: one node per stage (a job of fewer nodes than stages
    gets the nodes it needs: idle nodes change nothing for the reference); reconfigure at
    failovers, or only on breaks."""
    settings = [f"cluster.nodes={setup['pp']}"] if setup["nodes"] < setup["pp"] else []
    return settings + [f"strategy.overload={rng.choice(('null', 0.05))}"]


@register
class Bamboo(Strategy):
    name = "bamboo"
    config = BambooConfig
    tests = StrategyTests(conformance_scripts=("one failure", "after the optimizer steps", "two in one stage",
                                               "changes during recovery"),
                          random=_random_settings)

    @staticmethod
    def sized_by_membership(cfg) -> bool:
        """floor(live nodes / cluster.pp) pipelines, whatever cluster.dp (ftbench.job.sized_by_membership)."""
        return True

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.overload = cfg.get("overload", None)
        if self.overload is not None and not 0 <= float(self.overload) < 1:
            raise ConfigError("strategy.overload", f"must be a fraction in [0, 1) or null, got {self.overload}",
                              "set strategy.overload=null (reconfigure only when a pipeline breaks or grows) "
                              "or 0.05 (Bamboo's simulator)")
        self.recovery = str(cfg.get("recovery", "lazy"))
        if self.recovery not in RECOVERY_MODES:
            raise ConfigError("strategy.recovery", f"must be one of {', '.join(RECOVERY_MODES)}, got {self.recovery!r}",
                              "set strategy.recovery=lazy (Bamboo's default: the copy in host memory) or eager "
                              "(the copy on the GPU, its forward run redundantly)")
        self.eager = self.recovery == "eager"
        self.microbatches = ctx.global_batch // ctx.microbatch_size
        self.groups: list[list[int]] = []  # S nodes each, in stage order
        self.idle: list[int] = []  # live nodes in no pipeline
        self.runner: list[list[int]] = []  # per pipeline, per stage: the worker that runs it
        self.copy: list[list[int | None]] = []  # per pipeline, per stage: the worker holding its redundant copy
        self.current: Plan | None = None

    # -- plan ---------------------------------------------------------------------------
    def plan(self, cluster) -> Plan:
        self.S, self.lanes = cluster.pp, cluster.gpus_per_node
        if self.S < 2:
            raise ConfigError("cluster.pp", "bamboo needs at least 2 stages: a worker holds a redundant copy of "
                              "the next stage of its pipeline", "set cluster.pp=2 or more")
        live = sorted(n for n in cluster.alive if n < cluster.nodes)
        if len(live) < self.S:
            raise TooFewNodes("cluster.nodes", f"bamboo puts each of the {self.S} stages on its own node, and the job "
                              f"has {len(live)} nodes", f"use at least cluster.pp = {self.S} nodes (cluster.nodes, "
                              "or cluster.pp x cluster.dp / cluster.gpus_per_node)")
        if len(live) // self.S * self.lanes > self.microbatches:
            raise ConfigError("train.microbatches", f"{len(live) // self.S * self.lanes} pipelines but only "
                              f"{self.microbatches} micro-batches in the global batch",
                              "raise train.microbatches, or lower cluster.dp")
        self._regroup(live, cluster)
        self.current = self._build(cluster)
        return self.current

    def _regroup(self, live: list[int], cluster) -> None:
        """floor(nodes / S) whole pipelines (times the lanes) over `live`, every copy in place."""
        count = self._fitting(len(live))
        self.groups = [live[k * self.S:(k + 1) * self.S] for k in range(count)]
        self.idle = live[count * self.S:]
        self.runner, self.copy = [], []
        for nodes in self.groups:
            for lane in range(self.lanes):
                workers = [cluster.workers_on(n)[lane] for n in nodes]
                self.runner.append(workers)
                self.copy.append([workers[(s - 1) % self.S] for s in range(self.S)])

    def _build(self, cluster, rule: str = "") -> Plan:
        """The plan of the current pipelines: each its own schedule with the redundant ops, the
        stages of a worker that took over its successor's merged into one order."""
        S, dp = self.S, len(self.runner)
        counts = self.ctx.split_microbatches(dp)
        ops: dict[int, list[Op]] = {}
        holds: dict[int, list[tuple[int, int]]] = {}
        for d in range(dp):
            for w, order in pipeline_orders(self.ctx.schedule_name, S, counts[d], d, self.runner[d],
                                            self.copy[d], redundant_forward=self.eager).items():
                ops[w] = order
            for s, w in enumerate(self.runner[d]):
                holds.setdefault(w, []).append((d, s))
            for s, w in enumerate(self.copy[d]):
                if w is not None and (d, s) not in holds[w]:
                    holds[w].append((d, s))
        schedule = Schedule(ops, stages=(S,) * dp, microbatches=counts, name=self.ctx.schedule_name)
        partition = (self.ctx.cost_model.balanced_partition(S),) * dp
        failed_over = sum(len(set(r)) < S for r in self.runner)
        shape = f"{len(self.groups)}x{S}" + (f"x{self.lanes}" if self.lanes > 1 else "")
        name = (f"bamboo[{shape}]" + (f" {failed_over} failed over" if failed_over else "")
                + (f" after {rule}" if rule else ""))
        host = frozenset() if self.eager else frozenset(
            (w, d, s) for d, held in enumerate(self.copy) for s, w in enumerate(held)
            if w is not None and self.runner[d][s] != w)  # lazy: copies it does not run are in host memory
        return Plan(schedule=schedule, partition=partition, holds={w: tuple(h) for w, h in holds.items()},
                    node_of={w: cluster.node_of(w) for w in ops}, name=name, host=host)

    # -- memory -------------------------------------------------------------------------
    def _params(self, d: int, s: int) -> int:
        plan = self.current
        return self.ctx.cost_model.stage(plan.layers(d, s), s == 0, plan.is_last_stage(d, s)).params

    def extra_memory(self, plan: Plan) -> tuple[None, float]:
        """Host memory (the sim's report; the device's is the plan's, Plan.host): lazy keeps
        each copy's weights and Adam state there (CHECKPOINT_BYTES_PER_PARAM per parameter,
        as Bamboo's engine allocates params, exp_avg and exp_avg_sq on 'cpu'), and the stage's
        output of every micro-batch of the iteration, copied there after its backward (the
        redundant stage's inputs for a re-run). Eager keeps nothing there."""
        if not plan.host:
            return None, 0.0
        cm, spec = self.ctx.cost_model, self.ctx.cost_model.spec
        boundary = spec.boundary_bytes(self.ctx.microbatch_size, self.ctx.seq_len)
        per_worker: dict[int, float] = {}
        for w, d, s in plan.host:
            params = cm.stage(plan.layers(d, s), s == 0, plan.is_last_stage(d, s)).params
            outputs = plan.schedule.microbatches[d] * boundary
            per_worker[w] = per_worker.get(w, 0.0) + CHECKPOINT_BYTES_PER_PARAM * params + outputs
        return None, max(per_worker.values())

    def memory_breakdown(self, plan: Plan, worker: int, peak: float) -> str:
        """The worker's device memory at its peak, in parts (the sim's `oom` message): its own
        stages' weights, gradients and Adam state; the copy (on the device, or in host memory
        and not counted); stashed activations, its own and the redundant forward's; at the
        run's micro-batch, sequence length and recompute setting."""
        from ftbench.costs import PlanCosts

        costs = PlanCosts(self.ctx.cost_model, plan)
        ops = plan.schedule.ops[worker]
        runs = {(op.pipeline, op.stage) for op in ops if op.kind == F}
        own_state = copy_device = copy_host = 0.0
        for d, s in plan.holds.get(worker, ()):
            params = costs._stage(d, s).params
            if (d, s) in runs:
                own_state += ADAM_STATE_BYTES_PER_PARAM * params
            elif (worker, d, s) in plan.host:
                copy_host += CHECKPOINT_BYTES_PER_PARAM * params
            else:
                copy_device += ADAM_STATE_BYTES_PER_PARAM * params
        own = redundant = 0.0
        best = (0.0, 0.0)  # (own, redundant) at the activations' peak, as the simulator walks them
        for op in ops:
            effect = OP_KINDS[op.kind].memory
            if effect == "stash":
                own += costs.stash_bytes(op)
            elif effect == "unstash":
                rebuilt = costs.recompute_bytes(op)
                if own + rebuilt + redundant > sum(best):
                    best = (own + rebuilt, redundant)
                own -= costs.stash_bytes(op) - (costs.weight_stash_bytes(op) if op.kind == B else 0.0)
            elif effect == "unstash_weight":
                own -= costs.weight_stash_bytes(op)
            elif effect == "stash_to_end":
                redundant += costs.stash_bytes(op)
            if own + redundant > sum(best):
                best = (own, redundant)
        copies = (f"the next stage's copy on the device {copy_device / 1e9:.1f} GB (recovery eager)" if copy_device
                  else f"the next stage's copy in host memory {copy_host / 1e9:.1f} GB, not on the device "
                  "(recovery lazy)" if copy_host else "no copy")
        counts = sorted({plan.schedule.microbatches[d] for d, _ in runs})
        mine = "its stage's" if len(runs) == 1 else f"its {len(runs)} stages'"
        return (f"{mine} weights, gradients and Adam state {own_state / 1e9:.1f} GB + {copies} + stashed "
                f"activations {sum(best) / 1e9:.1f} GB: its own {best[0] / 1e9:.1f} GB and the redundant forward's "
                f"{best[1] / 1e9:.1f} GB, {'/'.join(map(str, counts))} micro-batches of {self.ctx.microbatch_size} x "
                f"{self.ctx.seq_len} tokens per pipeline, train.recompute={self.ctx.recompute}")

    # -- membership ---------------------------------------------------------------------
    def on_event(self, event: FailureEvent, cluster, iteration: int) -> Recovery:
        node = event.node
        if event.kind == "join":
            return self._join(node, cluster)
        if node in self.idle:
            self.idle.remove(node)
            return Recovery()
        if not any(node in nodes for nodes in self.groups):
            return Recovery()  # a node outside the job
        dead = set(cluster.workers_on(node))
        broken = [(d, s) for d, stages in enumerate(self.runner) for s, w in enumerate(stages)
                  if w in dead and (self.copy[d][s] is None or self.copy[d][s] in dead)]
        if broken:
            d, s = broken[0]
            return self._reconfigure(cluster, f"stage {s} of pipeline {d} lost its copy")
        runner = [[self.copy[d][s] if w in dead else w for s, w in enumerate(stages)]
                  for d, stages in enumerate(self.runner)]
        copy = [[None if w in dead or stages[s] != self.runner[d][s] else w for s, w in enumerate(held)]
                for d, (held, stages) in enumerate(zip(self.copy, runner))]
        live = len(self._live_nodes(cluster))
        if self.overload is not None and 2 * len(_overloaded(runner, cluster)) / max(live, 1) > self.overload \
                and self._fitting(live) > 0:  # (a regroup that forms no pipeline would end the run)
            return self._reconfigure(cluster, "overload")
        actions = [Rendezvous()]
        if not self.eager:  # each taker first loads its copy from host memory onto its GPU
            loads: dict[int, float] = {}
            for d, stages in enumerate(runner):
                for s, w in enumerate(stages):
                    if w != self.runner[d][s]:
                        loads[w] = loads.get(w, 0.0) + CHECKPOINT_BYTES_PER_PARAM * self._params(d, s)
            if loads:
                actions.append(LoadFromHost(tuple(sorted(loads)), max(loads.values())))
        self.runner, self.copy = runner, copy
        self.current = self._build(cluster, "failover")
        return Recovery(actions=actions, plan=self.current)

    def _join(self, node: int, cluster) -> Recovery:
        if node >= cluster.nodes or node in self.idle or any(node in nodes for nodes in self.groups):
            return Recovery()
        self.idle.append(node)
        more = self._fitting(len(self._live_nodes(cluster))) > len(self.groups)
        overloaded = _overloaded(self.runner, cluster)
        if more or (overloaded and len(self.idle) >= len(overloaded)):
            return self._reconfigure(cluster, "join")
        return Recovery()

    def resume(self, cluster, iteration: int) -> Recovery:
        """After a wait for nodes (fewer than one pipeline's stages): a reconfiguration over
        every live node, each worker copying the layers it lacks from a surviving holder
        (TooFewNodes while fewer than S nodes live)."""
        known = {n for nodes in self.groups for n in nodes} | set(self.idle)
        live = sorted(n for n in cluster.alive if n < cluster.nodes)
        if len(live) < self.S:
            raise TooFewNodes("cluster.pp", f"bamboo needs {self.S} live nodes, one per stage, and {len(live)} are up",
                              "wait for the trace's joins")
        self.idle += [n for n in live if n not in known]  # nodes that joined during the wait
        return self._reconfigure(cluster, "resume")

    def _fitting(self, nodes: int) -> int:
        """Node groups of whole pipelines over `nodes` live nodes, a micro-batch per pipeline at least."""
        return min(nodes // self.S, self.microbatches // self.lanes)

    def _live_nodes(self, cluster) -> list[int]:
        alive = cluster.alive
        return sorted(n for n in [*(n for nodes in self.groups for n in nodes), *self.idle] if n in alive)

    def _reconfigure(self, cluster, rule: str) -> Recovery:
        """Regroup the live nodes into whole pipelines; copy the layers each worker lacks."""
        live = self._live_nodes(cluster)
        if len(live) < self.S:  # the job stops until the trace brings enough nodes back (resume)
            return Recovery(unrecoverable=f"{len(live)} live nodes, fewer than the {self.S} stages of one pipeline "
                            f"({rule})", wait=True)
        old = self.current
        saved = (self.groups, self.idle, self.runner, self.copy)
        self._regroup(live, cluster)
        new = self._build(cluster, f"reconfiguration ({rule})")
        alive = cluster.alive

        def survived(w: int) -> bool:
            return cluster.node_of(w) in alive

        lost = _unheld(old, new, survived)
        if lost:
            self.groups, self.idle, self.runner, self.copy = saved
            return Recovery(unrecoverable=f"no surviving worker holds stage {lost[0]} (original or redundant copy): "
                            f"{rule}")
        self.current = new
        copies = peer_copies(old, new, survived, self.ctx.cost_model)
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=new)


def _overloaded(runner: list[list[int]], cluster) -> set[int]:
    """Nodes that run two stages of some pipeline (after a failover)."""
    return {cluster.node_of(w) for stages in runner for w in stages if stages.count(w) > 1}


def _unheld(old: Plan, new: Plan, survived) -> list[int]:
    """Stages of `new` whose layers no surviving worker of `old` holds."""
    held = {old.layers(d, s) for w, h in old.holds.items() if survived(w) for d, s in h}
    return sorted({s for h in new.holds.values() for d, s in h if new.layers(d, s) not in held})


def pipeline_orders(generator: str, S: int, microbatches: int, d: int, runner: list[int],
                    copy: list[int | None], redundant_forward: bool = True) -> dict[int, list[Op]]:
    """Pipeline d's ops by worker: `generator`'s order for each stage; with
    `redundant_forward` (eager recovery), RF(s+1, m) just before the backward of (s, m) on the
    worker holding stage s+1's copy when it runs stage s (none for stage 0's copy); RSYNC(s)
    last on every copy's worker. A worker that runs two stages
    takes both stages' ops in the order of a fault-free run's timing (unit op costs), which
    keeps every dependency ahead of its consumer, so the merged orders cannot deadlock."""
    one = generate(generator, S, microbatches)
    read = read_ops(one)
    per_stage = [[op._replace(pipeline=d) for op in read(grid_worker(0, s, S))] for s in range(S)]
    for s in range(S - 1 if redundant_forward else 0):
        holder = copy[s + 1]
        if holder is not None and holder == runner[s] and runner[s + 1] != holder:
            order, out, added = per_stage[s], [], set()
            for op in order:
                if op.kind in (B, BW) and op.microbatch not in added:
                    out.append(Op(RF, s + 1, op.microbatch, d))
                    added.add(op.microbatch)
                out.append(op)
            per_stage[s] = out
    for s, holder in enumerate(copy):
        if holder is not None and runner[s] != holder:
            per_stage[(s - 1) % S].append(Op(RSYNC, s, NO_MICROBATCH, d))
    by_worker: dict[int, list[int]] = {}
    for s, w in enumerate(runner):
        by_worker.setdefault(w, []).append(s)
    if all(len(stages) == 1 for stages in by_worker.values()):
        return {runner[s]: per_stage[s] for s in range(S)}
    start = _start_times(per_stage, S, microbatches)
    return {w: sorted((op for s in stages for op in per_stage[s]), key=lambda op: (start[op[:3]], op.stage))
            for w, stages in by_worker.items()}


def _start_times(per_stage: list[list[Op]], S: int, microbatches: int) -> dict[tuple, float]:
    """(kind, stage, micro-batch) -> its start in a run of the pipeline with one worker per
    stage and every op one unit long."""
    from ftbench.sim.simulator import simulate
    from ftbench.sim.unit_costs import UnitCosts

    alone = {s: [op._replace(pipeline=0) for op in ops] for s, ops in enumerate(per_stage)}
    result = simulate(Schedule(alone, stages=(S,), microbatches=(microbatches,)), UnitCosts(optimizer=1.0),
                      dedupe=False)
    return {op[:3]: start for _, op, start, _ in result.ops}
