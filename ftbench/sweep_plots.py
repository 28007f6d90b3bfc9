"""Plots of any sweep: `python -m ftbench.report SWEEP --plots`, and the sweep's own callback
(ftbench/sweep_check.py) when a --multirun sweep ends.

- `vs-<key>.png`, one per swept key (strategy and seeds aside): throughput, ETTR and recovery
  time per strategy against the key, each point the mean over the seeds with its 95 %
  interval, one row of panels per combination of the other swept keys' values (a paper
  table's models); a cell where a seed ended `oom`, `unrecoverable` or otherwise not ok is a
  marker at zero, one shape per status, in its strategy's colour.
- `strategies.png` when the strategy is the only thing swept: the same three as bars.
- `over-time.png`: throughput over time of one cell per strategy (`--cell key=value,...`,
  default the first setup and its lowest seed), failures as lines, recoveries shaded.
- `recovery-breakdown.png`: the mean recovery time per run of each strategy, split by action
  (on the modelled clock each action's seconds, `action_s`; measured recoveries as a whole).

Every line has its legend entry, and points of different lines at one x are set apart so
that none hides another."""
from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftbench.run_tables import SEED_KEYS, column_value, load_runs, run_clock, swept_columns, x_keys
from ftbench.tables import interval95, throughput_axes, throughput_series

METRICS = (("throughput", "throughput (samples/s)"), ("ettr", "ETTR"), ("recovery_s", "recovery time per run (s)"))


@dataclass
class Point:
    """One x of one line: each metric's mean and 95 % half-width over the seeds that ended ok,
    and the statuses of the seeds that did not."""
    x: Any
    metrics: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    ok: int = 0
    failed: Counter = field(default_factory=Counter)


def recovery_total(run: dict) -> float:
    return sum(float(r.get("recovery_s") or 0.0) for r in run.get("recoveries") or [] if isinstance(r, dict))


def _metric(run: dict, name: str) -> float | None:
    if name == "recovery_s":
        return recovery_total(run)
    value = run.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _label(run: dict, others: list[str]) -> str:
    parts = [str(run.get("strategy"))] + [f"{k}={column_value(run, k)}" for k in others]
    return ", ".join(parts)


