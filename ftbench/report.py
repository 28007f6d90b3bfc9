"""Reading results: Gantt charts of one iteration, a console summary of one run, tables
(Markdown or CSV) over many run folders, and the sweep helpers behind them (`swept_keys`,
which the CLI records in each summary, and `SweepCheck`, the Hydra callback that makes a
sweep with no "ok" job exit non-zero).

CLI: `python -m ftbench.report RUN_OR_SWEEP_DIR... [--csv] [--out FILE] [--columns A,B]
[--per-run]`. Default columns: strategy, one per swept key, model, schedule, backend, pp, dp,
microbatches, iterations, time, iteration time, throughput, ETTR (`ettr`: productive time over
the run's time), failures, recovery total, lost iterations, status. Times are in the run's
clock, named in the header: `sim s` (the cost model: sim, or local with backend.clock=model)
or `wall s` (measured); a table that mixes them says `s` and adds a `clock` column.
Iteration time: sim, one iteration of the first plan; local, the median over its iterations
(metrics.jsonl). Runs that differ only in the seed share a row: numbers that differ show
mean ± sample standard deviation (`--per-run`: no grouping).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import statistics
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from hydra.experimental.callback import Callback

from ftbench.metrics import (METRICS_FILE, SUMMARY_FILE, peak_memory_max, read_metrics, recovery_totals,
                             summary_ettr)

KIND_COLOURS: dict[str, str] = {
    "F": "#4C72B0",    # forward: blue
    "B": "#DD8452",    # input gradient: orange
    "W": "#55A868",    # weight gradient: green
    "BW": "#C44E52",   # fused backward: red
    "OPT": "#8172B3",  # optimizer step: purple
    "RF": "#A1C9F4",   # Bamboo's redundant forward: light blue
    "RSYNC": "#64B5CD",  # Bamboo's redundant-copy refresh: teal
    "AR": "#937860",   # gradient all-reduce (network): brown, drawn hatched
}
UNKNOWN_COLOUR = "#9E9E9E"
COMM_KINDS = {"AR"}  # network ops: not compute, so they do not fill bubbles
MAX_ROWS = 64  # rows drawn before the chart keeps only the first and last halves
MAX_LABELS = 4000  # micro-batch numbers written at most; more only slows drawing down

DEFAULT_COLUMNS = ["strategy", "model", "schedule", "backend", "pp", "dp", "microbatches", "iterations",
                   "time_s", "iteration_s", "throughput", "ettr", "failures", "recovery_s", "lost_iterations",
                   "status"]


# --------------------------------------------------------------------------- Gantt chart

def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals, so overlapping ops on one worker count once."""
    busy, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        busy += end - max(start, end_so_far)
        end_so_far = end
    return busy


def bubble_fraction(timeline: list[dict], workers: Iterable[int] | None = None) -> float:
    """1 - busy compute / (workers * makespan); all-reduce time is not compute."""
    if not timeline:
        return 0.0
    t0 = min(op["start"] for op in timeline)
    makespan = max(op["end"] for op in timeline) - t0
    worker_ids = set(workers) if workers is not None else {op["worker"] for op in timeline}
    if makespan <= 0 or not worker_ids:
        return 0.0
    per_worker: dict[int, list[tuple[float, float]]] = {}
    for op in timeline:
        if op["kind"] not in COMM_KINDS:
            per_worker.setdefault(op["worker"], []).append((op["start"], op["end"]))
    busy = sum(_busy_seconds(spans) for spans in per_worker.values())
    return max(0.0, 1.0 - busy / (len(worker_ids) * makespan))


def _rows_to_draw(workers: list[int]) -> tuple[list[int], bool]:
    """All workers, or the first and last MAX_ROWS/2 when there are too many to read."""
    if len(workers) <= MAX_ROWS:
        return workers, False
    half = MAX_ROWS // 2
    return workers[:half] + workers[-half:], True


