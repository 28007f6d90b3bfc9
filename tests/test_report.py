"""Gantt PNGs, the one-run console summary, and tables over run folders."""
from __future__ import annotations

import csv
import io
import json

import pytest

from ftbench.metrics import SUMMARY_KEYS, write_summary
from ftbench.console import format_summary, human_duration
from ftbench.gantt import KIND_COLOURS, bubble_fraction, gantt_span, plot_gantt, plot_gantt_panels
from ftbench.report import DEFAULT_COLUMNS, group_by_seed, load_runs, main, override_map, run_clock, runs_table, swept_keys
from ftbench.sweep_check import sweep_exit_code

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
    from ftbench.schedule import KINDS

    assert set(KIND_COLOURS) == {*KINDS, "AR"}  # every row of the op-kind table, and the all-reduce
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


def test_format_summary_shows_ettr_as_a_percentage():
    def ettr_line(**changes):
        return next(line for line in format_summary(summary(**changes)).splitlines() if line.startswith("ETTR"))

    assert ettr_line(ettr=0.973124, productive_s=7006.5).split() == ["ETTR", "97.3", "%"]
    assert ettr_line(ettr=1.0).endswith(" 100.0 %")
    assert ettr_line(ettr=0.99996).endswith(" 99.9 %")  # not 100 % while time was lost
    assert ettr_line(ettr=None, productive_s=3600.0).endswith(" 50.0 %")  # from productive_s / time_s
    assert ettr_line(time_s=0.0).endswith(" -")


def test_format_summary_names_the_modelled_clock_simulated_time():
    local_modelled = format_summary({"status": "ok", "backend": "local", "clock": "model", "time_s": 60.0})
    assert "simulated time" in local_modelled and "wall time" not in local_modelled
    assert "wall time" in format_summary({"status": "ok", "backend": "local", "clock": "wall", "time_s": 60.0})


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


# --------------------------------------------------------------------------- sweeps

LEVEL_OVERRIDES = ["backend=sim", "strategy=recycle", "model=gpt3-medium", "cluster.dp=4"]


def write_level_sweep(root):
    """Three jobs of a sweep over strategy.level: the same strategy, model, shape and status."""
    for n, (level, throughput) in enumerate([("reroute", 196.7), ("decoupled", 225.9),
                                             ("staggered", 225.9)]):
        write_summary(root / "sweep" / str(n),
                      summary(strategy="recycle", throughput=throughput, seed=0,
                              overrides=[*LEVEL_OVERRIDES, f"strategy.level={level}"],
                              swept=["strategy.level"]))
    return root / "sweep"


def test_a_swept_key_gets_a_column(tmp_path):
    runs = load_runs([write_level_sweep(tmp_path)])
    rows = list(csv.reader(io.StringIO(runs_table(runs, fmt="csv"))))
    assert rows[0][:2] == ["strategy", "strategy.level"]
    assert [row[1] for row in rows[1:]] == ["reroute", "decoupled", "staggered"]


def test_override_keys_that_differ_get_a_column_without_swept(tmp_path):
    """Runs from separate command lines: no `swept`, but their overrides differ."""
    for n, every in enumerate([10, 20]):
        write_summary(tmp_path / str(n), summary(overrides=["backend=sim", f"strategy.every={every}"],
                                                 swept=[]))
    rows = list(csv.reader(io.StringIO(runs_table(load_runs([tmp_path]), fmt="csv"))))
    column = rows[0].index("strategy.every")
    assert [row[column] for row in rows[1:]] == ["10", "20"]
    assert "backend=sim" not in rows[0]


def test_swept_keys_with_a_column_are_not_repeated(tmp_path):
    for n, dp in enumerate([2, 4]):
        write_summary(tmp_path / str(n), summary(dp=dp, overrides=[f"cluster.dp={dp}"],
                                                 swept=["cluster.dp", "model"]))
    header = runs_table(load_runs([tmp_path]), fmt="csv").splitlines()[0].split(",")
    assert "cluster.dp" not in header and header.count("dp") == 1 and header.count("model") == 1


