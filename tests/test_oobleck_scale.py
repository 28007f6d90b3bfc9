"""Oobleck at scale: each fast path gives exactly what its straightforward reference gives, on
small random cases. The batch split's fill (against handing out micro-batches one by one from
a heap), the re-instantiation rules (against their first, list-by-list form), plans of
heterogeneous pipelines held as templates (against one op list per worker), their timing
from one pipeline of each kind (against the simulator on the whole plan), the layers copied
after a re-instantiation (against ftbench.transfers.layer_copies), plans made from earlier
ones (against the same plans made afresh), and whole runs with the fast paths against runs on
the reference paths (plans, recoveries and metrics equal)."""
import random
import sys
from itertools import islice

import pytest

from conftest import compose, run
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.plan import pipelines_plan
from ftbench.planning.oobleck import (Template, Templates, Unrecoverable, grow, pipelines_layer_copies, reconfigure,
                                      split_batch, split_greedy, split_greedy_heap)
from ftbench.schedule import generate, grid_worker, read_ops
from ftbench.sim.pipelines import FIGURES, PipelinesTimer
from ftbench.sim.simulator import simulate
from ftbench.transfers import layer_copies


# -- batch split ----------------------------------------------------------------------------------
def _templates(rng, kinds: int) -> list[Template]:
    out = []
    for _ in range(kinds):
        # whole seconds often: slots of different templates then meet at the same time (ties)
        times = tuple(float(rng.randint(1, 4)) if rng.random() < 0.4 else rng.uniform(0.1, 3.0)
                      for _ in range(rng.randint(1, 6)))
        out.append(Template(len(times), tuple((i, i + 1) for i in range(len(times))), times))
        if rng.random() < 0.3:  # an equal template, another object
            out.append(Template(len(times), tuple((i, i + 1) for i in range(len(times))), times))
    return out


def test_the_fill_hands_out_what_the_heap_hands_out():
    rng = random.Random(27)
    for case in range(1500):
        kinds = _templates(rng, rng.randint(1, 5) if case % 100 else 90)  # (and now and then many distinct ones)
        templates = [rng.choice(kinds) for _ in range(rng.randint(1, 40) if case % 100 else 200)]
        microbatches = len(templates) + rng.randint(0, 300)
        assert split_greedy(templates, microbatches) == split_greedy_heap(templates, microbatches), case


# -- re-instantiation rules -------------------------------------------------------------------------
def _reference_reconfigure(pipelines, lost, n0, valid):
    """reconfigure as first written: every pipeline looked at, list by list."""
    kept = [[n for n in p if n not in lost] for p in pipelines]
    kept = [p for p in kept if p]
    if sum(map(len, kept)) < n0:
        raise Unrecoverable("too few")
    spare = []

    def shed(p):
        while len(p) > n0 and not valid(len(p)):
            spare.append(p.pop())
    for p in kept:
        shed(p)
    rule = "template"
    for short in [p for p in kept if len(p) < n0]:
        while len(short) < n0 and spare:
            short.append(spare.pop(0))
        while len(short) < n0:
            donors = [p for p in kept if len(p) > n0 and valid(len(p) - 1)]
            if not donors:
                break
            short.append(max(reversed(donors), key=len).pop())
            rule = "borrow"
    if any(len(p) < n0 for p in kept):
        from ftbench.planning.oobleck import _merge

        kept, rule = _merge(kept, n0), "merge"
        for p in kept:
            shed(p)
    return kept, rule, spare


def _reference_grow(pipelines, idle, n0, valid, most=None):
    pipelines = [list(p) for p in pipelines]
    idle = list(idle)
    while len(idle) >= n0 and (most is None or len(pipelines) < most):
        pipelines.append(idle[:n0])
        idle = idle[n0:]
    while idle:
        room = [p for p in pipelines if valid(len(p) + 1)]
        if not room:
            break
        min(room, key=len).append(idle.pop(0))
    return pipelines, idle


