"""`DistTransport`: the transport seam (ftbench.engine.transport.Transport) over torch.distributed.

One process per worker; a worker's rank is its worker id (`rank_of`). What crosses processes:

- **Activations and gradients** go point-to-point, `isend` by the producer (never blocking,
  so two neighbours that both send before they receive cannot deadlock) and `irecv` by the
  consumer at the op that needs it. Each *direction* between two ranks has a process group
  of its own (`src -> dst`), so its stream carries messages of one direction only, in the
  producer's op order; `prepare` checks, from the plan, that every consumer takes them in
  that same order (NCCL matches point-to-point messages by order alone). On gloo every
  message also carries a tag made from its key (kind, pipeline, stage, micro-batch), so a
  message can only ever land in the receive posted for that key.
- **Gradient sums** of one layer fragment (ftbench.layers.GradientSync) run in a process
  group of the fragment's members (`dist.new_group`, one per member set), on one flat buffer
  per fragment. Two members all-reduce (a + b == b + a bit for bit); three or more
  all-gather and add in member order, the order the in-process transport adds in, so the
  sums, hence the trained weights, equal the `local` backend's exactly. The slots of a
  fragment (which parameters have a gradient, their shapes) are agreed once per fragment and
  plan with a small all-reduce.

Every wait has a deadline (`timeout_s`, the process groups' timeout too) and a wait that
runs past it raises `DistTimeout` naming this worker, the peer and the operation.
Groups are created collectively: every rank calls `prepare(plan)` at the same point with the
same plan, and creates the groups the plan needs in one fixed order.
"""
from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist

from ftbench.engine.transport import ACT, GRAD, Key
from ftbench.errors import UserError
from ftbench.layers import GradientSync, fragment_layout
from ftbench.schedule import B, BW, F, Op

KIND_CODE = {ACT: 0, GRAD: 1}
MAX_DIMS = 4  # parameters have at most this many dimensions (GPT-2's have 1 or 2)


class DistError(UserError):
    """A distributed run that cannot go on: a peer that does not answer, a job past its deadline."""


class DistTimeout(DistError):
    """A wait that ran past `backend.timeout_s`: names the waiting worker, the peer and the op."""


def tag_of(key: Key) -> int:
    """A point-to-point tag unique per message key within an iteration (gloo matches on it)."""
    kind, pipeline, stage, microbatch = key
    if not (0 <= pipeline < 256 and 0 <= stage < 256 and 0 <= microbatch < 2 ** 14):
        raise DistError(f"message {key} is outside the tag range (256 pipelines, 256 stages, 16384 micro-batches)")
    return (((KIND_CODE[kind] << 8) | pipeline) << 8 | stage) << 14 | microbatch


def describe(key: Key) -> str:
    kind, pipeline, stage, microbatch = key
    what = "activation" if kind == ACT else "gradient"
    return f"the {what} of stage {stage}, micro-batch {microbatch} of pipeline {pipeline}"


def plan_crc(plan) -> int:
    """A fingerprint of a plan that is the same in every process (str hashes are salted)."""
    return zlib.crc32(repr((plan.name, plan.schedule.key(), plan.partition)).encode())


def p2p_order(plan) -> tuple[dict, dict]:
    """Per direction (src worker, dst worker): the message keys the producer sends, in its op
    order, and those the consumer receives, in its op order."""
    schedule = plan.schedule
    where = schedule.index()
    sends: dict = {}
    receives: dict = {}
    for w in schedule.workers:
        for op in schedule.ops[w]:
            last = plan.is_last_stage(op.pipeline, op.stage)
            if op.kind == F:
                if op.stage > 0:
                    src = where[Op(F, op.stage - 1, op.microbatch, op.pipeline)]
                    receives.setdefault((src, w), []).append((ACT, op.pipeline, op.stage - 1, op.microbatch))
                if not last:
                    dst = where[Op(F, op.stage + 1, op.microbatch, op.pipeline)]
                    sends.setdefault((w, dst), []).append((ACT, op.pipeline, op.stage, op.microbatch))
            elif op.kind in (B, BW):
                if not last:
                    src = where[schedule.backward_input_op(op.stage + 1, op.microbatch, op.pipeline)]
                    receives.setdefault((src, w), []).append((GRAD, op.pipeline, op.stage, op.microbatch))
                if op.stage > 0:
                    dst = where[schedule.backward_input_op(op.stage - 1, op.microbatch, op.pipeline)]
                    sends.setdefault((w, dst), []).append((GRAD, op.pipeline, op.stage - 1, op.microbatch))
    return sends, receives


