"""`+experiment=today-16k` (docs/today.md): every registered strategy at 16,384 GPUs under
Llama 3's interruption rate, ETTR with its interval, the reported anchors beside the table."""
from __future__ import annotations

import pytest

from ftbench.cli import compose
from ftbench.run import execute
from ftbench.tables import aggregate, markdown

QUIET = ["wandb.mode=disabled", "report.gantt=false", "report.progress=false"]


def test_the_table_holds_every_strategy_at_llama3s_scale_and_rate():
    from ftbench.strategies import REGISTRY
    from omegaconf import OmegaConf

    cfg = compose(["+experiment=today-16k", "strategy=gemini"])
    swept = OmegaConf.to_container(OmegaConf.load("conf/experiment/today-16k.yaml"))["hydra"]["sweeper"]["params"]
    assert set(swept["strategy"].split(",")) == set(REGISTRY), "a registered strategy is missing from the table"
    assert set(cfg.table.rows) == set(REGISTRY)
    assert cfg.cluster.pp * cfg.cluster.dp == 16_384 and cfg.hardware.name == "h100"
    assert cfg.failures.job_mtbf_hours == pytest.approx(54 * 24 / 419, abs=5e-4)  # Llama 3, Table 5
    assert cfg.train.max_hours == 54 * 24


def test_ettr_carries_its_interval_and_the_anchors_are_context_not_cells():
    spec = {"name": "t", "rows": {"gemini": "Gemini"}, "columns": {"llama3": {"hours": 3.093}},
            "models": {"m": {"label": "M"}}, "anchors": ["ByteRobust (2025): 97 % ETTR on 9,600 GPUs"]}
    cells = [{"model": "m", "strategy": "gemini", "table": {"name": "t", "column": "llama3"}, "seed": k,
              "status": "ok", "throughput": 10.0, "ettr": e, "peak_memory_bytes": [1e9]}
             for k, e in enumerate([0.96, 0.97, 0.98])]
    (record,) = aggregate(spec, cells)
    assert record["ettr"] == pytest.approx(0.97) and record["ettr_ci95"] == pytest.approx(4.303 * 0.01 / 3 ** 0.5)
    text = markdown(spec, [record])
    assert "| 97.0 ± 2.5 % |" in text
    assert "- ByteRobust (2025): 97 % ETTR on 9,600 GPUs" in text and "not scored" in text
    assert "1 of 1" not in text.split("Anchors")[1].split("## Per cell")[0]  # no agreement count of anchors


def test_a_cell_of_the_table_runs_on_a_smaller_grid(tmp_path):
    """One cell as the table runs it, on pp 8 x dp 64 (512 GPUs, 64 nodes) for 54 days: Gemini
    under a failure a day (54 expected, each node back 45 s after it failed)."""
    cfg = compose(["+experiment=today-16k", "strategy=gemini", "table.column=llama3", "cluster.dp=64",
                   "failures.job_mtbf_hours=24", *QUIET])
    summary = execute(cfg, tmp_path / "run", echo=lambda *_: None)
    assert summary["status"] == "ok", summary["error"]
    assert abs(summary["failures"] - 54) < 4 * 54 ** 0.5 and 0.9 < summary["ettr"] < 1.0
    assert cfg.failures.repair_hours * 3600 == cfg.cluster.replacement_s  # one machine pool for every strategy


def test_samples_dropped_show_beside_throughput_and_ettr():
    """torchft's cell says what share of the kept iterations' global batches it did not train;
    a strategy that keeps the global batch shows none."""
    spec = {"name": "t", "rows": {"torchft": "torchft", "gemini": "Gemini"}, "columns": {"llama3": {"hours": 3.0}},
            "models": {"m": {"label": "M"}}}
    cells = [{"model": "m", "strategy": s, "table": {"name": "t", "column": "llama3"}, "seed": 0, "status": "ok",
              "throughput": 10.0, "ettr": 0.99, "samples": 999_000, "samples_dropped": dropped,
              "peak_memory_bytes": [1e9]} for s, dropped in (("torchft", 1_000), ("gemini", 0))]
    records = {r["strategy"]: r for r in aggregate(spec, cells)}
    assert records["torchft"]["dropped"] == pytest.approx(1e-3) and records["gemini"]["dropped"] == 0
    text = markdown(spec, list(records.values()))
    assert "| torchft | 10 · 99.0 % · 0.1 % of the samples dropped |" in text
    assert "| Gemini | 10 · 99.0 % |" in text
