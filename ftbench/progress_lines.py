"""Progress as plain lines, for a console that is not a terminal (nohup, SLURM, CI logs).

A progress bar redraws one line in place, which a log file cannot show, so there the run
prints a line every `report.progress_every_s` seconds instead: iteration, throughput,
failures and recoveries so far. The state comes from the run's own metrics records (the same
on every backend, dist included), and a line is printed by a daemon thread that only reads
it, so a phase without records (a planner planning ahead) still shows that the run is alive.
"""
from __future__ import annotations

import sys
import threading
import time


class ProgressLines:
    def __init__(self, every_s: float, iterations: int, echo=print, clock=time.monotonic):
        self.every_s, self.iterations, self.echo, self.clock = float(every_s), iterations, echo, clock
        self.started = clock()
        self.iteration = 0
        self.samples = 0
        self.time_s = 0.0
        self.failures = 0
        self.recoveries = 0
        self.joins = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_console(cls, report, iterations: int, echo=print) -> "ProgressLines | None":
        """Lines only where a progress bar would not show: progress on, stderr not a terminal."""
        every = report.get("progress_every_s")
        if not report.get("progress", True) or every is None or sys.stderr.isatty():
            return None
        return cls(every, iterations, echo)

    def observe(self, record: dict) -> None:
        event = record.get("event")
        if event in ("iteration", "iterations"):  # one, or the simulator's closed-form jump over several
            self.iteration = int(record.get("iteration", record.get("last", self.iteration - 1))) + 1
            self.samples = record.get("samples", self.samples)
            self.time_s = record.get("time_s", self.time_s)
        elif event == "fail":
            self.failures += 1
        elif event == "join":
            self.joins += 1
        elif event == "recovery":
            self.recoveries += 1

    def line(self) -> str:
        elapsed = self.clock() - self.started
        if self.iteration == 0 and not self.failures:
            return f"ftbench: {elapsed:.0f} s, starting (no iteration done yet)"
        throughput = self.samples / self.time_s if self.time_s else 0.0
        return (f"ftbench: {elapsed:.0f} s, iteration {self.iteration}/{self.iterations}, "
                f"{throughput:.4g} samples/s, failures {self.failures}, recoveries {self.recoveries}"
                + (f", joins {self.joins}" if self.joins else ""))

    def start(self) -> "ProgressLines":
        self._thread = threading.Thread(target=self._tick, name="ftbench-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            self.echo(self.line())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
