"""The `dist` backend's engine: this rank's worker and its ops of the plan.

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

The run loop's `Backend` protocol over this engine is `DistBackend` (ftbench.distributed.backend).
"""
from __future__ import annotations

import torch

from ftbench.actions import HOST, MEMORY, NO_HOST_CHECKPOINT
from ftbench.distributed.faults import die, dies_among_ops
from ftbench.distributed.membership import log
from ftbench.distributed.transport import DistError, DistTransport, plan_crc
from ftbench.engine.boundary_log import ReplayTransport, unusable_replay
from ftbench.engine.iteration_work import performing
from ftbench.engine.log_file import replay_sources
from ftbench.engine.transport import ACT
from ftbench.errors import ResultError
from ftbench.engine.executor import WorkerExecutor, in_chunk, pipeline_share, step_members, sum_chunks, take_grads
from ftbench.engine.op_times import now as op_clock
from ftbench.engine.state import EngineState, load_shards, newest_commits, on_cpu
from ftbench.engine.worker import Worker
from ftbench.layers import GradientSync, fragment_layout, model_layers, stage_units
from ftbench.engine.local import covers, fragment_writers, holding, replica_units, replicas_agree
from ftbench.schedule import F, OPT, RSYNC, Op, dependency_graph, topological_order


class DistEngine(EngineState):
    """This rank's worker (ftbench.engine.state.EngineState: `workers` holds it alone, or
    nothing on a standby) and its ops of the plan, over the transport."""

    def __init__(self, ctx, data, lr: float, weight_decay: float, dtype: torch.dtype, transport: DistTransport,
                 device: torch.device, store=None, recompute: str = "none", undo: bool = False,
                 kill: tuple[int, int, int] | None = None, boundary_log=None):
        # Swift's boundary log (ftbench.engine.boundary_log): this rank's own BoundaryLog on the
        # run folder every rank shares, so a replay reads what the other ranks' workers sent
        super().__init__(ctx, data, lr, weight_decay, dtype, store, boundary_log, device)
        # `undone` (EngineState's): optimizer steps undone over the run by the whole job
        # (abandoned iterations), as this rank learnt it: each strike's survivors sum their
        # counts (DistBackend)
        # backend.unannounced=recover: an unannounced death rolls the survivors back to the start
        # of the iteration in flight (roll_back). Nothing is copied for it: every replica's
        # optimizer steps through its StepUndo (ftbench.engine.undo), which keeps the step's
        # gradient until the iteration completes, as scripted strikes after a step need too.
        self.undo = undo
        self.kill = kill  # backend.kill: (rank, iteration, ops) where this job's chaos test dies
        self.recompute = recompute  # train.recompute, as the local backend's executor takes it
        self.transport = transport
        self.rank = transport.rank
        self._steps = None  # (plan key, steps, loss slots, members, syncs each OPT waits for)
        self._crc = (None, 0)  # (plan, its fingerprint)
        self._outs: dict = {}  # LocalSGD or DiLoCo: loss slot -> (pipeline, own mean), this iteration's
        self.peak_memory = 0  # this rank's peak (its worker's, whichever worker it runs)

    # -- state ----------------------------------------------------------------------------
    @property
    def worker(self) -> Worker | None:
        """This rank's worker in the plan (None: it runs none, a standby)."""
        return next(iter(self.workers.values()), None)

    def adopt(self, plan) -> list:
        """Continue with `plan` (EngineState.adopt): this rank's worker keeps the replicas it
        still holds and builds those it newly holds from the initial weights; a worker this
        rank no longer runs is freed."""
        self.transport.prepare(plan)
        me = self.transport.worker
        for w in [w for w in self.workers if w != me]:
            self.workers.pop(w).destroy()
        return super().adopt(plan)

    def _holds(self, plan) -> dict:
        me = self.transport.worker
        return {} if me is None else {me: plan.holds.get(me, ())}

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
        members = {n: step_members(plan, n, self.local_steps) for n in deps if isinstance(n, GradientSync)}
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
        tokens = self.samples(plan, iteration)
        normaliser = tokens.normaliser
        world = self.transport.world
        vector = torch.zeros(len(slots) + 2 * world, dtype=torch.float64, device=self.device)
        self._outs = {}
        if self.worker is not None:
            extra = {} if self.recompute == "none" else {"recompute": self.recompute}
            transport = self.transport if completed is None else _CutTransport(self.transport, plan, completed)
            # the strategy's per-iteration work (Swift's logging: a cut iteration's records are
            # dropped with it, abandon_iteration)
            transport = performing(self.iteration_work(plan), transport, self.boundary_log, iteration)
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
                    if executor.outs:  # LocalSGD or DiLoCo: the pipeline's own mean (finish_without)
                        self._outs[slots[op]] = executor.outs.pop()
            if dies_after is not None:
                die("backend.kill: unannounced, past this worker's last op of the iteration")
            for sync in late:
                executor.reduce_wait(sync, members[sync])
            self.transport.flush_sends()
            self.transport.flush_state_sends()  # redundant copies' refreshes (Bamboo)
            self._track_memory()
        if completed is not None:
            return None
        return self._end_iteration(plan, iteration, tokens, vector, len(slots), timed=True)

    def finish_without(self, plan, iteration: int, touched: frozenset) -> float:
        """After `run_iteration` cut at the ops that finish the pipelines a failure left alone
        and the regroup without the dead (RunLoop._finish_without): the touched pipelines' live
        replicas drop the iteration, and the others end it, their sync among themselves and
        the loss over their samples (ftbench.engine.executor.finished_loss, in the same order)."""
        self.abandon_pipelines(plan, touched)
        _, slots, _, _ = self._plan_steps(plan)
        samples = self.samples(plan, iteration, without=touched)
        vector = torch.zeros(len(slots) + 2 * self.transport.world, dtype=torch.float64, device=self.device)
        for slot, (pipeline, out) in self._outs.items():
            if pipeline not in touched:
                vector[slot] = pipeline_share(out, pipeline, samples.per_pipeline, samples.normaliser)
        return self._end_iteration(plan, iteration, samples, vector, len(slots), without=touched)

    def _end_iteration(self, plan, iteration: int, tokens, vector, n_slots: int, timed: bool = False,
                       without: frozenset = frozenset()) -> float:
        """Every rank's ops of the iteration are done: the LocalSGD/DiLoCo sync, then the loss
        sum with every rank's iteration and plan fingerprint, checked; the steps stand (and
        with `timed`, an iteration whose ops were being timed is kept)."""
        self._outs = {}
        world = self.transport.world
        # LocalSGD's or DiLoCo's window, on every rank (a standby may take a group's worker
        # over), and its sync, undone if a death cuts it (abandon_iteration)
        self.after_ops(plan, iteration, tokens, keep=True, without=without)
        vector[n_slots + self.rank] = iteration + 1
        if self._crc[0] is not plan:
            self._crc = (plan, plan_crc(plan))
        vector[n_slots + world + self.rank] = self._crc[1]
        self.transport.all_sum(vector, f"end iteration {iteration} with every rank (the loss sum)")
        marks = vector[n_slots:].tolist()
        alive = self.transport.alive  # the dead left zeros
        its, crcs = [marks[r] for r in alive], [marks[world + r] for r in alive]
        if len(set(its)) != 1 or len(set(crcs)) != 1:
            raise DistError(f"the ranks' run loops disagree at iteration {iteration}: iterations "
                            f"{[int(m) - 1 for m in its]}, plan fingerprints {[int(m) for m in crcs]} (ranks {alive})")
        self._commit_steps()  # every rank ended the iteration: its steps stand
        if timed:
            self.op_timer.end()  # an iteration being timed (this rank's worker's ops) completed
        if self.boundary_log is not None:
            self.boundary_log.seal(iteration)  # only now: a death before the sum abandons the iteration
        loss = torch.zeros((), dtype=torch.float64)
        for share in vector[:n_slots].cpu():
            loss += share  # the global order, as the local driver adds
        return float(loss)

    def _record_memory(self, worker, state: int) -> None:
        """This rank's peak, whichever worker it runs: device state and activations, plus the
        boundary log's buffer of the iteration in flight (Swift), until it is written."""
        if self.boundary_log is not None:
            state += self.boundary_log.buffered(worker.id)
        self.peak_memory = max(self.peak_memory, state + worker.peak_activation_bytes)

    def roll_back(self) -> int:
        """An unannounced death cut the iteration in flight: drop it, and give every replica
        back the state it had when the iteration began: those that stepped undo their step
        (abandon_iteration), the others never left it. Returns the replicas undone here."""
        if not self.undo:
            raise DistError(f"rank {self.rank}: rolling back an iteration needs backend.unannounced=recover")
        return self.abandon_iteration()

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
            everyone = t.all_gather_objects(on_cpu(mine), "gather the in-memory commits")
            commits = [c for part in everyone for c in part]
            self.adopt(plan)
            iteration, shards = newest_commits(commits)
        else:
            if self.rank == t.leader and self.store is not None:
                self.store.wait()  # a persist in flight completes before anyone reads
            t.all_sum(torch.zeros(1, dtype=torch.float64, device=self.device), "wait for the checkpoint files")
            self.adopt(plan)
            if source == HOST:  # this rank's parameters, from every node's host memory still there
                loaded = self.host_memory.load(self.expected_shapes(plan))
            else:
                loaded = self.store.load() if self.store is not None else None
            found = torch.zeros(len(t.alive), dtype=torch.float64, device=self.device)
            found[t.alive.index(self.rank)] = -1 if loaded is None else loaded[0]
            t.all_sum(found, "agree on the checkpoint to restore")
            if len(set(found.tolist())) != 1:
                root = (self.host_memory if source == HOST else self.store).root
                raise DistError(f"the ranks found different checkpoints in {root}: iterations "
                                f"{[int(v) for v in found.tolist()]} (ranks {t.alive}); is the run folder shared?")
            if loaded is None and source == HOST:  # every rank alike: none found one
                raise ResultError("unrecoverable", NO_HOST_CHECKPOINT)
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
        samples = self.samples(plan, iteration)
        executor = WorkerExecutor(self.worker, transport, plan, samples, samples.normaliser, **extra)

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
        """This rank's shards of a checkpoint of `plan`; right after a failure (a save before
        anything is rebuilt) only the workers of live ranks write, as every rank decides alike
        from the agreed membership."""
        n = model_layers(plan.partition)
        t = self.transport
        up = set(t.alive)
        alive = None if all(t.rank_of(w) in up for w in plan.holds) else (lambda w: t.rank_of(w) in up)
        return {name: on_cpu(self.worker.replica(layers).shard(units, n))
                for name, w, layers, units in fragment_writers(plan, alive) if w == t.worker}

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
