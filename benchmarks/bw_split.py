"""Decoupled backward benchmark: B + W against one fused backward.

A GPT-2-small-sized stage (hidden 768, 12 heads, 3 of GPT-2 small's 12 blocks) runs forward,
then either one fused backward (plain autograd, nothing patched) or B (input gradients, the
weight-gradient matmuls recorded) followed by W (the recorded matmuls). Both are timed side
by side in one process, interleaved, and the median ratio printed. Target: (B + W) / fused
<= 1.15, i.e. the split does no shared work twice.

    python benchmarks/bw_split.py [--layers 3] [--batch 2] [--seq 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# measured wall time of the default run
DURATION = "30-35 s on 2 shared cores (5-10 s of it importing torch)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"bw_split.py: (B + W) / fused backward, {args.repeats} repeats; typically {DURATION}",
          file=sys.stderr, flush=True)
    import torch  # after --help and the header: torch takes seconds to import

    from ftbench.engine.deferred import WeightGradStore, make_deferrable
    from ftbench.models.gpt import build_stage
    from ftbench.models.specs import resolve_model

    spec = resolve_model("gpt-tiny", layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024)
    plain = build_stage(spec, 0, 0, args.layers, False, False)  # a middle stage: blocks only
    store = WeightGradStore()
    split = make_deferrable(build_stage(spec, 0, 0, args.layers, False, False), store)
    x = torch.randn(args.batch, args.seq, spec.hidden)
    gy = torch.randn(args.batch, args.seq, spec.hidden)

    def fused() -> float:
        inp = x.clone().requires_grad_()
        y = plain(inp)
        start = time.perf_counter()
        y.backward(gy)
        return time.perf_counter() - start

    def b_then_w() -> tuple[float, float]:
        inp = x.clone().requires_grad_()
        y = split(inp)
        start = time.perf_counter()
        with store.defer("m"):
            y.backward(gy)
        mid = time.perf_counter()
        store.flush("m")
        return mid - start, time.perf_counter() - mid

    fused(), b_then_w()  # warm-up
    print(f"  warmed up; timing {args.repeats} repeats", file=sys.stderr, flush=True)
    ratios, fused_s, b_s, w_s = [], [], [], []
    for _ in range(args.repeats):
        f = fused()
        b, w = b_then_w()
        fused_s.append(f), b_s.append(b), w_s.append(w), ratios.append((b + w) / f)
        plain.zero_grad(set_to_none=True), split.zero_grad(set_to_none=True)
    med = statistics.median
    print(f"stage: {args.layers} GPT-2 small blocks (hidden 768), micro-batch {args.batch} x {args.seq} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"fused backward  {med(fused_s) * 1e3:8.1f} ms")
    print(f"B               {med(b_s) * 1e3:8.1f} ms")
    print(f"W               {med(w_s) * 1e3:8.1f} ms")
    print(f"(B + W) / fused {med(ratios):8.3f}   (median of {args.repeats}; target <= 1.15)")


if __name__ == "__main__":
    main()
