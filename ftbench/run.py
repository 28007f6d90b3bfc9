"""One run, from a composed config to a run folder: metrics.jsonl, summary.json, gantt.png.

Backend-independent: it resolves the config, builds the cluster, failure script and
strategy, hands them to the backend, and writes the outputs. A user error (bad setting,
impossible plan, OOM) becomes `status` and `error` in summary.json, never a lost run.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ftbench.calibrate import apply as calibrate
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.errors import ConfigError, UserError
from ftbench.failures import build_failure_script
from ftbench.folders import inside
from ftbench.progress_lines import ProgressLines
from ftbench.metrics import MetricsWriter, WandbSink, clean_stale_summaries, ettr, write_summary
from ftbench.report import format_summary, plot_gantt, plot_gantt_panels
from ftbench.actions import FILE, SNAPSHOT
from ftbench.failures import FailureScript
from ftbench.loop import CLOCKS, run_loop, shared_cores_iteration
from ftbench.sim.backend import SimBackend
from ftbench.sim.cache import SimCache
from ftbench.threads import configure as configure_threads
from ftbench.strategies import build_strategy
from ftbench.strategies.none import NoFaultTolerance

# The local backend (ftbench.engine, ftbench.checkpoint, ftbench.equivalence, models.data,
# models.gpt) imports torch and transformers: seconds. It is imported inside the local-backend
# functions below, so --help, config errors and simulator runs never pay for it
# (tests/test_startup.py).
if TYPE_CHECKING:
    from ftbench.engine.local import LocalEngine

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
    except UserError as err:
        config_error = isinstance(err, ConfigError)
        summary.update(status=err.status, error=str(err))
        metrics.log({"event": "error", "status": err.status, "error": str(err)})
    except BaseException as err:  # a bug, Ctrl-C or SIGTERM, not a user error: keep the evidence, re-raise
        interrupted = isinstance(err, KeyboardInterrupt)
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        outcome = getattr(err, "outcome", None)
        if outcome is not None:  # what the run loop had done when it stopped
            summary.update(_totals(outcome, outcome.global_batch), global_batch=outcome.global_batch)
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


def simulate(cfg, run_dir: Path) -> dict:
    """A sim run of `cfg` without metrics files or W&B (calibration, planners' what-ifs): the
    summary's totals, with `status` and `error` also for settings that cannot run."""
    try:
        return _run(cfg, run_dir, lambda record: None)
    except UserError as err:
        return {"status": err.status, "error": str(err), "throughput": 0.0}


def _run(cfg, run_dir: Path, log, shared_dir: Path | None = None) -> dict:
    ctx = RunContext.from_config(cfg)
    ctx.run_dir, ctx.shared_dir = Path(run_dir), shared_dir  # path settings resolve inside them
    cluster, script = _cluster_and_script(cfg, ctx)
    job_mtbf = cfg.failures.get("job_mtbf_hours")
    if ctx.node_mtbf_hours is None and job_mtbf and cfg.failures.kind == "poisson":
        ctx.node_mtbf_hours = job_mtbf * cluster.nodes  # as the failure script draws them (Young/Daly reads it)
    ctx.job_mtbf_s, ctx.failures_per_iteration = script.job_mtbf_s, script.failures_per_iteration
    if ctx.backend not in AVAILABLE_BACKENDS:
        raise ConfigError("backend", f"backend '{ctx.backend}' is not implemented yet",
                          f"use one of {', '.join(AVAILABLE_BACKENDS)}")
    if ctx.backend != "dist":
        from ftbench.distributed.launch import refuse_dist_settings  # imports no torch

        refuse_dist_settings(cfg)  # backend.kill and backend.stall would be ignored
    clock = _clock(cfg)
    strategy = build_strategy(cfg.strategy, ctx)
    log({"event": "start", "clock": clock, "failures": script.description, "microbatches": ctx.microbatches,
         "global_batch": ctx.global_batch, "nodes": cluster.nodes})
    common = {"microbatches": ctx.microbatches, "global_batch": ctx.global_batch, "seq_len": ctx.seq_len,
              "failure_script": script.description, "model_parameters": ctx.spec.parameters,
              "op_times": ctx.cost_model.op_source}  # measured (the profile's calibrated lines) or flops
    if ctx.backend == "local":
        return {**common, **_run_local(cfg, ctx, strategy, cluster, script, run_dir, log, clock)}
    if ctx.backend == "dist":  # one process per worker (ftbench/distributed/launch.py)
        from ftbench.distributed.launch import run_dist
        return {**common, **run_dist(cfg, ctx, strategy, cluster, script, run_dir, log, clock)}
    return {**common, **_run_sim(cfg, ctx, strategy, cluster, script, run_dir, log)}


def _cluster_and_script(cfg, ctx) -> tuple[Cluster, FailureScript]:
    """The cluster and the failure script. A trace's starting membership (the nodes it adds
    at its first instant) is the job: it sets cluster.nodes when that is unset, and must equal
    it when set. Nodes the trace adds later join as new node ids, and the cluster grows with
    them (Cluster.join)."""
    seed = cfg.failures.seed if cfg.failures.seed is not None else cfg.seed
    c = cfg.cluster
    if cfg.failures.kind != "trace":
        cluster = Cluster.from_config(c)
        return cluster, build_failure_script(cfg.failures, cluster.nodes, seed, iterations=ctx.iterations,
                                             max_hours=ctx.max_hours)
    script = build_failure_script(cfg.failures, c.nodes or 0, seed, iterations=ctx.iterations,
                                  max_hours=ctx.max_hours)
    initial = script.initial_nodes
    if c.nodes is not None and c.nodes != initial:
        raise ConfigError("cluster.nodes", f"it is {c.nodes} but the trace starts with {initial} node(s) "
                          f"({script.description})", f"drop cluster.nodes (the trace sets it) or set "
                          f"cluster.nodes={initial}")
    sized = sized_by_membership(cfg)
    if not sized and initial * c.gpus_per_node < c.pp * c.dp:
        raise ConfigError("cluster.dp", f"the grid pp x dp = {c.pp} x {c.dp} needs {c.pp * c.dp} GPUs but the trace "
                          f"starts with {initial} node(s) of {c.gpus_per_node} GPUs ({script.description})",
                          f"choose cluster.pp x cluster.dp <= {initial * c.gpus_per_node} (oobleck, bamboo and varuna "
                          "with strategy.start=fastest build their job from the live nodes and wait for the trace's "
                          "joins), or replay another trace")
    return Cluster.from_config(c, nodes=initial, require_grid=not sized), script


def sized_by_membership(cfg) -> bool:
    """Whether the strategy builds its job from the live nodes rather than on the configured
    pp x dp grid (oobleck; bamboo, pipelines of cluster.pp stages over the live nodes; varuna
    with strategy.start=fastest): on a trace it needs no grid of GPUs at the start, and where
    the nodes are too few to start it waits for the trace's joins (TooFewNodes)."""
    from ftbench.strategies import REGISTRY

    cls = REGISTRY.get(str(cfg.strategy.name))
    check = getattr(cls, "sized_by_membership", None)
    return bool(check(cfg.strategy)) if check is not None else False


def _clock(cfg) -> str:
    clock = cfg.backend.get("clock") or ("model" if cfg.backend.name == "sim" else "wall")
    if clock not in CLOCKS:
        raise ConfigError("backend.clock", f"unknown option '{clock}'", f"choose one of {', '.join(CLOCKS)}")
    if cfg.backend.name == "sim" and clock != "model":
        raise ConfigError("backend.clock", "the simulator has only the modelled clock",
                          "drop backend.clock, or set backend.clock=model")
    return clock


def _totals(outcome, global_batch: int) -> dict:
    samples = outcome.iterations * global_batch
    segments = outcome.plan_segments
    return {"iterations": outcome.iterations, "samples": samples, "time_s": outcome.time_s,
            "throughput": samples / outcome.time_s if outcome.time_s > 0 else 0.0,
            "ettr": ettr(outcome.productive_s, outcome.time_s), "productive_s": outcome.productive_s,
            "failures": outcome.failures, "recoveries": outcome.recoveries,
            "lost_iterations": sum(r.get("lost_iterations", 0) for r in outcome.recoveries),
            "plan_segments": segments, "final_shape": segments[-1]["shape"] if segments else None,
            "checkpoints": outcome.checkpoints, "status": outcome.status, "error": outcome.error}


def _run_sim(cfg, ctx, strategy, cluster, script, run_dir: Path, log) -> dict:
    cache = SimCache(ctx.cost_model, enabled=cfg.backend.memoize)
    with _progress(ctx, cfg.report.progress, "simulating") as progress:
        backend = SimBackend(ctx, getattr(strategy, "extra_memory", None), getattr(strategy, "memory_breakdown", None))
        outcome = run_loop(ctx, strategy, cluster, script, backend, cache, log, progress)
    first = outcome.first_timeline
    if first is not None and cfg.report.gantt:
        _draw_gantt(outcome, cache, run_dir, cfg, ctx)
    log({"event": "end", "status": outcome.status, "iterations": outcome.iterations, "time_s": outcome.time_s})
    return {
        **_totals(outcome, ctx.global_batch),
        "peak_memory_bytes": [int(outcome.peak_memory_bytes[w]) for w in sorted(outcome.peak_memory_bytes)],
        "peak_host_bytes_max": backend.peak_host,
        "iteration_time_s": shared_cores_iteration(first, ctx.hardware.cores) if first else None,
        "bubble_fraction": first.bubble_fraction() if first else None,
        "plans_simulated": cache.distinct_plans,
    }


def _run_local(cfg, ctx, strategy, cluster, script, run_dir: Path, log, clock: str) -> dict:
    threads = configure_threads(cfg.backend, ctx.spec)  # before any torch work (ftbench/threads.py)
    from ftbench.engine.backend import LocalBackend
    from ftbench.engine.local import check_fits_host
    from ftbench.equivalence import divergence_error
    from ftbench.fault_free import check as check_fault_free
    from ftbench.models.gpt import save_pretrained

    check_fits_host(ctx, cfg.cluster.dp, cfg.backend.dtype)
    engine = local_engine(cfg, ctx, strategy, run_dir, log)
    timelines = SimCache(ctx.cost_model)  # failure points (and the modelled clock's times)
    with _progress(ctx, cfg.report.progress, "training") as progress:
        measured = getattr(ctx.hardware, "provenance", None) is not None  # restart_s measured here, not assumed
        backend = LocalBackend(engine, realtime=clock == "wall", restart_s=ctx.hardware.restart_s if measured else 0.0)
        outcome = run_loop(ctx, strategy, cluster, script, backend, timelines,
                           log, progress, clock=clock)
    if outcome.first_timeline is not None and cfg.report.gantt:
        _draw_gantt(outcome, timelines, run_dir, cfg, ctx, measured=engine.op_timer.timed)
    result = {**_totals(outcome, ctx.global_batch), "losses": outcome.losses, "clock": clock, "threads": threads,
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
                result.update(check_fault_free(cfg, ctx, outcome.losses, state, progress=cfg.report.progress))
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


def local_engine(cfg, ctx, strategy, run_dir: Path | None, log=None) -> LocalEngine:
    from ftbench.checkpoint import CheckpointStore, CheckpointWarning
    from ftbench.engine.local import LocalEngine
    from ftbench.models.data import make_source

    try:
        data = make_source(cfg.train.data, ctx.spec, ctx.seq_len, ctx.seed, cfg.train.data_path)
    except ValueError as err:
        raise ConfigError("train.data_path" if cfg.train.data == "text" else "train.data", str(err),
                          "point train.data_path at a local text file, or use train.data=synthetic") from None
    store = None
    if run_dir is not None and getattr(strategy, "checkpoint_mode", None) in (FILE, SNAPSHOT):
        on_skip = None
        if log is not None:  # a skipped checkpoint is a metrics line, not only a warning
            def on_skip(reason: str, iteration: int) -> None:
                log({"event": "checkpoint_skipped", "iteration": iteration, "reason": reason})
                warnings.warn(reason, CheckpointWarning, stacklevel=2)
        store = CheckpointStore(run_dir / "checkpoints", keep=cfg.strategy.get("keep", 2), on_skip=on_skip)
    boundary_log = None
    if run_dir is not None and getattr(strategy, "log_dir", None):  # Swift's boundary log, in the run folder
        from ftbench.engine.boundary_log import BoundaryLog
        boundary_log = BoundaryLog(inside(run_dir, "strategy.log_dir", strategy.log_dir))
    return LocalEngine(ctx, data, cfg.train.lr, cfg.train.weight_decay, store, cfg.backend.dtype, boundary_log)


def fault_free_reference(cfg, ctx, progress: bool = False) -> tuple[list[float], dict]:
    """Losses and final weights of the same training with no failures and no fault tolerance."""
    configure_threads(cfg.backend, ctx.spec)  # the same count as the run it checks
    from ftbench.engine.backend import LocalBackend

    strategy = NoFaultTolerance(cfg.strategy, ctx)
    cluster = Cluster.from_config(cfg.cluster)
    engine = local_engine(cfg, ctx, strategy, None)
    with _progress(ctx, progress, "fault-free check") as bar:
        outcome = run_loop(ctx, strategy, cluster, FailureScript([], iter(())), LocalBackend(engine),
                           SimCache(ctx.cost_model), lambda record: None, bar)
    return outcome.losses, engine.final_state()


def _draw_gantt(outcome, timelines, run_dir: Path, cfg, ctx, measured: list | None = None) -> None:
    """sim: one simulated iteration of the first plan; with a recovery that changed the plan,
    the plan after the first such recovery below it, on the same time axis. local and dist
    (`measured`: ftbench.engine.op_times): each timed iteration as it ran, beside the cost
    model's picture of the same plan, each on its own time axis."""
    if measured:
        _draw_measured_gantt(measured, timelines, run_dir, cfg, ctx)
        return
    first = outcome.first_timeline
    title = (f"{ctx.spec.name}, {cfg.schedule.name}, pp={cfg.cluster.pp} dp={cfg.cluster.dp}, "
             f"m={ctx.microbatches}, {cfg.hardware.name}: one iteration {first.iteration_time:.3g} s")
    try:
        after = outcome.plan_after_recovery
        if after is None:
            plot_gantt(first.timeline(), run_dir / "gantt.png", title=title, worker_labels=_gantt_labels(first))
            return
        second = timelines(after)
        panels = [(f"before: {outcome.plan_segments[0]['plan']}, {outcome.plan_segments[0]['shape']}, "
                   f"{first.iteration_time:.3g} s", first.timeline()),
                  (f"after the first recovery: {after.name}, {after.shape}, {second.iteration_time:.3g} s",
                   second.timeline())]
        plot_gantt_panels(panels, run_dir / "gantt.png", title=title)
    except Exception as err:  # a plot must never cost the run its results
        warnings.warn(f"could not draw the Gantt chart: {err}")


def _draw_measured_gantt(measured: list[dict], timelines, run_dir: Path, cfg, ctx) -> None:
    """What ran beside what the cost model predicts, for the first iteration of each plan timed."""
    panels = []
    for entry in measured:
        t0 = min((op["start"] for op in entry["ops"]), default=0.0)
        ops = [{**op, "start": op["start"] - t0, "end": op["end"] - t0} for op in entry["ops"]]
        span = max((op["end"] for op in ops), default=0.0)
        how = "one process runs every worker's ops in turn" if ctx.backend == "local" else "a process per worker"
        panels.append((f"measured: {entry['plan']}, {entry['shape']}, iteration {entry['iteration']}, "
                       f"{span:.3g} s of compute ops (wall clock, this machine; {how})", ops))
        if entry.get("model") is not None:
            model = timelines(entry["model"])
            panels.append((f"cost model: the same plan on hardware={cfg.hardware.name} ({ctx.cost_model.op_source} "
                           f"op times), {model.iteration_time:.3g} s", model.timeline()))
    title = (f"{ctx.spec.name}, {cfg.schedule.name}, {ctx.backend}: each plan's first complete iteration as it ran, "
             "above the cost model's picture of it (each panel on its own time axis)")
    try:
        plot_gantt_panels(panels, run_dir / "gantt.png", title=title, shared_axis=False)
    except Exception as err:  # a plot must never cost the run its results
        warnings.warn(f"could not draw the Gantt chart: {err}")


def _gantt_labels(result) -> dict[int, str]:
    first_op = {}
    for worker, op, _, _ in result.ops:
        first_op.setdefault(worker, op)
    return {w: f"w{w} p{op.pipeline}/s{op.stage}" for w, op in first_op.items()}


class _progress:
    """tqdm when stderr is a terminal, a no-op callable otherwise: over iterations, or, for a
    run capped by train.max_hours, over its (simulated or wall) hours, so that a run that ends
    at its cap shows 100 %."""

    def __init__(self, ctx, enabled: bool, desc: str):
        self.ctx, self.enabled, self.desc, self.bar = ctx, enabled, desc, None
        self.hours = ctx.max_hours is not None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm
            if self.hours:
                self.bar = tqdm(total=float(self.ctx.max_hours), unit="h", desc=self.desc, disable=None, leave=True,
                                bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} h [{elapsed}<{remaining}]")
            else:
                self.bar = tqdm(total=self.ctx.iterations, unit="it", desc=self.desc, disable=None, leave=True)
        return self

    def __call__(self, iteration: int, time_s: float = 0.0) -> None:
        if self.bar is not None:
            done = min(time_s / 3600.0, self.bar.total) if self.hours else iteration
            self.bar.update(done - self.bar.n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
