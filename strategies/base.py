"""The strategy contract: a strategy is a plan for the current membership plus the recovery
actions it takes when membership changes. Backends execute both; they hold no strategy logic.

A strategy is one module and one YAML file (conf/strategy/<name>.yaml): a subclass of
`Strategy` registered with `@register`, its settings as a `StrategyConfig` dataclass beside it
(`config`), and the settings the suite's own checks run it with (`tests`). The registry, the
Hydra schemas, conformance, the seeded random failure scripts and the docs tests are all
derived from the registration (docs/extending.md)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ftbench.actions import CheckpointTier, Recovery
from ftbench.cluster import ClusterView
from ftbench.failures import FailureEvent
from ftbench.plan import Plan

__all__ = ["REGISTRY", "Recovery", "Strategy", "StrategyConfig", "StrategyTests", "register"]


@dataclass
class StrategyConfig:
    """A strategy's settings (`strategy.*`); each strategy's schema extends this with its own
    fields only, so a setting of one strategy is refused on another."""
    name: str = "none"  # the strategy, a key of the registry


@dataclass(frozen=True)
class StrategyTests:
    """How the suite's own checks run a strategy on their small gpt-tiny setups.

    `conformance`: settings for the sim/local/dist conformance matrix (pp 2 x dp 3, 8
    iterations, one GPU per node); `conformance_scripts`: its scripts in CI ("one failure" in
    the default test tier, the others in `-m extended`; the rest run in `-m full`); `random`: draws the strategy's settings for a seeded random
    failure script, `random(rng, setup)` with `setup` the case's facts (pp, dp, gpus, nodes,
    microbatches) -> overrides; None: not in the random scripts (say why in `left_out`);
    `dist`: settings for the dist chaos trials (benchmarks/dist_chaos.py)."""
    conformance: tuple[str, ...] = ()
    conformance_scripts: tuple[str, ...] = ("one failure",)
    random: Callable[[random.Random, dict], list[str]] | None = field(default=lambda rng, setup: [])
    left_out: str = ""
    dist: tuple[str, ...] = ()


class Strategy:
    """Subclass this, set `name` and `config`, implement `plan` and `on_event`, and register the
    class (`@register`). Every other hook has a default that means "this mechanism is not used"."""

    name: ClassVar[str]  # strategy=<name>
    config: ClassVar[type] = StrategyConfig  # its settings' schema (a StrategyConfig)
    tests: ClassVar[StrategyTests] = StrategyTests()  # how the suite's checks run it
    # Periodic checkpoints of one tier: FILE | SNAPSHOT | MEMORY (ftbench.actions), or None for
    # none. With a mode, the run loop asks `checkpoint_interval` and saves through the backend.
    # Several tiers: override `checkpoint_tiers` instead.
    checkpoint_mode: str | None = None
    # The tuned tier (every=None): also checkpoint right after the first iteration that
    # completes after each recovery (Varuna).
    checkpoint_after_change: bool = False
    # The tuned tier: the modelled stall of every save, in seconds (a measured figure from a
    # paper), or None to model it from the checkpoint's bytes.
    save_s: float | None = None
    # With a checkpoint mode: iterations between checkpoints, or None when tuned
    # (checkpoint_interval); dist's fault injection reads it to strike inside a save.
    every: int | None = None
    # Whether every step trains the whole global batch. False: a step may go on without some
    # replicas' samples (torchft), which the samples ledger records (ftbench.samples).
    keeps_global_batch: ClassVar[bool] = True
    # Whether it can run LocalSGD or DiLoCo (train.data_parallel, ftbench.local_sgd), where the
    # replicas of a stage differ between syncs: a strategy whose checkpoints or copies take one
    # replica per stage for all of them cannot.
    trains_local_steps: ClassVar[bool] = False
    # Under LocalSGD or DiLoCo: whether a failure leaves the replica groups it does not touch
    # alone. They finish the iteration's local step and its sync among themselves, as nothing
    # ties one group to another between syncs, and the strategy recovers at the iteration's
    # end (torchft; RunLoop._finish_without). False: the iteration is undone and redone.
    finishes_local_step: ClassVar[bool] = False
    # A folder inside the run folder where the strategy's own files go (Swift's boundary logs),
    # or None.
    log_dir: str | None = None
    # extra_memory(plan) -> ({worker: device bytes} or None, host bytes at most): what the
    # mechanism keeps beyond training state, checked against memory on sim (Swift's undo
    # gradient, a snapshot in host memory); None: nothing.
    extra_memory: Callable[[Plan], tuple[dict | None, float]] | None = None
    # memory_breakdown(plan, worker, peak) -> the worker's memory in words for an `oom`
    # message (Bamboo); None: the generic state + activations split.
    memory_breakdown: Callable[[Plan, int, float], str] | None = None
    # resume(cluster, iteration) -> Recovery: after a wait for nodes (Recovery(wait=True)),
    # the recovery onto the live nodes, or raise TooFewNodes while they are still too few;
    # None: the strategy never waits (too few nodes ends the run).
    resume: Callable[[ClusterView, int], Recovery] | None = None

    def __init__(self, cfg: Any, ctx: Any):
        self.cfg, self.ctx = cfg, ctx

    @staticmethod
    def sized_by_membership(cfg: Any) -> bool:
        """Whether the strategy builds its job from the live nodes rather than the configured
        pp x dp grid (with these settings): on a trace it then needs no grid at the start."""
        return False

    @classmethod
    def check_settings(cls, cfg: Any) -> None:
        """Refuse settings its schema accepts but this run would ignore (ConfigError)."""

    def plan(self, cluster: ClusterView) -> Plan:
        """The plan for the cluster's current membership."""
        raise NotImplementedError(f"strategy {self.name} has no plan()")

    def on_event(self, event: FailureEvent, cluster: ClusterView, iteration: int) -> Recovery:
        """React to a failure or join that the cluster already reflects (a read-only view)."""
        raise NotImplementedError(f"strategy {self.name} has no on_event()")

    def checkpoint_tiers(self) -> tuple[CheckpointTier, ...]:
        """The checkpoints the strategy keeps, saved in this order where several are due after
        the same iteration: at most one tier in memory (MEMORY) and one on storage (FILE or
        SNAPSHOT), at most one tuned (every=None). Default: one tuned tier of
        `checkpoint_mode`, or none."""
        return () if self.checkpoint_mode is None else (CheckpointTier(self.checkpoint_mode),)

    def iteration_work(self, plan: Plan) -> tuple:
        """What the mechanism does in every iteration of `plan` beyond training, as data
        (ftbench.actions.ITERATION_WORK: Swift's LogBoundaries): the modelled clock charges it
        in the plan's iteration time, `local` and `dist` perform it. A function of the plan
        alone (timings are memoised per plan). Default: nothing."""
        return ()

    def checkpoint_interval(self, iteration_s: float, stall_s: float, persist_s: float) -> int:
        """The tuned checkpoint tier's iterations between checkpoints, given the measured
        (local, dist) or modelled (sim) iteration time, save stall and background persist."""
        raise NotImplementedError(f"strategy {self.name} has checkpoint_mode {self.checkpoint_mode!r} "
                                  "but no checkpoint_interval()")


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make `cls` the strategy `strategy=<cls.name>`."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"{cls!r} is not a subclass of ftbench.strategies.base.Strategy")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"strategy {cls.__name__} has no name")
    if not (isinstance(cls.config, type) and issubclass(cls.config, StrategyConfig)):
        raise TypeError(f"strategy {name}: config must be a StrategyConfig dataclass, got {cls.config!r}")
    if cls.config().name != name:
        raise TypeError(f"strategy {name}: its config's default name is {cls.config().name!r}")
    other = REGISTRY.get(name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise TypeError(f"two strategies named {name}: {other.__module__}.{other.__qualname__} and "
                        f"{cls.__module__}.{cls.__qualname__}")
    REGISTRY[name] = cls
    return cls

