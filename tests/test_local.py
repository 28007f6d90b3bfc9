"""The local backend: real pipelined training, real failures, real recoveries, and the
equivalence of every checkpoint preset with fault-free training."""
import json

import pytest
import torch

from conftest import LOCAL, assert_matches_fault_free, compose, run
from ftbench.checkpoint import CheckpointStore, CheckpointWarning
from ftbench.context import RunContext
from ftbench.engine.deferred import WeightGradStore, make_deferrable
from ftbench.engine.reference import train_single_process
from ftbench.engine.worker import WorkerFailed
from ftbench.equivalence import compare, load_state
from ftbench.assembly.local_engine import local_engine
from ftbench.models.data import make_source
from ftbench.models.gpt import build_stage, lm_loss_sum
from ftbench.strategies import build_strategy

ONE_FAILURE = ("failures=scripted", "failures.events=[{iteration:5,node:5}]")
TWO_FAILURES = ("failures=scripted", "failures.events=[{iteration:3,node:1},{iteration:7,node:2}]")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_pipelined_training_matches_single_process_gpt2(tmp_path, schedule):
    s = run(tmp_path, *LOCAL, f"schedule={schedule}", "strategy=none", "failures=none")
    cfg = compose(*LOCAL)
    ctx = RunContext.from_config(cfg)
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    losses, state = train_single_process(ctx.spec, ctx.seed, data, ctx.iterations, ctx.global_batch,
                                         ctx.microbatch_size, cfg.train.lr, dtype=torch.float64)
    assert compare(s["losses"], load_state(s["final_state"]), losses, state) is None
    assert s["losses"][-1] < s["losses"][0] - 0.2  # it really trains


# Elastic Horovod keeps state only in surviving replicas, so its second failure needs a stage
# that still has one: dp=4 (shrinks to 3 pipelines, and stays at 3).
ELASTIC = ("cluster.dp=4", "train.microbatches=2")
ELASTIC_TWO = ("failures=scripted", "failures.events=[{iteration:3,node:1},{iteration:7,node:6}]")


# `full` for one failure: the default tier's two failures recover from a first one alike.
ONE = pytest.mark.full


@pytest.mark.parametrize("strategy,setup,failures", [
    pytest.param("checkpoint", (), ONE_FAILURE, marks=ONE), ("checkpoint", (), TWO_FAILURES),
    pytest.param("checkfreq", (), ONE_FAILURE, marks=ONE), ("checkfreq", (), TWO_FAILURES),
    pytest.param("elastic-horovod", (), ONE_FAILURE, marks=ONE), ("elastic-horovod", ELASTIC, ELASTIC_TWO),
    pytest.param("varuna", (), ONE_FAILURE, marks=ONE), ("varuna", (), TWO_FAILURES),
])
def test_checkpoint_presets_train_the_fault_free_model(tmp_path, strategy, setup, failures):
    s = assert_matches_fault_free(tmp_path, setup=setup, faults=(f"strategy={strategy}", *failures))
    assert s["failures"] == len(s["recoveries"]) >= 1
    for r in s["recoveries"]:
        assert r["recovery_s"] >= 0 and r["lost_iterations"] == r["iteration"] - r["restored_iteration"] >= 0


FAIL_THEN_JOIN = ("failures=scripted", "failures.events=[{iteration:3,node:5},{iteration:6,node:5,kind:join}]")


# Varuna morphs up only when the cost model says the bigger shape is faster; for gpt-tiny
# at hidden 128 it is (pp 4 x dp 1 on 7 survivors, pp 4 x dp 2 once the node is back).
@pytest.mark.parametrize("strategy,setup", [("elastic-horovod", ()), ("varuna", ("model.hidden=128",))])
def test_shrink_then_grow_back_matches_fault_free(tmp_path, strategy, setup):
    s = assert_matches_fault_free(tmp_path, setup=setup, faults=(f"strategy={strategy}", *FAIL_THEN_JOIN))
    shrink, grow = s["recoveries"]
    assert grow["lost_iterations"] == 0 and grow["shape"] != shrink["shape"]
    assert grow["actions"] == (["Rendezvous", "SyncFromPeers"] if strategy == "elastic-horovod"
                               else ["SaveCheckpoint", "RestartJob", "RestoreCheckpoint"])


def test_zb_h1_under_failures_matches_too(tmp_path):
    assert_matches_fault_free(tmp_path, setup=("schedule=zb-h1",), faults=("strategy=checkpoint", "strategy.every=4", *TWO_FAILURES))


def test_same_config_twice_gives_bit_identical_losses(tmp_path):
    a = run(tmp_path / "a", *LOCAL, "strategy=checkpoint", "strategy.every=4", *ONE_FAILURE)
    b = run(tmp_path / "b", *LOCAL, "strategy=checkpoint", "strategy.every=4", *ONE_FAILURE)
    assert a["losses"] == b["losses"]


