"""Who is still in a dist job: heartbeats, failure detection and agreement through the store.

Every process of the job beats a counter in the job's TCPStore (the rendezvous store, which
the launcher hosts, so it outlives any node) from a thread of its own. After a failure the
survivors *detect* it: a member whose counter stops moving for `stale_s` is dead, one whose
counter moves is alive; every member is classified within the deadline or the job stops
with an error. Then they *agree*: the first dead set posted for the new membership epoch
is its verdict (a live rank it names stops: fenced, as a failed one), and each survivor
posts the dead set it saw and reads everyone else's; all must be equal. Only then do they
build the process groups of the new epoch (torch's own gloo or NCCL groups on a prefix of
the store named by the epoch, so the dead never need to answer), on which everything after
runs. A rank that stops with an error rather than dying says so first (`post_abort`):
whoever then finds it silent stops the job too, instead of recovering from a failure that
did not happen.

A death must reach every survivor within seconds, whatever it waits on: the first rank that
stops waiting in an epoch posts the epoch's *alarm* (`Alarm`), and every watched wait gives
up on seeing it (ftbench.distributed.transport), so all survivors detect at about the same
time. Each beat also dates itself (the counter is the time of the last beat, in ms), so a
recovery is measured from the death, not from whenever a survivor noticed it.

This is the small part a reconfigurable process group needs on top of torch.distributed;
torchft packages the same idea (a quorum, then `configure()` of a fresh group per
membership) but brings a Rust lighthouse and a package outside this project's dependencies.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta

# Each rank's membership decisions (what it detected, agreed, regrouped, and its heartbeat's
# stalls), timestamped on its stderr: the launcher keeps it per node under dist/logs, where a
# run that went wrong is read afterwards.
log = logging.getLogger("ftbench.distributed")


def log_to_stderr(rank: int) -> None:
    """Send this process's membership log to its stderr, each line naming the rank."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s ftbench rank {rank}: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

HEARTBEAT_S = 0.05  # between beats
STALE_S = 2.0  # a member whose beat has not moved this long is dead (threads of a busy machine stall ~1 s)
SETTLE_S = 0.5  # after the first death, how long the dead set must hold still (a node's processes die together)


STORE_ENV = "FTBENCH_STORE"  # host:port of the store `ftbench` hosts for the job (ftbench.distributed.launch)
JOB_PREFIX = "ftbench/job/"  # that store serves one job: its keys need no run id


def job_store(timeout_s: float):
    """A client of the job's store, under this job's prefix: the one `ftbench` hosts (it
    outlives every node: the launcher of a job on this machine, or the coordinator of a
    torchrun job, backend.launcher=torchrun), else the launcher's MASTER_ADDR/MASTER_PORT
    (a torchrun job without a coordinator: the store node 0's agent hosts)."""
    import torch.distributed as dist

    endpoint = os.environ.get(STORE_ENV)
    if endpoint:
        host, port = endpoint.rsplit(":", 1)
        prefix = JOB_PREFIX
    else:
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        prefix = f"ftbench/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, store)


def beats(store, ranks) -> dict[int, int]:
    """Each rank's heartbeat counter now (0: never beat): the time of its last beat, in ms."""
    return {r: store.add(f"hb/{r}", 0) for r in ranks}


def last_beat_s(store, ranks) -> dict[int, float]:
    """Each rank's last beat as a wall-clock time (time.time()): when a dead rank died."""
    return {r: b / 1000 for r, b in beats(store, ranks).items()}


