"""The Strategy protocol: a strategy is a plan for the current membership plus the recovery
actions it takes when membership changes. Backends execute both; they hold no strategy logic."""
from __future__ import annotations

from typing import Protocol

from ftbench.actions import Recovery
from ftbench.cluster import ClusterView
from ftbench.failures import FailureEvent
from ftbench.plan import Plan


class Strategy(Protocol):
    name: str
    # Periodic checkpoints: FILE | SNAPSHOT | MEMORY (ftbench.actions), or None for none. A
    # strategy with a mode also has `checkpoint_interval(iteration_s, stall_s, persist_s) -> int`,
    # which backends call with measured (local) or modelled (sim) costs.
    checkpoint_mode: str | None

    def plan(self, cluster: ClusterView) -> Plan:
        """The plan for the cluster's current membership."""

    def on_event(self, event: FailureEvent, cluster: ClusterView, iteration: int) -> Recovery:
        """React to a failure or join that the cluster already reflects (a read-only view)."""

    # Optional, for strategies that return Recovery(wait=True):
    # def resume(self, cluster: ClusterView, iteration: int) -> Recovery:
    #     """After a wait for nodes: the recovery onto the live nodes (the plan and what it
    #     costs), or raise TooFewNodes while they are still too few."""
