"""Nothing a run does reaches outside its run folder: every path setting (Swift's
strategy.log_dir, ReCycle's strategy.plan_cache) is refused with a clean error naming it when
it leads out (absolute, `..`, a symlink out, empty, a device), and nothing the run did not
create is deleted. Each form is tried against a folder holding a file, which must survive."""
import os
import subprocess
import sys

import pytest

from conftest import LOCAL, ROOT, run

SWIFT = (*LOCAL, "cluster.pp=2", "cluster.dp=1", "train.iterations=3", "strategy=swift", "strategy.every=2")
RECYCLE = ("backend=sim", "model=gpt-tiny", "report.gantt=false", "strategy=recycle", "cluster.dp=3",
           "train.iterations=4", "failures=scripted", "failures.events=[{iteration:2,node:1}]")
FORMS = ["absolute", "parent", "deep-parent", "symlink", "empty", "device", "itself", "reserved"]


def _victim(tmp_path):
    """A folder beside the run folder holding a file that no run may touch."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("not the run's")
    return victim


def _value(form: str, tmp_path, run_dir) -> str:
    victim = tmp_path / "victim"
    if form == "symlink":
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "out").symlink_to(victim, target_is_directory=True)
        return "out"
    return {"absolute": str(victim), "parent": "..", "deep-parent": "sub/../../victim", "empty": "''",
            "device": os.devnull, "itself": ".", "reserved": "checkpoints"}[form]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("setting,setup", [("strategy.log_dir", SWIFT), ("strategy.plan_cache", RECYCLE)],
                         ids=["swift-log-dir", "recycle-plan-cache"])
def test_a_path_setting_outside_the_run_folder_is_refused(tmp_path, form, setting, setup):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    summary = run(run_dir, *setup, f"{setting}={_value(form, tmp_path, run_dir)}")
    assert summary["status"] == "error" and f"`{setting}`" in summary["error"], summary["error"]
    assert (victim / "precious.txt").read_text() == "not the run's"
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]


def test_a_log_folder_the_run_found_is_not_deleted(tmp_path):
    """A log folder that existed before the run keeps what it held; one the run made goes."""
    run_dir = tmp_path / "run"
    (run_dir / "mine").mkdir(parents=True)
    (run_dir / "mine" / "notes.txt").write_text("the user's")
    summary = run(run_dir, *SWIFT, "strategy.log_dir=mine")
    assert summary["status"] == "ok", summary["error"]
    assert (run_dir / "mine" / "notes.txt").read_text() == "the user's"
    summary = run(tmp_path / "second", *SWIFT, "strategy.log_dir=new-logs")
    assert summary["status"] == "ok", summary["error"]
    assert not (tmp_path / "second" / "new-logs").exists()


def test_the_plan_cache_lands_inside_the_run_folder(tmp_path):
    summary = run(tmp_path / "run", *RECYCLE)
    assert summary["status"] == "ok", summary["error"]
    assert any((tmp_path / "run" / "plan-cache").glob("*.json"))


def test_the_cli_exits_2_naming_the_setting(tmp_path):
    victim = _victim(tmp_path)
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    out = subprocess.run([sys.executable, "-m", "ftbench", *SWIFT, f"strategy.log_dir={victim}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "strategy.log_dir" in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]


def test_a_setting_hydra_rejects_is_recorded_in_the_given_run_folder(tmp_path):
    """A command line Hydra cannot compose still writes its summary into hydra.run.dir, not
    into ./runs of the current folder."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    out = subprocess.run([sys.executable, "-m", "ftbench", "model=no-such-model", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "`model`" in out.stderr and f"Run folder: {tmp_path / 'run'}" in out.stderr
    assert '"status": "error"' in (tmp_path / "run" / "summary.json").read_text()
    assert not (tmp_path / "runs").exists()
