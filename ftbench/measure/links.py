"""Links between two processes over gloo, the dist backend's CPU transport: point-to-point
latency and bandwidth, all-reduce, and the creation of a process group.

Both processes run `exchange` with the same settings, the parent as rank 0 (its timings are
the ones kept), the peer (ftbench.measure.peer) as rank 1:

- point-to-point: a ping-pong of one float32 message per size, 1 KB to 64 MB; half the
  round trip is one message's time. A line through (bytes, seconds), fitted on relative
  residuals, gives the latency (intercept) and the bandwidth (1 / slope);
- all-reduce: `dist.all_reduce` of a few sizes (a ring of 2 on gloo), after a barrier;
- a process group: the dist backend's own `Group` (ftbench.distributed.transport: torch's
  gloo group on a prefix of the job's store, what survivors build after a failure) for both
  ranks, to the end of its first all-reduce, after a barrier.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ftbench.distributed.transport import Group
from ftbench.measure.fit import median

KB, MB = 1024, 1024 * 1024


def p2p_sizes(quick: bool) -> list[int]:
    """1 KB to 64 MB in steps of 4 (16 MB at most with --quick)."""
    top = 16 * MB if quick else 64 * MB
    sizes, size = [], KB
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def allreduce_sizes(quick: bool) -> list[int]:
    return [4 * KB, 256 * KB, 4 * MB] if quick else [4 * KB, 256 * KB, 4 * MB, 32 * MB]


def ping_pong(rank: int, nbytes: int, reps: int) -> list[float]:
    """One-way seconds of `reps` messages of `nbytes` (half a round trip each), after one warm-up."""
    buf = torch.zeros(max(1, nbytes // 4))
    peer = 1 - rank
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if rep:
            times.append((time.perf_counter() - start) / 2)
    return times


def allreduce_times(nbytes: int, reps: int) -> list[float]:
    buf = torch.ones(max(1, nbytes // 4))
    times = []
    for rep in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        if rep:
            times.append(time.perf_counter() - start)
    return times


def group_times(store, rank: int, reps: int, timeout_s: float) -> list[float]:
    """Seconds to build a 2-rank Group on the job's store and finish its first all-reduce."""
    times = []
    for rep in range(reps):
        dist.barrier()
        start = time.perf_counter()
        group = Group(store, f"measure/group/{rep}/", (0, 1), rank, datetime.timedelta(seconds=timeout_s),
                      torch.device("cpu"))
        group.pg.allreduce([torch.zeros(1)]).wait()
        times.append(time.perf_counter() - start)
        del group
    return times


def exchange(rank: int, settings: dict, store, say=None) -> dict:
    """Every link measurement, in the same order on both ranks; rank 0's medians."""
    reps = settings["reps"]
    p2p = {}
    for size in settings["p2p_sizes"]:
        times = ping_pong(rank, size, reps if size < 16 * MB else max(2, reps // 2))
        p2p[size] = median(times)
        if say and size >= MB:
            say(f"links: {size // MB} MB one way {p2p[size] * 1e3:.2f} ms")
    allreduce = {size: median(allreduce_times(size, reps)) for size in settings["allreduce_sizes"]}
    if say:
        say("links: all-reduce of 2 ranks " + ", ".join(f"{s // KB} KB {t * 1e3:.2f} ms" for s, t in allreduce.items()))
    groups = group_times(store, rank, settings["group_reps"], settings["timeout_s"])
    if say:
        say(f"links: a 2-rank process group, built and first all-reduce: {median(groups) * 1e3:.1f} ms (median)")
    dist.barrier()
    return {"p2p": p2p, "allreduce": allreduce, "groups": groups}