class Heartbeat:
    """This process's beat: a counter in the store, moved every HEARTBEAT_S from a daemon thread
    (its own store client: the main thread's waits never delay it). Each beat adds the time
    since the previous one, so the counter is the wall-clock time of the last beat in ms: one
    add both proves the rank alive and dates its death (DistBackend measures from it)."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.store = job_store(timeout_s)
        self._last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftbench-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._last = self.store.add(f"hb/{self.rank}", 0)
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        # never 0, so the counter always moves (a clock stepped back still moves it)
        self._last = self.store.add(f"hb/{self.rank}", max(1, int(time.time() * 1000) - self._last))

    def _run(self) -> None:
        last, refused = time.perf_counter(), 0
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception as err:  # noqa: BLE001 - a slow store, or it went away as the job ends
                # Keep beating: a thread that gave up here would read as a dead process.
                if not refused:
                    log.warning("heartbeat: the store refused a beat (%s: %s)", type(err).__name__, err)
                refused += 1
                continue
            now = time.perf_counter()
            if now - last > STALE_S / 2:  # what a peer's detection would see as silence
                log.warning("heartbeat: %.2f s between two beats%s", now - last,
                            f" ({refused} refused)" if refused else "")
            last, refused = now, 0

    def stop(self) -> None:
        self._stop.set()


class MembershipError(RuntimeError):
    pass


class Fenced(MembershipError):
    """This rank is in the dead set another survivor posted first for the new epoch: it was
    silent too long for them, so it must stop as a failed process would (it cannot rejoin
    an epoch built without it)."""


def post_abort(store, rank: int, why: str) -> None:
    """Tell the job that this rank stops with an error (not a failure): whoever then finds it
    silent stops the job too instead of recovering from it (ftbench.distributed.backend)."""
    store.set(f"abort/{rank}", why)


def aborted(store, ranks) -> dict[int, str]:
    """The ranks among `ranks` that stopped with an error, and the error."""
    return {r: store.get(f"abort/{r}").decode(errors="replace") for r in ranks if store.check([f"abort/{r}"])}


class Alarm:
    """The job's alarm for one membership epoch: the first rank that stops waiting in it (a
    closed connection, a silent heartbeat, its deadline, or an error that ends it) posts why,
    and every other rank's waits give up on seeing it (ftbench.distributed.transport), so a
    death that one rank notices reaches every survivor within a watch period, not at the end
    of their own deadlines. Only a rank that has left the epoch's collectives posts: nobody
    could finish them anyway, so an alarm never ends a wait that could still complete."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.epoch = 0  # the transport's: an alarm of an earlier epoch is over once the survivors regrouped

    def post(self, why: str) -> dict:
        """Post `why` unless another rank was first; the epoch's alarm (this one or the first)."""
        mine = json.dumps({"rank": self.rank, "why": why})
        return json.loads(self.store.compare_set(f"alarm/{self.epoch}", "", mine))

    def posted(self) -> dict | None:
        """The epoch's alarm, {"rank", "why"}, if a rank posted one."""
        key = f"alarm/{self.epoch}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None


WATCH_STALE_S = 3 * STALE_S  # a watched wait gives up on a peer silent this long (no false alarm on a stall)
QUIET_S = 2 * STALE_S + SETTLE_S  # after a failed wait: a death before it shows by then, else none happened


class Liveness:
    """Which ranks have stopped beating, from repeated looks at their counters (a watched wait
    asks every WATCH_EVERY_S while it waits: ftbench.distributed.transport). Silence counts
    only across looks close together: after a long pause between two looks (this process
    was computing, or stalled itself) the observation starts again."""

    def __init__(self, store, stale_s: float = WATCH_STALE_S):
        self.store, self.stale_s = store, stale_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat, when that beat was first seen)
        self._looked = None  # when the last look was

    def silent(self, ranks) -> list[int]:
        now = time.perf_counter()
        if self._looked is None or now - self._looked > self.stale_s / 2:
            self._seen.clear()
        self._looked = now
        out = []
        for r in ranks:
            beat = self.store.add(f"hb/{r}", 0)
            seen = self._seen.get(r)
            if seen is None or seen[0] != beat:
                self._seen[r] = (beat, now)
            elif now - seen[1] >= self.stale_s:
                out.append(r)
        return out

    def observed(self) -> dict[int, tuple[int, float]]:
        """{rank: (its beat, when this process first saw it)} from recent looks (none after a
        long pause), for `detect` to go on from instead of watching the silence again."""
        if self._looked is None or time.perf_counter() - self._looked > self.stale_s / 2:
            return {}
        return dict(self._seen)


