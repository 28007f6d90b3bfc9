"""metrics.jsonl streaming, atomic summary.json, and the W&B sink's never-break-a-run promise."""
from __future__ import annotations

import datetime
import json
import re
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ftbench.metrics import STATUSES, SUMMARY_KEYS, MetricsWriter, ettr, read_metrics, summary_ettr, write_summary
from ftbench.wandb_sink import WandbSink, log_sweep_table, sweep_rows, wandb_group

ROOT = Path(__file__).resolve().parents[1]


def full_summary(**changes) -> dict:
    summary = {key: None for key in SUMMARY_KEYS}
    summary.update(strategy="none", backend="sim", model="gpt-tiny", dp=2, pp=4, microbatches=8,
                   global_batch=16, iterations=10, samples=160, time_s=12.5, throughput=12.8,
                   failures=0, recoveries=[], peak_memory_bytes=[1_000, 2_000], status="ok",
                   error=None)
    summary.update(changes)
    return summary


def wandb_cfg(mode: str, group: str | None = None):
    return types.SimpleNamespace(mode=mode, project="ftbench-test", entity=None, group=group)


def test_summary_keys_cover_the_contract():
    assert set(SUMMARY_KEYS) >= {"strategy", "recoveries", "peak_memory_bytes", "status", "error"}
    assert STATUSES == ("ok", "oom", "unrecoverable", "diverged", "error", "died", "interrupted")


def test_each_line_is_readable_before_close(tmp_path):
    writer = MetricsWriter(tmp_path / "run")
    writer.log({"iteration": 0, "loss": 2.5})
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"iteration": 0, "loss": 2.5}]
    writer.log({"event": "failure", "node": 3, "path": tmp_path})  # odd types become strings
    records = read_metrics(tmp_path / "run")
    assert records[1] == {"event": "failure", "node": 3, "path": str(tmp_path)}
    writer.close()


def test_writer_appends_and_is_a_context_manager(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log({"iteration": 0})
    with MetricsWriter(tmp_path) as writer:
        writer.log({"iteration": 1})
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [0, 1]


def test_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1}\n{"iteration": 2, "lo')
    assert read_metrics(path) == [{"iteration": 0}, {"iteration": 1}]


def test_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=":2"):
        read_metrics(path)


def test_write_summary_round_trips_without_leftovers(tmp_path):
    summary = full_summary(recoveries=[{"time_s": 3.0, "iteration": 4, "recovery_s": 60.0,
                                        "lost_iterations": 2}])
    path = write_summary(tmp_path / "run", summary)
    assert path == tmp_path / "run" / "summary.json"
    assert json.loads(path.read_text()) == summary
    write_summary(tmp_path / "run", full_summary(status="oom", error="out of memory"))
    assert json.loads(path.read_text())["status"] == "oom"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def test_write_summary_names_missing_keys(tmp_path):
    summary = full_summary()
    del summary["throughput"], summary["peak_memory_bytes"]
    with pytest.raises(ValueError, match="throughput.*peak_memory_bytes"):
        write_summary(tmp_path, summary)
    assert list(tmp_path.iterdir()) == []


def test_write_summary_rejects_unknown_status(tmp_path):
    with pytest.raises(ValueError, match="'crashed'"):
        write_summary(tmp_path, full_summary(status="crashed"))
    assert list(tmp_path.iterdir()) == []


def test_disabled_sink_never_imports_wandb(tmp_path):
    # A fresh interpreter: this test process may have imported wandb already.
    code = (
        "import sys, types\n"
        "from ftbench.wandb_sink import WandbSink\n"
        "cfg = types.SimpleNamespace(mode='disabled', project='p', entity=None, group=None)\n"
        f"sink = WandbSink(cfg, {str(tmp_path)!r}, 'run', 'none', None, {{'a': 1}})\n"
        "sink.log({'iteration': 0, 'loss': 1.0})\n"
        "sink.finish({'status': 'ok'})\n"
        "assert not sink.active\n"
        "assert 'wandb' not in sys.modules, 'wandb was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_wandb_mode_env_disables_the_sink(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would now fail loudly
    sink = WandbSink(wandb_cfg("offline"), tmp_path, "run", "none", None, {})
    assert not sink.active


class FakeRun:
    id = "fake1"

    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, None
        self.defined, self.artifacts = [], []

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, data, step=None):
        assert step is None, "the sink must leave W&B's step alone"
        self.logged.append(data)

    def log_artifact(self, artifact, aliases=None):
        self.artifacts.append(artifact)

    def finish(self, exit_code=0):
        self.finished = exit_code


class FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


class FakeImage:
    def __init__(self, path, caption=None):
        self.path = path


class FakeArtifact:
    def __init__(self, name, type, metadata=None):
        self.name, self.type, self.files = name, type, []

    def add_dir(self, path, policy="mutable"):
        self.files.append(path)

    def add_file(self, path, name=None, policy="mutable"):
        self.files.append(path)


def fake_wandb(init):
    module = types.ModuleType("wandb")
    module.init = init
    module.Table, module.Image, module.Artifact = FakeTable, FakeImage, FakeArtifact
    return module


def test_sink_rows_keep_events_apart_on_the_iteration_axis(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, seen = FakeRun(), {}

    def init(**kwargs):
        seen.update(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init))
    sink = WandbSink(wandb_cfg("offline", group="from-cfg"), tmp_path, "r1", "bamboo", "sweep",
                     {"backend": {"name": "local"}})
    sink.log({"event": "start", "clock": "wall", "nodes": 8})
    # W&B starts with the start line, before training
    assert seen["group"] == "from-cfg" and seen["job_type"] == "bamboo" and seen["mode"] == "offline"
    assert seen["dir"] == str(tmp_path)
    sink.log({"event": "iteration", "iteration": 5, "loss": 1.5, "plan": "1f1b", "ok": True})
    sink.log({"event": "fail", "node": 1, "time_s": 2.0, "iteration": 6})
    sink.log({"event": "recovery", "iteration": 6, "recovery_s": 3.0, "lost_iterations": 3,
              "actions": ["RestartJob", "RestoreCheckpoint"], "copies": [{"src": 1}]})
    sink.log({"event": "iteration", "iteration": 3, "loss": 2.0})  # a rollback: kept, not dropped
    sink.log({"event": "checkpoint_interval", "every": 4})  # no iteration: the last one seen
    assert run.logged == [{"start/clock": "wall", "start/nodes": 8, "iteration": 0}]  # training: held
    sink.log({"event": "end", "status": "ok"})  # after the run loop: the held lines, in order
    assert run.logged == [
        {"start/clock": "wall", "start/nodes": 8, "iteration": 0},
        {"iteration": 5, "loss": 1.5, "ok": 1},
        {"fail/node": 1, "fail/time_s": 2.0, "iteration": 6},
        {"recovery/recovery_s": 3.0, "recovery/lost_iterations": 3,
         "recovery/actions": "RestartJob, RestoreCheckpoint", "iteration": 6},
        {"iteration": 3, "loss": 2.0},
        {"checkpoint_interval/every": 4, "iteration": 3},
        {"end/status": "ok", "iteration": 3},
    ]
    assert run.defined[0] == ("iteration", None)
    assert {("loss", "iteration"), ("start/*", "iteration"), ("recovery/*", "iteration")} <= set(run.defined)
    assert len(run.defined) == len(set(run.defined))  # each once

    (tmp_path / "gantt.png").write_bytes(b"png")
    (tmp_path / "other.png").write_bytes(b"png")
    (tmp_path / "final_model").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    recoveries = [{"time_s": 1.0, "iteration": 6, "recovery_s": 30.0, "lost_iterations": 2,
                   "restored_iteration": 4, "actions": ["RestartJob"], "plan": "1f1b", "shape": "pp=4 dp=2",
                   "cause": "fail"}]
    sink.finish(full_summary(recoveries=recoveries, run_dir=str(tmp_path),
                             final_state=str(tmp_path / "final_model")))
    media = run.logged[-1]
    assert media["recoveries"].columns[:4] == ["time_s", "iteration", "recovery_s", "lost_iterations"]
    assert media["recoveries"].data == [[1.0, 6, 30.0, 2, 4, "RestartJob", "1f1b", "pp=4 dp=2", "fail"]]
    assert media["gantt"].path.endswith("gantt.png") and media["plots/other"].path.endswith("other.png")
    assert [(a.name, a.type) for a in run.artifacts] == [("model-fake1", "model"), ("summary-fake1", "summary")]
    assert run.finished == 0
    assert run.summary["throughput"] == 12.8 and run.summary["status"] == "ok"
    assert run.summary["recoveries_count"] == 1 and run.summary["lost_iterations_total"] == 2
    assert "recoveries" not in run.summary  # lists stay in summary.json
    assert run.summary["ettr"] is None  # full_summary has no productive time
    assert not sink.active


