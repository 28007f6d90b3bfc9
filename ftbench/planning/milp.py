"""An exact planner: the ReCycle (SOSP 2024) schedule MILP, solved with CBC through pulp.

In ReCycle's vocabulary, a failed worker's micro-batches are *adaptively re-routed* to its
data-parallel peers of the same stage (PlanningProblem.assignment fixes which peer takes
which), and the planner decides when every surviving worker runs each of its F, B and W (or
fused BW) ops, so that the peers' extra work fills the pipeline bubbles (*decoupled
back-propagation* lets W wait for one) and the gradient all-reduce and optimizer step start
as early as they can. As a mixed-integer program:

- a start time S_o >= 0 for every F/B/W/BW op o of duration d_o;
- dependencies: S_o >= S_p + d_p + transfer(p -> o) for each input p of o (a boundary send
  between workers, none within one);
- one op at a time per worker: for ops a, b of one worker a binary x_ab (a before b) and the
  big-M disjunction S_b >= S_a + d_a - M_ab (1 - x_ab), S_a >= S_b + d_b - M_ba x_ab;
- the stash cap (*memory-constrained* schedules): when F_k starts on a worker, at most cap - 1
  other micro-batches are forwarded there and not yet backpropagated:
  sum_j y_jk <= cap - 1 with y_jk >= [F_j before F_k] + [F_k before B_j] - 1; likewise
  (decoupled) at most `defer` micro-batches between B and W when a B starts. Both caps come
  from the GPU's memory (PlanningProblem.stash_cap, defer_cap);
- the gradient sync of stage s at G_s >= the end of every W/BW of stage s, each survivor's
  optimizer step ending at E_ds = max(G_s + allreduce_s, its last op's end) + optimizer_s
  (the all-reduce is free with one survivor, as in ProblemCosts), and C >= every E_ds. A
  worker's last op is a W or BW, so E_ds = G_s + allreduce_s + optimizer_s for all its
  survivors: one constraint per stage. With train.overlap_grad_reduce the all-reduce runs
  in buckets during the last W/BW and ends at max over the stage's W/BW ops o of
  end_o + c_o, c_o = overlapped_sync_s(allreduce_s, units, d_o) (ftbench.sim.simulator):
  a finish F_s >= end_o + c_o for every o. Every W/BW of a stage has the same d_o, so c_o
  is one constant c_s and F_s = G_s + c_s: the same constraint with c_s in place of
  allreduce_s (PlanningProblem.sync_s gives either);
- minimise C.

These are the simulator's semantics (ftbench.sim.simulator) with "as soon as possible"
relaxed to "no earlier than possible", so the orders a solution induces (each worker's ops by
S) simulate to at most its C (up to CBC's tolerances).

Fixed orders, which need no binary: ops of one kind and one owner pipeline run in micro-batch
order on a worker (a restriction the heuristic and the warm starts obey too); with the
dependencies that orders F(j) < B(k) < W(l) for j <= k <= l of one pipeline, and with the
stash cap B(j) before the forward `cap` places after F(j). Two Ws of different pipelines on
one worker follow their Bs' order (swapping equal Ws changes no time, so an optimum of that
form exists). And a pair whose reverse order cannot fit under the incumbent's makespan is
fixed: heads and tails (longest paths to an op and from it, raised by one-machine bounds over
what the fixed orders put on its worker) show it. Heads and tails also bound each S and give
each disjunction its own big-M, M_ab = incumbent - tail(a) - head(b). Sequencing cuts
(G_s >= end of a + what runs after a on its worker, S_a >= the worker's first head + what runs
before a) and a per-worker one-machine bound that knows the stash cap lift the lower bound.

Times are scaled to about one op's length inside the model (CBC's tolerances are absolute).
"""
from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import pulp

from ftbench.planning.heuristic import RULES, schedule_once
from ftbench.planning.problem import PlanningError, PlanningProblem, Position, evaluate, stash_peaks
from ftbench.schedule import B, BW, F, W, Op, ScheduleError

