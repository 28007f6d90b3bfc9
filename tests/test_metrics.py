"""metrics.jsonl streaming, atomic summary.json, and the W&B sink's never-break-a-run promise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ftbench.metrics import (
    STATUSES, SUMMARY_KEYS, MetricsWriter, WandbSink, read_metrics, write_summary,
)

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
    assert STATUSES == ("ok", "oom", "unrecoverable", "error")


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
        "from ftbench.metrics import WandbSink\n"
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
    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, None

    def log(self, data, step=None):
        self.logged.append((data, step))

    def finish(self, exit_code=0):
        self.finished = exit_code


def fake_wandb(init):
    module = types.ModuleType("wandb")
    module.init = init
    return module


def test_sink_logs_numbers_with_monotonic_steps(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, seen = FakeRun(), {}

    def init(**kwargs):
        seen.update(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init))
    sink = WandbSink(wandb_cfg("offline", group="from-cfg"), tmp_path, "r1", "bamboo", "sweep", {})
    assert seen["group"] == "from-cfg" and seen["job_type"] == "bamboo" and seen["mode"] == "offline"
    assert seen["dir"] == str(tmp_path)
    sink.log({"iteration": 5, "loss": 1.5, "kind": "iter", "ok": True})
    sink.log({"iteration": 3, "loss": 2.0})  # a rollback: the step must not go backwards
    sink.log({"event": "failure", "node": 1})
    assert run.logged == [({"iteration": 5, "loss": 1.5, "ok": 1}, 5),
                          ({"iteration": 3, "loss": 2.0}, 6),
                          ({"node": 1}, None)]
    sink.finish(full_summary(recoveries=[{"recovery_s": 30.0, "lost_iterations": 2}]))
    assert run.finished == 0
    assert run.summary["throughput"] == 12.8 and run.summary["status"] == "ok"
    assert run.summary["recoveries_count"] == 1 and run.summary["lost_iterations_total"] == 2
    assert "recoveries" not in run.summary  # lists stay in summary.json
    assert not sink.active


def test_sink_warns_once_and_goes_quiet_when_init_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)

    def init(**kwargs):
        raise RuntimeError("no network")

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init))
    with pytest.warns(UserWarning, match="no network"):
        sink = WandbSink(wandb_cfg("online"), tmp_path, "r1", "none", None, {})
    assert not sink.active
    sink.log({"iteration": 0, "loss": 1.0})  # no-ops, no exceptions
    sink.finish(full_summary())


def test_offline_sink_writes_into_the_run_folder(tmp_path):
    # A subprocess keeps wandb's background service and global state out of pytest, and
    # lets a slow wandb start be a skip rather than a hang.
    run_dir = tmp_path / "run"
    code = (
        "import types\n"
        "from ftbench.metrics import WandbSink\n"
        "cfg = types.SimpleNamespace(mode='offline', project='ftbench-test', entity=None, group=None)\n"
        f"sink = WandbSink(cfg, {str(run_dir)!r}, 'run', 'none', 'tests', {{'seed': 0}})\n"
        "assert sink.active, 'wandb offline init failed'\n"
        "for i in range(3):\n"
        "    sink.log({'iteration': i, 'loss': 1.0 / (i + 1)})\n"
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
