"""`python -m ftbench.report`: tables over run folders (ftbench/run_tables.py) and, with
`--plots`, a sweep's plots (ftbench/sweep_plots.py).

CLI: `python -m ftbench.report RUN_OR_SWEEP_DIR... [--csv] [--out FILE] [--columns A,B]
[--per-run] [--plots [--cell KEY=VALUE,...]]`. Default columns: strategy, one per swept key, model, schedule, backend, pp, dp,
microbatches, iterations, time, iteration time, throughput, ETTR (`ettr`: productive time over
the run's time), samples dropped (torchft's steps without a replica group), failures, recovery total, lost iterations, status. Times are in the run's
clock, named in the header: `sim s` (the cost model: sim, or local with backend.clock=model)
or `wall s` (measured); a table that mixes them says `s` and adds a `clock` column.
Iteration time: sim, one iteration of the first plan; local, the median over its iterations
(metrics.jsonl). Runs that differ only in the seed share a row: numbers that differ show
mean ± sample standard deviation (`--per-run`: no grouping).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ftbench.metrics import SUMMARY_FILE
from ftbench.run_tables import (DEFAULT_COLUMNS, group_by_seed, load_runs, override_map, run_clock, runs_table,
                                swept_keys, unknown_columns, valid_columns)
from ftbench.sweep_plots import parse_cell, write_plots

__all__ = ["DEFAULT_COLUMNS", "group_by_seed", "load_runs", "main", "override_map", "run_clock", "runs_table",
           "swept_keys"]


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
    parser.add_argument("--plots", action="store_true",
                        help="also draw the sweep's plots into the (first) folder given: each metric per strategy "
                             "against each swept key, throughput over time, recovery time by action")
    parser.add_argument("--publish", action="store_true",
                        help="save the sweep's W&B Report in W&B (its definition: wandb-report.json in the sweep "
                             "folder), after `wandb sync` of its runs; needs `wandb login`")
    parser.add_argument("--cell", help="with --plots: the cell of the over-time plot, key=value,... (default: the "
                                       "first setup, lowest seed)")
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
    if args.plots:
        folder = Path(args.paths[0])
        try:
            parse_cell(args.cell)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for path in write_plots(folder if folder.is_dir() else folder.parent, cell=args.cell):
            print(f"wrote {path}", file=sys.stderr)
    if args.publish:
        from ftbench.errors import UserError
        from ftbench.wandb_report import publish

        try:
            print(f"W&B report: {publish(Path(args.paths[0]))}", file=sys.stderr)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
