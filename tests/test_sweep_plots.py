"""Plots of any sweep (ftbench/sweep_plots.py): what each plot shows is computed from the
summaries (means and 95 % intervals over seeds, statuses, recovery time by action), and the
files are drawn by `python -m ftbench.report SWEEP --plots` and by the sweep's callback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftbench.run_tables import x_keys
from ftbench.sweep_plots import cell_runs, parse_cell, recovery_breakdown, series, write_plots
from ftbench.tables import interval95

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _run(folder: Path, strategy: str, mtbf: int, seed: int, throughput: float, status: str = "ok",
         recoveries=()) -> dict:
    """A run folder of a sweep over strategy x failures.job_mtbf_hours x seed: its summary and
    the metrics lines the over-time plot reads."""
    folder.mkdir(parents=True)
    summary = {"strategy": strategy, "backend": "sim", "status": status, "seed": seed, "throughput": throughput,
               "ettr": 0.9 if status == "ok" else None, "recoveries": list(recoveries),
               "swept": ["strategy", "failures.job_mtbf_hours", "seed"],
               "overrides": [f"strategy={strategy}", f"failures.job_mtbf_hours={mtbf}", f"seed={seed}"]}
    (folder / "summary.json").write_text(json.dumps(summary))
    lines = [{"event": "start", "global_batch": 8},
             {"event": "iterations", "first": 0, "last": 9, "count": 10, "iteration_time_s": 36.0, "time_s": 360.0},
             {"event": "fail", "node": 1, "time_s": 400.0, "iteration": 10},
             {"event": "iterations", "first": 10, "last": 19, "count": 10, "iteration_time_s": 36.0, "time_s": 900.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return summary


def _sweep(root: Path) -> Path:
    restart = {"time_s": 400.0, "recovery_s": 100.0, "actions": ["RestartJob", "RestoreCheckpoint"],
               "action_s": [60.0, 40.0]}
    measured = {"time_s": 400.0, "recovery_s": 30.0, "actions": ["Rendezvous"]}  # no per-action seconds
    k = 0
    for strategy, base in (("checkpoint", 100.0), ("recycle", 120.0)):
        for mtbf in (1, 3):
            for seed in (0, 1, 2):
                status = "oom" if (strategy, mtbf, seed) == ("recycle", 1, 2) else "ok"
                recoveries = [restart] if strategy == "checkpoint" else [measured]
                _run(root / str(k), strategy, mtbf, seed, base + 10 * mtbf + seed, status, recoveries)
                k += 1
    return root


def test_each_point_is_the_mean_and_interval_over_the_seeds_that_ended_ok(tmp_path):
    from ftbench.run_tables import load_runs

    runs = load_runs([_sweep(tmp_path)])
    assert x_keys(runs) == ["failures.job_mtbf_hours"]
    lines = series(runs, "failures.job_mtbf_hours")
    assert sorted(lines) == ["checkpoint", "recycle"]
    one, three = lines["checkpoint"]
    assert (one.x, three.x) == (1, 3) and one.ok == 3 and not one.failed
    assert one.metrics["throughput"] == pytest.approx(interval95([110.0, 111.0, 112.0]))
    assert one.metrics["recovery_s"] == (100.0, pytest.approx(0.0))
    cut = lines["recycle"][0]  # one seed ended oom: the mean is over the other two, the oom is shown
    assert cut.ok == 2 and cut.failed == {"oom": 1}
    assert cut.metrics["throughput"] == pytest.approx(interval95([130.0, 131.0]))


def test_recovery_time_is_split_by_action_where_the_clock_gives_each():
    runs = [{"strategy": "checkpoint", "status": "ok",
             "recoveries": [{"recovery_s": 100.0, "actions": ["RestartJob", "RestoreCheckpoint"], "action_s": [60.0, 30.0]}]},
            {"strategy": "checkpoint", "status": "ok", "recoveries": []},
            {"strategy": "recycle", "status": "ok", "recoveries": [{"recovery_s": 12.0, "actions": ["Rendezvous"]}]},
            {"strategy": "recycle", "status": "oom", "recoveries": [{"recovery_s": 99.0, "actions": ["Rendezvous"]}]}]
    split = recovery_breakdown(runs)
    assert split["checkpoint"] == {"RestartJob": 30.0, "RestoreCheckpoint": 15.0, "(rest of the recovery)": 5.0}
    assert split["recycle"] == {"recovery": 12.0}  # the oom run left out


def test_the_over_time_cell_is_chosen_by_its_values_and_the_lowest_seed(tmp_path):
    from ftbench.run_tables import load_runs

    runs = load_runs([_sweep(tmp_path)])
    cell, chosen = cell_runs(runs, parse_cell("failures.job_mtbf_hours=3"))
    assert cell == {"failures.job_mtbf_hours": "3"}
    assert sorted((r["strategy"], r["seed"], r["throughput"]) for r in chosen) == [("checkpoint", 0, 130.0),
                                                                                    ("recycle", 0, 150.0)]
    default, _ = cell_runs(runs, {})
    assert default == {"failures.job_mtbf_hours": "1"}
    with pytest.raises(ValueError, match="key=value"):
        parse_cell("failures.job_mtbf_hours")


def test_the_report_command_draws_every_plot(tmp_path):
    sweep = _sweep(tmp_path / "sweep")
    out = subprocess.run([sys.executable, "-m", "ftbench.report", str(sweep), "--plots"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, out.stderr
    for name in ("vs-failures.job_mtbf_hours.png", "over-time.png", "recovery-breakdown.png"):
        assert (sweep / name).read_bytes()[:8] == PNG, name
        assert f"wrote {sweep / name}" in out.stderr
    assert set(write_plots(sweep)) == {sweep / "vs-failures.job_mtbf_hours.png", sweep / "over-time.png",
                                       sweep / "recovery-breakdown.png"}


@pytest.mark.slow
def test_a_sweep_draws_its_plots_when_it_ends(tmp_path):
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "ftbench", "--multirun", "backend=sim", "model=gpt-tiny",
                          "strategy=none,checkpoint", "seed=0,1", "train.iterations=20", "failures=none",
                          "report.gantt=false", f"hydra.sweep.dir={sweep}", "wandb.mode=disabled"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "WANDB_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Plots: strategies.png, over-time.png, recovery-breakdown.png." in out.stdout, out.stdout[-1000:]
    assert (sweep / "strategies.png").read_bytes()[:8] == PNG


def test_a_sweep_over_several_keys_draws_a_row_per_combination_of_the_others(tmp_path):
    """Against one key, the other swept keys' values each make a row of panels (a paper table's
    models), its lines the strategies alone: 2 models x 2 strategies is 2 rows of 2 lines, not
    4 lines on one axis, and a status is a marker (no text that overlaps)."""
    from ftbench.run_tables import load_runs
    from ftbench.sweep_plots import facets, plot_against

    k = 0
    for model in ("gpt3-medium", "gpt3-6.7b"):
        for strategy in ("checkpoint", "recycle"):
            for mtbf in (1, 3):
                folder = tmp_path / str(k)
                folder.mkdir()
                k += 1
                status = "oom" if (model, strategy) == ("gpt3-6.7b", "recycle") else "ok"
                summary = {"strategy": strategy, "backend": "sim", "status": status, "seed": 0, "recoveries": [],
                           "throughput": 10.0 * mtbf if status == "ok" else None, "ettr": 0.9,
                           "swept": ["model", "strategy", "failures.job_mtbf_hours"],
                           "overrides": [f"model={model}", f"strategy={strategy}", f"failures.job_mtbf_hours={mtbf}"]}
                (folder / "summary.json").write_text(json.dumps(summary))
    runs = load_runs([tmp_path])
    rows = facets(runs, "failures.job_mtbf_hours")
    assert [label for label, _ in rows] == ["model=gpt3-6.7b", "model=gpt3-medium"]
    assert all(sorted(series(part, "failures.job_mtbf_hours", others=[])) == ["checkpoint", "recycle"]
               for _, part in rows)
    assert facets(runs, "failures.job_mtbf_hours")[0][1] and len(facets(runs, "model")) == 2
    assert plot_against(runs, "failures.job_mtbf_hours", tmp_path / "vs.png").read_bytes()[:8] == PNG
