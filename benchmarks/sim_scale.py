"""Simulator scale benchmark.

`--scale 1024` (default): GPT-3 6.7B on 1,024 A100 80GB GPUs (pp 8 x dp 128, 64 micro-batches
per pipeline) for 30 simulated days with Poisson node failures
(conf/experiment/sim-6.7b-1024gpu.yaml). Target: well under 10 s wall per strategy.

`--scale 16k`: the same model on 16,384 GPUs (pp 8 x dp 2,048, 8 GPUs per node) for 54
simulated days at the Llama 3 interruption rate, one per 3.09 h for the job
(conf/experiment/sim-6.7b-16k.yaml). Target: under 60 s wall per strategy.

ReCycle starts with a cold plan cache (a fresh folder per run).

Runs once per registered strategy (or those of `--strategies a,b`). `none` has no fault
tolerance, so its run is cut at the first failure. Prints, per strategy: wall time, the part
of it spent simulating plans (the memoised simulator, plan keys included) and in the
strategy (its plans and recovery decisions, Varuna's candidate shapes included), distinct
plans simulated, simulated iterations per wall second, and how far the run got.

    python benchmarks/sim_scale.py [--scale 1024|16k] [--strategies a,b] [extra Hydra overrides...]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")

SCALES = {"1024": "sim-6.7b-1024gpu", "16k": "sim-6.7b-16k"}


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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="1024")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered one)")
    args, extra = parser.parse_known_args(argv)

    from ftbench.cli import compose
    from ftbench.run import execute
    from ftbench.sim.cache import SimCache
    from ftbench.strategies import REGISTRY

    names = args.strategies.split(",") if args.strategies else list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        parser.error(f"unknown strategies {unknown}; registered: {', '.join(REGISTRY)}")
    simulating, deciding = Stopwatch(), Stopwatch()
    simulating.wrap(SimCache, "__call__")
    for cls in {REGISTRY[n] for n in names}:
        for method in ("plan", "on_event"):
            deciding.wrap(cls, method)

    base = [f"experiment={SCALES[args.scale]}", "report.progress=false", "wandb.mode=disabled", *extra]
    print(f"{'strategy':<16} {'status':<14} {'wall s':>7} {'sim s':>6} {'strat s':>7} {'plans':>6} "
          f"{'iterations':>11} {'sim days':>9} {'iters/wall s':>13} {'failures':>9}")
    s = None
    for name in names:
        simulating.seconds = deciding.seconds = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            cfg = compose(base + [f"strategy={name}"])
            if "plan_cache" in cfg.strategy:  # a cold plan cache: every plan is made in this run
                cfg = compose(base + [f"strategy={name}", f"strategy.plan_cache={tmp}/plan-cache"])
            start = time.perf_counter()
            s = execute(cfg, Path(tmp), echo=lambda *_: None)
            wall = time.perf_counter() - start
        print(f"{name:<16} {s['status']:<14} {wall:7.2f} {simulating.seconds:6.2f} {deciding.seconds:7.2f} "
              f"{s['plans_simulated']:>6} {s['iterations']:>11,} {s['time_s'] / 86400:9.2f} "
              f"{s['iterations'] / wall:13,.0f} {s['failures']:>9}", flush=True)
    if s is not None and s.get("iteration_time_s") is not None:
        workers = s["pp"] * s["dp"]
        print(f"\nOne plan = one iteration of {workers:,} workers (identical pipelines simulated once); "
              f"iteration time {s['iteration_time_s']:.3f} s, bubble {s['bubble_fraction']:.1%}. "
              "sim s: simulating plans; strat s: the strategy's plans and decisions.")


if __name__ == "__main__":
    main(sys.argv[1:])
