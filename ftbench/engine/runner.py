"""A whole local run: real iterations, real failures, the strategy's recovery performed for real.

A failure scripted for iteration k strikes after half of that iteration's ops have run: the
failed node's workers are destroyed, the iteration in flight is lost everywhere, and the
strategy's recovery decides what comes back and from where. A join takes effect at the next
iteration boundary. Time is wall-clock.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ftbench.engine.local import LocalEngine
from ftbench.errors import UserError
from ftbench.failures import FailureScript
from ftbench.outcome import RunOutcome
from ftbench.failures import ITERATION_EVENT_FRACTION


@dataclass
class LocalOutcome(RunOutcome):
    losses: list[float] = field(default_factory=list)
    checkpoints: int = 0


class _Due:
    """Events due at an iteration: scripted for it (or earlier), or timed and already past.
    Timed events are pulled lazily: Poisson and interval scripts are endless."""

    def __init__(self, script: FailureScript):
        self.by_iteration = list(script.by_iteration)
        self.by_time = iter(script.by_time)
        self._next = next(self.by_time, None)

    def pop(self, iteration: int, elapsed: float) -> list:
        due = [e for e in self.by_iteration if e.iteration <= iteration]
        self.by_iteration = self.by_iteration[len(due):]  # sorted by iteration
        while self._next is not None and self._next.time_s <= elapsed:
            due.append(self._next)
            self._next = next(self.by_time, None)
        return due


def run_local(ctx, engine: LocalEngine, strategy, cluster, script: FailureScript, log,
              progress=None) -> LocalOutcome:
    out = LocalOutcome(losses=[math.nan] * ctx.iterations)
    started = time.perf_counter()
    elapsed = lambda: time.perf_counter() - started  # noqa: E731
    engine.build(strategy.plan(cluster))
    mode = getattr(strategy, "checkpoint_mode", None)
    every = None
    if mode is not None:
        cost = engine.save(0, mode)
        if engine.store is not None and engine.store.pending is not None:
            cost.persist_s = engine.store.wait().seconds  # measure the background persist once, for tuning
        out.checkpoints += 1
        log({"event": "checkpoint", "iteration": 0, "mode": mode, "stall_s": cost.stall_s, "time_s": elapsed()})
    events = _Due(script)
    it = 0
    while it < ctx.iterations:
        due = events.pop(it, elapsed())
        joins = [e for e in due if e.kind == "join"]
        fails = [e for e in due if e.kind == "fail"]
        for event in joins:
            _membership(event, it, strategy, cluster, engine, out, log, elapsed)
        if out.status != "ok":
            break
        t0 = time.perf_counter()
        if fails:
            engine.run_iteration(it, stop_after=int(engine.ops_per_iteration() * ITERATION_EVENT_FRACTION))
            for event in fails:
                it = _membership(event, it, strategy, cluster, engine, out, log, elapsed)
                if out.status != "ok":
                    break
            if out.status != "ok":
                break
            continue
        result = engine.run_iteration(it)
        out.losses[it] = result.loss
        it += 1
        log({"event": "iteration", "iteration": it - 1, "loss": result.loss, "iteration_s": time.perf_counter() - t0,
             "time_s": elapsed(), "samples": it * ctx.global_batch, "plan": engine.plan.name})
        if progress is not None:
            progress(it)
        if mode is not None:
            if every is None:
                every = strategy.checkpoint_interval(time.perf_counter() - t0, cost.stall_s, cost.persist_s)
                log({"event": "checkpoint_interval", "every": every, "stall_s": cost.stall_s,
                     "persist_s": cost.persist_s})
            if it % every == 0 and it < ctx.iterations:
                cost = engine.save(it, mode)
                out.checkpoints += 1
                log({"event": "checkpoint", "iteration": it, "mode": mode, "stall_s": cost.stall_s,
                     "time_s": elapsed()})
    if engine.store is not None:
        engine.store.wait()
    out.iterations = it if out.status == "ok" else sum(1 for loss in out.losses if not math.isnan(loss))
    out.time_s = elapsed()
    return out


def _membership(event, it: int, strategy, cluster, engine: LocalEngine, out: LocalOutcome, log, elapsed) -> int:
    """Apply one failure or join and the strategy's recovery; returns the iteration to go on from."""
    if event.kind == "fail":
        if not cluster.is_alive(event.node):
            return it
        cluster.fail(event.node)
        out.failures += 1
        engine.destroy(cluster.workers_on(event.node))
        engine.abandon_iteration()
        engine.lose_unfinished_persist()
    else:
        cluster.join(event.node)
    t_event = elapsed()
    log({"event": event.kind, "node": event.node, "time_s": t_event, "iteration": it})
    recovery = strategy.on_event(event, cluster, it)
    if recovery.unrecoverable:
        out.status, out.error = "unrecoverable", recovery.unrecoverable
        log({"event": "unrecoverable", "time_s": t_event, "iteration": it, "reason": recovery.unrecoverable})
        return it
    if not recovery.actions and recovery.plan is None:
        return it
    t0 = time.perf_counter()
    try:
        restored = engine.perform(recovery.actions, recovery.plan or engine.plan, it)
    except UserError as err:
        out.status, out.error = err.status, str(err)
        log({"event": err.status, "time_s": elapsed(), "iteration": it, "reason": str(err)})
        return it
    restored = it if restored is None else restored
    record = {"time_s": t_event, "iteration": it, "recovery_s": time.perf_counter() - t0,
              "lost_iterations": it - restored, "restored_iteration": restored,
              "actions": [type(a).__name__ for a in recovery.actions], "plan": engine.plan.name,
              "shape": engine.plan.shape}
    out.recoveries.append(record)
    log({"event": "recovery", **record})
    return restored
