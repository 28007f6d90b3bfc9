"""Memoised simulation of plans: the timeline oracle of the run loop (iteration times,
failure points, memory) and the `sim` backend's whole cost of an iteration."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from itertools import repeat

from ftbench.costs import PlanCosts
from ftbench.plan import Plan
from ftbench.local_sgd import outer_sync_s
from ftbench.recovery_costs import iteration_work_seconds
from ftbench.schedule import check_coverage, key_bytes
from ftbench.sim.grid import ComposedResult, GridTimer
from ftbench.sim.parts_timer import PartsTimer
from ftbench.sim.pipelines import PipelinesTimer
from ftbench.sim.simulator import SimResult, simulate

# Results kept, least recently used first out, up to this many workers in all (a result holds
# per-worker figures): a hundred plans of 1,024 workers, or eight of 16,384.
KEEP_WORKERS = 1 << 17
KEEP_PLANS = 8  # plans recognised by identity, without computing their key


class SimCache:
    """Memoises the simulation of each distinct plan."""

    def __init__(self, cost_model, enabled: bool = True, iteration_work=None):
        self.cost_model, self.enabled = cost_model, enabled
        # strategy.iteration_work(plan) -> the work every iteration does beyond training (Swift's
        # logging), charged in the plan's iteration time; None: nothing
        self.iteration_work = iteration_work
        self._results: OrderedDict[tuple, SimResult] = OrderedDict()
        self._kept_workers = 0
        self._seen: set = set()  # every distinct plan simulated (its key's digest)
        self._by_id: OrderedDict[int, tuple[Plan, SimResult]] = OrderedDict()
        self.simulations = 0
        self._grids = GridTimer(cost_model)  # generated grids: from one pipeline of each kind
        self._pipelines = PipelinesTimer(cost_model)  # heterogeneous pipelines (oobleck): from their kinds
        self._parts = PartsTimer(cost_model)  # bound parts (recycle): from their classes, compiled once per set

    def __call__(self, plan: Plan) -> SimResult:
        hit = self._by_id.get(id(plan))
        if hit is not None and hit[0] is plan:
            self._by_id.move_to_end(id(plan))
            return hit[1]
        same = plan.same_timing
        if self.enabled and same is not None and same.applies_to(plan):
            # a renaming of a plan already checked and timed (its reference): its figures renamed
            result = RenamedResult(plan, self.cost_model, self(same.reference), same)
            self._by_id[id(plan)] = (plan, result)
            while len(self._by_id) > KEEP_PLANS:
                self._by_id.popitem(last=False)
            return result
        key = plan.key() if self.enabled else None
        result = self._results.get(key) if self.enabled else None
        if result is None:
            if not (self.enabled and self._pipelines.covered(plan)):  # (plans of pipelines: shape by shape)
                check_coverage(plan.schedule)  # a strategy's plan must train every micro-batch once
            # (memoize=false keeps the plain path: the reference for the grid timer)
            result = (self._grids(plan) if self.enabled else None) or \
                (self._pipelines(plan) if self.enabled else None) or \
                (self._parts(plan) if self.enabled else None) or \
                simulate(plan.schedule, PlanCosts(self.cost_model, plan), staggered=plan.staggered_optimizer)
            for work in self.iteration_work(plan) if self.iteration_work is not None else ():
                result.iteration_time += iteration_work_seconds(work, plan, self.cost_model, result.iteration_time)
            steps = getattr(self.cost_model, "local_steps", None)
            if steps is not None:  # LocalSGD's or DiLoCo's sync, spread over the iterations between two
                result.iteration_time += outer_sync_s(self.cost_model, plan) / steps.sync_every
            self.simulations += 1
            if self.enabled:
                self._keep(key, result)
        else:
            self._results.move_to_end(key)
        self._by_id[id(plan)] = (plan, result)
        while len(self._by_id) > KEEP_PLANS:
            self._by_id.popitem(last=False)
        return result

    def _keep(self, key: tuple, result: SimResult) -> None:
        self._seen.add(_digest(key))
        self._results[key] = result
        self._kept_workers += _workers(result)
        while self._kept_workers > KEEP_WORKERS and len(self._results) > 1:
            _, old = self._results.popitem(last=False)  # simulated again if it comes back
            self._kept_workers -= _workers(old)

    @property
    def distinct_plans(self) -> int:
        return len(self._seen) if self.enabled else self.simulations


class RenamedResult(ComposedResult):
    """A plan's SimResult from its reference's (Plan.same_timing): the same iteration time,
    each worker's figures its reference worker's (dicts made when first read, as copies of the
    reference's with the renamed and absent workers changed), op and all-reduce rows from
    simulating the plan itself when first read."""

    def __init__(self, plan: Plan, cost_model, reference: SimResult, same):
        self.iteration_time = reference.iteration_time
        self.schedule = plan.schedule
        self.worker_count = len(plan.schedule.ops)
        self._plan, self._model, self._reference, self._same = plan, cost_model, reference, same
        # what its figures are made of: the reference's result, the workers that take another
        # reference worker's figures (plan worker -> reference worker), the reference's workers
        # the plan does not have (ftbench.sim.backend folds peaks from these, not per worker)
        self.reference, self.renamed, self.absent = reference, same.renamed, same.absent
        self._dicts: dict[str, dict] = {}
        self._whole: SimResult | None = None

    def _per_worker(self, name: str) -> dict:
        found = self._dicts.get(name)
        if found is None:
            values = getattr(self._reference, name)
            found = dict(values)  # the reference's workers, in its order
            found.update((w, values[r]) for w, r in self._same.renamed.items())
            for w in self._same.absent:
                del found[w]
            self._dicts[name] = found
        return found

    def whole(self) -> SimResult:
        """The plan itself simulated (its rows), with its own optimizer (staggered or not)."""
        if self._whole is None:
            self._whole = simulate(self.schedule, PlanCosts(self._model, self._plan),
                                   staggered=self._plan.staggered_optimizer)
        return self._whole

    def peak_columns(self) -> tuple[list[int], list[float]]:
        """(workers, peak_memory_bytes of each)."""
        peaks = self._per_worker("peak_memory_bytes")
        return list(peaks), list(peaks.values())


def _workers(result: SimResult) -> int:
    """How many workers a result has figures for (a GridResult knows without building them)."""
    count = getattr(result, "worker_count", None)
    return len(result.busy) if count is None else count


def _digest(key: tuple):
    """A small stand-in for a plan key, for counting: its SHA-256 digest where the key is plain
    data (a grid's packed key, whose bytes parts go in as they are), else the key itself.
    (SHA-256, which CPUs compute in hardware: a megabyte per plan of 16,384 workers.)"""
    h = hashlib.sha256()
    try:
        for part in _parts(key):
            if part is _OPEN or part is _CLOSE:
                h.update(b"(" if part is _OPEN else b")")
                continue
            tag = b"b" if isinstance(part, bytes) else b"m"
            data = part if tag == b"b" else key_bytes(part)
            h.update(tag + len(data).to_bytes(8, "little"))
            h.update(data)
    except ValueError:  # not plain data (ops as named tuples): the key itself
        return key
    return h.digest()


_OPEN, _CLOSE = object(), object()


def _parts(key: tuple):
    """A key's parts, a tuple holding bytes opened (between _OPEN and _CLOSE) so that its
    bytes are not copied into one marshalled string."""
    for part in key:
        if isinstance(part, tuple) and any(map(isinstance, part, repeat(bytes))):
            yield _OPEN
            yield from _parts(part)
            yield _CLOSE
        else:
            yield part
