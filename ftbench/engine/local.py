"""The local backend's state: every worker of a plan inside one process, real tensors.

`LocalEngine` builds workers for a plan, runs iterations through the `Executor`, destroys
failed workers, and performs recovery actions for real: checkpoint files are written and
read, in-memory commits are copied, replacements are waited for. It holds no strategy logic.
The state mechanism it shares with the dist backend's engine (adopting a plan, an
iteration's samples, undoing an abandoned iteration, commits, memory) is
`ftbench.engine.state.EngineState`; what is its own is that every worker runs here.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import torch

from ftbench.actions import (FILE, HOST, MEMORY, NO_HOST_CHECKPOINT, SNAPSHOT)
from ftbench.checkpoint import CheckpointStore
from ftbench.engine.boundary_log import BoundaryLog, ReplayTransport, unusable_replay
from ftbench.engine.iteration_work import performing
from ftbench.engine.log_file import LogInvalid, replay_sources
from ftbench.engine.executor import Executor, IterationResult, finished_loss
from ftbench.engine.state import EngineState, load_shards, newest_commits
from ftbench.engine.worker import StageReplica
from ftbench.errors import ReplayUnavailable, ResultError
from ftbench.layers import fragment_layout, model_layers, stage_units
from ftbench.local_sgd import groups, heal_source
from ftbench.plan import checkpoint_writers
from ftbench.transfers import group_copies

DTYPES = {"float32": torch.float32, "float64": torch.float64}  # the choices of backend.dtype


def check_fits_host(ctx, replicas: int, dtype: str) -> None:
    """The local backend keeps every worker's state in this process: refuse, as an `oom`
    result, a model whose replicas plus AdamW state cannot fit in this machine's memory."""
    width = DTYPES[dtype].itemsize
    need = ctx.spec.parameters * width * (4 * replicas + 1)  # weights, gradients, 2 moments per replica + the init copy
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * have:
        raise ResultError("oom", f"the local backend would need about {need / 1e9:.1f} GB for {replicas} replicas of "
                        f"{ctx.spec.name} ({ctx.spec.parameters / 1e6:.0f}M parameters) but this machine has "
                        f"{have / 1e9:.1f} GB; use backend=sim for paper-scale models, or a smaller model "
                        "(model=gpt-tiny) or cluster.dp")


@dataclass
class Writer:
    """Who writes one fragment's part of a checkpoint (every parameter is written once)."""
    name: str  # the shard's name in the checkpoint
    worker: int
    replica: StageReplica
    units: tuple[int, int]  # ftbench.layers units; the whole replica when it is a whole stage


@dataclass
class SaveCost:
    stall_s: float  # training waits this long
    persist_s: float  # then files are written in the background this long (0 when synchronous)


