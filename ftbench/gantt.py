"""Gantt charts: one iteration's ops per worker (`plot_gantt`), panels of several on one page
(`plot_gantt_panels`), and a run's `gantt.png` (`draw_run_gantt`: sim, the modelled iteration
before and after the first plan change; local and dist, each plan's first timed iteration as it
ran beside the cost model's picture of it)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

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


# --------------------------------------------------------------------------- a run's gantt.png

def draw_run_gantt(outcome, timelines, run_dir: Path, cfg, ctx, measured: list | None = None) -> None:
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
