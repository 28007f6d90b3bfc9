"""backend=dist when things go wrong in the harness itself (issue 36, item 4 and the dist parts
of item 6): a gloo timeout reports the time it really waited and ends in seconds when nobody
died; a Swift replay whose standby dies takes the next live standby; a rank's bug exits 1
(not a bad setting's 2) and a job that stops without results keeps what its metrics lines
logged. (The launcher's deadline under a frozen launcher: tests/test_dist.py.)"""
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import ROOT
from test_dist import assert_none_left, leftover_descendants

dist = pytest.importorskip("torch.distributed")
# `dist` marks the tests that start processes; the others run in this process
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _cli(tmp_path, *overrides, prelude: str = "") -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    """`ftbench backend=dist ...` as a user runs it (after `prelude`, Python run first in the
    CLI's process); (the process, summary, metrics lines), after checking no process is left."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1",
               FTBENCH_TEST_MARKER=marker)
    script = f"{prelude}\nimport sys\nfrom ftbench.cli import main\nsys.argv[1:] = {list(overrides)!r}\nmain()\n"
    out = subprocess.run([sys.executable, "-c", script, ], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_none_left(f"FTBENCH_TEST_MARKER={marker}")
    return out, summary, lines


# -- a gloo timeout --------------------------------------------------------------------------
class _TimesOut:
    """A gloo work whose wait fails at once, as the "Operation timed out!" seen after under a second."""

    def wait(self, timeout=None):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Operation timed out!")


def test_a_gloo_timeout_reports_the_time_it_really_waited():
    from ftbench.distributed.transport import DistTimeout, DistTransport

    t = DistTransport.__new__(DistTransport)
    t.timeout_s, t.alarm, t.worker, t.rank = 60.0, None, 1, 1
    t.timeout = None
    with pytest.raises(DistTimeout) as err:
        t._wait(_TimesOut(), "receive x", p2p=True)
    message = str(err.value)
    assert "waited more than" not in message, message
    assert "gloo reported a timeout after 0.0 s, before backend.timeout_s (60 s)" in message, message
    assert "worker 1 (rank 1) could not receive x" in message
    # at the deadline: the deadline, and the time measured
    late = t._failure(RuntimeError("Timed out waiting 60000ms for recv"), "rank 1", "receive x", 60.2)
    assert "waited more than 60 s (backend.timeout_s) to receive x (after 60.2 s)" in str(late)


def test_after_a_failed_wait_with_nobody_dead_detection_ends_in_seconds(dist_store):
    """Every process still beats after a wait failed: the wait's error stands after QUIET_S,
    not after a whole backend.timeout_s (60 s here) more (issue 36)."""
    from ftbench.distributed.membership import QUIET_S, MembershipError, detect

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            for r in (0, 1, 2):
                dist_store.add(f"hb/{r}", 1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    started = time.monotonic()
    try:
        with pytest.raises(MembershipError, match="kept beating"):
            detect(dist_store, [0, 1, 2], 60.0, quiet_s=QUIET_S)
        elapsed = time.monotonic() - started
        assert QUIET_S <= elapsed < QUIET_S + 5, elapsed
        # one that did stop (frozen, as a SIGSTOPped process's beat) is still found dead
        started = time.monotonic()
        stop.set()
        beating.join()
        dead, _ = detect(dist_store, [0, 1, 2], 60.0, quiet_s=QUIET_S)
        assert dead == {0, 1, 2} and time.monotonic() - started < QUIET_S + 5
    finally:
        stop.set()


# -- a standby that dies during Swift's replay ---------------------------------------------
@pytest.mark.dist
def test_a_replay_whose_standby_dies_uses_the_next_live_standby(tmp_path):
    """Node 1 fails in iteration 3; the standby taking its place (rank 2) dies as the replay
    begins (backend.kill=2:3:recovery). The replay completes without it, as a restore does,
    and the node is replaced again by the next standby (rank 3), which replays: the run ends
    ok and equal to fault-free training (was `error`: "no live rank runs the replayed workers")."""
    out, summary, lines = _cli(tmp_path, "backend=dist", "model=gpt-tiny", "backend.dtype=float64", "cluster.pp=2",
                               "cluster.dp=1", "train.iterations=5", "train.microbatches=4", "strategy=swift",
                               "strategy.every=2", "cluster.spares=2", "failures.events=[{iteration:3,node:1}]",
                               "backend.kill=2:3:recovery", "backend.timeout_s=30", "report.gantt=false",
                               "report.progress=false", f"hydra.run.dir={tmp_path}")
    logs = {p.parts[-5]: p.read_text() for p in (tmp_path / "dist" / "logs").rglob("stderr.log")}
    assert out.returncode == 0 and summary["status"] == "ok", (out.returncode, summary.get("error"), out.stderr[-2000:],
                                                              {node: log[-1500:] for node, log in logs.items()})
    assert summary["matches_fault_free"] is True and summary["iterations"] == 5
    first, second = summary["recoveries"]
    assert first["interrupted_by_nodes"] == [1] and "ReplayLogs" in first["actions"]
    assert "ReplayLogs" in second["actions"] and second["iteration"] == 3
    assert [r["node"] for r in lines if r["event"] == "fail"] == [1, 1] and summary["failures"] == 2
    assert [m["dead_ranks"] for m in summary["measured_recoveries"]] == [[1], [2]]
    assert "the replay of workers [1] is skipped: their ranks [2] died in this recovery" in logs["node3"]


# -- records ---------------------------------------------------------------------------------
def _buggy(error_dir: str) -> None:
    from ftbench.distributed.worker import env_ranks, report_errors

    with report_errors(error_dir):
        if env_ranks()[0] == 1:
            raise ZeroDivisionError("a bug in rank 1")
        time.sleep(30)


@pytest.mark.dist
def test_a_ranks_bug_is_no_user_error(tmp_path):
    """An exception of a rank that is not a user error is RankFailed (status `error` from an
    exception: exit 1), a DistError only for what the user can act on (exit 2)."""
    from ftbench.distributed.launch import launch
    from ftbench.distributed.transport import RankFailed
    from ftbench.errors import UserError

    with pytest.raises(RankFailed) as err:
        launch(_buggy, (str(tmp_path),), 2, 10.0, 60.0, tmp_path, start_method="fork")
    assert not isinstance(err.value, UserError)
    assert "rank 1 failed with ZeroDivisionError: a bug in rank 1 (a bug, not a setting" in str(err.value)
    assert str(tmp_path / "error-rank1.json") in str(err.value)
    assert leftover_descendants() == []


BUG_IN_ITERATION_2 = """
import ftbench.distributed.engine as engine
step = engine.DistEngine.run_iteration
def run_iteration(self, plan, iteration, *args, **kwargs):
    if iteration == 2:
        raise ZeroDivisionError("a bug in iteration 2")
    return step(self, plan, iteration, *args, **kwargs)
