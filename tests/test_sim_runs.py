"""Whole simulated runs: outputs, OOM as a result, failures, time limits, memoisation."""
import json
import math

import pytest

from conftest import compose, run
from ftbench.context import RunContext
from ftbench.metrics import SUMMARY_KEYS, read_metrics

SIM = ("backend=sim", "strategy=none", "failures=none")  # the default job is local; these are simulator runs
MEDIUM = (*SIM, "model=gpt3-medium", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2", "train.microbatches=8")


def test_fault_free_run_writes_the_contract(tmp_path, run_config):
    s = run_config(*MEDIUM, "train.iterations=50")
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == "ok" and set(SUMMARY_KEYS) <= set(on_disk)
    assert s["iterations"] == 50 and s["samples"] == 50 * 16
    assert s["time_s"] == pytest.approx(50 * s["iteration_time_s"])
    assert s["throughput"] == pytest.approx(s["samples"] / s["time_s"])
    assert s["ettr"] == 1.0 and s["productive_s"] == pytest.approx(s["time_s"], rel=1e-12)  # no failure, no checkpoint
    assert len(s["peak_memory_bytes"]) == 8
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    events = [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert events == ["start", "iterations", "end"]


def test_gpt3_6_7b_on_one_40gb_gpu_is_an_oom_result(run_config):
    s = run_config(*SIM, "model=gpt3-6.7b", "hardware=a100-40gb", "cluster.pp=1", "cluster.dp=1")
    assert s["status"] == "oom"
    assert "hardware=a100-40gb" in s["error"] and "cluster.pp" in s["error"]
    # 16 bytes per parameter of Adam mixed-precision state alone is ~107 GB
    assert s["peak_memory_bytes"][0] > 16 * 6.6e9
    assert s["iterations"] == 0


def test_more_stages_fit_where_one_does_not(run_config):
    s = run_config(*SIM, "model=gpt3-6.7b", "hardware=a100-80gb", "cluster.pp=8", "cluster.dp=1",
                   "train.iterations=3")
    assert s["status"] == "ok" and max(s["peak_memory_bytes"]) < 80e9


def test_a_failure_ends_a_run_without_fault_tolerance(tmp_path, run_config):
    s = run_config(*MEDIUM, "failures=scripted", "failures.events=[{iteration:7,node:5}]", "train.iterations=20")
    assert s["status"] == "unrecoverable" and s["iterations"] == 7 and s["failures"] == 1
    assert "node 5" in s["error"] and "iteration 7" in s["error"]
    # the failure strikes half-way through iteration 7: that half iteration is spent and lost
    assert s["time_s"] == pytest.approx(7.5 * s["iteration_time_s"])
    fail = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "fail"]
    assert fail == [{"event": "fail", "node": 5, "time_s": pytest.approx(s["time_s"]), "iteration": 7}]


def test_failure_of_an_idle_standby_node_changes_nothing(run_config):
    s = run_config(*MEDIUM, "cluster.nodes=10", "failures=scripted",
                   "failures.events=[{iteration:2,node:9}]", "train.iterations=5")
    assert s["status"] == "ok" and s["iterations"] == 5 and s["failures"] == 1


def test_timed_failures_stop_at_the_first_in_use_failure(run_config):
    s = run_config(*MEDIUM, "failures=interval", "failures.every=1m", "train.iterations=100000")
    assert s["status"] == "unrecoverable"
    assert s["time_s"] == pytest.approx(60.0)
    assert s["iterations"] == math.floor(60.0 / s["iteration_time_s"])


def test_max_hours_stops_the_run_with_whole_iterations(run_config):
    s = run_config(*MEDIUM, "train.iterations=1000000000", "train.max_hours=2")
    assert s["status"] == "ok"
    assert s["iterations"] == math.floor(7200 / s["iteration_time_s"])
    assert s["time_s"] <= 7200


def test_long_runs_jump_and_memoise(tmp_path, run_config):
    s = run_config(*MEDIUM, "train.iterations=1000000000", "train.max_hours=720", "report.gantt=false")
    assert s["plans_simulated"] == 1 and s["iterations"] > 100_000
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert len(lines) == 3  # one segment covers every identical iteration
    assert lines[1]["count"] == s["iterations"]


def test_balanced_partition_gives_the_lm_head_stage_fewer_layers():
    ctx = RunContext.from_config(compose(*MEDIUM))
    parts = ctx.cost_model.balanced_partition(4)
    sizes = [e - s for s, e in parts]
    assert sum(sizes) == 24 and parts[0][0] == 0 and parts[-1][1] == 24
    assert sizes[-1] < sizes[1]  # the LM head costs about as much as a few layers
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_iteration_time_follows_the_cost_model():
    """A single-stage, single-replica plan's iteration is m x (F + B + W) + the optimizer step."""
    ctx = RunContext.from_config(compose(*SIM, "model=gpt3-medium", "cluster.pp=1", "cluster.dp=1",
                                         "train.microbatches=4", "hardware=a100-80gb"))
    from ftbench.costs import PlanCosts
    from ftbench.sim.simulator import simulate

    plan = ctx.grid_plan(1, 1)
    spec, hw = ctx.spec, ctx.hardware
    b, s = 1, spec.seq_len
    flops = spec.layers * (spec.layer_forward_flops(b, s) + spec.layer_backward_input_flops(b, s)
                           + spec.layer_backward_weight_flops(b, s)) + 3 * spec.head_forward_flops(b, s)
    compute = 4 * flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    optimizer = 28 * (spec.parameters + spec.vocab * spec.hidden) / (hw.hbm_gbps * 1e9)
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    assert result.iteration_time == pytest.approx(compute + optimizer, rel=1e-9)


def test_a_plan_that_drops_a_microbatch_is_rejected_before_simulation():
    from ftbench.schedule import F, Op, ScheduleError
    from ftbench.sim.cache import SimCache

    ctx = RunContext.from_config(compose(*MEDIUM))
    plan = ctx.grid_plan(4, 2)
    plan.schedule.ops[5].remove(Op(F, 1, 3, 1))  # worker 5 = pipeline 1, stage 1
    with pytest.raises(ScheduleError, match=r"missing F\(s1,m3,p1\)"):
        SimCache(ctx.cost_model)(plan)


def test_wandb_sink_gets_the_sweep_group_the_strategy_and_every_metrics_line(tmp_path, monkeypatch):
    import ftbench.run as run_module

    calls = {}

    class Recorder:
        def __init__(self, cfg, run_dir, name, job_type, group, config):
            calls.update(job_type=job_type, group=group, config=config, logged=[])

        def log(self, record):
            calls["logged"].append(record)

        def finish(self, summary, config_error=False):
            calls.update(summary=summary, config_error=config_error)

    monkeypatch.setattr(run_module, "WandbSink", Recorder)
    cfg = compose(*MEDIUM, "report.progress=false", "report.gantt=false")
    summary = run_module.execute(cfg, tmp_path, wandb_group="20-00-00-abcd", echo=lambda *_: None)
    assert calls["job_type"] == "none" and calls["group"] == "20-00-00-abcd"
    assert calls["config"]["model"]["name"] == "gpt3-medium"
    assert calls["logged"] == read_metrics(tmp_path / "metrics.jsonl")
    assert calls["summary"]["status"] == summary["status"] == "ok" and not calls["config_error"]


@pytest.mark.parametrize("crash", [RuntimeError("bug in a strategy"), KeyboardInterrupt()])
def test_a_crash_keeps_metrics_and_summary(tmp_path, monkeypatch, crash):
    import ftbench.run as run_module

    def boom(*args, **kwargs):
        raise crash

    import ftbench.assembly.sim as sim_run

    monkeypatch.setattr(sim_run, "run_loop", boom)
    with pytest.raises(type(crash)):
        run_module.execute(compose(*MEDIUM, "report.progress=false"), tmp_path, echo=lambda *_: None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    interrupted = isinstance(crash, KeyboardInterrupt)
    assert summary["status"] == ("interrupted" if interrupted else "error") and summary["error"]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["event"] == "error"
    assert (tmp_path / "error.txt").exists() == isinstance(crash, RuntimeError)


def kept_seconds(lines: list[dict]) -> float:
    """productive_s replayed from metrics.jsonl: every iteration index, at the time of the last
    line that ran it (a rollback's redo comes after the lost run, so the last line is the kept one)."""
    kept = {}
    for line in lines:
        if line["event"] == "iterations":  # sim: a segment of identical iterations
            kept.update(dict.fromkeys(range(line["first"], line["last"] + 1), line["iteration_time_s"]))
        elif line["event"] == "iteration":  # local, dist: one iteration, measured
            kept[line["iteration"]] = line["iteration_s"]
        elif line["event"] == "recovery":
            kept = {i: t for i, t in kept.items() if i < line["restored_iteration"]}
    return math.fsum(kept.values())


TWO_FAILURES = ("failures=scripted", "failures.events=[{iteration:9,node:5},{iteration:22,node:2}]")


@pytest.mark.parametrize("strategy,extra", [
    ("checkpoint", ("strategy.every=4",)),
    ("checkfreq", ("strategy.every=1", "hardware.storage_gbps=0.05")),  # falls back past a snapshot in flight
    ("elastic-horovod", ()), ("varuna", ()), ("bamboo", ()), ("oobleck", ()), ("recycle", ()),
])
def test_ettr_counts_each_kept_iteration_once(tmp_path, run_config, strategy, extra):
    """ETTR = productive_s / time_s, where productive_s is the time of the iterations the final
    model holds (replayed from metrics.jsonl), at the plan they ran on; lower than fault-free."""
    # elastic-horovod keeps no copy of a stage whose every replica failed: one failure only
    failures = ("failures=scripted", "failures.events=[{iteration:9,node:5}]") if strategy == "elastic-horovod" \
        else TWO_FAILURES
    s = run_config(*MEDIUM, f"strategy={strategy}", *extra, *failures, "train.iterations=30", "report.gantt=false")
    assert s["status"] == "ok" and s["failures"] == len(s["recoveries"]) >= 1, s["error"]
    assert s["productive_s"] == pytest.approx(kept_seconds(read_metrics(tmp_path / "metrics.jsonl")), rel=1e-12)
    assert s["ettr"] == round(s["productive_s"] / s["time_s"], 6)
    fault_free = run(tmp_path / "fault-free", *MEDIUM, f"strategy={strategy}", *extra, "train.iterations=30",
                     "report.gantt=false")
    assert 0 < s["ettr"] < fault_free["ettr"] <= 1.0
