"""Bamboo: every worker holds its successor's stage (refreshed after each step): in host
memory (recovery lazy, Bamboo's default), or on the GPU with its forward run redundantly
before each backward (recovery eager); it takes the stage over when its successor fails
(lazy: loading the copy onto the GPU first); broken pipelines regroup. The redundancy is real on `local`: the copies are replicas whose
equality with the originals the final-state check verifies, and failovers, reconfigurations
and joins train exactly what fault-free training trains."""

import pytest

from conftest import LOCAL, assert_matches_fault_free, compose, run, seeded_failures
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.actions import LoadFromHost
from ftbench.costs import ADAM_STATE_BYTES_PER_PARAM, PlanCosts
from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM, action_seconds
from ftbench.failures import FailureEvent
from ftbench.schedule import B, BW, F, OPT, RF, RSYNC, Op, Schedule, ScheduleError, validate
from ftbench.sim.simulator import simulate
from ftbench.strategies import build_strategy
from ftbench.strategies.bamboo import pipeline_orders

SETUP = ("strategy=bamboo", "cluster.pp=3", "cluster.dp=2")  # 6 nodes: 2 pipelines of 3
EAGER = "strategy.recovery=eager"


def _planned(*overrides):
    cfg = compose("backend=sim", "strategy=bamboo", "wandb.mode=disabled", *overrides)
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    return ctx, cluster, strategy, strategy.plan(cluster.view())


def _fail(strategy, cluster, node):
    cluster.fail(node)
    return strategy.on_event(FailureEvent(node), cluster.view(), 0)


# -- the plan and its schedule --------------------------------------------------------------------
def test_each_worker_holds_the_next_stage_and_runs_its_forward_before_each_backward():
    ctx, _, _, plan = _planned("model=gpt-tiny", *SETUP[1:], "train.microbatches=4", EAGER)
    validate(plan.schedule)
    S = 3
    for d in range(2):
        workers = [plan.schedule.worker_of(Op(OPT, s, -1, d)) for s in range(S)]
        for s, w in enumerate(workers):
            assert set(plan.holds[w]) == {(d, s), (d, (s + 1) % S)}  # its stage and a copy of the next
            ops = plan.schedule.ops[w]
            # the copy is refreshed from its stage's worker after that worker's step
            assert ops[-1] == Op(RSYNC, (s + 1) % S, -1, d)
            redundant = [op for op in ops if op.kind == RF]
            if s == S - 1:
                assert redundant == []  # the last stage holds stage 0 but never runs it (Bamboo's engine)
                continue
            assert [op.microbatch for op in redundant] == list(range(4))
            for op in redundant:  # right before the backward of the same micro-batch
                after = ops[ops.index(op) + 1]
                assert after.kind in (B, BW) and after.microbatch == op.microbatch and after.stage == s
                assert ops.index(Op(F, s, op.microbatch, d)) < ops.index(op)
    assert plan.name == "bamboo[2x3]" and plan.host == frozenset()
    # lazy (the default): the same copies, in host memory, and no redundant forward
    _, _, _, lazy = _planned("model=gpt-tiny", *SETUP[1:], "train.microbatches=4")
    assert lazy.holds == plan.holds
    assert lazy.host == {(w, d, s) for w, held in lazy.holds.items() for d, s in held[1:]}
    assert not any(op.kind == RF for ops in lazy.schedule.ops.values() for op in ops)
    assert [op for op in lazy.schedule.ops[0] if op.kind == RSYNC] == [Op(RSYNC, 1, -1, 0)]


def test_misplaced_redundant_ops_are_refused():
    ops = pipeline_orders("1f1b", 2, 2, 0, [0, 1], [1, 0])
    validate(Schedule(ops, stages=(2,), microbatches=(2,)))
    for bad in (Op(RF, 1, 5, 0), Op(RSYNC, 1, 0, 0), Op(RF, 2, 0, 0)):
        broken = {w: list(o) for w, o in ops.items()}
        broken[0].append(bad)
        with pytest.raises(ScheduleError, match="outside the schedule's shape"):
            validate(Schedule(broken, stages=(2,), microbatches=(2,)))


