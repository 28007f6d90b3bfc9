"""`gemini` (docs/strategies/gemini.md): checkpoints in host memory on the node and its group's
peers, kept across a process restart, lost with their node; files when a whole group lost its
memory; the checkpoint traffic charged where it does not fit the network's idle time."""
import json

import pytest
import torch

from conftest import compose, run
from ftbench.actions import HOST, CheckpointTier
from ftbench.checkpoint_schedule import checkpoint_tiers
from ftbench.context import RunContext
from ftbench.engine.host_memory import HostMemory
from ftbench.plan import host_groups
from ftbench.recovery_costs import interleaved_checkpoint_stall_s, replica_bytes

# pp 2 x dp 1 on two nodes of one GPU: no data-parallel replica anywhere, so a failed node's
# state can only come from a peer's host memory (or the files)
TINY = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=1", "cluster.gpus_per_node=1", "cluster.spares=1",
        "train.iterations=8", "train.microbatches=4", "report.gantt=false", "cluster.replacement_s=0")
LOCAL = ("backend=local", "backend.clock=model", *TINY)


def _recovery(summary):
    (recovery,) = summary["recoveries"]
    return recovery


@pytest.mark.parametrize("backend", ["sim", "local"])
def test_a_node_without_a_replica_takes_its_state_from_its_group_peer(tmp_path, backend):
    """Node 1 fails in iteration 5 (files at 0 and 4): the job restarts and node 1's replacement
    loads the checkpoint of iteration 5 from node 0's host memory; node 0 loads its own."""
    summary = run(tmp_path, f"backend={backend}", *TINY, "strategy=gemini", "strategy.every=4",
                  "failures=scripted", "failures.events=[{iteration:5,node:1}]")
    assert summary["status"] == "ok", summary["error"]
    recovery = _recovery(summary)
    assert recovery["actions"] == ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    assert (recovery["restored_iteration"], recovery["lost_iterations"]) == (5, 0)
    assert [(c["src"], c["dst"], c["head"]) for c in recovery["copies"]] == [(0, 1, True)]
    if backend == "local":
        assert summary["matches_fault_free"] is True
        # node 1's folder was emptied when it failed, refilled by the saves after the recovery
        assert sorted(p.name for p in (tmp_path / "host" / "node1").iterdir()) == ["iter_00000006", "iter_00000007"]


@pytest.mark.parametrize("group, events, restored, copies", [
    (1, "[{iteration:5,node:1}]", 4, []),  # alone in its group: its memory went with it
    (2, "[{iteration:5,node:1},{iteration:5,node:0}]", 4, []),  # both nodes of the group in one iteration
    # node 1's replacement holds both nodes' state again once iteration 6 is saved
    (2, "[{iteration:5,node:1},{iteration:6,node:0}]", 6, [(1, 0)]),
])
def test_files_when_a_whole_group_lost_its_memory(tmp_path, group, events, restored, copies):
    summary = run(tmp_path, *LOCAL, "strategy=gemini", "strategy.every=4", f"strategy.group={group}",
                  "failures=scripted", f"failures.events={events}")
    assert summary["status"] == "ok", summary["error"]
    last = summary["recoveries"][-1]
    assert last["restored_iteration"] == restored
    assert [(c["src"], c["dst"]) for c in last.get("copies", [])] == copies
    assert summary["matches_fault_free"] is True


def test_a_restore_from_host_memory_needs_a_live_holder(tmp_path):
    """The engine, not the strategy, decides what host memory still holds: with node 0's and
    node 1's memory lost (one group), nothing covers stage 1, whatever a strategy would ask."""
    memory = HostMemory(tmp_path, group=2)
    shard = {"model": {"w": torch.zeros(2)}, "optim": {}}
    other = {"model": {"v": torch.zeros(3)}, "optim": {}}
    memory.save(3, {"worker0_0": shard, "worker1_0": other}, {"worker0_0": 0, "worker1_0": 1}, {0, 1})
    assert memory.load({"w": (2,), "v": (3,)})[0] == 3
    memory.lose(1)
    assert memory.load({"w": (2,), "v": (3,)})[0] == 3  # node 0 holds node 1's too
    memory.lose(0)
    assert memory.load({"w": (2,), "v": (3,)}) is None
    memory.save(4, {"worker0_0": shard}, {"worker0_0": 0}, {0, 1})
    assert memory.load({"w": (2,), "v": (3,)}) is None and memory.load({"w": (2,)})[0] == 4


def test_host_memory_outlives_the_restart_and_not_a_forgotten_timeline(tmp_path):
    """On sim a RestartJob empties the MEMORY tier but keeps HOST; a restore forgets newer saves."""
    from ftbench.actions import RestartJob, RestoreCheckpoint
    from ftbench.sim.backend import SimBackend

    backend = SimBackend(None)
    for i in (2, 3, 4):
        backend.save(None, i, HOST)
    backend.save(None, 4, "memory")
    assert backend.perform([RestartJob(), RestoreCheckpoint(HOST)], None, None, 5) == 4
    assert backend.perform([RestartJob(), RestoreCheckpoint("file")], None, None, 5) == 0
    assert backend.saved[HOST] == []


def test_placement_groups():
    assert host_groups([3, 1, 2, 0], 2) == [(0, 1), (2, 3)]
    assert host_groups(range(7), 3) == [(0, 1, 2), (3, 4, 5, 6)]  # the rest joins the last group
    assert host_groups([5], 2) == [(5,)]
    assert host_groups(range(3), 1) == [(0,), (1,), (2,)]


