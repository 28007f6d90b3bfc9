"""One run, from a composed config to a run folder: metrics.jsonl, summary.json, gantt.png.

Backend-independent: it resolves the config, builds the cluster, failure script and
strategy, hands them to the backend, and writes the outputs. A user error (bad setting,
impossible plan, OOM) becomes `status` and `error` in summary.json, never a lost run.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from ftbench.assembly.sim import run_sim
from ftbench.calibrate import apply as calibrate
from ftbench.console import format_summary
from ftbench.errors import ConfigError, UserError
from ftbench.job import clock_of, common_fields, setup, totals
from ftbench.loss_plot import plot_loss_quietly
from ftbench.metrics import MetricsWriter, clean_stale_summaries, write_summary
from ftbench.progress_lines import ProgressLines
from ftbench.strategies import build_strategy
from ftbench.wandb_sink import WandbSink

# The local backend (ftbench/assembly/local.py: ftbench.engine, ftbench.checkpoint,
# ftbench.equivalence, models.data, models.gpt) imports torch and transformers: seconds. It
# is imported only when a local run starts, so --help, config errors and simulator runs never
# pay for it (tests/test_startup.py).
AVAILABLE_BACKENDS = ("sim", "local", "dist")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel, `kill`): handled like Ctrl-C, so the run folder keeps
    what was done."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _echo(text: str) -> None:
    """execute's default echo: print, and log to `ftbench.console`, which the CLI's job logging
    (conf/config.yaml) writes to the run folder's ftbench.log only; outside the CLI the record
    has no handler unless the caller configured logging."""
    print(text)
    logging.getLogger("ftbench.console").info(text)


def execute(cfg, run_dir: Path | str, wandb_group: str | None = None, echo=_echo,
            overrides: list[str] | None = None, swept: list[str] | None = None,
            cache_dir: Path | None = None) -> dict:
    """Run `cfg` into `run_dir` and return the summary (also written to summary.json).

    `overrides` (the Hydra task overrides `cfg` was composed with) and `swept` (the keys a
    --multirun sweep varies) are recorded in the summary for tables over runs. `cache_dir`
    (a sweep's folder) keeps what the sweep's jobs share: the calibration fits."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_summaries(run_dir)  # a run killed mid-write (SIGKILL) in this folder before
    summary = _base_summary(cfg, overrides, swept)
    started = time.perf_counter()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        with MetricsWriter(run_dir) as metrics:
            _execute(cfg, run_dir, wandb_group, summary, started, metrics, cache_dir, echo)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return summary


def _execute(cfg, run_dir: Path, wandb_group, summary: dict, started: float, metrics,
             cache_dir: Path | None = None, echo=_echo) -> None:
    sink, config_error = None, False
    try:
        table_strategy_settings(cfg, summary["overrides"], echo)
        calibration = calibrate(cfg, cache_dir)  # before the sink records the config: the fitted efficiency
        if calibration is not None:
            summary["calibration"] = calibration
            summary["efficiency"] = calibration["efficiency"]
        sink = WandbSink(cfg.wandb, run_dir, name=run_dir.name, job_type=str(cfg.strategy.name),
                         group=wandb_group, config=cfg)
        lines = ProgressLines.for_console(cfg.report, int(cfg.train.iterations), echo)

        def log(record: dict) -> None:
            metrics.log(record)
            sink.log(record)
            if lines is not None:
                lines.observe(record)

        try:
            if lines is not None:
                lines.start()
            summary.update(_run(cfg, run_dir, log, cache_dir))
        finally:
            if lines is not None:
                lines.stop()
        plot_loss_quietly(summary, run_dir)  # after the run: beside the reference it was checked against
    except UserError as err:
        config_error = isinstance(err, ConfigError)
        summary.update(status=err.status, error=str(err))
        metrics.log({"event": "error", "status": err.status, "error": str(err)})
    except BaseException as err:  # a bug, Ctrl-C or SIGTERM, not a user error: keep the evidence, re-raise
        interrupted = isinstance(err, KeyboardInterrupt)
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        outcome = getattr(err, "outcome", None)
        if outcome is not None:  # what the run loop had done when it stopped
            summary.update(totals(outcome, outcome.global_batch), global_batch=outcome.global_batch)
            if outcome.losses:
                summary["losses"] = outcome.losses
        summary.update(getattr(err, "results", None) or {})  # a whole run's results (dist), stopped in its check
        summary.update(status="interrupted" if interrupted else "error",
                       error=what if interrupted else f"{type(err).__name__}: {err}")
        if not interrupted:
            (run_dir / "error.txt").write_text(traceback.format_exc())
        metrics.log({"event": "error", "status": summary["status"], "error": summary["error"],
                     "iterations": summary["iterations"]})
        _finish(run_dir, summary, started, sink)
        err.run_dir = str(run_dir)  # for the CLI's one-line report
        raise
    _finish(run_dir, summary, started, sink, echo, config_error)


def _finish(run_dir: Path, summary: dict, started: float, sink, echo=None, config_error: bool = False) -> None:
    """Write summary.json, print the summary (`echo`), then close the W&B run: after the print,
    so that the run's console log in W&B ends with it."""
    summary["wall_s"] = time.perf_counter() - started
    summary["run_dir"] = str(run_dir)
    write_summary(run_dir, summary)
    if echo is not None:
        echo(format_summary(summary))
    if sink is not None:
        sink.finish(summary, config_error=config_error)


def _base_summary(cfg, overrides: list[str] | None = None, swept: list[str] | None = None) -> dict:
    """Summary keys known before anything runs, so even a config error leaves a full summary.
    `overrides`: the task overrides as given (`strategy.level=reroute`); `swept`: the keys of
    those a sweep varies (both [] when not given)."""
    return {"strategy": cfg.strategy.name, "backend": cfg.backend.name, "model": cfg.model.name,
            "hardware": cfg.hardware.name, "schedule": cfg.schedule.name, "dp": cfg.cluster.dp,
            "pp": cfg.cluster.pp, "microbatches": cfg.train.microbatches, "global_batch": cfg.train.global_batch,
            "iterations": 0, "samples": 0, "time_s": 0.0, "throughput": 0.0, "ettr": None, "productive_s": 0.0,
            "failures": 0,
            "recoveries": [], "peak_memory_bytes": [], "status": "error", "error": None, "seed": cfg.seed,
            "overrides": [str(o) for o in overrides or []], "swept": [str(k) for k in swept or []],
            **({"table": {"name": cfg.table.name, "column": cfg.table.column}} if cfg.table.name else {})}


def table_strategy_settings(cfg, overrides=(), echo=None) -> None:
    """A paper table's settings for this cell's system (`table.strategies.<name>`, e.g. Varuna's
    measured save time), merged into `strategy`: a table sets each system's own fields without
    making them settings of the others. A field given on the command line (`strategy.X=` in
    `overrides`, the task overrides) wins over the table's, and `echo` says so."""
    own = (cfg.table.get("strategies") or {}).get(str(cfg.strategy.name)) if cfg.table.name else None
    if own:
        from omegaconf import OmegaConf

        given = {str(o).lstrip("+~").split("=", 1)[0] for o in overrides}
        for key, value in own.items():
            if key not in cfg.strategy:
                raise ConfigError(f"table.strategies.{cfg.strategy.name}.{key}",
                                  f"strategy '{cfg.strategy.name}' has no setting '{key}'",
                                  f"use one of {', '.join(map(str, cfg.strategy.keys()))}")
            if f"strategy.{key}" in given:
                if echo is not None:
                    echo(f"ftbench: strategy.{key} from the command line wins over "
                         f"table.strategies.{cfg.strategy.name}.{key}")
                continue
            OmegaConf.update(cfg, f"strategy.{key}", value, merge=True)


def say_if_oversubscribed(ranks: int, launcher: str) -> bool:
    """dist on this machine with more worker processes than usable cores: say so once, at the
    start (its times then measure the cores' sharing as much as the strategy)."""
    from ftbench.threads import usable_cpus

    cores = usable_cpus()
    if launcher != "self" or ranks <= cores:
        return False
    print(f"ftbench: {ranks} dist ranks share {cores} usable core(s) on this machine: every process gets a "
          f"fraction of a core, so wall times measure the sharing too", file=sys.stderr)
    return True


def _run(cfg, run_dir: Path, log, shared_dir: Path | None = None) -> dict:
    ctx, cluster, script = setup(cfg, run_dir, shared_dir)
    if ctx.backend not in AVAILABLE_BACKENDS:
        raise ConfigError("backend", f"backend '{ctx.backend}' is not implemented yet",
                          f"use one of {', '.join(AVAILABLE_BACKENDS)}")
    if ctx.backend != "dist":
        from ftbench.distributed.launch import refuse_dist_settings  # imports no torch

        refuse_dist_settings(cfg)  # backend.kill and backend.stall would be ignored
    clock = clock_of(cfg)
    strategy = build_strategy(cfg.strategy, ctx)
    log({"event": "start", "clock": clock, "failures": script.description, "microbatches": ctx.microbatches,
         "global_batch": ctx.global_batch, "nodes": cluster.nodes})
    common = common_fields(ctx, script)
    if ctx.backend == "local":
        from ftbench.assembly.local import run_local  # imports torch (see above)
        return {**common, **run_local(cfg, ctx, strategy, cluster, script, run_dir, log, clock)}
    if ctx.backend == "dist":  # one process per worker (ftbench/distributed/launch.py)
        from ftbench.distributed.launch import run_dist

        say_if_oversubscribed(cluster.pp * cluster.dp, cfg.backend.get("launcher", "self"))
        return {**common, **run_dist(cfg, ctx, strategy, cluster, script, run_dir, log, clock)}
    return {**common, **run_sim(cfg, ctx, strategy, cluster, script, run_dir, log)}