@pytest.mark.parametrize("backend", ["local", "sim"])
def test_nothing_of_wandb_runs_while_training(tmp_path, monkeypatch, backend):
    """The timed region is training: W&B starts before the run loop and gets its lines after
    it, so a run's ETTR and throughput are what they are with wandb.mode=disabled. Every call
    into W&B (init, log) is recorded with whether the run loop was running."""
    import ftbench.loop as loop
    from conftest import LOCAL, run as run_job

    monkeypatch.delenv("WANDB_MODE", raising=False)
    training, calls = [], []
    loop_run = loop.RunLoop.run

    def marked(self):
        training.append(True)
        try:
            return loop_run(self)
        finally:
            training.pop()

    class Run(FakeRun):
        def log(self, data, step=None):
            calls.append(("log", bool(training)))
            super().log(data, step)

    def init(**kwargs):
        calls.append(("init", bool(training)))
        return wandb_run

    wandb_run = Run()
    monkeypatch.setattr(loop.RunLoop, "run", marked)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init))
    summary = run_job(tmp_path, *LOCAL, f"backend={backend}", "strategy=checkpoint", "strategy.every=2",
                      "failures.events=[{iteration:3,node:1}]", "wandb.mode=offline")
    assert summary["status"] == "ok" and summary["iterations"] == 10
    assert calls[0] == ("init", False) and len(calls) > 5
    assert not [call for call in calls if call[1]], "W&B was called while the run loop ran"
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert len(wandb_run.logged) == len(lines) + 1  # every line, then the tables and images


def test_ettr_is_productive_time_over_run_time(tmp_path, monkeypatch):
    assert {"ettr", "productive_s"} <= set(SUMMARY_KEYS)
    assert ettr(9.0, 10.0) == 0.9 and ettr(10.0, 10.0) == 1.0 and ettr(0.0, 10.0) == 0.0
    assert ettr(2.0, 3.0) == 0.666667  # rounded to 6 decimals
    assert ettr(10.000000001, 10.0) == 1.0  # float noise never leaves [0, 1]
    assert ettr(1.0, 0.0) is None and ettr(None, 10.0) is None and ettr(1.0, None) is None
    assert summary_ettr({"ettr": 0.5, "productive_s": 1.0, "time_s": 10.0}) == 0.5  # the recorded value wins
    assert summary_ettr({"productive_s": 1.0, "time_s": 10.0}) == 0.1  # a summary without it
    assert summary_ettr({"time_s": 10.0}) is None

    run = FakeRun()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(lambda **kwargs: run))
    WandbSink(wandb_cfg("offline"), tmp_path, "r1", "none", None, {}).finish(
        full_summary(ettr=0.8, productive_s=10.0, run_dir=str(tmp_path)))
    assert run.summary["ettr"] == 0.8 and run.summary["productive_s"] == 10.0


