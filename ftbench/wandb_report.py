"""A W&B Report of a sweep or a paper table, built with wandb-workspaces (W&B's library for
reports): the saved, shareable page users open.

Offline (no network here, and W&B's default in this suite), the report's definition is
written into the sweep folder, `wandb-report.json`: plain data naming every panel's metric,
the run set (the sweep's W&B group, grouped by strategy), the paper table when there is one,
and a short text of what was run. `python -m ftbench.report SWEEP --publish`, after
`wandb sync` of the sweep's offline runs, builds the wandb-workspaces Report from it and
saves it in W&B (entity and project from the sweep's config)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftbench.errors import UserError
from ftbench.run_tables import load_runs, x_keys
from ftbench.wandb_sink import wandb_group

REPORT_FILE = "wandb-report.json"
# Summary metrics every run logs (WandbSink: the summary's scalars and their totals)
SUMMARY_PANELS = (("throughput", "throughput (samples/s)"), ("ettr", "ETTR"),
                  ("samples_dropped", "samples dropped per run (torchft: steps without a replica group)"),
                  ("recovery_s_total", "recovery time per run (s)"), ("lost_iterations_total", "lost iterations per run"))
MEDIA = ("gantt", "plots/loss")  # the runs' gantt.png and loss.png (WandbSink logs every PNG)


def _sweep_config(sweep_dir: Path) -> dict:
    """The sweep's wandb and table sections (multirun.yaml), {} without one."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    return {"wandb": OmegaConf.to_container(cfg.get("wandb") or {}, resolve=False),
            "table": OmegaConf.to_container(cfg.get("table") or {}, resolve=False),
            "task": list(OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or [])}


def definition(sweep_dir: Path | str) -> dict:
    """The report of the sweep in `sweep_dir`, as plain data (what `wandb-report.json` holds)."""
    sweep_dir = Path(sweep_dir)
    runs = load_runs([sweep_dir])
    if not runs:
        raise FileNotFoundError(f"no summary.json under {sweep_dir}")
    config = _sweep_config(sweep_dir)
    wandb = config.get("wandb") or {}
    group = wandb.get("group") or wandb_group(sweep_dir.name, sweep_dir)
    keys = x_keys(runs)
    strategies = sorted({str(r.get("strategy")) for r in runs})
    statuses: dict[str, int] = {}
    for run in runs:
        statuses[str(run.get("status"))] = statuses.get(str(run.get("status")), 0) + 1
    panels: list[dict] = [{"type": "bar", "title": title, "metric": metric, "groupby": "strategy.name"}
                          for metric, title in SUMMARY_PANELS]
    for key in keys:
        panels += [{"type": "scatter", "title": f"{title} against {key}", "x_config": key, "y": metric}
                   for metric, title in SUMMARY_PANELS[:3]]
    if any(r.get("losses") for r in runs):
        panels.append({"type": "line", "title": "loss per iteration", "y": "loss", "groupby": "strategy.name"})
    text = (f"{len(runs)} runs ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}) of "
            f"{', '.join(strategies)}" + (f", swept over {', '.join(keys)}" if keys else "") +
            (f". Command: ftbench --multirun {' '.join(config['task'])}" if config.get("task") else "") + ".")
    blocks: list[dict] = [{"type": "h1", "text": f"ftbench sweep {sweep_dir.name}"}, {"type": "p", "text": text}]
    table = sweep_dir / "table.md"
    if table.is_file():  # a paper table: ours beside the paper's
        blocks += [{"type": "h2", "text": (config.get("table") or {}).get("title") or "The paper's table"},
                   {"type": "markdown", "text": table.read_text(encoding="utf-8")}]
    blocks.append({"type": "panel_grid", "runset": {"group": group, "name": str(sweep_dir.name)},
                   "panels": panels + [{"type": "media", "title": "Gantt charts and losses", "keys": list(MEDIA)}]})
    return {"title": f"ftbench: {sweep_dir.name}", "description": text, "entity": wandb.get("entity"),
            "project": wandb.get("project") or "ftbench", "group": group, "blocks": blocks}


