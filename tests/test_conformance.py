"""Backends agree: the same failure script gives the same events, recovery actions, restored
iterations, lost work and plans (name and shape of every iteration) on `sim` and on `local`.

`local` runs on the modelled clock here (`backend.clock=model`), so time-based events strike
at the same simulated instant as on `sim`; everything else (failure points, membership,
checkpoints, the strategy's decisions) is the shared run loop's, whichever clock runs.
"""
import pytest

from conftest import run
from ftbench.metrics import read_metrics
from ftbench.strategies import REGISTRY

# Every registered strategy, with the settings and CI's scripts its registration gives
# (StrategyTests: conformance, conformance_scripts).
STRATEGIES = list(REGISTRY)

# gpt-tiny, pp=2 x dp=3, one GPU per node: node = pipeline * 2 + stage.
SETUP = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=3", "train.iterations=8", "train.microbatches=2",
         "cluster.replacement_s=0.2", "report.gantt=false", "report.check_fault_free=false")
EVERY = {name: cls.tests.conformance for name, cls in REGISTRY.items()}


def _events(*events) -> str:
    body = ",".join("{" + ",".join(f"{k}:{v}" for k, v in e.items()) + "}" for e in events)
    return f"failures.events=[{body}]"


def _scripts(T: float, first_recovery: tuple[float, float]) -> dict:
    """The scripts; T is one fault-free iteration's simulated time, `first_recovery` the
    (time, duration) of the recovery from the first failure of "one failure"."""
    t_fail, recovery_s = first_recovery
    return {
        "one failure": ((), [dict(iteration=3, node=3)]),
        # at 0.97 of iteration 3, during the optimizer steps: some stages have stepped (their
        # survivors undo it on local), the same events and lost work as on sim
        "after the optimizer steps": ((), [dict(iteration=3, node=3, at=0.97)]),
        "two in one iteration": ((), [dict(iteration=3, node=1), dict(iteration=3, node=4)]),
        "two in one stage": ((), [dict(iteration=2, node=1), dict(iteration=5, node=3)]),
        "failure then join": ((), [dict(iteration=2, node=3), dict(iteration=5, node=3, kind="join")]),
        "time-based failure": ((), [dict(time_s=4.37 * T, node=2)]),
        "standby used up": (("cluster.spares=1",), [dict(iteration=2, node=0), dict(iteration=4, node=5)]),
        "reshape and grow back": ((), [dict(iteration=2, node=4), dict(iteration=2, node=5),
                                       dict(iteration=4, node=4, kind="join"), dict(iteration=4, node=5, kind="join")]),
        # a join, then a member's failure, while the first recovery runs: merged into it
        "changes during recovery": ((), [dict(iteration=3, node=3),
                                         dict(time_s=t_fail + 0.3 * max(recovery_s, 1e-9), node=3, kind="join"),
                                         dict(time_s=t_fail + 0.5 * max(recovery_s, 1e-9), node=0)]),
        "already down, idle and new nodes": (("cluster.nodes=7",), [
            dict(iteration=1, node=6), dict(iteration=2, node=1), dict(iteration=3, node=1),
            dict(iteration=5, node=9, kind="join")]),
    }


def _trace(run_dir, summary) -> dict:
    events = [(r["event"], r.get("node"), r.get("iteration"), r.get("ignored"))
              for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] in ("fail", "join", "unrecoverable")]
    recoveries = [(r["iteration"], tuple(r["actions"]), r["restored_iteration"], r["lost_iterations"], r["plan"],
                   r["shape"], tuple((m["event"], m["node"], m["restarts"]) for m in r.get("merged", ())))
                  for r in summary["recoveries"]]
    return {"status": summary["status"], "iterations": summary["iterations"], "failures": summary["failures"],
            "events": events, "recoveries": recoveries, "plans": summary["plan_segments"]}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    base = tmp_path_factory.mktemp("calibrate")
    free = run(base / "free", "backend=sim", "strategy=none", "failures=none", *SETUP)
    one = run(base / "one", "backend=sim", "strategy=checkpoint", "strategy.every=2", "failures=scripted",
              _events(dict(iteration=3, node=3)), *SETUP)
    r = one["recoveries"][0]
    T = free["iteration_time_s"]
    return _scripts(T, (r["time_s"], r["recovery_s"])) | {"T": T}


def _own_first_recovery(tmp_path, overrides) -> tuple[float, float]:
    """(time, duration) of the strategy's own recovery from "one failure": the changes that
    must fall inside it are timed from it (a restart takes a minute, a rendezvous seconds)."""
    one = run(tmp_path, "backend=sim", *overrides, _events(dict(iteration=3, node=3)))
    r = one["recoveries"][0]
    return r["time_s"], r["recovery_s"]


# CI runs every strategy under "one failure" (the default tier) and under two or three more
# scripts (the extended tier: tests/conftest.py), and every script with at least two strategies
# (those whose recovery it exercises most: undo after the optimizer steps for the in-place ones,
# grow-back for the reshaping ones, a merged recovery for a restart, a re-instantiation and a
# failover), as each registration names them; `-m full` runs the other cases.
DEFAULT_TIER = {name: cls.tests.conformance_scripts for name, cls in REGISTRY.items()}
CASES = [pytest.param(strategy, script, id=f"{strategy}-{script}",
                      marks=() if script in DEFAULT_TIER[strategy] else pytest.mark.full)
         for strategy in STRATEGIES for script in _scripts(1.0, (1.0, 1.0))]


@pytest.mark.parametrize("strategy,script", CASES)
def test_sim_and_local_agree(tmp_path, scripts, strategy, script):
    setup, events = scripts[script]
    common = (f"strategy={strategy}", *EVERY.get(strategy, ()), *SETUP, *setup, "failures=scripted")
    if script == "changes during recovery" and strategy != "none":
        setup, events = _scripts(scripts["T"], _own_first_recovery(tmp_path / "first", common))[script]
    overrides = (*common, _events(*events))
    sim = run(tmp_path / "sim", "backend=sim", *overrides)
    local = run(tmp_path / "local", "backend=local", "backend.clock=model", *overrides)
    assert sim["status"] != "error", sim["error"]
    assert _trace(tmp_path / "local", local) == _trace(tmp_path / "sim", sim)
    # the same iterations count, at the same modelled times: the same ETTR
    assert local["productive_s"] == pytest.approx(sim["productive_s"], rel=1e-9)
    assert local["ettr"] == pytest.approx(sim["ettr"], abs=2e-6)
    if strategy != "none" and script != "two in one stage":
        assert sim["failures"] >= 1 and sim["status"] == "ok", sim["error"]
    if strategy != "none" and script == "changes during recovery":  # both changes were merged into it
        assert [(m["event"], m["restarts"]) for m in sim["recoveries"][0]["merged"]] == [("join", False),
                                                                                       ("fail", True)]


def test_every_registration_names_scripts_that_exist():
    """A script a registration names for CI must be one of the scripts (a typo would leave
    the strategy out of CI without a word)."""
    names = set(_scripts(1.0, (1.0, 1.0)))
    for strategy, scripts in DEFAULT_TIER.items():
        assert scripts and set(scripts) <= names, (strategy, sorted(set(scripts) - names))
