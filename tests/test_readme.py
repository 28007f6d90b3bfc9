"""Every `ftbench` command in the README runs as written and does what its comment says. The
fast ones (simulator runs, --help, --version) run here; local runs are covered by the tests
of the local backend with smaller iteration counts."""
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        block = block.replace("\\\n", " ")
        commands += [line.strip() for line in block.splitlines() if line.strip().startswith("ftbench ")]
    return commands


def _fast(command: str) -> bool:
    args = shlex.split(command.split("#")[0], comments=False)
    return ("backend=sim" in args or any(a.startswith("experiment=") for a in args)) \
        and not any(a.startswith("hydra/launcher=") for a in args)


def test_the_readme_has_its_examples():
    commands = _commands()
    assert len(commands) >= 15 and sum(map(_fast, commands)) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in _commands() if _fast(c)])
def test_readme_command_runs_as_written(tmp_path, command):
    code, _, comment = command.partition("  #")
    args = shlex.split(code)[1:]
    expected = 3 if "exit code 3" in comment else 0
    out = subprocess.run([sys.executable, "-m", "ftbench", *args, "report.progress=false", "wandb.mode=disabled",
                          f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == expected, out.stderr[-3000:]
    summaries = list(tmp_path.rglob("summary.json"))
    assert summaries, "no run folder was written"
    said = re.search(r"(\d+) failures", comment)  # a comment that gives the count is held to it
    if said:
        import json

        assert json.loads(summaries[0].read_text())["failures"] == int(said.group(1))


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version(flag):
    out = subprocess.run([sys.executable, "-m", "ftbench", flag], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ftbench" in out.stdout
