"""Failure scripts: which nodes fail (or join) and when.

`build_failure_script` turns the `failures` config group into a `FailureScript`:

- events tied to an iteration number (scripted runs only) come as a sorted list, and
- events tied to a time come as a time-ordered iterator. It may be lazy and endless (poisson with
  repair, interval without a count), so consumers pull events only up to their own horizon,
  for example with `take_until`.

Everything random is drawn from `random.Random(seed)`, so a seed always gives the same events.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ftbench.durations import parse_duration
from ftbench.errors import ConfigError
from ftbench.paths import TRACES_DIR

KINDS = ("none", "scripted", "interval", "poisson", "trace")
EVENT_KINDS = ("fail", "join")
# A failure scripted "at iteration k" strikes this far into iteration k (of its simulated timeline)
# unless the event (`at`) or the group (`failures.at`) says where.
ITERATION_EVENT_FRACTION = 0.5


@dataclass(frozen=True)
class FailureEvent:
    node: int  # node id
    kind: str = "fail"  # "fail" | "join"
    time_s: float | None = None  # set for time-based events
    iteration: int | None = None  # set for iteration-based events (exactly one of the two is set)
    # iteration-based failures: where in the iteration it strikes, a fraction in [0, 1) of its
    # simulated timeline (None: ITERATION_EVENT_FRACTION); the ops completed by then, optimizer
    # steps included, have run (ftbench.events)
    at: float | None = None


@dataclass
class FailureScript:
    by_iteration: list[FailureEvent]  # sorted by iteration (stable)
    by_time: Iterator[FailureEvent]  # time-ordered, may be lazy and unbounded
    initial_nodes: int | None = None  # trace only: nodes the trace starts with (the adds at its first instant)
    description: str = ""  # one line for logs and reports
    # trace with failures.end_at_last_event: the run ends at this time, s (its last event's,
    # after the shift); the run loop stops there as at train.max_hours. None: no such end.
    end_s: float | None = None
    # scripted only: the events of `by_time` as a list (the iterator cannot be looked at twice)
    scripted_by_time: tuple[FailureEvent, ...] = ()
    # trace with later adds: a job left with too few nodes to go on waits for them, as the
    # Oobleck artifact's simulators do (ftbench.loop, Recovery.wait); elsewhere it ends there
    waits_for_joins: bool = False
    # scripted only: each event's index in failures.events, for messages that name it
    event_index: dict[FailureEvent, int] = dataclasses.field(default_factory=dict)
    # the rate this failure model implies for the whole job, read by the checkpoint-interval
    # rules (Young/Daly): mean seconds between failures (inf: none expected), or for a script
    # by iteration, failures per iteration (its failures over train.iterations); None: unknown
    job_mtbf_s: float | None = None
    failures_per_iteration: float | None = None

    def setting_of(self, event: FailureEvent) -> str:
        """`failures.events[i]` for a scripted event (`failures.events` when not known)."""
        index = self.event_index.get(event)
        return "failures.events" if index is None else f"failures.events[{index}]"


def take_until(events: Iterable[FailureEvent], horizon_s: float) -> list[FailureEvent]:
    """The events with time_s <= horizon_s, in order.

    Pulls from the iterator until the first event past the horizon, which is consumed and
    dropped: an endless stream cannot be peeked without it.
    """
    taken = []
    for event in events:
        if event.time_s is None or event.time_s > horizon_s:
            break
        taken.append(event)
    return taken


# Settings that only some kinds of script read (seed: those that draw at random), and the value
# that means "not set".
OWNED_SETTINGS = {"events": ("scripted",), "at": ("scripted",), "every": ("interval",), "mtbf_hours": ("poisson",),
                  "repair_hours": ("poisson",), "job_mtbf_hours": ("poisson",), "path": ("trace",),
                  "count": ("interval", "poisson", "trace"), "seed": ("interval", "poisson"),
                  "end_at_last_event": ("trace",)}
UNSET = {"end_at_last_event": True}  # its default (FailuresConfig); None or [] for the others


def build_failure_script(cfg, num_nodes: int, seed: int, iterations: int | None = None,
                         max_hours: float | None = None) -> FailureScript:
    """The failure script for a `FailuresConfig` (or a DictConfig with the same fields).

    With `iterations` (and `max_hours`) given, scripted events that can never fire in such a
    run are refused (`check_reachable`)."""
    script = _build(cfg, num_nodes, seed)
    if iterations is not None:
        check_reachable(script, iterations, max_hours)
        if (_get(cfg, "kind") or "none") == "scripted":  # a script: its failures over the run
            fails = sum(e.kind == "fail" for e in (*script.by_iteration, *script.scripted_by_time))
            script.failures_per_iteration = fails / iterations
    return script


def check_reachable(script: FailureScript, iterations: int, max_hours: float | None = None) -> FailureScript:
    """Refuse scripted events a run of `iterations` iterations (and at most `max_hours`
    hours) never reaches: they would be silently dropped. Iterations are numbered from 0, so
    an event at iteration `iterations` or later never fires (a join scripted "at iteration k"
    takes effect before iteration k, which does not exist either). Timed events are checked
    against `max_hours` only, the one end time known before the run: when the last iteration
    ends depends on the recoveries (and on the wall clock on local/dist), so an event after
    the fault-free run's end may still fire once earlier failures delay the run. The run loop
    applies no event at or past the time limit (ftbench.loop), and neither is accepted here.
    Streams (interval, poisson, trace) may run past the end by design and are not checked.
    Returns `script`."""
    for event in script.by_iteration:
        if event.iteration >= iterations:
            raise ConfigError(script.setting_of(event),
                              f"the {event.kind} of node {event.node} at iteration {event.iteration} never happens: "
                              f"the run has iterations 0..{iterations - 1} (train.iterations={iterations})",
                              f"script events at iterations below {iterations}, or raise train.iterations")
    if max_hours is not None:
        horizon_s = max_hours * 3600.0
        for event in script.scripted_by_time:
            if event.time_s >= horizon_s:
                raise ConfigError(script.setting_of(event),
                                  f"the {event.kind} of node {event.node} at time_s {event.time_s:g} never happens: "
                                  f"the run stops at train.max_hours={max_hours:g} ({horizon_s:g} s)",
                                  f"script events at time_s below {horizon_s:g}, or raise train.max_hours")
    return script


def _build(cfg, num_nodes: int, seed: int) -> FailureScript:
    kind = _get(cfg, "kind") or "none"
    if kind not in KINDS:
        raise ConfigError("failures", f"unknown kind '{kind}'",
                          f"pick one of {', '.join(KINDS)}, e.g. failures=poisson")
    events = list(_get(cfg, "events") or [])
    for field, owners in OWNED_SETTINGS.items():
        value = _get(cfg, field)
        if value not in (None, [], UNSET.get(field)) and kind not in owners:
            # e.g. `failures.every=6h` alone would otherwise silently run without failures
            raise ConfigError(f"failures.{field}", f"it is set but failures is '{kind}', which ignores it",
                              f"add failures={' or failures='.join(owners)} to use it, or drop it")
    count = _get(cfg, "count")
    if count is not None and count < 0:
        raise ConfigError("failures.count", f"{count} is negative",
                          "give a number of failures >= 0, or null for no limit")
    if _get(cfg, "seed") is not None:
        seed = _get(cfg, "seed")  # a failures-specific seed overrides the run's seed

    if kind == "none":
        return FailureScript([], iter(()), description="no failures", job_mtbf_s=math.inf)
    if count == 0 and kind in ("interval", "poisson"):  # a paper table's fault-free column
        return FailureScript([], iter(()), description=f"no failures ({kind} with failures.count=0)",
                             job_mtbf_s=math.inf)
    if kind == "scripted":
        return _scripted(events, num_nodes, check_at(_get(cfg, "at"), "failures.at"))
    if kind == "interval":
        return _interval(cfg, num_nodes, seed, count)
    if kind == "poisson":
        return _poisson(cfg, num_nodes, seed, count)
    return _trace(cfg, count)


def _get(cfg, name):
    # getattr with a default works for dataclasses and for DictConfig alike
    # (OmegaConf's missing-key error is an AttributeError).
    return getattr(cfg, name, None)


def _limit(events: Iterator[FailureEvent], count: int | None) -> Iterator[FailureEvent]:
    """Stop the stream right after its `count`-th fail event (None: no limit)."""
    if count is None:
        yield from events
        return
    if count == 0:
        return
    fails = 0
    for event in events:
        yield event
        if event.kind == "fail":
            fails += 1
            if fails >= count:
                return


def _count_text(count: int | None) -> str:
    return "" if count is None else f", at most {count} failures"


# --- scripted ------------------------------------------------------------------------------

def check_at(at, setting: str) -> float | None:
    """A failure point as given (None: not given): a fraction in [0, 1) of the iteration's
    simulated timeline. 1 is refused: the iteration would be over, and a failure then is one
    at the next iteration's start (at 0)."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at < 1:
        raise ConfigError(setting, f"{at!r} is not a fraction in [0, 1) of the iteration",
                          "give where in its iteration the failure strikes, e.g. 0.5 (half-way), 0.97 "
                          "(during the optimizer steps), or 0 (at its start)")
    return float(at)


