"""The run loop shared by every backend.

It owns what is the same everywhere: taking events as the run reaches them
(`ftbench.events` defines when each takes effect), applying membership changes (it is the
only writer of `Cluster`; strategies see a read-only view and ask for replacements,
standbys and reshapes through their `Recovery`), asking the strategy, periodic checkpoints
and their interval, recovery and lost-work records, the time of the iterations that count
(`KeptIterations`: the run's `productive_s`, the numerator of its ETTR), and the metrics lines.
A membership change timed while a recovery runs is merged into it (`RunLoop._merge`).

A backend implements the small protocol `Backend` and holds no loop logic: `sim` jumps over
runs of identical iterations in closed form, `local` runs them one at a time.

Two clocks: the *modelled* clock (always on `sim`; on `local` with `backend.clock=model`)
advances by the cost model's iteration, checkpoint and recovery times, so the same failure
script gives the same events, plans and lost work on every backend; the *wall* clock
(`local`'s default) measures them.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from itertools import chain, compress, islice, repeat
from operator import countOf, eq
from typing import Protocol

from ftbench.actions import (FILE, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint, SaveCheckpoint,
                             WaitForReplacement, leading_saves)
from ftbench.checkpoint_schedule import Checkpoints
from ftbench.cluster import Cluster
from ftbench.errors import ReplayUnavailable, TooFewNodes, UserError
from ftbench.events import EventQueue
from ftbench.failures import ITERATION_EVENT_FRACTION, FailureEvent, FailureScript
from ftbench.journal import Journal, JournaledBackend
from ftbench.local_sgd import finishes_iteration
from ftbench.outcome import RunOutcome
from ftbench.plan import Plan, checkpoint_writers
from ftbench.recovery_costs import SaveCost, action_seconds
from ftbench.samples import IterationRuns, SamplesLedger, plan_samples, sample_ranges
from ftbench.schedule import OPT
from ftbench.sim.simulator import SimResult, ops_completed_at
from ftbench.transfers import copy_sizes

CLOCKS = ("model", "wall")  # backend.clock
# Actions by which the nodes agree on a new membership: a change that arrives while one runs
# is merged into its recovery (RunLoop._merge).
AGREEMENT = (RestartJob, Rendezvous)
# A recovery's record lists at most this many of its state copies (with their count and bytes):
# a reshape of 16,384 workers copies thousands, after each of thousands of failures.
COPIES_LISTED = 64


class Backend(Protocol):
    jumps: bool  # advances many identical iterations at once (no per-iteration work)
    cuts_ops: bool  # runs ops, so a failure must be cut at the resolved ones (sim only charges time)

    def start(self, plan: Plan) -> None:
        """Fresh state for `plan` (the initial weights)."""

    def run_iteration(self, plan: Plan, iteration: int) -> float | None:
        """Train one whole iteration of `plan`; its loss (None where nothing is computed)."""

    def finish_without(self, plan: Plan, iteration: int, finishing: frozenset, dead_workers: list[int],
                       touched: frozenset) -> float | None:
        """A failure cuts the pipelines `touched` (Strategy.finishes_local_step): the ops in
        `finishing` run (those completed when it struck, and all of the other pipelines'),
        `dead_workers` lose their state, and the others end the iteration, its sync among
        themselves; their loss."""

    def strike(self, plan: Plan, iteration: int, completed: frozenset, dead_workers: list[int]) -> int | None:
        """A failure: the ops in `completed` of `iteration` have run (optimizer steps among
        them), then `dead_workers` lose all their state and survivors drop the iteration in
        flight, undoing the optimizer steps they took in it (ftbench.engine.undo). The number
        of replicas whose step was undone (None where no state is held: sim)."""

    def perform(self, actions: list, old: Plan, new: Plan, iteration: int) -> int | None:
        """Carry out recovery actions and continue with `new`; the iteration restored to (None:
        no rollback)."""

    def save(self, plan: Plan, iteration: int, mode: str) -> SaveCost | None:
        """A periodic checkpoint after `iteration` iterations; its measured cost, if measured."""

    def iteration_time(self, plan: Plan, iteration: int, measured: float) -> float:
        """Wall clock: the iteration time the run loop's decisions take (the checkpoint
        interval), from this process's `measured` one: the same on every process (dist: the
        leader's)."""

    def drop_checkpoints(self, iterations: list[int]) -> None:
        """These checkpoints were not durable when a failure struck: they are gone."""

    def lose_unfinished_persist(self) -> None:
        """Wall clock: a background persist still running when a failure strikes is lost."""

    def lose_host_memory(self, node: int) -> None:
        """`node` failed: the HOST tier's checkpoints in its host memory are gone."""

    def check_memory(self, plan: Plan, timeline: SimResult) -> str | None:
        """None when `plan` fits the workers' memory, else why not (an `oom` result)."""

    def peak_memory(self) -> dict[int, float]:
        """Peak bytes per worker over the run."""

    def finish(self) -> None:
        """The run is over: wait for anything still in the background."""


def shared_cores_iteration(timeline: SimResult, cores: int | None) -> float:
    """The iteration a plan's timeline gives, where its workers share `cores` cores
    (`hardware.cores`: a job on one machine, `local` being one process): no machine does more
    than its cores at once, so at least the workers' busy time over the cores."""
    if not cores:
        return timeline.iteration_time
    return max(timeline.iteration_time, sum(timeline.busy.values()) / cores)


