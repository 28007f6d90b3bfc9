"""The W&B mirror of the run records (ftbench/metrics.py): `WandbSink` mirrors one run (its
docstring says what lands where); `log_sweep_table` logs one table of a sweep folder's
summaries. A convenience on top of metrics.jsonl and summary.json: it must never be the
reason a run fails.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from ftbench.metrics import (SUMMARY_FILE, dumps, peak_memory_max, recovery_totals,
                             summary_ettr)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_fields(record: dict) -> dict:
    """The fields W&B can chart: numbers and booleans (as 0/1); text and lists are left out."""
    numeric = {}
    for key, value in record.items():
        if isinstance(value, bool):
            numeric[key] = int(value)
        elif _is_number(value):
            numeric[key] = value
    return numeric


def _event_fields(record: dict) -> dict:
    """An event's fields for its W&B row: numbers, booleans (0/1), text (cut to 1000 characters)
    and lists of plain values (joined with ", "); nested structures stay in metrics.jsonl."""
    fields = _numeric_fields(record)
    for key, value in record.items():
        if key in fields or key == "event":
            continue
        if isinstance(value, str):
            fields[key] = value[:1000]
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
            fields[key] = ", ".join(map(str, value))[:1000]
    return fields


# The lines that carry the run's progress: their fields go at the top level of W&B's history
# (loss, iteration_s, ...); every other event goes under "<event>/".
PROGRESS_EVENTS = ("iteration", "iterations")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _leading_date(name: str) -> bool:
    """Whether `name` starts with a date (2024-05-01..., 2024_05_01..., 20240501...)."""
    return re.match(r"\d{4}[-_]?\d{2}[-_]?\d{2}(?!\d)", name) is not None


def _folder_date(folder: Path, today: _dt.date | None = None) -> str:
    """The date of a run folder from Hydra's layout (runs/<date>/<time>..., runs/multirun/
    <date>/<time>/<job>): the nearest ancestor named like a date; else today's date."""
    for part in reversed(Path(folder).parts):
        if _DATE.fullmatch(part):
            return part
    return (today or _dt.date.today()).isoformat()


def wandb_group(group: str | None, run_dir: Path | str, today: _dt.date | None = None) -> str:
    """The W&B group of a run: readable, and unique per sweep.

    - a sweep (`group` is the sweep folder's name, Hydra's `<time>-<id>` under
      `runs/multirun/<date>/`): `<date>_<group>`, the date taken from the run folder's path
      (today's when the path has none); a name that already starts with a date is kept;
    - a single run (`group` None): `single-<date>`, one group per day of single runs (the
      run's strategy is its job type, so W&B can split the group further).
    """
    if group:
        group = str(group)
        return group if _leading_date(group) else f"{_folder_date(Path(run_dir), today)}_{group}"
    return f"single-{_folder_date(Path(run_dir), today)}"


def _backend_of(config: Any) -> str | None:
    backend = config.get("backend") if isinstance(config, dict) else None
    if isinstance(backend, dict):
        backend = backend.get("name")
    return backend if isinstance(backend, str) else None


def _table_cell(value: Any) -> Any:
    """A value a wandb.Table column holds: plain values as they are, lists as text."""
    if value is None or isinstance(value, (str, bool)) or _is_number(value):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        return ", ".join(map(str, value))
    return dumps(value)


RECOVERY_COLUMNS = ("time_s", "iteration", "recovery_s", "lost_iterations", "restored_iteration",
                    "actions", "plan", "shape", "cause")


def _wandb_settings(wandb: Any) -> Any:
    """Settings that keep W&B quiet and cheap; names this wandb version lacks are dropped."""
    wanted = {
        # Record what the run prints (files/output.log and the run file's output records):
        # "wrap" tees sys.stdout and sys.stderr, without the pseudo-terminal "redirect" needs.
        "console": "wrap",
        "silent": True,  # W&B's own banner and run summary stay out of the run's output (the summary is ours)
        "x_disable_stats": True,  # no system-metrics sampling thread
        "x_disable_meta": True,
        "x_disable_machine_info": True,
        "x_save_requirements": False,
        "disable_git": True,
        "disable_job_creation": True,
        "save_code": False,
    }
    known = getattr(getattr(wandb, "Settings", None), "model_fields", None)
    if known is None:
        return None
    return wandb.Settings(**{k: v for k, v in wanted.items() if k in known})


