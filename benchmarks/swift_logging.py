"""Swift's selective logging for GPT-3 models: log bytes against modelled recovery time.

    python benchmarks/swift_logging.py [--models gpt3-medium gpt3-2.7b gpt3-6.7b] [--pp 8]
        [--microbatches 16] [--interval 100] [--parallel 1] [--plot runs/swift_logging.png]

Typical duration: 2-5 s on 2 shared cores (the cost model only; nothing is trained or simulated).

Each pipeline stage is a machine (one GPU per node: a logging group is a machine by default
in Swift), the layers cut by the cost model's balanced partition. For every model the greedy
of `ftbench.planning.swift` merges adjacent logging groups, the merge that adds the least
expected recovery time per byte of log saved first, from logging every boundary to logging
none. Printed per step: the groups, the log on storage at its peak (one checkpoint interval
of both directions' boundary tensors, fp16) and the expected recovery time of one machine's
failure (its group replays half an interval on average). Setup values: checkpoint every 100
iterations (Swift's scripts), micro-batch 1 x 2048 tokens, A100 80 GB at the hardware
profile's efficiency (our assumptions); the plot has a curve per model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from ftbench.planning.swift import SelectiveLogging

# measured wall time of the default run
DURATION = "2-5 s on 2 shared cores (the cost model only)"


def logging_of(model: str, pp: int, microbatches: int, interval: int, parallel: int, hardware: str) -> SelectiveLogging:
    from ftbench.cli import compose  # here, not at the top: --help and the header come first
    from ftbench.context import RunContext
    from ftbench.planning.swift import SelectiveLogging

    cfg = compose(["backend=sim", f"model={model}", f"hardware={hardware}", f"cluster.pp={pp}", "cluster.dp=1",
                   f"train.microbatches={microbatches}", "train.microbatch_size=1"])
    ctx = RunContext.from_config(cfg)
    cm = ctx.cost_model
    cuts = cm.balanced_partition(pp)
    stages = [cm.stage(layers, i == 0, i == pp - 1) for i, layers in enumerate(cuts)]
    machine_s = [s.forward_s + s.backward_input_s + s.backward_weight_s for s in stages]
    boundary = ctx.spec.boundary_bytes(ctx.microbatch_size, ctx.seq_len)
    return SelectiveLogging(machine_s, [boundary] * (pp - 1), microbatches, interval, parallel)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--models", nargs="+", default=["gpt3-medium", "gpt3-2.7b", "gpt3-6.7b"])
    parser.add_argument("--pp", type=int, default=8, help="pipeline stages, one machine each (default 8)")
    parser.add_argument("--microbatches", type=int, default=16, help="per iteration (default 16)")
    parser.add_argument("--interval", type=int, default=100, help="iterations between checkpoints (Swift: 100)")
    parser.add_argument("--parallel", type=int, default=1, help="parallel recovery's degree (default 1: serial)")
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--plot", default="runs/swift_logging.png",
                        help="the curves' PNG, written under runs/ unless given ('' for none)")
    args = parser.parse_args(argv)
    print(f"swift_logging.py: Swift's selective logging, log bytes vs recovery time; typically {DURATION}", file=sys.stderr, flush=True)
    print(f"Swift selective logging: pp {args.pp} (a machine per stage), {args.microbatches} micro-batches, "
          f"checkpoint every {args.interval} iterations, replay parallel {args.parallel}", flush=True)
    curves = {}
    for model in args.models:
        s = logging_of(model, args.pp, args.microbatches, args.interval, args.parallel, args.hardware)
        curves[model] = curve = s.curve()
        print(f"\n{model}\n| groups | logged boundaries | log at its peak (GB) | expected recovery (s) |\n|---|---|---|---|")
        for plan in curve:
            print(f"| {len(plan.groups)} | {','.join(map(str, plan.logged_boundaries)) or '-'} | "
                  f"{plan.log_bytes / 1e9:.2f} | {plan.recovery_s:.1f} |", flush=True)
    if str(args.plot):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for model, curve in curves.items():
            ax.plot([p.log_bytes / 1e9 for p in curve], [p.recovery_s for p in curve], marker="o", label=model)
        ax.set_xlabel("log on storage at its peak (GB)")
        ax.set_ylabel("expected recovery time (s)")
        ax.set_title(f"Swift selective logging, pp {args.pp}, checkpoint every {args.interval} iterations")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
