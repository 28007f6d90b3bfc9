"""The transport seam: a worker's executor touches only its own worker's state, and every
exchange between workers (activations, gradients, gradient sums, state copies) goes through
the transport."""
import torch

from conftest import LOCAL, compose
from ftbench.context import RunContext
from ftbench.engine.executor import WorkerExecutor
from ftbench.engine.local import LocalEngine
from ftbench.engine.transport import InProcessTransport
from ftbench.layers import GradientSync
from ftbench.schedule import F, Op
from ftbench.models.data import batch, make_source


class RecordingTransport(InProcessTransport):
    """Records every call: (method, key or sync, src, dst) with the worker making the call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def send(self, key, tensor, src, dst):
        self.calls.append(("send", key, src, dst))
        super().send(key, tensor, src, dst)

    def receive(self, key, src, dst):
        self.calls.append(("receive", key, src, dst))
        return super().receive(key, src, dst)

    def reduce_start(self, sync, worker, members, tensors):
        self.calls.append(("reduce_start", sync, worker, tuple(members)))
        super().reduce_start(sync, worker, members, tensors)

    def reduce_wait(self, sync, worker):
        self.calls.append(("reduce_wait", sync, worker, None))
        return super().reduce_wait(sync, worker)

    def send_state(self, units, shard, src, dst):
        self.calls.append(("send_state", units, src, dst))
        super().send_state(units, shard, src, dst)

    def receive_state(self, units, src, dst):
        self.calls.append(("receive_state", units, src, dst))
        return super().receive_state(units, src, dst)


def _engine(*overrides):
    cfg = compose(*LOCAL, "backend.dtype=float64", *overrides)
    ctx = RunContext.from_config(cfg)
    data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
    engine = LocalEngine(ctx, data, cfg.train.lr, 0.0, store=None, dtype="float64")
    plan = ctx.grid_plan(cfg.cluster.pp, cfg.cluster.dp)
    engine.build(plan)
    return ctx, data, engine, plan


def _drive(engine, plan, transport, tokens, normaliser):
    """A driver of its own (as a dist backend's per-process loop would be): while one worker
    runs, every other worker's state is unreachable (as if in another process)."""
    deps, order, members = engine.executor.graph(plan)
    where = plan.schedule.index()
    execs = {w: WorkerExecutor(engine.workers[w], transport, plan, tokens, normaliser) for w in plan.workers}
    hidden = {}

    def alone(w, fn):
        for v, worker in engine.workers.items():
            if v != w:
                hidden[v], worker._replicas = worker._replicas, None  # any access raises WorkerFailed
        try:
            return fn()
        finally:
            for v, replicas in hidden.items():
                engine.workers[v]._replicas = replicas
            hidden.clear()

    loss = torch.zeros((), dtype=torch.float64)
    for node in order:
        if isinstance(node, GradientSync):
            for w in members[node]:
                alone(w, lambda: execs[w].reduce_start(node, members[node]))
            for w in members[node]:
                alone(w, lambda: execs[w].reduce_wait(node, members[node]))
        else:
            share = alone(where[node], lambda: execs[where[node]].run(node))
            if share is not None:
                loss += share
    return float(loss)


def test_each_worker_reaches_only_its_own_state_and_the_transport():
    ctx, data, engine, plan = _engine("schedule=zb-h1")
    transport = RecordingTransport()
    b = ctx.microbatch_size
    offsets = [sum(plan.schedule.microbatches[:p]) for p in range(len(plan.schedule.microbatches))]

    def tokens(pipeline, microbatch):
        first = (offsets[pipeline] + microbatch) * b
        return batch(data, 0, range(first, first + b))

    normaliser = float(ctx.global_batch * (ctx.seq_len - 1))
    loss = _drive(engine, plan, transport, tokens, normaliser)
    assert not transport.mail and not transport.pending and not transport.results  # all delivered

    # The in-process driver on a fresh engine gives the same loss and weights, bit for bit.
    _, _, reference, _ = _engine("schedule=zb-h1")
    assert reference.run_iteration(0).loss == loss
    for w in plan.workers:
        (mine,), (theirs,) = engine.workers[w].replicas.values(), reference.workers[w].replicas.values()
        for (name, p), q in zip(mine.named_parameters().items(), theirs.named_parameters().values()):
            assert torch.equal(p, q), name

    # Every cross-stage edge of the schedule was one send and one receive between the right workers.
    where = plan.schedule.index()
    sends = {(k, s, d) for kind, k, s, d in transport.calls if kind == "send"}
    receives = {(k, s, d) for kind, k, s, d in transport.calls if kind == "receive"}
    expected = set()
    for (p, m) in [(p, m) for p in range(2) for m in range(plan.schedule.microbatches[p])]:
        for s in range(3):
            expected.add((("act", p, s, m), where[Op(F, s, m, p)], where[Op(F, s + 1, m, p)]))
            expected.add((("grad", p, s, m), where[plan.schedule.backward_input_op(s + 1, m, p)],
                          where[plan.schedule.backward_input_op(s, m, p)]))
    assert sends == receives == expected
    # Every stage's gradients were summed through the transport by both of its holders.
    starts = [(sync.units, w, members) for kind, sync, w, members in transport.calls if kind == "reduce_start"]
    assert sorted(starts) == sorted((sync.units, w, (sync.stage, 4 + sync.stage))
                                    for sync in engine.executor.graph(plan)[2] for w in (sync.stage, 4 + sync.stage))


def test_peer_copies_move_state_through_the_transport():
    from ftbench.actions import Transfer

    _, _, engine, plan = _engine()
    transport = engine.executor.transport = RecordingTransport()
    engine.run_iteration(0)
    stale = engine.workers[1].replica((2, 4)).module.h["2"].ln_1.weight
    stale.data.add_(1.0)  # worker 1's copy of stage 1 drifts; worker 5 holds the same layers
    engine.copy_replicas([Transfer((2, 4), False, False, 5, 1, 0.0)], plan)
    sent = [c[1:] for c in transport.calls if c[0] == "send_state"]
    received = [c[1:] for c in transport.calls if c[0] == "receive_state"]
    assert sent == received and [(src, dst) for _, src, dst in sent] == [(5, 1)] and not transport.mail
    engine.final_state()  # every replica agrees again
    assert torch.equal(stale, engine.workers[5].replica((2, 4)).module.h["2"].ln_1.weight)
