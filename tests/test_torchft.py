"""`torchft` (docs/strategies/torchft.md): a failed replica group drops out and the step goes on
without its samples; its replacement joins later and heals from a live group. The run must
equal fault-free training replayed under its samples ledger, and differ from it otherwise."""
import pytest

from conftest import compose, run
from ftbench.context import RunContext
from ftbench.equivalence import compare, load_state
from ftbench.fault_free import fault_free_reference
from ftbench.samples import replayed

# gpt-tiny, pp 2 x dp 3 on six one-GPU nodes: replica group d is nodes 2d and 2d + 1
SETUP = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=3", "train.iterations=8", "train.microbatches=2",
         "cluster.replacement_s=0.2", "report.gantt=false", "strategy=torchft", "failures=scripted")
LOCAL = ("backend=local", "backend.clock=model", *SETUP)
FAIL_THEN_JOIN = "failures.events=[{iteration:3,node:3},{iteration:5,node:3,kind:join}]"


def test_a_failed_group_drops_its_samples_until_it_rejoins_and_heals_from_a_peer(tmp_path):
    summary = run(tmp_path, *LOCAL, FAIL_THEN_JOIN)
    assert summary["status"] == "ok", summary["error"]
    b = summary["global_batch"] // 3  # each group's samples
    # group 1 (nodes 2 and 3) is out for iterations 3 and 4: its samples b..2b-1 are dropped
    assert summary["ledger"] == [[0, 2, 3 * b, [[0, 3 * b]]], [3, 4, 2 * b, [[0, b], [2 * b, 3 * b]]],
                                 [5, 7, 3 * b, [[0, 3 * b]]]]
    assert summary["samples_dropped"] == 2 * b
    fail, join = summary["recoveries"]
    assert (fail["actions"], fail["shape"], fail["lost_iterations"]) == (["Rendezvous"], "pp=2 dp=2", 0)
    assert (join["actions"], join["shape"]) == (["Rendezvous", "SyncFromPeers"], "pp=2 dp=3")
    # both stages of group 1 heal from a live group's replicas
    assert sorted((c["dst"], c["head"]) for c in join["copies"]) == [(2, False), (3, True)]
    assert summary["matches_fault_free"] is True
    assert summary["fault_free_noise_floor"] is None  # bit for bit the replayed reference


def test_the_check_replays_the_ledger_and_would_see_another(tmp_path):
    """The run equals fault-free training replayed under its ledger; it differs from plain
    fault-free training and from a replay that dropped another group's samples, so the
    check is not vacuous."""
    summary = run(tmp_path, *LOCAL, FAIL_THEN_JOIN, "report.check_fault_free=false")
    state = load_state(summary["final_state"])
    cfg = compose("report.progress=false", *LOCAL, "strategy=none", "failures=none")
    ctx = RunContext.from_config(cfg)
    replay = replayed(summary["ledger"], ctx.global_batch)
    assert sorted(replay) == [3, 4]
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx, replay=replay)) is None
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx)) is not None
    b = ctx.global_batch // 3
    other = {i: ((b, 3 * b),) for i in replay}  # group 0 dropped instead of group 1
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx, replay=other)) is not None


def test_a_failure_after_the_optimizer_steps_is_undone_and_the_step_redone_without_the_group(tmp_path):
    summary = run(tmp_path, *LOCAL, "failures.events=[{iteration:3,node:2,at:0.97}]")
    assert summary["status"] == "ok", summary["error"]
    assert summary["recoveries"][0]["lost_iterations"] == 0
    assert summary["samples_dropped"] > 0 and summary["matches_fault_free"] is True


@pytest.mark.parametrize("spares, wait_s", [(0, 0.2), (1, 0.0)])
def test_the_replacement_joins_after_its_wait_and_its_processes_start(tmp_path, spares, wait_s):
    """No scripted join: the loop brings the replacement (a standby at once, else a new node
    after cluster.replacement_s), whose processes start (hardware.restart_s), then it joins."""
    summary = run(tmp_path, "backend=sim", *SETUP, f"cluster.spares={spares}", "hardware.restart_s=0.5", "hardware.rendezvous_s=0.01",
                  "train.iterations=20000", "failures.events=[{iteration:3,node:3}]")
    assert summary["status"] == "ok", summary["error"]
    fail, join = summary["recoveries"]
    assert join["cause"] == "join" and join["shape"] == "pp=2 dp=3"
    assert join["time_s"] - fail["time_s"] == pytest.approx(wait_s + 0.5, abs=summary["iteration_time_s"] * 1.01)
    assert 0 < summary["samples_dropped"] < summary["samples"]


def test_a_group_waits_for_all_its_nodes(tmp_path):
    """Nodes 2 and 3 (both of group 1) fail; group 1 rejoins only when both are back."""
    summary = run(tmp_path, "backend=sim", *SETUP, "failures.events=[{iteration:2,node:2},{iteration:3,node:3},"
                  "{iteration:4,node:2,kind:join},{iteration:6,node:3,kind:join}]")
    assert summary["status"] == "ok", summary["error"]
    assert [(r["iteration"], r["cause"], r["shape"]) for r in summary["recoveries"]] == [
        (2, "fail", "pp=2 dp=2"), (6, "join", "pp=2 dp=3")]
    assert [s["shape"] for s in summary["plan_segments"]] == ["pp=2 dp=3", "pp=2 dp=2", "pp=2 dp=3"]


def test_every_group_lost_is_unrecoverable(tmp_path):
    summary = run(tmp_path, "backend=sim", *SETUP, "cluster.dp=1", "failures.events=[{iteration:3,node:1}]")
    assert summary["status"] == "unrecoverable"
    assert "every replica group lost a worker" in summary["error"]
