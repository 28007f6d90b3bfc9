"""The per-stage normal form against the exact one (strategy.normalise=stage vs pipeline).

ReCycle plans one schedule per normal form of a failure configuration. `pipeline` renames
whole pipelines: two configurations share a plan when one is the other with pipelines
renumbered. `stage` keeps only the number of failed workers at each stage (the failed workers of
a stage hold the same weights as any of its peers, so which pipelines lost them is renamed away;
ftbench.planning.problem.normalise_stages): far fewer forms, and at scale one plan per count.

`check_grid` times both plans of every failure set of up to `failures` failed workers (one GPU
per node) in which every stage keeps a replica, each renamed onto the real workers by the
strategy and simulated with the fault-free slots as release times (the run's own timing).
Failure sets with the same pipeline normal form get the same pair of plans up to renaming
workers, and with every hop between nodes such plans time out alike (tested), so one set per
form is simulated unless `every_set`; the others are counted with it. The setups are the ReCycle
table's grids (pp 4 x dp 4 and pp 8 x dp 4).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ftbench.costs import PlanCosts
from ftbench.planning.problem import PlanningError, normalise, stage_form
from ftbench.sim.simulator import simulate

# The check's setups: the ReCycle table's (conf/experiment/recycle-table.yaml), one GPU per node:
# (model, pp, dp, micro-batches per pipeline).
SETUPS = (("gpt3-medium", 4, 4, 8), ("gpt3-3.35b", 4, 4, 8), ("gpt3-6.7b", 8, 4, 16))
HARDWARE = "recycle-testbed"


@dataclass
class GridCheck:
    model: str
    pp: int
    dp: int
    sets: int = 0  # failure sets covered
    simulated: int = 0  # failure sets whose two plans were simulated
    exact_forms: int = 0
    stage_forms: int = 0
    # (normalised / exact - 1, the failure set) of the most slowed and the most sped up
    worst: tuple[float, tuple] = (0.0, ())
    best: tuple[float, tuple] = (0.0, ())
    ratios: list[float] = field(default_factory=list, repr=False)  # per failure set
    # failure sets without a plan that fits in memory: (pipeline form's, per-stage form's) count
    no_plan: tuple[int, int] = (0, 0)
    mismatched: list = field(default_factory=list)  # sets where only one of the two has a plan


def failure_sets(pp: int, dp: int, failures: int):
    """Every set of 1..`failures` failed (pipeline, stage) positions that leaves each stage a replica."""
    positions = [(d, s) for d in range(dp) for s in range(pp)]
    for k in range(1, failures + 1):
        for combo in itertools.combinations(positions, k):
            failed = set(combo)
            if all(any((d, s) not in failed for d in range(dp)) for s in range(pp)):
                yield failed


def _strategy(model: str, pp: int, dp: int, m: int, by: str, overrides=()):
    from ftbench.cli import compose
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.strategies import build_strategy

    cfg = compose(["backend=sim", f"model={model}", f"hardware={HARDWARE}", "cluster.gpus_per_node=1",
                   f"cluster.pp={pp}", f"cluster.dp={dp}", f"train.microbatches={m}", "strategy=recycle",
                   "strategy.plan_cache=null", "strategy.plan_ahead=0", f"strategy.normalise={by}", *overrides])
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    return strategy, cluster, ctx


def _time(strategy, cluster, ctx, failed) -> float | None:
    """The iteration time of the strategy's plan for `failed` (None: no plan fits in memory)."""
    strategy.failed = set(failed)
    try:
        plan = strategy._plan_for(cluster)
    except PlanningError:
        return None
    return simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer).iteration_time


def check_grid(model: str, pp: int, dp: int, m: int, failures: int = 3, every_set: bool = False, sample=None,
               overrides=()) -> GridCheck:
    """Both plans of every failure set on a pp x dp grid of `model` with m micro-batches per
    pipeline (see the module docstring); `sample`: only the failure sets it keeps (a callable on
    the list of sets, for fast tests)."""
    exact, _, ctx = _strategy(model, pp, dp, m, "pipeline", overrides)
    staged, cluster, _ = _strategy(model, pp, dp, m, "stage", overrides)
    # One library for both (the same problem: the same plans, each made once), ranking a per-stage
    # form's layouts as the staged strategy does.
    exact.library.rank, staged.library = staged.library.rank, exact.library
    sets = list(failure_sets(pp, dp, failures))
    if sample is not None:
        sets = sample(sets)
    out = GridCheck(model, pp, dp, sets=len(sets))
    timed: dict = {}
    stage_forms = set()
    for failed in sets:
        form = normalise(failed, dp, pp)[0]
        stage_forms.add(stage_form(failed, pp))
        key = tuple(sorted(failed)) if every_set else form
        if key not in timed:
            timed[key] = (_time(staged, cluster, ctx, failed), _time(exact, cluster, ctx, failed))
            out.simulated += 1
        normalised, plain = timed[key]
        if normalised is None or plain is None:
            out.no_plan = (out.no_plan[0] + (plain is None), out.no_plan[1] + (normalised is None))
            if (normalised is None) != (plain is None):
                out.mismatched.append(tuple(sorted(failed)))
            continue
        ratio = normalised / plain - 1.0
        out.ratios.append(ratio)
        if ratio > out.worst[0]:
            out.worst = (ratio, tuple(sorted(failed)))
        if ratio < out.best[0]:
            out.best = (ratio, tuple(sorted(failed)))
    out.exact_forms = len({normalise(f, dp, pp)[0] for f in sets})
    out.stage_forms = len(stage_forms)
    return out


def check(setups=SETUPS, **kwargs) -> list[GridCheck]:
    """check_grid of every setup."""
    return [check_grid(*setup, **kwargs) for setup in setups]


def summary(checks: list[GridCheck]) -> str:
    """One line per grid, as the scale benchmark prints it: per-stage plan / pipeline plan - 1."""
    lines = []
    for c in checks:
        slower = sum(r > 0.02 for r in c.ratios)
        faster = sum(r < -0.02 for r in c.ratios)
        none = f"; no plan fits {c.no_plan[0]} / {c.no_plan[1]} sets" if any(c.no_plan) else ""
        lines.append(f"  {c.model} pp {c.pp} x dp {c.dp}: {c.sets:,} sets ({c.exact_forms} pipeline forms, "
                     f"{c.stage_forms} per-stage forms): worst {100 * c.worst[0]:+.2f} %, best {100 * c.best[0]:+.2f} % "
                     f"{list(c.best[1])}; {slower} sets more than 2 % slower, {faster} more than 2 % faster{none}")
    return "\n".join(lines)
