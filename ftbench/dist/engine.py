"""The `dist` backend in one process: this rank's worker, its ops, and the run loop's protocol.

`DistEngine` holds only this process's worker (its replicas, built from the same initial
weights the local backend builds) and runs that worker's ops of the plan through the same
`WorkerExecutor` the local backend uses, with a `DistTransport` underneath. Its op order is
the plan's global topological order (the local driver's) filtered to this worker: the
worker's own order is kept, every gradient sum it takes part in starts right after its own
last contribution and is waited for just before the optimizer step that needs it, and
because every rank follows one global order no wait can close a cycle.

The iteration's loss is every last-stage forward's share, summed in the global order (the
local driver's order, so the float64 sum is the same bit for bit): each rank puts its shares
at their positions of one vector, zeros elsewhere, and one all-reduce of the vector hands
every rank all of them. The same vector carries each rank's iteration and plan fingerprint,
so ranks whose run loops disagree stop with an error instead of exchanging wrong tensors.

`DistBackend` adapts the engine to the run loop's `Backend` protocol (ftbench.loop). It
holds no strategy logic. This slice trains fault-free: strikes and recovery actions arrive
with real failures (issue 12).
"""
from __future__ import annotations

import time

import torch

from ftbench.actions import FILE, MEMORY, SNAPSHOT
from ftbench.dist.transport import DistError, DistTransport, plan_crc
from ftbench.engine.executor import WorkerExecutor, sync_members
from ftbench.engine.worker import StageReplica, Worker
from ftbench.layers import GradientSync, fragment_layout, model_layers
from ftbench.models.data import batch
from ftbench.models.gpt import build_stage
from ftbench.engine.local import fragment_writers
from ftbench.recovery_costs import SaveCost
from ftbench.schedule import F, OPT, dependency_graph, topological_order


