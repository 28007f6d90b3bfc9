"""Swift (strategy=swift): undo, replica copies, boundary logs and replay, parallel recovery,
selective logging, on `local` (real tensors, real log files) and `sim`.

Every failure really destroys the failed workers' state (LocalEngine.destroy); the state
comes back only through Swift's own actions: a copy from a live replica, or the failed
group's checkpoint replayed on the logged boundary tensors. The replay repeats the original
arithmetic, so with no undone step it trains the fault-free model bit for bit; once a step
was undone (a failure after some stages stepped) or the replay was split (parallel
recovery), to float tolerance.
"""
import math

import pytest
import torch

from conftest import LOCAL, compose, run, seeded_failures
from ftbench.engine.boundary_log import BoundaryLog
from ftbench.equivalence import compare, load_state
from ftbench.errors import ConfigError
from ftbench.metrics import read_metrics

SWIFT = ("strategy=swift", "strategy.every=4", "failures=scripted")
DP1 = ("cluster.pp=4", "cluster.dp=1")  # no replica: every failure replays from the logs
DP2 = ("cluster.pp=4", "cluster.dp=2")  # a live replica of every stage: copies
CHECKED = ("report.check_fault_free=true",)


def _events(*events: str) -> str:
    return "failures.events=[" + ",".join(events) + "]"


def _reference(tmp_path, *setup) -> dict:
    ref = run(tmp_path / "fault-free", *LOCAL, *setup, "strategy=none", "failures=none")
    assert ref["status"] == "ok", ref["error"]
    return ref


def _exactly_equal(a: dict, b: dict) -> bool:
    sa, sb = load_state(a["final_state"]), load_state(b["final_state"])
    return a["losses"] == b["losses"] and set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _actions(summary) -> list[list[str]]:
    return [r["actions"] for r in summary["recoveries"]]


# -- logging-based recovery ---------------------------------------------------------------

def test_at_its_default_interval_a_replay_starts_from_the_newest_young_daly_checkpoint(tmp_path):
    """strategy.every=null (the default): the checkpoint interval is Young/Daly's, from the
    measured iteration and save and the script's one failure in 10 iterations; the replay
    starts from the newest multiple of it and trains the fault-free model bit for bit."""
    s = run(tmp_path / "swift", *LOCAL, "strategy=swift", "failures=scripted", *DP1, _events("{iteration:7,node:2}"))
    assert s["status"] == "ok", s["error"]
    every = next(r["every"] for r in read_metrics(tmp_path / "swift" / "metrics.jsonl")
                 if r["event"] == "checkpoint_interval")
    assert s["checkpoints"] == 1 + (10 - 1) // every  # the initial one, then every multiple before the last
    assert _actions(s) == [["WaitForReplacement", "UndoSteps", "Rendezvous", "ReplayLogs"]]
    assert s["lost_iterations"] == 0
    assert _exactly_equal(s, _reference(tmp_path, *DP1))


def test_a_replay_from_the_logs_trains_the_fault_free_model_bit_for_bit(tmp_path):
    """dp = 1: node 2 fails half-way into iteration 6 (before any step); its stage is reloaded
    from the checkpoint of iteration 4 and iterations 4 and 5 are replayed on the logs."""
    s = run(tmp_path / "swift", *LOCAL, *SWIFT, *DP1, _events("{iteration:6,node:2}"))
    assert s["status"] == "ok", s["error"]
    assert _actions(s) == [["WaitForReplacement", "UndoSteps", "Rendezvous", "ReplayLogs"]]
    assert s["recoveries"][0]["lost_iterations"] == 0 and s["lost_iterations"] == 0
    assert s["log_peak_bytes"] > 0 and s["log_files"] > 0
    assert not (tmp_path / "swift" / "swift-logs").exists()  # the run is over: its logs are removed
    assert _exactly_equal(s, _reference(tmp_path, *DP1))


