"""Gantt PNGs, the one-run console summary, and tables over run folders."""
from __future__ import annotations

import csv
import io
import json

import pytest

from ftbench.metrics import SUMMARY_KEYS, write_summary
from ftbench.report import (
    KIND_COLOURS, bubble_fraction, format_summary, gantt_span, human_duration, load_runs, main,
    plot_gantt, plot_gantt_panels, runs_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def op(worker, kind, start, end, mb=None, stage=None):
    return {"worker": worker, "kind": kind, "stage": worker if stage is None else stage,
            "microbatch": mb, "pipeline": 0, "start": start, "end": end}


def two_stage_timeline() -> list[dict]:
    """GPipe-like, 2 stages, 2 micro-batches, F=1 ms, BW=2 ms, then all-reduce and optimizer."""
    ms = 1e-3
    return [
        op(0, "F", 0, 1 * ms, 0), op(0, "F", 1 * ms, 2 * ms, 1),
        op(1, "F", 1 * ms, 2 * ms, 0), op(1, "F", 2 * ms, 3 * ms, 1),
        op(1, "BW", 3 * ms, 5 * ms, 0), op(1, "BW", 5 * ms, 7 * ms, 1),
        op(0, "BW", 5 * ms, 7 * ms, 0), op(0, "BW", 7 * ms, 9 * ms, 1),
        op(0, "AR", 7 * ms, 9.5 * ms), op(1, "AR", 7 * ms, 9.5 * ms),
        op(0, "OPT", 9.5 * ms, 10 * ms), op(1, "OPT", 9.5 * ms, 10 * ms),
    ]


def summary(**changes) -> dict:
    s = {key: None for key in SUMMARY_KEYS}
    s.update(strategy="bamboo", backend="sim", model="gpt-1.3b", dp=2, pp=4, microbatches=8,
             global_batch=16, iterations=1000, samples=16000, time_s=7200.0, throughput=2.2222,
             failures=2, recoveries=[{"time_s": 100.0, "iteration": 10, "recovery_s": 90.0,
                                      "lost_iterations": 1},
                                     {"time_s": 900.0, "iteration": 120, "recovery_s": 30.0,
                                      "lost_iterations": 3}],
             peak_memory_bytes=[30e9, 35.5e9, 20e9], status="ok", error=None)
    s.update(changes)
    return s


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_every_kind_has_a_distinct_colour():
    assert set(KIND_COLOURS) == {"F", "B", "W", "BW", "OPT", "AR"}
    assert len(set(KIND_COLOURS.values())) == len(KIND_COLOURS)


def test_bubble_fraction_ignores_all_reduce():
    # Busy compute: worker 0 has 2+4+0.5 ms, worker 1 has 2+4+0.5 ms, of 2 x 10 ms.
    assert bubble_fraction(two_stage_timeline()) == pytest.approx(1 - 13 / 20)
    assert bubble_fraction([]) == 0.0


def test_gantt_of_two_workers(tmp_path):
    path = plot_gantt(two_stage_timeline(), tmp_path / "g" / "gantt.png", title="2 stages",
                      worker_labels={0: "node 0", 1: "node 1"})
    assert path == tmp_path / "g" / "gantt.png"
    assert_png(path)


def test_gantt_of_a_hundred_workers(tmp_path):
    timeline = [op(w, kind, t, t + 0.5, mb, stage=w % 4)
                for w in range(100) for mb, (kind, t) in enumerate([("F", 0.0), ("B", 1.0),
                                                                   ("W", 2.0), ("OPT", 20.0)])]
    timeline += [op(w, "AR", 2.5, 20.0) for w in range(100)]
    assert_png(plot_gantt(timeline, tmp_path / "big.png", title="100 workers"))


def test_gantt_of_an_empty_timeline(tmp_path):
    assert_png(plot_gantt([], tmp_path / "empty.png"))


def test_gantt_panels_share_one_time_axis(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from ftbench.schedule import one_f_one_b, zb_h1
    from ftbench.sim.simulator import simulate
    from ftbench.sim.unit_costs import UnitCosts

    short = simulate(one_f_one_b(2, 2), UnitCosts()).timeline()  # 8 time units
    long = simulate(zb_h1(2, 4), UnitCosts()).timeline()  # longer: 4 micro-batches
    assert gantt_span([short, long]) == (0.0, max(op["end"] for op in long))
    xlims = []
    save = Figure.savefig

    def spy(fig, *args, **kwargs):  # the figure is closed inside: read its axes while saving
        xlims.extend(ax.get_xlim() for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    path = plot_gantt_panels([("1F1B, 2 micro-batches", short), ("ZB-H1, 4 micro-batches", long)],
                             tmp_path / "p" / "panels.png", title="two schedules")
    assert path == tmp_path / "p" / "panels.png"
    assert_png(path)
    assert len(xlims) == 2 and xlims[0] == xlims[1]
    # A span of 13 (>= 10 s) is drawn in seconds: the longer timeline fits on both panels.
    assert xlims[0][1] >= max(op["end"] for op in long) == 13.0


def test_format_summary_shows_status_and_throughput():
    text = format_summary(summary())
    assert "ok" in text and "2.22 samples/s" in text
    assert "2.00 h" in text  # 7200 s of simulated time
    assert "2 (total 2.00 min)" in text  # two recoveries, 120 s
    assert "35.50 GB" in text
    assert "4" in text.split("lost iterations")[1].splitlines()[0]


def test_format_summary_of_a_failed_run_with_few_keys():
    text = format_summary({"status": "oom", "error": "stage 3 needs 50 GB", "backend": "local"})
    assert "oom: stage 3 needs 50 GB" in text
    assert "wall time" in text


def test_human_duration_units():
    assert human_duration(5) == "5.00 s"
    assert human_duration(90) == "1.50 min"
    assert human_duration(3 * 86400) == "3.00 d"
    assert human_duration(0.0039) == "3.90 ms"
    assert human_duration(None) == "-"


def make_runs(root):
    write_summary(root / "sweep" / "0", summary(strategy="none", throughput=3.14159, failures=0,
                                                recoveries=[]))
    write_summary(root / "sweep" / "1", summary(strategy="bamboo | fast", status="oom",
                                                error="too big"))
    return root / "sweep"


def test_runs_table_markdown_and_csv(tmp_path):
    runs = load_runs([make_runs(tmp_path)])
    assert [r["strategy"] for r in runs] == ["none", "bamboo | fast"]
    assert runs[0]["run_dir"] == str(tmp_path / "sweep" / "0")

    lines = runs_table(runs).strip().splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert lines[0].startswith("| strategy") and set(lines[1]) <= set("|-: ")
    assert "3.142" in lines[2] and "bamboo \\| fast" in lines[3]

    rows = list(csv.reader(io.StringIO(runs_table(runs, fmt="csv"))))
    assert rows[0][:4] == ["strategy", "model", "schedule", "backend"]
    assert len(rows) == 3 and rows[2][0] == "bamboo | fast"


def test_runs_table_derived_columns(tmp_path):
    runs = load_runs([make_runs(tmp_path) / "1" / "summary.json"])
    table = runs_table(runs, ["recoveries", "recovery_s", "lost_iterations", "peak_memory_gb"],
                       fmt="csv")
    assert table.splitlines()[1] == "2,120,4,35.5"


def test_main_prints_a_table(tmp_path, capsys):
    assert main([str(make_runs(tmp_path))]) == 0
    assert capsys.readouterr().out.count("\n") == 4
    out = tmp_path / "t.csv"
    assert main([str(tmp_path / "sweep"), "--csv", "--out", str(out)]) == 0
    assert out.read_text().startswith("strategy,model,schedule,backend")


def test_main_without_summaries_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_load_runs_skips_a_broken_summary(tmp_path):
    make_runs(tmp_path)
    (tmp_path / "sweep" / "2").mkdir()
    (tmp_path / "sweep" / "2" / "summary.json").write_text("{not json")
    with pytest.warns(UserWarning, match="skipping"):
        runs = load_runs([tmp_path])
    assert len(runs) == 2
    assert json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())["strategy"] == "none"
