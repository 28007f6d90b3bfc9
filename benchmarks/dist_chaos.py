"""Chaos trials on backend=dist: a seeded random node is SIGKILLed at a seeded random iteration.

For each strategy, `--trials` runs of gpt-tiny (pp 2 x dp 2, one GPU per node, one standby
node: 5 processes) each kill one node drawn from the seed. A trial passes when it ends within
its deadline, recovered (`ok`, trained exactly like fault-free training by the run's own check)
or with a clear `unrecoverable`, with every metrics line there and no process left behind
(the process table is read after each trial). Prints one line per trial, then per strategy the
measured recovery phases (detection, agreement, state transfer, first iteration after) beside
the simulator's prediction of the recovery actions on the same hardware profile
(`hardware=cpu` by default), with the ratio.

With `--unannounced`, nothing is scripted: a seeded random process dies after a seeded random
number of its ops of a seeded random iteration (`backend.kill`), and the survivors must notice,
agree, roll back to the iteration's start and let the strategy recover (backend.unannounced).
These trials run with the default `backend.timeout_s` (60 s): each prints its death-to-regroup
time (from the dead rank's last heartbeat until the slowest survivor has its new process
groups), and the run ends with their median and worst beside what `sim` charges for the same
step (a Rendezvous, `rendezvous_s` of hardware=cpu).

With `--during-recovery` (two standby nodes: 6 processes), the scripted failure is followed
by the death of another seeded random process (a standby included) while the recovery from it runs
(`backend.kill=RANK:ITERATION:recovery`): the survivors complete the recovery without it, then
recover from its death.

    python benchmarks/dist_chaos.py [--trials 20] [--seed 0] [--strategies checkpoint,recycle,...]
                                    [--unannounced | --during-recovery | --mixed]

`--mixed` draws each trial's kind from the seed; `tests/test_dist_chaos.py` runs it (20 trials
per strategy, `python -m pytest -m chaos`).

A trial takes 30 to 45 s on a 2-core machine (5 processes start, the run, then the fault-free
reference on `local`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ftbench.local_sgd import finishes_iteration  # noqa: E402
from ftbench.strategies import REGISTRY  # noqa: E402

# Every registered strategy but the baseline (a death ends `none`), with the settings its
# registration gives these trials (StrategyTests.dist).
STRATEGIES = tuple(name for name in REGISTRY if name != "none")
EXTRA = {name: cls.tests.dist for name, cls in REGISTRY.items()}
ITERATIONS = 6
SETUP = ("model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "cluster.gpus_per_node=1", "cluster.spares=1",
         f"train.iterations={ITERATIONS}", "train.microbatches=4", "report.gantt=false", "report.progress=false",
         "backend.timeout_s=30", "backend.dtype=float64", "hardware=cpu", "wandb.mode=disabled")
DEADLINE_S = 240
OPS = 9  # --unannounced: a process dies after 0 to OPS - 1 of its ops (each worker runs more)
# wall time of the default run, extrapolated from measured runs (MORE: what was measured)
DURATION = "about 80-90 min on 2 shared cores, extrapolated: 20 trials x 8 strategies at 30-35 s per trial"
MORE = ("measured at light load, per trial: 30-35 s scripted, 35-40 s --unannounced, 45-55 s "
        "--during-recovery; about 80 s each under heavy load")


def marked(marker: str) -> list[int]:
    """Live processes whose environment carries `marker`."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def trial(strategy: str, node: int, iteration: int, folder: Path, ops: int | None = None,
          also: int | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One run: node `node` fails in `iteration`, scripted, or (with `ops`) its process dies
    unannounced after `ops` of its ops there (one GPU per node: rank = node); with `also`,
    that rank dies during the recovery from the scripted failure; `extra`: more overrides
    (--set)."""
    marker = f"FTBENCH_CHAOS={uuid.uuid4().hex}"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", FTBENCH_CHAOS=marker.split("=")[1])
    failure = (f"failures.events=[{{iteration:{iteration},node:{node}}}]" if ops is None else
               f"backend.kill={node}:{iteration}:{ops}")
    # a second death may need a second standby (checkpoint restart replaces every failed node)
    during = () if also is None else (f"backend.kill={also}:{recovered_at(strategy, iteration, extra)}:recovery",
                                      "backend.timeout_s=10", "cluster.spares=2")
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "ftbench", "backend=dist", f"strategy={strategy}", *SETUP,
                        *EXTRA.get(strategy, ()), *extra, failure,
                        *(() if ops is None else ("backend.timeout_s=60",)),
                        *during,
                        f"hydra.run.dir={folder}"], cwd=ROOT, env=env, capture_output=True, timeout=DEADLINE_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    wall = time.monotonic() - started
    time.sleep(1.0)  # agents past their exit barrier
    left = marked(marker)
    out = {"wall_s": wall, "timed_out": timed_out, "left": left}
    try:
        summary = json.loads((folder / "summary.json").read_text())
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as err:
        return {**out, "status": f"no summary ({err})", "passed": False}
    events = [r["event"] for r in lines]
    fails = events.count("fail")  # a death during a recovery is a second failure (if the run got that far)
    complete = events[:1] == ["start"] and events[-1:] == ["end"] and \
        (fails == 1 if also is None else fails == 2 if summary["status"] == "ok" else fails in (1, 2))
    if summary["status"] == "ok":
        last = len(events) - 1 - events[::-1].index("recovery")
        restored = lines[last]["restored_iteration"]
        after = lines[last:]
        complete = complete and [r["iteration"] for r in after if r["event"] == "iteration"] == \
            list(range(restored, ITERATIONS))
    ok = summary["status"] == "ok" and summary.get("matches_fault_free") is True
    passed = (ok or summary["status"] == "unrecoverable") and complete and not left and not timed_out
    return {**out, "status": summary["status"], "passed": passed, "complete": complete,
            "measured": summary.get("measured_recoveries") or [], "error": summary.get("error")}


def rendezvous_s() -> float:
    """What `sim` charges for a Rendezvous on hardware=cpu: the survivors agree and rebuild."""
    from omegaconf import OmegaConf

    from ftbench.config import HardwareConfig

    return OmegaConf.merge(OmegaConf.structured(HardwareConfig),
                           OmegaConf.load(ROOT / "conf" / "hardware" / "cpu.yaml")).rendezvous_s


MODES = ("scripted", "unannounced", "during-recovery")


def recovered_at(strategy: str, iteration: int, extra: tuple[str, ...]) -> int:
    """The iteration at which the recovery from a scripted failure in `iteration` is performed:
    that one, or the next where the groups it leaves alone finish it first (torchft under
    LocalSGD or DiLoCo: Strategy.finishes_local_step)."""
    algorithm = next((x.split("=", 1)[1] for x in extra if x.startswith("train.data_parallel=")), "synchronous")
    return iteration + 1 if finishes_iteration(REGISTRY[strategy], algorithm) else iteration


def draw(rng: random.Random, mode: str) -> tuple[str, int, int, int | None, int | None]:
    """One trial's (mode, node, iteration, ops, also) from the seed's stream; `mode` "mixed"
    draws one of MODES first."""
    if mode == "mixed":
        mode = rng.choice(MODES)
    node, iteration = rng.randrange(4), rng.randrange(1, ITERATIONS - 1)
    ops = rng.randrange(OPS) if mode == "unannounced" else None
    also = rng.choice([r for r in range(6) if r != node]) if mode == "during-recovery" else None
    return mode, node, iteration, ops, also


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"Typical duration: {DURATION}; {MORE}.")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--unannounced", action="store_true", help="kill with backend.kill, nothing scripted")
    parser.add_argument("--during-recovery", action="store_true",
                        help="another process dies during the recovery from the scripted failure")
    parser.add_argument("--mixed", action="store_true",
                        help="each trial one of the three kinds above, drawn from the seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override for every trial, e.g. --set train.data_parallel=diloco "
                             "--set train.sync_every=2 (repeatable)")
    args = parser.parse_args(argv)
    mode = "mixed" if args.mixed else "unannounced" if args.unannounced else \
        "during-recovery" if args.during_recovery else "scripted"
    rng = random.Random(args.seed)
    failed = 0
    regroups = []  # death_to_regroup_s of every death of every trial
    strategies = args.strategies.split(",")
    print(f"dist_chaos.py: {args.trials} {mode} trial(s) for each of {len(strategies)} strategies on backend=dist, "
          "a line per trial; 30-80 s per trial on 2 shared cores, depending on load",
          file=sys.stderr, flush=True)
    print(f"{'strategy':<16} {'trial':>5} {'node':>4} {'iter':>4} {'status':<14} {'wall s':>7} "
          f"{'detect s':>8} {'agree s':>7} {'regroup s':>9} {'state s':>7} {'first it s':>10} {'passed':>6}"
          + ("  also" if mode in ("during-recovery", "mixed") else ""), flush=True)
    for strategy in strategies:
        phases = []
        for i in range(args.trials):
            _, node, iteration, ops, also = draw(rng, mode)
            with tempfile.TemporaryDirectory() as tmp:
                r = trial(strategy, node, iteration, Path(tmp) / "run", ops, also, tuple(args.set))
            m = r.get("measured") or [{}]
            m = m[0]
            phases += r.get("measured") or []
            regroups += [p["death_to_regroup_s"] for p in r.get("measured") or [] if "death_to_regroup_s" in p]
            failed += not r["passed"]
            print(f"{strategy:<16} {i:>5} {node:>4} {iteration:>4} {r['status']:<14} {r['wall_s']:7.1f} "
                  f"{m.get('detection_s', float('nan')):8.2f} {m.get('agreement_s', float('nan')):7.3f} "
                  f"{m.get('death_to_regroup_s', float('nan')):9.2f} {m.get('state_transfer_s', 0.0):7.3f} {m.get('first_iteration_s', float('nan')):10.3f} "
                  f"{'yes' if r['passed'] else 'NO':>6}" + (f"  {also}" if also is not None else "")
                  + ("" if r["passed"] else f"  {r.get('error') or ''} left={r['left']} timed_out={r['timed_out']}"),
                  flush=True)
        if phases:
            # The survivors' new process groups are the dist side of the simulator's rendezvous.
            actions = [sum(p.get(k, 0.0) for k in ("replacement_s", "restart_s", "state_transfer_s", "rendezvous_s",
                                                    "checkpoint_s", "new_group_s")) for p in phases]
            predicted = [p["predicted_actions_s"] for p in phases]
            total = [p["detection_s"] + p["agreement_s"] + a for p, a in zip(phases, actions)]
            print(f"  {strategy}: recovery actions (new groups included) measured {statistics.median(actions):.3f} s "
                  f"(median), sim "
                  f"predicts {statistics.median(predicted):.3f} s on hardware=cpu, measured/predicted "
                  f"{statistics.median(actions) / max(statistics.median(predicted), 1e-9):.2f}; with detection "
                  f"and agreement {statistics.median(total):.2f} s", flush=True)
    if regroups:
        print(f"\ndeath to regroup over {len(regroups)} deaths: median {statistics.median(regroups):.2f} s, worst "
              f"{max(regroups):.2f} s (backend.timeout_s 60); sim charges rendezvous_s = {rendezvous_s():g} s "
              "(hardware=cpu) for the survivors to agree and rebuild their groups", flush=True)
    print(f"\n{failed} trial(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