def write_definition(sweep_dir: Path | str) -> Path:
    path = Path(sweep_dir) / REPORT_FILE
    path.write_text(json.dumps(definition(sweep_dir), indent=1) + "\n", encoding="utf-8")
    return path


def panel_metrics(spec: dict) -> list[tuple[str, str]]:
    """(where, name) of every metric the report's panels read: ("summary", ...), ("history",
    ...), ("config", ...) or ("media", ...)."""
    found = []
    for block in spec["blocks"]:
        for panel in block.get("panels", []):
            if panel["type"] == "bar":
                found += [("summary", panel["metric"]), ("config", panel["groupby"])]
            elif panel["type"] == "scatter":
                found += [("config", panel["x_config"]), ("summary", panel["y"])]
            elif panel["type"] == "line":
                found += [("history", panel["y"]), ("config", panel["groupby"])]
            elif panel["type"] == "media":
                found += [("media", key) for key in panel["keys"]]
    return found


def build(spec: dict, entity: str | None = None) -> Any:
    """The wandb-workspaces Report of a definition (not saved)."""
    import wandb_workspaces.reports.v2 as wr

    entity = entity or spec.get("entity") or ""
    blocks = []
    for block in spec["blocks"]:
        kind = block["type"]
        if kind in ("h1", "h2", "p"):
            blocks.append({"h1": wr.H1, "h2": wr.H2, "p": wr.P}[kind](block["text"]))
        elif kind == "markdown":
            blocks.append(wr.MarkdownBlock(text=block["text"]))
        elif kind == "panel_grid":
            runset = wr.Runset(entity=entity, project=spec["project"], name=block["runset"]["name"],
                               filters=f"Metric('Group') == '{block['runset']['group']}'")
            blocks.append(wr.PanelGrid(runsets=[runset], panels=[_panel(wr, p) for p in block["panels"]]))
    return wr.Report(entity=entity, project=spec["project"], title=spec["title"], description=spec["description"],
                     blocks=blocks)


def _panel(wr: Any, panel: dict) -> Any:
    kind = panel["type"]
    if kind == "bar":
        return wr.BarPlot(title=panel["title"], metrics=[wr.SummaryMetric(panel["metric"])],
                          groupby=wr.Config(panel["groupby"]), groupby_aggfunc="mean", groupby_rangefunc="stderr")
    if kind == "scatter":
        return wr.ScatterPlot(title=panel["title"], x=wr.Config(panel["x_config"]), y=wr.SummaryMetric(panel["y"]))
    if kind == "line":
        return wr.LinePlot(title=panel["title"], x="Step", y=[panel["y"]], groupby=wr.Config(panel["groupby"]))
    if kind == "media":
        return wr.MediaBrowser(title=panel["title"], media_keys=list(panel["keys"]))
    raise ValueError(f"unknown panel type {kind!r}")


def publish(sweep_dir: Path | str) -> str:
    """Build the sweep's report from its definition and save it in W&B; its URL."""
    path = Path(sweep_dir) / REPORT_FILE
    spec = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else definition(sweep_dir)
    report = build(spec)
    try:
        report.save()
    except Exception as err:
        raise UserError(f"W&B could not save the report: {type(err).__name__}: {err}. Fix: log in (`wandb login`), "
                        "upload the sweep's offline runs first (`wandb sync` in each run folder's wandb/), and set "
                        "wandb.entity and wandb.project in the sweep's config") from None
    return str(report.url)


def write_report_quietly(sweep_dir: Path | str) -> Path | None:
    """write_definition for the sweep's callbacks: a report must never cost a sweep its exit code."""
    try:
        return write_definition(sweep_dir)
    except Exception as err:
        import warnings

        warnings.warn(f"could not write {REPORT_FILE}: {type(err).__name__}: {err}")
        return None
