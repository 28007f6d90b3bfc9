"""Recovery actions: what a strategy asks a backend to do, as data.

A strategy never touches state or time itself. It returns these; the modelled clock charges
their cost (ftbench/recovery_costs.py) and the `local` backend performs them for real
(ftbench/engine/backend.py). That is what keeps a strategy's simulated and real behaviour the
same mechanism. An action that moves state between workers names every copy (`Transfer`:
which layers, from which worker, to which, how many bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftbench.plan import LayerRange, Plan

# Where a checkpoint lives.
FILE = "file"  # real files on storage, loaded after a restart (checkpoint restart, Varuna)
SNAPSHOT = "snapshot"  # two-phase: copy to host memory (stall), persist to files in the background (CheckFreq)
MEMORY = "memory"  # in-memory commit on each worker; gone with the worker (Elastic Horovod)
# In host memory kept outside the training processes (Gemini's agents), each node's also held
# by the other nodes of its group (CheckpointTier.group): a process restart keeps it, a node's
# failure loses what that node held. `local` and `dist` keep it as files in the run folder,
# one folder per node (ftbench.engine.host_memory), since no memory outlives their processes.
HOST = "host"
NO_HOST_CHECKPOINT = ("no host-memory checkpoint holds every parameter: every node of some placement group "
                      "lost its host memory (restore the files instead)")
CHECKPOINT_MODES = (FILE, SNAPSHOT, MEMORY, HOST)

# The tiers a strategy may keep at once (CheckpointTier): at most one in memory and one on storage.
MEMORY_MODES = (MEMORY, HOST)
STORAGE_MODES = (FILE, SNAPSHOT)

# fp32 master weights + Adam's two moments; the fp16 working weights are re-cast from the master copy.
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Transfer:
    """One copy of state (weights and optimizer state) between workers: a replica's, or a piece
    of one (Oobleck: a new layer cut takes its layers from holders cut another way)."""
    layers: LayerRange  # transformer blocks [first, end) (empty for the embedding or head alone)
    embedding: bool  # with the token/position embeddings (a first stage)
    head: bool  # with the final LayerNorm and LM head (a last stage)
    src: int  # worker that sends
    dst: int  # worker that receives
    nbytes: float  # checkpointed bytes moved (CHECKPOINT_BYTES_PER_PARAM per parameter)

    def __str__(self) -> str:
        blocks = [f"blocks {self.layers[0]}-{self.layers[1] - 1}"] if self.layers[1] > self.layers[0] else []
        parts = (["embedding"] if self.embedding else []) + blocks + (["head"] if self.head else [])
        return f"{' + '.join(parts)}: worker {self.src} -> {self.dst} ({self.nbytes / 1e6:.3g} MB)"


@dataclass(frozen=True)
class CheckpointTier:
    """One tier of a strategy's periodic checkpoints: where they live (`mode`) and every how
    many iterations one is saved. `every=None`: at the interval the strategy's
    `checkpoint_interval` gives for the costs of the plan in force (tuned); at most one tier is.
    A modern strategy keeps two (Gemini: in memory every iteration, files every few hours),
    and its recovery says which it restores (RestoreCheckpoint.source)."""
    mode: str
    every: int | None = None
    group: int = 1  # HOST: the nodes of a placement group, each holding every member's checkpoint


@dataclass(frozen=True)
class InterleavedCheckpoint:
    """Per-iteration work (Gemini's traffic scheduling): every `every` iterations each GPU's
    state goes to its node's host memory and to the other `group - 1` nodes of its placement
    group, the traffic spread over the idle network time of the iterations between two
    checkpoints. The modelled clock charges what does not fit in that time
    (recovery_costs.interleaved_checkpoint_stall_s); on `local` and `dist` the copy is the
    HOST tier's save, so nothing more is done in the iteration."""
    every: int
    group: int


@dataclass(frozen=True)
class LogBoundaries:
    """Per-iteration work (Swift's logging): every tensor sent across `boundaries` ((pipeline,
    s): the edge between stages s and s+1) is copied to host memory and written to the run's
    log files in the background, each with its iteration and sender. The modelled clock charges
    what the copy and the write do not hide behind the iteration (recovery_costs); `local` and
    `dist` log the sends for real (ftbench.engine.boundary_log)."""
    boundaries: frozenset


# Work a strategy asks of every iteration (Strategy.iteration_work); a backend must handle each.
ITERATION_WORK = (LogBoundaries, InterleavedCheckpoint)


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
    snapshots). The backend reports which iteration it restored, hence the lost work. With
    `MEMORY`, `copies` name the commits that workers taking a new place get from a peer."""
    source: str = FILE
    copies: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class Rendezvous:
    """Survivors agree on the new membership and rebuild communicators, without restarting."""


@dataclass(frozen=True)
class SyncFromPeers:
    """Workers that join (or take a new place) receive the current weights and optimizer state
    of their layers from a surviving replica, as `copies` name; nothing is rolled back."""
    copies: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class UndoSteps:
    """Survivors whose stages already applied the interrupted iteration's optimizer step
    invert it (ftbench.engine.undo), so every stage stands at the iteration's start. The
    engine undoes them when the failure strikes, for every strategy; this action is where
    Swift's recovery charges that pass on the modelled clock (nothing more to do for real)."""