ARTIFACTS_FOLDER = "artifacts"  # in the offline run's folder: one subfolder per logged artifact
STAGED_SUFFIX = ".staged"  # of each file there: <artifact>/<path in the artifact>.staged
DATA_FOLDER = "tmp/wandb-data"  # W&B's data folder while the run is open, in the offline run's folder


def keep_artifacts_in_run_folder(run: Any, root: Path | str) -> None:
    """Make an offline run's artifacts travel with its folder.

    W&B stages an artifact's files in its data folder (~/.local/share/wandb: the home folder),
    and an artifact added with policy="immutable" (our model) names the file where it lies;
    the run file (`run-<id>.wandb`) records those absolute paths, which `wandb sync` reads
    later. So, until `run.finish()`:

    - each artifact the run logs (ours, and the `run_table` one W&B makes for each logged
      Table) gets its files copied to `<offline run>/artifacts/<artifact>/<path>.staged` and
      its paths made relative to `root`, the folder given to wandb.init: a copy of `root`
      holds them, and `wandb sync wandb/offline-run-...` run from inside it finds them;
    - W&B's data folder (WANDB_DATA_DIR) is `<offline run>/tmp/wandb-data`, removed at finish:
      its staged copies (W&B leaves one behind per logged Table) never reach the home folder.

    An online run uploads at once: it is left as it is.
    """
    if not getattr(run, "offline", False):
        return
    offline = Path(run.settings.sync_dir)
    log_artifact, finish = run.log_artifact, run.finish
    previous = os.environ.get("WANDB_DATA_DIR")

    def staged_log_artifact(artifact: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(artifact, "manifest"):  # a path instead: W&B makes the artifact itself, unstaged
            _stage_files(artifact, offline / ARTIFACTS_FOLDER, Path(root))
        return log_artifact(artifact, *args, **kwargs)

    def finish_and_restore(*args: Any, **kwargs: Any) -> Any:
        try:
            return finish(*args, **kwargs)
        finally:
            if previous is None:
                os.environ.pop("WANDB_DATA_DIR", None)
            else:
                os.environ["WANDB_DATA_DIR"] = previous
            shutil.rmtree(offline / DATA_FOLDER, ignore_errors=True)

    run.log_artifact, run.finish = staged_log_artifact, finish_and_restore
    os.environ["WANDB_DATA_DIR"] = str((offline / DATA_FOLDER).resolve())  # once finish restores it


def _stage_files(artifact: Any, folder: Path, root: Path) -> None:
    target_dir = _free_folder(folder / re.sub(r"[^\w.-]", "_", str(artifact.name)))
    for entry in artifact.manifest.entries.values():
        if not entry.local_path:  # a reference: nothing of ours to upload
            continue
        # `.staged`: a copy of summary.json must not pass for a run's (reports search folders for it)
        target = target_dir / f"{entry.path}{STAGED_SUFFIX}"
        target.parent.mkdir(parents=True, exist_ok=True)
        # a copy, even of the model: wandb-core removes the staged files it has uploaded
        shutil.copyfile(entry.local_path, target)
        entry.local_path = os.path.relpath(target.resolve(), root.resolve())


def _free_folder(stem: Path) -> Path:
    """`stem`, or `stem-2`, ...: an artifact name logged twice keeps both versions' files."""
    for k in range(1, 10_000):
        folder = stem if k == 1 else stem.with_name(f"{stem.name}-{k}")
        if not folder.exists():
            return folder
    raise OSError(f"no free folder name beside {stem}")


def _reinit_value(wandb: Any) -> Any:
    """Finish any run still open in this process (Hydra multirun runs jobs one after another)."""
    field = getattr(getattr(wandb, "Settings", None), "model_fields", {}).get("reinit")
    if field is not None and "finish_previous" in str(field.annotation):
        return "finish_previous"
    return True  # older wandb: True meant "finish the previous run and start a new one"


def _plain_config(config: Any) -> Any:
    """W&B wants plain containers; Hydra hands out OmegaConf nodes."""
    if config is None or isinstance(config, dict):
        return config
    try:
        from omegaconf import OmegaConf
        return OmegaConf.to_container(config, resolve=True)
    except Exception:  # not an OmegaConf node: let wandb try it as it is
        return config


# The lines that follow the run loop: the held lines go to W&B with them.
TRAINING_ENDS = ("end", "error")


class WandbSink:
    """Optional W&B mirror of a run. Never breaks a run: on a W&B error it warns and turns into
    a no-op (an extra at `finish` that fails is skipped with a warning).

    What lands in W&B, for users who chart and compare runs there:

    - group: `wandb.group` when set, else `wandb_group(group, run_dir)`: `<date>_<sweep folder>`
      for a sweep, `single-<date>` for a single run; job type: the strategy; name: the folder.
    - history: one row per metrics line, W&B's own `_step` left alone (a row per call, so a
      rollback's redone iterations are not dropped). The x axis is a step metric set with
      `define_metric`: `iteration` on local (and dist) runs, simulated time `time_s` on sim.
      Progress lines (`iteration`: loss, iteration_s, time_s, samples; sim's `iterations`:
      first, last, count, iteration_time_s, time_s, ... plus `iteration` = last) go at the top
      level. Every other event gets a row of its own with its fields under `<event>/`
      (`fail/node`, `recovery/recovery_s`, `checkpoint/stall_s`, ...) and the step metric's
      value when it happened: the line's own `iteration` (`time_s` on sim), else the last one
      seen.
    - at finish: a `recoveries` wandb.Table (one row per summary["recoveries"] entry), the
      run folder's `*.png` as wandb.Image (`gantt.png` under `gantt`, others under
      `plots/<name>`), the final model folder (artifact type "model", `model-<run id>`) and
      summary.json (type "summary", `summary-<run id>`), and the summary's scalars (plus
      recovery totals, peak memory and `ettr`, the effective training time ratio) in
      `run.summary`.
    - the console: what the run prints from the start of the W&B run on (`files/output.log`).

    The timed region is training, and nothing of W&B runs inside it: the W&B run starts at the
    run's `start` line (logged once the settings are checked, before training: a run that
    stops on a setting error before it starts none), and the lines from then until the `end`
    (or `error`) line, which follows the run loop, are held and logged after it, in order.
    So a run's W&B history fills when its training is over (metrics.jsonl as it goes).
    An offline run's folder (`<run folder>/wandb/offline-run-<time>-<id>/`) holds all that
    `wandb sync` uploads, artifacts included (`keep_artifacts_in_run_folder`).
    """

    MODES = ("offline", "online", "disabled")

    def __init__(self, cfg: Any, run_dir: Path | str, name: str, job_type: str,
                 group: str | None, config: dict | None):
        self.run = None
        self.run_dir = Path(run_dir)
        self.step_metric, self.group = "iteration", group
        self._defined: set[str] = set()
        self._step_value: float = 0
        self._init: dict | None = None  # wandb.init's arguments until the run starts
        self._pending: list[dict] = []  # metrics lines before it starts
        self._training = False  # between the start and end lines: lines are held in _pending
        mode = getattr(cfg, "mode", "offline")
        # WANDB_MODE=disabled is W&B's own kill switch; honouring it lets a test suite or a CI
        # job turn W&B off for every run without editing configs.
        if os.environ.get("WANDB_MODE", "").strip().lower() == "disabled":
            mode = "disabled"
        if mode == "disabled":
            return  # without importing wandb: importing it is slow and starts nothing useful
        if mode not in self.MODES:
            warnings.warn(f"wandb.mode {mode!r} is not one of {', '.join(self.MODES)}; "
                          "W&B logging is off for this run", stacklevel=2)
            return
        config = _plain_config(config)
        self.step_metric = "time_s" if _backend_of(config) == "sim" else "iteration"
        self.group = getattr(cfg, "group", None) or wandb_group(group, self.run_dir)
        self._init = dict(mode=mode, dir=str(self.run_dir), project=getattr(cfg, "project", None),
                          entity=getattr(cfg, "entity", None), group=self.group, job_type=job_type,
                          name=name, config=config)

    @property
    def active(self) -> bool:
        """Whether this run goes to W&B (started, or waiting for its first progress line)."""
        return self.run is not None or self._init is not None

    def _start(self) -> None:
        """wandb.init, then the metrics lines held until now. The W&B run starts at the start
        line (or the first progress line, for a caller without one), or at `finish`: a run that
        stops on a setting error before it starts leaves no W&B run behind (see `finish`)."""
        kwargs, self._init = self._init, None
        try:
            import wandb
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(**kwargs, reinit=_reinit_value(wandb), settings=_wandb_settings(wandb))
            keep_artifacts_in_run_folder(self.run, self.run_dir)
            self._define(self.step_metric, None)
        except Exception as exc:  # import error, bad login, no network for online mode...
            self._give_up("start", exc)
            return
        pending, self._pending = self._pending, []
        for record in pending:
            self._log(record)

    def _give_up(self, action: str, exc: BaseException) -> None:
        warnings.warn(f"W&B could not {action} ({type(exc).__name__}: {exc}); "
                      "the run goes on without W&B (metrics.jsonl and summary.json are unaffected)",
                      stacklevel=3)
        run, self.run, self._pending = self.run, None, []
        if run is not None and action != "finish":
            try:
                run.finish(exit_code=1)
            except Exception:
                pass

    def _define(self, name: str, step_metric: str | None) -> None:
        """define_metric once per name (or `<event>/*` glob) with the run's step metric."""
        if name in self._defined or "*" in name[:-1]:  # W&B takes only a trailing glob
            return
        self._defined.add(name)
        if step_metric is None:
            self.run.define_metric(name)
        else:
            self.run.define_metric(name, step_metric=step_metric)

    def row(self, record: dict) -> dict:
        """The W&B history row of a metrics line (empty: nothing to log). Keeps the step
        metric's last value so events without one are placed where they happened."""
        step = self.step_metric
        event = record.get("event")
        value = record.get(step)
        if _is_number(value):
            self._step_value = value
        if event is None or event in PROGRESS_EVENTS:  # a bare record of numbers is progress too
            data = _numeric_fields({k: v for k, v in record.items() if k != "event"})
            if event == "iterations" and "iteration" not in data and _is_number(record.get("last")):
                data["iteration"] = record["last"]
            if not data:
                return {}
        else:
            fields = _event_fields({k: v for k, v in record.items() if k != step})
            if not fields:
                return {}
            event = re.sub(r"[^A-Za-z0-9_.-]", "_", str(event)) or "event"
            data = {f"{event}/{key}": v for key, v in fields.items()}
        data[step] = self._step_value
        return data

    def log(self, record: dict) -> None:
        event = record.get("event")
        if self._init is not None:  # not started: hold the line until the run is about to train
            self._pending.append(record)
            if event in ("start", None) or event in PROGRESS_EVENTS:
                self._start()
                self._training = True
            return
        if self._training:  # training: only a list append (W&B gets the lines after it)
            self._pending.append(record)
            if event in TRAINING_ENDS:
                self._flush()
            return
        self._log(record)

    def _flush(self) -> None:
        """Training is over: log the lines held during it."""
        self._training = False
        pending, self._pending = self._pending, []
        for record in pending:
            self._log(record)

    def _log(self, record: dict) -> None:
        if self.run is None:
            return
        try:
            data = self.row(record)
            if not data:
                return
            for key in data:
                if key != self.step_metric:
                    prefix = key.split("/", 1)[0]
                    self._define(f"{prefix}/*" if "/" in key else key, self.step_metric)
            self.run.log(data)  # no step=: W&B's _step counts rows, define_metric sets the x axis
        except Exception as exc:
            self._give_up("log", exc)

    def finish(self, summary: dict, config_error: bool = False) -> None:
        """Log the extras and close the W&B run. `config_error`: the run stopped on a setting
        to fix; if it had not started training, no W&B run is made for it at all."""
        if self._init is not None:
            if config_error:
                self._init, self._pending = None, []
                return
            self._start()
        self._flush()  # a run that ended without its end line (a crash, Ctrl-C)
        if self.run is None:
            return
        try:
            import wandb
        except Exception as exc:
            self._give_up("finish", exc)
            return
        self._extra("log the recoveries table and images", self._log_media, wandb, summary)
        self._extra("log the final model", self._log_model, wandb, summary)
        self._extra("log summary.json", self._log_summary_file, wandb, summary)
        try:
            self.run.summary.update(_summary_scalars(summary))
            self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
        except Exception as exc:
            self._give_up("finish", exc)
        self.run = None

    def _extra(self, action: str, fn, *args: Any) -> None:
        if self.run is None:
            return
        try:
            fn(*args)
        except Exception as exc:  # one missing extra must not cost the run its W&B record
            warnings.warn(f"W&B could not {action} ({type(exc).__name__}: {exc})", stacklevel=3)

    def _log_media(self, wandb: Any, summary: dict) -> None:
        media: dict[str, Any] = {"recoveries": recoveries_table(wandb, summary)}
        losses, reference = summary.get("losses"), summary.get("fault_free_losses")
        if losses and reference:  # loss.png's series: this run beside fault-free training
            table = wandb.Table(columns=["iteration", "loss", "fault_free_loss"],
                                data=[[i, _table_cell(a), _table_cell(b)] for i, (a, b) in enumerate(zip(losses, reference))])
            media["loss_vs_fault_free"] = table
            media["loss_vs_fault_free_chart"] = wandb.plot.line_series(
                xs=list(range(len(reference))), ys=[[a if isinstance(a, (int, float)) else None for a in losses],
                                                     list(reference)],
                keys=["this run", "fault-free"], title="loss per iteration", xname="iteration")
        for png in sorted(self.run_dir.glob("*.png")):
            key = "gantt" if png.name == "gantt.png" else f"plots/{png.stem}"
            media[key] = wandb.Image(str(png), caption=png.name)
        self.run.log(media)

    def _log_model(self, wandb: Any, summary: dict) -> None:
        folder = summary.get("final_state")
        if not folder or not Path(folder).is_dir():
            return
        artifact = wandb.Artifact(f"model-{self.run.id}", type="model",
                                  metadata=_artifact_metadata(summary))
        # immutable: no copy in W&B's staging area (the home folder); an offline run copies the
        # files into its own folder (keep_artifacts_in_run_folder), an online one uploads them
        for path in sorted(Path(folder).rglob("*")):  # file by file: add_dir prints a line of its own
            if path.is_file():
                artifact.add_file(str(path), name=path.relative_to(folder).as_posix(), policy="immutable")
        self.run.log_artifact(artifact, aliases=["latest", "final"])

    def _log_summary_file(self, wandb: Any, summary: dict) -> None:
        path = Path(summary.get("run_dir") or self.run_dir) / SUMMARY_FILE
        if not path.is_file():
            return
        artifact = wandb.Artifact(f"summary-{self.run.id}", type="summary",
                                  metadata=_artifact_metadata(summary))
        artifact.add_file(str(path), name=SUMMARY_FILE)
        self.run.log_artifact(artifact)


def recoveries_table(wandb: Any, summary: dict) -> Any:
    """A wandb.Table of summary["recoveries"], one row per recovery, RECOVERY_COLUMNS."""
    recoveries = summary.get("recoveries")
    entries = [r for r in recoveries if isinstance(r, dict)] if isinstance(recoveries, list) else []
    rows = [[_table_cell(entry.get(column)) for column in RECOVERY_COLUMNS] for entry in entries]
    return wandb.Table(columns=list(RECOVERY_COLUMNS), data=rows)


def _artifact_metadata(summary: dict) -> dict:
    keep = ("strategy", "backend", "model", "hardware", "schedule", "pp", "dp", "iterations",
            "status", "matches_fault_free", "seed")
    return {k: summary[k] for k in keep if k in summary and not isinstance(summary[k], (dict, list))}


# The sweep table's fixed columns (summary keys or values derived from them); sweep_rows adds
# one per swept key after `strategy`.
SWEEP_COLUMNS: tuple[str, ...] = (
    "run", "strategy", "backend", "model", "hardware", "schedule", "pp", "dp", "microbatches",
    "global_batch", "iterations", "samples", "samples_dropped", "time_s", "throughput", "ettr", "failures",
    "recoveries",
    "recovery_s", "lost_iterations", "peak_memory_gb", "status", "matches_fault_free",
    "wall_s", "error",
)


def sweep_rows(sweep_dir: Path | str) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows (one per run, in sweep order) of a sweep folder's summaries: SWEEP_COLUMNS
    with, after `strategy`, one column per swept key (the summaries' `swept`, and override keys
    whose value differs between runs, as in `python -m ftbench.report`) that SWEEP_COLUMNS does
    not already show; its cells are the run's values (from its `overrides`)."""
    from ftbench.run_tables import column_value, load_runs, swept_columns

    sweep_dir = Path(sweep_dir)
    summaries = load_runs([sweep_dir])
    swept = swept_columns(summaries, list(SWEEP_COLUMNS), aggregated=False)
    at = SWEEP_COLUMNS.index("strategy") + 1
    columns = [*SWEEP_COLUMNS[:at], *swept, *SWEEP_COLUMNS[at:]]
    rows = []
    for summary in summaries:
        totals = recovery_totals(summary)
        peak = peak_memory_max(summary)
        run_dir = Path(summary["run_dir"])
        derived = {
            "run": str(run_dir.relative_to(sweep_dir)) if run_dir.is_relative_to(sweep_dir) else run_dir.name,
            "failures": summary.get("failures") if not isinstance(summary.get("failures"), list)
            else len(summary["failures"]),
            "recoveries": totals["count"], "recovery_s": totals["recovery_s"],
            "lost_iterations": totals["lost_iterations"],
            "peak_memory_gb": None if peak is None else peak / 1e9,
            "ettr": summary_ettr(summary),
            **{key: column_value(summary, key) for key in swept},
        }
        rows.append([_table_cell(derived[c] if c in derived else summary.get(c)) for c in columns])
    return columns, rows


def start_sweep_run(sweep_dir: Path | str, cfg: Any, job_type: str, name: str,
                    default_mode: str = "offline") -> Any:
    """Start the W&B run of a whole sweep (the sweep table, a paper table); None when W&B is off.

    The run lands in the sweep folder (`<sweep>/wandb/`) and in the sweep's group: `cfg.group`
    when set, else `wandb_group(<sweep folder's name>, sweep_dir)`, the group its jobs'
    WandbSink runs get; it is named `<group>-<name>`. `cfg` (the `wandb` config section, or
    None) gives mode (`default_mode` without one), project ("ftbench" without one) and entity.
    Off: `WANDB_MODE=disabled`, or a mode other than offline and online; wandb is then not
    imported. W&B's own errors propagate, for the caller to warn in its own words.
    """
    sweep_dir = Path(sweep_dir)
    mode = getattr(cfg, "mode", default_mode) if cfg is not None else default_mode
    if os.environ.get("WANDB_MODE", "").strip().lower() == "disabled" or mode not in ("offline", "online"):
        return None
    import wandb

    group = getattr(cfg, "group", None) or wandb_group(sweep_dir.name, sweep_dir)
    run = wandb.init(mode=mode, dir=str(sweep_dir), project=getattr(cfg, "project", "ftbench"),
                     entity=getattr(cfg, "entity", None), group=group, job_type=job_type,
                     name=f"{group}-{name}", reinit=_reinit_value(wandb), settings=_wandb_settings(wandb))
    try:
        keep_artifacts_in_run_folder(run, sweep_dir)  # the tables' run_table artifacts
    except Exception:
        run.finish(exit_code=1)
        raise
    return run


def log_sweep_table(sweep_dir: Path | str, cfg: Any = None, run: Any = None, key: str = "sweep") -> bool:
    """Log one wandb.Table of a sweep's summaries (see sweep_rows); True when it was logged.

    `run`: an open W&B run to log into; without one, a run of its own is started in the sweep
    folder (job type "sweep-summary", the sweep's group, `cfg` as in WandbSink: mode,
    project, entity, group; mode "offline" when `cfg` is None) and finished. Like the sink,
    it never raises for W&B's sake: it warns and returns False.
    """
    sweep_dir = Path(sweep_dir)
    try:
        columns, rows = sweep_rows(sweep_dir)
    except Exception as exc:
        warnings.warn(f"could not read the sweep's summaries ({type(exc).__name__}: {exc})", stacklevel=2)
        return False
    own = run is None
    try:
        if own:
            run = start_sweep_run(sweep_dir, cfg, job_type="sweep-summary", name="summary")
            if run is None:  # W&B is off
                return False
        import wandb
        run.log({key: wandb.Table(columns=columns, data=rows)})
        if own:
            run.finish()
        return True
    except Exception as exc:
        warnings.warn(f"W&B could not log the sweep table ({type(exc).__name__}: {exc})", stacklevel=2)
        if own and run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:
                pass
        return False


def _summary_scalars(summary: dict) -> dict:
    """Scalar summary fields, plus totals of the list fields so W&B tables can sort by them."""
    scalars = {k: v for k, v in summary.items()
               if isinstance(v, (str, bool)) or (_is_number(v) and math.isfinite(v)) or v is None}
    totals = recovery_totals(summary)
    scalars.setdefault("recoveries_count", totals["count"])
    scalars.setdefault("recovery_s_total", totals["recovery_s"])
    scalars.setdefault("lost_iterations_total", totals["lost_iterations"])
    scalars["ettr"] = summary_ettr(summary)  # productive_s / time_s (see `ettr`)
    peak = peak_memory_max(summary)
    if peak is not None:
        scalars.setdefault("peak_memory_bytes_max", peak)
    return scalars


__all__ = [
    "WandbSink", "wandb_group", "recoveries_table", "sweep_rows", "log_sweep_table", "start_sweep_run",
    "keep_artifacts_in_run_folder",
]
