"""LocalSGD's and DiLoCo's sync, performed for real (ftbench.local_sgd has the algorithm).

After the last optimizer step of a sync iteration, the replicas of each stage (one per
pipeline of the grid) meet:

1. each healing replica (its group did not train the whole window) takes the state of the
   source group's replica of the stage: weights, AdamW moments, DiLoCo's outer state;
2. each replica contributes, in pipeline order, its parameters (LocalSGD) or its pseudo-
   gradients, the last sync's parameters less its own (DiLoCo); a healing one zeros. The
   sum over the members, divided by the participants, is every member's result;
3. LocalSGD: the parameters are set to it. DiLoCo: back to the last sync's parameters, then
   the outer step, SGD with Nesterov momentum as torch.optim.SGD(nesterov=True) does it
   (buffer = momentum x buffer + delta; parameters -= lr x (delta + momentum x buffer)),
   and the result is the new last sync.

The members reduce over the engine's transport, as gradient syncs do, so local (one
process) and dist (a process per worker) run the same arithmetic in the same order: every
member ends with the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftbench.layers import Units, model_layers, stage_units
from ftbench.local_sgd import LocalSteps, groups, heal_source, stage_members


@dataclass(frozen=True)
class OuterSync:
    """One stage's sync reduction (a transport key, beside the gradient syncs')."""
    units: Units
    holders: tuple  # (pipeline, stage) in pipeline order


def new_outer_state(replica) -> dict:
    """DiLoCo's state of a replica as it starts: the last sync's parameters (its own now) and
    the outer momentum, zero."""
    params = replica.named_parameters()
    return {"backup": {n: p.detach().clone() for n, p in params.items()},
            "momentum": {n: torch.zeros_like(p) for n, p in params.items()}}


def sync(plan, steps: LocalSteps, participants: frozenset, workers: dict, transport, keep: bool = False,
         without: frozenset = frozenset()) -> None:
    """The sync after a sync iteration of `plan`: `participants`, the groups (ftbench.local_sgd.groups)
    that trained the whole window; `workers`, this process's (the others' replicas are reached
    through `transport`). With `keep`, each replica first keeps its state (`pre_sync`), so a
    death in the middle of the sync can put it back (EngineState.abandon_iteration).
    `without`: pipelines a failure cut in this iteration, which take no part."""
    of = groups(plan)
    n_layers = model_layers(plan.partition)
    source = heal_source(participants.intersection(of))
    count = len(participants.intersection(of))
    for s, members in sorted(stage_members(plan).items()):
        members = [(d, w) for d, w in members if d not in without]
        d0 = members[0][0]
        units = stage_units(plan.layers(d0, s), s == 0, plan.is_last_stage(d0, s), n_layers)
        key = OuterSync(units, tuple((d, s) for d, _ in members))
        order = tuple(w for _, w in members)
        here = [(d, w) for d, w in members if w in workers]
        if not here:
            continue
        replicas = {w: workers[w].replica(plan.layers(d, s)) for d, w in here}
        if keep:
            for replica in replicas.values():
                replica.pre_sync = replica.shard()
        src = next(w for d, w in members if of[d] == source)
        healing = [w for d, w in members if of[d] not in participants]
        _heal(units, src, healing, replicas, transport)
        if len(order) == 1:  # one replica: the sum is its own contribution (no reduction to run)
            (d, w), = here
            _apply(steps, replicas[w], _contribution(steps, replicas[w], of[d] in participants), count)
            continue
        for d, w in here:
            transport.reduce_start(key, w, order, _contribution(steps, replicas[w], of[d] in participants))
        for d, w in here:
            _apply(steps, replicas[w], transport.reduce_wait(key, w), count)


def _heal(units, src: int, healing: list[int], replicas: dict, transport) -> None:
    """Healing replicas take the source replica's whole state."""
    if not healing:
        return
    pairs = [(src, w) for w in healing]
    prepare = getattr(transport, "state_groups", None)
    if prepare is not None:
        prepare(pairs)  # dist: the point-to-point groups the copies go over
    if src in replicas:
        shard = replicas[src].shard()
        for w in healing:
            transport.send_state(units, shard, src, w)
    for w in healing:
        if w in replicas:
            got = transport.receive_state(units, src, w)
            replicas[w].load(got["model"], got["optim"], outer=got.get("outer"), keep_undo=True)
    flush = getattr(transport, "flush_state_sends", None)
    if flush is not None:
        flush()


def _contribution(steps: LocalSteps, replica, participates: bool) -> list[torch.Tensor]:
    params = list(replica.named_parameters().items())
    if not participates:
        return [torch.zeros_like(p) for _, p in params]
    if steps.algorithm == "localsgd":
        return [p.detach().clone() for _, p in params]
    backup = replica.outer["backup"]
    return [backup[n] - p.detach() for n, p in params]


def _apply(steps: LocalSteps, replica, sums: list, count: int) -> None:
    with torch.no_grad():
        for (name, p), total in zip(replica.named_parameters().items(), sums):
            mean = total / count
            if steps.algorithm == "localsgd":
                p.copy_(mean)
                continue
            outer = replica.outer
            buf = outer["momentum"][name]
            buf.mul_(steps.outer_momentum).add_(mean)
            p.copy_(outer["backup"][name])
            p.sub_(mean.add(buf, alpha=steps.outer_momentum), alpha=steps.outer_lr)
            outer["backup"][name].copy_(p)
