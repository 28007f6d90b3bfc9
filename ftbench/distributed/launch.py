"""Starting a dist job: `ftbench backend=dist ...` launches one process per worker of the plan
through PyTorch's elastic launcher (torch.distributed.launcher.api.elastic_launch: c10d
rendezvous on 127.0.0.1, a free port, no restarts), and turns what comes back into the run's
results; `python -m ftbench.distributed ...` under torchrun runs the same job across nodes.

- Rank 0's metrics lines go to `<run>/dist/rank0-metrics.jsonl`; this process tails that file
  into the run's metrics.jsonl (and W&B) while the job runs.
- Each rank's stdout and stderr land under `<run>/dist/logs/`.
- A rank that fails writes `<run>/dist/error-rank<R>.json`; the earliest one is the root
  cause the run reports (a peer that did not answer names the peer and the op).
- The job has an overall deadline (`backend.deadline_s`; default: `backend.timeout_s` x
  (iterations + 10)); past it the launcher stops every process.

Importing this module does not import torch (config errors stay fast).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

from ftbench.distributed.faults import check_settings
from ftbench.distributed.protocol import (ERROR_PREFIX, IN_JOB_ENV, LATEST, RESTARTS_ENV, RESULT_KEY, RESUME_ENV,
                                          WORLD_ENV, job_nodes, per_node, shutdown_timeout)
from ftbench.errors import ConfigError
from ftbench.folders import inside

HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the elastic launcher installs handlers for these
STOPPED = ("SignalException", "KeyboardInterrupt", "SystemExit")  # a rank stopped from outside: no bug of its own


def timeout_s(cfg) -> float:
    return float(cfg.backend.get("timeout_s") or 60.0)


def deadline_s(cfg) -> float:
    deadline = cfg.backend.get("deadline_s")
    if deadline is not None:
        return float(deadline)
    return timeout_s(cfg) * (cfg.train.iterations + 10)


def check_config(cfg, strategy, clock: str) -> None:
    """What backend=dist runs: decisions every rank takes alike (ftbench.distributed.worker), so
    failures scripted by iteration (or by time on the modelled clock); a join runs on a
    standby node's processes (job_nodes starts one per join)."""
    if cfg.failures.kind not in ("none", "scripted"):
        raise ConfigError("failures", f"failures={cfg.failures.kind} on backend=dist is not implemented yet: every "
                          "rank must see each failure at the same iteration", "use failures=scripted (or none)")
    if cfg.failures.kind == "scripted":
        timed = [e for e in cfg.failures.events or () if e.get("time_s") is not None]
        if timed and clock == "wall":
            raise ConfigError("failures.events", "a failure at time_s on backend=dist's wall clock would strike each "
                              "rank at its own point", "give the failure an iteration, or use backend.clock=model")
    t = cfg.backend.get("timeout_s")
    if t is None or not t > 0:
        raise ConfigError("backend.timeout_s", f"must be a positive number of seconds, got {t}",
                          "set backend.timeout_s=60 (or another deadline per wait)")
    launcher = cfg.backend.get("launcher", "self")
    if launcher not in LAUNCHERS:
        raise ConfigError("backend.launcher", f"unknown launcher '{launcher}'", f"choose one of {', '.join(LAUNCHERS)}")
    port = cfg.backend.get("store_port", 29500)
    if launcher == "torchrun" and not (isinstance(port, int) and 0 < port < 65536):
        raise ConfigError("backend.store_port", f"must be a TCP port number, got {port}",
                          "set backend.store_port=29500 (the port torchrun's --rdzv-endpoint names)")
    mode = cfg.backend.get("unannounced", "recover")
    if mode not in UNANNOUNCED:
        raise ConfigError("backend.unannounced", f"unknown mode '{mode}'", f"choose one of {', '.join(UNANNOUNCED)}")
    check_settings(cfg, strategy)  # backend.kill and backend.stall
    d = cfg.backend.get("deadline_s")
    if d is not None and not d > 0:
        raise ConfigError("backend.deadline_s", f"must be a positive number of seconds or null, got {d}",
                          "set backend.deadline_s=3600, or null for timeout_s x (iterations + 10)")
    if clock == "wall":
        why = ("every rank runs the run loop and must take the same decisions, but each would take this one from "
               "its own wall clock")
        if cfg.train.max_hours is not None:
            raise ConfigError("train.max_hours", f"a wall-clock time limit on backend=dist is not implemented yet: "
                              f"{why}", "drop train.max_hours, or use backend.clock=model")


