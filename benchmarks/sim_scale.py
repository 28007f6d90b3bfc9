"""Simulator scale benchmark: every strategy at 1,024 and 16,384 GPUs, whatever a failure takes down.

`--scale 1024` (default): GPT-3 6.7B on 1,024 A100 80GB GPUs (pp 8 x dp 128, 64 micro-batches
per pipeline) for 30 simulated days with Poisson node failures
(conf/experiment/sim-6.7b-1024gpu.yaml). Target: under 10 s wall per strategy.

`--scale 16k`: the same model on 16,384 GPUs (pp 8 x dp 2,048) for 54 simulated days at the
Llama 3 interruption rate, one per 3.09 h for a job of 8-GPU nodes
(conf/experiment/sim-6.7b-16k.yaml). Target: under 60 s wall per strategy.

`--gpus-per-node N` (default: the experiment's 8): with 1, a failure takes one GPU out of a
pipeline, the case ReCycle and Oobleck are built for; the experiments' failure rates are per
node, so such a job sees about 8 times the failures (about 3,000 at 16k), the same GPUs lost
one at a time. Targets for every case: peak resident memory under 4 GB.

Each strategy runs in its own process (its peak resident memory is that process's, VmHWM), with a
cold plan cache, and is stopped after `--limit-s` seconds (default 600): the row then says how
far it got (the simulated days reached and the failures applied). Printed per strategy: wall
time, peak resident memory, the part spent simulating plans (the memoised simulator, plan keys
included) and in the strategy (its plans and recovery decisions), distinct plans simulated,
iterations, simulated days, failures. `none` has no fault tolerance, so its run is cut at the
first failure.

`--growth`: per strategy, wall time against the failures applied (`failures.count` 10, 100,
374, at the chosen scale) and against GPUs (1,024, 4,096, 16,384: the 16k setup at dp 128, 512,
2,048, 100 failures each).

With recycle among the strategies, the run ends with ReCycle's normalisation check
(ftbench/planning/normal_check.py; `--no-check` skips it): on the ReCycle table's grids (pp 4 x
dp 4, pp 8 x dp 4, one GPU per node), every failure set of 1-3 failed workers, the plan of its
per-stage normal form (strategy.normalise=stage, the default) against the plan of its pipeline
normal form (renaming pipelines only), both renamed onto the real workers and simulated: one
line per grid with the sets checked and the largest slow-down and speed-up.

    python benchmarks/sim_scale.py [--scale 1024|16k] [--gpus-per-node N] [--strategies a,b]
                                   [--limit-s 600] [--growth] [--no-check] [extra Hydra overrides...]

Typical duration on 2 shared cores: 11-21 s at 1,024 GPUs (recycle 2-4 s of it, with 8 or 1 GPUs
per node), then 2-5 min for the normalisation check; 2-5 min at 16k with 8 per node (recycle under
1 min of it: 37-54 s measured on 2026-11-27 at load average 2.2-5.7); with 1 GPU per node at 16k
recycle takes about 1-1.5 min (56-110 s at load average 2.4 to 6.1, on 2026-11-27)
(docs/strategies/recycle.md, "Scale"); --growth not re-measured (earlier: about 5 min).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")

SCALES = {"1024": "sim-6.7b-1024gpu", "16k": "sim-6.7b-16k"}
BENCH_FILE = "sim_scale.json"  # what a child adds to summary.json: its stopwatches
# measured wall time of the default run (MORE: other options)
DURATION = "11-21 s on 2 shared cores at 1,024 GPUs, and 2-5 min for ReCycle's normalisation check"
MORE = ("--scale 16k 2-5 min (recycle under 1 min of it; with --gpus-per-node 1 about 1.5 min); "
        "--growth not re-measured (earlier: about 5 min)")


class Stopwatch:
    """Seconds spent inside some methods (the outermost call counts, nested ones do not)."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0

    def wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self._depth += 1
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def child(name: str, run_dir: Path, overrides: list[str]) -> None:
    """One strategy's run in this process, into `run_dir` (summary.json, and the stopwatches in
    BENCH_FILE, also when the parent stops it with SIGTERM)."""
    from ftbench.cli import compose
    from ftbench.run import execute
    from ftbench.sim.cache import SimCache
    from ftbench.strategies import REGISTRY

    from ftbench.sim import cache

    simulating, deciding = Stopwatch(), Stopwatch()
    simulating.wrap(SimCache, "__call__")
    simulations = [0]  # plans simulated, also for a run stopped before its summary counts them
    simulate = cache.simulate

    def counted(*args, **kwargs):
        simulations[0] += 1
        return simulate(*args, **kwargs)

    cache.simulate = counted
    for method in ("plan", "on_event"):
        deciding.wrap(REGISTRY[name], method)
    cfg = compose(overrides + [f"strategy={name}"])
    if "plan_cache" in cfg.strategy:  # a cold plan cache: every plan is made in this run
        cfg = compose(overrides + [f"strategy={name}", "strategy.plan_cache=plan-cache"])
    try:
        execute(cfg, run_dir, echo=lambda *_: None)
    finally:
        (run_dir / BENCH_FILE).write_text(json.dumps({"sim_s": simulating.seconds, "strategy_s": deciding.seconds,
                                                      "rss_gb": peak_rss_gb(), "simulations": simulations[0]}))


