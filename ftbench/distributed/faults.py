"""Faults a dist job strikes itself: how a process dies, and the chaos settings that make one
die or pause where no failure script says so.

- `die`: this process ends as a crashed machine's would (SIGKILL). A scripted failure's node,
  a rank fenced by the survivors' verdict and every injected death end this way.
- `backend.kill=RANK:ITERATION:OPS|save|recovery`: rank RANK dies after OPS of its ops of
  iteration ITERATION (`dies_among_ops`), in the checkpoint after it (`dies_in_save`), or as
  the recovery performed at it moves state (`dies_in_recovery`), without telling the run loop.
- `backend.stall=RANK:ITERATION:SECONDS`: rank RANK pauses that long as the recovery performed
  at ITERATION starts, beating all along (`stall_here`).

The settings are parsed (`parse_kill`, `parse_stall`) and checked (`check_settings`: a fault
that can never strike is refused) before any process starts. Importing this module does not
import torch.
"""
from __future__ import annotations

import os
import signal
import time

from ftbench.checkpoint_schedule import checkpoint_tiers
from ftbench.distributed.membership import log
from ftbench.distributed.protocol import IN_JOB_ENV, job_nodes
from ftbench.errors import ConfigError
from ftbench.local_sgd import finishes_iteration

SAVE = "save"  # backend.kill=RANK:ITERATION:save: the death strikes in the checkpoint after ITERATION
RECOVERY = "recovery"  # backend.kill=RANK:ITERATION:recovery: in the recovery performed at ITERATION


# -- striking ---------------------------------------------------------------------------------
def die(why: str) -> None:
    """This process dies here, as a crashed machine's would (SIGKILL: nothing runs after). Under
    the user's torchrun its node's agent dies with it, as on a dead machine: an agent that can
    restart its processes (--max-restarts) must not bring a dead node's back."""
    log.info("dies: %s", why)
    for handler in log.handlers:
        handler.flush()
    if os.environ.get(IN_JOB_ENV) and os.environ.get("TORCHELASTIC_RUN_ID"):
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def dies_among_ops(kill, rank: int, iteration: int) -> int | None:
    """backend.kill=RANK:K:OPS names this rank and iteration K: after how many of its ops (of
    the whole iteration) it dies; else None."""
    if kill and kill[:2] == (rank, iteration) and isinstance(kill[2], int):
        return kill[2]
    return None


def dies_in_recovery(kill, rank: int, iteration: int) -> bool:
    """backend.kill=RANK:K:recovery names this rank and the recovery performed at iteration
    K: it dies as the first action that moves or loads state starts (else at the end)."""
    return bool(kill) and kill[2] == RECOVERY and (kill[0], kill[1]) == (rank, iteration)


def dies_in_save(kill, rank: int, iteration: int) -> bool:
    """backend.kill=RANK:K:save names this rank and the checkpoint after iteration K."""
    return bool(kill) and kill[2] == SAVE and (kill[0], kill[1] + 1) == (rank, iteration)


def stall_here(stall, rank: int, iteration: int):
    """backend.stall names this rank and the recovery performed at `iteration`: pause its
    seconds here (once: a straggler, beating all along). The stall still to come: None once it
    paused, else `stall`."""
    if stall and stall[:2] == (rank, iteration):
        seconds = stall[2]
        log.info("pauses %g s (backend.stall)", seconds)
        time.sleep(seconds)
        return None
    return stall


# -- the settings ---------------------------------------------------------------------------
def parse_kill(text) -> tuple[int, int, int | str] | None:
    """backend.kill "RANK:ITERATION:OPS" -> (rank, iteration, ops), "RANK:ITERATION:save" or
    "RANK:ITERATION:recovery" -> (rank, iteration, that word); None if malformed."""
    parts = [p.strip() for p in str(text).split(":")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts[:2]) or \
            not (parts[2].isdigit() or parts[2] in (SAVE, RECOVERY)):
        return None
    return int(parts[0]), int(parts[1]), parts[2] if parts[2] in (SAVE, RECOVERY) else int(parts[2])


def parse_stall(text) -> tuple[int, int, float] | None:
    """backend.stall "RANK:ITERATION:SECONDS" -> (rank, iteration, seconds); None if malformed."""
    parts = [p.strip() for p in str(text).split(":")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts[:2]):
        return None
    try:
        seconds = float(parts[2])
    except ValueError:
        return None
    return (int(parts[0]), int(parts[1]), seconds) if seconds > 0 else None