def test_a_worker_running_two_stages_merges_them_without_deadlock():
    """After a failover worker 0 runs stages 0 and 1 (and keeps no copy); every other worker's
    redundancy that survives stays."""
    for gen in ("gpipe", "1f1b", "zb-h1"):
        ops = pipeline_orders(gen, 4, 6, 0, [0, 0, 2, 3], [3, None, None, 2])
        validate(Schedule(ops, stages=(4,), microbatches=(6,)))
        assert not any(op.kind in (RF, RSYNC) for op in ops[0])  # it holds no copy now
        assert [op for op in ops[3] if op.kind in (RF, RSYNC)] == [Op(RSYNC, 0, -1, 0)]
        assert {op.stage for op in ops[0] if op.kind == F} == {0, 1}


def test_redundancy_doubles_the_state_and_keeps_every_redundant_forward_in_memory():
    """Sim, eager: a worker's static memory is its stage plus the next one, 16 bytes a
    parameter each; its activations add the next stage's for every micro-batch (held to the
    iteration's end); the redundant forwards make the iteration longer than without redundancy."""
    setup = ("model=gpt3-medium", "hardware=a100-40gb", "cluster.pp=4", "cluster.dp=2",
             "train.microbatch_size=1", "train.microbatches=8")
    ctx, _, _, plan = _planned(*setup, EAGER)
    costs = PlanCosts(ctx.cost_model, plan)
    result = simulate(plan.schedule, costs)
    cut = ctx.cost_model.balanced_partition(4)
    stage = [ctx.cost_model.stage(cut[s], s == 0, s == 3) for s in range(4)]
    w = plan.schedule.worker_of(Op(OPT, 1, -1, 0))  # stage 1: 3 in flight under 1F1B, stage 2 redundant
    assert costs.static_bytes(w) == ADAM_STATE_BYTES_PER_PARAM * (stage[1].params + stage[2].params)
    own = redundant = peak = 0.0
    for op in plan.schedule.ops[w]:  # own stash: F to BW; redundant forwards: kept to the end
        own += stage[1].activation_bytes * ((op.kind == F) - (op.kind == BW))
        redundant += stage[2].activation_bytes * (op.kind == RF)
        peak = max(peak, own + redundant)
    assert redundant == 8 * stage[2].activation_bytes
    assert result.peak_activation_bytes[w] == pytest.approx(peak)
    cfg = compose("backend=sim", "strategy=none", "wandb.mode=disabled", *setup)
    base_ctx = RunContext.from_config(cfg)
    base = build_strategy(cfg.strategy, base_ctx).plan(Cluster.from_config(cfg.cluster).view())
    assert result.iteration_time > simulate(base.schedule, PlanCosts(base_ctx.cost_model, base)).iteration_time


def test_lazy_keeps_the_copy_in_host_memory_and_eager_on_the_device():
    """Sim, one configuration in each mode, against a count by hand: lazy's device memory is
    its own stage (16 bytes a parameter) and its own 1F1B stash, exactly what `none` needs,
    and the copy's weights and Adam state (12 bytes a parameter) plus the stage's output of
    every micro-batch are host memory; eager adds the copy (16 bytes a parameter) and the
    redundant forward's activations of every micro-batch on the device, and nothing on the host."""
    setup = ("model=gpt3-medium", "hardware=a100-40gb", "cluster.pp=4", "cluster.dp=2",
             "train.microbatch_size=1", "train.microbatches=8")
    peaks = {}
    for mode in ("lazy", "eager"):
        ctx, _, bamboo, plan = _planned(*setup, f"strategy.recovery={mode}")
        cm = ctx.cost_model
        cut = cm.balanced_partition(4)
        stage = [cm.stage(cut[s], s == 0, s == 3) for s in range(4)]
        w = plan.schedule.worker_of(Op(OPT, 1, -1, 0))  # stage 1, holding stage 2's copy
        result = simulate(plan.schedule, PlanCosts(cm, plan))
        own_state = ADAM_STATE_BYTES_PER_PARAM * stage[1].params
        own_stash = 3 * stage[1].activation_bytes  # 1F1B: pp - 1 = 3 micro-batches in flight at stage 1
        _, host = bamboo.extra_memory(plan)
        if mode == "lazy":
            assert result.peak_memory_bytes[w] == pytest.approx(own_state + own_stash)
            boundary = cm.spec.boundary_bytes(1, ctx.seq_len)
            biggest = max(CHECKPOINT_BYTES_PER_PARAM * stage[(s + 1) % 4].params for s in range(4))
            assert host == pytest.approx(biggest + 8 * boundary)
        else:
            copy = ADAM_STATE_BYTES_PER_PARAM * stage[2].params
            own = redundant = act = 0.0
            for op in plan.schedule.ops[w]:  # own stash F to BW; the redundant forward's kept to the end
                own += stage[1].activation_bytes * ((op.kind == F) - (op.kind == BW))
                redundant += stage[2].activation_bytes * (op.kind == RF)
                act = max(act, own + redundant)
            assert redundant == 8 * stage[2].activation_bytes and act > own_stash
            assert result.peak_memory_bytes[w] == pytest.approx(own_state + copy + act)
            assert host == 0.0
        peaks[mode] = result.peak_memory_bytes[w]
    cfg = compose("backend=sim", "strategy=none", "wandb.mode=disabled", *setup)
    base_ctx = RunContext.from_config(cfg)
    base = build_strategy(cfg.strategy, base_ctx).plan(Cluster.from_config(cfg.cluster).view())
    none = simulate(base.schedule, PlanCosts(base_ctx.cost_model, base)).peak_memory_bytes
    assert peaks["lazy"] == pytest.approx(none[base.schedule.worker_of(Op(OPT, 1, -1, 0))])


