"""A strategy's per-iteration work (ftbench.actions.ITERATION_WORK), performed for real: the
one place where `local` and `dist` turn it into what an iteration does. The modelled clock
charges the same work in the plan's iteration time (ftbench.recovery_costs)."""
from __future__ import annotations

from ftbench.actions import InterleavedCheckpoint, LogBoundaries
from ftbench.engine.boundary_log import LoggingTransport


def no_work(plan) -> tuple:
    """A strategy that does nothing in an iteration beyond training (Strategy.iteration_work)."""
    return ()


def performing(works, transport, boundary_log, iteration: int):
    """The transport iteration `iteration` runs over, doing `works` as it runs: LogBoundaries
    logs every send across its boundaries into `boundary_log` (Swift); InterleavedCheckpoint
    (Gemini) is the HOST tier's save, made after the iteration like every checkpoint."""
    for work in works:
        if isinstance(work, InterleavedCheckpoint):
            continue
        if isinstance(work, LogBoundaries):
            if boundary_log is None:
                raise RuntimeError(f"{work!r} needs a boundary log: the strategy keeps none (strategy.log_dir)")
            transport = LoggingTransport(transport, boundary_log, work.boundaries, iteration)
        else:
            raise TypeError(f"the engine cannot perform the per-iteration work {work!r}")
    return transport
