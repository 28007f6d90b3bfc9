"""Oobleck's planning (Jang et al., SOSP 2023): pipeline templates, their instantiation over
the live nodes, and the split of the global batch's micro-batches among the pipelines.

**Templates.** A template is the best pipeline over n nodes: its stages, and the layers of
each. By default (stage_per="node", the paper's layout) a node holds one stage and its g
GPUs share it as *lanes*: lane j of a pipeline is GPU j of each of its nodes, running the
stages on its own share of the pipeline's micro-batches (Oobleck shards a stage over the
node's GPUs with FSDP; this schedule IR keeps a replica whole on one GPU, so every GPU holds
the whole stage). With stage_per="gpu" each GPU takes one stage, consecutive stages of the
pipeline, which pools the node's memory as FSDP does (the artifact's planner also lets a
node divide its GPUs among stages). The layers are cut by dynamic programming over layer
ranges, minimising the slowest stage (then the sum of stage times), with every stage's
weights, gradients, Adam state and its 1F1B in-flight activations within one GPU's memory.

n0 is the fewest nodes such a cut exists for. Templates exist for every node count n0 ..
n_max = N - f*n0 (N: the job's nodes; f: the failures to survive).

**Coverage.** Any M live nodes with (f+1)*n0 <= M <= N form at least f+1 pipelines, each of
a template's size: f+1 pipelines of n0..n_max nodes can hold every total from (f+1)*n0 to
(f+1)*n_max (sizes are consecutive, so one more node at a time reaches each), and
(f+1)*n_max = (f+1)*(N - f*n0) >= N exactly when N >= (f+1)*n0, which the job must satisfy.
No pipeline of such a set can exceed n_max, since the other f need n0 each. When the model's
layers or memory rule out sizes up to n_max, `uncovered` names the counts no set reaches.

**Instantiation.** Among the sets of pipeline sizes that use every live node with at least
f+1 pipelines, the one whose batch split gives the shortest iteration wins. Oobleck
enumerates the sets; so do we when there are few, rank them by the split's continuous
optimum and split the best few exactly. When there are many (hundreds of nodes), the
candidates are the sets of one size or two adjacent sizes, and the set of highest
steady-state rate (sum of 1/slowest-stage, from a knapsack over node counts).

**Batch split.** The global batch's micro-batches are split among the pipelines to minimise
the slowest one; pipeline p with B micro-batches takes about a_p + b_p*B (1F1B: its fill and
drain, then one slowest stage per micro-batch). A MILP (pulp/CBC) for small instances; a
greedy fill, which gives each next micro-batch to the pipeline that would finish it first
(optimal for a max of non-decreasing costs), for large ones. Every pipeline gets at least one.

**At scale.** A job of 16,384 GPUs has thousands of pipelines and thousands of failures, each
of which changes one or two pipelines. The fill is computed per template, not micro-batch by
micro-batch; the rules copy only the pipelines they change; the layers copied after a
failure are looked for only in the pipelines that changed (`pipelines_layer_copies`). Each
gives exactly what its straightforward form gives (tests/test_oobleck_scale.py).
"""
from __future__ import annotations

import struct
import weakref
from collections import Counter
from bisect import bisect_left, insort
from dataclasses import dataclass
from itertools import chain, compress, count, repeat
from operator import add, and_, eq, gt, not_

from ftbench.costs import ADAM_STATE_BYTES_PER_PARAM
from ftbench.layers import stage_units
from ftbench.actions import CHECKPOINT_BYTES_PER_PARAM
from ftbench.transfers import piece, subtract_runs

STAGE_PER = ("gpu", "node")  # strategy.stage_per
MILP_MAX_PIPELINES = 24  # larger batch splits use the greedy fill (equal optimum, no solver)
MILP_TIME_LIMIT_S = 10.0
ENUMERATE_MAX_SETS = 4000
EXACT_SPLITS = 8  # sets of sizes whose batch split is computed exactly (the best by the relaxation)  # more sets of pipeline sizes than this: the knapsack picks one