def _sort_key(value: Any) -> tuple:
    return (0, float(value), "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0.0, str(value))


def series(runs: list[dict], key: str | None, others: list[str] | None = None) -> dict[str, list[Point]]:
    """Per line (the strategy, with the values of `others`: by default the other swept keys),
    its points against `key` (None: one point per line), in order of x."""
    others = [k for k in x_keys(runs) if k != key] if others is None else others
    cells: dict[str, dict[Any, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        x = column_value(run, key) if key is not None else ""
        cells[_label(run, others)][x].append(run)
    lines = {}
    for label, by_x in cells.items():
        points = []
        for x in sorted(by_x, key=_sort_key):
            point = Point(x)
            done = [r for r in by_x[x] if r.get("status") == "ok"]
            point.ok = len(done)
            point.failed = Counter(str(r.get("status")) for r in by_x[x] if r.get("status") != "ok")
            for name, _ in METRICS:
                values = [v for v in (_metric(r, name) for r in done) if v is not None and math.isfinite(v)]
                if values:
                    point.metrics[name] = interval95(values)
            points.append(point)
        lines[label] = points
    return lines


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    return plt


def _clock_unit(runs: list[dict]) -> str:
    clocks = {run_clock(r) for r in runs} - {None}
    return "simulated s" if clocks == {"sim"} else "wall s" if clocks == {"wall"} else "s"


# A cell's status where it did not end ok: a marker at zero of this shape (the strategy's colour).
STATUS_MARKERS = {"oom": "X", "unrecoverable": "v", "error": "D", "diverged": "s", "died": "P", "interrupted": "*"}
FACETS_MAX = 8  # rows of panels at most (the other keys' combinations); beyond, one row per line as before


def facets(runs: list[dict], key: str | None) -> list[tuple[str, list[dict]]]:
    """The runs split by the values of the swept keys other than `key` (each a row of panels),
    in order; one facet of every run where there is no other key or too many combinations."""
    others = [k for k in x_keys(runs) if k != key] if key is not None else []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(column_value(run, k) for k in others)].append(run)
    if not others or len(groups) > FACETS_MAX:
        return [("", runs)]
    ordered = sorted(groups, key=lambda values: [_sort_key(v) for v in values])
    return [(", ".join(f"{k}={v}" for k, v in zip(others, values)), groups[values]) for values in ordered]


def plot_against(runs: list[dict], key: str | None, path: Path) -> Path:
    """Throughput, ETTR and recovery time per line against `key` (None: bars per line), a row
    of panels per facet (the other swept keys' values)."""
    plt = _pyplot()
    rows = facets(runs, key)
    faceted = len(rows) > 1
    row_lines = [series(part, key, others=[] if faceted else None) for _, part in rows]
    labels_all = sorted({label for lines in row_lines for label in lines})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of = {label: colours[i % len(colours)] for i, label in enumerate(labels_all)}
    xs = sorted({p.x for lines in row_lines for points in lines.values() for p in points}, key=_sort_key)
    numeric = key is not None and all(_sort_key(x)[0] == 0 for x in xs)
    position = {x: (float(x) if numeric else i) for i, x in enumerate(xs)}
    span = (max(position.values()) - min(position.values())) if len(position) > 1 else 1.0
    gap = (min(b - a for a, b in zip(sorted(position.values()), sorted(position.values())[1:]))
           if len(position) > 1 else 1.0)
    dodge = 0.3 * min(gap, span) / max(len(labels_all), 1)  # lines side by side at one x, none hidden
    fig, axes = plt.subplots(len(rows), len(METRICS), figsize=(5.2 * len(METRICS), 0.6 + 3.6 * len(rows)),
                             squeeze=False)
    unit = _clock_unit(runs)
    statuses: set[str] = set()
    for r, ((facet, _), lines) in enumerate(zip(rows, row_lines)):
        for m, (name, title) in enumerate(METRICS):
            ax = axes[r][m]
            for label, points in lines.items():
                i = labels_all.index(label)
                colour = colour_of[label]
                shift = (i - (len(labels_all) - 1) / 2) * dodge
                done = [p for p in points if name in p.metrics]
                xv = [position[p.x] + shift for p in done]
                yv = [p.metrics[name][0] for p in done]
                err = [p.metrics[name][1] or 0.0 for p in done]
                if key is None:
                    ax.bar([i], yv or [0.0], yerr=err or None, color=colour, label=label, capsize=4)
                else:
                    ax.errorbar(xv, yv, yerr=err, color=colour, marker="o", markersize=4, capsize=3, label=label,
                                linewidth=1.2)
                for p in points:
                    at = (i if key is None else position[p.x] + shift)
                    for status in p.failed:
                        statuses.add(status)
                        ax.plot([at], [0.0], marker=STATUS_MARKERS.get(status, "o"), markersize=8, color=colour,
                                linestyle="none", clip_on=False, zorder=5)
            ax.set_title(title.replace("(s)", f"({unit})") + (f"\n{facet}" if facet else ""), fontsize=10)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if key is None:
                ax.set_xticks(range(len(labels_all)), labels_all, rotation=20, ha="right", fontsize=8)
            else:
                ax.set_xlabel(key)
                if not numeric:
                    ax.set_xticks(list(position.values()), [str(x) for x in xs])
    handles = [plt.Line2D([], [], color=colour_of[label], marker="o", markersize=4) for label in labels_all]
    labels = list(labels_all)
    for status in sorted(statuses):
        handles.append(plt.Line2D([], [], marker=STATUS_MARKERS.get(status, "o"), color="#555555", linestyle="none",
                                  markersize=8))
        labels.append(f"{status} (a seed of the cell, at zero)")
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    seeds = max((p.ok + sum(p.failed.values()) for lines in row_lines for points in lines.values() for p in points),
                default=0)
    fig.suptitle(("per strategy" if key is None else f"against {key}") +
                 f": mean over up to {seeds} seed(s), bars/whiskers the 95 % interval", fontsize=11)
    legend_rows = 1 + (len(labels) - 1) // 4
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, (0.35 + 0.22 * legend_rows) / height, 1, 1 - 0.45 / height))
    fig.savefig(path, dpi=110, facecolor="white")
    plt.close(fig)
    return path


def parse_cell(text: str | None) -> dict[str, str]:
    """`key=value,key=value` -> {key: value}."""
    cell = {}
    for item in (text or "").split(","):
        if item.strip():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--cell takes key=value pairs, got '{item}'")
            cell[key.strip()] = value.strip()
    return cell


def cell_runs(runs: list[dict], cell: dict[str, str]) -> tuple[dict[str, str], list[dict]]:
    """(the cell, one run per strategy in it, the lowest seed of each): `cell` as given, or the
    first run's values of every swept key but the strategy and the seeds."""
    keys = [k for k in swept_columns(runs, [], aggregated=False) if k != "strategy"]
    if not cell and runs:
        first = runs[0]
        cell = {k: str(column_value(first, k)) for k in keys if k not in SEED_KEYS}
    chosen = [r for r in runs if all(str(column_value(r, k)) == str(v) for k, v in cell.items())]
    best: dict[str, dict] = {}
    for run in sorted(chosen, key=lambda r: _sort_key(r.get("seed", 0))):
        best.setdefault(str(run.get("strategy")), run)
    return cell, list(best.values())


