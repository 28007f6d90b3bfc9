"""Oobleck's Table 2 (SOSP 2023) on the simulator: throughput under the Oobleck traces (30
nodes, one removed every 6 h, 1 h or 10 min, 15 removals, the run ending at the last one),
beside the published cells, with ratios; and throughput by live-node count, 30 down to 15.

    python benchmarks/oobleck_table.py [--models gpt3-medium gpt3-2.7b gpt3-6.7b] [--hardware a100-40gb]

What is calibrated, once per model: `hardware.efficiency`, so that fault-free Oobleck on 30
nodes trains at the artifact's measured fault-free throughput (the Oobleck artifact, tools/simulator/: Medium 38.47,
2.7B 9.21, 6.7B 5.51 samples/s). Everything under failures comes from the strategy's own
mechanism: re-instantiation, the layer copies it charges by bytes over the links, the
rendezvous, the lost iteration in flight, and the plans' simulated iterations.

Assumptions (the artifact does not say): GPUs per node 4 (reviewers got at least 4), the GPU
(--hardware, default A100 40 GB: its memory decides n0 and the templates), sequence length
the model's (2048), micro-batches of 8 samples for Medium (given) and 4 for 2.7B and 6.7B,
and full activation recompute only where the model does not fit without it (2.7B and 6.7B:
a micro-batch of 4 sequences of 2048 tokens stashes gigabytes per layer), so that f = 1
holds down to 15 nodes. The `recompute` column says which.
GPT-3 Medium's 819 samples per iteration are not a multiple of 8: 816 (102 micro-batches).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Oobleck's Table 2 cells (SOSP 2023) (samples/s) and the artifact's fault-free throughput.
PUBLISHED = {"gpt3-medium": {"6h": 29.30, "1h": 29.21, "10m": 28.70},
             "gpt3-2.7b": {"6h": 7.29, "1h": 7.23, "10m": 6.89},
             "gpt3-6.7b": {"6h": 4.33, "1h": 4.22, "10m": 3.55}}
FAULT_FREE = {"gpt3-medium": 38.47, "gpt3-2.7b": 9.21, "gpt3-6.7b": 5.51}
BATCH = {"gpt3-medium": (816, 8), "gpt3-2.7b": (512, 4), "gpt3-6.7b": (1024, 4)}  # (global batch, micro-batch)
TRACES = ("6h", "1h", "10m")
NODES, GPUS = 30, 4
# measured wall time of the default run
DURATION = "15-60 s on 2 shared cores for the 3 models, depending on load; --by-nodes adds little"


RECOMPUTE: dict[str, str] = {}  # model -> train.recompute, chosen by needs_recompute
STAGE_PER = ["node"]  # strategy.stage_per (--stage-per)


def needs_recompute(model: str, hardware: str) -> str:
    """`full` when no pipeline of up to 30 nodes holds the model's stages with their stashed
    activations (what practitioners do), else `none`."""
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.planning.oobleck import Templates

    batch, micro = BATCH[model]
    ctx = RunContext.from_config(compose(["backend=sim", f"model={model}", f"hardware={hardware}",
                                          f"train.microbatch_size={micro}", "cluster.pp=4", "cluster.dp=1",
                                          f"train.global_batch={batch}"]))
    t = Templates(ctx.cost_model, GPUS, STAGE_PER[0])
    n0 = t.n0()
    return "none" if n0 is not None and 2 * n0 <= NODES // 2 else "full"


def setup(model: str, hardware: str, efficiency: float, nodes: int = NODES) -> list[str]:
    batch, micro = BATCH[model]
    return ["backend=sim", "strategy=oobleck", f"strategy.stage_per={STAGE_PER[0]}", f"model={model}",
            f"hardware={hardware}",
            f"hardware.efficiency={efficiency!r}", f"cluster.gpus_per_node={GPUS}", f"cluster.nodes={nodes}",
            f"cluster.pp={GPUS}", "cluster.dp=1", "cluster.spares=0", f"train.global_batch={batch}",
            f"train.microbatch_size={micro}", f"train.recompute={RECOMPUTE[model]}", "report.gantt=false", "report.progress=false", "wandb.mode=disabled"]


def run(overrides: list[str]) -> dict:
    from ftbench.cli import compose
    from ftbench.run import execute

    with tempfile.TemporaryDirectory() as tmp:
        return execute(compose(overrides), Path(tmp), echo=lambda *_: None)


def fault_free(model: str, hardware: str, efficiency: float, nodes: int = NODES) -> float:
    s = run(setup(model, hardware, efficiency, nodes) + ["failures=none", "train.iterations=3"])
    if s["status"] != "ok":
        raise SystemExit(f"{model}: fault-free run on {nodes} nodes ended {s['status']}: {s['error']}")
    return s["throughput"]


def calibrate(model: str, hardware: str) -> float:
    """hardware.efficiency giving the published fault-free throughput (bisection in log space:
    throughput grows with efficiency)."""
    target, lo, hi = FAULT_FREE[model], 1e-4, 1.0
    if fault_free(model, hardware, hi) < target:
        raise SystemExit(f"{model}: even efficiency 1.0 trains slower than {target} samples/s on {hardware}")
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if fault_free(model, hardware, mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-4:
            break
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--models", nargs="+", default=list(PUBLISHED))
    parser.add_argument("--hardware", default="a100-40gb")
    parser.add_argument("--by-nodes", action="store_true", help="also throughput by live-node count, 30 down to 15")
    parser.add_argument("--stage-per", choices=("node", "gpu"), default="node",
                        help="strategy.stage_per: a node's GPUs hold consecutive stages, or share the node's one stage")
    args = parser.parse_args()
    STAGE_PER[0] = args.stage_per
    print(f"oobleck_table.py: Oobleck's Table 2 on the simulator, {len(args.models)} model(s), a row per model; "
          f"typically {DURATION}", file=sys.stderr, flush=True)
    print(f"Oobleck on the simulator, {NODES} nodes x {GPUS} GPUs ({args.hardware}), stage per {args.stage_per}; "
          "published = Oobleck's Table 2", flush=True)
    print(f"{'model':<12} {'efficiency':>10} {'fault-free':>10} " + " ".join(
        f"{t + ' ours':>9} {t + ' paper':>9} {'ratio':>6}" for t in TRACES) + f" {'recompute':>9} {'wall (s)':>8}",
        flush=True)
    for model in args.models:
        started = time.perf_counter()
        RECOMPUTE[model] = needs_recompute(model, args.hardware)
        efficiency = calibrate(model, args.hardware)
        print(f"  {model}: calibrated, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        free = fault_free(model, args.hardware, efficiency)
        cells = []
        for trace in TRACES:
            print(f"  {model}: trace {trace}, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            # The run ends at the trace's last event (failures.end_at_last_event, the default).
            s = run(setup(model, args.hardware, efficiency) + [
                "failures=trace", f"failures.path={ROOT / 'conf' / 'traces' / f'{trace}.csv'}",
                "train.iterations=100000000"])
            if s["status"] != "ok":
                cells.append(f"{s['status']:>9} {PUBLISHED[model][trace]:>9.2f} {'':>6}")
                continue
            ours = s["throughput"]
            cells.append(f"{ours:>9.2f} {PUBLISHED[model][trace]:>9.2f} {ours / PUBLISHED[model][trace]:>6.2f}")
        print(f"{model:<12} {efficiency:>10.4f} {free:>10.2f} " + " ".join(cells)
              + f" {RECOMPUTE[model]:>9} {time.perf_counter() - started:>8.1f}", flush=True)
        if args.by_nodes:
            counts = range(NODES, NODES // 2 - 1, -1)
            rates = [fault_free(model, args.hardware, efficiency, n) for n in counts]
            print("  by live nodes: " + ", ".join(f"{n}: {r:.2f}" for n, r in zip(counts, rates)), flush=True)


if __name__ == "__main__":
    main()
