"""The cost model's measured terms (issue 39 item 2): a fixed cost per op, op times from a
calibrated profile's lines where it measured the run's model, and the detection of a death
charged before its recovery."""
import dataclasses

import pytest

from conftest import run
from ftbench.config import HardwareConfig
from ftbench.costs import CostModel
from models.specs import resolve_model

TINY = resolve_model("gpt-tiny")
LINE = {"fixed_s": 1e-3, "per_block_s": 2e-3, "embedding_s": 5e-4, "head_s": 4e-3}
OPS = {"forward": LINE, "backward_input": {**LINE, "per_block_s": 3e-3}, "backward_weight": {**LINE, "per_block_s": 1e-3},
       "backward": {**LINE, "per_block_s": 3.5e-3}, "step": {"fixed_s": 2e-4, "per_param_s": 1e-9}}


def _model(seq_len=32, **hardware) -> CostModel:
    return CostModel(TINY, HardwareConfig(**{"name": "cpu", "peak_tflops": 0.1, **hardware}), 1, seq_len)


def test_without_overhead_or_measurements_op_times_are_flops_alone():
    plain, zero = _model(), _model(op_overhead_s=0.0)
    for first, last in ((True, False), (False, False), (False, True)):
        a, b = plain.stage((0, 2), first, last), zero.stage((0, 2), first, last)
        assert a == b and a.fused_backward_s == a.backward_input_s + a.backward_weight_s
    assert plain.op_source == "flops"


def test_each_op_pays_the_fixed_cost_once_and_the_fused_backward_once():
    plain, costly = _model(), _model(op_overhead_s=0.01)
    a, b = plain.stage((0, 2), False, False), costly.stage((0, 2), False, False)
    assert b.forward_s == pytest.approx(a.forward_s + 0.01)
    assert b.backward_input_s == pytest.approx(a.backward_input_s + 0.01)
    assert b.backward_weight_s == pytest.approx(a.backward_weight_s + 0.01)
    assert b.fused_backward_s == pytest.approx(a.fused_backward_s + 0.01)  # one op, not two


def test_a_measured_profile_gives_its_lines_for_the_model_it_measured():
    measured = {"model": "gpt-tiny", "microbatch_size": 1, "seq_len": 32, "ops": OPS}
    model = _model(measured=measured)
    assert model.op_source == "measured"
    middle, first, last = model.stage((1, 3), False, False), model.stage((0, 2), True, False), model.stage((2, 4), False, True)
    assert middle.forward_s == pytest.approx(1e-3 + 2 * 2e-3)
    assert first.forward_s == pytest.approx(1e-3 + 2 * 2e-3 + 5e-4)
    assert last.backward_input_s == pytest.approx(1e-3 + 2 * 3e-3 + 4e-3)
    assert middle.backward_weight_s == pytest.approx(1e-3 + 2 * 1e-3)
    assert middle.fused_backward_s == pytest.approx(1e-3 + 2 * 3.5e-3)
    assert model.optimizer_s(1000) == pytest.approx(2e-4 + 1e-6)
    # another sequence length was not measured: FLOPs (and the fixed cost), said so
    other = _model(seq_len=16, measured=measured)
    assert other.op_source == "flops" and other.stage((1, 3), False, False) != middle


def test_a_measured_profile_times_a_sim_run(tmp_path):
    """The sim's iteration follows the measured lines: fault-free 1F1B on pp 2 x dp 1 with 2
    micro-batches is F0 F0' F1 F1' ... on the critical path; with every line doubled it takes
    twice as long (links aside), and the summary says which op times it used."""
    measured = {"model": "gpt-tiny", "microbatch_size": 1, "seq_len": 32, "ops": OPS}
    doubled = {kind: {k: 2 * v for k, v in line.items()} for kind, line in OPS.items()}
    setup = ("backend=sim", "model=gpt-tiny", "hardware=cpu", "cluster.pp=2", "cluster.dp=1", "train.microbatches=2",
             "train.iterations=2", "strategy=none", "failures=none", "hardware.link_latency_us=0",
             "hardware.intra_node_gbps=1e9", "hardware.inter_node_gbps=1e9", "report.gantt=false")
    once = run(tmp_path / "once", *setup, f"+hardware.measured={_yaml(measured)}")
    twice = run(tmp_path / "twice", *setup, f"+hardware.measured={_yaml({**measured, 'ops': doubled})}")
    assert once["op_times"] == twice["op_times"] == "measured"
    assert twice["iteration_time_s"] == pytest.approx(2 * once["iteration_time_s"], rel=1e-6)


