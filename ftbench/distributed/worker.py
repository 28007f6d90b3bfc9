"""One process of a dist job: this rank's worker, driven by the shared run loop.

**Who drives.** Every rank runs the same run loop (ftbench.loop.RunLoop) over the same
config, failure script and strategy, so every rank takes the same decisions at the same
points and the backend's collectives line up; the leader (the lowest live rank) writes the
metrics lines and returns the results. Nothing is broadcast per iteration: the loop's inputs are identical everywhere
(seeded data and failures, deterministic planning) and the backend hands every rank the
same loss and the same measured checkpoint costs. Decisions taken from each process's own
wall clock (a measured checkpoint interval, `train.max_hours`) are refused on the wall clock
(ftbench.distributed.launch.check_config): they would need an agreement step. Every
iteration's closing all-reduce also compares the ranks' iteration and plan, so ranks whose
loops disagree stop with an error instead of exchanging the wrong tensors.

`train(job)` is the elastic launcher's entry point (ftbench.distributed.launch) and the body of
`python -m ftbench.distributed` under torchrun.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from ftbench.distributed.protocol import (ERROR_PREFIX, NODE_ENV, RESTARTS_ENV, RESULT_KEY, RESUME_ENV, WORLD_ENV,
                                          exit_now, heartbeats)


def env_ranks() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from the launcher's environment. Under
    ftbench's node agents a rank is its node's first rank plus its local rank, whichever
    agents the elastic rendezvous met (after a restart, only the nodes still up come back, and
    every process keeps its rank)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if os.environ.get(NODE_ENV) is not None:
        rank, world = int(os.environ[NODE_ENV]) * local_world + local, int(os.environ[WORLD_ENV])
    return rank, world, local, local_world


def setup_threads(setting, spec) -> int:
    """This process's torch intra-op threads, before any torch work: backend.threads, or
    ftbench.threads' choice over this process's share of the usable CPUs."""
    from ftbench import threads

    _, _, _, local_world = env_ranks()
    usable = max(1, threads.usable_cpus() // max(1, local_world))
    return threads.apply(threads.choose(setting, spec, usable=usable))


def init_process_group(timeout_s: float, members: list[int] | None = None, incarnation: int = 0):
    """Join the job's default process group: NCCL on a GPU (one per local rank), gloo on CPU.
    Returns (rank, world size, device, process group backend). `members`: the ranks started
    again after the job's `incarnation`-th restart (the default group is theirs alone)."""
    import torch
    import torch.distributed as dist

    from ftbench.distributed.membership import STORE_ENV, job_store

    rank, world, local, _ = env_ranks()
    if torch.cuda.is_available():
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get(STORE_ENV):  # the job's own store, not node 0's agent's: no node's death takes it
        prefix = "default/" if not incarnation else f"default/restart{incarnation}/"
        store = dist.PrefixStore(prefix, job_store(timeout_s))
        place, size = (rank, world) if members is None else (sorted(members).index(rank), len(members))
        dist.init_process_group(backend, store=store, rank=place, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return rank, world, device, backend


@contextmanager
def report_errors(error_dir: str | Path | None):
    """Write an exception leaving the block to `<error_dir>/error-rank<R>.json` (time, type,
    message), so the launcher can name the root cause: the earliest error of the job."""
    try:
        yield
    except BaseException as err:
        if error_dir is not None:
            rank = env_ranks()[0]
            record = {"rank": rank, "time": time.time(), "type": type(err).__name__, "error": str(err),
                      "user_error": _is_user_error(err), "status": getattr(err, "status", None),
                      "traceback": traceback.format_exc()}
            path = Path(error_dir) / f"{ERROR_PREFIX}{rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
        raise


def _is_user_error(err: BaseException) -> bool:
    """Whether the launcher reports `err` as what the user can act on (else: a bug, exit 1)."""
    from ftbench.errors import UserError

    return isinstance(err, UserError) or getattr(err, "user_error", False) is True


class LineWriter:
    """Rank 0's metrics lines, appended and flushed one by one to a file the launcher tails."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def __call__(self, record: dict) -> None:
        from ftbench.metrics import dumps

        self._file.write(dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def start_method() -> str:
    """How the launcher starts processes: fork on CPU (each inherits this process's imports:
    seconds saved per process), spawn when CUDA is there (a forked CUDA context is unusable)."""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def preload() -> None:
    """Import what every rank needs (torch, transformers, the engine) before forking."""
    import ftbench.distributed.backend  # noqa: F401
    import ftbench.gantt  # noqa: F401
    import ftbench.job  # noqa: F401
    import ftbench.strategies  # noqa: F401


_status: int | None = None  # this process's exit status, once rank_main runs in it


def rank_main(entrypoint, *args):
    """What the launchers run in each rank process: `entrypoint(*args)`; at exit the process
    ends through `exit_now`, with 0, or 1 if it raised."""
    global _status
    if _status is None:
        atexit.register(lambda: exit_now(_status))
    _status = 1
    result = entrypoint(*args)
    _status = 0
    return result


def entry(job: dict) -> dict | None:
    """The elastic launcher's entry point (a module-level function: spawn pickles it by name)."""
    with report_errors(job.get("error_dir")):
        return train(job)


def train(job: dict, log=None) -> dict | None:
    """Run this rank's part of the job. `job`: {"cfg": the resolved config (a DictConfig), "run_dir",
    "metrics": the file rank 0 appends its metrics lines to (when `log` is None)}. Rank 0
    returns the results for the summary; other ranks None."""
    from ftbench.context import RunContext
    from ftbench.journal import Journal

    entered = time.time()  # a restarted process: its relaunch ends here (DistBackend.perform_resumed)
    cfg = job["cfg"]
    journal = Journal.load(Path(os.environ[RESUME_ENV])) if os.environ.get(RESUME_ENV) else Journal()
    resume = journal.resume["state"] if journal.resume is not None else None
    # A rank that has not joined the first group by 3/4 of the deadline writes every thread's
    # stack into its log (a rare hang of a rank forked from a long-lived process, not explained
    # yet): the next occurrence says where.
    faulthandler.dump_traceback_later(0.75 * float(cfg.backend.timeout_s), exit=False)
    ctx = RunContext.from_config(cfg)
    ctx.run_dir = Path(job["run_dir"])  # path settings resolve inside it (ftbench.folders)
    threads = setup_threads(cfg.backend.get("threads"), ctx.spec)  # before any torch work
    import torch.distributed as dist

    rank, world, device, pg_backend = init_process_group(float(cfg.backend.timeout_s),
                                                         None if resume is None else resume["ranks"],
                                                         0 if resume is None else resume["restarts"])
    faulthandler.cancel_dump_traceback_later()
    leader_log = _LeaderLog(rank, log, job.get("metrics"))
    heartbeat = alarm = None
    if heartbeats(cfg):  # the survivors of a failure tell the dead by their silent beat
        from ftbench.distributed.membership import Alarm, Heartbeat, job_store, log_to_stderr

        log_to_stderr(rank)  # its membership decisions, kept per node under dist/logs
        heartbeat = Heartbeat(rank, float(cfg.backend.timeout_s)).start()
        alarm = Alarm(job_store(float(cfg.backend.timeout_s)), rank)  # the main thread's: its waits look at it
    try:
        result = _train(cfg, ctx, job, leader_log, rank, world, device, pg_backend, threads, heartbeat, alarm,
                        journal, entered)
        if result is not None and heartbeat is not None:
            # The leader hands its results to whoever hosts the store (the launcher, or the
            # coordinator of a torchrun job): it may not be rank 0, nor on node 0.
            import pickle

            heartbeat.store.set(RESULT_KEY, pickle.dumps(result))
    except BaseException as err:
        if heartbeat is not None and not _signalled(err):  # an error, not a failure: the others stop too
            _post_abort(heartbeat, alarm, rank, err)
        raise
    finally:
        # A failed rank leaves at once: its peers' waits end at their deadlines (or the
        # launcher stops them); tearing the groups down here could block on a dead peer.
        leader_log.close()
        if heartbeat is not None:
            heartbeat.stop()
    if heartbeat is None:
        dist.destroy_process_group()
    return result


def _signalled(err: BaseException) -> bool:
    """Whether this process was stopped from outside (its agent's SIGTERM when a process of its
    node died, the launcher's, Ctrl-C): its node is failing or the job ending, not an error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(err, (SignalException, KeyboardInterrupt, SystemExit))


def _post_abort(heartbeat, alarm, rank: int, err: BaseException) -> None:
    """Say why this rank stops, and raise the alarm: the others' waits on it end now, not at
    their deadlines, and they find it stopped rather than failed."""
    from ftbench.distributed.membership import log, post_abort
    from ftbench.distributed.transport import describe_error

    why = describe_error(err)
    log.info("stops the job: %s", why)
    try:
        post_abort(heartbeat.store, rank, why)
        alarm.post(f"rank {rank} stops the job: {why}")
    except Exception:  # noqa: BLE001 - the store is gone: the job is over anyway
        pass


class _LeaderLog:
    """The run loop's `log` on every rank: only the current leader (the lowest live rank)
    writes, so after the leader's node fails the next one carries on in the same file."""

    def __init__(self, rank: int, log, path):
        self.rank, self.log, self.path = rank, log, path
        self.leader = lambda: 0  # set once the transport exists
        self._writer = None

    def __call__(self, record: dict) -> None:
        if self.leader() != self.rank:
            return
        if self.log is None:
            if not self.path:
                return
            if self._writer is None:
                self._writer = LineWriter(self.path)
            self._writer(record)
        else:
            self.log(record)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _ignore(record: dict) -> None:
    return None


def _train(cfg, ctx, job, log, rank, world, device, pg_backend, threads, heartbeat=None, alarm=None, journal=None,
           entered: float | None = None) -> dict | None:
    import torch

    from ftbench.checkpoint_schedule import keeps_files
    from ftbench.checkpoint import CheckpointStore
    from ftbench.cluster import Cluster
    from ftbench.distributed.backend import DistBackend
    from ftbench.distributed.engine import DistEngine
    from ftbench.distributed.faults import parse_kill, parse_stall
    from ftbench.distributed.transport import DistTransport
    from ftbench.engine.host_memory import run_host_memory
    from ftbench.engine.local import DTYPES
    from ftbench.failures import build_failure_script
    from ftbench.loop import run_loop
    from ftbench.models.data import make_source
    from ftbench.models.gpt import save_pretrained
    from ftbench.gantt import draw_run_gantt
    from ftbench.job import clock_of, totals
    from ftbench.sim.cache import SimCache
    from ftbench.strategies import build_strategy

    run_dir = Path(job["run_dir"])
    clock = clock_of(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    seed = cfg.failures.seed if cfg.failures.seed is not None else cfg.seed
    script = build_failure_script(cfg.failures, cluster.nodes, seed, iterations=ctx.iterations,
                                  max_hours=ctx.max_hours)
    ctx.job_mtbf_s, ctx.failures_per_iteration = script.job_mtbf_s, script.failures_per_iteration  # as run.py
    strategy = build_strategy(cfg.strategy, ctx)
    data = make_source(cfg.train.data, ctx.spec, ctx.seq_len, ctx.seed, cfg.train.data_path)
    dtype = DTYPES[cfg.backend.dtype]
    resume = journal.resume["state"] if journal is not None and journal.resume is not None else None
    transport = DistTransport(rank, world, float(cfg.backend.timeout_s), device, dtype,
                              (ctx.microbatch_size, ctx.seq_len, ctx.spec.hidden), ordered=pg_backend == "nccl",
                              alive=None if resume is None else resume["ranks"],
                              epoch=0 if resume is None else resume["epoch"] + 1)
    log.leader = lambda: transport.leader
    if alarm is not None:
        transport.watch(alarm)  # every wait also ends on the alarm, or a silent heartbeat
    store = None
    if keeps_files(strategy):
        # The leader writes; after a failure every rank reads its state back from the same folder.
        store = CheckpointStore(run_dir / "checkpoints", keep=cfg.strategy.get("keep", 2))
    boundary_log = None
    if strategy.log_dir:  # Swift: each rank logs its own sends into the one shared folder
        from ftbench.engine.boundary_log import BoundaryLog
        from ftbench.folders import inside

        boundary_log = BoundaryLog(inside(run_dir, "strategy.log_dir", strategy.log_dir), job.get("log_dir_new"))
    recover = heartbeat is not None and cfg.backend.get("unannounced", "recover") == "recover"
    engine = DistEngine(ctx, data, cfg.train.lr, cfg.train.weight_decay, dtype, transport, device, store,
                        recompute=cfg.train.get("recompute") or "none", undo=recover,
                        kill=parse_kill(cfg.backend.kill) if cfg.backend.get("kill") is not None else None,
                        boundary_log=boundary_log)
    engine.iteration_work = strategy.iteration_work  # (Swift's logging)
    engine.host_memory = run_host_memory(cfg, strategy, run_dir)  # the leader writes, every rank reads
    timelines = SimCache(ctx.cost_model, iteration_work=strategy.iteration_work)
    membership = None
    if heartbeat is not None:
        from ftbench.distributed.membership import job_store

        membership = job_store(float(cfg.backend.timeout_s))  # the heartbeat thread keeps its own client
    stall = parse_stall(cfg.backend.stall) if cfg.backend.get("stall") is not None else None
    backend = DistBackend(engine, cluster.gpus_per_node, cluster.nodes, membership, recover=recover, stall=stall)
    if os.environ.get(RESTARTS_ENV):  # the launcher starts new processes when these end for a RestartJob
        backend.relaunch = (Path(os.environ[RESTARTS_ENV]), journal)
    if resume is not None:
        backend.resume_state(resume, entered)
    outcome = run_loop(ctx, strategy, cluster, script, backend, timelines, log, None, clock=clock, journal=journal)
    backend.close_log()  # the run is over: the log folder goes (as on local)
    if cfg.report.gantt:
        engine.op_timer.write(run_dir, rank)  # before the gather below, which every rank reaches after it
    state = engine.gather_final_state() if outcome.status == "ok" else None
    if rank != transport.leader:
        return None
    if outcome.first_timeline is not None and cfg.report.gantt:
        from ftbench.engine.op_times import merged

        draw_run_gantt(outcome, timelines, run_dir, cfg, ctx, measured=merged(engine.op_timer.timed, run_dir))
    result = {**totals(outcome, ctx.global_batch, ctx.local_steps), "losses": outcome.losses, "clock": clock, "threads": threads,
              "peak_memory_bytes": [outcome.peak_memory_bytes[w] for w in sorted(outcome.peak_memory_bytes)],
              "final_state": None, "matches_fault_free": None, "processes": world,
              "process_group": pg_backend, "device": str(device), "measured_recoveries": backend.recoveries,
              **backend.log_stats}
    if state is not None:
        state = {k: v.to(torch.device("cpu")) for k, v in state.items()}
        if rank == 0:
            result["final_state"] = str(save_pretrained(state, ctx.spec, run_dir / "final_model"))
        else:  # transformers writes files on torch.distributed rank 0 only: the launcher converts this one
            path = run_dir / "dist" / "final_state.pt"
            torch.save(state, path)
            result["final_state_file"] = str(path)
    return result
