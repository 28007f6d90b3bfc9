"""Simulator scale benchmark.

GPT-3 6.7B on 1,024 A100 80GB GPUs (pp 8 x dp 128, 64 micro-batches per pipeline) for 30
simulated days with Poisson node failures (conf/experiment/sim-6.7b-1024gpu.yaml), once per
registered strategy. `none` has no fault tolerance, so its run is cut at the first failure.
Prints, per strategy: wall time, distinct plans simulated, simulated iterations per wall
second, and how far the run got. Target: well under 10 s wall per strategy on 2 cores.

    python benchmarks/sim_scale.py [extra Hydra overrides...]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")


def main(extra: list[str]) -> None:
    from ftbench.cli import compose
    from ftbench.run import execute
    from ftbench.strategies import REGISTRY

    base = ["experiment=sim-6.7b-1024gpu", "report.progress=false", "wandb.mode=disabled", *extra]
    print(f"{'strategy':<12} {'status':<14} {'wall s':>7} {'plans':>6} {'iterations':>11} "
          f"{'sim days':>9} {'iters/wall s':>13} {'failures':>9}")
    for name in REGISTRY:
        cfg = compose(base + [f"strategy={name}"])
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            s = execute(cfg, Path(tmp), echo=lambda *_: None)
            wall = time.perf_counter() - start
        print(f"{name:<12} {s['status']:<14} {wall:7.2f} {s['plans_simulated']:>6} {s['iterations']:>11,} "
              f"{s['time_s'] / 86400:9.2f} {s['iterations'] / wall:13,.0f} {s['failures']:>9}")
    print("\nOne plan = one discrete-event simulation of a 132,096-op iteration "
          f"(1,024 workers x 129 ops); iteration time {s['iteration_time_s']:.3f} s, "
          f"bubble {s['bubble_fraction']:.1%}.")


if __name__ == "__main__":
    main(sys.argv[1:])
