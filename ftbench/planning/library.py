"""Plans computed ahead of failures, one per normalised failure configuration, cached on disk.

ReCycle keeps the solver off the critical path: before training starts it plans every
failure configuration up to a threshold of failed nodes (configurations that are equal up
to renaming pipelines share one plan), so a failure only switches to a stored plan. Plans are
JSON files named by a hash of everything they depend on (grid, micro-batches, op times,
placement, failed positions, B/W split, planner and its version, MILP time limit), so a
changed setting never reuses a stale plan.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ftbench.placement import node_of, workers_on
from ftbench.planning.heuristic import list_schedule
from ftbench.planning.problem import (PlanningError, PlanningProblem, Position, canonical_failed, evaluate,
                                      normalise)
from ftbench.schedule import Op

METHODS = ("heuristic", "milp", "auto")
# `auto` solves the MILP only for instances this small (ops of one iteration); above it the
# MILP would not finish in the time limit, and the heuristic is within a few percent.
AUTO_MILP_MAX_OPS = 200


@dataclass
class StoredPlan:
    orders: dict[Position, list[Op]]  # canonical pipelines
    method: str  # heuristic | milp
    iteration_s: float  # single-iteration time as the planner timed it (barrier semantics)
    seconds: float  # planning wall time
    status: str = "heuristic"  # heuristic | optimal | feasible (MILP hit its time limit)
    cached: bool = False


class PlanLibrary:
    """Plans for failure configurations of one grid. `base` is the fault-free problem."""

    def __init__(self, base: PlanningProblem, method: str = "heuristic", milp_time_limit_s: float = 30.0,
                 cache_dir: str | Path | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown planner {method!r}")
        self.base, self.method, self.milp_time_limit_s = base, method, milp_time_limit_s
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self._plans: dict[tuple, StoredPlan] = {}

    def problem(self, form) -> PlanningProblem:
        return replace(self.base, failed=canonical_failed(form))

    def method_for(self, problem: PlanningProblem) -> str:
        if self.method != "auto":
            return self.method
        ops = sum(len(problem.ops_of(pos)) for pos in problem.workers)
        return "milp" if ops <= AUTO_MILP_MAX_OPS else "heuristic"

    def get(self, form) -> StoredPlan:
        """The plan of a normal form: from memory, from disk, or computed now (and stored)."""
        if form in self._plans:
            return self._plans[form]
        problem = self.problem(form)
        method = self.method_for(problem)
        path = self._path(problem, method)
        plan = _load(path) if path is not None else None
        if plan is None:
            plan = self._compute(problem, method)
            if path is not None:
                _store(path, plan)
        self._plans[form] = plan
        return plan

    def _path(self, problem: PlanningProblem, method: str) -> Path | None:
        if self.cache_dir is None:
            return None
        limit = f"-{self.milp_time_limit_s:g}s" if method == "milp" else ""
        return self.cache_dir / f"{method}{limit}-{problem.key()}.json"

    def _compute(self, problem: PlanningProblem, method: str) -> StoredPlan:
        started = time.perf_counter()
        orders = list_schedule(problem)
        if method == "milp":
            from ftbench.planning.milp import solve

            result = solve(problem, warm_start=orders, time_limit_s=self.milp_time_limit_s)
            return StoredPlan(result.orders, "milp", result.makespan, time.perf_counter() - started, result.status)
        return StoredPlan(orders, "heuristic", evaluate(problem, orders).iteration_time,
                          time.perf_counter() - started)

    def precompute(self, forms, progress=None) -> None:
        for form in forms:
            self.get(form)
            if progress is not None:
                progress()


def forms_up_to(threshold: int, pp: int, dp: int, gpus_per_node: int, placement: str = "pipeline") -> list:
    """Normal forms of every configuration of at most `threshold` failed nodes in which each
    stage keeps a replica. Up to renaming pipelines, such a configuration fits in the first
    few pipelines, so only nodes there are combined (not all C(nodes, k) sets)."""
    g = gpus_per_node
    if placement == "stage":  # a node spans g pipelines at one stage
        span = (threshold + 1) * g
    else:
        span = threshold * (math.ceil(g / pp) + 1) + math.lcm(pp, g) // pp
    pipelines = min(dp, span)
    nodes = sorted({node_of(d * pp + s, pp, dp, g, placement) for d in range(pipelines) for s in range(pp)})
    forms = {normalise(set(), dp, pp)[0]}
    for k in range(1, threshold + 1):
        for combo in itertools.combinations(nodes, k):
            failed = {divmod(w, pp) for n in combo for w in workers_on(n, pp, dp, g, placement) if w < dp * pp}
            if all(any((d, s) not in failed for d in range(dp)) for s in range(pp)):
                forms.add(normalise(failed, dp, pp)[0])
    return sorted(forms, key=lambda f: (sum(map(len, f)), f))


# -- the on-disk format -------------------------------------------------------------------

def _store(path: Path, plan: StoredPlan) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"method": plan.method, "iteration_s": plan.iteration_s, "seconds": plan.seconds, "status": plan.status,
            "orders": [[d, s, [list(op) for op in ops]] for (d, s), ops in sorted(plan.orders.items())]}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: a concurrent sweep never reads half a plan


def _load(path: Path) -> StoredPlan | None:
    try:
        data = json.loads(path.read_text())
        orders = {(d, s): [Op(*op) for op in ops] for d, s, ops in data["orders"]}
        return StoredPlan(orders, data["method"], data["iteration_s"], data["seconds"], data["status"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: plan again


__all__ = ["PlanLibrary", "PlanningError", "StoredPlan", "forms_up_to", "METHODS"]
