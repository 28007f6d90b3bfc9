"""The shortcuts that keep reshaping strategies (elastic-horovod, varuna) fast at 16,384 GPUs give
exactly what the general computations give: a generated grid timed from one pipeline of each
kind (ftbench.sim.grid) is the whole grid simulated; copies worked out stage by stage are the
per-worker ones; busiest links and node bytes found by counting are the sums; the checkpoint
ledger's shortcut drops what the scan drops. Compared on small cases; no timing asserts."""
from __future__ import annotations

import random
from collections import defaultdict

import pytest

from conftest import compose
from ftbench.actions import MEMORY, RestoreCheckpoint, Transfer
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.plan import generated_grid_plan, grid_plan
from ftbench.recovery_costs import CheckpointLedger, _most_node_bytes, _node_bytes, action_seconds
from ftbench.schedule import generate
from ftbench.sim.cache import SimCache
from ftbench.sim.grid import GridResult, GridTimer
from ftbench.sim.simulator import simulate
from ftbench.transfers import Copies, peer_copies, transfer_seconds

FIGURES = ("busy", "peak_stash", "peak_activation_bytes", "peak_memory_bytes")


def _ctx(*overrides: str) -> RunContext:
    return RunContext.from_config(compose("model=gpt3-medium", "backend=sim", "hardware=a100-80gb", *overrides))


