"""Which state moves when a plan changes in place: for every replica a worker of the new
plan holds but did not hold (with the same layers) before, a copy from a live worker that
did. Sources are spread: each copy takes the holder that sends the fewest bytes so far, so
independent copies run in parallel over different links."""
from __future__ import annotations

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
    copies = []
    for w in sorted(after):
        for key, (d, s) in sorted(after[w].items()):
            if key in before.get(w, {}) and alive(w) and kept(w):
                continue
            sources = holders.get(key)
            if not sources:
                continue  # no live holder: a restore from checkpoint must provide it
            src = min(sources, key=lambda v: (sent[v], v))
            layers, embedding, head = key
            nbytes = CHECKPOINT_BYTES_PER_PARAM * cost_model.stage(layers, embedding, head).params
            sent[src] += nbytes
            copies.append(Transfer(layers, embedding, head, src, w, nbytes))
    return tuple(copies)


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
