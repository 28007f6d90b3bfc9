"""What recovery actions and checkpoints cost under the cost model (the simulator's charges,
and the modelled clock's on every backend).

Bytes come from the plan (which worker holds which layers) and the model shape; seconds
from the hardware profile: checkpoint files over `storage_gbps` per node, each file's measured
fixed cost written and read back (`checkpoint_file_s`, `checkpoint_load_file_s`; nodes write in
parallel, workers on one node share it), host copies over `host_gbps` per GPU, process
restarts `restart_s`, a rendezvous of survivors `rendezvous_s`. No per-model constants.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import cycle

from ftbench.actions import (FILE, HOST, MEMORY, SNAPSHOT, InterleavedCheckpoint, LoadFromHost, LogBoundaries, Rendezvous,
                             ReplayLogs, RestartJob, RestoreCheckpoint, SaveCheckpoint, SyncFromPeers, UndoSteps,
                             WaitForReplacement)
from ftbench.actions import CHECKPOINT_BYTES_PER_PARAM
from ftbench.plan import Plan, checkpoint_writers
from ftbench.transfers import transfer_seconds


@dataclass
class SaveCost:
    stall_s: float  # training waits this long
    persist_s: float  # then storage is written in the background this long


def _stage_bytes(plan: Plan, pipeline: int, stage: int, cost_model) -> float:
    """Checkpointed bytes of one stage replica."""
    layers = plan.layers(pipeline, stage)
    return CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(layers, stage == 0, plan.is_last_stage(pipeline, stage)).params


def replica_bytes(plan: Plan, cost_model) -> dict[int, float]:
    """Checkpointed bytes each worker holds: computed once per plan (several recovery costs
    of one plan read it, and on a 16,384-GPU grid one walk over the workers is noticeable)."""
    memo = plan.__dict__.setdefault("_replica_bytes_memo", {})
    key = cost_model.key()
    if key not in memo:
        per_replica = {}  # (pipeline, stage) -> bytes, by what decides them: layers, first, last
        by_shape = {}
        out = defaultdict(float)
        for w, held in plan.holds.items():
            for replica in held:
                nbytes = per_replica.get(replica)
                if nbytes is None:
                    pipeline, stage = replica
                    shape = (plan.layers(pipeline, stage), stage == 0, plan.is_last_stage(pipeline, stage))
                    if shape not in by_shape:
                        by_shape[shape] = _stage_bytes(plan, pipeline, stage, cost_model)
                    nbytes = per_replica[replica] = by_shape[shape]
                out[w] += nbytes
        memo[key] = out
    return memo[key]


def grid_replica_bytes(plan: Plan, cost_model) -> list[float] | None:
    """On a grid (Plan.grid), the bytes a worker of each stage holds, as replica_bytes has
    them (one replica, added to 0.0); None for other plans. Every pipeline cuts the layers
    alike, so a worker's bytes depend only on its stage: pp figures instead of one per worker."""
    grid = plan.grid()
    if grid is None:
        return None
    return [0.0 + _stage_bytes(plan, 0, stage, cost_model) for stage in range(grid.pp)]


def most_replica_bytes(plan: Plan, cost_model) -> float:
    """max(replica_bytes(plan).values()): on a grid, the largest stage's (every stage is held)."""
    per_stage = grid_replica_bytes(plan, cost_model)
    return max(per_stage) if per_stage is not None else max(replica_bytes(plan, cost_model).values())


def _writer_node_bytes(plan: Plan, cost_model, alive=None) -> dict[int, float]:
    """Bytes each node writes when one replica per stage saves (`alive`: only live workers)."""
    out = defaultdict(float)
    for stage, w in checkpoint_writers(plan, alive).items():
        pipeline = next(p for p, s in plan.holds[w] if s == stage)
        out[plan.node_of[w]] += _stage_bytes(plan, pipeline, stage, cost_model)
    return out


