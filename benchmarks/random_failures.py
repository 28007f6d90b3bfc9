"""Random failure scripts against every strategy: which runs train the fault-free model.

Each seed draws one small gpt-tiny setup and one scripted list of fails and joins
(ftbench/chaos.py: bursts in one iteration, a node failing while down, rejoins, new node
ids, time-based events); every strategy runs that same case, and on the local backend the
result is compared with fault-free training of the same setup (run once per seed):

  equal          status ok, losses and final weights match fault-free training
  unrecoverable  ended "unrecoverable" with a stated reason
  different      status ok but trained another model than fault-free training: a bug
  crashed        an exception, a config error or "unrecoverable" without a reason: a bug
  oom            ended "oom"

On `sim` there are no losses: "ok" stands for status ok. The table counts per strategy; then
every "different" and "crashed" case is printed with the command that reproduces it.

    python benchmarks/random_failures.py [--cases 200] [--seed 0] [--strategies all]
                                         [--backend local|sim] [--jobs 1] [--timeout 300]

--cases counts runs (seed x strategy); seeds run in order from --seed. `python -m ftbench.chaos
SEED STRATEGY [--backend sim]` replays one case and prints its verdict.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftbench.chaos import STRATEGIES, Result, random_case, run_case  # noqa: E402

BUGS = ("different", "crashed")
# wall time of the default run, extrapolated from measured runs (MORE: what was measured)
DURATION = "about 15 min (quiet) to 1 hour (heavy load) on 2 shared cores, extrapolated: 3-17 s per local run"
MORE = ("measured: 8 local runs took 23-40 s at light load, 135 s under heavy load; --backend sim: 200 "
        "runs in 30 s to 2 min")


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch

    torch.set_num_threads(1)


def _run_seed(seed: int, strategies: list[str], backend: str, timeout_s: float) -> list[Result]:
    """All strategies on one seed's case, in one process: they share the fault-free reference."""
    return [run_case(random_case(seed, s, backend), timeout_s=timeout_s) for s in strategies]


def plan_cases(cases: int, seed: int, strategies: list[str]) -> list[tuple[int, list[str]]]:
    """(seed, strategies) tasks covering `cases` runs, whole seeds first."""
    tasks, left = [], cases
    for i in range(math.ceil(cases / len(strategies))):
        tasks.append((seed + i, strategies[:min(left, len(strategies))]))
        left -= len(tasks[-1][1])
    return tasks


def run_all(tasks, backend: str, jobs: int, timeout_s: float) -> list[Result]:
    from tqdm import tqdm

    results: list[Result] = []
    total = sum(len(s) for _, s in tasks)
    with tqdm(total=total, unit="run", desc=f"random failures ({backend})", file=sys.stderr) as bar:
        def record(batch):
            results.extend(batch)
            bad = sum(r.outcome in BUGS for r in results)
            bar.set_postfix(bugs=bad, refresh=False)
            bar.update(len(batch))

        if jobs <= 1:
            for seed, strategies in tasks:
                for strategy in strategies:
                    record([run_case(random_case(seed, strategy, backend), timeout_s=timeout_s)])
        else:
            with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
                futures = [pool.submit(_run_seed, seed, strategies, backend, timeout_s)
                           for seed, strategies in tasks]
                for future in as_completed(futures):
                    record(future.result())
    order = {s: i for i, s in enumerate(STRATEGIES)}
    return sorted(results, key=lambda r: (r.case.seed, order.get(r.case.strategy, 99)))


def format_table(results: list[Result], backend: str) -> str:
    columns = ["ok" if backend == "sim" else "equal", "unrecoverable", "different", "crashed", "oom"]
    counts: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        counts[r.case.strategy][r.outcome] += 1
    strategies = [s for s in STRATEGIES if s in counts] + sorted(set(counts) - set(STRATEGIES))
    rows = [["strategy", "runs", *columns]]
    for s in strategies:
        rows.append([s, str(sum(counts[s].values())), *(str(counts[s][c]) for c in columns)])
    total = Counter()
    for s in strategies:
        total.update(counts[s])
    rows.append(["all", str(len(results)), *(str(total[c]) for c in columns)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns) + 2)]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([line(rows[0]), line(["-" * w for w in widths]), *map(line, rows[1:])])


def format_reasons(results: list[Result], width: int = 110) -> str:
    """Each distinct reason given for "unrecoverable" (node ids and numbers folded), with counts."""
    import re

    counts: dict[tuple[str, str], int] = Counter()
    for r in results:
        if r.outcome == "unrecoverable":
            counts[(r.case.strategy, re.sub(r"\d+(\.\d+)?", "N", r.detail))] += 1
    return "\n".join(f"{n:4d}  {s:<16} {reason if len(reason) <= width else reason[:width - 3] + '...'}"
                     for (s, reason), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1])))


def format_bugs(results: list[Result]) -> str:
    lines = []
    for r in results:
        if r.outcome not in BUGS:
            continue
        c = r.case
        replay = f"python -m ftbench.chaos {c.seed} {c.strategy}" + (" --backend sim" if c.backend == "sim" else "")
        note = " (time-based events at wall-clock time: may not replay exactly)" if c.wall_clock_events else ""
        lines += [f"# seed {c.seed}, {c.strategy}: {r.outcome}: {r.detail}{note}",
                  f"#   replay: {replay}", c.description, ""]
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"Typical duration: {DURATION}; {MORE}.")
    parser.add_argument("--cases", type=int, default=200, help="runs in all (seed x strategy)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--strategies", default="all", help=f"comma-separated, of {','.join(STRATEGIES)}")
    parser.add_argument("--backend", default="local", choices=("local", "sim"))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as crashed")
    args = parser.parse_args(argv)
    strategies = list(STRATEGIES) if args.strategies == "all" else [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies or args.cases < 1:
        parser.error(f"unknown strategies {unknown}" if unknown else "need at least one strategy and one case")
    os.environ.setdefault("WANDB_MODE", "disabled")
    per_run = "3-17 s per run" if args.backend == "local" else "0.2-0.7 s per run"
    print(f"random_failures.py: {args.cases} runs on {args.backend}, a progress bar on stderr; {per_run} on "
          "2 shared cores, depending on load", file=sys.stderr, flush=True)
    results = run_all(plan_cases(args.cases, args.seed, strategies), args.backend, args.jobs, args.timeout)
    print(f"\n{len(results)} runs on {args.backend}, seeds {args.seed}..{max(r.case.seed for r in results)}\n")
    print(format_table(results, args.backend))
    reasons = format_reasons(results)
    if reasons:
        print(f"\nUnrecoverable runs, by stated reason:\n\n{reasons}")
    bugs = format_bugs(results)
    if bugs:
        print(f"\nDifferent and crashed runs, with the command that reproduces each:\n\n{bugs}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