def test_out_of_memory_comes_from_the_memory_model(tmp_path):
    """GPT-3 3.35B at pp 4 fits an 80 GB A100 without redundancy, and eager Bamboo's copies
    and redundant activations do not: an `oom` result whose message gives the worker's memory
    in parts. Lazy fits: its copy is in host memory."""
    setup = ("backend=sim", "model=gpt3-3.35b", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=2",
             "train.microbatch_size=1", "train.microbatches=8", "train.iterations=3")
    assert run(tmp_path / "none", *setup, "strategy=none")["status"] == "ok"
    summary = run(tmp_path / "bamboo", *setup, "strategy=bamboo", EAGER)
    assert summary["status"] == "oom" and "out of memory" in summary["error"]
    for part in ("its stage's weights, gradients and Adam state", "the next stage's copy on the device",
                 "the redundant forward's", "8 micro-batches of 1 x 2048 tokens", "train.recompute=none"):
        assert part in summary["error"], summary["error"]
    lazy = run(tmp_path / "lazy", *setup, "strategy=bamboo")
    assert lazy["status"] == "ok" and lazy["peak_host_bytes_max"] > 0


# -- failover and reconfiguration rules ---------------------------------------------------------
def test_failover_moves_the_stage_to_its_predecessor_and_drops_the_lost_copies():
    _, cluster, bamboo, plan = _planned("model=gpt-tiny", *SETUP[1:], EAGER)
    recovery = _fail(bamboo, cluster, 1)  # pipeline 0, stage 1
    assert [type(a).__name__ for a in recovery.actions] == ["Rendezvous"]  # eager: no state moves
    new = recovery.plan
    assert new.schedule.worker_of(Op(OPT, 1, -1, 0)) == 0
    assert set(new.holds[0]) == {(0, 0), (0, 1)} and set(new.holds[2]) == {(0, 2), (0, 0)}
    assert not any(op.kind == RF for op in new.schedule.ops[0])
    # stage 2's copy was on the failed worker: losing stage 2's worker now breaks the pipeline
    recovery = _fail(bamboo, cluster, 2)
    assert recovery.plan.name.startswith("bamboo[1x3] after reconfiguration")
    assert [type(a).__name__ for a in recovery.actions] == ["Rendezvous", "SyncFromPeers"]


