"""Traces replay as the Oobleck artifact replays them: time starts at the trace's first event
(measured spot traces start late), the run ends at its last event, and nodes the trace adds
later join as new node ids. The AWS spot traces run on sim."""
import pytest

from conftest import run
from ftbench.config import FailuresConfig
from ftbench.failures import TRACES_DIR, FailureEvent, build_failure_script, read_trace
from ftbench.metrics import read_metrics

SIM = ("backend=sim", "model=gpt-tiny", "wandb.mode=disabled", "report.gantt=false")
# The Oobleck Table 2 grid (4 GPUs per node, pp 4, dp 1), shrunk to gpt-tiny and 8 micro-batches.
AWS = (*SIM, "cluster.gpus_per_node=4", "cluster.pp=4", "cluster.dp=1", "cluster.spares=0", "train.global_batch=8",
       "train.iterations=10000000000", "failures=trace")
AWS_END_S = {"aws-p3-trace.csv": 40920.0, "aws-g4dn-trace.csv": 38760.0 - 480.0}  # last row, after the shift


def late_trace(tmp_path, rows="") -> str:
    """8 nodes that appear 5 s into the file, then `rows`."""
    path = tmp_path / "late.csv"
    path.write_text("".join(f"5000,add,n{k}\n" for k in range(8)) + rows)
    return str(path)


def test_a_trace_that_starts_late_starts_at_its_first_event(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("480000,add,a\n480000,add,b\n540000,add,c\n600000,remove,a\n")
    initial, events = read_trace(path)
    assert initial == 2  # the adds at the first instant are the job
    assert events == [FailureEvent(node=2, kind="join", time_s=60.0), FailureEvent(node=0, kind="fail", time_s=120.0)]
    script = build_failure_script(FailuresConfig(kind="trace", path=str(path)), 2, 0)
    assert script.initial_nodes == 2 and script.end_s == 120.0
    assert "shifted 480 s earlier" in script.description and "ends at its last event (120 s)" in script.description


def test_the_aws_g4dn_trace_starts_with_its_first_node():
    initial, events = read_trace(TRACES_DIR / "aws-g4dn-trace.csv")  # first row: 480000,add,node1
    assert initial == 1
    assert events[0] == FailureEvent(node=1, kind="join", time_s=60.0)
    assert [e.time_s for e in events[1:20]] == [120.0] * 19
    assert events[-1].time_s == AWS_END_S["aws-g4dn-trace.csv"]


def test_a_trace_that_starts_at_zero_is_not_shifted():
    script = build_failure_script(FailuresConfig(kind="trace", path="aws-p3-trace.csv"), 18, 0)
    assert script.initial_nodes == 18 and "shifted" not in script.description
    assert script.end_s == AWS_END_S["aws-p3-trace.csv"]
    off = build_failure_script(FailuresConfig(kind="trace", path="aws-p3-trace.csv", end_at_last_event=False), 18, 0)
    assert off.end_s is None


def test_the_run_ends_at_the_last_event(tmp_path):
    trace = late_trace(tmp_path, "3605000,add,n8\n")  # a join an hour after the start: the last event
    s = run(tmp_path / "end", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}",
            "train.iterations=10000000000")
    assert s["status"] == "ok" and "shifted 5 s earlier" in s["failure_script"]
    assert 3600.0 - s["iteration_time_s"] < s["time_s"] <= 3600.0
    assert not [r for r in read_metrics(tmp_path / "end") if r.get("event") == "join"]  # the end is not replayed

    # Earlier at train.iterations (the default 20) ...
    s = run(tmp_path / "short", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}")
    assert s["status"] == "ok" and s["iterations"] == 20 and s["time_s"] < 1.0
    # ... and with end_at_last_event off, only train.iterations / train.max_hours end it.
    s = run(tmp_path / "on", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}",
            "failures.end_at_last_event=false", "train.max_hours=2", "train.iterations=10000000000")
    assert s["status"] == "ok" and 7200.0 - s["iteration_time_s"] < s["time_s"] <= 7200.0
    joins = [r for r in read_metrics(tmp_path / "on") if r.get("event") == "join"]
    assert [(r["node"], r["time_s"]) for r in joins] == [(8, pytest.approx(3600.0, abs=1e-3))]