def _counts(total: int, dp: int) -> tuple[int, ...]:
    return tuple(total // dp + (1 if d < total % dp else 0) for d in range(dp))


def _same_as_simulated(result, plan, model, rows: bool = False) -> None:
    whole = simulate(plan.schedule, PlanCosts(model, plan))
    assert result.iteration_time == whole.iteration_time
    for name in FIGURES:
        assert list(getattr(result, name).items()) == list(getattr(whole, name).items()), name
    if rows:
        assert result.ops == whole.ops and result.allreduces == whole.allreduces


@pytest.mark.parametrize("overrides", [(), ("train.overlap_grad_reduce=true",), ("train.recompute=full",)])
def test_a_grid_timed_by_kinds_is_the_whole_grid_simulated(overrides):
    ctx = _ctx(*overrides)
    model, timer = ctx.cost_model, GridTimer(ctx.cost_model)
    rng = random.Random(f"grid-timer{overrides}")
    for case in range(25):
        schedule, pp, dp = rng.choice(["1f1b", "zb-h1", "gpipe"]), rng.choice([1, 2, 3, 4, 6]), rng.randint(2, 7)
        counts, g = _counts(rng.randint(dp, 4 * dp), dp), rng.choice([1, 2, 3, 4, 8])
        workers = list(range(pp * dp + 3))
        if rng.random() < 0.5:
            rng.shuffle(workers)
        node_of = (lambda g: lambda w: w // g)(g)
        layers = model.balanced_partition(pp)
        if case % 3:
            plan = generated_grid_plan(schedule, pp, counts, layers, workers, node_of)
        else:
            plan = grid_plan(generate(schedule, pp, counts, dp), layers, pp, g, node_of=node_of, workers=workers)
        result = timer(plan)
        assert isinstance(result, GridResult)
        _same_as_simulated(result, plan, model, rows=case < 5)


def test_one_set_of_kinds_is_retimed_for_every_pipeline_count():
    """Grids whose pipelines come in the same kinds share one small plan, timed again for
    each all-reduce charge (the pipeline count, whether a stage sits on one node)."""
    ctx = _ctx()
    model, timer = ctx.cost_model, GridTimer(ctx.cost_model)
    for g in (1, 2, 8):
        for dp in range(2, 12):
            plan = generated_grid_plan("1f1b", 2, _counts(3 * dp + 1, dp), model.balanced_partition(2),
                                       list(range(2 * dp)), (lambda g: lambda w: w // g)(g))
            _same_as_simulated(timer(plan), plan, model)
    assert len(timer._kinds) <= 2 * 3  # (4, 3) micro-batch kinds, per node pattern


def test_plans_that_are_no_generated_grid_are_left_to_the_simulator():
    ctx = _ctx()
    timer = GridTimer(ctx.cost_model)
    plan = ctx.grid_plan(4, 3, 2)
    assert timer(plan) is not None
    mixed = plan.on_workers(list(range(12)), lambda w: w // 2)  # no grid layout any more
    assert timer(mixed) is None
    handed_out = ctx.grid_plan(4, 3, 2)
    handed_out.schedule.ops[0]  # a worker's list handed out: no longer a regular grid
    assert timer(handed_out) is None


def test_the_sim_cache_gives_what_memoize_false_gives():
    ctx = _ctx()
    fast, plain = SimCache(ctx.cost_model), SimCache(ctx.cost_model, enabled=False)
    for g in (1, 4):
        for dp in (2, 5, 9):
            plan = ctx.grid_plan(4, dp, g, node_of=(lambda g: lambda w: w // g)(g))
            a, b = fast(plan), plain(plan)
            assert a.iteration_time == b.iteration_time and a.bubble_fraction() == b.bubble_fraction()
            assert list(a.peak_memory_bytes.items()) == list(b.peak_memory_bytes.items())


def _reference_transfer_seconds(copies, node_of, cost_model) -> float:
    """transfer_seconds as it adds bytes up copy by copy."""
    if not copies:
        return 0.0
    hw = cost_model.hw
    out_bytes, in_bytes, local_bytes = defaultdict(float), defaultdict(float), defaultdict(float)
    for c in copies:
        a, b = node_of(c.src), node_of(c.dst)
        if a == b:
            local_bytes[c.dst] += c.nbytes
        else:
            out_bytes[a] += c.nbytes
            in_bytes[b] += c.nbytes
    inter = max([*out_bytes.values(), *in_bytes.values(), 0.0]) / (hw.inter_node_gbps * 1e9)
    intra = max([*local_bytes.values(), 0.0]) / (hw.intra_node_gbps * 1e9)
    return hw.link_latency_us * 1e-6 + max(inter, intra)


def test_grid_copies_are_the_per_worker_ones():
    """Between grids peer_copies goes stage by stage (Copies); passing `kept` takes the
    per-worker path. Both name the same copies, in the same order, at the same cost."""
    ctx = _ctx()
    model = ctx.cost_model
    rng = random.Random("grid-copies")
    total = 0
    for _ in range(150):
        pp_old = rng.choice([1, 2, 3, 4])
        pp_new = pp_old if rng.random() < 0.7 else rng.choice([1, 2, 3, 4])
        dp_old, dp_new = rng.randint(1, 6), rng.randint(1, 6)
        n = max(pp_old * dp_old, pp_new * dp_new) + 5
        old_workers = rng.sample(range(n), pp_old * dp_old)
        if rng.random() < 0.5:
            old_workers.sort()
        dead = set(rng.sample(range(n), rng.randint(0, 3)))
        survivors = [w for w in range(n) if w not in dead]
        if rng.random() < 0.5:
            rng.shuffle(survivors)
        if len(survivors) < pp_new * dp_new:
            continue
        g = rng.choice([1, 2, 4])
        node_of = (lambda g: lambda w: w // g)(g)
        old = generated_grid_plan("1f1b", pp_old, (2,) * dp_old, model.balanced_partition(pp_old), old_workers, node_of)
        new = generated_grid_plan("1f1b", pp_new, (2,) * dp_new, model.balanced_partition(pp_new), survivors, node_of)
        alive = (lambda dead: lambda w: w not in dead)(dead)
        fast, slow = peer_copies(old, new, alive, model), peer_copies(old, new, alive, model, kept=alive)
        assert isinstance(fast, Copies) and type(slow) is tuple
        assert fast == slow and list(fast) == list(slow) and fast[:3] == slow[:3] and len(fast) == len(slow)
        nodes = {**old.node_of, **new.node_of}.__getitem__
        assert transfer_seconds(fast, nodes, model) == transfer_seconds(slow, nodes, model) \
            == _reference_transfer_seconds(slow, nodes, model)
        assert RestoreCheckpoint(MEMORY, fast) == RestoreCheckpoint(MEMORY, slow)
        assert action_seconds(RestoreCheckpoint(MEMORY, fast), old, new, model) == \
            action_seconds(RestoreCheckpoint(MEMORY, slow), old, new, model)
        total += len(slow)
    assert total > 200


def test_busiest_links_found_by_counting_are_the_sums():
    ctx = _ctx()
    rng = random.Random("busiest-link")
    for _ in range(300):
        sizes = rng.sample([1e9, 3.3e8, 7.77e8 / 3, 0.1 + 0.2, 5e8], rng.randint(1, 3))
        copies = [Transfer((0, 1), False, False, rng.randrange(12), rng.randrange(12), rng.choice(sizes))
                  for _ in range(rng.randint(0, 40))]
        node_of = (lambda g: lambda w: w // g)(rng.choice([1, 1, 2, 3]))
        assert transfer_seconds(copies, node_of, ctx.cost_model) == \
            _reference_transfer_seconds(copies, node_of, ctx.cost_model)


@pytest.mark.parametrize("g", [1, 2, 4])
def test_most_node_bytes_is_the_largest_sum(g):
    ctx = _ctx()
    for pp, dp in ((1, 3), (4, 2), (3, 5)):
        plan = generated_grid_plan("1f1b", pp, (2,) * dp, ctx.cost_model.balanced_partition(pp),
                                   list(range(3, 3 + pp * dp)), (lambda g: lambda w: w // g)(g))
        assert _most_node_bytes(plan, ctx.cost_model) == max(_node_bytes(plan, ctx.cost_model).values())


def test_the_ledger_drops_what_a_scan_drops():
    rng = random.Random("ledger")
    for _ in range(200):
        ledger, saved, t = CheckpointLedger(), [], 0.0
        for _ in range(30):
            t += rng.random()
            if rng.random() < 0.6:
                entry = (rng.randrange(100), t + rng.choice([0.0, 0.0, rng.random() * 3]))
                ledger.add(*entry)
                saved.append(entry)
            else:
                lost = [i for i, at in saved if at > t]
                saved = [(i, at) for i, at in saved if at <= t]
                assert ledger.drop_not_durable(t) == lost and ledger.saved == saved


@pytest.mark.parametrize("strategy,gpus_per_node", [("elastic-horovod", 1), ("varuna", 2), ("checkpoint", 4)])
def test_live_workers_kept_between_calls_are_those_a_fresh_look_finds(strategy, gpus_per_node):
    from ftbench.cluster import Cluster
    from ftbench.strategies import build_strategy

    cfg = compose("model=gpt3-medium", "backend=sim", f"strategy={strategy}", "cluster.pp=4", "cluster.dp=6",
                  f"cluster.gpus_per_node={gpus_per_node}")
    strategy, fresh = (build_strategy(cfg.strategy, RunContext.from_config(cfg)) for _ in range(2))
    cluster = Cluster.from_config(cfg.cluster)
    view = cluster.view()
    rng = random.Random("alive-workers")
    for _ in range(200):
        node = rng.randrange(cluster.nodes + 2)
        if rng.random() < 0.7:
            cluster.fail(node)
        else:
            cluster.join(node)
        if rng.random() < 0.8:
            fresh._alive = None
            assert strategy.alive_workers(view) == fresh.alive_workers(view)


def test_peaks_are_kept_per_worker_as_a_loop_keeps_them():
    from types import SimpleNamespace

    from ftbench.sim.backend import SimBackend

    backend, kept = SimBackend(_ctx()), {}
    rng = random.Random("peaks")
    for _ in range(300):
        workers = rng.sample(range(40), rng.randint(1, 12))
        peaks = {w: rng.choice([0.0, -1.0, 1.0, 2.0, 3.5, rng.random()]) if rng.random() < 0.2 else 1.0 + rng.random()
                 for w in workers}
        backend.check_memory(None, SimpleNamespace(peak_memory_bytes=peaks, peak_activation_bytes=peaks))
        for w, peak in peaks.items():
            old = kept.get(w, 0.0)
            if peak > old:
                kept[w] = peak
            elif w not in kept:
                kept[w] = old
        assert list(backend.peak_memory().items()) == list(kept.items())


def test_the_workers_a_failure_takes_are_found_as_a_scan_finds_them():
    from types import SimpleNamespace

    from ftbench.cluster import Cluster
    from ftbench.loop import RunLoop

    rng = random.Random("dead-workers")
    for g in (1, 2, 4):
        cfg = compose("cluster.pp=4", "cluster.dp=4", f"cluster.gpus_per_node={g}", "cluster.nodes=20")
        cluster = Cluster.from_config(cfg.cluster)
        for _ in range(30):
            workers = rng.sample(range(cluster.workers), rng.randint(1, 16))
            odd = rng.random() < 0.3  # a plan that places workers elsewhere than the cluster would
            node_of = {w: rng.randrange(cluster.nodes) if odd else cluster.node_of(w) for w in workers}
            loop = SimpleNamespace(plan=SimpleNamespace(node_of=node_of), cluster=cluster)
            for node in range(cluster.nodes):
                assert RunLoop._workers_on(loop, node) == [w for w, n in node_of.items() if n == node]
