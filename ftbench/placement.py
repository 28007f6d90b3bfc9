"""Where workers sit: the map from a worker (one GPU; grid id pipeline * pp + stage) to its
node. A node fails as a whole, so placement decides what one node failure takes:

- `pipeline`: node = worker // gpus_per_node; a node holds consecutive stages of one pipeline
  (pipeline-parallel sends stay inside the node; a node failure takes several stages of one
  pipeline);
- `stage`: a node holds one stage of gpus_per_node different pipelines (the data-parallel
  all-reduce stays inside the node; a node failure leaves the other replicas of that stage on
  other nodes, the layout in which re-routing to data-parallel peers helps most).

The layout is physical: it is fixed by the configured grid, whatever shape a strategy later
trains in. Nodes past the grid (standbys, new nodes) hold worker ids past it.
"""
from __future__ import annotations

import functools

PLACEMENTS = ("pipeline", "stage")


def node_of(worker: int, pp: int, dp: int, gpus_per_node: int, placement: str) -> int:
    grid = pp * dp
    if placement == "pipeline" or worker >= grid:
        return worker // gpus_per_node
    pipeline, stage = divmod(worker, pp)
    return (pipeline // gpus_per_node) * pp + stage


def workers_on(node: int, pp: int, dp: int, gpus_per_node: int, placement: str) -> list[int]:
    grid_nodes = pp * dp // gpus_per_node
    if placement == "pipeline" or node >= grid_nodes:
        return list(range(node * gpus_per_node, (node + 1) * gpus_per_node))
    group, stage = divmod(node, pp)
    return [(group * gpus_per_node + i) * pp + stage for i in range(gpus_per_node)]


@functools.lru_cache(maxsize=4)
def grid_nodes(pp: int, dp: int, gpus_per_node: int, placement: str) -> tuple[int, ...]:
    """node_of for every worker of the grid, computed once per layout: strategies that keep
    the grid build per-worker node maps from it at each failure of a large cluster."""
    return tuple(node_of(w, pp, dp, gpus_per_node, placement) for w in range(pp * dp))
