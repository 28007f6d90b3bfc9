"""Varuna's checkpoint rule, as the Oobleck artifact's simulator has it (the Varuna column of
Oobleck's Table 2): every `strategy.every` iterations, and once right after the first
iteration that completes after each restart or morph. The rule lives in the shared run loop
(`Checkpoints`), so sim and local charge and write the same checkpoints; `strategy.save_s`
gives the save's stall as measured elsewhere."""
import json

import pytest

from conftest import LOCAL, ROOT, run

SIM = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2",
       "train.microbatches=8", "report.gantt=false")


def metrics(run_dir, event):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == event]


def _restored(summary) -> list[int]:
    return [r["restored_iteration"] for r in summary["recoveries"]]


def test_second_failure_rolls_back_only_to_the_post_change_checkpoint(run_config):
    # every=10: the first failure (during iteration 25) rolls back to 20; the job checkpoints
    # again after iteration 20 completes in the new shape (after 21), so the second failure
    # (during iteration 29, before the periodic one after 30) loses 8 iterations, not 9.
    s = run_config(*SIM, "strategy=varuna", "strategy.every=10", "train.iterations=50", "failures=scripted",
                   "failures.events=[{iteration:25,node:5},{iteration:29,node:0}]")
    assert s["status"] == "ok" and s["failures"] == 2
    first, second = s["recoveries"]
    assert (first["iteration"], first["restored_iteration"]) == (25, 20)
    assert (second["iteration"], second["restored_iteration"], second["lost_iterations"]) == (29, 21, 8)


def test_post_change_checkpoint_is_a_normal_save_charged_as_save_s(tmp_path, run_config):
    # strategy.save_s fixes every save's stall, whatever the shape, so the time adds up
    # exactly: checkpoints before iteration 0, after 10 and 20, the failure half-way through
    # iteration 26 (back to 20), the post-change one after 21, then after 30 and 40.
    s = run_config(*SIM, "strategy=varuna", "strategy.every=10", "strategy.save_s=7", "train.iterations=50",
                   "failures=scripted", "failures.events=[{iteration:25,node:5}]")
    assert s["status"] == "ok" and s["checkpoints"] == 6
    r = s["recoveries"][0]
    assert (r["restored_iteration"], r["lost_iterations"]) == (20, 5)
    assert all(x["stall_s"] == 7.0 for x in metrics(tmp_path, "checkpoint_interval"))
    T1, T2 = s["iteration_time_s"], metrics(tmp_path, "iterations")[-1]["iteration_time_s"]
    assert T1 != T2  # it morphed
    expected = 25.5 * T1 + r["recovery_s"] + 30 * T2 + 6 * 7.0
    assert s["time_s"] == pytest.approx(expected, rel=1e-9)


def test_post_change_checkpoint_that_falls_on_the_interval_is_not_doubled(run_config):
    # every=1: a checkpoint after every iteration anyway; the rule adds none.
    s = run_config(*SIM, "strategy=varuna", "strategy.every=1", "train.iterations=20", "failures=scripted",
                   "failures.events=[{iteration:12,node:5}]")
    assert s["status"] == "ok"
    # checkpoints before iteration 0 and after 1..12, then, back at 12, after 13..19: the
    # post-change one after 13 is the periodic one
    assert s["recoveries"][0]["restored_iteration"] == 12
    assert s["checkpoints"] == 1 + 12 + 7


def test_checkpoint_restart_keeps_only_the_interval(run_config):
    s = run_config(*SIM, "strategy=checkpoint", "strategy.every=10", "train.iterations=50", "failures=scripted",
                   "failures.events=[{iteration:25,node:5},{iteration:29,node:0}]")
    assert _restored(s) == [20, 20]
    assert s["checkpoints"] == 5  # before iteration 0, after 10, 20, 30 and 40


def test_save_s_is_the_stall_of_a_morph_up_save_too(tmp_path):
    events = ("failures=scripted", "failures.events=[{iteration:25,node:5},{iteration:30,node:5,kind:join}]")
    grow = {}
    for save_s in (5, 50):
        s = run(tmp_path / str(save_s), *SIM, *events, "train.iterations=50", "strategy=varuna",
                f"strategy.save_s={save_s}")
        grow[save_s] = s["recoveries"][1]
        assert grow[save_s]["actions"] == ["SaveCheckpoint", "RestartJob", "RestoreCheckpoint"]
    assert grow[50]["recovery_s"] - grow[5]["recovery_s"] == pytest.approx(45.0)


