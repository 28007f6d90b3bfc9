"""Failure scripts: scripted, interval, poisson and trace sources, and their config errors."""
from __future__ import annotations

import math
import time

import pytest

from ftbench.config import FailureEventConfig, FailuresConfig
from ftbench.errors import ConfigError
from ftbench.failures import (FailureEvent, TRACES_DIR, build_failure_script, read_trace,
                              take_until)

HOUR = 3600.0


def build(num_nodes=8, run_seed=0, **kwargs):
    """A script from FailuresConfig(**kwargs); `run_seed` is the run's seed, `seed=` the group's."""
    return build_failure_script(FailuresConfig(**kwargs), num_nodes, run_seed)


def config_error(num_nodes=8, **kwargs) -> ConfigError:
    # Building alone must raise: errors may not wait until a lazy stream is read.
    with pytest.raises(ConfigError) as info:
        build(num_nodes, **kwargs)
    return info.value


# --- none / scripted -------------------------------------------------------------------------

def test_none_has_no_events():
    script = build(kind="none")
    assert script.by_iteration == [] and list(script.by_time) == []


def test_scripted_splits_and_sorts_events():
    events = [
        FailureEventConfig(node=3, iteration=10),
        FailureEventConfig(node=1, time_s=500.0),
        FailureEventConfig(node=2, iteration=4),
        FailureEventConfig(node=5, time_s=20.0, kind="join"),
        FailureEventConfig(node=0, iteration=4),  # same iteration as node 2: keeps its order
        FailureEventConfig(node=42, time_s=500.0, kind="join"),  # a brand-new node may join
    ]
    script = build(num_nodes=4, kind="scripted", events=events)
    assert script.by_iteration == [
        FailureEvent(node=2, iteration=4), FailureEvent(node=0, iteration=4),
        FailureEvent(node=3, iteration=10)]
    assert list(script.by_time) == [
        FailureEvent(node=5, kind="join", time_s=20.0), FailureEvent(node=1, time_s=500.0),
        FailureEvent(node=42, kind="join", time_s=500.0)]


@pytest.mark.parametrize("event, words", [
    (FailureEventConfig(node=1), "exactly one"),
    (FailureEventConfig(node=1, iteration=3, time_s=5.0), "exactly one"),
    (FailureEventConfig(node=1, iteration=3, kind="explode"), "explode"),
    (FailureEventConfig(node=4, iteration=3), "node 4"),
    (FailureEventConfig(node=-1, iteration=3, kind="join"), "node -1"),
    (FailureEventConfig(node=1, iteration=-2), "negative"),
    (FailureEventConfig(node=1, time_s=-1.0), "negative"),
])
def test_scripted_bad_event_names_its_index(event, words):
    good = FailureEventConfig(node=0, iteration=1)
    err = config_error(num_nodes=4, kind="scripted", events=[good, event])
    assert err.setting == "failures.events[1]"
    assert "failures.events[1]" in str(err) and words in str(err)


# --- validation of the group ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, setting, example", [
    (dict(kind="interval"), "failures.every", "failures=interval failures.every="),
    (dict(kind="poisson"), "failures.mtbf_hours", "failures=poisson failures.mtbf_hours="),
    (dict(kind="trace"), "failures.path", "failures=trace failures.path="),
    (dict(kind="poisson", mtbf_hours=0.0), "failures.mtbf_hours", "not positive"),
    (dict(kind="poisson", mtbf_hours=10.0, repair_hours=-1.0), "failures.repair_hours", "not positive"),
    (dict(kind="interval", every="soon"), "failures.every", "not a duration"),
    (dict(kind="interval", every="6h", count=-1), "failures.count", "negative"),
])
def test_missing_or_bad_settings_are_named(kwargs, setting, example):
    err = config_error(**kwargs)
    assert err.setting == setting
    assert f"`{setting}`" in str(err) and example in str(err)


def test_unknown_kind_lists_the_options():
    err = config_error(kind="meteor")
    assert err.setting == "failures"
    for option in ("none", "scripted", "interval", "poisson", "trace"):
        assert option in str(err)


def test_events_without_scripted_kind_are_rejected():
    err = config_error(kind="poisson", mtbf_hours=10.0, events=[FailureEventConfig(node=0, iteration=1)])
    assert err.setting == "failures.events"
    assert "failures=scripted" in str(err)


# --- interval -----------------------------------------------------------------------------

def test_interval_removes_distinct_nodes_at_multiples_of_the_period_until_none_left():
    script = build(num_nodes=10, kind="interval", every="30m")
    events = list(script.by_time)
    assert len(events) == 10  # stops once every node is gone
    assert [e.time_s for e in events] == [k * 1800.0 for k in range(1, 11)]
    assert sorted(e.node for e in events) == list(range(10))
    assert all(e.kind == "fail" and e.iteration is None for e in events)
    assert script.by_iteration == []