def test_only_the_host_tier_takes_a_group():
    class Strategy:
        name = "x"

        def __init__(self, tiers):
            self.checkpoint_tiers = lambda: tiers

    assert checkpoint_tiers(Strategy((CheckpointTier(HOST, 1, 3),)))
    for tiers in ((CheckpointTier("file", 1, 2),), (CheckpointTier(HOST, 1, 0),),
                  (CheckpointTier(HOST, 1), CheckpointTier("memory", 1))):
        with pytest.raises(TypeError):
            checkpoint_tiers(Strategy(tiers))


def _stall(tmp_path, *overrides):
    cfg = compose("backend=sim", "model=gpt3-6.7b", "hardware=a100-80gb", "cluster.pp=8", "cluster.dp=4",
                  "cluster.gpus_per_node=8", "strategy=gemini", *overrides)
    ctx = RunContext.from_config(cfg)
    plan = ctx.grid_plan(8, 4, 8, node_of=lambda w: w // 8)
    return plan, ctx.cost_model


def test_the_traffic_stalls_only_past_the_idle_network_time(tmp_path):
    """GPT-3 6.7B on pp 8: a GPU's state (about 10 GB) goes to host memory and to one peer node
    at 25 GB/s each, in the background of an iteration of seconds; training waits only for
    what goes past the iteration's time less the GPU's own all-reduce."""
    plan, cost_model = _stall(tmp_path)
    hw = cost_model.hw
    nbytes = max(replica_bytes(plan, cost_model).values())
    local, remote = nbytes / (hw.host_gbps * 1e9), nbytes / (hw.inter_node_gbps * 1e9)
    assert 0.3 < local < 0.5 and 0.3 < remote < 0.5
    assert interleaved_checkpoint_stall_s(plan, cost_model, 6.0, 1, 2) == 0.0
    # an iteration shorter than the copy: the part past it, network side (all-reduce included)
    short = interleaved_checkpoint_stall_s(plan, cost_model, 0.1, 1, 2)
    assert short > remote - 0.1
    # spread over 4 iterations, a quarter of the traffic each; 3 nodes a group: twice the sends
    assert interleaved_checkpoint_stall_s(plan, cost_model, 0.1, 4, 2) < short
    assert interleaved_checkpoint_stall_s(plan, cost_model, 0.1, 1, 3) == pytest.approx(short + remote, rel=1e-9)


def test_a_fault_free_run_saves_to_host_memory_every_iteration(tmp_path):
    summary = run(tmp_path, *LOCAL, "strategy=gemini", "strategy.every=4", "failures=none")
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saves = [(x["iteration"], x["mode"]) for x in events if x["event"] == "checkpoint"]
    assert [i for i, mode in saves if mode == HOST] == list(range(8))  # (none after the last iteration)
    assert [i for i, mode in saves if mode == "file"] == [0, 4]
    assert summary["status"] == "ok"
    # every node's host memory holds both nodes' newest two (group 2, keep 2)
    for node in (0, 1):
        folders = sorted(p.name for p in (tmp_path / "host" / f"node{node}").iterdir())
        assert folders == ["iter_00000006", "iter_00000007"]
        manifest = json.loads((tmp_path / "host" / f"node{node}" / "iter_00000007" / "manifest.json").read_text())
        assert sorted(manifest["shards"]) == ["worker0_0", "worker1_0"]


def test_a_strategy_that_counts_on_lost_memory_gets_unrecoverable(tmp_path, monkeypatch):
    """The run loop empties a failed node's host memory on every backend that holds it: a
    Gemini that ignored its own bookkeeping (every node counted as holding a checkpoint)
    restores from host memory after both nodes of the group failed, and `local` finds nothing
    that holds stage 1 (sim, which trusts the strategy, would go on)."""
    from ftbench.strategies.gemini import Gemini

    monkeypatch.setattr(Gemini, "_holds_checkpoint", lambda self, node, iteration: True)
    summary = run(tmp_path, *LOCAL, "strategy=gemini", "strategy.every=4", "report.check_fault_free=false",
                  "failures=scripted", "failures.events=[{iteration:5,node:1},{iteration:5,node:0}]")
    assert summary["status"] == "unrecoverable"
    assert "no host-memory checkpoint holds every parameter" in summary["error"]


def test_host_memory_is_written_without_fsync(tmp_path, monkeypatch):
    """Memory survives no power loss: the files standing in for it skip fsync (the checkpoint
    files keep it), and a load still verifies every shard it reads."""
    import os

    def no_fsync(fd):
        raise AssertionError("fsync on host memory")

    monkeypatch.setattr(os, "fsync", no_fsync)
    memory = HostMemory(tmp_path, group=1)
    memory.save(1, {"worker0_0": {"model": {"w": torch.ones(2)}, "optim": {}}}, {"worker0_0": 0}, {0})
    (tmp_path / "node0" / "iter_00000001" / "worker0_0.pt").write_bytes(b"damaged")
    assert memory.load({"w": (2,)}) is None  # the damaged shard does not verify


def test_the_stall_per_worker_equals_the_grids_per_stage(tmp_path):
    """The per-worker path (any plan) and the per-stage shortcut (a grid) give the same stall."""
    import dataclasses

    plan, cost_model = _stall(tmp_path)
    any_plan = dataclasses.replace(plan, holds=dict(plan.holds))  # the same plan, no longer known as a grid
    assert plan.grid() is not None and any_plan.grid() is None
    for iteration_s, every, group in ((0.1, 1, 2), (0.3, 2, 3), (6.0, 1, 2)):
        assert interleaved_checkpoint_stall_s(any_plan, cost_model, iteration_s, every, group) == pytest.approx(
            interleaved_checkpoint_stall_s(plan, cost_model, iteration_s, every, group), rel=1e-12, abs=0)