class FailuresDiscovered(Exception):
    """Raised by a backend's run_iteration: `nodes` died during the iteration in flight without
    any failure script announcing it (a real crash), nothing of that iteration is kept, and
    the survivors are ready to go on without them (dist: backend.unannounced=recover). The run
    loop then treats each as a failure striking at the start of that iteration. Raised by
    `perform` (with `restored`, the iteration the recovery restored), the nodes died while the
    recovery ran: it was completed without them, and they fail next."""

    def __init__(self, nodes: list[int], why: str = "", restored: int | None = None):
        super().__init__(f"nodes {nodes} failed unannounced" + (f": {why}" if why else ""))
        self.nodes, self.why, self.restored = list(nodes), why, restored


@dataclass
class LoopOutcome(RunOutcome):
    losses: list[float] = field(default_factory=list)  # per iteration; nan where none was computed
    checkpoints: int = 0
    plan_segments: list[dict] = field(default_factory=list)  # {first, last, plan, shape} runs of iterations
    ledger: list[list] = field(default_factory=list)  # [first, last, samples each, ranges]: SamplesLedger.entries
    peak_memory_bytes: dict[int, float] = field(default_factory=dict)
    first_timeline: SimResult | None = None
    plan_after_recovery: Plan | None = None  # the plan after the first recovery that changed it
    global_batch: int = 0


@dataclass
class InFlight:
    """The recovery that last ran on the modelled clock, while nothing else has run since: a
    membership change timed before its `end` arrived while it ran and is merged into it
    (RunLoop._merge). `record` is the group's entry in the run's recoveries."""
    record: dict
    start: float
    end: float


class KeptIterations(IterationRuns):
    """The time of the iterations that count, for ETTR (the run's `productive_s`): every
    iteration index the final model holds, once, at the time its last (kept) execution took
    (the value of each run: seconds per iteration). Checkpoint stalls, recoveries, waits and
    the part of an iteration a failure cut short are never added."""

    def seconds(self) -> float:
        return math.fsum(count * each for _, count, each in self.runs)


