"""`ftbench calibrate` (python -m ftbench.measure, issue 39 item 1): one --quick run on this
machine writes a hardware profile with every key, each fitted number the fit of the raw
points the profile records, provenance filled, and nothing left behind; bad arguments end
with exit 2 and one line. No timing is asserted (the numbers are this machine's, and noisy)."""
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT
from ftbench.config import HardwareConfig
from ftbench.costs import CostModel
from ftbench.distributed.membership import STALE_S
from ftbench.measure.cli import main
from ftbench.models.specs import resolve_model

TOP = ("name", "peak_tflops", "efficiency", "memory_gb", "hbm_gbps", "intra_node_gbps", "inter_node_gbps",
       "link_latency_us", "storage_gbps", "host_gbps", "restart_s", "rendezvous_s", "op_overhead_s", "detection_s",
       "checkpoint_file_s", "checkpoint_load_file_s", "measured", "provenance")
OPS = ("forward", "backward_input", "backward_weight", "backward")
PHASES = ("imports_s", "process_group_s", "model_s", "checkpoint_s", "first_iteration_s")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One quick calibration into a fresh folder: (profile, stdout, the folder)."""
    folder = tmp_path_factory.mktemp("calibrate")
    out = folder / "profiles" / "here.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "ftbench.measure", "--quick", "--name", "here", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return yaml.safe_load(out.read_text()), done.stdout, folder


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
@pytest.mark.dist
def test_every_key_is_there_finite_and_positive(calibrated):
    profile, _, _ = calibrated
    assert list(profile) == list(TOP)
    assert profile["name"] == "here" and profile["efficiency"] == 1.0
    for key in TOP[1:-2]:
        assert finite(profile[key]), key
        # a fixed cost below the noise is clamped to 0
        assert profile[key] > 0 or key in ("op_overhead_s", "checkpoint_file_s", "checkpoint_load_file_s"), key
    assert profile["op_overhead_s"] >= 0 and profile["checkpoint_file_s"] >= 0
    assert profile["inter_node_gbps"] == profile["intra_node_gbps"]  # one machine: said so in the sources
    m = profile["measured"]
    assert (m["model"], m["microbatch_size"], m["seq_len"], m["dtype"], m["threads"]) == ("gpt-tiny", 1, 32, "float32", 1)
    for kind in OPS:
        line = m["ops"][kind]
        assert all(finite(line[k]) for k in ("fixed_s", "per_block_s", "embedding_s", "head_s", "residual")), kind
        assert line["per_block_s"] > 0 and line["embedding_s"] > 0 and line["head_s"] > 0, kind
        assert line["blocks"] == [1, 2, 4] and all(s > 0 for s in line["medians_s"])
    assert finite(m["ops"]["step"]["fixed_s"]) and m["ops"]["step"]["per_param_s"] > 0
    assert m["p2p"]["latency_s"] > 0 and m["p2p"]["gbps"] > 0
    assert m["p2p"]["sizes"][0] == 1024 and all(s > 0 for s in m["p2p"]["seconds"])
    assert m["allreduce"]["ranks"] == 2 and len(m["allreduce"]["sizes"]) == len(m["allreduce"]["seconds"]) >= 3
    assert all(m["checkpoint"][k] > 0 for k in ("save_gbps", "load_gbps", "bytes"))
    assert all(m["restart_phases"][k] > 0 for k in (*PHASES, "total_s"))


@pytest.mark.slow
@pytest.mark.dist
def test_the_fits_are_the_fits_of_the_recorded_points(calibrated):
    profile, _, _ = calibrated
    m = profile["measured"]
    spec = resolve_model("gpt-tiny")
    for kind in (*OPS, "step"):
        line = m["ops"][kind]
        xs = line["params"] if kind == "step" else line["blocks"]
        slope, intercept = np.polyfit(xs, line["medians_s"], 1)
        assert line["per_param_s" if kind == "step" else "per_block_s"] == pytest.approx(slope, rel=1e-6, abs=1e-15)
        assert line["fixed_s"] == pytest.approx(intercept, rel=1e-6, abs=1e-12)
    intercepts = [m["ops"][k]["fixed_s"] for k in OPS[:3]]
    assert profile["op_overhead_s"] == pytest.approx(max(0.0, statistics.median(intercepts)))
    flops = spec.layer_forward_flops(1, 32) + spec.layer_backward_input_flops(1, 32) + spec.layer_backward_weight_flops(1, 32)
    slopes = sum(m["ops"][k]["per_block_s"] for k in OPS[:3])
    assert profile["peak_tflops"] == pytest.approx(flops / slopes / 1e12)
    # point-to-point: a line fitted on relative residuals (weights 1/seconds)
    seconds = np.array(m["p2p"]["seconds"])
    slope, intercept = np.polyfit(m["p2p"]["sizes"], seconds, 1, w=1 / seconds)
    assert m["p2p"]["latency_s"] == pytest.approx(intercept, rel=1e-6)
    assert m["p2p"]["gbps"] == pytest.approx(1 / slope / 1e9, rel=1e-6)
    assert profile["link_latency_us"] == pytest.approx(m["p2p"]["latency_s"] * 1e6)
    assert profile["intra_node_gbps"] == pytest.approx(m["p2p"]["gbps"])
    checkpoint = m["checkpoint"]
    assert profile["storage_gbps"] == pytest.approx(min(checkpoint["save_gbps"], checkpoint["load_gbps"]))
    # the save rate leaves out the fixed cost of the two files a save writes (its shard and its manifest)
    writing = max(checkpoint["save_s"] - 2 * checkpoint["file_s"], 1e-9)
    assert checkpoint["save_gbps"] == pytest.approx(checkpoint["bytes"] / writing / 1e9)
    # and the load rate the fixed cost of reading those two files back (checkpoint_load_file_s)
    reading = max(checkpoint["load_s"] - 2 * checkpoint["load_file_s"], 1e-9)
    assert checkpoint["load_gbps"] == pytest.approx(checkpoint["bytes"] / reading / 1e9)
    phases = m["restart_phases"]
    assert phases["total_s"] == pytest.approx(sum(phases[p] for p in PHASES))
    # the simulator charges the reload (RestoreCheckpoint) and the next iteration on their own
    assert profile["restart_s"] == pytest.approx(phases["total_s"] - phases["checkpoint_s"] - phases["first_iteration_s"])
    assert profile["rendezvous_s"] == pytest.approx(statistics.median(m["group_s"]))
    detection = m["detection"]
    assert profile["detection_s"] == pytest.approx(detection["total_s"])
    assert detection["stale_s"] == STALE_S and detection["detect_s"] >= STALE_S  # detect waits out the staleness


@pytest.mark.slow
@pytest.mark.dist
def test_provenance_summary_and_nothing_left_behind(calibrated):
    profile, stdout, folder = calibrated
    prov = profile["provenance"]
    for key in ("host", "cpu", "gpu", "torch", "python", "date", "command"):
        assert isinstance(prov[key], str) and prov[key], key
    assert "--quick" in prov["command"] and set(profile) - {"name", "measured", "provenance"} <= set(prov["sources"]) | {
        "efficiency"}
    for quantity in (*OPS, "step", "op_overhead_s", "link_latency_us", "intra_node_gbps", "storage_gbps",
                     "restart_s", "detection_s"):
        assert any(line.startswith(quantity + " ") for line in stdout.splitlines()), quantity
    assert sorted(p.name for p in folder.rglob("*")) == ["here.yaml", "profiles"]  # the scratch folder is gone
    peers = [p for p in Path("/proc").glob("[0-9]*") if str(folder) in read_cmdline(p)]
    assert peers == []


def read_cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.dist
def test_the_profile_loads_as_hardware_and_times_the_measured_model(calibrated):
    profile, _, _ = calibrated
    hardware = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.create(profile)))
    model = CostModel(resolve_model("gpt-tiny"), hardware, 1, 32)
    assert model.op_source == "measured"
    forward = profile["measured"]["ops"]["forward"]
    assert model.stage((1, 3), False, False).forward_s == pytest.approx(forward["fixed_s"] + 2 * forward["per_block_s"])


@pytest.mark.parametrize("argv, setting, fix", [
    (["--model", "gpt-nope"], "--model", "choose one of"),
    (["--microbatch-size", "0"], "--microbatch-size", "1 or more"),
    (["--seq-len", "4096"], "--seq-len", "between 2 and 32"),
    (["--threads", "0"], "--threads", "1 or more"),
    (["--name", "a/b"], "--name", "letters"),
])
def test_bad_arguments_exit_2_with_one_line(argv, setting, fix, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "x.yaml")], prog="ftbench calibrate") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"ftbench calibrate: {setting}:") and fix in err
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out: cannot write to" in err and "writable path" in err


def test_ftbench_calibrate_dispatches_before_hydra(monkeypatch, tmp_path, capsys):
    from ftbench.cli import main as ftbench_main

    monkeypatch.setattr(sys, "argv", ["ftbench", "calibrate", "--model", "gpt-nope", "--out", str(tmp_path / "x.yaml")])
    with pytest.raises(SystemExit) as stop:
        ftbench_main()
    assert stop.value.code == 2 and "ftbench calibrate: --model: unknown model 'gpt-nope'" in capsys.readouterr().err
