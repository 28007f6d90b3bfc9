"""What the processes of a dist job agree on: the launcher, the node agents, torchrun's
coordinator and every rank process read and write these names, so they live here, below all
of them (every module of the package may import this one; it imports none of theirs but
`membership`'s store variable).

- environment variables the launcher and agents set for the rank processes;
- keys in the job's store;
- exit codes, and how a rank's process ends (`exit_now`);
- the job's layout, which the launcher and every rank decide alike (`per_node`, `heartbeats`).

Importing this module does not import torch.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

# -- environment variables --------------------------------------------------------------
IN_JOB_ENV = "FTBENCH_DIST_IN_JOB"  # set by `python -m ftbench.distributed`: this process is a rank of a torchrun job
NODE_ENV = "FTBENCH_NODE"  # set by ftbench.distributed.agent: the node whose processes these are
WORLD_ENV = "FTBENCH_WORLD"  # and the job's processes, every node's (standbys included)
RESUME_ENV = "FTBENCH_RESUME"  # the restart journal new processes go on from (ftbench.journal)
RESTARTS_ENV = "FTBENCH_RESTARTS"  # where RestartJob writes that journal: set when the launcher restarts processes

# -- keys in the job's store --------------------------------------------------------------
RESULT_KEY = "result"  # the leader's results, pickled
LATEST = "restart/latest"  # the journal of the job's last restart (set by its leader)

# -- files and exit codes -------------------------------------------------------------------
ERROR_PREFIX = "error-rank"  # <error_dir>/error-rank<R>.json: why rank R stopped (ftbench.distributed.worker)
RESTART_EXIT = 75  # a rank's process ended for a RestartJob: the launcher starts the job's processes again
SHUTDOWN_S = 5  # how long an elastic agent waits for its processes to end after SIGTERM before SIGKILL


def shutdown_timeout(elastic_class) -> dict:
    """`shutdown_timeout=SHUTDOWN_S` for torch's LaunchConfig or LocalElasticAgent where the
    installed torch takes it (newer releases; older ones wait their own 30 s): a keyword
    torch does not know would end every launch with a TypeError."""
    return {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in inspect.signature(elastic_class).parameters else {}


def exit_now(status: int):
    """End this rank's process with `status`, its files flushed, without tearing down
    torch.distributed. A gloo group abandoned after a failure may still be connecting or
    closing in a daemon thread (ftbench.distributed.transport), and unloading the library
    under it aborts the process ("terminate called without an active exception", SIGABRT), so
    the launcher would count a survivor that finished its work as failed. Forked ranks end this
    way already (multiprocessing ends them with os._exit); spawned and torchrun ranks now do too."""
    if "wandb" in sys.modules:  # its service process is stopped at exit, which os._exit skips
        try:
            sys.modules["wandb"].teardown()
        except Exception:  # noqa: BLE001 - nothing to stop
            pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed
            pass
    os._exit(status)


# -- the job's layout -----------------------------------------------------------------------
def per_node(cfg) -> bool:
    """Whether the job runs one elastic agent per node, with heartbeats (a death ends only its
    own node's processes): when failures are scripted or a process is set to die (backend.kill)."""
    return cfg.failures.kind != "none" or cfg.backend.get("kill") is not None


def heartbeats(cfg) -> bool:
    """Whether this rank beats and watches its peers' beats: on the per-node layout, and in
    every job whose store `ftbench` hosts (a torchrun job with a coordinator)."""
    from ftbench.distributed.membership import STORE_ENV

    return per_node(cfg) or bool(os.environ.get(STORE_ENV))


def job_nodes(cfg, cluster) -> int:
    """Nodes whose processes the job starts: the cluster's, its standbys, and one more per
    join the failure script names (a returning node's processes stand by until it joins)."""
    joins = 0
    if cfg.failures.kind == "scripted":
        joins = sum(1 for e in cfg.failures.events or () if str(e.get("kind", "fail")) == "join")
    return cluster.nodes + cluster.spares + joins