def test_a_lazy_failover_loads_the_copy_onto_the_gpu_first():
    """Lazy: the predecessor taking over moves the copy's weights and Adam state (12 bytes a
    parameter) from host memory over hardware.host_gbps; the stage it runs now counts on the
    device, and the surviving copies stay in host memory."""
    ctx, cluster, bamboo, plan = _planned("model=gpt3-medium", "hardware=a100-40gb", "cluster.pp=4",
                                          "cluster.dp=2", "train.microbatch_size=1", "train.microbatches=8")
    recovery = _fail(bamboo, cluster, 1)  # pipeline 0, stage 1: worker 0 takes it over
    assert [type(a).__name__ for a in recovery.actions] == ["Rendezvous", "LoadFromHost"]
    load = recovery.actions[1]
    cm = ctx.cost_model
    params = cm.stage(cm.balanced_partition(4)[1], False, False).params
    assert load == LoadFromHost((0,), CHECKPOINT_BYTES_PER_PARAM * params)
    seconds = action_seconds(load, plan, recovery.plan, cm)
    assert seconds > 0 and seconds == pytest.approx(CHECKPOINT_BYTES_PER_PARAM * params / (ctx.hardware.host_gbps * 1e9))
    new = recovery.plan
    assert (0, 0, 1) in plan.host and (0, 0, 1) not in new.host  # worker 0 runs stage 1 now
    assert PlanCosts(cm, new).static_bytes(0) == ADAM_STATE_BYTES_PER_PARAM * (
        cm.stage(cm.balanced_partition(4)[0], True, False).params + params)
    assert (3, 0, 0) in new.host  # the last stage's copy of stage 0 stays in host memory


def test_a_lazy_failover_charges_the_load_in_the_run(tmp_path):
    """The run's recovery time: the rendezvous plus the copy's load, on sim as the cost model says."""
    setup = ("backend=sim", "model=gpt3-medium", "hardware=a100-40gb", "strategy=bamboo", "cluster.pp=4",
             "cluster.dp=2", "train.microbatch_size=1", "train.microbatches=8", "train.iterations=6",
             "failures.events=[{iteration:2,node:1}]")
    lazy, eager = run(tmp_path / "lazy", *setup), run(tmp_path / "eager", *setup, EAGER)
    assert lazy["recoveries"][0]["actions"] == ["Rendezvous", "LoadFromHost"]
    assert eager["recoveries"][0]["actions"] == ["Rendezvous"]
    ctx = RunContext.from_config(compose(*setup))
    cm = ctx.cost_model
    load = CHECKPOINT_BYTES_PER_PARAM * cm.stage(cm.balanced_partition(4)[1], False, False).params \
        / (ctx.hardware.host_gbps * 1e9)
    assert lazy["recoveries"][0]["recovery_s"] == pytest.approx(eager["recoveries"][0]["recovery_s"] + load)


def test_overload_threshold_reconfigures_at_a_failover():
    _, cluster, bamboo, _ = _planned("model=gpt-tiny", *SETUP[1:], "strategy.overload=0.05")
    recovery = _fail(bamboo, cluster, 1)  # 2 x 1 overloaded / 5 live > 5 %
    assert "reconfiguration (overload)" in recovery.plan.name


