"""Checkpoint tiers (Strategy.checkpoint_tiers): several tiers advance in closed form exactly as
saved one at a time, a recovery restores the tier it names on every backend, and the contract
refuses what it cannot honour."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT, strategy_package

from ftbench.actions import FILE, MEMORY, SNAPSHOT, CheckpointTier
from ftbench.checkpoint_schedule import Checkpoints, checkpoint_tiers
from ftbench.recovery_costs import SaveCost


def _strategy(*tiers: CheckpointTier, tuned_every: int = 5):
    return SimpleNamespace(name="tiers", checkpoint_tiers=lambda: tiers, save_s=None, checkpoint_after_change=False,
                           checkpoint_interval=lambda T, stall, persist: tuned_every)


def _schedule(tiers, costs, iterations=200, T=1.0):
    """Checkpoints on the wall-clock path (their costs as measured ones), on `T`-second iterations."""
    ckpt = Checkpoints(_strategy(*tiers), None, iterations, lambda record: None, modelled=False)
    for tier, cost in zip(ckpt.tiers, costs):
        tier.measured = SaveCost(*cost)
    ckpt.use(SimpleNamespace(name="plan"), T)
    return ckpt


def _stepped(ckpt, it: int, t: float, n: int):
    """n iterations one at a time, as the run loop saves on a stepping backend: end time and
    every save's (mode, iteration, durable time)."""
    saves = []
    for k in range(it + 1, it + n + 1):
        t += ckpt.T
        for tier in ckpt.due(k):
            t += ckpt.persist_wait(tier, t) + tier.stall
            tier.ledger.add(k, t + tier.persist)
            saves.append((tier.mode, k, t + tier.persist))
    return t, saves


@pytest.mark.parametrize("tiers,costs", [
    # memory every iteration, snapshots persisting longer than their interval (they wait)
    ((CheckpointTier(MEMORY, 1), CheckpointTier(SNAPSHOT, 3)), ((0.05, 0.0), (0.2, 4.5))),
    # the storage tier listed first, tuned (every 5), memory every 2
    ((CheckpointTier(SNAPSHOT), CheckpointTier(MEMORY, 2)), ((0.3, 7.0), (0.1, 0.0))),
    ((CheckpointTier(MEMORY, 4), CheckpointTier(FILE, 6)), ((0.1, 0.0), (0.7, 0.0))),
])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 37), (5, 60), (11, 188)])
def test_several_tiers_advance_in_closed_form_as_saved_one_at_a_time(tiers, costs, start, n):
    jumped, stepped = _schedule(tiers, costs), _schedule(tiers, costs)
    for ckpt in (jumped, stepped):  # the same history before `start`: a persist still running
        _stepped(ckpt, 0, 0.0, start)
    t0 = start * 1.3
    t_end, count, newest = jumped.advance(start, t0, n)
    t_step, saves = _stepped(stepped, start, t0, n)
    assert t_end == pytest.approx(t_step, rel=1e-12)
    assert count == len(saves)
    durable = {(mode, k): at for mode, k, at in saves}
    for tier, k in newest:  # the newest few of each tier, durable when saved one at a time says
        assert tier.ledger.saved[-1][0] >= k
        assert dict(tier.ledger.saved)[k] == pytest.approx(durable[(tier.mode, k)], rel=1e-12), (tier.mode, k)
    assert {(t.mode, k) for t, k in newest} <= set(durable)
    # fit: the most iterations that end by a limit, as stepping finds them
    limit = t0 + 0.6 * (t_step - t0)
    fitted = jumped.fit(start, t0, limit, n)
    assert t0 + jumped.span(start, fitted, t0) <= limit * (1 + 1e-12)
    assert fitted == n or t0 + jumped.span(start, fitted + 1, t0) > limit


@pytest.mark.parametrize("tiers,words", [
    ((CheckpointTier(MEMORY, 1), CheckpointTier(MEMORY, 2)), "at most one memory tier"),
    ((CheckpointTier(FILE, 1), CheckpointTier(SNAPSHOT, 2)), "at most one storage tier"),
    ((CheckpointTier(MEMORY), CheckpointTier(FILE)), "at most one tuned tier"),
    ((CheckpointTier("disk", 1),), "a mode in"),
    ((CheckpointTier(FILE, 0),), "whole number >= 1"),
])
def test_the_contract_refuses_tiers_it_cannot_honour(tiers, words):
    with pytest.raises(TypeError, match=words):
        checkpoint_tiers(_strategy(*tiers))


# -- restored by tier, on sim and on local ------------------------------------------------

SETUP = ("model=gpt-tiny", "cluster.pp=2", "train.iterations=9", "train.microbatches=2", "strategy=peer-memory",
         "strategy.every=2", "strategy.file_every=3", "cluster.replacement_s=0", "report.gantt=false",
         "report.progress=false", "wandb.mode=disabled", "failures=scripted")