@dataclass(frozen=True)
class ReplayLogs:
    """Swift's logging-based recovery: `workers` (the failed ones' replacements and the rest
    of their logging group) load their replicas from the checkpoint of iteration `since` and
    replay iterations since..until-1, reading what crosses a logged boundary from the log
    files instead of receiving it from the other workers, which wait. With `helpers`, each
    replayed iteration's micro-batches are split across that many groups of workers
    (parallel recovery: `helpers[k]` are group k's workers, each loading the checkpoint of
    the replayed worker at the same place), their gradients summed before each step. Nothing
    is rolled back: the run goes on at `until`."""
    workers: tuple[int, ...]
    since: int
    until: int
    helpers: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class LoadFromHost:
    """`workers` move replicas they keep in host memory onto their GPU before running them
    (Bamboo's lazy copy of the next stage, at a failover: weights and Adam state, as its
    engine's build_layers and update_state do), each over its own host link in parallel;
    `nbytes`: the most one of them moves. On local and dist the replica already sits in the
    worker's memory: only the modelled clock charges it."""
    workers: tuple[int, ...] = ()
    nbytes: float = 0.0


def leading_saves(actions) -> int:
    """How many SaveCheckpoint actions lead `actions`: such saves (just-in-time checkpoints)
    are the survivors' own, made before any replacement takes a failed node's place."""
    return next((i for i, a in enumerate(actions) if not isinstance(a, SaveCheckpoint)), len(actions))


# The one dispatch of recovery actions, shared by every backend that performs them for real
# (ftbench.engine.backend, ftbench.distributed.backend): action type -> the name of the
# backend's method that performs it, called as method(action, recovery in progress).
PERFORMERS = {SaveCheckpoint: "save_checkpoint", WaitForReplacement: "wait_for_replacement",
              RestartJob: "restart_job", RestoreCheckpoint: "restore_checkpoint", Rendezvous: "rendezvous",
              SyncFromPeers: "sync_from_peers", UndoSteps: "undo_steps", ReplayLogs: "replay_logs",
              LoadFromHost: "load_from_host"}


def performer(backend, action, name: str):
    """The method of `backend` that performs `action`, through PERFORMERS; a TypeError naming
    the backend (`name`) for an action it cannot perform."""
    method = next((PERFORMERS[t] for t in type(action).__mro__ if t in PERFORMERS), None)
    bound = getattr(backend, method, None) if method is not None else None
    if bound is None:
        raise TypeError(f"the {name} backend cannot perform {action!r}")
    return bound


# Every recovery action; a backend must handle each (tests/test_actions.py checks).
ACTIONS = (SaveCheckpoint, WaitForReplacement, RestartJob, RestoreCheckpoint, Rendezvous, SyncFromPeers, UndoSteps,
           ReplayLogs, LoadFromHost)


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
    # Failed nodes that get a replacement while training goes on without them (torchft): a
    # standby while any is left, else a new node after `cluster.replacement_s`; either way its
    # processes start (`hardware.restart_s`) and it joins then, as a join event of the node.
    later: tuple[int, ...] = ()
    shape: tuple[int, int] | None = None  # the job's new (pp, dp)