def _scripted(events, num_nodes: int, at: float | None = None) -> FailureScript:
    """`at`: failures.at, where events by iteration strike unless they say (None: the default)."""
    by_iteration, by_time, index = [], [], {}
    joined = {_get(ev, "node") for ev in events if (_get(ev, "kind") or "fail") == "join"}
    for i, ev in enumerate(events):
        setting = f"failures.events[{i}]"
        node, kind = _get(ev, "node"), _get(ev, "kind") or "fail"
        iteration, time_s = _get(ev, "iteration"), _get(ev, "time_s")
        if (iteration is None) == (time_s is None):
            raise ConfigError(setting, "needs exactly one of `iteration` and `time_s`",
                              f"write e.g. {{node: {node}, iteration: 10}} or {{node: {node}, time_s: 3600}}")
        if kind not in EVENT_KINDS:
            raise ConfigError(setting, f"kind '{kind}' is not fail or join", "use kind: fail or kind: join")
        if node is None or node < 0:
            raise ConfigError(setting, f"node {node} is not a node id", "give a node id >= 0")
        # A join may name a new id (a node that was not in the job); a fail must hit an existing
        # one, or one a scripted join brings in.
        if kind == "fail" and node >= num_nodes and node not in joined:
            raise ConfigError(setting, f"node {node} fails but the cluster has nodes 0..{num_nodes - 1} "
                              "(and no scripted join brings that node in)",
                              f"pick a node below {num_nodes}, or raise cluster.nodes")
        own_at = check_at(_get(ev, "at"), f"{setting}.at")
        if own_at is not None and (kind != "fail" or iteration is None):
            what = "a join" if kind != "fail" else "an event by time_s, which strikes at its time"
            raise ConfigError(f"{setting}.at", f"only a failure scripted by iteration strikes at a point of it "
                              f"(this is {what})", "drop `at` from this event")
        if iteration is not None:
            if iteration < 0:
                raise ConfigError(setting, f"iteration {iteration} is negative", "give an iteration >= 0")
            point = own_at if own_at is not None else at if kind == "fail" else None
            event = FailureEvent(node=int(node), kind=kind, iteration=int(iteration), at=point)
            by_iteration.append(event)
        else:
            if time_s < 0:
                raise ConfigError(setting, f"time_s {time_s} is negative", "give a time >= 0 s")
            event = FailureEvent(node=int(node), kind=kind, time_s=float(time_s))
            by_time.append(event)
        index.setdefault(event, i)
    # sorted() is stable: events at the same iteration/time keep the order they were written in.
    by_iteration.sort(key=lambda e: e.iteration)
    by_time.sort(key=lambda e: e.time_s)
    return FailureScript(by_iteration, iter(by_time),
                         description=f"scripted, {len(by_iteration)} events by iteration, "
                                     f"{len(by_time)} by time", scripted_by_time=tuple(by_time), event_index=index)


