"""benchmarks/sim_vs_real.py runs: a tiny version of its matrix (one local row and the same on
sim with a given profile), without timing assertions (issue 39 item 4)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location("sim_vs_real", ROOT / "benchmarks" / "sim_vs_real.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_matrix_prints_a_row_and_a_line_per_quantity(tmp_path, capsys):
    profiles = tmp_path / "conf" / "hardware"
    profiles.mkdir(parents=True)
    text = (ROOT / "conf" / "hardware" / "cpu.yaml").read_text().replace("name: cpu", "name: tiny-test")
    (profiles / "tiny-test.yaml").write_text(text + "provenance: {host: test}\n")
    assert _benchmark().main(["--tiny", "--profile", str(profiles / "tiny-test.yaml"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("checkpoint one failure"))
    assert "local-1" in row and row.count("=") == 4  # predicted/measured=ratio for each quantity
    for quantity in ("iteration", "checkpoint stall", "recovery", "run time"):
        assert f"{quantity}: median " in out and "worst" in out
    assert (tmp_path / "out" / "sim_vs_real.png").stat().st_size > 0


def test_a_profile_outside_a_hardware_folder_is_refused(tmp_path, capsys):
    assert _benchmark().main(["--tiny", "--profile", str(tmp_path / "p.yaml"), "--out", str(tmp_path)]) == 2
    assert "--profile must be a file in a folder named hardware/" in capsys.readouterr().err


def test_the_matrix_takes_ranks_strategies_and_cases():
    bench = _benchmark()
    got = bench.rows(False, ranks=(1, 16), strategies=("checkpoint",), backends=("dist",), cases=("one failure",))
    assert [(processes, overrides[:2]) for _, _, processes, overrides in got] == [
        (1, ("cluster.pp=1", "cluster.dp=1")), (16, ("cluster.pp=4", "cluster.dp=4"))]
    one, sixteen = (overrides for _, _, _, overrides in got)
    # a one-rank job loses its only node, and its replacement takes its place; a larger one keeps a standby
    assert "failures.events=[{iteration:5,node:0}]" in one and "cluster.spares=1" not in one
    assert "failures.events=[{iteration:5,node:1}]" in sixteen and "cluster.spares=1" in sixteen
    assert all(label == "checkpoint one failure" and backend == "dist" for label, backend, _, _ in got)


def test_bad_matrix_settings_name_the_setting(tmp_path, capsys):
    bench = _benchmark()
    for argv, setting in ((["--ranks", "3"], "--ranks"), (["--strategies", "nope"], "--strategies"),
                          (["--backends", "sim"], "--backends"), (["--cases", "two failures"], "--cases"),
                          (["--device", "cuda", "--ranks", "2"], "--device cuda")):
        assert bench.main([*argv, "--out", str(tmp_path)]) == 2
        assert f"sim_vs_real.py: {setting}" in capsys.readouterr().err
