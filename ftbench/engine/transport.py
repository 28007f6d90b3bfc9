"""How workers exchange tensors: the seam between per-worker op execution and communication.

A worker's executor (ftbench.engine.executor.WorkerExecutor) touches only its own state and
a `Transport`. The local backend passes everything inside one process (`InProcessTransport`);
a `dist` backend implements the same methods over torch.distributed, and Swift's logging
wraps a transport to record the boundary tensors that cross it.

Messages are keyed by (kind, pipeline, stage, microbatch): kind "act" is stage `stage`'s
output activation of that micro-batch, "grad" the gradient w.r.t. stage `stage`'s output.
Reductions are two-phase (start, then wait), like an asynchronous all-reduce, so a driver
that runs every worker in one thread can let each participant contribute before any waits.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ftbench.layers import GradientSync, Units

Key = tuple[str, int, int, int]  # ("act" | "grad", pipeline, stage, microbatch)
ACT, GRAD = "act", "grad"


class Transport(Protocol):
    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        """Worker `src` hands `tensor` (values only, no autograd graph) to worker `dst`."""

    def receive(self, key: Key, src: int, dst: int) -> torch.Tensor:
        """Worker `dst` takes what `src` sent under `key`."""

    def reduce_start(self, sync: GradientSync, worker: int, members: tuple[int, ...],
                     tensors: list[torch.Tensor | None]) -> None:
        """Worker `worker` contributes its gradients of `sync`'s fragment to the sum over
        `members` (the workers holding it, in the fixed summation order). None: no gradient."""

    def reduce_wait(self, sync: GradientSync, worker: int) -> list[torch.Tensor | None]:
        """The sums (one fresh tensor per contributed one; None where no member had one)."""

    def send_state(self, units: Units, shard: dict, src: int, dst: int) -> None:
        """Worker `src` sends its shard of `units` (ftbench.layers): weights and AdamW state by
        Hugging Face parameter name, so it loads into any partition."""

    def receive_state(self, units: Units, src: int, dst: int) -> dict:
        """Worker `dst` takes the shard of `units` that `src` sent."""


class TransportError(RuntimeError):
    """A message or contribution that is not there: a driver ran ops out of dependency order."""


class InProcessTransport:
    """Every worker in one process: messages are dict entries, a reduction sums the members'
    tensors in member order once the last one has contributed."""

    def __init__(self):
        self.mail: dict = {}
        self.pending: dict = {}  # sync -> (members, {worker: tensors})
        self.results: dict = {}  # sync -> (sums, workers that still have to collect them)

    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        self.mail[(key, src, dst)] = tensor.detach()

    def receive(self, key: Key, src: int, dst: int) -> torch.Tensor:
        try:
            return self.mail.pop((key, src, dst))
        except KeyError:
            raise TransportError(f"worker {dst} expects {key} from worker {src}, which was not sent") from None

    def reduce_start(self, sync, worker, members, tensors) -> None:
        group, contributions = self.pending.setdefault(sync, (tuple(members), {}))
        if worker not in group or worker in contributions:
            raise TransportError(f"worker {worker} contributes to {sync} as a member of {group}")
        contributions[worker] = list(tensors)
        if len(contributions) == len(group):
            del self.pending[sync]
            self.results[sync] = (_sum([contributions[w] for w in group]), set(group))

    def reduce_wait(self, sync, worker) -> list:
        if sync not in self.results:
            raise TransportError(f"worker {worker} waits for {sync} before every member contributed")
        sums, waiting = self.results[sync]
        waiting.discard(worker)
        if not waiting:
            del self.results[sync]
        return [None if t is None else t.clone() for t in sums]

    def send_state(self, units, shard, src, dst) -> None:
        self.mail[(("state", *units), src, dst)] = shard

    def receive_state(self, units, src, dst) -> dict:
        return self.receive(("state", *units), src, dst)

    def clear(self) -> None:
        """Drop what an abandoned iteration left in flight."""
        self.mail.clear()
        self.pending.clear()
        self.results.clear()


def _sum(contributions: list[list]) -> list:
    """Element-wise sums over members, in member order (a fixed order: reproducible)."""
    if len({len(c) for c in contributions}) > 1:
        raise TransportError("members contributed different numbers of tensors")
    sums = []
    for tensors in zip(*contributions):
        present = [t for t in tensors if t is not None]
        if not present:
            sums.append(None)
            continue
        total = present[0].clone()
        for t in present[1:]:
            total.add_(t)
        sums.append(total)
    return sums
