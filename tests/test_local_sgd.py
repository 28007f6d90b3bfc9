"""LocalSGD and DiLoCo (train.data_parallel, ftbench/local_sgd.py): each pipeline steps on its
own samples and the replicas meet every train.sync_every steps. The local engine must train
what a plain loop over whole models trains; torchft under them must equal fault-free training
replayed under its ledger (a group that left drops its window, a returning group heals at
the next sync); sim and local must agree; bad settings get clear errors."""
import pytest
import torch

from conftest import compose, run
from ftbench.context import RunContext
from ftbench.engine.worker import make_optimizer
from ftbench.equivalence import compare, load_state
from ftbench.metrics import read_metrics
from ftbench.fault_free import fault_free_reference
from ftbench.models.data import batch, make_source
from ftbench.models.gpt import init_full_model, lm_loss_sum
from ftbench.samples import replayed

TINY = ("model=gpt-tiny", "cluster.pp=2", "train.microbatches=2", "report.gantt=false", "report.progress=false")
LOCAL = ("backend=local", *TINY, "report.check_fault_free=false")
# torchft, pp 2 x dp 3 on six one-GPU nodes (group d: nodes 2d, 2d + 1): group 1 fails in
# iteration 4 and its node is back in 5, inside the window 3..5 of sync_every=3
TORCHFT = ("cluster.dp=3", "train.iterations=9", "train.sync_every=3", "cluster.replacement_s=0.2",
           "strategy=torchft", "failures=scripted",
           "failures.events=[{iteration:4,node:3},{iteration:5,node:3,kind:join}]")


def plain_local_steps(cfg, algorithm: str, dp: int, sync_every: int):
    """LocalSGD or DiLoCo written out over dp whole GPT-2 models, float64: each model takes an
    AdamW step on its own samples' mean loss, and every sync_every steps (and after the last)
    the models average their parameters (LocalSGD) or their pseudo-gradients, the outer
    Nesterov step then applied to the last sync's parameters (DiLoCo, arXiv 2311.08105)."""
    ctx = RunContext.from_config(cfg)
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    models = [init_full_model(ctx.spec, ctx.seed).to(torch.float64) for _ in range(dp)]
    optimizers = [make_optimizer(m.parameters(), cfg.train.lr, cfg.train.weight_decay) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    last_sync = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in last_sync.items()}
    own = ctx.microbatches * ctx.microbatch_size  # samples per model per step
    losses = []
    for i in range(ctx.iterations):
        total = 0.0
        for d, (model, optimizer) in enumerate(zip(models, optimizers)):
            for first in range(d * own, (d + 1) * own, ctx.microbatch_size):
                ids = batch(data, i, range(first, first + ctx.microbatch_size))
                loss = lm_loss_sum(model(input_ids=ids).logits, ids) / (own * (ctx.seq_len - 1))
                loss.backward()
                total += loss.item() / dp
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if (i + 1) % sync_every and i + 1 != ctx.iterations:
            continue
        with torch.no_grad():
            for n in names:
                params = [dict(m.named_parameters())[n] for m in models]
                if algorithm == "localsgd":
                    mean = sum(p.clone() for p in params) / dp
                else:
                    delta = sum(last_sync[n] - p for p in params) / dp
                    momentum[n].mul_(cfg.train.outer_momentum).add_(delta)
                    mean = last_sync[n] - cfg.train.outer_lr * (delta + cfg.train.outer_momentum * momentum[n])
                    last_sync[n] = mean.clone()
                for p in params:
                    p.copy_(mean)
    return losses, {k: v.detach().clone() for k, v in models[0].state_dict().items()}


