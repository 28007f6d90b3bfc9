"""Release times: a worker's own ops start no earlier than in the original schedule.

ReCycle (Gandhi et al., SOSP 2024) adapts a pipeline to a failure without replacing its
schedule: the abstract's optimizations "ensure re-routed micro-batches are processed within the
original pipeline schedule's bubbles", and the authors' talk (MLSys seminar) plans "the schedule
of micro batch re-routing with least additional time slots" on top of 1F1B. We state that as
release times taken from the fault-free timeline of the configured schedule (`schedule=`):

- each surviving worker runs its own micro-batches' F and B (or fused BW) in their fault-free
  order, and none of them starts before it started in the fault-free iteration;
- its optimizer step starts no earlier than the fault-free step of its stage, so an adapted
  iteration is never shorter than the fault-free one (a smaller all-reduce after a failure
  buys nothing);
- re-routed micro-batches and the weight-gradient passes (W) that decoupled backprop defers
  have no release: they fill the bubbles, and what does not fit pushes the timeline back.

With the staggered optimizer iterations run back to back and the slots repeat with the
fault-free period: iteration r's op is released r periods after its fault-free start.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import cached_property

from ftbench.schedule import B, BW, F, NO_MICROBATCH, OPT, W, Op

# The fused and split backward stand for one another: B takes the slot of the original BW
# (decoupled backprop on a 1F1B baseline), BW the slot of the original B (a ZB baseline).
_SAME_SLOT = {B: BW, BW: B}


@dataclass(frozen=True)
class Releases:
    pp: int  # grid worker w belongs to pipeline w // pp (its own micro-batches)
    starts: tuple[tuple[tuple[str, int, int], float], ...]  # ((kind, stage, micro-batch), fault-free start)
    period: float  # the fault-free iteration time: the slots repeat with it (staggered optimizer)
    orders: tuple[tuple[tuple[str, int], ...], ...] = ()  # per stage, pipeline 0's (kind, micro-batch) F/B/BW order
    # ((grid worker, pipeline), ...): workers whose own micro-batches are another pipeline's (a
    # plan renamed stage by stage, ftbench.planning.problem.Renaming); every other worker's are
    # its own pipeline's
    owners: tuple[tuple[int, int], ...] = ()

    @cached_property
    def _table(self) -> dict[tuple[str, int, int], float]:
        return dict(self.starts)

    @cached_property
    def _owners(self) -> dict[int, int]:
        return dict(self.owners)

    def with_owners(self, owners: dict[int, int]) -> "Releases":
        """The same slots, with these workers running another pipeline's micro-batches as their own."""
        return replace(self, owners=tuple(sorted(owners.items()))) if owners or self.owners else self

    def of(self, worker: int, op: Op) -> float | None:
        """When grid worker `worker` may start `op` at the earliest (None: whenever it can)."""
        if self.owners:
            pipeline = self._owners.get(worker)
            if pipeline is not None:
                return self.of_position(pipeline, op)
        return self.of_position(worker // self.pp, op)

    def of_position(self, pipeline: int, op: Op) -> float | None:
        """The same for the worker of `pipeline` (at op.stage)."""
        table = self._table
        if op.kind == OPT:
            return table.get((OPT, op.stage, NO_MICROBATCH))
        if op.pipeline != pipeline or op.kind == W:
            return None  # re-routed work and deferred weight gradients fill bubbles
        found = table.get((op.kind, op.stage, op.microbatch))
        if found is None and op.kind in _SAME_SLOT:
            found = table.get((_SAME_SLOT[op.kind], op.stage, op.microbatch))
        return found

    def own_order(self, stage: int, decoupled: bool) -> tuple[tuple[str, int], ...]:
        """A stage's own F and B (decoupled) or BW ops as (kind, micro-batch), in fault-free order."""
        back = B if decoupled else BW
        return tuple((F if kind == F else back, k) for kind, k in self.orders[stage])

    def key(self) -> str:
        found = self.__dict__.get("_key")
        if found is None:
            data = [self.pp, self.period, [[list(k), v] for k, v in self.starts], self.orders]
            if self.owners:  # (keys without owners stay as they were)
                data.append(self.owners)
            found = self.__dict__["_key"] = hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]
        return found


def releases_of(result, pp: int) -> Releases:
    """Release times from a simulated fault-free iteration (ftbench.sim.simulator.SimResult):
    per (kind, stage, micro-batch) its earliest start over the pipelines, per stage its latest
    optimizer start (the stage's common all-reduce ends then), the iteration time, and the
    order of pipeline 0's F and B/BW ops at each stage."""
    starts: dict[tuple[str, int, int], float] = {}
    # The simulated workers' rows: every other worker copies one of them, times and all, so
    # the extremes are the same (16,384 workers' rows would take seconds to build).
    rows = result.simulated_ops() if hasattr(result, "simulated_ops") else result.ops
    for _, op, start, _ in rows:
        key = (op.kind, op.stage, NO_MICROBATCH if op.kind == OPT else op.microbatch)
        if op.kind == OPT:
            starts[key] = max(starts.get(key, start), start)
        elif op.kind != W:
            starts[key] = min(starts.get(key, start), start)
    ops = result.schedule.ops
    orders = tuple(tuple((op.kind, op.microbatch) for op in ops[s] if op.kind in (F, B, BW)) for s in range(pp))
    return Releases(pp, tuple(sorted(starts.items())), result.iteration_time, orders)
