"""`python -m ftbench.distributed [overrides]`: one rank of a dist job started by torchrun.

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m ftbench.distributed cluster.pp=4 cluster.dp=2 --run-dir runs/dist-job

Every rank composes the same config from the same overrides (backend=dist is implied).
Rank 0 runs the job as `ftbench` does (metrics.jsonl, summary.json, the printed summary in
the run folder, `--run-dir` or runs/dist/<date>/<time>); the other ranks train and exit.
Exit codes as ftbench's.

With a coordinator (`ftbench backend=dist backend.launcher=torchrun ...` on a machine that
stays up, which hosts the job's store and writes the run folder), every rank is given
`--store HOST:PORT` and the same `--run-dir`: then no rank writes the run folder, the
leader (the lowest live rank) hands the coordinator its metrics lines and results, and a
failure of any node, node 0 included, is survived.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    run_dir = None
    if "--run-dir" in args:
        i = args.index("--run-dir")
        run_dir = args[i + 1]
        del args[i:i + 2]
    store = None
    if "--store" in args:
        i = args.index("--store")
        store = args[i + 1] if i + 1 < len(args) else ""
        del args[i:i + 2]
        if ":" not in store or run_dir is None:
            print("python -m ftbench.distributed: --store takes the coordinator's HOST:PORT and needs the coordinator's "
                  "--run-dir (on storage every node shares)", file=sys.stderr)
            return 2
    if not any(a.startswith("backend=") for a in args):
        args.append("backend=dist")
    from ftbench.cli import EXIT_CODES, compose
    from ftbench.distributed.launch import check_config, job_of
    from ftbench.distributed.protocol import IN_JOB_ENV
    from ftbench.distributed.worker import env_ranks, report_errors, train
    from ftbench.errors import UserError

    cfg = compose(args)
    if cfg.backend.name != "dist":
        print("python -m ftbench.distributed runs backend=dist only", file=sys.stderr)
        return 2
    os.environ[IN_JOB_ENV] = "1"
    run_dir = Path(run_dir or Path("runs") / "dist" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S"))
    if store is not None:
        from ftbench.distributed.membership import STORE_ENV, job_store
        from ftbench.distributed.torchrun_restarts import take_identity

        os.environ[STORE_ENV] = store
        take_identity(job_store(float(cfg.backend.timeout_s)), run_dir)  # a process torchrun started again keeps its rank
    rank = env_ranks()[0]
    if rank == 0 and store is None:
        from ftbench.run import execute

        summary = execute(cfg, run_dir)
        return EXIT_CODES.get(summary["status"], 1)
    try:  # the settings rank 0 refuses, the other ranks refuse too, instead of waiting for it
        from ftbench.context import RunContext
        from ftbench.job import clock_of
        from ftbench.strategies import build_strategy

        ctx = RunContext.from_config(cfg)
        check_config(cfg, build_strategy(cfg.strategy, ctx), clock_of(cfg))
    except UserError as err:
        print(f"rank {rank}: {err}", file=sys.stderr)
        return 2
    job = job_of(cfg, run_dir)
    if store is None:
        job["metrics"] = None  # rank 0 writes the run folder itself
    with report_errors(job["error_dir"]):
        train(job)
    return 0


if __name__ == "__main__":
    from ftbench.distributed.protocol import exit_now

    exit_now(main())  # not through torch's teardown: see exit_now