def test_sim_sink_uses_simulated_time_as_the_step_metric(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(lambda **kwargs: run))
    sink = WandbSink(wandb_cfg("offline"), tmp_path, "r1", "none", None, {"backend": {"name": "sim"}})
    sink.log({"event": "iterations", "first": 0, "last": 49, "count": 50, "iteration_time_s": 2.0,
              "time_s": 100.0, "plan": "1f1b"})
    sink.log({"event": "fail", "node": 3, "time_s": 101.0, "iteration": 50})
    sink.log({"event": "checkpoint_interval", "every": 10})
    sink.log({"event": "odd name*", "x": 1})
    sink.log({"time_s": 102.0, "loss": 0.5})  # a bare record of numbers is progress
    sink.finish(full_summary(run_dir=str(tmp_path)))  # no end line: the held lines go first
    assert run.logged[:-1] == [
        {"first": 0, "last": 49, "count": 50, "iteration_time_s": 2.0, "time_s": 100.0, "iteration": 49},
        {"fail/node": 3, "fail/iteration": 50, "time_s": 101.0},
        {"checkpoint_interval/every": 10, "time_s": 101.0},
        {"odd_name_/x": 1, "time_s": 101.0},
        {"time_s": 102.0, "loss": 0.5},
    ]
    assert run.defined[0] == ("time_s", None) and ("fail/*", "time_s") in run.defined
    assert ("odd_name_/*", "time_s") in run.defined and ("loss", "time_s") in run.defined


def test_a_failing_extra_is_skipped_and_the_run_still_finishes(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = FakeRun()
    module = fake_wandb(lambda **kwargs: run)

    def broken_table(**kwargs):
        raise RuntimeError("tables are broken")

    module.Table = broken_table
    monkeypatch.setitem(sys.modules, "wandb", module)
    sink = WandbSink(wandb_cfg("offline"), tmp_path, "r1", "none", None, {})
    with pytest.warns(UserWarning, match="tables are broken"):
        sink.finish(full_summary(run_dir=str(tmp_path)))
    assert run.finished == 0 and run.summary["status"] == "ok"


def test_group_names_carry_the_date(tmp_path):
    day = datetime.date(2031, 2, 3)
    sweep_job = Path("runs/multirun/2024-05-01/20-00-00-abcd/0_none_gpt-tiny_sim")
    assert wandb_group("20-00-00-abcd", sweep_job, day) == "2024-05-01_20-00-00-abcd"
    assert wandb_group("20-00-00-abcd", tmp_path, day) == "2031-02-03_20-00-00-abcd"  # a bare time: today
    assert wandb_group("2024-05-01_x", tmp_path, day) == "2024-05-01_x"  # already dated
    assert wandb_group(None, Path("runs/2024-05-02/10-11-12-ab_none_gpt-tiny_local"), day) == "single-2024-05-02"
    assert wandb_group(None, tmp_path, day) == "single-2031-02-03"


def test_sweep_rows_and_table(tmp_path, monkeypatch):
    sweep = tmp_path / "20-00-00-abcd"
    for num, strategy in ((1, "checkpoint"), (0, "none")):
        recoveries = [{"recovery_s": 2.0, "lost_iterations": 1}] if strategy != "none" else []
        write_summary(sweep / f"{num}_{strategy}", full_summary(strategy=strategy, recoveries=recoveries))
    columns, rows = sweep_rows(sweep)
    table = [dict(zip(columns, row)) for row in rows]
    assert [(r["run"], r["strategy"], r["recoveries"], r["lost_iterations"]) for r in table] == [
        ("0_none", "none", 0, 0), ("1_checkpoint", "checkpoint", 1, 1)]
    assert table[0]["peak_memory_gb"] == pytest.approx(2e-6)
    assert columns.index("ettr") == columns.index("throughput") + 1 and table[0]["ettr"] is None

    run = FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(lambda **kwargs: run))
    assert log_sweep_table(sweep, run=run)
    assert run.logged[0]["sweep"].data == rows and run.finished is None  # a given run stays open
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not log_sweep_table(sweep)  # no run of its own when W&B is off


