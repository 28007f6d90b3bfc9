"""CBC with and without `-threads 1`, side by side: how often a tiny MILP runs to its time limit.

CBC 2.10's threaded branch and bound (what `-threads 1` selects) sometimes leaves its main
thread waiting for a worker thread that never starts, until the time limit (coin-or/Cbc#640).
ftbench asks for no threads (ftbench.planning.milp.cbc_solver). This solves Oobleck's batch split of
two equal pipelines (3 variables) `--solves` times each way, interleaved, with a short time
limit, and prints the solves that ran to it and the median time of the others.

    python benchmarks/cbc_threads.py [--solves 500] [--time-limit 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import pulp

# measured wall time of the default run
DURATION = "15-30 s on 2 shared cores for 500 solves each way; every solve that hangs adds --time-limit"


def split_problem(threads: int | None, time_limit_s: float) -> float:
    """One solve of min Z, Z >= a + b*B_p, B_0 + B_1 = 4, B_0 >= B_1 >= 1; its wall time."""
    from ftbench.planning.milp import cbc_solver, variable

    problem = pulp.LpProblem("split", pulp.LpMinimize)
    z = variable(problem, "slowest", 0, None)
    b = [variable(problem, f"b{p}", 1, 4, pulp.LpInteger) for p in range(2)]
    problem += z
    for p in range(2):
        problem += z >= 0.5 + 1.0 * b[p]
    problem += pulp.lpSum(b) == 4
    problem += b[0] >= b[1]
    solver = cbc_solver(time_limit_s, None)
    if threads is not None:
        solver.optionsDict["threads"] = threads
    started = time.perf_counter()
    problem.solve(solver)
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--solves", type=int, default=500)
    parser.add_argument("--time-limit", type=float, default=2.0)
    args = parser.parse_args(argv)
    print(f"cbc_threads.py: {args.solves} CBC solves each way, time limit {args.time_limit:g} s; typically {DURATION}",
          file=sys.stderr, flush=True)
    started, every = time.perf_counter(), max(1, args.solves // 10)
    times: dict[str, list[float]] = {"no threads (ftbench)": [], "-threads 1": []}
    for i in range(args.solves):
        if i and i % every == 0:
            print(f"  {i}/{args.solves} solves each way  {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        times["no threads (ftbench)"].append(split_problem(None, args.time_limit))
        times["-threads 1"].append(split_problem(1, args.time_limit))
    print(f"{'CBC':<22} {'solves':>6} {'to the limit':>12} {'median s (others)':>18}")
    for name, seconds in times.items():
        hung = [s for s in seconds if s >= 0.9 * args.time_limit]
        rest = [s for s in seconds if s < 0.9 * args.time_limit]
        print(f"{name:<22} {len(seconds):>6} {len(hung):>12} {statistics.median(rest):>18.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
