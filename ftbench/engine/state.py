"""The training state an engine keeps, whichever backend runs it (`EngineState`).

An engine holds the workers its process runs, each with one `StageReplica` per layer range
(ftbench.engine.worker), and keeps them in step with the run:

- `adopt` a plan: workers keep the replicas they still hold, build those they newly hold
  from the initial weights, and free the rest (`build`: every worker from scratch);
- `tokens`: the samples of an iteration, fixed by (seed, iteration) whoever computes them;
- `abandon_iteration`: a failure cut the iteration in flight, so every replica that already
  took its optimizer step undoes it (ftbench.engine.undo), and what the iteration left
  behind (stash, deferred W, gradients, messages in flight, unsealed log records) goes;
- `_commit_steps`: an iteration is over and its steps stand (their undo records go);
  `commit`: an in-memory checkpoint (Elastic Horovod) of every replica;
- `keep` and `revert`: a host copy of every replica before a recovery, and back to it when a
  death interrupts the recovery;
- `_track_memory`: each live worker's device state (weights, gradients, AdamW moments and
  the undo's gradient copies) after its ops, recorded by the backend's `_record_memory`.

Two engines build on it. `LocalEngine` (ftbench.engine.local) runs every worker of the plan
in this process; `DistEngine` (ftbench.distributed.engine) runs one worker, its rank's, and
reaches the others over its transport. What differs is theirs: which workers a process runs
(`_holds`), how peaks are recorded, who counts the job's undone steps, and everything that
moves state between workers.
"""
from __future__ import annotations

import torch

from ftbench.engine.iteration_work import no_work
from ftbench.engine.op_times import OpTimer
from ftbench.engine.outer_sync import new_outer_state, sync as outer_sync
from ftbench.engine.worker import StageReplica, Worker
from ftbench.errors import ResultError
from ftbench.models.data import batch
from ftbench.models.gpt import build_stage
from ftbench.local_sgd import SyncWindow
from ftbench.samples import count, counted, pipeline_offsets, sample_ranges