# --- interval ------------------------------------------------------------------------------

def _interval(cfg, num_nodes: int, seed: int, count: int | None) -> FailureScript:
    every = _get(cfg, "every")
    if every is None:
        raise ConfigError("failures.every", "interval failures need a period",
                          "set it, e.g. failures=interval failures.every=6h")
    period_s = parse_duration(every, "failures.every")
    description = f"interval, one node every {every}, {num_nodes} nodes{_count_text(count)}"
    return FailureScript([], _interval_events(period_s, num_nodes, seed, count), description=description,
                         job_mtbf_s=period_s)


def _interval_events(period_s: float, num_nodes: int, seed: int, count: int | None):
    rng = random.Random(seed)
    alive = list(range(num_nodes))
    limit = num_nodes if count is None else min(count, num_nodes)
    for k in range(1, limit + 1):
        # Uniform pick among the nodes still up; swap-remove keeps each pick O(1).
        i = rng.randrange(len(alive))
        alive[i], alive[-1] = alive[-1], alive[i]
        # k * period rather than a running sum: no drift from adding floats.
        yield FailureEvent(node=alive.pop(), kind="fail", time_s=k * period_s)


# --- poisson -------------------------------------------------------------------------------

def _poisson(cfg, num_nodes: int, seed: int, count: int | None) -> FailureScript:
    mtbf_hours, repair_hours = _get(cfg, "mtbf_hours"), _get(cfg, "repair_hours")
    job_mtbf = _get(cfg, "job_mtbf_hours")
    if job_mtbf is not None:
        if mtbf_hours is not None:
            raise ConfigError("failures.job_mtbf_hours", "it is set together with failures.mtbf_hours",
                              "give the job's MTBF or one node's, not both (failures.mtbf_hours=null)")
        if job_mtbf <= 0:
            raise ConfigError("failures.job_mtbf_hours", f"{job_mtbf} is not positive",
                              "give the mean hours between failures of the whole job, e.g. 6")
    elif mtbf_hours is None:
        raise ConfigError("failures.mtbf_hours", "poisson failures need the MTBF of one node",
                          "set it, e.g. failures=poisson failures.mtbf_hours=5000")
    elif mtbf_hours <= 0:
        raise ConfigError("failures.mtbf_hours", f"{mtbf_hours} is not positive",
                          "give the mean hours between failures of one node, e.g. 5000")
    if repair_hours is not None and repair_hours <= 0:
        raise ConfigError("failures.repair_hours", f"{repair_hours} is not positive",
                          "give the hours until a failed node is back, e.g. 2, or null for never")
    repair = "no repair" if repair_hours is None else f"repair {repair_hours:g} h"
    repair_s = None if repair_hours is None else repair_hours * 3600.0
    if job_mtbf is not None:
        rate = f"a failure every {job_mtbf:g} h for the job (a live node, at random)"
        events = _job_poisson_events(job_mtbf * 3600.0, repair_s, num_nodes, seed)
        job_mtbf_s = job_mtbf * 3600.0
    else:
        rate = f"MTBF {mtbf_hours:g} h per node"
        events = _poisson_events(mtbf_hours * 3600.0, repair_s, num_nodes, seed)
        job_mtbf_s = mtbf_hours * 3600.0 / max(num_nodes, 1)  # the job's rate while every node is up
    description = f"poisson, {rate}, {num_nodes} nodes, {repair}{_count_text(count)}"
    return FailureScript([], _limit(events, count), description=description, job_mtbf_s=job_mtbf_s)


