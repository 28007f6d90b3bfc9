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
    assert out.stdout.rstrip().splitlines()[-1].split() == ["run", "folder", f"{tmp_path}/run"]
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
    assert (f"ftbench: sweep done (2 ok). Plots: vs-schedule.png, over-time.png, recovery-breakdown.png. "
            f"Sweep folder: {tmp_path}/sweep") in out.stdout
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


SMALL = (*SIM, "model=gpt3-medium", "train.iterations=3")
OOM = (*SIM, "model=gpt3-6.7b", "cluster.pp=1", "cluster.dp=1", "hardware=a100-40gb")  # oom on sim


def summaries(folder):
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*/summary.json"))]


def report(*args):
    return subprocess.run([sys.executable, "-m", "ftbench.report", *map(str, args)], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)


def test_a_run_records_its_overrides(tmp_path):
    out = ftbench(tmp_path, *SMALL)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["overrides"] == [*SMALL] and summary["swept"] == []


def test_a_sweep_records_overrides_and_swept_keys_and_the_report_shows_them(tmp_path):
    out = ftbench(tmp_path, "--multirun", *SMALL, "hardware.efficiency=0.4,0.5", "schedule=1f1b")
    assert out.returncode == 0, out.stderr
    runs = summaries(tmp_path / "sweep")
    assert [r["swept"] for r in runs] == [["hardware.efficiency"], ["hardware.efficiency"]]
    assert sorted(next(o for o in r["overrides"] if o.startswith("hardware.efficiency=")) for r in runs) == [
        "hardware.efficiency=0.4", "hardware.efficiency=0.5"]
    assert all("schedule=1f1b" in r["overrides"] and "train.iterations=3" in r["overrides"] for r in runs)

    table = report(tmp_path / "sweep", "--csv")
    assert table.returncode == 0, table.stderr
    rows = [line.split(",") for line in table.stdout.splitlines()]
    assert rows[0][:2] == ["strategy", "hardware.efficiency"] and sorted(r[1] for r in rows[1:]) == ["0.4", "0.5"]
    assert "time (sim s)" in rows[0] and "recovery total (sim s)" in rows[0] and "lost iterations" in rows[0]

    warned = report(tmp_path / "sweep", "--columns", "strategy,hardware.efficiency,nonsense")
    assert warned.returncode == 0 and "unknown column nonsense" in warned.stderr


def test_a_seed_sweep_is_one_row_in_the_report(tmp_path):
    out = ftbench(tmp_path, "--multirun", *SMALL, "seed=1,2")
    assert out.returncode == 0, out.stderr
    assert [r["swept"] for r in summaries(tmp_path / "sweep")] == [["seed"], ["seed"]]
    table = report(tmp_path / "sweep")
    body = [line for line in table.stdout.splitlines() if line.startswith("| none")]
    assert len(body) == 1 and "1,2" in body[0]


def test_a_sweep_where_no_job_ends_ok_exits_3(tmp_path):
    out = ftbench(tmp_path, "--multirun", *OOM, "seed=1,2")
    assert out.returncode == 3, out.stderr
    assert "no job of the sweep ended 'ok' (2 oom)" in out.stderr and "Traceback" not in out.stderr
    assert [r["status"] for r in summaries(tmp_path / "sweep")] == ["oom", "oom"]


def test_a_reused_sweep_folder_judges_only_the_new_jobs(tmp_path):
    assert ftbench(tmp_path, "--multirun", *SMALL, "seed=1,2").returncode == 0
    # hydra.sweep.dir is the same folder: the earlier "ok" jobs must not count
    out = ftbench(tmp_path, "--multirun", *OOM, "seed=3,4", "hydra.sweep.subdir=oom${hydra.job.num}")
    assert out.returncode == 3, out.stderr


