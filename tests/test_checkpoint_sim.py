"""The checkpoint family on the simulator: costs come from the cost model and the hardware
profile, and time is accounted exactly."""
import json
import math

import pytest

from conftest import compose
from ftbench.context import RunContext
from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM
from ftbench.strategies.checkpoint import young_daly_interval_s

SIM = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2",
       "train.microbatches=8", "report.gantt=false")
FAIL_25 = ("failures=scripted", "failures.events=[{iteration:25,node:5}]", "train.iterations=50")


def metrics(tmp_path, event):
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == event]


def test_checkpoint_restart_time_is_accounted_exactly(tmp_path, run_config):
    s = run_config(*SIM, *FAIL_25, "strategy=checkpoint", "strategy.every=10")
    assert s["status"] == "ok" and s["iterations"] == 50
    r = s["recoveries"][0]
    assert (r["iteration"], r["restored_iteration"], r["lost_iterations"]) == (25, 20, 5)
    assert r["actions"] == ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    T = s["iteration_time_s"]
    stall = metrics(tmp_path, "checkpoint_interval")[0]["stall_s"]
    # 25 iterations, the failure half-way through the 26th, recovery, 30 redone/remaining;
    # checkpoints before iteration 0 and after 10, 20 (twice: before and after the failure), 30, 40.
    expected = 25 * T + 0.5 * T + r["recovery_s"] + 30 * T + 5 * stall
    assert s["time_s"] == pytest.approx(expected, rel=1e-9)


def test_ettr_of_checkpoint_restart_by_hand(tmp_path, run_config):
    """ETTR from the summary's own numbers: the 50 iterations of the final model count, each
    once; the 5 lost ones, the half iteration the failure cut short, the recovery and the
    checkpoint stalls do not."""
    s = run_config(*SIM, *FAIL_25, "strategy=checkpoint", "strategy.every=10")
    T, stall = s["iteration_time_s"], metrics(tmp_path, "checkpoint_interval")[0]["stall_s"]
    (r,) = s["recoveries"]
    assert (s["iterations"], s["lost_iterations"], s["checkpoints"]) == (50, 5, 5)  # saves after 0, 10, 20, 30, 40
    time_s = (s["iterations"] + s["lost_iterations"] + 0.5) * T + r["recovery_s"] + s["checkpoints"] * stall
    assert s["time_s"] == pytest.approx(time_s, rel=1e-9)
    assert s["productive_s"] == pytest.approx(s["iterations"] * T, rel=1e-12)
    assert s["ettr"] == pytest.approx(50 * T / time_s, abs=1e-6) and s["ettr"] == round(s["ettr"], 6)
    assert 0.07 < s["ettr"] < 0.09  # a minute's recovery against 6 s of training


def test_recovery_costs_follow_the_hardware_profile(tmp_path):
    from conftest import run

    base = run(tmp_path / "a", *SIM, *FAIL_25, "strategy=checkpoint", "cluster.spares=0")["recoveries"][0]
    slow_restart = run(tmp_path / "b", *SIM, *FAIL_25, "strategy=checkpoint", "cluster.spares=0",
                       "hardware.restart_s=100")["recoveries"][0]
    slow_disk = run(tmp_path / "c", *SIM, *FAIL_25, "strategy=checkpoint", "cluster.spares=0",
                    "hardware.storage_gbps=1")["recoveries"][0]
    spare = run(tmp_path / "d", *SIM, *FAIL_25, "strategy=checkpoint", "cluster.spares=1")["recoveries"][0]
    assert slow_restart["recovery_s"] - base["recovery_s"] == pytest.approx(40.0)
    assert base["recovery_s"] - spare["recovery_s"] == pytest.approx(45.0)  # no standby: wait replacement_s
    ctx = RunContext.from_config(compose(*SIM))
    plan = ctx.grid_plan(4, 2)
    # Each node reads its own stage's state: the largest stage over 2 GB/s, then over 1 GB/s.
    largest = max(CHECKPOINT_BYTES_PER_PARAM * ctx.cost_model.stage(plan.layers(0, s), s == 0, s == 3).params
                  for s in range(4))
    assert slow_disk["recovery_s"] - base["recovery_s"] == pytest.approx(largest / 1e9 * (1 / 1 - 1 / 2))


def test_young_daly_interval_from_mtbf_and_modelled_cost(tmp_path, run_config):
    s = run_config(*SIM, "failures=none", "strategy=checkpoint", "strategy.every=null", "strategy.mtbf_hours=500",
                   "train.iterations=100")
    interval = metrics(tmp_path, "checkpoint_interval")[0]
    T = s["iteration_time_s"]
    expected = round(young_daly_interval_s(interval["stall_s"], 500 * 3600 / 8) / T)
    assert interval["every"] == expected > 1


def test_young_daly_by_default_from_the_failure_models_rate(tmp_path):
    """strategy.every=null (the default) is Young/Daly with the failure model's M: a script's
    failures over train.iterations (one in 50 iterations here), none expected: the run's length."""
    from conftest import run

    run(tmp_path / "script", *SIM, *FAIL_25, "strategy=checkpoint")
    chosen = metrics(tmp_path / "script", "checkpoint_interval")[0]
    T = json.loads((tmp_path / "script" / "summary.json").read_text())["iteration_time_s"]
    M, C = 50 * T, chosen["stall_s"]
    assert chosen["every"] == max(1, round((math.sqrt(2 * C * M) - C) / T)), (chosen, T)
    run(tmp_path / "none", *SIM, "failures=none", "strategy=checkpoint", "train.iterations=30")
    assert metrics(tmp_path / "none", "checkpoint_interval")[0]["every"] == 30