class DistEngine:
    def __init__(self, ctx, data, lr: float, weight_decay: float, dtype: torch.dtype, transport: DistTransport,
                 device: torch.device, store=None, recompute: str = "none"):
        self.ctx, self.data, self.lr, self.weight_decay = ctx, data, lr, weight_decay
        self.recompute = recompute  # train.recompute, as the local backend's executor takes it
        self.dtype, self.transport, self.device, self.store = dtype, transport, device, store
        self.rank = transport.rank
        self.worker: Worker | None = None
        self.plan = None
        self._steps = None  # (plan key, steps, loss slots, members)
        self.peak_memory = 0

    # -- state ----------------------------------------------------------------------------
    def build(self, plan) -> None:
        if self.worker is not None:
            self.worker.destroy()
        self.worker = None
        self.plan = None
        self.adopt(plan)

    def adopt(self, plan) -> None:
        """Continue with `plan`: this rank's worker keeps the replicas it still holds and
        builds those it newly holds from the initial weights (as LocalEngine.adopt does)."""
        self.transport.prepare(plan)
        me = self.transport.worker
        if me is None:
            if self.worker is not None:
                self.worker.destroy()
            self.worker = None
        else:
            if self.worker is None or not self.worker.alive or self.worker.id != me:
                self.worker = Worker(me)
            wanted = {plan.layers(d, s): (d, s) for d, s in plan.holds.get(me, ())}
            for layers in [k for k in self.worker.replicas if k not in wanted]:
                self.worker.replicas.pop(layers).destroy()
            for layers, (d, s) in wanted.items():
                if layers not in self.worker.replicas:
                    module = build_stage(self.ctx.spec, self.ctx.seed, *layers, s == 0, plan.is_last_stage(d, s))
                    self.worker.replicas[layers] = StageReplica(s, module.to(device=self.device, dtype=self.dtype),
                                                                self.lr, self.weight_decay)
        self.plan = plan

    # -- one iteration ----------------------------------------------------------------------
    def _plan_steps(self, plan):
        """This worker's part of the global order: ("start", sync) when a sum it takes part in
        can start, ("op", op, syncs to wait for first); the position of every loss share."""
        key = plan.key()
        if self._steps is not None and self._steps[0] == key:
            return self._steps[1:]
        deps = dependency_graph(plan.schedule, layout=fragment_layout(plan.schedule.stages, plan.partition))
        order = topological_order(plan.schedule, deps)
        members = {n: sync_members(plan, n) for n in deps if isinstance(n, GradientSync)}
        where = plan.schedule.index()
        me = self.transport.worker
        steps, slots = [], {}
        for node in order:
            if isinstance(node, GradientSync):
                if me in members[node]:
                    steps.append(("start", node))
                continue
            if node.kind == F and plan.is_last_stage(node.pipeline, node.stage):
                slots[node] = len(slots)
            if where[node] == me:
                waits = [d for d in deps[node] if isinstance(d, GradientSync)] if node.kind == OPT else []
                steps.append(("op", node, waits))
        self._steps = (key, steps, slots, members)
        return steps, slots, members

    def run_iteration(self, plan, iteration: int) -> float:
        if self.plan is not plan:
            self.adopt(plan)
        steps, slots, members = self._plan_steps(plan)
        schedule = plan.schedule
        offsets = [sum(schedule.microbatches[:p]) for p in range(len(schedule.microbatches))]
        b = self.ctx.microbatch_size

        def tokens(pipeline: int, microbatch: int) -> torch.Tensor:
            first = (offsets[pipeline] + microbatch) * b  # as LocalEngine.run_iteration: fixed by (seed, i)
            return batch(self.data, iteration, range(first, first + b)).to(self.device)

        normaliser = float(self.ctx.global_batch * (self.ctx.seq_len - 1))
        world = self.transport.world
        vector = torch.zeros(len(slots) + 2 * world, dtype=torch.float64, device=self.device)
        if self.worker is not None:
            extra = {} if self.recompute == "none" else {"recompute": self.recompute}
            executor = WorkerExecutor(self.worker, self.transport, plan, tokens, normaliser, **extra)
            for step in steps:
                if step[0] == "start":
                    executor.reduce_start(step[1], members[step[1]])
                    continue
                _, op, waits = step
                for sync in waits:
                    executor.reduce_wait(sync, members[sync])
                share = executor.run(op)
                if share is not None:
                    vector[slots[op]] = share
            self.transport.flush_sends()
            self._track_memory()
        vector[len(slots) + self.rank] = iteration + 1
        vector[len(slots) + world + self.rank] = plan_crc(plan)
        self.transport.all_sum(vector, f"end iteration {iteration} with every rank (the loss sum)")
        marks = vector[len(slots):].tolist()
        if len(set(marks[:world])) != 1 or len(set(marks[world:])) != 1:
            raise DistError(f"the ranks' run loops disagree at iteration {iteration}: iterations "
                            f"{[int(m) - 1 for m in marks[:world]]}, plan fingerprints {[int(m) for m in marks[world:]]}")
        loss = torch.zeros((), dtype=torch.float64)
        for share in vector[:len(slots)].cpu():
            loss += share  # the global order, as the local driver adds
        return float(loss)

    def _track_memory(self) -> None:
        state = sum(r.state_bytes() for r in self.worker.replicas.values())
        self.peak_memory = max(self.peak_memory, state + self.worker.peak_activation_bytes)

    # -- checkpoints and results ------------------------------------------------------------
    def my_shards(self, plan) -> dict:
        n = model_layers(plan.partition)
        return {name: _on_cpu(self.worker.replica(layers).shard(units, n))
                for name, w, layers, units in fragment_writers(plan) if w == self.transport.worker}

    def commit(self, iteration: int) -> None:
        if self.worker is not None:
            for replica in self.worker.replicas.values():
                replica.commit = {"iteration": iteration, "shard": replica.shard()}

    def gather_final_state(self) -> dict | None:
        """Rank 0: the trained model (Hugging Face names), after checking that every replica
        of every parameter, on every rank, holds the same weights. Other ranks: None."""
        import torch.distributed as dist

        mine = {}
        if self.worker is not None:
            for layers, replica in self.worker.replicas.items():
                mine[(self.worker.id, layers)] = {k: v.detach().cpu() for k, v in replica.named_parameters().items()}
        gathered = [None] * self.transport.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        state: dict = {}
        for part in gathered:
            for (w, layers), params in part.items():
                for name, p in params.items():
                    if name in state and not torch.equal(state[name], p):
                        raise RuntimeError(f"replicas of {name} diverged (worker {w}, layers {layers})")
                    state.setdefault(name, p)
        return state


