"""`checkfreq`: CheckFreq (Mohan et al., FAST 2021) on top of checkpoint restart.

Checkpoints are two-phase: a *snapshot* copies the state to host memory (training stalls
only for this copy), then a background thread *persists* it to storage while training goes
on. A new snapshot waits for the previous persist. The frequency is tuned so the stall stays
under `overhead_bound` of training time, and no more often than a persist takes. A failure
during a persist loses that checkpoint: recovery uses the previous one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ftbench.actions import SNAPSHOT
from ftbench.strategies.base import StrategyConfig, StrategyTests, register
from ftbench.strategies.checkpoint import CheckpointRestart, every_drawn


@dataclass
class CheckFreqConfig(StrategyConfig):
    """CheckFreq: two-phase checkpoints, their frequency tuned by overhead."""
    name: str = "checkfreq"
    every: Optional[int] = None  # iterations between checkpoints (null: tuned by CheckFreq's overhead rule)
    keep: int = 2  # checkpoints kept on storage (local and dist backends)
    overhead_bound: float = 0.035  # largest fraction of iteration time spent stalled on snapshots
    save_s: Optional[float] = None  # fixed snapshot stall in seconds (null: bytes over hardware.host_gbps)


@register
class CheckFreq(CheckpointRestart):
    name = "checkfreq"
    config = CheckFreqConfig
    tests = StrategyTests(conformance=("strategy.every=2",),
                          conformance_scripts=("one failure", "two in one iteration", "time-based failure"),
                          random=every_drawn(1, 2, 3, 4, "null"), dist=("strategy.every=2",))
    checkpoint_mode = SNAPSHOT

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        if not 0 < cfg.overhead_bound < 1:
            from ftbench.errors import ConfigError
            raise ConfigError("strategy.overhead_bound", f"must be in (0, 1), got {cfg.overhead_bound}",
                              "give the tolerated fraction of iteration time, e.g. strategy.overhead_bound=0.035")
        self.overhead_bound = cfg.overhead_bound

    def extra_memory(self, plan) -> tuple[None, float]:
        """CheckFreq's snapshot: a copy of the writer's stage in host memory until it is persisted."""
        from ftbench.recovery_costs import most_replica_bytes

        return None, most_replica_bytes(plan, self.ctx.cost_model)

    def checkpoint_interval(self, iteration_s: float, stall_s: float, persist_s: float) -> int:
        if self.every is not None:
            return self.every
        by_overhead = math.ceil(stall_s / (self.overhead_bound * iteration_s))
        by_persist = math.ceil(persist_s / iteration_s)  # the next snapshot would wait for this persist
        return max(1, by_overhead, by_persist)
