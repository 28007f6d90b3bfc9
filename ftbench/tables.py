"""Paper tables from a sweep: `table.md`, `table.csv` and plots, beside the published cells.

A paper-table experiment (conf/experiment/recycle-table.yaml, oobleck-table2.yaml) runs one
job per cell and seed and names the table in every job (`table.name`, `table.column`). When
the sweep ends, `TableReport` (a Hydra callback the experiments add) reads the sweep's
summaries and the table's spec from the sweep's multirun.yaml (rows, columns, models, the
paper's values) and writes into the sweep folder:

- `table.md`: the paper's layout, each cell "ours (paper, ratio)"; ours is the mean over
  seeds with a 95 % interval (Student's t) where failures are random; then the checks the
  reproduction is judged by (the ordering of every column, cells within 15 %, OOM where the
  paper has OOM), the fitted efficiency per model, and memory and ETTR per cell;
- `table.csv`: one line per cell with every number;
- `throughput_vs_failures.png` (one panel per model, a line per system, the paper's cells as
  hollow markers) and `throughput_over_time.png` (one model and column, seed 0: each
  system's throughput along the same failures, the failures marked).

The same tables and plots go to W&B, in the sweep's group. `python -m ftbench.tables
SWEEP_DIR` writes them again from the folder.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ftbench.metrics import METRICS_FILE, SUMMARY_FILE, peak_memory_max, read_metrics
from ftbench.scorecard import FAULT_FREE, markdown_lines, score


# Student's t, two-sided 95 %, by degrees of freedom (1..30); beyond 30 the normal's 1.96.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


def interval95(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % confidence interval (None for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    dof = len(values) - 1
    t = _T95[dof - 1] if dof <= len(_T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


# --------------------------------------------------------------------------- reading a sweep

def table_spec(sweep_dir: Path) -> dict:
    """The `table` section of the sweep's config (multirun.yaml), unresolved values as given."""
    from omegaconf import OmegaConf

    path = Path(sweep_dir) / "multirun.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a sweep folder")
    cfg = OmegaConf.load(path)
    spec = OmegaConf.to_container(cfg.get("table", {}), resolve=False) or {}
    if not spec.get("name"):
        raise ValueError(f"{sweep_dir} is not a paper-table sweep (its config has no table.name)")
    # the cells hardware.efficiency is fitted to: the calibrated system's fault-free runs
    node = cfg.get("calibrate")
    calibrate = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    strategy = (calibrate.get("strategy") or {}).get("name")
    if calibrate.get("throughput") is not None and strategy:
        spec.setdefault("fitted", {"strategy": strategy, "column": FAULT_FREE})
    return spec


def load_cells(sweep_dir: Path) -> list[dict]:
    """Every summary under the sweep that names a table cell."""
    cells = []
    for path in sorted(Path(sweep_dir).rglob(SUMMARY_FILE)):
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary.get("table"), dict):
            summary["_dir"] = str(path.parent)
            cells.append(summary)
    return cells


def _paper_value(spec: dict, model: str, row: str, column: str) -> Any:
    return ((spec.get("paper") or {}).get(model) or {}).get(row, {}).get(column) if row else None