def _on_cpu(obj):
    """A shard with its tensors in host memory (what crosses processes as a pickled object)."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    return obj


class DistBackend:
    """The run loop's Backend protocol for one rank of a dist job. Every rank runs the same
    loop and calls these methods at the same points, so collectives here line up."""

    jumps = False
    cuts_ops = True

    def __init__(self, engine: DistEngine):
        self.engine = engine
        self._measured_persist = False
        self._peaks: dict[int, float] = {}

    def start(self, plan) -> None:
        self.engine.build(plan)

    def run_iteration(self, plan, iteration: int) -> float:
        return self.engine.run_iteration(plan, iteration)

    def strike(self, plan, iteration, completed, dead_workers) -> None:
        raise DistError("failures on backend=dist are not implemented yet: use failures=none")

    def perform(self, actions, old, new, iteration: int) -> int | None:
        if actions:
            raise DistError(f"recovery actions on backend=dist are not implemented yet "
                            f"({', '.join(type(a).__name__ for a in actions)})")
        self.engine.adopt(new)
        return None

    def save(self, plan, iteration: int, mode: str) -> SaveCost:
        """A checkpoint: in-memory commits stay in each process; files are written by rank 0
        from the writers' shards. Every rank returns rank 0's measured cost, so every run
        loop makes the same decisions from it."""
        import torch.distributed as dist

        engine = self.engine
        if engine.plan is not plan:
            engine.adopt(plan)
        started = time.perf_counter()
        persist, stall = 0.0, None
        if mode == MEMORY:
            engine.commit(iteration)
        elif mode in (FILE, SNAPSHOT):
            shards = engine.my_shards(plan) if engine.worker is not None else {}
            gathered = [None] * engine.transport.world if engine.rank == 0 else None
            dist.gather_object(shards, gathered, dst=0)
            if engine.rank == 0:
                merged = {k: v for part in gathered for k, v in part.items()}
                if mode == FILE:
                    engine.store.save(iteration, merged)
                else:
                    engine.store.save_async(iteration, merged)  # shard() copied: that is the snapshot
                    if not self._measured_persist:  # measure the background persist once, for tuning
                        stall = time.perf_counter() - started
                        persist = engine.store.wait().seconds
            self._measured_persist = self._measured_persist or mode == SNAPSHOT
        else:
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        cost = [time.perf_counter() - started if stall is None else stall, persist]
        dist.broadcast_object_list(cost, src=0)
        return SaveCost(*cost)

    def drop_checkpoints(self, iterations) -> None:
        if self.engine.store is not None:
            self.engine.store.discard_after_persist(iterations)

    def lose_unfinished_persist(self) -> None:
        return None  # no failures yet on dist

    def check_memory(self, plan, timeline) -> str | None:
        return None

    def peak_memory(self) -> dict[int, float]:
        return dict(self._peaks)

    def finish(self) -> None:
        import torch.distributed as dist

        if self.engine.store is not None:
            self.engine.store.wait()
        mine = {} if self.engine.worker is None else {self.engine.worker.id: self.engine.peak_memory}
        everyone = [None] * self.engine.transport.world
        dist.all_gather_object(everyone, mine)
        self._peaks = {w: v for part in everyone for w, v in part.items()}