def _time_unit(span_s: float) -> tuple[float, str]:
    return (1000.0, "ms") if span_s < 10.0 else (1.0, "s")


def _fits(width_pt: float, height_pt: float, text: str, fontsize: float) -> bool:
    """Whether `text` fits inside a bar of this size, with a little margin."""
    return width_pt >= 0.62 * fontsize * len(text) + 3 and height_pt >= fontsize + 2


def plot_gantt(timeline: list[dict], path: Path | str, title: str = "",
               worker_labels: dict[int, str] | None = None) -> Path:
    """Draw one row per worker (worker 0 on top), a bar per op coloured by kind, into a PNG."""
    import matplotlib
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = worker_labels or {}
    rows, _, _ = _gantt_rows(timeline, labels)
    t0, span = gantt_span([timeline])
    width_in, row_in = 12.0, 0.3
    height_in = max(2.6, 1.6 + row_in * max(len(rows), 1))
    fig, ax = plt.subplots(figsize=(width_in, height_in))
    try:
        _draw_gantt(ax, timeline, labels, title, t0, span, width_in, row_in)
        ax.legend(handles=_legend_handles([timeline]), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  frameon=False)
        fig.savefig(path, dpi=120, bbox_inches="tight", facecolor="white")
    finally:
        plt.close(fig)
    return path


def plot_gantt_panels(panels: list[tuple[str, list[dict]]], path: Path | str, title: str = "",
                      shared_axis: bool = True) -> Path:
    """Several timelines stacked vertically, one panel per (title, timeline), into a PNG: on one
    shared time axis (same origin and scale everywhere, so lengths compare at a glance), or
    with `shared_axis=False` each on its own (a measured run beside a model of it). Panels
    draw as in plot_gantt; the legend (every kind in any panel) appears once."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("plot_gantt_panels needs at least one (title, timeline) panel")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    timelines = [timeline for _, timeline in panels]
    t0, span = gantt_span(timelines)
    width_in, row_in = 12.0, 0.3
    # Each panel: its rows plus about 0.9 in for its two-line title and the tick labels.
    heights = [0.9 + row_in * max(len(_gantt_rows(tl, {})[0]), 1) for tl in timelines]
    fig, axes = plt.subplots(len(panels), 1, sharex=shared_axis, squeeze=False,
                             figsize=(width_in, sum(heights) + 0.6 + (0.4 if title else 0.0)),
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    axes = [row[0] for row in axes]
    try:
        for ax, (panel_title, timeline) in zip(axes, panels):
            origin, length = (t0, span) if shared_axis else gantt_span([timeline])
            _draw_gantt(ax, timeline, {}, panel_title, origin, length, width_in, row_in)
        for ax in axes[:-1] if shared_axis else ():
            ax.set_xlabel("")  # one time axis: labelled at the bottom only
        axes[0].legend(handles=_legend_handles(timelines), loc="upper left",
                       bbox_to_anchor=(1.01, 1.0), frameon=False)
        if title:
            fig.suptitle(title, fontsize=11, x=0.0, ha="left")
        fig.savefig(path, dpi=120, bbox_inches="tight", facecolor="white")
    finally:
        plt.close(fig)
    return path


def gantt_span(timelines: list[list[dict]]) -> tuple[float, float]:
    """(t0, span) covering every op of every timeline: the common origin and length of the
    time axis (0.0, 0.0 when there are no ops)."""
    starts = [op["start"] for timeline in timelines for op in timeline]
    ends = [op["end"] for timeline in timelines for op in timeline]
    t0 = min(starts, default=0.0)
    return t0, max(ends, default=0.0) - t0


def _gantt_rows(timeline: list[dict], labels: dict[int, str]) -> tuple[list[int], list[int], bool]:
    """(rows drawn, all workers, whether rows were capped)."""
    workers = sorted({op["worker"] for op in timeline} | set(labels))
    rows, capped = _rows_to_draw(workers)
    return rows, workers, capped


def _draw_gantt(ax: Any, timeline: list[dict], labels: dict[int, str], title: str, t0: float,
                span: float, width_in: float, row_in: float) -> None:
    """One timeline into `ax` (bars, micro-batch numbers, axes, title) on the time axis
    [t0, t0 + span]; the legend is the caller's."""
    rows, workers, capped = _gantt_rows(timeline, labels)
    row_of = {worker: index for index, worker in enumerate(rows)}
    scale, unit = _time_unit(span)
    # About 3 points of plot width, in time units: the narrowest bar a separator suits.
    narrow = span * scale * 3.0 / (width_in * 72 * 0.75)
    _draw_ops(ax, timeline, row_of, t0, scale, narrow)
    _draw_labels(ax, timeline, row_of, t0, scale, span, width_in, row_in)
    _style_axes(ax, rows, labels, span * scale, unit, t0, capped)
    ax.set_title(_gantt_title(title, timeline, workers, rows, capped, _own_span(timeline), scale, unit),
                 fontsize=10, loc="left")
    if not timeline:
        ax.text(0.5, 0.5, "empty timeline", transform=ax.transAxes, ha="center", va="center")


