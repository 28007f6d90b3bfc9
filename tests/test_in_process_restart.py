"""`in-process-restart` on the simulator: checkpoint restart's recovery less the restart of every
process, plus the survivors' rendezvous (docs/strategies/in-process-restart.md)."""
import pytest

from conftest import run

SETUP = ("backend=sim", "model=gpt3-medium", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2",
         "train.iterations=50", "strategy.every=10", "failures.events=[{iteration:25,node:5}]")


@pytest.mark.parametrize("spares", [1, 0])
def test_the_recovery_is_checkpoint_restarts_less_the_process_restart(tmp_path, spares):
    ours = run(tmp_path / "ipr", *SETUP, "strategy=in-process-restart", f"cluster.spares={spares}",
               "hardware.restart_s=100", "hardware.rendezvous_s=7")
    theirs = run(tmp_path / "ckpt", *SETUP, "strategy=checkpoint", f"cluster.spares={spares}",
                 "hardware.restart_s=100", "hardware.rendezvous_s=7")
    (mine,), (base,) = ours["recoveries"], theirs["recoveries"]
    assert mine["actions"] == ["WaitForReplacement", "Rendezvous", "RestoreCheckpoint"]
    assert base["actions"] == ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    # the same checkpoints, the same lost work, the same wait for the replacement and the same
    # reload; the rendezvous (7 s) in place of the restart of every process (100 s)
    assert (mine["restored_iteration"], mine["lost_iterations"]) == (base["restored_iteration"], base["lost_iterations"]) == (20, 5)
    assert mine["recovery_s"] == pytest.approx(base["recovery_s"] - 100 + 7, rel=1e-12)
    assert ours["time_s"] == pytest.approx(theirs["time_s"] - 93, rel=1e-12)


def test_a_failure_needs_a_replacement_and_its_wait_is_charged(tmp_path):
    with_standby = run(tmp_path / "a", *SETUP, "strategy=in-process-restart", "cluster.spares=1")
    without = run(tmp_path / "b", *SETUP, "strategy=in-process-restart", "cluster.spares=0",
                  "cluster.replacement_s=45")
    assert without["recoveries"][0]["recovery_s"] == pytest.approx(with_standby["recoveries"][0]["recovery_s"] + 45)
