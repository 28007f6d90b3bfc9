"""Tables (Markdown or CSV) over many run folders, and the sweep helper behind them
(`swept_keys`, which the CLI records in each summary). `python -m ftbench.report` (ftbench/report.py)
prints them; the other rooms of reading results: plots of a sweep in ftbench/sweep_plots.py,
Gantt charts in ftbench/gantt.py, the console summary of one run in ftbench/console.py, the
sweep's Hydra callback in ftbench/sweep_check.py, W&B in ftbench/wandb_sink.py.
"""
from __future__ import annotations

import csv
import io
import json
import re
import statistics
import warnings
from pathlib import Path
from typing import Any, Iterable

from ftbench.console import failure_count
from ftbench.metrics import (METRICS_FILE, SUMMARY_FILE, peak_memory_max, read_metrics, recovery_totals,
                             summary_ettr)

DEFAULT_COLUMNS = ["strategy", "model", "schedule", "backend", "pp", "dp", "microbatches", "iterations",
                   "time_s", "iteration_s", "throughput", "ettr", "samples_dropped", "failures", "recovery_s",
                   "lost_iterations", "status"]


# --------------------------------------------------------------------------- many runs

def _natural_key(path: Path) -> list:
    """Sort sweep folders 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _summary_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / SUMMARY_FILE).is_file():
        return [path / SUMMARY_FILE]
    return sorted(path.rglob(SUMMARY_FILE), key=_natural_key)


def load_runs(paths: list[str | Path]) -> list[dict]:
    """Summaries from run folders, summary.json files, or folders searched recursively.

    Each summary gets "run_dir". A missing path raises FileNotFoundError; an unreadable
    summary is skipped with a warning so one broken run does not hide a whole sweep.
    """
    runs, seen = [], set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"no such file or folder: {path}")
        for file in _summary_files(path):
            resolved = file.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            try:
                summary = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                warnings.warn(f"skipping {file}: {exc}", stacklevel=2)
                continue
            if not isinstance(summary, dict):
                warnings.warn(f"skipping {file}: not a JSON object", stacklevel=2)
                continue
            summary["run_dir"] = str(file.parent)
            runs.append(summary)
    return runs


# --------------------------------------------------------------------------- overrides and sweeps

SEED_KEYS = ("seed", "failures.seed")  # runs that differ only in these are repeats of one setup
# Swept keys an always-shown column already displays under another name.
COLUMN_ALIASES = {"cluster.dp": "dp", "cluster.pp": "pp", "train.microbatches": "microbatches"}
MULTIRUN_FILE = "multirun.yaml"  # Hydra writes it into the sweep folder before launching any job


def _scalar(text: str) -> Any:
    """An override's value as typed: numbers become numbers, anything else stays text."""
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            continue
    return text


def override_map(overrides: Iterable[str] | None) -> dict[str, Any]:
    """{"strategy.level": "reroute", "cluster.dp": 4, ...} from ["strategy.level=reroute", ...];
    `+`/`++`/`~` prefixes are dropped (a `~key` deletion maps to None)."""
    values: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, value = str(item).partition("=")
        key = key.strip().lstrip("+~")
        if key:
            values[key] = _scalar(value) if sep else None
    return values