def test_interval_stops_after_count_and_seed_picks_nodes():
    events = list(build(num_nodes=100, kind="interval", every="6h", count=5).by_time)
    assert [e.time_s for e in events] == [k * 6 * HOUR for k in range(1, 6)]
    assert len({e.node for e in events}) == 5
    again = list(build(num_nodes=100, kind="interval", every="6h", count=5).by_time)
    other = list(build(num_nodes=100, run_seed=1, kind="interval", every="6h", count=5).by_time)
    assert again == events and other != events
    # failures.seed wins over the run's seed
    pinned = list(build(num_nodes=100, run_seed=1, kind="interval", every="6h", count=5, seed=0).by_time)
    assert pinned == events


def test_interval_without_count_is_lazy():
    stream = build(num_nodes=1_000_000, kind="interval", every="1h").by_time
    assert [e.time_s for e in take_until(stream, 3 * HOUR)] == [HOUR, 2 * HOUR, 3 * HOUR]


# --- poisson ------------------------------------------------------------------------------

def test_poisson_same_seed_same_events_other_seed_other_events():
    def first(seed):
        return take_until(build(num_nodes=64, run_seed=seed, kind="poisson", mtbf_hours=50.0,
                                repair_hours=2.0).by_time, 200 * HOUR)
    assert first(7) == first(7)
    assert first(7) != first(8)
    times = [e.time_s for e in first(7)]
    assert times == sorted(times) and len(times) > 100


def test_poisson_failure_rate_matches_mtbf():
    nodes, mtbf, horizon = 20_000, 100.0, 50.0
    events = take_until(build(num_nodes=nodes, run_seed=3, kind="poisson", mtbf_hours=mtbf).by_time,
                        horizon * HOUR)
    assert all(e.kind == "fail" for e in events)
    assert len({e.node for e in events}) == len(events)  # without repair each node fails once
    expected = 1 - math.exp(-horizon / mtbf)  # P(Exp(mtbf) <= horizon)
    assert len(events) / nodes == pytest.approx(expected, rel=0.03)


def test_poisson_without_repair_ends_when_all_nodes_are_down():
    events = list(build(num_nodes=50, kind="poisson", mtbf_hours=1.0).by_time)
    assert sorted(e.node for e in events) == list(range(50))