def test_the_replay_reads_the_logged_tensors(tmp_path, monkeypatch):
    """A control: with every logged tensor perturbed slightly (the training itself untouched),
    the replayed stage trains another model, so the replay does read the logs."""
    record = BoundaryLog.record

    def perturbed(self, iteration, src, key, tensor):
        record(self, iteration, src, key, tensor * (1 + 1e-3))

    monkeypatch.setattr(BoundaryLog, "record", perturbed)
    s = run(tmp_path / "swift", *LOCAL, *SWIFT, *DP1, _events("{iteration:6,node:2}"))
    assert s["status"] == "ok", s["error"]
    ref = _reference(tmp_path, *DP1)
    assert compare(s["losses"], load_state(s["final_state"]), ref["losses"], load_state(ref["final_state"]))


@pytest.mark.parametrize("setup,events", [
    # a node holds two stages: the pair replays, the edge between them needs no log
    (("cluster.pp=4", "cluster.dp=1", "cluster.gpus_per_node=2"), ("{iteration:6,node:1}", "{iteration:8,node:0}")),
    # every replica of a stage on the failed node (placement=stage): its replicas replay together
    (("cluster.pp=2", "cluster.dp=2", "cluster.gpus_per_node=2", "cluster.placement=stage"), ("{iteration:6,node:1}",)),
    # selective logging merged two nodes into one group: their edge is not logged, both replay
    (("cluster.pp=4", "cluster.dp=1", "strategy.log_budget_gb=0.0002"), ("{iteration:6,node:2}",)),
    # zero-bubble's split backward replays in its own order
    (("cluster.pp=4", "cluster.dp=1", "schedule=zb-h1"), ("{iteration:5,node:1}", "{iteration:7,node:3}")),
    # a failure right after a checkpoint: nothing to replay, only the checkpoint to load
    (("cluster.pp=4", "cluster.dp=1"), ("{iteration:4,node:0}",)),
], ids=["two stages a node", "every replica lost", "merged groups", "zb-h1", "at a checkpoint"])
def test_replays_of_every_shape_are_exact(tmp_path, setup, events):
    s = run(tmp_path / "swift", *LOCAL, *SWIFT, *setup, _events(*events))
    assert s["status"] == "ok", s["error"]
    assert all("ReplayLogs" in a for a in _actions(s)), _actions(s)
    plain = tuple(o for o in setup if not o.startswith("strategy."))
    assert _exactly_equal(s, _reference(tmp_path, *plain))


@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
@pytest.mark.parametrize("budget,logged,replayed", [(None, 3, 1), (0.0004, 3, 1), (0.0002, 1, 2)])
def test_selective_logging_trades_log_for_replay(budget, logged, replayed):
    """Under a smaller budget nodes share a logging group: fewer boundaries are logged, and a
    failure replays the failed node's whole group (gpt-tiny: one boundary's log over 4
    iterations is about 131 kB in the model)."""
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.failures import FailureEvent
    from ftbench.strategies import build_strategy

    cfg = compose(*LOCAL, *SWIFT, *DP1, *([f"strategy.log_budget_gb={budget}"] if budget else []))
    strategy = build_strategy(cfg.strategy, RunContext.from_config(cfg))
    cluster = Cluster.from_config(cfg.cluster)
    plan = strategy.plan(cluster.view())
    assert len(plan.logged) == logged
    cluster.fail(2)
    actions = strategy.on_event(FailureEvent(2, iteration=6), cluster.view(), 6).actions
    (replay,) = [a for a in actions if type(a).__name__ == "ReplayLogs"]
    assert 2 in replay.workers and len(replay.workers) == replayed
    assert (replay.since, replay.until) == (4, 6)


# -- failures after some stages stepped, replicas, seeded scripts --------------------------

@pytest.mark.parametrize("at", [0.9, 0.97, 0.999])
@pytest.mark.parametrize("setup", [DP1, DP2], ids=["logging", "replication"])
def test_a_failure_after_steps_trains_the_fault_free_model(tmp_path, setup, at):
    """Survivors that stepped undo it; the lost stage comes from a replica (dp 2) or a replay
    (dp 1); the run's own check compares with fault-free training."""
    s = run(tmp_path, *LOCAL, *SWIFT, *setup, *CHECKED, "train.iterations=8",
            _events(f"{{iteration:6,node:1,at:{at}}}"))
    assert s["status"] == "ok" and s["matches_fault_free"] is True, s["error"]
    (fail,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "fail"]
    if at >= 0.97:
        assert fail["stepped"] > 0 and fail["undone"] > 0, fail
    expected = "ReplayLogs" if setup is DP1 else "SyncFromPeers"
    assert _actions(s) == [["WaitForReplacement", "UndoSteps", "Rendezvous", expected]]


