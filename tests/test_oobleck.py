"""Oobleck: templates cover every live-node count, instantiation uses every live node with at
least f+1 pipelines and keeps the global batch, the batch split is optimal, the paper's
re-instantiation rules (borrow, merge), and heterogeneous pipelines with different cuts that
train exactly what fault-free training trains across a borrow, a merge, a join and seeded
random failures."""
import itertools
import random

import pytest

from conftest import LOCAL, assert_matches_fault_free, compose, run, seeded_failures
from ftbench.context import RunContext
from ftbench.planning.oobleck import (Template, Templates, Unrecoverable, instantiate, reconfigure, slowest,
                                      split_greedy, split_milp, stage_bytes, uncovered)

# gpt-tiny with 6 MB GPUs: a pipeline needs 2 nodes (n0 = 2), and templates cut the layers
# differently (2 nodes: 4 + 4 blocks, 3 nodes: 3 + 3 + 2, ...). 8 nodes: 4 pipelines of 2.
SETUP = ("strategy=oobleck", "hardware.memory_gb=0.006", "cluster.pp=2", "cluster.dp=4")


def _ctx(*overrides):
    return RunContext.from_config(compose(*LOCAL, *SETUP, *overrides))


# -- templates and coverage ---------------------------------------------------------------------
def _brute_covered(sizes, f, m) -> bool:
    for k in range(f + 1, m // min(sizes) + 1):
        if any(sum(c) == m for c in itertools.combinations_with_replacement(sizes, k)):
            return True
    return False


def test_templates_from_n0_to_n_max_cover_every_live_count():
    """Templates for n0 .. N - f*n0 let every count from (f+1)*n0 to N form f+1 or more pipelines."""
    for nodes in range(2, 41):
        for f in range(4):
            for n0 in range(1, 7):
                if (f + 1) * n0 > nodes:
                    continue
                sizes = range(n0, nodes - f * n0 + 1)
                assert uncovered(sizes, f, (f + 1) * n0, nodes) == [], (nodes, f, n0)


def test_uncovered_counts_agree_with_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        sizes = sorted(rng.sample(range(1, 9), rng.randint(1, 3)))
        f, top = rng.randint(0, 2), rng.randint(1, 20)
        expected = [m for m in range(1, top + 1) if not _brute_covered(sizes, f, m)]
        assert uncovered(sizes, f, 1, top) == expected, (sizes, f, top)


def test_a_template_is_the_best_cut_that_fits_in_memory():
    ctx = _ctx()
    t = Templates(ctx.cost_model, 1)
    L, memory = ctx.spec.layers, ctx.cost_model.memory_bytes
    assert t.n0() == 2 and t.get(1) is None  # the whole model does not fit on one 6 MB GPU

    def stage_s(r, k, S):
        c = ctx.cost_model.stage(r, k == 0, k == S - 1)
        return c.forward_s + c.backward_input_s + c.backward_weight_s

    for S in range(2, 6):
        best = None
        for cuts in itertools.combinations(range(1, L), S - 1):
            bounds = (0, *cuts, L)
            ranges = [(bounds[k], bounds[k + 1]) for k in range(S)]
            if any(stage_bytes(ctx.cost_model, r, k, S) > memory for k, r in enumerate(ranges)):
                continue
            times = [stage_s(r, k, S) for k, r in enumerate(ranges)]
            value = (max(times), sum(times))
            best = value if best is None or value < best else best
        template = t.get(S)
        assert (max(template.stage_s), sum(template.stage_s)) == pytest.approx(best, rel=1e-12)
        assert all(stage_bytes(ctx.cost_model, r, k, S) <= memory for k, r in enumerate(template.partition))


# -- instantiation and batch split ------------------------------------------------------------
@pytest.mark.parametrize("model,hardware,gpus", [("gpt3-6.7b", "a100-40gb", 4), ("gpt3-medium", "v100-16gb", 1)])
def test_instantiation_uses_every_live_node_and_keeps_the_global_batch(model, hardware, gpus):
    cfg = compose("backend=sim", f"model={model}", f"hardware={hardware}")
    ctx = RunContext.from_config(cfg)
    t = Templates(ctx.cost_model, gpus)
    n0, f, N, microbatches = t.n0(), 1, 30, 128
    sizes = [n for n in range(n0, min(N - f * n0, t.longest) + 1) if t.get(n)]
    for live in range((f + 1) * n0, N + 1):
        chosen, counts = instantiate(t, sizes, live, f, microbatches)
        assert sum(chosen) == live and len(chosen) >= f + 1
        assert sum(counts) == microbatches and min(counts) >= 1
        assert all(n in sizes for n in chosen)


def _random_templates(rng, k):
    kinds = [Template(n, tuple((i, i + 1) for i in range(n)), tuple(rng.uniform(0.5, 2.0) for _ in range(n)))
             for n in range(1, 4)]
    return [rng.choice(kinds) for _ in range(k)]


def test_the_batch_split_is_optimal():
    """The greedy fill and the MILP reach the same slowest pipeline, that of brute force."""
    rng = random.Random(1)
    for case in range(40):
        k = rng.randint(1, 4)
        templates = sorted(_random_templates(rng, k), key=lambda t: t.nodes)
        m = rng.randint(k, 9)
        brute = min(slowest(templates, c) for c in itertools.product(range(1, m + 1), repeat=k) if sum(c) == m)
        greedy, milp = split_greedy(templates, m), split_milp(templates, m)
        assert sum(greedy) == sum(milp) == m
        assert slowest(templates, greedy) == pytest.approx(brute, rel=1e-12), case
        assert slowest(templates, milp) == pytest.approx(brute, rel=1e-9), case


# -- re-instantiation rules ---------------------------------------------------------------------
def test_a_short_pipeline_borrows_from_the_largest():
    pipelines = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
    after, rule, idle = reconfigure(pipelines, {1, 3, 4}, n0=2, valid=lambda n: 2 <= n <= 8)
    assert rule == "borrow" and idle == []
    assert sorted(map(sorted, after)) == [[0, 13], [2, 12], [5, 6, 7, 8], [9, 10, 11]]


def test_short_pipelines_merge_and_the_last_absorbs_a_whole_one():
    after, rule, _ = reconfigure([[0, 1], [4, 5], [8, 9], [12, 13]], {1, 5, 9}, n0=2, valid=lambda n: 2 <= n <= 8)
    assert rule == "merge"
    assert sorted(map(sorted, after)) == [[0, 4], [8, 12, 13]]


def test_too_few_nodes_for_a_pipeline_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="fewer than one pipeline"):
        reconfigure([[0, 1, 2]], {0, 1}, n0=2, valid=lambda n: n >= 2)
    # A merge may give a size with no template: it sheds back to n0 (which has one).
    after, rule, idle = reconfigure([[0, 1], [2, 3]], {3}, n0=2, valid=lambda n: n == 2)
    assert (after, rule, idle) == ([[2, 0]], "merge", [1])