@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_the_engine_trains_what_a_plain_loop_over_whole_models_trains(tmp_path, algorithm):
    setup = (*LOCAL, "cluster.dp=2", "train.iterations=7", f"train.data_parallel={algorithm}", "train.sync_every=3",
             "backend.dtype=float64", "strategy=none", "failures=none")
    summary = run(tmp_path, *setup)
    losses, state = plain_local_steps(compose(*setup), algorithm, 2, 3)
    assert compare(summary["losses"], load_state(summary["final_state"]), losses, state) is None
    # the syncs changed training: synchronous data parallelism trains another model
    sync = run(tmp_path / "sync", *LOCAL, "cluster.dp=2", "train.iterations=7", "backend.dtype=float64",
               "strategy=none", "failures=none")
    assert compare(summary["losses"], load_state(summary["final_state"]), sync["losses"],
                   load_state(sync["final_state"])) is not None
    assert summary["syncs"] == [[2, 5, [0, 1], [], 2 * 3 * 4], [6, 6, [0, 1], [], 4]]
    assert summary["samples"] == 7 * 4 and summary["samples_dropped"] == 0


def test_localsgd_over_one_pipeline_is_synchronous_training_to_the_bit(tmp_path):
    """An average over one replica is the replica: nothing else may differ."""
    common = (*LOCAL, "cluster.dp=1", "train.iterations=5", "strategy=none", "failures=none")
    local = run(tmp_path / "local", *common, "train.data_parallel=localsgd", "train.sync_every=2")
    sync = run(tmp_path / "sync", *common)
    assert local["losses"] == sync["losses"]
    assert all(torch.equal(a, b) for a, b in zip(load_state(local["final_state"]).values(),
                                                 load_state(sync["final_state"]).values()))


@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_torchft_drops_the_window_of_a_group_that_left_and_heals_it_at_the_sync(tmp_path, algorithm):
    summary = run(tmp_path, "backend=local", "backend.clock=model", *TINY, *TORCHFT,
                  f"train.data_parallel={algorithm}")
    assert summary["status"] == "ok", summary["error"]
    b = summary["global_batch"] // 3
    # group 1 trained iterations 3 and 5 of the window 3..5 but not 4: it takes no part in
    # that sync, heals there, and its window's samples count nothing
    assert summary["syncs"] == [[2, 2, [0, 1, 2], [], 9 * b], [5, 5, [0, 2], [1], 6 * b], [8, 8, [0, 1, 2], [], 9 * b]]
    assert summary["samples"] == 24 * b and summary["samples_dropped"] == 3 * b
    fail, join = summary["recoveries"]
    assert fail["actions"] == ["Rendezvous"] and join["actions"] == ["Rendezvous", "SyncFromPeers"]
    # under local steps a returning group takes every stage from one group, the lowest live one
    assert sorted((c["src"], c["dst"]) for c in join["copies"]) == [(0, 2), (1, 3)]
    assert summary["matches_fault_free"] is True


def test_the_replayed_check_sees_another_heal_or_another_ledger(tmp_path, monkeypatch):
    """The run equals its replayed reference, and not one that heals from another group or
    drops another iteration: the check is not vacuous."""
    overrides = ("backend=local", "backend.clock=model", *TINY, *TORCHFT, "train.data_parallel=diloco",
                 "report.check_fault_free=false")
    summary = run(tmp_path, *overrides)
    state = load_state(summary["final_state"])
    cfg = compose("report.progress=false", *overrides[:-1], "strategy=none", "failures=none")
    ctx = RunContext.from_config(cfg)
    replay = replayed(summary["ledger"], ctx.global_batch)
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx, replay=replay)) is None
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx, replay={3: replay[4]})) is not None
    import ftbench.engine.local as local_engine

    monkeypatch.setattr(local_engine, "heal_source", max)  # group 2's state instead of group 0's
    assert compare(summary["losses"], state, *fault_free_reference(cfg, ctx, replay=replay)) is not None


# Two failures after every stage stepped (at 0.97), each leaving other groups alone: DiLoCo
# syncing every step in float32, the setup of the seeded random script (ftbench.chaos 1
# torchft) that first showed the undo's rounding amplified by the outer momentum
KEPT = ("cluster.dp=3", "train.iterations=7", "train.microbatches=3", "train.data_parallel=diloco",
        "train.sync_every=1", "strategy=torchft", "failures=scripted", "failures.at=0.97",
        "failures.events=[{iteration:0,node:2},{iteration:1,node:0}]", "backend.dtype=float32")


