"""backend=dist: one process per worker under torch.distributed (gloo here), started by
PyTorch's elastic launcher. Fault-free dist training equals fault-free local training (losses
and final weights, bit for bit in float32); a peer that never answers ends the job with an
error naming the peer and the op within the deadline; no process is left behind."""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, run

dist = pytest.importorskip("torch.distributed")
pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

# gpt-tiny on pp 2 x dp 2 (4 processes), 3 iterations of 4 micro-batches per pipeline.
SETUP = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "train.iterations=3", "train.microbatches=4",
         "strategy=none", "failures=none", "backend.dtype=float32", "report.gantt=false")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z":  # zombies hold nothing
            tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def leftover_descendants(pid: int | None = None) -> list[str]:
    """Processes below `pid` (this one) still alive, apart from multiprocessing's resource
    tracker (a helper of this process, not a worker)."""
    tree, out, todo = _children(), [], [pid or os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            line = _cmdline(child)
            if "resource_tracker" not in line:
                out.append(f"{child}: {line}")
    return out


def processes_with(marker: str) -> list[str]:
    """Live processes whose environment holds `marker` (everything a CLI run started inherits it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(f"{environ.parent.name}: {_cmdline(int(environ.parent.name))}")
        except OSError:
            continue
    return found


def assert_none_left(marker: str, within_s: float = 10.0) -> None:
    """No process whose environment holds `marker` is alive `within_s` seconds from now."""
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == [], "processes left behind"


def _assert_equal_training(summary: dict, reference: dict) -> None:
    import torch

    from ftbench.equivalence import load_state

    assert summary["losses"] == reference["losses"]  # exact: the same sums in the same order
    mine, theirs = load_state(summary["final_state"]), load_state(reference["final_state"])
    assert set(mine) == set(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def test_dist_cli_1f1b_equals_local_and_leaves_no_process(tmp_path):
    """`python -m ftbench backend=dist ...` as a user runs it: 4 processes, summary and metrics
    written by rank 0, the same training as local, nothing left running afterwards."""
    marker = f"FTBENCH_TEST_MARKER={uuid.uuid4().hex}"
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1",
               FTBENCH_TEST_MARKER=marker.split("=", 1)[1])
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ftbench", "backend=dist", *SETUP, "schedule=1f1b",
                          "report.progress=false", f"hydra.run.dir={tmp_path}/dist"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["backend"] == "dist"
    assert summary["processes"] == 4 and summary["process_group"] == "gloo" and summary["threads"] == 1
    lines = [json.loads(line) for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["start", "iteration", "iteration", "iteration", "end"]
    assert [r["loss"] for r in lines if r["event"] == "iteration"] == summary["losses"]
    assert len(summary["peak_memory_bytes"]) == 4
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == []
    reference = run(tmp_path / "local", "backend=local", *SETUP, "schedule=1f1b")
    assert reference["status"] == "ok", reference["error"]
    _assert_equal_training(summary, reference)
    assert time.monotonic() - started < 120


def test_dist_zero_bubble_equals_local(tmp_path, spawned_ranks):
    """Decoupled B/W (zb-h1), launched from this process through the same entry as the CLI."""
    summary = run(tmp_path / "dist", "backend=dist", *SETUP, "schedule=zb-h1")
    assert summary["status"] == "ok", summary["error"]
    assert leftover_descendants() == []
    reference = run(tmp_path / "local", "backend=local", *SETUP, "schedule=zb-h1")
    _assert_equal_training(summary, reference)


# `full`: the default tier's Young/Daly interval on dist is test_dist_failures.py's
# checkpoint restart onto a standby (the same leader's interval, with 2 GPUs a node)
@pytest.mark.full
def test_the_young_daly_interval_is_the_leaders_on_every_rank(tmp_path, spawned_ranks):
    """Checkpoint restart at its default, Young/Daly from the script's one failure in 6
    iterations and the measured iteration and save: every rank takes the leader's
    measurements (each deciding from its own clock would split the ranks' checkpoints, and
    the job would hang or diverge), so the restart restores the newest multiple of it."""
    summary = run(tmp_path, "backend=dist", *SETUP, "train.iterations=6", "strategy=checkpoint",
                  "failures=scripted", "failures.events=[{iteration:3,node:1}]", "report.check_fault_free=true")
    assert summary["status"] == "ok" and summary["matches_fault_free"] is True, summary["error"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    every = next(x["every"] for x in lines if x.get("event") == "checkpoint_interval")
    assert summary["recoveries"][0]["restored_iteration"] == 3 // every * every
    assert leftover_descendants() == []


def _silent_peer(timeout_s: float, error_dir: str) -> None:
    """Rank 1 waits for an activation rank 0 never sends; rank 0 stays alive but silent."""
    import torch

    from ftbench.distributed.transport import DistTransport
    from ftbench.distributed.worker import init_process_group, report_errors
    from ftbench.plan import grid_plan
    from ftbench.schedule import generate

    with report_errors(error_dir):
        rank, world, device, _ = init_process_group(timeout_s)
        plan = grid_plan(generate("1f1b", 2, 2, 1), ((0, 1), (1, 2)), 2, 1)
        transport = DistTransport(rank, world, timeout_s, device, torch.float32, (1, 4, 8))
        transport.prepare(plan)
        if rank == 1:
            transport.receive(("act", 0, 0, 0), src=0, dst=1)
        else:
            time.sleep(20 * timeout_s)


def test_a_peer_that_never_answers_ends_with_a_clear_timeout(tmp_path):
    from ftbench.distributed.launch import launch
    from ftbench.distributed.transport import DistError

    timeout = 5.0
    started = time.monotonic()
    with pytest.raises(DistError) as err:
        launch(_silent_peer, (timeout, str(tmp_path)), 2, timeout, 60.0, tmp_path, start_method="fork")
    elapsed = time.monotonic() - started
    message = str(err.value)
    assert "worker 1 (rank 1)" in message and "5 s (backend.timeout_s)" in message, message
    assert "receive the activation of stage 0, micro-batch 0 of pipeline 0 from worker 0 (rank 0)" in message
    assert timeout <= elapsed < timeout + 25, elapsed
    assert leftover_descendants() == []


def _stuck(seconds: float) -> None:
    time.sleep(seconds)


def test_the_launcher_stops_a_job_past_its_deadline(tmp_path, monkeypatch):
    """The deadline needs no signal to reach this thread (issue 36: interrupt_main's signal,
    raised inside logging's lock release, was swallowed and the job read as a success)."""
    import _thread

    from ftbench.distributed.launch import launch
    from ftbench.distributed.transport import DistError

    monkeypatch.setattr(_thread, "interrupt_main", lambda *args: None)  # a lost signal changes nothing
    started = time.monotonic()
    with pytest.raises(DistError, match="past its deadline of 2 s"):
        launch(_stuck, (60.0,), 2, 5.0, 2.0, tmp_path, start_method="fork")
    assert time.monotonic() - started < 20
    assert leftover_descendants() == []


STUCK_JOB = """
import sys, time
from pathlib import Path
from ftbench.distributed.launch import launch
from ftbench.distributed.transport import DistError

def stuck(seconds):
    time.sleep(seconds)

try:
    launch(stuck, (60.0,), 2, 5.0, 2.0, Path(sys.argv[1]), start_method="fork")
except DistError as err:
    print(err)
    sys.exit(3)
sys.exit(0)
"""


def test_a_launcher_stopped_past_its_deadline_still_fails_the_job(tmp_path):
    """The launcher's process is frozen (SIGSTOP) for 4 s across its 2 s deadline, as an
    overloaded machine would hold it: once it runs again the job ends as a failure, its ranks
    stopped, never as a success."""
    import signal

    launcher = subprocess.Popen([sys.executable, "-c", STUCK_JOB, str(tmp_path)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        pids = tmp_path / "pids"
        wait = time.monotonic() + 60
        while len(list(pids.glob("rank*"))) < 2 and launcher.poll() is None and time.monotonic() < wait:
            time.sleep(0.05)
        ranks = [int(p.read_text()) for p in pids.glob("rank*")]
        assert len(ranks) == 2, launcher.communicate(timeout=30)[0]
        launcher.send_signal(signal.SIGSTOP)
        time.sleep(4.0)
        resumed = time.monotonic()
        launcher.send_signal(signal.SIGCONT)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGCONT)
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 3 and "past its deadline of 2 s" in out, out
    assert time.monotonic() - resumed < 20
    for pid in ranks:  # no rank left running (nor a zombie: the launcher reaped them)
        assert not Path(f"/proc/{pid}").exists(), pid
