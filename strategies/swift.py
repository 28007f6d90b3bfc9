"""`swift`: Swift (Zhong et al., PPoPP 2023 / TPDS 2024): recovery without a redundant copy.

Swift keeps no extra copy of the model state. When a node fails:

1. **Undo to the consensus iteration.** Survivors agree on the iteration to go on from, the
   interrupted one; stages that already applied its optimizer step invert it
   (ftbench.engine.undo: the engine undoes them when the failure strikes, every in-place
   strategy alike). `UndoSteps` charges that pass on the modelled clock.
2. **Replication-based recovery.** A lost stage with a live data-parallel replica is copied
   from it to the replacement (a standby, else a new node, as `checkpoint` gets them):
   weights and optimizer state, nothing rolled back, and the interrupted iteration is redone.
3. **Logging-based recovery.** A lost stage with no live replica (dp = 1, or every replica
   on the failed node) is rebuilt from its own last checkpoint by replaying the iterations
   since, on the tensors that crossed its logging group's edges: Swift logs, on the sender's
   side, the activations and gradients crossing every boundary between logging groups (a
   group is a node by default), to real files in `strategy.log_dir`, and its periodic
   checkpoints (`strategy.every`) delete the logs they cover. The failed node's group (and
   whatever shares gradient sums with it) loads the checkpoint and replays; the others wait.
4. **Parallel recovery** (`strategy.parallel_recovery: k`): each replayed iteration's
   micro-batches are split across k workers per replayed one, the replacement and k - 1
   survivors that load its checkpoint (data-parallel peers of its stage first); their
   gradients are summed before each step.
5. **Selective logging** (`strategy.log_budget_gb`): adjacent groups are merged greedily
   (ftbench.planning.swift) until the log fits the budget: less log, longer replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ftbench.actions import FILE, LogBoundaries, Rendezvous, ReplayLogs, SyncFromPeers, Transfer, UndoSteps
from ftbench.cluster import Cluster
from ftbench.errors import ConfigError
from ftbench.failures import FailureEvent
from ftbench.folders import relative_setting
from ftbench.plan import Plan
from ftbench.planning.swift import SelectiveLogging
from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM, replica_bytes
from ftbench.strategies.base import Recovery, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointConfig, CheckpointRestart, every_drawn


UNDO_BYTES_PER_PARAM = 4  # the fp32 gradient the last optimizer step applied


@dataclass
class SwiftConfig(CheckpointConfig):
    """Swift: undo, replica copies, logging and replay from its own checkpoints (`every`, `keep`)."""
    name: str = "swift"
    log_dir: str = "swift-logs"  # where the boundary logs are written, inside the run folder (local/dist)
    log_budget_gb: Optional[float] = None  # selective logging: most log bytes on storage, GB (null: log every node boundary)
    parallel_recovery: int = 1  # workers sharing each replayed worker's replay (1: serial; k: it and k - 1 survivors)


@register
class Swift(CheckpointRestart):
    name = "swift"
    config = SwiftConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "after the optimizer steps", "two in one iteration",
                                               "standby used up"),
                          random=every_drawn(1, 2, 3, 4), dist=("strategy.every=2",))
    checkpoint_mode = FILE

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.budget_gb = cfg.log_budget_gb
        if self.every is None and self.budget_gb is not None:
            raise ConfigError("strategy.every", "selective logging (strategy.log_budget_gb) sizes the log kept "
                              "between two checkpoints when it plans, before any iteration is timed, so it needs a "
                              "fixed interval", "set strategy.every to a number of iterations (Swift's evaluation: "
                              "100), or leave strategy.log_budget_gb null to log every node boundary")
        self.interval = self.every  # the interval in force: fixed, else the run loop's Young/Daly one
        self.log_dir = str(relative_setting("strategy.log_dir", cfg.log_dir))  # inside the run folder
        self.parallel = cfg.parallel_recovery
        if not isinstance(self.parallel, int) or self.parallel < 1:
            raise ConfigError("strategy.parallel_recovery", f"must be a whole number of at least 1, got {self.parallel}",
                              "set 1 for a serial replay, or k >= 2 to split each replayed iteration over k workers")
        if self.parallel > ctx.microbatches:
            raise ConfigError("strategy.parallel_recovery", f"{self.parallel} workers cannot share a replay of "
                              f"{ctx.microbatches} micro-batches per pipeline",
                              f"set strategy.parallel_recovery to at most {ctx.microbatches}")
        if self.budget_gb is not None and not self.budget_gb >= 0:
            raise ConfigError("strategy.log_budget_gb", f"must be a size in GB, got {self.budget_gb}",
                              "give the most log storage in GB (e.g. 50), or null to log every node boundary")
        self.logging = None  # the SelectiveLogging plan chosen under the budget (None: every node boundary)

    # -- plan ---------------------------------------------------------------------------
    def plan(self, cluster: Cluster) -> Plan:
        grid = super().plan(cluster)
        workers, gpn = len(grid.holds), cluster.gpus_per_node
        if (self.parallel - 1) * gpn > workers - gpn:  # a node's failure leaves too few to share with
            raise ConfigError("strategy.parallel_recovery", f"{self.parallel} workers per replayed one need "
                              f"{(self.parallel - 1) * gpn} survivors to share a node's replay, and a failure "
                              f"leaves {workers - gpn} workers", "lower strategy.parallel_recovery (1: serial replay)")
        self.current = grid.with_logging(self._logged(grid, cluster))
        return self.current

    def iteration_work(self, plan: Plan) -> tuple:
        """Every iteration logs what crosses the plan's logged boundaries."""
        return (LogBoundaries(plan.logged),) if plan.logged else ()

    def _stage_machines(self, plan: Plan) -> list[int]:
        """Stage -> index of its node along pipeline 0 (consecutive stages on one node share one)."""
        nodes = [plan.node_of[w] for w in plan.workers[:plan.schedule.stages[0]]]
        index = [0]
        for a, b in zip(nodes, nodes[1:]):
            index.append(index[-1] + (a != b))
        return index

    def _logged(self, plan: Plan, cluster: Cluster) -> frozenset:
        """The logged boundaries (pipeline, s): every node boundary of pipeline 0's layout, or
        the groups' edges that selective logging keeps under strategy.log_budget_gb."""
        pp, dp = plan.schedule.stages[0], len(plan.schedule.stages)
        machine = self._stage_machines(plan)
        group = machine
        if self.budget_gb is not None and machine[-1] > 0:
            selective = self._selective(plan, machine)
            try:
                self.logging = selective.within(self.budget_gb * 1e9)
            except ValueError as err:
                raise ConfigError("strategy.log_budget_gb", str(err),
                                  "raise strategy.log_budget_gb, or leave it null to log every node boundary") from None
            of = {}
            for k, (first, last) in enumerate(self.logging.groups):
                of.update({m: k for m in range(first, last + 1)})
            group = [of[m] for m in machine]
        edges = [s for s in range(pp - 1) if group[s] != group[s + 1]]
        if not edges and self._needs_logging(plan):
            setting = "strategy.log_budget_gb" if machine[-1] > 0 else "cluster.gpus_per_node"
            raise ConfigError(setting, "swift cannot log this plan: every stage of a pipeline is in one logging "
                              "group, and a stage has no replica on another node, so a failure would replay the "
                              "whole pipeline (checkpoint restart)",
                              "spread a pipeline over several nodes (cluster.gpus_per_node < cluster.pp) or raise "
                              "strategy.log_budget_gb" if setting.startswith("strategy") else
                              "spread a pipeline over several nodes: cluster.gpus_per_node < cluster.pp")
        return frozenset((d, s) for d in range(dp) for s in edges)

    def _needs_logging(self, plan: Plan) -> bool:
        """Whether some stage has every replica on one node (a failure there leaves none)."""
        nodes_of_stage: dict[int, set] = {}
        for w, held in plan.holds.items():
            for _, s in held:
                nodes_of_stage.setdefault(s, set()).add(plan.node_of[w])
        return any(len(nodes) == 1 for nodes in nodes_of_stage.values())

    def _selective(self, plan: Plan, machine: list[int]) -> SelectiveLogging:
        """Selective logging's model of pipeline 0: its nodes in order, one micro-batch's
        forward and backward on each, the tensor crossing each node boundary."""
        cm, ctx = self.ctx.cost_model, self.ctx
        pp = plan.schedule.stages[0]
        t = [0.0] * (machine[-1] + 1)
        for s in range(pp):
            c = cm.stage(plan.layers(0, s), s == 0, plan.is_last_stage(0, s))
            t[machine[s]] += c.forward_s + c.backward_input_s + c.backward_weight_s
        boundary = [cm.spec.boundary_bytes(ctx.microbatch_size, ctx.seq_len)] * machine[-1]
        return SelectiveLogging(t, boundary, plan.schedule.microbatches[0], self.every, self.parallel)

    def extra_memory(self, plan: Plan) -> tuple[dict[int, float], float]:
        """What Swift keeps beyond training state (the sim's memory check and report): on the
        device, the undo's copy of the last applied gradient (fp32, as the optimizer consumed
        it: UNDO_BYTES_PER_PARAM per parameter of the worker's replicas); in host memory, one
        iteration's log on the sender until it is written (its logged sends: every
        micro-batch's boundary tensor, each way it sends one)."""
        per_param = UNDO_BYTES_PER_PARAM / CHECKPOINT_BYTES_PER_PARAM
        device = {w: b * per_param for w, b in replica_bytes(plan, self.ctx.cost_model).items()}
        boundary = self.ctx.cost_model.spec.boundary_bytes(self.ctx.microbatch_size, self.ctx.seq_len)
        sends = max((sum((d, s) in plan.logged for d, s in held) + sum((d, s - 1) in plan.logged for d, s in held), m)
                    for held, m in ((held, plan.schedule.microbatches[held[0][0]]) for held in plan.holds.values()))
        return device, sends[0] * sends[1] * boundary if sends[0] else 0.0

    def checkpoint_interval(self, iteration_s: float, stall_s: float, persist_s: float) -> int:
        """As checkpoint restart's (fixed, else Young/Daly), kept: a replay starts from the
        newest multiple of it."""
        self.interval = super().checkpoint_interval(iteration_s, stall_s, persist_s)
        return self.interval

    # -- recovery -----------------------------------------------------------------------
    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        plan = self.current
        lost = set(self._workers_on(plan, event.node, cluster))
        replicas = self._replicas_of(plan)
        alive = cluster.is_alive

        def live_holders(w: int) -> list[int]:
            """A live worker outside `lost` holding each replica `w` holds (the first found, in
            worker order), or [] when a replica of it has none."""
            found = []
            for d, s in plan.holds[w]:
                src = next((v for v in replicas[_layers(plan, d, s)] if v not in lost and alive(plan.node_of[v])),
                           None)
                if src is None:
                    return []
                found.append(src)
            return found

        orphans = {w for w in lost if not live_holders(w)}
        actions = [UndoSteps(), Rendezvous()]
        replay = self._replay_set(plan, orphans) if orphans else set()
        copies = self._copies(plan, sorted(lost - replay), replay, replicas, alive)
        if copies:
            actions.append(SyncFromPeers(copies))  # replication-based recovery
        if replay:
            # the newest checkpoint (saved synchronously); none but the initial one before the
            # interval is known (wall clock: after the first iteration is timed)
            since = iteration // self.interval * self.interval if self.interval else 0
            helpers = ()
            if self.parallel > 1:
                helpers = self._helpers(plan, sorted(replay), lost | replay, alive)
                if helpers is None:
                    return Recovery(unrecoverable=f"strategy.parallel_recovery={self.parallel} needs "
                                    f"{(self.parallel - 1) * len(replay)} survivors outside the replay of "
                                    f"{len(replay)} workers, and too few are left; lower "
                                    "strategy.parallel_recovery")
            actions.append(ReplayLogs(tuple(sorted(replay)), since, iteration, helpers))
        return Recovery(actions=actions, plan=plan, replace=(event.node,))

    @staticmethod
    def _workers_on(plan: Plan, node: int, cluster: Cluster) -> list[int]:
        """The plan's workers on `node` (the placement is fixed: the node's worker ids)."""
        return [w for w in cluster.workers_on(node) if plan.node_of.get(w) == node]

    def _replicas_of(self, plan: Plan) -> dict[tuple, list[int]]:
        """A replica's layers -> the workers holding them, in worker order (once per plan)."""
        memo = getattr(self, "_replica_memo", None)
        if memo is None or memo[0] is not plan:
            out: dict[tuple, list[int]] = {}
            for w in sorted(plan.holds):
                for d, s in plan.holds[w]:
                    out.setdefault(_layers(plan, d, s), []).append(w)
            memo = self._replica_memo = (plan, out)
        return memo[1]

    def _copies(self, plan: Plan, targets: list[int], replay: set, replicas: dict, alive) -> tuple[Transfer, ...]:
        """Each target's replicas from a live holder outside the failure and the replay, the
        least loaded first, then the lowest id (as ftbench.transfers.peer_copies chooses)."""
        sent: dict[int, float] = {}
        out = []
        for w in targets:
            for d, s in plan.holds[w]:
                key = _layers(plan, d, s)
                sources = [v for v in replicas[key] if v not in replay and v not in targets and alive(plan.node_of[v])]
                src = min(sources, key=lambda v: (sent.get(v, 0.0), v))
                layers, embedding, head = key
                nbytes = CHECKPOINT_BYTES_PER_PARAM * self.ctx.cost_model.stage(layers, embedding, head).params
                sent[src] = sent.get(src, 0.0) + nbytes
                out.append(Transfer(layers, embedding, head, src, w, nbytes))
        return tuple(out)

    def _replay_set(self, plan: Plan, orphans: set[int]) -> set[int]:
        """The workers that replay: those whose state is lost with no live replica, closed
        over unlogged boundaries (their inputs were not logged: the neighbour replays too)
        and over gradient sums (every replica of a replayed stage replays with it)."""
        memo = getattr(self, "_where_memo", None)
        if memo is None or memo[0] is not plan:
            memo = self._where_memo = (plan, {(d, s): w for w, held in plan.holds.items() for d, s in held})
        where, replicas = memo[1], self._replicas_of(plan)
        out, todo = set(), list(orphans)
        while todo:
            w = todo.pop()
            if w in out:
                continue
            out.add(w)
            for d, s in plan.holds[w]:
                near = [(d, s - 1)] if s > 0 and (d, s - 1) not in plan.logged else []
                if s + 1 < plan.schedule.stages[d] and (d, s) not in plan.logged:
                    near.append((d, s + 1))
                todo.extend(where[x] for x in near)
                todo.extend(replicas[_layers(plan, d, s)])
        return out

    def _helpers(self, plan: Plan, replay: list[int], excluded: set[int], alive) -> tuple | None:
        """Parallel recovery's groups: group 0 is the replaying workers, group k >= 1 gives
        each of them a live worker outside the failure and the replay, a data-parallel peer
        of its stage first (None: too few)."""
        replicas = self._replicas_of(plan)
        taken = set(excluded)
        groups = [tuple(replay)]
        pool = None  # every other live worker, in id order, built only if peers run out
        for _ in range(self.parallel - 1):
            group = []
            for w in replay:
                d, s = plan.holds[w][0]
                peer = next((v for v in replicas[_layers(plan, d, s)] if v not in taken and alive(plan.node_of[v])),
                            None)
                if peer is None:
                    if pool is None:
                        pool = [v for v in sorted(plan.holds) if alive(plan.node_of[v])]
                    peer = next((v for v in pool if v not in taken), None)
                    if peer is None:
                        return None
                group.append(peer)
                taken.add(peer)
            groups.append(tuple(group))
        return tuple(groups)


def _layers(plan: Plan, d: int, s: int) -> tuple:
    """What identifies a replica's state: its layers, with or without embedding and head."""
    return plan.layers(d, s), s == 0, plan.is_last_stage(d, s)
