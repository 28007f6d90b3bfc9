"""The scorecard counts honestly: fitted cells left out, a status mismatch a miss in both
directions, orderings with statuses and the fault-free cells, from a small synthetic sweep."""
from __future__ import annotations

import json

import yaml

from ftbench.scorecard import score, summary_line
from ftbench.sensitivity import summarize
from ftbench.tables import aggregate, load_cells, markdown, table_spec

PAPER = {"m": {"Base": {"fault-free": 10.0}, "A": {"6h": 8.0, "30m": 6.0}, "B": {"6h": "OOM", "30m": "OOM"},
               "C": {"6h": 7.0, "30m": 5.0}},
         "n": {"Base": {"fault-free": 10.0}, "A": {"6h": 8.0}, "B": {"6h": "OOM"}, "C": {"6h": 7.0}}}
# (model, strategy, column): (status, throughput); the comment says how each cell is judged
OURS = {("m", "base", "fault-free"): ("ok", 12.0),   # fitted: left out (1.2x would be a miss)
        ("m", "a", "6h"): ("ok", 8.5),               # within
        ("m", "a", "30m"): ("ok", 0.0),              # no iteration where the paper has a number: a miss
        ("m", "b", "6h"): ("oom", 0.0),              # OOM as the paper
        ("m", "b", "30m"): ("ok", 3.0),              # a number where the paper has OOM: a miss
        ("m", "c", "6h"): ("unrecoverable", 0.0),    # a miss
        ("m", "c", "30m"): ("ok", 5.5),              # within (1.10x)
        ("n", "base", "fault-free"): ("ok", 10.0),
        ("n", "a", "6h"): ("ok", 7.0),               # within (0.875x)
        ("n", "b", "6h"): ("oom", 0.0),
        ("n", "c", "6h"): ("ok", 6.9)}               # within; n's 6h ranks as the paper's


def _sweep(tmp_path):
    spec = {"name": "t", "columns": {"fault-free": {}, "6h": {"hours": 6}, "30m": {"hours": 0.5}},
            "models": {"m": {"label": "M"}, "n": {"label": "N"}}, "paper": PAPER,
            "rows": {"base": "Base", "a": "A", "b": "B", "c": "C"}}
    config = {"table": spec, "calibrate": {"throughput": "${cell:models,fault_free}", "strategy": {"name": "base"}}}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump(config))
    for i, ((model, strategy, column), (status, throughput)) in enumerate(OURS.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        summary = {"model": model, "strategy": strategy, "table": {"name": "t", "column": column}, "seed": 0,
                   "status": status, "throughput": throughput, "efficiency": 0.25 if model == "m" else 0.5}
        (folder / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_each_count_of_a_synthetic_sweep(tmp_path):
    sweep = _sweep(tmp_path)
    spec = table_spec(sweep)
    assert spec["fitted"] == {"strategy": "base", "column": "fault-free"}
    card = score(spec, aggregate(spec, load_cells(sweep)))
    assert card["within"] == (4, 6)
    assert card["status"] == (6, 9)
    assert card["agree"] == (6, 9)
    assert card["orderings"] == (1, 3)
    assert [(c["model"], c["efficiency"]) for c in card["fitted"]] == [("m", 0.25), ("n", 0.5)]
    orders = {(c["model"], c["column"]): c for c in card["ordering_checks"]}
    assert orders[("m", "6h")]["paper"] == ["Base, fault-free", "A", "C", "B (OOM)"]
    assert orders[("m", "6h")]["ours"] == ["Base, fault-free", "A", "B (OOM)", "C (unrecoverable)"]
    assert not orders[("m", "6h")]["statuses"] and orders[("n", "6h")]["match"]
    assert summary_line(card) == "within 15%: 4 of 6, status agreement 6 of 9, orderings 1 of 3 (2 fitted cells left out)"


def test_the_table_and_the_sensitivity_row_show_the_same_counts(tmp_path):
    sweep = _sweep(tmp_path)
    spec = table_spec(sweep)
    text = markdown(spec, aggregate(spec, load_cells(sweep)))
    assert "- M, Base, fault-free: the paper's 10.0 (hardware.efficiency fitted to 0.2500)" in text
    assert "cells within 15% of the paper's number: 4 of 6" in text
    assert "status agreement (a number or OOM, as the paper): 6 of 9" in text
    assert "M, B, 30m: ours number, the paper OOM" in text and "M, A, 30m: ours no iteration, the paper 6.0" in text
    row = summarize(sweep)
    assert row["within"] == (4, 6) and row["status"] == (6, 9) and row["orderings"] == (1, 3)