def refuse_dist_settings(cfg) -> None:
    """backend.kill and backend.stall on a backend other than dist, which would ignore them."""
    for setting in ("kill", "stall"):
        if cfg.backend.get(setting) is not None:
            raise ConfigError(f"backend.{setting}", f"backend={cfg.backend.name} has no processes to "
                              f"{'kill' if setting == 'kill' else 'pause'}: only backend=dist acts on it",
                              f"drop backend.{setting}, or use backend=dist")


UNANNOUNCED = ("recover", "stop")  # backend.unannounced
LAUNCHERS = ("self", "torchrun")  # backend.launcher


def run_dist(cfg, ctx, strategy, cluster, script, run_dir: Path, log, clock: str) -> dict:
    """The dist backend's part of ftbench.run._run: the job's results for the summary."""
    check_config(cfg, strategy, clock)
    job = job_of(cfg, run_dir)
    if strategy.log_dir:  # Swift: checked here, before any rank starts; removed at the end only if new
        job["log_dir_new"] = not inside(run_dir, "strategy.log_dir", strategy.log_dir).exists()
    if os.environ.get(IN_JOB_ENV):  # rank 0 of a torchrun job (python -m ftbench.distributed): train here
        from ftbench.distributed.worker import train

        result = train(job, log=log)
    else:
        logged = LoggedTotals(log, ctx.global_batch)
        try:
            result = _launch(cfg, strategy, cluster, job, logged)
        except BaseException as err:
            from ftbench.distributed.transport import DistError

            if isinstance(err, DistError):
                # The job stopped without results: the summary keeps what its metrics lines
                # recorded (issue 36: one said `failures: 0` after a logged failure).
                log({"event": "error", "status": err.status, "error": str(err)})
                return {**logged.totals(), "status": err.status, "error": str(err)}
            err.outcome = logged.outcome()  # a bug, or Ctrl-C: ftbench.run records it with these totals
            raise
    if result.get("final_state_file"):  # the leader was not rank 0 (its node failed): write the model here
        import torch

        from ftbench.models.gpt import save_pretrained

        path = Path(result.pop("final_state_file"))
        result["final_state"] = str(save_pretrained(torch.load(path), ctx.spec, Path(run_dir) / "final_model"))
        path.unlink()
    if result.get("status") == "ok" and cfg.report.check_fault_free and strategy.name != "none":
        try:
            _check_fault_free(cfg, ctx, result, log)
        except BaseException as err:  # Ctrl-C during the check: the summary keeps the run's results
            err.results = {k: v for k, v in result.items() if k not in ("status", "error")}
            raise
    log({"event": "end", "status": result.get("status"), "iterations": result.get("iterations"),
         "time_s": result.get("time_s")})
    return result


def _launch(cfg, strategy, cluster, job: dict, log) -> dict:
    """Start the job's processes the way the settings ask; the leader's results."""
    if cfg.backend.get("launcher", "self") == "torchrun":
        # torchrun starts the processes on the nodes; this process hosts the job's store and
        # writes the run folder, so that no node's death ends the job.
        return coordinate(job, job_nodes(cfg, cluster), cluster.gpus_per_node, log, timeout_s(cfg), deadline_s(cfg),
                          int(cfg.backend.store_port))
    if per_node(cfg):
        # One agent per node, standbys included, so a node's death ends only its own processes.
        nodes = job_nodes(cfg, cluster)
        return launch_nodes(job, nodes, cluster.gpus_per_node, log, timeout_s(cfg), deadline_s(cfg))
    processes = len(strategy.plan(cluster.view()).workers)
    return launch_training(job, processes, log, timeout_s(cfg), deadline_s(cfg))