def test_groups_a_failure_leaves_alone_keep_their_local_step(tmp_path, monkeypatch):
    """torchft under DiLoCo: the groups a failure does not touch finish the iteration and its
    sync among themselves, nothing of theirs undone, and in float32 the run is fault-free
    training replayed under its ledger bit for bit. Redoing the iteration instead (as under
    synchronous training) undoes their steps: no longer bit for bit, the undo's rounding."""
    import strategies.torchft as torchft

    kept = run(tmp_path / "kept", "backend=local", "backend.clock=model", *TINY, *KEPT)
    fails = [r for r in read_metrics(tmp_path / "kept" / "metrics.jsonl") if r["event"] == "fail"]
    # group 1 (node 2) out of iteration 0: groups 0 and 2 finish it; group 0 (node 0) out of
    # iteration 1: group 2, the second pipeline of the plan then, finishes it
    assert [(f["iteration"], f["finished"], "undone" in f) for f in fails] == [(0, [0, 2], False), (1, [1], False)]
    assert all(f["stepped"] > 0 for f in fails)
    g = kept["global_batch"] // 3  # each group's samples
    assert kept["ledger"] == [[0, 0, 2 * g, [[0, g], [2 * g, 3 * g]]], [1, 6, g, [[2 * g, 3 * g]]]]
    assert [r["iteration"] for r in kept["recoveries"]] == [1, 2]  # at the end of the iteration struck
    assert kept["matches_fault_free"] is True
    assert kept["fault_free_difference_max"]["weights"] == 0 and kept["fault_free_difference_max"]["loss"] == 0

    monkeypatch.setattr(torchft.Torchft, "finishes_local_step", False)
    redone = run(tmp_path / "redone", "backend=local", "backend.clock=model", *TINY, *KEPT)
    fails = [r for r in read_metrics(tmp_path / "redone" / "metrics.jsonl") if r["event"] == "fail"]
    assert all(f["undone"] > 0 for f in fails) and redone["ledger"] == kept["ledger"]
    assert redone["fault_free_difference_max"]["weights"] > 0


def test_a_failure_mid_schedule_leaves_the_other_groups_to_finish(tmp_path):
    """1F1B over pp 4 x dp 2, a node of group 0 failing half-way through iteration 1: group 1
    is then between its backwards and has stepped some stages, not all. It finishes the
    iteration alone (its steps wait on no other group's backward), and local equals the
    replayed reference bit for bit and agrees with sim."""
    overrides = ("model=gpt-tiny", "cluster.pp=4", "cluster.dp=2", "cluster.gpus_per_node=2", "schedule=1f1b",
                 "train.microbatches=3", "train.iterations=4", "train.data_parallel=localsgd", "train.sync_every=2",
                 "strategy=torchft", "failures=scripted", "failures.events=[{iteration:1,node:1,at:0.6}]",
                 "report.gantt=false")
    local = run(tmp_path / "local", "backend=local", "backend.clock=model", *overrides)
    sim = run(tmp_path / "sim", "backend=sim", *overrides)
    assert local["status"] == sim["status"] == "ok" and local["ledger"] == sim["ledger"]
    assert local["recoveries"][0]["iteration"] == 2 and local["syncs"][0][2] == [1]  # group 1 alone
    fail, = [r for r in read_metrics(tmp_path / "local" / "metrics.jsonl") if r["event"] == "fail"]
    assert 0 < fail["stepped"] < 4 and fail["finished"] == [1]  # some stages had stepped, not all
    assert local["fault_free_difference_max"] == {**local["fault_free_difference_max"], "loss": 0.0, "weights": 0.0}


def test_a_failure_in_the_last_iteration_ends_the_run_on_the_live_groups(tmp_path):
    """Group 1 fails half-way through the last iteration: group 0 finishes it and its sync, and
    the run recovers once more, so its final weights are the live group's."""
    summary = run(tmp_path, "backend=local", "backend.clock=model", *TINY, "cluster.dp=2", "train.iterations=3",
                  "train.data_parallel=diloco", "train.sync_every=2", "strategy=torchft", "failures=scripted",
                  "failures.events=[{iteration:2,node:3}]")
    assert summary["status"] == "ok" and summary["iterations"] == 3 and summary["recoveries"][-1]["shape"] == "pp=2 dp=1"
    assert summary["syncs"][-1][:4] == [2, 2, [0], []] and summary["matches_fault_free"] is True


