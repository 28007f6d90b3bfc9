"""Recovery actions are complete: every action type has a cost and every backend performs it;
state copies name their layers, source, destination and bytes, and independent copies
overlap while copies sharing a link add up."""
import dataclasses

import pytest

from conftest import LOCAL, compose
from ftbench.actions import ACTIONS, FILE, MEMORY, RestoreCheckpoint, SyncFromPeers, Transfer
from ftbench.context import RunContext
from ftbench.engine.backend import LocalBackend
from ftbench.recovery_costs import action_seconds
from ftbench.assembly.local_engine import local_engine
from ftbench.sim.backend import SimBackend
from ftbench.transfers import peer_copies, transfer_seconds
from ftbench.strategies import build_strategy


def _instances(plan, ctx):
    """One instance of every action type (fields filled with something valid)."""
    copies = peer_copies(plan, plan, lambda w: True, ctx.cost_model)
    out = []
    for cls in ACTIONS:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "nodes":
                kwargs[f.name] = (0,)
            elif f.name == "seconds":
                kwargs[f.name] = 0.0
            elif f.name == "workers":
                kwargs[f.name] = (0,)
            elif f.name in ("since", "until"):
                kwargs[f.name] = 0
            elif f.name == "copies":
                kwargs[f.name] = copies
        out.append(cls(**kwargs))
    return out


def test_every_action_has_a_cost_and_every_backend_performs_it(tmp_path):
    cfg = compose(*LOCAL, "strategy=checkpoint", "strategy.every=1")
    ctx = RunContext.from_config(cfg)
    plan = ctx.grid_plan(4, 2)
    actions = _instances(plan, ctx)
    assert {type(a) for a in actions} == set(ACTIONS)
    for action in actions:
        assert action_seconds(action, plan, plan, ctx.cost_model) >= 0.0
    sim = SimBackend(ctx)
    sim.start(plan)
    local = LocalBackend(local_engine(cfg, ctx, build_strategy(cfg.strategy, ctx), tmp_path), realtime=False)
    local.start(plan)
    for backend in (sim, local):
        backend.save(plan, 0, FILE)
        backend.save(plan, 0, MEMORY)
        for action in actions:  # raises TypeError for an action the backend does not know
            backend.perform([action], plan, plan, 0)


def test_copies_name_layers_source_destination_and_bytes():
    ctx = RunContext.from_config(compose(*LOCAL))
    old, new = ctx.grid_plan(4, 1), ctx.grid_plan(4, 2)  # pipeline 1 joins: workers 4..7 need stages 0..3
    copies = peer_copies(old, new, lambda w: True, ctx.cost_model)
    assert [(c.src, c.dst) for c in copies] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert copies[0].embedding and not copies[0].head and copies[3].head
    assert [c.layers for c in copies] == list(ctx.cost_model.balanced_partition(4))
    assert all(c.nbytes == 12 * ctx.cost_model.stage(c.layers, c.embedding, c.head).params for c in copies)


def test_independent_copies_overlap_and_shared_links_add_up():
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", "hardware=a100-80gb"))
    hw = ctx.hardware
    nbytes = 1e9
    node_of = {w: w for w in range(8)}.__getitem__  # one GPU per node
    one = transfer_seconds([Transfer((0, 1), False, False, 0, 4, nbytes)], node_of, ctx.cost_model)
    disjoint = transfer_seconds([Transfer((0, 1), False, False, 0, 4, nbytes),
                                 Transfer((1, 2), False, False, 1, 5, nbytes)], node_of, ctx.cost_model)
    same_source = transfer_seconds([Transfer((0, 1), False, False, 0, 4, nbytes),
                                    Transfer((0, 1), False, False, 0, 5, nbytes)], node_of, ctx.cost_model)
    latency = hw.link_latency_us * 1e-6
    assert one == pytest.approx(latency + nbytes / (hw.inter_node_gbps * 1e9))
    assert disjoint == pytest.approx(one)
    assert same_source - latency == pytest.approx(2 * (one - latency))
    # dependent actions add up: a memory restore's copies come after each worker's own copy back
    plan = ctx.grid_plan(4, 2)
    restore = action_seconds(RestoreCheckpoint(MEMORY), plan, plan, ctx.cost_model)
    copies = (Transfer((0, 1), False, False, 0, 4, nbytes),)
    assert action_seconds(RestoreCheckpoint(MEMORY, copies), plan, plan, ctx.cost_model) == pytest.approx(
        restore + transfer_seconds(copies, plan.node_of.__getitem__, ctx.cost_model))
    assert action_seconds(SyncFromPeers(copies), plan, plan, ctx.cost_model) == pytest.approx(
        transfer_seconds(copies, plan.node_of.__getitem__, ctx.cost_model))


def test_copies_spread_over_holders_as_the_plain_scan_would():
    """peer_copies picks each copy's source from a heap per layer range; on random reshapes
    it picks exactly what a scan for the least-sent holder (lowest id among equals) picks."""
    import random
    from collections import defaultdict

    from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM
    from ftbench.transfers import _replicas

    def scanned(old, new, alive, cost_model):
        before, after = _replicas(old), _replicas(new)
        holders = defaultdict(list)
        for w, replicas in before.items():
            if alive(w):
                for key in replicas:
                    holders[key].append(w)
        sent, out = defaultdict(float), []
        for w in sorted(after):
            for key, _ in sorted(after[w].items()):
                if (key in before.get(w, {}) and alive(w)) or not holders.get(key):
                    continue
                src = min(holders[key], key=lambda v: (sent[v], v))
                nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(*key).params
                sent[src] += nbytes
                out.append(Transfer(*key, src, w, nbytes))
        return tuple(out)

    ctx = RunContext.from_config(compose(*LOCAL))
    rng = random.Random("peer-copies")
    total = 0
    for _ in range(30):
        pp, dp = rng.choice((2, 4)), rng.randint(2, 6)
        old = ctx.grid_plan(pp, dp)
        dead = set(rng.sample(range(pp * dp), rng.randint(1, pp)))
        survivors = [w for w in range(pp * dp + 4) if w not in dead]
        rng.shuffle(survivors)
        new = ctx.grid_plan(pp, dp - 1).on_workers(survivors, lambda w: w)
        alive = lambda w: w not in dead  # noqa: E731
        copies = peer_copies(old, new, alive, ctx.cost_model)
        assert copies == scanned(old, new, alive, ctx.cost_model)
        total += len(copies)
    assert total > 100  # sources chosen among several holders, again and again


def test_one_table_dispatches_every_action_on_local_and_dist():
    """local and dist perform recovery actions through one table (ftbench.actions.PERFORMERS):
    it names every action, each backend defines every method it names, and an action outside
    it is refused with the backend's name."""
    from ftbench.actions import PERFORMERS, performer
    from ftbench.distributed.backend import DistBackend

    assert set(PERFORMERS) == set(ACTIONS)
    for backend in (LocalBackend, DistBackend):
        for method in PERFORMERS.values():
            assert callable(getattr(backend, method, None)), (backend.__name__, method)

    class Unknown:
        pass

    with pytest.raises(TypeError, match="the dist backend cannot perform"):
        performer(object(), Unknown(), "dist")
