"""`DistTransport`: the transport seam (ftbench.engine.transport.Transport) over torch.distributed.

One process per worker; a worker's rank is its worker id (`rank_of`). What crosses processes:

- **Activations and gradients** go point-to-point, `isend` by the producer (never blocking,
  so two neighbours that both send before they receive cannot deadlock) and `irecv` by the
  consumer at the op that needs it. Each *direction* between two ranks has a process group
  of its own (`src -> dst`), so its stream carries messages of one direction only, in the
  producer's op order; `prepare` checks, from the plan, that every consumer takes them in
  that same order (NCCL matches point-to-point messages by order alone). On gloo every
  message also carries a tag made from its key (kind, pipeline, stage, micro-batch), so a
  message can only ever land in the receive posted for that key.
- **Gradient sums** of one layer fragment (ftbench.layers.GradientSync) run in a process
  group of the fragment's members (one per member set), on one flat buffer
  per fragment. Two members all-reduce (a + b == b + a bit for bit); three or more
  all-gather and add in member order, the order the in-process transport adds in, so the
  sums, hence the trained weights, equal the `local` backend's exactly. The slots of a
  fragment (which parameters have a gradient, their shapes) are agreed once per fragment and
  plan with a small all-reduce.

Every wait has a deadline (`timeout_s`, the process groups' timeout too) and a wait that
runs past it raises `DistTimeout` naming this worker, the peer and the operation. With
heartbeats (the per-node layout) every wait is also *watched*, so that a death any rank
notices reaches every survivor within seconds, whatever it waits on (gloo cannot abort an
operation in flight, so the waits give up themselves):

- a collective, and a group's creation, is waited for in periods of WATCH_EVERY_S; between
  two, it gives up when a rank posted the epoch's alarm (`Told`) or a peer's heartbeat went
  silent (`PeerSilent`). A peer that is alive but slow beats, and is waited for up to the
  deadline.
- a rank whose wait failed (a closed connection, `ConnectionLost`, a silent peer, its
  deadline, an alarm) leaves the epoch (`abandon`): it posts the alarm and closes its groups,
  so a peer blocked in a send or receive with it, which cannot be waited for in periods (a
  gloo send or receive that times out closes its connection), sees the connection close.

Groups are torch's gloo (or NCCL) process groups built directly on the job's store, named by
the membership epoch and their ranks (`Group`): only the members build one, so after a
failure the survivors make the groups of the new epoch without the dead (torch's
`new_group` would need every rank of the job, or names that depend on each process's
history). Every rank calls `prepare(plan)` at the same point with the same plan and builds
the groups it belongs to in one fixed order.
"""
from __future__ import annotations

import datetime
import threading
import time
import zlib

import torch
import torch.distributed as dist

from ftbench.distributed.membership import log
from ftbench.engine.transport import ACT, GRAD, Key
from ftbench.errors import UserError
from ftbench.layers import GradientSync, fragment_layout
from ftbench.schedule import B, BW, F, OPT, RSYNC, Op

KIND_CODE = {ACT: 0, GRAD: 1}
WATCH_EVERY_S = 0.25  # a watched wait looks at the alarm and the peers' heartbeats this often
EARLY = 0.9  # a timeout gloo reports before this share of backend.timeout_s is its own, not our deadline
MAX_DIMS = 4  # parameters have at most this many dimensions (GPT-2's have 1 or 2)


class DistError(UserError):
    """A distributed run that cannot go on: a peer that does not answer, a job past its deadline."""


class RankFailed(RuntimeError):
    """A rank of a dist job raised an exception that is no user error (a bug): not a DistError,
    so the run ends with status `error` from an exception and the command exits 1."""


class WaitFailed(DistError):
    """A wait that ended without its answer: names the waiting worker, the peer and the op, and
    why (the subclasses), which the rank's log repeats when it looks for the dead."""


class DistTimeout(WaitFailed):
    """A wait that ran past `backend.timeout_s` with every peer beating: a straggler, or a peer
    stuck on someone else."""


class ConnectionLost(WaitFailed):
    """gloo reported the connection to a peer closed: its process died, or it left the epoch's
    groups after a failure of its own (DistTransport.abandon)."""


class PeerSilent(WaitFailed):
    """A peer's heartbeat stopped moving while this rank waited: a dead or frozen process."""