def aggregate(spec: dict, cells: list[dict]) -> list[dict]:
    """One record per (model, system, column): seeds, mean, interval, paper value, ratio."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        key = (cell["model"], cell["strategy"], cell["table"]["column"])
        groups.setdefault(key, []).append(cell)
    rows = spec.get("rows") or {}
    records = []
    for (model, strategy, column), runs in groups.items():
        row = rows.get(strategy, strategy)
        ok = [r for r in runs if r.get("status") == "ok"]
        statuses = sorted({str(r.get("status")) for r in runs})
        record = {"model": model, "system": row, "strategy": strategy, "column": column, "seeds": len(runs),
                  "status": "ok" if len(ok) == len(runs) else "/".join(statuses),
                  "paper": _paper_value(spec, model, row, column)}
        if ok:
            record["throughput"], record["ci95"] = interval95([r["throughput"] for r in ok])
            ettrs = [r["ettr"] for r in ok if isinstance(r.get("ettr"), (int, float))]
            record["ettr"], record["ettr_ci95"] = interval95(ettrs) if ettrs else (None, None)
            record["failures"] = statistics.fmean(r.get("failures", 0) for r in ok)
            # the share of the trained samples' steps' global batches that were dropped (torchft)
            record["dropped"] = statistics.fmean(_dropped_share(r) for r in ok)
            record["efficiency"] = ok[0].get("efficiency")
        peaks = [p for p in (peak_memory_max(r) for r in runs) if p]
        record["peak_memory_gb"] = max(peaks) / 1e9 if peaks else None
        record["memory_gb"] = runs[0].get("memory_gb")
        record["error"] = next((r.get("error") for r in runs if r.get("status") != "ok"), None)
        paper = record["paper"]
        if isinstance(paper, (int, float)) and record.get("throughput"):
            record["ratio"] = record["throughput"] / paper
        records.append(record)
    return records


# --------------------------------------------------------------------------- writing

def _num(value: Any, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def cell_text(record: dict | None) -> str:
    """'ours (paper, ratio×)': ours is mean ± 95 % half-width, or the status when not ok."""
    if record is None:
        return "–"
    if record["status"] != "ok":
        ours = record["status"].upper() if record["status"] == "oom" else record["status"]
    else:
        ours = _num(record["throughput"]) + (f" ± {_num(record['ci95'])}" if record.get("ci95") else "")
    paper = record["paper"]
    if paper is None:
        return ours
    if not isinstance(paper, (int, float)):
        return f"{ours} ({paper})"
    ratio = f", {record['ratio']:.2f}×" if record.get("ratio") is not None else ""
    return f"{ours} ({paper:g}{ratio})"


def _model_names(spec: dict) -> dict[str, str]:
    return {m: (v or {}).get("label", m) if isinstance(v, dict) else m for m, v in (spec.get("models") or {}).items()}


def markdown(spec: dict, records: list[dict]) -> str:
    by_cell = {(r["model"], r["system"], r["column"]): r for r in records}
    models = [m for m in spec.get("models") or {} if any(r["model"] == m for r in records)]
    labels = _model_names(spec)
    columns = list(spec.get("columns") or {})
    systems = list(dict.fromkeys([*(spec.get("rows") or {}).values(), *(r["system"] for r in records)]))
    published = bool(spec.get("paper"))
    lines = [f"# {spec.get('title') or spec['name']}", ""]
    if published:
        lines += ["Each cell: ours (the paper's value, ours / paper). Ours is the mean over seeds ± the half-width "
                  "of its 95 % interval where failures are random; `–`: not in this sweep.", ""]
    else:  # no published cells (today-16k): throughput and ETTR, nothing to score
        lines += ["Each cell: throughput in samples/s, then ETTR (time on iterations that count over run time); "
                  "each the mean over seeds ± the half-width of its 95 % interval where failures are random; "
                  "`–`: not in this sweep.", ""]
    text = cell_text if published else _throughput_and_ettr
    for model in models:
        lines += [f"## {labels.get(model, model)}", "", "| system | " + " | ".join(columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for system in systems:
            if not any((model, system, c) in by_cell for c in columns):
                continue
            lines.append(f"| {system} | " + " | ".join(text(by_cell.get((model, system, c))) for c in columns)
                         + " |")
        lines.append("")
    anchors = spec.get("anchors") or []
    if anchors:  # reported for other jobs and setups: context for the ETTR column, not scored
        lines += ["Anchors (whole-job figures reported for production runs, other setups: context, not scored):",
                  "", *[f"- {a}" for a in anchors], ""]
    lines += _checks_markdown(spec, records, scored=published)
    return "\n".join(lines) + "\n"


def _dropped_share(summary: dict) -> float:
    """samples_dropped over the global batches of the kept iterations (0: none dropped)."""
    dropped = summary.get("samples_dropped") or 0
    whole = (summary.get("samples") or 0) + dropped
    return dropped / whole if whole else 0.0


def _dropped_text(record: dict) -> str:
    share = record.get("dropped")
    return "" if not share else f"{100 * share:.2g} %"


def _throughput_and_ettr(record: dict | None) -> str:
    """A cell of a table with no published values: 'throughput ± ci · ETTR ± ci %', or the status."""
    if record is None:
        return "–"
    if record["status"] != "ok":
        return record["status"].upper() if record["status"] == "oom" else record["status"]
    ours = f"{record['throughput']:,.0f}" + (f" ± {record['ci95']:,.0f}" if record.get("ci95") else "")
    dropped = _dropped_text(record)
    return f"{ours} · {_ettr_text(record)}" + (f" · {dropped} of the samples dropped" if dropped else "")


def _checks_markdown(spec: dict, records: list[dict], scored: bool = True) -> list[str]:
    labels = _model_names(spec)
    lines = markdown_lines(spec, score(spec, records), labels) + [""] if scored else []
    lines += ["## Per cell", "",
              "Peak memory: the largest worker's, GB. ETTR: time on iterations that count / run time. Samples "
              "dropped: the share of the kept iterations' global batches their steps did not train (torchft). "
              "Efficiency: the model's `hardware.efficiency`" + (" (fitted, listed above)." if scored else "."), "",
              "| model | system | column | seeds | status | throughput | ±95 % | paper | ratio | ETTR | samples dropped | "
              "failures | peak memory (GB) | efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=_record_order(spec)):
        paper = r["paper"] if r["paper"] is not None else ""
        lines.append(f"| {labels.get(r['model'], r['model'])} | {r['system']} | {r['column']} | {r['seeds']} | "
                     f"{r['status']} | {_num(r.get('throughput'))} | {_num(r.get('ci95'))} | {paper} | "
                     f"{_num(r.get('ratio'))} | {_ettr_text(r)} | {_dropped_text(r)} | "
                     f"{_num(r.get('failures'), 1)} | {_num(r.get('peak_memory_gb'), 1)} | "
                     f"{_num(r.get('efficiency'), 4)} |")
    errors = [r for r in records if r.get("error")]
    if errors:
        lines += ["", "Cells that did not end ok:", ""]
        lines += [f"- {labels.get(r['model'], r['model'])}, {r['system']}, {r['column']}: {r['error']}"
                  for r in sorted(errors, key=_record_order(spec))]
    return lines


def _ettr_text(record: dict) -> str:
    """ETTR in percent, with the half-width of its 95 % interval over seeds where there is one."""
    if record.get("ettr") is None:
        return ""
    ci = record.get("ettr_ci95")
    return _num(100 * record["ettr"], 1) + (f" ± {_num(100 * ci, 1)}" if ci else "") + " %"


def _record_order(spec: dict):
    models = list(spec.get("models") or {})
    columns = list(spec.get("columns") or {})
    systems = list((spec.get("rows") or {}).values())

    def index(items: list, value: Any) -> int:
        return items.index(value) if value in items else len(items)

    return lambda r: (index(models, r["model"]), index(systems, r["system"]), index(columns, r["column"]))


CSV_COLUMNS = ["model", "system", "strategy", "column", "seeds", "status", "throughput", "ci95", "paper", "ratio",
               "ettr", "ettr_ci95", "dropped", "failures", "peak_memory_gb", "efficiency", "error"]


def write_csv(spec: dict, records: list[dict], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in sorted(records, key=_record_order(spec)):
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})


# --------------------------------------------------------------------------- plots

def _failures_per_day(spec: dict, column: str) -> float | None:
    """A column's failure frequency for the x axis: failures per day (0: fault-free)."""
    if column == FAULT_FREE:
        return 0.0
    hours = ((spec.get("columns") or {}).get(column) or {}).get("hours")
    return 24.0 / float(hours) if isinstance(hours, (int, float)) and hours > 0 else None


