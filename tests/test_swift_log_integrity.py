"""Swift's boundary logs are verified like checkpoints (ftbench.engine.log_file): a damaged log
or checkpoint is found before the replay uses it, and the recovery falls back to what still
verifies, says so in its record, and still trains the fault-free model.

The damage is done when the failure strikes (LocalBackend.strike, patched in-process): the
logs of the iterations the replay needs are on storage then, and nothing has read them yet.
dp = 1, pp = 4, a checkpoint every 4 iterations: node 2 failing in iteration 6 is replayed
from the checkpoint of iteration 4 on the logs of iterations 4 and 5 that workers 1 and 3
wrote (stage 2's input activations and output gradients).
"""
import errno
import io

import pytest
import torch

from conftest import LOCAL, run
from ftbench.checkpoint import CheckpointStore
from ftbench.engine import log_file
from ftbench.engine.backend import LocalBackend
from ftbench.engine.boundary_log import BoundaryLog
from ftbench.equivalence import compare, load_state
from ftbench.errors import ReplayUnavailable
from ftbench.metrics import read_metrics

SWIFT = ("strategy=swift", "strategy.every=4", "failures=scripted", "cluster.pp=4", "cluster.dp=1")
AT_6 = "failures.events=[{iteration:6,node:2}]"
AT_10 = "failures.events=[{iteration:10,node:2}]"
REPLAYED = ["WaitForReplacement", "UndoSteps", "Rendezvous", "ReplayLogs"]
RESTARTED = REPLAYED + ["RestartJob", "RestoreCheckpoint"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    ref = run(tmp_path_factory.mktemp("fault-free"), *LOCAL, "cluster.pp=4", "cluster.dp=1", "train.iterations=12",
              "strategy=none", "failures=none")
    assert ref["status"] == "ok", ref["error"]
    return ref


def _matches(summary: dict, ref: dict) -> None:
    """The equivalence check of tests/conftest.assert_matches_fault_free, on a shared reference."""
    difference = compare(summary["losses"], load_state(summary["final_state"]),
                         ref["losses"], load_state(ref["final_state"]))
    assert difference is None, difference


def _damaging(monkeypatch, damage) -> None:
    """`damage(engine)` once, when the first failure strikes."""
    strike, done = LocalBackend.strike, []

    def striking(self, plan, iteration, completed, dead_workers):
        out = strike(self, plan, iteration, completed, dead_workers)
        if not done:
            self.engine.boundary_log.wait()
            self.engine.store.wait()
            damage(self.engine)
            done.append(iteration)
        return out

    monkeypatch.setattr(LocalBackend, "strike", striking)


def _flip_a_tensor_bit(path) -> None:
    """One bit of one tensor's stored values (not the header, not the zip's bookkeeping)."""
    raw = bytearray(path.read_bytes())
    tensor = next(iter(torch.load(io.BytesIO(raw[raw.index(b"\n", len(log_file.MAGIC)) + 1:]),
                                  weights_only=True).values()))
    at = raw.index(tensor.contiguous().numpy().tobytes())
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))


def _log(engine, src: int, iteration: int):
    return engine.boundary_log.path(src, iteration)


DAMAGES = {
    "wrong iteration": lambda e: _log(e, 1, 5).write_bytes(_log(e, 1, 4).read_bytes()),
    "truncated": lambda e: _log(e, 1, 5).write_bytes(_log(e, 1, 5).read_bytes()[:-100]),
    "empty": lambda e: _log(e, 3, 4).write_bytes(b""),
    "deleted": lambda e: _log(e, 3, 5).unlink(),
    "garbage": lambda e: _log(e, 1, 4).write_bytes(bytes(range(256)) * 8),
    "one flipped bit": lambda e: _flip_a_tensor_bit(_log(e, 3, 4)),
}
FOUND = {"wrong iteration": "holds iteration 4 of worker 1, not iteration 5 of worker 1",
         "truncated": "payload of", "empty": "no log header (0 bytes", "deleted": "(missing)",
         "garbage": "no log header", "one flipped bit": "sha256 mismatch"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_log_restarts_from_the_checkpoint_and_trains_the_fault_free_model(
        tmp_path, monkeypatch, fault_free, damage):
    """Damaged logs after the replay's checkpoint leave no replay: the job restarts from the
    newest checkpoint that verifies (4), says why, and redoes iterations 4 and 5."""
    _damaging(monkeypatch, DAMAGES[damage])
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=12", AT_6)
    assert s["status"] == "ok", s["error"]
    (recovery,) = s["recoveries"]
    assert recovery["actions"] == RESTARTED
    assert FOUND[damage] in recovery["fallback"] and "restarting the job" in recovery["fallback"]
    assert (recovery["restored_iteration"], recovery["lost_iterations"]) == (4, 2)
    _matches(s, fault_free)


def test_the_runs_own_equivalence_check_passes_after_a_log_of_another_iteration(tmp_path, monkeypatch):
    """The case that used to pass silently (status ok, the run's own check false): with
    report.check_fault_free the run itself now finds fault-free training."""
    _damaging(monkeypatch, DAMAGES["wrong iteration"])
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=8", AT_6, "report.check_fault_free=true")
    assert s["status"] == "ok", s["error"]
    assert s["recoveries"][0]["actions"] == RESTARTED and s["matches_fault_free"] is True


def test_the_run_loops_recovery_line_names_the_fallback(tmp_path, monkeypatch):
    """What reaches metrics.jsonl: the recovery line with the file at fault."""
    _damaging(monkeypatch, DAMAGES["deleted"])
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=8", AT_6)
    assert s["status"] == "ok", s["error"]
    (line,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "recovery"]
    assert "worker3/iteration00000005.pt" in line["fallback"] and line["actions"] == RESTARTED


def _flip_checkpoint(iteration: int):
    def damage(engine):
        shard = sorted(engine.store.folder(iteration).glob("*.pt"))[0]
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        shard.write_bytes(bytes(raw))
    return damage


def test_a_damaged_newest_checkpoint_restarts_from_the_older_one(tmp_path, monkeypatch, fault_free):
    """Node 2 fails in iteration 10: the replay would start from the checkpoint of 8, which
    no longer verifies; the logs since 4 went when 8 was written, so the job restarts from 4."""
    _damaging(monkeypatch, _flip_checkpoint(8))
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=12", AT_10)
    assert s["status"] == "ok", s["error"]
    (recovery,) = s["recoveries"]
    assert recovery["actions"] == RESTARTED
    assert "checkpoint of iteration 8 does not verify" in recovery["fallback"]
    assert (recovery["restored_iteration"], recovery["lost_iterations"]) == (4, 6)
    skipped = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "checkpoint_skipped"]
    assert skipped and "sha256 mismatch" in skipped[0]["reason"]
    _matches(s, fault_free)