def test_default_job_checks_itself_and_matches(tmp_path):
    s = run(tmp_path, "train.iterations=8", "train.microbatches=4", "report.gantt=false")
    assert (s["backend"], s["strategy"], s["pp"], s["dp"]) == ("local", "checkpoint", 4, 2)
    assert s["status"] == "ok" and s["failures"] == 1 and s["matches_fault_free"] is True
    r = s["recoveries"][0]
    # checkpoints at the Young/Daly interval for one failure in 8 iterations, from this machine's
    # measured iteration and save: the restore is the newest multiple of it before iteration 5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    every = next(x["every"] for x in lines if x.get("event") == "checkpoint_interval")
    assert r["iteration"] == 5 and r["restored_iteration"] == 5 // every * every
    assert r["lost_iterations"] == 5 - r["restored_iteration"]
    assert len(s["losses"]) == 8 and s["throughput"] > 0
    # the reference it was checked against: its losses in the summary, both drawn in loss.png
    assert s["fault_free_losses"] == s["losses"] and s["recoveries"][0]["cause"] == "fail"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_local_summary_and_metrics(tmp_path):
    from transformers import GPT2LMHeadModel

    s = run(tmp_path, *LOCAL, "strategy=checkpoint", "strategy.every=4", *ONE_FAILURE)
    model = GPT2LMHeadModel.from_pretrained(s["final_state"])
    assert model.config.n_layer == 8
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x.get("event") == "iteration") == 10 + 1  # iteration 4 is redone
    assert any(x.get("event") == "recovery" for x in lines)
    assert len(s["peak_memory_bytes"]) == 8 and min(s["peak_memory_bytes"]) > 0


def test_local_ettr_counts_the_kept_iterations(tmp_path):
    """Wall clock: ETTR is the measured time of the iterations the final model holds (iteration
    4, lost to the failure, counts once, at its redo) over the run's wall time."""
    s = run(tmp_path, *LOCAL, "strategy=checkpoint", "strategy.every=4", *ONE_FAILURE)
    assert s["status"] == "ok" and s["lost_iterations"] == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kept = {x["iteration"]: x["iteration_s"] for x in lines if x.get("event") == "iteration"}  # the redo comes last
    assert sorted(kept) == list(range(10))
    assert s["productive_s"] == pytest.approx(sum(kept.values()), rel=1e-9)
    assert 0 < s["productive_s"] < s["time_s"] and 0 < s["ettr"] < 1
    assert s["ettr"] == pytest.approx(s["productive_s"] / s["time_s"], abs=1e-6)


def test_local_ettr_is_lower_with_a_failure(tmp_path):
    """The modelled clock makes the comparison exact: the same setup with and without a failure."""
    setup = (*LOCAL, "strategy=checkpoint", "backend.clock=model")
    faulty = run(tmp_path / "faulty", *setup, *ONE_FAILURE)
    fault_free = run(tmp_path / "fault-free", *setup, "failures=none")
    assert faulty["status"] == fault_free["status"] == "ok"
    assert faulty["productive_s"] == pytest.approx(fault_free["productive_s"], rel=1e-12)  # the same 10 iterations
    assert 0 < faulty["ettr"] < fault_free["ettr"] < 1  # fault-free still stalls for its checkpoints


def test_truncated_checkpoint_is_skipped_with_a_warning(tmp_path, monkeypatch):
    save = CheckpointStore.save

    def save_then_truncate(self, iteration, shards):
        info = save(self, iteration, shards)
        if iteration == 4:  # the newest checkpoint before the failure gets cut in half
            shard = info.path / "stage0.pt"
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return info

    monkeypatch.setattr(CheckpointStore, "save", save_then_truncate)
    with pytest.warns(CheckpointWarning, match="stage0.pt"):
        s = run(tmp_path, *LOCAL, "strategy=checkpoint", "strategy.every=2", *ONE_FAILURE,
                "report.check_fault_free=true")
    r = s["recoveries"][0]
    assert (r["restored_iteration"], r["lost_iterations"]) == (2, 3)
    assert s["matches_fault_free"] is True


def _engine(tmp_path, *overrides):
    cfg = compose(*LOCAL, *overrides)
    ctx = RunContext.from_config(cfg)
    strategy = build_strategy(cfg.strategy, ctx)
    engine = local_engine(cfg, ctx, strategy, tmp_path)
    plan = ctx.grid_plan(cfg.cluster.pp, cfg.cluster.dp)
    engine.build(plan)
    return engine


def test_a_failed_workers_state_is_gone(tmp_path):
    engine = _engine(tmp_path)
    engine.run_iteration(0)
    replica = engine.workers[5].replica(1)
    params = list(replica.module.parameters())
    engine.destroy([5])
    with pytest.raises(WorkerFailed):
        engine.workers[5].replicas
    with pytest.raises(WorkerFailed):
        replica.module
    with pytest.raises(WorkerFailed):
        replica.optimizer
    assert all(p.numel() == 0 and p.grad is None for p in params)  # even stale references hold nothing
    with pytest.raises(WorkerFailed):
        engine.run_iteration(1)  # the plan still uses worker 5: nothing may quietly read its state


