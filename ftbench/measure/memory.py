"""Memory and host-snapshot bandwidth from large tensor copies.

`hbm_gbps` (what bounds the optimizer step in the cost model) counts the bytes a copy moves,
read and write: 2 x size / time of `dst.copy_(src)` into a buffer allocated beforehand, on
the device the ops ran on. `host_gbps` is a snapshot as the engine takes one (a replica's
`shard()` clones every tensor): size / time of `src.clone()` on CPU, or of the copy to host
memory on a GPU (`.to("cpu")`), allocation included.
"""
from __future__ import annotations

import time

import torch

from ftbench.measure.fit import median, spread
from ftbench.measure.ops import synchronize


def timed(fn, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int, device: str, reps: int) -> dict:
    """Median GB/s of an in-place copy (2 x bytes moved) and of a snapshot (bytes copied out)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    copies = [timed(lambda: dst.copy_(src), device) for _ in range(reps)]
    target = "cpu"
    snapshots = [timed(lambda: src.to(target, copy=True), device) for _ in range(reps)]
    return {"bytes": src.numel() * 4,
            "copy_s": median(copies), "copy_spread": spread(copies),
            "hbm_gbps": 2 * src.numel() * 4 / median(copies) / 1e9,
            "snapshot_s": median(snapshots), "snapshot_spread": spread(snapshots),
            "host_gbps": src.numel() * 4 / median(snapshots) / 1e9}
