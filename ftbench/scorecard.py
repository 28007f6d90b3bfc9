"""The scorecard of a paper table: how many of the paper's cells the reproduction agrees with,
counted so that nothing flatters it.

- A *fitted* cell (the one a model's `hardware.efficiency` is fitted to: the experiment's
  `calibrate` run in the fault-free column) agrees by construction, so it is listed with its
  fitted number and left out of every count.
- Each other cell the paper prints has an *outcome*: a number, or OOM. Ours is a number only
  when the run ended ok with a positive throughput; an OOM is OOM; anything else (unrecoverable,
  an error, no iteration done) is neither. A status mismatch is a miss in both directions.
- *within 15 %*: the paper's number cells whose ours is a number within 15 % of it.
- *status agreement*: every judged cell whose outcome is the paper's (number or OOM).
- *agreement*: every judged cell that is within 15 % or OOM where the paper has OOM.
- *orderings*: per model and failure column, the systems ranked by the paper and by us,
  together with every system's fault-free cell (a failure never makes a system faster than
  fault-free training, so the baseline row belongs in every column); an ordering agrees only
  when every status agrees and the numbers rank the same.

Cells the sweep did not run are not judged (a partial sweep); the scorecard says how many of
the paper's cells it judged.
"""
from __future__ import annotations

from typing import Any

WITHIN = 0.15  # the target: every cell within 15 % of the paper's
FAULT_FREE = "fault-free"  # the column key of a system's own fault-free run
NUMBER, OOM = "number", "OOM"


def paper_outcome(value: Any) -> str | None:
    """The outcome the paper prints: a number, OOM, or None where it prints nothing."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return NUMBER
    return OOM if value == "OOM" else None


def our_outcome(record: dict | None) -> str | None:
    """Ours: a number (ok and some training done), OOM, or what the run ended as instead."""
    if record is None:
        return None
    statuses = record["status"].split("/")
    if statuses == ["ok"]:
        return NUMBER if (record.get("throughput") or 0) > 0 else "no iteration"
    return OOM if statuses == ["oom"] else record["status"]


def fitted_cells(spec: dict, models: list[str]) -> set[tuple[str, str, str]]:
    """(model, system, column) of the cells the efficiency is fitted to: `spec["fitted"]`
    names the system (a strategy) whose fault-free run the experiment calibrates."""
    fitted = spec.get("fitted") or {}
    strategy = fitted.get("strategy")
    if not strategy:
        return set()
    system = (spec.get("rows") or {}).get(strategy, strategy)
    return {(m, system, fitted.get("column", FAULT_FREE)) for m in models}


def judge_cells(spec: dict, records: list[dict]) -> list[dict]:
    """One judgement per paper cell the sweep ran: outcomes, ratio, fitted, within, agrees."""
    by_cell = {(r["model"], r["system"], r["column"]): r for r in records}
    fitted = fitted_cells(spec, list(spec.get("paper") or {}))
    out = []
    for model, rows in (spec.get("paper") or {}).items():
        for system, cells in rows.items():
            for column, value in (cells or {}).items():
                paper = paper_outcome(value)
                record = by_cell.get((model, system, column))
                if paper is None or record is None:
                    continue
                ours = our_outcome(record)
                ratio = record["throughput"] / value if paper == NUMBER and ours == NUMBER else None
                within = ratio is not None and abs(ratio - 1) <= WITHIN
                out.append({"model": model, "system": system, "column": column, "paper": value,
                            "paper_outcome": paper, "ours": ours, "ratio": ratio,
                            "fitted": (model, system, column) in fitted, "status_agrees": ours == paper,
                            "within": within, "agrees": within or (paper == OOM and ours == OOM)})
    return out


def _entry_name(system: str, column: str) -> str:
    if column != FAULT_FREE:
        return system
    return system if FAULT_FREE in system else f"{system}, {FAULT_FREE}"


def orderings(spec: dict, records: list[dict]) -> list[dict]:
    """Per model and failure column, the paper's ranking and ours, the fault-free cells included."""
    by_cell = {(r["model"], r["system"], r["column"]): r for r in records}
    checks = []
    for model, rows in (spec.get("paper") or {}).items():
        for column in [c for c in spec.get("columns") or {} if c != FAULT_FREE]:
            entries = [(system, c) for system, cells in rows.items() for c in (column, FAULT_FREE)
                       if paper_outcome((cells or {}).get(c)) is not None]
            if len({s for s, c in entries if c == column}) < 1 or len(entries) < 2:
                continue
            if any((model, s, c) not in by_cell for s, c in entries):
                continue  # not in this sweep
            paper = {(s, c): rows[s][c] for s, c in entries}
            ours = {(s, c): by_cell[(model, s, c)] for s, c in entries}
            paper_rank = _rank({e: (paper_outcome(v), v) for e, v in paper.items()})
            ours_rank = _rank({e: (our_outcome(r), r.get("throughput")) for e, r in ours.items()})
            statuses = all(our_outcome(ours[e]) == paper_outcome(paper[e]) for e in entries)
            checks.append({"model": model, "column": column, "paper": paper_rank, "ours": ours_rank,
                           "statuses": statuses, "match": statuses and paper_rank == ours_rank})
    return checks


