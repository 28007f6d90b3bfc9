"""Execute one iteration of a plan on real tensors.

`WorkerExecutor` runs one worker's ops (F, B, W, BW, OPT, and its part in gradient syncs) on
that worker's own state (OPT steps through the replica's StepUndo, so that an iteration a
failure abandons after the step can be undone: ftbench.engine.undo); everything it exchanges
with other workers goes through a `Transport` (ftbench.engine.transport), so a `dist` backend
(one process per worker) and Swift's logging transport reuse it unchanged.

`Executor` is the in-process driver: it runs every worker's ops in one topological order of
the schedule's dependency graph that also keeps each worker's own order, so each worker sees
exactly the sequence the schedule gives it (that sequence is what decides gradient-
accumulation order, hence the numerics).

Losses are summed cross-entropies divided by (global batch x predicted tokens), so gradients
are normalised by the global batch and a micro-batch's contribution does not depend on which
worker, pipeline or schedule computed it.

Activation recomputation (`recompute="full"`, train.recompute): F runs without autograd and
stashes only the stage's input (and, on the last stage, the targets); B/BW first re-run the
stage's forward with autograd on that input, then backpropagate exactly as without
recomputation, so a decoupled B still records W's matmul operands (from the rebuilt graph).
The recomputed forward runs the same kernels on the same inputs, so training is bit-identical
to `recompute="none"`; the model has no dropout (models/gpt.py sets every dropout to 0), so
there is no RNG state to replay.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ftbench.costs import RECOMPUTE_MODES
from ftbench.engine.op_times import now as op_clock
from ftbench.engine.transport import ACT, GRAD, InProcessTransport, Transport
from ftbench.engine.worker import StageReplica, Worker
from ftbench.layers import GradientSync, fragment_layout, model_layers, stage_units
from ftbench.schedule import B, BW, F, OPT, RF, RSYNC, W, Op, dependency_graph, topological_order
from ftbench.models.gpt import lm_loss_sum


@dataclass
class IterationResult:
    loss: float  # the global batch's mean loss (valid when complete)
    ops_run: int
    complete: bool
    # under LocalSGD or DiLoCo: (pipeline, its last stage's mean loss over its own samples), in
    # the order the shares were summed, for a loss over fewer pipelines (finished_loss)
    outs: tuple = ()


def pipeline_share(out, pipeline: int, per_pipeline, normaliser: float):
    """LocalSGD or DiLoCo: a pipeline's own mean loss `out` as its share of the iteration's mean
    over every sample that counts."""
    return out * (per_pipeline[pipeline] / normaliser)


def finished_loss(outs, samples) -> float:
    """The iteration's mean loss over the samples that count in `samples` (IterationSamples,
    LocalSGD or DiLoCo), from the pipelines' own means `outs`, summed in their order (a
    pipeline that does not count adds 0)."""
    loss = None
    for pipeline, out in outs:
        share = pipeline_share(out, pipeline, samples.per_pipeline, samples.normaliser)
        loss = share if loss is None else loss + share
    return 0.0 if loss is None else float(loss)


def step_members(plan, sync: GradientSync, local_steps) -> tuple[int, ...]:
    """The members of a gradient sync in an iteration: none under LocalSGD or DiLoCo
    (`local_steps`, ftbench.local_sgd), where each replica steps on its own gradients."""
    return () if local_steps is not None else sync_members(plan, sync)


def sync_members(plan, sync: GradientSync) -> tuple[int, ...]:
    """The workers that step a replica of the sync's fragment, in holder (pipeline) order:
    the reduction's members and its summation order."""
    where = plan.schedule.index()
    members = []
    for d, s in sync.holders:
        w = where.get(Op(OPT, s, -1, d))
        if w is not None and w not in members:
            members.append(w)
    return tuple(members)


