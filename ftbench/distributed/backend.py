"""The `dist` backend in one process: the run loop's `Backend` protocol for one rank.

`DistBackend` adapts the engine to the run loop's `Backend` protocol (ftbench.loop): real
kills at the resolved failure point, detection and agreement among the survivors, and the
strategies' recovery actions performed between processes. It holds no strategy logic.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ftbench.actions import (FILE, HOST, MEMORY, SNAPSHOT, LoadFromHost, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint,
                             SaveCheckpoint, SyncFromPeers, UndoSteps, WaitForReplacement, leading_saves,
                             performer)
from ftbench.distributed.engine import DistEngine
from ftbench.distributed.faults import die, dies_in_recovery, dies_in_save, stall_here
from ftbench.distributed.membership import log
from ftbench.distributed.protocol import LATEST, RESTART_EXIT, exit_now
from ftbench.distributed.transport import (DistAbort, DistError, UnannouncedDeath, WaitFailed, describe_error,
                                           plan_crc)
from ftbench.recovery_costs import SaveCost
from ftbench.schedule import OPT

AGREED = (WaitForReplacement, Rendezvous)  # done in a recovery's first attempt, not again after a death
MOVE_NO_STATE = (WaitForReplacement, Rendezvous, UndoSteps)  # backend.kill=RANK:K:recovery dies at another


@dataclass
class Performing:
    """A recovery in progress (DistBackend._perform): its plans and iteration, the phases
    measured so far, the pending record, the deaths that interrupted it and the time they
    cost; the action at hand (index, start); the iteration a restore went back to."""
    old: object
    new: object
    iteration: int
    phases: dict
    pending: dict | None
    lost: list | tuple
    wasted: float
    index: int = 0
    started: float = 0.0
    restored: int | None = None


def _death(store, dead) -> float:
    """When the first of `dead` died: its last heartbeat (wall clock)."""
    from ftbench.distributed.membership import last_beat_s

    return min(last_beat_s(store, sorted(dead)).values())


def _phases(rank: int, death: float, detected: float, agreed: float, regrouped: float) -> dict:
    """Survivor `rank`'s recovery phases, measured from the death (wall-clock times): until it
    knew who died, until the survivors agreed, until its new groups were built."""
    return {"detection_s": detected - death, "agreement_s": agreed - detected, "new_group_s": regrouped - agreed,
            "death_to_regroup_s": regrouped - death, "rank": rank}


def _lost_nodes(records: list[dict]) -> list[int]:
    """The nodes of `_lose`'s records (one node, or a list of them, each)."""
    return sorted({n for r in records for n in (r["node"] if isinstance(r["node"], list) else [r["node"]])})