def test_poisson_repair_rejoins_after_repair_hours_and_fails_again():
    repair = 3.0
    events = take_until(build(num_nodes=20, run_seed=5, kind="poisson", mtbf_hours=10.0,
                              repair_hours=repair).by_time, 500 * HOUR)
    by_node: dict[int, list[FailureEvent]] = {}
    for e in events:
        by_node.setdefault(e.node, []).append(e)
    joins = 0
    for history in by_node.values():
        # fail, join, fail, join, ... per node, each join exactly `repair` after its fail
        assert [e.kind for e in history] == ["fail", "join"] * (len(history) // 2) + ["fail"] * (len(history) % 2)
        for fail, join in zip(history[0::2], history[1::2]):
            assert join.time_s - fail.time_s == pytest.approx(repair * HOUR, abs=1e-6)
            joins += 1
    assert joins > 100


def test_poisson_count_limits_failures():
    events = list(build(num_nodes=30, kind="poisson", mtbf_hours=5.0, repair_hours=1.0, count=12).by_time)
    assert sum(e.kind == "fail" for e in events) == 12
    assert events[-1].kind == "fail"


def test_poisson_large_cluster_is_cheap():
    start = time.perf_counter()
    events = take_until(build(num_nodes=16_384, kind="poisson", mtbf_hours=50_000.0,
                              repair_hours=2.0).by_time, 30 * 24 * HOUR)
    assert time.perf_counter() - start < 2.0
    # 16384 nodes * 720 h / 50000 h is about 236 failures, plus their joins
    assert 150 < sum(e.kind == "fail" for e in events) < 330


# --- trace --------------------------------------------------------------------------------

def test_6h_trace_matches_the_file():
    rows = [line.split(",") for line in (TRACES_DIR / "6h.csv").read_text().split()]
    initial_rows = [r for r in rows if r[0] == "0" and r[1] == "add"]
    removals = [r for r in rows if r[1] == "remove"]
    assert len(initial_rows) == 30 and len(removals) == 15  # what the file holds

    script = build(num_nodes=30, kind="trace", path=str(TRACES_DIR / "6h.csv"))
    events = list(script.by_time)
    assert script.initial_nodes == 30
    assert [e.kind for e in events] == ["fail"] * 15
    assert [e.time_s for e in events] == [k * 6 * HOUR for k in range(1, 16)]
    # ids follow first appearance: node1 -> 0, ..., node30 -> 29
    assert [e.node for e in events] == [int(r[2].removeprefix("node")) - 1 for r in removals]


def test_aws_p3_trace_has_fails_and_joins():
    initial, events = read_trace(TRACES_DIR / "aws-p3-trace.csv")
    assert initial == 18
    kinds = [e.kind for e in events]
    assert kinds.count("fail") == 167 and kinds.count("join") == 177 - 18
    times = [e.time_s for e in events]
    assert times == sorted(times) and times[-1] == pytest.approx(11.37 * HOUR, rel=1e-3)


def test_trace_count_limits_fail_events():
    events = list(build(kind="trace", path="aws-p3-trace.csv", count=10).by_time)
    assert sum(e.kind == "fail" for e in events) == 10 and events[-1].kind == "fail"


def test_trace_tolerates_blank_lines_and_spaces(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,nodeA\n\n 0 , add , nodeB \r\n1500,remove,nodeB\n  \n2500,add,nodeC\n")
    initial, events = read_trace(trace)
    assert initial == 2
    assert events == [FailureEvent(node=1, kind="fail", time_s=1.5),
                      FailureEvent(node=2, kind="join", time_s=2.5)]


@pytest.mark.parametrize("bad_row", ["1000,remove", "soon,remove,node1", "1000,crash,node1",
                                     "1000,remove,node9", "-5,remove,node1"])
def test_malformed_trace_row_names_file_and_line(tmp_path, bad_row):
    trace = tmp_path / "broken.csv"
    trace.write_text(f"0,add,node1\n0,add,node2\n\n{bad_row}\n")
    with pytest.raises(ConfigError) as info:
        build(kind="trace", path=str(trace))
    assert info.value.setting == "failures.path"
    assert "broken.csv" in str(info.value) and "line 4" in str(info.value)


def test_trace_path_resolves_in_conf_traces(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing called 6h.csv here
    script = build(kind="trace", path="6h.csv")
    assert script.initial_nodes == 30 and "6h.csv" in script.description
    # also relative to the project root
    assert build(kind="trace", path="conf/traces/6h.csv").initial_nodes == 30


def test_trace_path_prefers_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "6h.csv").write_text("0,add,x\n0,add,y\n0,add,z\n")
    assert build(kind="trace", path="6h.csv").initial_nodes == 3


def test_missing_trace_lists_known_traces(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = config_error(kind="trace", path="nope.csv")
    assert err.setting == "failures.path"
    assert "nope.csv" in str(err) and "6h.csv" in str(err) and "aws-p3-trace.csv" in str(err)


# --- take_until / DictConfig -----------------------------------------------------------------

def test_take_until_is_inclusive_and_stops():
    events = iter([FailureEvent(0, time_s=1.0), FailureEvent(1, time_s=2.0), FailureEvent(2, time_s=3.0)])
    assert [e.node for e in take_until(events, 2.0)] == [0, 1]


def test_accepts_omegaconf_dictconfig():
    from omegaconf import OmegaConf
    cfg = OmegaConf.structured(FailuresConfig(
        kind="scripted", events=[FailureEventConfig(node=1, iteration=2), FailureEventConfig(node=0, time_s=9.0)]))
    script = build_failure_script(cfg, 4, 0)
    assert script.by_iteration == [FailureEvent(node=1, iteration=2)]
    assert list(script.by_time) == [FailureEvent(node=0, time_s=9.0)]


def test_a_job_mtbf_is_the_jobs_rate_while_nodes_are_down_for_repair():
    """failures.job_mtbf_hours is the job's rate, as a paper's "a failure every 30 min" column:
    16 nodes each down 1 h after a failure still see 2 failures an hour (independent node draws
    saw 16 / (8 + 1) = 1.78 an hour: a down node cannot fail). Over 2,000 h the count is Poisson(4,000): the
    check is 4 sigma wide (about 6 %)."""
    horizon = 2000.0
    events = take_until(build(num_nodes=16, run_seed=11, kind="poisson", mtbf_hours=None, job_mtbf_hours=0.5,
                              repair_hours=1.0).by_time, horizon * HOUR)
    fails = [e for e in events if e.kind == "fail"]
    expected = horizon / 0.5
    assert abs(len(fails) - expected) <= 4 * math.sqrt(expected), len(fails)
    down: set[int] = set()
    for e in events:  # a failure strikes a node that is up; a join brings back a node that was down
        assert (e.node not in down) if e.kind == "fail" else (e.node in down), e
        (down.add if e.kind == "fail" else down.remove)(e.node)


def test_a_job_mtbf_with_every_node_down_waits_for_a_repair():
    events = take_until(build(num_nodes=2, run_seed=2, kind="poisson", mtbf_hours=None, job_mtbf_hours=0.01,
                              repair_hours=5.0).by_time, 100 * HOUR)
    times = [e.time_s for e in events]
    assert times == sorted(times) and sum(e.kind == "fail" for e in events) > 20
    down = 0
    for e in events:
        down += 1 if e.kind == "fail" else -1
        assert 0 <= down <= 2
    assert list(build(num_nodes=3, kind="poisson", mtbf_hours=None, job_mtbf_hours=1.0).by_time)[-1].kind == "fail"