def _own_span(timeline: list[dict]) -> float:
    return gantt_span([timeline])[1]


def _legend_handles(timelines: list[list[dict]]) -> list:
    from matplotlib.patches import Patch

    kinds = {op["kind"] for timeline in timelines for op in timeline}
    handles = [Patch(facecolor=KIND_COLOURS[k], edgecolor="#555555",
                     hatch="////" if k in COMM_KINDS else None,
                     label="AR (all-reduce)" if k == "AR" else k) for k in KIND_COLOURS if k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#BBBBBB", label="idle (bubble)"))
    return handles


def _draw_ops(ax: Any, timeline: list[dict], row_of: dict[int, int], t0: float,
              scale: float, narrow: float) -> None:
    """One broken_barh per (row, kind): far fewer artists than one bar per op.

    Bars narrower than `narrow` (x units) get an outline in their own colour instead of the
    white separator, which would otherwise paint over them and hide short ops entirely.
    """
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for op in timeline:
        row = row_of.get(op["worker"])
        if row is not None:
            bar = ((op["start"] - t0) * scale, max(0.0, op["end"] - op["start"]) * scale)
            groups.setdefault((row, op["kind"]), []).append(bar)
    for (row, kind), bars in groups.items():
        colour = KIND_COLOURS.get(kind, UNKNOWN_COLOUR)
        if kind in COMM_KINDS:
            # Network op: thin, hatched, low in the row, on top of any compute it overlaps.
            ax.broken_barh(bars, (row + 0.12, 0.28), facecolors="#F3ECE4", edgecolors=colour,
                           hatch="////", linewidth=0.6, zorder=3)
        else:
            edges = ["white" if width >= narrow else colour for _, width in bars]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, edgecolors=edges,
                           linewidth=0.4, zorder=2)


def _draw_labels(ax: Any, timeline: list[dict], row_of: dict[int, int], t0: float,
                 scale: float, span: float, width_in: float, row_in: float) -> None:
    """Micro-batch numbers inside compute bars that are wide enough to hold them."""
    if span <= 0:
        return
    fontsize = 7 if len(row_of) <= 32 else 5.5
    plot_width_pt = width_in * 72 * 0.75  # the axes take about three quarters of the figure
    height_pt = row_in * 72 * 0.8
    written = 0
    for op in timeline:
        row = row_of.get(op["worker"])
        mb = op.get("microbatch")
        if row is None or mb is None or op["kind"] in COMM_KINDS:
            continue
        text = str(mb)
        width_pt = (op["end"] - op["start"]) / span * plot_width_pt
        if not _fits(width_pt, height_pt, text, fontsize):
            continue
        centre = ((op["start"] + op["end"]) / 2 - t0) * scale
        ax.text(centre, row, text, ha="center", va="center", fontsize=fontsize,
                color="white", zorder=4, clip_on=True)
        written += 1
        if written >= MAX_LABELS:
            return


