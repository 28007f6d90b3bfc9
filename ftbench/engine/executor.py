"""Execute one iteration of a plan on real tensors, inside one process.

The ops run in one topological order of the schedule's dependency graph that also keeps
every worker's own order, so each worker sees exactly the sequence the schedule gives it
(that sequence is what decides gradient-accumulation order, hence the numerics). A send
between workers is a `detach()`: the receiver gets the values, never the sender's graph.

Losses are summed cross-entropies divided by (global batch x predicted tokens), so gradients
are normalised by the global batch and a micro-batch's contribution does not depend on which
worker, pipeline or schedule computed it.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ftbench.engine.worker import StageReplica, Worker
from ftbench.schedule import B, BW, F, OPT, W, GradientSync, Op, dependency_graph, topological_order
from models.gpt import lm_loss_sum


@dataclass
class IterationResult:
    loss: float  # the global batch's mean loss (valid when complete)
    ops_run: int
    complete: bool


class Executor:
    """Runs plans on a set of workers. `tokens(pipeline, microbatch)` gives a micro-batch's
    input ids for the iteration being run."""

    def __init__(self, workers: dict[int, Worker]):
        self.workers = workers
        self._orders: dict[int, tuple] = {}  # id(plan) -> (plan, order)

    def order(self, plan) -> list:
        hit = self._orders.get(id(plan))
        if hit is None or hit[0] is not plan:
            order = topological_order(plan.schedule, dependency_graph(plan.schedule))
            hit = self._orders[id(plan)] = (plan, order)
        return hit[1]

    def run(self, plan, tokens, normaliser: float, stop_after: int | None = None) -> IterationResult:
        """Run the plan's iteration; with `stop_after`, stop after that many worker ops (a
        failure strikes there). Syncs are not counted: they are network, not worker, steps."""
        schedule = plan.schedule
        where = schedule.index()
        mail: dict = {}  # ("act"|"grad", pipeline, stage, microbatch) -> tensor
        batches: dict = {}
        loss = torch.zeros((), dtype=torch.float64)
        ran = 0
        for node in self.order(plan):
            if isinstance(node, GradientSync):
                self._allreduce(node, schedule)
                continue
            # A failure strikes before any stage steps: an iteration is either lost whole or
            # completed (a partially applied step is Swift's undo problem, not modelled here).
            if stop_after is not None and (ran >= stop_after or node.kind == OPT):
                return IterationResult(float("nan"), ran, False)
            worker = self.workers[where[node]]
            replica = worker.replica(node.stage)
            if node.kind == F:
                loss += self._forward(node, replica, worker, schedule, mail, batches, tokens, normaliser)
            elif node.kind in (B, BW):
                self._backward(node, replica, mail, deferred=node.kind == B)
            elif node.kind == W:
                replica.store.flush((node.pipeline, node.microbatch))
            elif node.kind == OPT:
                replica.optimizer.step()
                replica.optimizer.zero_grad(set_to_none=True)
            ran += 1
        return IterationResult(float(loss), ran, True)

    # -- ops ----------------------------------------------------------------------------
    def _forward(self, op: Op, replica: StageReplica, worker: Worker, schedule, mail, batches, tokens,
                 normaliser) -> torch.Tensor:
        key = (op.pipeline, op.microbatch)
        module = replica.module
        last = op.stage == schedule.stages[op.pipeline] - 1
        if key not in batches:
            batches[key] = tokens(*key)
        if op.stage == 0:
            x = batches[key]
        else:
            x = mail.pop(("act", op.pipeline, op.stage - 1, op.microbatch)).requires_grad_()
        saved = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            y = module(x)
            out = lm_loss_sum(y, batches[key]) / normaliser if last else y
        replica.stash[key] = (x, out, saved.bytes)
        stashed = sum(entry[2] for r in worker.replicas.values() for entry in r.stash.values())
        worker.peak_activation_bytes = max(worker.peak_activation_bytes, stashed)
        if last:
            return out.detach().to(torch.float64)
        mail[("act", op.pipeline, op.stage, op.microbatch)] = y.detach()
        return torch.zeros((), dtype=torch.float64)

    def _backward(self, op: Op, replica: StageReplica, mail, deferred: bool) -> None:
        key = (op.pipeline, op.microbatch)
        x, out, _ = replica.stash.pop(key)
        grad = None if out.dim() == 0 else mail.pop(("grad", op.pipeline, op.stage, op.microbatch))
        with replica.store.defer(key) if deferred else nullcontext():
            torch.autograd.backward(out, grad)
        if op.stage > 0:
            mail[("grad", op.pipeline, op.stage - 1, op.microbatch)] = x.grad

    def _allreduce(self, sync: GradientSync, schedule) -> None:
        """Sum the stage's gradients over its replicas, in pipeline order (deterministic),
        and give every replica the sum."""
        where = schedule.index()
        workers = []
        for p in sync.replicas:
            opt = Op(OPT, sync.stage, -1, p)
            if opt in where and where[opt] not in workers:
                workers.append(where[opt])
        replicas = [self.workers[w].replica(sync.stage) for w in workers]
        if len(replicas) < 2:
            return
        params = [list(r.module.parameters()) for r in replicas]
        for group in zip(*params):
            grads = [p.grad for p in group if p.grad is not None]
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total.add_(g)
            for p in group:
                p.grad = total.clone()


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward (the stashed activations),
    leaving out parameters, which are stored anyway."""

    def __init__(self):
        self.bytes = 0

    def pack(self, t):
        if not isinstance(t, torch.nn.Parameter):
            self.bytes += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t):
        return t