def test_detection_is_charged_before_a_failures_recovery(tmp_path):
    setup = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "strategy=checkpoint", "strategy.every=10",
             "train.iterations=30", "failures=scripted", "failures.events=[{iteration:15,node:3}]",
             "report.gantt=false", "report.check_fault_free=false")
    (base,) = run(tmp_path / "base", *setup)["recoveries"]
    (slow,) = run(tmp_path / "slow", *setup, "hardware.detection_s=2.5")["recoveries"]
    assert "detection_s" not in base and slow["detection_s"] == 2.5
    assert slow["recovery_s"] == pytest.approx(base["recovery_s"] + 2.5)


def _yaml(value) -> str:
    """A Hydra override value for a nested dict."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def test_hardware_config_has_the_measured_fields():
    names = {f.name for f in dataclasses.fields(HardwareConfig)}
    assert {"op_overhead_s", "detection_s", "measured", "provenance"} <= names


def test_a_local_restart_on_a_measured_profile_is_charged_its_measured_restart(tmp_path):
    """One process cannot restart itself: on a profile `ftbench calibrate` measured
    (`provenance`), a RestartJob rebuilds every worker in place and the wall clock is charged
    the rest of the profile's restart; on an assumed profile nothing is charged."""
    from conftest import LOCAL

    setup = (*LOCAL, "hardware=cpu", "strategy=checkpoint", "strategy.every=2", "cluster.pp=2", "cluster.dp=1",
             "train.iterations=4", "failures.events=[{iteration:3,node:1}]")
    assumed = run(tmp_path / "assumed", *setup)
    measured = run(tmp_path / "measured", *setup, "hardware.restart_s=7.5", "+hardware.provenance={host:here}")
    assert assumed["status"] == measured["status"] == "ok"
    assert "charged_restart_s" not in assumed["recoveries"][0]
    (recovery,) = measured["recoveries"]
    assert 7.0 < recovery["charged_restart_s"] <= 7.5  # less the in-place rebuild, measured
    assert recovery["recovery_s"] >= recovery["charged_restart_s"]
    assert measured["time_s"] - measured["productive_s"] >= recovery["charged_restart_s"]


def test_workers_sharing_cores_take_at_least_their_busy_time_over_the_cores(tmp_path):
    """hardware.cores: a job on one machine whose workers share its cores (local: one process,
    1) takes at least its workers' busy time over the cores; null leaves the makespan."""
    setup = ("backend=sim", "model=gpt-tiny", "hardware=cpu", "cluster.pp=2", "cluster.dp=2", "train.microbatches=4",
             "train.iterations=2", "strategy=none", "failures=none", "report.gantt=false")
    free = run(tmp_path / "free", *setup)
    one = run(tmp_path / "one", *setup, "hardware.cores=1")
    many = run(tmp_path / "many", *setup, "hardware.cores=64")
    busy = free["iteration_time_s"] * 4 * (1 - free["bubble_fraction"])  # the 4 workers' busy time
    assert one["iteration_time_s"] == pytest.approx(busy)
    assert one["iteration_time_s"] > free["iteration_time_s"] == many["iteration_time_s"]
    assert one["time_s"] == pytest.approx(2 * one["iteration_time_s"])
    bad = run(tmp_path / "bad", *setup, "hardware.cores=0")
    assert bad["status"] == "error" and "hardware.cores" in bad["error"]