_RANK = {F: 0, B: 1, BW: 1, W: 2}  # the order of one micro-batch's ops on its worker


@dataclass
class MilpResult:
    orders: dict[Position, list[Op]]  # per surviving worker, its F/B/W (or BW) ops in order (no OPT)
    makespan: float  # simulated iteration time of `orders`
    objective: float  # the MILP's objective value (the incumbent's makespan when CBC found nothing better)
    bound: float  # CBC's best lower bound on the objective (== objective when optimal)
    status: str  # "optimal" | "feasible" (time limit hit, or the warm start kept)
    seconds: float  # wall time of the solve
    binaries: int
    constraints: int


def solve(problem: PlanningProblem, warm_start: dict[Position, list[Op]] | None = None,
          time_limit_s: float = 30.0) -> MilpResult:
    """The best per-worker orders CBC finds within `time_limit_s`, never worse than `warm_start`.

    The MIP start is the better of `warm_start` (when it keeps the fixed orders and the caps)
    and the heuristic's list schedules (ftbench.planning.heuristic); when CBC's orders simulate no better than the best of those,
    that one comes back with status "feasible". `bound` is CBC's best bound as its log prints
    it (rounded down), raised to the model's static lower bound (heads, tails, per-worker
    one-machine bounds), never above the objective; it equals the objective when optimal."""
    t0 = time.perf_counter()
    # The heuristic's list schedules (both priority rules) are always candidates.
    known = [(orders, evaluate(problem, orders))
             for orders in (schedule_once(problem, rule)[0] for rule in RULES.values())]
    if warm_start is not None:
        known.insert(0, (warm_start, evaluate(problem, warm_start)))
    # The orders to fall back on, and the MIP start: the best of those in the model's space.
    best, best_sim = min(known, key=lambda k: k[1].iteration_time)
    incumbent, sim = min(((o, s) for o, s in known if _obeys(problem, o, s)), key=lambda k: k[1].iteration_time)
    model = _Model(problem, sim.iteration_time)
    start = _ws_in_b_order(incumbent)  # into the model's space, at the same times
    model.start_from(start, evaluate(problem, start))
    cbc_status, objective, bound = model.run(time_limit_s)

    orders, makespan, status = best, best_sim.iteration_time, "feasible"
    if cbc_status is None:  # no solution from CBC: report the incumbent it was given
        objective = sim.iteration_time
    else:
        candidate = model.orders()
        candidate_time = _checked_time(problem, candidate)
        if candidate_time is not None and candidate_time <= makespan:
            orders, makespan, status = candidate, candidate_time, cbc_status
    bound = min(max(bound, model.lower_bound), objective)
    return MilpResult(orders, makespan, objective, bound, status, time.perf_counter() - t0,
                      model.binaries, model.constraints)


