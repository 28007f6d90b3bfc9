"""`oobleck`: Oobleck's pipeline templates and re-instantiation (Jang et al., SOSP 2023).

Before training, a *pipeline template* is planned for every node count from n0 (the fewest
nodes whose GPUs hold the model and its optimizer state, or `strategy.min_nodes` where that
is more: a comparison can hold Oobleck to the others' pipeline depth) to N - f*n0, each with its own cut
of the layers (ftbench.planning.oobleck). The job runs as heterogeneous pipelines built from
templates over every live node, at least f+1 of them, so every layer has f+1 holders on
disjoint nodes; the global batch's micro-batches are split among the pipelines so the
slowest finishes first, and each layer's gradients are reduced across every pipeline that
holds it. The global batch never changes.

On a failure the pipelines are re-instantiated: a damaged pipeline takes the template of its
new size; one left below n0 borrows nodes from the largest pipeline, and pipelines still too
short are merged. Every layer a worker newly holds is copied, weights and optimizer state,
from a surviving holder (in pieces when the cuts differ, in parallel over the links); the
iteration in flight is lost. Joined nodes grow the pipelines back (n0 of them start a new
one). Fewer live nodes than (f+1)*n0, or a layer no survivor holds, is unrecoverable.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import warnings
from functools import partial
from itertools import chain, repeat
from operator import attrgetter, contains

from ftbench.actions import Rendezvous, SyncFromPeers
from ftbench.errors import ConfigError, TooFewNodes
from ftbench.failures import FailureEvent
from ftbench.plan import Plan, pipelines_plan_of
from ftbench.planning.oobleck import (STAGE_PER, Templates, Unrecoverable, grow, instantiate, pipelines_layer_copies,
                                      reconfigure, split_batch, template_range, uncovered)
from ftbench.strategies.base import Recovery, Strategy, StrategyConfig, StrategyTests, register
from ftbench.transfers import layer_copies

SPLITS = ("auto", "milp", "greedy")


@dataclass
class OobleckConfig(StrategyConfig):
    """Oobleck: pipeline templates, heterogeneous pipelines, re-instantiation on failures."""
    name: str = "oobleck"
    f: int = 1  # failures to survive at once: templates for n0..N - f*n0 nodes, at least f+1 pipelines
    batch_split: str = "auto"  # milp (pulp/CBC) | greedy | auto (MILP up to 24 pipelines, else the greedy fill)
    stage_per: str = "node"  # node: one stage per node, its GPUs share it as lanes | gpu: a node's GPUs hold consecutive stages
    min_nodes: Optional[int] = None  # the fewest nodes a pipeline has (null: n0, the fewest that hold the model); e.g. cluster.pp, to run Oobleck on the others' pipeline depth


def _random_settings(rng: random.Random, setup: dict) -> list[str]:
    """A seeded random script's Oobleck: f failures at once; 6 MB GPUs make gpt-tiny need 2
    nodes a pipeline (cuts that differ), where the job has the 2 x (f+1) nodes that takes."""
    nodes, gpus = setup["nodes"], setup["gpus"]
    f = rng.choice((0, 1)) if nodes >= 2 and setup["microbatches"] * setup["dp"] >= 2 * gpus else 0  # a micro-batch per lane
    memory = rng.choice((24, 0.006)) if nodes >= 2 * (f + 1) else 24
    return [f"strategy.f={f}", f"hardware.memory_gb={memory}"]


@register
class Oobleck(Strategy):
    name = "oobleck"
    config = OobleckConfig
    tests = StrategyTests(conformance=("hardware.memory_gb=0.006",),  # gpt-tiny needs 2 nodes a pipeline: cuts that differ
                          conformance_scripts=("one failure", "two in one iteration", "changes during recovery",
                                               "already down, idle and new nodes"),
                          random=_random_settings)

    @staticmethod
    def sized_by_membership(cfg) -> bool:
        """Its pipelines cover the live nodes (ftbench.job.sized_by_membership)."""
        return True

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.f = int(cfg.get("f", 1))
        if self.f < 0:
            raise ConfigError("strategy.f", f"must be 0 or more failures, got {self.f}",
                              "set strategy.f=1 (survive one failure at a time)")
        self.stage_per = cfg.get("stage_per", "node")
        if self.stage_per not in STAGE_PER:
            raise ConfigError("strategy.stage_per", f"unknown choice '{self.stage_per}'",
                              f"choose one of {', '.join(STAGE_PER)}")
        self.split = cfg.get("batch_split", "auto")
        if self.split not in SPLITS:
            raise ConfigError("strategy.batch_split", f"unknown split '{self.split}'", f"choose one of {', '.join(SPLITS)}")
        self.microbatches = ctx.global_batch // ctx.microbatch_size
        self.pipelines: list[list[int]] = []  # node lists, in stage order
        self.idle: list[int] = []  # live nodes in no pipeline (joined, waiting for enough to use)
        self.current: Plan | None = None
        self.coverage_gaps: list[int] = []
        self._gpus_on: list[list[int]] | None = None  # see _placement

    # -- plan ---------------------------------------------------------------------------
    def plan(self, cluster) -> Plan:
        if getattr(self, "templates", None) is None:  # kept when a wait for nodes plans again (resume)
            self.templates = Templates(self.ctx.cost_model, cluster.gpus_per_node, self.stage_per)
        t = self.templates
        n0 = t.n0()
        if n0 is None:
            layout = ("one stage per GPU" if self.stage_per == "gpu" else "one stage per node, whole on each of its GPUs")
            raise ConfigError("model", f"{self.ctx.spec.name} fits on no pipeline of nodes with {cluster.gpus_per_node} "
                              f"GPUs of {self.ctx.cost_model.hw.memory_gb:g} GB ({layout}, a layer per stage at most)",
                              "use GPUs with more memory (hardware=...), train.recompute=full, a smaller micro-batch, "
                              "strategy.stage_per=gpu (pools a node's memory), or a smaller model")
        floor, model_n0 = self.cfg.get("min_nodes"), n0
        if floor is not None:
            if int(floor) < 1:
                raise ConfigError("strategy.min_nodes", f"must be at least 1 node, got {floor}",
                                  "set strategy.min_nodes to a pipeline depth in nodes (e.g. cluster.pp), or null")
            n0 = max(n0, int(floor))  # templates start at this depth: shallower pipelines are not built
        self.n0 = n0
        nodes = cluster.nodes
        live = sorted(n for n in cluster.alive if n < nodes)
        if len(live) < (self.f + 1) * n0:  # (then also n_max = N - f*n0 < n0: no template range)
            if n0 > model_n0:  # strategy.min_nodes set the depth, not the model
                raise TooFewNodes("strategy.min_nodes", f"{len(live)} nodes cannot form f+1 = {self.f + 1} pipelines "
                                  f"of at least strategy.min_nodes = {n0} nodes",
                                  f"set strategy.min_nodes to at most {max(len(live) // (self.f + 1), model_n0)}, "
                                  f"or use at least {(self.f + 1) * n0} nodes")
            raise TooFewNodes("strategy.f", f"{len(live)} nodes cannot form f+1 = {self.f + 1} pipelines of n0 = {n0} "
                              f"nodes ({self.ctx.spec.name} needs {n0} node(s) per pipeline)",
                              f"lower strategy.f, or use at least {(self.f + 1) * n0} nodes")
        lo, hi = template_range(n0, nodes, self.f)
        self.sizes = [n for n in range(lo, min(hi, t.longest) + 1) if t.get(n) is not None]
        # The layer count, or memory, can rule out sizes up to n_max; then some counts may lack a set.
        self.coverage_gaps = uncovered(self.sizes, self.f, (self.f + 1) * n0, nodes)
        if self.coverage_gaps:
            warnings.warn(f"oobleck: no set of f+1 or more pipelines of the template sizes {self.sizes} uses exactly "
                          f"{self.coverage_gaps} live nodes; at those counts some nodes wait idle", stacklevel=2)
        found = None
        for used in range(len(live), (self.f + 1) * n0 - 1, -1):  # every node if the sizes allow, else most
            found = instantiate(t, self.sizes, used, self.f, self.microbatches)
            if found is not None:
                self.idle = live[used:]
                break
        if found is None:
            raise ConfigError("train.microbatches", f"no set of at least {self.f + 1} pipelines over {len(live)} nodes "
                              f"gets a micro-batch each from {self.microbatches}",
                              "raise the global batch (train.microbatches x cluster.dp), or lower strategy.f")
        sizes, _ = found
        self.pipelines, at = [], 0
        for n in sizes:
            self.pipelines.append(live[at:at + n])
            at += n
        self.current = self._build(cluster)
        return self.current

    def _build(self, cluster, rule: str = "") -> Plan:
        """The plan of the current pipelines: each on its template, the batch split among them."""
        t = self.templates
        lanes = t.lanes_of(list(map(len, self.pipelines)))
        counts = split_batch(lanes, self.microbatches, self.split)
        if counts is None:
            raise Unrecoverable(f"{len(lanes)} pipelines (lanes) but only {self.microbatches} micro-batches")
        gpus_on, node_of = self._placement(cluster)
        if t.lanes == 1 and self._gpu_is_node:  # one GPU per node, numbered as its node: pipelines are their workers
            workers = self.pipelines
        elif t.lanes == 1:  # each GPU a stage: a pipeline's workers are its nodes' GPUs in order
            workers = list(map(list, map(chain.from_iterable, map(partial(map, gpus_on.__getitem__), self.pipelines))))
        else:  # GPU `lane` of every node, one stage each
            workers = []
            for nodes in self.pipelines:
                gpus = list(map(gpus_on.__getitem__, nodes))
                workers += ([on_node[lane] for on_node in gpus] for lane in range(t.lanes))
        shape = "+".join(map(str, map(len, self.pipelines)))
        name = f"oobleck[{shape}]" + (f" after {rule}" if rule else "")
        # made from the current plan where only some pipelines changed (most failures)
        return pipelines_plan_of(self.ctx.schedule_name, workers, list(map(attrgetter("partition"), lanes)), counts,
                                 node_of.__getitem__, name=name, like=self.current)

    def _placement(self, cluster) -> tuple[list[list[int]], dict[int, int]]:
        """(the workers on each node of the job, each one's node), as the cluster places them;
        made once (the placement is physical, fixed by the configured grid), not per plan."""
        if self._gpus_on is None or len(self._gpus_on) != cluster.nodes:
            self._gpus_on = [cluster.workers_on(node) for node in range(cluster.nodes)]
            self._node_of = {w: cluster.node_of(w) for on_node in self._gpus_on for w in on_node}
            self._gpu_is_node = all(on_node == [node] for node, on_node in enumerate(self._gpus_on))
        return self._gpus_on, self._node_of

    # -- membership ---------------------------------------------------------------------
    def on_event(self, event: FailureEvent, cluster, iteration: int) -> Recovery:
        node = event.node
        if event.kind == "join":
            return self._join(node, cluster)
        if node in self.idle:
            self.idle.remove(node)
            return Recovery()
        if not self._runs(node):
            return Recovery()  # a node outside the job (a standby)
        live = sum(map(len, self.pipelines)) - 1 + len(self.idle)
        least = (self.f + 1) * self.n0
        if live < least:  # the job stops until the trace brings enough nodes back (resume)
            return Recovery(unrecoverable=f"{live} nodes are left, fewer than (f+1)*n0 = {least}: oobleck keeps at "
                            f"least f+1 = {self.f + 1} pipelines of n0 = {self.n0} nodes", wait=True)
        try:
            pipelines, rule, shed = reconfigure(self.pipelines, {node}, self.n0, self._valid)
        except Unrecoverable as why:
            return Recovery(unrecoverable=str(why))
        idle = self.idle + shed
        if idle:  # nodes waiting for a pipeline take part now
            pipelines, idle = grow(pipelines, idle, self.n0, self._valid, self._most_pipelines())
        return self._switch(pipelines, cluster, rule, idle)

    def resume(self, cluster, iteration: int) -> Recovery:
        """After a wait for nodes (too few for f+1 pipelines): pipelines over the live nodes
        instantiated as at the start (TooFewNodes while still too few), every layer a worker
        lacks copied from a surviving holder of the plan before the wait; no holder left of
        some layer is unrecoverable (Oobleck keeps no checkpoint)."""
        old, before, idle_before = self.current, self.pipelines, self.idle
        new = self.plan(cluster)
        copies, orphaned = self._copies(old, new, cluster)
        if orphaned:
            self.current, self.pipelines, self.idle = old, before, idle_before
            return Recovery(unrecoverable=f"no surviving worker holds unit {orphaned[0][0]} of the model after the "
                            "wait for nodes (units: 0 the embeddings, 1..L the blocks, L+1 the head)")
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=new)

    def _copies(self, old: Plan, new: Plan, cluster):
        """Every layer a worker of `new` lacks, copied from a live holder in `old` (layer_copies;
        for two plans of pipelines, looking only at the pipelines that changed)."""
        alive = cluster.alive
        found = pipelines_layer_copies(old, new, alive, self.ctx.cost_model)
        if found is None:
            found = layer_copies(old, new, lambda w: cluster.node_of(w) in alive, self.ctx.cost_model)
        return found

    def _runs(self, node: int) -> bool:
        """Whether some pipeline has the node."""
        return any(map(contains, self.pipelines, repeat(node)))

    def _valid(self, nodes: int) -> bool:
        return self.templates.get(nodes) is not None

    def _most_pipelines(self) -> int:
        """A micro-batch per lane at least."""
        return self.microbatches // self.templates.lanes

    def _join(self, node: int, cluster) -> Recovery:
        if node >= cluster.nodes or self._runs(node) or node in self.idle:
            return Recovery()
        pipelines, idle = grow(self.pipelines, self.idle + [node], self.n0, self._valid, self._most_pipelines())
        if pipelines == self.pipelines:
            self.idle = idle
            return Recovery()
        return self._switch(pipelines, cluster, "join", idle)

    def _switch(self, pipelines: list[list[int]], cluster, rule: str, idle: list[int]) -> Recovery:
        """Continue on `pipelines` (`idle` waiting); `rule` (template, borrow, merge, join) names the plan."""
        old, before, idle_before = self.current, self.pipelines, self.idle
        self.pipelines, self.idle = pipelines, idle
        try:
            new = self._build(cluster, rule)
        except Unrecoverable as why:
            self.pipelines, self.idle = before, idle_before
            return Recovery(unrecoverable=str(why))
        copies, orphaned = self._copies(old, new, cluster)
        if orphaned:
            self.pipelines, self.idle = before, idle_before
            return Recovery(unrecoverable=f"no surviving worker holds unit {orphaned[0][0]} of the model "
                            "(units: 0 the embeddings, 1..L the blocks, L+1 the head)")
        self.current = new
        return Recovery(actions=[Rendezvous(), SyncFromPeers(copies)], plan=new)