class Told(WaitFailed):
    """Another rank posted the epoch's alarm (ftbench.distributed.membership.Alarm): it stopped
    waiting, so nobody can finish this wait."""


class UnannouncedDeath(DistError):
    """A process died where no failure was scripted, and backend.unannounced=stop ends the run
    there: a result of its own (status "died", exit code 5), neither a bad setting nor a bug."""

    status = "died"


class DistAbort(RuntimeError):
    """The job stops on every rank: a wait of a recovery failed and no process had died, or a
    rank that stopped with an error (not a failure) is missing. Not a run result (the run
    loop turns UserErrors of a recovery into a status on the rank that raised them): the
    launcher reports the job's earliest error, the root cause. Never a bug of its own (a
    rank's bug is that rank's earlier error): `user_error` in its error record."""

    user_error = True


def describe_error(err: BaseException) -> str:
    """An exception as one line: its type and its message's first line (gloo's run on)."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


CLOSED = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")  # gloo's words for a gone peer


def _closed(err: BaseException) -> str | None:
    """gloo's sentence saying a connection closed ("Connection closed by peer [host]:port"), if it is one."""
    text = str(err)
    for word in CLOSED:
        at = text.find(word)
        if at >= 0:
            return text[at:].split(". ")[0].splitlines()[0]
    return None


def tag_of(key: Key) -> int:
    """A point-to-point tag unique per message key within an iteration (gloo matches on it)."""
    kind, pipeline, stage, microbatch = key
    if not (0 <= pipeline < 256 and 0 <= stage < 256 and 0 <= microbatch < 2 ** 14):
        raise DistError(f"message {key} is outside the tag range (256 pipelines, 256 stages, 16384 micro-batches)")
    return (((KIND_CODE[kind] << 8) | pipeline) << 8 | stage) << 14 | microbatch


def describe(key: Key) -> str:
    kind, pipeline, stage, microbatch = key
    what = "activation" if kind == ACT else "gradient"
    return f"the {what} of stage {stage}, micro-batch {microbatch} of pipeline {pipeline}"


def plan_crc(plan) -> int:
    """A fingerprint of a plan that is the same in every process (str hashes are salted): its
    ops worker by worker, whichever way the schedule holds them (a plan read from the plan
    cache is a plain dict where the one planned here is a lazy grid)."""
    from ftbench.schedule import read_ops

    schedule = plan.schedule
    read = read_ops(schedule)
    crc = zlib.crc32(repr((plan.name, schedule.stages, schedule.microbatches, plan.partition)).encode())
    for w in sorted(schedule.ops):
        crc = zlib.crc32(repr((w, [tuple(op) for op in read(w)])).encode(), crc)
    return crc


def p2p_order(plan) -> tuple[dict, dict]:
    """Per direction (src worker, dst worker): the message keys the producer sends, in its op
    order, and those the consumer receives, in its op order."""
    schedule = plan.schedule
    where = schedule.index()
    sends: dict = {}
    receives: dict = {}
    for w in schedule.workers:
        for op in schedule.ops[w]:
            last = plan.is_last_stage(op.pipeline, op.stage)
            if op.kind == F:
                if op.stage > 0:
                    src = where[Op(F, op.stage - 1, op.microbatch, op.pipeline)]
                    receives.setdefault((src, w), []).append((ACT, op.pipeline, op.stage - 1, op.microbatch))
                if not last:
                    dst = where[Op(F, op.stage + 1, op.microbatch, op.pipeline)]
                    sends.setdefault((w, dst), []).append((ACT, op.pipeline, op.stage, op.microbatch))
            elif op.kind in (B, BW):
                if not last:
                    src = where[schedule.backward_input_op(op.stage + 1, op.microbatch, op.pipeline)]
                    receives.setdefault((src, w), []).append((GRAD, op.pipeline, op.stage, op.microbatch))
                if op.stage > 0:
                    dst = where[schedule.backward_input_op(op.stage - 1, op.microbatch, op.pipeline)]
                    sends.setdefault((w, dst), []).append((GRAD, op.pipeline, op.stage - 1, op.microbatch))
    return sends, receives


def redundant_pairs(plan) -> list[tuple[int, int]]:
    """(worker that steps a stage, worker holding its redundant copy) per RSYNC op, in a fixed
    order: the state copies every iteration of the plan makes."""
    schedule = plan.schedule
    where = schedule.index()
    return sorted((where[Op(OPT, op.stage, op.microbatch, op.pipeline)], w)
                  for w in schedule.workers for op in schedule.ops[w] if op.kind == RSYNC)


