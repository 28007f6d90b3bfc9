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
