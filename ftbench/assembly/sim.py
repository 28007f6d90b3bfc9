"""The sim backend's run: the run loop on the modelled clock over the memoised simulator."""
from __future__ import annotations

from pathlib import Path

from ftbench.gantt import draw_run_gantt
from ftbench.errors import UserError
from ftbench.job import Progress, clock_of, common_fields, setup, totals
from ftbench.loop import run_loop, shared_cores_iteration
from ftbench.sim.backend import SimBackend
from ftbench.sim.cache import SimCache
from ftbench.strategies import build_strategy


def run_sim(cfg, ctx, strategy, cluster, script, run_dir: Path, log) -> dict:
    cache = SimCache(ctx.cost_model, enabled=cfg.backend.memoize, iteration_work=strategy.iteration_work)
    with Progress(ctx, cfg.report.progress, "simulating") as progress:
        backend = SimBackend(ctx, strategy.extra_memory, strategy.memory_breakdown)
        outcome = run_loop(ctx, strategy, cluster, script, backend, cache, log, progress)
    first = outcome.first_timeline
    if first is not None and cfg.report.gantt:
        draw_run_gantt(outcome, cache, run_dir, cfg, ctx)
    log({"event": "end", "status": outcome.status, "iterations": outcome.iterations, "time_s": outcome.time_s})
    return {
        **totals(outcome, ctx.global_batch, ctx.local_steps),
        "peak_memory_bytes": [int(outcome.peak_memory_bytes[w]) for w in sorted(outcome.peak_memory_bytes)],
        "peak_host_bytes_max": backend.peak_host,
        "iteration_time_s": shared_cores_iteration(first, ctx.hardware.cores) if first else None,
        "bubble_fraction": first.bubble_fraction() if first else None,
        "plans_simulated": cache.distinct_plans,
    }


def simulate(cfg, run_dir: Path) -> dict:
    """A sim run of `cfg` without metrics files or W&B (calibration, planners' what-ifs): the
    summary's totals, with `status` and `error` also for settings that cannot run."""
    try:
        ctx, cluster, script = setup(cfg, run_dir)
        clock_of(cfg)  # the simulator has only the modelled clock
        strategy = build_strategy(cfg.strategy, ctx)
        return {**common_fields(ctx, script),
                **run_sim(cfg, ctx, strategy, cluster, script, run_dir, lambda record: None)}
    except UserError as err:
        return {"status": err.status, "error": str(err), "throughput": 0.0}