class LoggedTotals:
    """The run's `log`, keeping the totals of what it forwards (the leader's metrics lines):
    a job that stops without results is recorded with what it did, as the run loop counts it
    (iterations kept, failures, recoveries, time)."""

    def __init__(self, log, global_batch: int):
        self.log, self.global_batch = log, global_batch
        self.iterations = 0  # where the run loop is: the next iteration's index
        self.time_s = 0.0
        self.failures = 0
        self.checkpoints = 0
        self.recoveries: list[dict] = []
        self.losses: dict[int, float] = {}

    def __call__(self, record: dict) -> None:
        event = record.get("event")
        if event == "iteration":
            self.iterations = record["iteration"] + 1
            self.losses[record["iteration"]] = record.get("loss")
        elif event == "recovery":
            self.iterations = record.get("restored_iteration", self.iterations)
            self.recoveries.append({k: v for k, v in record.items() if k != "event"})
        elif event == "fail":
            self.failures += 1
        elif event == "checkpoint":
            self.checkpoints += 1
        if isinstance(record.get("time_s"), (int, float)):
            self.time_s = float(record["time_s"])
        self.log(record)

    def totals(self) -> dict:
        """The summary's totals from what was logged (no plan segments or ETTR: not logged)."""
        samples = self.iterations * self.global_batch
        return {"iterations": self.iterations, "samples": samples, "time_s": self.time_s,
                "throughput": samples / self.time_s if self.time_s > 0 else 0.0, "failures": self.failures,
                "recoveries": self.recoveries, "checkpoints": self.checkpoints,
                "lost_iterations": sum(r.get("lost_iterations", 0) for r in self.recoveries),
                "losses": [self.losses[i] for i in sorted(self.losses) if i < self.iterations]}

    def outcome(self):
        """The same as ftbench.run reads it from an exception's `outcome`."""
        from ftbench.loop import LoopOutcome

        totals = self.totals()
        return LoopOutcome(status="error", iterations=self.iterations, time_s=self.time_s, failures=self.failures,
                           recoveries=self.recoveries, losses=totals["losses"], checkpoints=self.checkpoints,
                           global_batch=self.global_batch)


def job_of(cfg, run_dir) -> dict:
    """What every rank gets: the resolved config, the run folder, where rank 0's metrics lines
    and the ranks' errors go."""
    import copy

    from omegaconf import OmegaConf

    folder = Path(run_dir) / "dist"
    resolved = copy.deepcopy(cfg)  # a DictConfig pickles with its schema types
    OmegaConf.resolve(resolved)
    return {"cfg": resolved, "run_dir": str(run_dir),
            "metrics": str(folder / "rank0-metrics.jsonl"), "error_dir": str(folder)}


def _check_fault_free(cfg, ctx, result: dict, log) -> None:
    """Compare with fault-free training of the same setup on the local backend (float32:
    against a measured noise floor, ftbench/fault_free.py)."""
    from transformers.utils import logging as hf_logging

    from ftbench.equivalence import divergence_error, load_state
    from ftbench.fault_free import check

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading the saved model is no progress to show
    try:
        state = load_state(result["final_state"])
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    result.update(check(cfg, ctx, result["losses"], state, ledger=result.get("ledger")))
    difference = result["fault_free_difference"]
    log({"event": "equivalence", "matches_fault_free": difference is None, "difference": difference,
         "difference_max": result["fault_free_difference_max"], "noise_floor": result["fault_free_noise_floor"]})
    if difference is not None:
        result.update(status="diverged", error=divergence_error(difference, cfg.backend.dtype, result.get("plan_segments")))