def test_save_s_for_plain_checkpoint_restart(tmp_path, run_config):
    s = run_config(*SIM, "strategy=checkpoint", "strategy.save_s=11.2", "train.iterations=20", "failures=none")
    assert s["status"] == "ok"
    assert metrics(tmp_path, "checkpoint_interval")[0]["stall_s"] == 11.2


@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_save_s_must_be_positive(run_config, value):
    s = run_config(*SIM, "strategy=varuna", f"strategy.save_s={value}", "train.iterations=5")
    assert s["status"] == "error" and s["error"].startswith("Invalid setting `strategy.save_s`:"), s["error"]
    assert ("not a number" if value == "nan" else "seconds") in s["error"] and "null" in s["error"]


# The Oobleck traces' 10-minute case: 30 nodes of 4 GPUs, one removed every 10 minutes.
# hardware.efficiency 0.01 puts an iteration near the artifact's 20 s, the save and restart
# are the artifact's GPT-3 Medium numbers. With every=50 fewer iterations than the interval
# fit between two removals: without the post-change checkpoint every failure rolled back to
# the same checkpoint (the job stalled); with it, each 10 minutes keeps at least an iteration.
TRACE_10M = ("backend=sim", "strategy=varuna", "model=gpt3-medium", "hardware=a100-80gb", "hardware.efficiency=0.01",
             "cluster.gpus_per_node=4", "cluster.nodes=30", "cluster.pp=4", "cluster.dp=30",
             "train.global_batch=720", "train.microbatch_size=8", "failures=trace",
             f"failures.path={ROOT / 'conf' / 'traces' / '10m.csv'}", "train.max_hours=2.505",
             "train.iterations=100000000", "hardware.restart_s=78.7", "strategy.save_s=11.2", "report.gantt=false")


def test_ten_minute_trace_keeps_progress_whatever_the_interval(tmp_path):
    runs = {every: run(tmp_path / str(every), *TRACE_10M, f"strategy.every={every}") for every in (10, 50)}
    for every, s in runs.items():
        assert s["status"] == "ok" and s["failures"] >= 10, (every, s["error"])
        restored = _restored(s)
        # after a restart the job checkpoints once an iteration completes: the next failure
        # never rolls back past it
        assert all(b > a for a, b in zip(restored, restored[1:])), (every, restored)
    assert runs[50]["iterations"] >= runs[50]["failures"]


def test_local_writes_the_post_change_checkpoint_and_matches_fault_free(tmp_path):
    # every=8 on 10 iterations: without the rule only the initial checkpoint would exist at
    # either failure. Failure during iteration 3: back to 0, saved after 1; failure during 7:
    # back to 1, saved after 2; then after 8.
    failures = ("failures=scripted", "failures.events=[{iteration:3,node:1},{iteration:7,node:2}]")
    overrides = (*LOCAL, "strategy=varuna", "strategy.every=8", "strategy.keep=10", *failures)
    s = run(tmp_path / "local", *overrides, "report.check_fault_free=true")
    assert s["status"] == "ok" and s["matches_fault_free"] is True
    assert _restored(s) == [0, 1]
    assert [x["iteration"] for x in metrics(tmp_path / "local", "checkpoint")] == [0, 1, 2, 8]
    for iteration in (1, 2, 8):
        assert (tmp_path / "local" / "checkpoints" / f"iter_{iteration:08d}" / "manifest.json").is_file()
    sim = run(tmp_path / "sim", *overrides, "backend=sim")  # the same loop: the same checkpoints
    assert _restored(sim) == [0, 1] and sim["checkpoints"] == s["checkpoints"] == 4