class EngineState:
    """The workers of one process and their replicas (see the module's docstring). A subclass
    says which workers its process runs (`_holds`), where its transport is (`transport`) and
    how memory peaks are recorded (`_record_memory`)."""

    transport = None  # what carries messages between workers (a subclass's); `clear` drops those in flight

    def __init__(self, ctx, data, lr: float, weight_decay: float, dtype: torch.dtype, store=None,
                 boundary_log=None, device: torch.device | None = None):
        self.ctx, self.data, self.store = ctx, data, store
        self.lr, self.weight_decay, self.dtype, self.device = lr, weight_decay, dtype, device
        # Swift's boundary log (ftbench.engine.boundary_log): where the plan's logged boundaries go
        self.boundary_log = boundary_log
        # strategy.iteration_work(plan): what every iteration does beyond training, performed
        # by ftbench.engine.iteration_work (the run's assembly sets the strategy's)
        self.iteration_work = no_work
        # the HOST tier's host memory, outside the processes (ftbench.engine.host_memory): the
        # run's assembly sets it for a strategy that keeps one (gemini)
        self.host_memory = None
        # {iteration: sample ranges}: fault-free training replayed under a run's ledger
        # (ftbench.samples.replayed; ftbench.fault_free), None otherwise
        self.replayed = None
        self.workers: dict[int, Worker] = {}  # the workers this process runs
        # LocalSGD or DiLoCo (ftbench.local_sgd), None: synchronous; the groups that trained the
        # sync window in flight
        self.local_steps = getattr(ctx, "local_steps", None)
        self.window = SyncWindow()
        self.plan = None
        self.undone = 0  # optimizer steps undone over the run (abandoned iterations), every replica of the job
        self.op_timer = OpTimer()  # the first complete iteration of each plan, op by op (gantt.png)

    # -- which state ------------------------------------------------------------------------
    def _holds(self, plan) -> dict[int, list[tuple[int, int]]]:
        """The workers this process runs in `plan`, each with the (pipeline, stage) it holds."""
        raise NotImplementedError

    def _replica(self, layers, stage: int, last: bool) -> StageReplica:
        """A replica of `layers` (stage `stage`; `last`: with the head) from the initial weights."""
        module = build_stage(self.ctx.spec, self.ctx.seed, *layers, stage == 0, last)
        module = module.to(self.dtype) if self.device is None else module.to(device=self.device, dtype=self.dtype)
        replica = StageReplica(stage, module, self.lr, self.weight_decay)
        if self.local_steps is not None and self.local_steps.algorithm == "diloco":
            replica.outer = new_outer_state(replica)
        return replica

    def build(self, plan) -> None:
        """Start `plan` from scratch: fresh workers with the initial weights (as new processes would)."""
        for worker in self.workers.values():
            worker.destroy()
        self.workers.clear()
        self.plan = None
        self.adopt(plan)

    def adopt(self, plan) -> list[tuple[int, tuple[int, int]]]:
        """Continue with `plan`, keeping the replicas workers already hold; replicas a worker
        newly needs start from the initial weights until a restore or copy fills them. Returns
        those new (worker, layers)."""
        created = []
        for w, held in self._holds(plan).items():
            worker = self.workers.get(w)
            if worker is None or not worker.alive:
                worker = self.workers[w] = Worker(w)
            # Replicas are keyed by layer range: the same layers are the same state, whichever
            # pipeline or stage index names them in `plan`.
            wanted = {plan.layers(pipeline, stage): (pipeline, stage) for pipeline, stage in held}
            for layers in [k for k in worker.replicas if k not in wanted]:
                worker.replicas.pop(layers).destroy()  # layers the worker no longer holds are freed
            for layers, (pipeline, stage) in wanted.items():
                if layers not in worker.replicas:
                    worker.replicas[layers] = self._replica(layers, stage, plan.is_last_stage(pipeline, stage))
                    created.append((w, layers))
        self.plan = plan
        return created

    def _replicas(self) -> list[StageReplica]:
        """Every live replica of this process."""
        return [r for worker in self.workers.values() if worker.alive for r in worker.replicas.values()]

    # -- an iteration ---------------------------------------------------------------------------
    def samples(self, plan, iteration: int, without: frozenset = frozenset()) -> "IterationSamples":
        """The samples of `iteration` under `plan`: tokens(pipeline, microbatch) on this
        engine's device, the loss's normaliser, and (replaying a ledger) the micro-batches
        that do not count; `without`, pipelines whose samples do not count (a failure's
        groups under torchft's LocalSGD or DiLoCo: RunLoop._finish_without)."""
        b = self.ctx.microbatch_size
        offsets = pipeline_offsets(plan)
        ranges = self.replayed.get(iteration) if self.replayed is not None else None
        dropped = frozenset()
        if ranges is None and without:
            ranges = sample_ranges(plan, b, without)
            dropped = frozenset((p, k) for p in without for k in range(plan.schedule.microbatches[p]))
        elif ranges is None:
            ranges = sample_ranges(plan, b)
        else:  # fault-free training replayed under a ledger: what it did not train contributes 0
            dropped = frozenset((p, k) for p, (o, n) in enumerate(zip(offsets, plan.schedule.microbatches))
                                for k in range(n) if not counted(ranges, (o + k) * b, (o + k + 1) * b))
        tokens = self.ctx.seq_len - 1
        per_pipeline = None
        if self.local_steps is not None:  # each pipeline steps on its own samples' mean loss
            per_pipeline = tuple(sum((p, k) not in dropped for k in range(n)) * b * tokens
                                 for p, n in enumerate(plan.schedule.microbatches))
        return IterationSamples(self.data, iteration, offsets, b, self.device, float(count(ranges) * tokens),
                                dropped, per_pipeline)

    def after_ops(self, plan, iteration: int, samples: "IterationSamples", keep: bool = False,
                  without: frozenset = frozenset()) -> None:
        """The iteration's ops are all done: under LocalSGD or DiLoCo, its groups count in the
        window, and a sync iteration syncs (ftbench.engine.outer_sync; with `keep`, undoably;
        without the pipelines `without`, which a failure cut)."""
        steps = self.local_steps
        if steps is None:
            return
        self.window.trained(steps, iteration, samples.present(plan))
        if steps.syncs_after(iteration):
            outer_sync(plan, steps, self.window.through, {w: x for w, x in self.workers.items() if x.alive},
                       self.transport, keep=keep, without=without)

    def _commit_steps(self) -> None:
        """The iteration's optimizer steps can no longer be abandoned: drop their undo records."""
        for replica in self._replicas():
            replica.undo.clear()
            replica.pre_sync = None
        self.window.commit()

    def abandon_iteration(self) -> int:
        """The iteration in flight is lost and will be redone: replicas that already took its
        optimizer step undo it (ftbench.engine.undo: back to the iteration's start), and its
        stash, deferred W, gradients and every message and sum in flight are dropped. Returns
        the replicas undone here."""
        self.window.revert()
        undone = sum(map(_abandon, self._replicas()))
        if self.boundary_log is not None:
            self.boundary_log.discard_open()  # an abandoned iteration's sends are not logged
        self._clear_transport()
        return undone

    def abandon_pipelines(self, plan, pipelines: frozenset) -> None:
        """A failure cut the pipelines `pipelines` of `plan` (RunLoop._finish_without): this
        process's live replicas of theirs drop the iteration, undoing a step they took (their
        group is out until it heals from a live one), and what they left in flight is dropped."""
        for w, held in plan.holds.items():
            worker = self.workers.get(w)
            if worker is not None and worker.alive and any(d in pipelines for d, _ in held):
                for replica in worker.replicas.values():
                    _abandon(replica)
        self._clear_transport()

    def _clear_transport(self) -> None:
        clear = getattr(self.transport, "clear", None)
        if clear is not None:
            clear()  # messages and reductions in flight are lost with the iteration

    # -- memory ---------------------------------------------------------------------------------
    def _track_memory(self) -> None:
        """Each live worker's device state: weights, gradients, AdamW state and the undo's
        gradient copies (StepUndo.bytes), which live from a replica's step to the iteration's
        end; the backend records it with the worker's activations (`_record_memory`)."""
        for worker in self.workers.values():
            if worker.alive:
                self._record_memory(worker, sum(r.state_bytes() + r.undo.bytes() for r in worker.replicas.values()))

    def _record_memory(self, worker: Worker, state: int) -> None:
        raise NotImplementedError

    # -- commits and host copies ----------------------------------------------------------------
    def commit(self, iteration: int) -> None:
        """An in-memory commit of `iteration` (Elastic Horovod): every replica of the plan here
        keeps a copy of its weights and AdamW state."""
        for w, worker in self.workers.items():
            if w in self.plan.holds:
                for replica in worker.replicas.values():
                    replica.commit = {"iteration": iteration, "shard": replica.shard()}

    def forget_newer(self, iteration: int, writer: bool) -> None:
        """A restore went back to `iteration`: every checkpoint newer than it, of any tier,
        belongs to the abandoned timeline (a later restore must not find it): this process's
        in-memory commits, and with `writer` (the process that writes the files) the files."""
        for worker in self.workers.values():
            for replica in worker.replicas.values() if worker.alive else ():
                if replica.commit is not None and replica.commit["iteration"] > iteration:
                    replica.commit = None
        if writer and self.store is not None:
            self.store.discard_after_persist([i for i in self.store.iterations() if i > iteration])
        if writer and self.host_memory is not None:
            self.host_memory.forget_newer(iteration)

    def expected_shapes(self, plan) -> dict:
        """{parameter name: shape} of this process's replicas of `plan` (adopted): what a
        restore must find for them."""
        return {n: tuple(p.shape) for w in self._holds(plan) if w in self.workers
                for r in self.workers[w].replicas.values() for n, p in r.named_parameters().items()}

    def host_shards(self) -> tuple[dict[str, dict], dict[str, int]]:
        """This process's part of a HOST checkpoint: every live replica of the plan as a shard
        named after its worker, and the node each shard's worker runs on."""
        shards, home = {}, {}
        for w, worker in sorted(self.workers.items()):
            if w in self.plan.holds and worker.alive:
                for k, replica in enumerate(worker.replicas.values()):
                    name = f"worker{w}_{k}"
                    shards[name], home[name] = on_cpu(replica.shard()), self.plan.node_of[w]
        return shards, home

    def keep(self) -> dict:
        """This process's state before a recovery (each live worker's replicas: weights, AdamW
        state and in-memory commit, in host memory), for `revert` if a death interrupts it."""
        return {w: {layers: (r.stage, r.module.is_last, on_cpu(r.shard()), on_cpu(r.commit))
                    for layers, r in worker.replicas.items()}
                for w, worker in self.workers.items() if worker.alive}

    def revert(self, kept: dict) -> None:
        """Back to the state `keep` took: a recovery that a death interrupted starts again from
        it (replicas the recovery dropped or rebuilt come back as they were)."""
        self.abandon_iteration()
        for worker in self.workers.values():
            worker.destroy()
        self.workers.clear()
        self.plan = None
        for w, replicas in kept.items():
            worker = self.workers[w] = Worker(w)
            for layers, (stage, last, shard, commit) in replicas.items():
                replica = worker.replicas[layers] = self._replica(layers, stage, last)
                load_shards([replica], [shard], self.device)
                replica.commit = to_device(commit, self.device)


