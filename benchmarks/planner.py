"""ReCycle's planners, timed side by side: the MILP (pulp/CBC) on small grids, the
list-scheduling heuristic on a large one, and the heuristic's gap to the MILP.

    python benchmarks/planner.py                 # MILP pp=4 x dp=2..4, m=8; heuristic pp=8 x dp=16, m=32
    python benchmarks/planner.py --time-limit 60 --dps 2 3
    python benchmarks/planner.py --one-gpu-per-node   # + where planning is ReCycle's limit (1-3 min in all)

Op times are GPT-3 Medium's on A100s from the cost model (ftbench.costs), with one worker of
stage 1 failed (its micro-batches re-routed to the stage's peers), B and W decoupled. Targets:
MILP under 30 s per instance, heuristic under 1 s per plan, heuristic at most 5 % above the
MILP optimum. The gap is also given against CBC's lower bound, which holds even when the MILP
stops at its time limit without proving optimality.
"""
from __future__ import annotations

import argparse
import sys
import time

# measured wall time of the default run (MORE: other options)
DURATION = "8-25 s on 2 shared cores"
MORE = ("a MILP instance stops at --time-limit at worst; --one-gpu-per-node 1-3 min")


def _problem(pp: int, dp: int, m: int, failed, model: str):
    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.planning.problem import problem_for

    ctx = RunContext.from_config(compose(["backend=sim", f"model={model}", f"cluster.pp={pp}", f"cluster.dp={dp}",
                                          f"train.microbatches={m}"]))
    return problem_for(ctx, pp, dp, 1, failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=f"Typical duration: {DURATION}; {MORE}.")
    ap.add_argument("--dps", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--time-limit", type=float, default=30.0, help="CBC time limit per instance, s")
    ap.add_argument("--model", default="gpt3-medium")
    ap.add_argument("--one-gpu-per-node", action="store_true",
                    help="also: the heuristic on 1,024 GPUs with 1 to 32 single failed workers (1-3 min in all)")
    args = ap.parse_args()
    print(f"planner.py: ReCycle's MILP and heuristic planners, a line per instance; typically {DURATION}",
          file=sys.stderr, flush=True)
    from ftbench.planning.heuristic import list_schedule
    from ftbench.planning.milp import solve
    from ftbench.planning.problem import evaluate

    print("MILP (warm-started by the heuristic), pp=4, m=8, worker (0,1) failed", flush=True)
    print(f"{'dp':>3} {'heuristic ms':>13} {'MILP ms':>9} {'bound ms':>9} {'status':>9} {'MILP s':>7} "
          f"{'gap to MILP':>12} {'gap to bound':>13} {'binaries':>9}", flush=True)
    for dp in args.dps:
        problem = _problem(4, dp, 8, {(0, 1)}, args.model)
        heuristic = list_schedule(problem)
        h = evaluate(problem, heuristic).iteration_time
        result = solve(problem, warm_start=heuristic, time_limit_s=args.time_limit)
        print(f"{dp:>3} {h * 1e3:>13.3f} {result.makespan * 1e3:>9.3f} {result.bound * 1e3:>9.3f} "
              f"{result.status:>9} {result.seconds:>7.1f} {100 * (h / result.makespan - 1):>11.2f}% "
              f"{100 * (h / result.bound - 1):>12.2f}% {result.binaries:>9}", flush=True)

    print("\nheuristic, pp=8 x dp=16, m=32 (128 workers, 12,288 ops)", flush=True)
    for failed in (set(), {(0, 1)}, {(0, 1), (3, 5)}, {(0, 2), (1, 2)}):
        problem = _problem(8, 16, 32, failed, args.model)
        started = time.perf_counter()
        orders = list_schedule(problem)
        seconds = time.perf_counter() - started
        print(f"  failed {sorted(failed)!s:<18} {seconds:6.3f} s   iteration {evaluate(problem, orders).iteration_time * 1e3:.2f} ms",
              flush=True)

    if args.one_gpu_per_node:
        one_gpu_per_node(args.model)


def one_gpu_per_node(model: str) -> None:
    """The heuristic where ReCycle's planning is the limit: GPT-3 6.7B's grid at 1,024 GPUs
    (pp 8 x dp 128, m 64) with single failed workers (one GPU per node, never repaired, as in
    `sim_scale.py --gpus-per-node 1`). Each failed worker hands its 64 micro-batches to 64 peers,
    which ties their pipelines to its own: the largest coupled part, which must be scheduled op
    by op, grows with the failures until it is the whole grid."""
    import random

    from ftbench.planning import heuristic
    from ftbench.planning.parts import split

    print("\nheuristic, GPT-3 6.7B pp=8 x dp=128, m=64, one GPU per node: n failed workers (seeded)", flush=True)
    print(f"{'failed':>7} {'parts':>6} {'largest part':>13} {'its ops':>9} {'planning s':>11} {'us per op':>10}",
          flush=True)
    rng = random.Random(0)
    positions = rng.sample([(d, s) for d in range(128) for s in range(8)], 32)
    for n in (1, 2, 4, 8, 16, 32):
        problem = _problem(8, 128, 64, set(positions[:n]), "gpt3-6.7b")
        heuristic._SHAPE_PLANS.clear()  # cold: every shape planned in this row
        started = time.perf_counter()
        heuristic.list_schedule_shaped(problem)
        seconds = time.perf_counter() - started
        shapes = split(problem)
        largest = max((shape for shape, _ in shapes), key=lambda shape: len(shape.workers))
        ops = sum(len(largest.ops_of(pos)) for pos in largest.workers)
        total = sum(len(parts) for _, parts in shapes)
        scheduled = sum(sum(len(shape.ops_of(pos)) for pos in shape.workers) for shape, _ in shapes)
        print(f"{n:>7} {total:>6} {len(largest.workers):>8} wkrs {ops:>9,} {seconds:>11.2f} "
              f"{1e6 * seconds / (2 * scheduled):>10.1f}", flush=True)


if __name__ == "__main__":
    main()
