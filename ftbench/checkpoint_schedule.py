"""A strategy's periodic checkpoints on the run loop's clock: its tiers (ftbench.actions
.CheckpointTier), when saves are due, each tier's interval (recomputed for every new plan
from modelled or measured costs) and, on the modelled clock, when each checkpoint becomes
durable. Runs of iterations with their checkpoints advance in closed form (sim jumps).

A strategy keeps at most one tier in memory and one on storage, at most one of them tuned
(`every=None`: the strategy's `checkpoint_interval` picks it). Where several tiers are due
after the same iteration they save in the order the strategy lists them.

The tuned tier of a strategy with `checkpoint_after_change = True` (varuna) also saves right
after the first iteration that completes after each recovery (a restart, a morph): the job
saves once it has trained one iteration in its new shape, whatever the interval, so the next
failure never rolls back past it. That save is an ordinary one (same cost, same ledger);
where it falls on a multiple of the interval it is that checkpoint, not a second one. A
strategy's `save_s` (strategy.save_s), when set, is the modelled stall of the tuned tier's
saves."""
from __future__ import annotations

import math

from ftbench.actions import CHECKPOINT_MODES, HOST, MEMORY_MODES, STORAGE_MODES, CheckpointTier
from ftbench.recovery_costs import CheckpointLedger, SaveCost, save_cost


def checkpoint_tiers(strategy) -> tuple[CheckpointTier, ...]:
    """The strategy's tiers, checked against the contract (a TypeError names the breach: it
    is the strategy's code, not a setting, that is wrong)."""
    tiers = tuple(strategy.checkpoint_tiers())
    name = getattr(strategy, "name", type(strategy).__name__)
    for tier in tiers:
        if not isinstance(tier, CheckpointTier) or tier.mode not in CHECKPOINT_MODES:
            raise TypeError(f"strategy {name}: a checkpoint tier must be a CheckpointTier of a mode in "
                            f"{CHECKPOINT_MODES}, got {tier!r}")
        if tier.every is not None and (not isinstance(tier.every, int) or tier.every < 1):
            raise TypeError(f"strategy {name}: tier {tier.mode} saves every {tier.every!r} iterations; "
                            "give a whole number >= 1, or None for the tuned interval")
        if not isinstance(tier.group, int) or tier.group < 1 or (tier.group > 1 and tier.mode != HOST):
            raise TypeError(f"strategy {name}: tier {tier.mode} has group={tier.group!r}; a group of nodes "
                            f"(a whole number >= 1) is for the {HOST} tier only")
    for kind, modes in (("memory", MEMORY_MODES), ("storage", STORAGE_MODES)):
        if sum(t.mode in modes for t in tiers) > 1:
            raise TypeError(f"strategy {name}: at most one {kind} tier ({' or '.join(modes)}), got {tiers}")
    if sum(t.every is None for t in tiers) > 1:
        raise TypeError(f"strategy {name}: at most one tuned tier (every=None), got {tiers}")
    return tiers


def host_tier(strategy) -> CheckpointTier | None:
    """The strategy's HOST tier (host memory outside the processes), or None: the run's engine
    then needs its host memory (ftbench.engine.host_memory)."""
    return next((t for t in checkpoint_tiers(strategy) if t.mode == HOST), None)


def keeps_files(strategy) -> bool:
    """Whether the strategy writes checkpoint files (a storage tier): the run needs a store."""
    return any(t.mode in STORAGE_MODES for t in checkpoint_tiers(strategy))