@pytest.mark.parametrize("cores", [None, 2])
def test_a_checkpoint_pays_each_files_fixed_cost_and_one_disk_per_machine(cores):
    """A FILE save: each stage's shard is a file (its fixed cost, hardware.checkpoint_file_s,
    plus its bytes over storage_gbps) and the manifest one file more. Nodes write their own
    shards at once (the slowest counts); a job on one machine (hardware.cores) writes every
    shard to its one disk. A profile without the fixed cost gives what it always gave."""
    from ftbench.actions import FILE
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.plan import checkpoint_writers
    from ftbench.recovery_costs import _stage_bytes, save_cost

    base = ["backend=sim", "model=gpt-tiny", "hardware=cpu", "cluster.pp=2", "cluster.dp=2"]
    plain = RunContext.from_config(compose(base))
    plan = plain.grid_plan(2, 2, 1)
    writers = checkpoint_writers(plan)
    shard = {s: _stage_bytes(plan, next(p for p, t in plan.holds[w] if t == s), s, plain.cost_model)
             for s, w in writers.items()}
    storage = plain.cost_model.hw.storage_gbps * 1e9
    assert save_cost(FILE, plan, plain.cost_model).stall_s == max(shard.values()) / storage
    overrides = base + ["hardware.checkpoint_file_s=0.01"] + ([f"hardware.cores={cores}"] if cores else [])
    ctx = RunContext.from_config(compose(overrides))
    stall = save_cost(FILE, plan, ctx.cost_model).stall_s
    if cores is None:  # two nodes write one shard each, at once; then the manifest
        assert stall == pytest.approx(0.01 + max(shard.values()) / storage + 0.01)
    else:  # one disk: both shards and the manifest, one after another
        assert stall == pytest.approx(3 * 0.01 + sum(shard.values()) / storage)


@pytest.mark.parametrize("cores", [None, 2])
def test_a_restore_pays_each_files_fixed_cost_read_back_and_one_disk_per_machine(cores):
    """A FILE restore: each node reads its workers' shards (bytes over storage_gbps, plus each
    file's read-back cost, hardware.checkpoint_load_file_s) and the manifest; a job on one
    machine (hardware.cores) reads the checkpoint's files once from its one disk. A profile
    without the fixed cost and without `cores` gives what it always gave."""
    from ftbench.actions import FILE, RestoreCheckpoint
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.plan import checkpoint_writers
    from ftbench.recovery_costs import _stage_bytes, action_seconds

    base = ["backend=sim", "model=gpt-tiny", "hardware=a100-80gb", "cluster.pp=2", "cluster.dp=2"]
    plain = RunContext.from_config(compose(base))
    plan = plain.grid_plan(2, 2, 1)
    shard = {s: _stage_bytes(plan, next(p for p, t in plan.holds[w] if t == s), s, plain.cost_model)
             for s, w in checkpoint_writers(plan).items()}
    storage = plain.cost_model.hw.storage_gbps * 1e9
    restore = RestoreCheckpoint(FILE)
    assert action_seconds(restore, plan, plan, plain.cost_model) == max(shard.values()) / storage
    overrides = base + ["hardware.checkpoint_load_file_s=0.01"] + ([f"hardware.cores={cores}"] if cores else [])
    ctx = RunContext.from_config(compose(overrides))
    seconds = action_seconds(restore, plan, plan, ctx.cost_model)
    if cores is None:  # one worker per node: its stage's file and the manifest, every node at once
        assert seconds == pytest.approx(2 * 0.01 + max(shard.values()) / storage)
    else:  # one disk: each stage's file once, and the manifest
        assert seconds == pytest.approx(3 * 0.01 + sum(shard.values()) / storage)
    bad = RunContext.from_config  # a negative cost is refused, naming the setting
    with pytest.raises(Exception, match="checkpoint_load_file_s"):
        bad(compose(base + ["hardware.checkpoint_load_file_s=-1"]))