def test_sim_charges_the_whole_iteration_a_failure_leaves_alone_and_no_redo(tmp_path):
    """On sim, torchft under DiLoCo: the iteration struck half-way counts whole for the groups
    that finish it, and nothing is redone; synchronous torchft loses the half and redoes it."""
    overrides = ("backend=sim", *TINY, *(o for o in TORCHFT if "sync_every" not in o), "failures.at=0.5")
    diloco = ("train.data_parallel=diloco", "train.sync_every=3")
    free = run(tmp_path / "free", "backend=sim", *TINY, "cluster.dp=3", "train.iterations=9", *diloco,
               "strategy=none", "failures=none")
    diloco = run(tmp_path / "diloco", *overrides, *diloco)
    synchronous = run(tmp_path / "sync", *overrides)
    assert free["status"] == diloco["status"] == synchronous["status"] == "ok"
    T = free["iteration_time_s"]
    recovered = sum(r["recovery_s"] for r in diloco["recoveries"])
    assert diloco["time_s"] == pytest.approx(9 * T + recovered, rel=1e-9)
    assert diloco["productive_s"] == pytest.approx(9 * T, rel=1e-9)
    assert synchronous["productive_s"] < synchronous["time_s"] - sum(r["recovery_s"] for r in synchronous["recoveries"])


def test_sim_and_local_agree_under_diloco(tmp_path):
    overrides = (*TINY, *TORCHFT, "train.data_parallel=diloco", "report.check_fault_free=false")
    sim = run(tmp_path / "sim", "backend=sim", *overrides)
    local = run(tmp_path / "local", "backend=local", "backend.clock=model", *overrides)
    assert sim["status"] == local["status"] == "ok"
    for key in ("syncs", "ledger", "samples", "plan_segments"):
        assert sim[key] == local[key], key
    assert [r["actions"] for r in sim["recoveries"]] == [r["actions"] for r in local["recoveries"]]
    assert local["ettr"] == pytest.approx(sim["ettr"], abs=2e-6)


def test_the_sync_costs_time_once_per_window_and_the_step_none(tmp_path):
    """On sim: no gradient all-reduce in a step, one parameter all-reduce per sync_every
    steps, spread over them."""
    common = ("backend=sim", "model=gpt3-6.7b", "hardware=h100", "cluster.pp=8", "cluster.dp=16",
              "cluster.gpus_per_node=8", "train.iterations=20", "strategy=none", "failures=none",
              "report.gantt=false", "report.progress=false")
    sync = run(tmp_path / "a", *common)["iteration_time_s"]
    every = {h: run(tmp_path / f"h{h}", *common, "train.data_parallel=localsgd", f"train.sync_every={h}")
             ["iteration_time_s"] for h in (1, 10)}
    assert every[10] < sync and every[10] < every[1]
    ctx = RunContext.from_config(compose(*common, "train.data_parallel=localsgd", "train.sync_every=1"))
    from ftbench.local_sgd import outer_sync_s

    plan = ctx.grid_plan(8, 16, 8)
    assert every[1] - every[10] == pytest.approx(outer_sync_s(ctx.cost_model, plan) * 0.9, rel=1e-6)


@pytest.mark.parametrize("overrides, setting", [
    (("train.data_parallel=local",), "train.data_parallel"),
    (("train.sync_every=5",), "train.sync_every"),
    (("train.data_parallel=localsgd", "train.outer_lr=0.5"), "train.outer_lr"),
    (("train.data_parallel=diloco", "train.sync_every=0"), "train.sync_every"),
    (("train.data_parallel=diloco", "train.outer_momentum=1.0"), "train.outer_momentum"),
    (("train.data_parallel=diloco", "strategy=checkpoint"), "train.data_parallel"),
])
def test_bad_settings_name_the_setting(overrides, setting):
    from ftbench.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        RunContext.from_config(compose("backend=sim", *overrides))
    assert err.value.setting == setting
