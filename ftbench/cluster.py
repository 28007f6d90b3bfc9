"""Workers, nodes and membership.

A worker is one GPU; a node holds `gpus_per_node` workers and fails as a whole. On the
regular grid worker = pipeline * pp + stage; which node holds it is the placement's choice
(ftbench.placement), so with one GPU per node the node id is the worker id. Nodes past the
grid's need are idle standbys.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ftbench import placement
from ftbench.errors import ConfigError
from ftbench.placement import PLACEMENTS


@dataclass
class Cluster:
    pp: int
    dp: int
    gpus_per_node: int
    nodes: int
    spares: int
    replacement_s: float
    placement: str = "pipeline"  # ftbench.placement.PLACEMENTS
    alive: set[int] = field(default_factory=set)  # empty: every node starts alive

    def __post_init__(self):
        if not self.alive:
            self.alive = set(range(self.nodes))
        self.layout = (self.pp, self.dp)  # the configured grid fixes where workers sit

    @classmethod
    def from_config(cls, cfg, nodes: int | None = None, require_grid: bool = True) -> "Cluster":
        """`nodes`: the node count where cluster.nodes is unset and something else sets it (a
        trace's starting membership); else pp*dp/gpus_per_node. `require_grid=False`: the
        nodes may hold fewer GPUs than pp*dp (a strategy that builds its job from the live
        nodes and waits for a trace's joins; the grid then fixes only where workers sit)."""
        grid = cfg.pp * cfg.dp
        nodes = cfg.nodes if cfg.nodes is not None else nodes
        if nodes is None and grid % cfg.gpus_per_node:
            raise ConfigError("cluster.gpus_per_node",
                              f"pp*dp = {grid} workers do not fill whole nodes of {cfg.gpus_per_node} GPUs",
                              "choose gpus_per_node dividing cluster.pp*cluster.dp, or set cluster.nodes")
        nodes = nodes if nodes is not None else grid // cfg.gpus_per_node
        if require_grid and nodes * cfg.gpus_per_node < grid:
            raise ConfigError("cluster.nodes", f"{nodes} nodes of {cfg.gpus_per_node} GPUs cannot hold "
                              f"pp*dp = {grid} workers", f"set cluster.nodes >= {-(-grid // cfg.gpus_per_node)}")
        placement = cfg.get("placement", "pipeline") if hasattr(cfg, "get") else cfg.placement
        if placement not in PLACEMENTS:
            raise ConfigError("cluster.placement", f"unknown option '{placement}'",
                              f"choose one of {', '.join(PLACEMENTS)}")
        if placement == "stage" and cfg.dp % cfg.gpus_per_node:
            raise ConfigError("cluster.placement", f"stage placement puts one stage of {cfg.gpus_per_node} pipelines "
                              f"on each node, but dp={cfg.dp} pipelines do not fill whole nodes",
                              "choose cluster.dp divisible by cluster.gpus_per_node, or cluster.placement=pipeline")
        return cls(cfg.pp, cfg.dp, cfg.gpus_per_node, nodes, cfg.spares, cfg.replacement_s, placement)

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, worker: int) -> int:
        return placement.node_of(worker, *self.layout, self.gpus_per_node, self.placement)

    def workers_on(self, node: int) -> list[int]:
        return placement.workers_on(node, *self.layout, self.gpus_per_node, self.placement)

    def is_alive(self, node: int) -> bool:
        return node in self.alive

    def view(self) -> "ClusterView":
        return ClusterView(self)

    # -- membership changes: the run loop (ftbench.loop) is their only caller -------------
    def fail(self, node: int) -> None:
        self.alive.discard(node)

    def join(self, node: int) -> None:
        self.alive.add(node)
        self.nodes = max(self.nodes, node + 1)


class ClusterView:
    """What strategies see of the cluster: the current membership, read-only. A strategy
    asks for changes through its `Recovery` (replace, standby, shape); the run loop applies
    them, so membership has one writer."""

    _READ = ("pp", "dp", "gpus_per_node", "nodes", "spares", "replacement_s", "workers", "placement", "layout")

    def __init__(self, cluster: Cluster):
        object.__setattr__(self, "_cluster", cluster)

    def __getattr__(self, name):
        if name in self._READ:
            return getattr(self._cluster, name)
        raise AttributeError(f"the cluster view has no {name!r}: membership is changed only by the run loop "
                             "(ask for it through Recovery.replace / standby / shape)")

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot set cluster.{name} from a strategy: return it in the Recovery "
                             "(replace / standby / shape) and the run loop applies it")

    @property
    def alive(self) -> frozenset[int]:
        return frozenset(self._cluster.alive)

    def node_of(self, worker: int) -> int:
        return self._cluster.node_of(worker)

    def workers_on(self, node: int) -> list[int]:
        return self._cluster.workers_on(node)

    def is_alive(self, node: int) -> bool:
        return self._cluster.is_alive(node)