def newest_commits(commits: list[dict]) -> tuple[int, list[dict]]:
    """The iteration of the newest in-memory commits and their shards (older ones: workers that
    left the job); unrecoverable when no commit survived."""
    if not commits:
        raise ResultError("unrecoverable", "no in-memory commit survived the failure")
    iteration = max(c["iteration"] for c in commits)
    return iteration, [c["shard"] for c in commits if c["iteration"] == iteration]


def to_device(obj, device):
    """Nested dicts and lists of tensors with every tensor detached and on `device`."""
    if torch.is_tensor(obj):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    return obj


def on_cpu(obj):
    """A shard with its tensors in host memory (what crosses processes as a pickled object)."""
    return to_device(obj, torch.device("cpu"))


def load_shards(replicas, shards, device=None) -> None:
    """Load checkpoint shards (or in-memory commits) into `replicas`, each taking its own
    parameters and AdamW state from all of them together (moved to `device` when given).
    Shared by the local and dist backends."""
    model = {k: v for s in shards for k, v in s["model"].items()}
    optim = {k: v for s in shards for k, v in s["optim"].items()}
    outer = None
    if any("outer" in s for s in shards):  # DiLoCo's outer state (ftbench.engine.outer_sync)
        outer = {kind: {k: v for s in shards if "outer" in s for k, v in s["outer"][kind].items()}
                 for kind in ("backup", "momentum")}
    if device is not None:
        model, optim, outer = to_device(model, device), to_device(optim, device), to_device(outer, device)
    for replica in replicas:
        try:
            replica.load(model, optim, outer=outer)
        except KeyError as missing:
            raise ResultError("unrecoverable", f"parameter {missing} survived in no checkpoint or "
                              "replica: every copy of it was lost") from None


