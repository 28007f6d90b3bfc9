"""Seeded random failure scripts on small setups, and the verdict on each run.

Hand-written failure scripts test what their author thought of; random ones find the rest
(a failure of a node that is already down, a join and a failure in the same iteration, a
second failure before the first recovery settled, ...). `random_case(seed, strategy)` draws
a small setup of gpt-tiny (pp, dp, GPUs per node, spares, schedule, iterations, micro-batches)
and a scripted list of membership events from the seed alone, so every strategy meets the same
setup and the same failures for a given seed (and one fault-free reference run serves them
all); strategy settings (`strategy.every`, ReCycle's fallback) come from the seed and the
strategy's registration (`StrategyTests.random`, ftbench/strategies/base.py). `run_case` runs a case, `classify` gives the verdict against fault-free training of
the same setup:

  equal          status ok and losses and final weights match fault-free training
  different      status ok but losses or final weights differ from fault-free training
  unrecoverable  the run ended as "unrecoverable" and said why (summary["error"])
  oom            the run ended as "oom"
  crashed        an exception, a config error, or "unrecoverable" without a reason
  ok             status ok, nothing to compare with (the sim backend has no losses)

Time-based events strike at modelled time (`local` cases set `backend.clock=model`), so runs
replay exactly; about four cases in ten get one or two, inside the fault-free timeline or past
the seconds a first recovery takes. A case given `backend.clock=wall` by hand may not replay
the same (`Case.wall_clock_events`).

    python -m ftbench.chaos SEED STRATEGY [--backend local|sim]     # replay one case
"""
from __future__ import annotations

import random
import shlex
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ftbench.strategies import REGISTRY, strategy_class

# Every registered strategy whose registration draws its settings (StrategyTests.random).
STRATEGIES = tuple(name for name, cls in REGISTRY.items() if cls.tests.random is not None)
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
OUTCOMES = ("equal", "ok", "unrecoverable", "different", "crashed", "oom")
# Added to every run by run_case (the reference is run here, once per setup); left out of
# the printed command line, so a pasted command checks itself against fault-free training.
RUN_ONLY = ("report.check_fault_free=false",)


@dataclass(frozen=True)
class Case:
    seed: int
    strategy: str
    backend: str
    setup: tuple[str, ...]  # everything but the strategy and the failures: the reference's key
    strategy_overrides: tuple[str, ...]  # strategy=..., strategy.every=..., ...
    events: tuple[dict, ...]  # {"iteration" | "time_s": ..., "node": n, "kind": "fail" | "join"}
    notes: tuple[str, ...] = field(default=())  # what the script exercises, e.g. "fail-while-down" (event_notes)

    @property
    def failure_overrides(self) -> tuple[str, ...]:
        return ("failures=scripted", "failures.events=" + events_text(self.events))

    @property
    def overrides(self) -> list[str]:
        """The Hydra overrides of this case, as `ftbench` takes them."""
        return [*self.strategy_overrides, *self.setup, *self.failure_overrides]

    @property
    def training(self) -> tuple[str, ...]:
        """The training settings the strategy's draw chose (torchft's LocalSGD or DiLoCo): its
        fault-free reference trains the same algorithm."""
        return tuple(o for o in self.strategy_overrides if o.startswith("train."))

    @property
    def reference_overrides(self) -> list[str]:
        """Fault-free training of the same setup."""
        return ["strategy=none", *self.training, *self.setup, "failures=none"]

    @property
    def description(self) -> str:
        """A command line to paste into a shell."""
        return "ftbench " + " ".join(shlex.quote(o) for o in self.overrides)

    @property
    def wall_clock_events(self) -> bool:
        """Time-based events at wall-clock time: the run may not replay exactly."""
        return (self.backend != "sim" and not any(o.startswith("backend.clock=") for o in self.setup)
                and any("time_s" in e for e in self.events))


