"""The parent's side of the second process: start it, join its process group, collect its
restart phases; stop it for good whatever happens.

The clock of a restart starts when the parent starts the process (`subprocess.Popen` of
`sys.executable`); the peer stamps the wall clock (same machine, same clock) after each of
its phases (ftbench.measure.peer), so `imports_s` holds the interpreter's start too.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ftbench.distributed.membership import JOB_PREFIX, STORE_ENV
from ftbench.measure.peer import READY_KEY, RESTART_KEY

PHASES = ("imports", "process_group", "model", "checkpoint", "first_iteration")
JOIN_S = 10.0  # a process dead this long after the kill is waited for no more: it is killed again


class PeerFailed(RuntimeError):
    """The second process stopped early or did not answer in time."""


class Peer:
    """The second process and the store both use: started by `start`, ended by `stop`."""

    def __init__(self, folder: Path, timeout_s: float):
        self.timeout_s = timeout_s
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(JOB_PREFIX, self.server)  # the layout membership.job_store reads
        self.log = folder / "peer.log"
        self.process: subprocess.Popen | None = None
        self.spawned = 0.0

    def start(self, settings: dict) -> None:
        env = dict(os.environ, **{STORE_ENV: f"127.0.0.1:{self.server.port}"})
        with open(self.log, "wb") as log:
            self.spawned = time.time()
            self.process = subprocess.Popen([sys.executable, "-m", "ftbench.measure.peer", json.dumps(settings)],
                                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_for(self, key: str, seconds: float) -> str:
        """The value the peer posts under `key`; PeerFailed if it stops or takes longer."""
        deadline = time.monotonic() + seconds
        while not self.store.check([key]):
            if self.process.poll() is not None:
                raise PeerFailed(f"the second process stopped (exit {self.process.returncode}): {self.tail()}")
            if time.monotonic() > deadline:
                raise PeerFailed(f"the second process posted no {key!r} within {seconds:g} s: {self.tail()}")
            time.sleep(0.01)
        return self.store.get(key).decode()

    def tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:]) or "(no output)"
        except OSError:
            return "(no log)"

    def join_group(self) -> None:
        """Rank 0 of the 2-rank gloo group, once the peer's imports are done."""
        self.wait_for(READY_KEY, self.timeout_s)
        dist.init_process_group("gloo", store=dist.PrefixStore("default/", self.store), rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=self.timeout_s))

    def restart_phases(self) -> dict:
        """Seconds of each phase and the total, from the spawn to the end of the first iteration."""
        stamps = json.loads(self.wait_for(RESTART_KEY, self.timeout_s))
        phases, last = {}, self.spawned
        for name in PHASES:
            phases[f"{name}_s"] = stamps[name] - last
            last = stamps[name]
        phases["total_s"] = last - self.spawned
        return phases

    def kill(self) -> float:
        """SIGKILL the peer (an unannounced death); the perf_counter time of the kill."""
        killed = time.perf_counter()
        self.process.kill()
        return killed

    def stop(self) -> None:
        """Leave nothing behind: the process killed and reaped, the group and the store closed."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            try:
                self.process.wait(timeout=JOIN_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=JOIN_S)
        if dist.is_initialized():
            dist.destroy_process_group()
