"""Run records: `metrics.jsonl` (streamed) and `summary.json` (atomic).

The two files are the contract other tools read (docs/outputs.md); the W&B mirror
(ftbench/wandb_sink.py) is a convenience on top and must never be the reason a run fails.
"""
from __future__ import annotations

import json
import math
import os
import socket
import uuid
from pathlib import Path
from typing import Any

SUMMARY_KEYS: tuple[str, ...] = (
    "strategy", "backend", "model", "dp", "pp", "microbatches", "global_batch",
    "iterations", "samples", "time_s", "throughput", "ettr", "productive_s", "failures", "recoveries",
    "peak_memory_bytes", "status", "error",
)
STATUSES = ("ok", "oom", "unrecoverable", "diverged", "error", "died", "interrupted")  # diverged: differs from fault-free training; died: dist, backend.unannounced=stop; interrupted: Ctrl-C or SIGTERM

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


def dumps(obj: Any, **kwargs: Any) -> str:
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
        self._file.write(dumps(record) + "\n")
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


def _finite(obj: Any) -> Any:
    """`obj` with every NaN or infinity as None: summary.json is strict JSON (a run that ended
    early has NaN losses for the iterations it did not reach; strict parsers reject NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_summary(run_dir: Path | str, summary: dict) -> Path:
    """Atomically write <run_dir>/summary.json: readers see the old file or the whole new one.
    Numbers that are not finite are written as null (strict JSON)."""
    check_summary(summary)
    summary = _finite(summary)
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / SUMMARY_FILE
    clean_stale_summaries(folder)
    text = dumps(summary, indent=2, allow_nan=False) + "\n"
    # The temporary file sits in the same folder so os.replace is a rename, not a copy. Its name
    # says who writes it, so that a later writer can tell one left by a killed process.
    tmp_name = str(folder / f".summary.{_writer()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write_then_name(folder, text, tmp_name)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return target


def _write_then_name(folder: Path, text: str, name: str) -> None:
    """Write `text` to a new file called `name`, fsynced. Where the file system allows it
    (Linux O_TMPFILE) the file has no name until it is whole, so a SIGKILL while it is written
    leaves nothing behind; only the instant between naming and the rename remains."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o644)
    except (AttributeError, OSError):  # no O_TMPFILE here: a named file from the start
        fd = None
    if fd is not None:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            _fill(tmp, text)
            if _name_unnamed(tmp.fileno(), name):
                return
    with open(name, "x", encoding="utf-8") as tmp:
        _fill(tmp, text)


def _fill(tmp, text: str) -> None:
    os.fchmod(tmp.fileno(), 0o644)  # the summary is for everyone to read, whatever the umask
    tmp.write(text)
    tmp.flush()
    os.fsync(tmp.fileno())


def _name_unnamed(fd: int, name: str) -> bool:
    """Give the O_TMPFILE file `fd` its name: linkat(AT_EMPTY_PATH), else through /proc; False
    where neither is allowed (then the caller writes a named file)."""
    import ctypes

    at_empty_path, at_fdcwd = 0x1000, -100  # <fcntl.h>
    try:
        if ctypes.CDLL(None, use_errno=True).linkat(fd, b"", at_fdcwd, os.fsencode(name), at_empty_path) == 0:
            return True
    except (OSError, AttributeError):
        pass
    try:
        os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
        return True
    except OSError:
        return False


def _writer() -> str:
    return f"{socket.gethostname().replace('.', '-')}.{os.getpid()}"


def clean_stale_summaries(folder: Path) -> None:
    """Remove temporary summaries that a process killed mid-write (SIGKILL: no cleanup runs)
    left in `folder`: those written on this host by a process that no longer exists. Others'
    (another host on shared storage, a live writer) are left alone."""
    host = socket.gethostname().replace(".", "-")
    for tmp in folder.glob(".summary.*.tmp"):
        parts = tmp.name.split(".")  # '', summary, host, pid, random, tmp
        if len(parts) != 6 or parts[2] != host or not parts[3].isdigit():
            continue
        try:
            os.kill(int(parts[3]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # alive, someone else's


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


ETTR_DIGITS = 6  # ettr is rounded to this many decimals (0.0001 %)


def ettr(productive_s: Any, time_s: Any) -> float | None:
    """Effective training time ratio: the time spent on iterations that count (`productive_s`:
    each iteration the final model holds, once, at the time its kept execution took) over the
    run's whole time (`time_s`: with checkpoint stalls, recoveries, waits for replacements,
    lost iterations and redone work). A float in [0, 1], rounded to ETTR_DIGITS decimals;
    None when the run spent no time (or either number is missing)."""
    if not (_is_number(productive_s) and _is_number(time_s)) or not time_s > 0 or not math.isfinite(time_s):
        return None
    return round(min(max(productive_s / time_s, 0.0), 1.0), ETTR_DIGITS)


def summary_ettr(summary: dict) -> float | None:
    """A summary's `ettr`; for a summary written before it existed, from `productive_s` and
    `time_s` when it has them (else None)."""
    value = summary.get("ettr")
    if _is_number(value):
        return float(value)
    return ettr(summary.get("productive_s"), summary.get("time_s"))


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


__all__ = [
    "SUMMARY_KEYS", "STATUSES", "METRICS_FILE", "SUMMARY_FILE", "MetricsWriter", "check_summary", "dumps",
    "write_summary", "read_metrics", "recovery_totals", "peak_memory_max", "ettr", "summary_ettr",
]
