"""The README and docs/ as a newcomer reads them: every shell command in a ```bash block runs
and does what its comment says, or is listed in SKIPPED with the reason; every relative link
and anchor resolves; nothing points outside the repository; the README stays a front page.

`local` and `dist` commands run as written with `train.iterations` capped just past their last
scripted event (the start-up and the events are what the page shows; 20 iterations of
gpt-tiny would only cost CI minutes), and must end `ok` and, on `local`, equal fault-free
training."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250

# Commands that do not run here, each with why (matched against the command's text).
SKIPPED = [
    (r"^pip install ", "the quick start's install: .ci/run runs exactly it on a clean checkout"),
    (r"^python -m pytest", "the test suite itself"),
    (r"^torchrun |backend\.launcher=torchrun", "several nodes (tests/test_dist_torchrun.py runs two torchrun "
                                              "agents and a coordinator on loopback)"),
    (r"^srun |^#SBATCH|^head=|^run=|^args=|^wait$", "a SLURM batch script"),
    (r"hydra/launcher=submitit_slurm", "a SLURM cluster (tests/test_sweep_launchers.py submits this sweep to a "
                                       "stand-in sbatch)"),
    (r"^ftbench --multirun \+experiment=(recycle|oobleck)-table",
     "a paper table: 2.5-4 min (docs/reproducing.md); its one-cell form runs here and "
     "tests/test_tables.py runs a reduced sweep"),
    (r"^ftbench --multirun \+experiment=today-16k",
     "today's strategies at 16,384 GPUs: 45 jobs, 5-8 min (docs/today.md); tests/test_today_table.py runs a "
     "cell on a smaller grid and holds the sweep to the registry"),
    (r"^(CUDA_VISIBLE_DEVICES=\S* )?python benchmarks/", "a benchmark (seconds to an hour, docs/benchmarks.md); "
                             "tests/test_benchmarks_help.py runs every --help"),
    (r"^python -m ftbench\.sensitivity", "needs the folders of several table sweeps (minutes each); "
                                         "tests/test_sensitivity.py runs it on small ones"),
    (r"backend=dist .*strategy=(checkpoint|recycle|jit-checkpoint|in-process-restart|gemini) |"
     r"strategy=swift backend=dist",
     "a dist run with a failure: 30-55 s each on 2 cores; the same strategy and failure on dist "
     "run in tests/test_dist_failures.py (checkpoint onto a standby, recycle re-routing, the "
     "survivors' just-in-time save, the in-process restart onto a reserve worker, Gemini's reload "
     "from host memory after the restart) and tests/test_dist_swift.py (a lost stage replayed "
     "from the logs)"),
    (r"^cd runs/|^wandb sync |^find runs/.*offline-run|^while read",
     "wandb sync needs the network; tests/test_metrics.py copies an offline run folder elsewhere "
     "and finds its metrics, config, console, tables, images and artifacts in the .wandb file"),
    (r"^python -m ftbench\.tables ", "needs a table sweep's folder; tests/test_tables.py runs it"),
    (r"strategy=peer-memory", "a strategy from another package (docs/extending.md): tests/test_extending.py "
                              "builds the package from the page and runs it through conformance and the random scripts"),
    (r"^python -m ftbench\.report .*--publish", "saves a report in W&B: needs a login and the network; "
                                                 "tests/test_wandb_report.py builds the report and checks its panels"),
    (r"^ftbench calibrate|^(CUDA_VISIBLE_DEVICES=\S* )?python -m ftbench\.measure", "measures this machine for over a minute and writes "
                                                        "conf/hardware/; tests/test_measure.py runs it with --quick"),
]


def shell_commands() -> list[tuple[str, str]]:
    """(page, command line) for every line of every ```bash block, continuation lines joined."""
    found = []
    for page in PAGES:
        for body in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not (line.startswith("# ") or line == "#"):
                    found.append((str(page.relative_to(ROOT)), line))
    return found


def skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, command)), None)


def kind(command: str) -> str:
    """How a command is exercised here: sim, local, dist, report, or skipped."""
    if skip_reason(command):
        return "skipped"
    args = shlex.split(command.split("  #")[0])
    if args[:3] == ["python", "-m", "ftbench.report"]:
        return "report"
    if args[0] != "ftbench":
        return "unknown"
    if "backend=dist" in args:
        return "dist"
    if "backend=sim" in args or any(a.lstrip("+").startswith("experiment=") for a in args):
        return "sim"
    return "local"


def unique(which: str) -> list[str]:
    """The distinct commands of a kind; one shown on two pages runs once (with its comment)."""
    by_code: dict[str, str] = {}
    for _, command in shell_commands():
        if kind(command) == which:
            code = command.split("  #")[0].strip()
            by_code[code] = max(by_code.get(code, ""), command, key=len)
    return sorted(by_code.values())


def test_every_command_runs_here_or_says_why_not():
    commands = shell_commands()
    unknown = [f"{page}: {c}" for page, c in commands if kind(c) == "unknown"]
    assert not unknown, "commands neither run by this test nor listed in SKIPPED:\n" + "\n".join(unknown)
    assert len(unique("sim")) >= 15 and unique("local") and unique("dist") and unique("report")


def _ftbench(tmp_path, command: str, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    code, _, comment = command.partition("  #")
    args = shlex.split(code)[1:]
    out = subprocess.run([sys.executable, "-m", "ftbench", *args, *extra, "report.progress=false",
                          "wandb.mode=disabled", f"hydra.run.dir={tmp_path}/run",
                          f"hydra.sweep.dir={tmp_path}/sweep"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return out, comment


def _summaries(tmp_path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("summary.json"))]


def _holds_comment(comment: str, summary: dict, tmp_path: Path) -> None:
    """A comment that gives the failure count, or the iteration a failure strikes, is held to it."""
    said = re.search(r"(\d+) failures", comment)
    if said:
        assert summary["failures"] == int(said.group(1)), comment
    said = re.search(r"\(iteration (\d+)\)", comment)
    if said:
        lines = [json.loads(line) for p in tmp_path.rglob("metrics.jsonl") for line in p.read_text().splitlines()]
        assert [e["iteration"] for e in lines if e["event"] == "fail"][:1] == [int(said.group(1))], comment


def on_the_front_page(command: str) -> bool:
    """Whether the README shows `command` (the same code, whatever its comment)."""
    code = command.split("  #")[0].strip()
    return any(c.split("  #")[0].strip() == code for page, c in shell_commands() if page == "README.md")


def tiered(commands: list[str]) -> list:
    """The README's commands in the default tier, the other pages' in `full`: the front page is
    what a newcomer runs first, and what the other pages' commands do is each checked in the
    tests of their strategy, backend or feature too (the `full` tier runs every page's)."""
    return [c if on_the_front_page(c) else pytest.param(c, marks=pytest.mark.full) for c in commands]


@pytest.mark.slow
@pytest.mark.parametrize("command", tiered(unique("sim")))
def test_sim_command_runs_as_written(tmp_path, command):
    out, comment = _ftbench(tmp_path, command)
    assert out.returncode == (3 if "exit code 3" in comment else 0), out.stderr[-3000:]
    summaries = _summaries(tmp_path)
    assert summaries, "no run folder was written"
    _holds_comment(comment, summaries[0], tmp_path)


def _capped(command: str) -> list[str]:
    """`train.iterations` just past the last scripted event, unless the command sets it."""
    if "train.iterations=" in command:
        return []
    scripted = [int(i) for i in re.findall(r"iteration:(\d+)", command)]
    if "failures.events" not in command:
        scripted = [5]  # the default job's failure (iteration 5), or none
    if "time_s:" in command:
        return []  # when a timed failure strikes is what the command shows
    return [f"train.iterations={max(scripted) + 2}"]


def _check_local(tmp_path: Path, command: str) -> str | None:
    """What is wrong with a local command's run, or None."""
    tmp_path.mkdir()
    out, comment = _ftbench(tmp_path, command, *_capped(command))
    if out.returncode != 0:
        return out.stderr[-2000:]
    summary = _summaries(tmp_path)[0]
    if summary["status"] != "ok" or summary["matches_fault_free"] is False:
        return f"status {summary['status']}, matches_fault_free {summary['matches_fault_free']}: {summary.get('error')}"
    if "failures.events" in command and summary["failures"] != command.count("node:"):
        return f"{summary['failures']} failures struck of {command.count('node:')} scripted"
    try:
        _holds_comment(comment, summary, tmp_path)
    except AssertionError as err:
        return f"the comment does not hold: {err}"
    return None


def local_commands(tier: str) -> list[str]:
    """The local commands of a tier (as `tiered`): the README's in the default one, the other
    pages' in `full` (each strategy's local training is checked in its own tests too)."""
    return [c for c in unique("local") if on_the_front_page(c) == (tier == "default")]


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["default", pytest.param("full", marks=pytest.mark.full)])
def test_local_commands_train_the_fault_free_model(tmp_path, tier):
    """Each local command ends ok, its scripted failures struck, equal to fault-free training.
    Two at a time: each uses one torch thread (gpt-tiny), and this is the longest docs test
    (all of them: 166 s on 2 cores; the `full` tier runs the pages other than the README)."""
    from concurrent.futures import ThreadPoolExecutor

    commands = local_commands(tier)
    assert commands
    with ThreadPoolExecutor(2) as pool:
        problems = list(pool.map(lambda i: _check_local(tmp_path / str(i), commands[i]), range(len(commands))))
    failed = [f"{c}\n  {why}" for c, why in zip(commands, problems) if why]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("command", unique("dist"))
def test_dist_command_runs(tmp_path, command):
    out, comment = _ftbench(tmp_path, command, *_capped(command), "backend.timeout_s=30")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = _summaries(tmp_path)[0]
    assert summary["status"] == "ok", summary.get("error")
    if "failures.events" in command:
        assert summary["failures"] == command.count("node:")


@pytest.mark.slow
def test_report_commands_on_a_sweep(tmp_path):
    """The pages' `python -m ftbench.report <sweep>` commands, on a small sweep of their own."""
    sweep = tmp_path / "sweep"
    made = subprocess.run([sys.executable, "-m", "ftbench", "--multirun", "backend=sim", "strategy=none",
                           "model=gpt3-medium", "schedule=1f1b,zb-h1", "train.iterations=20", "wandb.mode=disabled",
                           "report.progress=false", f"hydra.sweep.dir={sweep}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    for command in unique("report"):
        args = shlex.split(command.split("  #")[0].replace("runs/multirun/<date>/<time>-<id>", str(sweep)))
        out = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, f"{command}\n{out.stderr[-2000:]}"
        assert "none" in (out.stdout + ((tmp_path / "t.csv").read_text() if "--out t.csv" in command else "")), command


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or ROOT.resolve() not in dest.parents and dest != ROOT.resolve():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and dest.is_file() and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# A file of the repository named in a page (`ftbench/loop.py`), and a dotted name of the package
# (`ftbench.engine.state.newest_commits`); ftbench.log is a run folder's log, not a module.
CITED_PATH = re.compile(r"`((?:ftbench|strategies|models|benchmarks|tests|conf|hydra_plugins)/[\w/.\-]*\w)`")
CITED_NAME = re.compile(r"`(ftbench(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_every_file_and_name_a_page_cites_exists():
    """The pages describe the code as it is: a module moved or renamed leaves no page behind."""
    stale = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        stale += [f"{page.relative_to(ROOT)}: {p}" for p in CITED_PATH.findall(text) if not (ROOT / p).exists()]
        stale += [f"{page.relative_to(ROOT)}: {n}" for n in CITED_NAME.findall(text)
                  if n != "ftbench.log" and not _resolves(n)]
    assert not stale, "\n".join(sorted(set(stale)))


def test_pages_point_at_nothing_outside_the_repository():
    outside = [str(p.relative_to(ROOT)) for p in PAGES if "../shared" in p.read_text(encoding="utf-8")]
    assert not outside


def test_every_code_block_says_its_language():
    """A block without one is either a command the tests would miss or output read as one."""
    unlabelled = []
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                if not inside and line.strip() == "```":
                    unlabelled.append(f"{page.relative_to(ROOT)}:{number}")
                inside = not inside
    assert not unlabelled, "fences with no language: " + ", ".join(unlabelled)


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES


def test_every_registered_strategy_has_its_page_its_yaml_and_its_table_rows():
    """From the registry: a page under docs/strategies/, a conf/strategy/ YAML file on its own
    schema, a row in the README's strategy table and in docs/strategies/README.md's."""
    import re

    from ftbench.strategies import REGISTRY

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "strategies" / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| strategy | on a failure | page |"):].split("\n\n")[0]
    readme_rows = set(re.findall(r"^\| `([\w-]+)` \|", table, re.M))
    index_rows = set(re.findall(r"^\| \[`([\w-]+)`\]\([\w-]+\.md\) \|", index, re.M))
    assert readme_rows == set(REGISTRY), "README.md's strategy table"
    assert index_rows == set(REGISTRY) - {"none"}, "docs/strategies/README.md's table"
    running = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    setting = next(line for line in running.splitlines() if line.startswith("| `strategy` |"))
    assert set(re.findall(r"`([\w-]+)`", setting.split("(the registry")[0])) - {"strategy"} == set(REGISTRY), \
        "docs/running.md's strategy setting"
    for name in REGISTRY:
        yaml = (ROOT / "conf" / "strategy" / f"{name}.yaml").read_text(encoding="utf-8")
        assert f"/schema/strategy/{name}@_here_" in yaml and f"name: {name}" in yaml, name
        if name != "none":
            assert (ROOT / "docs" / "strategies" / f"{name}.md").exists(), name


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version(flag):
    out = subprocess.run([sys.executable, "-m", "ftbench", flag], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ftbench" in out.stdout


def test_ci_runs_the_readmes_test_command():
    """.ci/run is the quick start's second command, step by step, then the README's second CI
    step (the extended tier): what a newcomer runs is what CI runs, and the README says all CI runs."""
    readme = next(c for _, c in shell_commands() if "pytest" in c and c.startswith("pip install"))
    extended = [c for page, c in shell_commands() if page == "README.md" and "-m extended" in c]
    assert extended == ["python -m pytest -q -m extended"], extended
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [line for line in script if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert " && ".join(steps) == f"{readme} && {extended[0]}"
