"""Run records: `metrics.jsonl` (streamed), `summary.json` (atomic) and an optional W&B mirror.

The two files are the contract other tools read (see DESIGN.md, "Contracts other tools rely
on"); W&B is a convenience on top and must never be the reason a run fails.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

SUMMARY_KEYS: tuple[str, ...] = (
    "strategy", "backend", "model", "dp", "pp", "microbatches", "global_batch",
    "iterations", "samples", "time_s", "throughput", "failures", "recoveries",
    "peak_memory_bytes", "status", "error",
)
STATUSES = ("ok", "oom", "unrecoverable", "error")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _json_default(value: Any) -> Any:
    """Turn the odd types runs produce (tensors, numpy scalars, paths) into JSON values."""
    # 0-d tensors and numpy scalars have .item(); arrays and tensors have .tolist().
    for method in ("item", "tolist"):
        convert = getattr(value, method, None)
        if callable(convert):
            try:
                return convert()
            except (ValueError, TypeError, RuntimeError):
                continue
    return str(value)


def _dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(obj, default=_json_default, **kwargs)


class MetricsWriter:
    """Appends one JSON object per line to <run_dir>/metrics.jsonl, flushed after every line."""

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        # Append: a resumed run keeps the lines its earlier attempt wrote.
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        # One write of a complete line, then flush: a crash loses at most this line.
        self._file.write(_dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_summary(summary: dict) -> None:
    """Raise ValueError naming every missing required key, or a status outside STATUSES."""
    missing = [key for key in SUMMARY_KEYS if key not in summary]
    if missing:
        raise ValueError(f"summary is missing required keys: {', '.join(missing)}")
    if summary["status"] not in STATUSES:
        raise ValueError(f"summary status {summary['status']!r} is not one of {', '.join(STATUSES)}")


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable; not every platform lets a folder be opened.
    (Shared by summary.json and checkpoint files.)"""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_summary(run_dir: Path | str, summary: dict) -> Path:
    """Atomically write <run_dir>/summary.json: readers see the old file or the whole new one."""
    check_summary(summary)
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / SUMMARY_FILE
    # The temporary file sits in the same folder so os.replace is a rename, not a copy.
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=".summary.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(_dumps(summary, indent=2) + "\n")
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return target


def read_metrics(path: Path | str) -> list[dict]:
    """Records of a metrics.jsonl (or of the run folder holding one).

    A last line that does not parse is the one a crash cut short, so it is skipped; a bad
    line anywhere else means the file is not what we wrote, so that raises ValueError.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = [(number, line) for number, line in
             enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if index == len(lines) - 1:
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return records


def recovery_totals(summary: dict) -> dict:
    """Count, total recovery seconds and total lost iterations of a summary's `recoveries`."""
    recoveries = summary.get("recoveries") or []
    if not isinstance(recoveries, list):
        recoveries = []
    entries = [r for r in recoveries if isinstance(r, dict)]
    return {
        "count": len(recoveries),
        "recovery_s": sum(float(r.get("recovery_s") or 0.0) for r in entries),
        "lost_iterations": sum(int(r.get("lost_iterations") or 0) for r in entries),
    }


def peak_memory_max(summary: dict) -> float | None:
    """Largest per-worker peak memory in bytes; the field may be a list, a dict or one number."""
    peak = summary.get("peak_memory_bytes")
    if isinstance(peak, dict):
        peak = list(peak.values())
    if isinstance(peak, (list, tuple)):
        numbers = [v for v in peak if _is_number(v)]
        return float(max(numbers)) if numbers else None
    return float(peak) if _is_number(peak) else None


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


def _wandb_settings(wandb: Any) -> Any:
    """Settings that keep W&B quiet and cheap; names this wandb version lacks are dropped."""
    wanted = {
        "console": "off",  # do not wrap stdout/stderr: the run prints its own progress
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


class WandbSink:
    """Optional W&B mirror of the metrics. Never breaks a run: on any W&B error it warns once
    and turns into a no-op."""

    MODES = ("offline", "online", "disabled")

    def __init__(self, cfg: Any, run_dir: Path | str, name: str, job_type: str,
                 group: str | None, config: dict | None):
        self.run = None
        self._last_step: int | None = None
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
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            import wandb
            self.run = wandb.init(
                mode=mode, dir=str(run_dir), project=getattr(cfg, "project", None),
                entity=getattr(cfg, "entity", None),
                group=getattr(cfg, "group", None) or group, job_type=job_type, name=name,
                config=_plain_config(config), reinit=_reinit_value(wandb),
                settings=_wandb_settings(wandb),
            )
        except Exception as exc:  # import error, bad login, no network for online mode...
            self._give_up("start", exc)

    @property
    def active(self) -> bool:
        return self.run is not None

    def _give_up(self, action: str, exc: BaseException) -> None:
        warnings.warn(f"W&B could not {action} ({type(exc).__name__}: {exc}); "
                      "the run goes on without W&B (metrics.jsonl and summary.json are unaffected)",
                      stacklevel=3)
        run, self.run = self.run, None
        if run is not None and action != "finish":
            try:
                run.finish(exit_code=1)
            except Exception:
                pass

    def _step_for(self, iteration: Any) -> int | None:
        """W&B drops rows whose step goes backwards, and a rollback redoes iterations: such rows
        go one past the last step instead; the true number stays in the `iteration` field."""
        if not _is_number(iteration):
            return None
        step = int(iteration)
        if self._last_step is not None and step < self._last_step:
            step = self._last_step + 1
        self._last_step = step
        return step

    def log(self, record: dict) -> None:
        if self.run is None:
            return
        data = _numeric_fields(record)
        if not data:
            return
        try:
            step = self._step_for(record.get("iteration"))
            if step is None:
                self.run.log(data)
            else:
                self.run.log(data, step=step)
        except Exception as exc:
            self._give_up("log", exc)

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update(_summary_scalars(summary))
            self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
        except Exception as exc:
            self._give_up("finish", exc)
        self.run = None


def _summary_scalars(summary: dict) -> dict:
    """Scalar summary fields, plus totals of the list fields so W&B tables can sort by them."""
    scalars = {k: v for k, v in summary.items()
               if isinstance(v, (str, bool)) or (_is_number(v) and math.isfinite(v)) or v is None}
    totals = recovery_totals(summary)
    scalars.setdefault("recoveries_count", totals["count"])
    scalars.setdefault("recovery_s_total", totals["recovery_s"])
    scalars.setdefault("lost_iterations_total", totals["lost_iterations"])
    peak = peak_memory_max(summary)
    if peak is not None:
        scalars.setdefault("peak_memory_bytes_max", peak)
    return scalars


__all__ = [
    "SUMMARY_KEYS", "STATUSES", "METRICS_FILE", "SUMMARY_FILE", "MetricsWriter", "check_summary",
    "write_summary", "read_metrics", "recovery_totals", "peak_memory_max", "WandbSink",
]