class WorkerExecutor:
    """One worker's side of an iteration: its ops on its own state, the rest via `transport`.
    `tokens(pipeline, microbatch)` gives a micro-batch's input ids; `recompute` is "none" or
    "full" (activation recomputation, see the module docstring)."""

    def __init__(self, worker: Worker, transport: Transport, plan, tokens, normaliser: float,
                 recompute: str = "none"):
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.worker, self.transport, self.plan = worker, transport, plan
        self.tokens, self.normaliser = tokens, normaliser
        # micro-batches whose loss counts 0: fault-free training replayed under a ledger that
        # dropped them (ftbench.engine.state.IterationSamples)
        self.dropped = getattr(tokens, "dropped", frozenset())
        # LocalSGD or DiLoCo: each pipeline's own normaliser (ftbench.engine.state.IterationSamples)
        self.per_pipeline = getattr(tokens, "per_pipeline", None)
        self.recompute = recompute == "full"
        self.outs: list = []  # LocalSGD or DiLoCo: (pipeline, own mean loss) of each last-stage forward
        self._batches: dict = {}
        self._redundant_inputs: dict = {}  # (pipeline, micro-batch) -> own output, for RF
        self._n_layers = model_layers(plan.partition)

    def _loss(self, y: torch.Tensor, targets: torch.Tensor, key) -> torch.Tensor:
        """A last stage's share of the iteration's mean loss; 0 (its gradients exactly 0, so
        a sum that includes them is the sum without them) for a micro-batch that does not count."""
        normaliser = self.normaliser if self.per_pipeline is None else (self.per_pipeline[key[0]] or 1.0)
        out = lm_loss_sum(y, targets) / normaliser
        return out * 0.0 if key in self.dropped else out

    def _share(self, out: torch.Tensor, pipeline: int) -> torch.Tensor:
        """A last stage's loss as its share of the iteration's mean over every sample that
        counts (under LocalSGD or DiLoCo, rescaled from its pipeline's own mean)."""
        share = out.detach().to(torch.float64)
        if self.per_pipeline is not None:
            self.outs.append((pipeline, share))
            share = pipeline_share(share, pipeline, self.per_pipeline, self.normaliser)
        return share

    def replica(self, pipeline: int, stage: int) -> StageReplica:
        return self.worker.replica(self.plan.layers(pipeline, stage))

    def run(self, op: Op) -> torch.Tensor | None:
        """Run one op; a last-stage forward returns its share of the loss (float64)."""
        replica = self.replica(op.pipeline, op.stage)
        if op.kind == F:
            return self._forward(op, replica)
        if op.kind in (B, BW):
            self._backward(op, replica, deferred=op.kind == B)
        elif op.kind == W:
            replica.store.flush((op.pipeline, op.microbatch))
        elif op.kind == OPT:
            replica.undo.step()  # records the step (its gradient), so an abandoned iteration can undo it
            self._send_to_redundant(op, replica)
            replica.optimizer.zero_grad(set_to_none=True)
        elif op.kind == RF:
            self._redundant_forward(op, replica)
        elif op.kind == RSYNC:
            self._refresh_redundant(op, replica)
        else:
            raise ValueError(f"unknown op {op}")
        return None

    # -- Bamboo's redundant copies (ftbench.schedule: RF, RSYNC) ---------------------------
    def _runs_here(self, op: Op) -> bool:
        return self.plan.schedule.index().get(op) == self.worker.id

    def _units(self, op: Op) -> tuple[int, int]:
        return stage_units(self.plan.layers(op.pipeline, op.stage), op.stage == 0,
                           self.plan.is_last_stage(op.pipeline, op.stage), self._n_layers)

    def _redundant_forward(self, op: Op, replica: StageReplica) -> None:
        """Stage s's forward on the redundant copy, on this worker's own output of stage s-1;
        its activations stay in the copy's stash until the iteration ends (RSYNC clears them)."""
        key = (op.pipeline, op.microbatch)
        if op.stage == 0:
            x = self.tokens(*key)
        else:
            x = self._redundant_inputs.pop(key)
        last = self.plan.is_last_stage(op.pipeline, op.stage)
        if self.recompute:  # as F: only the input is kept, a backward would rebuild the rest
            with torch.no_grad():
                replica.module(x)
            replica.stash[("redundant",) + key] = (x, None, x.numel() * x.element_size())
        else:
            saved = _SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                y = replica.module(x.detach().requires_grad_() if op.stage > 0 else x)
                out = self._loss(y, self.tokens(*key), key) if last else y
            replica.stash[("redundant",) + key] = (x, out, saved.bytes)
        self._note_activations()

    def _send_to_redundant(self, op: Op, replica: StageReplica) -> None:
        """After the step, send the stage's weights and optimizer state to the worker holding
        its redundant copy (Bamboo keeps the copy in step this way), with the gradients the
        step applied: the copy's undo records the refresh as that step, so a failure later in
        the iteration takes the copy back to the iteration's start like the original."""
        refresh = Op(RSYNC, op.stage, op.microbatch, op.pipeline)
        dst = self.plan.schedule.index().get(refresh)
        if dst is not None:
            shard = replica.shard()
            shard["grad"] = {n: p.grad.detach().clone() for n, p in replica.named_parameters().items()
                             if p.grad is not None}
            self.transport.send_state(self._units(op), shard, self.worker.id, dst)

    def _refresh_redundant(self, op: Op, replica: StageReplica) -> None:
        src = self._peer(Op(OPT, op.stage, op.microbatch, op.pipeline))
        shard = self.transport.receive_state(self._units(op), src, self.worker.id)
        replica.stash.clear()  # the redundant forwards' activations live until the iteration ends
        replica.load(shard["model"], shard["optim"], grads=shard.get("grad"))

    # -- gradient syncs -----------------------------------------------------------------
    def _sync_replica(self, sync: GradientSync) -> StageReplica:
        where = self.plan.schedule.index()
        for d, s in sync.holders:
            if where.get(Op(OPT, s, -1, d)) == self.worker.id:
                return self.replica(d, s)
        raise ValueError(f"worker {self.worker.id} steps no holder of {sync}")

    def reduce_start(self, sync: GradientSync, members: tuple[int, ...]) -> None:
        if len(members) < 2:
            return  # nobody to sum with
        params = self._sync_replica(sync).fragment_parameters(sync.units, self._n_layers)
        self.transport.reduce_start(sync, self.worker.id, members, [p.grad for p in params])

    def reduce_wait(self, sync: GradientSync, members: tuple[int, ...]) -> None:
        if len(members) < 2:
            return
        params = self._sync_replica(sync).fragment_parameters(sync.units, self._n_layers)
        for p, total in zip(params, self.transport.reduce_wait(sync, self.worker.id)):
            if total is not None:
                p.grad = total

    # -- ops ----------------------------------------------------------------------------
    def _peer(self, op: Op) -> int:
        return self.plan.schedule.worker_of(op)

    def _forward(self, op: Op, replica: StageReplica) -> torch.Tensor | None:
        key = (op.pipeline, op.microbatch)
        last = self.plan.is_last_stage(op.pipeline, op.stage)
        if key not in self._batches and (op.stage == 0 or last):
            self._batches[key] = self.tokens(*key)
        if op.stage == 0:
            x = self._batches[key]
        else:
            src = self._peer(Op(F, op.stage - 1, op.microbatch, op.pipeline))
            x = self.transport.receive((ACT, op.pipeline, op.stage - 1, op.microbatch), src, self.worker.id)
        if self.recompute:
            # Keep only the input (and the targets): the backward rebuilds the rest.
            with torch.no_grad():
                y = replica.module(x)
                out = self._loss(y, self._batches[key], key) if last else y
            x = x.detach()
            replica.stash[key] = (x, self._batches[key] if last else None, x.numel() * x.element_size())
        else:
            if op.stage > 0:
                x.requires_grad_()
            saved = _SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                y = replica.module(x)
                out = self._loss(y, self._batches[key], key) if last else y
            replica.stash[key] = (x, out, saved.bytes)
        self._note_activations()
        if last:
            return self._share(out, op.pipeline)
        if self._runs_here(Op(RF, op.stage + 1, op.microbatch, op.pipeline)):
            self._redundant_inputs[key] = y.detach()  # this worker's redundant forward of the next stage
        dst = self._peer(Op(F, op.stage + 1, op.microbatch, op.pipeline))
        self.transport.send((ACT, op.pipeline, op.stage, op.microbatch), y.detach(), self.worker.id, dst)
        return None

    def _note_activations(self, transient: int = 0) -> None:
        """Track the worker's peak of stashed activations (plus a backward's rebuilt ones)."""
        stashed = sum(entry[2] for r in self.worker.replicas.values() for entry in r.stash.values())
        self.worker.peak_activation_bytes = max(self.worker.peak_activation_bytes, stashed + transient)

    def _recompute(self, op: Op, replica: StageReplica, key) -> tuple[torch.Tensor, torch.Tensor]:
        """Re-run the stage's forward with autograd on the stashed input: (input leaf, output or loss)."""
        x, targets, _ = replica.stash[key]
        if op.stage > 0:
            x = x.detach().requires_grad_()
        saved = _SavedBytes()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            y = replica.module(x)
            out = self._loss(y, targets, key) if targets is not None else y
        self._note_activations(saved.bytes)  # the rebuilt activations live until this backward ends
        return x, out

    def _backward(self, op: Op, replica: StageReplica, deferred: bool) -> None:
        key = (op.pipeline, op.microbatch)
        schedule = self.plan.schedule
        if self.recompute:
            x, out = self._recompute(op, replica, key)
            del replica.stash[key]
        else:
            x, out, _ = replica.stash.pop(key)
        grad = None
        if out.dim() != 0:
            src = self._peer(schedule.backward_input_op(op.stage + 1, op.microbatch, op.pipeline))
            grad = self.transport.receive((GRAD, op.pipeline, op.stage, op.microbatch), src, self.worker.id)
        with replica.store.defer(key) if deferred else nullcontext():
            torch.autograd.backward(out, grad)
        if op.stage > 0:
            dst = self._peer(schedule.backward_input_op(op.stage - 1, op.microbatch, op.pipeline))
            self.transport.send((GRAD, op.pipeline, op.stage - 1, op.microbatch), x.grad, self.worker.id, dst)