class DistTransport:
    """The Transport protocol over torch.distributed for the worker of this process."""

    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device, dtype: torch.dtype,
                 message_shape: tuple[int, ...], ordered: bool = False, alive: list[int] | None = None,
                 epoch: int = 0):
        self.rank, self.world = rank, world
        self.timeout_s = float(timeout_s)
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.device, self.dtype, self.message_shape = device, dtype, tuple(message_shape)
        self.ordered = ordered  # the backend matches messages by order only (NCCL): refuse plans that reorder
        self.worker: int | None = None  # this process's worker in the current plan
        # Membership (ftbench.distributed.membership): the live ranks, the group they all share (None:
        # the default group, before any failure), the epoch it belongs to, and which rank runs
        # each worker (a standby's rank takes over the workers of the node it replaces).
        # (a job's processes restarted by RestartJob: the ranks that came back, in an epoch of their own)
        self.alive: list[int] = list(range(world)) if alive is None else sorted(alive)
        self.epoch = epoch
        self.worker_rank: dict[int, int] = {}
        # Watching (with heartbeats: the per-node layout): every collective wait and group
        # creation also ends when the epoch's alarm is posted or a peer stops beating, and a
        # rank that leaves the epoch closes its groups (`abandon`). None: waits only have their
        # deadline (a job without failures).
        self.alarm = None  # ftbench.distributed.membership.Alarm
        self.liveness = None  # ftbench.distributed.membership.Liveness of this epoch
        self._builder = None  # a store client of group creations' own (a client runs one call at a time)
        from ftbench.distributed.membership import job_store

        self.store = job_store(self.timeout_s)
        self.group = self._new_group(self.alive, "all")  # every live rank
        self._pairs: dict[tuple[int, int], object] = {}  # (src rank, dst rank) -> group of that direction
        self._groups: dict[tuple[int, ...], object] = {}  # sorted member ranks -> fragment group
        self._slots: dict = {}  # (sync, members) -> per slot: shape or None (no member has a gradient)
        self._sends: list = []  # (work, tensor, key, dst) in flight
        self._own: dict = {}  # key -> tensor a worker sent to itself (it runs both stages)
        self._state_sends: list = []  # (work, tensor, units, dst) of state copies in flight
        self._reductions: dict = {}  # sync -> (work, buffer(s), members, slots)
        self._prepared = None

    # -- ranks and groups ---------------------------------------------------------------
    def rank_of(self, worker: int) -> int:
        rank = self.worker_rank.get(worker, worker)
        if not 0 <= rank < self.world:
            raise DistError(f"worker {worker} has no process: the job has {self.world} (one per GPU of every node, "
                            f"standbys included: ranks 0..{self.world - 1})")
        return rank

    @property
    def leader(self) -> int:
        """The lowest live rank: it writes the metrics, the checkpoint files and the results."""
        return self.alive[0]

    def watch(self, alarm) -> None:
        """Watch every wait from now on (heartbeats run): see `_watch`."""
        from ftbench.distributed.membership import Liveness

        self.alarm, self.liveness = alarm, Liveness(self.store)
        alarm.epoch = self.epoch

    def _new_group(self, ranks, name: str = "group") -> "Group":
        """A process group of `ranks` in this membership epoch, created by its members only,
        named by the epoch and its ranks in the job's store (every member derives the same
        name, and ranks outside it, dead ones included, never need to answer). Watched, the
        creation runs in a thread of its own, so that the alarm or a silent member ends the
        wait: gloo's constructor waits for every member's address up to the deadline."""
        ranks = tuple(sorted(ranks))
        prefix = f"pg/{self.epoch}/{name}/{'-'.join(map(str, ranks))}/"
        what = f"build the process group '{name}' of ranks {list(ranks)} (membership epoch {self.epoch})"
        started = time.perf_counter()
        if self.alarm is None:
            try:
                return Group(self.store, prefix, ranks, self.rank, self.timeout, self.device)
            except RuntimeError as err:  # a member that never joined: the store's wait, or gloo's connect, timed out
                raise self._failure(err, f"rank {self.rank}", what, time.perf_counter() - started) from None
        from ftbench.distributed.membership import job_store

        if self._builder is None:
            self._builder = job_store(self.timeout_s)
        built: list = []

        def build() -> None:
            try:
                built.append(Group(self._builder, prefix, ranks, self.rank, self.timeout, self.device))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                built.append(err)

        thread = threading.Thread(target=build, name="ftbench-new-group", daemon=True)
        thread.start()
        try:
            self._watch(lambda s: (thread.join(s), not thread.is_alive())[1], f"rank {self.rank}", what,
                        [r for r in ranks if r != self.rank])
        except WaitFailed:
            self._builder = None  # the abandoned creation keeps its client until gloo's own deadline
            raise
        if isinstance(built[0], BaseException):
            raise self._failure(built[0], f"rank {self.rank}", what, time.perf_counter() - started) from None
        return built[0]

    def regroup(self, alive: list[int]) -> None:
        """Continue with the ranks `alive` (every one of them calls this at the same point): a
        new epoch with its own groups; messages and sums in flight are dropped with the old ones."""
        self.alive = sorted(alive)
        self._close_groups()
        self.epoch += 1
        if self.alarm is not None:
            from ftbench.distributed.membership import Liveness

            self.alarm.epoch, self.liveness = self.epoch, Liveness(self.store)
        log.info("regroup: epoch %d, ranks %s", self.epoch, self.alive)
        self.group = self._new_group(self.alive, "all")

    def abandon(self, why: str) -> dict | None:
        """This rank leaves the epoch's collectives (a wait of it failed): post the alarm, so
        every other rank's waits give up too, and close the epoch's groups, so that a peer
        blocked in a send or receive with this rank (which nothing else can end) sees the
        connection close. The epoch's alarm (this one, or an earlier rank's)."""
        if self.alarm is None:
            return None
        try:
            first = self.alarm.post(why)
        except Exception as err:  # noqa: BLE001 - the store is gone: nobody is waiting any more
            log.info("could not post the alarm (%s)", describe_error(err))
            first = None
        self._close_groups()
        return first

    def _close_groups(self) -> None:
        """Drop every group of this epoch (and what is in flight on them). Each is destroyed in a
        thread of its own: gloo's destructor waits for a collective in flight, which ends only at
        its peers' closing or its own deadline, while a group of sends and receives closes its
        connections at once (the peer's pending receive fails: how a departure propagates)."""
        groups = [g for g in (self.group, *self._pairs.values(), *self._groups.values()) if g is not None]
        self.clear()
        self._pairs.clear()
        self._groups.clear()
        self._slots.clear()
        self._prepared = None
        self.group = None
        while groups:  # the thread holds the only reference (no name here keeps one): the destructor runs there
            threading.Thread(target=_drop, args=([groups.pop()],), name="ftbench-close-group", daemon=True).start()

    def forget_plan(self) -> None:
        """Workers moved to other ranks (a standby took them over): the next `prepare` builds
        the groups again, even for the plan prepared last."""
        self._prepared = None

    def prepare(self, plan) -> None:
        """Create the process groups `plan` needs (collective: every rank, same plan, same point)."""
        key = plan.key()
        if self._prepared == key:
            return
        self.worker = next((w for w in plan.workers if self.rank_of(w) == self.rank), None)
        sends, receives = p2p_order(plan)
        if self.ordered:
            for pair, keys in sorted(sends.items()):
                if pair[0] != pair[1] and receives.get(pair) != keys:  # a worker's own messages stay in its process
                    src, dst = pair
                    raise DistError(f"plan {plan.name!r}: worker {dst} takes the messages of worker {src} in "
                                    "another order than they are sent, which a backend matching messages by "
                                    "order (NCCL) cannot deliver")
        # Ranks that died during a recovery still run workers of the plan it was heading for,
        # until the strategy's next plan leaves them out: no group waits for them meanwhile.
        alive = set(self.alive)
        for src, dst in sorted(sends):
            pair = (self.rank_of(src), self.rank_of(dst))
            if pair not in self._pairs and self.rank in pair and pair[0] != pair[1] and set(pair) <= alive:
                self._pairs[pair] = self._new_group(pair, f"from{pair[0]}to{pair[1]}")  # one per direction
        self.state_groups(redundant_pairs(plan))  # Bamboo's redundant copies are refreshed every iteration
        for sync in fragment_layout(plan.schedule.stages, plan.partition).syncs:
            members = _members(plan, sync)
            if len(members) < 2:
                continue
            ranks = tuple(sorted(self.rank_of(m) for m in members))
            if ranks not in self._groups and self.rank in ranks and set(ranks) <= alive:
                self._groups[ranks] = self._new_group(ranks, "fragment")
        self._slots.clear()
        self._prepared = key

    # -- waits --------------------------------------------------------------------------
    def _wait(self, work, what: str, p2p: bool = False) -> None:
        me = f"worker {self.worker} (rank {self.rank})" if self.worker is not None else f"rank {self.rank}"
        started = time.perf_counter()
        try:
            if self.alarm is None or p2p:
                # A gloo send or receive cannot be waited for in slices (one that times out closes
                # its connection): it ends at its deadline, or when the peer dies or leaves the
                # epoch (`abandon` closes its groups).
                done = work.wait(timeout=self.timeout)
                if done is False:
                    raise RuntimeError("Timed out: the wait returned unfinished")
            else:
                self._watch(lambda s: _waited(work, s), me, what, [r for r in self.alive if r != self.rank])
        except WaitFailed:
            raise
        except Exception as err:  # noqa: BLE001 - gloo and NCCL raise different types
            raise self._failure(err, me, what, time.perf_counter() - started) from None

    def _watch(self, done, me: str, what: str, peers: list[int]) -> None:
        """Wait until `done(seconds)` (which waits at most that long) says it is done; between
        two looks, give up when the deadline passed (DistTimeout), a rank posted the epoch's
        alarm (Told) or one of `peers` stopped beating (PeerSilent). The first look waits a
        whole period: a wait that completes in it costs nothing more."""
        started = time.perf_counter()
        while not done(WATCH_EVERY_S):
            waited = time.perf_counter() - started
            if waited > self.timeout_s:
                raise DistTimeout(f"{me} waited more than {self.timeout_s:g} s (backend.timeout_s) to {what}: "
                                  "no answer, every peer beating")
            alarm = self.alarm.posted()
            if alarm is not None:
                raise Told(f"{me} stopped waiting to {what} after {waited:.1f} s: told by rank {alarm['rank']} "
                           f"({alarm['why']})")
            silent = self.liveness.silent(peers)
            if silent:
                raise PeerSilent(f"{me} stopped waiting to {what} after {waited:.1f} s: ranks {silent} stopped "
                                 f"beating (silent for {self.liveness.stale_s:g} s)")

    def _failure(self, err: BaseException, me: str, what: str, waited: float | None = None) -> WaitFailed:
        """gloo's (or NCCL's) error of a wait that lasted `waited` seconds (measured here), as what
        happened: a closed connection, the deadline, or a timeout gloo reported before it (issue 36:
        an "Operation timed out!" after under a second read as "waited more than 60 s")."""
        closed = _closed(err)
        if closed:
            return ConnectionLost(f"{me} could not {what}: the connection closed ({closed}): the peer died or left "
                                  "the membership epoch")
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            if waited is not None and waited < EARLY * self.timeout_s:
                return DistTimeout(f"{me} could not {what}: gloo reported a timeout after {waited:.1f} s, before "
                                   f"backend.timeout_s ({self.timeout_s:g} s) ({describe_error(err)})")
            measured = f" (after {waited:.1f} s)" if waited is not None else ""
            return DistTimeout(f"{me} waited more than {self.timeout_s:g} s (backend.timeout_s) to {what}{measured}: "
                               f"no answer ({describe_error(err)})")
        return WaitFailed(f"{me} could not {what}: {describe_error(err)}")

    # -- point to point -----------------------------------------------------------------
    def send(self, key: Key, tensor: torch.Tensor, src: int, dst: int) -> None:
        s, d = self.rank_of(src), self.rank_of(dst)
        if s == d:  # a worker running two stages (Bamboo's failover) hands itself the boundary
            self._own[key] = tensor.detach()
            return
        t = tensor.detach().contiguous()
        group = self._pairs[(s, d)]
        work = group.pg.send([t], group.index(d), tag_of(key))
        self._sends.append((work, t, key, dst))

    def receive(self, key: Key, src: int, dst: int) -> torch.Tensor:
        s, d = self.rank_of(src), self.rank_of(dst)
        if s == d:
            return self._own.pop(key)
        buffer = torch.empty(self.message_shape, dtype=self.dtype, device=self.device)
        group = self._pairs[(s, d)]
        work = group.pg.recv([buffer], group.index(s), tag_of(key))
        self._wait(work, f"receive {describe(key)} from worker {src} (rank {s})", p2p=True)
        return buffer

    def flush_sends(self) -> None:
        """Wait until every message this worker sent was taken (end of an iteration)."""
        sends, self._sends = self._sends, []
        for work, _, key, dst in sends:
            self._wait(work, f"send {describe(key)} to worker {dst} (rank {self.rank_of(dst)}), which did not take it",
                       p2p=True)

    # -- gradient sums ------------------------------------------------------------------
    def reduce_start(self, sync: GradientSync, worker: int, members: tuple[int, ...], tensors: list) -> None:
        members = tuple(members)
        ranks = tuple(sorted(self.rank_of(m) for m in members))
        group = self._groups[ranks]
        slots = self._slots.get((sync, members))
        if slots is None:
            slots = self._slots[(sync, members)] = self._agree_slots(sync, members, group, tensors)
        parts = []
        for t, shape in zip(tensors, slots):
            if shape is None:
                if t is not None:
                    raise DistError(f"worker {worker} has a gradient in slot of {sync} that no member had before")
                continue
            parts.append(t.reshape(-1) if t is not None else
                         torch.zeros(_numel(shape), dtype=self.dtype, device=self.device))
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self.device)
        if len(members) == 2:
            work = group.pg.allreduce([flat])
            self._reductions[sync] = (work, flat, None, members, slots)
        else:
            gathered = [torch.empty_like(flat) for _ in ranks]
            work = group.pg.allgather([gathered], [flat])
            self._reductions[sync] = (work, flat, gathered, members, slots)

    def reduce_wait(self, sync: GradientSync, worker: int) -> list:
        work, flat, gathered, members, slots = self._reductions.pop(sync)
        self._wait(work, f"sum the gradients of layer fragment {sync.units} with workers "
                         f"{', '.join(str(m) for m in members if m != worker)} (ranks "
                         f"{', '.join(str(self.rank_of(m)) for m in members if m != worker)})")
        if gathered is not None:  # add in member order: the in-process transport's order
            position = {r: i for i, r in enumerate(sorted(self.rank_of(m) for m in members))}
            total = gathered[position[self.rank_of(members[0])]].clone()
            for m in members[1:]:
                total.add_(gathered[position[self.rank_of(m)]])
            flat = total
        sums, offset = [], 0
        for shape in slots:
            if shape is None:
                sums.append(None)
                continue
            n = _numel(shape)
            sums.append(flat[offset:offset + n].view(shape))
            offset += n
        return sums

    def _agree_slots(self, sync, members, group, tensors) -> list:
        """Which slots any member has a gradient in, and their shapes (one small all-reduce)."""
        header = torch.zeros((len(tensors), 1 + MAX_DIMS), dtype=torch.int64, device=self.device)
        for i, t in enumerate(tensors):
            if t is not None:
                if t.dim() > MAX_DIMS:
                    raise DistError(f"a gradient of {sync} has {t.dim()} dimensions (at most {MAX_DIMS})")
                header[i, 0] = t.dim() + 1
                for j, size in enumerate(t.shape):
                    header[i, 1 + j] = size
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        work = group.pg.allreduce([header], options)
        self._wait(work, f"agree on the gradients of layer fragment {sync.units} with workers {members}")
        slots = []
        for row in header.tolist():
            slots.append(None if row[0] == 0 else tuple(row[1:row[0]]))
        return slots

    # -- state copies (recovery: a worker taking layers from a live holder) ----------------
    def state_groups(self, pairs) -> None:
        """Create the groups for state copies between (src worker, dst worker) `pairs`, in the
        given order (every rank walks the same list, so creations never wait on each other in
        a cycle); one group per unordered pair of ranks."""
        for src, dst in pairs:
            key = ("state",) + tuple(sorted((self.rank_of(src), self.rank_of(dst))))
            if key not in self._pairs and self.rank in key[1:] and key[1] != key[2] and set(key[1:]) <= set(self.alive):
                self._pairs[key] = self._new_group(key[1:], "state")

    def send_state(self, units, shard, src, dst) -> None:
        s, d = self.rank_of(src), self.rank_of(dst)
        payload = _pack(shard)
        group = self._pairs[("state",) + tuple(sorted((s, d)))]
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        tag = _state_tag(units)
        for t, k in ((size, tag), (payload, tag + 1)):
            self._state_sends.append((group.pg.send([t], group.index(d), k), t, units, dst))

    def receive_state(self, units, src, dst) -> dict:
        s, d = self.rank_of(src), self.rank_of(dst)
        group = self._pairs[("state",) + tuple(sorted((s, d)))]
        what = f"receive the state of layer units {units} from worker {src} (rank {s})"
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(group.pg.recv([size], group.index(s), _state_tag(units)), what, p2p=True)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(group.pg.recv([payload], group.index(s), _state_tag(units) + 1), what, p2p=True)
        return _unpack(payload, self.device)

    def flush_state_sends(self) -> None:
        sends, self._state_sends = self._state_sends, []
        for work, _, units, dst in sends:
            self._wait(work, f"send the state of layer units {units} to worker {dst}, which did not take it",
                       p2p=True)

    # -- whole-job collectives --------------------------------------------------------------
    def all_sum(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Sum `values` over every rank of the job (in place), within the deadline."""
        self._wait(self.group.pg.allreduce([values]), what)
        return values

    def all_gather_objects(self, obj, what: str) -> list:
        """`obj` of every live rank (picklable, small), in rank order, within the deadline."""
        import pickle

        group = self.group
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in group.ranks]
        self._wait(group.pg.allgather([sizes], [torch.tensor([data.numel()], device=self.device)]), what)
        longest = max(int(n.item()) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in group.ranks]
        self._wait(group.pg.allgather([parts], [padded]), what)
        return [pickle.loads(p[:int(n.item())].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]

    def clear(self) -> None:
        self._own.clear()
        self._sends.clear()
        self._reductions.clear()


class Group:
    """A process group of some ranks: torch's own gloo (NCCL on a GPU) process group built on
    a prefix of the job's store, as torchft builds one per membership; `pg` takes the
    c10d calls (send, recv, allreduce, allgather), `index(rank)` is a rank's place in it."""

    def __init__(self, store, prefix: str, ranks: tuple[int, ...], rank: int, timeout, device):
        self.ranks = ranks
        self._index = {r: i for i, r in enumerate(ranks)}
        prefixed = dist.PrefixStore(prefix, store)
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(prefixed, self._index[rank], len(ranks))
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, self._index[rank], len(ranks), timeout)

    def index(self, rank: int) -> int:
        return self._index[rank]

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - a backend without abort
            pass