class _Model:
    def __init__(self, problem: PlanningProblem, upper_bound: float):
        self.p = problem
        ops = [op for pos in problem.workers for op in problem.ops_of(pos)]
        self.where = {op: problem.runner_of(op) for op in ops}
        self.unit = max(problem.duration(op) for op in ops) or 1.0
        self.dur = {op: problem.duration(op) / self.unit for op in ops}
        self.ub = upper_bound / self.unit * (1 + 1e-9) + 1e-9  # slack: the incumbent must stay feasible
        self.back = B if problem.decoupled else BW
        self.by_worker = {pos: sorted(problem.ops_of(pos), key=lambda o: (o.microbatch, _RANK[o.kind], o.pipeline))
                          for pos in problem.workers}
        # Release times (the original schedule, ftbench.release): each worker's own F and B/BW
        # in their fault-free order, none before its slot; a step no earlier than the stage's.
        self.release = {op: (problem.release_of(self.where[op], op) or 0.0) / self.unit for op in ops}
        self.own_index = {}  # own-chain op -> its place in the worker's fault-free order
        for pos in problem.workers:
            self.own_index.update((op, i) for i, op in enumerate(problem.own_chain(pos) or ()))
        self.step_release = [problem.step_release(s) / self.unit for s in range(problem.pp)]
        self.edges = self._edges(ops)
        self._fixed = set()  # (a, b): a before b, beyond the rules
        for _ in range(3):  # fixings sharpen heads and tails, which may fix more pairs
            self._sort()
            self._bounds()
            fixed = self._fix_by_bound()
            if not fixed:
                break
            self.edges += [(a, b, self.dur[a]) for a, b in fixed]
        self._sort()
        self._build()

    # -- static structure -------------------------------------------------------------
    def _edges(self, ops: list[Op]) -> list[tuple[Op, Op, float]]:
        """Precedence edges (a, b, lag): b starts >= lag after a starts. Dependencies, plus the
        chain of each (kind, pipeline) on a worker in micro-batch order."""
        p = self.p
        edges = []
        for op in ops:
            for dep in p.dependencies(op):
                edges.append((dep, op, self.dur[dep] + p.transfer_s(self.where[dep], self.where[op]) / self.unit))
        self.index = {}  # op -> its place in its (kind, pipeline) chain on its worker
        for pos in self.by_worker:
            mine = p.own_chain(pos) or []
            edges += [(a, b, self.dur[a]) for a, b in zip(mine, mine[1:])]
        for pos, wops in self.by_worker.items():
            chains = defaultdict(list)
            for op in wops:
                chains[(op.kind, op.pipeline)].append(op)
            for chain in chains.values():
                self.index.update((op, i) for i, op in enumerate(chain))
                edges += [(a, b, self.dur[a]) for a, b in zip(chain, chain[1:])]
            # The stash cap orders one pipeline's backward before its forward `cap` places on:
            # otherwise cap + 1 of its micro-batches would be stashed when that forward starts.
            # Likewise the deferral cap orders one pipeline's W before its B `defer` places on.
            cap, defer = p.stash_cap(pos), p.defer_cap(pos) if p.decoupled else 0
            for (kind, _), chain in chains.items():
                if kind == F:
                    edges += [(a._replace(kind=self.back), b, self.dur[a._replace(kind=self.back)])
                              for a, b in zip(chain, chain[cap:])]
                elif kind == B:
                    edges += [(a._replace(kind=W), b, self.dur[a._replace(kind=W)])
                              for a, b in zip(chain, chain[defer:])]
        return edges

    def _sort(self) -> None:
        """A topological order of the edges (Kahn)."""
        ops = list(self.dur)
        succ, indeg = defaultdict(list), {op: 0 for op in ops}
        for a, b, _ in self.edges:
            succ[a].append(b)
            indeg[b] += 1
        ready, self.topo = deque(op for op in ops if indeg[op] == 0), []
        while ready:
            op = ready.popleft()
            self.topo.append(op)
            for b in succ[op]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
        if len(self.topo) != len(ops):  # e.g. a stash cap below what the fault-free order holds
            raise PlanningError("the fixed orders and memory caps leave no schedule (a dependency cycle)")
        self.rank = {op: i for i, op in enumerate(self.topo)}

    def before(self, a: Op, b: Op) -> bool:
        """a precedes b on their worker in every schedule considered (the fixed orders)."""
        if a.kind == b.kind == W and a.pipeline != b.pipeline:
            return self.before(a._replace(kind=B), b._replace(kind=B))
        if a in self.own_index and b in self.own_index:  # the worker's own chain: fault-free order
            return self.own_index[a] < self.own_index[b]
        if (a, b) in self._fixed:
            return True
        if a.pipeline != b.pipeline:
            return False
        if a.kind == b.kind:
            return a.microbatch < b.microbatch
        if a.kind == self.back and b.kind == F:  # the stash cap, within one pipeline
            return self.index[b] - self.index[a] >= self.p.stash_cap(self.where[a])
        if a.kind == W and b.kind == B:  # the deferral cap, within one pipeline
            return self.index[b] - self.index[a] >= self.p.defer_cap(self.where[a])
        return _RANK[a.kind] < _RANK[b.kind] and a.microbatch <= b.microbatch

    def _tail_base(self, op: Op) -> float:
        """From the end of an op to C at least: what follows the stage's last W/BW (which ends
        no earlier): the all-reduce (free with one survivor; with overlap what is left of it,
        PlanningProblem.sync_s), then the optimizer."""
        return (self.p.sync_s(op.stage) + self.p.stages[op.stage].optimizer_s) / self.unit

    def _bounds(self) -> None:
        """head(o): earliest start of o; tail(o): least time from its end to C. Longest paths
        over the edges, raised by one-machine bounds over what the fixed orders put before
        (after) o on its worker (Jackson's rule: the preds in head order, without idling more than forced)."""
        preds, succs = defaultdict(list), defaultdict(list)
        for a, b, lag in self.edges:
            preds[b].append((a, lag))
            succs[a].append((b, lag))
        self.head = {}
        for op in self.topo:
            h = max([self.release[op]] + [self.head[a] + lag for a, lag in preds[op]])
            t = 0.0
            for a in sorted(self._earlier(op), key=self.head.get):
                t = max(t, self.head[a]) + self.dur[a]
            self.head[op] = max(h, t)
        self.tail = {}
        for op in reversed(self.topo):
            base = self._tail_base(op)
            tl = max([base] + [lag - self.dur[op] + self.dur[b] + self.tail[b] for b, lag in succs[op]])
            t = base
            for b in sorted(self._later(op), key=self.tail.get):  # the same bound, time reversed
                t = max(t, self.tail[b]) + self.dur[b]
            self.tail[op] = max(tl, t)
        self.lower_bound = max([self.head[o] + self.dur[o] + self.tail[o] for o in self.topo]
                               + [r + self.p.stages[s].optimizer_s / self.unit for s, r in enumerate(self.step_release)])
        for pos, wops in self.by_worker.items():  # a worker runs everything it has, from its first head
            t = 0.0
            for release, d in sorted(self._releases(pos, wops)):
                t = max(t, release) + d
            self.lower_bound = max(self.lower_bound, t + min(self._tail_base(o) for o in wops))
        self.lower_bound *= self.unit

    def _releases(self, pos: Position, wops: list[Op]) -> list[tuple[float, float]]:
        """(earliest start, length) of a worker's ops for a one-machine bound. Its forwards are
        alike, so take them by slot: the t-th forward it runs starts no earlier than the t-th
        smallest forward head, nor (the stash cap) than the end of its (t - cap)-th backward,
        which starts no earlier than the (t - cap)-th smallest backward head."""
        cap = self.p.stash_cap(pos)
        forwards = sorted(self.head[o] for o in wops if o.kind == F)
        d_f, d_b = (next(self.dur[o] for o in wops if o.kind == kind) for kind in (F, self.back))
        starts = []  # the earliest start of the i-th backward it runs
        for h in sorted(self.head[o] for o in wops if o.kind == self.back):
            starts.append(max(h, starts[-1] + d_b) if starts else h)
        slots = [(max(h, starts[t - cap] + d_b) if t >= cap else h, d_f) for t, h in enumerate(forwards)]
        return slots + [(self.head[o], self.dur[o]) for o in wops if o.kind != F]

    def _earlier(self, op: Op) -> list[Op]:
        return [a for a in self.by_worker[self.where[op]] if a != op and self.before(a, op)]

    def _later(self, op: Op) -> list[Op]:
        return [b for b in self.by_worker[self.where[op]] if b != op and self.before(op, b)]

    def _fix_by_bound(self) -> list[tuple[Op, Op]]:
        """Fix a before b when b before a cannot finish under the incumbent's makespan."""
        fixed = []
        for pos, wops in self.by_worker.items():
            for i, a in enumerate(wops):
                for b in wops[i + 1:]:
                    if _paired(a, b) or self.before(a, b) or self.before(b, a):
                        continue
                    if self.head[b] + self.dur[b] + self.dur[a] + self.tail[a] > self.ub:
                        fixed.append((a, b))
                    elif self.head[a] + self.dur[a] + self.dur[b] + self.tail[b] > self.ub:
                        fixed.append((b, a))
        self._fixed.update(fixed)
        # Two Ws of other pipelines follow their Bs' order: edges for the heads and tails.
        return fixed + [(a._replace(kind=W), b._replace(kind=W)) for a, b in fixed
                        if a.kind == b.kind == B and a.pipeline != b.pipeline]

    # -- the MILP ---------------------------------------------------------------------
    def _build(self) -> None:
        p, dur, ub = self.p, self.dur, self.ub
        m = self.m = pulp.LpProblem("recycle", pulp.LpMinimize)
        self.S = {op: self._var(f"S{i}", self.head[op], max(self.head[op], ub - self.tail[op] - dur[op]))
                  for i, op in enumerate(self.topo)}
        self.C = self._var("C", min(self.lower_bound / self.unit, ub), ub)
        self.G = {s: self._var(f"G{s}", 0, ub) for s in range(p.pp)}
        m += self.C
        for a, b, lag in self.edges:  # dependencies and micro-batch order
            m += self.S[b] >= self.S[a] + lag
        self.x = {}
        pairs = [(a, b) for wops in self.by_worker.values() for i, a in enumerate(wops) for b in wops[i + 1:]]
        for a, b in pairs:
            if not (_paired(a, b) or self.before(a, b) or self.before(b, a)):
                self.x[(a, b)] = self._var(f"x{len(self.x)}", 0, 1, pulp.LpBinary)
        for a, b in pairs:
            if a.pipeline == b.pipeline and (a, b) not in self._fixed and (b, a) not in self._fixed:
                continue  # ordered by the edges, or free
            first = self.order_expr(a, b)
            if isinstance(first, int):  # a fixed order the edges do not imply
                a, b = (a, b) if first else (b, a)
                m += self.S[b] >= self.S[a] + dur[a]
        for a, b in pairs:
            first = self.order_expr(a, b)
            if not isinstance(first, int):
                # The tightest big-Ms under C <= ub: S_a + d_a - S_b <= ub - tail(a) - head(b).
                m += self.S[b] >= self.S[a] + dur[a] - (ub - self.tail[a] - self.head[b]) * (1 - first)
                m += self.S[a] >= self.S[b] + dur[b] - (ub - self.tail[b] - self.head[a]) * first
        self.y = {}
        for pos, wops in self.by_worker.items():
            self._stash(pos, [op for op in wops if op.kind == F], self.back, p.stash_cap(pos))
            if p.decoupled:
                self._stash(pos, [op for op in wops if op.kind == B], W, p.defer_cap(pos))
        for pos, wops in self.by_worker.items():
            # Sequencing cuts, linear in the binaries: what runs after `a` on its worker fits
            # between a's end and G_s (a worker's last op is a W or BW), what runs before it
            # between the worker's first head and S_a. They are G_s >= end(W) and the
            # dependencies when all orders are fixed, and lift the bound on C as binaries are.
            start = min(self.head[o] for o in wops)
            for a in wops:
                others = [b for b in wops if b != a]
                m += self.G[a.stage] >= self.S[a] + dur[a] + pulp.lpSum(dur[b] * self.order_expr(a, b) for b in others)
                m += self.S[a] >= start + pulp.lpSum(dur[b] * self.order_expr(b, a) for b in others)
        for s in range(p.pp):
            # E_ds >= G_s + AR + opt (with overlap: F_s = G_s + c_s, see the module docstring)
            m += self.C >= self.G[s] + (p.sync_s(s) + p.stages[s].optimizer_s) / self.unit
            if self.step_release[s] > 0:  # no step before the stage's fault-free one
                m += self.C >= self.step_release[s] + p.stages[s].optimizer_s / self.unit
        self.binaries = len(self.x)
        self.constraints = m.numConstraints()

    def _var(self, name: str, low: float, high: float, cat: str = pulp.LpContinuous) -> pulp.LpVariable:
        return variable(self.m, name, low, high, cat)

    def order_expr(self, a: Op, b: Op):
        """[a before b] on one worker: 1, 0, or an expression in the binaries."""
        if _paired(a, b):
            return self.order_expr(a._replace(kind=B), b._replace(kind=B))
        if self.before(a, b):
            return 1
        if self.before(b, a):
            return 0
        return self.x[(a, b)] if (a, b) in self.x else 1 - self.x[(b, a)]

    def _stash(self, pos: Position, opens: list[Op], close: str, cap: int) -> None:
        """At most `cap` micro-batches between an `opens` op and their `close` op on a worker:
        when opener k starts, at most cap - 1 others have opened and not closed (F..B: the
        stash cap; B..W: the deferral cap)."""
        if cap >= len(opens):
            return
        for k in opens:
            const, terms = 0, []
            for j in opens:
                if j == k:
                    continue
                held = (self.order_expr(j, k), self.order_expr(k, j._replace(kind=close)))
                known = [h for h in held if isinstance(h, int)]  # (pulp expressions overload ==)
                if 0 in known:
                    continue  # j opens after k, or closes before k opens: not held when k opens
                if len(known) == 2:
                    const += 1
                elif known:
                    terms.append(next(h for h in held if not isinstance(h, int)))
                else:
                    y = self.y[(j, k, close)] = self._var(f"y{len(self.y)}", 0, 1)
                    self.m += y >= held[0] + held[1] - 1
                    terms.append(y)
            if const + len(terms) > cap - 1:
                self.m += pulp.lpSum(terms) + const <= cap - 1

    # -- warm start, solve, read back -------------------------------------------------
    def start_from(self, orders: dict[Position, list[Op]], sim) -> None:
        """Initial values from a simulated incumbent (CBC's MIP start)."""
        start = {op: s / self.unit for _, op, s, _ in sim.ops if op in self.S}
        for op, var in self.S.items():
            _initial(var, start[op])
        position = {op: i for order in orders.values() for i, op in enumerate(order)}
        for (a, b), x in self.x.items():
            x.setInitialValue(1 if position[a] < position[b] else 0)
        value = lambda e: e if isinstance(e, int) else e.value()  # noqa: E731
        for (j, k, close), y in self.y.items():
            y.setInitialValue(max(0, value(self.order_expr(j, k)) + value(self.order_expr(k, j._replace(kind=close))) - 1))
        for s, g in self.G.items():
            _initial(g, max(e for _, op, _, e in sim.ops if op.stage == s and op in self.S) / self.unit)
        _initial(self.C, sim.iteration_time / self.unit)

    def run(self, time_limit_s: float) -> tuple[str | None, float, float]:
        """(status or None when CBC found no solution, objective, CBC's bound), in seconds."""
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "cbc.log")
            self.m.solve(cbc_solver(time_limit_s, log))
            with open(log) as f:
                text = f.read()
        if self.m.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or self.C.value() is None:
            return None, math.inf, _parse_bound(text) * self.unit
        objective = self.C.value() * self.unit
        proved = self.m.sol_status == pulp.LpSolutionOptimal  # CBC's "Optimal" (vs "Stopped on time")
        bound = objective if proved else _parse_bound(text) * self.unit
        return ("optimal" if proved else "feasible"), objective, bound

    def orders(self) -> dict[Position, list[Op]]:
        """Each worker's ops by start time; ties (zero-length ops) in a dependency-respecting order."""
        return {pos: sorted(wops, key=lambda o: (round(self.S[o].value(), 9), self.rank[o]))
                for pos, wops in self.by_worker.items()}