@dataclass(frozen=True)
class Template:
    """The pipeline of `nodes` nodes: per stage its layer range, the time per micro-batch of each."""
    nodes: int
    partition: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]  # F + B + W of one micro-batch, per stage

    @property
    def stages(self) -> int:
        return len(self.partition)

    @property
    def fill_s(self) -> float:
        """a in a + b*B: one micro-batch through every stage, less the slowest stage counted in b."""
        return sum(self.stage_s) - max(self.stage_s)

    @property
    def per_microbatch_s(self) -> float:
        return max(self.stage_s)

    def time(self, microbatches: int) -> float:
        return self.fill_s + self.per_microbatch_s * microbatches


class Templates:
    """Templates of one model on one kind of node, made on demand and kept."""

    def __init__(self, cost_model, gpus_per_node: int, stage_per: str = "node"):
        if stage_per not in STAGE_PER:
            raise ValueError(f"stage_per must be one of {STAGE_PER}, got {stage_per!r}")
        self.cost, self.g = cost_model, gpus_per_node
        # A node's GPUs: each a stage of the pipeline (gpu), or each a *lane* running the
        # node's one stage on its own share of the pipeline's micro-batches (node).
        self.stages_per_node = gpus_per_node if stage_per == "gpu" else 1
        self.lanes = 1 if stage_per == "gpu" else gpus_per_node
        self.layers = cost_model.spec.layers
        self.memory = cost_model.memory_bytes
        self._made: dict[int, Template | None] = {}

    def get(self, nodes: int) -> Template | None:
        """The template over `nodes` nodes; None when no cut fits (too few layers or too little memory)."""
        if nodes not in self._made:
            self._made[nodes] = self._make(nodes)
        return self._made[nodes]

    @property
    def longest(self) -> int:
        """The most nodes one pipeline can take: a stage needs a layer."""
        return self.layers // self.stages_per_node

    def n0(self) -> int | None:
        """The fewest nodes whose GPUs hold the model with its optimizer state (None: no count does)."""
        for n in range(1, self.longest + 1):
            if self.get(n) is not None:
                return n
        return None

    def lanes_of(self, combo) -> list[Template]:
        """The templates of pipelines of these sizes, once per lane (what a batch split splits over)."""
        for n in set(combo):
            self.get(n)
        one = list(map(self._made.__getitem__, combo))
        return one if self.lanes == 1 else list(chain.from_iterable(map(repeat, one, repeat(self.lanes))))

    def _make(self, nodes: int) -> Template | None:
        stages = nodes * self.stages_per_node
        if not 1 <= stages <= self.layers:
            return None
        cut = _cut(self.cost, stages, self.memory)
        if cut is None:
            return None
        partition, times = cut
        return Template(nodes, partition, times)


def _stage_s(cost_model, layers, first: bool, last: bool) -> float:
    c = cost_model.stage(layers, first, last)
    return c.forward_s + c.backward_input_s + c.backward_weight_s


def stage_bytes(cost_model, layers, index: int, stages: int) -> float:
    """Peak memory of stage `index` of `stages` under 1F1B: its weights, gradients and Adam
    state, the activations of the stages - index micro-batches in flight, and (with
    recompute) the activations one backward rebuilds."""
    c = cost_model.stage(layers, index == 0, index == stages - 1)
    return ADAM_STATE_BYTES_PER_PARAM * c.params + (stages - index) * c.activation_bytes + c.recompute_bytes