@pytest.mark.parametrize("setup,nodes,count", [(DP1, 4, 2), (DP2, 8, 3)], ids=["dp1", "dp2"])
@pytest.mark.parametrize("tag", ["swift-a", "swift-b"])
def test_seeded_random_failures_train_the_fault_free_model(tmp_path, setup, nodes, count, tag):
    s = run(tmp_path, *LOCAL, *SWIFT, *setup, *CHECKED, seeded_failures(f"{tag}-{nodes}", nodes, count, draw_at=True))
    assert s["status"] == "ok" and s["matches_fault_free"] is True, s["error"]
    assert s["failures"] == count


# -- parallel recovery ---------------------------------------------------------------------

def test_parallel_recovery_equals_the_serial_replay_to_float_tolerance(tmp_path):
    serial = run(tmp_path / "serial", *LOCAL, *SWIFT, *DP1, _events("{iteration:7,node:2}"))
    parallel = run(tmp_path / "parallel", *LOCAL, *SWIFT, *DP1, "strategy.parallel_recovery=2",
                   _events("{iteration:7,node:2}"))
    assert serial["status"] == parallel["status"] == "ok"
    a, b = load_state(serial["final_state"]), load_state(parallel["final_state"])
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the sum was split: not the same bits
    lines = [r for r in read_metrics(tmp_path / "parallel" / "metrics.jsonl") if r["event"] == "recovery"]
    assert lines and lines[0]["actions"][-1] == "ReplayLogs"


@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
def test_parallel_recovery_shortens_the_modelled_replay(tmp_path):
    """On sim, the replay's compute is shared by the helpers (each also loads the checkpoint)."""
    setup = ("backend=sim", "model=gpt3-medium", "cluster.pp=8", "cluster.dp=1", "train.iterations=200",
             "strategy=swift", "strategy.every=100", "failures=scripted", _events("{iteration:180,node:3}"),
             "report.gantt=false")
    serial = run(tmp_path / "serial", *setup)
    parallel = run(tmp_path / "parallel", *setup, "strategy.parallel_recovery=4")
    assert serial["status"] == parallel["status"] == "ok", (serial["error"], parallel["error"])
    assert parallel["recoveries"][0]["recovery_s"] < serial["recoveries"][0]["recovery_s"]


# -- logs: real, bounded, cleaned up ------------------------------------------------------

def test_a_checkpoint_deletes_the_logs_it_covers(tmp_path):
    log = BoundaryLog(tmp_path / "logs")
    for i in range(6):
        log.record(i, 1, ("act", 0, 0, 0), torch.full((4,), float(i)))
        log.record(i, 2, ("grad", 0, 0, 0), torch.full((4,), -float(i)))
        log.seal(i)
    log.wait()
    assert log.files_written == 12 and log.bytes_now == log.peak_bytes > 0
    assert torch.equal(log.read(2, 3, ("grad", 0, 0, 0)), torch.full((4,), -3.0))
    log.drop_before(4)
    kept = sorted(str(p.relative_to(tmp_path / "logs")) for p in (tmp_path / "logs").rglob("*.pt"))
    assert kept == ["worker1/iteration00000004.pt", "worker1/iteration00000005.pt",
                    "worker2/iteration00000004.pt", "worker2/iteration00000005.pt"]
    assert log.bytes_now == sum(p.stat().st_size for p in (tmp_path / "logs").rglob("*.pt"))
    assert log.bytes_now < log.peak_bytes
    log.record(6, 1, ("act", 0, 0, 0), torch.ones(4))
    log.discard_open()  # an abandoned iteration is never written
    log.seal(6)
    log.wait()
    assert not log.path(1, 6).exists()
    with pytest.raises(Exception, match="no log of worker 1 for iteration 2"):
        log.read(1, 2, ("act", 0, 0, 0))
    log.close(remove=True)
    assert not (tmp_path / "logs").exists()