def detect(store, members: list[int], deadline_s: float, stale_s: float = STALE_S,
           observed: dict[int, tuple[int, float]] | None = None,
           quiet_s: float | None = None) -> tuple[set[int], float]:
    """(the members that died, seconds it took to know): a member whose beat has not moved
    for `stale_s` is dead. A failure is expected, so this waits until some member is dead and
    then until the dead set has held still for SETTLE_S (the other processes of a failed node
    die at about the same time). `observed` (Liveness.observed): beats already seen unmoved
    since then, by the wait that failed: their silence counts from then. `quiet_s`: after a
    wait that already failed (a death precedes it), give up once every member has kept beating
    this long, instead of waiting out `deadline_s` (issue 36: a gloo timeout with nobody dead
    took a whole backend.timeout_s more to stop)."""
    started = time.perf_counter()
    beat = beats(store, members)
    moved = {r: started for r in members}
    for r, (seen_beat, since) in (observed or {}).items():
        if r in moved and seen_beat == beat[r]:
            moved[r] = min(since, started)
    dead: set[int] = set()
    settled = None  # when the dead set last changed
    while True:
        now = time.perf_counter()
        for r in members:
            b = store.add(f"hb/{r}", 0)
            if b != beat[r]:
                beat[r], moved[r] = b, now
        seen = {r for r in members if now - moved[r] >= stale_s}
        if seen != dead:
            dead, settled = seen, now
        if dead and now - settled >= SETTLE_S:
            log.info("detect: ranks %s silent (their last beats %s s ago; the others' %s s ago)", sorted(dead),
                     [round(now - moved[r], 2) for r in sorted(dead)],
                     [round(now - moved[r], 2) for r in members if r not in dead])
            return dead, now - started
        if not dead and quiet_s is not None and now - started > quiet_s:
            raise MembershipError(f"every process kept beating for {quiet_s:g} s after the failed wait: none died")
        if now - started > deadline_s:
            raise MembershipError(f"no process stopped beating within {deadline_s:g} s after the failure point"
                                  if not dead else f"the set of dead ranks kept changing for {deadline_s:g} s")
        time.sleep(HEARTBEAT_S / 2)


def agree(store, epoch: int, rank: int, survivors: list[int], dead: set[int], deadline_s: float) -> float:
    """Post this rank's view of epoch `epoch` (the dead set) and check every survivor's is the
    same; seconds it took. Raises MembershipError naming who saw what otherwise."""
    started = time.perf_counter()
    # The first dead set posted for the epoch is its verdict: two groups of survivors that
    # each saw the other silent (a stall, not a death) cannot both go on.
    verdict = json.loads(store.compare_set(f"verdict/{epoch}", "", json.dumps(sorted(dead))))
    if verdict != sorted(dead):
        if rank in verdict:
            raise Fenced(f"rank {rank} is dead in the verdict of membership epoch {epoch} ({verdict}), "
                         f"though it saw {sorted(dead)} dead: its heartbeat was silent too long")
        raise MembershipError(f"the survivors disagree on who failed in membership epoch {epoch}: the verdict "
                              f"is {verdict}, rank {rank} saw {sorted(dead)}")
    store.set(f"view/{epoch}/{rank}", json.dumps(sorted(dead)))
    keys = [f"view/{epoch}/{r}" for r in survivors]
    try:
        store.wait(keys, timedelta(seconds=deadline_s))
    except Exception as err:  # noqa: BLE001 - DistStoreError on a timeout
        missing = [r for r, k in zip(survivors, keys) if not store.check([k])]
        raise MembershipError(f"ranks {missing} posted no view of membership epoch {epoch} within {deadline_s:g} s "
                              f"({type(err).__name__})") from None
    views = {r: json.loads(store.get(k)) for r, k in zip(survivors, keys)}
    log.info("agree: epoch %d, ranks %s saw %s", epoch, survivors, sorted(dead))
    if any(v != sorted(dead) for v in views.values()):
        raise MembershipError(f"the survivors disagree on who failed in membership epoch {epoch}: "
                              + ", ".join(f"rank {r} saw {v}" for r, v in sorted(views.items())))
    return time.perf_counter() - started