def _style_axes(ax: Any, rows: list[int], labels: dict[int, str], span: float, unit: str,
                t0: float, capped: bool) -> None:
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)  # inverted: worker 0 on top
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([labels.get(w, f"w{w}") for w in rows],
                       fontsize=8 if len(rows) <= 32 else 6)
    # A sliver of room on both sides so ops at the very start or end are not hidden by the frame.
    ax.set_xlim((-0.005 * span, span * 1.01) if span > 0 else (0.0, 1.0))
    xlabel = f"time ({unit})"
    if t0:
        xlabel += f" since t = {t0:.6g} s"
    ax.set_xlabel(xlabel)
    ax.set_facecolor("white")
    ax.set_axisbelow(True)  # grid behind bars, so bubbles read as white gaps on a light grid
    ax.grid(True, axis="x", color="#E4E4E4", linewidth=0.8)
    for row in range(len(rows) + 1):  # faint row separators
        ax.axhline(row - 0.5, color="#F0F0F0", linewidth=0.6, zorder=0)
    if capped:
        half = len(rows) // 2
        ax.axhline(half - 0.5, color="#555555", linestyle="--", linewidth=1.0, zorder=5)


def _gantt_title(title: str, timeline: list[dict], workers: list[int], rows: list[int],
                 capped: bool, span: float, scale: float, unit: str) -> str:
    bubbles = bubble_fraction(timeline, workers)
    plural = "worker" if len(workers) == 1 else "workers"
    facts = (f"bubble fraction {bubbles:.1%}  |  {len(workers)} {plural}  |  "
             f"makespan {span * scale:.4g} {unit}")
    if capped:
        half = len(rows) // 2
        facts += f"  |  showing first {half} and last {half} of {len(workers)} workers"
    return f"{title}\n{facts}" if title else facts


# --------------------------------------------------------------------------- one run

def human_duration(seconds: Any) -> str:
    """3.9 ms, 12.3 s, 4.5 min, 2.25 h, 3.1 d."""
    if not isinstance(seconds, (int, float)):
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if abs(seconds) >= size:
            return f"{_short(seconds / size)} {unit}"
    if seconds == 0:
        return "0 s"
    return f"{_short(seconds * 1000)} ms"  # tiny simulated models finish in milliseconds


def _memory(peak_bytes: float | None) -> str:
    if peak_bytes is None:
        return "-"
    if peak_bytes >= 1e8:
        return f"{peak_bytes / 1e9:.2f} GB per worker (max)"
    return f"{peak_bytes / 1e6:.3g} MB per worker (max)"  # toy models would read 0.00 GB