def swept_keys(sweep_dir: Path | str) -> list[str]:
    """The keys a Hydra --multirun sweep varies, in the order given: overrides with several
    values (`a=1,2`, `range()`, `choice()`, `glob()`, `interval()`) on the command line or in
    `hydra.sweeper.params`. Read from the `multirun.yaml` Hydra's sweeper saves in the sweep
    folder before it launches any job, so every job sees the same answer whatever launcher runs
    it (in-process, joblib workers, SLURM). [] with a warning when that file cannot be read."""
    path = Path(sweep_dir) / MULTIRUN_FILE
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        hydra_cfg = OmegaConf.load(path).hydra
        params = OmegaConf.select(hydra_cfg, "sweeper.params")
        lines = [f"{key}={value}" for key, value in
                 (OmegaConf.to_container(params, resolve=False) if params else {}).items()]
        lines += [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception as exc:  # a missing or odd file must not fail the job: the report copes
        warnings.warn(f"cannot read the sweep's overrides from {path}: {exc}", stacklevel=2)
        return []
    keys: list[str] = []
    for override in parsed:
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if override.is_sweep_override() and key not in keys:
            keys.append(key)
    return keys


# --------------------------------------------------------------------------- table columns

def run_clock(run: dict) -> str | None:
    """Which seconds a run's times count: "sim" (the cost model: every sim run, and local runs
    with backend.clock=model) or "wall" (measured; local's default)."""
    clock = run.get("clock")
    if clock == "wall":
        return "wall"
    if clock == "model" or run.get("backend") == "sim":
        return "sim"
    if run.get("backend") in ("local", "dist"):
        return "wall"
    return None


_ITERATION_CACHE: dict[tuple[str, int], float | None] = {}


def _iteration_seconds(run: dict) -> float | None:
    """Time of one iteration in the run's clock. sim: `iteration_time_s` (one iteration of the
    first plan, no failure); local: the median over the iterations in metrics.jsonl
    (`iteration_s` on the wall clock, the step of `time_s` on the modelled clock)."""
    value = run.get("iteration_time_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    run_dir = run.get("run_dir")
    path = Path(run_dir) / METRICS_FILE if run_dir else None
    try:
        key = (str(path), path.stat().st_mtime_ns) if path else None
    except OSError:
        return None
    if key is None:
        return None
    if key not in _ITERATION_CACHE:
        try:
            records = [r for r in read_metrics(path) if r.get("event") == "iteration"]
        except (OSError, ValueError):
            records = []
        if run_clock(run) == "wall":
            times = [r["iteration_s"] for r in records if isinstance(r.get("iteration_s"), (int, float))]
        else:
            stamps = [0.0] + [r["time_s"] for r in records if isinstance(r.get("time_s"), (int, float))]
            times = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
        _ITERATION_CACHE[key] = statistics.median(times) if times else None
    return _ITERATION_CACHE[key]


# Columns computed from list fields, so tables can show them next to plain keys.
DERIVED_COLUMNS = {
    "recoveries": lambda run: recovery_totals(run)["count"],
    "recovery_s": lambda run: recovery_totals(run)["recovery_s"],
    "lost_iterations": lambda run: recovery_totals(run)["lost_iterations"],
    "peak_memory_gb": lambda run: (None if peak_memory_max(run) is None
                                   else peak_memory_max(run) / 1e9),
    "failures": lambda run: failure_count(run.get("failures")),
    "iteration_s": _iteration_seconds,
    "clock": run_clock,
    "ettr": summary_ettr,
}
SEEDS_COLUMN = "seeds"  # the seeds of a row that stands for several runs
# Headers with units; "{clock}" is "sim s", "wall s", or "s" when the table mixes clocks
# (it then has a `clock` column saying which, per row).
HEADERS = {
    "time_s": "time ({clock})",
    "iteration_s": "iteration ({clock})",
    "iteration_time_s": "iteration_time ({clock})",
    "recovery_s": "recovery total ({clock})",
    "throughput": "throughput (samples/{clock})",
    "peak_memory_gb": "peak memory (GB)",
    "lost_iterations": "lost iterations",
    "ettr": "ETTR",
    "samples_dropped": "samples dropped",
}
TIMED_COLUMNS = ("time_s", "iteration_s", "iteration_time_s", "recovery_s", "throughput")


def column_value(run: dict, column: str) -> Any:
    if column in DERIVED_COLUMNS:
        return DERIVED_COLUMNS[column](run)
    if column == SEEDS_COLUMN:
        return _seed_label(run)
    value: Any = run
    for part in column.split("."):  # dotted names reach into nested dicts
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:  # a swept or overridden setting the summary has no key for
        value = override_map(run.get("overrides")).get(column)
    return value


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        if abs(value) >= 1e4:
            return f"{value:.0f}"
        if abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_numeric_column(values: list[Any]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(_is_number(v) for v in present)


def valid_columns(runs: list[dict]) -> list[str]:
    """Every column name `runs_table` can fill for these runs."""
    names = set(DEFAULT_COLUMNS) | set(DERIVED_COLUMNS) | {SEEDS_COLUMN}
    for run in runs:
        names |= set(run) | set(override_map(run.get("overrides")))
    return sorted(names)


def unknown_columns(runs: list[dict], columns: list[str]) -> list[str]:
    """The names in `columns` no run has (typos): their cells would all be empty."""
    valid = set(valid_columns(runs))
    return [c for c in columns if c not in valid and all(column_value(run, c) is None for run in runs)]


def _seed_label(run: dict) -> Any:
    overrides = override_map(run.get("overrides"))
    seed = run.get("seed", overrides.get("seed"))
    if overrides.get("failures.seed") is not None:
        return f"{_cell(seed)} (failures {_cell(overrides['failures.seed'])})"
    return seed


def _setup_key(run: dict) -> tuple | None:
    """What a run is, apart from its seed; None (never grouped) for a summary without
    `overrides`, whose setup is not fully recorded."""
    if not isinstance(run.get("overrides"), list):
        return None
    overrides = {k: _cell(v) for k, v in override_map(run["overrides"]).items() if k not in SEED_KEYS}
    fields = tuple(_cell(run.get(k)) for k in ("strategy", "backend", "model", "hardware", "schedule",
                                               "pp", "dp", "microbatches", "global_batch", "status"))
    return tuple(sorted(overrides.items())), fields, run_clock(run)


def group_by_seed(runs: list[dict]) -> list[list[dict]]:
    """Runs that differ only in the seed (`seed`, `failures.seed`) and ended with the same
    status, grouped in order of first appearance; every other run is a group of its own."""
    groups: list[list[dict]] = []
    index: dict[tuple, int] = {}
    for run in runs:
        key = _setup_key(run)
        if key is not None and key in index:
            groups[index[key]].append(run)
            continue
        if key is not None:
            index[key] = len(groups)
        groups.append([run])
    return groups


def _aggregate(values: list[Any], column: str) -> tuple[Any, float | None]:
    """(value, spread) of one column over a group: the value when all agree; mean and sample
    standard deviation when they are numbers that differ; else the distinct values listed."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    if len(present) == len(values) and all(v == present[0] for v in present):
        return present[0], None
    if column in SEED_KEYS or column == SEEDS_COLUMN or not all(_is_number(v) for v in present):
        distinct = list(dict.fromkeys(_cell(v) for v in present))
        return ",".join(distinct), None
    return statistics.fmean(present), (statistics.stdev(present) if len(present) > 1 else 0.0)


def swept_columns(runs: list[dict], columns: list[str], aggregated: bool) -> list[str]:
    """Keys the runs' sweeps varied (`swept`), then override keys whose value differs between
    runs (runs from separate sweeps or single runs), minus those already shown."""
    keys: list[str] = []
    for run in runs:
        keys += [str(k) for k in run.get("swept") or [] if k not in keys]
    maps = [override_map(run.get("overrides")) for run in runs]
    for key in dict.fromkeys(k for m in maps for k in m):
        if len({_cell(m.get(key)) for m in maps}) > 1 and key not in keys:
            keys.append(key)
    shown = set(columns)
    return [k for k in keys if k not in shown and COLUMN_ALIASES.get(k) not in shown
            and not (aggregated and k in SEED_KEYS)]


def x_keys(runs: list[dict]) -> list[str]:
    """The swept keys a plot can put on its x axis: all but the strategy and the seeds."""
    return [k for k in swept_columns(runs, [], aggregated=False) if k not in ("strategy", *SEED_KEYS)]


def _table_columns(runs: list[dict], columns: list[str] | None, groups: list[list[dict]],
                   clocks: set[str]) -> list[str]:
    aggregated = any(len(group) > 1 for group in groups)
    explicit = columns is not None
    columns = list(columns if explicit else DEFAULT_COLUMNS)
    if not explicit:
        at = columns.index("strategy") + 1 if "strategy" in columns else 0
        columns[at:at] = swept_columns(runs, columns, aggregated)
        if aggregated and not any(c in columns for c in (*SEED_KEYS, SEEDS_COLUMN)):
            columns.append(SEEDS_COLUMN)
    if len(clocks) > 1 and "clock" not in columns and any(c in TIMED_COLUMNS for c in columns):
        timed = min(columns.index(c) for c in TIMED_COLUMNS if c in columns)
        at = columns.index("backend") + 1 if "backend" in columns else timed
        columns.insert(at, "clock")
    return columns


def _header(column: str, clocks: set[str]) -> str:
    if column not in HEADERS:
        return column
    clock = f"{next(iter(clocks))} s" if len(clocks) == 1 else "s"
    return HEADERS[column].format(clock=clock)


def runs_table(runs: list[dict], columns: list[str] | None = None, fmt: str = "md",
               aggregate: bool = True) -> str:
    """A Markdown (fmt="md") or CSV (fmt="csv") table, one row per run.

    Default columns: DEFAULT_COLUMNS plus, after `strategy`, one per swept key (the summaries'
    `swept`, and override keys whose value differs between runs). Headers of times state the
    clock: `time (sim s)` / `time (wall s)`; a table mixing clocks says `time (s)` and adds a
    `clock` column. With `aggregate`, runs that differ only in the seed share one row: numbers
    that differ are mean ± sample standard deviation (CSV: the mean, and the deviation in a
    `<header> std` column after it), the seeds are listed in `seeds` (or the seed column).
    """
    if fmt not in ("md", "csv"):
        raise ValueError(f"table format {fmt!r} is not 'md' or 'csv'")
    groups = group_by_seed(runs) if aggregate else [[run] for run in runs]
    clocks = {clock for clock in (run_clock(run) for run in runs) if clock}
    columns = _table_columns(runs, columns, groups, clocks)
    pairs = [[_aggregate([column_value(run, c) for run in group], c) for c in columns] for group in groups]
    spread = [any(row[i][1] is not None for row in pairs) for i in range(len(columns))]
    headers = [_header(c, clocks) for c in columns]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([h for i, header in enumerate(headers)
                         for h in ([header, f"{header} std"] if spread[i] else [header])])
        for row in pairs:
            writer.writerow([cell for i, (value, std) in enumerate(row)
                             for cell in ([_cell(value), _cell(std)] if spread[i] else [_cell(value)])])
        return out.getvalue()
    cells = [[_cell(value) + (f" ± {_cell(std)}" if std is not None else "") for value, std in row]
             for row in pairs]
    cells = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in cells]
    widths = [max([len(h), 3] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    numeric = [_is_numeric_column([row[i][0] for row in pairs]) for i in range(len(columns))]

    def line(parts: list[str]) -> str:
        return "| " + " | ".join(parts) + " |"

    header = line([h.ljust(w) for h, w in zip(headers, widths)])
    rule = line([("-" * (w - 1) + ":") if num else "-" * w for w, num in zip(widths, numeric)])
    body = [line([c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)])
            for row in cells]
    text = "\n".join([header, rule, *body]) + "\n"
    if any(spread):
        text += "\nRows over several seeds: numbers that differ are mean ± sample standard deviation.\n"
    return text
