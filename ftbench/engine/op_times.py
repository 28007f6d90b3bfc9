"""What really ran: the start and end of every compute op in the first complete iteration of
each plan a real run trains (`local`, `dist`), on the machine's monotonic clock (one clock for
every process on a host), for gantt.png beside the cost model's picture of the same plan.

Timing an op is two clock reads; the records stay in memory while the run trains and are
written after the run loop (`dist`: one file per rank in the run folder, read by the leader)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ftbench.schedule import OPT

PLANS_TIMED = 3  # the first plan and the first two a recovery changes to: what gantt.png draws
FOLDER = "op-times"  # inside the run folder (dist): rank-<r>.json
now = time.monotonic


class OpTimer:
    """The timed iterations of a run: [{plan, shape, iteration, ops: [{worker, kind, stage,
    pipeline, microbatch, start, end}], model: the Plan}]."""

    def __init__(self, plans: int = PLANS_TIMED):
        self.plans, self.timed = plans, []
        self._seen: set = set()
        self.current: dict | None = None

    def begin(self, plan, iteration: int) -> "OpTimer | None":
        """Self, to time this iteration's ops, when it is one of the first complete iterations
        of a plan not timed yet; None otherwise (an iteration a failure cuts is dropped)."""
        key = (plan.name, plan.shape)
        self.current = None
        if key in self._seen or len(self._seen) >= self.plans:
            return None
        self.current = {"plan": plan.name, "shape": plan.shape, "iteration": iteration, "ops": [], "model": plan}
        return self

    def record(self, worker: int, op, start: float, end: float) -> None:
        self.current["ops"].append({"worker": worker, "kind": op.kind, "stage": op.stage, "pipeline": op.pipeline,
                                    "microbatch": None if op.kind == OPT else op.microbatch,
                                    "start": start, "end": end})

    def end(self) -> None:
        """The timed iteration completed: keep it."""
        if self.current is not None:
            self._seen.add((self.current["plan"], self.current["shape"]))
            self.timed.append(self.current)
            self.current = None

    def write(self, run_dir: Path, rank: int) -> None:
        """This rank's timed iterations, for the leader to merge (after the run loop)."""
        folder = Path(run_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        plain = [{k: v for k, v in entry.items() if k != "model"} for entry in self.timed]
        (folder / f"rank-{rank}.json").write_text(json.dumps(plain))


def merged(timed: list[dict], run_dir: Path) -> list[dict]:
    """The leader's timed iterations with every rank's ops (dist): the files the other ranks
    wrote, matched by plan, shape and iteration; a file that does not parse is left out."""
    by_key = {(e["plan"], e["shape"], e["iteration"]): {**e, "ops": list(e["ops"])} for e in timed}
    for path in sorted((Path(run_dir) / FOLDER).glob("rank-*.json")):
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for entry in entries:
            target = by_key.get((entry.get("plan"), entry.get("shape"), entry.get("iteration")))
            if target is not None:
                target["ops"] += entry.get("ops", [])
    for entry in by_key.values():  # the leader's own file holds its ops again: once each
        unique = {(op["worker"], op["kind"], op["stage"], op["pipeline"], op["microbatch"]): op for op in entry["ops"]}
        entry["ops"] = sorted(unique.values(), key=lambda op: op["start"])
    return list(by_key.values())
