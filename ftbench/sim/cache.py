"""Memoised simulation of plans: the timeline oracle of the run loop (iteration times,
failure points, memory) and the `sim` backend's whole cost of an iteration."""
from __future__ import annotations

from ftbench.costs import PlanCosts
from ftbench.plan import Plan
from ftbench.schedule import check_coverage
from ftbench.sim.simulator import SimResult, simulate


class SimCache:
    """Memoises the simulation of each distinct plan."""

    def __init__(self, cost_model, enabled: bool = True):
        self.cost_model, self.enabled = cost_model, enabled
        self._results: dict[tuple, SimResult] = {}
        self._by_id: dict[int, tuple[Plan, SimResult]] = {}
        self.simulations = 0

    def __call__(self, plan: Plan) -> SimResult:
        hit = self._by_id.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        key = plan.key() if self.enabled else None
        result = self._results.get(key) if self.enabled else None
        if result is None:
            check_coverage(plan.schedule)  # a strategy's plan must train every micro-batch once
            result = simulate(plan.schedule, PlanCosts(self.cost_model, plan), staggered=plan.staggered_optimizer)
            self.simulations += 1
            if self.enabled:
                self._results[key] = result
        self._by_id[id(plan)] = (plan, result)
        return result

    @property
    def distinct_plans(self) -> int:
        return len(self._results) if self.enabled else self.simulations
