"""`none`: fault-free training with no fault tolerance, the baseline every strategy is compared
with. Its plan is the plain pp x dp grid under the configured schedule; a failure of a node
that runs a worker ends the run ("unrecoverable"). Failures of idle standby nodes and joins
change nothing."""
from __future__ import annotations

from ftbench.cluster import Cluster
from ftbench.failures import FailureEvent
from ftbench.plan import Plan
from ftbench.strategies.base import Recovery, Strategy, StrategyConfig, StrategyTests, register


@register
class NoFaultTolerance(Strategy):
    name = "none"
    trains_local_steps = True  # nothing to recover: fault-free training of any data-parallel algorithm
    config = StrategyConfig
    tests = StrategyTests(conformance_scripts=("one failure", "time-based failure"))

    def plan(self, cluster: Cluster) -> Plan:
        return self.ctx.grid_plan(cluster.pp, cluster.dp, cluster.gpus_per_node, node_of=cluster.node_of)

    def on_event(self, event: FailureEvent, cluster: Cluster, iteration: int) -> Recovery:
        in_use = any(w < cluster.pp * cluster.dp for w in cluster.workers_on(event.node))
        if event.kind == "fail" and in_use:
            return Recovery(unrecoverable=(
                f"node {event.node} failed during iteration {iteration} and strategy `none` has no "
                "fault tolerance; it is the fault-free baseline, so run a fault-tolerant strategy to train through failures, "
                "or add failures=none to train without the failure script (the default job has one)"))
        return Recovery()