def test_default_columns_show_recovery_lost_iterations_and_iteration_time(tmp_path):
    assert {"recovery_s", "lost_iterations", "iteration_s"} <= set(DEFAULT_COLUMNS)
    write_summary(tmp_path / "0", summary(iteration_time_s=0.25))
    lines = runs_table(load_runs([tmp_path])).splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    row = dict(zip(header, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert row["recovery total (sim s)"] == "120" and row["lost iterations"] == "4"
    assert row["iteration (sim s)"] == "0.25"


def test_ettr_column_follows_throughput(tmp_path):
    assert DEFAULT_COLUMNS.index("ettr") == DEFAULT_COLUMNS.index("throughput") + 1
    write_summary(tmp_path / "0", summary(ettr=0.973124))
    write_summary(tmp_path / "1", summary(strategy="none", ettr=None, productive_s=1800.0))  # ettr left out: derived
    lines = runs_table(load_runs([tmp_path])).splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert header[header.index("throughput (samples/sim s)") + 1] == "ETTR"
    rows = [dict(zip(header, [c.strip() for c in line.strip("|").split("|")])) for line in lines[2:]]
    assert [row["ETTR"] for row in rows] == ["0.9731", "0.25"]
    table = list(csv.DictReader(io.StringIO(runs_table(load_runs([tmp_path]), fmt="csv"))))
    assert [float(row["ETTR"]) for row in table] == [pytest.approx(0.9731), 0.25]


def test_headers_state_the_clock(tmp_path):
    write_summary(tmp_path / "sim", summary(backend="sim"))
    write_summary(tmp_path / "local", summary(backend="local", clock="wall", time_s=3.5))
    write_summary(tmp_path / "modelled", summary(backend="local", clock="model"))
    sim_only = runs_table(load_runs([tmp_path / "sim"])).splitlines()[0]
    assert "time (sim s)" in sim_only and "throughput (samples/sim s)" in sim_only
    assert "clock" not in sim_only
    wall_only = runs_table(load_runs([tmp_path / "local"])).splitlines()[0]
    assert "time (wall s)" in wall_only and "recovery total (wall s)" in wall_only
    # A local run on the modelled clock counts simulated seconds, like sim.
    assert "time (sim s)" in runs_table(load_runs([tmp_path / "modelled"])).splitlines()[0]

    mixed = list(csv.reader(io.StringIO(runs_table(load_runs([tmp_path]), fmt="csv"))))
    assert "time (s)" in mixed[0] and "time (sim s)" not in mixed[0]
    clock = mixed[0].index("clock")
    assert clock == mixed[0].index("backend") + 1
    assert sorted(row[clock] for row in mixed[1:]) == ["sim", "sim", "wall"]
    assert [run_clock(r) for r in ({"backend": "sim"}, {"backend": "local"}, {})] == ["sim", "wall", None]


def test_local_iteration_time_is_the_median_from_metrics(tmp_path):
    run = tmp_path / "local"
    write_summary(run, summary(backend="local", clock="wall"))
    lines = [{"event": "iteration", "iteration": i, "iteration_s": s, "time_s": i + 1.0}
             for i, s in enumerate([0.5, 0.1, 0.2, 9.0])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert runs_table(load_runs([run]), ["iteration_s"], fmt="csv").splitlines() == [
        "iteration (wall s)", "0.35"]


def write_seed_sweep(root, strategies=("checkpoint",), seeds=(0, 1, 2)):
    for n, (strategy, seed) in enumerate((s, seed) for s in strategies for seed in seeds):
        write_summary(root / "sweep" / str(n),
                      summary(strategy=strategy, seed=seed, throughput=10.0 + seed, failures=seed,
                              overrides=["backend=sim", f"strategy={strategy}", f"seed={seed}"],
                              swept=["strategy", "seed"] if len(strategies) > 1 else ["seed"]))
    return root / "sweep"


def test_runs_that_differ_only_in_the_seed_share_a_row(tmp_path):
    runs = load_runs([write_seed_sweep(tmp_path, strategies=("checkpoint", "varuna"))])
    assert [len(g) for g in group_by_seed(runs)] == [3, 3]
    lines = runs_table(runs).splitlines()
    assert len([line for line in lines if line.startswith("| checkpoint") or line.startswith("| varuna")]) == 2
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    row = dict(zip(header, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert row["throughput (samples/sim s)"] == "11 ± 1"  # mean ± sample std of 10, 11, 12
    assert row["pp"] == "4" and row["seeds"] == "0,1,2" and "seed" not in header
    assert "mean ± sample standard deviation" in lines[-1]

    rows = list(csv.reader(io.StringIO(runs_table(runs, fmt="csv"))))
    assert rows[0][rows[0].index("throughput (samples/sim s)") + 1] == "throughput (samples/sim s) std"
    assert rows[1][rows[0].index("throughput (samples/sim s)")] == "11"
    assert rows[1][rows[0].index("throughput (samples/sim s) std")] == "1"

    per_run = list(csv.reader(io.StringIO(runs_table(runs, fmt="csv", aggregate=False))))
    assert len(per_run) == 7 and "seed" in per_run[0] and "seeds" not in per_run[0]


def test_runs_with_other_differences_or_no_overrides_are_not_grouped(tmp_path):
    write_seed_sweep(tmp_path / "a", seeds=(0, 1))
    write_summary(tmp_path / "b", summary(strategy="checkpoint", seed=2, status="oom",
                                          overrides=["backend=sim", "strategy=checkpoint", "seed=2"]))
    write_summary(tmp_path / "c" / "0", summary(seed=0))  # older summaries: no overrides recorded
    write_summary(tmp_path / "c" / "1", summary(seed=1))
    runs = load_runs([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert [len(g) for g in group_by_seed(runs)] == [2, 1, 1, 1]


def test_main_warns_about_unknown_columns(tmp_path, capsys):
    write_level_sweep(tmp_path)
    assert main([str(tmp_path / "sweep"), "--columns", "strategy,strategy.level,thruput"]) == 0
    captured = capsys.readouterr()
    assert "unknown column thruput" in captured.err and "valid columns:" in captured.err
    assert "throughput" in captured.err.split("valid columns:")[1]
    assert "reroute" in captured.out
    assert main([str(tmp_path / "sweep"), "--columns", "strategy,recovery_s,dp"]) == 0
    assert capsys.readouterr().err == ""


def test_main_per_run(tmp_path, capsys):
    write_seed_sweep(tmp_path)
    assert main([str(tmp_path / "sweep")]) == 0
    assert "±" in capsys.readouterr().out
    assert main([str(tmp_path / "sweep"), "--per-run"]) == 0
    assert "±" not in capsys.readouterr().out


def test_override_map():
    assert override_map(["a.b=1", "+c=x,y", "~d", "e=[{iteration:5,node:1}]", "f=0.5"]) == {
        "a.b": 1, "c": "x,y", "d": None, "e": "[{iteration:5,node:1}]", "f": 0.5}
    assert override_map(None) == {}


def test_swept_keys_from_multirun_yaml(tmp_path):
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n"
        "  sweeper:\n"
        "    params:\n"
        "      train.lr: 1e-3,1e-4\n"
        "  overrides:\n"
        "    task:\n"
        "    - backend=sim\n"
        "    - strategy.level=reroute,decoupled\n"
        "    - seed=range(3)\n"
        "    - failures.events=[{iteration:50,node:1}]\n"
        "    - 'model.name=\"a,b\"'\n"
        "seed: 0\n")
    assert swept_keys(tmp_path) == ["train.lr", "strategy.level", "seed"]
    with pytest.warns(UserWarning, match="cannot read"):
        assert swept_keys(tmp_path / "missing") == []


def test_sweep_exit_code():
    assert sweep_exit_code(["oom", "ok"]) == 0
    assert sweep_exit_code(["oom", "unrecoverable"]) == 3
    assert sweep_exit_code(["oom", "error"]) == 3
    assert sweep_exit_code(["error", "error"]) == 2
    assert sweep_exit_code([]) == 3


def test_format_summary_ends_with_the_run_folder():
    text = format_summary({"status": "ok", "backend": "sim", "run_dir": "/somewhere/run"})
    assert text.splitlines()[-1].split() == ["run", "folder", "/somewhere/run"]


def test_the_console_summary_says_what_the_run_swept_and_what_its_recoveries_answered():
    """Under a sweep the summary names the values this run ran with; recoveries after joins
    (a job growing back) are counted apart from those after failures; on dist the measured
    death to regroup, which the recoveries' own times leave out, is shown beside them."""
    text = format_summary(summary(
        swept=["strategy", "failures.job_mtbf_hours"], overrides=["strategy=oobleck", "failures.job_mtbf_hours=3",
                                                                  "cluster.dp=4"],
        recoveries=[{"cause": "fail", "recovery_s": 2.0}, {"cause": "fail", "recovery_s": 1.0},
                    {"cause": "join", "recovery_s": 1.0}],
        measured_recoveries=[{"death_to_regroup_s": 2.5}, {"death_to_regroup_s": 3.0}]))
    lines = dict(line.split(None, 1) if not line.startswith(("measured", "pp x")) else (line[:15], line[15:])
                 for line in text.splitlines())
    assert lines["swept"].strip() == "strategy=oobleck, failures.job_mtbf_hours=3"
    assert lines["recoveries"].strip() == "3 (after 2 failures and 1 join) (total 4.00 s)"
    assert lines["measured (dist)"].strip().startswith("death to regroup 5.50 s over 2 (worst 3.00 s)")
    plain = format_summary(summary(recoveries=[{"cause": "fail", "recovery_s": 2.0}]))
    assert "swept" not in plain and "measured" not in plain and "join" not in plain


def test_loss_png_is_drawn_only_beside_a_reference(tmp_path):
    from ftbench.loss_plot import plot_loss

    run = summary(losses=[5.0, 4.8, None], fault_free_losses=[5.0, 4.8, 4.7], matches_fault_free=False,
                  recoveries=[{"iteration": 2, "restored_iteration": 1, "cause": "fail", "recovery_s": 1.0},
                              {"iteration": 2, "cause": "join", "recovery_s": 0.5}])
    assert_png(plot_loss(run, tmp_path / "loss.png"))
    assert plot_loss(summary(losses=[5.0]), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_a_dist_job_with_more_ranks_than_cores_says_so(capsys, monkeypatch):
    import ftbench.threads as threads
    from ftbench.run import say_if_oversubscribed

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    assert say_if_oversubscribed(16, "self")
    assert "16 dist ranks share 2 usable core(s)" in capsys.readouterr().err
    assert not say_if_oversubscribed(2, "self") and not say_if_oversubscribed(16, "torchrun")
    assert capsys.readouterr().err == ""
