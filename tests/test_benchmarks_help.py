"""Every benchmark answers --help quickly and says how long it typically runs (issue 28)."""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import ROOT

BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def _help(path):
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    return path.name, out


def test_every_benchmark_help_gives_its_typical_duration():
    assert len(BENCHMARKS) >= 15
    with ThreadPoolExecutor(8) as pool:  # subprocesses: threads only wait on them
        results = list(pool.map(_help, BENCHMARKS))
    for name, out in results:
        assert out.returncode == 0, f"{name}: {out.stderr[-2000:]}"
        assert re.search(r"Typical duration: [^\n]*\d", out.stdout), f"{name}: {out.stdout[-1000:]}"


def test_a_benchmark_writes_only_under_runs(tmp_path):
    """Run from any folder, a benchmark's default output lands under ./runs/, nowhere else."""
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "swift_logging.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["runs/swift_logging.png"], written