def _cut(cost_model, stages: int, memory: float):
    """The layer cut of `stages` stages minimising (slowest stage, sum of stages) among those
    whose stages fit in `memory`; (partition, per-stage time) or None."""
    L = cost_model.spec.layers
    inf = (float("inf"), float("inf"))
    # best[k][j]: the best (max, sum) over cuts of layers [0, j) into stages 0..k-1
    best = [[inf] * (L + 1) for _ in range(stages + 1)]
    back = [[0] * (L + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        last = k == stages
        for j in range(k, L - (stages - k) + 1) if not last else (L,):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev[0] == inf[0]:
                    continue
                if stage_bytes(cost_model, (i, j), k - 1, stages) > memory:
                    continue
                t = _stage_s(cost_model, (i, j), k == 1, last)
                value = (max(prev[0], t), prev[1] + t)
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    if best[stages][L] == inf:
        return None
    ranges, j = [], L
    for k in range(stages, 0, -1):
        i = back[k][j]
        ranges.append((i, j))
        j = i
    partition = tuple(reversed(ranges))
    times = tuple(_stage_s(cost_model, r, k == 0, k == stages - 1) for k, r in enumerate(partition))
    return partition, times


# -- coverage ---------------------------------------------------------------------------
def template_range(n0: int, nodes: int, f: int) -> tuple[int, int]:
    """[n0, n_max] with n_max = N - f*n0."""
    return n0, nodes - f * n0


def uncovered(sizes, f: int, lo: int, hi: int) -> list[int]:
    """The live-node counts in [lo, hi] that no set of at least f+1 pipelines of `sizes` sums to."""
    sizes = sorted(set(sizes))
    reach = _reachable(tuple(sizes), f + 1, hi)
    return [m for m in range(lo, hi + 1) if not reach[m]]


def _reachable(sizes: tuple[int, ...], least: int, top: int) -> list[bool]:
    """reach[m]: some multiset of at least `least` sizes sums to m (m <= top)."""
    # count[m]: the most pipelines (capped at `least`) of a multiset summing to m; -1: none
    count = [-1] * (top + 1)
    count[0] = 0
    for m in range(1, top + 1):
        for n in sizes:
            if n <= m and count[m - n] >= 0:
                count[m] = max(count[m], min(least, count[m - n] + 1))
    return [c >= least for c in count]


# -- batch split --------------------------------------------------------------------------
def split_batch(templates: list[Template], microbatches: int, solver: str = "auto") -> tuple[int, ...] | None:
    """Micro-batches per pipeline (in the order given), minimising the slowest pipeline's time;
    None when there are fewer micro-batches than pipelines."""
    if microbatches < len(templates):
        return None
    if solver == "milp" or (solver == "auto" and len(templates) <= MILP_MAX_PIPELINES):
        return split_milp(templates, microbatches)
    return split_greedy(templates, microbatches)


def split_greedy(templates: list[Template], microbatches: int) -> tuple[int, ...]:
    """One micro-batch each, then each next one to the pipeline that would finish it earliest
    (ties: the lowest index); pipelines of the same template take turns.

    The fill hands out the M - P smallest *slots* (pipeline p's k-th micro-batch, k >= 2, at
    time a_p + b_p*k), ordered by (time, p): a pipeline's slots come in increasing time, so
    the heap of `split_greedy_heap` pops exactly them, in that order. They are found here
    without handing them out one by one (131,072 micro-batches over thousands of pipelines
    at 16,384 GPUs, after every failure): pipelines with equal (a, b) have equal slots, the
    time of the last slot handed out is found by bisection over the floats, and the slots at
    exactly that time go to the lowest indices."""
    extra = microbatches - len(templates)
    if extra <= 0:
        return (1,) * len(templates)
    ids = list(map(id, templates))
    distinct = dict.fromkeys(ids)
    # (usually a few distinct templates among thousands of pipelines: each found and counted in bulk)
    first, size = (dict(zip(ids, templates)), Counter(ids)) if len(distinct) > 64 else \
        ({i: templates[ids.index(i)] for i in distinct}, {i: ids.count(i) for i in distinct})
    lines: dict[tuple[float, float], list[int]] = {}  # (a, b) -> the ids of its templates
    for i in distinct:
        lines.setdefault((first[i].fill_s, first[i].per_microbatch_s), []).append(i)
    kinds = [(a, b, sum(map(size.__getitem__, group))) for (a, b), group in lines.items()]

    def handed(limit: float) -> int:  # slots at or before `limit`
        return sum(n * _slots_by(a, b, limit) for a, b, n in kinds)

    lo, hi = 0, _bits(max(a + b * (extra + 1) for a, b, _ in kinds))  # handed(0.0) = 0 < extra <= handed(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if handed(_float(mid)) >= extra:
            hi = mid
        else:
            lo = mid
    before, last = _float(lo), _float(hi)  # adjacent floats: the last slot handed out is at `last`
    each, tied = {}, []  # per template id: its pipelines' count so far; the ids with a slot at exactly `last`
    for (a, b), group in lines.items():
        k = _slots_by(a, b, before)
        each.update(dict.fromkeys(group, 1 + k))
        if a + b * (k + 2) == last:
            tied += group
    counts = list(map(each.__getitem__, ids))
    if tied:  # the slots at `last` still to hand out go to the lowest indices among them
        ties = sorted(chain.from_iterable(compress(range(len(ids)), map(eq, ids, repeat(i))) for i in tied))
        for p in ties[:extra - handed(before)]:
            counts[p] += 1
    return tuple(counts)


def _slots_by(a: float, b: float, limit: float) -> int:
    """How many k >= 2 have a + b*k <= limit (computed as Template.time computes it)."""
    k = max(int((limit - a) / b), 1)
    while a + b * (k + 1) <= limit:
        k += 1
    while k >= 2 and a + b * k > limit:
        k -= 1
    return k - 1


def _bits(x: float) -> int:
    """The order of a non-negative float among the floats, as an integer."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def split_greedy_heap(templates: list[Template], microbatches: int) -> tuple[int, ...]:
    """split_greedy handing out the micro-batches one at a time from a heap (the reference)."""
    import heapq

    counts = [1] * len(templates)
    heap = [(t.time(2), p) for p, t in enumerate(templates)]
    heapq.heapify(heap)
    for _ in range(microbatches - len(templates)):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (templates[p].time(counts[p] + 1), p))
    return tuple(counts)


def split_milp(templates: list[Template], microbatches: int) -> tuple[int, ...]:
    """min Z s.t. Z >= a_p + b_p*B_p, sum B_p = micro-batches, B_p >= 1 integer (pulp/CBC);
    pipelines of one template get non-increasing counts (the same pipeline, renamed)."""
    import pulp

    from ftbench.planning.milp import cbc_solver, variable

    problem = pulp.LpProblem("oobleck_batch", pulp.LpMinimize)
    z = variable(problem, "slowest", 0, None)
    b = [variable(problem, f"b{p}", 1, microbatches, pulp.LpInteger) for p in range(len(templates))]
    problem += z
    scale = max(t.per_microbatch_s for t in templates)  # times in units of the slowest stage: a well-scaled problem
    for p, t in enumerate(templates):
        problem += z >= t.fill_s / scale + (t.per_microbatch_s / scale) * b[p]
    problem += pulp.lpSum(b) == microbatches
    for p in range(1, len(templates)):
        if templates[p] == templates[p - 1]:
            problem += b[p - 1] >= b[p]
    status = problem.solve(cbc_solver(MILP_TIME_LIMIT_S, None))
    if pulp.LpStatus[status] != "Optimal":
        return split_greedy(templates, microbatches)
    counts = [int(round(v.value())) for v in b]
    greedy = split_greedy(templates, microbatches)
    # CBC's integrality tolerance can leave an equal-cost split in another order: keep the
    # fill's if it is no slower (both are optimal then; the fill's is deterministic).
    if slowest(templates, greedy) <= slowest(templates, counts) + 1e-12:
        return greedy
    return tuple(counts)


def slowest(templates: list[Template], counts) -> float:
    return max(t.time(c) for t, c in zip(templates, counts))


# -- instantiation ----------------------------------------------------------------------------
def instantiate(templates: Templates, sizes: list[int], live: int, f: int, microbatches: int):
    """The best set of pipeline sizes (largest first) using exactly `live` nodes with at least
    f+1 pipelines, each a size of `sizes`, and its batch split: (sizes, micro-batches per
    lane, templates.lanes per pipeline in order) or None."""
    sizes = sorted({n for n in sizes if templates.get(n) is not None})
    if not sizes:
        return None
    sets = candidate_sets(templates, tuple(sizes), live, f + 1, microbatches)
    # Rank by the split's continuous optimum (cheap), then split the best few exactly.
    ranked = sorted(sets, key=lambda combo: (relaxed_time(templates, combo, microbatches), -len(combo), combo))
    best = None
    for combo in ranked[:EXACT_SPLITS]:
        ts = templates.lanes_of(combo)
        counts = split_greedy(ts, microbatches)
        value = (slowest(ts, counts), -len(combo), combo)
        if best is None or value < best[0]:
            best = (value, combo, counts)
    return None if best is None else (best[1], best[2])


def relaxed_time(templates: Templates, combo: tuple[int, ...], microbatches: int) -> float:
    """The slowest pipeline's time if micro-batches could be split in fractions: Z with
    sum over pipelines of (Z - a_p) / b_p = micro-batches."""
    ts = templates.lanes_of(combo)
    rate = sum(1.0 / t.per_microbatch_s for t in ts)
    return (microbatches + sum(t.fill_s / t.per_microbatch_s for t in ts)) / rate


def candidate_sets(templates: Templates, sizes: tuple[int, ...], live: int, least: int, microbatches: int):
    """Every multiset of sizes summing to `live` with at least `least` members (at most one per
    micro-batch), when there are few; else the one of highest steady-state rate."""
    most = min(microbatches // templates.lanes, live)  # a micro-batch per lane at least
    sets = _sets(sizes, live, least, most, ENUMERATE_MAX_SETS)
    if sets is not None:
        return sets
    out = _near_uniform_sets(sizes, live, least, most)
    big = tuple(n for n in sizes if n * most >= live)  # at most `most` pipelines
    rate = {n: 1.0 / templates.get(n).per_microbatch_s for n in big}
    found = _best_rate_set(big, live, least, rate) if big else None
    return out + ([found] if found is not None and found not in out else [])


def _near_uniform_sets(sizes, total: int, least: int, most: int) -> list[tuple[int, ...]]:
    """Sets of one size, or two adjacent sizes, summing to `total`: for each size n, the
    remainder of total/n spread one node each over some pipelines (n and n+1), or the
    shortfall of ceil(total/n) pipelines taken one node each from some (n and n-1)."""
    have, out = set(sizes), []
    for n in sizes:
        k, r = divmod(total, n)
        if r == 0:
            out.append((n,) * k)
        elif r <= k and n + 1 in have:
            out.append((n + 1,) * r + (n,) * (k - r))
        up = -(-total // n)
        short = up * n - total
        if 0 < short <= up and n - 1 in have:
            out.append((n,) * (up - short) + (n - 1,) * short)
    return [c for c in dict.fromkeys(out) if least <= len(c) <= most]


def _sets(sizes, total: int, least: int, most: int, limit: int):
    """Multisets (largest first) of `sizes` summing to `total` with least..most members; None
    past `limit` of them."""
    out = []
    descending = sorted(sizes, reverse=True)

    def walk(i: int, left: int, chosen: list[int]) -> bool:
        if left == 0:
            if least <= len(chosen) <= most:
                out.append(tuple(chosen))
                if len(out) > limit:
                    return False
            return True
        if len(chosen) >= most:
            return True
        for k in range(i, len(descending)):
            n = descending[k]
            if n <= left:
                chosen.append(n)
                ok = walk(k, left - n, chosen)
                chosen.pop()
                if not ok:
                    return False
        return True

    return out if walk(0, total, []) else None


def _best_rate_set(sizes, total: int, least: int, rate: dict) -> tuple[int, ...] | None:
    """Knapsack: the multiset of sizes summing exactly to `total`, with at least `least`
    members, of highest summed rate."""
    neg = float("-inf")
    # value[m][c]: best rate for m nodes with min(members, least) = c; choice: the last size added
    value = [[neg] * (least + 1) for _ in range(total + 1)]
    choice = [[None] * (least + 1) for _ in range(total + 1)]
    value[0][0] = 0.0
    for m in range(1, total + 1):
        for n in sizes:
            if n > m:
                continue
            for c in range(least + 1):
                v = value[m - n][c]
                if v == neg:
                    continue
                c2 = min(least, c + 1)
                if v + rate[n] > value[m][c2]:
                    value[m][c2], choice[m][c2] = v + rate[n], (n, c)
    if value[total][least] == neg:
        return None
    combo, m, c = [], total, least
    while m > 0:
        n, c = choice[m][c]
        combo.append(n)
        m -= n
    return tuple(sorted(combo, reverse=True))


# -- reconfiguration ------------------------------------------------------------------------
class Unrecoverable(Exception):
    pass


def reconfigure(pipelines: list[list[int]], lost: set[int], n0: int, valid) -> tuple[list[list[int]], str, list[int]]:
    """Oobleck's rules after nodes in `lost` fail, on pipelines given as node lists (in stage
    order); `valid(n)`: a template of n nodes exists. In order: drop the lost nodes (a pipeline
    left with n0 or more takes the template of its new size); a pipeline left short **borrows**
    nodes, one at a time from the end of the largest pipeline that has more than n0 (the last
    such on ties), until it has n0 or no pipeline can lend; pipelines still short are
    **merged**, each absorbing the next short one until it has n0; a last one still short
    absorbs a whole healthy pipeline (the first).

    Where memory rules out some sizes (a longer pipeline stashes more micro-batches on its
    first stages), a pipeline of a size with no template sheds nodes from its end to the next
    size that has one; shed nodes first fill short pipelines, then wait as idle nodes.
    Returns (pipelines, the last rule used: "template", "borrow" or "merge", idle nodes);
    raises Unrecoverable when the nodes cannot form one pipeline of n0."""
    lost = set(lost)
    kept = list(pipelines)  # the pipelines given, each copied before it changes (_Changing)
    changing = _Changing(kept)
    for i in compress(count(), map(not_, map(lost.isdisjoint, kept))):  # the pipelines that lost nodes
        kept[i] = [n for n in kept[i] if n not in lost]
        changing.copied.add(i)
    if not all(kept):  # a pipeline lost every node: the others move up (copied, as the index changed)
        kept = [list(p) for p in kept if p]
        changing = _Changing(kept, set(range(len(kept))))
    if sum(map(len, kept)) < n0:
        raise Unrecoverable(f"{sum(map(len, kept))} nodes are left, fewer than one pipeline's n0 = {n0}")
    spare: list[int] = []
    sizes = list(map(len, kept))  # kept in step with `kept`
    invalid = {m for m in set(sizes) if m > n0 and not valid(m)}
    for i in compress(count(), map(invalid.__contains__, list(sizes))):  # in order, as shedding every pipeline
        _shed(changing(i), n0, valid, spare)
        sizes[i] = len(kept[i])
    rule = "template"
    for i in compress(count(), map(gt, repeat(n0), list(sizes))):  # the short pipelines, in order
        short = changing(i)
        while len(short) < n0 and spare:
            short.append(spare.pop(0))
        while len(short) < n0:
            donor = _donor(sizes, n0, valid)
            if donor is None:
                break
            short.append(changing(donor).pop())
            sizes[donor] -= 1
            rule = "borrow"
        sizes[i] = len(short)
    if min(sizes) < n0:
        kept, rule = _merge(list(map(list, kept)), n0), "merge"
        for p in kept:
            _shed(p, n0, valid, spare)  # n0 has a template: shedding always ends on one
    return kept, rule, spare


class _Changing:
    """kept[i], copied the first time it is asked for (reconfigure changes a few pipelines of
    thousands: the others stay the lists given)."""

    def __init__(self, kept: list[list[int]], copied: set[int] | None = None):
        self.kept, self.copied = kept, set() if copied is None else copied

    def __call__(self, i: int) -> list[int]:
        if i not in self.copied:
            self.kept[i] = list(self.kept[i])
            self.copied.add(i)
        return self.kept[i]


def _donor(sizes: list[int], n0: int, valid) -> int | None:
    """The pipeline that lends a node: the largest of those with more than n0 nodes whose
    size one smaller has a template, the last of equals; None if none can."""
    lend = [m for m in set(sizes) if m > n0 and valid(m - 1)]
    if not lend:
        return None
    largest = max(lend)
    return len(sizes) - 1 - sizes[::-1].index(largest)


def _shed(pipeline: list[int], n0: int, valid, spare: list[int]) -> None:
    """Move nodes from the end of `pipeline` to `spare` until its size has a template (not below n0)."""
    while len(pipeline) > n0 and not valid(len(pipeline)):
        spare.append(pipeline.pop())


def _merge(pipelines: list[list[int]], n0: int) -> list[list[int]]:
    shorts = [p for p in pipelines if len(p) < n0]
    healthy = [p for p in pipelines if len(p) >= n0]
    merged: list[list[int]] = []
    current: list[int] = []
    for p in shorts:
        current = current + p
        if len(current) >= n0:
            merged.append(current)
            current = []
    if current:  # the last short one: it absorbs a whole healthy pipeline, else the last merged one
        if healthy:
            merged.append(current + healthy.pop(0))
        else:
            merged[-1] = merged[-1] + current
    return healthy + merged


def grow(pipelines: list[list[int]], idle: list[int], n0: int, valid,
         most: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Idle (joined or shed) nodes: n0 of them together start a new pipeline (while there are
    fewer than `most`: one micro-batch each at least); fewer each go to the shortest pipeline
    whose size one larger has a template. (pipelines, still idle)."""
    pipelines = list(map(list, pipelines))
    idle = list(idle)
    while len(idle) >= n0 and (most is None or len(pipelines) < most):
        pipelines.append(idle[:n0])
        idle = idle[n0:]
    sizes = list(map(len, pipelines))
    while idle:
        room = [m for m in set(sizes) if valid(m + 1)]
        if not room:
            break
        i = sizes.index(min(room))  # the shortest with room, the first of equals
        pipelines[i].append(idle.pop(0))
        sizes[i] += 1
    return pipelines, idle


# -- re-instantiation copies ------------------------------------------------------------------
def pipelines_layer_copies(old, new, alive_nodes, cost_model):
    """ftbench.transfers.layer_copies(old, new, alive, cost_model) with alive(w) = the node of
    w (in `old`) is in `alive_nodes`, for two plans of pipelines_plan whose every worker of
    `new` is alive; None for any other pair (then layer_copies it is).

    layer_copies looks at every worker of both plans; after a failure that re-cuts one
    pipeline, only that pipeline's workers lack layers. A pipeline of `new` on the same
    workers, in the same order and with the same cut as one of `old` lacks nothing, so only
    the others' workers are looked at (those `new` was made from `old` without, when it was),
    in worker order as layer_copies takes them. A piece's source is the holder that has sent
    the fewest bytes so far, the lowest id among equals: the lowest-id live holder that has
    sent nothing, if any (from `old`'s holders of the piece's first unit, by cut and stage,
    kept sorted), else the least-sent of those that have sent. Returns (copies, unit runs no
    live worker holds)."""
    was, now = old.pipelines(), new.pipelines()
    if was is None or now is None or not alive_nodes.issuperset(new.node_of.values()):
        return None
    n = cost_model.spec.layers
    lacking = sorted(_lacking(old, new, was, now, n))
    holders = _Holders(old, was, alive_nodes, n)
    sent: dict[int, float] = {}  # bytes sent so far, by the holders that sent any
    copies, orphaned = [], []
    for w, runs in lacking:
        for a, b in runs:
            u = a
            while u < b:
                found = holders.least_sent(u, sent)
                if found is None:
                    orphaned.append((u, u + 1))
                    u += 1
                    continue
                src, hi = found
                end = min(hi, b)
                nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.unit_params((u, end))
                sent[src] = sent.get(src, 0.0) + nbytes
                copies.append(piece((u, end), n, src, w, nbytes))
                u = end
    return tuple(copies), orphaned


def _lacking(old, new, was, now, n: int):
    """(worker, the unit runs of its new stage it did not hold) of every worker of `new` that
    lacks some, skipping pipelines that `old` ran alike (the same workers in order, the same
    cut): those `new` was made from `old` without changing, or else found at once among those
    at the same index, and else by a pipeline's first worker."""
    old_holds, old_stages = old.holds, old.schedule.stages
    changed = now.changed_from(was)
    if changed is None:
        changed = compress(count(), map(not_, _alike(old, new, was, now)))
    for d in changed:
        workers, cut = now.lists[d], new.partition[d]
        held = old_holds.get(workers[0])
        if held is not None and len(held) == 1 and held[0][1] == 0:
            e = held[0][0]
            if old.partition[e] == cut and was.lists[e] == workers:
                continue
        for s, w in enumerate(workers):
            want = stage_units(cut[s], s == 0, s == len(cut) - 1, n)
            have = [stage_units(old.partition[e][t], t == 0, t == old_stages[e] - 1, n)
                    for e, t in old_holds.get(w, ())]
            runs = subtract_runs(want, have)
            if runs:
                yield w, runs


def _alike(old, new, was, now) -> list[bool]:
    """Per pipeline of `new`: whether the pipeline of `old` at its index ran on the same
    workers in the same order with the same cut."""
    k = min(len(was.lists), len(now.lists))
    same = list(map(and_, map(eq, now.lists[:k], was.lists[:k]), map(eq, new.partition[:k], old.partition[:k])))
    return same + [False] * (len(now.lists) - k)


class _Holders:
    """The live holders of each unit in a pipelines plan: per cut and stage, the workers at
    that stage of the pipelines of that cut, sorted (_holder_index). A piece's source is the
    least (bytes sent, id); a holder that has sent, or is dead, is never again the lowest of
    those that have sent nothing, so a cursor per list only moves on."""

    def __init__(self, plan, layout, alive_nodes, n: int):
        self.plan, self.alive = plan, alive_nodes
        self.index = _holder_index(layout, n)
        self.at: dict[tuple, int] = {}  # (cut, stage) -> the first position that may still be picked

    def least_sent(self, unit: int, sent: dict) -> tuple[int, int] | None:
        """(the source for a piece starting at `unit`, the end of the units it holds), or None
        when no live worker holds the unit."""
        node_of, alive, at = self.plan.node_of, self.alive, self.at
        best = None
        for cut, ranges in self.index.units.items():
            s = self.index.stage_at[cut][unit] if unit < len(self.index.stage_at[cut]) else None
            if s is None:
                continue
            workers = self.index.sorted[(cut, s)]
            i = at.get((cut, s), 0)
            while i < len(workers) and (workers[i] in sent or node_of[workers[i]] not in alive):
                i += 1
            at[(cut, s)] = i
            if i < len(workers) and (best is None or workers[i] < best[0]):
                best = (workers[i], ranges[s][1])
        if best is not None:
            return best
        # every live holder has sent something: the least (bytes, id) of them
        least = None
        for w, nbytes in sent.items():
            if node_of.get(w) in alive and w in self.plan.holds:
                for e, t in self.plan.holds[w]:
                    lo, hi = self.index.units[self.plan.partition[e]][t]
                    if lo <= unit < hi and (least is None or (nbytes, w) < least[0]):
                        least = ((nbytes, w), (w, hi))
        return None if least is None else least[1]


class _HolderIndex:
    """A pipelines plan's holders by cut and stage (see _Holders)."""

    def __init__(self, units: dict, sorted_: dict):
        self.units = units  # cut -> each stage's units
        self.sorted = sorted_  # (cut, stage) -> the workers at that stage of the pipelines of that cut, sorted
        self.stage_at = {cut: [s for s, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]
                         for cut, ranges in units.items()}  # cut -> unit -> its stage


_HOLDER_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> its _HolderIndex


def _holder_index(layout, n: int) -> _HolderIndex:
    """The holder index of a pipelines plan's layout: made from its parent's where it was
    made from an earlier plan (moving only the workers of the pipelines that changed), else
    from every pipeline."""
    found = _HOLDER_INDEXES.get(layout)
    if found is not None:
        return found
    parent = layout.parent() if layout.parent is not None else None
    earlier = _HOLDER_INDEXES.get(parent) if parent is not None else None
    if earlier is not None:
        units, lists = dict(earlier.units), {key: list(workers) for key, workers in earlier.sorted.items()}
        for d in layout.changed:
            for cut, workers, drop in ((parent.partition[d], parent.lists[d], True),
                                       (layout.partition[d], layout.lists[d], False)):
                if cut not in units:
                    units[cut] = [stage_units(layers, s == 0, s == len(cut) - 1, n) for s, layers in enumerate(cut)]
                for s, w in enumerate(workers):
                    at = lists.setdefault((cut, s), [])
                    if drop:
                        del at[bisect_left(at, w)]
                    else:
                        insort(at, w)
        for cut in [cut for cut, ranges in units.items() if not any(lists.get((cut, s)) for s in range(len(ranges)))]:
            del units[cut]  # no pipeline has this cut any more
        found = _HolderIndex(units, lists)
    else:
        ids = list(map(id, layout.partition))
        starts: dict[tuple, list[int]] = {}  # cut -> the first worker's index of each pipeline of that cut
        for i, cut in dict(zip(ids, layout.partition)).items():
            starts.setdefault(cut, []).extend(compress(layout.bounds, map(eq, ids, repeat(i))))
        units = {cut: [stage_units(layers, s == 0, s == len(cut) - 1, n) for s, layers in enumerate(cut)]
                 for cut in starts}
        workers = layout.workers
        lists = {(cut, s): sorted(map(workers.__getitem__, map(add, firsts, repeat(s))))
                 for cut, firsts in starts.items() for s in range(len(cut))}
        found = _HolderIndex(units, lists)
    _HOLDER_INDEXES[layout] = found
    return found