def test_joined_nodes_wait_when_another_pipeline_would_lack_a_micro_batch():
    _, cluster, bamboo, _ = _planned("model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "train.microbatches=1")
    for node in (4, 5):  # new nodes: 3 pipelines would fit, but the global batch has 2 micro-batches
        cluster.join(node)
        assert bamboo.on_event(FailureEvent(node, kind="join"), cluster.view(), 0).plan is None
    assert bamboo.idle == [4, 5]


def test_too_few_nodes_for_a_pipeline_is_unrecoverable(tmp_path):
    summary = run(tmp_path, *LOCAL, "strategy=bamboo", "cluster.pp=3", "cluster.dp=1",
                  "failures.events=[{iteration:2,node:1},{iteration:3,node:2}]")
    assert summary["status"] == "unrecoverable" and "fewer than the 3 stages" in summary["error"]


@pytest.mark.parametrize("override,message", [
    ("cluster.pp=1", "at least 2 stages"),
    ("strategy.overload=2", "must be a fraction"),
    ("strategy.recovery=sometimes", "must be one of lazy, eager"),
])
def test_bad_settings_name_the_setting(tmp_path, override, message):
    summary = run(tmp_path, "backend=sim", "model=gpt-tiny", "strategy=bamboo", "cluster.pp=2", "cluster.dp=2",
                  override)
    assert summary["status"] == "error" and message in summary["error"], summary["error"]
    assert override.split("=")[0] in summary["error"]


# -- training -------------------------------------------------------------------------------------
def _rules(summary) -> list[str]:
    return [r["plan"].split(" after ")[-1].split(" (")[0] for r in summary["recoveries"]]


@pytest.mark.parametrize("events,rules", [
    ("[{iteration:2,node:1}]", ["failover"]),
    ("[{iteration:2,node:1},{iteration:4,node:5}]", ["failover", "failover"]),  # in different pipelines
    ("[{iteration:2,node:1},{iteration:4,node:0}]", ["failover", "reconfiguration"]),  # consecutive stages
    ("[{iteration:1,node:2},{iteration:2,node:1},{iteration:5,node:1,kind:join},{iteration:6,node:2,kind:join}]",
     ["failover", "reconfiguration", "reconfiguration"]),  # the pipeline comes back when its nodes rejoin
], ids=["failover", "two-failovers", "reconfiguration", "join"])
def test_redundant_stages_train_the_fault_free_model(tmp_path, events, rules):
    summary = assert_matches_fault_free(tmp_path, setup=SETUP, faults=(f"failures.events={events}",))
    assert _rules(summary) == rules
    assert all(r["lost_iterations"] == 0 for r in summary["recoveries"])


def test_eager_redundant_forwards_train_the_fault_free_model(tmp_path):
    """Eager: the redundant forwards change nothing the iteration trains, across a failover
    and a reconfiguration."""
    summary = assert_matches_fault_free(tmp_path, setup=SETUP,  # (the fault-free run is strategy=none)
                                        faults=(EAGER, "failures.events=[{iteration:2,node:1},{iteration:4,node:0}]"))
    assert _rules(summary) == ["failover", "reconfiguration"]
    assert [r["actions"] for r in summary["recoveries"]] == [["Rendezvous"], ["Rendezvous", "SyncFromPeers"]]


def test_a_nodes_gpus_fail_over_together(tmp_path):
    """2 GPUs per node: GPU j of 3 nodes is one pipeline, so a node's failure fails over two
    pipelines at once, each to its own predecessor."""
    summary = assert_matches_fault_free(tmp_path, setup=("strategy=bamboo", "cluster.pp=3", "cluster.dp=4",
                                                         "cluster.gpus_per_node=2", "train.microbatches=2"),
                                        faults=("failures.events=[{iteration:2,node:4}]",))
    assert summary["recoveries"][0]["plan"] == "bamboo[2x3x2] 2 failed over after failover"


@pytest.mark.parametrize("seed", [5, 17])
def test_seeded_random_failures_train_the_fault_free_model(tmp_path, seed):
    summary = assert_matches_fault_free(tmp_path, setup=SETUP, faults=(seeded_failures(f"bamboo-{seed}", 6, 3),))
    assert summary["failures"] == 3


@pytest.mark.dist
def test_dist_processes_fail_over_and_reconfigure_after_real_kills(tmp_path):
    """backend=dist: two failovers in different pipelines (a worker runs its dead successor's
    stage from its redundant copy, sending itself the boundary tensors), then the death of a
    worker running two stages breaks its pipeline and the survivors regroup, copying layers
    over torch.distributed; the run's own check: exactly fault-free training."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_conformance import _trace
    from test_dist_failures import run_dist

    setup = ("model=gpt-tiny", *SETUP, "train.iterations=6", "train.microbatches=2", "report.gantt=false",
             "report.progress=false", "backend.timeout_s=30", "backend.clock=model")
    events = "failures.events=[{iteration:2,node:1},{iteration:2,node:5},{iteration:4,node:0}]"
    summary, lines = run_dist(tmp_path / "dist", events, setup=setup)
    assert summary["matches_fault_free"] is True
    # and the conformance check: the same events, actions, lost work and plans as on sim
    sim = run(tmp_path / "sim", "backend=sim", *setup[:-1], events)
    assert _trace(tmp_path / "dist", summary) == _trace(tmp_path / "sim", sim)
    assert _rules(summary) == ["failover", "failover", "reconfiguration"]
    assert summary["recoveries"][1]["plan"] == "bamboo[2x3] 2 failed over after failover"
    assert [r["event"] for r in lines].count("iteration") == 6