def test_the_log_on_storage_is_bounded_by_the_checkpoint_interval(tmp_path):
    peaks = {}
    for every in (2, 6):
        s = run(tmp_path / str(every), *LOCAL, "strategy=swift", f"strategy.every={every}", *DP1, "failures=none",
                "train.iterations=12")
        assert s["status"] == "ok", s["error"]
        peaks[every] = s["log_peak_bytes"]
    # one iteration's log is the same in both: the peak grows with the iterations a checkpoint covers
    assert peaks[6] == pytest.approx(3 * peaks[2], rel=0.05)


def test_swift_keeps_less_beside_training_state_than_elastic_horovod(tmp_path):
    """Measured on local: Swift's host memory is one iteration's log on the sender until it is
    written; Elastic Horovod keeps a commit of its whole replica, CheckFreq a snapshot;
    checkpoint restart nothing. The device state (with the undo's gradient copy, which every
    strategy's engine keeps) is the same for all."""
    host, device = {}, {}
    for strategy in ("swift", "elastic-horovod", "checkfreq", "checkpoint"):
        s = run(tmp_path / strategy, *LOCAL, f"strategy={strategy}", "strategy.every=2", *DP2, "failures=none")
        assert s["status"] == "ok", s["error"]
        host[strategy], device[strategy] = s["peak_host_bytes_max"], max(s["peak_memory_bytes"])
    assert host["checkpoint"] == 0 < host["swift"] < host["elastic-horovod"]
    assert host["checkfreq"] > host["swift"]
    assert len(set(device.values())) == 1, device


@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
def test_on_sim_swift_extra_memory_is_below_elastic_horovods(tmp_path):
    """GPT-3 2.7B, pp 8 x dp 2: Swift's undo gradient (device) plus its log buffer (host)
    against Elastic Horovod's commit (host)."""
    setup = ("backend=sim", "model=gpt3-2.7b", "cluster.pp=8", "cluster.dp=2", "strategy.every=100",
             "train.iterations=50", "failures=none", "report.gantt=false")
    out = {st: run(tmp_path / st, *setup, f"strategy={st}") for st in ("swift", "elastic-horovod", "checkpoint")}
    assert all(s["status"] == "ok" for s in out.values())
    swift_extra = max(out["swift"]["peak_memory_bytes"]) - max(out["checkpoint"]["peak_memory_bytes"])
    assert swift_extra > 0
    assert swift_extra + out["swift"]["peak_host_bytes_max"] < out["elastic-horovod"]["peak_host_bytes_max"]


# -- bad settings ----------------------------------------------------------------------------

@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
@pytest.mark.parametrize("overrides,setting", [
    (("strategy.log_budget_gb=0.00000001",), "strategy.log_budget_gb"),  # below one iteration of a boundary
    (("strategy.log_budget_gb=0.0001",), "strategy.log_budget_gb"),  # every node merged into one group
    (("cluster.pp=2", "strategy.parallel_recovery=3"), "strategy.parallel_recovery"),  # nobody to share with
    (("strategy.parallel_recovery=0",), "strategy.parallel_recovery"),
    (("strategy.parallel_recovery=9",), "strategy.parallel_recovery"),  # more than the micro-batches
    (("cluster.gpus_per_node=4",), "cluster.gpus_per_node"),  # the whole pipeline on one node: nothing to log
    (("strategy.every=null", "strategy.log_budget_gb=50"), "strategy.every"),  # selective logging plans with it
])
def test_bad_settings_name_the_setting(tmp_path, overrides, setting):
    s = run(tmp_path, *LOCAL, "strategy=swift", "cluster.pp=4", "cluster.dp=1", *overrides)
    assert s["status"] == "error" and setting in s["error"], s["error"]


