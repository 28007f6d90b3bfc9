"""The local backend's run: every worker in this process, real training (torch, transformers
GPT-2 blocks), checked against fault-free training at the end. Imported only for local runs
runs: torch and transformers take seconds (tests/test_startup.py)."""
from __future__ import annotations

from pathlib import Path

from ftbench.assembly.local_engine import local_engine
from ftbench.gantt import draw_run_gantt
from ftbench.job import Progress, totals
from ftbench.loop import run_loop
from ftbench.sim.cache import SimCache
from ftbench.threads import configure as configure_threads


def run_local(cfg, ctx, strategy, cluster, script, run_dir: Path, log, clock: str) -> dict:
    threads = configure_threads(cfg.backend, ctx.spec)  # before any torch work (ftbench/threads.py)
    from ftbench.engine.backend import LocalBackend
    from ftbench.engine.local import check_fits_host
    from ftbench.equivalence import divergence_error
    from ftbench.fault_free import check as check_fault_free
    from ftbench.models.gpt import save_pretrained

    check_fits_host(ctx, cfg.cluster.dp, cfg.backend.dtype)
    engine = local_engine(cfg, ctx, strategy, run_dir, log)
    # failure points (and the modelled clock's times)
    timelines = SimCache(ctx.cost_model, iteration_work=strategy.iteration_work)
    with Progress(ctx, cfg.report.progress, "training") as progress:
        measured = getattr(ctx.hardware, "provenance", None) is not None  # restart_s measured here, not assumed
        backend = LocalBackend(engine, realtime=clock == "wall", restart_s=ctx.hardware.restart_s if measured else 0.0)
        outcome = run_loop(ctx, strategy, cluster, script, backend, timelines,
                           log, progress, clock=clock)
    if outcome.first_timeline is not None and cfg.report.gantt:
        draw_run_gantt(outcome, timelines, run_dir, cfg, ctx, measured=engine.op_timer.timed)
    result = {**totals(outcome, ctx.global_batch, ctx.local_steps), "losses": outcome.losses, "clock": clock, "threads": threads,
              "peak_memory_bytes": [engine.peak_memory[w] for w in sorted(engine.peak_memory)],
              "peak_host_bytes_max": max(engine.peak_host.values(), default=0),
              "final_state": None, "matches_fault_free": None}
    if engine.boundary_log is not None:  # Swift: what the log held at most, then it goes (the run is over)
        engine.boundary_log.close(remove=True)
        result.update(log_peak_bytes=engine.boundary_log.peak_bytes, log_files=engine.boundary_log.files_written)
    if outcome.status == "ok":
        state = engine.final_state()
        result["final_state"] = str(save_pretrained(state, ctx.spec, run_dir / "final_model"))
        if cfg.report.check_fault_free and strategy.name != "none":
            try:  # float32: against a measured noise floor (ftbench/fault_free.py)
                result.update(check_fault_free(cfg, ctx, outcome.losses, state, progress=cfg.report.progress,
                                               ledger=result["ledger"]))
            except BaseException as err:  # Ctrl-C during the check: the summary is the run's, not the check's
                err.outcome = outcome
                raise
            difference = result["fault_free_difference"]
            log({"event": "equivalence", "matches_fault_free": difference is None, "difference": difference,
                 "difference_max": result["fault_free_difference_max"],
                 "noise_floor": result["fault_free_noise_floor"]})
            if difference is not None:  # the strategy trained another model: a harness or strategy bug
                result.update(status="diverged", error=divergence_error(difference, cfg.backend.dtype,
                                                                        result.get("plan_segments")))
    log({"event": "end", "status": outcome.status, "iterations": outcome.iterations, "time_s": outcome.time_s})
    return result