def _poisson_events(mtbf_s: float, repair_s: float | None, num_nodes: int, seed: int):
    """Every node is its own renewal process; a heap merges them lazily in time order.

    The heap holds one pending event per node, so memory is O(nodes) and each event costs
    O(log nodes), however far the consumer reads.
    """
    rng = random.Random(seed)
    rate = 1.0 / mtbf_s
    # (time, node, kind): node ids are unique in the heap, so ties never compare the kind.
    heap = [(rng.expovariate(rate), node, "fail") for node in range(num_nodes)]
    heapq.heapify(heap)
    while heap:
        t, node, kind = heapq.heappop(heap)
        yield FailureEvent(node=node, kind=kind, time_s=t)
        if kind == "fail" and repair_s is not None:
            heapq.heappush(heap, (t + repair_s, node, "join"))
        elif kind == "join":
            # Memoryless: a repaired node fails again after a fresh exponential time.
            heapq.heappush(heap, (t + rng.expovariate(rate), node, "fail"))
        # Without repair a failed node stays down: nothing more for it.


def _job_poisson_events(job_mtbf_s: float, repair_s: float | None, num_nodes: int, seed: int):
    """The job fails at its own rate, as the papers' columns mean it ("a failure every 30 min"):
    one Poisson process for the job, each failure striking a node that is up, at random. Nodes
    drawn independently would fail less often than the label while some are down (a failed node
    cannot fail again until repaired); with every node down the next failure waits for a repair
    (the process is memoryless, so it is drawn afresh from there)."""
    rng = random.Random(seed)
    rate = 1.0 / job_mtbf_s
    up = list(range(num_nodes))  # kept sorted, so a seed picks the same nodes on every machine
    repairs: list[tuple[float, int]] = []  # (time back, node)
    t = rng.expovariate(rate)
    while up or repairs:
        while repairs and (repairs[0][0] <= t or not up):
            back, node = heapq.heappop(repairs)
            yield FailureEvent(node=node, kind="join", time_s=back)
            bisect.insort(up, node)
            if back > t:  # every node was down: the job's next failure is drawn from the repair on
                t = back + rng.expovariate(rate)
        if not up:
            return
        node = up.pop(rng.randrange(len(up)))
        yield FailureEvent(node=node, kind="fail", time_s=t)
        if repair_s is not None:
            heapq.heappush(repairs, (t + repair_s, node))
        t += rng.expovariate(rate)