def test_checkfreq_snapshots_stall_less_and_respect_the_bound(tmp_path):
    from conftest import run

    run(tmp_path / "cf", *SIM, "failures=none", "strategy=checkfreq", "train.iterations=100")
    run(tmp_path / "ck", *SIM, "failures=none", "strategy=checkpoint", "train.iterations=100")
    cf = metrics(tmp_path / "cf", "checkpoint_interval")[0]
    ck = metrics(tmp_path / "ck", "checkpoint_interval")[0]
    assert cf["stall_s"] < ck["stall_s"] and cf["persist_s"] > 0
    T = json.loads((tmp_path / "cf" / "summary.json").read_text())["iteration_time_s"]
    assert cf["stall_s"] / (cf["every"] * T) <= 0.035
    assert cf["every"] * T >= cf["persist_s"]  # the next snapshot never waits for a persist


def test_checkfreq_failure_during_a_persist_falls_back(tmp_path, run_config):
    # every=1 with a persist longer than an iteration: the newest snapshot is not on storage yet.
    s = run_config(*SIM, *FAIL_25, "strategy=checkfreq", "strategy.every=1", "hardware.storage_gbps=0.05")
    r = s["recoveries"][0]
    interval = metrics(tmp_path, "checkpoint_interval")[0]
    assert interval["persist_s"] > s["iteration_time_s"]
    assert r["restored_iteration"] < 25 and r["lost_iterations"] >= 1


def test_elastic_horovod_shrinks_without_replacement(tmp_path, run_config):
    s = run_config(*SIM, *FAIL_25, "strategy=elastic-horovod")
    r = s["recoveries"][0]
    assert r["actions"] == ["Rendezvous", "RestoreCheckpoint"] and r["restored_iteration"] == 24
    lines = metrics(tmp_path, "iterations")
    assert lines[-1]["iteration_time_s"] > lines[0]["iteration_time_s"]  # one pipeline does the whole batch


def test_varuna_morphs_into_a_shape_that_fits_the_survivors(tmp_path, run_config):
    s = run_config(*SIM, *FAIL_25, "strategy=varuna", "strategy.every=4")
    assert s["status"] == "ok"
    r = s["recoveries"][0]
    assert r["actions"] == ["RestartJob", "RestoreCheckpoint"] and r["restored_iteration"] == 24
    assert metrics(tmp_path, "iterations")[-1]["iteration_time_s"] != s["iteration_time_s"]


def test_poisson_failures_over_days(run_config):
    s = run_config(*SIM, "failures=poisson", "failures.mtbf_hours=50", "strategy=checkpoint",
                   "strategy.every=null", "train.iterations=1000000000", "train.max_hours=240")
    assert s["status"] == "ok" and s["failures"] >= 5 and s["lost_iterations"] > 0
    assert s["time_s"] <= 240 * 3600 and all(r["recovery_s"] > 0 for r in s["recoveries"])


def test_elastic_horovod_grows_back_when_the_node_returns(tmp_path, run_config):
    s = run_config(*SIM, "failures=scripted", "failures.events=[{iteration:25,node:5},{iteration:30,node:5,kind:join}]",
                   "train.iterations=50", "strategy=elastic-horovod")
    shrink, grow = s["recoveries"]
    assert grow["actions"] == ["Rendezvous", "SyncFromPeers"] and grow["lost_iterations"] == 0
    assert grow["recovery_s"] > 0  # the new pipeline's state crosses the network
    lines = metrics(tmp_path, "iterations")
    assert lines[-1]["iteration_time_s"] == pytest.approx(lines[0]["iteration_time_s"])


def test_varuna_morphs_up_when_nodes_return(tmp_path, run_config):
    s = run_config(*SIM, "failures=scripted", "failures.events=[{iteration:25,node:5},{iteration:30,node:5,kind:join}]",
                   "train.iterations=50", "strategy=varuna")
    shrink, grow = s["recoveries"]
    assert grow["actions"] == ["SaveCheckpoint", "RestartJob", "RestoreCheckpoint"]
    assert grow["lost_iterations"] == 0 and grow["shape"] == "pp=4 dp=2"


def test_young_daly_takes_the_node_mtbf_from_the_jobs_mtbf(tmp_path):
    """failures.job_mtbf_hours=10 on 8 nodes is a node MTBF of 80 h: the same interval as
    failures.mtbf_hours=80, not a setting error."""
    from conftest import run

    def interval(folder, *failures):
        summary = run(tmp_path / folder, "backend=sim", "model=gpt3-medium", "strategy=checkpoint",
                      "strategy.every=null", "failures=poisson", *failures, "train.max_hours=1",
                      "train.iterations=1000000")
        assert summary["status"] == "ok", summary["error"]
        lines = [json.loads(x) for x in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]
        return next(e["every"] for e in lines if e["event"] == "checkpoint_interval")

    by_job = interval("job", "failures.mtbf_hours=null", "failures.job_mtbf_hours=10")
    assert by_job == interval("node", "failures.mtbf_hours=80") != interval("other", "failures.mtbf_hours=20")