def _drop(holder: list) -> None:
    """Abort and release the group in `holder`, this thread's only (DistTransport._close_groups):
    NCCL's abort ends its operations in flight; gloo's does nothing, and its destructor waits
    for them."""
    try:
        holder[0].abort()
        holder.clear()
    except Exception:  # noqa: BLE001 - a destructor's error: the group is gone either way
        pass


def _waited(work, seconds: float) -> bool:
    """Whether `work` completed within `seconds` (its own error raised if it failed). A gloo
    collective can be waited for again after such a wait runs out.

    A look that runs out raises "Operation timed out!" and the work may complete right after,
    before `is_completed()` is asked: that error is the look's, not the collective's, so a
    completed work is waited for once more (at once: it is done), which returns if the
    collective succeeded and raises its own error if it failed. Re-raising the look's error
    failed a joining rank's first loss sum as "gloo reported a timeout after 0.5 s" (issue 36:
    rank 6 of test_oobleck's join, the second look of a rank waiting for its peers' recovery)."""
    try:
        return work.wait(timeout=datetime.timedelta(seconds=seconds)) is not False
    except Exception:
        if not work.is_completed():
            return False  # this look ran out: the caller looks again
    return work.wait() is not False  # completed meanwhile, or failed: its own outcome


def _members(plan, sync) -> tuple[int, ...]:
    from ftbench.engine.executor import sync_members

    return sync_members(plan, sync)


def _state_tag(units) -> int:
    lo, hi = units
    return ((lo << 12) | hi) << 1


def _pack(shard) -> torch.Tensor:
    """A shard (nested dicts of tensors) as bytes in a uint8 tensor (host memory)."""
    import io

    buffer = io.BytesIO()
    from ftbench.engine.state import to_device

    torch.save(to_device(shard, torch.device("cpu")), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack(payload: torch.Tensor, device) -> dict:
    import io

    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location=device, weights_only=False)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