def test_a_size_memory_rules_out_sheds_nodes_to_one_that_fits():
    """Sizes 2 and 4 have templates, 3 not (a longer pipeline stashes more micro-batches on
    its first stage): a 4-node pipeline losing one keeps 2 nodes and the third waits idle."""
    after, rule, idle = reconfigure([[0, 1, 2, 3], [4, 5, 6, 7]], {0}, n0=2, valid=lambda n: n in (2, 4))
    assert (after, rule, idle) == ([[1, 2], [4, 5, 6, 7]], "template", [3])


# -- training ---------------------------------------------------------------------------------------
def _rules(summary) -> list[str]:
    return [r["plan"].split(" after ")[-1] for r in summary["recoveries"]]


@pytest.mark.parametrize("events,rules", [
    ("[{iteration:2,node:1}]", ["merge"]),
    ("[{iteration:2,node:1},{iteration:4,node:5}]", ["merge", "borrow"]),
    ("[{iteration:2,node:6},{iteration:5,node:6,kind:join}]", ["merge", "join"]),
], ids=["merge", "borrow", "join"])
def test_heterogeneous_pipelines_train_the_fault_free_model(tmp_path, events, rules):
    summary = assert_matches_fault_free(tmp_path, setup=SETUP, faults=(f"failures.events={events}",))
    assert _rules(summary) == rules
    first = summary["recoveries"][0]
    assert first["actions"] == ["Rendezvous", "SyncFromPeers"] and first["lost_iterations"] == 0
    assert any(c["layers"] for c in first["copies"])  # layers moved between pipelines cut differently


