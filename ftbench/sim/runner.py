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
from ftbench.outcome import RunOutcome
from ftbench.plan import Plan
from ftbench.schedule import check_coverage
from ftbench.actions import RestoreCheckpoint, SaveCheckpoint
from ftbench.recovery_costs import CheckpointLedger, action_seconds, save_cost
from ftbench.sim.simulator import SimResult, simulate

# A failure scripted "at iteration k" strikes this far into iteration k.
from ftbench.failures import ITERATION_EVENT_FRACTION  # noqa: E402


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
            result = simulate(plan.schedule, PlanCosts(self.cost_model, plan), staggered=plan.staggered_optimizer)
            self.simulations += 1
            if self.enabled:
                self._results[key] = result
        self._by_id[id(plan)] = (plan, result)
        return result

    @property
    def distinct_plans(self) -> int:
        return len(self._results) if self.enabled else self.simulations


@dataclass
class SimOutcome(RunOutcome):
    peak_memory_bytes: dict[int, float] = field(default_factory=dict)
    first_result: SimResult | None = None


class _Events:
    """Merges iteration-scripted and time-ordered events as the run reaches them."""

    def __init__(self, script: FailureScript):
        self.by_iteration = list(script.by_iteration)
        self.by_time = iter(script.by_time)
        self._next_timed = next(self.by_time, None)

    def next_timed(self, t: float) -> float:
        """When the next time-ordered event strikes (not before t); inf when none is left."""
        return max(self._next_timed.time_s, t) if self._next_timed is not None else math.inf

    def next_iteration(self) -> int | None:
        """The iteration during which the next iteration-scripted event strikes."""
        return self.by_iteration[0].iteration if self.by_iteration else None

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
    ckpt = _Checkpointing(strategy, ctx.cost_model, ctx.iterations, log)
    t, it = ckpt.save_initial(plan), 0
    while it < ctx.iterations and t < horizon:
        result = cache(plan)
        if out.first_result is None:
            out.first_result = result
        if not _fits_memory(result, ctx, out, log, t, it):
            break
        T = result.iteration_time
        if T <= 0:
            raise ValueError(f"plan {plan.name!r} has a zero iteration time")
        ckpt.use(plan, T)
        t_timed, k = events.next_timed(t), events.next_iteration()
        limit = ctx.iterations - it if k is None else min(ctx.iterations - it, max(k - it, 0))
        # Whole iterations (with the checkpoints among them) that finish before the next event.
        n = ckpt.fit(it, t, min(t_timed, horizon), limit)
        if n > 0:
            t_end, saved = ckpt.advance(it, t, n)
            log({"event": "iterations", "first": it, "last": it + n - 1, "count": n, "iteration_time_s": T,
                 "checkpoints": saved, "time_s": t_end, "samples": (it + n) * ctx.global_batch, "plan": plan.name})
            it, t = it + n, t_end
            if progress is not None:
                progress(it)
        if it >= ctx.iterations:
            break
        step = ckpt.span_of_next(it)  # the next iteration and the checkpoint after it, if any
        t_event = min(t_timed, t + ITERATION_EVENT_FRACTION * T if k is not None and it >= k else math.inf)
        if t_event < min(t + step, horizon):
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
        elif t + step > horizon:
            break  # the next iteration would not finish before train.max_hours
    out.iterations, out.time_s = it, t
    return out


class _Checkpointing:
    """The strategy's periodic checkpoints: after every `every`-th iteration training stalls
    for the save; the file becomes usable `persist_s` later. Runs of iterations with their
    checkpoints are advanced in closed form, so long runs stay one jump per event."""

    def __init__(self, strategy, cost_model, iterations: int, log):
        self.strategy, self.cost_model, self.iterations, self.log = strategy, cost_model, iterations, log
        self.mode = getattr(strategy, "checkpoint_mode", None)
        self.ledger = CheckpointLedger()
        self.every, self.stall, self.persist, self.T = 2**62, 0.0, 0.0, 0.0
        self._plan = None

    def save_initial(self, plan) -> float:
        """The checkpoint before the first iteration (what a restart before any other reloads)."""
        if self.mode is None:
            return 0.0
        cost = save_cost(self.mode, plan, self.cost_model)
        self.ledger.add(0, cost.stall_s + cost.persist_s)
        return cost.stall_s

    def use(self, plan, T: float) -> None:
        self.T = T
        if self.mode is None or plan is self._plan:
            return
        cost = save_cost(self.mode, plan, self.cost_model)
        self.stall, self.persist, self.T, self._plan = cost.stall_s, cost.persist_s, T, plan
        self.every = self.strategy.checkpoint_interval(T, cost.stall_s, cost.persist_s)
        self.log({"event": "checkpoint_interval", "every": self.every, "stall_s": cost.stall_s,
                  "persist_s": cost.persist_s})

    def _saves(self, it: int, n: int) -> int:
        """Checkpoints after iterations it+1 .. it+n (none after the last iteration of the run)."""
        end = min(it + n, self.iterations - 1)
        return max(end // self.every - it // self.every, 0) if self.mode is not None else 0

    def _span(self, it: int, n: int) -> float:
        return n * self.T + self._saves(it, n) * self.stall

    def span_of_next(self, it: int) -> float:
        return self._span(it, 1)

    def fit(self, it: int, t: float, t_limit: float, most: int) -> int:
        """The most iterations (<= most) that, with their checkpoint stalls, end by t_limit."""
        if math.isinf(t_limit):
            return most
        lo, hi = 0, most
        while lo < hi:  # the span grows with n: bisect
            mid = (lo + hi + 1) // 2
            if t + self._span(it, mid) <= t_limit * (1 + 1e-12):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance(self, it: int, t: float, n: int) -> tuple[float, int]:
        """Run n iterations from (it, t): the end time and how many checkpoints were written."""
        saves = self._saves(it, n)
        if saves:
            last = min(it + n, self.iterations - 1) // self.every * self.every
            for k in range(max(saves - 3, 0), saves):  # the newest few are all a restore can want
                at = last - (saves - 1 - k) * self.every
                self.ledger.add(at, t + self._span(it, at - it) + self.persist)
        return t + self._span(it, n), saves


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
        cost = action_seconds(action, plan, new, ctx.cost_model)
        if isinstance(action, SaveCheckpoint):
            ckpt.ledger.add(it, t + seconds + cost)
        if isinstance(action, RestoreCheckpoint):
            # After a failure, a persist still running when it struck is lost; a join restores
            # what the recovery itself just saved.
            restored = ckpt.ledger.restorable(t if event.kind == "fail" else t + seconds)
        seconds += cost
    record = {"time_s": t, "iteration": it, "recovery_s": seconds, "lost_iterations": it - restored,
              "restored_iteration": restored, "actions": [type(a).__name__ for a in recovery.actions],
              "plan": new.name, "shape": new.shape}
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