def _run(site, folder, *overrides) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "ftbench", *SETUP, *overrides, f"hydra.run.dir={folder}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((folder / "summary.json").read_text())


def test_a_restart_empties_the_memory_tier_on_sim_as_on_local():
    """Every process restarts: a memory restore after it finds nothing, as local and dist find
    no commit (ftbench.engine.state.newest_commits); the file tier is still there."""
    from ftbench.actions import RestartJob, RestoreCheckpoint
    from ftbench.errors import ResultError
    from ftbench.sim.backend import SimBackend

    backend = SimBackend(ctx=None)
    backend.start(None)
    for k in (2, 3, 4, 6):
        backend.save(None, k, MEMORY if k % 2 == 0 else FILE)
    assert backend.perform([RestoreCheckpoint(MEMORY)], None, None, 7) == 6
    assert backend.perform([RestartJob(), RestoreCheckpoint(FILE)], None, None, 7) == 3
    with pytest.raises(ResultError, match="no in-memory commit"):
        backend.perform([RestoreCheckpoint(MEMORY)], None, None, 5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "local", pytest.param("dist", marks=pytest.mark.dist)])
def test_a_recovery_restores_the_tier_it_names(tmp_path, backend):
    """peer-memory (docs/extending.md) keeps two tiers, each restored where the other is newer.
    Memory every 4, files every 3, dp 2: a node's failure in iteration 7 restores memory
    (iteration 4: three lost, the files of 6 unused). Memory every 2, files every 3, dp 1: the
    stage's only replica is gone, so files in iteration 5 (iteration 3: two lost, the memory
    of 4 unused), and after the redo a failure in iteration 7 finds the files of iteration 6
    (one lost). On local and dist (its processes restarted) the model is fault-free
    training's."""
    site = tmp_path / "site"
    strategy_package(site)
    extra = {"sim": ("backend=sim",), "local": ("backend=local", "backend.clock=model"),
             "dist": ("backend=dist", "cluster.spares=2")}[backend]
    memory = _run(site, tmp_path / "memory", *extra, "cluster.dp=2", "strategy.every=4",
                  "failures.events=[{iteration:7,node:1}]")
    assert memory["status"] == "ok", memory["error"]
    got = [(r["actions"], r["iteration"], r["lost_iterations"]) for r in memory["recoveries"]]
    assert got == [(["WaitForReplacement", "Rendezvous", "RestoreCheckpoint"], 7, 3)], got
    files = _run(site, tmp_path / "files", *extra, "cluster.dp=1",
                 "failures.events=[{iteration:5,node:1},{iteration:7,node:0}]")
    assert files["status"] == "ok", files["error"]
    got = [(r["actions"], r["iteration"], r["lost_iterations"]) for r in files["recoveries"]]
    restart = ["WaitForReplacement", "RestartJob", "RestoreCheckpoint"]
    assert got == [(restart, 5, 2), (restart, 7, 1)], got
    if backend != "sim":
        assert memory["matches_fault_free"] and files["matches_fault_free"], (memory["error"], files["error"])


def test_a_restore_forgets_every_newer_checkpoint_of_either_tier(tmp_path):
    """Memory restored to iteration 4 while files of iteration 6 exist (they belong to the
    abandoned timeline, as the sim backend drops them): local removes them, so a later file
    restore finds iteration 3; restored files forget newer in-memory commits likewise."""
    from conftest import LOCAL, compose

    from ftbench.actions import RestoreCheckpoint
    from ftbench.checkpoint import CheckpointStore
    from ftbench.context import RunContext
    from ftbench.engine.backend import LocalBackend, Performing
    from ftbench.engine.local import LocalEngine
    from ftbench.models.data import make_source

    cfg = compose(*LOCAL, "cluster.pp=2", "cluster.dp=1")
    ctx = RunContext.from_config(cfg)
    engine = LocalEngine(ctx, make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed), cfg.train.lr, 0.0,
                         store=CheckpointStore(tmp_path / "ckpt", keep=4))
    plan = ctx.grid_plan(2, 1)
    engine.build(plan)
    backend = LocalBackend(engine)
    for it, mode in ((3, FILE), (4, MEMORY), (6, FILE)):
        engine.save(it, mode)
    restore = Performing(old=plan, new=plan, iteration=7)
    backend.restore_checkpoint(RestoreCheckpoint(MEMORY), restore)
    assert restore.restored == 4 and engine.store.iterations() == [3]
    engine.save(5, MEMORY)
    restore = Performing(old=plan, new=plan, iteration=6)
    backend.restore_checkpoint(RestoreCheckpoint(FILE), restore)
    assert restore.restored == 3
    assert {r.commit for w in engine.workers.values() for r in w.replicas.values()} == {None}