def test_one_stage_per_node_shared_by_its_gpus_trains_the_fault_free_model(tmp_path):
    """strategy.stage_per=node: a node holds one stage and its 2 GPUs run it as lanes, each on
    its own micro-batches; a merge and a borrow later, still fault-free training."""
    setup = ("hardware.memory_gb=0.006", "cluster.pp=2", "cluster.dp=6", "cluster.gpus_per_node=2",
             "train.microbatches=2")
    summary = assert_matches_fault_free(tmp_path, setup=setup, faults=(
        "strategy=oobleck", "strategy.stage_per=node", "failures.events=[{iteration:2,node:1},{iteration:4,node:4}]"))
    assert _rules(summary) == ["merge", "borrow"]
    # 2 + 3 nodes after the merge: two lanes of 2 stages and two lanes of 3.
    assert summary["recoveries"][0]["shape"] == "pp=2/2/3/3 dp=4"


@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_random_failures_train_the_fault_free_model(tmp_path, seed):
    summary = assert_matches_fault_free(tmp_path, setup=SETUP, faults=(seeded_failures(f"oobleck-{seed}", 8, 2),))
    assert summary["failures"] == 2


@pytest.mark.dist
@pytest.mark.parametrize("events,rules,dead", [
    # `full` (with tests/test_dist_failures.py's merge-then-borrow against sim): CI runs the
    # merge with this test's fault-free check in the join case below (the extended tier), and
    # the borrow on local above
    pytest.param("[{iteration:2,node:1},{iteration:4,node:4}]", ["merge", "borrow"], [[1], [4]],
                 marks=pytest.mark.full),
    # node 1 returns: its processes are a standby node's (ranks 6 or 7), started for the join
    ("[{iteration:2,node:1},{iteration:4,node:1,kind:join}]", ["merge", "join"], [[1], None]),
], ids=["merge-then-borrow", "join"])
def test_dist_processes_reinstantiate_after_real_kills(tmp_path, events, rules, dead):
    """backend=dist: the failed nodes' processes are SIGKILLed; the survivors re-instantiate
    (merge short pipelines, borrow a node), copy the layers each lacks from live holders over
    torch.distributed, and train exactly what fault-free training trains (the run's own check)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_dist_failures import run_dist

    setup = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=3", "train.iterations=6", "train.microbatches=2",
             "report.gantt=false", "report.progress=false", "backend.timeout_s=30", *SETUP[:2])
    summary, lines = run_dist(tmp_path, f"failures.events={events}", setup=setup)
    assert summary["matches_fault_free"] is True
    assert _rules(summary) == rules
    assert [m.get("dead_ranks") for m in summary["measured_recoveries"]] == dead  # a join kills nobody
    assert [r["event"] for r in lines].count("iteration") == 6


def test_fewer_nodes_than_f_plus_one_pipelines_is_unrecoverable(tmp_path):
    summary = run(tmp_path, *LOCAL, "strategy=oobleck", "hardware.memory_gb=0.006", "cluster.pp=2", "cluster.dp=2",
                  "failures.events=[{iteration:2,node:3}]")
    assert summary["status"] == "unrecoverable" and "(f+1)*n0 = 4" in summary["error"]


@pytest.mark.parametrize("override,message", [
    ("strategy.f=-1", "must be 0 or more"),
    ("strategy.f=5", "cannot form f+1 = 6 pipelines"),
    ("strategy.batch_split=exact", "unknown split 'exact'"),
    ("strategy.stage_per=rack", "unknown choice 'rack'"),
    ("strategy.min_nodes=0", "at least 1 node"),
])
def test_bad_settings_name_the_setting(tmp_path, override, message):
    summary = run(tmp_path, "backend=sim", "model=gpt-tiny", "strategy=oobleck", "cluster.pp=1", "cluster.dp=4", override)
    assert summary["status"] == "error" and message in summary["error"], summary["error"]
    assert override.split("=")[0] in summary["error"]


def test_min_nodes_keeps_every_pipeline_at_least_that_deep(tmp_path):
    """strategy.min_nodes raises n0: gpt-tiny fits on one node, so Oobleck alone runs 8 pipelines
    of 1 node; held to depth 2 it runs 4 of 2, also after a failure (a short one borrows)."""
    free = run(tmp_path / "free", "backend=sim", "model=gpt-tiny", "strategy=oobleck", "cluster.pp=2",
               "cluster.dp=4", "failures=none")
    assert free["final_shape"].startswith("pp=1 ")
    held = run(tmp_path / "held", "backend=sim", "model=gpt-tiny", "strategy=oobleck", "cluster.pp=2",
               "cluster.dp=4", "strategy.min_nodes=2", "failures=scripted", "failures.events=[{iteration:3,node:1}]")
    assert held["status"] == "ok", held["error"]
    depths = [segment["shape"] for segment in held["plan_segments"]]
    assert all("pp=1 " not in shape for shape in depths), depths
