"""The Strategy protocol: a strategy is a plan for the current membership plus the recovery
actions it takes when membership changes. Backends execute both; they hold no strategy logic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ftbench.cluster import ClusterView
from ftbench.failures import FailureEvent
from ftbench.plan import Plan


@dataclass
class Recovery:
    """What a strategy does about a membership change."""
    actions: list[Any] = field(default_factory=list)  # recovery actions, as data; the backend charges/executes them
    plan: Plan | None = None  # the plan to continue with (None: keep the current one)
    unrecoverable: str | None = None  # set when training cannot go on: why
    # With `unrecoverable`: too few nodes to go on now, but the state survives (on the live
    # nodes or in a checkpoint). On the modelled clock the run loop stops training and waits
    # for the timed events that bring more nodes, asking the strategy's `resume` after each.
    wait: bool = False
    # Membership requests; the run loop applies them (it is the only writer of membership).
    replace: tuple[int, ...] = ()  # failed nodes that get a replacement (a standby, else a new node)
    standby: tuple[int, ...] = ()  # returning nodes that wait as standbys
    shape: tuple[int, int] | None = None  # the job's new (pp, dp)


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
