"""Which state moves when a plan changes in place: for every replica a worker of the new
plan holds but did not hold (with the same layers) before, a copy from a live worker that
did. Sources are spread: each copy takes the holder that sends the fewest bytes so far, so
independent copies run in parallel over different links."""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import chain, compress, cycle, filterfalse, islice, repeat
from operator import eq

from ftbench.actions import Transfer
from ftbench.plan import Plan
from ftbench.actions import CHECKPOINT_BYTES_PER_PARAM


def group_copies(plan: Plan, source: int, pipelines, cost_model) -> list[Transfer]:
    """Every stage of each of `pipelines` from pipeline `source`'s replica of it (LocalSGD or
    DiLoCo, where replicas differ between syncs: a group heals from one group, ftbench.local_sgd)."""
    copies, holder = [], {pos: w for w, held in plan.holds.items() for pos in held}
    for s in range(plan.schedule.stages[source]):
        layers, first, last = plan.layers(source, s), s == 0, plan.is_last_stage(source, s)
        nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(layers, first, last).params
        copies += [Transfer(layers, first, last, holder[(source, s)], holder[(d, s)], nbytes) for d in sorted(pipelines)]
    return copies


def _replicas(plan: Plan) -> dict[int, dict[tuple, tuple[int, int]]]:
    """worker -> {(layers, embedding, head): (pipeline, stage)} of the replicas it holds."""
    out: dict[int, dict] = defaultdict(dict)
    for w, held in plan.holds.items():
        for d, s in held:
            out[w][(plan.layers(d, s), s == 0, plan.is_last_stage(d, s))] = (d, s)
    return out


def peer_copies(old: Plan, new: Plan, alive, cost_model, kept=None) -> Sequence[Transfer]:
    """The copies that give every worker of `new` the replicas it lacks, as a tuple (between
    two grids, with `kept` left out: Copies, equal to that tuple). `alive(worker)` says
    whether a worker survived; `kept(worker)` whether it still holds its replicas of `old`
    (default: every live worker does)."""
    if kept is None:
        grid = _grid_peer_copies(old, new, alive, cost_model)
        if grid is not None:
            return grid
    kept = kept or alive
    before, after = _replicas(old), _replicas(new)
    holders = defaultdict(list)
    for w, replicas in before.items():
        if alive(w) and kept(w):
            for key in replicas:
                holders[key].append(w)
    sent = defaultdict(float)
    least = _LeastSent(holders, sent)
    copies = []
    for w in sorted(after):
        for key, (d, s) in sorted(after[w].items()):
            if key in before.get(w, {}) and alive(w) and kept(w):
                continue
            if not holders.get(key):
                continue  # no live holder: a restore from checkpoint must provide it
            src = least.pick(key)
            layers, embedding, head = key
            nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(layers, embedding, head).params
            sent[src] += nbytes
            copies.append(Transfer(layers, embedding, head, src, w, nbytes))
    return tuple(copies)


class Copies(Sequence):
    """Transfers held per kind of replica (the layers of one stage), each Transfer made when
    read: a reshape of 16,384 workers copies thousands of replicas after each of thousands of
    failures, and the run's records list only the first few. Read in destination order, as
    peer_copies lists them; equal to the tuple of those Transfers."""

    def __init__(self, kinds: list[tuple], dst: list[list[int]], src: list[list[int]]):
        self.kinds = kinds  # (layers, embedding, head, nbytes) of each kind
        self.dst, self.src = dst, src  # per kind: its copies' destinations (increasing) and their sources
        self._rows: list | None = None
        self._columns: tuple | None = None

    def __len__(self) -> int:
        return sum(map(len, self.dst))

    def _merged(self):
        """(destination, kind, source) of every copy, by destination (each worker gets one at most)."""
        return heapq.merge(*map(zip, self.dst, map(repeat, range(len(self.kinds))), self.src))

    def rows(self) -> list[tuple[int, int, int]]:
        """(destination, kind, source) of every copy, in order."""
        if self._rows is None:
            self._rows = list(self._merged())
        return self._rows

    def _transfer(self, row: tuple[int, int, int]) -> Transfer:
        dst, kind, src = row
        layers, embedding, head, nbytes = self.kinds[kind]
        return Transfer(layers, embedding, head, src, dst, nbytes)

    def __iter__(self):
        return map(self._transfer, self._merged() if self._rows is None else self._rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(map(self._transfer, self.rows()[i]))
        return self._transfer(self.rows()[i])

    def columns(self) -> tuple[list[int], list[int], list[float]]:
        """(sources, destinations, bytes) of every copy, kind by kind (not in order)."""
        if self._columns is None:
            sizes = chain.from_iterable(map(repeat, (kind[3] for kind in self.kinds), map(len, self.dst)))
            self._columns = list(chain.from_iterable(self.src)), list(chain.from_iterable(self.dst)), list(sizes)
        return self._columns

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, Copies)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Copies({len(self)} transfers)"


