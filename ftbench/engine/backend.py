"""The `local` backend: every worker in this process, real tensors, recovery done for real.

It adapts `LocalEngine` (the workers' state) to the run loop's protocol (ftbench.loop):
whole iterations, a failure cut at the resolved ops, and the recovery actions performed for
real: replacements waited for, processes "restarted" (all state rebuilt from the initial
weights), checkpoint files written and read, state copied from peers.
"""
from __future__ import annotations

import time

from ftbench.actions import (MEMORY, LoadFromHost, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint, SaveCheckpoint,
                             SyncFromPeers, UndoSteps, WaitForReplacement)
from ftbench.engine.local import LocalEngine
from ftbench.plan import Plan
from ftbench.recovery_costs import SaveCost


class LocalBackend:
    jumps = False
    cuts_ops = True

    def __init__(self, engine: LocalEngine, realtime: bool = True, restart_s: float = 0.0):
        self.engine = engine
        self.realtime = realtime  # wall clock: a replacement is really waited for
        self.restart_s = restart_s  # hardware.restart_s: what a process restart takes
        # One process cannot restart itself: a RestartJob rebuilds every worker in place (model,
        # optimizer; the data position follows the iteration). On a measured profile (`ftbench
        # calibrate`: a real process restart on this machine) the wall clock is charged the rest
        # of it, restart_s less the rebuild: the seconds the last perform charged (RunLoop.now).
        self.charged = 0.0
        self._measured_persist = False

    def start(self, plan: Plan) -> None:
        self.engine.build(plan)

    def run_iteration(self, plan: Plan, iteration: int) -> float:
        self._use(plan)
        return self.engine.run_iteration(iteration).loss

    def iteration_time(self, plan: Plan, iteration: int, measured: float) -> float:
        return measured  # one process: its own measurement

    def strike(self, plan: Plan, iteration: int, completed: frozenset, dead_workers: list[int]) -> int:
        """The completed ops run (optimizer steps among them), the dead workers lose their
        state, and the survivors abandon the iteration, undoing the steps they took in it;
        the replicas undone."""
        self._use(plan)
        if completed:
            self.engine.run_iteration(iteration, completed=completed)
        self.engine.destroy(dead_workers)
        return self.engine.abandon_iteration()

    def perform(self, actions, old: Plan, new: Plan, iteration: int) -> int | None:
        engine, restored = self.engine, None
        self.charged = 0.0
        for action in actions:
            if isinstance(action, WaitForReplacement):
                if self.realtime:
                    time.sleep(action.seconds)
            elif isinstance(action, RestartJob):
                started = time.perf_counter()
                engine.build(new)
                if self.realtime:
                    self.charged += max(0.0, self.restart_s - (time.perf_counter() - started))
            elif isinstance(action, RestoreCheckpoint):
                restored = engine.restore(action.source, new)
                if action.source == MEMORY:
                    # What a worker restored is its commit now: a worker that took another
                    # stage in a reshape would otherwise hold none until the next commit.
                    engine.save(restored, MEMORY)
            elif isinstance(action, SyncFromPeers):
                engine.copy_replicas(action.copies, new)
            elif isinstance(action, ReplayLogs):
                engine.adopt(new)  # the replacements' workers, fresh until the checkpoint loads
                engine.replay(action.workers, action.since, action.until, max(len(action.helpers), 1))
            elif isinstance(action, UndoSteps):
                pass  # done when the failure struck (LocalEngine.abandon_iteration)
            elif isinstance(action, Rendezvous):
                pass  # one process: no communicators to rebuild (the modelled clock charges hardware.rendezvous_s)
            elif isinstance(action, LoadFromHost):
                pass  # the replica is in this process's memory already (the modelled clock charges the host link)
            elif isinstance(action, SaveCheckpoint):
                engine.save(iteration, action.mode)
                if engine.store is not None:
                    engine.store.wait()  # a restart must not begin before the files are complete
            else:
                raise TypeError(f"the local backend cannot perform {action!r}")
        self._use(new)
        return restored

    def _use(self, plan: Plan) -> None:
        if self.engine.plan is not plan:
            self.engine.adopt(plan)

    def save(self, plan: Plan, iteration: int, mode: str) -> SaveCost:
        self._use(plan)
        cost = self.engine.save(iteration, mode)
        store = self.engine.store
        if not self._measured_persist and store is not None and store.pending is not None:
            cost.persist_s = store.wait().seconds  # measure the background persist once, for tuning
            self._measured_persist = True
        return SaveCost(cost.stall_s, cost.persist_s)

    def drop_checkpoints(self, iterations) -> None:
        if self.engine.store is not None:
            self.engine.store.discard_after_persist(iterations)

    def lose_unfinished_persist(self) -> None:
        self.engine.lose_unfinished_persist()

    def check_memory(self, plan, timeline) -> None:
        return None  # check_fits_host refused, before the run, what this machine cannot hold

    def peak_memory(self) -> dict[int, float]:
        return dict(self.engine.peak_memory)

    def finish(self) -> None:
        if self.engine.store is not None:
            self.engine.store.wait()
        if self.engine.boundary_log is not None:
            self.engine.boundary_log.wait()