def test_a_config_error_is_raised_before_anything_runs():
    from ftbench.context import RunContext
    from ftbench.strategies import build_strategy

    cfg = compose(*LOCAL, "strategy=swift", "strategy.parallel_recovery=0")
    with pytest.raises(ConfigError) as err:
        build_strategy(cfg.strategy, RunContext.from_config(cfg))
    assert err.value.setting == "strategy.parallel_recovery"


# -- sim ---------------------------------------------------------------------------------------

@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
def test_on_sim_replay_grows_with_the_iterations_since_the_checkpoint(tmp_path):
    """A failure 90 iterations past the checkpoint replays more than one 10 past it, and both
    cost less than checkpoint restart's redo of the same iterations after its restart."""
    def recovery(name, strategy, iteration):
        s = run(tmp_path / name, "backend=sim", "model=gpt3-medium", "cluster.pp=8", "cluster.dp=1",
                "train.iterations=300", f"strategy={strategy}", "strategy.every=100", "failures=scripted",
                _events(f"{{iteration:{iteration},node:3}}"), "report.gantt=false")
        assert s["status"] == "ok", s["error"]
        return s

    early, late = recovery("early", "swift", 110), recovery("late", "swift", 190)
    assert late["recoveries"][0]["recovery_s"] > early["recoveries"][0]["recovery_s"]
    restart = recovery("restart", "checkpoint", 190)
    assert late["time_s"] < restart["time_s"]
    free = run(tmp_path / "free", "backend=sim", "model=gpt3-medium", "cluster.pp=8", "cluster.dp=1",
               "train.iterations=300", "strategy=swift", "strategy.every=100", "failures=none", "report.gantt=false")
    assert late["time_s"] > free["time_s"]  # a failure never makes training faster
    assert math.isclose(free["iteration_time_s"], late["iteration_time_s"])


@pytest.mark.parametrize("events", [
    ("{iteration:3,node:1}",),
    ("{iteration:3,node:2,at:0.97}", "{iteration:6,node:0}"),
    ("{iteration:3,node:3}", "{time_s:0.0035,node:1}"),  # a time-based failure, maybe during the replay
], ids=["one", "two, after steps", "time-based"])
def test_sim_and_local_agree_on_the_logging_path(tmp_path, events):
    """The conformance test's check (tests/test_conformance.py) on Swift's replay path: the
    same events, actions, restored iterations, plans and modelled times on sim and local."""
    from test_conformance import SETUP, _trace

    overrides = ("strategy=swift", "strategy.every=2", *SETUP, "cluster.pp=4", "cluster.dp=1", "failures=scripted",
                 _events(*events))
    sim = run(tmp_path / "sim", "backend=sim", *overrides)
    local = run(tmp_path / "local", "backend=local", "backend.clock=model", *overrides)
    assert sim["status"] == "ok", sim["error"]
    assert _trace(tmp_path / "local", local) == _trace(tmp_path / "sim", sim)
    assert local["productive_s"] == pytest.approx(sim["productive_s"], rel=1e-9)
    assert any("ReplayLogs" in r["actions"] for r in sim["recoveries"])


