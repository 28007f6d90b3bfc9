"""How a paper table's cells move with its setup: one row per sweep folder of the same
experiment, each run with other settings (`failures.repair_hours=4`, `cluster.gpus_per_node=4`, ...).

Per folder: the settings that differ from the experiment (the sweep's command-line overrides),
the scorecard's counts (ftbench/scorecard.py: orderings, cells within 15 %, status agreement;
fitted cells left out, a status mismatch a miss),
each system's cells against the paper's (geometric mean of ours / paper over the failure
columns), the cells that ended neither ok nor OOM (unrecoverable: the setup defeats the
system), and how much each system keeps from the rarest to the most frequent failures
(ours, then the paper's): that last ratio does not depend on the fitted efficiency, so it
shows the failure model apart from the fault-free speed.

    python -m ftbench.sensitivity runs/tables/recycle-sens/*     # a markdown table on stdout
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from ftbench.scorecard import FAULT_FREE, WITHIN, score
from ftbench.tables import aggregate, load_cells, table_spec


def settings(sweep_dir: Path) -> str:
    """The sweep's command-line overrides, without the experiment and the per-cell lists."""
    from omegaconf import OmegaConf

    # unresolved: an override may hold an interpolation (`+table.strategies.oobleck={min_nodes:${cluster.pp}}`)
    hydra = OmegaConf.to_container(OmegaConf.load(Path(sweep_dir) / "multirun.yaml"), resolve=False).get("hydra", {})
    task = [str(o) for o in (hydra.get("overrides") or {}).get("task", [])]
    swept = set(((hydra.get("sweeper") or {}).get("params") or {}).keys())
    # the harness's own settings (W&B, Hydra, reports) change no cell
    harness = ("wandb.", "hydra.", "report.")
    own = [o for o in task if "experiment=" not in o and o.split("=")[0].lstrip("+~") not in swept
           and not o.lstrip("+~").startswith(harness)]
    return ", ".join(f"`{o}`" for o in own) or "the experiment as given"


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def summarize(sweep_dir: Path | str) -> dict:
    """The checks and per-system movement of one sweep folder."""
    sweep_dir = Path(sweep_dir)
    spec = table_spec(sweep_dir)
    records = aggregate(spec, load_cells(sweep_dir))
    failure_columns = [c for c in spec.get("columns") or {} if c != FAULT_FREE]
    card = score(spec, records)
    systems = {}
    for system in dict.fromkeys(r["system"] for r in records if r["column"] in failure_columns):
        mine = {(r["model"], r["column"]): r for r in records if r["system"] == system}
        ratios = [r["ratio"] for (_, column), r in mine.items() if column in failure_columns and r.get("ratio") is not None]
        kept, kept_paper = [], []
        first, last = failure_columns[0], failure_columns[-1]
        for model in dict.fromkeys(m for m, _ in mine):
            a, b = mine.get((model, first)), mine.get((model, last))
            if a and b and a.get("throughput") and b.get("throughput") is not None:
                kept.append(b["throughput"] / a["throughput"])
            # the paper's, over every model it has both cells of (the same in every row)
            pa, pb = (a or {}).get("paper"), (b or {}).get("paper")
            if isinstance(pa, (int, float)) and isinstance(pb, (int, float)) and pa:
                kept_paper.append(pb / pa)
        systems[system] = {"ratio": _geomean(ratios), "kept": statistics.fmean(kept) if kept else None,
                           "kept_paper": statistics.fmean(kept_paper) if kept_paper else None}
    return {"dir": str(sweep_dir), "settings": settings(sweep_dir), "columns": (failure_columns[0], failure_columns[-1]),
            "orderings": card["orderings"], "within": card["within"], "status": card["status"],
            "ended": sum(r["status"] not in ("ok", "oom") for r in records), "cells": len(records),
            "systems": systems}


def markdown(rows: list[dict]) -> str:
    systems = list(dict.fromkeys(s for row in rows for s, v in row["systems"].items() if v["ratio"] is not None))
    first, last = rows[0]["columns"] if rows else ("", "")
    head = (["setup", "orderings", f"within {WITHIN:.0%}", "status agreement", "cells ended otherwise"] + [f"{s}: ours / paper" for s in systems]
            + [f"{s}: {last} / {first}, ours (paper)" for s in systems])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row['settings']} ({Path(row['dir']).name})"] + [f"{a} / {b}" for a, b in
                                                                      (row["orderings"], row["within"], row["status"])]
        cells.append(f"{row['ended']} of {row['cells']}")
        for s in systems:
            v = row["systems"].get(s, {}).get("ratio")
            cells.append("" if v is None else f"{v:.2f}")
        for s in systems:
            v = row["systems"].get(s, {})
            kept, paper = v.get("kept"), v.get("kept_paper")
            cells.append("" if kept is None else f"{kept:.2f}" + ("" if paper is None else f" ({paper:.2f})"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftbench.sensitivity", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders of the same experiment")
    args = parser.parse_args(argv)
    rows = []
    for folder in args.sweeps:
        try:
            rows.append(summarize(folder))
        except (FileNotFoundError, ValueError) as err:
            print(f"skipped {folder}: {err}", file=sys.stderr)
    if not rows:
        print("no paper-table sweep among the folders given", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
