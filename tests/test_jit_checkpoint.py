"""`jit-checkpoint` (docs/strategies/jit-checkpoint.md): the survivors save when a failure strikes,
the job restarts from that save; the writers of such a save are live workers only."""
import json

import pytest

from conftest import run
from ftbench.errors import ResultError
from ftbench.engine.local import fragment_writers
from ftbench.plan import checkpoint_writers, generated_grid_plan

SETUP = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2",
         "cluster.spares=1", "train.iterations=50")


def test_the_survivors_save_and_the_restart_redoes_nothing(tmp_path):
    jit = run(tmp_path / "jit", *SETUP, "strategy=jit-checkpoint", "failures.events=[{iteration:25,node:5}]")
    (recovery,) = jit["recoveries"]
    assert recovery["actions"] == ["SaveCheckpoint", "WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    assert (recovery["restored_iteration"], recovery["lost_iterations"]) == (25, 0)
    save, wait, restart, reload = recovery["action_s"]
    assert (wait, restart) == (0.0, 60.0) and save > 0 and reload > 0
    # stage 1's usual writer (worker 5, node 5) died: its other replica (node 1) writes instead;
    # one stage per node still, so the save costs what the initial checkpoint's did
    events = [json.loads(x) for x in (tmp_path / "jit" / "metrics.jsonl").read_text().splitlines()]
    (initial,) = [x for x in events if x["event"] == "checkpoint"]
    assert save == pytest.approx(initial["stall_s"], rel=1e-12)
    # checkpoint restart at its tuned interval loses iterations; this one only the struck iteration's part
    ckpt = run(tmp_path / "ckpt", *SETUP, "strategy=checkpoint", "strategy.every=10",
               "failures.events=[{iteration:25,node:5}]")
    assert ckpt["recoveries"][0]["lost_iterations"] == 5


def test_no_periodic_checkpoint_in_the_steady_state(tmp_path):
    summary = run(tmp_path, *SETUP, "strategy=jit-checkpoint", "failures=none")
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in events if x["event"] == "checkpoint"] == [0]  # the initial state only
    assert summary["status"] == "ok"


@pytest.mark.parametrize("every, restored", [(None, 0), (10, 20)])
def test_a_stage_with_no_survivor_falls_back_to_the_files(tmp_path, every, restored):
    settings = ("cluster.dp=1", "failures.events=[{iteration:25,node:1}]")
    extra = () if every is None else (f"strategy.every={every}",)
    summary = run(tmp_path, *SETUP, "strategy=jit-checkpoint", *settings, *extra)
    (recovery,) = summary["recoveries"]
    assert recovery["actions"] == ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    assert recovery["restored_iteration"] == restored


def test_writers_after_a_failure_are_live_replicas():
    plan = generated_grid_plan("1f1b", 3, (4, 4), ((0, 2), (2, 4), (4, 6)), list(range(6)), lambda w: w)
    usual = checkpoint_writers(plan)
    assert usual == {0: 0, 1: 4, 2: 2}  # one per stage, from different pipelines
    assert checkpoint_writers(plan, alive=lambda w: True) == usual
    assert checkpoint_writers(plan, alive=lambda w: w != 4) == {0: 0, 1: 1, 2: 2}  # stage 1's other replica
    assert checkpoint_writers(plan, alive=lambda w: w not in (1, 4)) == {0: 0, 2: 2}  # stage 1 lost
    assert [w for _, w, _, _ in fragment_writers(plan, alive=lambda w: w != 4)] == [0, 1, 2]
    with pytest.raises(ResultError, match="no live replica of stage 1"):
        fragment_writers(plan, alive=lambda w: w not in (1, 4))
