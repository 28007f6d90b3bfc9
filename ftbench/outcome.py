"""What a backend's run loop hands back to `ftbench.run`, whichever backend ran."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunOutcome:
    status: str = "ok"  # ok | oom | unrecoverable
    error: str | None = None
    iterations: int = 0  # completed (useful) iterations
    time_s: float = 0.0  # simulated (sim) or wall-clock (local) seconds
    productive_s: float = 0.0  # of time_s, spent on iterations that count (ftbench.loop.KeptIterations)
    failures: int = 0
    recoveries: list[dict] = field(default_factory=list)  # {time_s, iteration, recovery_s, lost_iterations, ...}