def test_sweep_table_has_a_column_per_swept_key(tmp_path):
    sweep = tmp_path / "20-00-00-abcd"
    for num, (strategy, mtbf) in enumerate((("none", 10), ("checkpoint", 10), ("checkpoint", 100))):
        write_summary(sweep / f"{num}_{strategy}", full_summary(
            strategy=strategy, swept=["strategy", "failures.mtbf_hours", "cluster.dp"],
            overrides=[f"strategy={strategy}", f"failures.mtbf_hours={mtbf}", "cluster.dp=2", "seed=0"]))
    columns, rows = sweep_rows(sweep)
    # after `strategy`; strategy and cluster.dp (as `dp`) have columns already
    assert columns[:3] == ["run", "strategy", "failures.mtbf_hours"] and columns.count("strategy") == 1
    assert "cluster.dp" not in columns and "seed" not in columns  # seed: the same in every run
    assert [row[2] for row in rows] == [10, 10, 100]


def test_a_config_error_starts_no_wandb_run(tmp_path, monkeypatch):
    from conftest import run as execute_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    started = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(lambda **kwargs: started.append(kwargs) or FakeRun()))
    sim = ("backend=sim", "wandb.mode=offline", "train.iterations=2", "report.gantt=false")
    bad = execute_run(tmp_path / "bad", *sim, "cluster.dp=0")
    assert bad["status"] == "error" and "`cluster.dp`" in bad["error"]
    assert not started and not (tmp_path / "bad" / "wandb").exists()
    assert execute_run(tmp_path / "good", *sim)["status"] == "ok"
    assert len(started) == 1  # the same setup without the error does start one


def test_sink_warns_once_and_goes_quiet_when_init_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)

    def init(**kwargs):
        raise RuntimeError("no network")

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init))
    sink = WandbSink(wandb_cfg("online"), tmp_path, "r1", "none", None, {})
    with pytest.warns(UserWarning, match="no network"):
        sink.log({"iteration": 0, "loss": 1.0})  # the first progress line starts W&B
    assert not sink.active
    sink.log({"iteration": 1, "loss": 1.0})  # no-ops, no exceptions
    sink.finish(full_summary())


def test_offline_sink_writes_into_the_run_folder(tmp_path):
    # A subprocess keeps wandb's background service and global state out of pytest, and
    # lets a slow wandb start be a skip rather than a hang.
    run_dir = tmp_path / "run"
    code = (
        "import types\n"
        "from ftbench.wandb_sink import WandbSink\n"
        "cfg = types.SimpleNamespace(mode='offline', project='ftbench-test', entity=None, group=None)\n"
        f"sink = WandbSink(cfg, {str(run_dir)!r}, 'run', 'none', 'tests', {{'seed': 0}})\n"
        "for i in range(3):\n"
        "    sink.log({'iteration': i, 'loss': 1.0 / (i + 1)})\n"
        "assert sink.run is not None, 'wandb offline init failed'\n"
        "sink.finish({'status': 'ok', 'throughput': 1.0})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
               WANDB_CACHE_DIR=str(tmp_path / "cache"), WANDB_DATA_DIR=str(tmp_path / "data"))
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("wandb offline start took over 180 s on this machine")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "wandb").is_dir()
    assert list((run_dir / "wandb").glob("offline-run-*"))


# -- decoding W&B's offline run file ------------------------------------------------------
# wandb >= 0.18 writes run-<id>.wandb from its Go core and no longer ships the Python reader
# (wandb.sdk.internal.datastore). The file is a LevelDB-style log: a 7-byte header (":W&B",
# magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of
# type + data, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a
# header is zero padding. Each whole record is a wandb.proto Record, parsed with wandb's own
# protobuf classes.
_BLOCK, _HEADER = 32768, 7


