"""The `local` backend: every worker in this process, real tensors, recovery done for real.

It adapts `LocalEngine` (the workers' state) to the run loop's protocol (ftbench.loop):
whole iterations, a failure cut at the resolved ops, and the recovery actions performed for
real: replacements waited for, processes "restarted" (all state rebuilt from the initial
weights), checkpoint files written and read, state copied from peers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ftbench.actions import (MEMORY, LoadFromHost, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint, SaveCheckpoint,
                             SyncFromPeers, UndoSteps, WaitForReplacement, performer)
from ftbench.engine.local import LocalEngine
from ftbench.plan import Plan
from ftbench.recovery_costs import SaveCost


@dataclass
class Performing:
    """A recovery in progress: its plans and iteration, and the iteration a restore went back to."""
    old: Plan
    new: Plan
    iteration: int
    restored: int | None = None


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

    def finish_without(self, plan: Plan, iteration: int, finishing: frozenset, dead_workers: list[int],
                       touched: frozenset) -> float:
        """The pipelines a failure leaves alone finish the iteration and its sync; their loss
        (LocalEngine.finish_without)."""
        self._use(plan)
        return self.engine.finish_without(iteration, finishing, dead_workers, touched)

    def perform(self, actions, old: Plan, new: Plan, iteration: int) -> int | None:
        """The recovery actions, one after the other, each by its method (ftbench.actions.PERFORMERS);
        the iteration a restore went back to, or None."""
        self.charged = 0.0
        recovery = Performing(old, new, iteration)
        for action in actions:
            performer(self, action, "local")(action, recovery)
        self._use(new)
        return recovery.restored

    # -- the recovery actions (ftbench.actions.PERFORMERS) ----------------------------------
    def wait_for_replacement(self, action: WaitForReplacement, recovery: Performing) -> None:
        if self.realtime:
            time.sleep(action.seconds)

    def restart_job(self, action: RestartJob, recovery: Performing) -> None:
        started = time.perf_counter()
        self.engine.build(recovery.new)
        if self.realtime:
            self.charged += max(0.0, self.restart_s - (time.perf_counter() - started))

    def restore_checkpoint(self, action: RestoreCheckpoint, recovery: Performing) -> None:
        recovery.restored = self.engine.restore(action.source, recovery.new)
        self.engine.forget_newer(recovery.restored, writer=True)
        if action.source == MEMORY:
            # What a worker restored is its commit now: a worker that took another
            # stage in a reshape would otherwise hold none until the next commit.
            self.engine.save(recovery.restored, MEMORY)

    def sync_from_peers(self, action: SyncFromPeers, recovery: Performing) -> None:
        self.engine.copy_replicas(action.copies, recovery.new)

    def replay_logs(self, action: ReplayLogs, recovery: Performing) -> None:
        self.engine.adopt(recovery.new)  # the replacements' workers, fresh until the checkpoint loads
        self.engine.replay(action.workers, action.since, action.until, max(len(action.helpers), 1))

    def undo_steps(self, action: UndoSteps, recovery: Performing) -> None:
        pass  # done when the failure struck (EngineState.abandon_iteration)

    def rendezvous(self, action: Rendezvous, recovery: Performing) -> None:
        pass  # one process: no communicators to rebuild (the modelled clock charges hardware.rendezvous_s)

    def load_from_host(self, action: LoadFromHost, recovery: Performing) -> None:
        pass  # the replica is in this process's memory already (the modelled clock charges the host link)

    def save_checkpoint(self, action: SaveCheckpoint, recovery: Performing) -> None:
        self.engine.save(recovery.iteration, action.mode)
        if self.engine.store is not None:
            self.engine.store.wait()  # a restart must not begin before the files are complete

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

    def lose_host_memory(self, node: int) -> None:
        if self.engine.host_memory is not None:
            self.engine.host_memory.lose(node)

    def check_memory(self, plan, timeline) -> None:
        return None  # check_fits_host refused, before the run, what this machine cannot hold

    def peak_memory(self) -> dict[int, float]:
        return dict(self.engine.peak_memory)

    def finish(self) -> None:
        if self.engine.store is not None:
            self.engine.store.wait()
        if self.engine.boundary_log is not None:
            self.engine.boundary_log.wait()