def _paired(a: Op, b: Op) -> bool:
    """Two Ws of different pipelines on one worker: the same length, inputs from their worker's
    own Bs and nothing waiting on them but the sync, so swapping two of them changes no time.
    Some optimal order therefore runs a worker's Ws in the order of their Bs; the model keeps
    only such orders (x_{W_a W_b} = x_{B_a B_b}), which removes those binaries."""
    return a.kind == b.kind == W and a.pipeline != b.pipeline


def _ws_in_b_order(orders: dict[Position, list[Op]]) -> dict[Position, list[Op]]:
    """The same orders with each worker's W slots refilled in the order of its Bs (see _paired)."""
    out = {}
    for pos, order in orders.items():
        ws = iter([op._replace(kind=W) for op in order if op.kind == B])
        out[pos] = [next(ws) if op.kind == W else op for op in order]
    return out


def _initial(var: pulp.LpVariable, value: float) -> None:
    """A MIP-start value, clamped into the variable's bounds (they differ by rounding only)."""
    low = -math.inf if var.lowBound is None else var.lowBound
    high = math.inf if var.upBound is None else var.upBound
    var.setInitialValue(min(max(value, low), high))


def variable(problem, name: str, low, high, cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A variable of `problem` (pulp >= 3.3 attaches it; LpVariable(...) alone is deprecated there)."""
    if hasattr(problem, "add_variable"):
        return problem.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


def cbc_solver(time_limit_s: float, log_path: str | None):
    # pulp 3 deprecates PULP_CBC_CMD; its bundled binary is the same CBC run through COIN_CMD.
    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)
    if path is None or not os.path.exists(path):
        path = None  # a CBC on PATH (pulp[cbc])
    return pulp.COIN_CMD(path=path, msg=False, timeLimit=time_limit_s, warmStart=True, logPath=log_path)


def _parse_bound(log: str) -> float:
    """CBC's best bound: its last 'best possible' progress figure or its closing 'Lower bound:'
    line, whichever is higher, each lowered by half a unit of its last printed digit (CBC
    rounds them, the closing one to a few digits). 0 when CBC printed neither."""
    found = re.findall(r"best possible ([-+0-9.eE]+)", log)[-1:]
    found += re.findall(r"^Lower bound:\s*([-+0-9.eE]+)", log, re.MULTILINE)[-1:]
    return max((_round_down(text) for text in found), default=0.0)


def _round_down(text: str) -> float:
    """The least value that CBC could have printed as `text`."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(text) - 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def _obeys(problem: PlanningProblem, orders: dict[Position, list[Op]], sim=None) -> bool:
    """Whether `orders` lies in the MILP's space: each (kind, pipeline) in micro-batch order on
    every worker, its own chain (releases) in fault-free order, and the stash and deferral caps kept."""
    for pos, order in orders.items():
        mine = problem.own_chain(pos)
        if mine is not None:
            members = set(mine)
            if [op for op in order if op in members] != mine:
                return False
        last = {}
        for op in order:
            if last.get((op.kind, op.pipeline), -1) > op.microbatch:
                return False
            last[(op.kind, op.pipeline)] = op.microbatch
        held, deferred = stash_peaks(order)
        if held > problem.stash_cap(pos) or (problem.decoupled and deferred > problem.defer_cap(pos)):
            return False
    return True


def _checked_time(problem: PlanningProblem, orders: dict[Position, list[Op]]) -> float | None:
    """Simulated time of orders read off a solution, None when they do not run or break a cap."""
    try:
        sim = evaluate(problem, orders)
    except ScheduleError:
        return None
    return sim.iteration_time if _obeys(problem, orders, sim) else None
