"""Swift's selective logging (Zhong et al., PPoPP 2023 / TPDS 2024): which pipeline
boundaries to log.

Swift logs the tensors that cross a *logging-group* boundary (activations forward,
gradients backward), a group being a machine by default. When a machine fails with no live
replica, its whole group rolls back to the group's last checkpoint and replays the
iterations since, reading the logged tensors at the group's edges in place of its
neighbours' sends; the other groups wait. A bigger group logs less (fewer boundaries) but
replays more: more machines, each replaying its own stages.

Selective logging merges adjacent groups greedily, each time the merge that adds the least
expected recovery time per byte of log it saves, until the log fits the budget.

The model here, per iteration and per failure of one machine, uniform over machines:

- a boundary's log: its activation and gradient for every micro-batch, `2 x m x bytes`;
  a log lives until the next checkpoint covers it, so the log on storage peaks at
  `interval` iterations of it;
- a group's replay of one iteration: its stages run as a pipeline on the logged inputs,
  `sum(t_i) + (m - 1) * max(t_i)` (t_i: one micro-batch's forward and backward on machine i;
  1F1B's fill plus its steady state), times the iterations since the checkpoint, half the
  interval on average, divided by the replay's parallel degree (parallel recovery);
- the expected recovery time: the mean over machines of their group's replay.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggingPlan:
    """Groups of consecutive machines (first, last inclusive), the log bytes on storage at
    its peak (over one checkpoint interval) and the expected recovery time of a failure."""
    groups: tuple[tuple[int, int], ...]
    log_bytes: float
    recovery_s: float

    @property
    def logged_boundaries(self) -> tuple[int, ...]:
        """Boundary i lies between machine i and i + 1."""
        return tuple(last for _, last in self.groups[:-1])


class SelectiveLogging:
    """`machine_s[i]`: one micro-batch's forward + backward on machine i (its stages);
    `boundary_bytes[i]`: one micro-batch's tensor crossing from machine i to i + 1;
    `microbatches`: per iteration; `interval`: iterations between checkpoints;
    `parallel`: the replay's parallel degree (1: serial replay)."""

    def __init__(self, machine_s: list[float], boundary_bytes: list[float], microbatches: int,
                 interval: int, parallel: int = 1):
        if len(boundary_bytes) != len(machine_s) - 1:
            raise ValueError(f"{len(machine_s)} machines need {len(machine_s) - 1} boundaries, "
                             f"got {len(boundary_bytes)}")
        if microbatches < 1 or interval < 1 or parallel < 1:
            raise ValueError("microbatches, interval and parallel must be at least 1")
        self.t, self.b = list(machine_s), list(boundary_bytes)
        self.m, self.interval, self.parallel = microbatches, interval, parallel

    def boundary_log_bytes(self, i: int) -> float:
        """Boundary i's log at its peak: both directions, every micro-batch, `interval` iterations."""
        return 2.0 * self.m * self.b[i] * self.interval

    def replay_s(self, group: tuple[int, int]) -> float:
        """The expected replay of `group` after one of its machines fails."""
        times = self.t[group[0]:group[1] + 1]
        per_iteration = sum(times) + (self.m - 1) * max(times)
        return per_iteration * (self.interval / 2.0) / self.parallel

    def plan_of(self, groups) -> LoggingPlan:
        groups = tuple(groups)
        machines = len(self.t)
        log = sum(self.boundary_log_bytes(last) for _, last in groups[:-1])
        recovery = sum((last - first + 1) * self.replay_s((first, last)) for first, last in groups) / machines
        return LoggingPlan(groups, log, recovery)

    def _merge_cost(self, groups, j: int) -> float:
        """Added expected recovery time per byte saved by merging groups j and j + 1."""
        a, b = groups[j], groups[j + 1]
        merged = (a[0], b[1])
        added = ((merged[1] - merged[0] + 1) * self.replay_s(merged)
                 - (a[1] - a[0] + 1) * self.replay_s(a) - (b[1] - b[0] + 1) * self.replay_s(b)) / len(self.t)
        saved = self.boundary_log_bytes(a[1])
        return added / saved if saved > 0 else float("inf") if added > 0 else 0.0

    def curve(self) -> list[LoggingPlan]:
        """Every plan of the greedy, from a group per machine (log everything) to one group
        (log nothing): the trade-off between log bytes and expected recovery time."""
        groups = [(i, i) for i in range(len(self.t))]
        plans = [self.plan_of(groups)]
        while len(groups) > 1:
            j = min(range(len(groups) - 1), key=lambda k: (self._merge_cost(groups, k), k))
            groups[j:j + 2] = [(groups[j][0], groups[j + 1][1])]
            plans.append(self.plan_of(groups))
        return plans

    def within(self, budget_bytes: float) -> LoggingPlan:
        """The greedy's first plan whose log fits `budget_bytes`."""
        smallest = min((self.boundary_log_bytes(i) / self.interval for i in range(len(self.b))), default=0.0)
        if self.b and budget_bytes < smallest:
            raise ValueError(f"a log budget of {budget_bytes / 1e9:.3g} GB is below one iteration of the smallest "
                             f"boundary's log ({smallest / 1e9:.3g} GB)")
        return next(p for p in self.curve() if p.log_bytes <= budget_bytes)
