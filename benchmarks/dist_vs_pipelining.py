"""Fault-free `dist` iteration time against PyTorch's own pipeline parallelism.

The same GPT (our stages: transformers GPT-2 blocks, split by the cost model's balanced
partition), the same micro-batches and data, the same AdamW, on pp processes (dp 1):

- `dist`: `ftbench backend=dist strategy=none`, the run loop in every process, our
  WorkerExecutor over DistTransport; iteration times from rank 0's metrics lines;
- `pipelining`: torch.distributed.pipelining's `Schedule1F1B` over `PipelineStage`s built from
  the same stage modules, an AdamW step and one small all-reduce per iteration (the
  iteration-closing collective `dist` does too), timed on rank 0.

Both start through the same elastic launcher and run interleaved (dist, pipelining, dist,
pipelining) so background load hits both; the median iteration time of each, after warm-up,
and their ratio are printed (target: dist / pipelining <= 1.1). The first iteration's loss of
each is printed too: they agree, so both do the same work.

    python benchmarks/dist_vs_pipelining.py [--pp 2] [--microbatches 8] [--iterations 20]
        [--layers 8] [--hidden 128] [--heads 4] [--seq-len 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

WARMUP = 3  # iterations left out of the medians (allocator, first sends, lazy init)
# measured wall time of the default run
DURATION = "20-35 s on 2 shared cores"


def _overrides(args) -> list[str]:
    return ["model=gpt-tiny", f"model.layers={args.layers}", f"model.hidden={args.hidden}", f"model.heads={args.heads}",
            f"model.seq_len={args.seq_len}", f"cluster.pp={args.pp}", "cluster.dp=1",
            f"train.microbatches={args.microbatches}", f"train.iterations={args.iterations}", "strategy=none",
            "failures=none", "backend.dtype=float32", "report.progress=false", "report.gantt=false",
            "wandb.mode=disabled"]


def run_dist(args, folder: Path) -> tuple[list[float], float]:
    from ftbench.cli import compose
    from ftbench.run import execute

    summary = execute(compose(["backend=dist", *_overrides(args)]), folder, echo=lambda *_: None)
    if summary["status"] != "ok":
        raise SystemExit(f"dist run failed: {summary['error']}")
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["iteration_s"] for r in lines if r["event"] == "iteration"], summary["losses"][0]


def _pipelining(spec, seed: int, partition, m: int, b: int, seq_len: int, iterations: int, lr: float,
                timeout: float):
    """One rank of the pipelining job: (iteration times, first iteration's loss on the last rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from ftbench.distributed.worker import init_process_group, setup_threads
    from ftbench.engine.worker import make_optimizer
    from ftbench.models.data import batch, make_source
    from ftbench.models.gpt import build_stage, lm_loss_sum

    setup_threads(None, spec)
    rank, world, device, _ = init_process_group(timeout)
    first, end = partition[rank]
    module = build_stage(spec, seed, first, end, rank == 0, rank == world - 1).to(device=device, dtype=torch.float32)
    stage = PipelineStage(module, rank, world, device)
    normaliser = float(m * b * (seq_len - 1))  # as ftbench: the global batch's mean loss

    def loss_fn(logits, tokens):
        return lm_loss_sum(logits, tokens) / normaliser

    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=False)
    optimizer = make_optimizer(module.parameters(), lr, 0.0)
    data = make_source("synthetic", spec, seq_len, seed)
    closing = torch.zeros(1, dtype=torch.float64, device=device)
    times, first_loss = [], None
    for it in range(iterations):
        started = time.perf_counter()
        if rank == 0:
            schedule.step(batch(data, it, range(m * b)).to(device))
        elif rank == world - 1:
            losses = []
            schedule.step(target=batch(data, it, range(m * b)).to(device), losses=losses)
            if first_loss is None:
                first_loss = float(sum(loss.detach().double() for loss in losses))
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(closing)
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    return times, first_loss


def run_pipelining(args, folder: Path) -> tuple[list[float], float]:
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.distributed import worker
    from ftbench.distributed.launch import launch

    cfg = compose(["backend=dist", *_overrides(args)])
    ctx = RunContext.from_config(cfg)
    partition = ctx.grid_plan(args.pp, 1).partition[0]
    start_method = worker.start_method()
    if start_method == "fork":
        worker.preload()
    out = launch(_pipelining, (ctx.spec, ctx.seed, partition, ctx.microbatches, ctx.microbatch_size, ctx.seq_len,
                               args.iterations, cfg.train.lr, 60.0),
                 args.pp, 60.0, 600.0, folder, start_method)
    return out[0][0], out[args.pp - 1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"dist_vs_pipelining.py: {args.rounds} rounds of a dist run and a pipelining run, pp {args.pp}, "
          f"{args.iterations} iterations each; typically {DURATION}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    times = {"dist": [], "pipelining": []}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, fn in (("dist", run_dist), ("pipelining", run_pipelining)):
                print(f"  round {r + 1}/{args.rounds}: {name}  {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
                its, loss = fn(args, Path(tmp) / f"{name}-{r}")
                times[name] += its[WARMUP:]
                losses[name] = loss
    d, p = statistics.median(times["dist"]), statistics.median(times["pipelining"])
    print(f"model: {args.layers} GPT-2 blocks, hidden {args.hidden}, seq {args.seq_len}; pp={args.pp} dp=1, "
          f"{args.microbatches} micro-batches; {args.rounds} rounds x {args.iterations - WARMUP} timed iterations each")
    print(f"first-iteration loss: dist {losses['dist']:.9f}, pipelining {losses['pipelining']:.9f}")
    print(f"{'':12}{'median iteration':>18}")
    print(f"{'dist':12}{d * 1e3:>15.2f} ms")
    print(f"{'pipelining':12}{p * 1e3:>15.2f} ms")
    print(f"ratio dist / pipelining: {d / p:.3f} (target <= 1.1)")


if __name__ == "__main__":
    main()