def wandb_records(path: Path) -> list:
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack_from("<HB", data, 4) == (0xBEE1, 0), data[:7]
    records, chunks, pos = [], [], _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if (crc, length, kind) == (0, 0, 0):  # the unwritten rest of the last block
            break
        body = data[pos + _HEADER:pos + _HEADER + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pos += _HEADER + length
        chunks.append(body)
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def history_rows(records) -> list[dict]:
    """History records as {key: value}; nested keys joined with '/'."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def of_type(records, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def only_run_file(run_dir: Path) -> Path:
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


LOCAL_RUN = ("backend=local", "model=gpt-tiny", "train.iterations=4", "train.microbatches=2",
             "wandb.mode=offline", "report.check_fault_free=false", "strategy=checkpoint", "strategy.every=4",
             "failures=scripted", "failures.events=[{iteration:2,node:5}]")
SIM_RUN = ("backend=sim", "model=gpt-tiny", "train.iterations=20", "wandb.mode=offline",
           "strategy=checkpoint", "failures=scripted", "failures.events=[{iteration:5,node:5}]")


@pytest.fixture(scope="module")
def offline_sweep(tmp_path_factory):
    """A real local run and a real sim run, W&B offline, in one folder; then the sweep table.
    A subprocess keeps wandb's service and global state out of pytest."""
    sweep = tmp_path_factory.mktemp("wandb") / "20-00-00-abcd"
    (sweep / "local").mkdir(parents=True)
    from PIL import Image
    Image.new("RGB", (8, 8), "red").save(sweep / "local" / "notes.png")  # any *.png is logged
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import conftest\n"
        "os.environ.pop('WANDB_MODE', None)\n"
        "from ftbench.wandb_sink import log_sweep_table\n"
        "from ftbench.run import execute\n"
        f"sweep = Path({str(sweep)!r})\n"
        # execute's own echo: the summary is printed, for W&B's console log
        f"cfg = conftest.compose('report.progress=false', *{LOCAL_RUN!r})\n"
        "assert execute(cfg, sweep / 'local')['status'] == 'ok'\n"
        f"assert conftest.run(sweep / 'sim', *{SIM_RUN!r})['status'] == 'ok'\n"
        "assert log_sweep_table(sweep)\n"
        "assert 'WANDB_DATA_DIR' not in os.environ, 'W&B data folder not restored'\n"
    )
    # W&B's data, cache and config folders at their defaults, in a home folder of the test's own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_"))}
    scratch = sweep.parent
    env.update(PYTHONPATH=str(ROOT), WANDB_SILENT="true", WANDB_DIR=str(scratch / "wandb-dir"),
               HOME=str(scratch / "home"))
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip("two small runs with wandb offline took over 240 s on this machine")
    assert done.returncode == 0, done.stderr[-3000:]
    return sweep


def test_offline_local_run_has_every_iteration_and_event_in_wandb(offline_sweep):
    run_dir = offline_sweep / "local"
    records = wandb_records(only_run_file(run_dir))
    lines = read_metrics(run_dir)
    rows = history_rows(records)

    # one row per metrics line (none dropped, none merged) plus the row of tables and images
    assert len(rows) == len(lines) + 1
    assert [row["_step"] for row in rows] == list(range(len(rows)))
    losses = [(row["iteration"], row["loss"]) for row in rows if "loss" in row]
    expected = [(line["iteration"], line["loss"]) for line in lines if line["event"] == "iteration"]
    assert losses == expected and [i for i, _ in losses] == [0, 1, 0, 1, 2, 3]  # 0, 1 redone after the rollback
    for row, line in zip(rows, lines):
        event = line["event"]
        if event != "iteration":
            assert not any(key == "loss" or key.startswith("iteration_") for key in row)
            assert any(key.startswith(f"{event}/") for key in row), (event, row)
    recovery = next(row for row in rows if "recovery/recovery_s" in row)
    assert recovery["iteration"] == 2 and recovery["recovery/lost_iterations"] == 2
    assert recovery["recovery/restored_iteration"] == 0
    assert next(row for row in rows if "fail/node" in row)["fail/node"] == 5

    metrics = {(m.name or m.glob_name): m for m in of_type(records, "metric")}
    assert "iteration" in metrics and not metrics["iteration"].step_metric
    for name in ("loss", "iteration_s", "recovery/*", "fail/*", "checkpoint/*"):
        assert metrics[name].step_metric == "iteration", name

    media = rows[-1]
    assert media["recoveries/_type"] == "table-file" and media["recoveries/nrows"] == 1
    table = json.loads(next(run_dir.glob("wandb/offline-run-*/files/" + media["recoveries/path"])).read_text())
    row = dict(zip(table["columns"], table["data"][0]))
    assert row["iteration"] == 2 and row["lost_iterations"] == 2 and "RestoreCheckpoint" in row["actions"]
    assert media["plots/notes/_type"] == "image-file"

    artifacts = {a.type: a for a in of_type(records, "artifact")}
    assert {"model", "summary"} <= set(artifacts)
    assert "model.safetensors" in {entry.path for entry in artifacts["model"].manifest.contents}
    assert {entry.path for entry in artifacts["summary"].manifest.contents} == {"summary.json"}

    (run,) = of_type(records, "run")
    assert run.job_type == "checkpoint" and run.display_name == "local"
    assert re.fullmatch(r"single-\d{4}-\d{2}-\d{2}", run.run_group), run.run_group  # no date in tmp paths
    summary = {}
    for update in of_type(records, "summary"):
        summary.update({item.key or "/".join(item.nested_key): item.value_json for item in update.update})
    assert json.loads(summary["status"]) == "ok" and json.loads(summary["recoveries_count"]) == 1
    assert 0 < json.loads(summary["ettr"]) < 1 and json.loads(summary["productive_s"]) > 0