def _short(value: float) -> str:
    """About three significant digits without scientific notation."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01 or value == 0:
        return f"{value:.2f}"
    return f"{value:.2g}"


def _count(value: Any) -> Any:
    """`failures` is a count, but a list of failure records is counted too."""
    return len(value) if isinstance(value, (list, tuple)) else value


def _percent(ratio: float | None) -> str:
    """0.97312 -> '97.3 %'; a ratio short of 1 never reads as 100.0 % (at most 99.9 %)."""
    if ratio is None:
        return "-"
    return f"{min(ratio * 100, 99.9) if ratio < 1 else 100.0:.1f} %"


def _or_dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _final_shape(s: dict) -> str:
    """' (ended pp=4 dp=1)' when the run ended in another shape than it started in."""
    final = s.get("final_shape")
    return f" (ended {final})" if final and final != f"pp={s.get('pp')} dp={s.get('dp')}" else ""


def format_summary(summary: dict) -> str:
    """A short aligned table of one run for the console."""
    s = summary
    # the modelled clock (sim, or local/dist with backend.clock=model) is simulated time
    sim = s.get("backend") == "sim" or s.get("clock") == "model"
    totals = recovery_totals(s)
    peak = peak_memory_max(s)
    throughput = s.get("throughput")
    iterations = _or_dash(s.get("iterations"))
    if s.get("samples") is not None:
        iterations += f" ({s['samples']} samples)"
    microbatches = _or_dash(s.get("microbatches"))
    if s.get("global_batch") is not None:
        microbatches += f" (global batch {s['global_batch']})"
    status = _or_dash(s.get("status"))
    if s.get("status") != "ok" and s.get("error"):
        status += f": {s['error']}"
    charged = sum(float(r.get("charged_restart_s") or 0.0) for r in s.get("recoveries") or [] if isinstance(r, dict))
    clock_time = human_duration(s.get("time_s"))
    if charged:  # local: restarts a process cannot perform on itself, charged at the measured profile's cost
        clock_time += f" ({human_duration(charged)} of it charged for process restarts: hardware.restart_s)"
    rows = [
        ("strategy", _or_dash(s.get("strategy"))),
        ("backend", _or_dash(s.get("backend"))),
        ("model", _or_dash(s.get("model"))),
        ("pp x dp", f"{_or_dash(s.get('pp'))} x {_or_dash(s.get('dp'))}" + _final_shape(s)),
        ("micro-batches", microbatches),
        ("iterations", iterations),
        ("simulated time" if sim else "wall time", clock_time),
        ("throughput", f"{_short(throughput)} samples/s"
         if isinstance(throughput, (int, float)) else "-"),
        ("ETTR", _percent(summary_ettr(s))),
        ("failures", _or_dash(_count(s.get("failures")))),
        ("recoveries", f"{totals['count']} (total {human_duration(totals['recovery_s'])})"),
        ("lost iterations", str(totals["lost_iterations"])),
        ("peak memory", _memory(peak)),
        ("status", status),
    ]
    if s.get("matches_fault_free") is not None:  # local runs that ran the equivalence check
        verdict = "yes" if s["matches_fault_free"] else f"NO ({s.get('fault_free_difference')})"
        rows.append(("matches fault-free", verdict + _against_floor(s)))
    if s.get("run_dir"):  # where everything else is: the last line, found at a glance
        rows.append(("run folder", str(s["run_dir"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def _against_floor(s: dict) -> str:
    """A float32 verdict's numbers: the largest difference beside its measured noise floor."""
    seen, floor = s.get("fault_free_difference_max"), s.get("fault_free_noise_floor")
    if not seen or not floor:
        return ""
    def g(x) -> str:
        return f"{x:.2g}" if isinstance(x, (int, float)) else str(x)
    return (f"; {seen['parameter']} off by {g(seen['weights'])}, float32 noise floor {g(floor['weights'])}"
            f" (x{floor['factor']} allowed); losses off by {g(seen['loss'])}, floor {g(floor['loss'])}")


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


def sweep_exit_code(statuses: list[Any]) -> int:
    """0 when some job ended "ok"; 2 when every job ended "error" (a setting to fix); 3 otherwise
    (no job ended "ok": all "oom"/"unrecoverable", a mix, or no summary at all)."""
    if "ok" in statuses:
        return 0
    if statuses and all(status == "error" for status in statuses):
        return 2
    return 3


def _summary_stamps(folder: Path) -> dict[Path, tuple[int, int]]:
    if not folder.is_dir():
        return {}
    stamps = {}
    for path in folder.rglob(SUMMARY_FILE):
        try:
            stat = path.stat()
        except OSError:
            continue
        stamps[path] = (stat.st_ino, stat.st_mtime_ns)
    return stamps


