"""The run loop's journal (ftbench.journal): what a process restarted mid-run replays to get the
loop back. The loop must come back exactly as it was (same records, losses, times) without the
backend doing anything, a damaged journal must not verify, and a loop that does not follow its
journal must stop instead of going on from a wrong state. The real restart is on dist
(tests/test_dist_failures.py: checkpoint restart onto a standby)."""
import pickle
from dataclasses import asdict

import pytest

from ftbench.cli import compose
from ftbench.context import RunContext
from ftbench.journal import Journal, JournalError, verifies
from ftbench.loop import run_loop
from ftbench.assembly.local_engine import local_engine
from ftbench.job import cluster_and_script
from ftbench.sim.cache import SimCache
from ftbench.strategies import build_strategy

SETUP = ["backend=local", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "train.iterations=6",
         "train.microbatches=4", "report.gantt=false", "report.progress=false", "wandb.mode=disabled"]


class Untouchable:
    """A backend the replayed loop must not reach: every call is answered from the journal."""
    jumps = False
    cuts_ops = True

    def __getattr__(self, name):
        raise AssertionError(f"the replayed loop reached the backend ({name})")


def _loop_parts(overrides, tmp_path):
    cfg = compose(SETUP + list(overrides))
    ctx = RunContext.from_config(cfg)
    ctx.run_dir = tmp_path
    cluster, script = cluster_and_script(cfg, ctx)
    ctx.job_mtbf_s, ctx.failures_per_iteration = script.job_mtbf_s, script.failures_per_iteration
    return cfg, ctx, build_strategy(cfg.strategy, ctx), cluster, script


def _recorded_run(overrides, tmp_path):
    """A local run on the wall clock, its loop journaled: (outcome, lines, journal)."""
    from ftbench.engine.backend import LocalBackend

    cfg, ctx, strategy, cluster, script = _loop_parts(overrides, tmp_path)
    lines, journal = [], Journal()
    backend = LocalBackend(local_engine(cfg, ctx, strategy, tmp_path))
    outcome = run_loop(ctx, strategy, cluster, script, backend, SimCache(ctx.cost_model), lines.append,
                       clock="wall", journal=journal)
    return outcome, lines, journal


def _replayed(overrides, tmp_path, journal: Journal):
    _, ctx, strategy, cluster, script = _loop_parts(overrides, tmp_path)
    lines = []
    outcome = run_loop(ctx, strategy, cluster, script, Untouchable(), SimCache(ctx.cost_model), lines.append,
                       clock="wall", journal=journal)
    return outcome, lines


def _comparable(outcome) -> dict:
    kept = asdict(outcome)
    for name in ("first_timeline", "plan_after_recovery"):  # objects rebuilt by the replay: compared by name
        kept[name] = getattr(getattr(outcome, name), "name", None) if name == "plan_after_recovery" else None
    return kept


@pytest.mark.parametrize("strategy", ["checkpoint", "varuna", "recycle"])
def test_replaying_the_journal_gives_the_loop_back_exactly(tmp_path, strategy):
    """A run with a failure (a restart of the job for checkpoint and varuna, a reroute for recycle)
    recorded, then a new loop replayed from its journal alone: every record, loss and time is the
    same, no metrics line is written twice, and the backend is never reached."""
    overrides = [f"strategy={strategy}", "cluster.spares=1", "failures.events=[{iteration:3,node:1}]"]
    outcome, lines, journal = _recorded_run(overrides, tmp_path / "run")
    assert outcome.status == "ok" and outcome.failures == 1 and len(outcome.recoveries) == 1
    assert any(kind == "clock" for kind, *_ in journal.entries)
    path = journal.write(tmp_path / "journal", {"call": "none"})
    replayed, quiet = _replayed(overrides, tmp_path / "replay", Journal.load(path))
    assert _comparable(replayed) == _comparable(outcome)
    assert quiet == []


def test_a_journal_that_does_not_verify_is_refused(tmp_path):
    journal = Journal([("clock", 1.0), ("return", "start", None)])
    path = journal.write(tmp_path / "journal-1", {"call": "perform", "state": {}})
    assert verifies(path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the payload
    path.write_bytes(bytes(data))
    assert not verifies(path)
    with pytest.raises(JournalError, match="does not verify"):
        Journal.load(path)
    path.write_bytes(path.read_bytes()[:20])  # a write cut short
    assert not verifies(path)
    assert not verifies(tmp_path / "missing")


def test_the_clock_goes_on_across_a_restart(tmp_path):
    """A restarted process reads the clock on from the last reading plus the time since the
    journal was written, never backwards."""
    journal = Journal()
    before = journal.clock()
    path = journal.write(tmp_path / "journal-1", {"call": "perform", "state": {}})
    resumed = Journal.load(path)
    resumed.until = 0  # nothing to replay: read the clock live
    assert resumed.clock() >= before


def test_a_loop_that_does_not_follow_its_journal_stops(tmp_path):
    """The journal of one failure script, replayed by a loop with another: the first answer that
    differs stops it (JournalError), rather than a loop going on from a state it never had."""
    overrides = ["strategy=checkpoint", "cluster.spares=1", "failures.events=[{iteration:3,node:1}]"]
    _, _, journal = _recorded_run(overrides, tmp_path / "run")
    other = ["strategy=checkpoint", "cluster.spares=1", "failures.events=[{iteration:2,node:1}]"]
    replay = Journal.load(journal.write(tmp_path / "journal", {"call": "none"}))
    with pytest.raises(JournalError, match="did not replay as it ran"):
        _replayed(other, tmp_path / "replay", replay)


def test_exceptions_the_loop_handles_are_replayed_with_their_attributes():
    from ftbench.loop import FailuresDiscovered

    journal = Journal()

    def dies():
        raise FailuresDiscovered([2], "ranks [2] stopped beating", restored=4)

    with pytest.raises(FailuresDiscovered):
        journal.call("run_iteration", dies)
    replay = Journal(pickle.loads(pickle.dumps(journal.entries)), resume={"call": "none"})
    with pytest.raises(FailuresDiscovered) as found:
        replay.call("run_iteration", dies)
    assert (found.value.nodes, found.value.why, found.value.restored) == ([2], "ranks [2] stopped beating", 4)