class RunLoop:
    def __init__(self, ctx, strategy, cluster: Cluster, script: FailureScript, backend: Backend, timelines,
                 log, progress=None, clock: str = "model", journal: Journal | None = None):
        if clock not in CLOCKS:
            raise ValueError(f"unknown clock {clock!r}")
        # With a journal (dist), the backend's answers and the clock's readings are recorded, so
        # that processes restarted mid-run get this loop back by replaying it (ftbench.journal).
        self._wall = time.perf_counter if journal is None else journal.clock
        if journal is not None:
            backend, log = JournaledBackend(backend, journal), _quiet_while_replaying(log, journal)
        self.ctx, self.strategy, self.cluster, self.backend = ctx, strategy, cluster, backend
        self.view = cluster.view()
        self.timelines, self.log, self.progress = timelines, log, progress
        self.modelled = clock == "model"
        self.events = EventQueue(script)
        self.out = LoopOutcome(losses=[math.nan] * ctx.iterations if not backend.jumps else [],
                               global_batch=ctx.global_batch)
        self.ckpt = Checkpoints(strategy, ctx.cost_model, ctx.iterations, log, self.modelled)
        # The run stops before an iteration that would end past train.max_hours, or past the
        # end the failure script sets (a trace's last event: failures.end_at_last_event).
        ends = [ctx.max_hours * 3600.0] if ctx.max_hours is not None else []
        if script.end_s is not None:
            ends.append(script.end_s)
        self.horizon = min(ends, default=math.inf)
        self.it, self.t, self.plan = 0, 0.0, None
        self.stopped = False  # the run reached its end while waiting for nodes (_wait_for_nodes)
        self.waits_for_joins = bool(getattr(script, "waits_for_joins", False))
        self.kept = KeptIterations()
        self.ledger = SamplesLedger()
        self._points: dict = {}
        self._wall0 = self._wall()
        self._nodes: tuple | None = None  # ((plan, its nodes), ...): the last two plans asked about
        self._action_s: dict = {}  # (action, id(old), id(new)) -> (old, new, modelled seconds)
        self._writers_of: tuple | None = None  # (plan, the nodes of its usual checkpoint writers)
        self._flight: InFlight | None = None  # the recovery a timed change would be merged into
        self._merging: InFlight | None = None  # set while the strategy answers a merged change
        self._waits = 0  # waits for nodes so far (_wait_for_nodes)
        self._charged = 0.0  # wall clock: restarts a backend charged rather than performed (LocalBackend.charged)

    # -- clock --------------------------------------------------------------------------
    def now(self) -> float:
        return self.t if self.modelled else self._wall() - self._wall0 + self._charged

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> LoopOutcome:
        try:
            with _rare_collections(self.backend.jumps):
                return self._run()
        except BaseException as err:  # Ctrl-C, SIGTERM, a bug: whoever reports it gets what was done
            self.out.iterations, self.out.time_s = self.it, self.now()
            self.out.productive_s = self.kept.seconds()
            self.out.ledger = self.ledger.entries()
            err.outcome = self.out
            raise

    def _run(self) -> LoopOutcome:
        out = self.out
        self.plan = self._first_plan()
        self.backend.start(self.plan)
        self._save(0, initial=True)
        while self.it < self.ctx.iterations and out.status == "ok" and not self.stopped:
            if self._boundary_events():
                continue  # membership changed: look again (more may be due, the plan may differ)
            timeline = self.timelines(self.plan)
            if out.first_timeline is None:
                out.first_timeline = timeline
            problem = self.backend.check_memory(self.plan, timeline)
            if problem is not None:
                out.status, out.error = "oom", problem
                self.log({"event": "oom", "time_s": self.now(), "iteration": self.it, "reason": problem})
                break
            T = shared_cores_iteration(timeline, getattr(self.ctx.hardware, "cores", None))
            if T <= 0:
                raise ValueError(f"plan {self.plan.name!r} has a zero iteration time")
            self.ckpt.use(self.plan, T if self.modelled else None)
            n, strike = self._next_step(T)
            if n > 0:
                self._advance(n, T)
            elif strike is not None:
                self._strike(*strike, timeline=timeline, T=T)
            else:
                break  # the next iteration would not finish before train.max_hours (or the trace's end)
        self.backend.finish()
        out.iterations, out.time_s = self.it, self.now()
        out.productive_s = self.kept.seconds()
        out.ledger = self.ledger.entries()
        out.peak_memory_bytes = self.backend.peak_memory()
        return out

    def _first_plan(self) -> Plan:
        """The strategy's first plan. A strategy that cannot start on the nodes the job has
        (TooFewNodes: a trace that starts with fewer nodes than its smallest job) waits, on the
        modelled clock, for the timed events that bring more: the clock moves to each instant,
        its events change membership only (no strategy is running yet; a node lost before the
        start is no failure of the job), and the strategy is asked again. No iteration runs
        meanwhile; the wait counts in the run's time. On the wall clock, or when no event
        before the run's end brings enough nodes, the error stands."""
        while True:
            try:
                return self.strategy.plan(self.view)
            except TooFewNodes as err:
                upcoming = self.events.peek_timed()
                if not self.modelled or upcoming is None or upcoming.time_s >= self.horizon:
                    raise
                self.t = max(self.t, upcoming.time_s)
                while (event := self.events.peek_timed()) is not None and event.time_s <= self.t:
                    self.events.pop_timed()
                    if event.kind == "join":
                        self.cluster.join(event.node)
                    else:
                        self.cluster.fail(event.node)
                    self.log({"event": event.kind, "node": event.node, "time_s": self.t, "iteration": 0,
                              "before_start": True})
                self.log({"event": "waiting", "time_s": self.t, "nodes": len(self.cluster.alive),
                          "reason": err.problem})

    def _next_step(self, T: float) -> tuple[int, tuple[FailureEvent, float] | None]:
        """(whole iterations to run before the next event, or the failure striking now)."""
        it, t = self.it, self.now()
        k = self.events.next_iteration()
        limit = self.ctx.iterations - it if k is None else min(self.ctx.iterations - it, max(k - it, 0))
        if limit == 0:  # a scripted failure strikes inside this iteration (boundary events went first)
            event = self.events.pop_scripted()
            return 0, (event, ITERATION_EVENT_FRACTION if event.at is None else event.at)
        if not self.modelled:  # wall clock: one iteration at a time; timed events are seen at boundaries
            return (1, None) if t < self.horizon else (0, None)
        t_event = self.events.next_time()
        n = self.ckpt.fit(it, t, min(t_event, self.horizon), limit)
        if n > 0:
            return n, None
        if t_event < self.horizon and t < self.horizon and t_event < t + self.ckpt.span(it, 1, t):
            if self._strikes(self.events.peek_timed()):
                return 0, (self.events.pop_timed(), min(max((t_event - t) / T, 0.0), 1.0))
            return 1, None  # a boundary event inside this iteration: it applies at its end
        return 0, None

    def _strikes(self, event: FailureEvent) -> bool:
        """Whether the event interrupts the iteration in flight: the failure of a live node
        that runs a worker of the plan."""
        return (event.kind == "fail" and self.cluster.is_alive(event.node)
                and event.node in self._plan_nodes(self.plan))

    def _plan_nodes(self, plan: Plan) -> frozenset[int]:
        """The nodes `plan` runs on, kept for the last two plans asked about (plans are not
        changed once made)."""
        for hit in self._nodes or ():
            if hit[0] is plan:
                return hit[1]
        nodes = plan.nodes()
        self._nodes = ((plan, nodes), *(self._nodes or ())[:1])
        return nodes

    def _boundary_events(self) -> bool:
        """Apply what is due at this iteration boundary; True when anything was. A timed event
        at or past the run's end (train.max_hours, a trace's last event) is not: a recovery
        that ran past the end ends the run, which applies nothing after it."""
        now = self.now()
        timed = self.events.peek_timed()
        if timed is not None and timed.time_s <= now and timed.time_s < self.horizon and now < self.horizon:
            event = self.events.pop_timed()
            if self._flight is not None and event.time_s < self._flight.end:
                self._merge(event, self._flight)
            elif self._strikes(event):  # (wall clock) it struck during the last iteration
                self._strike(event, 0.0, timeline=self.timelines(self.plan), T=0.0)
            else:
                self._apply(event)
            return True
        scripted = self.events.peek_scripted()
        if scripted is not None and scripted.iteration <= self.it and not self._strikes(scripted):
            self._apply(self.events.pop_scripted())
            return True
        return False

    # -- iterations ---------------------------------------------------------------------
    def _advance(self, n: int, T: float) -> None:
        self._flight = None  # training goes on: the last recovery is over
        if self.backend.jumps:
            t_end, saved, newest = self.ckpt.advance(self.it, self.t, n)
            for tier, at in newest:
                self.backend.save(self.plan, at, tier.mode)
            self.out.checkpoints += saved
            self.log({"event": "iterations", "first": self.it, "last": self.it + n - 1, "count": n,
                      "iteration_time_s": T, "checkpoints": saved, "time_s": t_end,
                      "samples": self.ledger.samples() + n * plan_samples(self.plan, self.ctx.microbatch_size),
                      "plan": self.plan.name})
            self._segment(self.it, self.it + n - 1)
            self.kept.add(self.it, n, T)  # the checkpoint stalls in t_end are not productive
            self.ledger.add(self.it, n, sample_ranges(self.plan, self.ctx.microbatch_size))
            self.it, self.t = self.it + n, t_end
            if self.progress is not None:
                self.progress(self.it, self.now())
            return
        for _ in range(n):
            started = self._wall()
            try:
                loss = self.backend.run_iteration(self.plan, self.it)
            except FailuresDiscovered as found:
                self._discovered(found)
                return
            measured = self._wall() - started
            if self.modelled:
                self.t += T
            self.out.losses[self.it] = math.nan if loss is None else loss
            self._segment(self.it, self.it)
            self.kept.add(self.it, 1, T if self.modelled else measured)
            self.ledger.add(self.it, 1, sample_ranges(self.plan, self.ctx.microbatch_size))
            self.it += 1
            self.log({"event": "iteration", "iteration": self.it - 1, "loss": loss, "iteration_s": measured,
                      "time_s": self.now(), "samples": self.ledger.samples(), "plan": self.plan.name})
            if not self.modelled and self.ckpt.needs_measure(self.plan):
                try:
                    self.ckpt.use(self.plan, self.backend.iteration_time(self.plan, self.it, measured))
                except FailuresDiscovered as found:  # a process died meanwhile (dist)
                    self._discovered(found)
                    return
            if self.progress is not None:
                self.progress(self.it, self.now())
            if self.ckpt.due(self.it):
                try:
                    self._save(self.it, self.ckpt.due(self.it))
                except FailuresDiscovered as found:  # a process died during the checkpoint (dist)
                    self._discovered(found)
                    return

    def _segment(self, first: int, final: int) -> None:
        segments = self.out.plan_segments
        last = segments[-1] if segments else None
        if last and (last["plan"], last["shape"], last["last"]) == (self.plan.name, self.plan.shape, first - 1):
            last["last"] = final
        else:
            segments.append({"first": first, "last": final, "plan": self.plan.name, "shape": self.plan.shape})

    def _save(self, iteration: int, tiers=None, initial: bool = False) -> None:
        """Checkpoints after `iteration` iterations (0: the state before training) of `tiers`
        (None: every tier), in the strategy's order."""
        for tier in self.ckpt.tiers if tiers is None else tiers:
            measured = self.backend.save(self.plan, iteration, tier.mode)
            if self.modelled:
                cost = tier.modelled_cost(self.plan, self.ctx.cost_model)
                self.t += self.ckpt.persist_wait(tier, self.t) + cost.stall_s
                tier.ledger.add(iteration, self.t + cost.persist_s)
            else:
                cost = measured or SaveCost(0.0, 0.0)
                tier.measured = cost
            self.ckpt.saved(tier, iteration)
            self.out.checkpoints += 1
            if not self.backend.jumps or initial:
                self.log({"event": "checkpoint", "iteration": iteration, "mode": tier.mode, "stall_s": cost.stall_s,
                          "time_s": self.now()})

    # -- membership ---------------------------------------------------------------------
    def _strike(self, event: FailureEvent, fraction: float, timeline: SimResult, T: float) -> None:
        """A live node of the plan fails `fraction` into the iteration in flight: the ops
        completed by then ran (optimizer steps included), the survivors abandon the iteration
        (the backend undoes the steps they took in it) and the strategy recovers. Where ops are
        cut, the metrics line says how many optimizer steps had completed (`stepped`, from the
        resolved point: the same on every backend that cuts) and how many replicas the
        backend undid (`undone`)."""
        dead = self._workers_on(event.node)
        touched = frozenset(d for w in dead for d, _ in self.plan.holds.get(w, ()))
        if fraction > 0 and self._finishes(touched):
            self._finish_without(event, fraction, timeline, T, dead, touched)
            return
        if self.modelled:
            self.t += fraction * T
        completed = self._point(timeline, fraction) if fraction > 0 and self.backend.cuts_ops else frozenset()
        t_fail = self.now()
        self.cluster.fail(event.node)
        self.out.failures += 1
        undone = self.backend.strike(self.plan, self.it, completed, dead)
        extra = {}
        if self.backend.cuts_ops:
            extra["stepped"] = sum(op.kind == OPT for op in completed)
            if undone is not None:
                extra["undone"] = undone
        # logged once the backend has struck: on dist the leader may be among the dead, and the
        # next leader writes the line
        self.log({"event": "fail", "node": event.node, "time_s": t_fail, "iteration": self.it, **extra})
        self._lose_unpersisted(event.node)
        self._ask_strategy(event)

    def _finishes(self, touched: frozenset) -> bool:
        """Whether the pipelines a failure leaves alone finish the iteration in flight: the
        strategy lets them (ftbench.local_sgd.finishes_iteration) and some are left."""
        if self.ctx.local_steps is None or not finishes_iteration(self.strategy, self.ctx.local_steps.algorithm):
            return False
        return any(d not in touched for held in self.plan.holds.values() for d, _ in held)

    def _finish_without(self, event: FailureEvent, fraction: float, timeline: SimResult, T: float,
                        dead: list[int], touched: frozenset) -> None:
        """A failure `fraction` into the iteration under torchft's LocalSGD or DiLoCo: the
        replica groups it does not touch wait on no other group until the sync, so they finish
        the iteration's local step (nothing of theirs is undone) and its sync among themselves
        (the backend's `finish_without`); the iteration counts their samples. The strategy
        recovers at the iteration's end, as at the next one's start (after the last iteration
        too, so the run ends on the live groups). The metrics line says how many optimizer
        steps had completed when it struck (`stepped`) and which pipelines finished
        (`finished`). Should another death cut the survivors' sync (dist), they roll the
        iteration back as from any death found in it, and it is redone."""
        completed = self._point(timeline, fraction) if self.backend.cuts_ops else frozenset()
        # what runs: the ops completed by then, and every op of the pipelines left alone
        finishing = completed.union(op for ops in self.plan.schedule.ops.values() for op in ops
                                    if op.pipeline not in touched) if self.backend.cuts_ops else frozenset()
        it = self.it
        t_start, started = self.t, self._wall()
        if self.modelled:
            self.t += fraction * T
        fail = {"event": "fail", "node": event.node, "time_s": self.now(), "iteration": it}
        self.cluster.fail(event.node)
        self.out.failures += 1
        if self.backend.cuts_ops:
            fail["stepped"] = sum(op.kind == OPT for op in completed)
        try:
            loss = self.backend.finish_without(self.plan, it, finishing, dead, touched)
        except FailuresDiscovered as found:  # dist: a death cut the survivors' sync, rolled back
            self.log(fail)
            self._lose_unpersisted(event.node)
            self._ask_strategy(event)
            self._discovered(found)
            return
        fail["finished"] = sorted({d for held in self.plan.holds.values() for d, _ in held} - touched)
        self.log(fail)  # (after the backend: on dist the leader may be among the dead)
        self._lose_unpersisted(event.node)
        measured = self._wall() - started
        if self.modelled:
            self.t = t_start + T
        if not self.backend.jumps:
            self.out.losses[it] = math.nan if loss is None else loss
        self._segment(it, it)
        self.kept.add(it, 1, T if self.modelled else measured)
        self.ledger.add(it, 1, sample_ranges(self.plan, self.ctx.microbatch_size, touched))
        self.it += 1
        if self.backend.jumps:  # (as sim logs its iterations)
            self.log({"event": "iterations", "first": it, "last": it, "count": 1, "iteration_time_s": T,
                      "checkpoints": 0, "time_s": self.now(), "samples": self.ledger.samples(),
                      "plan": self.plan.name, "without": sorted(touched)})
        else:
            self.log({"event": "iteration", "iteration": it, "loss": loss, "iteration_s": measured,
                      "time_s": self.now(), "samples": self.ledger.samples(), "plan": self.plan.name,
                      "without": sorted(touched)})
        if self.progress is not None:
            self.progress(self.it, self.now())
        # (after the last iteration too: the final weights are the live groups')
        self._ask_strategy(FailureEvent(event.node, iteration=self.it))

    def _workers_on(self, node: int) -> list[int]:
        """The plan's workers on `node`, in the plan's order: where at most one, the node's
        workers the plan places there, as many as a count over the plan finds; else looked
        for over the plan's 16,384 workers (in bulk)."""
        node_of = self.plan.node_of
        on = [w for w in self.cluster.workers_on(node) if node_of.get(w) == node]
        if len(on) > 1 or countOf(node_of.values(), node) != len(on):
            on = list(compress(node_of, map(eq, node_of.values(), repeat(node))))
        return on

    def _fail(self, node: int, **extra) -> None:
        """A live node fails now: membership, the count, the metrics line."""
        self.cluster.fail(node)
        self.out.failures += 1
        self.log({"event": "fail", "node": node, "time_s": self.now(), "iteration": self.it, **extra})

    def _lose_unpersisted(self, node: int) -> None:
        """Checkpoints not yet durable when `node` fails are lost, and what it held in host
        memory outside the processes (the HOST tier)."""
        self.backend.lose_host_memory(node)
        if self.modelled:
            lost = self.ckpt.drop_not_durable(self.now())
            if lost:
                self.backend.drop_checkpoints(lost)
        else:
            self.backend.lose_unfinished_persist()

    def _discovered(self, found: FailuresDiscovered) -> None:
        """Nodes that died unannounced in the iteration in flight (the backend has rolled the
        survivors back to its start), in the checkpoint after it (its state stands) or during a
        recovery (completed without them): each fails as a scripted failure striking at
        fraction 0 of the next iteration to run. A standby node that dies (dist: its
        processes wait outside the cluster's nodes) is one spare fewer."""
        for node in found.nodes:
            if self.out.status != "ok":
                return
            if not self.cluster.is_alive(node):
                if node >= self.cluster.nodes and self.cluster.spares > 0:
                    self.cluster.spares -= 1
                    self.out.failures += 1
                    self.log({"event": "fail", "node": node, "time_s": self.now(), "iteration": self.it,
                              "standby": True, "unannounced": found.why or True})
                continue
            self._fail(node, unannounced=found.why or True)
            self._lose_unpersisted(node)
            self._ask_strategy(FailureEvent(node, iteration=self.it))

    def _point(self, timeline: SimResult, fraction: float) -> frozenset:
        """The ops completed `fraction` into the timeline, resolved once per (timeline, fraction):
        the optimizer steps (OPT) that finished by then included, so some stages may have
        stepped and others not."""
        key = (id(timeline), fraction)
        hit = self._points.get(key)
        if hit is None or hit[0] is not timeline:
            hit = self._points[key] = (timeline, ops_completed_at(timeline, fraction, stop_before_optimizer=False))
        return hit[1]

    def _apply(self, event: FailureEvent) -> None:
        """A membership change that interrupts nothing (see ftbench.events)."""
        node, cluster = event.node, self.cluster
        if event.kind == "fail" and not cluster.is_alive(node):
            self.log({"event": "fail", "node": node, "time_s": self.now(), "iteration": self.it,
                      "ignored": "the node is already down"})
            return
        if event.kind == "join" and cluster.is_alive(node) and node < cluster.nodes:
            self.log({"event": "join", "node": node, "time_s": self.now(), "iteration": self.it,
                      "ignored": "the node is already up"})
            return
        if event.kind == "fail":
            cluster.fail(node)
            self.out.failures += 1
            self.backend.lose_host_memory(node)
        else:
            cluster.join(node)
        self.log({"event": event.kind, "node": node, "time_s": self.now(), "iteration": self.it})
        self._ask_strategy(event)

    def _merge(self, event: FailureEvent, flight: InFlight) -> None:
        """A membership change timed while the recovery in flight runs (modelled clock) is
        merged into it, one recovery for the changes that arrive while it runs, as the Oobleck
        artifact's simulators handle a change during a rendezvous (Varuna's restart, Oobleck's
        reconfiguration): a node that joins, or fails outside the plan being recovered to,
        is taken in and the recovery still ends when it would; a member that fails starts the
        recovery again from that moment, so it ends the strategy's new recovery's time after
        the failure, not after the recovery in flight. The strategy answers the change as
        usual and the backend carries that out; the group's record says what was merged."""
        restarts = self._strikes(event)
        self.t = max(event.time_s, flight.start)  # the change's moment, inside the recovery
        self._merging, waits = flight, self._waits
        try:
            if restarts:
                self._strike(event, 0.0, timeline=self.timelines(self.plan), T=0.0)
            else:
                self._apply(event)
        finally:
            self._merging = None
        if not restarts and self._waits == waits:
            self.t = flight.end
        flight.end = self.t
        record = flight.record
        record["recovery_s"] = flight.end - flight.start
        record.setdefault("merged", []).append({"event": event.kind, "node": event.node, "time_s": event.time_s,
                                                "restarts": restarts})
        if self._flight is None and self.out.status == "ok" and not self.stopped:
            self._flight = flight  # (a recovery from deaths found meanwhile, dist, is the one in flight)
        self.log({"event": "recovery_merged", "index": len(self.out.recoveries) - 1, "node": event.node,
                  "kind": event.kind, "time_s": event.time_s, "restarts": restarts, "end_s": flight.end,
                  "plan": record["plan"], "shape": record["shape"]})

    @staticmethod
    def _fold(group: dict, record: dict) -> None:
        """The strategy's answer to a merged change, into the group's record: its actions,
        the plan it ends on, the iteration restored and what moved."""
        group["actions"] = group["actions"] + record["actions"]
        if "action_s" in record:
            group["action_s"] = group.get("action_s", []) + record["action_s"]
        group["plan"], group["shape"] = record["plan"], record["shape"]
        group["restored_iteration"] = record["restored_iteration"]
        group["lost_iterations"] = group["iteration"] - record["restored_iteration"]
        if "copies" in record:
            room = COPIES_LISTED - len(group.get("copies", ()))
            group["copies"] = group.get("copies", []) + record["copies"][:max(room, 0)]
            group["copies_total"] = group.get("copies_total", 0) + record["copies_total"]
            group["copied_bytes"] = group.get("copied_bytes", 0.0) + record["copied_bytes"]
        for key in ("fallback", "interrupted_by_nodes"):
            if key in record:
                group[key] = record[key]

    def _ask_strategy(self, event: FailureEvent) -> None:
        out, cluster, it = self.out, self.cluster, self.it
        merging, self._merging, self._flight = self._merging, None, None
        recovery = self.strategy.on_event(event, self.view, it)
        if recovery.unrecoverable and recovery.wait:
            recovery = self._wait_for_nodes(recovery.unrecoverable)
            if recovery is None:
                return  # the run ended waiting
            it = self.it
        if recovery.unrecoverable:
            out.status, out.error = "unrecoverable", recovery.unrecoverable
            self.log({"event": "unrecoverable", "time_s": self.now(), "iteration": it,
                      "reason": recovery.unrecoverable})
            return
        actions = list(recovery.actions)
        if merging is not None:  # nothing trained since the recovery in flight restored its state: no save
            actions = [a for a in actions if not isinstance(a, SaveCheckpoint)]
        # nodes of the plan down now, before any replacement takes their place: a save that
        # leads the recovery (just-in-time checkpoints) is made by the live workers alone, and
        # comes before the replacement
        saves = any(isinstance(a, SaveCheckpoint) for a in actions)
        gone = frozenset(self._plan_nodes(self.plan) - cluster.alive) if saves else frozenset()
        if recovery.replace:
            actions.insert(leading_saves(actions), self._replace(recovery.replace))
        cluster.spares += len(recovery.standby)
        self._replace_later(recovery.later)
        if recovery.shape is not None:
            cluster.pp, cluster.dp = recovery.shape
        old, new = self.plan, recovery.plan or self.plan
        down = sorted(self._plan_nodes(new) - cluster.alive)  # nodes of the plan that are not alive
        if down:
            raise RuntimeError(f"strategy {self.strategy.name!r} continued after {event.kind} of node {event.node} "
                               f"with a plan on failed node(s) {down}")
        if not actions:
            if new is not old:
                self.backend.perform([], old, new, it)
                self.plan = new
            return
        started, t_event = self._wall(), self.now()
        interrupted = None
        fallback = None
        try:
            restored, actions, fallback = self._perform(actions, old, new, it)
        except FailuresDiscovered as found:  # dist: nodes died during the recovery
            restored, interrupted = found.restored, found
        except UserError as err:
            out.status, out.error = err.status, str(err)
            self.log({"event": err.status, "time_s": self.now(), "iteration": it, "reason": str(err)})
            return
        restored = it if restored is None else restored
        detection = charged_restart = 0.0
        if self.modelled:
            # a failure is noticed when the survivors agree on it (hardware.detection_s), then recovered
            detection = getattr(self.ctx.hardware, "detection_s", 0.0) if event.kind == "fail" else 0.0
            seconds, each = detection, []
            for action in actions:
                each.append(self._action_seconds(action, old, new, gone))
                seconds += each[-1]
                if isinstance(action, SaveCheckpoint):
                    self.ckpt.ledger(action.mode).add(it, self.t + seconds)
            self.t += seconds
        else:
            charged_restart = getattr(self.backend, "charged", 0.0)  # (local: a restart it rebuilt in place)
            self._charged += charged_restart
            seconds = self._wall() - started + charged_restart
        self.plan, self.it = new, restored
        self.ckpt.recovered(restored)  # the post-change checkpoint (strategy.checkpoint_after_change)
        self.kept.rollback(restored)  # iterations restored..it-1 were lost: their redo counts instead
        self.ledger.rollback(restored)
        if out.plan_after_recovery is None and new is not old:
            out.plan_after_recovery = new
        record = {"time_s": t_event, "iteration": it, "recovery_s": seconds, "lost_iterations": it - restored,
                  "restored_iteration": restored, "actions": [type(a).__name__ for a in actions],
                  "plan": new.name, "shape": new.shape, "cause": event.kind}
        moved = [getattr(a, "copies", ()) for a in actions]  # (ftbench.transfers.Copies: made when read)
        total = sum(map(len, moved))
        if total:  # what moved between workers: layers, from, to, bytes (the first COPIES_LISTED of them)
            record["copies"] = [{"layers": list(c.layers), "embedding": c.embedding, "head": c.head, "src": c.src,
                                 "dst": c.dst, "bytes": c.nbytes}
                                for c in islice(chain.from_iterable(moved), COPIES_LISTED)]
            record["copies_total"] = total
            record["copied_bytes"] = math.fsum(chain.from_iterable(map(copy_sizes, moved)))
        if detection:
            record["detection_s"] = detection
        if self.modelled:  # each action's modelled seconds, beside `actions` (sim_vs_real compares phases)
            record["action_s"] = each
        if charged_restart:  # one process cannot restart itself: the rest of a restart, charged
            record["charged_restart_s"] = charged_restart
        if fallback is not None:  # what did not verify, and what was done instead
            record["fallback"] = fallback
        if interrupted is not None:  # completed without them; they fail next
            record["interrupted_by_nodes"] = interrupted.nodes
        if merging is not None:
            self._fold(merging.record, record)
        else:
            out.recoveries.append(record)
            self.log({"event": "recovery", **record})
            if self.modelled and any(isinstance(a, AGREEMENT) for a in actions):
                self._flight = InFlight(record, t_event, self.t)
        if interrupted is not None:
            self._discovered(interrupted)

    def _perform(self, actions: list, old: Plan, new: Plan, it: int) -> tuple[int | None, list, str | None]:
        """backend.perform, falling back when Swift's replay cannot run as planned
        (ReplayUnavailable: its checkpoint or a log file it reads does not verify, and nothing
        was used): first a replay from the older checkpoint the backend found usable with its
        logs, else a restart of the job from the newest checkpoint that verifies. Returns the
        iteration restored, every action performed, and why it fell back (None: it did not)."""
        todo, done, reasons = list(actions), [], []
        while True:
            try:
                restored = self.backend.perform(todo, old, new, it)
                return restored, done + todo, "; ".join(reasons) or None
            except ReplayUnavailable as err:
                replay = next((a for a in todo if isinstance(a, ReplayLogs)), None)
                if replay is None:
                    raise
                done += todo[:todo.index(replay) + 1]
                old = new  # what ran before the replay already moved to `new`
                if err.start is not None and err.start < replay.since:
                    reasons.append(f"{err}; replaying from the checkpoint of iteration {err.start} instead")
                    todo = [ReplayLogs(replay.workers, err.start, replay.until, replay.helpers)]
                else:
                    reasons.append(f"{err}; restarting the job from the newest checkpoint that verifies")
                    todo = [RestartJob(), RestoreCheckpoint(FILE)]

    def _wait_for_nodes(self, reason: str):
        """Too few nodes to go on (`Recovery.wait`): training stops and, where the failure
        script brings nodes (a trace's adds: FailureScript.waits_for_joins) and on the modelled
        clock, the run waits for the timed events that bring more, as the Oobleck artifact's
        simulators stop until enough spot nodes are back. The clock moves to each event's
        instant, its events change membership (a node lost meanwhile counts as a failure), and
        the strategy's `resume` is asked for its recovery onto the live nodes (TooFewNodes:
        wait on). The wait counts in the run's time, not in its productive time. Returns that
        recovery; None when the run reaches its end (a trace's last event, train.max_hours)
        still waiting: it ends there, status ok. Elsewhere (other failure scripts, the wall
        clock, a strategy without `resume`), or when no later event can come, the job cannot
        go on: Recovery(unrecoverable=reason)."""
        from ftbench.actions import Recovery

        resume = self.strategy.resume
        if not self.modelled or resume is None or not self.waits_for_joins:
            return Recovery(unrecoverable=reason)
        started = self.t
        self._waits += 1
        self.log({"event": "waiting", "time_s": self.t, "iteration": self.it, "nodes": len(self.cluster.alive),
                  "reason": reason})
        while True:
            upcoming = self.events.peek_timed()
            if upcoming is None or upcoming.time_s >= self.horizon:
                if upcoming is None:
                    return Recovery(unrecoverable=f"{reason}; no node joins later")
                self.t = max(self.t, self.horizon)
                self.stopped = True
                self.log({"event": "stopped", "time_s": self.t, "iteration": self.it, "waited_s": self.t - started,
                          "reason": f"the run's end came while waiting: {reason}"})
                return None
            self.t = max(self.t, upcoming.time_s)
            while (event := self.events.peek_timed()) is not None and event.time_s <= self.t:
                self.events.pop_timed()
                if event.kind == "join":
                    self.cluster.join(event.node)
                elif self.cluster.is_alive(event.node):
                    self.cluster.fail(event.node)
                    self.out.failures += 1
                    self._lose_unpersisted(event.node)
                self.log({"event": event.kind, "node": event.node, "time_s": self.t, "iteration": self.it,
                          "while_waiting": True})
            try:
                recovery = resume(self.view, self.it)
            except TooFewNodes:
                continue
            self.log({"event": "resumed", "time_s": self.t, "iteration": self.it, "waited_s": self.t - started,
                      "nodes": len(self.cluster.alive)})
            return recovery

    def _action_seconds(self, action, old: Plan, new: Plan, gone: frozenset = frozenset()) -> float:
        """action_seconds, once per (action, old plan, new plan): a restart onto the same plan
        after every failure costs the same each time. A save of `old` while nodes of it are
        `gone` is written by the live workers alone."""
        if isinstance(action, (WaitForReplacement, RestartJob, Rendezvous)):  # constants: nothing to keep
            return action_seconds(action, old, new, self.ctx.cost_model)
        if gone and isinstance(action, SaveCheckpoint) and not gone.isdisjoint(self._writer_nodes(old)):
            node_of = old.node_of  # a usual writer is down: the live writers' save, costed afresh
            return action_seconds(action, old, new, self.ctx.cost_model, self.ckpt.save_s,
                                  alive=lambda w: node_of[w] not in gone)
        if getattr(action, "copies", ()):  # this recovery's own copies (thousands at scale: not hashed)
            return action_seconds(action, old, new, self.ctx.cost_model, self.ckpt.save_s)
        key = (action, id(old), id(new))
        hit = self._action_s.get(key)
        if hit is None or hit[0] is not old or hit[1] is not new:
            if len(self._action_s) >= 16:
                del self._action_s[next(iter(self._action_s))]  # the oldest
            hit = self._action_s[key] = (old, new, action_seconds(action, old, new, self.ctx.cost_model,
                                                                  self.ckpt.save_s))
        return hit[2]

    def _writer_nodes(self, plan: Plan) -> frozenset[int]:
        """The nodes of `plan`'s usual checkpoint writers (one per stage), kept for the last plan."""
        hit = self._writers_of
        if hit is None or hit[0] is not plan:
            hit = self._writers_of = (plan, frozenset(plan.node_of[w] for w in checkpoint_writers(plan).values()))
        return hit[1]

    def _replace_later(self, nodes: tuple[int, ...]) -> None:
        """Failed nodes get replacements while training goes on without them (Recovery.later):
        a standby while any is left, else a new node after `cluster.replacement_s`; its
        processes start (`hardware.restart_s`) and it joins then, timed from now, as the
        failed node's join."""
        start_s = getattr(self.ctx.hardware, "restart_s", 0.0)
        for node in nodes:
            if self.cluster.spares > 0:
                self.cluster.spares -= 1
                wait = 0.0
            else:
                wait = self.cluster.replacement_s
            self.events.add(FailureEvent(node, "join", time_s=self.now() + wait + start_s))
            self.log({"event": "replacement", "node": node, "time_s": self.now(), "joins_s": wait + start_s})

    def _replace(self, nodes: tuple[int, ...]) -> WaitForReplacement:
        """Failed nodes get replacements: a standby at once while any is left, else a new
        node after `cluster.replacement_s`. The replacement takes the failed node's place."""
        wait = 0.0
        for node in nodes:
            if self.cluster.spares > 0:
                self.cluster.spares -= 1
            else:
                wait = self.cluster.replacement_s
            self.cluster.join(node)
        return WaitForReplacement(tuple(nodes), wait)


