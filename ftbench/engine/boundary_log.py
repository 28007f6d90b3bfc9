"""Swift's log of boundary tensors, as real files, and the transports that write and replay it.

A plan's `logged` boundaries (ftbench.plan.Plan.logged: (pipeline, s) is the edge between
stages s and s + 1) are where Swift records what crosses: stage s's output activations going
forward and stage s + 1's input gradients going back, on the sender's side, so the log
survives the receiver's failure. `LoggingTransport` wraps a transport and hands every such
send to a `BoundaryLog`, which buffers an iteration in host memory and, once the iteration
completes, writes one file per sender (`worker{src}/iteration{i:08d}.pt`) in a background
thread (Swift's logging is asynchronous), each with its iteration, sender and sha256
(ftbench.engine.log_file), verified before a replay reads it. An iteration a failure
abandons is never written.
A checkpoint of iteration c covers everything before it: `drop_before(c)` deletes those
files, so the log on storage stays bounded by one checkpoint interval.

After a failure, `ReplayTransport` lets the replayed workers run an old iteration: what a
replayed worker would receive from a worker outside the replay comes from the log, and what
it sends to one is dropped (that worker has it already).
"""
from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ftbench.engine import log_file
from ftbench.engine.transport import Key, TransportError
from ftbench.errors import ReplayUnavailable


def logged_key(key: Key, logged) -> bool:
    """Whether a message crosses a logged boundary: an activation of stage s or a gradient
    of stage s's output both cross the edge (pipeline, s)."""
    return (key[1], key[2]) in logged


