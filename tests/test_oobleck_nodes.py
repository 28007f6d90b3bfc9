"""Oobleck's throughput by live-node count on its Table 2 setup (GPT-3 Medium, 30 nodes x 4
GPUs, 816 samples = 102 micro-batches of 8, f = 1), fault-free, from the planner's own
estimate (instantiate + the batch split; no simulation): every lost node lowers the capacity
of the pipelines, the integer batch split never gets faster with fewer nodes, and (not yet,
issue 38 item 4) every lost node lowers throughput. docs/strategies/oobleck.md, "Throughput
by live nodes", has the cause and the numbers."""
import pytest

from conftest import compose
from ftbench.context import RunContext
from ftbench.planning.oobleck import Templates, candidate_sets, relaxed_time, instantiate, slowest, template_range

NODES = range(30, 14, -1)  # the Table 2 traces: 30 nodes down to 15
F = 1


@pytest.fixture(scope="module")
def table2():
    cfg = compose("+experiment=oobleck-table2", "model=gpt3-medium", "strategy=oobleck", "table.column=fault-free",
                  "failures=none", "failures.path=null", "failures.count=null", "calibrate.throughput=null")
    ctx = RunContext.from_config(cfg)
    templates = Templates(ctx.cost_model, cfg.cluster.gpus_per_node, "node")
    lo, hi = template_range(templates.n0(), cfg.cluster.nodes, F)
    sizes = tuple(n for n in range(lo, min(hi, templates.longest) + 1) if templates.get(n) is not None)
    return templates, sizes, ctx.global_batch // ctx.microbatch_size


def _estimated(table2, nodes: int) -> float:
    """The slowest pipeline (lane) of the plan instantiated over `nodes` live nodes."""
    templates, sizes, microbatches = table2
    combo, counts = instantiate(templates, sizes, nodes, F, microbatches)
    return slowest(templates.lanes_of(combo), counts)


def test_every_lost_node_lowers_the_pipelines_capacity(table2):
    """With the batch split in fractions, the best set of pipelines is slower with every lost
    node: each node adds capacity, whatever the integer split makes of it."""
    templates, sizes, microbatches = table2
    best = [min(relaxed_time(templates, combo, microbatches)
                for combo in candidate_sets(templates, sizes, n, F + 1, microbatches)) for n in NODES]
    assert all(a < b for a, b in zip(best, best[1:])), list(zip(NODES, best))


def test_the_estimated_iteration_never_gets_faster_with_a_lost_node(table2):
    times = [_estimated(table2, n) for n in NODES]
    assert all(a <= b for a, b in zip(times, times[1:])), list(zip(NODES, times))


@pytest.mark.xfail(strict=True, reason="issue 38 item 4, open: one-GPU lanes share 102 whole micro-batches (2-3 "
                   "each), so the slowest lane often keeps its count when a node is lost; Oobleck's own granularity "
                   "(a node's GPUs share each micro-batch) still leaves 29, 26, 24 and 18 nodes level "
                   "(docs/strategies/oobleck.md, Throughput by live nodes)")
def test_throughput_falls_with_every_lost_node(table2):
    times = [_estimated(table2, n) for n in NODES]
    assert all(a < b for a, b in zip(times, times[1:])), list(zip(NODES, times))