def _write_s(plan: Plan, cost_model, alive=None) -> float:
    """Writing one checkpoint: the slowest node's stage shards over `storage_gbps`, plus each
    file's fixed cost (`hardware.checkpoint_file_s`; the manifest is one file more). A job on
    one machine (`hardware.cores` set) has one disk: every stage's shard is written to it."""
    hw = cost_model.hw
    storage = hw.storage_gbps * 1e9
    per_file = float(getattr(hw, "checkpoint_file_s", 0.0) or 0.0)
    by_node = _writer_node_bytes(plan, cost_model, alive)
    if not per_file and getattr(hw, "cores", None) is None:
        return max(by_node.values()) / storage  # (the paper profiles: as before, to the bit)
    files = Counter(plan.node_of[w] for w in checkpoint_writers(plan, alive).values())
    if getattr(hw, "cores", None) is not None:
        return (sum(files.values()) + 1) * per_file + sum(by_node.values()) / storage
    return max(files[n] * per_file + nbytes / storage for n, nbytes in by_node.items()) + per_file


def _read_s(plan: Plan, cost_model) -> float:
    """Reading one checkpoint back (a FILE restore into `plan`): each node reads its workers'
    shards over `storage_gbps`, plus each file's fixed cost (`hardware.checkpoint_load_file_s`:
    open, read, sha256, unpickle; the manifest is one file more). A job on one machine
    (`hardware.cores` set) has one disk, from which the checkpoint's files are read once."""
    hw = cost_model.hw
    storage = hw.storage_gbps * 1e9
    per_file = float(getattr(hw, "checkpoint_load_file_s", 0.0) or 0.0)
    if getattr(hw, "cores", None) is not None:
        shards = _writer_node_bytes(plan, cost_model)
        return (len(checkpoint_writers(plan)) + 1) * per_file + sum(shards.values()) / storage
    if not per_file:
        return _most_node_bytes(plan, cost_model) / storage  # (the paper profiles: as before, to the bit)
    stages = defaultdict(set)
    for w, held in plan.holds.items():
        stages[plan.node_of[w]].update(s for _, s in held)
    return max((len(stages[n]) + 1) * per_file + nbytes / storage for n, nbytes in _node_bytes(plan, cost_model).items())


def _node_bytes(plan: Plan, cost_model) -> dict[int, float]:
    per_stage = grid_replica_bytes(plan, cost_model)
    if per_stage is None:
        pairs = ((plan.node_of[w], nbytes) for w, nbytes in replica_bytes(plan, cost_model).items())
    else:  # the same additions in the same order, each worker's bytes taken per stage
        pairs = zip(map(plan.node_of.__getitem__, plan.grid().workers), cycle(per_stage))
    out = defaultdict(float)
    for node, nbytes in pairs:
        out[node] += nbytes
    return out


def _most_node_bytes(plan: Plan, cost_model) -> float:
    """max(_node_bytes(plan).values()): on a grid with one worker per node, each node's sum
    is its worker's stage bytes added to 0.0, so the largest stage's (all are held)."""
    per_stage = grid_replica_bytes(plan, cost_model)
    if per_stage is not None:
        grid = plan.grid()
        if len(set(grid.node_list(plan.node_of))) == len(grid.workers):
            return max(per_stage)
    return max(_node_bytes(plan, cost_model).values())