class Tier:
    """One tier's schedule: its interval in force, the cost of one save (modelled, or the last
    measured one), and the ledger of when each of its checkpoints becomes durable."""

    def __init__(self, tier: CheckpointTier, save_s: float | None):
        self.mode, self.fixed, self.tuned = tier.mode, tier.every, tier.every is None
        self.save_s = save_s if self.tuned else None  # a paper's measured stall is the tuned tier's
        self.every: int | None = None  # unknown until the plan's iteration time is
        self.stall = self.persist = 0.0
        self.ledger = CheckpointLedger()
        self.measured = SaveCost(0.0, 0.0)  # wall clock: the last save's cost
        self.after_change: int | None = None  # the iteration after which the post-change save is due
        self._cost: tuple | None = None  # (plan, its modelled SaveCost): the last one asked for

    def modelled_cost(self, plan, cost_model) -> SaveCost:
        if self._cost is None or self._cost[0] is not plan:
            self._cost = (plan, save_cost(self.mode, plan, cost_model, self.save_s))
        return self._cost[1]

    def due(self, it: int) -> bool:
        return (self.every is not None and it % self.every == 0) or it == self.after_change

    def extra(self, it: int, end: int) -> int | None:
        """The post-change checkpoint when it falls in (it, end] off the interval's multiples."""
        at = self.after_change
        if at is None or not it < at <= end or (self.every is not None and at % self.every == 0):
            return None
        return at

    def saves(self, it: int, end: int) -> int:
        """Saves after iterations it+1..end."""
        if self.every is None:
            return 0
        return max(end // self.every - it // self.every, 0) + (self.extra(it, end) is not None)

    def newest(self, it: int, end: int) -> list[int]:
        """The newest few (3) of the saves after iterations it+1..end: all a restore can want."""
        if not self.saves(it, end):
            return []
        periodic = end // self.every - it // self.every
        last = end // self.every * self.every
        points = [last - k * self.every for k in range(min(periodic, 3))]
        extra = self.extra(it, end)
        if extra is not None:
            points.append(extra)
        return sorted(points)[-3:]


class Checkpoints:
    """The strategy's checkpoint tiers on the run loop's clock (see the module's docstring)."""

    def __init__(self, strategy, cost_model, iterations: int, log, modelled: bool):
        self.strategy, self.cost_model, self.iterations, self.log = strategy, cost_model, iterations, log
        self.modelled = modelled
        self.save_s: float | None = strategy.save_s
        self.tiers = [Tier(t, self.save_s) for t in checkpoint_tiers(strategy)]
        self.after_change_rule = bool(strategy.checkpoint_after_change)
        self.T = 0.0
        self._plan = None
        self._ledgers: dict[str, CheckpointLedger] = {t.mode: t.ledger for t in self.tiers}

    def ledger(self, mode: str) -> CheckpointLedger:
        """The ledger of the tier of `mode` (a recovery's SaveCheckpoint of a mode no tier keeps
        gets its own)."""
        ledger = self._ledgers.get(mode)
        if ledger is None:
            ledger = self._ledgers[mode] = CheckpointLedger()
        return ledger

    def drop_not_durable(self, t: float) -> list[int]:
        """A failure at time t: every tier's checkpoints not yet durable are gone (only a
        storage tier persists in the background, so they are its)."""
        return [i for ledger in self._ledgers.values() for i in ledger.drop_not_durable(t)]

    def recovered(self, restored: int) -> None:
        """A recovery resumed training at iteration `restored`: with the post-change rule, the
        tuned tier's checkpoint is due once iteration `restored` completes (replacing any
        still pending)."""
        if self.after_change_rule:
            for tier in self.tiers:
                if tier.tuned:
                    tier.after_change = restored + 1

    def saved(self, tier: Tier, iteration: int) -> None:
        """`tier` wrote a checkpoint after `iteration` iterations."""
        if tier.after_change is not None and iteration >= tier.after_change:
            tier.after_change = None

    def use(self, plan, T: float | None) -> None:
        """Continue with `plan`, whose iteration takes T seconds (None: not measured yet)."""
        if T is not None:
            self.T = T
        if not self.tiers or plan is self._plan or T is None:
            return
        self._plan = plan
        several = len(self.tiers) > 1
        for tier in self.tiers:
            cost = tier.modelled_cost(plan, self.cost_model) if self.modelled else tier.measured
            tier.stall, tier.persist = cost.stall_s, cost.persist_s
            tier.every = self.strategy.checkpoint_interval(T, cost.stall_s, cost.persist_s) if tier.tuned \
                else tier.fixed
            self.log({"event": "checkpoint_interval", "every": tier.every, "stall_s": cost.stall_s,
                      "persist_s": cost.persist_s, "plan": plan.name, **({"mode": tier.mode} if several else {})})

    def needs_measure(self, plan) -> bool:
        return bool(self.tiers) and plan is not self._plan

    def due(self, it: int) -> list[Tier]:
        """The tiers that save after iteration `it` (none after the run's last iteration): a
        multiple of a tier's interval, or the post-change checkpoint."""
        if it >= self.iterations:
            return []
        return [tier for tier in self.tiers if tier.due(it)]

    # -- closed form (jumping backends) --------------------------------------------------
    def span(self, it: int, n: int, t: float) -> float:
        """Seconds that n iterations from (it, t) take with their saves' stalls, and the waits
        of snapshots for the previous persist: one persist runs at a time (CheckFreq), so a
        snapshot due before it ends waits, as `persist_wait` does one save at a time."""
        end = min(it + n, self.iterations - 1)
        span = n * self.T
        counts = []
        for tier in self.tiers:
            counts.append(tier.saves(it, end))
            span += counts[-1] * tier.stall
        if len(self.tiers) == 1 and counts[0]:  # a persist runs only in snapshot mode, which has no
            tier = self.tiers[0]  # extra post-change save (varuna writes files)
            first = (it // tier.every + 1) * tier.every
            span += self.persist_wait(tier, t + (first - it) * self.T)
            span += (counts[0] - 1) * max(0.0, tier.persist - tier.every * self.T)  # steady state: the same each time
        elif len(self.tiers) > 1:
            span += sum(wait for _, _, wait, _ in self._persists(it, end, t))
        return span

    def _persists(self, it: int, end: int, t: float):
        """With several tiers: each save of a tier that persists in the background after
        iterations it+1..end, as (tier, iteration, its wait for the previous persist, when it
        becomes durable), one save at a time in the order they run."""
        for tier in self.tiers:
            if tier.persist <= 0.0 or tier.every is None or not tier.saves(it, end):
                continue
            order = self.tiers.index(tier)
            previous, waits = tier.ledger.last_durable, 0.0
            for at in range((it // tier.every + 1) * tier.every, end + 1, tier.every):
                # everything saved before it: every tier's saves after it+1..at-1, and at `at`
                # the tiers listed before it
                before = sum(other.saves(it, at - 1) * other.stall for other in self.tiers)
                before += sum(other.stall for other in self.tiers[:order] if other.due(at))
                start = t + (at - it) * self.T + before + waits
                wait = max(0.0, previous - start)
                waits += wait
                last = start + wait + tier.stall + tier.persist
                yield tier, at, wait, last
                previous = last

    def _saved_by(self, tier: Tier, at: int, it: int, t: float, waits: dict) -> float:
        """When the stall of `tier`'s save after iteration `at` ends, in a run from (it, t):
        iteration `at` ends, then the tiers due there save in order, each after its wait."""
        ends = t + self.span(it, at - 1 - it, t) + self.T
        for other in self.tiers[:self.tiers.index(tier) + 1]:
            if other.due(at):
                ends += waits.get((other.mode, at), 0.0) + other.stall
        return ends

    def persist_wait(self, tier: Tier, start: float) -> float:
        """How long a save of `tier` starting at `start` waits for its previous persist."""
        return max(0.0, tier.ledger.last_durable - start)

    def fit(self, it: int, t: float, t_limit: float, most: int) -> int:
        """The most iterations (<= most) that, with their checkpoint stalls, end by t_limit."""
        if math.isinf(t_limit):
            return most
        lo, hi = 0, most
        while lo < hi:  # the span grows with n: bisect
            mid = (lo + hi + 1) // 2
            if t + self.span(it, mid, t) <= t_limit * (1 + 1e-12):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance(self, it: int, t: float, n: int) -> tuple[float, int, list[tuple[Tier, int]]]:
        """n iterations from (it, t): end time, checkpoints written, and each tier's newest few
        of them as (tier, iteration), in the order they were saved."""
        end = min(it + n, self.iterations - 1)
        saves = sum(tier.saves(it, end) for tier in self.tiers)
        newest = sorted(((tier, at) for tier in self.tiers for at in tier.newest(it, end)),
                        key=lambda pair: (pair[1], self.tiers.index(pair[0])))
        # every span from the ledgers as they were at `it` (a new entry would make a save wait for itself)
        t_end = t + self.span(it, n, t)
        if len(self.tiers) == 1:
            durable = [t + self.span(it, at - it, t) + tier.persist for tier, at in newest]
        else:
            waits = {(tier.mode, at): wait for tier, at, wait, _ in self._persists(it, end, t)}
            durable = [self._saved_by(tier, at, it, t, waits) + tier.persist for tier, at in newest]
        for (tier, at), when in zip(newest, durable):
            tier.ledger.add(at, when)
        for tier in self.tiers:
            mine = [at for other, at in newest if other is tier]
            if mine:
                self.saved(tier, mine[-1])  # after the span: it counts the post-change checkpoint
        return t_end, saves, newest