def plot_over_time(runs: list[dict], path: Path, cell: dict[str, str] | None = None) -> Path | None:
    """Throughput over time of one cell per strategy, failures as lines, recoveries shaded."""
    cell, chosen = cell_runs(runs, cell or {})
    if not chosen:
        return None
    plt = _pyplot()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    marked = set()
    styles = ("-", "--", "-.", ":")  # equal curves (no failure yet) stay visible one over another
    for i, run in enumerate(chosen):
        colour = colours[i % len(colours)]
        hours, rate, fails = throughput_series(Path(run["run_dir"]))
        ax.plot(hours, rate, color=colour, linewidth=1.4, linestyle=styles[i % len(styles)],
                label=f"{run.get('strategy')} ({run.get('status')})")
        for t in fails:
            ax.axvline(t, color=colour, alpha=0.5, linewidth=0.8, linestyle=":",
                       label="failure" if "failure" not in marked else None)
            marked.add("failure")
        for r in run.get("recoveries") or []:
            start = float(r.get("time_s") or 0.0) / 3600.0
            ax.axvspan(start, start + float(r.get("recovery_s") or 0.0) / 3600.0, color=colour, alpha=0.15,
                       label="recovery" if "recovery" not in marked else None)
            marked.add("recovery")
    shown = ", ".join(f"{k}={v}" for k, v in cell.items()) or "every run"
    seeds = sorted({str(r.get("seed")) for r in chosen})
    ax.set_title(f"throughput over time: {shown}, seed {', '.join(seeds)}", fontsize=10)
    throughput_axes(ax, "time (hours, " + _clock_unit(chosen).replace(" s", " clock") + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110, facecolor="white")
    plt.close(fig)
    return path


def recovery_breakdown(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per strategy: the mean seconds per run of each recovery action (over its runs that ended
    ok); a recovery without per-action seconds counts whole, as `recovery`."""
    per: dict[str, list[Counter]] = defaultdict(list)
    for run in runs:
        if run.get("status") != "ok":
            continue
        spent: Counter = Counter()
        for r in run.get("recoveries") or []:
            actions, seconds = r.get("actions") or [], r.get("action_s")
            if isinstance(seconds, list) and len(seconds) == len(actions):
                for action, s in zip(actions, seconds):
                    spent[str(action)] += float(s or 0.0)
                spent["(rest of the recovery)"] += max(0.0, float(r.get("recovery_s") or 0.0) - sum(map(float, seconds)))
            else:
                spent["recovery"] += float(r.get("recovery_s") or 0.0)
        per[str(run.get("strategy"))].append(spent)
    return {s: {a: sum(c[a] for c in counters) / len(counters) for a in {a for c in counters for a in c}}
            for s, counters in per.items()}


def plot_recovery_breakdown(runs: list[dict], path: Path) -> Path | None:
    means = recovery_breakdown(runs)
    if not means:
        return None
    plt = _pyplot()
    actions = sorted({a for m in means.values() for a in m if m[a] > 0})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(means) + 2.6))
    for i, (strategy, m) in enumerate(means.items()):
        left = 0.0
        for j, action in enumerate(actions):
            width = m.get(action, 0.0)
            ax.barh([i], [width], left=left, color=colours[j % len(colours)], label=action if i == 0 else None)
            left += width
    ax.set_yticks(range(len(means)), list(means))
    ax.set_xlabel(f"mean recovery time per run ({_clock_unit(runs)})")
    ax.set_title("recovery time by action (runs that ended ok)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    if actions:  # below the bars: never over one
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(4, len(actions)), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, facecolor="white")
    plt.close(fig)
    return path


def write_plots(sweep_dir: Path | str, out_dir: Path | str | None = None, cell: str | None = None) -> list[Path]:
    """Every plot of the runs under `sweep_dir`, into `out_dir` (default: the sweep folder)."""
    runs = [r for r in load_runs([sweep_dir]) if r.get("run_dir")]
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    keys = x_keys(runs)
    for key in keys:
        written.append(plot_against(runs, key, out / f"vs-{key.replace('/', '_')}.png"))
    if not keys:
        written.append(plot_against(runs, None, out / "strategies.png"))
    for made in (plot_over_time(runs, out / "over-time.png", parse_cell(cell)),
                 plot_recovery_breakdown(runs, out / "recovery-breakdown.png")):
        if made is not None:
            written.append(made)
    return written


def write_plots_quietly(sweep_dir: Path | str) -> list[Path]:
    """write_plots for the sweep's callback: a plot must never cost a sweep its exit code."""
    try:
        return write_plots(sweep_dir)
    except Exception as err:
        warnings.warn(f"could not draw the sweep's plots: {type(err).__name__}: {err}")
        return []