def test_a_joblib_sweep_records_and_exits_like_the_basic_launcher(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    joblib = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    out = ftbench(tmp_path / "ok", "--multirun", *joblib, *SMALL, "schedule=1f1b,zb-h1")
    assert out.returncode == 0, out.stderr
    runs = summaries(tmp_path / "ok" / "sweep")
    assert len(runs) == 2 and all(r["swept"] == ["schedule"] and r["status"] == "ok" for r in runs)
    out = ftbench(tmp_path / "oom", "--multirun", *joblib, *OOM, "seed=1,2")
    assert out.returncode == 3, out.stderr


def test_sigterm_is_handled_like_ctrl_c_and_keeps_what_was_done(tmp_path):
    import signal
    import time

    env = dict(os.environ, WANDB_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "ftbench", "strategy=none", "failures=none", "train.iterations=100000",
                             "report.progress=false", "report.check_fault_free=false", f"hydra.run.dir={tmp_path}/run"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait for a few trained iterations
            if metrics.exists() and metrics.read_text().count('"event": "iteration"') >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # one line on the console, not a traceback; the conventional exit status of SIGTERM
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert f"ftbench: terminated (SIGTERM); {tmp_path}/run keeps what was done" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    assert summary["iterations"] >= 3 and summary["samples"] == summary["iterations"] * summary["global_batch"]
    assert all(isinstance(x, float) for x in summary["losses"][:3])
    assert json.loads(metrics.read_text().splitlines()[-1])["event"] == "error"


def test_ctrl_c_during_the_fault_free_check_keeps_the_runs_summary(tmp_path, monkeypatch):
    """Interrupted while the run checks itself against fault-free training (after its own
    training loop), the summary holds the run's iterations and failures, not the check's."""
    import ftbench.fault_free as fault_free
    import ftbench.run as run_module
    from conftest import LOCAL, compose

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fault_free, "fault_free_reference", interrupted)
    cfg = compose("report.progress=false", *LOCAL, "report.check_fault_free=true", "strategy=checkpoint",
                  "failures=scripted", "failures.events=[{iteration:3,node:5}]")
    with pytest.raises(KeyboardInterrupt):
        run_module.execute(cfg, tmp_path, echo=lambda *_: None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "interrupted"
    assert summary["iterations"] == 10 and summary["failures"] == 1


@pytest.mark.dist
def test_ctrl_c_during_a_dist_runs_fault_free_check_keeps_the_runs_summary(tmp_path, monkeypatch, spawned_ranks):
    """The same on dist, whose results come from the ranks, not from a run loop here."""
    import ftbench.distributed.launch as launch
    import ftbench.run as run_module
    from conftest import compose

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_check_fault_free", interrupted)
    cfg = compose("report.progress=false", "backend=dist", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=1",
                  "train.iterations=3", "train.microbatches=2", "report.gantt=false", "report.check_fault_free=true",
                  "strategy=checkpoint", "strategy.every=2", "cluster.spares=1", "failures=scripted",
                  "failures.events=[{iteration:1,node:1}]")
    with pytest.raises(KeyboardInterrupt):
        run_module.execute(cfg, tmp_path, echo=lambda *_: None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "interrupted"
    assert summary["iterations"] == 3 and summary["failures"] == 1 and len(summary["recoveries"]) == 1


def test_a_time_capped_run_shows_progress_in_hours(monkeypatch):
    """The progress bar of a run capped by train.max_hours counts hours (a run that ends at
    its cap shows 100 %), others count iterations."""
    import tqdm

    from ftbench.context import RunContext
    from ftbench.job import Progress
    from conftest import compose

    bars = []

    class Fake:
        def __init__(self, total, unit, **kwargs):
            self.total, self.unit, self.n = total, unit, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Fake)
    capped = RunContext.from_config(compose("backend=sim", "train.max_hours=2", "train.iterations=1000000000"))
    with Progress(capped, True, "simulating") as progress:
        progress(500, 1800.0)
        progress(100000, 7200.0)
    assert (bars[0].unit, bars[0].total, bars[0].n) == ("h", 2.0, 2.0)
    plain = RunContext.from_config(compose("backend=sim", "train.iterations=20"))
    with Progress(plain, True, "simulating") as progress:
        progress(20, 99.0)
    assert (bars[1].unit, bars[1].total, bars[1].n) == ("it", 20, 20)
