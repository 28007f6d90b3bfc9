"""One engine-state core (ftbench.engine.state.EngineState) under both real backends' engines:
local and dist adopt plans, build replicas, draw an iteration's samples, undo an abandoned
iteration, commit and keep host copies through the same code."""
import torch

from conftest import LOCAL, compose
from ftbench.context import RunContext
from ftbench.engine.local import LocalEngine
from ftbench.engine.state import EngineState
from ftbench.models.data import make_source

CORE = ("build", "adopt", "_replica", "_replicas", "tokens", "normaliser", "_commit_steps", "_track_memory",
        "commit", "keep", "revert")


def _engine():
    cfg = compose(*LOCAL, "backend.dtype=float64")
    ctx = RunContext.from_config(cfg)
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    engine = LocalEngine(ctx, data, cfg.train.lr, cfg.train.weight_decay, store=None, dtype="float64")
    plan = ctx.grid_plan(cfg.cluster.pp, cfg.cluster.dp)
    engine.build(plan)
    return engine, plan


def _weights(engine) -> dict:
    return {(w, name): p.detach().clone() for w, worker in engine.workers.items()
            for r in worker.replicas.values() for name, p in r.named_parameters().items()}


def test_local_and_dist_engines_share_the_state_core():
    """Neither engine has its own copy of the mechanism: each says which workers its process
    runs and how it records memory; dist also frees a worker its rank no longer runs."""
    from ftbench.distributed.engine import DistEngine

    for engine in (LocalEngine, DistEngine):
        assert issubclass(engine, EngineState)
        assert [name for name in CORE if name in vars(engine) and name != "adopt"] == []
        assert "_holds" in vars(engine) and "_record_memory" in vars(engine)


def test_an_abandoned_iteration_is_undone_and_counted():
    """Every op of iteration 0 ran, optimizer steps included, and a failure abandons it: every
    replica undoes its step (back to the initial weights, to the step's rounding), and the local
    engine counts them for the job."""
    engine, plan = _engine()
    before = _weights(engine)
    every_op = frozenset(op for ops in plan.schedule.ops.values() for op in ops)
    engine.run_iteration(0, completed=every_op)
    assert any(not torch.equal(before[k], v) for k, v in _weights(engine).items())
    assert engine.abandon_iteration() == len(plan.workers) == engine.undone
    for key, p in _weights(engine).items():
        torch.testing.assert_close(p, before[key], rtol=0, atol=1e-12)
    assert engine.abandon_iteration() == 0 and engine.undone == len(plan.workers)  # nothing left to undo


def test_revert_gives_back_what_keep_took():
    """keep (before a recovery) and revert (a death interrupted it): the weights and in-memory
    commits come back bit for bit, whatever ran in between."""
    engine, plan = _engine()
    engine.commit(0)
    kept, before = engine.keep(), _weights(engine)
    engine.run_iteration(0)
    engine.commit(1)
    engine.revert(kept)
    assert engine.plan is None
    engine.adopt(plan)
    after = _weights(engine)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {r.commit["iteration"] for w in engine.workers.values() for r in w.replicas.values()} == {0}
