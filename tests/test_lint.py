"""The code stays ruff clean (the rules and exclusions are in pyproject.toml's [tool.ruff];
ruff comes with the test extra). The dist backend's files are checked too: in ftbench/dist/,
its old folder, ruff's default exclusions skipped them for the name."""
import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_code_is_ruff_clean():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dist_backend_is_among_the_checked_files():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "ftbench/distributed/engine.py" in out.stdout, out.stdout[-2000:]
