"""Which state moves when a plan changes in place: for every replica a worker of the new
plan holds but did not hold (with the same layers) before, a copy from a live worker that
did. Sources are spread: each copy takes the holder that sends the fewest bytes so far, so
independent copies run in parallel over different links."""
from __future__ import annotations

import heapq
from collections import defaultdict

from ftbench.actions import Transfer
from ftbench.plan import Plan
from ftbench.recovery_costs import CHECKPOINT_BYTES_PER_PARAM


def _replicas(plan: Plan) -> dict[int, dict[tuple, tuple[int, int]]]:
    """worker -> {(layers, embedding, head): (pipeline, stage)} of the replicas it holds."""
    out: dict[int, dict] = defaultdict(dict)
    for w, held in plan.holds.items():
        for d, s in held:
            out[w][(plan.layers(d, s), s == 0, plan.is_last_stage(d, s))] = (d, s)
    return out


def peer_copies(old: Plan, new: Plan, alive, cost_model, kept=None) -> tuple[Transfer, ...]:
    """The copies that give every worker of `new` the replicas it lacks. `alive(worker)` says
    whether a worker survived; `kept(worker)` whether it still holds its replicas of `old`
    (default: every live worker does)."""
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
            for a, b in _subtract(want, held.get(w, ())):
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
                    copies.append(_piece((u, end), n, src, w, nbytes))
                    u = end
    return tuple(copies), orphaned


def _subtract(units: tuple[int, int], have) -> list[tuple[int, int]]:
    """The runs of `units` outside every range in `have`."""
    runs = [units]
    for lo, hi in have:
        runs = [r for a, b in runs for r in ((a, min(b, lo)), (max(a, hi), b)) if r[0] < r[1]]
    return runs


def _piece(units: tuple[int, int], n_layers: int, src: int, dst: int, nbytes: float) -> Transfer:
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
    out_bytes, in_bytes, local_bytes = defaultdict(float), defaultdict(float), defaultdict(float)
    for c in copies:
        a, b = node_of(c.src), node_of(c.dst)
        if a == b:
            local_bytes[c.dst] += c.nbytes
        else:
            out_bytes[a] += c.nbytes
            in_bytes[b] += c.nbytes
    inter = max([*out_bytes.values(), *in_bytes.values(), 0.0]) / (hw.inter_node_gbps * 1e9)
    intra = max([*local_bytes.values(), 0.0]) / (hw.intra_node_gbps * 1e9)
    return hw.link_latency_us * 1e-6 + max(inter, intra)