def test_offline_sim_run_charts_against_simulated_time_and_logs_the_gantt(offline_sweep):
    run_dir = offline_sweep / "sim"
    records = wandb_records(only_run_file(run_dir))
    rows = history_rows(records)
    lines = read_metrics(run_dir)
    assert len(rows) == len(lines) + 1
    metrics = {(m.name or m.glob_name): m for m in of_type(records, "metric")}
    assert "time_s" in metrics and not metrics["time_s"].step_metric
    assert metrics["iteration_time_s"].step_metric == "time_s" and metrics["recovery/*"].step_metric == "time_s"
    segments = [row for row in rows if "iteration_time_s" in row]
    assert [(r["first"], r["last"], r["time_s"]) for r in segments] == [
        (r["first"], r["last"], r["time_s"]) for r in lines if r["event"] == "iterations"]
    recovery = next(row for row in rows if "recovery/recovery_s" in row)
    line = next(r for r in lines if r["event"] == "recovery")
    assert recovery["time_s"] == line["time_s"] and recovery["recovery/iteration"] == line["iteration"]
    assert rows[-1]["gantt/_type"] == "image-file"


def test_log_sweep_table_offline(offline_sweep):
    records = wandb_records(only_run_file(offline_sweep))
    (run,) = of_type(records, "run")
    assert run.job_type == "sweep-summary" and run.run_group.endswith("_20-00-00-abcd")
    (row,) = history_rows(records)
    assert row["sweep/_type"] == "table-file" and row["sweep/nrows"] == 2