def events_text(events) -> str:
    """[{iteration:2,node:1},{time_s:0.5,node:9,kind:join}] (Hydra's override grammar)."""
    parts = []
    for e in events:
        when = f"iteration:{e['iteration']}" if "iteration" in e else f"time_s:{e['time_s']}"
        kind = "" if e.get("kind", "fail") == "fail" else f",kind:{e['kind']}"
        parts.append(f"{{{when},node:{e['node']}{kind}}}")
    return "[" + ",".join(parts) + "]"


# -- the generator ---------------------------------------------------------------------------

def random_case(seed: int, strategy: str, backend: str = "local") -> Case:
    """A random small setup and failure script; the same seed gives the same case."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    rng = random.Random(f"ftbench-chaos/{seed}")
    pp, dp = rng.choice((2, 3, 4)), rng.randint(1, 4)
    gpus = rng.choice([g for g in (1, 2) if (pp * dp) % g == 0])
    nodes = pp * dp // gpus
    iterations, microbatches = rng.randint(6, 12), rng.randint(2, 4)
    clock = backend != "sim"  # local keeps the modelled clock: time-based events replay exactly
    setup = [f"backend={backend}", "model=gpt-tiny", f"cluster.pp={pp}", f"cluster.dp={dp}",
             f"cluster.gpus_per_node={gpus}", f"cluster.spares={rng.choice((0, 1, 2))}",
             f"cluster.replacement_s={rng.choice((0, 0.2))}", f"schedule={rng.choice(SCHEDULES)}",
             f"train.iterations={iterations}", f"train.microbatches={microbatches}",
             "wandb.mode=disabled", "report.gantt=false", "report.progress=false"]
    if clock:
        setup.append("backend.clock=model")
    # Seconds per iteration, roughly (simulated gpt-tiny on the default GPU): only places
    # time-based events inside the run.
    iteration_s, time_events = 1e-4, rng.random() < 0.4
    events, notes = _random_events(rng, nodes, iterations, iteration_s, time_events)
    srng = random.Random(f"ftbench-chaos/{seed}/{strategy}")
    facts = {"pp": pp, "dp": dp, "gpus": gpus, "nodes": nodes, "microbatches": microbatches, "iterations": iterations}
    strategy_overrides = [f"strategy={strategy}", *strategy_class(strategy).tests.random(srng, facts)]
    return Case(seed, strategy, backend, tuple(setup), tuple(strategy_overrides), tuple(events), tuple(notes))


def _random_events(rng: random.Random, nodes: int, iterations: int, iteration_s: float,
                   time_events: bool) -> tuple[list[dict], list[str]]:
    """Iteration events (fails, joins of nodes that failed earlier or of new ids, bursts in one
    iteration, a node failing while down) and maybe time-based ones."""
    last = iterations - 1
    when = lambda lo=0: rng.choice([rng.randint(max(lo, 1), max(lo, last - 1)), rng.randint(lo, last)])  # noqa: E731
    drafted: list[tuple[int, int, dict]] = []  # (iteration, draw order, event)

    def add(iteration, node, kind="fail"):
        event = {"iteration": iteration, "node": node}
        if kind != "fail":
            event["kind"] = kind
        drafted.append((iteration, len(drafted), event))

    new_ids = iter(range(nodes, nodes + 3))
    for _ in range(rng.choices((1, 2, 3, 4), weights=(50, 30, 15, 5))[0]):
        incident = rng.choices(("fail", "down-twice", "fail-join", "burst", "join-new"),
                               weights=(30, 15, 25, 20, 10))[0]
        node, at = rng.randrange(nodes), when()
        if incident == "fail":
            add(at, node)
        elif incident == "down-twice":  # fails again while still down (same or later iteration)
            add(at, node)
            add(rng.randint(at, last), node)
        elif incident == "fail-join":  # comes back, and sometimes fails once more
            add(at, node)
            back = rng.randint(at + 1, last) if at < last and rng.random() < 0.85 else at
            add(back, node, "join")
            if rng.random() < 0.3:
                add(rng.randint(back, last), node)
        elif incident == "burst":  # several distinct nodes in one iteration
            for n in rng.sample(range(nodes), min(nodes, 3 if rng.random() < 0.25 else 2)):
                add(at, n)
        else:  # a node that was never in the job
            new = next(new_ids, None)
            if new is None:
                continue
            add(at, new, "join")
    drafted.sort(key=lambda d: (d[0], d[1]))  # Hydra sorts stably by iteration anyway
    events, down = [], set()
    for _, _, event in drafted:  # a join needs the node down by then (or a new id)
        node = event["node"]
        if event.get("kind") == "join":
            if node < nodes and node not in down:
                continue
            down.discard(node)
        else:
            down.add(node)
        events.append(event)
    if time_events:
        for _ in range(rng.randint(1, 2)):
            t = round(rng.uniform(0.2, 0.9) * iterations * iteration_s, 6)
            if rng.random() < 0.3:  # past the seconds a first recovery takes
                t = round(rng.uniform(1.0, 80.0), 3)
            if rng.random() < 0.7:
                events.append({"time_s": t, "node": rng.randrange(nodes)})
            else:
                events.append({"time_s": t, "node": next(new_ids, nodes + 3), "kind": "join"})
    return events, event_notes(events, nodes)


def event_notes(events, nodes: int) -> list[str]:
    """What a script exercises: fail, rejoin (a failed node comes back), join-new (an id
    outside the job joins), fail-while-down (a node fails again before it came back),
    fail-after-rejoin, burst (two or more failures in one iteration), join-and-fail (a join
    and a failure in one iteration), time (a time-based event)."""
    notes, down, joined, per_iteration = set(), set(), set(), {}
    for e in events:
        if "time_s" in e:
            notes.add("time")
            continue
        node, kind = e["node"], e.get("kind", "fail")
        per_iteration.setdefault(e["iteration"], []).append(kind)
        if kind == "join":
            notes.add("join-new" if node >= nodes and node not in down else "rejoin")
            down.discard(node)
            joined.add(node)
        else:
            notes.add("fail")
            if node in down:
                notes.add("fail-while-down")
            elif node in joined:
                notes.add("fail-after-rejoin")
            down.add(node)
    for kinds in per_iteration.values():
        if kinds.count("fail") >= 2:
            notes.add("burst")
        if "fail" in kinds and "join" in kinds:
            notes.add("join-and-fail")
    return sorted(notes)


# -- running and judging ---------------------------------------------------------------------

@dataclass
class Result:
    case: Case
    outcome: str  # one of OUTCOMES
    status: str  # the run's status ("exception" when execute raised)
    detail: str  # the error, or the first difference from fault-free training
    failures: int | None = None
    wall_s: float = 0.0


def classify(summary: dict, reference: tuple[list, dict] | None) -> str:
    """The verdict on one run. `reference`: (losses, state dict) of fault-free training of the
    same setup, or None where there is nothing to compare with (sim): status only."""
    return _judge(summary, reference)[0]


def _judge(summary: dict, reference) -> tuple[str, str]:
    status, error = summary.get("status"), summary.get("error")
    if status == "oom":
        return "oom", str(error or "")
    if status == "unrecoverable":
        return ("unrecoverable", str(error)) if error and str(error).strip() else ("crashed", "unrecoverable without a reason")
    if status != "ok":
        return "crashed", f"status {status!r}: {error}"
    if reference is None:
        return "ok", ""
    from ftbench.equivalence import compare, load_state

    if not summary.get("losses") or not summary.get("final_state"):
        return "different", "status ok but no losses or final state"
    try:
        state = load_state(summary["final_state"])
    except Exception as err:  # noqa: BLE001 a broken final state is a wrong result
        return "different", f"final state does not load: {type(err).__name__}: {err}"
    difference = compare(summary["losses"], state, *reference)
    return ("different", difference) if difference else ("equal", "")


class _Timeout(Exception):
    pass


def _execute(overrides: list[str], run_dir: Path, timeout_s: float | None) -> dict:
    """execute() with a time limit; an exception becomes status "exception"."""
    from ftbench.cli import compose
    from ftbench.run import execute

    def on_alarm(*_):
        raise _Timeout(f"no result after {timeout_s:g} s")

    use_alarm = bool(timeout_s) and hasattr(signal, "SIGALRM")
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return execute(compose([*overrides, *RUN_ONLY]), run_dir, echo=lambda *_: None)
    except BaseException as err:  # noqa: BLE001 any exception of a run is a verdict, not our crash
        if isinstance(err, KeyboardInterrupt):
            raise
        last = traceback.format_exc().strip().splitlines()[-1]
        return {"status": "exception", "error": last if not isinstance(err, _Timeout) else f"timeout: {err}"}
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


_REFERENCES: dict[tuple[str, ...], tuple] = {}  # training and setup -> (losses, state) or an error string


def _replayed_reference(case: Case, ledger) -> tuple | None:
    """(losses, state) of the case's fault-free training replayed under `ledger`; None where
    the ledger trained every iteration's global batch (the usual reference then)."""
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.fault_free import fault_free_reference
    from ftbench.samples import replayed

    cfg = compose(case.reference_overrides)
    ctx = RunContext.from_config(cfg)
    replay = replayed(ledger, ctx.global_batch)
    return None if replay is None else fault_free_reference(cfg, ctx, replay=replay)