engine.DistEngine.run_iteration = run_iteration
"""


@pytest.mark.dist
def test_a_dist_bug_exits_1_with_what_was_done(tmp_path):
    """A bug in every rank at iteration 2 (the forked ranks inherit the patched engine): the run
    ends `error` with exit 1 (was 2, a bad setting's code), and the summary keeps the two
    iterations metrics.jsonl logged."""
    out, summary, lines = _cli(tmp_path, "backend=dist", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=1",
                               "train.iterations=4", "train.microbatches=2", "strategy=none", "failures=none",
                               "report.gantt=false", "report.progress=false", f"hydra.run.dir={tmp_path}",
                               prelude=BUG_IN_ITERATION_2)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert summary["status"] == "error" and "ZeroDivisionError: a bug in iteration 2" in summary["error"], summary
    assert "a bug, not a setting" in summary["error"]
    assert [r["iteration"] for r in lines if r["event"] == "iteration"] == [0, 1]
    assert summary["iterations"] == 2 and len(summary["losses"]) == 2


@pytest.mark.dist
@pytest.mark.full  # CI (extended tier) asserts the same counts in test_dist_failures' straggler past the deadline
def test_a_job_stopped_after_a_failure_counts_it(tmp_path):
    """Rank 0 pauses 10 s in the recovery from node 1's failure, past backend.timeout_s=5: the
    job stops with the others' timeout (no results), and the summary counts the failure and
    the two iterations its metrics lines logged (one said `failures: 0`)."""
    out, summary, lines = _cli(tmp_path, "backend=dist", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=2",
                               "train.iterations=4", "train.microbatches=4", "strategy=recycle",
                               "cluster.gpus_per_node=1", "cluster.spares=0", "failures.events=[{iteration:2,node:1}]",
                               "backend.stall=0:2:10", "backend.timeout_s=5", "report.gantt=false",
                               "report.progress=false", f"hydra.run.dir={tmp_path}")
    assert summary["status"] == "error" and out.returncode == 2, (summary.get("error"), out.stderr[-2000:])
    assert [r["event"] for r in lines].count("fail") == 1 and lines[-1]["event"] == "error"
    assert summary["failures"] == 1 and summary["iterations"] == 2, summary