# --- trace ---------------------------------------------------------------------------------

def _trace(cfg, count: int | None) -> FailureScript:
    path = _get(cfg, "path")
    if not path:
        raise ConfigError("failures.path", "trace failures need a trace file",
                          "set it, e.g. failures=trace failures.path=6h.csv")
    resolved = _resolve_trace(str(path))
    trace = load_trace(resolved)
    fails = sum(e.kind == "fail" for e in trace.events)
    joins = len(trace.events) - fails
    # The run ends at the trace's last event unless told not to (a field missing, as in an
    # older DictConfig, means the default: end there).
    end_s = trace.end_s if _get(cfg, "end_at_last_event") is not False and trace.end_s > 0 else None
    shift = (f", shifted {trace.shift_s:g} s earlier (its first event, at {trace.shift_s:g} s, is t=0)"
             if trace.shift_s else "")
    end = f", the run ends at its last event ({end_s:g} s)" if end_s is not None else ""
    description = (f"trace {resolved.name}{shift}, {trace.initial} node{'s' * (trace.initial != 1)} at start, {fails} fails, {joins} joins, "
                   f"up to {trace.peak} nodes at once{_count_text(count)}{end}")
    # its failures over its span: the rate the run will see (inf: a trace without failures)
    mtbf = trace.end_s / fails if fails and trace.end_s > 0 else math.inf
    return FailureScript([], _limit(iter(trace.events), count), initial_nodes=trace.initial, description=description,
                         end_s=end_s, waits_for_joins=joins > 0,
                         job_mtbf_s=mtbf)


