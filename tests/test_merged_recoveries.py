"""Membership changes that arrive while a recovery runs are merged into it (issue 38 item 5;
ftbench/loop.py, RunLoop._merge), as the Oobleck artifact's simulators handle a change during
a rendezvous: a join (or the failure of a node outside the plan) is taken in without moving
the recovery's end; a member that fails starts the recovery again from that moment. On `sim`
here; tests/test_conformance.py runs the same on `local` and tests/test_dist_failures.py on
`dist`."""
import pytest

from conftest import run

# GPT-3 Medium on 8 single-GPU A100 nodes: Varuna restarts in pp=3 dp=2 on 7 or 6 nodes, each
# restart 60 s plus a 1.0 s reload (docs/strategies/varuna.md), far longer than an iteration.
VARUNA = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "strategy=varuna", "strategy.every=10",
          "train.iterations=50", "report.gantt=false", "report.check_fault_free=false", "failures=scripted")
FIRST = "{iteration:25,node:5}"


def _varuna(tmp_path, *later: str) -> dict:
    summary = run(tmp_path, *VARUNA, f"failures.events=[{','.join((FIRST, *later))}]")
    assert summary["status"] == "ok", summary.get("error")
    return summary


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """The first failure's recovery with nothing arriving during it."""
    (recovery,) = _varuna(tmp_path_factory.mktemp("alone"))["recoveries"]
    assert recovery["recovery_s"] > 60
    return recovery


def test_a_member_failing_during_a_restart_starts_it_again_from_that_moment(tmp_path, alone):
    t_change = alone["time_s"] + 0.4 * alone["recovery_s"]
    summary = _varuna(tmp_path, f"{{time_s:{t_change},node:0}}")
    (group,) = summary["recoveries"]  # one recovery, not two one after another
    assert summary["failures"] == 2
    assert group["merged"] == [{"event": "fail", "node": 0, "time_s": t_change, "restarts": True}]
    end = group["time_s"] + group["recovery_s"]
    assert end == pytest.approx(t_change + alone["recovery_s"])  # 6 nodes restart in the same shape as 7
    assert end < alone["time_s"] + 2 * alone["recovery_s"]  # earlier than the second restart queued after it
    assert group["actions"] == ["RestartJob", "RestoreCheckpoint"] * 2
    assert group["restored_iteration"] == alone["restored_iteration"]
    assert group["lost_iterations"] == alone["lost_iterations"]


def test_a_join_during_a_restart_leaves_its_end_where_it_was(tmp_path, alone):
    t_change = alone["time_s"] + 0.5 * alone["recovery_s"]
    summary = _varuna(tmp_path, f"{{time_s:{t_change},node:5,kind:join}}")
    (group,) = summary["recoveries"]
    assert group["merged"] == [{"event": "join", "node": 5, "time_s": t_change, "restarts": False}]
    assert group["recovery_s"] == pytest.approx(alone["recovery_s"])
    assert group["shape"] == "pp=4 dp=2"  # the job restarts in the shape of the 8 nodes it now has
    assert "SaveCheckpoint" not in group["actions"]  # nothing trained since the restore: no morph save


def test_changes_after_the_recovery_are_recovered_on_their_own(tmp_path, alone):
    t_after = alone["time_s"] + alone["recovery_s"] + 1e-6
    summary = _varuna(tmp_path, f"{{time_s:{t_after},node:0}}")
    first, second = summary["recoveries"]
    assert "merged" not in first and first["recovery_s"] == pytest.approx(alone["recovery_s"])
    assert second["time_s"] >= t_after


def test_several_changes_during_one_restart_make_one_recovery(tmp_path, alone):
    t0, s = alone["time_s"], alone["recovery_s"]
    summary = _varuna(tmp_path, f"{{time_s:{t0 + 0.2 * s},node:0}}", f"{{time_s:{t0 + 0.5 * s},node:5,kind:join}}",
                      f"{{time_s:{t0 + 0.9 * s},node:7}}")
    (group,) = summary["recoveries"]
    assert [(m["event"], m["node"], m["restarts"]) for m in group["merged"]] == [
        ("fail", 0, True), ("join", 5, False), ("fail", 7, True)]
    # the last member's failure restarts it: the end is one restart after it, on 6 nodes
    assert group["time_s"] + group["recovery_s"] == pytest.approx(t0 + 0.9 * s + s)
    assert summary["failures"] == 3


def test_an_idle_node_failing_during_a_restart_moves_nothing(tmp_path):
    """With 10 nodes, 9 live after the first failure: pp=4 dp=2 takes 8 of them, and the failure
    of the one it leaves idle is no member's."""
    (ten,) = run(tmp_path / "alone", *VARUNA, "cluster.nodes=10", f"failures.events=[{FIRST}]")["recoveries"]
    t_change = ten["time_s"] + 0.5 * ten["recovery_s"]
    summary = run(tmp_path / "merged", *VARUNA, "cluster.nodes=10",
                  f"failures.events=[{FIRST},{{time_s:{t_change},node:9}}]")
    (group,) = summary["recoveries"]
    assert group["merged"] == [{"event": "fail", "node": 9, "time_s": t_change, "restarts": False}]
    assert group["shape"] == ten["shape"] == "pp=4 dp=2"
    assert group["recovery_s"] == pytest.approx(ten["recovery_s"])
    assert summary["failures"] == 2


@pytest.mark.parametrize("strategy, extra", [("recycle", ("strategy.plan_cache=null",)), ("oobleck", ())])
def test_a_member_failing_during_a_rendezvous_starts_it_again(tmp_path, strategy, extra):
    """In-place reconfigurations agree on membership too (Rendezvous): the same rule."""
    base = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", f"strategy={strategy}", *extra,
            "cluster.pp=4", "cluster.dp=3", "train.iterations=30", "report.gantt=false",
            "report.check_fault_free=false", "failures=scripted")
    (alone,) = run(tmp_path / "alone", *base, "failures.events=[{iteration:10,node:5}]")["recoveries"]
    t_change = alone["time_s"] + 0.5 * alone["recovery_s"]
    summary = run(tmp_path / "merged", *base, f"failures.events=[{{iteration:10,node:5}},{{time_s:{t_change},node:2}}]")
    (group,) = summary["recoveries"]
    assert group["merged"] == [{"event": "fail", "node": 2, "time_s": t_change, "restarts": True}]
    assert group["time_s"] + group["recovery_s"] > t_change
    assert summary["status"] == "ok" and summary["iterations"] == 30
