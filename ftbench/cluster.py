"""Workers, nodes and membership.

A worker is one GPU; a node holds `gpus_per_node` workers and fails as a whole. On the
regular grid worker = pipeline * pp + stage and node = worker // gpus_per_node, so with one
GPU per node the node id is the worker id. Nodes past the grid's need are idle standbys.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ftbench.errors import ConfigError


@dataclass
class Cluster:
    pp: int
    dp: int
    gpus_per_node: int
    nodes: int
    spares: int
    replacement_s: float
    alive: set[int] = field(default_factory=set)  # empty: every node starts alive

    def __post_init__(self):
        if not self.alive:
            self.alive = set(range(self.nodes))

    @classmethod
    def from_config(cls, cfg) -> "Cluster":
        grid = cfg.pp * cfg.dp
        if cfg.nodes is None and grid % cfg.gpus_per_node:
            raise ConfigError("cluster.gpus_per_node",
                              f"pp*dp = {grid} workers do not fill whole nodes of {cfg.gpus_per_node} GPUs",
                              "choose gpus_per_node dividing cluster.pp*cluster.dp, or set cluster.nodes")
        nodes = cfg.nodes if cfg.nodes is not None else grid // cfg.gpus_per_node
        if nodes * cfg.gpus_per_node < grid:
            raise ConfigError("cluster.nodes", f"{nodes} nodes of {cfg.gpus_per_node} GPUs cannot hold "
                              f"pp*dp = {grid} workers", f"set cluster.nodes >= {-(-grid // cfg.gpus_per_node)}")
        return cls(cfg.pp, cfg.dp, cfg.gpus_per_node, nodes, cfg.spares, cfg.replacement_s)

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, worker: int) -> int:
        return worker // self.gpus_per_node

    def workers_on(self, node: int) -> list[int]:
        return list(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def is_alive(self, node: int) -> bool:
        return node in self.alive

    def fail(self, node: int) -> None:
        self.alive.discard(node)

    def join(self, node: int) -> None:
        self.alive.add(node)
        self.nodes = max(self.nodes, node + 1)