def copy_sizes(copies) -> list[float]:
    """The bytes of each of `copies` (Transfers, or Copies), in no set order: for sums that
    do not depend on it (math.fsum)."""
    return copies.columns()[2] if isinstance(copies, Copies) else [c.nbytes for c in copies]


def _grid_peer_copies(old: Plan, new: Plan, alive, cost_model) -> Copies | None:
    """peer_copies(old, new, alive, cost_model) for two grids (Plan.grid: each worker keeps one
    replica, of its place's stage), stage by stage instead of worker by worker; None for other
    plans. A worker of `new` gets a copy unless it is a holder (a live worker that kept that
    replica in `old`); none where there is no holder (a restore from checkpoint must provide
    it). Each holder keeps one replica, so it sends only copies of that one, each the same
    bytes: picking the least-sent holder (lowest id among equals) goes round the holders in
    id order."""
    was, now = old.grid(), new.grid()
    if was is None or now is None:
        return None
    stage_keys = [_grid_stage_keys(plan, grid.pp) for plan, grid in ((old, was), (new, now))]
    if None in stage_keys:
        return None
    kinds: dict[tuple, int] = {}
    old_kind, new_kind = ([kinds.setdefault(key, len(kinds)) for key in keys] for keys in stage_keys)
    holders: list[list[int]] = [[] for _ in kinds]
    for s, k in enumerate(old_kind):
        holders[k].extend(filter(alive, was.workers[s::was.pp]))
    dst: list[list[int]] = [[] for _ in kinds]
    for s, k in enumerate(new_kind):
        if holders[k]:
            dst[k].extend(filterfalse(set(holders[k]).__contains__, now.workers[s::now.pp]))
    for held, to in zip(holders, dst):
        held.sort()
        to.sort()
    src = [list(islice(cycle(held), len(to))) for held, to in zip(holders, dst)]
    table = [(*key, CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(*key).params) for key in kinds]
    return Copies(table, dst, src)


def _grid_stage_keys(plan: Plan, pp: int) -> list[tuple] | None:
    """(layers, embedding, head) of each stage of a grid whose pipelines all cut alike."""
    partition = plan.partition
    if not partition or partition.count(partition[0]) != len(partition):
        return None
    return [(layers, s == 0, s == pp - 1) for s, layers in enumerate(partition[0][:pp])]


class _LeastSent:
    """The holder of a key that has sent the fewest bytes so far, the lowest id among equals:
    min(holders[key], key=lambda v: (sent[v], v)), from a heap per key instead of a scan (a
    reshape of 16,384 workers copies thousands of replicas, each with thousands of holders).
    Entries go stale as `sent` grows; a stale entry at the top is pushed back with its current
    count, so the top whose count is current is the minimum: a stale entry's count is never
    above its holder's current one."""

    def __init__(self, holders: dict, sent: dict):
        self.holders, self.sent, self.heaps = holders, sent, {}

    def pick(self, key) -> int:
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = [(self.sent[v], v) for v in self.holders[key]]
            heapq.heapify(heap)
        while True:
            count, v = heap[0]
            now = self.sent[v]
            if count == now:
                return v
            heapq.heapreplace(heap, (now, v))


def layer_copies(old: Plan, new: Plan, alive, cost_model) -> tuple[tuple[Transfer, ...], list[tuple[int, int]]]:
    """The copies that give every worker of `new` the layers it lacks when the plans cut the
    layers differently (Oobleck's re-instantiation): a worker keeps what it held of its new
    layers, and each missing run of layers comes in pieces from live workers that held them,
    the least loaded sender first. Returns (copies, unit runs no live worker holds)."""
    from ftbench.layers import stage_units

    n = cost_model.spec.layers
    held: dict[int, list[tuple[int, int]]] = defaultdict(list)  # live worker -> units it held
    holders_at: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # unit -> (lo, hi, worker)
    for w, replicas in old.holds.items():
        if not alive(w):
            continue
        for d, s in replicas:
            lo, hi = stage_units(old.layers(d, s), s == 0, old.is_last_stage(d, s), n)
            held[w].append((lo, hi))
            for u in range(lo, hi):
                holders_at[u].append((lo, hi, w))
    sent = defaultdict(float)
    copies, orphaned = [], []
    for w in sorted(new.holds):
        for d, s in new.holds[w]:
            want = stage_units(new.layers(d, s), s == 0, new.is_last_stage(d, s), n)
            for a, b in subtract_runs(want, held.get(w, ())):
                u = a
                while u < b:
                    sources = holders_at.get(u)
                    if not sources:
                        orphaned.append((u, u + 1))
                        u += 1
                        continue
                    _, hi, src = min(sources, key=lambda h: (sent[h[2]], h[2]))
                    end = min(hi, b)
                    nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.unit_params((u, end))
                    sent[src] += nbytes
                    copies.append(piece((u, end), n, src, w, nbytes))
                    u = end
    return tuple(copies), orphaned