def test_an_offline_run_folder_copied_elsewhere_holds_everything_wandb_sync_needs(offline_sweep, tmp_path):
    """Copy a run folder, take the original and W&B's home folders away, and find in the copy's
    run file the metrics, config, console, table, images and artifacts, with every file they
    name inside the copy (an artifact's path is relative to the run folder: `wandb sync` runs
    there)."""
    original, home = offline_sweep / "local", offline_sweep.parent / "home"
    staged = [p for p in home.rglob("*") if p.is_file() and "artifacts" in p.parts]
    assert not staged, staged  # nothing of the run's was left in the home folder
    copy = tmp_path / "elsewhere" / "local"
    shutil.copytree(original, copy, symlinks=True)
    aside = original.with_name("local-moved-away")
    original.rename(aside)
    shutil.rmtree(home)
    try:
        run_file = only_run_file(copy)
        files = run_file.parent / "files"
        records = wandb_records(run_file)
        rows = history_rows(records)
        assert [r["loss"] for r in rows if "loss" in r] == [
            line["loss"] for line in read_metrics(copy) if line["event"] == "iteration"]
        (run,) = of_type(records, "run")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["model"]["name"] == "gpt-tiny" and config["strategy"]["name"] == "checkpoint"

        console = "".join(r.output_raw.line for r in records if r.WhichOneof("record_type") == "output_raw")
        assert "lost iterations" in console  # the summary execute printed
        assert "lost iterations" in (files / "output.log").read_text()

        media = rows[-1]
        images = [key[:-len("/_type")] for key, value in media.items() if value == "image-file"]
        assert "plots/notes" in images
        for key in ("recoveries", *images):
            assert (files / media[f"{key}/path"]).stat().st_size > 0, key

        artifacts = of_type(records, "artifact")
        assert {"model", "summary", "run_table"} <= {a.type for a in artifacts}
        for artifact in artifacts:
            for entry in artifact.manifest.contents:
                assert not os.path.isabs(entry.local_path), (artifact.name, entry.local_path)
                assert (copy / entry.local_path).stat().st_size == entry.size, (artifact.name, entry.path)
        (model,) = [a for a in artifacts if a.type == "model"]
        weights = next(e for e in model.manifest.contents if e.path == "model.safetensors")
        assert (copy / weights.local_path).read_bytes() == (copy / "final_model" / "model.safetensors").read_bytes()
    finally:
        aside.rename(original)


def test_a_summary_is_strict_json_even_with_losses_not_reached(tmp_path):
    """A run that ended early has NaN losses for the iterations it did not reach: written as
    null, so strict parsers (which reject NaN and Infinity) read the file."""
    import json
    import math

    from ftbench.metrics import SUMMARY_KEYS, write_summary

    summary = {**{key: 0 for key in SUMMARY_KEYS}, "status": "error", "throughput": math.nan,
               "losses": [5.0, math.nan, math.inf], "nested": {"x": -math.inf}}
    path = write_summary(tmp_path, summary)

    def strict(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    back = json.loads(path.read_text(), parse_constant=strict)
    assert back["losses"] == [5.0, None, None] and back["nested"] == {"x": None} and back["throughput"] is None


def test_a_summary_left_by_a_killed_writer_is_cleaned_by_the_next_one(tmp_path):
    """SIGKILL between mkstemp and the rename leaves `.summary.*.tmp` (no cleanup can run):
    the next write in the folder removes it; a live writer's, or another host's, stays."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from ftbench.metrics import clean_stale_summaries

    folder = tmp_path / "run"
    folder.mkdir()
    # A real writer killed mid-write: it blocks after creating its temporary file.
    code = ("import os, sys, tempfile; from ftbench import metrics\n"
            "fd, name = tempfile.mkstemp(dir=sys.argv[1], prefix=f'.summary.{metrics._writer()}.', suffix='.tmp')\n"
            "print(name, flush=True); sys.stdin.read()")
    writer = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    left = writer.stdout.readline().strip()
    host = socket.gethostname().replace(".", "-")
    live = folder / f".summary.{host}.{os.getpid()}.abc.tmp"  # this test's process: alive
    elsewhere = folder / ".summary.other-host.1.abc.tmp"
    live.write_text("{}")
    elsewhere.write_text("{}")
    clean_stale_summaries(folder)
    assert os.path.exists(left), "a live writer's file was removed"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    write_summary(folder, full_summary())
    assert not os.path.exists(left)
    assert live.exists() and elsewhere.exists()
    assert (folder / "summary.json").exists()


def test_a_sigkill_while_the_summary_is_written_leaves_no_file_behind(tmp_path):
    """The summary is written unnamed (O_TMPFILE) and named only when whole: a process killed
    while writing it (here, stopped in its fsync) leaves neither a half summary nor a
    temporary file in the run folder."""
    import signal
    import subprocess
    import sys

    script = f"""
import os, sys, time
from ftbench import metrics
def stuck(fd):
    print("writing", flush=True)
    time.sleep(60)
metrics.os.fsync = stuck
metrics.write_summary({str(tmp_path)!r}, {full_summary()!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
