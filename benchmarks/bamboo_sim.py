"""Bamboo on the simulator: what redundancy costs with no failure, what it needs in memory,
and what a pipeline runs at after failovers.

For each setup, side by side in one run:
  - the fault-free iteration time of `none` (the same pipelines without redundancy) and of
    `bamboo` (its eager redundant forward before every backward, the redundant copies
    refreshed after every step), and their ratio: the overhead of eager redundancy;
  - the peak memory per worker of both (weights, gradients and Adam state of every replica
    held, plus stashed activations), their ratio, and whether Bamboo fits the GPU;
  - Bamboo's throughput after one failover and after two (in different pipelines), relative
    to its own fault-free throughput: every node's worker that fails hands its stage to its
    predecessor, which then runs two stages.

Everything is the strategy's own plans timed by the simulator with the documented cost model;
nothing is calibrated (ratios do not depend on `hardware.efficiency`).

Setups (assumptions where the papers do not say):
  - "Oobleck's table" (Oobleck SOSP'23, Table 2): 30 nodes of 4 A100 40 GB GPUs; Bamboo with 6
    stages per pipeline (the step of Oobleck's Bamboo throughput table, 6 nodes) and one
    node per stage, so 5 x 4 pipelines; global batch BERT-Large 8192, GPT-2 1024, GPT-3 Medium
    819, 2.7B 512, 6.7B 1024 (the Oobleck artifact, SymbioticLab/Oobleck sosp23-artifact, tools/simulator/), each rounded to a multiple of 20 pipelines x the
    micro-batch (`none` needs that); micro-batches of 2 (BERT) and 4 (GPT-2), Bamboo's own
    example configurations, and 8 / 4 / 4 for the GPT-3 models (benchmarks/oobleck_table.py)
    (external/deepspeed/DeepSpeedExamples/pipeline_parallelism/{bert,gpt2}.json); the model's
    context (512, 1024); no activation recomputation (Bamboo's examples set none, and its
    redundant forward keeps every activation until the iteration ends). `none`: the same
    6 x 20 grid.
  - "ReCycle's table" (ReCycle SOSP'24): ReCycle's setup is not published; as in this
    project's ReCycle ablation (benchmarks/recycle_ablation.py), pp 4 and dp 4, one GPU per
    node, 8 micro-batches of 1 x 2048 tokens per pipeline: GPT-3 Medium on A100 40 GB, GPT-3
    3.35B and 6.7B on A100 80 GB (6.7B at pp 8), to show where memory runs out.

Bamboo runs eager (`strategy.recovery=eager`: the copy on the GPU, the redundant forward):
the mode whose cost this measures. `--recovery lazy` (Bamboo's default) keeps the copy in
host memory and runs no redundant forward: its device memory and fault-free time are
`none`'s.

    python benchmarks/bamboo_sim.py [--setups oobleck recycle] [--recovery eager|lazy]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# measured wall time of the default run
DURATION = "4-25 s on 2 shared cores, depending on load"

OOBLECK = [  # (model, setup overrides for bamboo, for none)
    ("bert-large", ["model=bert-large", "hardware=a100-40gb", "cluster.gpus_per_node=4", "cluster.pp=6",
                    "train.global_batch=8160", "train.microbatch_size=2"], 30),
    ("gpt2-xl", ["model=gpt2-xl", "hardware=a100-40gb", "cluster.gpus_per_node=4", "cluster.pp=6",
                 "train.global_batch=1040", "train.microbatch_size=4"], 30),
    # the GPT-3 rows of Oobleck's table (Bamboo: OOM there), micro-batches as benchmarks/oobleck_table.py
    ("gpt3-medium", ["model=gpt3-medium", "hardware=a100-40gb", "cluster.gpus_per_node=4", "cluster.pp=6",
                     "train.global_batch=800", "train.microbatch_size=8"], 30),
    ("gpt3-2.7b", ["model=gpt3-2.7b", "hardware=a100-40gb", "cluster.gpus_per_node=4", "cluster.pp=6",
                   "train.global_batch=480", "train.microbatch_size=4"], 30),
    ("gpt3-6.7b", ["model=gpt3-6.7b", "hardware=a100-40gb", "cluster.gpus_per_node=4", "cluster.pp=6",
                   "train.global_batch=1040", "train.microbatch_size=4"], 30),
]
RECYCLE = [
    ("gpt3-medium", ["model=gpt3-medium", "hardware=a100-40gb", "cluster.pp=4", "cluster.dp=4",
                     "train.microbatch_size=1", "train.microbatches=8"], None),
    ("gpt3-3.35b", ["model=gpt3-3.35b", "hardware=a100-80gb", "cluster.pp=4", "cluster.dp=4",
                    "train.microbatch_size=1", "train.microbatches=8"], None),
    ("gpt3-6.7b", ["model=gpt3-6.7b", "hardware=a100-80gb", "cluster.pp=8", "cluster.dp=4",
                   "train.microbatch_size=1", "train.microbatches=16"], None),
]


def _sized(overrides: list[str], nodes: int | None, strategy: str) -> list[str]:
    """With `nodes`: the job is that many nodes; bamboo sizes its pipelines from them (dp=1
    only sets the batch check), none runs the same grid (pp x nodes*GPUs/pp)."""
    if nodes is None:
        return overrides
    pp = int(next(o for o in overrides if o.startswith("cluster.pp=")).split("=")[1])
    gpus = int(next(o for o in overrides if o.startswith("cluster.gpus_per_node=")).split("=")[1])
    if strategy == "bamboo":
        return [*overrides, "cluster.dp=1", f"cluster.nodes={nodes}"]
    return [*overrides, f"cluster.dp={nodes // pp * gpus}"]


RECOVERY = ["strategy.recovery=eager"]  # main() sets it from --recovery


def measure(overrides: list[str], strategy: str, fail_nodes=()) -> dict:
    """Plan `strategy` for the setup, apply failures of `fail_nodes` one by one, and simulate
    the plan in force after each: iteration time, peak memory, plan name."""
    from ftbench.cli import compose
    from ftbench.cluster import Cluster
    from ftbench.context import RunContext
    from ftbench.failures import FailureEvent
    from ftbench.strategies import build_strategy

    mode = RECOVERY if strategy == "bamboo" else []
    cfg = compose(["backend=sim", f"strategy={strategy}", "wandb.mode=disabled", *overrides, *mode])
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy_ = build_strategy(cfg.strategy, ctx)
    plan = strategy_.plan(cluster.view())
    out = [_time(ctx, plan)]
    for node in fail_nodes:
        cluster.fail(node)
        recovery = strategy_.on_event(FailureEvent(node), cluster.view(), 0)
        if recovery.unrecoverable:
            raise RuntimeError(recovery.unrecoverable)
        plan = recovery.plan or plan
        out.append(_time(ctx, plan))
    return {"runs": out, "samples": ctx.global_batch, "memory": ctx.cost_model.memory_bytes}


def _time(ctx, plan) -> dict:
    from ftbench.costs import PlanCosts
    from ftbench.sim.simulator import simulate

    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan))
    return {"iteration_s": result.iteration_time, "peak_gb": max(result.peak_memory_bytes.values()) / 1e9,
            "plan": plan.name}


def report(title: str, setups) -> None:
    print(f"\n## {title}\n", flush=True)
    print("| model | none s/it | bamboo s/it | overhead | none GB | bamboo GB | memory ratio | fits | "
          "1 failover | 2 failovers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, overrides, nodes in setups:
        started = time.perf_counter()
        base = measure(_sized(overrides, nodes, "none"), "none")["runs"][0]
        # two failovers in different pipelines: stage 1 of the first pipeline's node group,
        # then stage 2 of the second group (lanes of one node fail over together)
        pp = int(next(o for o in overrides if o.startswith("cluster.pp=")).split("=")[1])
        bamboo = measure(_sized(overrides, nodes, "bamboo"), "bamboo", fail_nodes=(1, pp + 2))
        free, one, two = bamboo["runs"]
        fits = "yes" if free["peak_gb"] * 1e9 <= bamboo["memory"] else f"OOM ({bamboo['memory'] / 1e9:.0f} GB)"
        print(f"| {model} | {base['iteration_s']:.3f} | {free['iteration_s']:.3f} | "
              f"{free['iteration_s'] / base['iteration_s']:.2f}x | {base['peak_gb']:.1f} | {free['peak_gb']:.1f} | "
              f"{free['peak_gb'] / base['peak_gb']:.2f}x | {fits} | "
              f"{free['iteration_s'] / one['iteration_s']:.2f} | {free['iteration_s'] / two['iteration_s']:.2f} |",
              flush=True)
        print(f"  ({free['plan']}; after failovers: {one['plan']!r}, {two['plan']!r}; "
              f"{time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    print("\noverhead: bamboo's fault-free iteration time / none's; memory ratio: peak per worker, bamboo / none;"
          "\nfailover columns: throughput after one and two failovers / bamboo's fault-free throughput.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--setups", nargs="+", default=["oobleck", "recycle"], choices=["oobleck", "recycle"])
    parser.add_argument("--recovery", default="eager", choices=["eager", "lazy"],
                        help="Bamboo's mode (strategy.recovery; default eager, the redundancy whose cost this measures)")
    args = parser.parse_args()
    RECOVERY[:] = [f"strategy.recovery={args.recovery}"]
    print(f"bamboo_sim.py: Bamboo ({args.recovery}) vs none on the simulator, setups {' '.join(args.setups)}; "
          f"typically {DURATION}",
          file=sys.stderr, flush=True)
    if "oobleck" in args.setups:
        report("Oobleck's table: 30 nodes x 4 A100 40 GB, 6 stages, one node per stage", OOBLECK)
    if "recycle" in args.setups:
        report("ReCycle's table (this project's ReCycle setup): pp x dp 4 x 4, 1 GPU per node", RECYCLE)


if __name__ == "__main__":
    main()
