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

`DistBackend` adapts the engine to the run loop's `Backend` protocol (ftbench.loop): real
kills at the resolved failure point, detection and agreement among the survivors, and the
strategies' recovery actions performed between processes. It holds no strategy logic.
"""
from __future__ import annotations

import os
import time

import torch

from ftbench.actions import FILE, MEMORY, SNAPSHOT
from ftbench.distributed.faults import die, dies_among_ops, dies_in_recovery, dies_in_save, stall_here
from ftbench.distributed.membership import log
from ftbench.distributed.protocol import LATEST, RESTART_EXIT, exit_now
from ftbench.distributed.transport import (DistAbort, DistError, DistTransport, UnannouncedDeath, WaitFailed,
                                           describe_error, plan_crc)
from ftbench.engine.boundary_log import LoggingTransport, ReplayTransport, unusable_replay
from ftbench.engine.log_file import replay_sources
from ftbench.engine.transport import ACT
from ftbench.errors import ResultError
from ftbench.engine.executor import WorkerExecutor, in_chunk, sum_chunks, sync_members, take_grads
from ftbench.engine.op_times import OpTimer, now as op_clock
from ftbench.engine.worker import StageReplica, Worker
from ftbench.layers import GradientSync, fragment_layout, model_layers, stage_units
from ftbench.models.data import batch
from ftbench.models.gpt import build_stage
from ftbench.engine.local import (covers, fragment_writers, holding, load_shards, replica_units, replicas_agree,
                                  to_device)
from ftbench.recovery_costs import SaveCost
from ftbench.schedule import F, OPT, RSYNC, Op, dependency_graph, topological_order


class DistEngine:
    def __init__(self, ctx, data, lr: float, weight_decay: float, dtype: torch.dtype, transport: DistTransport,
                 device: torch.device, store=None, recompute: str = "none", undo: bool = False,
                 kill: tuple[int, int, int] | None = None, boundary_log=None):
        self.ctx, self.data, self.lr, self.weight_decay = ctx, data, lr, weight_decay
        # Swift's boundary log (ftbench.engine.boundary_log): this rank's own BoundaryLog on the
        # run folder every rank shares, so a replay reads what the other ranks' workers sent
        self.boundary_log = boundary_log
        # backend.unannounced=recover: an unannounced death rolls the survivors back to the start
        # of the iteration in flight (roll_back). Nothing is copied for it: every replica's
        # optimizer steps through its StepUndo (ftbench.engine.undo), which keeps the step's
        # gradient until the iteration completes, as scripted strikes after a step need too.
        self.undo = undo
        # optimizer steps undone over the run by the whole job (abandoned iterations), as this
        # rank learnt it: each strike's survivors sum their counts (DistBackend)
        self.undone = 0
        self.kill = kill  # backend.kill: (rank, iteration, ops) where this job's chaos test dies
        self.op_timer = OpTimer()  # this rank's ops in the first complete iteration of each plan (gantt.png)
        self.recompute = recompute  # train.recompute, as the local backend's executor takes it
        self.dtype, self.transport, self.device, self.store = dtype, transport, device, store
        self.rank = transport.rank
        self.worker: Worker | None = None
        self.plan = None
        self._steps = None  # (plan key, steps, loss slots, members, syncs each OPT waits for)
        self._crc = (None, 0)  # (plan, its fingerprint)
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
                    self.worker.replicas[layers] = self._replica(layers, s, plan.is_last_stage(d, s))
        self.plan = plan

    def _replica(self, layers, stage: int, last: bool) -> StageReplica:
        """A replica of `layers` (stage `stage`) from the initial weights."""
        module = build_stage(self.ctx.spec, self.ctx.seed, *layers, stage == 0, last)
        return StageReplica(stage, module.to(device=self.device, dtype=self.dtype), self.lr, self.weight_decay)

    def keep(self):
        """This rank's state before a recovery (its worker and each replica's weights, AdamW
        state and in-memory commit, in host memory), for `revert` if a death interrupts it."""
        if self.worker is None or not self.worker.alive:
            return None
        return self.worker.id, {layers: (r.stage, r.module.is_last, _on_cpu(r.shard()), _on_cpu(r.commit))
                                for layers, r in self.worker.replicas.items()}

    def revert(self, kept) -> None:
        """Back to the state `keep` took: a recovery that a death interrupted starts again from
        it (replicas the recovery dropped or rebuilt come back as they were)."""
        self.abandon_iteration()
        if self.worker is not None:
            self.worker.destroy()
        self.worker, self.plan = None, None
        if kept is None:
            return
        worker, replicas = kept
        self.worker = Worker(worker)
        for layers, (stage, last, shard, commit) in replicas.items():
            replica = self.worker.replicas[layers] = self._replica(layers, stage, last)
            load_shards([replica], [shard], self.device)
            replica.commit = to_device(commit, self.device)

    # -- one iteration ----------------------------------------------------------------------
    def _plan_steps(self, plan):
        """This worker's part of the global order: ("start", sync) when a sum it takes part in
        can start, ("op", op, syncs to wait for first); the position of every loss share; the
        members of every sum; the sums every OPT of the plan (any worker's) waits for."""
        key = (plan.key(), self.transport.worker, self.transport.epoch)  # a standby may take a worker over
        if self._steps is not None and self._steps[0] == key:
            return self._steps[1:]
        deps = dependency_graph(plan.schedule, layout=fragment_layout(plan.schedule.stages, plan.partition))
        order = topological_order(plan.schedule, deps)
        members = {n: sync_members(plan, n) for n in deps if isinstance(n, GradientSync)}
        where = plan.schedule.index()
        me = self.transport.worker
        steps, slots, opt_syncs = [], {}, {}
        for node in order:
            if isinstance(node, GradientSync):
                if me in members[node]:
                    steps.append(("start", node))
                continue
            if node.kind == F and plan.is_last_stage(node.pipeline, node.stage):
                slots[node] = len(slots)
            if node.kind == OPT:
                opt_syncs[node] = [d for d in deps[node] if isinstance(d, GradientSync)]
            if where[node] == me:
                steps.append(("op", node, opt_syncs.get(node, [])))
        self._steps = (key, steps, slots, members, opt_syncs)
        return steps, slots, members, opt_syncs

    @staticmethod
    def _cut_steps(steps: list, completed: frozenset, opt_syncs: dict) -> tuple[list, list]:
        """This worker's steps of an iteration a failure cuts at `completed`: its completed ops,
        and its part in every sum a completed optimizer step (anyone's) waits for, as the local
        driver runs them (such a sum completed before the failure, every member having
        contributed). A sum this worker takes part in but none of its completed ops waits for
        is waited for after its last op (so the sum is whole on every member before anyone
        moves on, or dies): (steps, those late waits)."""
        needed = {sync for op in completed if op.kind == OPT for sync in opt_syncs.get(op, ())}
        cut = [s for s in steps if (s[0] == "op" and s[1] in completed) or (s[0] == "start" and s[1] in needed)]
        waited = {sync for s in cut if s[0] == "op" for sync in s[2]}
        late = [s[1] for s in cut if s[0] == "start" and s[1] not in waited]
        return cut, late

    def run_iteration(self, plan, iteration: int, completed: frozenset | None = None) -> float | None:
        """Run this worker's ops of iteration `iteration`; the loss (every rank gets it). With
        `completed` (where a failure strikes: ops closed under dependencies), run only those,
        send only what a completed op takes, sum nothing and return None."""
        if self.plan is not plan:
            self.adopt(plan)
        steps, slots, members, opt_syncs = self._plan_steps(plan)
        late = []
        if completed is not None:
            steps, late = self._cut_steps(steps, completed, opt_syncs)
        tokens, normaliser = self._tokens(plan, iteration), self._normaliser
        world = self.transport.world
        vector = torch.zeros(len(slots) + 2 * world, dtype=torch.float64, device=self.device)
        if self.worker is not None:
            extra = {} if self.recompute == "none" else {"recompute": self.recompute}
            transport = self.transport if completed is None else _CutTransport(self.transport, plan, completed)
            if self.boundary_log is not None and plan.logged:
                # a cut iteration's records are dropped with it (abandon_iteration)
                transport = LoggingTransport(transport, self.boundary_log, plan.logged, iteration)
            executor = WorkerExecutor(self.worker, transport, plan, tokens, normaliser, **extra)
            timer = self.op_timer.begin(plan, iteration) if completed is None else None
            self._commit_steps()  # nothing recorded reaches back into an earlier iteration
            dies_after = dies_among_ops(self.kill, self.rank, iteration) if completed is None else None
            for done, step in enumerate(steps):
                if done == dies_after:
                    die("backend.kill: unannounced, among its ops (the run loop was not told)")
                if step[0] == "start":
                    executor.reduce_start(step[1], members[step[1]])
                    continue
                _, op, waits = step
                for sync in waits:
                    executor.reduce_wait(sync, members[sync])
                started = op_clock() if timer is not None else 0.0
                share = executor.run(op)
                if timer is not None:
                    timer.record(self.rank, op, started, op_clock())
                if share is not None:
                    vector[slots[op]] = share
            if dies_after is not None:
                die("backend.kill: unannounced, past this worker's last op of the iteration")
            for sync in late:
                executor.reduce_wait(sync, members[sync])
            self.transport.flush_sends()
            self.transport.flush_state_sends()  # redundant copies' refreshes (Bamboo)
            self._track_memory()
        if completed is not None:
            return None
        vector[len(slots) + self.rank] = iteration + 1
        if self._crc[0] is not plan:
            self._crc = (plan, plan_crc(plan))
        vector[len(slots) + world + self.rank] = self._crc[1]
        self.transport.all_sum(vector, f"end iteration {iteration} with every rank (the loss sum)")
        marks = vector[len(slots):].tolist()
        alive = self.transport.alive  # the dead left zeros
        its, crcs = [marks[r] for r in alive], [marks[world + r] for r in alive]
        if len(set(its)) != 1 or len(set(crcs)) != 1:
            raise DistError(f"the ranks' run loops disagree at iteration {iteration}: iterations "
                            f"{[int(m) - 1 for m in its]}, plan fingerprints {[int(m) for m in crcs]} (ranks {alive})")
        self._commit_steps()  # every rank ended the iteration: its steps stand
        self.op_timer.end()  # an iteration being timed (this rank's worker's ops) completed
        if self.boundary_log is not None:
            self.boundary_log.seal(iteration)  # only now: a death before the sum abandons the iteration
        loss = torch.zeros((), dtype=torch.float64)
        for share in vector[:len(slots)].cpu():
            loss += share  # the global order, as the local driver adds
        return float(loss)

    def _tokens(self, plan, iteration: int):
        """tokens(pipeline, microbatch) of `iteration` under `plan`, on this rank's device."""
        schedule = plan.schedule
        offsets = [sum(schedule.microbatches[:p]) for p in range(len(schedule.microbatches))]
        b = self.ctx.microbatch_size

        def tokens(pipeline: int, microbatch: int) -> torch.Tensor:
            first = (offsets[pipeline] + microbatch) * b  # as LocalEngine.run_iteration: fixed by (seed, i)
            return batch(self.data, iteration, range(first, first + b)).to(self.device)
        return tokens

    @property
    def _normaliser(self) -> float:
        return float(self.ctx.global_batch * (self.ctx.seq_len - 1))

    def _track_memory(self) -> None:
        """Weights, gradients, AdamW state and the undo's gradient copies (StepUndo.bytes),
        which live from a replica's step to the iteration's end, plus the activations, plus
        the boundary log's buffer of the iteration in flight (Swift), until it is written."""
        state = sum(r.state_bytes() + r.undo.bytes() for r in self.worker.replicas.values())
        if self.boundary_log is not None:
            state += self.boundary_log.buffered(self.worker.id)
        self.peak_memory = max(self.peak_memory, state + self.worker.peak_activation_bytes)

    def _commit_steps(self) -> None:
        """The iteration's optimizer steps can no longer be abandoned: drop their undo records."""
        if self.worker is not None and self.worker.alive:
            for replica in self.worker.replicas.values():
                replica.undo.clear()

    def roll_back(self) -> int:
        """An unannounced death cut the iteration in flight: drop it, and give every replica
        back the state it had when the iteration began: those that stepped undo their step
        (abandon_iteration), the others never left it. Returns the replicas undone here."""
        if not self.undo:
            raise DistError(f"rank {self.rank}: rolling back an iteration needs backend.unannounced=recover")
        return self.abandon_iteration()

    def abandon_iteration(self) -> int:
        """The iteration in flight is lost and will be redone: replicas that already took its
        optimizer step undo it (ftbench.engine.undo), and its stash, deferred W, gradients and
        every message and sum in flight are dropped. Returns the replicas undone here."""
        undone = 0
        if self.worker is not None and self.worker.alive:
            for replica in self.worker.replicas.values():
                if replica.undo.recorded:
                    replica.undo.undo()
                    undone += 1
                replica.reset_iteration()
        if self.boundary_log is not None:
            self.boundary_log.discard_open()  # an abandoned iteration's sends are not logged
        self.transport.clear()
        return undone

    # -- recovery ---------------------------------------------------------------------------
    def restore(self, source: str, plan) -> int:
        """Load the newest checkpoint every live rank can use into this rank's replicas of
        `plan`; its iteration (0: none usable, every replica from the initial weights). Files
        are read from the shared run folder (the leader wrote them); in-memory commits are
        gathered from every live rank."""
        t = self.transport
        if source == MEMORY:
            mine = []
            if self.worker is not None and self.worker.alive:
                mine = [r.commit for r in self.worker.replicas.values() if r.commit is not None]
            everyone = t.all_gather_objects(_on_cpu(mine), "gather the in-memory commits")
            commits = [c for part in everyone for c in part]
            self.adopt(plan)
            if not commits:
                raise ResultError("unrecoverable", "no in-memory commit survived the failure")
            iteration = max(c["iteration"] for c in commits)
            shards = [c["shard"] for c in commits if c["iteration"] == iteration]
        else:
            if self.rank == t.leader and self.store is not None:
                self.store.wait()  # a persist in flight completes before anyone reads
            t.all_sum(torch.zeros(1, dtype=torch.float64, device=self.device), "wait for the checkpoint files")
            self.adopt(plan)
            loaded = self.store.load() if self.store is not None else None
            found = torch.zeros(len(t.alive), dtype=torch.float64, device=self.device)
            found[t.alive.index(self.rank)] = -1 if loaded is None else loaded[0]
            t.all_sum(found, "agree on the checkpoint to restore")
            if len(set(found.tolist())) != 1:
                raise DistError(f"the ranks found different checkpoints in {self.store.root}: iterations "
                                f"{[int(v) for v in found.tolist()]} (ranks {t.alive}); is the run folder shared?")
            if loaded is None:
                self.build(plan)
                return 0
            iteration, by_name = loaded
            shards = list(by_name.values())
        if self.worker is not None:
            load_shards(self.worker.replicas.values(), shards, self.device)
        return iteration

    def replay(self, plan, workers, since: int, until: int, chunks: int = 1) -> None:
        """Swift's logging-based recovery (ftbench.actions.ReplayLogs), every live rank taking
        part: the ranks running `workers` load their replicas from the FILE checkpoint of
        iteration `since` and replay iterations since..until-1, their own ops in the plan's
        global order and the gradient sums among them (`_replay_steps`), what other workers
        sent them read from those workers' log files in the shared folder (ReplayTransport);
        every other rank waits. All meet after each replayed iteration (one all-reduce, within
        the transport's deadline like every wait here), so no wait spans the whole replay.

        With `chunks` > 1 (parallel recovery) each replayed rank splits the iteration's
        micro-batches into that many contiguous groups itself, accumulates each group's
        gradients apart and sums them in group order before the sums and steps: the local
        backend's chunked replay (Executor.replay), the same arithmetic. The helpers do not
        compute here (on dist their share would have to come back as gradients over the
        network; the result is the same)."""
        t = self.transport
        self.adopt(plan)  # always: a standby may have taken over a worker of this very plan (DistBackend._place)
        workers = frozenset(workers)
        gone = {w: t.rank_of(w) for w in sorted(workers) if t.rank_of(w) not in t.alive}
        if gone and len(gone) == len(workers):
            # The processes that were to replay (a standby's) died in this very recovery: as a
            # restore without them, the replay completes without them, and the run loop asks the
            # strategy to recover their node next, on the next live standby (DistBackend._place).
            log.info("the replay of workers %s is skipped: their ranks %s died in this recovery", sorted(workers),
                     sorted(set(gone.values())))
            return
        if gone:
            raise DistError(f"the replay by workers {sorted(workers)} cannot run: the ranks of workers {sorted(gone)} "
                            f"({sorted(set(gone.values()))}) died while the others live")
        replaying = self.worker is not None and self.worker.alive and self.worker.id in workers
        if replaying and self.boundary_log is None:
            raise DistError(f"rank {self.rank}: worker {self.worker.id} replays from the boundary log, but the "
                            "strategy keeps none (no log_dir)")
        if self.boundary_log is not None:
            self.boundary_log.wait()  # this rank's logged iterations are on storage before anyone reads them
        if self.rank == t.leader and self.store is not None:
            self.store.wait()
        t.all_sum(torch.zeros(1, dtype=torch.float64, device=self.device),
                  "wait for the checkpoint files and the boundary logs of every rank")
        # Only the replaying ranks read the checkpoint; they must all find the one of `since`,
        # and every log file they will read must be there (else all stop here, alike).
        loaded = self.store.load(at_most=since) if replaying and self.store is not None else None
        start = 0 if loaded is None else loaded[0]
        mine = (start, self._unusable_logs(plan, workers, start, until)) if replaying else None
        views = t.all_gather_objects(mine, "agree on the checkpoint and the logs the replay starts from")
        held = {v[0] for v in views if v is not None}
        problems = [problem for v in views if v is not None for problem in v[1]]
        if len(held) > 1:
            raise DistError(f"the replaying ranks found different checkpoints in {self.store.root}: iterations "
                            f"{[None if v is None else v[0] for v in views]} (ranks {t.alive}; None: not replaying); "
                            "is the run folder shared?")
        if not held:
            raise DistError(f"no live rank runs the replayed workers {sorted(workers)}")
        unusable = unusable_replay(since, held.pop(), until, problems)
        if unusable is not None:  # every rank alike, nothing used yet: the run loop falls back
            raise unusable
        if replaying:
            if loaded is None:  # iteration 0 without a file: the initial weights, re-created from the seed
                for layers, replica in list(self.worker.replicas.items()):
                    self.worker.replicas[layers] = self._replica(layers, replica.stage, replica.module.is_last)
                    replica.destroy()
            else:
                load_shards(self.worker.replicas.values(), list(loaded[1].values()), self.device)
            steps = self._replay_steps(plan, workers)
        for iteration in range(since, until):
            if replaying:
                self._replay_iteration(plan, workers, iteration, steps, chunks)
            t.all_sum(torch.zeros(1, dtype=torch.float64, device=self.device),
                      f"wait for the replay of iteration {iteration} by workers {sorted(workers)}")

    def _unusable_logs(self, plan, workers: frozenset, since: int, until: int) -> list[str]:
        """What is wrong with the log files this worker's replay from `since` would read (what
        workers outside the replay sent it across a logged boundary, each iteration): missing
        or not verifying (ftbench.engine.log_file), as 'path: reason'."""
        return self.boundary_log.check(replay_sources(plan, [self.worker.id], workers), since, until)

    def _replay_steps(self, plan, workers: frozenset) -> list:
        """This worker's steps of a replay by `workers`: all its ops, and the sums it takes
        part in, which must lie within the replay (as Executor.replay requires)."""
        steps, _, members, _ = self._plan_steps(plan)
        for step in steps:
            if step[0] == "start" and not workers.issuperset(members[step[1]]):
                raise DistError(f"{step[1]} sums over workers {members[step[1]]}, of which only "
                                f"{sorted(workers.intersection(members[step[1]]))} replay")
        return steps

    def _replay_iteration(self, plan, workers: frozenset, iteration: int, steps: list, chunks: int) -> None:
        _, _, members, _ = self._plan_steps(plan)
        transport = ReplayTransport(self.transport, self.boundary_log, workers, iteration)
        extra = {} if self.recompute == "none" else {"recompute": self.recompute}
        executor = WorkerExecutor(self.worker, transport, plan, self._tokens(plan, iteration), self._normaliser,
                                  **extra)

        def run(step) -> None:
            if step[0] == "start":
                executor.reduce_start(step[1], members[step[1]])
                return
            for sync in step[2]:
                executor.reduce_wait(sync, members[sync])
            executor.run(step[1])

        if chunks <= 1:
            for step in steps:
                run(step)
        else:
            counts = plan.schedule.microbatches
            params = [p for r in self.worker.replicas.values() for p in r.module.parameters()]
            parts = []  # per share, per parameter: its gradient over the share's micro-batches
            for k in range(chunks):
                for step in steps:
                    if step[0] == "op" and in_chunk(step[1], k, chunks, counts):
                        run(step)
                parts.append(take_grads(params))
            sum_chunks(params, parts)  # in share order, as Executor.replay does
            for step in steps:
                if step[0] == "start" or step[1].kind == OPT:
                    run(step)
        self.transport.flush_sends()
        self._track_memory()
        self._commit_steps()

    def copy_replicas(self, copies, plan) -> None:
        """Named state copies (ftbench.actions.Transfer) between processes, then `plan` (as
        LocalEngine.copy_replicas): each source sends the copy's layers as held now; a replica
        this rank newly holds is assembled from the pieces it receives and what it held of
        those layers before. After a death interrupted the recovery (`revert`), copies to the dead
        are dropped and a copy from the dead is taken from another survivor holding its layers."""
        t = self.transport
        n = model_layers(plan.partition)
        alive = set(t.alive)
        copies = [c for c in copies if t.rank_of(c.dst) in alive]
        if any(t.rank_of(c.src) not in alive for c in copies):
            copies = self._from_survivors(copies, n)
        outgoing = []
        for c in copies:  # read every source before adopting: a source may change place in `plan`
            if t.rank_of(c.src) != self.rank:
                continue
            units = stage_units(c.layers, c.embedding, c.head, n)
            replica = holding(self.worker, units, n)
            if replica is None:
                raise DistError(f"copy {c}: worker {c.src} (rank {self.rank}) holds no replica of those layers")
            outgoing.append((c, units, replica.shard(None if replica_units(replica, n) == units else units, n)))
        old = self.worker if self.worker is not None and self.worker.alive else None
        before = set(old.replicas) if old is not None else set()
        wanted = {plan.layers(d, s) for d, s in plan.holds.get(old.id, ())} if old is not None else set()
        kept = [r.shard() for layers, r in old.replicas.items() if layers not in wanted] if old is not None else []
        self.adopt(plan)
        same = old is not None and self.worker is old
        created = set(self.worker.replicas) - (before if same else set()) if self.worker is not None else set()
        pieces = {layers: list(kept if same else ()) for layers in created}
        t.state_groups([(c.src, c.dst) for c in copies])
        for c, units, shard in outgoing:
            t.send_state(units, shard, c.src, c.dst)
        for c in copies:
            if t.rank_of(c.dst) == self.rank:
                units = stage_units(c.layers, c.embedding, c.head, n)
                received = t.receive_state(units, c.src, c.dst)
                target = holding(self.worker, units, n)
                if target is None:
                    raise DistError(f"copy {c}: worker {c.dst} (rank {self.rank}) holds no replica for those layers")
                if target.layers not in pieces:  # a replica kept from before: refreshed in place
                    pieces[target.layers] = [target.shard()]
                pieces[target.layers].append(received)
        t.flush_state_sends()
        for layers, parts in pieces.items():
            try:
                load_shards([self.worker.replica(layers)], parts, self.device)
            except ResultError as err:
                raise DistError(f"worker {self.worker.id} takes layers {layers} but no copy gives them their state "
                                f"({err})") from None

    def _from_survivors(self, copies, n: int) -> list:
        """`copies` with every dead source replaced by the lowest live rank whose worker holds a
        replica covering the copy's layers (collective: each rank says what it holds). A copy
        no survivor can give ends the run as unrecoverable: its only holder died mid-recovery."""
        import dataclasses

        t = self.transport
        mine = None
        if self.worker is not None and self.worker.alive:
            mine = (self.worker.id, [replica_units(r, n) for r in self.worker.replicas.values()])
        held = [h for h in t.all_gather_objects(mine, "say which layers each survivor holds") if h is not None]
        alive = set(t.alive)
        out = []
        for c in copies:
            if t.rank_of(c.src) in alive:
                out.append(c)
                continue
            units = stage_units(c.layers, c.embedding, c.head, n)
            source = next((w for w, ranges in held if w != c.dst and any(covers(r, units) for r in ranges)), None)
            if source is None:
                raise ResultError("unrecoverable", f"worker {c.src} died during the recovery while sending {c}, "
                                  "and no survivor holds those layers")
            out.append(dataclasses.replace(c, src=source))
        return out

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
        """The leader: the trained model (Hugging Face names), after checking that every replica
        of every parameter, on every rank, holds the same weights (bit for bit, or to float
        tolerance once some rank undid an optimizer step: ftbench.engine.local.replicas_agree).
        Other ranks: None."""
        t = self.transport
        mine = {}
        if self.worker is not None:
            for layers, replica in self.worker.replicas.items():
                mine[(self.worker.id, layers)] = {k: v.detach().cpu() for k, v in replica.named_parameters().items()}
        gathered = t.all_gather_objects((mine, self.undone), "gather the trained weights")
        if self.rank != t.leader:
            return None
        exact = max(undone for _, undone in gathered) == 0
        state: dict = {}
        for part, _ in gathered:
            for (w, layers), params in part.items():
                for name, p in params.items():
                    if name in state and not replicas_agree(state[name], p, exact):
                        raise RuntimeError(f"replicas of {name} diverged (worker {w}, layers {layers})")
                    state.setdefault(name, p)
        return state


def _death(store, dead) -> float:
    """When the first of `dead` died: its last heartbeat (wall clock)."""
    from ftbench.distributed.membership import last_beat_s

    return min(last_beat_s(store, sorted(dead)).values())


def _phases(rank: int, death: float, detected: float, agreed: float, regrouped: float) -> dict:
    """Survivor `rank`'s recovery phases, measured from the death (wall-clock times): until it
    knew who died, until the survivors agreed, until its new groups were built."""
    return {"detection_s": detected - death, "agreement_s": agreed - detected, "new_group_s": regrouped - agreed,
            "death_to_regroup_s": regrouped - death, "rank": rank}


def _on_cpu(obj):
    """A shard with its tensors in host memory (what crosses processes as a pickled object)."""
    return to_device(obj, torch.device("cpu"))


def _lost_nodes(records: list[dict]) -> list[int]:
    """The nodes of `_lose`'s records (one node, or a list of them, each)."""
    return sorted({n for r in records for n in (r["node"] if isinstance(r["node"], list) else [r["node"]])})


class _CutTransport:
    """The transport of an iteration cut by a failure: a message whose consumer is not among
    the completed ops is never taken, so it is not sent."""

    def __init__(self, transport: DistTransport, plan, completed: frozenset):
        self._t, self._plan, self._completed = transport, plan, completed

    def __getattr__(self, name):
        return getattr(self._t, name)

    def send(self, key, tensor, src, dst) -> None:
        kind, pipeline, stage, microbatch = key
        schedule = self._plan.schedule
        consumer = Op(F, stage + 1, microbatch, pipeline) if kind == ACT else \
            schedule.backward_input_op(stage, microbatch, pipeline)
        if consumer in self._completed:
            self._t.send(key, tensor, src, dst)

    def send_state(self, units, shard, src, dst) -> None:
        """A redundant copy's refresh (Bamboo) is sent only if its RSYNC is among the completed."""
        where = self._plan.schedule.index()
        if any(op.kind == RSYNC and where[op] == dst for op in self._completed):
            self._t.send_state(units, shard, src, dst)


class DistBackend:
    """The run loop's Backend protocol for one rank of a dist job. Every rank runs the same
    loop and calls these methods at the same points, so collectives here line up.

    A failure (`strike`) is real: every process of the failed node runs its ops up to the
    resolved point and SIGKILLs itself; the survivors (standbys included) detect the deaths
    through the store's heartbeats, agree on them and continue in a new process group
    (ftbench.distributed.membership). Recovery actions are then performed for real: a standby's
    processes take over a replaced node's workers, a restart rebuilds every worker's state
    from the initial weights in place, checkpoints are read from the shared run folder, state
    is copied between processes, and Swift's lost stages are replayed from the checkpoint on
    the boundary logs the other ranks wrote to the shared run folder (DistEngine.replay). Each
    recovery's measured phases are kept for the summary."""

    jumps = False
    cuts_ops = True

    def __init__(self, engine: DistEngine, gpus_per_node: int = 1, active_nodes: int | None = None,
                 membership_store=None, realtime: bool = True, recover: bool = False, stall=None):
        self.engine = engine
        self.stall = stall  # backend.stall: (rank, iteration, seconds) where this job's chaos test pauses
        self.recover = recover  # backend.unannounced=recover (with the membership store)
        self._measured_persist = False
        self._peaks: dict[int, float] = {}
        t = engine.transport
        g = max(1, gpus_per_node)
        self.g = g
        self.node_of_rank = {r: r // g for r in range(t.world)}
        nodes = t.world // g
        active = nodes if active_nodes is None else active_nodes
        self.standbys = list(range(active, nodes))  # nodes whose processes wait to replace a failed one
        self.store = membership_store
        self.realtime = realtime
        self.recoveries: list[dict] = []  # measured phases, one per recovery
        self._pending: dict | None = None
        self._first_after: dict | None = None
        self.log_stats: dict = {}  # Swift's boundary log over the job (finish): log_peak_bytes, log_files
        # (folder, ftbench.journal.Journal): set when the launcher starts new processes after
        # these end (RestartJob); None: a restart rebuilds every worker in place
        self.relaunch = None
        self.restarts = 0  # the job's restarts so far (processes ended and started again)
        self._resumed: dict | None = None  # a restarted process: how its relaunch went, until the recovery uses it

    def start(self, plan) -> None:
        self.engine.build(plan)

    def run_iteration(self, plan, iteration: int) -> float:
        started = time.perf_counter()
        try:
            loss = self.engine.run_iteration(plan, iteration)
        except (DistError, RuntimeError) as err:  # a wait that ended badly: did a process die?
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration)  # raises FailuresDiscovered, or the error
        if self._first_after is not None:
            self._first_after["first_iteration_s"] = time.perf_counter() - started
            self._first_after = None
        return loss

    def iteration_time(self, plan, iteration: int, measured: float) -> float:
        """The leader's measured iteration time, on every rank: each run loop then takes the
        same checkpoint interval from it. A process that dies meanwhile is found as in a save."""
        try:
            return self.engine.transport.all_gather_objects(measured, "share the measured iteration time")[0]
        except (DistError, RuntimeError) as err:
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration, roll_back=False)  # raises FailuresDiscovered, or the error
            raise

    def strike(self, plan, iteration, completed, dead_workers) -> None:
        from ftbench.distributed.membership import Fenced, MembershipError, agree, detect

        engine, t = self.engine, self.engine.transport
        if self.store is None:
            raise DistError("failures on backend=dist need the job's store (the launcher's per-node layout)")
        if engine.plan is not plan:
            engine.adopt(plan)
        node = plan.node_of[dead_workers[0]]
        victims = {r for r, n in self.node_of_rank.items() if n == node and r in t.alive}
        if completed:
            engine.run_iteration(plan, iteration, completed=completed)
        if t.rank in victims:
            die("its node fails here (the failure script): every process of it")
        undone = engine.abandon_iteration()  # survivors that stepped go back to the iteration's start
        try:
            dead, _ = detect(self.store, t.alive, t.timeout_s)
            detected = time.time()
            if dead != victims:
                raise MembershipError(f"node {node} failed (ranks {sorted(victims)}), but the dead ranks are "
                                      f"{sorted(dead)}")
            survivors = [r for r in t.alive if r not in dead]
            agree(self.store, t.epoch + 1, t.rank, survivors, dead, t.timeout_s)
        except Fenced as err:
            die(str(err))
        except MembershipError as err:
            raise DistError(f"rank {t.rank}: {err}") from None
        agreed = time.time()
        death = _death(self.store, dead)
        t.regroup(survivors)
        for r in dead:
            del self.node_of_rank[r]
        phases = self._slowest(_phases(t.rank, death, detected, agreed, time.time()))
        self._pending = {"iteration": iteration, "node": node, "dead_ranks": sorted(dead), **phases}
        if not any(op.kind == OPT for op in completed):
            return 0  # nothing stepped: no rank undid anything (and no sum to wait for)
        return self._job_undone(undone, f"the failure in iteration {iteration}")

    def _slowest(self, phases: dict) -> dict:
        """The phases of the survivor that regrouped last after a death (every survivor calls
        this in the new group, and all keep the same): the job recovered when it had."""
        everyone = self.engine.transport.all_gather_objects(phases, "share the measured recovery phases")
        return max(everyone, key=lambda p: p["death_to_regroup_s"])

    def _job_undone(self, undone: int, where: str) -> int:
        """The survivors' undone steps summed (every survivor calls it, in the new group): the
        job's count, as the local backend has it, kept by every rank (DistEngine.undone)."""
        engine = self.engine
        total = torch.tensor([float(undone)], dtype=torch.float64, device=engine.device)
        engine.transport.all_sum(total, f"count the optimizer steps undone after {where}")
        engine.undone += int(total.item())
        return int(total.item())

    def _unannounced(self, err: BaseException, plan, iteration: int, roll_back: bool = True) -> None:
        """A wait of iteration `iteration` failed. If processes died (a crash no failure script
        announced), their nodes fail: the node's other processes stop too, the survivors agree
        on the dead, roll their replicas back to the iteration's start (backend.unannounced=
        recover) and raise FailuresDiscovered for the run loop, which asks the strategy as for
        a failure at that iteration's start. Else, or with unannounced=stop, the error stands.
        `roll_back=False`: the wait was outside an iteration (a checkpoint), whose state stands."""
        from ftbench.loop import FailuresDiscovered

        undone = []
        nodes, record = self._lose(err, f"iteration {iteration}",
                                   (lambda: undone.append(self.engine.roll_back())) if roll_back else None)
        if roll_back:
            record["undone"] = self._job_undone(undone[0], f"the unannounced death in iteration {iteration}")
        self._pending = {"iteration": iteration, **record}
        raise FailuresDiscovered(nodes, f"ranks {record['dead_ranks']} stopped beating ({type(err).__name__})")

    def _lose(self, err: BaseException, where: str, before_regroup=None) -> tuple[list[int], dict]:
        """A wait failed in `where`: find who died (else `err` stands), stop the rest of their
        nodes, agree among the survivors, call `before_regroup`, and continue in a new process
        group without them. (the dead nodes, the measured phases)."""
        from ftbench.distributed.membership import QUIET_S, Fenced, MembershipError, aborted, agree, detect

        t = self.engine.transport
        log.info("a wait failed in %s: %s", where, describe_error(err))
        t.abandon(f"rank {t.rank} in {where}: {describe_error(err)}")  # the others stop waiting too
        try:
            # Everyone's waits end within seconds (the alarm), so every survivor looks for the
            # dead at about the same time; nobody dead: the wait's own error stands. The
            # silence the failed wait already watched counts.
            seen = t.liveness.observed() if t.liveness is not None else None
            dead, _ = detect(self.store, t.alive, t.timeout_s, observed=seen, quiet_s=QUIET_S)
        except MembershipError:
            raise err from None
        detected = time.time()
        stopped = aborted(self.store, sorted(dead))
        if stopped:  # they did not fail: they ended the job with an error, which stands here too
            raise DistAbort(f"rank {t.rank}: " + "; ".join(f"rank {r} stopped the job: {why}"
                                                           for r, why in stopped.items())) from None
        nodes = sorted({self.node_of_rank[r] for r in dead})
        if not self.recover:
            raise UnannouncedDeath(f"rank {t.rank}: ranks {sorted(dead)} (nodes {nodes}) died in {where}, "
                                   "and no failure was scripted there (backend.unannounced=stop)") from None
        death = _death(self.store, dead)  # the first death: the rest of its node may die later
        victims = {r for r, n in self.node_of_rank.items() if n in nodes and r in t.alive}
        if t.rank in victims:
            die("a process of its node died: the node fails whole")
        try:
            while victims - dead:  # the rest of those nodes stops once it notices too
                more, _ = detect(self.store, sorted(victims - dead), 2 * t.timeout_s)
                dead = dead | more
            detected = time.time()
            survivors = [r for r in t.alive if r not in victims]
            agree(self.store, t.epoch + 1, t.rank, survivors, victims, 3 * t.timeout_s)
        except Fenced as error:
            die(str(error))
        except MembershipError as error:
            raise DistError(f"rank {t.rank}: {error}") from None
        agreed = time.time()
        if before_regroup is not None:
            before_regroup()
        t.regroup(survivors)
        for r in victims:
            del self.node_of_rank[r]
        phases = self._slowest(_phases(t.rank, death, detected, agreed, time.time()))
        log.info("ranks %s died; the survivors regrouped %.2f s after the death (rank %d last)", sorted(victims),
                 phases["death_to_regroup_s"], phases["rank"])
        return nodes, {"node": nodes[0] if len(nodes) == 1 else nodes, "dead_ranks": sorted(victims),
                       "unannounced": True, **phases}

    def perform(self, actions, old, new, iteration: int) -> int | None:
        """The recovery actions, measured. A death while they run (found through a failed wait,
        backend.unannounced=recover) interrupts them: the survivors agree on the dead, go back
        to the state they had before the recovery, and run it again without the dead (copies
        from them taken from another holder); the run loop is then told of the deaths
        (FailuresDiscovered, with the iteration restored), as of a failure at the next
        iteration's start: the recovery completes, then the next failure strikes, as `sim`
        has it for a failure that falls during a recovery."""
        log.info("recovery at iteration %d: %s onto plan %s (crc %08x)", iteration,
                 [type(a).__name__ for a in actions], new.name, plan_crc(new))
        self.stall = stall_here(self.stall, self.engine.rank, iteration)  # once: a straggler, beating all along
        if self.store is None or not self.recover or not actions:
            return self._perform(actions, old, new, iteration, {}, self._pending)
        return self._perform_again_if_interrupted(actions, old, new, iteration)

    def perform_resumed(self, resume: dict, actions, old, new, iteration: int) -> int | None:
        """In the processes started again after a RestartJob: the recovery it interrupted goes on
        from the restart (this process builds every worker's state from the initial weights)
        with what had been done and measured before the processes ended."""
        carried = resume["call_state"]
        first = resume["action"]
        if self.store is None or not self.recover:
            return self._perform(actions, old, new, iteration, carried["phases"], carried["pending"], first=first)
        return self._perform_again_if_interrupted(actions, old, new, iteration, carried, first)

    def _perform_again_if_interrupted(self, actions, old, new, iteration: int, carried: dict | None = None,
                                      first: int = 0) -> int | None:
        from ftbench.loop import FailuresDiscovered

        carried = carried or {"phases": {}, "pending": self._pending, "lost": [], "wasted": 0.0}
        kept, phases, pending = self.engine.keep(), carried["phases"], carried["pending"]
        lost, wasted = carried["lost"], carried["wasted"]
        while True:
            started = time.perf_counter()
            try:
                restored = self._perform(actions, old, new, iteration, phases, pending, lost=lost, first=first,
                                         wasted=wasted)
                break
            except (WaitFailed, RuntimeError) as err:  # a wait failed (other errors stand)
                wasted += time.perf_counter() - started  # until a wait failed: a few seconds (watched waits)
                try:
                    nodes, record = self._lose(err, f"the recovery at iteration {iteration}")
                except DistError as standing:  # nobody died: the job stops here, not as this rank's result
                    raise DistAbort(str(standing)) from None
                lost.append(record)
                self.engine.revert(kept)
                log.info("the recovery at iteration %d runs again without ranks %s", iteration, record["dead_ranks"])
        if not lost:
            return restored
        self.recoveries[-1].update(interrupted_by=[r["dead_ranks"] for r in lost], interrupted_s=wasted)
        self._first_after = None  # the next iteration runs after the recovery from these deaths
        merged = {"iteration": iteration, **lost[-1], "dead_ranks": sorted(r for x in lost for r in x["dead_ranks"]),
                  "detection_s": sum(x["detection_s"] for x in lost),
                  "agreement_s": sum(x["agreement_s"] for x in lost),
                  "new_group_s": sum(x["new_group_s"] for x in lost),
                  "death_to_regroup_s": sum(x["death_to_regroup_s"] for x in lost), "during_recovery": True}
        self._pending = merged
        raise FailuresDiscovered(_lost_nodes(lost), f"ranks {merged['dead_ranks']} stopped beating during the recovery",
                                 restored=restored)

    def _perform(self, actions, old, new, iteration: int, phases: dict, pending, lost=(), first: int = 0,
                 wasted: float = 0.0) -> int | None:
        from ftbench.actions import (LoadFromHost, Rendezvous, ReplayLogs, RestartJob, RestoreCheckpoint,
                                     SaveCheckpoint, SyncFromPeers, UndoSteps, WaitForReplacement)
        from ftbench.recovery_costs import action_seconds

        engine, restored = self.engine, None
        # replacements and returning nodes alike; not the nodes that died in this recovery (the
        # strategy decides about them next)
        self._place(new, skip=set(_lost_nodes(lost)))
        dies = dies_in_recovery(self.engine.kill, self.engine.rank, iteration)
        for index, action in enumerate(actions):
            if index < first:
                continue  # done before the processes restarted
            started = time.perf_counter()
            if isinstance(action, (WaitForReplacement, Rendezvous)) and lost:
                continue  # waited for, or agreed, in the interrupted attempt
            if dies and not isinstance(action, (WaitForReplacement, Rendezvous, UndoSteps)):
                die("backend.kill=RANK:ITERATION:recovery, as the recovery moves state")
            if isinstance(action, WaitForReplacement):
                if self.realtime and action.seconds:
                    time.sleep(action.seconds)
                name = "replacement_s"
            elif isinstance(action, RestartJob):
                if self.relaunch is not None and self._resumed is None:
                    # every process of the job ends here; the launcher starts new ones, which go on below
                    self._end_for_restart(index, iteration, phases, pending, list(lost), wasted)
                engine.build(new)  # every worker's state from the initial weights
                if self._resumed is not None:  # in the new processes: the restart's phases, measured
                    phases.update(self._relaunched(time.perf_counter() - started))
                    continue
                name = "restart_s"
            elif isinstance(action, RestoreCheckpoint):
                restored = engine.restore(action.source, new)
                if action.source == MEMORY:
                    engine.commit(restored)  # what a worker restored is its commit now (as on local)
                name = "state_transfer_s"
            elif isinstance(action, SyncFromPeers):
                engine.copy_replicas(action.copies, new)
                name = "state_transfer_s"
            elif isinstance(action, ReplayLogs):
                engine.replay(new, action.workers, action.since, action.until, max(len(action.helpers), 1))
                name = "replay_s"
            elif isinstance(action, UndoSteps):
                name = "undo_s"  # done when the failure struck (DistEngine.abandon_iteration)
            elif isinstance(action, Rendezvous):
                name = "rendezvous_s"  # the group of the survivors was built when they agreed
            elif isinstance(action, LoadFromHost):
                name = "state_transfer_s"  # the replica is in the worker's memory already (the model charges it)
            elif isinstance(action, SaveCheckpoint):
                self._save(old, iteration, action.mode)  # a death here interrupts the recovery
                if engine.store is not None and engine.rank == engine.transport.leader:
                    engine.store.wait()  # a restart must not begin before the files are complete
                name = "checkpoint_s"
            else:
                raise TypeError(f"the dist backend cannot perform {action!r}")
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
        if dies:
            die("backend.kill=RANK:ITERATION:recovery, at the end (no action moved state)")
        engine.adopt(new)
        if actions:  # every live rank completed it, or none goes on (a death meanwhile interrupts it)
            engine.transport.all_sum(torch.zeros(1, dtype=torch.float64, device=engine.device),
                                     f"finish the recovery at iteration {iteration} with every rank")
            record = dict(pending or {"iteration": iteration})
            record.update(phases)
            record["actions"] = [type(a).__name__ for a in actions]
            record["predicted_actions_s"] = sum(action_seconds(a, old, new, engine.ctx.cost_model) for a in actions)
            self.recoveries.append(record)
            self._first_after = record
        self._pending = None
        return restored

    def _end_for_restart(self, action: int, iteration: int, phases: dict, pending, lost: list,
                         wasted: float) -> None:
        """RestartJob with the launcher's restarts: every live rank gets here; the leader writes
        the run loop's journal and what this recovery has done so far, then every process
        ends (RESTART_EXIT) and the launcher starts new ones on the nodes still up, which go on
        from the journal (ftbench.journal). A death before the journal is complete interrupts
        the recovery as any death during one does."""
        folder, journal = self.relaunch
        engine, t = self.engine, self.engine.transport
        begun = time.time()
        pids = t.all_gather_objects(os.getpid(), f"reach the restart of the job at iteration {iteration}")
        if engine.rank == t.leader:
            if engine.store is not None:
                engine.store.wait()  # a persist in flight completes before the processes end (as in place)
            state = {"ranks": list(t.alive), "epoch": t.epoch, "restarts": self.restarts + 1,
                     "worker_rank": dict(t.worker_rank), "node_of_rank": dict(self.node_of_rank),
                     "standbys": list(self.standbys), "recoveries": self.recoveries, "undone": engine.undone,
                     "measured_persist": self._measured_persist, "stall": self.stall, "kill": engine.kill,
                     "begun": begun, "pids": pids}
            call_state = {"phases": dict(phases), "pending": pending, "lost": lost, "wasted": wasted}
            path = journal.write(folder / f"journal-{self.restarts + 1}", {"call": "perform", "action": action,
                                                                            "state": state, "call_state": call_state})
            if self.store is not None:  # where processes that torchrun starts again find it
                self.store.set(LATEST, str(path))
        t.all_sum(torch.zeros(1, dtype=torch.float64, device=engine.device),
                  f"wait for the restart journal of iteration {iteration}")
        log.info("ends for the restart of the job at iteration %d (restart %d)", iteration, self.restarts + 1)
        exit_now(RESTART_EXIT)

    def resume_state(self, state: dict, entered: float) -> None:
        """A process started again after a RestartJob: the backend's state as the journal kept it."""
        t = self.engine.transport
        t.worker_rank = dict(state["worker_rank"])
        self.node_of_rank, self.standbys = dict(state["node_of_rank"]), list(state["standbys"])
        self.recoveries, self._measured_persist = list(state["recoveries"]), state["measured_persist"]
        self.stall, self.engine.kill, self.engine.undone = state["stall"], state["kill"], state["undone"]
        self.restarts = state["restarts"]
        self._resumed = {"begun": state["begun"], "entered": entered, "ready": time.time(), "pids": state["pids"]}

    def _relaunched(self, rebuild_s: float) -> dict:
        """The restart's phases, from the slowest process of the job: the old processes' end
        (reaching the restart, the journal) to the new ones rebuilding every worker's state."""
        resumed, self._resumed = self._resumed, None
        now = time.time()
        mine = {"restart_s": now - resumed["begun"], "relaunch_s": resumed["entered"] - resumed["begun"],
                "process_init_s": resumed["ready"] - resumed["entered"], "rebuild_s": rebuild_s,
                "replay_journal_s": now - resumed["ready"] - rebuild_s, "pid": os.getpid()}
        key = f"restart/{self.restarts}/launched"  # when ftbench's launcher started the new agents
        if self.store is not None and self.store.check([key]):
            launched = float(self.store.get(key))
            mine.update(agents_exit_s=launched - resumed["begun"], agents_start_s=resumed["entered"] - launched)
        everyone = self.engine.transport.all_gather_objects(mine, "share the measured restart phases")
        slowest = dict(max(everyone, key=lambda p: p["restart_s"]))
        del slowest["pid"]
        # the processes that ended and those that took their place (no id in common: really restarted)
        slowest.update(processes_ended=resumed["pids"], processes_started=[p["pid"] for p in everyone])
        return slowest

    def _place(self, plan, skip=frozenset()) -> None:
        """Nodes of `plan` without live processes (a replacement, a failed node that joins
        again, or a new one) run on a standby node's processes, as a new machine's would."""
        t = self.engine.transport
        alive = set(t.alive)
        homeless = sorted({n for w, n in plan.node_of.items()
                           if t.worker_rank.get(w, w) not in alive and n not in skip})
        if homeless:
            self._take_standbys(homeless, plan)

    def _take_standbys(self, nodes, plan) -> None:
        """Each of these nodes' workers move to the processes of the next standby node."""
        t = self.engine.transport
        for node in nodes:
            workers = sorted(w for w, n in plan.node_of.items() if n == node)
            spare = next((n for n in self.standbys
                          if all(self.node_of_rank.get(n * self.g + i) == n for i in range(self.g))), None)
            if spare is None:
                raise DistError(f"node {node} needs a replacement, but no standby process is left: on backend=dist "
                                "a replacement or a returning node is a standby node's processes (raise "
                                "cluster.spares)")
            self.standbys.remove(spare)
            for i, w in enumerate(workers):
                t.worker_rank[w] = spare * self.g + i
            for i in range(self.g):
                self.node_of_rank[spare * self.g + i] = node
        t._prepared = None  # the same plan may now run on other ranks

    def save(self, plan, iteration: int, mode: str) -> SaveCost:
        """A checkpoint: in-memory commits stay in each process; files are written by the
        leader from the writers' shards. Every rank returns the leader's measured cost, so
        every run loop makes the same decisions from it. A process that dies meanwhile is
        found as in an iteration (FailuresDiscovered), with nothing to roll back: the
        iteration before the checkpoint is complete, and a checkpoint left unfinished does
        not verify, so no restore takes it."""
        if dies_in_save(self.engine.kill, self.engine.rank, iteration):
            die("backend.kill=RANK:ITERATION:save")
        try:
            return self._save(plan, iteration, mode)
        except (DistError, RuntimeError) as err:
            if self.store is None:
                raise
            self._unannounced(err, plan, iteration, roll_back=False)  # raises FailuresDiscovered, or the error
            raise

    def _save(self, plan, iteration: int, mode: str) -> SaveCost:
        engine = self.engine
        t = engine.transport
        if engine.plan is not plan:
            engine.adopt(plan)
        started = time.perf_counter()
        persist, stall, written = 0.0, None, False
        leader = engine.rank == t.leader
        if mode == MEMORY:
            engine.commit(iteration)
        elif mode in (FILE, SNAPSHOT):
            shards = engine.my_shards(plan) if engine.worker is not None else {}
            gathered = t.all_gather_objects(shards, "gather the checkpoint shards")
            if leader:
                merged = {k: v for part in gathered for k, v in part.items()}
                if mode == FILE:
                    written = engine.store.save(iteration, merged).skipped is None
                else:
                    engine.store.save_async(iteration, merged)  # shard() copied: that is the snapshot
                    if not self._measured_persist:  # measure the background persist once, for tuning
                        stall = time.perf_counter() - started
                        persist = engine.store.wait().seconds
            self._measured_persist = self._measured_persist or mode == SNAPSHOT
        else:
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        cost = [time.perf_counter() - started if stall is None else stall, persist, written]
        cost = t.all_gather_objects(cost, "share the checkpoint's cost")[0]  # the leader's, first in rank order
        if cost[2] and engine.boundary_log is not None:  # every rank knows the files are complete now
            self._drop_logs_before(iteration)
        return SaveCost(*cost[:2])

    def _drop_logs_before(self, iteration: int) -> None:
        """A FILE checkpoint of `iteration` is written: each rank deletes its own logs before it;
        the leader also deletes those of workers whose process died (no live BoundaryLog knows
        them), so the log on storage stays within one checkpoint interval after failures too."""
        log = self.engine.boundary_log
        log.drop_before(iteration)
        if self.engine.rank == self.engine.transport.leader:
            for path in log.folder.glob("worker*/iteration*.pt"):
                try:
                    if int(path.stem[len("iteration"):]) < iteration:
                        path.unlink(missing_ok=True)
                except ValueError:
                    continue  # not a log file of ours

    def drop_checkpoints(self, iterations) -> None:
        if self.engine.store is not None and self.engine.rank == self.engine.transport.leader:
            self.engine.store.discard_after_persist(iterations)

    def lose_unfinished_persist(self) -> None:
        """A failure kills a persist still in flight only on the failed node; the leader's
        (which wrote it) finishes unless the leader died, and then it never completes."""
        return None

    def check_memory(self, plan, timeline) -> str | None:
        return None

    def peak_memory(self) -> dict[int, float]:
        return dict(self._peaks)

    def finish(self) -> None:
        t = self.engine.transport
        if self.engine.store is not None and self.engine.rank == t.leader:
            self.engine.store.wait()
        log = self.engine.boundary_log
        if log is not None:
            log.wait()  # every rank's files are written before the leader removes the folder (close_log)
        mine = {} if self.engine.worker is None else {self.engine.worker.id: self.engine.peak_memory}
        stats = (0, 0) if log is None else (log.peak_bytes, log.files_written)
        everyone = t.all_gather_objects((mine, stats), "gather the peak memory")
        self._peaks = {w: v for part, _ in everyone for w, v in part.items()}
        if log is not None:
            # the ranks' logs peak together (every rank seals each iteration and drops at each
            # checkpoint alike), so their sum is the folder's peak; ranks that died are missing
            self.log_stats = {"log_peak_bytes": sum(s[0] for _, s in everyone),
                              "log_files": sum(s[1] for _, s in everyone)}

    def close_log(self) -> None:
        """The run is over: the leader removes the log folder (every rank's writes ended in
        `finish`); the others only stop their writer."""
        log = self.engine.boundary_log
        if log is not None:
            log.close(remove=self.engine.rank == self.engine.transport.leader)