class Executor:
    """The in-process driver: runs plans on a set of workers in one topological order."""

    def __init__(self, workers: dict[int, Worker], transport: Transport | None = None, recompute: str = "none",
                 local_steps=None):
        self.workers = workers
        self.local_steps = local_steps  # LocalSGD or DiLoCo: no gradient sums (ftbench.local_sgd)
        self.transport = transport if transport is not None else InProcessTransport()
        self.recompute = recompute  # train.recompute, for every WorkerExecutor
        self._graphs: dict[int, tuple] = {}  # id(plan) -> (plan, deps, order, members)

    def graph(self, plan) -> tuple[dict, list, dict]:
        """(dependency graph, topological order, sync -> members) of a plan, built once."""
        hit = self._graphs.get(id(plan))
        if hit is None or hit[0] is not plan:
            deps = dependency_graph(plan.schedule, layout=fragment_layout(plan.schedule.stages, plan.partition))
            order = topological_order(plan.schedule, deps)
            members = {n: step_members(plan, n, self.local_steps) for n in deps if isinstance(n, GradientSync)}
            hit = self._graphs[id(plan)] = (plan, deps, order, members)
        return hit[1:]

    def order(self, plan) -> list:
        return self.graph(plan)[1]

    def replay(self, plan, tokens, normaliser: float, workers, transport: Transport, chunks: int = 1) -> None:
        """Swift's replay of one iteration by `workers` alone (`transport`, a ReplayTransport,
        gives them from the log what other workers sent): their ops in the iteration's order,
        the gradient syncs among them and their optimizer steps, so a serial replay repeats
        the original arithmetic exactly. With `chunks` > 1 (parallel recovery) each pipeline's
        micro-batches are split into that many contiguous groups, each accumulated on its own
        gradient buffers as a helper worker would, and the groups' gradients are summed in
        order before the syncs and steps: the serial replay's result to float rounding."""
        deps, order, members = self.graph(plan)
        where = plan.schedule.index()
        workers = frozenset(workers)
        mine = []
        for node in order:
            if isinstance(node, GradientSync):
                inside = workers.intersection(members[node])
                if inside and len(inside) < len(members[node]):
                    raise ValueError(f"{node} sums over {members[node]}, of which only {sorted(inside)} replay")
                if inside:
                    mine.append(node)
            elif where[node] in workers:
                mine.append(node)
        execs = {w: WorkerExecutor(self.workers[w], transport, plan, tokens, normaliser, self.recompute)
                 for w in workers}

        def run(node) -> None:
            if isinstance(node, GradientSync):
                group = members[node]
                for w in group:
                    execs[w].reduce_start(node, group)
                for w in group:
                    execs[w].reduce_wait(node, group)
            else:
                execs[where[node]].run(node)

        if chunks <= 1:
            for node in mine:
                run(node)
            return
        counts = plan.schedule.microbatches
        params = [p for w in sorted(workers) for r in self.workers[w].replicas.values() for p in r.module.parameters()]
        parts = []  # per chunk, per parameter: its gradient over the chunk's micro-batches
        for k in range(chunks):
            for node in mine:
                if not isinstance(node, GradientSync) and in_chunk(node, k, chunks, counts):
                    run(node)
            parts.append(take_grads(params))
        sum_chunks(params, parts)
        for node in mine:
            if isinstance(node, GradientSync) or node.kind == OPT:
                run(node)

    def run(self, plan, tokens, normaliser: float, completed: frozenset | None = None,
            transport: Transport | None = None, timer=None) -> IterationResult:
        """Run the plan's iteration. With `completed` (a set of ops closed under dependencies
        and each worker's order: where a failure strikes), run exactly those ops, and the
        gradient syncs that some completed OPT waits for; the result is then incomplete.
        `timer` (ftbench.engine.op_times.OpTimer) gets every op's start and end."""
        deps, order, members = self.graph(plan)
        if completed is not None:
            _check_closed(plan, deps, completed, members)
        where = plan.schedule.index()
        transport = transport if transport is not None else self.transport
        execs = {w: WorkerExecutor(self.workers[w], transport, plan, tokens, normaliser, self.recompute)
                 for w in plan.workers}
        needed = None if completed is None else {s for op in completed if op.kind == OPT for s in deps[op]}
        loss = None  # summed where the shares are (a GPU's loss is read once, at the end)
        outs = []
        ran = 0
        for node in order:
            if isinstance(node, GradientSync):
                if needed is None or node in needed:
                    group = members[node]
                    for w in group:  # every member contributes, then every member collects
                        execs[w].reduce_start(node, group)
                    for w in group:
                        execs[w].reduce_wait(node, group)
                continue
            if completed is not None and node not in completed:
                continue
            started = op_clock() if timer is not None else 0.0
            share = execs[where[node]].run(node)
            if timer is not None:
                timer.record(where[node], node, started, op_clock())
            if share is not None:
                share = share.to(torch.float64)
                loss = share if loss is None else loss + share
                mine = execs[where[node]].outs
                if mine:
                    outs.append(mine.pop())
            ran += 1
        if completed is not None:
            return IterationResult(float("nan"), ran, False, tuple(outs))
        return IterationResult(0.0 if loss is None else float(loss), ran, True, tuple(outs))


