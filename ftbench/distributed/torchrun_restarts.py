"""Restarts of the job's processes under the user's torchrun (`backend.launcher=torchrun`).

Run with `--max-restarts=K` and an elastic node count (`--nnodes=1:N`), torchrun's elastic
agent on each node starts that node's processes again when they end with an error, after a
new rendezvous of the agents still up. A RestartJob ends every process of the job that way
(ftbench.distributed.backend: the leader writes the run loop's journal first), so the agents
start new ones, which must take the ranks their predecessors had: torchrun numbers them anew
in each rendezvous, and a node that died is gone. Each process is known in the job's store by
its host, its agent's process id (an agent lives across its workers' restarts) and its local
rank: the first time it meets the store it notes its rank there, and a process started again
in its place reads it back, with the journal to go on from. A node's death kills its agent
too (ftbench.distributed.faults.die), as a machine's death would, so no agent starts the
processes of a dead node again.
"""
from __future__ import annotations

import os
import socket

from ftbench.distributed.protocol import LATEST, RESTARTS_ENV, RESUME_ENV


def identity_key() -> str:
    return f"identity/{socket.gethostname()}/{os.getppid()}/{os.environ.get('LOCAL_RANK', '0')}"


def take_identity(store, run_dir) -> bool:
    """This process's rank and the job's size, kept across torchrun's restarts (RANK and
    WORLD_SIZE set from the store for a process started again); whether it was restarted. With
    restarts left in its agent (TORCHELASTIC_MAX_RESTARTS), RestartJob may end the processes
    (RESTARTS_ENV); a restarted process goes on from the last restart's journal (RESUME_ENV)."""
    from pathlib import Path

    key = identity_key()
    restarted = bool(store.check([key]))
    if restarted:
        os.environ["RANK"] = store.get(key).decode()
        os.environ["WORLD_SIZE"] = store.get("world").decode()
        if not store.check([LATEST]):
            raise RuntimeError("this process was started again by torchrun, but the job wrote no restart journal: "
                               "torchrun restarted it after a crash, which ftbench cannot go on from")
        os.environ[RESUME_ENV] = store.get(LATEST).decode()
    else:
        store.set(key, os.environ.get("RANK", "0"))
        store.set("world", os.environ.get("WORLD_SIZE", "1"))
    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if left > 0:
        os.environ[RESTARTS_ENV] = str(Path(run_dir) / "dist" / "restart")
    else:
        os.environ.pop(RESTARTS_ENV, None)
    return restarted
