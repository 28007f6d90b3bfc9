"""Paper tables as sweeps: the cell resolver, the sweeper's exclusions, job MTBF, the one fit
per model, the report (table.md, table.csv, plots) and a re-run that skips finished cells."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftbench.calibrate import fit
from ftbench.cli import compose, normalise
from ftbench.errors import ConfigError
from ftbench.failures import build_failure_script, take_until
from ftbench.run import execute
from ftbench.sweeper import keep_jobs
from ftbench.tables import aggregate, cell_text, interval95, markdown

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["wandb.mode=disabled", "report.gantt=false", "report.progress=false"]


def test_plus_experiment_is_the_same_as_experiment():
    assert normalise(["+experiment=recycle-table", "seed=1"]) == ["experiment=recycle-table", "seed=1"]
    assert compose(["+experiment=recycle-table"]).table.name == "recycle"


def test_cells_resolve_dotted_model_names_and_columns():
    cfg = compose(["+experiment=recycle-table", "model=gpt3-3.35b", "table.column=2h"])
    assert (cfg.cluster.pp, cfg.cluster.dp, cfg.train.microbatches) == (4, 4, 8)
    assert cfg.failures.job_mtbf_hours == 2.0 and cfg.calibrate.throughput == 14.87
    six = compose(["+experiment=recycle-table", "model=gpt3-6.7b"])
    assert (six.cluster.pp, six.train.microbatches) == (8, 16)
    per_strategy = compose(["+experiment=oobleck-table2", "model=gpt3-2.7b", "strategy=bamboo"])
    assert (per_strategy.cluster.pp, per_strategy.cluster.dp) == (6, 20)


def test_a_model_outside_the_table_names_the_setting():
    cfg = compose(["+experiment=recycle-table", "model=gpt3-xl"])
    with pytest.raises(Exception, match="gpt3-xl"):
        _ = cfg.cluster.pp


def test_exclusions_leave_out_matching_jobs_only():
    jobs = [[f"strategy={s}", f"table.column={c}", f"seed={k}"]
            for s in ("none", "recycle") for c in ("fault-free", "6h") for k in (0, 1)]
    kept = keep_jobs(jobs, [{"strategy": "none", "table.column": ["6h"]},
                            {"table.column": "fault-free", "seed": [1]}])
    assert kept == [["strategy=none", "table.column=fault-free", "seed=0"],
                    ["strategy=recycle", "table.column=fault-free", "seed=0"],
                    ["strategy=recycle", "table.column=6h", "seed=0"],
                    ["strategy=recycle", "table.column=6h", "seed=1"]]


def test_job_mtbf_is_the_jobs_rate():
    """A column's "a failure every 2 h" is the job's: 500 in 1,000 h (4 sigma: 89), nodes down
    for repair or not."""
    job = compose(["backend=sim", "failures=poisson", "failures.mtbf_hours=null", "failures.job_mtbf_hours=2",
                   "failures.repair_hours=1"])
    events = take_until(build_failure_script(job.failures, 16, seed=3).by_time, 1000 * 3600.0)
    assert abs(sum(e.kind == "fail" for e in events) - 500) <= 4 * 500 ** 0.5
    both = compose(["backend=sim", "failures=poisson", "failures.job_mtbf_hours=2"])
    with pytest.raises(ConfigError, match="failures.job_mtbf_hours"):
        build_failure_script(both.failures, 16, seed=0)
    none = compose(["backend=sim", "failures=poisson", "failures.count=0"])
    assert list(build_failure_script(none.failures, 16, seed=0).by_time) == []


def test_interval_uses_student_t():
    mean, half = interval95([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
    assert interval95([5.0]) == (5.0, None)


def test_the_fit_meets_the_target_and_is_shared(tmp_path):
    cfg = compose(["+experiment=recycle-table", "model=gpt3-medium", "strategy=recycle", *QUIET])
    result = fit(cfg, tmp_path)
    assert result["reference"] == "none" and result["target"] == 27.58
    assert result["reached"] == pytest.approx(27.58, rel=2e-4) and result["reached"] >= 27.58
    assert json.loads((tmp_path / ".calibration.json").read_text())  # the sweep's cache
    other = compose(["+experiment=recycle-table", "model=gpt3-medium", "strategy=oobleck", "seed=2", *QUIET])
    assert fit(other, tmp_path) == result  # every cell of a model shares the model's one fit
    # The fitted run really trains at the target: the fit is a cell's own result, not a lookup.
    ran = execute(compose(["+experiment=recycle-table", "model=gpt3-medium", "strategy=none",
                           "table.column=fault-free", *QUIET]), tmp_path / "run", echo=lambda *_: None)
    assert ran["status"] == "ok" and ran["throughput"] == pytest.approx(27.58, rel=2e-4)
    assert ran["calibration"]["efficiency"] == ran["efficiency"] == result["efficiency"]


def _summary(model, strategy, column, seed, throughput, status="ok"):
    return {"model": model, "strategy": strategy, "table": {"name": "t", "column": column}, "seed": seed,
            "status": status, "throughput": throughput, "ettr": 0.9, "peak_memory_bytes": [1e9]}


def test_cells_aggregate_with_the_paper_beside_them():
    spec = {"name": "t", "rows": {"recycle": "ReCycle", "oobleck": "Oobleck"},
            "columns": {"fault-free": {}, "6h": {"hours": 6}}, "models": {"m": {"label": "M"}},
            "paper": {"m": {"ReCycle": {"6h": 10.0}, "Oobleck": {"6h": "OOM"}}}}
    cells = [_summary("m", "recycle", "6h", k, v) for k, v in enumerate([9.0, 10.0, 11.0])]
    cells += [_summary("m", "oobleck", "6h", 0, 0.0, status="oom")]
    records = {r["system"]: r for r in aggregate(spec, cells)}
    recycle = records["ReCycle"]
    assert recycle["seeds"] == 3 and recycle["throughput"] == 10.0 and recycle["ratio"] == 1.0
    assert cell_text(recycle) == "10.00 ± 2.48 (10, 1.00×)"
    assert cell_text(records["Oobleck"]) == "OOM (OOM)"
    text = markdown(spec, list(records.values()))
    assert "column orderings as the paper's, statuses and fault-free cells included: 1 of 1" in text
    assert "status agreement (a number or OOM, as the paper): 2 of 2" in text


@pytest.mark.slow
def test_a_table_sweep_writes_its_report_and_a_rerun_skips_done_cells(tmp_path):
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "ftbench", "--multirun", "+experiment=recycle-table",
            "model=gpt3-medium", "strategy=none,recycle", "table.column=fault-free,30m", "seed=0,1",
            "train.max_hours=3", f"hydra.sweep.dir={sweep}", "wandb.mode=disabled"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    first = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "4 jobs (4 left out by hydra.sweeper.exclude)" in first.stderr
    for name in ("table.md", "table.csv", "throughput_vs_failures.png", "throughput_over_time.png"):
        assert (sweep / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(sweep / "table.csv")))
    cells = {(r["system"], r["column"]): r for r in rows}
    assert cells[("ReCycle", "30m")]["seeds"] == "2" and cells[("ReCycle", "30m")]["paper"] == "22.27"
    assert float(cells[("fault-free DeepSpeed", "fault-free")]["ratio"]) == pytest.approx(1.0, rel=1e-3)
    done = sweep / "gpt3-medium" / "30m" / "recycle" / "seed1" / "summary.json"
    before = json.loads(done.read_text())
    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.count("skipped (report.skip_done)") == 4
    assert json.loads(done.read_text()) == before


def test_the_recycle_table_runs_oobleck_at_its_own_template_range():
    """No per-system depth for Oobleck (a setting chosen by the orderings is not a source): its
    templates start at n0, the fewest nodes that hold the model, as Oobleck's own code computes."""
    from ftbench.run import table_strategy_settings

    cfg = compose(["+experiment=recycle-table", "model=gpt3-6.7b", "strategy=oobleck"])
    table_strategy_settings(cfg)
    assert cfg.strategy.min_nodes is None
    held = compose(["+experiment=recycle-table", "model=gpt3-6.7b", "strategy=oobleck", "strategy.min_nodes=8"])
    table_strategy_settings(held)
    assert held.strategy.min_nodes == 8  # the sensitivity table's other setup, from the command line