def test_with_every_checkpoint_damaged_the_job_restarts_from_the_initial_weights(tmp_path, monkeypatch, fault_free):
    def damage(engine):
        _flip_checkpoint(4)(engine)
        _flip_checkpoint(8)(engine)

    _damaging(monkeypatch, damage)
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=12", AT_10)
    assert s["status"] == "ok", s["error"]
    (recovery,) = s["recoveries"]
    assert recovery["actions"] == RESTARTED and recovery["restored_iteration"] == 0
    _matches(s, fault_free)


def test_a_skipped_checkpoint_replays_from_the_older_one_on_the_logs_it_kept(tmp_path, monkeypatch, fault_free):
    """The checkpoint of 8 could not be written (disk full): the logs since 4 stay, and the
    replay runs from 4 instead, nothing rolled back."""
    write = CheckpointStore._write

    def full_at_8(self, iteration, folder, shards):
        if iteration == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, iteration, folder, shards)

    monkeypatch.setattr(CheckpointStore, "_write", full_at_8)
    s = run(tmp_path, *LOCAL, *SWIFT, "train.iterations=12", AT_10)
    assert s["status"] == "ok", s["error"]
    (recovery,) = s["recoveries"]
    assert recovery["actions"] == REPLAYED + ["ReplayLogs"]
    assert "replaying from the checkpoint of iteration 4 instead" in recovery["fallback"]
    assert recovery["lost_iterations"] == 0
    _matches(s, fault_free)


# -- the log files themselves -----------------------------------------------------------------

def test_a_log_file_records_its_iteration_and_sender_and_is_checked_before_use(tmp_path):
    log = BoundaryLog(tmp_path / "logs")
    for i in range(3):
        log.record(i, 1, ("act", 0, 0, 0), torch.full((4,), float(i)))
        log.seal(i)
    assert log.check([1], 0, 3) == []
    assert log.bytes_now == sum(p.stat().st_size for p in (tmp_path / "logs").rglob("*.pt"))
    log.path(1, 1).write_bytes(log.path(1, 2).read_bytes())  # a valid file, of another iteration
    (problem,) = log.check([1], 0, 3)
    assert "iteration00000001.pt: holds iteration 2 of worker 1, not iteration 1" in problem
    with pytest.raises(log_file.LogInvalid, match="not iteration 1 of worker 1"):
        log.read(1, 1, ("act", 0, 0, 0))
    assert torch.equal(log.read(1, 2, ("act", 0, 0, 0)), torch.full((4,), 2.0))
    log.record(1, 1, ("act", 0, 0, 0), torch.full((4,), 1.0))  # redone after a restart: replaced
    log.seal(1)
    assert log.check([1], 0, 3) == [] and torch.equal(log.read(1, 1, ("act", 0, 0, 0)), torch.ones(4))
    assert log.bytes_now == sum(p.stat().st_size for p in (tmp_path / "logs").rglob("*.pt"))
    log.close()


def test_a_replay_that_cannot_start_says_whether_an_older_one_can():
    from ftbench.engine.boundary_log import unusable_replay

    assert unusable_replay(8, 8, 10, []) is None
    older = unusable_replay(8, 4, 10, [])
    assert isinstance(older, ReplayUnavailable) and older.start == 4 and older.status == "unrecoverable"
    assert unusable_replay(8, 4, 10, ["a: missing"]).start is None
    assert unusable_replay(8, 8, 10, ["a: sha256 mismatch"]).start is None
