import math
import os
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"  # no network here; tests never talk to W&B
# Tests build tiny models, in this process and in CLI subprocesses: one intra-op thread each
# (set before torch is imported; ftbench.threads caps its automatic choice at it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[1]


# The quick tier (python -m pytest -m quick, about 2 minutes on 2 cores, for development): these
# files, which train no model for long and launch no dist job (schedules, plans, the simulator
# with every strategy, planners, checkpoint store, undo, configs, report), and the tests
# marked `quick` elsewhere (Swift's simulator tests). Their `slow`, `dist`, `full` and `chaos`
# tests stay out of it.
QUICK_FILES = {
    "test_actions.py", "test_checkpoint_sim.py", "test_checkpoint_store.py", "test_checkpoint_tiers.py", "test_config.py",
    "test_costs_measured.py", "test_dist_settings.py", "test_failures.py", "test_gpt_model.py", "test_layering.py",
    "test_layers.py", "test_lint.py", "test_merged_recoveries.py", "test_oobleck_nodes.py", "test_op_times.py",
    "test_recompute.py", "test_recycle_memory.py", "test_report.py", "test_run_folder.py", "test_schedule.py",
    "test_scorecard.py", "test_sim_grid_timer.py", "test_sim_parts.py", "test_sim_runs.py", "test_swift_logging.py",
    "test_transport.py", "test_undo.py",
}
OTHER_TIERS = ("slow", "dist", "full", "chaos")


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in QUICK_FILES and not any(item.get_closest_marker(m) for m in OTHER_TIERS):
            item.add_marker(pytest.mark.quick)


def compose(*overrides: str):
    """The config the CLI would build for these overrides (no run folder, no Hydra job)."""
    from ftbench.cli import compose as cli_compose

    return cli_compose(overrides)


def run(tmp_path, *overrides: str) -> dict:
    """Execute a run into tmp_path (as the CLI would) and return its summary."""
    from ftbench.run import execute

    cfg = compose("report.progress=false", *overrides)
    return execute(cfg, tmp_path, echo=lambda *_: None)


@pytest.fixture
def run_config(tmp_path):
    return lambda *overrides: run(tmp_path, *overrides)


# Small local runs: gpt-tiny, pp=4 x dp=2, 4 micro-batches of 1 sample per pipeline.
LOCAL = ("backend=local", "model=gpt-tiny", "train.iterations=10", "train.microbatches=4",
         "report.check_fault_free=false", "report.gantt=false", "cluster.replacement_s=0")


_FAULT_FREE: dict[tuple[str, ...], tuple[list[float], dict]] = {}  # overrides -> (losses, final weights)


def fault_free(tmp_path, *overrides: str) -> tuple[list[float], dict]:
    """(losses, final weights) of fault-free training of `overrides` (strategy=none,
    failures=none), trained once per test session: several tests judge strategies and
    failures against the same setup, and fault-free training depends on its config alone."""
    from ftbench.equivalence import load_state

    key = (*overrides, "strategy=none", "failures=none")
    if key not in _FAULT_FREE:
        reference = run(tmp_path / "fault-free", *key)
        assert reference["status"] == "ok", reference["error"]
        _FAULT_FREE[key] = (reference["losses"], load_state(reference["final_state"]))
    return _FAULT_FREE[key]


_REFERENCES: dict = {}  # the session's references of the runs' own check (ftbench.fault_free._REFERENCES)


@pytest.fixture(autouse=True)
def fault_free_references(request):
    """A run's own check (report.check_fault_free) trains its setup's fault-free reference
    once per session (ftbench.fault_free keeps references when asked), except in a test that
    monkeypatches: what it patches may be what the reference runs, so it trains its own and
    keeps none."""
    if "monkeypatch" in request.fixturenames:
        yield
        return
    from ftbench import fault_free

    fault_free._REFERENCES = _REFERENCES
    try:
        yield
    finally:
        fault_free._REFERENCES = None


def assert_matches_fault_free(tmp_path, setup=(), faults=()) -> dict:
    """The equivalence check: run `setup` under `faults` (strategy and failure overrides), then
    the same setup fault-free (strategy=none, failures=none; once per session, `fault_free`);
    per-iteration losses must agree to rtol 1e-5 and the saved final weights to
    `torch.testing.assert_close`'s tolerance. Returns the faulty run's summary."""
    from ftbench.equivalence import compare, load_state

    faulty = run(tmp_path / "faulty", *LOCAL, *setup, *faults)
    assert faulty["status"] == "ok", faulty["error"]
    difference = compare(faulty["losses"], load_state(faulty["final_state"]), *fault_free(tmp_path, *LOCAL, *setup))
    assert difference is None, difference
    return faulty


def seeded_failures(tag: str, nodes: int, count: int, draw_at: bool = False) -> str:
    """`failures.events=[...]`: `count` failures of distinct nodes below `nodes`, at distinct
    iterations 1..8 in order, drawn from the seed string `tag` (not picked by hand). With
    `draw_at`, each also strikes at a point `at` of its iteration drawn uniformly from [0, 1)
    (to 4 decimals, rounded down), after the other draws: the nodes and iterations are those
    of the same tag without it."""
    import random

    rng = random.Random(tag)
    failed = rng.sample(range(nodes), count)
    iterations = sorted(rng.sample(range(1, 9), count))
    points = [f",at:{math.floor(rng.random() * 1e4) / 1e4}" for _ in range(count)] if draw_at else [""] * count
    return "failures.events=[" + ",".join(f"{{iteration:{i},node:{n}{at}}}"
                                          for i, n, at in zip(iterations, failed, points)) + "]"


@pytest.fixture
def dist_store():
    """A torch.distributed TCPStore on a free local port (under a prefix), as a job's store."""
    from datetime import timedelta

    import torch.distributed as dist

    from ftbench.distributed.launch import free_port

    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    yield dist.PrefixStore("test/", server)


@pytest.fixture
def spawned_ranks(monkeypatch):
    """A dist job launched from this long-lived test process starts its ranks by spawn (as on
    GPUs), not fork: a rank forked from it after other launches has, rarely, hung before
    joining its first group (not explained yet; see docs/distributed.md). The CLI's runs fork
    from a fresh process, as users' do."""
    from ftbench.distributed import worker

    monkeypatch.setattr(worker, "start_method", lambda: "spawn")


def strategy_package(folder: Path) -> tuple[str, str]:
    """docs/extending.md's example strategy module and entry point as an installed package on
    `folder` (a dist-info folder is what an install leaves for importlib.metadata): put
    `folder` on PYTHONPATH and it is `strategy=<name>`. Returns (name, the module's code)."""
    import re

    page = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    name, target = re.search(r'\[project\.entry-points\."ftbench\.strategies"\]\n([\w-]+) = "([\w.:]+)"', page).groups()
    module = target.split(":")[0]
    (folder / module).mkdir(parents=True)
    (folder / module / "__init__.py").write_text(code, encoding="utf-8")
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[ftbench.strategies]\n{name} = {target}\n", encoding="utf-8")
    return name, code
