"""The W&B Report of a sweep (ftbench/wandb_report.py): written offline into the sweep folder
when the sweep ends, built with wandb-workspaces, and every panel names a metric, config key or
image the sweep's runs really logged (read back from their offline W&B run files)."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ftbench.wandb_report import REPORT_FILE, build, definition, panel_metrics


def logged(run_file: Path) -> dict[str, set[str]]:
    """What an offline W&B run recorded, by kind: history and summary keys, config keys (dotted,
    nested ones flattened). The file is a LevelDB-style log (a 7-byte W&B header, then 32 KiB
    blocks of chunks with a 7-byte header: checksum, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    found = {"history": set(), "summary": set(), "config": set()}

    def flatten(prefix, value):
        found["config"].add(prefix)
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}", v)

    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            found["history"] |= {i.key or "/".join(i.nested_key) for i in record.history.item}
        elif kind == "summary":
            found["summary"] |= {i.key or "/".join(i.nested_key) for i in record.summary.update}
        elif kind in ("config", "run"):  # the config given at init comes with the run record
            items = record.config.update if kind == "config" else record.run.config.update
            for item in items:
                flatten(item.key or ".".join(item.nested_key), json.loads(item.value_json))
    return found


@pytest.mark.slow
def test_a_sweeps_report_names_only_what_its_runs_logged(tmp_path):
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "ftbench", "--multirun", "model=gpt-tiny", "cluster.pp=2",
                          "cluster.dp=2", "train.iterations=4", "train.microbatches=2", "strategy=checkpoint,varuna",
                          "strategy.every=2", "failures=scripted", "failures.events=[{iteration:2,node:1}]",
                          "report.progress=false", f"hydra.sweep.dir={sweep}", "wandb.mode=offline"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    spec = json.loads((sweep / REPORT_FILE).read_text())
    assert spec == definition(sweep)
    runs = sorted(sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2
    seen = [logged(run) for run in runs]
    wanted = panel_metrics(spec)
    assert {where for where, _ in wanted} == {"summary", "config", "history", "media"}
    for where, name in wanted:
        for got in seen:
            if where == "media":  # an image logged under its key: its fields `<key>/_type`, ...
                assert f"{name}/_type" in got["history"], name
            else:
                assert name in got[where], (where, name, sorted(got[where])[:40])
    # the group filter is the runs' own group, and wandb-workspaces builds the report offline
    assert all(spec["group"].encode() in run.read_bytes() for run in runs)
    report = build(spec)
    grid = report.blocks[-1]
    assert len(grid.panels) == sum(len(b.get("panels", [])) for b in spec["blocks"])
    assert grid.runsets[0].filters == f"Metric('Group') == '{spec['group']}'"


def test_publishing_without_a_login_says_what_to_do(tmp_path):
    folder = tmp_path / "sweep" / "0"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"strategy": "none", "status": "ok", "backend": "sim",
                                                     "throughput": 1.0, "recoveries": []}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_API")}
    out = subprocess.run([sys.executable, "-m", "ftbench.report", str(tmp_path / "sweep"), "--publish"],
                         capture_output=True, text=True, timeout=300,
                         env={**env, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")})
    assert out.returncode == 2, out.stderr
    assert "W&B could not save the report" in out.stderr and "wandb login" in out.stderr