def test_throughput_over_time_reads_the_last_attempt_of_a_cell(tmp_path):
    """A cell run again into its folder appends a second attempt to metrics.jsonl: the plot's
    series must be the last attempt's (10 samples/s), not both added up."""
    from ftbench.tables import throughput_series

    attempt = [{"event": "start", "global_batch": 10},
               {"event": "iterations", "count": 100, "iteration_time_s": 1.0, "time_s": 100.0},
               {"event": "fail", "time_s": 100.0}, {"event": "end"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attempt * 2))
    _, rate, fails = throughput_series(tmp_path, bins=10)
    assert max(rate) == pytest.approx(10.0) and fails == [100.0 / 3600]


def test_a_paper_table_with_oom_cells_is_logged_to_wandb(tmp_path, monkeypatch):
    """W&B refuses a column mixing numbers and text: the paper's OOM cells are a status column
    beside the published numbers, and the table reaches the sweep's offline W&B run."""
    import warnings

    from omegaconf import OmegaConf

    from ftbench.tables import _to_wandb, wandb_rows

    monkeypatch.setenv("WANDB_MODE", "offline")
    spec = {"name": "t", "rows": {"recycle": "ReCycle", "oobleck": "Oobleck"},
            "columns": {"fault-free": {}, "6h": {"hours": 6}}, "models": {"m": {"label": "M"}},
            "paper": {"m": {"ReCycle": {"6h": 10.0}, "Oobleck": {"6h": "OOM"}}}}
    records = aggregate(spec, [_summary("m", "recycle", "6h", 0, 9.5), _summary("m", "oobleck", "6h", 0, 0.0, "oom")])
    columns, rows = wandb_rows(spec, records)
    by_system = {row[columns.index("system")]: dict(zip(columns, row)) for row in rows}
    assert (by_system["Oobleck"]["paper"], by_system["Oobleck"]["paper_status"]) == (None, "OOM")
    assert (by_system["ReCycle"]["paper"], by_system["ReCycle"]["paper_status"]) == (10.0, "reported")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # _to_wandb warns instead of raising when W&B refuses
        _to_wandb(tmp_path, spec, records, {}, OmegaConf.create({"mode": "offline", "project": "ftbench-test"}))
    (logged,) = tmp_path.glob("wandb/offline-run-*/files/media/table/paper_table_*.table.json")
    table = json.loads(logged.read_text())
    assert "OOM" in [row[table["columns"].index("paper_status")] for row in table["data"]]
    # the scorecard in the run's summary, counted as table.md counts it (no fitted cell here)
    from test_metrics import of_type, wandb_records

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    card = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for summary in of_type(wandb_records(run_file), "summary") for item in summary.update}
    assert (card["scorecard/within"], card["scorecard/within_of"]) == (1, 1)
    assert (card["scorecard/status"], card["scorecard/status_of"]) == (2, 2)
    assert card["scorecard/fitted_cells"] == 0