def plot_vs_failures(spec: dict, records: list[dict], path: Path) -> Path | None:
    """Throughput against failures per day, one panel per model: ours (filled, with the 95 %
    interval) beside the paper's (hollow, dotted); a cell that did not end ok (OOM) is an X at
    zero with its status, as is a paper cell that reads OOM; the systems are set slightly apart
    on x so that equal points (the fault-free column) do not hide one another; one legend for
    every system of every panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in spec.get("models") or {} if any(r["model"] == m for r in records)]
    if not models:
        return None
    labels = _model_names(spec)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.0), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    systems = list(dict.fromkeys([*(spec.get("rows") or {}).values(), *(r["system"] for r in records)]))
    xs = [x for c in spec.get("columns") or {} for x in [_failures_per_day(spec, c)] if x is not None]
    dodge = 0.012 * (max(xs) - min(xs) if len(xs) > 1 else 1.0)
    handles: dict[str, object] = {}
    for ax, model in zip(axes[0], models):
        for i, system in enumerate(systems):
            colour = colours[i % len(colours)]
            shift = (i - (len(systems) - 1) / 2) * dodge
            mine = [(x, r) for r in records if r["model"] == model and r["system"] == system
                    for x in [_failures_per_day(spec, r["column"])] if x is not None]
            ours = sorted((x, r) for x, r in mine if r.get("throughput"))
            if ours:
                line = ax.errorbar([x + shift for x, _ in ours], [r["throughput"] for _, r in ours],
                                   yerr=[r.get("ci95") or 0 for _, r in ours], marker="o", color=colour,
                                   label=system, capsize=3)
                handles.setdefault(system, line)
            for x, r in mine:
                if not r.get("throughput"):  # OOM or unrecoverable in every seed: no point to draw
                    mark = ax.plot([x + shift], [0.0], marker="X", markersize=9, color=colour, linestyle="none",
                                   label=system)[0]
                    handles.setdefault(system, mark)
                    ax.annotate(str(r.get("status", "")).upper() if r.get("status") == "oom" else str(r.get("status")),
                                (x + shift, 0.0), textcoords="offset points", xytext=(0, 7 + 9 * (i % 3)), ha="center",
                                fontsize=7, color=colour)
            paper = sorted((x, v) for c in spec.get("columns") or {}
                           for v in [_paper_value(spec, model, system, c)] for x in [_failures_per_day(spec, c)]
                           if isinstance(v, (int, float)) and x is not None)
            if paper:
                ax.plot([x + shift for x, _ in paper], [v for _, v in paper], linestyle=":", marker="o",
                        markerfacecolor="none", color=colour)
            for c in spec.get("columns") or {}:  # the paper's OOM cells
                x = _failures_per_day(spec, c)
                if x is not None and str(_paper_value(spec, model, system, c)).upper() == "OOM":
                    ax.plot([x + shift], [0.0], marker="x", markersize=8, color=colour, linestyle="none")
        ax.set_title(labels.get(model, model))
        ax.set_xlabel("failures per day")
        ax.set_ylabel("throughput (samples/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(6, len(handles)), fontsize=8,
               title="ours (filled, 95 % interval); paper (hollow, dotted); X: not ok (ours), x: OOM (paper)",
               title_fontsize=7, frameon=False)
    fig.suptitle(spec.get("title") or spec["name"], fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120, facecolor="white")
    plt.close(fig)
    return path


def throughput_series(run_dir: Path, bins: int = 120) -> tuple[list[float], list[float], list[float]]:
    """(bin centres in hours, samples/s in each bin, failure times in hours) of one sim run,
    from its metrics.jsonl: each stretch of identical iterations spreads its samples evenly
    over its own iterations' time; recoveries and stalls in between train nothing."""
    records = read_metrics(Path(run_dir) / METRICS_FILE)
    # metrics.jsonl is appended to (a resumed run keeps its earlier lines): a cell run again
    # into its folder holds both attempts, and only the last one is the summary's
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    records = records[starts[-1]:] if starts else records
    spans, fails, end = [], [], 0.0
    for rec in records:
        if rec.get("event") == "iterations" and rec.get("count"):
            busy = rec["count"] * rec["iteration_time_s"]
            spans.append((rec["time_s"] - busy, rec["time_s"], rec["samples"] if "samples" in rec else None,
                          rec["count"]))
            end = max(end, rec["time_s"])
        elif rec.get("event") == "iteration" and rec.get("iteration_s"):
            spans.append((rec["time_s"] - rec["iteration_s"], rec["time_s"], None, 1))
            end = max(end, rec["time_s"])
        elif rec.get("event") == "fail":
            fails.append(rec["time_s"] / 3600.0)
    start = next((r for r in records if r.get("event") == "start"), {})
    batch = start.get("global_batch") or 1
    if end <= 0:
        return [], [], fails
    width = end / bins
    rate = [0.0] * bins
    for t0, t1, _, count in spans:
        per_s = count * batch / (t1 - t0) if t1 > t0 else 0.0
        for b in range(max(0, int(t0 // width)), min(bins, int(t1 // width) + 1)):
            lo, hi = max(t0, b * width), min(t1, (b + 1) * width)
            if hi > lo:
                rate[b] += per_s * (hi - lo) / width
    centres = [(b + 0.5) * width / 3600.0 for b in range(bins)]
    return centres, rate, fails


def _timeline_choice(spec: dict, cells: list[dict]) -> tuple[str, str] | None:
    """The model and failure column of the over-time plot: the experiment's `timeline`, else the
    first model's most frequent failure column."""
    chosen = spec.get("timeline") or {}
    models = list(spec.get("models") or {})
    columns = [c for c in spec.get("columns") or {} if c != FAULT_FREE]
    if not models or not columns:
        return None
    return chosen.get("model", models[0]), chosen.get("column", columns[-1])


def plot_over_time(spec: dict, cells: list[dict], path: Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    choice = _timeline_choice(spec, cells)
    if choice is None:
        return None
    model, column = choice
    runs = sorted((c for c in cells if c["model"] == model and c["table"]["column"] == column
                   and c.get("status") == "ok"), key=lambda c: (c.get("seed", 0), c["strategy"]))
    first_seed = {}
    for run in runs:
        first_seed.setdefault(run["strategy"], run)
    if not first_seed:
        return None
    rows = spec.get("rows") or {}
    systems = list(rows.values())
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # the same colour per system as the other plot
    fig, ax = plt.subplots(figsize=(10, 3.8))
    fails_drawn: list[float] = []
    for strategy, run in first_seed.items():
        hours, rate, fails = throughput_series(Path(run["_dir"]))
        system = rows.get(strategy, strategy)
        colour = colours[(systems.index(system) if system in systems else len(systems)) % len(colours)]
        ax.plot(hours, rate, label=system, linewidth=1.2, color=colour)
        fails_drawn = fails_drawn or fails
    for i, t in enumerate(fails_drawn):
        ax.axvline(t, color="#C44E52", alpha=0.35, linewidth=0.8, label="failure" if i == 0 else None)
    labels = _model_names(spec)
    ax.set_title(f"{labels.get(model, model)}, failures {column} (seed {next(iter(first_seed.values())).get('seed', 0)}): "
                 "throughput over time", fontsize=10)
    throughput_axes(ax, "time (simulated hours)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, facecolor="white")
    plt.close(fig)
    return path


def throughput_axes(ax, xlabel: str) -> None:
    """The axes of a throughput-over-time plot (throughput_series): samples/s from zero, legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")


# --------------------------------------------------------------------------- the report

def write_report(sweep_dir: Path | str, wandb_cfg: Any = None) -> dict[str, Path]:
    """Write table.md, table.csv and the plots into the sweep folder (and W&B); their paths."""
    sweep_dir = Path(sweep_dir)
    spec = table_spec(sweep_dir)
    cells = load_cells(sweep_dir)
    records = aggregate(spec, cells)
    out = {"table.md": sweep_dir / "table.md", "table.csv": sweep_dir / "table.csv"}
    out["table.md"].write_text(markdown(spec, records), encoding="utf-8")
    write_csv(spec, records, out["table.csv"])
    for name, draw in (("throughput_vs_failures.png", lambda p: plot_vs_failures(spec, records, p)),
                       ("throughput_over_time.png", lambda p: plot_over_time(spec, cells, p))):
        try:
            if draw(sweep_dir / name) is not None:
                out[name] = sweep_dir / name
        except Exception as err:  # a plot must never cost the sweep its tables
            warnings.warn(f"could not draw {name}: {err}")
    _to_wandb(sweep_dir, spec, records, out, wandb_cfg)
    return out


WANDB_COLUMNS = [*CSV_COLUMNS[:CSV_COLUMNS.index("paper") + 1], "paper_status", *CSV_COLUMNS[CSV_COLUMNS.index("paper") + 1:]]


def wandb_rows(spec: dict, records: list[dict]) -> tuple[list[str], list[list]]:
    """The table's rows for a wandb.Table, whose columns each hold one type: `paper` holds the
    published number (null where the paper has none), `paper_status` says "OOM" where the paper
    reports one and "reported" beside a number, so that an OOM cell is a status, not text in a
    number column (W&B refuses the mix)."""
    rows = []
    for r in sorted(records, key=_record_order(spec)):
        paper = r.get("paper")
        number = paper if isinstance(paper, (int, float)) and math.isfinite(paper) else None
        cells = {**r, "paper": number,
                 "paper_status": None if paper is None else ("reported" if number is not None else str(paper))}
        rows.append([_wandb_value(cells.get(k)) for k in WANDB_COLUMNS])
    return list(WANDB_COLUMNS), rows


def _wandb_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if v is None or isinstance(v, (int, float, str)) else str(v)


def _to_wandb(sweep_dir: Path, spec: dict, records: list[dict], files: dict[str, Path], cfg: Any) -> None:
    from ftbench.wandb_sink import log_sweep_table, start_sweep_run

    try:
        # cfg None (`python -m ftbench.tables`) or without a mode: no W&B
        run = start_sweep_run(sweep_dir, cfg, job_type="paper-table", name=spec["name"], default_mode="disabled")
        if run is None:
            return
        import wandb

        columns, rows = wandb_rows(spec, records)
        payload = {"paper_table": wandb.Table(columns=columns, data=rows)}
        card = score(spec, records)
        for key in ("within", "status", "agree", "orderings"):  # the scorecard, as table.md counts it
            run.summary[f"scorecard/{key}"], run.summary[f"scorecard/{key}_of"] = card[key]
        run.summary["scorecard/fitted_cells"] = len(card["fitted"])
        for name, path in files.items():
            if name.endswith(".png"):
                payload[name[:-4]] = wandb.Image(str(path))
        run.log(payload)
        log_sweep_table(sweep_dir, cfg, run=run)
        run.finish()
    except Exception as err:
        warnings.warn(f"W&B could not log the paper table ({type(err).__name__}: {err})", stacklevel=2)


class TableReport(Callback):
    """Hydra callback of the paper-table experiments: the report when the sweep ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            files = write_report(sweep_dir, OmegaConf.select(config, "wandb"))
        except (OSError, ValueError) as err:
            print(f"ftbench: no paper table written: {err}", file=sys.stderr)
            return
        print(f"ftbench: paper table: {files['table.md']} (also {', '.join(p.name for n, p in files.items() if n != 'table.md')})",
              file=sys.stderr)
        from ftbench.wandb_report import write_report_quietly

        write_report_quietly(sweep_dir)  # again, now with the paper table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftbench.tables",
                                     description="Write a paper-table sweep's table.md, table.csv and plots again.")
    parser.add_argument("sweep_dir")
    args = parser.parse_args(argv)
    try:
        files = write_report(args.sweep_dir)
    except (OSError, ValueError) as err:
        print(f"ftbench.tables: {err}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in files.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
