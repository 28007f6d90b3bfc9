"""Your own strategy from your own package (docs/extending.md): the page's example module,
built into a package in a temporary folder with its entry point, is `strategy=peer-memory`
and goes through conformance and the seeded random failure scripts with no edit here."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import strategy_package

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_strategy_from_another_package_runs_through_conformance_and_the_random_scripts(tmp_path):
    name, code = strategy_package(tmp_path / "site")
    scripts = re.findall(r'"([^"]+)"', re.search(r"conformance_scripts=\(([^)]*)\)", code).group(1))
    env = {**os.environ, "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    selected = " and ".join(name.split("-"))  # -k reads a hyphen as an operator
    # what CI checks (the default and extended tiers): the registration's conformance scripts
    # beyond "one failure" are in the extended tier
    ci = "not chaos and not full"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", ci, "-k", selected,
                          "tests/test_conformance.py", "tests/test_random_failures.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # its registration's conformance scripts, one local random script against fault-free training,
    # and the random scripts on sim
    assert f"{len(scripts) + 2} passed" in out.stdout, out.stdout[-2000:]
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             "-m", ci, "-k", selected, "tests/test_conformance.py", "tests/test_random_failures.py"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert all(f"[{name}-{script}]" in listed.stdout for script in scripts), listed.stdout[-2000:]