# While a jumping backend (sim) runs, the cyclic garbage collector waits for this many new
# container objects instead of 700: a simulated plan of 16,384 workers is some hundred
# thousand small tuples and dicts, which the default thresholds traverse again and again
# (a third of the run), while the loop makes almost no reference cycles (reference counting
# frees the rest as usual).
RARE_COLLECTION_THRESHOLD = 1_000_000


class _rare_collections:
    """Raise the garbage collector's first threshold for the duration (when `on`), then
    restore the thresholds as they were."""

    def __init__(self, on: bool):
        self.on, self.saved = on, None

    def __enter__(self):
        if self.on:
            self.saved = gc.get_threshold()
            gc.set_threshold(max(self.saved[0], RARE_COLLECTION_THRESHOLD), *self.saved[1:])
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            gc.set_threshold(*self.saved)
        return False


def _quiet_while_replaying(log, journal: Journal):
    """`log`, silent while the loop replays its journal (those lines were written before the restart)."""
    def quiet(record: dict) -> None:
        if not journal.replaying:
            log(record)
    return quiet


def run_loop(ctx, strategy, cluster: Cluster, script: FailureScript, backend: Backend, timelines, log,
             progress=None, clock: str = "model", journal: Journal | None = None) -> LoopOutcome:
    """Drive `strategy` through `script` on `backend`; `log(record)` gets every metrics line."""
    return RunLoop(ctx, strategy, cluster, script, backend, timelines, log, progress, clock, journal).run()