def peak_rss_gb() -> float | None:
    """This process's peak resident memory since it started (VmHWM: reset by exec, unlike
    getrusage's ru_maxrss, which keeps the high-water mark of the process that forked it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # elsewhere: KiB on Linux


def measure(name: str, overrides: list[str], limit_s: float) -> dict:
    """Run one strategy in a child process; its summary with wall_s, rss_gb, sim_s,
    strategy_s, and `stopped` when the limit cut it."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--run-dir", str(run_dir), *overrides],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stopped = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if not stopped and time.perf_counter() - started > limit_s:
                proc.send_signal(signal.SIGTERM)  # the run keeps what it did (summary.json)
                stopped = True
            elif stopped and time.perf_counter() - started > limit_s + 60:
                proc.kill()  # it did not stop within a minute of SIGTERM: no process is left behind
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        try:
            s = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            s = {"status": "crashed", "error": stderr.strip().splitlines()[-1:] or "no summary", "iterations": 0,
                 "time_s": 0.0, "failures": 0, "plans_simulated": 0}
        s.update(sim_s=float("nan"), strategy_s=float("nan"), rss_gb=None)
        try:
            s.update(json.loads((run_dir / BENCH_FILE).read_text()))
        except (OSError, ValueError):
            pass
        if s["rss_gb"] is None:  # the child wrote nothing: the kernel's figure (may include its parent's)
            s["rss_gb"] = usage.ru_maxrss * 1024 / 1e9
        s.update(wall_s=wall, stopped=stopped)
        return s


def row(name: str, s: dict) -> str:
    status = f"stopped at {s['wall_s']:.0f} s" if s["stopped"] else s["status"]
    return (f"{name:<16} {status:<18} {s['wall_s']:7.2f} {s['rss_gb']:6.2f} {s['sim_s']:7.2f} {s['strategy_s']:7.2f} "
            f"{s.get('plans_simulated') or s.get('simulations', 0):>6} {s.get('iterations', 0):>11,} {s.get('time_s', 0.0) / 86400:9.2f} "
            f"{s.get('failures', 0):>9}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"Typical duration: {DURATION}; {MORE}.")
    parser.add_argument("--scale", choices=sorted(SCALES), default="1024")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="cluster.gpus_per_node (default: 8)")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered one)")
    parser.add_argument("--limit-s", type=float, default=600.0, help="stop a strategy's run after this long")
    parser.add_argument("--growth", action="store_true", help="wall time against failures and against GPUs")
    parser.add_argument("--no-check", action="store_true",
                        help="skip ReCycle's normalisation check (run when recycle is among the strategies)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)

    if args.child:
        child(args.child, args.run_dir, extra)
        return
    print(f"sim_scale.py: every strategy on the simulator at {args.scale} GPUs, a row per strategy; "
          f"typically {DURATION}", file=sys.stderr, flush=True)
    from ftbench.strategies import REGISTRY

    names = args.strategies.split(",") if args.strategies else list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        parser.error(f"unknown strategies {unknown}; registered: {', '.join(REGISTRY)}")
    base = [f"experiment={SCALES[args.scale]}", "report.progress=false", "wandb.mode=disabled", *extra]
    if args.gpus_per_node is not None:
        base.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    gpn = args.gpus_per_node or 8
    print(f"{args.scale} GPUs, {gpn} per node, limit {args.limit_s:.0f} s per strategy", flush=True)
    print(f"{'strategy':<16} {'status':<18} {'wall s':>7} {'RSS GB':>6} {'sim s':>7} {'strat s':>7} {'plans':>6} "
          f"{'iterations':>11} {'sim days':>9} {'failures':>9}", flush=True)
    last = None
    for name in names:
        last = measure(name, base, args.limit_s)
        print(row(name, last), flush=True)
    if last is not None and last.get("iteration_time_s") is not None:
        print(f"\nOne plan = one iteration of {last['pp'] * last['dp']:,} workers (identical pipelines simulated "
              f"once); iteration time {last['iteration_time_s']:.3f} s. sim s: simulating plans; strat s: the "
              "strategy's plans and decisions; RSS: the run's process at its peak.")
    if args.growth:
        growth(names, base, args.limit_s)
    if "recycle" in names and not args.no_check:
        normalisation_check()


def normalisation_check() -> None:
    """ReCycle's per-stage normal form against the pipeline form on the table's grids."""
    from ftbench.planning.normal_check import check, summary

    started = time.perf_counter()
    print("\nReCycle's per-stage normal form (strategy.normalise=stage) against renaming pipelines only, every "
          "failure set of 1-3 failed workers, one GPU per node (negative: the per-stage plan is faster):", flush=True)
    print(summary(check()), flush=True)
    print(f"(checked in {time.perf_counter() - started:.0f} s)", flush=True)


def growth(names: list[str], base: list[str], limit_s: float) -> None:
    counts, dps = (10, 100, 374), (128, 512, 2048)
    print("\nWall time (s) against failures applied (failures.count), and against GPUs (16k setup, 100 failures):")
    print(f"{'strategy':<16} " + " ".join(f"{c:>8} f" for c in counts) + "   " +
          " ".join(f"{8 * d:>7} GPUs" for d in dps), flush=True)
    for name in names:
        by_count = [measure(name, base + [f"failures.count={c}"], limit_s) for c in counts]
        by_gpus = [measure(name, [f"experiment={SCALES['16k']}", "report.progress=false", "wandb.mode=disabled",
                                  *[o for o in base[3:] if not o.startswith("cluster.dp=")],
                                  f"cluster.dp={d}", "failures.count=100"], limit_s) for d in dps]
        cell = lambda s: f"{s['wall_s']:8.2f}{'+' if s['stopped'] else ' '}"  # noqa: E731
        print(f"{name:<16} " + " ".join(cell(s) + " " for s in by_count) + "   " +
              " ".join(cell(s) + "     " for s in by_gpus), flush=True)
    print("(+: stopped at the limit)")


if __name__ == "__main__":
    main(sys.argv[1:])
