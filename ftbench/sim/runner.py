"""A whole simulated run: jump from one membership event to the next.

Between events the plan does not change, so every iteration takes the plan's (memoised)
iteration time and the run advances by whole iterations at once; that is what makes
simulating weeks of training on thousands of GPUs take seconds. An event loses the
iteration in flight; the strategy's recovery then says what else is lost and what plan
comes next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ftbench.cluster import Cluster
from ftbench.costs import PlanCosts
from ftbench.failures import FailureEvent, FailureScript
from ftbench.plan import Plan
from ftbench.schedule import check_coverage
from ftbench.actions import RestoreCheckpoint, SaveCheckpoint
from ftbench.sim.recovery import CheckpointLedger, action_seconds, save_cost
from ftbench.sim.simulator import SimResult, simulate

# A failure scripted "at iteration k" strikes this far into iteration k.
ITERATION_EVENT_FRACTION = 0.5


class SimCache:
    """Memoises the simulation of each distinct plan."""

    def __init__(self, cost_model, enabled: bool = True):
        self.cost_model, self.enabled = cost_model, enabled
        self._results: dict[tuple, SimResult] = {}
        self._by_id: dict[int, tuple[Plan, SimResult]] = {}
        self.simulations = 0

    def __call__(self, plan: Plan) -> SimResult:
        hit = self._by_id.get(id(plan))
        if self.enabled and hit is not None and hit[0] is plan:
            return hit[1]
        key = plan.key() if self.enabled else None
        result = self._results.get(key) if self.enabled else None
        if result is None:
            check_coverage(plan.schedule)  # a strategy's plan must train every micro-batch once
            result = simulate(plan.schedule, PlanCosts(self.cost_model, plan))
            self.simulations += 1
            if self.enabled:
                self._results[key] = result
        self._by_id[id(plan)] = (plan, result)
        return result

    @property
    def distinct_plans(self) -> int:
        return len(self._results) if self.enabled else self.simulations


@dataclass
class SimOutcome:
    status: str = "ok"
    error: str | None = None
    iterations: int = 0
    time_s: float = 0.0
    failures: int = 0
    recoveries: list[dict] = field(default_factory=list)
    peak_memory_bytes: dict[int, float] = field(default_factory=dict)
    first_result: SimResult | None = None


class _Events:
    """Merges iteration-scripted and time-ordered events as the run reaches them."""

    def __init__(self, script: FailureScript):
        self.by_iteration = list(script.by_iteration)
        self.by_time = iter(script.by_time)
        self._next_timed = next(self.by_time, None)

    def next_time(self, t: float, iteration: int, iteration_time: float) -> float:
        candidates = [math.inf]
        if self._next_timed is not None:
            candidates.append(max(self._next_timed.time_s, t))
        if self.by_iteration:
            k = self.by_iteration[0].iteration
            candidates.append(t + max(k - iteration + ITERATION_EVENT_FRACTION, 0.0) * iteration_time)
        return min(candidates)

    def pop(self, t_event: float) -> FailureEvent:
        if self._next_timed is not None and self._next_timed.time_s <= t_event:
            event, self._next_timed = self._next_timed, next(self.by_time, None)
            return event
        return self.by_iteration.pop(0)


def run_simulation(ctx, strategy, cluster: Cluster, script: FailureScript, cache: SimCache,
                   log, progress=None) -> SimOutcome:
    """Drive `strategy` through `script` on the simulator. `log(record)` gets every metrics line."""
    out = SimOutcome()
    horizon = ctx.max_hours * 3600.0 if ctx.max_hours is not None else math.inf
    events = _Events(script)
    plan = strategy.plan(cluster)
    ckpt = _Checkpointing(strategy, ctx.cost_model, log)
    t, it = ckpt.save(plan, 0, 0.0), 0
    while it < ctx.iterations and t < horizon:
        result = cache(plan)
        if out.first_result is None:
            out.first_result = result
        if not _fits_memory(result, ctx, out, log, t, it):
            break
        T = result.iteration_time
        if T <= 0:
            raise ValueError(f"plan {plan.name!r} has a zero iteration time")
        t_event = events.next_time(t, it, T)
        n = min(ctx.iterations - it, _whole(t_event - t, T), _whole(horizon - t, T), ckpt.until_next(plan, it, T))
        if n > 0:
            log({"event": "iterations", "first": it, "last": it + n - 1, "count": n, "iteration_time_s": T,
                 "time_s": t + n * T, "samples": (it + n) * ctx.global_batch, "plan": plan.name})
            it, t = it + n, t + n * T
            if progress is not None:
                progress(it)
        if it >= ctx.iterations:
            break
        if ckpt.due(it):
            t = ckpt.save(plan, it, t)
            continue
        if t_event < min(t + T, horizon):
            event = events.pop(t_event)
            if event.kind == "join":
                # A join takes effect at the next iteration boundary; no work is lost.
                if it < ctx.iterations and t + T <= horizon:
                    log({"event": "iterations", "first": it, "last": it, "count": 1, "iteration_time_s": T,
                         "time_s": t + T, "samples": (it + 1) * ctx.global_batch, "plan": plan.name})
                    it, t = it + 1, t + T
                t = max(t, t_event)
            else:
                t = max(t, t_event)  # the event strikes during iteration `it`: that iteration's work is lost
            new_plan, it, t = _membership_change(event, strategy, cluster, ctx, out, log, t, it, plan, ckpt)
            plan = new_plan or plan
            if out.status != "ok":
                break
        elif t + T > horizon:
            break  # the next iteration would not finish before train.max_hours
    out.iterations, out.time_s = it, t
    return out


class _Checkpointing:
    """Periodic checkpoints of the strategy: when they happen, what they cost, which are durable."""

    def __init__(self, strategy, cost_model, log):
        self.strategy, self.cost_model, self.log = strategy, cost_model, log
        self.mode = getattr(strategy, "checkpoint_mode", None)
        self.ledger = CheckpointLedger()
        self.every: int | None = None
        self.last_saved: int | None = None
        self._plan = None

    def until_next(self, plan, it: int, T: float) -> int:
        if self.mode is None:
            return 2**62
        if self.every is None or plan is not self._plan:
            cost = save_cost(self.mode, plan, self.cost_model)
            self.every = self.strategy.checkpoint_interval(T, cost.stall_s, cost.persist_s)
            self._plan = plan
            self.log({"event": "checkpoint_interval", "every": self.every})
        return (it // self.every + 1) * self.every - it

    def due(self, it: int) -> bool:
        return (self.mode is not None and self.every is not None and it % self.every == 0
                and it != self.last_saved)

    def save(self, plan, it: int, t: float) -> float:
        """Charge a checkpoint after iteration `it`; returns the time training resumes."""
        if self.mode is None:
            return t
        cost = save_cost(self.mode, plan, self.cost_model)
        resume = t + cost.stall_s
        self.last_saved = it
        self.ledger.add(it, resume + cost.persist_s)
        self.log({"event": "checkpoint", "iteration": it, "mode": self.mode, "stall_s": cost.stall_s,
                  "persist_s": cost.persist_s, "time_s": resume})
        return resume


def _whole(span: float, T: float) -> int:
    """Whole iterations of length T that end within `span` (robust to float rounding)."""
    if math.isinf(span):
        return 2**62
    return max(int(math.floor(span / T + 1e-9)), 0) if T > 0 else 2**62


def _membership_change(event, strategy, cluster, ctx, out, log, t, it, plan, ckpt):
    """Apply an event and charge the strategy's recovery; returns (plan or None, iteration, time)."""
    if event.kind == "fail":
        if not cluster.is_alive(event.node):
            return None, it, t  # already down: nothing changes
        cluster.fail(event.node)
        out.failures += 1
    else:
        cluster.join(event.node)
    log({"event": event.kind, "node": event.node, "time_s": t, "iteration": it})
    recovery = strategy.on_event(event, cluster, it)
    if recovery.unrecoverable:
        out.status, out.error = "unrecoverable", recovery.unrecoverable
        log({"event": "unrecoverable", "time_s": t, "iteration": it, "reason": recovery.unrecoverable})
        return None, it, t
    if not recovery.actions:
        return recovery.plan, it, t
    new = recovery.plan or plan
    seconds, restored = 0.0, it
    for action in recovery.actions:
        if isinstance(action, SaveCheckpoint):
            ckpt.ledger.add(it, t + seconds)
        if isinstance(action, RestoreCheckpoint):
            restored = ckpt.ledger.restorable(t + seconds)
            ckpt.last_saved = restored  # resuming from it: no need to write it again
        seconds += action_seconds(action, plan, new, ctx.cost_model)
    record = {"time_s": t, "iteration": it, "recovery_s": seconds, "lost_iterations": it - restored,
              "restored_iteration": restored, "actions": [type(a).__name__ for a in recovery.actions],
              "plan": new.name}
    out.recoveries.append(record)
    log({"event": "recovery", **record})
    return recovery.plan, restored, t + seconds


def _fits_memory(result: SimResult, ctx, out: SimOutcome, log, t: float, it: int) -> bool:
    for w, peak in result.peak_memory_bytes.items():
        out.peak_memory_bytes[w] = max(out.peak_memory_bytes.get(w, 0.0), peak)
    capacity = ctx.cost_model.memory_bytes
    worker, peak = max(result.peak_memory_bytes.items(), key=lambda kv: kv[1])
    if peak <= capacity:
        return True
    out.status = "oom"
    out.error = (f"out of memory: worker {worker} needs {peak / 1e9:.1f} GB (weights, gradients and Adam state "
                 f"{(peak - result.peak_activation_bytes[worker]) / 1e9:.1f} GB + stashed activations "
                 f"{result.peak_activation_bytes[worker] / 1e9:.1f} GB) but hardware={ctx.hardware.name} has "
                 f"{ctx.hardware.memory_gb:g} GB; raise cluster.pp, lower train.microbatch_size or pick a larger GPU")
    log({"event": "oom", "time_s": t, "iteration": it, "worker": worker, "bytes": peak})
    return False