def test_an_abandoned_iteration_leaves_nothing_behind(tmp_path):
    engine = _engine(tmp_path)
    from ftbench.sim.cache import SimCache
    from ftbench.sim.simulator import ops_completed_at

    halfway = ops_completed_at(SimCache(engine.ctx.cost_model)(engine.plan), 0.5)
    assert 0 < len(halfway) < engine.ops_per_iteration()
    engine.run_iteration(0, completed=halfway)
    engine.abandon_iteration()
    for worker in engine.workers.values():
        for replica in worker.replicas.values():
            assert not replica.stash and not replica.store.pending
            assert all(p.grad is None for p in replica.module.parameters())


def test_deferred_weight_gradients_equal_the_fused_backward():
    cfg = compose(*LOCAL)
    ctx = RunContext.from_config(cfg)
    ids = make_source("synthetic", ctx.spec, ctx.seq_len, 0).sample(0, 0).unsqueeze(0)
    grads = []
    for split in (False, True):
        store = WeightGradStore()
        stage = make_deferrable(build_stage(ctx.spec, 0, 0, 8, True, True), store)
        loss = lm_loss_sum(stage(ids), ids)
        if split:
            with store.defer("m0"):
                loss.backward()
            assert store.pending["m0"]  # B left the weight matmuls for W
            assert stage.h["0"].attn.c_attn.weight.grad is None
            store.flush("m0")
        else:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_elastic_horovod_loses_a_stage_without_replicas(tmp_path):
    s = run(tmp_path, *LOCAL, "strategy=elastic-horovod", *TWO_FAILURES)  # dp 2 -> 1, then a stage's last copy
    assert s["status"] == "unrecoverable" and "every replica of stage" in s["error"]
    assert len(s["recoveries"]) == 1


def test_text_data_option(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    s = run(tmp_path / "run", *LOCAL, "strategy=none", "failures=none", "train.data=text",
            f"train.data_path={text}", "train.iterations=3")
    assert s["status"] == "ok"
    bad = run(tmp_path / "bad", *LOCAL, "strategy=none", "failures=none", "train.data=text",
              f"train.data_path={tmp_path / 'missing.txt'}")
    assert bad["status"] == "error" and "train.data_path" in bad["error"]


def test_a_run_that_differs_from_fault_free_training_does_not_end_ok(tmp_path, monkeypatch):
    import ftbench.equivalence

    monkeypatch.setattr(ftbench.equivalence, "compare", lambda *args: "iteration 3: loss 5.1 vs 5.0")
    s = run(tmp_path, *LOCAL, "train.iterations=4", "strategy=checkpoint", "report.check_fault_free=true",
            "failures=scripted", "failures.events=[{iteration:2,node:5}]")
    assert s["status"] == "diverged" and "iteration 3" in s["error"] and s["matches_fault_free"] is False
    from ftbench.cli import EXIT_CODES
    assert EXIT_CODES["diverged"] not in (0, 2, 3)


@pytest.mark.parametrize("strategy,extra", [("recycle", ()), ("checkpoint", ("strategy.every=2",))])
def test_a_node_lost_during_a_recovery_fails_next(tmp_path, monkeypatch, strategy, extra):
    """The run loop's side of a death during a recovery (dist finds these through its waits):
    the backend completes the recovery without the node, destroys its state and reports it
    (FailuresDiscovered from `perform`, with the iteration restored); the loop records the
    interrupted recovery, fails the node at that iteration's start, and the strategy
    recovers, so training still equals fault-free training."""
    from ftbench.engine.backend import LocalBackend
    from ftbench.loop import FailuresDiscovered

    perform, lost = LocalBackend.perform, []

    def perform_then_lose_node_3(self, actions, old, new, iteration):
        restored = perform(self, actions, old, new, iteration)
        if actions and not lost:
            lost.append(iteration)
            dead = [w for w, node in new.node_of.items() if node == 3]
            self.strike(new, iteration, frozenset(), dead)
            raise FailuresDiscovered([3], "died during the recovery (test)", restored=restored)
        return restored

    monkeypatch.setattr(LocalBackend, "perform", perform_then_lose_node_3)
    summary = assert_matches_fault_free(tmp_path, ("cluster.gpus_per_node=1",),
                                        (f"strategy={strategy}", *extra, "failures.events=[{iteration:3,node:1}]"))
    first, second = summary["recoveries"][:2]
    assert first["interrupted_by_nodes"] == [3] and lost == [3]
    assert second["iteration"] == first["restored_iteration"]
    lines = [json.loads(x) for x in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    fails = [(r["node"], r["iteration"]) for r in lines if r["event"] == "fail"]
    assert fails == [(1, 3), (3, first["restored_iteration"])]


def test_a_float32_divergence_after_a_change_of_shape_says_how_to_check_it():
    from ftbench.equivalence import divergence_error

    reshaped = [{"shape": "pp=2 dp=2"}, {"shape": "pp=2 dp=1"}]
    assert "backend.dtype=float64" in divergence_error("final weight w differs", "float32", reshaped)
    # the same shape throughout, or float64: nothing excuses the difference
    assert "float64" not in divergence_error("final weight w differs", "float32", reshaped[:1])
    assert "float64" not in divergence_error("final weight w differs", "float64", reshaped)
