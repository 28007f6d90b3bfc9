"""cluster.placement: which node holds which workers, and what follows from it (what a node
failure takes, link costs, checkpoint writers)."""
import pytest

from conftest import LOCAL, assert_matches_fault_free, compose, run
from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.placement import node_of, workers_on
from ftbench.plan import checkpoint_writers


@pytest.mark.parametrize("placement", ["pipeline", "stage"])
@pytest.mark.parametrize("pp,dp,g", [(4, 2, 1), (4, 2, 2), (2, 4, 2), (3, 4, 4), (2, 6, 3)])
def test_nodes_partition_the_workers(placement, pp, dp, g):
    nodes = pp * dp // g + 2  # two standbys past the grid
    seen = []
    for n in range(nodes):
        ws = workers_on(n, pp, dp, g, placement)
        assert len(ws) == g and all(node_of(w, pp, dp, g, placement) == n for w in ws)
        seen += ws
    assert sorted(seen) == list(range(nodes * g))


def test_stage_placement_puts_one_stage_of_several_pipelines_on_a_node():
    # pp=4, dp=4, 2 GPUs per node: node 0 holds stage 0 of pipelines 0 and 1 (workers 0 and 4)
    assert workers_on(0, 4, 4, 2, "stage") == [0, 4]
    assert workers_on(5, 4, 4, 2, "stage") == [9, 13]  # stage 1 of pipelines 2 and 3
    assert workers_on(0, 4, 4, 2, "pipeline") == [0, 1]


def test_links_and_checkpoint_writers_follow_the_placement():
    ctx = RunContext.from_config(compose("backend=sim", "model=gpt3-medium", "hardware=a100-80gb"))
    by = {}
    for placement in ("pipeline", "stage"):
        cluster = Cluster(4, 4, 2, 8, 0, 0.0, placement)
        plan = ctx.grid_plan(4, 4, 2, node_of=cluster.node_of)
        costs = PlanCosts(ctx.cost_model, plan)
        by[placement] = (costs.transfer_time(0, 1), costs.allreduce_time(0, 0, [0, 4, 8, 12]), plan)
    assert by["pipeline"][0] < by["stage"][0]  # stage 0 -> 1 crosses nodes under stage placement
    writers = checkpoint_writers(by["stage"][2])
    assert len({by["stage"][2].node_of[w] for w in writers.values()}) == 4  # writes spread over nodes


def test_stage_placement_needs_whole_nodes_of_pipelines(tmp_path):
    s = run(tmp_path, *LOCAL, "cluster.placement=stage", "cluster.gpus_per_node=2", "cluster.dp=3")
    assert s["status"] == "error" and "cluster.placement" in s["error"]


def test_a_node_failure_under_stage_placement_is_rerouted_and_trains_the_same_model(tmp_path):
    # pp=4 x dp=4, 2 GPUs per node, stage placement: node 1 holds stage 1 of pipelines 0 and 1;
    # its failure leaves stage 1 on pipelines 2 and 3, which take the re-routed micro-batches.
    s = assert_matches_fault_free(tmp_path, setup=("cluster.dp=4", "train.microbatches=2", "cluster.gpus_per_node=2",
                                                   "cluster.placement=stage", "train.iterations=6"),
                                  faults=("strategy=recycle", "strategy.plan_cache=null", "failures=scripted",
                                          "failures.events=[{iteration:2,node:1}]"))
    assert s["status"] == "ok" and s["recoveries"][0]["actions"] == ["Rendezvous"]
    assert s["recoveries"][0]["plan"] == "recycle-staggered (2 re-routed)"
