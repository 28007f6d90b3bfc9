"""Reading results: Gantt charts of one iteration, a console summary of one run, and tables
(Markdown or CSV) over many run folders.

CLI: `python -m ftbench.report RUN_OR_SWEEP_DIR... [--csv] [--out FILE]`.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable

from ftbench.metrics import SUMMARY_FILE, peak_memory_max, recovery_totals

KIND_COLOURS: dict[str, str] = {
    "F": "#4C72B0",    # forward: blue
    "B": "#DD8452",    # input gradient: orange
    "W": "#55A868",    # weight gradient: green
    "BW": "#C44E52",   # fused backward: red
    "OPT": "#8172B3",  # optimizer step: purple
    "AR": "#937860",   # gradient all-reduce (network): brown, drawn hatched
}
UNKNOWN_COLOUR = "#9E9E9E"
COMM_KINDS = {"AR"}  # network ops: not compute, so they do not fill bubbles
MAX_ROWS = 64  # rows drawn before the chart keeps only the first and last halves
MAX_LABELS = 4000  # micro-batch numbers written at most; more only slows drawing down

DEFAULT_COLUMNS = ["strategy", "model", "schedule", "backend", "pp", "dp", "microbatches", "iterations",
                   "time_s", "throughput", "failures", "status"]


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


def plot_gantt_panels(panels: list[tuple[str, list[dict]]], path: Path | str, title: str = "") -> Path:
    """Several timelines stacked vertically on one shared time axis, one panel per
    (title, timeline), into a PNG: same origin and scale everywhere, so lengths compare at a
    glance. Panels draw as in plot_gantt; the legend (every kind in any panel) appears once."""
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
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(width_in, sum(heights) + 0.6 + (0.4 if title else 0.0)),
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    axes = [row[0] for row in axes]
    try:
        for ax, (panel_title, timeline) in zip(axes, panels):
            _draw_gantt(ax, timeline, {}, panel_title, t0, span, width_in, row_in)
        for ax in axes[:-1]:
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


def _or_dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def format_summary(summary: dict) -> str:
    """A short aligned table of one run for the console."""
    s = summary
    sim = s.get("backend") == "sim"
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
    rows = [
        ("strategy", _or_dash(s.get("strategy"))),
        ("backend", _or_dash(s.get("backend"))),
        ("model", _or_dash(s.get("model"))),
        ("pp x dp", f"{_or_dash(s.get('pp'))} x {_or_dash(s.get('dp'))}"),
        ("micro-batches", microbatches),
        ("iterations", iterations),
        ("simulated time" if sim else "wall time", human_duration(s.get("time_s"))),
        ("throughput", f"{_short(throughput)} samples/s"
         if isinstance(throughput, (int, float)) else "-"),
        ("failures", _or_dash(_count(s.get("failures")))),
        ("recoveries", f"{totals['count']} (total {human_duration(totals['recovery_s'])})"),
        ("lost iterations", str(totals["lost_iterations"])),
        ("peak memory", _memory(peak)),
        ("status", status),
    ]
    if s.get("matches_fault_free") is not None:  # local runs that ran the equivalence check
        verdict = "yes" if s["matches_fault_free"] else f"NO ({s.get('fault_free_difference')})"
        rows.append(("matches fault-free", verdict))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


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


# Columns computed from list fields, so tables can show them next to plain keys.
DERIVED_COLUMNS = {
    "recoveries": lambda run: recovery_totals(run)["count"],
    "recovery_s": lambda run: recovery_totals(run)["recovery_s"],
    "lost_iterations": lambda run: recovery_totals(run)["lost_iterations"],
    "peak_memory_gb": lambda run: (None if peak_memory_max(run) is None
                                   else peak_memory_max(run) / 1e9),
    "failures": lambda run: _count(run.get("failures")),
}


def _value(run: dict, column: str) -> Any:
    if column in DERIVED_COLUMNS:
        return DERIVED_COLUMNS[column](run)
    value: Any = run
    for part in column.split("."):  # dotted names reach into nested dicts
        value = value.get(part) if isinstance(value, dict) else None
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


def _is_numeric_column(values: list[Any]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                 for v in present)


def runs_table(runs: list[dict], columns: list[str] | None = None, fmt: str = "md") -> str:
    """A Markdown (fmt="md") or CSV (fmt="csv") table, one row per run."""
    columns = list(columns or DEFAULT_COLUMNS)
    values = [[_value(run, c) for c in columns] for run in runs]
    cells = [[_cell(v) for v in row] for row in values]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(cells)
        return out.getvalue()
    if fmt != "md":
        raise ValueError(f"table format {fmt!r} is not 'md' or 'csv'")
    cells = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in cells]
    widths = [max([len(col), 3] + [len(row[i]) for row in cells]) for i, col in enumerate(columns)]
    numeric = [_is_numeric_column([row[i] for row in values]) for i in range(len(columns))]

    def line(parts: list[str]) -> str:
        return "| " + " | ".join(parts) + " |"

    header = line([c.ljust(w) for c, w in zip(columns, widths)])
    rule = line([("-" * (w - 1) + ":") if num else "-" * w for w, num in zip(widths, numeric)])
    body = [line([c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)])
            for row in cells]
    return "\n".join([header, rule, *body]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftbench.report",
        description="Table of run results (summary.json files) as Markdown or CSV.")
    parser.add_argument("paths", nargs="+", help="run folders, summary.json files or sweep folders")
    parser.add_argument("--csv", action="store_true", help="write CSV instead of Markdown")
    parser.add_argument("--out", help="write the table to this file instead of printing it")
    parser.add_argument("--columns", help="comma-separated columns (default: "
                        + ",".join(DEFAULT_COLUMNS) + ")")
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
    table = runs_table(runs, columns, fmt="csv" if args.csv else "md")
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