def _abandon(replica) -> int:
    """One replica drops the iteration in flight: a sync a death cut is put back (the state
    after the step), a step it took is undone. 1 if it undid a step."""
    if replica.pre_sync is not None:
        kept, replica.pre_sync = replica.pre_sync, None
        replica.load(kept["model"], kept["optim"], outer=kept.get("outer"), keep_undo=True)
    undone = 0
    if replica.undo.recorded:
        replica.undo.undo()
        undone = 1
    replica.reset_iteration()
    return undone


class IterationSamples:
    """The samples of one iteration under a plan: called as tokens(pipeline, microbatch), the
    input ids of that micro-batch (micro-batch k of pipeline p holds the iteration's samples
    (offset_p + k) * b ... + b - 1, fixed by (seed, iteration) whoever computes them);
    `normaliser`, what the summed token losses are divided by (the mean over the samples that
    count); `dropped`, the (pipeline, microbatch) whose loss counts 0 (a replayed ledger);
    `per_pipeline`, under LocalSGD or DiLoCo, each pipeline's own normaliser (its samples that
    count), its gradients being its own (None: synchronous)."""

    def __init__(self, data, iteration: int, offsets, b: int, device, normaliser: float, dropped: frozenset,
                 per_pipeline: tuple | None = None):
        self.data, self.iteration, self.offsets, self.b, self.device = data, iteration, offsets, b, device
        self.normaliser, self.dropped, self.per_pipeline = normaliser, dropped, per_pipeline

    def present(self, plan) -> frozenset:
        """The replica groups (ftbench.local_sgd.groups) whose samples count in this iteration."""
        return frozenset(o for p, (o, n) in enumerate(zip(self.offsets, plan.schedule.microbatches))
                         if any((p, k) not in self.dropped for k in range(n)))

    def __call__(self, pipeline: int, microbatch: int) -> torch.Tensor:
        first = (self.offsets[pipeline] + microbatch) * self.b
        ids = batch(self.data, self.iteration, range(first, first + self.b))
        return ids if self.device is None else ids.to(self.device)