def launch_training(job: dict, processes: int, log, timeout: float, deadline: float) -> dict:
    from ftbench.distributed import worker

    start_method = worker.start_method()
    if start_method == "fork":
        worker.preload()  # imported once here, inherited by every process instead of imported by each
    folder = Path(job["error_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    tail = _Tail(Path(job["metrics"]), log)
    tail.start()
    try:
        results = launch(worker.entry, (job,), processes, timeout, deadline, folder, start_method)
    finally:
        tail.stop()
    return results[0]


def launch_nodes(job: dict, nodes: int, gpus_per_node: int, log, timeout: float, deadline: float) -> dict:
    """The job as `nodes` elastic agents on this machine (ftbench.distributed.agent), one per node,
    meeting in a store this process hosts; the leader's results. Past `deadline` every agent
    and its processes are stopped.

    A RestartJob ends every process of the job (ftbench.distributed.backend: the leader first
    writes the run loop's journal, ftbench.journal); when every agent has exited and the
    journal of that restart verifies, the job starts again: one new agent per node still up,
    whose processes keep their ranks and go on from the journal."""
    import pickle

    from ftbench.distributed.membership import STORE_ENV
    from ftbench.journal import Journal, JournalError

    folder = _fresh_folder(job)
    job_path = folder / "job.pkl"
    job_path.write_bytes(pickle.dumps(job))
    restarts = folder / "restart"
    for stale in restarts.glob("journal-*") if restarts.exists() else ():
        stale.unlink()  # an earlier attempt's
    port = free_port()
    store = host_store(port, timeout)
    env = dict(os.environ, **{STORE_ENV: f"127.0.0.1:{port}", WORLD_ENV: str(nodes * gpus_per_node),
                              RESTARTS_ENV: str(restarts)})
    tail = _Tail(Path(job["metrics"]), log)
    tail.start()
    agents: list = []
    started = time.monotonic()
    up, incarnation = list(range(nodes)), 0
    try:
        while True:
            agents = _start_agents(job_path, up, gpus_per_node, port, folder, env, incarnation)
            try:
                _wait_for_agents(agents, _job_view(store), timeout, deadline, started, folder)
            finally:
                _stop(agents)
            journal = restarts / f"journal-{incarnation + 1}"
            if _job_view(store).check([RESULT_KEY]) or not journal.exists() or first_error(folder) is not None:
                break
            try:
                ranks = Journal.load(journal).resume["state"]["ranks"]
            except JournalError as err:
                from ftbench.distributed.transport import DistError

                raise DistError(f"the job's processes ended for a restart, but {err}") from None
            incarnation += 1
            up = sorted({r // gpus_per_node for r in ranks})
            _job_view(store).set(f"restart/{incarnation}/launched", repr(time.time()))  # the restart's phases split here
            env[RESUME_ENV] = str(journal)
            with open(folder / "launcher.log", "a") as note:
                note.write(f"restart {incarnation}: the processes of nodes {up} start again from {journal}\n")
    finally:
        _stop(agents)
        tail.stop()
    try:
        return _result(store, folder, started, f"agent logs in {folder}", _failed_agents(agents, folder, up, incarnation))
    finally:
        del store


def _start_agents(job_path: Path, nodes: list[int], gpus_per_node: int, port: int, folder: Path, env: dict,
                  incarnation: int) -> list:
    """One elastic agent per node in `nodes`, meeting in a rendezvous of their own."""
    import subprocess
    import sys

    run_id = f"ftbench-{uuid.uuid4().hex[:8]}"
    agents = []
    for node in nodes:
        name = f"agent{node}.log" if not incarnation else f"agent{node}-restart{incarnation}.log"
        with open(folder / name, "wb") as out:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "ftbench.distributed.agent", str(job_path), str(node), str(len(nodes)),
                 str(gpus_per_node), f"127.0.0.1:{port}", run_id, str(incarnation)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env))
    return agents


def _stop(agents) -> None:
    """Kill what is left of these agents and their processes (they share the agent's session)."""
    for agent in agents:
        if agent.poll() is None:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            agent.wait()


def _wait_for_agents(agents, view, timeout: float, deadline: float, started: float, folder: Path) -> None:
    """Until every agent has exited, or `timeout` seconds after the leader posted its results
    (the ranks leave within seconds then; one that hangs must not turn a finished job into one
    past its deadline), or past `deadline` without results (DistError)."""
    from ftbench.distributed.transport import DistError

    posted = None  # when the results were first seen
    while any(agent.poll() is None for agent in agents):
        now = time.monotonic()
        if posted is None and view.check([RESULT_KEY]):
            posted = now
        if posted is not None and now - posted > timeout:
            return
        if now - started > deadline:
            if posted is not None:
                return
            raise DistError(f"the dist job ran past its deadline of {deadline:g} s (backend.deadline_s) and was "
                            f"stopped; rank logs in {folder / 'logs'}")
        time.sleep(0.1)


def coordinate(job: dict, nodes: int, gpus_per_node: int, log, timeout: float, deadline: float, port: int) -> dict:
    """backend.launcher=torchrun: host the job's store on `port` (torchrun's rendezvous and the
    ranks' membership both meet there), forward the leader's metrics lines and wait for its
    results; the ranks are started elsewhere (`torchrun ... -m ftbench.distributed --store HOST:PORT`).
    Ends when the leader posts its results, when every rank has stopped beating after an
    error, or past `deadline`."""
    from ftbench.distributed.membership import STALE_S, beats
    from ftbench.distributed.transport import DistError

    folder = _fresh_folder(job)
    store = host_store(port, timeout)
    view = _job_view(store)
    ranks = range(nodes * gpus_per_node)
    host = socket.getfqdn()
    print(f"ftbench: hosting the job's store on {host}:{port}; start torchrun on every node with "
          f"--nnodes={nodes} --nproc-per-node={gpus_per_node} --rdzv-backend=c10d "
          f"--rdzv-endpoint={host}:{port} -m ftbench.distributed --store {host}:{port} --run-dir {job['run_dir']} "
          "and this run's overrides", flush=True)
    tail = _Tail(Path(job["metrics"]), log)
    tail.start()
    started = time.monotonic()
    last = beats(view, ranks)
    moved = started  # when some rank's beat last moved
    restart = None  # the journal of the job's last restart (torchrun starts the processes again: no beat meanwhile)
    try:
        while not view.check([RESULT_KEY]):
            now = time.monotonic()
            counts = beats(view, ranks)
            if counts != last:
                last, moved = counts, now
            if view.check([LATEST]) and view.get(LATEST) != restart:
                restart, moved = view.get(LATEST), now + timeout  # the new processes have timeout_s to beat
            if now - moved > 2 * STALE_S and (any(last.values()) or first_error(folder) is not None):
                break  # every rank that started has stopped, and none posted results
            if now - started > deadline:
                raise DistError(f"the dist job ran past its deadline of {deadline:g} s (backend.deadline_s) "
                                f"without results; errors in {folder}")
            time.sleep(0.2)
        # The ranks leave one by one after the results: keep the store up until they have.
        quiet_since, last = time.monotonic(), beats(view, ranks)
        end = time.monotonic() + timeout
        while time.monotonic() - quiet_since < 2 * STALE_S and time.monotonic() < end:
            time.sleep(0.2)
            counts = beats(view, ranks)
            if counts != last:
                last, quiet_since = counts, time.monotonic()
    finally:
        tail.stop()
    try:
        return _result(store, folder, started, f"rank logs on the nodes, errors in {folder}")
    finally:
        del store


def host_store(port: int, timeout: float):
    """The job's TCPStore, served from this process on `port` (every interface)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                    timeout=timedelta(seconds=timeout))


def _job_view(store):
    """The job's keys in a store `ftbench` hosts (ftbench.distributed.membership.job_store's prefix)."""
    from torch.distributed import PrefixStore

    from ftbench.distributed.membership import JOB_PREFIX

    return PrefixStore(JOB_PREFIX, store)


def _fresh_folder(job: dict) -> Path:
    """The job's dist folder, without the errors of an earlier attempt."""
    folder = Path(job["error_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{ERROR_PREFIX}*.json"):
        stale.unlink()
    return folder


def _failed_agents(agents, folder: Path, nodes: list[int] | None = None, incarnation: int = 0) -> str:
    """Which node agents exited with an error, and the last line each wrote (an agent that
    failed before its processes started, e.g. on an import, leaves no rank error record)."""
    failed = []
    for node, agent in zip(nodes if nodes is not None else range(len(agents)), agents):
        if agent.returncode:
            name = f"agent{node}.log" if not incarnation else f"agent{node}-restart{incarnation}.log"
            try:
                lines = (folder / name).read_text(errors="replace").strip().splitlines()
            except OSError:
                lines = []
            failed.append(f"node {node}'s agent exited with {agent.returncode}" + (f": {lines[-1]}" if lines else ""))
    return "; ".join(failed)


def _result(store, folder: Path, started: float, where: str, agents: str = "") -> dict:
    """The results the leader posted in the store, or the job's root-cause error (`agents`:
    what the node agents said, when no rank left an error record)."""
    import pickle

    from ftbench.distributed.transport import DistError

    prefixed = _job_view(store)
    if prefixed.check([RESULT_KEY]):
        return pickle.loads(prefixed.get(RESULT_KEY))
    root = first_error(folder)
    if root is not None:
        raise _rank_error(root, folder, where)
    raise DistError(f"the dist job ended without results after {time.monotonic() - started:.1f} s"
                    + (f": {agents}" if agents else "") + f" ({where})")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entrypoint, args: tuple, processes: int, timeout: float, deadline: float, folder: Path,
           start_method: str = "spawn") -> dict:
    """Run `entrypoint(*args)` in `processes` processes on this machine under PyTorch's elastic
    launcher; {rank: return value}. A failure raises DistError with the earliest rank error
    found in `folder` (ftbench.distributed.worker.report_errors); past `deadline` seconds every
    process is stopped and DistError says so."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ftbench.distributed.transport import DistError
    from ftbench.distributed.worker import rank_main

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{ERROR_PREFIX}*.json"):
        stale.unlink()
    run_id = f"ftbench-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", local_addr="127.0.0.1",
        rdzv_configs={"join_timeout": int(max(timeout, 1)), "last_call_timeout": 1},
        max_restarts=0, monitor_interval=0.05, start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(folder / "logs"), redirects=Std.ALL),
        **shutdown_timeout(LaunchConfig))
    main = threading.current_thread() is threading.main_thread()
    saved = {name: signal.getsignal(getattr(signal, name)) for name in HANDLED_SIGNALS} if main else {}
    pids = folder / "pids"  # each rank's process id, written as it starts (noting_pid)
    if pids.exists():
        for stale in pids.iterdir():
            stale.unlink()
    watchdog = _Deadline(deadline, pids)
    started = time.monotonic()
    watchdog.start()
    try:
        results = elastic_launch(config, rank_main)(noting_pid, str(pids), entrypoint, *args)
    except BaseException as err:
        if watchdog.finish():
            raise DistError(f"the dist job ran past its deadline of {deadline:g} s (backend.deadline_s) and was "
                            f"stopped; rank logs in {folder / 'logs'}") from None
        root = first_error(folder)
        if root is not None:
            raise _rank_error(root, folder, f"rank logs in {folder / 'logs'}") from None
        if isinstance(err, Exception):
            raise DistError(f"the dist job failed after {time.monotonic() - started:.1f} s: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__} "
                            f"(rank logs in {folder / 'logs'})") from None
        raise
    finally:
        watchdog.finish()
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
    if watchdog.expired:  # the ranks were stopped as they returned: the job still ran past its deadline
        raise DistError(f"the dist job ran past its deadline of {deadline:g} s (backend.deadline_s) and was "
                        f"stopped; rank logs in {folder / 'logs'}")
    return results


def noting_pid(pids: str, entrypoint, *args):
    """A rank of `launch`: note this process's id in `pids` (for the deadline), then run."""
    rank = os.environ.get("RANK", "0")
    Path(pids).mkdir(parents=True, exist_ok=True)
    (Path(pids) / f"rank{rank}").write_text(str(os.getpid()))
    return entrypoint(*args)


class _Deadline:
    """`launch`'s deadline, kept by a thread of its own that sends no signal to the caller:
    past `deadline` seconds it marks the job expired and SIGKILLs every rank process that
    noted its id in `pids` (again every 0.2 s, for a rank that starts late), until the caller's
    `finish`. The elastic agent then finds its processes dead and returns a failure, whatever
    the caller's thread was doing (issue 36: an interrupt_main signal raised inside logging's
    lock release was swallowed, and a job past its deadline read as a success)."""

    def __init__(self, deadline: float, pids: Path):
        self.deadline, self.pids = deadline, pids
        self.expired = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftbench-dist-deadline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        if self._done.wait(self.deadline):
            return
        with self._lock:
            if self._done.is_set():
                return
            self.expired = True
        while True:
            for path in self.pids.glob("rank*") if self.pids.exists() else ():
                try:
                    pid = int(path.read_text())
                except (OSError, ValueError):
                    continue  # being written
                if _child_of_this_process(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if self._done.wait(0.2):
                return

    def finish(self) -> bool:
        """The caller is done with the job: stop watching. Whether the deadline expired."""
        with self._lock:
            self._done.set()
        return self.expired


def _child_of_this_process(pid: int) -> bool:
    """Whether `pid` is a live child of this process (a rank), not a process that reused the id."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()  # no /proc to ask: trust the note
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[1]) == os.getpid()


def _rank_error(root: dict, folder: Path, where: str) -> Exception:
    """The job's root-cause error (`first_error`) as the launcher raises it: what the user can
    act on (a setting, a peer that did not answer, a result such as `unrecoverable`) as
    DistError, with the rank's status; any other exception of a rank is a bug, RankFailed (not
    a user error: the run's status is `error` and the command exits 1, not a bad setting's 2)."""
    from ftbench.distributed.transport import DistError, RankFailed

    rank = root["rank"]
    message = f"rank {rank} failed: {root['error']} ({where})"
    if root.get("user_error") is False and root.get("type") not in STOPPED:
        return RankFailed(f"rank {rank} failed with {root.get('type')}: {root['error']} (a bug, not a setting: its "
                          f"traceback in {Path(folder) / f'{ERROR_PREFIX}{rank}.json'}; {where})")
    return DistError(message, root.get("status"))


def first_error(folder: Path) -> dict | None:
    """The earliest error a rank reported in `folder`: the root cause (the others follow from it)."""
    records = []
    for path in Path(folder).glob(f"{ERROR_PREFIX}*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"]) if records else None


class _Tail:
    """Forwards the complete lines appended to `path` to `log`, while a job runs."""

    def __init__(self, path: Path, log):
        self.path, self.log = path, log
        self.offset = 0
        self.buffer = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftbench-dist-metrics", daemon=True)

    def start(self) -> None:
        if self.path.exists():
            self.offset = self.path.stat().st_size  # lines of an earlier attempt were forwarded then
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.drain()

    def drain(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self.log(json.loads(line))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.drain()  # what came after the last poll
