"""Death to regroup, as `backend=dist` goes through it: the peer beats like a dist rank
(membership.Heartbeat) and is SIGKILLed; the parent detects the silence with the dist
backend's own `detect` (a beat unmoved for STALE_S, then the dead set still for SETTLE_S),
agrees on it (`agree`, one survivor), and builds the survivors' group of the next epoch (the
transport's `Group`) to the end of its first all-reduce. The total, from the kill, is the
profile's `detection_s`.
"""
from __future__ import annotations

import datetime
import time

import torch

from ftbench.distributed.membership import HEARTBEAT_S, SETTLE_S, STALE_S, agree, detect
from ftbench.distributed.transport import Group
from ftbench.measure.peer import BEATING_KEY

EPOCH = 1  # the membership epoch after the death


def measure_detection(peer, say) -> dict:
    """Kill the beating peer and time detection, agreement and the new group."""
    peer.wait_for(BEATING_KEY, peer.timeout_s)
    time.sleep(5 * HEARTBEAT_S)  # a few beats, as a live rank has
    killed = peer.kill()
    dead, detect_s = detect(peer.store, [1], deadline_s=peer.timeout_s)
    if dead != {1}:
        raise RuntimeError(f"detection saw ranks {sorted(dead)} dead, not the killed rank 1")
    agree_s = agree(peer.store, EPOCH, 0, [0], dead, peer.timeout_s)
    start = time.perf_counter()
    group = Group(peer.store, f"measure/epoch/{EPOCH}/", (0,), 0, datetime.timedelta(seconds=peer.timeout_s),
                  torch.device("cpu"))
    group.pg.allreduce([torch.zeros(1)]).wait()
    regroup_s = time.perf_counter() - start
    total = time.perf_counter() - killed
    say(f"detection: kill to regroup {total:.2f} s (detect {detect_s:.2f} s: heartbeat silent {STALE_S:g} s "
        f"+ settle {SETTLE_S:g} s; agree {agree_s * 1e3:.1f} ms; new group {regroup_s * 1e3:.1f} ms)")
    return {"detect_s": detect_s, "agree_s": agree_s, "regroup_s": regroup_s, "total_s": total,
            "stale_s": STALE_S, "settle_s": SETTLE_S, "heartbeat_s": HEARTBEAT_S}