def test_a_command_line_strategy_setting_wins_over_the_tables():
    """`strategy.every=5` given with Oobleck Table 2's Varuna cell is kept (the table's
    `every: 10` is not merged over it), and the run says which one won."""
    from ftbench.run import table_strategy_settings

    given = ["+experiment=oobleck-table2", "model=gpt3-6.7b", "strategy=varuna", "strategy.every=5"]
    cfg = compose(given)
    said = []
    table_strategy_settings(cfg, given, said.append)
    assert cfg.strategy.every == 5 and cfg.strategy.start == "fastest"
    assert said == ["ftbench: strategy.every from the command line wins over table.strategies.varuna.every"]


@pytest.mark.slow
def test_a_column_sees_the_failures_its_label_says(tmp_path):
    """A simulated 48 h under "a failure every 30 min" strikes every failure of its script (the
    script's rate is the label: tests/test_failures.py), 96 expected (Poisson: 4 sigma is 39)."""
    cfg = compose(["+experiment=recycle-table", "model=gpt3-medium", "strategy=recycle", "table.column=30m", *QUIET])
    summary = execute(cfg, tmp_path / "run", echo=lambda *_: None)
    assert summary["status"] == "ok"
    script = build_failure_script(cfg.failures, 16, seed=cfg.seed)
    scripted = [e for e in take_until(script.by_time, summary["time_s"]) if e.kind == "fail"]
    assert summary["failures"] == len(scripted)
    assert abs(summary["failures"] - 96) <= 4 * 96 ** 0.5, summary["failures"]