class SweepCheck(Callback):
    """Hydra callback (conf/config.yaml, `hydra.callbacks.sweep_check`): when a --multirun sweep
    ends and no job ended "ok", print why and exit with `sweep_exit_code` (3; 2 when every job
    was a setting error). It reads the summary.json files under the sweep folder that are new
    or rewritten since the sweep started (summaries are replaced atomically, so a rewrite has a
    new inode), which works whichever launcher ran the jobs: in this process, in joblib
    workers, or on SLURM (shared filesystem). A job that raised made Hydra fail already."""

    def __init__(self) -> None:
        self._sweep_dir: Path | None = None
        self._before: dict[Path, tuple[int, int]] = {}

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        self._before = _summary_stamps(self._sweep_dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        before = self._before if sweep_dir == self._sweep_dir else {}
        statuses: list[Any] = []
        for path, stamp in sorted(_summary_stamps(sweep_dir).items()):
            if before.get(path) == stamp:
                continue  # an older sweep's job in a reused folder
            try:
                statuses.append(json.loads(path.read_text(encoding="utf-8")).get("status"))
            except (OSError, ValueError, AttributeError):
                statuses.append(None)
        from omegaconf import OmegaConf

        mode = OmegaConf.select(config, "wandb.mode", default="disabled")
        if statuses and mode != "disabled":  # log_sweep_table honours WANDB_MODE=disabled too  # one W&B table of the sweep's summaries, in the sweep's group
            from ftbench.metrics import log_sweep_table

            log_sweep_table(sweep_dir, OmegaConf.select(config, "wandb"))
        code = sweep_exit_code(statuses)
        if not code:
            counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(str(s) for s in statuses).items()))
            print(f"ftbench: sweep done ({counts}). Sweep folder: {sweep_dir}")
        if code:
            counts = ", ".join(f"{n} {status}" for status, n in
                               sorted(Counter(str(s) for s in statuses).items())) or f"no {SUMMARY_FILE}"
            print(f"ftbench: no job of the sweep ended 'ok' ({counts}); exit code {code}.\n"
                  f"Sweep folder: {sweep_dir}", file=sys.stderr)
            sys.exit(code)


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
    "failures": lambda run: _count(run.get("failures")),
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
}
TIMED_COLUMNS = ("time_s", "iteration_s", "iteration_time_s", "recovery_s", "throughput")


def _value(run: dict, column: str) -> Any:
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
    return [c for c in columns if c not in valid and all(_value(run, c) is None for run in runs)]


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


def _swept_columns(runs: list[dict], columns: list[str], aggregated: bool) -> list[str]:
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


def _table_columns(runs: list[dict], columns: list[str] | None, groups: list[list[dict]],
                   clocks: set[str]) -> list[str]:
    aggregated = any(len(group) > 1 for group in groups)
    explicit = columns is not None
    columns = list(columns if explicit else DEFAULT_COLUMNS)
    if not explicit:
        at = columns.index("strategy") + 1 if "strategy" in columns else 0
        columns[at:at] = _swept_columns(runs, columns, aggregated)
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
    pairs = [[_aggregate([_value(run, c) for run in group], c) for c in columns] for group in groups]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftbench.report",
        description="Table of run results (summary.json files) as Markdown or CSV.")
    parser.add_argument("paths", nargs="+", help="run folders, summary.json files or sweep folders")
    parser.add_argument("--csv", action="store_true", help="write CSV instead of Markdown")
    parser.add_argument("--out", help="write the table to this file instead of printing it")
    parser.add_argument("--columns", help="comma-separated columns (default: "
                        + ",".join(DEFAULT_COLUMNS) + ", plus one per swept key)")
    parser.add_argument("--per-run", action="store_true",
                        help="one row per run; by default runs that differ only in the seed share "
                             "a row (mean ± sample standard deviation)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print(f"error: no {SUMMARY_FILE} found under {', '.join(args.paths)}", file=sys.stderr)
        return 2
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    unknown = unknown_columns(runs, columns) if columns else []
    if unknown:
        print(f"warning: unknown column{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
              f"(left empty); valid columns: {', '.join(valid_columns(runs))}", file=sys.stderr)
    table = runs_table(runs, columns, fmt="csv" if args.csv else "md", aggregate=not args.per_run)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table, encoding="utf-8")
        print(f"wrote {len(runs)} runs to {out}", file=sys.stderr)
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
