"""Local-backend overhead benchmark.

Fault-free training on the local backend (every worker of a pp x dp grid in one process,
through the harness: plan, executor, all-reduce, metrics) against plain single-process
training of the same GPT2LMHeadModel on the same samples (gradient accumulation over the
same micro-batches, one AdamW step per iteration). Both run in this process, alternately,
and the ratio of throughputs is printed per dtype. Target: local / plain >= 0.8.

    python benchmarks/local_throughput.py [--iterations 6] [--hidden 256] [--seq 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")

# measured wall time of the default run
DURATION = "2.5-5 min on 2 shared cores, depending on load (float64 takes twice float32's time)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"local_throughput.py: local backend / plain training, float32 and float64, {args.repeats} repeats each; "
          f"typically {DURATION}", file=sys.stderr, flush=True)
    import torch  # after --help and the header: torch takes seconds to import

    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.engine.reference import train_single_process
    from ftbench.models.data import make_source
    from ftbench.run import execute

    started = time.perf_counter()
    print(f"model: 8 GPT-2 blocks, hidden {args.hidden}, vocab 256, seq {args.seq}; pp 4 x dp 2, "
          f"8 micro-batches of 1 per pipeline; {args.iterations} iterations; {torch.get_num_threads()} threads",
          flush=True)
    for dtype in ("float32", "float64"):
        overrides = ["backend=local", "strategy=none", "failures=none", "model=gpt-tiny",
                     f"model.hidden={args.hidden}", f"model.seq_len={args.seq}", f"train.iterations={args.iterations}",
                     f"backend.dtype={dtype}", "report.progress=false", "report.gantt=false", "wandb.mode=disabled"]
        cfg = compose(overrides)
        ctx = RunContext.from_config(cfg)
        data = make_source("synthetic", ctx.spec, ctx.seq_len, ctx.seed)
        local, plain = [], []
        for i in range(args.repeats):
            print(f"  {dtype}: repeat {i + 1}/{args.repeats}  {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                s = execute(cfg, Path(tmp), echo=lambda *_: None)
            local.append(s["throughput"])
            start = time.perf_counter()
            train_single_process(ctx.spec, ctx.seed, data, ctx.iterations, ctx.global_batch, ctx.microbatch_size,
                                 cfg.train.lr, dtype=getattr(torch, dtype))
            plain.append(ctx.iterations * ctx.global_batch / (time.perf_counter() - start))
        ratio = statistics.median(a / b for a, b in zip(local, plain))
        print(f"{dtype}: local {statistics.median(local):7.1f} samples/s, plain single-process "
              f"{statistics.median(plain):7.1f} samples/s, local / plain {ratio:.2f} (target >= 0.8)", flush=True)


if __name__ == "__main__":
    main()
