"""The `sim` backend: nothing runs, time is the cost model's (ftbench.loop charges it).

It keeps which checkpoints exist (their iterations) and the peak memory of every plan,
and turns a plan that does not fit the GPUs' memory into an `oom` result.
"""
from __future__ import annotations

from itertools import compress, repeat
from operator import gt, itemgetter

from ftbench.actions import (FILE, HOST, MEMORY, NO_HOST_CHECKPOINT, STORAGE_MODES, LoadFromHost, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint, SaveCheckpoint, SyncFromPeers,
                             UndoSteps, WaitForReplacement)
from ftbench.errors import ResultError
from ftbench.plan import Plan
from ftbench.sim.cache import RenamedResult
from ftbench.sim.simulator import SimResult


# Actions whose whole effect here is the time the modelled clock charges for them.
TIME_ONLY = (WaitForReplacement, RestartJob, Rendezvous, SyncFromPeers, UndoSteps, LoadFromHost)


class SimBackend:
    jumps = True
    cuts_ops = False

    def __init__(self, ctx, extra_memory=None, describe_memory=None):
        self.ctx = ctx
        # strategy.memory_breakdown(plan, worker, peak) -> the worker's memory in words, for the
        # `oom` message in place of the generic state + activations split (Bamboo: its stage,
        # the copy, own and redundant activations)
        self.describe_memory = describe_memory
        # strategy.extra_memory(plan) -> ({worker: device bytes} or None, host bytes at most):
        # what the strategy's mechanism keeps beyond training state (Swift: the undo's gradient
        # on the device and the iteration's log in host memory; Elastic Horovod's commit and
        # CheckFreq's snapshot in host memory)
        self.extra_memory = extra_memory
        self.peak_host = 0.0
        self.saved: dict[str, list[int]] = {}  # mode -> iterations of its checkpoints that exist (newest few)
        self._peak: dict[int, float] = {}
        self._checked: tuple[SimResult, str | None] | None = None  # the last result checked, and its answer
        self._renamings: _Renamings | None = None  # peaks of the last reference renamed plans time out as

    def start(self, plan: Plan) -> None:
        self.saved = {}

    def run_iteration(self, plan: Plan, iteration: int) -> None:
        return None

    def iteration_time(self, plan: Plan, iteration: int, measured: float) -> float:
        return measured  # (the simulator's clock is modelled: the loop does not ask)

    def finish_without(self, plan, iteration, finishing, dead_workers, touched) -> None:
        return None  # the loop charges the whole iteration; no loss is computed

    def strike(self, plan, iteration, completed, dead_workers) -> None:
        # the lost work is the time the loop already charged; undoing the steps survivors took
        # in the iteration (local/dist: ftbench.engine.undo) is not charged (None: no state held)
        return None

    def perform(self, actions, old: Plan, new: Plan, iteration: int) -> int | None:
        restored = None
        for action in actions:
            if isinstance(action, SaveCheckpoint):
                self.save(old, iteration, action.mode)
            elif isinstance(action, RestartJob):
                self.saved.pop(MEMORY, None)  # every process restarts: what was in memory is gone (not HOST)
            elif isinstance(action, RestoreCheckpoint):
                # The newest checkpoint of the tier restored (0: the initial state, re-created
                # from the seed); later ones of any tier cannot exist, they would belong to the
                # abandoned timeline.
                held = self._of(action.source)
                if action.source == MEMORY and not held:  # as local and dist find it (newest_commits)
                    raise ResultError("unrecoverable", "no in-memory commit survived the failure")
                if action.source == HOST and not held:  # as local and dist find it (HostMemory.load)
                    raise ResultError("unrecoverable", NO_HOST_CHECKPOINT)
                restored = max(held, default=0)
                self.saved = {mode: [i for i in kept if i <= restored] for mode, kept in self.saved.items()}
            elif isinstance(action, ReplayLogs):
                held = max((i for i in self._of(FILE) if i <= action.since), default=0)
                if held != action.since:  # as the local and dist backends find it
                    raise ResultError("unrecoverable", f"the replay starts from the checkpoint of iteration "
                                      f"{action.since}, but the newest usable checkpoint holds iteration {held}")
            elif not isinstance(action, TIME_ONLY):
                raise TypeError(f"the sim backend cannot perform {action!r}")
        return restored

    def _of(self, source: str) -> list[int]:
        """The checkpoints a restore from `source` finds: FILE also finds persisted snapshots."""
        modes = STORAGE_MODES if source in STORAGE_MODES else (source,)
        return [i for mode in modes for i in self.saved.get(mode, ())]

    def save(self, plan, iteration: int, mode: str) -> None:
        self.saved[mode] = sorted(set(self.saved.get(mode, [])[-3:]) | {iteration})

    def drop_checkpoints(self, iterations) -> None:
        # only a storage tier's persist can be unfinished when a failure strikes
        gone = set(iterations)
        for mode in STORAGE_MODES:
            if mode in self.saved:
                self.saved[mode] = [i for i in self.saved[mode] if i not in gone]

    def lose_unfinished_persist(self) -> None:
        pass

    def lose_host_memory(self, node: int) -> None:
        pass  # which nodes' host memory can still serve a restore is the strategy's to say (gemini)

    def check_memory(self, plan: Plan, result: SimResult) -> str | None:
        # The loop asks again after every event; a result already folded in changes nothing.
        if self._checked is not None and self._checked[0] is result:
            return self._checked[1]
        extra = None
        if self.extra_memory is not None:
            extra, host = self.extra_memory(plan)
            self.peak_host = max(self.peak_host, host)
        problem = self._check_memory(result, extra, plan)
        self._checked = (result, problem)
        return problem

    def _check_memory(self, result: SimResult, extra: dict | None = None, plan: Plan | None = None) -> str | None:
        if not extra and isinstance(result, RenamedResult) and self._fold_renamed(result):
            return None
        workers, peaks = _peak_columns(result)
        if extra:
            peaks = [peak + extra.get(w, 0.0) for w, peak in zip(workers, peaks)]
        # kept[w] = max(kept.get(w, 0.0), peak), in bulk (16,384 workers a plan at scale):
        # workers seen for the first time go last, in order, then every peak above its kept one
        kept = self._peak
        if min(peaks, default=0.0) <= 0.0 and not all(map(kept.__contains__, workers)):  # (else all go in below)
            kept.update((w, peak if peak > 0.0 else 0.0) for w, peak in zip(workers, peaks) if w not in kept)
        kept.update(compress(zip(workers, peaks), map(gt, peaks, map(kept.get, workers, repeat(0.0)))))
        peak = max(peaks)
        if peak <= self.ctx.cost_model.memory_bytes:
            return None
        worker = workers[peaks.index(peak)]  # the first at the peak, as max(key=) picks
        act = result.peak_activation_bytes[worker]
        hw = self.ctx.hardware
        kept_extra = (extra or {}).get(worker, 0.0)
        more = f" + the strategy's own {kept_extra / 1e9:.1f} GB" if kept_extra else ""
        parts = (f"weights, gradients and Adam state {(peak - act - kept_extra) / 1e9:.1f} GB{more} + stashed "
                 f"activations {act / 1e9:.1f} GB")
        if self.describe_memory is not None and plan is not None:
            parts = self.describe_memory(plan, worker, peak)
        return (f"out of memory: worker {worker} needs {peak / 1e9:.1f} GB ({parts}) but hardware={hw.name} has "
                f"{hw.memory_gb:g} GB; raise cluster.pp, lower train.microbatch_size or pick a larger GPU")

    def _fold_renamed(self, result: RenamedResult) -> bool:
        """Fold the peaks of a plan that times out as a renamed reference (ReCycle: one per
        failure at scale) without a pass over its workers; True when done and every peak fits.
        Its worker w peaks as the reference's worker renamed.get(w, w), and a kept peak only
        grows, so a worker named as itself needs folding once per reference, and a renamed
        one once per (worker, reference worker) pair. False (nothing changed; the per-worker
        path decides) when some reference worker has no kept peak yet (the order in which
        workers are first kept is the plan's) or some reference peak exceeds the memory."""
        known = self._renamings
        if known is None or known.reference is not result.reference:
            peak_of = result.reference.peak_memory_bytes
            if not self._peak.keys() >= peak_of.keys():
                return False
            known = self._renamings = _Renamings(result.reference, peak_of, max(peak_of.values(), default=0.0))
        if known.top > self.ctx.cost_model.memory_bytes:
            return False
        renamed = result.renamed
        own = list(known.unfolded - result.absent - renamed.keys())
        _fold(self._peak, own, list(map(known.peak_of.__getitem__, own)))
        known.unfolded.difference_update(own)
        pairs = list(renamed.items() - known.pairs)
        _fold(self._peak, list(map(_first, pairs)), list(map(known.peak_of.__getitem__, map(_second, pairs))))
        known.pairs.update(pairs)
        return True

    def peak_memory(self) -> dict[int, float]:
        return dict(self._peak)

    def finish(self) -> None:
        pass


class _Renamings:
    """A reference result's peaks (per worker, and the largest), with what is folded into
    the kept peaks already: its workers not yet folded as themselves, and the (worker,
    reference worker) pairs folded."""

    def __init__(self, reference: SimResult, peak_of: dict[int, float], top: float):
        self.reference, self.peak_of, self.top = reference, peak_of, top
        self.unfolded: set[int] = set(peak_of)
        self.pairs: set[tuple[int, int]] = set()


def _fold(kept: dict, workers: list, peaks: list) -> None:
    """kept[w] = peak where the peak is above it, for workers kept already (in bulk)."""
    kept.update(compress(zip(workers, peaks), map(gt, peaks, map(kept.__getitem__, workers))))


_first, _second = itemgetter(0), itemgetter(1)


def _peak_columns(result: SimResult) -> tuple[list[int], list[float]]:
    """(workers, their peak bytes) of a result, in its order (a grid's result has them without
    making its dict: ftbench.sim.grid.GridResult)."""
    columns = getattr(result, "peak_columns", None)
    if columns is not None:
        return columns()
    peaks = result.peak_memory_bytes
    return list(peaks), list(peaks.values())
