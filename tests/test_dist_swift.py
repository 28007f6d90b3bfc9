"""strategy=swift on backend=dist: a node's process is really killed; Swift recovers it from
its boundary logs (each rank logs its own sends into the run folder every rank shares, and the
replacement replays from the checkpoint reading its peers' log files) or from a live replica,
and training equals fault-free training. The logging case is also compared with the same run
on `local`: the same recovery actions, the same losses and weights bit for bit (float32)."""
import json
import threading
import time

import pytest

from conftest import run
from test_dist import _assert_equal_training
from test_dist import pytestmark  # noqa: F401 - the dist tests' marks: skipped without gloo
from test_dist_failures import run_dist

# gpt-tiny, 4 micro-batches per pipeline, a checkpoint every 2 iterations, one standby node
# (on dist a replacement is a standby's processes).
SWIFT = ("strategy=swift", "strategy.every=2", "model=gpt-tiny", "train.microbatches=4", "cluster.gpus_per_node=1",
         "cluster.spares=1", "report.gantt=false", "report.progress=false")


def _fail_line(tmp_path) -> dict:
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (fail,) = [r for r in lines if r["event"] == "fail"]
    return fail


def _assert_log_gone(tmp_path) -> None:
    assert not list(tmp_path.rglob("swift-logs")), "the boundary log folder outlived the run"


@pytest.mark.parametrize("parallel", [1, pytest.param(2, marks=pytest.mark.full)])  # 2: the same replay in halves
def test_a_lost_stage_without_replica_is_replayed_from_the_logs(tmp_path, parallel):
    """pp=2, dp=1: node 1 (stage 1, the only copy) dies in iteration 3; the standby loads the
    checkpoint of iteration 2 and replays iteration 2 on stage 0's logged activations (with
    parallel recovery, in two halves of micro-batches whose gradients are summed)."""
    shape = ("cluster.pp=2", "cluster.dp=1", "train.iterations=5", "failures=scripted",
             "failures.events=[{iteration:3,node:1}]", f"strategy.parallel_recovery={parallel}")
    summary, _ = run_dist(tmp_path / "dist", *SWIFT, *shape, "backend.timeout_s=30", setup=())
    assert summary["matches_fault_free"] is True
    (recovery,) = summary["recoveries"]
    assert recovery["restored_iteration"] == 3 and recovery["lost_iterations"] == 0
    (measured,) = summary["measured_recoveries"]
    assert measured["dead_ranks"] == [1] and measured["replay_s"] > 0
    assert summary["log_peak_bytes"] > 0 and summary["log_files"] > 0
    _assert_log_gone(tmp_path / "dist")

    local = run(tmp_path / "local", "backend=local", "backend.dtype=float32", "report.check_fault_free=false",
                *SWIFT, *shape)
    assert local["status"] == "ok", local["error"]
    assert [r["actions"] for r in summary["recoveries"]] == [r["actions"] for r in local["recoveries"]]
    assert recovery["actions"] == ["WaitForReplacement", "UndoSteps", "Rendezvous", "ReplayLogs"]
    _assert_equal_training(summary, local)


def test_a_damaged_log_is_found_before_the_replay_and_the_job_restarts_from_the_checkpoint(tmp_path):
    """As above (serial), but stage 0's log of iteration 2, which the replay reads, is cut in
    half as soon as it is written (a watcher here): every rank finds it damaged before the
    replay uses it (ftbench.engine.log_file), and the run loop restarts the job from the
    checkpoint of iteration 2 instead; training still equals fault-free training."""
    target = tmp_path / "swift-logs" / "worker0" / "iteration00000002.pt"
    stop = threading.Event()

    def truncate_once() -> None:
        while not stop.is_set():
            if target.exists():  # whole from the start: the writer renames it into place
                target.write_bytes(target.read_bytes()[:-64])
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=truncate_once, daemon=True)
    watcher.start()
    try:
        summary, _ = run_dist(tmp_path, *SWIFT, "cluster.pp=2", "cluster.dp=1", "train.iterations=5",
                              "failures=scripted", "failures.events=[{iteration:3,node:1}]", "backend.timeout_s=30",
                              setup=())
    finally:
        stop.set()
    assert summary["matches_fault_free"] is True
    (recovery,) = summary["recoveries"]
    assert recovery["actions"] == ["WaitForReplacement", "UndoSteps", "Rendezvous", "ReplayLogs", "RestartJob",
                                   "RestoreCheckpoint"]
    assert "worker0/iteration00000002.pt: payload of" in recovery["fallback"], recovery["fallback"]
    assert (recovery["restored_iteration"], recovery["lost_iterations"]) == (2, 1)
    _assert_log_gone(tmp_path)


def test_a_lost_stage_with_a_live_replica_is_copied_after_undoing_steps(tmp_path):
    """pp=2, dp=2: node 1 dies at 97 % of iteration 2, after some optimizer steps: the survivors
    undo theirs, the standby takes stage 1 from its data-parallel replica, nothing is replayed."""
    summary, _ = run_dist(tmp_path, *SWIFT, "cluster.pp=2", "cluster.dp=2", "train.iterations=4",
                          "failures=scripted", "failures.events=[{iteration:2,node:1,at:0.97}]",
                          "backend.timeout_s=30", setup=())
    assert summary["matches_fault_free"] is True
    (recovery,) = summary["recoveries"]
    assert recovery["actions"] == ["WaitForReplacement", "UndoSteps", "Rendezvous", "SyncFromPeers"]
    assert recovery["lost_iterations"] == 0
    assert _fail_line(tmp_path)["undone"] >= 1
    _assert_log_gone(tmp_path)