class DistTransport:
    """The Transport protocol over torch.distributed for the worker of this process."""

    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device, dtype: torch.dtype,
                 message_shape: tuple[int, ...], ordered: bool = False):
        self.rank, self.world = rank, world
        self.timeout_s = float(timeout_s)
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.device, self.dtype, self.message_shape = device, dtype, tuple(message_shape)
        self.ordered = ordered  # the backend matches messages by order only (NCCL): refuse plans that reorder
        self.worker: int | None = None  # this process's worker in the current plan
        self._pairs: dict[tuple[int, int], object] = {}  # (src rank, dst rank) -> group of that direction
        self._groups: dict[tuple[int, ...], object] = {}  # sorted member ranks -> fragment group
        self._slots: dict = {}  # (sync, members) -> per slot: shape or None (no member has a gradient)
        self._sends: list = []  # (work, tensor, key, dst) in flight
        self._reductions: dict = {}  # sync -> (work, buffer(s), members, slots)
        self._prepared = None

    # -- ranks and groups ---------------------------------------------------------------
    def rank_of(self, worker: int) -> int:
        if not 0 <= worker < self.world:
            raise DistError(f"worker {worker} has no process: the job has {self.world} (one per worker, ranks 0.."
                            f"{self.world - 1})")
        return worker

    def prepare(self, plan) -> None:
        """Create the process groups `plan` needs (collective: every rank, same plan, same point)."""
        key = plan.key()
        if self._prepared == key:
            return
        self.worker = self.rank if self.rank in plan.workers else None
        sends, receives = p2p_order(plan)
        if self.ordered:
            for pair, keys in sorted(sends.items()):
                if receives.get(pair) != keys:
                    src, dst = pair
                    raise DistError(f"plan {plan.name!r}: worker {dst} takes the messages of worker {src} in "
                                    "another order than they are sent, which a backend matching messages by "
                                    "order (NCCL) cannot deliver")
        for src, dst in sorted(sends):
            pair = (self.rank_of(src), self.rank_of(dst))
            if pair not in self._pairs:
                self._pairs[pair] = dist.new_group(sorted(pair), timeout=self.timeout)
        for sync in fragment_layout(plan.schedule.stages, plan.partition).syncs:
            members = _members(plan, sync)
            if len(members) < 2:
                continue
            ranks = tuple(sorted(self.rank_of(m) for m in members))
            if ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
        self._slots.clear()
        self._prepared = key

    # -- waits --------------------------------------------------------------------------
    def _wait(self, work, what: str) -> None:
        me = f"worker {self.worker} (rank {self.rank})" if self.worker is not None else f"rank {self.rank}"
        try:
            done = work.wait(timeout=self.timeout)
        except Exception as err:  # noqa: BLE001 - gloo and NCCL raise different types on a timeout
            raise DistTimeout(f"{me} waited more than {self.timeout_s:g} s (backend.timeout_s) to {what}: "
                              f"no answer ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                              ) from None
        if done is False:
            raise DistTimeout(f"{me} waited more than {self.timeout_s:g} s (backend.timeout_s) to {what}: no answer")

    # -- point to point -----------------------------------------------------------------
    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        s, d = self.rank_of(src), self.rank_of(dst)
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst=d, group=self._pairs[(s, d)], tag=tag_of(key))
        self._sends.append((work, t, key, dst))

    def receive(self, key: Key, src: int, dst: int) -> torch.Tensor:
        s, d = self.rank_of(src), self.rank_of(dst)
        buffer = torch.empty(self.message_shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(buffer, src=s, group=self._pairs[(s, d)], tag=tag_of(key))
        self._wait(work, f"receive {describe(key)} from worker {src} (rank {s})")
        return buffer

    def flush_sends(self) -> None:
        """Wait until every message this worker sent was taken (end of an iteration)."""
        sends, self._sends = self._sends, []
        for work, _, key, dst in sends:
            self._wait(work, f"send {describe(key)} to worker {dst} (rank {self.rank_of(dst)}), which did not take it")

    # -- gradient sums ------------------------------------------------------------------
    def reduce_start(self, sync: GradientSync, worker: int, members: tuple[int, ...], tensors: list) -> None:
        members = tuple(members)
        ranks = tuple(sorted(self.rank_of(m) for m in members))
        group = self._groups[ranks]
        slots = self._slots.get((sync, members))
        if slots is None:
            slots = self._slots[(sync, members)] = self._agree_slots(sync, members, group, tensors)
        parts = []
        for t, shape in zip(tensors, slots):
            if shape is None:
                if t is not None:
                    raise DistError(f"worker {worker} has a gradient in slot of {sync} that no member had before")
                continue
            parts.append(t.reshape(-1) if t is not None else
                         torch.zeros(_numel(shape), dtype=self.dtype, device=self.device))
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self.device)
        if len(members) == 2:
            work = dist.all_reduce(flat, group=group, async_op=True)
            self._reductions[sync] = (work, flat, None, members, slots)
        else:
            gathered = [torch.empty_like(flat) for _ in ranks]
            work = dist.all_gather(gathered, flat, group=group, async_op=True)
            self._reductions[sync] = (work, flat, gathered, members, slots)

    def reduce_wait(self, sync: GradientSync, worker: int) -> list:
        work, flat, gathered, members, slots = self._reductions.pop(sync)
        self._wait(work, f"sum the gradients of layer fragment {sync.units} with workers "
                         f"{', '.join(str(m) for m in members if m != worker)} (ranks "
                         f"{', '.join(str(self.rank_of(m)) for m in members if m != worker)})")
        if gathered is not None:  # add in member order: the in-process transport's order
            position = {r: i for i, r in enumerate(sorted(self.rank_of(m) for m in members))}
            total = gathered[position[self.rank_of(members[0])]].clone()
            for m in members[1:]:
                total.add_(gathered[position[self.rank_of(m)]])
            flat = total
        sums, offset = [], 0
        for shape in slots:
            if shape is None:
                sums.append(None)
                continue
            n = _numel(shape)
            sums.append(flat[offset:offset + n].view(shape))
            offset += n
        return sums

    def _agree_slots(self, sync, members, group, tensors) -> list:
        """Which slots any member has a gradient in, and their shapes (one small all-reduce)."""
        header = torch.zeros((len(tensors), 1 + MAX_DIMS), dtype=torch.int64, device=self.device)
        for i, t in enumerate(tensors):
            if t is not None:
                if t.dim() > MAX_DIMS:
                    raise DistError(f"a gradient of {sync} has {t.dim()} dimensions (at most {MAX_DIMS})")
                header[i, 0] = t.dim() + 1
                for j, size in enumerate(t.shape):
                    header[i, 1 + j] = size
        work = dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._wait(work, f"agree on the gradients of layer fragment {sync.units} with workers {members}")
        slots = []
        for row in header.tolist():
            slots.append(None if row[0] == 0 else tuple(row[1:row[0]]))
        return slots

    # -- state copies (arrive with failures) ----------------------------------------------
    def send_state(self, units, shard, src, dst) -> None:
        raise DistError("state copies between processes arrive with failures on backend=dist (issue 12)")

    def receive_state(self, units, src, dst) -> dict:
        raise DistError("state copies between processes arrive with failures on backend=dist (issue 12)")

    # -- whole-job collectives --------------------------------------------------------------
    def all_sum(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Sum `values` over every rank of the job (in place), within the deadline."""
        work = dist.all_reduce(values, async_op=True)
        self._wait(work, what)
        return values

    def clear(self) -> None:
        self._sends.clear()
        self._reductions.clear()


def _members(plan, sync) -> tuple[int, ...]:
    from ftbench.engine.executor import sync_members

    return sync_members(plan, sync)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