def _resolve_trace(path: str) -> Path:
    """As given (relative to the current folder), then in conf/traces/, then in the project root."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [given, TRACES_DIR / given, TRACES_DIR.parent.parent / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    known = sorted(p.name for p in TRACES_DIR.glob("*.csv")) if TRACES_DIR.is_dir() else []
    raise ConfigError("failures.path", f"trace file '{path}' not found",
                      f"give a path to a CSV file or one of the files in {TRACES_DIR}: "
                      f"{', '.join(known) or '(none)'}")


@dataclass(frozen=True)
class Trace:
    """A membership trace as `load_trace` reads it. Times are relative to the trace's first
    row: a trace whose first nodes appear after t = 0 (measured spot traces do) starts there."""
    initial: int  # nodes added at the first instant: the starting membership, ids 0..initial-1
    events: list[FailureEvent]  # the later membership changes, in time order
    shift_s: float  # the first row's time in the file, s: subtracted from every time
    end_s: float  # the last row's time, after the shift, s
    peak: int  # the most nodes up at once
    names: int  # distinct node names: ids 0..names-1


def read_trace(path) -> tuple[int, list[FailureEvent]]:
    """(nodes at the start, later events in time order) of a trace file; see `load_trace`."""
    trace = load_trace(path)
    return trace.initial, trace.events


def load_trace(path) -> Trace:
    """Read `milliseconds,add|remove,nodeN` rows.

    Time is shifted so that the first row's time is t = 0 (`Trace.shift_s` is how far). Node
    names get ids 0, 1, ... in order of first appearance. The adds at that first instant are
    the starting membership and make no events; later removes are "fail" and later adds are
    "join" events (a name seen before that is added at the first instant again joins then).
    """
    path = Path(path)
    ids: dict[str, int] = {}
    up: set[int] = set()
    initial = peak = 0
    events: list[FailureEvent] = []
    first_ms = last_ms = None
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a byte-order mark
    except OSError as err:
        raise ConfigError("failures.path", f"cannot read '{path}': {err.strerror}",
                          "give a readable CSV trace file") from None
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ConfigError("failures.path", f"'{path}' is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                          f"offset {err.start}, line {line}); it is probably not a trace",
                          "give a CSV text file of `milliseconds,add|remove,nodeN` rows, saved as UTF-8") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue

        def bad(problem: str) -> ConfigError:
            return ConfigError("failures.path", f"{path}, line {number}: {problem} (row '{line}')",
                               "write rows as `milliseconds,add|remove,nodeN`, no header")

        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            raise bad(f"{len(fields)} fields instead of 3")
        ms_text, action, name = fields
        try:
            ms = float(ms_text)
        except ValueError:
            raise bad(f"'{ms_text}' is not a number of milliseconds") from None
        if not ms >= 0 or ms == float("inf"):  # also rejects nan
            raise bad(f"time {ms_text} is negative" if ms < 0 else f"time {ms_text} is not a number of milliseconds")
        if last_ms is not None and ms < last_ms:
            raise bad(f"time {ms_text} is earlier than the row before")
        if action not in ("add", "remove"):
            raise bad(f"'{action}' is neither add nor remove")
        if not name:
            raise bad("the node name is empty")
        if first_ms is None:
            first_ms = ms
        new = name not in ids
        node = ids.setdefault(name, len(ids))
        time_s = (ms - first_ms) / 1000.0
        # A trace that removes an absent node or adds a present one would confuse membership.
        if action == "add":
            if node in up:
                raise bad(f"{name} is added while already present")
            up.add(node)
            peak = max(peak, len(up))
            if ms == first_ms and new:
                initial += 1
            else:
                events.append(FailureEvent(node=node, kind="join", time_s=time_s))
        else:
            if node not in up:
                raise bad(f"{name} is removed while not present")
            up.discard(node)
            events.append(FailureEvent(node=node, kind="fail", time_s=time_s))
        last_ms = ms
    if first_ms is None:
        raise ConfigError("failures.path", f"trace '{path}' has no rows",
                          "give a CSV with `milliseconds,add|remove,nodeN` rows")
    return Trace(initial=initial, events=events, shift_s=first_ms / 1000.0, end_s=(last_ms - first_ms) / 1000.0,
                 peak=peak, names=len(ids))
