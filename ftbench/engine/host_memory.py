"""The HOST checkpoint tier on `local` and `dist` (ftbench.actions.HOST): host memory kept by
an agent outside the training processes, as Gemini keeps it (Wang et al., SOSP 2023).

Each node's "host memory" is a folder of the run, `host/node<N>/`, holding checkpoints as the
checkpoint store writes them (manifest, sha256 per shard, the newest `keep`), without fsync:
memory survives no power loss either. A save puts
every worker's replicas in its own node's folder and in those of the other nodes of its
placement group (ftbench.plan.host_groups). A process restart leaves the folders as they are
(the agents' memory outlives the processes); a node's failure empties its folder (`lose`).
A restore takes the newest iteration whose shards, over every node's folder still there,
hold every parameter the plan needs: what a failed node held comes from a peer of its group.

Files stand in for memory because no memory of `local` or `dist` outlives their processes;
the modelled clock charges host and network copies (ftbench.recovery_costs), not files.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from ftbench.checkpoint import CheckpointStore
from ftbench.checkpoint_schedule import host_tier
from ftbench.plan import host_groups

_NODE = re.compile(r"node(\d+)")


class HostMemory:
    def __init__(self, root: Path | str, group: int, keep: int = 2, on_skip=None):
        self.root, self.group, self.keep, self.on_skip = Path(root), group, keep, on_skip
        self._stores: dict[int, CheckpointStore] = {}

    def store(self, node: int) -> CheckpointStore:
        """Node `node`'s host memory."""
        if node not in self._stores:
            self._stores[node] = CheckpointStore(self.root / f"node{node}", keep=self.keep, on_skip=self.on_skip,
                                                 durable=False)
        return self._stores[node]

    def nodes(self) -> list[int]:
        """The nodes whose host memory holds something."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for e in self.root.iterdir() if (m := _NODE.fullmatch(e.name)) and e.is_dir())

    def save(self, iteration: int, shards: dict[str, dict], home: dict[str, int], nodes) -> None:
        """Checkpoint `iteration`: shard name -> the shard, `home`: shard name -> the node whose
        GPU holds it; `nodes`: the plan's nodes, cut into placement groups."""
        for group in host_groups(nodes, self.group):
            members = set(group)
            held = {name: shard for name, shard in shards.items() if home[name] in members}
            if held:
                for node in group:
                    self.store(node).save(iteration, held)

    def lose(self, node: int) -> None:
        """Node `node` failed: its host memory is gone."""
        self._stores.pop(node, None)
        shutil.rmtree(self.root / f"node{node}", ignore_errors=True)

    def forget_newer(self, iteration: int) -> None:
        """A restore went back to `iteration`: newer checkpoints belong to the abandoned timeline."""
        for node in self.nodes():
            store = self.store(node)
            store.discard_after_persist([i for i in store.iterations() if i > iteration])

    def load(self, expected: dict) -> tuple[int, dict[str, dict]] | None:
        """The newest iteration whose shards over every node's host memory hold each parameter
        of `expected` ({name: shape}) with its shape, and those shards by name; None when none does
        (a whole placement group lost its memory, or nothing was saved)."""
        stores = [self.store(n) for n in self.nodes()]
        for iteration in sorted({i for s in stores for i in s.iterations()}, reverse=True):
            merged: dict[str, dict] = {}
            for store in stores:
                loaded = store.load(at_most=iteration)
                if loaded is not None and loaded[0] == iteration:
                    merged.update(loaded[1])
            shapes = {name: tuple(t.shape) for shard in merged.values() for name, t in shard["model"].items()}
            if all(shapes.get(name) == tuple(shape) for name, shape in expected.items()):
                return iteration, merged
        return None


def run_host_memory(cfg, strategy, run_dir: Path | None, on_skip=None) -> HostMemory | None:
    """The run's host memory (`host/` in its folder) for a strategy with a HOST tier; None for
    any other strategy, or a run without a folder."""
    tier = host_tier(strategy)
    if tier is None or run_dir is None:
        return None
    return HostMemory(Path(run_dir) / "host", tier.group, keep=cfg.strategy.get("keep", 2), on_skip=on_skip)
