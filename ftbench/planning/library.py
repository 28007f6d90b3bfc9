"""Plans computed ahead of failures, one per normalised failure configuration, cached on disk.

ReCycle keeps the solver off the critical path: before training starts it plans every
failure configuration up to a threshold of failed nodes (configurations that are equal up
to renaming pipelines share one plan; with per-stage forms, those with the same number of
failed workers at each stage, ftbench.planning.problem.StageForm), so a failure only switches
to a stored plan. Plans are
JSON files named by a hash of everything they depend on (grid, micro-batches, op times,
placement, failed positions, B/W split, planner and its version, MILP time limit), so a
changed setting never reuses a stale plan.

The disk cache is optional. A plan read from it is checked against its problem (`check_orders`:
every surviving worker, exactly its ops, each worker's order and the workers together free of
deadlock); one that does not fit is planned again and overwritten. A cache folder that cannot
be written costs one PlanCacheWarning, then plans stay in memory only.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
import warnings
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from pathlib import Path

from ftbench.placement import node_of, workers_on
from ftbench.planning.heuristic import copy_shaped, list_schedule_shaped, list_schedule_timed
from ftbench.planning.problem import (PlanningError, PlanningProblem, Position, StageForm, canonical_failed, form_of,
                                      stage_layouts)
from ftbench.schedule import Op

METHODS = ("heuristic", "milp", "auto")
# `auto` solves the MILP only for instances this small (ops of one iteration); above it the
# MILP would not finish in the time limit, and the heuristic is within a few percent.
AUTO_MILP_MAX_OPS = 200


class PlanCacheWarning(UserWarning):
    """The on-disk plan cache could not be used; planning carried on without it."""


# Plans of more ops than this stay in memory: on large grids writing, reading and re-checking
# the JSON costs more than planning again (the list scheduler plans each shape of part once,
# and a stored plan is read back op by op, not per shape: 1.5 s per plan of a 1,024-GPU grid).
STORE_MAX_OPS = 20_000
# Plans kept in memory, least recently used first out, up to this many ops in all: a failure
# script that never repairs nodes reaches a new configuration at every failure, and with one
# GPU per node each plan of a 1,024-GPU grid holds about a hundred thousand ops. A plan let go
# is planned again if its configuration comes back (the planner is deterministic: the same plan).
KEEP_OPS = 2_000_000


@dataclass
class StoredPlan:
    _orders: dict[Position, list[Op]] | None  # canonical pipelines (None: built from `shaped` when read)
    method: str  # heuristic | milp
    iteration_s: float  # single-iteration time as the planner timed it (barrier semantics)
    seconds: float  # planning wall time
    status: str = "heuristic"  # heuristic | optimal | feasible (MILP hit its time limit)
    cached: bool = False
    shaped: list | None = None  # heuristic: [(shape, its orders, its parts)] (ftbench.planning.parts)
    form: tuple | None = None  # the pipeline normal form the orders are for (a per-stage form's chosen layout)

    @property
    def orders(self) -> dict[Position, list[Op]]:
        if self._orders is None:
            self._orders = copy_shaped(self.shaped)
        return self._orders

    def ops(self) -> int:
        if self.shaped is None:
            return sum(map(len, self.orders.values()))
        return sum(sum(map(len, orders.values())) * len(parts) for _, orders, parts in self.shaped)


class PlanLibrary:
    """Plans for failure configurations of one grid. `base` is the fault-free problem."""

    def __init__(self, base: PlanningProblem, method: str = "heuristic", milp_time_limit_s: float = 30.0,
                 cache_dir: str | Path | None = None, rank=None):
        if method not in METHODS:
            raise ValueError(f"unknown planner {method!r}")
        self.base, self.method, self.milp_time_limit_s = base, method, milp_time_limit_s
        # how a per-stage form's layouts are compared (default: the planner's own iteration time)
        self.rank = rank or (lambda plan: plan.iteration_s)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self._plans: OrderedDict[tuple, StoredPlan] = OrderedDict()
        self._kept_ops = 0
        self._infeasible: dict[tuple, PlanningError] = {}
        self._chosen: dict[StageForm, tuple] = {}  # per-stage form -> the layout whose plan it uses

    def problem(self, form) -> PlanningProblem:
        return replace(self.base, failed=canonical_failed(form))

    def method_for(self, problem: PlanningProblem) -> str:
        if self.method != "auto":
            return self.method
        ops = sum(len(problem.ops_of(pos)) for pos in problem.workers)
        return "milp" if ops <= AUTO_MILP_MAX_OPS else "heuristic"

    def get(self, form) -> StoredPlan:
        """The plan of a normal form: from memory, from disk, or computed now (and stored). A
        per-stage form (StageForm) gets the plan of its fastest layout (stage_layouts), each
        planned as a pipeline form; `form` on the plan says which."""
        if isinstance(form, StageForm):
            return self._get_stage(form)
        if form in self._plans:
            self._plans.move_to_end(form)
            return self._plans[form]
        if form in self._infeasible:
            raise self._infeasible[form]
        problem = self.problem(form)
        method = self.method_for(problem)
        path = self._path(problem, method)
        plan = _load(path) if path is not None else None
        if plan is not None:
            problem_found = check_orders(problem, plan.orders)
            if problem_found is not None:
                warnings.warn(PlanCacheWarning(f"cached plan {path} does not fit its problem ({problem_found}); "
                                               "planning again"), stacklevel=2)
                plan = None
        if plan is None:
            plan = self._compute(problem, method)
            if path is not None and plan.ops() <= STORE_MAX_OPS:
                self._store(path, plan)
        plan.form = form
        self._keep(form, plan)
        return plan

    def _get_stage(self, form: StageForm) -> StoredPlan:
        chosen = self._chosen.get(form)
        if chosen is not None:
            return self.get(chosen)
        if form in self._infeasible:
            raise self._infeasible[form]
        best, best_time, error = None, math.inf, None
        layouts = stage_layouts(form, self.base.dp)
        for layout in layouts:
            try:
                plan = self.get(layout)
            except PlanningError as err:
                error = error or err
                continue
            time = self.rank(plan) if len(layouts) > 1 else 0.0
            if time < best_time * (1 - 1e-12):
                best, best_time = plan, time
        if best is None:
            self._infeasible[form] = error
            raise error
        self._chosen[form] = best.form
        return best

    def _keep(self, form, plan: StoredPlan) -> None:
        self._plans[form] = plan
        self._kept_ops += plan.ops()
        while self._kept_ops > KEEP_OPS and len(self._plans) > 1:
            _, old = self._plans.popitem(last=False)
            self._kept_ops -= old.ops()

    def _store(self, path: Path, plan: StoredPlan) -> None:
        try:
            _store(path, plan)
        except OSError as error:
            # The cache only saves planning time: warn once, then keep plans in memory only.
            warnings.warn(PlanCacheWarning(f"cannot write the plan cache {self.cache_dir} ({error.strerror or error}); "
                                           "plans are kept in memory only (set strategy.plan_cache to a writable "
                                           "folder, or null)"), stacklevel=3)
            self.cache_dir = None

    def _path(self, problem: PlanningProblem, method: str) -> Path | None:
        if self.cache_dir is None or _ops_of(problem) > STORE_MAX_OPS:
            return None  # never stored (STORE_MAX_OPS): no key to hash, no file to look for
        limit = f"-{self.milp_time_limit_s:g}s" if method == "milp" else ""
        return self.cache_dir / f"{method}{limit}-{problem.key()}.json"

    def _compute(self, problem: PlanningProblem, method: str) -> StoredPlan:
        started = time.perf_counter()
        if method == "milp":
            from ftbench.planning.milp import solve

            orders, _ = list_schedule_timed(problem)  # raises PlanningError when nothing fits
            result = solve(problem, warm_start=orders, time_limit_s=self.milp_time_limit_s)
            return StoredPlan(result.orders, "milp", result.makespan, time.perf_counter() - started, result.status)
        # The list scheduler timed its plan by the simulator's rules: no second simulation.
        shaped, iteration_s = list_schedule_shaped(problem)
        # The problem's parts (kept on it while planning) hold the problem in turn: let them go,
        # so that a plan let go is freed at once and not left to the cyclic collector.
        problem.__dict__.pop("_parts", None)
        return StoredPlan(None, "heuristic", iteration_s, time.perf_counter() - started, shaped=shaped)

    def precompute(self, forms, progress=None, budget_s: float | None = None) -> int:
        """Plan the forms now, in order, until `budget_s` seconds have gone into it (None: every
        one); the others are planned when `get` first asks. A form with no plan that fits is
        remembered, and `get` raises its PlanningError when a failure reaches it. Returns how
        many forms were planned."""
        started, done = time.perf_counter(), 0
        for form in forms:
            if budget_s is not None and time.perf_counter() - started >= budget_s:
                break
            try:
                self.get(form)
            except PlanningError as error:
                self._infeasible[form] = error
            done += 1
            if progress is not None:
                progress()
        return done


def _ops_of(problem: PlanningProblem) -> int:
    """Ops of any plan of `problem`: every micro-batch of every pipeline runs at every stage
    (a failed worker's on a peer)."""
    return problem.dp * problem.pp * problem.microbatches * (3 if problem.decoupled else 2)


def forms_up_to(threshold: int, pp: int, dp: int, gpus_per_node: int, placement: str = "pipeline",
                by: str = "pipeline") -> list:
    """Normal forms (`by` "pipeline": renaming pipelines; "stage": per-stage counts) of every
    configuration of at most `threshold` failed nodes in which each stage keeps a replica. Up to
    renaming pipelines, such a configuration fits in the first few pipelines, so only nodes
    there are combined (not all C(nodes, k) sets). Fewest failed workers first."""
    g = gpus_per_node
    if placement == "stage":  # a node spans g pipelines at one stage
        span = (threshold + 1) * g
    else:
        span = threshold * (math.ceil(g / pp) + 1) + math.lcm(pp, g) // pp
    pipelines = min(dp, span)
    nodes = sorted({node_of(d * pp + s, pp, dp, g, placement) for d in range(pipelines) for s in range(pp)})
    forms = {form_of(set(), dp, pp, by)}
    for k in range(1, threshold + 1):
        for combo in itertools.combinations(nodes, k):
            failed = {divmod(w, pp) for n in combo for w in workers_on(n, pp, dp, g, placement) if w < dp * pp}
            if all(any((d, s) not in failed for d in range(dp)) for s in range(pp)):
                forms.add(form_of(failed, dp, pp, by))
    return sorted(forms, key=lambda f: (len(canonical_failed(f)), f))


def check_orders(problem: PlanningProblem, orders) -> str | None:
    """Why per-worker `orders` are not a plan of `problem` (None: they are): every surviving
    worker has an order, no other position has one, each order holds exactly the worker's
    F/B/W (or BW) ops, and the ops can run (dependencies and each worker's order have no cycle,
    so no deadlock)."""
    workers = set(problem.workers)
    if not isinstance(orders, dict) or set(orders) != workers:
        got = set(orders) if isinstance(orders, dict) else set()
        extra, missing = sorted(got - workers), sorted(workers - got)
        return (f"orders for positions {extra} outside the surviving workers" if extra
                else f"no order for workers {missing}")
    runner = {}
    for pos, order in orders.items():
        want = Counter(problem.ops_of(pos))
        try:
            have = Counter(order)
        except TypeError:  # e.g. a list where a number belongs: unhashable
            return f"worker {pos}: malformed ops"
        if have != want:
            wrong = sorted(map(str, (have - want).elements()))[:3]
            lost = sorted(map(str, (want - have).elements()))[:3]
            return f"worker {pos}: " + (f"ops {wrong} that it does not run" if wrong else f"ops {lost} missing")
        runner.update({op: pos for op in order})
    # Kahn's algorithm over dependencies + each worker's own order: all ops must come out.
    successors: dict = {op: [] for op in runner}
    indegree = {op: 0 for op in runner}
    for order in orders.values():
        for before, after in zip(order, order[1:]):
            successors[before].append(after)
            indegree[after] += 1
    for op in runner:
        for dep in problem.dependencies(op):
            successors[dep].append(op)
            indegree[op] += 1
    ready = deque(op for op, n in indegree.items() if n == 0)
    done = 0
    while ready:
        op = ready.popleft()
        done += 1
        for nxt in successors[op]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    if done != len(runner):
        return "the orders deadlock (an op waits, directly or not, for one ordered after it)"
    return None


# -- the on-disk format -------------------------------------------------------------------

def _store(path: Path, plan: StoredPlan) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"method": plan.method, "iteration_s": plan.iteration_s, "seconds": plan.seconds, "status": plan.status,
            "orders": [[d, s, [list(op) for op in ops]] for (d, s), ops in sorted(plan.orders.items())]}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # atomic: a concurrent sweep never reads half a plan
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _load(path: Path) -> StoredPlan | None:
    try:
        data = json.loads(path.read_text())
        orders = {(int(d), int(s)): [Op(*op) for op in ops] for d, s, ops in data["orders"]}
        plan = StoredPlan(orders, str(data["method"]), float(data["iteration_s"]), float(data["seconds"]),
                          str(data["status"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: plan again
    if not (math.isfinite(plan.iteration_s) and plan.iteration_s > 0):
        return None
    return plan


__all__ = ["PlanLibrary", "PlanCacheWarning", "PlanningError", "StoredPlan", "check_orders", "forms_up_to", "METHODS"]