def test_cluster_nodes_come_from_the_trace(tmp_path):
    trace = late_trace(tmp_path)  # 8 nodes, the default grid pp 4 x dp 2
    s = run(tmp_path / "unset", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}")
    assert s["status"] == "ok"
    s = run(tmp_path / "wrong", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}", "cluster.nodes=9")
    assert s["status"] == "error" and "`cluster.nodes`" in s["error"] and "starts with 8 node(s)" in s["error"]
    s = run(tmp_path / "grid", *SIM, "strategy=none", "failures=trace", f"failures.path={trace}", "cluster.dp=3")
    assert s["status"] == "error" and "`cluster.dp`" in s["error"] and "needs 12 GPUs" in s["error"]


@pytest.mark.parametrize("trace", ["aws-p3-trace.csv", "aws-g4dn-trace.csv"])
@pytest.mark.parametrize("strategy", ["oobleck", "varuna"])
def test_the_aws_traces_run_on_sim(tmp_path, strategy, trace):
    extra = ("strategy.batch_split=greedy",) if strategy == "oobleck" else ()
    s = run(tmp_path, *AWS, f"strategy={strategy}", *extra, f"failures.path={trace}")
    assert s["status"] == "ok", s["error"]
    initial = 18 if trace == "aws-p3-trace.csv" else 1
    # The run ends at the trace's last event (a restart under way then may finish after it).
    assert AWS_END_S[trace] - 600 < s["time_s"] < AWS_END_S[trace] + 600
    assert s["failures"] > 50 and s["recoveries"]
    records = read_metrics(tmp_path)
    joined = {r["node"] for r in records if r.get("event") == "join" and not r.get("before_start")}
    assert max(joined) >= initial + 50  # nodes never seen before join the job
    waits = [r for r in records if r.get("event") == "waiting"]
    if strategy == "oobleck" and trace == "aws-g4dn-trace.csv":
        # g4dn starts with one node; oobleck needs f+1 = 2 pipelines: it starts when node 2 comes, 60 s in
        assert [w["time_s"] for w in waits] == [60.0]
        assert [r["event"] for r in records[:3]] == ["start", "join", "waiting"]
    else:
        assert not waits


def _membership(run_dir) -> list[dict]:
    """The trace events the run applied, in order (before the start, while running, while waiting)."""
    return [r for r in read_metrics(run_dir) if r.get("event") in ("fail", "join") and not r.get("ignored")]


@pytest.mark.parametrize("strategy, trace_rows, dip_s, back_s, end_s", [
    # 2 nodes: oobleck's f+1 = 2 pipelines of one node; losing one leaves too few until a node comes
    ("oobleck", "0,add,a\n0,add,b\n50000,remove,b\n100000,add,c\n300000,add,d\n", 50.0, 100.0, 300.0),
    # varuna restarts on b (60 s), then has no worker left: it waits, then restarts from its checkpoint
    ("varuna", "0,add,a\n0,add,b\n50000,remove,a\n150000,remove,b\n250000,add,c\n400000,add,d\n", 150.0, 250.0,
     400.0),
])
def test_too_few_nodes_mid_trace_wait_for_joins(tmp_path, strategy, trace_rows, dip_s, back_s, end_s):
    trace = tmp_path / "dip.csv"
    trace.write_text(trace_rows)
    extra = ("strategy.batch_split=greedy",) if strategy == "oobleck" else ()
    s = run(tmp_path / "run", *AWS, f"strategy={strategy}", *extra, f"failures.path={trace}")
    assert s["status"] == "ok", s["error"]
    records = read_metrics(tmp_path / "run")
    waiting = [r for r in records if r.get("event") == "waiting"]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert [r["time_s"] for r in waiting] == [pytest.approx(dip_s, abs=0.01)]
    assert [r["time_s"] for r in resumed] == [back_s] and resumed[0]["waited_s"] == pytest.approx(back_s - dip_s, abs=0.01)
    assert [(r["event"], r["node"], r.get("while_waiting")) for r in records if r.get("event") == "join"] == [
        ("join", 2, True)]  # c (id 2) joins while the job waits; d's join is the trace's end
    assert resumed[0]["nodes"] == (2 if strategy == "oobleck" else 1)  # a and c; c alone
    assert records[records.index(resumed[0]) + 1]["event"] == "recovery"
    assert end_s - s["iteration_time_s"] < s["time_s"] <= end_s
    # the wait trains nothing: the run's productive time leaves it out
    assert s["productive_s"] <= s["time_s"] - (back_s - dip_s) + 1e-6
    # without a trace that brings nodes, the same loss still ends the run
    s = run(tmp_path / "scripted", *SIM, "cluster.gpus_per_node=4", "cluster.pp=4", "cluster.dp=1",
            "cluster.nodes=2", "cluster.spares=0", "train.global_batch=8", "train.iterations=1000",
            f"strategy={strategy}", *extra, "failures=scripted",
            "failures.events=[{iteration:3,node:1}]" if strategy == "oobleck"
            else "failures.events=[{iteration:3,node:0},{iteration:5,node:1}]")
    assert s["status"] == "unrecoverable"
    assert not [r for r in read_metrics(tmp_path / "scripted") if r.get("event") == "waiting"]


