"""Progress lines where the console is not a terminal: a line every report.progress_every_s
seconds with the iteration, throughput, failures and recoveries read from the run's records."""
import os
import subprocess
import sys

from conftest import LOCAL, ROOT

from ftbench.progress_lines import ProgressLines


def test_a_line_counts_what_the_records_say():
    now = [100.0]
    lines = ProgressLines(30, 20, echo=None, clock=lambda: now[0])
    assert lines.line() == "ftbench: 0 s, starting (no iteration done yet)"
    lines.observe({"event": "iteration", "iteration": 0, "samples": 16, "time_s": 2.0})
    lines.observe({"event": "fail", "node": 5, "iteration": 1})
    lines.observe({"event": "recovery", "iteration": 1})
    lines.observe({"event": "iterations", "first": 1, "last": 6, "samples": 112, "time_s": 8.0})
    now[0] = 131.0
    assert lines.line() == "ftbench: 31 s, iteration 7/20, 14 samples/s, failures 1, recoveries 1"


def test_a_run_whose_console_is_a_file_prints_lines_as_it_goes(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    out = subprocess.run([sys.executable, "-m", "ftbench", *LOCAL, "report.progress=true", "report.progress_every_s=0.5",
                          "strategy=checkpoint", "failures=scripted", "failures.events=[{iteration:3,node:5}]",
                          f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    progress = [line for line in out.stdout.splitlines() if line.startswith("ftbench: ") and " s, " in line]
    assert len(progress) >= 2, out.stdout
    after = [line for line in progress if "failures 1, recoveries 1" in line]  # the failure is in iteration 3 of 10
    assert after and int(after[-1].split("iteration ")[1].split("/")[0]) >= 4, progress


def test_no_lines_on_a_terminal_or_when_switched_off(monkeypatch):
    from omegaconf import OmegaConf

    report = OmegaConf.create({"progress": True, "progress_every_s": 30.0})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert ProgressLines.for_console(report, 10) is not None
    assert ProgressLines.for_console(OmegaConf.merge(report, {"progress_every_s": None}), 10) is None
    assert ProgressLines.for_console(OmegaConf.merge(report, {"progress": False}), 10) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the progress bar shows there
    assert ProgressLines.for_console(report, 10) is None
