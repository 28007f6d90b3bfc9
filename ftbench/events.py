"""When scripted and timed events take effect: the one definition every backend shares.

- A failure scripted "at iteration k" strikes during iteration k, at the fraction `at` of
  the plan's simulated timeline (the event's `at`, else `failures.at`, else
  `ITERATION_EVENT_FRACTION`, half-way); the ops each worker has completed by then, the
  optimizer steps that finished included, are resolved once
  (`ftbench.sim.simulator.ops_completed_at`) and every backend cuts at exactly those ops.
  The iteration in flight is then abandoned and redone: a survivor whose replica already
  stepped in it goes back to the iteration's start by undoing that step
  (`ftbench.engine.undo`, done by the engine when it abandons the iteration).
- A timed failure strikes at its time. On a modelled clock (`sim`, and `local` with
  `backend.clock=model`) that is a point inside the iteration in flight, resolved the same
  way, optimizer steps included; on the wall clock it is noticed at the next iteration
  boundary and strikes there, before any op of the next iteration has run.
- An event whose time passed while a recovery was running takes effect when that recovery
  ends (recoveries are not interrupted), before the next iteration starts.
- A join, the failure of a node that runs no worker of the plan, and the failure of a node
  that is already down change no state in flight: they take effect at an iteration
  boundary, scripted ones "at iteration k" before iteration k starts, timed ones at the
  first boundary at or after their time.
- Events at the same point are handled one at a time, in the order the script gives them.
- A replacement a recovery asked for while training goes on without it (`Recovery.later`:
  torchft's replica group on a new node) is a timed join the run loop adds (`EventQueue.add`),
  after the script's events of the same time.
"""
from __future__ import annotations

import heapq
import math
from itertools import count

from ftbench.failures import FailureEvent, FailureScript


class EventQueue:
    """Iteration-scripted events (a sorted list) and time-ordered ones (a lazy, maybe endless
    iterator), consumed as the run reaches them."""

    def __init__(self, script: FailureScript):
        self.by_iteration = list(script.by_iteration)
        self._timed = iter(script.by_time)
        self._next_timed = next(self._timed, None)
        self._added: list[tuple[float, int, FailureEvent]] = []  # (time, order, event): the loop's own
        self._order = count()

    # -- peeking ------------------------------------------------------------------------
    def next_iteration(self) -> int | None:
        """The iteration of the next iteration-scripted event."""
        return self.by_iteration[0].iteration if self.by_iteration else None

    def peek_scripted(self) -> FailureEvent | None:
        return self.by_iteration[0] if self.by_iteration else None

    def next_time(self) -> float:
        """When the next timed event happens; inf when none is left."""
        event = self.peek_timed()
        return event.time_s if event is not None else math.inf

    def peek_timed(self) -> FailureEvent | None:
        scripted, added = self._next_timed, self._added[0][2] if self._added else None
        if added is None or (scripted is not None and scripted.time_s <= added.time_s):
            return scripted
        return added

    # -- taking -------------------------------------------------------------------------
    def pop_scripted(self) -> FailureEvent:
        return self.by_iteration.pop(0)

    def pop_timed(self) -> FailureEvent:
        event = self.peek_timed()
        if event is self._next_timed:
            self._next_timed = next(self._timed, None)
        else:
            heapq.heappop(self._added)
        return event

    def add(self, event: FailureEvent) -> None:
        """A timed event the run itself brings (a replacement that joins later)."""
        heapq.heappush(self._added, (event.time_s, next(self._order), event))