QUIET = ("wandb.mode=disabled", "report.gantt=false", "report.progress=false")


@pytest.mark.parametrize("strategy", ["oobleck", "varuna", "bamboo"])
def test_the_oobleck_table_aws_column_replays_the_trace(tmp_path, strategy):
    """One cell of the AWS g4dn column of +experiment=oobleck-table2 (GPT-3 Medium), its first
    half hour: the job starts with the trace's one node (cluster.nodes from the trace), waits
    where the system cannot start on it, and applies the trace's events in order, at or after
    their times; the run ends at the limit."""
    from ftbench.cli import compose
    from ftbench.run import execute

    # (Bamboo's own setting, no recompute, runs out of memory on GPT-3 Medium; the replay is what is checked)
    fits = ["train.recompute=full"] if strategy == "bamboo" else []
    cfg = compose(["+experiment=oobleck-table2", "model=gpt3-medium", f"strategy={strategy}",
                   "table.column=aws-g4dn", "train.max_hours=0.5", *fits, *QUIET])
    s = execute(cfg, tmp_path, echo=lambda *_: None)
    assert s["status"] == "ok", s["error"]
    assert "aws-g4dn-trace.csv, shifted 480 s earlier" in s["failure_script"]
    records = read_metrics(tmp_path)
    assert next(r for r in records if r.get("event") == "start")["nodes"] == 1
    initial, events = read_trace(TRACES_DIR / "aws-g4dn-trace.csv")
    due = [e for e in events if e.time_s < 1800.0]
    applied = _membership(tmp_path)
    assert [(r["event"], r["node"]) for r in applied] == [(e.kind, e.node) for e in due][:len(applied)]
    assert all(r["time_s"] >= e.time_s for r, e in zip(applied, due))
    waits = [r["time_s"] for r in records if r.get("event") == "waiting"]
    if strategy == "varuna":  # its fastest shape on one node's 4 GPUs
        assert not waits
    else:  # oobleck: 2 pipelines of n0 = 3 nodes; bamboo: 6 stages, a node each: 120 s brings 19 nodes
        assert waits == [60.0, 120.0]
        assert min(r["time_s"] for r in records if r.get("event") == "recovery") > 120.0
    if strategy == "oobleck":  # its recoveries take seconds: it keeps up with the trace
        assert len(applied) == len(due) == 36
    else:  # restarts (varuna) and rendezvous (bamboo) of a minute or two: events queue behind them
        assert len(applied) >= 25
    assert 1800.0 - s["iteration_time_s"] < s["time_s"] < 1800.0 + 300.0
    assert s["failures"] == sum(r["event"] == "fail" for r in applied) > 0
