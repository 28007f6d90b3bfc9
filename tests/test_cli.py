"""The command line as a user runs it: exit codes, messages without tracebacks, sweeps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


SIM = ("backend=sim", "strategy=none", "failures=none")  # the default job is local; these are simulator runs


def ftbench(tmp_path, *args):
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "ftbench", *args,
                           f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_default_job_runs(tmp_path):
    out = ftbench(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "status" in out.stdout and "ok" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").exists()


@pytest.mark.parametrize("override,setting", [("cluster.pp=0", "cluster.pp"), ("cluster.pp=9", "cluster.pp"),
                                              ("train.global_batch=15", "train.global_batch")])
def test_bad_setting_exits_2_with_one_paragraph(tmp_path, override, setting):
    out = ftbench(tmp_path, override)
    assert out.returncode == 2
    assert setting in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "error"


def test_unknown_option_exits_non_zero_without_traceback(tmp_path):
    out = ftbench(tmp_path, "model=gpt5")
    assert out.returncode != 0
    assert "model" in out.stderr and "gpt3-medium" in out.stderr and "Traceback" not in out.stderr


def test_oom_exits_3_and_says_so(tmp_path):
    out = ftbench(tmp_path, *SIM, "model=gpt3-6.7b", "cluster.pp=1", "cluster.dp=1")
    assert out.returncode == 3
    assert "oom" in out.stderr and "Traceback" not in out.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "oom"


def test_multirun_sweep_gives_one_folder_per_job(tmp_path):
    out = ftbench(tmp_path, "--multirun", *SIM, "schedule=1f1b,zb-h1", "model=gpt3-medium", "hardware=a100-80gb")
    assert out.returncode == 0, out.stderr
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    runs = [json.loads(p.read_text()) for p in summaries]
    assert {r["schedule"] for r in runs} == {"1f1b", "zb-h1"} and all(r["status"] == "ok" for r in runs)
    zb = next(r for r in runs if r["schedule"] == "zb-h1")
    ofob = next(r for r in runs if r["schedule"] == "1f1b")
    assert zb["throughput"] > ofob["throughput"]


def test_a_sweep_records_failed_jobs_and_goes_on(tmp_path):
    out = ftbench(tmp_path, "--multirun", *SIM, "model=gpt3-6.7b", "cluster.pp=1,8", "cluster.dp=1", "hardware=a100-80gb")
    assert out.returncode == 0
    statuses = sorted(json.loads(p.read_text())["status"] for p in (tmp_path / "sweep").glob("*/summary.json"))
    assert statuses == ["ok", "oom"]