def test_the_rules_reconfigure_and_grow_as_first_written():
    rng = random.Random(5)
    for case in range(3000):
        n0 = rng.randint(1, 3)
        sizes = {n for n in range(n0, 9) if n == n0 or rng.random() < 0.7}
        valid = sizes.__contains__
        nodes = iter(rng.sample(range(200), 200))
        pipelines = [[next(nodes) for _ in range(rng.choice(sorted(sizes)))] for _ in range(rng.randint(1, 8))]
        before = [list(p) for p in pipelines]
        every = [n for p in pipelines for n in p]
        lost = set(rng.sample(every, rng.randint(1, min(4, len(every)))))
        try:
            expected = _reference_reconfigure(before, lost, n0, valid)
        except Unrecoverable:
            with pytest.raises(Unrecoverable):
                reconfigure(pipelines, lost, n0, valid)
            continue
        assert reconfigure(pipelines, lost, n0, valid) == expected, case
        assert pipelines == before  # the pipelines given are not changed
        idle = [next(nodes) for _ in range(rng.randint(0, 5))]
        most = rng.choice([None, len(expected[0]) + 1])
        assert grow(expected[0], idle, n0, valid, most) == _reference_grow(expected[0], idle, n0, valid, most), case


# -- plans ------------------------------------------------------------------------------------------
def _random_plan(ctx, rng, gpus: int, stage_per: str):
    """A plan of a few pipelines of random template sizes on shuffled nodes, the batch split."""
    templates = Templates(ctx.cost_model, gpus, stage_per)
    n0 = templates.n0()
    sizes = [n for n in range(n0, min(templates.longest, n0 + 5) + 1) if templates.get(n) is not None]
    combo = [rng.choice(sizes) for _ in range(rng.randint(1, 7))]
    nodes = iter(rng.sample(range(sum(combo) + 6), sum(combo)))
    lanes = templates.lanes_of(combo)
    counts = split_batch(lanes, len(lanes) + rng.randint(0, 12), "greedy")
    specs = []
    for n in combo:
        on = [list(range(node * gpus, (node + 1) * gpus)) for node in islice(nodes, n)]
        lists = [[w for gpu in on for w in gpu]] if templates.lanes == 1 else \
            [[gpu[lane] for gpu in on] for lane in range(templates.lanes)]
        for workers in lists:
            specs.append((workers, lanes[len(specs)].partition, counts[len(specs)]))
    return pipelines_plan(ctx.schedule_name, specs, lambda w: w // gpus), specs


def _ctx(*overrides):
    return RunContext.from_config(compose("backend=sim", "strategy=oobleck", "model=gpt3-6.7b", "hardware=a100-80gb",
                                          "train.microbatches=4", *overrides))


def test_a_pipelines_plan_holds_each_workers_ops_as_one_list_per_worker_would():
    ctx = _ctx("cluster.gpus_per_node=2")
    rng = random.Random(3)
    for case in range(20):
        plan, specs = _random_plan(ctx, rng, 2, rng.choice(["node", "gpu"]))
        ops, holds, node_of = {}, {}, {}
        for d, (workers, cut, count) in enumerate(specs):
            one = generate(ctx.schedule_name, len(cut), count)
            for s, w in enumerate(workers):
                ops[w] = [op._replace(pipeline=d) for op in read_ops(one)(grid_worker(0, s, len(cut)))]
                holds[w], node_of[w] = ((d, s),), w // 2
        assert {w: plan.schedule.ops.read(w) for w in plan.schedule.ops} == ops, case
        assert list(plan.schedule.ops) == list(ops) and plan.holds == holds and plan.node_of == node_of
        assert plan.partition == tuple(cut for _, cut, _ in specs)
        assert plan.schedule.microbatches == tuple(count for *_, count in specs)
    with pytest.raises(ValueError, match="worker 1 is in two pipelines"):
        pipelines_plan("1f1b", [([0, 1], ((0, 1), (1, 2)), 2), ([1, 2], ((0, 1), (1, 2)), 2)], lambda w: w)


@pytest.mark.parametrize("gpus,overrides", [
    (1, ()),
    (2, ("train.overlap_grad_reduce=true",)),
    (1, ("schedule=zb-h1", "train.recompute=full", "train.overlap_grad_reduce=true")),
    (2, ("schedule=gpipe",)),
], ids=["1f1b", "overlap", "zb-h1", "gpipe"])
def test_pipelines_timed_by_kind_as_the_simulator_times_the_whole_plan(gpus, overrides):
    ctx = _ctx(f"cluster.gpus_per_node={gpus}", *overrides)
    rng = random.Random(len(overrides) + gpus)
    timer = PipelinesTimer(ctx.cost_model)
    for case in range(12):
        plan, _ = _random_plan(ctx, rng, gpus, rng.choice(["node", "gpu"]))
        expected = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
        got = timer(plan)
        assert got.iteration_time == expected.iteration_time, case
        for figure in FIGURES:
            assert list(getattr(got, figure).items()) == list(getattr(expected, figure).items()), (case, figure)
        assert got.bubble_fraction() == expected.bubble_fraction()
    assert got.ops == expected.ops  # rows from the whole plan, when read


# -- copies -----------------------------------------------------------------------------------------
def test_the_layers_copied_are_those_layer_copies_finds():
    """Random plans before and after: pipelines kept, re-cut, borrowed from, merged and added,
    nodes lost (down to one holder of a layer, and none: orphaned units)."""
    ctx = _ctx("cluster.gpus_per_node=1")
    templates = Templates(ctx.cost_model, 1, "node")
    sizes = [n for n in range(templates.n0(), 8) if templates.get(n) is not None]
    rng = random.Random(11)
    fast = 0
    for case in range(150):
        nodes = rng.sample(range(60), 60)
        old, at = [], 0
        for _ in range(rng.randint(1, 5)):
            n = rng.choice(sizes)
            old.append(nodes[at:at + n])
            at += n
        dead = set(rng.sample(nodes[:at], rng.randint(0, min(at, 6))))
        new = []
        for p in old:
            kept = [x for x in p if x not in dead]
            if rng.random() < 0.5 and len(kept) in sizes:
                new.append(kept if rng.random() < 0.7 else kept[::-1])
        spare = nodes[at:]
        while rng.random() < 0.6 and len(spare) >= sizes[-1]:
            n = rng.choice(sizes)
            new.append(spare[:n])
            spare = spare[n:]
        if not new:
            new.append(spare[:sizes[0]])
        old_plan, new_plan = (pipelines_plan("1f1b", [(p, templates.get(len(p)).partition, 2) for p in pipes],
                                             lambda w: w) for pipes in (old, new))
        alive = frozenset(range(60)) - dead
        got = pipelines_layer_copies(old_plan, new_plan, alive, ctx.cost_model)
        expected = layer_copies(old_plan, new_plan, alive.__contains__, ctx.cost_model)
        assert got == expected, case
        fast += bool(got[0])
    assert fast > 50
    # a plan not built by pipelines_plan: the caller's layer_copies it is
    from ftbench.plan import grid_plan

    grid = grid_plan(generate("1f1b", 2, 2, 2), ((0, 16), (16, 32)), 2, 1)
    assert pipelines_layer_copies(grid, grid, frozenset(range(4)), ctx.cost_model) is None


# -- plans made from earlier ones ----------------------------------------------------------------------
def test_plans_made_from_earlier_ones_are_those_made_afresh():
    """A chain of plans as Oobleck makes them after failures (a pipeline loses a node and takes
    the template of its new size, micro-batch counts move, now and then a node moves between
    pipelines): each made from the one before (`like`) has the tables of the same plan made
    afresh, in the same order; the timer (which then updates its kinds and figures for the
    changed pipelines) gives what the simulator gives, and the layers copied are those
    layer_copies finds."""
    ctx = _ctx("cluster.gpus_per_node=1", "train.overlap_grad_reduce=true")
    templates = Templates(ctx.cost_model, 1, "node")
    sizes = [n for n in range(templates.n0(), 9) if templates.get(n) is not None]
    rng = random.Random(8)
    nodes = iter(rng.sample(range(400), 400))
    pipelines = [[next(nodes) for _ in range(rng.choice(sizes))] for _ in range(12)]
    counts = [rng.randint(1, 4) for _ in pipelines]
    timer = PipelinesTimer(ctx.cost_model)
    alive = set(range(400))
    made = derived = 0

    def build(like=None):
        specs = [(p, templates.get(len(p)).partition, c) for p, c in zip(pipelines, counts)]
        return pipelines_plan("1f1b", specs, lambda w: w, name="chain", like=like)

    plan = build()
    for step in range(60):
        d = rng.randrange(len(pipelines))
        if rng.random() < 0.15 and len(pipelines[d]) > sizes[0]:  # a node moves to the next pipeline
            pipelines[(d + 1) % len(pipelines)] = pipelines[(d + 1) % len(pipelines)] + [pipelines[d][-1]]
            pipelines[d] = pipelines[d][:-1]
        elif len(pipelines[d]) > sizes[0]:  # a node fails
            lost = rng.choice(pipelines[d])
            alive.discard(lost)
            pipelines[d] = [n for n in pipelines[d] if n != lost]
        for i in rng.sample(range(len(counts)), 3):
            counts[i] = max(1, counts[i] + rng.choice([-1, 1]))
        if any(templates.get(len(p)) is None for p in pipelines):
            break
        new, afresh = build(like=plan), build()
        derived += new.pipelines().parent is not None
        assert list(new.schedule.ops.of.items()) == list(afresh.schedule.ops.of.items()), step
        assert list(new.holds.items()) == list(afresh.holds.items()), step
        assert list(new.node_of.items()) == list(afresh.node_of.items()), step
        assert new.pipelines().workers == afresh.pipelines().workers and new.key() == afresh.key(), step
        got, expected = timer(new), simulate(new.schedule, PlanCosts(ctx.cost_model, new))
        assert timer.covered(new), step
        assert got.iteration_time == expected.iteration_time, step
        for figure in FIGURES:
            assert list(getattr(got, figure).items()) == list(getattr(expected, figure).items()), (step, figure)
        frozen = frozenset(alive)
        assert pipelines_layer_copies(plan, new, frozen, ctx.cost_model) == \
            layer_copies(plan, new, lambda w: w in frozen, ctx.cost_model), step
        plan, made = new, made + 1
    assert made > 40 and derived > 30


# -- whole runs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    ("cluster.gpus_per_node=1", "cluster.dp=8", "failures.mtbf_hours=200", "failures.repair_hours=20"),
    ("cluster.gpus_per_node=2", "cluster.dp=8", "strategy.stage_per=gpu", "failures.mtbf_hours=150",
     "failures.repair_hours=30"),
    ("cluster.gpus_per_node=4", "cluster.dp=16", "train.overlap_grad_reduce=true", "failures.mtbf_hours=300"),
], ids=["one-gpu", "stage-per-gpu", "lanes-overlap"])
def test_runs_on_the_fast_paths_compute_what_the_reference_paths_compute(tmp_path, monkeypatch, overrides):
    """The same run twice: as it runs (plans timed by kind, copies from the pipelines that
    changed), and with the simulator on every whole plan (backend.memoize=false) and
    layer_copies on every pair of plans."""
    setup = ("backend=sim", "strategy=oobleck", "experiment=sim-6.7b-1024gpu", "train.max_hours=200", *overrides)
    fast = run(tmp_path / "fast", *setup)
    from ftbench.strategies import REGISTRY

    strategy = sys.modules[REGISTRY["oobleck"].__module__]
    monkeypatch.setattr(strategy, "pipelines_layer_copies", lambda *args: None)
    reference = run(tmp_path / "reference", *setup, "backend.memoize=false")
    assert fast["status"] == "ok" and fast["failures"] > 3
    for key in ("iterations", "time_s", "throughput", "productive_s", "failures", "recoveries", "plan_segments",
                "lost_iterations", "final_shape", "iteration_time_s", "bubble_fraction", "peak_memory_bytes"):
        assert fast[key] == reference[key], key