def test_the_benchmark_compares_swift_with_the_baselines(tmp_path, capsys):
    """benchmarks/swift.py --quick as the README runs it: Swift's own setup and GPT-3 Medium
    (dp 4 and dp 1). Every run with the failure takes longer than the fault-free baseline;
    Swift never loses iterations; Elastic Horovod cannot recover without a replica."""
    bench = _bench()
    assert bench.main(["--quick", "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "swift-eval       swift" in out and (tmp_path / "s.png").stat().st_size > 0
    results = bench.measure(quick=True, parallel=4, echo=lambda line: None)
    assert set(results) == {"swift-eval", "gpt3-medium", "gpt3-medium-dp1"}
    for setup, got in results.items():
        free = got["none"]
        assert free["status"] == "ok" and free["failures"] == 0
        for label, s in got.items():
            if label == "none":
                continue
            if label == "elastic-horovod" and setup != "gpt3-medium":
                assert s["status"] == "unrecoverable", s["error"]  # dp 1: no replica
                continue
            assert s["status"] == "ok" and s["failures"] == 1, (setup, label, s["error"])
            assert s["time_s"] > free["time_s"]
            if label.startswith("swift"):
                assert s["lost_iterations"] == 0
                replay = "ReplayLogs" in s["recoveries"][0]["actions"]
                assert replay == (setup != "gpt3-medium"), (setup, s["recoveries"])
        if "swift parallel 4" in got:
            assert got["swift parallel 4"]["recoveries"][0]["recovery_s"] < got["swift"]["recoveries"][0]["recovery_s"]


def _bench():
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import swift as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench


def test_the_benchmarks_ratio_moves_with_the_run_length_and_the_restart_cost(capsys):
    """benchmarks/swift.py --grid on GPT-3 Medium dp 1 (its largest best/this), 2 x 2 cells:
    the restart is paid by CheckFreq alone (Swift's total is the same at every restart_s), so
    best/this grows with it; one failure's recovery is amortised by a longer run, so best/this
    falls with the iterations. The command line's --grid, --iterations and --restart-s reach
    the runs."""
    bench = _bench()
    cells = bench.grid(4, iterations=(300, 600), restarts=(30.0, 90.0), only=("gpt3-medium-dp1",),
                       echo=lambda line: None)

    def ratio(n, restart, label="swift"):
        got = cells[("gpt3-medium-dp1", n, restart)]
        assert all(s["status"] == "ok" for s in got.values()), got
        assert set(got) == {"checkfreq", "swift", "swift parallel 4"}  # no replica: no Elastic Horovod
        return got["checkfreq"]["time_s"] / got[label]["time_s"]

    for n in (300, 600):
        slow, fast = cells[("gpt3-medium-dp1", n, 90.0)], cells[("gpt3-medium-dp1", n, 30.0)]
        assert slow["swift"]["time_s"] == fast["swift"]["time_s"]
        paid = slow["checkfreq"]["recoveries"][0]["recovery_s"] - fast["checkfreq"]["recoveries"][0]["recovery_s"]
        assert paid == pytest.approx(60.0)
        for label in ("swift", "swift parallel 4"):
            assert ratio(n, 90.0, label) > ratio(n, 30.0, label)
    for restart in (30.0, 90.0):
        for label in ("swift", "swift parallel 4"):
            assert ratio(300, restart, label) > ratio(600, restart, label) > 1.0
    assert bench.main(["--grid", "--iterations", "400", "--restart-s", "45"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert sorted(line[0] for line in lines if line[1:3] == ["400", "45"]) == sorted(bench.GRID_SETUPS)
    with pytest.raises(SystemExit):
        bench.main(["--iterations", "150"])  # the failure strikes at 150: it would never happen


@pytest.mark.quick  # Swift on sim, in the quick tier (tests/conftest.py)
def test_logging_stalls_training_only_where_storage_cannot_keep_up(tmp_path):
    """The log writes overlap training: free at the profile's storage bandwidth, a stall when
    a node cannot write an iteration's log within an iteration."""
    setup = ("backend=sim", "model=gpt3-medium", "cluster.pp=4", "cluster.dp=1", "train.iterations=20",
             "failures=none", "report.gantt=false")
    plain = run(tmp_path / "plain", *setup, "strategy=checkpoint")
    swift = run(tmp_path / "swift", *setup, "strategy=swift")
    slow = run(tmp_path / "slow", *setup, "strategy=swift", "hardware.storage_gbps=0.01")
    assert swift["iteration_time_s"] == plain["iteration_time_s"]
    assert slow["iteration_time_s"] > swift["iteration_time_s"]


def test_swifts_own_setup_runs_as_the_docs_give_it(tmp_path):
    """`ftbench +experiment=swift-eval` (README, docs/swift.md): one machine of 8 GPUs killed at
    iteration 150, its 8 stages replayed from the checkpoint of iteration 100."""
    s = run(tmp_path, "+experiment=swift-eval")
    assert s["status"] == "ok" and s["failures"] == 1, s["error"]
    (rec,) = s["recoveries"]
    assert rec["actions"][-1] == "ReplayLogs" and rec["lost_iterations"] == 0 and rec["iteration"] == 150