def _rank(cells: dict[tuple[str, str], tuple[str | None, Any]]) -> list[str]:
    """Names from fastest to slowest; cells without a number last, by name, with their outcome."""
    numbers = sorted((e for e, (o, _) in cells.items() if o == NUMBER), key=lambda e: -cells[e][1])
    others = sorted((e for e, (o, _) in cells.items() if o != NUMBER), key=lambda e: _entry_name(*e))
    return ([_entry_name(*e) for e in numbers]
            + [f"{_entry_name(*e)} ({cells[e][0]})" for e in others])


def score(spec: dict, records: list[dict]) -> dict:
    """The counts: (agreeing, judged) pairs, the fitted cells with their numbers, the judgements."""
    cells = judge_cells(spec, records)
    judged = [c for c in cells if not c["fitted"]]
    numbers = [c for c in judged if c["paper_outcome"] == NUMBER]
    checks = orderings(spec, records)
    efficiency = {r["model"]: r.get("efficiency") for r in records if r.get("efficiency") is not None}
    fitted = [{**c, "efficiency": efficiency.get(c["model"])} for c in cells if c["fitted"]]
    paper_cells = sum(paper_outcome(v) is not None for rows in (spec.get("paper") or {}).values()
                      for cells_ in rows.values() for v in (cells_ or {}).values())
    return {"within": (sum(c["within"] for c in numbers), len(numbers)),
            "status": (sum(c["status_agrees"] for c in judged), len(judged)),
            "agree": (sum(c["agrees"] for c in judged), len(judged)),
            "orderings": (sum(c["match"] for c in checks), len(checks)),
            "fitted": fitted, "cells": cells, "ordering_checks": checks,
            "paper_cells": paper_cells, "judged_of": len(cells)}


def markdown_lines(spec: dict, result: dict, labels: dict[str, str]) -> list[str]:
    """The scorecard as Markdown: the fitted cells first, then the counts and the orderings."""
    lines = ["## Fitted, and left out of every count", ""]
    if result["fitted"]:
        lines += [f"- {labels.get(c['model'], c['model'])}, {c['system']}, {c['column']}: the paper's {c['paper']} "
                  + (f"(hardware.efficiency fitted to {c['efficiency']:.4f})" if c.get("efficiency") is not None
                     else "(hardware.efficiency fitted)") for c in result["fitted"]]
    else:
        lines.append("- nothing")
    w, s, a, o = result["within"], result["status"], result["agree"], result["orderings"]
    lines += ["", "## Scorecard", "",
              f"Judged: {result['judged_of']} of the paper's {result['paper_cells']} cells are in this sweep; "
              f"{len(result['fitted'])} of them fitted. A status mismatch (OOM, unrecoverable or no iteration where "
              "the paper has a number, a number where it has OOM) is a miss.", "",
              f"- cells within {WITHIN:.0%} of the paper's number: {w[0]} of {w[1]}",
              f"- status agreement (a number or OOM, as the paper): {s[0]} of {s[1]}",
              f"- cells that agree (within {WITHIN:.0%}, or OOM as the paper): {a[0]} of {a[1]}",
              f"- column orderings as the paper's, statuses and fault-free cells included: {o[0]} of {o[1]}", "",
              "| model | column | paper's order | ours | statuses | same |", "|---|---|---|---|---|---|"]
    for c in result["ordering_checks"]:
        lines.append(f"| {labels.get(c['model'], c['model'])} | {c['column']} | {' > '.join(c['paper'])} | "
                     f"{' > '.join(c['ours'])} | {'same' if c['statuses'] else 'differ'} | "
                     f"{'yes' if c['match'] else 'no'} |")
    misses = [c for c in result["cells"] if not c["fitted"] and not c["agrees"]]
    if misses:
        lines += ["", "Cells that miss:", ""]
        lines += [f"- {labels.get(c['model'], c['model'])}, {c['system']}, {c['column']}: ours "
                  + (f"{c['ratio']:.2f}x the paper's" if c["ratio"] is not None else f"{c['ours']}, the paper {c['paper']}")
                  for c in misses]
    return lines


def summary_line(result: dict) -> str:
    """One line for the console and the README."""
    w, s, o = result["within"], result["status"], result["orderings"]
    return (f"within {WITHIN:.0%}: {w[0]} of {w[1]}, status agreement {s[0]} of {s[1]}, "
            f"orderings {o[0]} of {o[1]} ({len(result['fitted'])} fitted cells left out)")