class BoundaryLog:
    """The boundary tensors of the iterations since the last checkpoint, on storage under
    `folder` (strategy.log_dir). `bytes_now` is what the files hold now, `peak_bytes` its most
    over the run; `buffered(worker)` what a sender holds in memory for the iteration in flight."""

    def __init__(self, folder: Path | str, created: bool | None = None):
        self.folder = Path(folder)
        # Only a folder this run made is removed at its end (`created`: whether the run found
        # none; None: decide now, as a single process can).
        self.created = not self.folder.exists() if created is None else created
        self.folder.mkdir(parents=True, exist_ok=True)
        self._open: dict[tuple[int, int], dict] = {}  # (iteration, src) -> {key: tensor}
        self._sizes: dict[tuple[int, int], int] = {}  # (iteration, src) -> bytes of its file
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swift-log")
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._cache: tuple | None = None  # ((iteration, src), {key: tensor}): the file read last
        self.bytes_now = 0
        self.peak_bytes = 0
        self.files_written = 0

    def path(self, src: int, iteration: int) -> Path:
        return self.folder / f"worker{src}" / f"iteration{iteration:08d}.pt"

    # -- writing ------------------------------------------------------------------------
    def record(self, iteration: int, src: int, key: Key, tensor: torch.Tensor) -> None:
        """Keep a copy of a logged send (the sender may reuse its buffer)."""
        self._open.setdefault((iteration, src), {})[key] = tensor.detach().clone()

    def buffered(self, worker: int) -> int:
        """Bytes `worker` holds in memory for the iteration in flight."""
        return sum(t.numel() * t.element_size() for (_, src), msgs in self._open.items() if src == worker
                   for t in msgs.values())

    def seal(self, iteration: int) -> None:
        """The iteration completed: its buffers are written, one file per sender, in the background."""
        if self._cache is not None and self._cache[0][0] == iteration:
            self._cache = None  # a redone iteration (after a restart) replaces its files
        for key in [k for k in self._open if k[0] == iteration]:
            messages = self._open.pop(key)
            self._pending.append(self._pool.submit(self._write, key, messages))

    def _write(self, key: tuple[int, int], messages: dict) -> None:
        iteration, src = key
        size = log_file.write(self.path(src, iteration), iteration, src, messages)  # with its sha256
        with self._lock:
            # an iteration redone after a restart replaces its file
            self.bytes_now += size - self._sizes.get(key, 0)
            self._sizes[key] = size
            self.peak_bytes = max(self.peak_bytes, self.bytes_now)
            self.files_written += 1

    def discard_open(self) -> None:
        """The iteration in flight was abandoned: what it logged is not kept."""
        self._open.clear()

    def wait(self) -> None:
        """Until every sealed iteration is on storage (errors of the writer surface here)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def drop_before(self, iteration: int) -> None:
        """A checkpoint of `iteration` was written: the logs of earlier iterations are not
        needed by any replay any more."""
        self.wait()
        for key in [k for k in self._sizes if k[0] < iteration]:
            self.path(key[1], key[0]).unlink(missing_ok=True)
            with self._lock:
                self.bytes_now -= self._sizes.pop(key)
        if self._cache is not None and self._cache[0][0] < iteration:
            self._cache = None

    # -- reading ------------------------------------------------------------------------
    def check(self, sources, since: int, until: int) -> list[str]:
        """What is wrong with the files of `sources` for iterations since..until-1 (a replay's
        reads), each as 'path: reason'; [] when every one verifies (ftbench.engine.log_file)."""
        self.wait()
        problems = []
        for iteration in range(since, until):
            for src in sources:
                try:
                    log_file.verified_payload(self.path(src, iteration), iteration, src)
                except log_file.LogInvalid as bad:
                    problems.append(str(bad))
        return problems

    def read(self, src: int, iteration: int, key: Key) -> torch.Tensor:
        """What `src` sent under `key` in `iteration`, from its file, verified first (LogInvalid)."""
        self.wait()
        if self._cache is None or self._cache[0] != (iteration, src):
            self._cache = ((iteration, src), log_file.load(self.path(src, iteration), iteration, src))
        messages = self._cache[1]
        if key not in messages:
            raise TransportError(f"the log of worker {src} for iteration {iteration} holds no {key}: "
                                 "that boundary is not logged")
        return messages[key]

    def close(self, remove: bool = False) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        if remove and self.created:  # never a folder the run found (it may hold what is not the run's)
            shutil.rmtree(self.folder, ignore_errors=True)


def unusable_replay(since: int, held: int, until: int, problems: list[str]) -> ReplayUnavailable | None:
    """Why a replay of since..until-1 cannot run as planned, or None: `held` is the newest
    checkpoint at or before `since` that verifies, `problems` what is wrong with the log files
    a replay from `held` reads. From an older `held` whose logs all verify the replay can
    still run (ReplayUnavailable.start); damaged logs after `since` rule out any replay."""
    if held == since and not problems:
        return None
    reasons = [] if held == since else [f"the checkpoint of iteration {since} does not verify (the newest that "
                                        f"does holds iteration {held})"]
    if problems:
        more = f" and {len(problems) - 2} more" if len(problems) > 2 else ""
        reasons.append(f"{len(problems)} boundary log file(s) of iterations {held}..{until - 1} do not verify: "
                       + "; ".join(problems[:2]) + more)
    start = held if held < since and not problems else None
    return ReplayUnavailable(f"the replay of iterations {since}..{until - 1} cannot run: " + ", and ".join(reasons),
                             start)


class LoggingTransport:
    """A transport that also logs every send crossing one of the plan's logged boundaries."""

    def __init__(self, inner, log: BoundaryLog, logged, iteration: int):
        self.inner, self.log, self.logged, self.iteration = inner, log, logged, iteration

    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        self.inner.send(key, tensor, src, dst)
        if logged_key(key, self.logged):
            self.log.record(self.iteration, src, key, tensor)

    def __getattr__(self, name):  # receive, reductions, state: as the wrapped transport
        return getattr(self.inner, name)


class ReplayTransport:
    """A replay of `iteration` by `replayed` workers: messages among them pass as usual; what
    one receives from any other worker is read from the log; what it sends to one is dropped."""

    def __init__(self, inner, log: BoundaryLog, replayed, iteration: int):
        self.inner, self.log, self.replayed, self.iteration = inner, log, frozenset(replayed), iteration

    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        if dst in self.replayed:
            self.inner.send(key, tensor, src, dst)

    def receive(self, key: Key, src: int, dst: int) -> torch.Tensor:
        if src in self.replayed:
            return self.inner.receive(key, src, dst)
        return self.log.read(src, self.iteration, key)

    def __getattr__(self, name):
        return getattr(self.inner, name)