def _random_jumps(seed: str, mode: str, after_change: bool):
    """2,000 seeded cases of a jump: (rng, iterations, every, it, n, jump, step), `jump` and
    `step` two schedulers of one run, to advance in one go and one iteration at a time."""
    import random

    from ftbench.checkpoint_schedule import Checkpoints
    from ftbench.strategies import Strategy

    class Rule(Strategy):
        checkpoint_mode, checkpoint_after_change = mode, after_change

    rng = random.Random(seed)
    for _ in range(2000):
        iterations, every = rng.randint(2, 60), rng.randint(1, 12)
        it = rng.randrange(iterations)
        n = rng.randint(1, iterations - it)
        jump, step = (Checkpoints(Rule(None, None), None, iterations, lambda _: None, True) for _ in range(2))
        yield rng, iterations, every, it, n, jump, step


def test_closed_form_counts_the_post_change_checkpoint_as_one_iteration_at_a_time_does():
    """sim advances many iterations at once: its saves, their times and the ledger must be
    those of checking `due` after every iteration (local's way)."""
    for _, iterations, every, it, n, jump, step in _random_jumps("varuna-closed-form", "file", True):
        for c in (jump, step):
            c.T, c.tiers[0].every, c.tiers[0].stall = 1.0, every, 0.25
            c.recovered(it)  # a recovery resumed at `it`: the post-change one is due after it + 1
        t_end, saves, newest = jump.advance(it, 0.0, n)
        t, written = 0.0, []
        for k in range(it + 1, it + n + 1):  # iteration k - 1 completes
            t += 1.0
            for tier in step.due(k):
                t += 0.25
                written.append((k, t))
                step.saved(tier, k)
        assert (saves, t_end) == (len(written), pytest.approx(t)), (iterations, every, it, n)
        assert [k for _, k in newest] == [k for k, _ in written[-3:]]
        assert jump.tiers[0].ledger.saved == [(k, pytest.approx(at)) for k, at in written[-3:]]
        assert jump.tiers[0].after_change == step.tiers[0].after_change


def test_closed_form_snapshots_wait_for_the_previous_persist_as_one_save_at_a_time_does():
    """CheckFreq persists one snapshot at a time: a snapshot due while the previous persist
    runs waits for it. sim's jumps must charge exactly the waits of saving one at a time, also
    when the run starts with a persist still running from before."""
    for rng, iterations, every, it, n, jump, step in _random_jumps("checkfreq-persist-wait", "snapshot", False):
        persist, before = rng.choice([0.0, 0.5, 3.0, 20.0]), rng.uniform(0, 30)
        for c in (jump, step):
            tier = c.tiers[0]
            c.T, tier.every, tier.stall, tier.persist = 1.0, every, 0.25, persist
            tier.ledger.add(it, before)  # the persist of the checkpoint at `it` ends at `before`
        t_end, saves, newest = jump.advance(it, 0.0, n)
        t, written = 0.0, []
        for k in range(it + 1, it + n + 1):
            t += 1.0
            for tier in step.due(k):
                t += step.persist_wait(tier, t) + 0.25
                written.append((k, t + persist))
                tier.ledger.add(k, t + persist)
        assert (saves, t_end) == (len(written), pytest.approx(t)), (iterations, every, it, n, persist, before)
        assert [k for _, k in newest] == [k for k, _ in written[-3:]]
        assert jump.tiers[0].ledger.saved[1:] == [(k, pytest.approx(at)) for k, at in written[-3:]]
        if len(written) > 1 and persist > every:  # persists longer than the interval set the pace
            assert t_end >= (len(written) - 1) * (persist + 0.25)


def test_checkfreq_on_sim_never_saves_faster_than_storage_persists(tmp_path):
    """A fixed interval shorter than the persist: every snapshot waits for the one before, so
    the run takes at least (checkpoints - 1) persists, as on local where save_async blocks."""
    import json

    from conftest import run

    summary = run(tmp_path, "backend=sim", "strategy=checkfreq", "strategy.every=1", "model=gpt3-medium",
                  "hardware.storage_gbps=0.05", "train.iterations=30", "failures=none")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    persist = next(e["persist_s"] for e in lines if e["event"] == "checkpoint_interval")
    assert persist > 1 and summary["checkpoints"] >= 30
    assert summary["time_s"] >= (summary["checkpoints"] - 1) * persist