class LocalEngine(EngineState):
    """Every worker of the plan, in this process (ftbench.engine.state.EngineState)."""

    def __init__(self, ctx, data, lr: float, weight_decay: float, store: CheckpointStore | None,
                 dtype: str = "float32", boundary_log: BoundaryLog | None = None):
        super().__init__(ctx, data, lr, weight_decay, DTYPES[dtype], store, boundary_log)
        self.executor = Executor(self.workers, recompute=getattr(ctx, "recompute", "none"),  # train.recompute
                                 local_steps=self.local_steps)
        self.peak_memory: dict[int, int] = {}  # worker -> peak bytes of device state (weights, grads, Adam, undo, activations)
        # worker -> peak bytes of what a strategy keeps in host memory besides: in-memory
        # commits (Elastic Horovod), snapshots until persisted (CheckFreq), the iteration's
        # boundary log until it is written (Swift)
        self.peak_host: dict[int, int] = {}

    @property
    def transport(self):
        """The executor's transport between workers, in this process."""
        return self.executor.transport

    def _holds(self, plan) -> dict:
        return plan.holds  # every worker of the plan runs here

    def run_iteration(self, iteration: int, completed: frozenset | None = None) -> IterationResult:
        """Run iteration `iteration` of the plan; with `completed` (ops closed under their
        dependencies and each worker's order: the failure point the run loop resolved from
        the plan's simulated timeline), run only those: a failure strikes there. Sends across
        the plan's logged boundaries go to the boundary log (Swift)."""
        self._commit_steps()  # nothing recorded reaches back into an earlier iteration
        log, transport = self.boundary_log, None
        works = self.iteration_work(self.plan)
        if works:
            transport = performing(works, self.executor.transport, log, iteration)
        timer = self.op_timer.begin(self.plan, iteration) if completed is None else None
        samples = self.samples(self.plan, iteration)
        if self.replayed is not None and self.local_steps is not None:
            self._rejoin_replayed(samples.present(self.plan))
        result = self.executor.run(self.plan, samples, samples.normaliser, completed, transport, timer)
        self._track_memory()  # with the steps' undo records, which live until the iteration completes
        if result.complete:
            self.after_ops(self.plan, iteration, samples)
            if timer is not None:
                timer.end()
            self._commit_steps()
            if log is not None:
                log.seal(iteration)
        return result

    def finish_without(self, iteration: int, finishing: frozenset, dead, touched: frozenset) -> float:
        """A failure cut the pipelines `touched` (RunLoop._finish_without): the ops in
        `finishing` run (the other pipelines' to their end: their local steps stand), `dead`
        lose their state, the touched pipelines' live replicas drop the iteration, and the
        iteration's sync (if due) joins the others. The loss over their samples."""
        plan = self.plan
        result = self.run_iteration(iteration, completed=finishing)
        self.destroy(dead)
        self.abandon_pipelines(plan, touched)
        samples = self.samples(plan, iteration, without=touched)
        self.after_ops(plan, iteration, samples, without=touched)
        self._commit_steps()
        return finished_loss(result.outs, samples)

    def _rejoin_replayed(self, present: frozenset) -> None:
        """Fault-free training replayed under a ledger, LocalSGD or DiLoCo: a group that trains
        again after iterations out takes every stage's state from the group the run's strategy
        healed it from (ftbench.local_sgd.heal_source over the groups that went on)."""
        last = self.window.last
        back = present - last
        if last and back:
            of = groups(self.plan)
            pipeline = {group: d for d, group in enumerate(of)}
            source = pipeline[heal_source(last & present)]
            self.copy_replicas(group_copies(self.plan, source, [pipeline[g] for g in back], self.ctx.cost_model),
                               self.plan)

    def replay(self, workers, since: int, until: int, chunks: int = 1) -> None:
        """Swift's logging-based recovery, done for real: `workers` load their replicas from
        the checkpoint of iteration `since` and replay iterations since..until-1 on the logged
        boundary tensors (ftbench.engine.boundary_log), the others waiting; with `chunks` > 1
        each iteration's micro-batches are split among helpers (Executor.replay). The
        checkpoint and every log file the replay reads are verified first: ReplayUnavailable
        when any is not usable, before any state changed."""
        workers = sorted(workers)
        replicas = [r for w in workers for r in self.workers[w].replicas.values()]
        expected = {n: tuple(p.shape) for w in self.plan.holds for r in self.workers[w].replicas.values()
                    for n, p in r.named_parameters().items()}  # the whole model's, as the store checks
        loaded = self.store.load(at_most=since, expected=expected) if self.store is not None else None
        held = 0 if loaded is None else loaded[0]
        sources = replay_sources(self.plan, workers, workers)
        if self.boundary_log is not None:
            problems = self.boundary_log.check(sources, held, until)
        else:
            problems = ["no boundary log is kept (strategy.log_dir)"] if sources else []
        unusable = unusable_replay(since, held, until, problems)
        if unusable is not None:
            raise unusable
        if loaded is None:  # iteration 0: the initial weights, re-created from the seed
            for w in workers:
                for layers in list(self.workers[w].replicas):
                    pipeline, stage = next((d, s) for d, s in self.plan.holds[w] if self.plan.layers(d, s) == layers)
                    self.workers[w].replicas[layers] = self._replica(layers, stage, self.plan.is_last_stage(pipeline, stage))
        else:
            load_shards(replicas, list(loaded[1].values()))
        try:
            for iteration in range(since, until):
                transport = ReplayTransport(self.executor.transport, self.boundary_log, workers, iteration)
                samples = self.samples(self.plan, iteration)
                self.executor.replay(self.plan, samples, samples.normaliser, workers, transport, chunks)
                self._track_memory()
                self._commit_steps()
        except LogInvalid as bad:  # changed on storage since it was checked: the replayed state is no good
            raise ReplayUnavailable(f"a boundary log stopped verifying during the replay: {bad}") from None

    def ops_per_iteration(self) -> int:
        return sum(len(ops) for ops in self.plan.schedule.ops.values())

    def abandon_iteration(self) -> int:
        """EngineState.abandon_iteration; every replica of the job is here, so this engine
        counts the job's undone steps itself."""
        undone = super().abandon_iteration()
        self.undone += undone
        return undone

    def destroy(self, worker_ids) -> None:
        for w in worker_ids:
            if w in self.workers:
                self.workers[w].destroy()

    def _record_memory(self, worker, state: int) -> None:
        """Per worker: device state and activations; in host memory, its in-memory commits and
        the iteration's boundary log until it is written."""
        host = sum(tensor_bytes(r.commit) for r in worker.replicas.values())
        if self.boundary_log is not None:
            host += self.boundary_log.buffered(worker.id)  # the iteration's log, until it is written
        self._host(worker.id, host)
        self.peak_memory[worker.id] = max(self.peak_memory.get(worker.id, 0), state + worker.peak_activation_bytes)

    def _host(self, worker: int, nbytes: int) -> None:
        self.peak_host[worker] = max(self.peak_host.get(worker, 0), nbytes)

    # -- checkpoints --------------------------------------------------------------------
    def _writers(self, plan=None) -> list[Writer]:
        """The checkpoint writers of `fragment_writers`, with the replicas they write from."""
        plan = plan or self.plan
        workers = self.workers
        # right after a failure (a save before anything is rebuilt) only live workers write
        alive = None if all(w in workers and workers[w].alive for w in plan.holds) else (
            lambda w: w in workers and workers[w].alive)
        return [Writer(name, w, workers[w].replica(layers), units)
                for name, w, layers, units in fragment_writers(plan, alive)]

    def _shard(self, writer: Writer, plan=None) -> dict:
        return writer.replica.shard(writer.units, model_layers((plan or self.plan).partition))

    def save(self, iteration: int, mode: str) -> SaveCost:
        started = time.perf_counter()
        if mode == MEMORY:
            self.commit(iteration)
            self._track_memory()  # the commits are host memory from now on
            return SaveCost(time.perf_counter() - started, 0.0)
        if mode == HOST:
            shards, home = self.host_shards()
            self.host_memory.save(iteration, shards, home, {self.plan.node_of[w] for w in self.plan.holds})
            return SaveCost(time.perf_counter() - started, 0.0)
        shards = {wr.name: self._shard(wr) for wr in self._writers()}
        if mode == FILE:
            info = self.store.save(iteration, shards)
            if self.boundary_log is not None and not getattr(info, "skipped", False):
                self.boundary_log.drop_before(iteration)  # the checkpoint covers the logs before it
            return SaveCost(time.perf_counter() - started, 0.0)
        if mode == SNAPSHOT:
            for wr in self._writers():  # each writer holds its snapshot until the persist is done
                self._host(wr.worker, tensor_bytes(shards[wr.name]))
            self.store.save_async(iteration, shards)  # shard() already copied: that is the snapshot
            return SaveCost(time.perf_counter() - started, 0.0)
        raise ValueError(f"unknown checkpoint mode {mode!r}")

    def lose_unfinished_persist(self) -> None:
        """A node failure kills a persist still in flight: that checkpoint never completes."""
        pending = getattr(self.store, "pending", None) if self.store is not None else None
        if pending is not None and not pending.done():
            self.store.wait()
            self.store.discard(pending.iteration)

    def restore(self, source: str, plan) -> int:
        """Load the newest usable checkpoint into every replica of `plan`; the iteration it holds."""
        if source == MEMORY:
            commits = [r.commit for worker in self.workers.values() if worker.alive
                       for r in worker.replicas.values() if r.commit is not None]
            self.adopt(plan)
            iteration, shards = newest_commits(commits)
        elif source == HOST:
            self.adopt(plan)
            loaded = self.host_memory.load(self.expected_shapes(plan))
            if loaded is None:
                raise ResultError("unrecoverable", NO_HOST_CHECKPOINT)
            iteration, shards = loaded[0], list(loaded[1].values())
        else:
            self.adopt(plan)
            # Only a checkpoint whose every parameter has the shape this model needs is usable.
            loaded = self.store.load(expected=self.expected_shapes(plan)) if self.store is not None else None
            if loaded is None:
                warnings.warn("no usable checkpoint: restarting from the initial weights (iteration 0)")
                self.build(plan)
                return 0
            iteration, by_name = loaded
            shards = list(by_name.values())
        self._load_all(plan, shards)
        return iteration

    def _load_all(self, plan, shards, workers=None) -> None:
        replicas = [r for w in (plan.holds if workers is None else workers) for r in self.workers[w].replicas.values()]
        load_shards(replicas, shards)

    def copy_replicas(self, copies, plan) -> None:
        """Perform named state copies (ftbench.actions.Transfer) and continue with `plan`: each
        source sends the weights and AdamW state of the copy's layers, as held now, to the
        destination, which holds them in `plan`. A copy may be a piece of the source's replica
        and of the destination's: a replica the destination newly holds is assembled from
        the pieces sent to it and what the destination itself held of its layers before."""
        n = model_layers(plan.partition)
        outgoing = []
        for c in copies:  # read every source before adopting: a source may change place in `plan`
            units = stage_units(c.layers, c.embedding, c.head, n)
            replica = holding(self.workers.get(c.src), units, n)
            if replica is None:
                raise RuntimeError(f"copy {c}: worker {c.src} holds no live replica of those layers")
            outgoing.append((c, units, replica.shard(None if replica_units(replica, n) == units else units, n)))
        kept = self._leaving_replicas(plan)
        created = self.adopt(plan)
        transport = self.executor.transport
        for c, units, shard in outgoing:
            transport.send_state(units, shard, c.src, c.dst)
        # Each replica a copy lands in: created ones start from what the worker held of their
        # layers; one the worker kept (stale: it sat outside the last plan) from itself.
        pieces = {key: list(kept.get(key[0], ())) for key in created}
        for c, units, _ in outgoing:
            received = transport.receive_state(units, c.src, c.dst)
            replica = holding(self.workers[c.dst], units, n)
            key = (c.dst, replica.layers)
            if key not in pieces:
                pieces[key] = [replica.shard()]
            pieces[key].append(received)  # later pieces win where they overlap
        for (w, layers) in pieces:
            try:
                load_shards([self.workers[w].replica(layers)], pieces[(w, layers)])
            except ResultError as err:
                raise RuntimeError(f"worker {w} takes layers {layers} but no copy gives them their state "
                                   f"({err})") from None

    def _leaving_replicas(self, plan) -> dict[int, list[dict]]:
        """What live workers of `plan` hold now in replicas `plan` does not keep (their state,
        read before adopting drops them): part of a new replica over those layers."""
        out: dict[int, list[dict]] = {}
        for w, held in plan.holds.items():
            worker = self.workers.get(w)
            if worker is None or not worker.alive:
                continue
            wanted = {plan.layers(d, s) for d, s in held}
            leaving = [r.shard() for layers, r in worker.replicas.items() if layers not in wanted]
            if leaving:
                out[w] = leaving
        return out

    # -- results ------------------------------------------------------------------------
    def final_state(self) -> dict[str, torch.Tensor]:
        """The trained model in the Hugging Face GPT2LMHeadModel layout, assembled from the
        fragments' writers, after checking that every replica holding a parameter (whatever
        its partition) holds the same weights: bit for bit, or, once an optimizer step was
        undone (`replicas_agree`), to float tolerance."""
        state = {}
        for writer in self._writers():
            state.update(self._shard(writer)["model"])
        for w in self.plan.holds:
            for layers, replica in self.workers[w].replicas.items():
                for name, p in replica.named_parameters().items():
                    if not replicas_agree(p, state[name], exact=self.undone == 0):
                        raise RuntimeError(f"replicas of {name} diverged (worker {w}, layers {layers})")
        return state


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in nested dicts and lists (0 for None)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def replicas_agree(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Whether two replicas of a parameter agree. Replicas train bit for bit alike, until an
    undone optimizer step (ftbench.engine.undo) gives one back its pre-step value to the step's
    rounding while a peer that had not stepped yet kept it exactly: from then on they agree to
    that rounding (a few ulps, which the identical updates that follow carry along), so
    `exact=False` compares them to float tolerance (torch.testing.assert_close's)."""
    if exact or a.shape != b.shape:
        return torch.equal(a, b)
    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        return False
    return True


def replica_units(replica, n_layers: int) -> tuple[int, int]:
    """The units (ftbench.layers) a replica holds, from its parameters' names."""
    from ftbench.layers import unit_of

    units = [unit_of(name, n_layers) for name in replica.names.values()]
    return min(units), max(units) + 1


def holding(worker, units, n_layers: int):
    """The live replica of `worker` holding all of `units`, or None."""
    if worker is None or not worker.alive:
        return None
    for replica in worker.replicas.values():
        if covers(replica_units(replica, n_layers), units):
            return replica
    return None


def covers(outer, inner) -> bool:
    """Whether the unit range `outer` contains `inner`."""
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def fragment_writers(plan, alive=None) -> list[tuple[str, int, tuple[int, int], tuple[int, int]]]:
    """(shard name, worker, layers of the replica, units) per layer fragment: one holder writes
    each fragment, so every parameter is written exactly once whatever the partitions. On a
    regular grid the fragments are the stages and the writers are checkpoint_writers' (the
    same choice the sim charges); otherwise fragment i is written by the i-th (mod holders)
    worker holding it, spreading writes. Every backend that writes checkpoints uses this.
    `alive` (a predicate on workers): only live workers write (a save right after a failure);
    a fragment no live worker holds ends the save as `unrecoverable`."""
    stages = plan.schedule.stages
    n = model_layers(plan.partition)
    regular = len(set(plan.partition)) == 1
    by_stage = checkpoint_writers(plan, alive) if regular else {}
    held = []  # (worker, layers, units) of every replica in the plan
    for w in sorted(plan.holds):
        if alive is not None and not alive(w):
            continue
        for d, s in plan.holds[w]:
            layers = plan.layers(d, s)
            held.append((w, layers, stage_units(layers, s == 0, s == stages[d] - 1, n)))
    writers = []
    for i, sync in enumerate(fragment_layout(stages, plan.partition).syncs):
        lo, hi = sync.units
        if regular:
            if sync.stage not in by_stage:
                raise ResultError("unrecoverable", f"no live replica of stage {sync.stage} is left to save it")
            writers.append((f"stage{sync.stage}", by_stage[sync.stage], plan.layers(0, sync.stage), sync.units))
            continue
        holders = sorted({(w, layers) for w, layers, (a, b) in held if a <= lo and hi <= b})
        if not holders:
            raise ResultError("unrecoverable", f"no live replica of layer units {lo}-{hi} is left to save them")
        w, layers = holders[i % len(holders)]
        writers.append((f"units{lo}-{hi}", w, layers, sync.units))
    return writers