def in_chunk(op: Op, k: int, chunks: int, counts) -> bool:
    """Parallel recovery: whether `op` (not a step) works on the k-th of `chunks` contiguous
    shares of its pipeline's micro-batches (`counts` per pipeline)."""
    n = counts[op.pipeline]
    return op.kind != OPT and k * n // chunks <= op.microbatch < (k + 1) * n // chunks


def take_grads(params) -> list:
    """The parameters' gradients, leaving them empty for the next share's accumulation."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def sum_chunks(params, parts: list[list]) -> None:
    """Each parameter's gradient: the shares' gradients summed in share order (a fixed order,
    so every backend that splits a replay gets the same bits)."""
    for i, p in enumerate(params):
        present = [part[i] for part in parts if part[i] is not None]
        if present:
            total = present[0].clone()
            for g in present[1:]:
                total.add_(g)
            p.grad = total


def _check_closed(plan, deps: dict, completed, members: dict) -> None:
    """A failure point must be a state the ops could reach: every op's producers and its
    worker's earlier ops are in it (a sync counts when all its inputs are; one with no
    `members`, under LocalSGD or DiLoCo, ties nothing)."""
    for ops in plan.schedule.ops.values():
        for before, op in zip(ops, ops[1:]):
            if op in completed and before not in completed:
                raise ValueError(f"{op} is completed but its worker's earlier {before} is not")
    for op in completed:
        for d in deps[op]:
            if isinstance(d, GradientSync) and not members[d]:
                continue  # LocalSGD or DiLoCo: no sum, each replica steps on its own gradients
            missing = [x for x in deps[d] if x not in completed] if isinstance(d, GradientSync) \
                else ([] if d in completed else [d])
            if missing:
                raise ValueError(f"{op} is completed but {missing[0]} it waits for is not")


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
