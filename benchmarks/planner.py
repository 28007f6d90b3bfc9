"""ReCycle's planners, timed side by side: the MILP (pulp/CBC) on small grids, the
list-scheduling heuristic on a large one, and the heuristic's gap to the MILP.

    python benchmarks/planner.py                 # MILP pp=4 x dp=2..4, m=8; heuristic pp=8 x dp=16, m=32
    python benchmarks/planner.py --time-limit 60 --dps 2 3

Op times are GPT-3 Medium's on A100s from the cost model (ftbench.costs), with one worker of
stage 1 failed (its micro-batches re-routed to the stage's peers), B and W decoupled. Targets:
MILP under 30 s per instance, heuristic under 1 s per plan, heuristic at most 5 % above the
MILP optimum. The gap is also given against CBC's lower bound, which holds even when the MILP
stops at its time limit without proving optimality.
"""
from __future__ import annotations

import argparse
import time

from ftbench.cli import compose
from ftbench.context import RunContext
from ftbench.planning.heuristic import list_schedule
from ftbench.planning.milp import solve
from ftbench.planning.problem import evaluate, problem_for


def _problem(pp: int, dp: int, m: int, failed, model: str):
    ctx = RunContext.from_config(compose(["backend=sim", f"model={model}", f"cluster.pp={pp}", f"cluster.dp={dp}",
                                          f"train.microbatches={m}"]))
    return problem_for(ctx, pp, dp, 1, failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dps", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--time-limit", type=float, default=30.0, help="CBC time limit per instance, s")
    ap.add_argument("--model", default="gpt3-medium")
    args = ap.parse_args()

    print("MILP (warm-started by the heuristic), pp=4, m=8, worker (0,1) failed")
    print(f"{'dp':>3} {'heuristic ms':>13} {'MILP ms':>9} {'bound ms':>9} {'status':>9} {'MILP s':>7} "
          f"{'gap to MILP':>12} {'gap to bound':>13} {'binaries':>9}")
    for dp in args.dps:
        problem = _problem(4, dp, 8, {(0, 1)}, args.model)
        heuristic = list_schedule(problem)
        h = evaluate(problem, heuristic).iteration_time
        result = solve(problem, warm_start=heuristic, time_limit_s=args.time_limit)
        print(f"{dp:>3} {h * 1e3:>13.3f} {result.makespan * 1e3:>9.3f} {result.bound * 1e3:>9.3f} "
              f"{result.status:>9} {result.seconds:>7.1f} {100 * (h / result.makespan - 1):>11.2f}% "
              f"{100 * (h / result.bound - 1):>12.2f}% {result.binaries:>9}")

    print("\nheuristic, pp=8 x dp=16, m=32 (128 workers, 12,288 ops)")
    for failed in (set(), {(0, 1)}, {(0, 1), (3, 5)}, {(0, 2), (1, 2)}):
        problem = _problem(8, 16, 32, failed, args.model)
        started = time.perf_counter()
        orders = list_schedule(problem)
        seconds = time.perf_counter() - started
        print(f"  failed {sorted(failed)!s:<18} {seconds:6.3f} s   iteration {evaluate(problem, orders).iteration_time * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
