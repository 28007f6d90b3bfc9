"""`checkpoint`: checkpoint restart, the baseline every fault-tolerant system compares with.

Every `every` iterations the job writes its state (weights + AdamW state, one file per
stage) to storage. When a node that runs a worker fails, the whole job stops: a standby node
takes its place at once (`cluster.spares`), or a new one is provisioned (`cluster.replacement_s`);
every process restarts, reloads the newest checkpoint that verifies, and redoes the
iterations since. With `every: null` the interval follows Young/Daly from the node MTBF and
the measured (local) or modelled (sim) checkpoint cost.
"""
from __future__ import annotations

import math
import random
from bisect import bisect_left
from dataclasses import dataclass
from itertools import compress
from typing import Optional

from ftbench.actions import FILE, RestartJob, RestoreCheckpoint
from ftbench.cluster import Cluster
from ftbench.errors import ConfigError
from ftbench.failures import FailureEvent
from ftbench.plan import Plan, generated_grid_plan
from ftbench.strategies.base import Recovery, Strategy, StrategyConfig, StrategyTests, register


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum sqrt(2 C M) - C (Young's sqrt(2 C M), less the write itself),
    for a checkpoint costing C seconds and a job MTBF of M seconds."""
    if cost_s >= mtbf_s / 2:
        return mtbf_s  # Daly's rule for expensive checkpoints
    return math.sqrt(2.0 * cost_s * mtbf_s) - cost_s


@dataclass
class CheckpointConfig(StrategyConfig):
    """Checkpoint restart (and the settings Varuna, Swift and ReCycle's fallback take from it)."""
    name: str = "checkpoint"
    every: Optional[int] = None  # iterations between checkpoints (null: tuned; Young/Daly from the failure model)
    mtbf_hours: Optional[float] = None  # one node's MTBF for Young/Daly (null: failures.mtbf_hours, or failures.job_mtbf_hours x nodes)
    keep: int = 2  # checkpoints kept on storage (local and dist backends)
    save_s: Optional[float] = None  # fixed checkpoint save stall in seconds (null: bytes over hardware.storage_gbps)


def every_drawn(*choices):
    """A seeded random script's `strategy.every`, drawn from `choices`."""
    def draw(rng: random.Random, setup: dict) -> list[str]:
        return [f"strategy.every={rng.choice(choices)}"]
    return draw


@register
class CheckpointRestart(Strategy):
    name = "checkpoint"
    config = CheckpointConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "standby used up", "changes during recovery"),
                          random=every_drawn(1, 2, 3, 4), dist=("strategy.every=2",))
    checkpoint_mode: str | None = FILE

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.every = cfg.every
        mtbf_hours = getattr(cfg, "mtbf_hours", None)  # CheckFreq tunes by overhead instead
        self.mtbf_hours = mtbf_hours if mtbf_hours is not None else ctx.node_mtbf_hours
        if self.every is not None and self.every < 1:
            raise ConfigError("strategy.every", f"must be at least 1 iteration, got {self.every}",
                              "set strategy.every to a positive number of iterations, or null for the tuned interval")
        keep = getattr(cfg, "keep", None)
        if keep is not None and keep < 1:
            raise ConfigError("strategy.keep", f"must be at least 1 checkpoint, got {keep}",
                              "set strategy.keep >= 1: a restart reloads the newest checkpoint kept on storage")
        self.save_s = getattr(cfg, "save_s", None)  # the loop's modelled save stall (None: from bytes)
        if self.save_s is not None and not (math.isfinite(self.save_s) and self.save_s > 0):
            raise ConfigError("strategy.save_s", f"must be a positive number of seconds, got {self.save_s}",
                              "set strategy.save_s to the measured checkpoint save time in seconds (e.g. 11.2), "
                              "or null to model it as the checkpoint's bytes over hardware.storage_gbps")
        self.current: Plan | None = None

    # -- plan ---------------------------------------------------------------------------
    def plan(self, cluster: Cluster) -> Plan:
        self.current = self.ctx.grid_plan(cluster.pp, cluster.dp, cluster.gpus_per_node, node_of=cluster.node_of)
        return self.current

    def nodes_in_use(self) -> frozenset[int]:
        cached = getattr(self, "_nodes_in_use", None)  # (plan, its nodes): plans are not changed once made
        if cached is None or cached[0] is not self.current:
            cached = self._nodes_in_use = (self.current, self.current.nodes())
        return cached[1]  # (kept, not copied: 16,384 nodes at scale)

    def checkpoint_interval(self, iteration_s: float, stall_s: float, persist_s: float) -> int:
        """Iterations between checkpoints: fixed, or Young/Daly for this job's MTBF (none
        expected: one interval as long as the run, so only the initial checkpoint is taken)."""
        if self.every is not None:
            return self.every
        job_mtbf_s = self.job_mtbf_s(iteration_s)
        if math.isinf(job_mtbf_s):
            return max(1, self.ctx.iterations)
        return max(1, round(young_daly_interval_s(stall_s, job_mtbf_s) / iteration_s))

    def job_mtbf_s(self, iteration_s: float) -> float:
        """Young/Daly's M for the job: one node's MTBF (strategy.mtbf_hours, failures.mtbf_hours)
        over the nodes in use, else the failure model's own rate (a script's failures over
        train.iterations, a trace's over its span, an interval's period)."""
        if self.mtbf_hours is not None:
            return self.mtbf_hours * 3600.0 / max(len(self.nodes_in_use()), 1)
        per_iteration, job_mtbf_s = self.ctx.failures_per_iteration, self.ctx.job_mtbf_s
        if per_iteration is not None:
            return iteration_s / per_iteration if per_iteration > 0 else math.inf
        if job_mtbf_s is None:
            raise ConfigError("strategy.every", "null asks for the Young/Daly interval, and the failure model "
                              "gives no rate", "set strategy.mtbf_hours (one node's MTBF in hours), or give a "
                              "fixed strategy.every")
        return job_mtbf_s

    # -- membership ---------------------------------------------------------------------
    def on_event(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        if event.kind == "join":
            return self.on_join(event, cluster, iteration)
        if event.node not in self.nodes_in_use():
            return Recovery()  # an idle node: nothing to recover
        return self.on_failure(event, cluster, iteration)

    def grid_on(self, cluster: Cluster, pp: int, dp: int, workers: list[int]) -> Plan:
        """ctx.grid_plan(pp, dp, gpus_per_node).on_workers(workers, cluster.node_of), built in
        one go (thousands of workers after each failure at scale)."""
        ctx = self.ctx
        nodes = self.worker_nodes(cluster)  # cluster.node_of, looked up
        split = getattr(self, "_split", None)  # (dp, ctx.split_microbatches(dp)): the last one asked for
        if split is None or split[0] != dp:
            split = self._split = (dp, ctx.split_microbatches(dp))
        return generated_grid_plan(ctx.schedule_name, pp, split[1], ctx.cost_model.balanced_partition(pp), workers,
                                   nodes.__getitem__)

    def alive_workers(self, cluster: Cluster) -> list[int]:
        """Workers on live nodes, in id order: the last call's list less the workers of the
        nodes that failed since, where none came (back) meanwhile (a failure at scale takes a
        few workers out of 16,384); else looked up afresh."""
        alive = cluster.alive
        last = getattr(self, "_alive", None)  # (live nodes, their workers) at the last call
        table = self.worker_nodes(cluster)  # cluster.node_of, looked up
        if last is None or not alive <= last[0]:
            workers = list(compress(range(len(table)), map(alive.__contains__, table)))  # (in bulk)
        else:
            workers = last[1]
            gone = last[0] - alive
            if gone:
                workers = workers.copy()
                for node in gone:
                    for w in cluster.workers_on(node):
                        i = bisect_left(workers, w)
                        if i < len(workers) and workers[i] == w and table[w] == node:
                            del workers[i]
        self._alive = (alive, workers)
        return workers

    def worker_nodes(self, cluster: Cluster) -> list[int]:
        """cluster.node_of(w) for every worker id w. The placement is physical and fixed for
        the run, so the table is kept (and extended when nodes join)."""
        key = (cluster.layout, cluster.gpus_per_node, cluster.placement)
        table = getattr(self, "_node_table", None)
        if table is None or table[0] != key:
            table = self._node_table = (key, [])
        nodes = table[1]
        if len(nodes) < cluster.workers:
            nodes.extend(cluster.node_of(w) for w in range(len(nodes), cluster.workers))
        return nodes if len(nodes) == cluster.workers else nodes[:cluster.workers]

    def on_join(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        if event.node not in self.nodes_in_use():
            return Recovery(standby=(event.node,))  # a repaired node waits as a standby
        return Recovery()

    def on_failure(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        # A replacement takes the failed node's place (a standby at once, else a new node after
        # cluster.replacement_s; the run loop decides which and adds the wait), then every
        # process restarts and reloads.
        return Recovery(actions=[RestartJob(), RestoreCheckpoint(FILE)], plan=self.current, replace=(event.node,))
