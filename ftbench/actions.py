"""Recovery actions: what a strategy asks a backend to do, as data.

A strategy never touches state or time itself. It returns these; the `sim` backend charges
their modelled cost (ftbench/sim/actions.py) and the `local` backend performs them for real
(ftbench/engine/local.py). That is what keeps a strategy's simulated and real behaviour the
same mechanism.
"""
from __future__ import annotations

from dataclasses import dataclass

# Where a checkpoint lives.
FILE = "file"  # real files on storage, loaded after a restart (checkpoint restart, Varuna)
SNAPSHOT = "snapshot"  # two-phase: copy to host memory (stall), persist to files in the background (CheckFreq)
MEMORY = "memory"  # in-memory commit on each worker; gone with the worker (Elastic Horovod)
CHECKPOINT_MODES = (FILE, SNAPSHOT, MEMORY)


@dataclass(frozen=True)
class SaveCheckpoint:  # also a recovery action: Varuna saves before morphing into a bigger shape
    """Save the training state after the current iteration."""
    mode: str = FILE


@dataclass(frozen=True)
class WaitForReplacement:
    """Spare nodes take the failed nodes' places; they are usable after `seconds`."""
    nodes: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class RestartJob:
    """Restart every training process and rebuild communicators: all in-memory state is gone."""


@dataclass(frozen=True)
class RestoreCheckpoint:
    """Roll back to the newest usable checkpoint of this kind (`FILE` also finds persisted
    snapshots). The backend reports which iteration it restored, hence the lost work."""
    source: str = FILE


@dataclass(frozen=True)
class Rendezvous:
    """Survivors agree on the new membership and rebuild communicators, without restarting."""


@dataclass(frozen=True)
class SyncFromPeers:
    """Workers that join receive the current weights and optimizer state of their stage from a
    surviving replica (Elastic Horovod's state sync); nothing is rolled back."""