def subtract_runs(units: tuple[int, int], have) -> list[tuple[int, int]]:
    """The runs of `units` outside every range in `have`."""
    runs = [units]
    for lo, hi in have:
        runs = [r for a, b in runs for r in ((a, min(b, lo)), (max(a, hi), b)) if r[0] < r[1]]
    return runs


def _columns(copies, ordered: bool) -> tuple[list[int], list[int], list[float]]:
    """(sources, destinations, bytes) of the copies: in order, or (Copies) kind by kind."""
    if not isinstance(copies, Copies):
        return [c.src for c in copies], [c.dst for c in copies], [c.nbytes for c in copies]
    if not ordered:
        return copies.columns()
    dsts, kinds, srcs = map(list, zip(*copies.rows()))
    return srcs, dsts, [copies.kinds[k][3] for k in kinds]


def _busiest_link(nodes: list[int], sizes: list[float]) -> float | None:
    """The most bytes one node's link carries when copy i goes over that of nodes[i] with
    sizes[i] bytes, each node's bytes added up in order from 0.0 (as transfer_seconds sums
    them), found by counting: where every copy over a node has one size, its sum is that size
    added once per copy, which never shrinks as copies are added, so per size the node with the
    most copies carries the most. None where a node carries copies of several sizes (the order
    of its additions would matter)."""
    if len(set(nodes)) == len(nodes):  # one copy per node: the largest
        return max(sizes)
    per_size = {size: Counter(compress(nodes, map(eq, sizes, repeat(size)))) for size in dict.fromkeys(sizes)}
    if sum(map(len, per_size.values())) != len(set(nodes)):
        return None
    most = 0.0
    for size, copies in per_size.items():
        total = 0.0
        for _ in range(max(copies.values())):
            total += size
        most = max(most, total)
    return most


def piece(units: tuple[int, int], n_layers: int, src: int, dst: int, nbytes: float) -> Transfer:
    """A Transfer of the units [lo, hi): unit 0 the embeddings, 1..L the blocks, L+1 the head."""
    lo, hi = units
    return Transfer((max(lo, 1) - 1, min(hi, n_layers + 1) - 1), lo == 0, hi == n_layers + 2, src, dst, nbytes)


def transfer_seconds(copies, node_of, cost_model) -> float:
    """Copies run in parallel, each limited by its links: a node sends and receives over its
    network link at `inter_node_gbps` (copies within a node over `intra_node_gbps` per GPU),
    so the time is that of the busiest link."""
    if not copies:
        return 0.0
    hw = cost_model.hw
    srcs, dsts, sizes = _columns(copies, ordered=False)
    sends, gets = list(map(node_of, srcs)), list(map(node_of, dsts))
    if not any(map(eq, sends, gets)):  # no copy within a node: count (in any order) instead of adding up
        out, into = _busiest_link(sends, sizes), _busiest_link(gets, sizes)
        if out is not None and into is not None:
            inter = max(out, into, 0.0) / (hw.inter_node_gbps * 1e9)
            return hw.link_latency_us * 1e-6 + max(inter, 0.0 / (hw.intra_node_gbps * 1e9))
    srcs, dsts, sizes = _columns(copies, ordered=True)
    out_bytes, in_bytes, local_bytes = defaultdict(float), defaultdict(float), defaultdict(float)
    for a, b, dst, nbytes in zip(map(node_of, srcs), map(node_of, dsts), dsts, sizes):
        if a == b:
            local_bytes[dst] += nbytes
        else:
            out_bytes[a] += nbytes
            in_bytes[b] += nbytes
    inter = max([*out_bytes.values(), *in_bytes.values(), 0.0]) / (hw.inter_node_gbps * 1e9)
    intra = max([*local_bytes.values(), 0.0]) / (hw.intra_node_gbps * 1e9)
    return hw.link_latency_us * 1e-6 + max(inter, intra)