def reference_for(case: Case, workdir: Path, timeout_s: float | None = None, ledger=None):
    """Fault-free training of the case's setup, run once per setup in this process; where the
    run's `ledger` dropped samples (torchft), the same training replayed under it
    (ftbench.fault_free), in this process."""
    from ftbench.equivalence import load_state

    if ledger:
        replayed = _replayed_reference(case, ledger)
        if replayed is not None:
            return replayed
    key = (*case.training, *case.setup)
    if key not in _REFERENCES:
        run_dir = Path(tempfile.mkdtemp(prefix="reference-", dir=workdir))
        try:
            summary = _execute(case.reference_overrides, run_dir, timeout_s)
            if summary.get("status") == "ok" and summary.get("losses") and summary.get("final_state"):
                _REFERENCES[key] = (list(summary["losses"]), load_state(summary["final_state"]))
            else:
                _REFERENCES[key] = f"fault-free reference failed: {summary.get('status')}: {summary.get('error')}"
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    return _REFERENCES[key]


def run_case(case: Case, workdir: Path | str | None = None, timeout_s: float | None = 300.0) -> Result:
    """Run the case (and, on a backend with losses, its fault-free reference) and judge it."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ftbench-chaos-") if own else workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{case.seed}-{case.strategy}-", dir=workdir))
    started = time.perf_counter()
    try:
        summary = _execute(case.overrides, run_dir, timeout_s)
        reference = None
        if case.backend != "sim" and summary.get("status") == "ok":
            reference = reference_for(case, workdir, timeout_s, summary.get("ledger"))
            if isinstance(reference, str):
                return Result(case, "crashed", "ok", reference, summary.get("failures"),
                              time.perf_counter() - started)
        outcome, detail = _judge(summary, reference)
        return Result(case, outcome, str(summary.get("status")), detail, summary.get("failures"),
                      time.perf_counter() - started)
    finally:
        shutil.rmtree(run_dir if not own else workdir, ignore_errors=True)


def reproduce(case: Case, echo=print) -> Result:
    """Run one case again, printing its command line and its verdict."""
    echo(case.description)
    if case.wall_clock_events:
        echo("(time-based events strike at wall-clock time here: the run may not replay exactly)")
    result = run_case(case)
    echo(f"-> {result.outcome}" + (f": {result.detail}" if result.detail else ""))
    return result


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Replay one random failure case of ftbench.chaos.")
    parser.add_argument("seed", type=int)
    parser.add_argument("strategy", choices=STRATEGIES)
    parser.add_argument("--backend", default="local", choices=("local", "sim"))
    parser.add_argument("--print", action="store_true", help="only print the command line")
    args = parser.parse_args(argv)
    case = random_case(args.seed, args.strategy, args.backend)
    if args.print:
        print(case.description)
        return 0
    return 0 if reproduce(case).outcome in ("equal", "ok", "unrecoverable", "oom") else 1


if __name__ == "__main__":
    raise SystemExit(main())