def save_cost(mode: str, plan: Plan, cost_model, save_s: float | None = None, alive=None) -> SaveCost:
    """One checkpoint's cost. `save_s` (strategy.save_s), when given, is the stall as measured
    elsewhere (the Oobleck artifact's Varuna: 11.2 s for GPT-3 Medium) in place of the bytes
    over the bandwidth; a background persist (snapshot mode) is still modelled. `alive`: a
    file checkpoint written by live workers only (a save right after a failure)."""
    hw = cost_model.hw
    if mode == FILE:
        return SaveCost(_write_s(plan, cost_model, alive) if save_s is None else save_s, 0.0)
    if mode == SNAPSHOT:
        copy = most_replica_bytes(plan, cost_model) / (hw.host_gbps * 1e9) if save_s is None else save_s
        return SaveCost(copy, _write_s(plan, cost_model))
    if mode == MEMORY:  # every worker copies its own state
        copy = most_replica_bytes(plan, cost_model) / (hw.host_gbps * 1e9) if save_s is None else save_s
        return SaveCost(copy, 0.0)
    if mode == HOST:  # Gemini: the copies are interleaved with training, charged as per-iteration work
        return SaveCost(0.0 if save_s is None else save_s, 0.0)
    raise ValueError(f"unknown checkpoint mode {mode!r}")


def action_seconds(action, old: Plan, new: Plan, cost_model, save_s: float | None = None, alive=None) -> float:
    """Modelled duration of one recovery action moving from plan `old` to plan `new`;
    `save_s` and `alive` as in save_cost (a SaveCheckpoint's stall, its live writers)."""
    hw = cost_model.hw
    if isinstance(action, WaitForReplacement):
        return action.seconds
    if isinstance(action, RestartJob):
        return hw.restart_s
    if isinstance(action, Rendezvous):
        return hw.rendezvous_s
    if isinstance(action, SaveCheckpoint):
        cost = save_cost(action.mode, old, cost_model, save_s, alive)
        return cost.stall_s + cost.persist_s  # before a restart the persist must finish
    if isinstance(action, RestoreCheckpoint):
        if action.source in (MEMORY, HOST):
            # Each worker copies its commit back; one taking a new place gets a peer's commit
            # (HOST: from the host memory of another node of its group, over the network).
            seconds = most_replica_bytes(new, cost_model) / (hw.host_gbps * 1e9)
            return seconds + _copies_s(action.copies, old, new, cost_model)
        return _read_s(new, cost_model)
    if isinstance(action, SyncFromPeers):
        return _copies_s(action.copies, old, new, cost_model)
    if isinstance(action, UndoSteps):
        # one pass over a replica's state, as the step itself (charged whether or not a stage
        # had stepped: an upper bound of milliseconds)
        return cost_model.optimizer_s(max(cost_model.stage(new.layers(d, s), s == 0, new.is_last_stage(d, s)).params
                                          for held in new.holds.values() for d, s in held))
    if isinstance(action, ReplayLogs):
        return replay_seconds(action, new, cost_model)
    if isinstance(action, LoadFromHost):  # each worker over its own GPU's host link, in parallel
        return action.nbytes / (hw.host_gbps * 1e9) if action.workers else 0.0
    raise TypeError(f"the cost model has no cost for {action!r}")


def _copies_s(copies, old: Plan, new: Plan, cost_model) -> float:
    node_of = {**old.node_of, **new.node_of}
    return transfer_seconds(copies, node_of.__getitem__, cost_model)


class CheckpointLedger:
    """The checkpoints a simulated job has: iteration and when it became durable."""

    def __init__(self):
        self.saved: list[tuple[int, float]] = []
        self._last_durable = float("-inf")  # when the last of them becomes durable

    def add(self, iteration: int, durable_at: float) -> None:
        self.saved.append((iteration, durable_at))
        self._last_durable = max(self._last_durable, durable_at)

    @property
    def last_durable(self) -> float:
        """When the last checkpoint written becomes durable (-inf: none)."""
        return self._last_durable

    def restorable(self, t: float) -> int:
        """The newest checkpoint durable by time t; 0 (the initial state, re-created from the
        seed) when none is. Later ones are gone: they belong to the abandoned timeline."""
        done = [i for i, at in self.saved if at <= t]
        iteration = max(done, default=0)
        self.saved = [(i, at) for i, at in self.saved if i <= iteration and at <= t]
        self._last_durable = max((at for _, at in self.saved), default=float("-inf"))  # no wait for a lost persist
        return iteration

    def drop_not_durable(self, t: float) -> list[int]:
        """A failure at time t: checkpoints not yet durable (a save or persist in progress)
        never complete. Returns their iterations."""
        if self._last_durable <= t:  # all durable: nothing to look through (thousands after thousands of failures)
            return []
        lost = [i for i, at in self.saved if at > t]
        self.saved = [(i, at) for i, at in self.saved if at <= t]
        self._last_durable = max((at for _, at in self.saved), default=float("-inf"))
        return lost


