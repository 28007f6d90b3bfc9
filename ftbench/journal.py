"""The run loop's journal: how a process restarted in the middle of a run gets the loop back.

A restart of the job (`RestartJob`) ends every training process; new ones start, rebuild the
model and load the checkpoint. The run loop, which every process of a `dist` job runs, must
come back too, with its strategy, cluster, events, checkpoint ledger and records exactly as
they were. The loop is deterministic given two inputs that come from outside it: what the
backend answers (losses, measured checkpoint costs, restored iterations, the failures it
discovered) and what the wall clock reads. The journal records both, in order, while the run
goes on; at a restart the leader writes it to the run folder (verified: a digest over the
payload, written whole before it is renamed into place). The new processes run the same loop
from the start against the journal: every backend call is answered from it, every clock
reading taken from it, no metrics line is written again, until the call the restart
interrupted, which the new processes' backend carries on for real (`Backend.perform_resumed`).
From there the journal records again, for the next restart.

The clock goes on across the restart: the new process's readings continue from the last one
recorded plus the real time that passed since the journal was written (on every process's
wall clock), so a recovery's time includes the processes' exit and start.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path

MAGIC = b"ftbench-journal-1\n"


class JournalError(RuntimeError):
    """A journal that does not verify, or a loop that does not replay it as recorded."""


class Journal:
    """What the backend answered the run loop and what the clock read, in order (`entries`).
    `replaying` while a restarted process goes through the entries of the journal it loaded."""

    def __init__(self, entries: list | None = None, resume: dict | None = None, offset: float = 0.0):
        self.entries: list[tuple] = list(entries or [])
        self.until = len(self.entries) if resume is not None else 0  # entries to answer from
        self.position = 0
        self.resume = resume  # {"call": the interrupted call, "state": the backend's state then, ...}
        self.offset = offset  # added to this process's perf_counter: the clock goes on across restarts

    @property
    def replaying(self) -> bool:
        return self.position < self.until

    # -- the two inputs ---------------------------------------------------------------------
    def clock(self) -> float:
        """The wall clock as the run loop reads it (seconds, any origin)."""
        if self.replaying:
            return self._next("clock")[1]
        value = time.perf_counter() + self.offset
        self.entries.append(("clock", value))
        return value

    def call(self, name: str, act):
        """`act()` for the backend call `name`, recorded; answered from the journal while
        replaying (`act` is not called). An exception the loop may handle is recorded and raised
        again in the replay."""
        if self.replaying:
            entry = self._next(name)
            if entry[0] == "raise":
                raise _rebuilt(entry[2])
            return entry[2]
        try:
            value = act()
        except Exception as err:  # the loop may catch it (FailuresDiscovered, a result): replay it too
            self.entries.append(("raise", name, _kept(err)))
            raise
        self.entries.append(("return", name, value))
        return value

    def _next(self, what: str) -> tuple:
        entry = self.entries[self.position]  # (replaying: position < until <= len(entries))
        if entry[0 if what == "clock" else 1] != what:
            raise JournalError(f"the restarted run loop asked for {what!r} where the journal has {entry[:2]} "
                               f"(entry {self.position} of {self.until}): the loop did not replay as it ran")
        self.position += 1
        return entry

    # -- on disk ----------------------------------------------------------------------------
    def write(self, path: Path, resume: dict) -> Path:
        """The journal so far and what the restarted processes need to go on (`resume`), written
        whole to a temporary file, flushed to disk and renamed into place."""
        payload = pickle.dumps({"entries": self.entries, "resume": {**resume, "clock": time.perf_counter()
                                                                    + self.offset, "time": time.time()}})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)
        return path

    @classmethod
    def load(cls, path: Path) -> "Journal":
        """The journal at `path`, verified, to replay; its clock continues from the time it was
        written. JournalError when it does not verify (a restart cannot go on from it)."""
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise JournalError(f"the restart journal {path} cannot be read: {err}") from None
        head, _, rest = data.partition(b"\n")
        digest, _, payload = rest.partition(b"\n")
        if head + b"\n" != MAGIC or hashlib.sha256(payload).hexdigest().encode() != digest:
            raise JournalError(f"the restart journal {path} does not verify (a partial or damaged write)")
        saved = pickle.loads(payload)
        resume = saved["resume"]
        offset = resume["clock"] + (time.time() - resume["time"]) - time.perf_counter()
        return cls(saved["entries"], resume, offset)


def verifies(path: Path) -> bool:
    """Whether the journal at `path` is complete and intact (the launcher asks before a restart)."""
    try:
        Journal.load(path)
    except JournalError:
        return False
    return True


def _kept(err: Exception) -> tuple:
    """An exception as the journal keeps it: its class, args and attributes (exceptions whose
    constructor takes other arguments than their args pickle badly as they are)."""
    return type(err), err.args, dict(vars(err))


def _rebuilt(kept: tuple) -> Exception:
    cls, args, attributes = kept
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(attributes)
    return err


class JournaledBackend:
    """A backend whose answers to the run loop go through `journal` (recorded; answered from it
    while replaying). The call a restart interrupted is handed to the backend's
    `perform_resumed` with what the journal kept of it."""

    def __init__(self, backend, journal: Journal):
        self.backend, self.journal = backend, journal

    def __getattr__(self, name):  # jumps, cuts_ops, charged and the rest: the backend's own
        return getattr(self.backend, name)

    def _call(self, name: str, *args):
        journal = self.journal
        if journal.resume is not None and not journal.replaying and name == journal.resume["call"]:
            resume, journal.resume = journal.resume, None  # from here on the backend acts, and it is recorded
            return journal.call(name, lambda: self.backend.perform_resumed(resume, *args))
        return journal.call(name, lambda: getattr(self.backend, name)(*args))  # looked up only when it acts

    @property
    def charged(self) -> float:
        """What the backend charged the clock for the last recovery (LocalBackend.charged), recorded."""
        return self.journal.call("charged", lambda: getattr(self.backend, "charged", 0.0))

    def start(self, plan):
        return self._call("start", plan)

    def run_iteration(self, plan, iteration):
        return self._call("run_iteration", plan, iteration)

    def finish_without(self, plan, iteration, finishing, dead_workers, touched):
        return self._call("finish_without", plan, iteration, finishing, dead_workers, touched)

    def strike(self, plan, iteration, completed, dead_workers):
        return self._call("strike", plan, iteration, completed, dead_workers)

    def perform(self, actions, old, new, iteration):
        return self._call("perform", actions, old, new, iteration)

    def save(self, plan, iteration, mode):
        return self._call("save", plan, iteration, mode)

    def iteration_time(self, plan, iteration, measured):
        return self._call("iteration_time", plan, iteration, measured)

    def drop_checkpoints(self, iterations):
        return self._call("drop_checkpoints", iterations)

    def lose_unfinished_persist(self):
        return self._call("lose_unfinished_persist")

    def lose_host_memory(self, node):
        return self._call("lose_host_memory", node)

    def check_memory(self, plan, timeline):
        return self._call("check_memory", plan, timeline)

    def peak_memory(self):
        return self._call("peak_memory")

    def finish(self):
        return self._call("finish")