class DistBackend:
    """The run loop's Backend protocol for one rank of a dist job. Every rank runs the same
    loop and calls these methods at the same points, so collectives here line up.

    A failure (`strike`) is real: every process of the failed node runs its ops up to the
    resolved point and SIGKILLs itself; the survivors (standbys included) detect the deaths
    through the store's heartbeats, agree on them and continue in a new process group
    (ftbench.distributed.membership). Recovery actions are then performed for real: a standby's
    processes take over a replaced node's workers, a restart rebuilds every worker's state
    from the initial weights in place, checkpoints are read from the shared run folder, state
    is copied between processes, and Swift's lost stages are replayed from the checkpoint on
    the boundary logs the other ranks wrote to the shared run folder (DistEngine.replay). Each
    recovery's measured phases are kept for the summary."""

    jumps = False
    cuts_ops = True

    def __init__(self, engine: DistEngine, gpus_per_node: int = 1, active_nodes: int | None = None,
                 membership_store=None, realtime: bool = True, recover: bool = False, stall=None):
        self.engine = engine
        self.stall = stall  # backend.stall: (rank, iteration, seconds) where this job's chaos test pauses
        self.recover = recover  # backend.unannounced=recover (with the membership store)
        self._measured_persist = False
        self._peaks: dict[int, float] = {}
        t = engine.transport
        g = max(1, gpus_per_node)
        self.g = g
        self.node_of_rank = {r: r // g for r in range(t.world)}
        nodes = t.world // g
        active = nodes if active_nodes is None else active_nodes
        self.standbys = list(range(active, nodes))  # nodes whose processes wait to replace a failed one
        self.store = membership_store
        self.realtime = realtime
        self.recoveries: list[dict] = []  # measured phases, one per recovery
        self._pending: dict | None = None
        self._first_after: dict | None = None
        self.log_stats: dict = {}  # Swift's boundary log over the job (finish): log_peak_bytes, log_files
        # (folder, ftbench.journal.Journal): set when the launcher starts new processes after
        # these end (RestartJob); None: a restart rebuilds every worker in place
        self.relaunch = None
        self.restarts = 0  # the job's restarts so far (processes ended and started again)
        self._resumed: dict | None = None  # a restarted process: how its relaunch went, until the recovery uses it

    def start(self, plan) -> None:
        self.engine.build(plan)

    def run_iteration(self, plan, iteration: int) -> float:
        started = time.perf_counter()
        try:
            loss = self.engine.run_iteration(plan, iteration)
        except (DistError, RuntimeError) as err:  # a wait that ended badly: did a process die?
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration)  # raises FailuresDiscovered, or the error
        if self._first_after is not None:
            self._first_after["first_iteration_s"] = time.perf_counter() - started
            self._first_after = None
        return loss

    def iteration_time(self, plan, iteration: int, measured: float) -> float:
        """The leader's measured iteration time, on every rank: each run loop then takes the
        same checkpoint interval from it. A process that dies meanwhile is found as in a save."""
        try:
            return self.engine.transport.all_gather_objects(measured, "share the measured iteration time")[0]
        except (DistError, RuntimeError) as err:
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration, roll_back=False)  # raises FailuresDiscovered, or the error
            raise

    def strike(self, plan, iteration, completed, dead_workers) -> None:
        node, victims = self._cut(plan, iteration, completed, dead_workers)
        undone = self.engine.abandon_iteration()  # survivors that stepped go back to the iteration's start
        self._regroup(node, victims, iteration)
        if not any(op.kind == OPT for op in completed):
            return 0  # nothing stepped: no rank undid anything (and no sum to wait for)
        return self._job_undone(undone, f"the failure in iteration {iteration}")

    def finish_without(self, plan, iteration, finishing, dead_workers, touched) -> float:
        """RunLoop._finish_without on dist: every rank runs its ops in `finishing` (the failed
        node's then die, the pipelines it does not touch run to their end), the survivors
        regroup, and the untouched pipelines end the iteration, its sync among themselves
        (DistEngine.finish_without). A death found meanwhile rolls the iteration back
        (FailuresDiscovered), as in any iteration."""
        node, victims = self._cut(plan, iteration, finishing, dead_workers)
        self._regroup(node, victims, iteration)
        try:
            return self.engine.finish_without(plan, iteration, touched)
        except (DistError, RuntimeError) as err:  # a wait that ended badly: did a process die?
            self._unannounced(err, plan, iteration)  # raises FailuresDiscovered, or the error
            raise

    def _cut(self, plan, iteration: int, completed: frozenset, dead_workers) -> tuple[int, set]:
        """The scripted failure of the node of `dead_workers`: every rank runs its ops in
        `completed`, then the node's processes die. (the node, its ranks)"""
        engine, t = self.engine, self.engine.transport
        if self.store is None:
            raise DistError("failures on backend=dist need the job's store (the launcher's per-node layout)")
        if engine.plan is not plan:
            engine.adopt(plan)
        node = plan.node_of[dead_workers[0]]
        victims = {r for r, n in self.node_of_rank.items() if n == node and r in t.alive}
        if completed:
            engine.run_iteration(plan, iteration, completed=completed)
        if t.rank in victims:
            die("its node fails here (the failure script): every process of it")
        return node, victims

    def _regroup(self, node: int, victims: set, iteration: int) -> None:
        """The survivors find the dead, agree on them and regroup without them; the measured
        phases wait for the recovery (`_pending`)."""
        from ftbench.distributed.membership import Fenced, MembershipError, agree, detect

        t = self.engine.transport
        try:
            dead, _ = detect(self.store, t.alive, t.timeout_s)
            detected = time.time()
            if dead != victims:
                raise MembershipError(f"node {node} failed (ranks {sorted(victims)}), but the dead ranks are "
                                      f"{sorted(dead)}")
            survivors = [r for r in t.alive if r not in dead]
            agree(self.store, t.epoch + 1, t.rank, survivors, dead, t.timeout_s)
        except Fenced as err:
            die(str(err))
        except MembershipError as err:
            raise DistError(f"rank {t.rank}: {err}") from None
        agreed = time.time()
        death = _death(self.store, dead)
        t.regroup(survivors)
        for r in dead:
            del self.node_of_rank[r]
        phases = self._slowest(_phases(t.rank, death, detected, agreed, time.time()))
        self._pending = {"iteration": iteration, "node": node, "dead_ranks": sorted(dead), **phases}

    def _slowest(self, phases: dict) -> dict:
        """The phases of the survivor that regrouped last after a death (every survivor calls
        this in the new group, and all keep the same): the job recovered when it had."""
        everyone = self.engine.transport.all_gather_objects(phases, "share the measured recovery phases")
        return max(everyone, key=lambda p: p["death_to_regroup_s"])

    def _job_undone(self, undone: int, where: str) -> int:
        """The survivors' undone steps summed (every survivor calls it, in the new group): the
        job's count, as the local backend has it, kept by every rank (DistEngine.undone)."""
        engine = self.engine
        total = torch.tensor([float(undone)], dtype=torch.float64, device=engine.device)
        engine.transport.all_sum(total, f"count the optimizer steps undone after {where}")
        engine.undone += int(total.item())
        return int(total.item())

    def _unannounced(self, err: BaseException, plan, iteration: int, roll_back: bool = True) -> None:
        """A wait of iteration `iteration` failed. If processes died (a crash no failure script
        announced), their nodes fail: the node's other processes stop too, the survivors agree
        on the dead, roll their replicas back to the iteration's start (backend.unannounced=
        recover) and raise FailuresDiscovered for the run loop, which asks the strategy as for
        a failure at that iteration's start. Else, or with unannounced=stop, the error stands.
        `roll_back=False`: the wait was outside an iteration (a checkpoint), whose state stands."""
        from ftbench.loop import FailuresDiscovered

        undone = []
        nodes, record = self._lose(err, f"iteration {iteration}",
                                   (lambda: undone.append(self.engine.roll_back())) if roll_back else None)
        if roll_back:
            record["undone"] = self._job_undone(undone[0], f"the unannounced death in iteration {iteration}")
        self._pending = {"iteration": iteration, **record}
        raise FailuresDiscovered(nodes, f"ranks {record['dead_ranks']} stopped beating ({type(err).__name__})")

    def _lose(self, err: BaseException, where: str, before_regroup=None) -> tuple[list[int], dict]:
        """A wait failed in `where`: find who died (else `err` stands), stop the rest of their
        nodes, agree among the survivors, call `before_regroup`, and continue in a new process
        group without them. (the dead nodes, the measured phases)."""
        from ftbench.distributed.membership import QUIET_S, Fenced, MembershipError, aborted, agree, detect

        t = self.engine.transport
        log.info("a wait failed in %s: %s", where, describe_error(err))
        t.abandon(f"rank {t.rank} in {where}: {describe_error(err)}")  # the others stop waiting too
        try:
            # Everyone's waits end within seconds (the alarm), so every survivor looks for the
            # dead at about the same time; nobody dead: the wait's own error stands. The
            # silence the failed wait already watched counts.
            seen = t.liveness.observed() if t.liveness is not None else None
            dead, _ = detect(self.store, t.alive, t.timeout_s, observed=seen, quiet_s=QUIET_S)
        except MembershipError:
            raise err from None
        detected = time.time()
        stopped = aborted(self.store, sorted(dead))
        if stopped:  # they did not fail: they ended the job with an error, which stands here too
            raise DistAbort(f"rank {t.rank}: " + "; ".join(f"rank {r} stopped the job: {why}"
                                                           for r, why in stopped.items())) from None
        nodes = sorted({self.node_of_rank[r] for r in dead})
        if not self.recover:
            raise UnannouncedDeath(f"rank {t.rank}: ranks {sorted(dead)} (nodes {nodes}) died in {where}, "
                                   "and no failure was scripted there (backend.unannounced=stop)") from None
        death = _death(self.store, dead)  # the first death: the rest of its node may die later
        victims = {r for r, n in self.node_of_rank.items() if n in nodes and r in t.alive}
        if t.rank in victims:
            die("a process of its node died: the node fails whole")
        try:
            while victims - dead:  # the rest of those nodes stops once it notices too
                more, _ = detect(self.store, sorted(victims - dead), 2 * t.timeout_s)
                dead = dead | more
            detected = time.time()
            survivors = [r for r in t.alive if r not in victims]
            agree(self.store, t.epoch + 1, t.rank, survivors, victims, 3 * t.timeout_s)
        except Fenced as error:
            die(str(error))
        except MembershipError as error:
            raise DistError(f"rank {t.rank}: {error}") from None
        agreed = time.time()
        if before_regroup is not None:
            before_regroup()
        t.regroup(survivors)
        for r in victims:
            del self.node_of_rank[r]
        phases = self._slowest(_phases(t.rank, death, detected, agreed, time.time()))
        log.info("ranks %s died; the survivors regrouped %.2f s after the death (rank %d last)", sorted(victims),
                 phases["death_to_regroup_s"], phases["rank"])
        return nodes, {"node": nodes[0] if len(nodes) == 1 else nodes, "dead_ranks": sorted(victims),
                       "unannounced": True, **phases}

    def perform(self, actions, old, new, iteration: int) -> int | None:
        """The recovery actions, measured. A death while they run (found through a failed wait,
        backend.unannounced=recover) interrupts them: the survivors agree on the dead, go back
        to the state they had before the recovery, and run it again without the dead (copies
        from them taken from another holder); the run loop is then told of the deaths
        (FailuresDiscovered, with the iteration restored), as of a failure at the next
        iteration's start: the recovery completes, then the next failure strikes, as `sim`
        has it for a failure that falls during a recovery."""
        log.info("recovery at iteration %d: %s onto plan %s (crc %08x)", iteration,
                 [type(a).__name__ for a in actions], new.name, plan_crc(new))
        self.stall = stall_here(self.stall, self.engine.rank, iteration)  # once: a straggler, beating all along
        if self.store is None or not self.recover or not actions:
            return self._perform(actions, old, new, iteration, {}, self._pending)
        return self._perform_again_if_interrupted(actions, old, new, iteration)

    def perform_resumed(self, resume: dict, actions, old, new, iteration: int) -> int | None:
        """In the processes started again after a RestartJob: the recovery it interrupted goes on
        from the restart (this process builds every worker's state from the initial weights)
        with what had been done and measured before the processes ended."""
        carried = resume["call_state"]
        first = resume["action"]
        if self.store is None or not self.recover:
            return self._perform(actions, old, new, iteration, carried["phases"], carried["pending"], first=first)
        return self._perform_again_if_interrupted(actions, old, new, iteration, carried, first)

    def _perform_again_if_interrupted(self, actions, old, new, iteration: int, carried: dict | None = None,
                                      first: int = 0) -> int | None:
        from ftbench.loop import FailuresDiscovered

        carried = carried or {"phases": {}, "pending": self._pending, "lost": [], "wasted": 0.0}
        kept, phases, pending = self.engine.keep(), carried["phases"], carried["pending"]
        lost, wasted = carried["lost"], carried["wasted"]
        while True:
            started = time.perf_counter()
            try:
                restored = self._perform(actions, old, new, iteration, phases, pending, lost=lost, first=first,
                                         wasted=wasted)
                break
            except (WaitFailed, RuntimeError) as err:  # a wait failed (other errors stand)
                wasted += time.perf_counter() - started  # until a wait failed: a few seconds (watched waits)
                try:
                    nodes, record = self._lose(err, f"the recovery at iteration {iteration}")
                except DistError as standing:  # nobody died: the job stops here, not as this rank's result
                    raise DistAbort(str(standing)) from None
                lost.append(record)
                self.engine.revert(kept)
                log.info("the recovery at iteration %d runs again without ranks %s", iteration, record["dead_ranks"])
        if not lost:
            return restored
        self.recoveries[-1].update(interrupted_by=[r["dead_ranks"] for r in lost], interrupted_s=wasted)
        self._first_after = None  # the next iteration runs after the recovery from these deaths
        merged = {"iteration": iteration, **lost[-1], "dead_ranks": sorted(r for x in lost for r in x["dead_ranks"]),
                  "detection_s": sum(x["detection_s"] for x in lost),
                  "agreement_s": sum(x["agreement_s"] for x in lost),
                  "new_group_s": sum(x["new_group_s"] for x in lost),
                  "death_to_regroup_s": sum(x["death_to_regroup_s"] for x in lost), "during_recovery": True}
        self._pending = merged
        raise FailuresDiscovered(_lost_nodes(lost), f"ranks {merged['dead_ranks']} stopped beating during the recovery",
                                 restored=restored)

    def _perform(self, actions, old, new, iteration: int, phases: dict, pending, lost=(), first: int = 0,
                 wasted: float = 0.0) -> int | None:
        from ftbench.recovery_costs import action_seconds

        engine = self.engine
        recovery = Performing(old, new, iteration, phases, pending, lost, wasted)
        # replacements and returning nodes alike; not the nodes that died in this recovery (the
        # strategy decides about them next), after the saves that lead the recovery (the
        # survivors' own, before a standby takes a failed node's ranks); at once in processes
        # started again after a restart
        place_at = 0 if first else leading_saves(actions)
        dies = dies_in_recovery(self.engine.kill, self.engine.rank, iteration)
        for index, action in enumerate(actions):
            if index == place_at:
                self._place(new, skip=set(_lost_nodes(lost)))
            if index < first:
                continue  # done before the processes restarted
            started = time.perf_counter()
            if isinstance(action, AGREED) and lost:
                continue  # waited for, or agreed, in the interrupted attempt
            if dies and not isinstance(action, MOVE_NO_STATE):
                die("backend.kill=RANK:ITERATION:recovery, as the recovery moves state")
            perform = performer(self, action, "dist")
            recovery.index, recovery.started = index, started
            name = perform(action, recovery)
            if name is not None:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
        if dies:
            die("backend.kill=RANK:ITERATION:recovery, at the end (no action moved state)")
        if place_at == len(actions):  # no action, or saves alone
            self._place(new, skip=set(_lost_nodes(lost)))
        engine.adopt(new)
        if actions:  # every live rank completed it, or none goes on (a death meanwhile interrupts it)
            engine.transport.all_sum(torch.zeros(1, dtype=torch.float64, device=engine.device),
                                     f"finish the recovery at iteration {iteration} with every rank")
            record = dict(pending or {"iteration": iteration})
            record.update(phases)
            record["actions"] = [type(a).__name__ for a in actions]
            record["predicted_actions_s"] = sum(action_seconds(a, old, new, engine.ctx.cost_model) for a in actions)
            self.recoveries.append(record)
            self._first_after = record
        self._pending = None
        return recovery.restored

    # -- the recovery actions (ftbench.actions.PERFORMERS): each returns the phase it is measured in
    def wait_for_replacement(self, action: WaitForReplacement, recovery: Performing) -> str:
        if self.realtime and action.seconds:
            time.sleep(action.seconds)
        return "replacement_s"

    def restart_job(self, action: RestartJob, recovery: Performing) -> str | None:
        if self.relaunch is not None and self._resumed is None:
            # every process of the job ends here; the launcher starts new ones, which go on below
            self._end_for_restart(recovery.index, recovery.iteration, recovery.phases, recovery.pending,
                                  list(recovery.lost), recovery.wasted)
        self.engine.build(recovery.new)  # every worker's state from the initial weights
        if self._resumed is not None:  # in the new processes: the restart's phases, measured
            recovery.phases.update(self._relaunched(time.perf_counter() - recovery.started))
            return None
        return "restart_s"

    def restore_checkpoint(self, action: RestoreCheckpoint, recovery: Performing) -> str:
        recovery.restored = self.engine.restore(action.source, recovery.new)
        self.engine.forget_newer(recovery.restored, writer=self.engine.rank == self.engine.transport.leader)
        if action.source == MEMORY:
            self.engine.commit(recovery.restored)  # what a worker restored is its commit now (as on local)
        return "state_transfer_s"

    def sync_from_peers(self, action: SyncFromPeers, recovery: Performing) -> str:
        self.engine.copy_replicas(action.copies, recovery.new)
        return "state_transfer_s"

    def replay_logs(self, action: ReplayLogs, recovery: Performing) -> str:
        self.engine.replay(recovery.new, action.workers, action.since, action.until, max(len(action.helpers), 1))
        return "replay_s"

    def undo_steps(self, action: UndoSteps, recovery: Performing) -> str:
        return "undo_s"  # done when the failure struck (EngineState.abandon_iteration)

    def rendezvous(self, action: Rendezvous, recovery: Performing) -> str:
        return "rendezvous_s"  # the group of the survivors was built when they agreed

    def load_from_host(self, action: LoadFromHost, recovery: Performing) -> str:
        return "state_transfer_s"  # the replica is in the worker's memory already (the model charges it)

    def save_checkpoint(self, action: SaveCheckpoint, recovery: Performing) -> str:
        engine = self.engine
        self._save(recovery.old, recovery.iteration, action.mode)  # a death here interrupts the recovery
        if engine.store is not None and engine.rank == engine.transport.leader:
            engine.store.wait()  # a restart must not begin before the files are complete
        return "checkpoint_s"

    def _end_for_restart(self, action: int, iteration: int, phases: dict, pending, lost: list,
                         wasted: float) -> None:
        """RestartJob with the launcher's restarts: every live rank gets here; the leader writes
        the run loop's journal and what this recovery has done so far, then every process
        ends (RESTART_EXIT) and the launcher starts new ones on the nodes still up, which go on
        from the journal (ftbench.journal). A death before the journal is complete interrupts
        the recovery as any death during one does."""
        folder, journal = self.relaunch
        engine, t = self.engine, self.engine.transport
        begun = time.time()
        pids = t.all_gather_objects(os.getpid(), f"reach the restart of the job at iteration {iteration}")
        if engine.rank == t.leader:
            if engine.store is not None:
                engine.store.wait()  # a persist in flight completes before the processes end (as in place)
            state = {"ranks": list(t.alive), "epoch": t.epoch, "restarts": self.restarts + 1,
                     "worker_rank": dict(t.worker_rank), "node_of_rank": dict(self.node_of_rank),
                     "standbys": list(self.standbys), "recoveries": self.recoveries, "undone": engine.undone,
                     "measured_persist": self._measured_persist, "stall": self.stall, "kill": engine.kill,
                     "begun": begun, "pids": pids}
            call_state = {"phases": dict(phases), "pending": pending, "lost": lost, "wasted": wasted}
            path = journal.write(folder / f"journal-{self.restarts + 1}", {"call": "perform", "action": action,
                                                                            "state": state, "call_state": call_state})
            if self.store is not None:  # where processes that torchrun starts again find it
                self.store.set(LATEST, str(path))
        t.all_sum(torch.zeros(1, dtype=torch.float64, device=engine.device),
                  f"wait for the restart journal of iteration {iteration}")
        log.info("ends for the restart of the job at iteration %d (restart %d)", iteration, self.restarts + 1)
        exit_now(RESTART_EXIT)

    def resume_state(self, state: dict, entered: float) -> None:
        """A process started again after a RestartJob: the backend's state as the journal kept it."""
        t = self.engine.transport
        t.worker_rank = dict(state["worker_rank"])
        self.node_of_rank, self.standbys = dict(state["node_of_rank"]), list(state["standbys"])
        self.recoveries, self._measured_persist = list(state["recoveries"]), state["measured_persist"]
        self.stall, self.engine.kill, self.engine.undone = state["stall"], state["kill"], state["undone"]
        self.restarts = state["restarts"]
        self._resumed = {"begun": state["begun"], "entered": entered, "ready": time.time(), "pids": state["pids"]}

    def _relaunched(self, rebuild_s: float) -> dict:
        """The restart's phases, from the slowest process of the job: the old processes' end
        (reaching the restart, the journal) to the new ones rebuilding every worker's state."""
        resumed, self._resumed = self._resumed, None
        now = time.time()
        mine = {"restart_s": now - resumed["begun"], "relaunch_s": resumed["entered"] - resumed["begun"],
                "process_init_s": resumed["ready"] - resumed["entered"], "rebuild_s": rebuild_s,
                "replay_journal_s": now - resumed["ready"] - rebuild_s, "pid": os.getpid()}
        key = f"restart/{self.restarts}/launched"  # when ftbench's launcher started the new agents
        if self.store is not None and self.store.check([key]):
            launched = float(self.store.get(key))
            mine.update(agents_exit_s=launched - resumed["begun"], agents_start_s=resumed["entered"] - launched)
        everyone = self.engine.transport.all_gather_objects(mine, "share the measured restart phases")
        slowest = dict(max(everyone, key=lambda p: p["restart_s"]))
        del slowest["pid"]
        # the processes that ended and those that took their place (no id in common: really restarted)
        slowest.update(processes_ended=resumed["pids"], processes_started=[p["pid"] for p in everyone])
        return slowest

    def _place(self, plan, skip=frozenset()) -> None:
        """Nodes of `plan` without live processes (a replacement, a failed node that joins
        again, or a new one) run on a standby node's processes, as a new machine's would."""
        t = self.engine.transport
        alive = set(t.alive)
        homeless = sorted({n for w, n in plan.node_of.items()
                           if t.worker_rank.get(w, w) not in alive and n not in skip})
        if homeless:
            self._take_standbys(homeless, plan)

    def _take_standbys(self, nodes, plan) -> None:
        """Each of these nodes' workers move to the processes of the next standby node."""
        t = self.engine.transport
        for node in nodes:
            workers = sorted(w for w, n in plan.node_of.items() if n == node)
            spare = next((n for n in self.standbys
                          if all(self.node_of_rank.get(n * self.g + i) == n for i in range(self.g))), None)
            if spare is None:
                raise DistError(f"node {node} needs a replacement, but no standby process is left: on backend=dist "
                                "a replacement or a returning node is a standby node's processes (raise "
                                "cluster.spares)")
            self.standbys.remove(spare)
            for i, w in enumerate(workers):
                t.worker_rank[w] = spare * self.g + i
            for i in range(self.g):
                self.node_of_rank[spare * self.g + i] = node
        t.forget_plan()  # the same plan may now run on other ranks

    def save(self, plan, iteration: int, mode: str) -> SaveCost:
        """A checkpoint: in-memory commits stay in each process; files are written by the
        leader from the writers' shards. Every rank returns the leader's measured cost, so
        every run loop makes the same decisions from it. A process that dies meanwhile is
        found as in an iteration (FailuresDiscovered), with nothing to roll back: the
        iteration before the checkpoint is complete, and a checkpoint left unfinished does
        not verify, so no restore takes it."""
        if dies_in_save(self.engine.kill, self.engine.rank, iteration):
            die("backend.kill=RANK:ITERATION:save")
        try:
            return self._save(plan, iteration, mode)
        except (DistError, RuntimeError) as err:
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration, roll_back=False)  # raises FailuresDiscovered, or the error
            raise

    def _save(self, plan, iteration: int, mode: str) -> SaveCost:
        engine = self.engine
        t = engine.transport
        if engine.plan is not plan:
            engine.adopt(plan)
        started = time.perf_counter()
        persist, stall, written = 0.0, None, False
        leader = engine.rank == t.leader
        if mode == MEMORY:
            engine.commit(iteration)
        elif mode == HOST:  # every rank's replicas to the leader, which writes each node's host memory
            mine = engine.host_shards() if engine.worker is not None else ({}, {})
            gathered = t.all_gather_objects(mine, "gather the host-memory checkpoint")
            if leader:
                shards = {k: v for part, _ in gathered for k, v in part.items()}
                home = {k: v for _, part in gathered for k, v in part.items()}
                engine.host_memory.save(iteration, shards, home, {plan.node_of[w] for w in plan.holds})
        elif mode in (FILE, SNAPSHOT):
            shards = engine.my_shards(plan) if engine.worker is not None else {}
            gathered = t.all_gather_objects(shards, "gather the checkpoint shards")
            if leader:
                merged = {k: v for part in gathered for k, v in part.items()}
                if mode == FILE:
                    written = engine.store.save(iteration, merged).skipped is None
                else:
                    engine.store.save_async(iteration, merged)  # shard() copied: that is the snapshot
                    if not self._measured_persist:  # measure the background persist once, for tuning
                        stall = time.perf_counter() - started
                        persist = engine.store.wait().seconds
            self._measured_persist = self._measured_persist or mode == SNAPSHOT
        else:
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        cost = [time.perf_counter() - started if stall is None else stall, persist, written]
        cost = t.all_gather_objects(cost, "share the checkpoint's cost")[0]  # the leader's, first in rank order
        if cost[2] and engine.boundary_log is not None:  # every rank knows the files are complete now
            self._drop_logs_before(iteration)
        return SaveCost(*cost[:2])

    def _drop_logs_before(self, iteration: int) -> None:
        """A FILE checkpoint of `iteration` is written: each rank deletes its own logs before it;
        the leader also deletes those of workers whose process died (no live BoundaryLog knows
        them), so the log on storage stays within one checkpoint interval after failures too."""
        log = self.engine.boundary_log
        log.drop_before(iteration)
        if self.engine.rank == self.engine.transport.leader:
            for path in log.folder.glob("worker*/iteration*.pt"):
                try:
                    if int(path.stem[len("iteration"):]) < iteration:
                        path.unlink(missing_ok=True)
                except ValueError:
                    continue  # not a log file of ours

    def drop_checkpoints(self, iterations) -> None:
        if self.engine.store is not None and self.engine.rank == self.engine.transport.leader:
            self.engine.store.discard_after_persist(iterations)

    def lose_unfinished_persist(self) -> None:
        """A failure kills a persist still in flight only on the failed node; the leader's
        (which wrote it) finishes unless the leader died, and then it never completes."""
        return None

    def lose_host_memory(self, node: int) -> None:
        """The failed node's host memory goes (the leader, which writes it, empties its folder)."""
        engine = self.engine
        if engine.host_memory is not None and engine.rank == engine.transport.leader:
            engine.host_memory.lose(node)

    def check_memory(self, plan, timeline) -> str | None:
        return None

    def peak_memory(self) -> dict[int, float]:
        return dict(self._peaks)

    def finish(self) -> None:
        t = self.engine.transport
        if self.engine.store is not None and self.engine.rank == t.leader:
            self.engine.store.wait()
        log = self.engine.boundary_log
        if log is not None:
            log.wait()  # every rank's files are written before the leader removes the folder (close_log)
        mine = {} if self.engine.worker is None else {self.engine.worker.id: self.engine.peak_memory}
        stats = (0, 0) if log is None else (log.peak_bytes, log.files_written)
        everyone = t.all_gather_objects((mine, stats), "gather the peak memory")
        self._peaks = {w: v for part, _ in everyone for w, v in part.items()}
        if log is not None:
            # the ranks' logs peak together (every rank seals each iteration and drops at each
            # checkpoint alike), so their sum is the folder's peak; ranks that died are missing
            self.log_stats = {"log_peak_bytes": sum(s[0] for _, s in everyone),
                              "log_files": sum(s[1] for _, s in everyone)}

    def close_log(self) -> None:
        """The run is over: the leader removes the log folder (every rank's writes ended in
        `finish`); the others only stop their writer."""
        log = self.engine.boundary_log
        if log is not None:
            log.close(remove=self.engine.rank == self.engine.transport.leader)