def replay_seconds(action: ReplayLogs, plan: Plan, cost_model) -> float:
    """Swift's logging-based recovery: the replaying workers (and parallel recovery's
    helpers, who load the same state) read their checkpoint, then replay each iteration since
    it: every replayed pipeline runs its replayed stages as a pipeline over its share of the
    micro-batches (fill plus steady state: sum of one micro-batch's stage times plus
    (m - 1) times the slowest), the helpers' gradients are summed, each stage steps; the
    logged inputs of its share are read from storage by each group's node, overlapped with
    the replay (a reader fetches the next iteration's logs meanwhile: our assumption)."""
    hw = cost_model.hw
    k = max(len(action.helpers), 1)
    stages = {}  # worker -> (pipeline, stage, StageCost) of what it replays
    for w in action.workers:
        for d, s in plan.holds[w]:
            stages[w] = (d, s, cost_model.stage(plan.layers(d, s), s == 0, plan.is_last_stage(d, s)))
    load = defaultdict(float)  # node -> checkpoint bytes it reads
    loaders = [(w, w) for w in action.workers] + [(h, w) for group in action.helpers[1:]
                                                   for h, w in zip(group, action.workers)]
    for reader, w in loaders:
        load[plan.node_of[reader]] += CHECKPOINT_BYTES_PER_PARAM * stages[w][2].params
    load_s = max(load.values(), default=0.0) / (hw.storage_gbps * 1e9)
    by_pipeline = defaultdict(list)
    for d, s, c in stages.values():
        by_pipeline[d].append((s, c))
    per_iteration, log_read = 0.0, defaultdict(float)
    boundary = cost_model.spec.boundary_bytes(cost_model.b, cost_model.s)
    groups = action.helpers or (action.workers,)
    place = {w: k for k, w in enumerate(action.workers)}  # a replayed worker's place in every group
    for d, run in by_pipeline.items():
        m = -(-plan.schedule.microbatches[d] // k)  # a helper's share
        times = [c.forward_s + c.backward_input_s + c.backward_weight_s for _, c in run]
        step = max(cost_model.optimizer_s(c.params) + cost_model.allreduce_s(c.params, k, False) for _, c in run)
        per_iteration = max(per_iteration, sum(times) + (m - 1) * max(times) + step)
    replayed = {(d, s) for d, s, _ in stages.values()}
    for w, (d, s, _) in stages.items():  # inputs from outside the replay come from the log
        edges = (s > 0 and (d, s - 1) not in replayed) + (s + 1 < plan.schedule.stages[d] and (d, s + 1) not in replayed)
        for group in groups:  # each group reads the logs of its share of the micro-batches, on its own node
            share = -(-plan.schedule.microbatches[d] // k)
            log_read[plan.node_of[group[place[w]]]] += edges * share * boundary
    iterations = action.until - action.since
    read_s = max(log_read.values(), default=0.0) / (hw.storage_gbps * 1e9)
    # a reader thread fetches the next iteration's logs while this one replays
    return load_s + iterations * max(per_iteration, read_s)


def iteration_work_seconds(work, plan: Plan, cost_model, iteration_s: float) -> float:
    """What one piece of a strategy's per-iteration work (ftbench.actions.ITERATION_WORK) adds
    to an iteration of `plan` that trains in `iteration_s` seconds."""
    if isinstance(work, LogBoundaries):
        return logging_stall_s(plan, cost_model, iteration_s, work.boundaries)
    if isinstance(work, InterleavedCheckpoint):
        return interleaved_checkpoint_stall_s(plan, cost_model, iteration_s, work.every, work.group)
    raise TypeError(f"no modelled cost for the per-iteration work {work!r}")


def logging_stall_s(plan: Plan, cost_model, iteration_s: float, logged: frozenset) -> float:
    """Swift's logging per iteration, overlapped with training: each sender copies the tensors
    it sends across the `logged` boundaries to host memory (`host_gbps` per GPU) and its node
    writes them to storage (`storage_gbps` per node) while the next iteration runs; training
    waits only for what does not fit in an iteration's time (the slowest copy or node write
    beyond it)."""
    if not logged:
        return 0.0
    hw = cost_model.hw
    boundary = cost_model.spec.boundary_bytes(cost_model.b, cost_model.s)
    per_node, most = defaultdict(float), 0.0
    for w, held in plan.holds.items():
        sends = sum(((d, s) in logged) + ((d, s - 1) in logged) * (s > 0) for d, s in held)
        if sends:
            nbytes = sends * plan.schedule.microbatches[held[0][0]] * boundary
            per_node[plan.node_of[w]] += nbytes
            most = max(most, nbytes)
    if not per_node:
        return 0.0
    slowest = max(most / (hw.host_gbps * 1e9), max(per_node.values()) / (hw.storage_gbps * 1e9))
    return max(0.0, slowest - iteration_s)


def interleaved_checkpoint_stall_s(plan: Plan, cost_model, iteration_s: float, every: int, group: int) -> float:
    """Gemini's checkpoint traffic per iteration (Wang et al., SOSP 2023): every `every`
    iterations each GPU copies its state to host memory (`host_gbps`, its own PCIe link) and
    sends it to the other `group - 1` nodes of its placement group over its network link
    (`inter_node_gbps`, one per GPU as the profiles assume), both in the background, spread
    over the `every` iterations until the next checkpoint. The network copy uses only the
    time the link is idle: an iteration's time less the GPU's own gradient all-reduce when
    its data-parallel ring leaves the node (pipeline activations, kilobytes to megabytes a
    micro-batch, are left out). Training waits only for what does not fit."""
    hw = cost_model.hw
    per_stage = grid_replica_bytes(plan, cost_model)
    if per_stage is not None:  # a grid: every worker of a stage alike (16,384 workers at scale)
        grid = plan.grid()
        pp = grid.pp
        dp = len(grid.workers) // pp
        stages = []
        for s, nbytes in enumerate(per_stage):
            ring = {plan.node_of[grid.workers[d * pp + s]] for d in range(dp)}
            params = cost_model.stage(plan.layers(0, s), s == 0, plan.is_last_stage(0, s)).params
            stages.append((nbytes, cost_model.allreduce_s(params, dp, len(ring) == 1)))
    else:  # each worker: its bytes, and the all-reduces of the layer ranges it holds
        rings = defaultdict(list)  # (layers, first, last) -> the workers holding a replica of them
        for w, held in plan.holds.items():
            for d, s in held:
                rings[(plan.layers(d, s), s == 0, plan.is_last_stage(d, s))].append(w)
        sync_of = {key: cost_model.allreduce_s(cost_model.stage(*key).params, len(ws),
                                               len({plan.node_of[v] for v in ws}) == 1)
                   for key, ws in rings.items()}
        stages = [(nbytes, sum(sync_of[(plan.layers(d, s), s == 0, plan.is_last_stage(d, s))]
                               for d, s in plan.holds[w]))
                  for w, nbytes in replica_bytes(plan, cost_model).items()]
    worst = 0.0
    for nbytes, sync in stages:
        local = nbytes / (hw.host_gbps * 1e9) / every
        remote = (group - 1) * nbytes / (hw.inter_node_gbps * 1e9) / every
        worst = max(worst, local - iteration_s, remote + sync - iteration_s)
    return worst