def check_settings(cfg, strategy) -> None:
    """backend.kill and backend.stall (ftbench.distributed.launch.check_config): well formed,
    and naming a rank of the job and a point the run reaches."""
    kill = cfg.backend.get("kill")
    if kill is not None:
        parsed = parse_kill(kill)
        if parsed is None:
            raise ConfigError("backend.kill", f"'{kill}' is not RANK:ITERATION:OPS, RANK:ITERATION:save or "
                              "RANK:ITERATION:recovery",
                              "give three whole numbers, e.g. backend.kill=3:2:10 (rank 3 dies after 10 ops of "
                              "iteration 2), or backend.kill=3:2:save (rank 3 dies in the checkpoint after "
                              "iteration 2), or backend.kill=3:2:recovery (rank 3 dies in the recovery from a "
                              "failure in iteration 2)")
        if parsed[1] >= cfg.train.iterations:
            raise ConfigError("backend.kill", f"iteration {parsed[1]} is past the run's {cfg.train.iterations} "
                              "iterations", "pick an iteration the run reaches")
        _check_kill_fires(cfg, strategy, *parsed)
    stall = cfg.backend.get("stall")
    if stall is not None:
        parsed = parse_stall(stall)
        if parsed is None:
            raise ConfigError("backend.stall", f"'{stall}' is not RANK:ITERATION:SECONDS",
                              "give two whole numbers and a positive number of seconds, e.g. backend.stall=0:3:12 "
                              "(rank 0 pauses 12 s as the recovery performed at iteration 3 starts)")
        if parsed[1] >= cfg.train.iterations:
            raise ConfigError("backend.stall", f"iteration {parsed[1]} is past the run's {cfg.train.iterations} "
                              "iterations", "pick an iteration the run reaches")
        _check_rank(cfg, "backend.stall", parsed[0])
        _check_recovery_at(cfg, strategy, "backend.stall", parsed[1])


def _check_kill_fires(cfg, strategy, rank: int, iteration: int, where) -> None:
    """backend.kill names a rank of the job and a point the run reaches: a death that can never
    strike is refused, not silently skipped."""
    _check_rank(cfg, "backend.kill", rank)
    if where == RECOVERY:
        _check_recovery_at(cfg, strategy, "backend.kill", iteration)
    elif where == SAVE:
        _check_checkpoint_after(cfg, strategy, iteration)


def _check_rank(cfg, setting: str, rank: int) -> None:
    from ftbench.cluster import Cluster

    cluster = Cluster.from_config(cfg.cluster)
    nodes = job_nodes(cfg, cluster)
    ranks = nodes * cluster.gpus_per_node
    if rank >= ranks:
        raise ConfigError(setting, f"rank {rank} does not exist: the job has {ranks} processes (ranks 0..{ranks - 1}: "
                          f"{nodes} nodes, {cluster.gpus_per_node} per node, standbys and joining nodes included)",
                          f"name a rank below {ranks}")


def _check_recovery_at(cfg, strategy, setting: str, iteration: int) -> None:
    """A recovery is performed at `iteration` only where the failure script has an event then,
    or a failure the iteration before whose untouched groups finish it first (torchft under
    LocalSGD or DiLoCo: Strategy.finishes_local_step); with times rather than iterations, it
    may be anywhere."""
    events = list(cfg.failures.events or ()) if cfg.failures.kind == "scripted" else []
    if any(e.get("iteration") is None for e in events):
        return
    at = {int(e["iteration"]) for e in events}
    if finishes_iteration(strategy, cfg.train.get("data_parallel", "synchronous")):
        at |= {int(e["iteration"]) + 1 for e in events if (e.get("kind") or "fail") == "fail"}
    at = sorted(at)
    if iteration not in at:
        raise ConfigError(setting, f"no recovery is performed at iteration {iteration}: "
                          + (f"the failure script's are at iterations {at}" if at else "the failure script has no event"),
                          "pick the iteration of a recovery: a scripted failure's or join's (torchft under LocalSGD "
                          "or DiLoCo: the one after a failure's)")


def _check_checkpoint_after(cfg, strategy, iteration: int) -> None:
    """A checkpoint follows iteration K when the strategy writes one every `every` iterations
    and K + 1 is a multiple of it (none after the run's last iteration). A tuned interval, or
    a strategy that also saves after each recovery (varuna), may save anywhere."""
    name = cfg.strategy.name
    tiers = checkpoint_tiers(strategy)
    if not tiers:
        raise ConfigError("backend.kill", f"strategy {name} writes no checkpoint, so the death in the checkpoint "
                          f"after iteration {iteration} never strikes", "kill among the ops (RANK:ITERATION:OPS), "
                          "or pick a strategy that checkpoints")
    # a tuned tier saves every `strategy.every` iterations where the strategy fixes it
    everys = {t.every if t.every is not None else strategy.every for t in tiers}
    if None in everys or strategy.checkpoint_after_change:
        return
    everys = sorted(everys)
    saves = sorted({k for every in everys for k in range(every - 1, cfg.train.iterations - 1, every)})
    if iteration not in saves:
        said = " and ".join(str(e) for e in everys)
        raise ConfigError("backend.kill", f"no checkpoint follows iteration {iteration}: strategy {name} saves "
                          f"every {said} iterations, after iterations {saves or 'none of this run'}",
                          "pick one of those iterations")
