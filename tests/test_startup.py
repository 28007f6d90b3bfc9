"""Start-up stays cheap: --help, --version, config errors and simulator runs import
neither torch nor transformers; the local backend picks its torch thread count from the CPUs
it may use and the model's size (ftbench/threads.py)."""
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftbench import threads
from ftbench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")


def python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter from the checkout; it prints HEAVY=[...] at the end."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    epilogue = f"\nimport sys as _s\nprint('HEAVY=' + repr([m for m in {HEAVY!r} if m in _s.modules]))\n"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code) + epilogue], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def heavy_modules(out: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in out.stdout.splitlines() if line.startswith("HEAVY=")]
    assert lines, out.stdout + out.stderr
    return eval(lines[-1][len("HEAVY="):])


def cli(args: list[str], tmp_path: Path) -> str:
    """`ftbench <args>` through the console script's main(), exit code caught, as Python code."""
    return f"""
        import sys
        from ftbench.cli import main
        sys.argv = ["ftbench", *{args!r}, "hydra.run.dir={tmp_path}/run"]
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code or 0
        print("EXIT", code)
    """


@pytest.mark.slow
def test_a_simulator_run_imports_neither_torch_nor_transformers(tmp_path):
    out = python(f"""
        from ftbench.cli import compose
        from ftbench.run import execute
        cfg = compose(["backend=sim", "strategy=checkpoint", "model=gpt3-medium", "train.iterations=20",
                       "report.progress=false", "report.gantt=false"])
        summary = execute(cfg, {str(tmp_path)!r}, echo=lambda *_: None)
        print("STATUS", summary["status"])
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "STATUS ok" in out.stdout
    assert heavy_modules(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_exit_0_without_torch(tmp_path, flag):
    out = python(cli([flag], tmp_path), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "EXIT 0" in out.stdout
    assert heavy_modules(out) == []
    if flag == "--version":
        assert out.stdout.splitlines()[0].startswith("ftbench ")
    else:
        text = out.stdout
        assert "pipeline-parallel" in text and "strategy:" in text and "backend.threads" in text
        assert "schema/" not in text and "is powered by Hydra" not in text
        assert "dist" in text and "(not yet)" not in text and "*checkpoint" in text


@pytest.mark.slow
def test_a_config_error_of_a_local_run_imports_no_torch(tmp_path):
    out = python(cli(["cluster.pp=0"], tmp_path), tmp_path)
    assert "EXIT 2" in out.stdout, out.stdout + out.stderr
    assert "cluster.pp" in out.stderr
    assert heavy_modules(out) == []


@pytest.mark.slow
def test_version_command_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "ftbench", "--version"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ftbench ") and "Hydra" not in out.stdout.split("(")[0]


@pytest.mark.slow
def test_the_console_output_lands_in_the_run_folders_log(tmp_path):
    out = python(cli(["backend=sim", "strategy=none", "failures=none", "model=gpt3-medium", "report.progress=false",
                      "report.gantt=false", "wandb.mode=disabled"], tmp_path), tmp_path)
    assert "EXIT 0" in out.stdout, out.stdout + out.stderr
    log = (tmp_path / "run" / "ftbench.log").read_text()
    assert "status" in log and "gpt3-medium" in log
    assert out.stdout.count("throughput") == 1  # printed once: the logger writes to the file only
    summary = tmp_path / "run" / "summary.json"
    assert stat.S_IMODE(summary.stat().st_mode) == 0o644
    assert json.loads(summary.read_text())["status"] == "ok"


def test_context_knows_the_data_kinds_of_models_data():
    from ftbench.context import DATA_KINDS
    from ftbench.models.data import KINDS

    assert tuple(DATA_KINDS) == tuple(KINDS)


# -------------------------------------------------------------------------------- threads

def _cgroup(tmp_path: Path, files: dict[str, str], proc: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc_file = tmp_path / "proc_self_cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def test_cgroup_v2_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000\n", "job/cpu.max": "250000 100000\n"}, "0::/job\n")
    assert threads.cgroup_cpu_quota(root, proc) == 2.5
    assert threads.usable_cpus(root, proc) == 2
    root, proc = _cgroup(tmp_path / "a", {"cpu.max": "50000 100000\n"})
    assert threads.usable_cpus(root, proc) == 1  # half a CPU still gets one thread
    root, proc = _cgroup(tmp_path / "b", {"cpu.max": "max 100000\n"})
    assert threads.cgroup_cpu_quota(root, proc) is None
    assert threads.usable_cpus(root, proc) == 8


def test_cgroup_v1_quota_and_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    root, proc = _cgroup(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n",
                                    "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/\n")
    assert threads.cgroup_cpu_quota(root, proc) == 4.0
    assert threads.usable_cpus(root, proc) == 3  # the affinity mask is the tighter limit
    root, proc = _cgroup(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
                         "3:cpu:/\n")
    assert threads.cgroup_cpu_quota(root, proc) is None


def test_pick_threads_uses_one_for_small_models_and_never_more_than_usable():
    tiny, big = SimpleNamespace(hidden=64), SimpleNamespace(hidden=4096)
    assert threads.pick_threads(tiny, 16) == 1
    assert threads.pick_threads(big, 4) == 4
    assert threads.pick_threads(big, 1) == 1
    assert 1 <= threads.pick_threads(SimpleNamespace(hidden=threads.MIN_HIDDEN_PER_THREAD), 64) <= 64


def test_backend_threads_overrides_and_omp_num_threads_caps(monkeypatch):
    big = SimpleNamespace(hidden=4096)
    assert threads.choose(3, big, usable=1) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose(None, big, usable=8) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose(None, big, usable=8) == threads.pick_threads(big, 8)
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ConfigError, match="backend.threads"):
            threads.choose(bad, big)


def test_apply_sets_torch_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert threads.apply(1) == 1 == torch.get_num_threads()
        assert threads.apply(2) == 2
    finally:
        torch.set_num_threads(before)
