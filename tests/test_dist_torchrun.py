"""backend=dist across "nodes" started by torchrun, as on a cluster: two torchrun agents on
loopback stand in for two nodes, and `ftbench backend=dist backend.launcher=torchrun` is the
coordinator that hosts the job's store and writes the run folder. Node 0 (rank 0, the first
leader, and the node whose agent would host torchrun's own store) is killed: the job must go
on and write its summary, and train what fault-free training trains."""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT
from test_dist import assert_none_left

dist = pytest.importorskip("torch.distributed")
# `dist` marks the tests that start processes; the others run in this process
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SETUP = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "cluster.gpus_per_node=2", "cluster.spares=0",
         "train.iterations=6", "train.microbatches=4", "report.gantt=false", "report.progress=false",
         "backend.timeout_s=30")


@pytest.mark.dist
def test_torchrun_nodes_survive_the_death_of_node_0(tmp_path):
    # float32: the survivors continue at dp 1, which sums gradients in another order (within the floor)
    overrides = [*SETUP, "strategy=elastic-horovod", "failures.events=[{iteration:2,node:0}]"]
    # the README's command, once per node
    output, nodes, run_dir, marker = _torchrun_job(tmp_path, overrides, 2, ["--nnodes=2"], timeout=240)
    # The dead node's torchrun reports its workers' SIGKILL; the survivor's finishes.
    assert nodes[1].wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    nodes[0].wait(timeout=60)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", (summary.get("error"), output[-3000:])
    assert summary["matches_fault_free"] is True
    (measured,) = summary["measured_recoveries"]
    assert measured["dead_ranks"] == [0, 1]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r["event"] for r in lines]
    assert events[0] == "start" and events[-1] == "end"
    assert [(r["node"], r["iteration"]) for r in lines if r["event"] == "fail"] == [(0, 2)]
    restored = lines[events.index("recovery")]["restored_iteration"]
    after = lines[events.index("recovery"):]
    assert [r["iteration"] for r in after if r["event"] == "iteration"] == list(range(restored, 6))
    assert_none_left(f"FTBENCH_TEST_MARKER={marker}")


@pytest.mark.dist
@pytest.mark.full
def test_torchrun_restarts_the_processes_for_a_checkpoint_restart(tmp_path):
    """Checkpoint restart under the user's torchrun, with restarts and an elastic node count as
    docs/distributed.md gives the command: node 1 dies (its agent with it), the standby node
    takes its workers, and the restart ends every process; the agents of the nodes still up
    start new ones (torchrun's own restart), which keep their ranks and go on from the journal."""
    overrides = [*SETUP[:4], "cluster.spares=1", *SETUP[5:], "strategy=checkpoint", "strategy.every=2",
                 "failures.events=[{iteration:3,node:1}]"]
    # 2 nodes and the standby
    output, nodes, run_dir, marker = _torchrun_job(
        tmp_path, overrides, 3, ["--nnodes=1:3", "--max-restarts=1", "--rdzv-conf=last_call_timeout=5"], timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", (summary.get("error"), output[-3000:],
                                       [(tmp_path / f"node{n}.log").read_text()[-2000:] for n in range(3)])
    assert summary["matches_fault_free"] is True
    (measured,) = summary["measured_recoveries"]
    assert measured["dead_ranks"] == [2, 3]
    assert len(measured["processes_ended"]) == len(measured["processes_started"]) == 4
    assert not set(measured["processes_ended"]) & set(measured["processes_started"])
    for node in (0, 2):  # the survivors' torchrun ends well once the job is done
        assert nodes[node].wait(timeout=60) == 0, (tmp_path / f"node{node}.log").read_text()[-3000:]
    assert_none_left(f"FTBENCH_TEST_MARKER={marker}")


def _torchrun_job(tmp_path, overrides, nodes: int, flags: list[str], timeout: float):
    """The coordinator (`ftbench backend=dist backend.launcher=torchrun`) and `nodes` torchrun
    agents on loopback with `flags`, as docs/distributed.md gives the commands; (the
    coordinator's output, the agents' processes, the run folder, the test marker). Every
    process still running at the end is killed."""
    from ftbench.distributed.launch import free_port

    port = free_port()
    marker = uuid.uuid4().hex
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1",
               FTBENCH_TEST_MARKER=marker)
    run_dir = tmp_path / "run"
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "ftbench", "backend=dist", "backend.launcher=torchrun", f"backend.store_port={port}",
         *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    agents = []
    try:
        _wait_for_port(port, coordinator)
        for node in range(nodes):
            with open(tmp_path / f"node{node}.log", "w") as out:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", *flags, "--nproc-per-node=2",
                     "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test",
                     "-m", "ftbench.distributed", "--store", f"127.0.0.1:{port}", *overrides, "--run-dir", str(run_dir)],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        output, _ = coordinator.communicate(timeout=timeout)
    finally:
        for process in [coordinator, *agents]:
            if process.poll() is None:
                process.kill()
    return output, agents, run_dir, marker


def _wait_for_port(port: int, coordinator, within_s: float = 60) -> None:
    """Until the coordinator's store listens (torchrun's agents need it from their start)."""
    import socket

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if coordinator.poll() is not None:
            raise AssertionError(f"the coordinator ended early: {coordinator.stdout.read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the coordinator's store did not listen on {port} within {within_s} s")


@pytest.mark.parametrize("override,message", [
    ("backend.launcher=slurm", "unknown launcher 'slurm'"),
    ("backend.store_port=0", "must be a TCP port number"),
])
def test_bad_launcher_settings_are_refused(tmp_path, override, message):
    from conftest import run

    overrides = [override] if "launcher" in override else ["backend.launcher=torchrun", override]
    summary = run(tmp_path, "backend=dist", "model=gpt-tiny", *overrides)
    assert summary["status"] == "error" and message in summary["error"], summary["error"]
    assert override.split("=")[0] in summary["error"]


@pytest.mark.dist
@pytest.mark.parametrize("module", ["ftbench.distributed", "ftbench.dist"])  # the old name still launches
def test_a_rank_given_a_store_needs_the_run_folder(module):
    out = subprocess.run([sys.executable, "-m", module, "--store", "127.0.0.1:29500", "model=gpt-tiny"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--run-dir" in out.stderr
