"""The shortcuts ReCycle's runs at scale take (issue 37 item 6), each against the slow path it
replaces: whole-pipeline plans' tables patched from the last failure set's, the peaks of plans
renamed from a reference folded without a pass over their workers, the coverage check of
bound parts, their key's flows and replica holds packed in bulk, and a stored plan freed
without the cyclic collector. No timing asserts: speed is
benchmarks/sim_scale.py's business."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from conftest import compose
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.failures import FailureEvent
from ftbench.planning.whole import WholeRenamings
from ftbench.schedule import GridOps, PartFlows, Schedule, key_bytes, part_coverage_problems, parts_cover
from ftbench.sim.backend import SimBackend
from ftbench.sim.cache import RenamedResult, SimCache
from ftbench.strategies import build_strategy


def _strategy(pp=4, dp=8, *extra):
    cfg = compose("backend=sim", "model=gpt3-medium", "strategy=recycle", "strategy.plan_cache=null",
                  "strategy.whole_above_ops=1", f"cluster.pp={pp}", f"cluster.dp={dp}", "train.microbatches=8", *extra)
    ctx, cluster = RunContext.from_config(cfg), Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    strategy.plan(cluster)
    assert strategy.whole
    return strategy, ctx, cluster


def _events(seed, cluster, strategy, count=14):
    """(plan, recovery) after each of `count` seeded failures and rejoins."""
    rng, down = random.Random(seed), []
    for _ in range(count):
        if down and rng.random() < 0.25:
            node = down.pop(rng.randrange(len(down)))
            cluster.join(node)
            recovery = strategy.on_event(FailureEvent(node, iteration=1, kind="join"), cluster, 1)
        else:
            node = rng.choice([n for n in range(cluster.nodes) if n not in down])
            cluster.fail(node)
            recovery = strategy.on_event(FailureEvent(node, iteration=1), cluster, 1)
            if recovery.unrecoverable:
                return
            down.append(node)
        yield recovery.plan or strategy.current


def _tables_as_built(reference, failed, most):
    """The renamed plan's tables as ReCycle built them before ftbench.planning.whole, pass by
    pass (the slow path)."""
    ops, holds, node_of = reference.schedule.ops, reference.holds, reference.node_of
    pp = reference.schedule.stages[0]
    down = {}
    for d, s in failed:
        down.setdefault(s, []).append(d)
    renamed, owners, absent = {}, {}, set()
    for s, lost_here in down.items():
        absent.update(d * pp + s for d in lost_here)
        lost = set(lost_here)
        free = [i for i in range(most) if i not in lost]
        beyond = sorted(d for d in lost_here if d >= most)
        for i, d in zip(free, beyond):
            renamed[i * pp + s], owners[i * pp + s] = d * pp + s, d
    of = dict(ops.of)
    of.update((w, ops.of[r]) for w, r in renamed.items())
    holds = dict(holds)
    holds.update((w, holds[r]) for w, r in renamed.items())
    node_of = dict(node_of)
    for w in absent:
        del of[w], holds[w], node_of[w]
    return renamed, owners, absent, of, holds, node_of


@pytest.mark.parametrize("seed", range(8))
def test_whole_tables_patched_from_the_last_set_are_those_built_afresh(seed):
    rng = random.Random(seed)
    pp, dp = rng.choice([(4, 8), (2, 12), (8, 6)])
    strategy, _, _ = _strategy(pp, dp)
    most = rng.randint(1, dp // 2)
    from ftbench.planning.problem import canonical_failed
    stored = strategy.library.get(tuple([tuple(range(pp))] * most + [()] * (dp - most)))
    assert canonical_failed(stored.form) == {(d, s) for d in range(most) for s in range(pp)}
    reference = strategy._reference(stored, most).plan
    renamings = WholeRenamings(reference.schedule.ops.of, reference.holds, reference.node_of, pp, most)
    failed = set()
    for _ in range(25):
        # grow mostly (the tables are patched), now and then shrink (built afresh); at most `most` a stage
        if failed and rng.random() < 0.2:
            failed.discard(rng.choice(sorted(failed)))
        else:
            s = rng.randrange(pp)
            alive = [d for d in range(dp) if (d, s) not in failed]
            if sum(1 for _, st in failed if st == s) < most and alive:
                failed.add((rng.choice(alive), s))
        got = renamings.tables(set(failed))
        renamed, owners, absent, of, holds, node_of = _tables_as_built(reference, failed, most)
        assert got.renamed == renamed and got.owners == owners and got.absent == absent
        # entry for entry, in the same order
        assert list(got.of.items()) == list(of.items())
        assert list(got.holds.items()) == list(holds.items())
        assert list(got.node_of.items()) == list(node_of.items())


class _Plain:
    """A result's per-worker peaks as plain dicts (the backend's per-worker path)."""

    def __init__(self, result):
        self.peak_memory_bytes = dict(result.peak_memory_bytes)
        self.peak_activation_bytes = dict(result.peak_activation_bytes)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tight", [False, True])
def test_renamed_plans_peaks_fold_as_worker_by_worker(seed, tight):
    strategy, ctx, cluster = _strategy()
    cache = SimCache(ctx.cost_model)
    first = cache(strategy.current)
    memory = ctx.cost_model.memory_bytes
    if tight:  # some plans do not fit: the per-worker path finds the worker and says so
        memory = sorted(first.peak_memory_bytes.values())[len(first.peak_memory_bytes) // 2] * 1.0001
    fake = SimpleNamespace(cost_model=SimpleNamespace(memory_bytes=memory), hardware=SimpleNamespace(name="tiny", memory_gb=1))
    fast, slow = SimBackend(fake), SimBackend(fake)
    assert fast.check_memory(strategy.current, first) == slow.check_memory(strategy.current, _Plain(first))
    renamed = 0
    for plan in _events(seed, cluster, strategy):
        result = cache(plan)
        renamed += isinstance(result, RenamedResult)
        assert fast.check_memory(plan, result) == slow.check_memory(plan, _Plain(result))
        assert list(fast.peak_memory().items()) == list(slow.peak_memory().items())
    assert renamed


def _whole_plans(seed):
    strategy, _, cluster = _strategy()
    return [plan for plan in _events(seed, cluster, strategy) if plan.schedule.ops.parts() is not None]


def _broken(schedule, parts, rng):
    """`parts` with one thing changed at random (a part dropped or doubled, flows moved, a
    pipeline out of range, a micro-batch dropped, doubled or out of range)."""
    parts = list(parts)
    i = rng.randrange(len(parts))
    flows, members = parts[i]
    pipes, mbs = list(flows.pipelines), [list(ks) for ks in flows.microbatches]
    change = rng.randrange(9)
    if change == 0:
        del parts[i]
        return parts
    if change == 1:
        return parts + [parts[i]]
    if change == 2:
        pipes[rng.randrange(len(pipes))] = rng.choice([-1, len(schedule.stages), rng.randrange(len(schedule.stages))])
    elif change == 3:
        p = rng.randrange(len(mbs))
        if mbs[p]:
            mbs[p].pop(rng.randrange(len(mbs[p])))
    elif change == 4:
        p = rng.randrange(len(mbs))
        mbs[p].append(rng.choice([*mbs[p], 99, -1]) if mbs[p] else 0)
    elif change == 5:
        j, other = rng.randrange(len(parts)), parts[rng.randrange(len(parts))][0]
        parts[j] = (other, parts[j][1])
        return parts
    elif change == 6:
        pipes = pipes[::-1]
    elif change == 7:  # a micro-batch renamed (the part's shape unchanged)
        p = rng.randrange(len(mbs))
        if mbs[p]:
            mbs[p][rng.randrange(len(mbs[p]))] = rng.randrange(-1, 10)
    else:  # a pipeline traded with another part's
        j = rng.randrange(len(parts))
        other_flows, other_members = parts[j]
        if j != i and other_flows.pipelines:
            q, p = rng.randrange(len(other_flows.pipelines)), rng.randrange(len(pipes))
            others = list(other_flows.pipelines)
            pipes[p], others[q] = others[q], pipes[p]
            parts[j] = (PartFlows(tuple(others), other_flows.microbatches), other_members)
    parts[i] = (PartFlows(tuple(pipes), tuple(map(tuple, mbs))), members)
    return parts


@pytest.mark.parametrize("seed", range(4))
def test_the_bulk_coverage_check_agrees_with_the_problems_it_names(seed):
    rng = random.Random(seed)
    checked = broken = 0
    for plan in _whole_plans(seed):
        schedule = plan.schedule
        parts = schedule.ops.parts()
        assert parts_cover(schedule, parts) and not part_coverage_problems(schedule, parts)
        for _ in range(25):
            changed = _broken(schedule, parts, rng)
            problems = part_coverage_problems(schedule, changed)
            assert parts_cover(schedule, changed) == (not problems), problems
            checked += 1
            broken += bool(problems)
    assert checked and broken > checked // 2


def test_the_key_of_bound_parts_packs_their_flows_as_plain_tuples():
    for plan in _whole_plans(1)[:3]:
        schedule = plan.schedule
        ops = schedule.ops
        parts = ops.parts()
        plain = key_bytes(tuple((tuple(f.pipelines), tuple(map(tuple, f.microbatches))) for f, _ in parts))
        assert schedule.released is not None and schedule.key()[2][2] == plain
        # flows held in lists (not tuples) are converted, as before (one object per part, as a plan has)
        listed = {id(f): PartFlows(list(f.pipelines), [list(ks) for ks in f.microbatches]) for f, _ in parts}
        again = Schedule(GridOps(ops.templates, {w: (tid, listed[id(f)]) for w, (tid, f) in ops.of.items()}),
                         schedule.stages, schedule.microbatches, schedule.name)
        assert again.key()[2] == plain


def test_the_key_packs_replica_holds_as_the_general_path_does(monkeypatch):
    from ftbench import plan as plan_module

    strategy, _, cluster = _strategy()
    plans = list(_events(2, cluster, strategy, count=6))
    references = [ref.plan for ref in strategy._references.values()]
    assert references and all(plan_module._pack_replica_holds(plan.holds, plan.schedule.stages) is not None
                              for plan in references)  # (the shortcut is taken)
    for plan in references + plans:
        plan._key = None
    keys = [plan.key() for plan in references + plans]
    monkeypatch.setattr(plan_module, "_pack_replica_holds", lambda holds, stages: None)
    for plan in references + plans:
        plan._key = None
    assert [plan.key() for plan in references + plans] == keys


def test_a_stored_plan_is_freed_without_the_cyclic_collector():
    """A planned problem's parts (which hold the problem) are let go once planned: a plan of
    16,384 workers left in a reference cycle until the collector ran cost a tenth of a run."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        strategy, _, _ = _strategy()
        problems = [weakref.ref(shape.parent) for stored in strategy.library._plans.values() if stored.shaped
                    for shape, _, _ in stored.shaped]
        assert problems and all(ref() is not None for ref in problems)
        strategy.library._plans.clear()
        assert all(ref() is None for ref in problems)
    finally:
        if enabled:
            gc.enable()
