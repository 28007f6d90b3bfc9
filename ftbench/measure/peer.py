"""The second process of a calibration: a restarted rank, then the far end of the links.

Started by the parent (ftbench.measure.restart) as `python -m ftbench.measure.peer SETTINGS`
(a JSON object). It times what a restarted rank of `backend=dist` goes through, stamping the
wall clock after each phase: interpreter and imports (torch, transformers, the engine, the
dist transport), joining the process group (gloo, rank 1 of 2, on the parent's store), the
model (the whole model in one stage replica, AdamW), the checkpoint (the CheckpointStore the
parent wrote: read, verified, loaded), and its first training iteration (the executor on a
one-stage plan). It posts the stamps to the store, runs its side of the link measurements
(ftbench.measure.links), then beats like a dist rank (membership.Heartbeat) until the parent
kills it to time the detection of its death. It never outlives the parent: it exits when
the parent is gone or at the settings' deadline.
"""
from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: the parent measures the interpreter's start itself

import json  # noqa: E402 - after the stamp above
import os  # noqa: E402
import sys  # noqa: E402

RESTART_KEY = "measure/restart"  # the stamps, posted to the job's store
READY_KEY = "measure/imported"  # imports done: the parent joins the process group now
BEATING_KEY = "measure/beating"  # the heartbeat runs: the parent may kill this process


def restarted_rank(settings: dict) -> tuple[dict, object]:
    """The phases of a restart, stamped; returns (stamps, the job's store)."""
    stamps = {"started": STARTED}
    import datetime

    import torch
    import torch.distributed as dist

    from ftbench import threads
    from ftbench.checkpoint import CheckpointStore
    from ftbench.distributed.membership import job_store
    from ftbench.distributed.transport import Group  # noqa: F401 - a restarted rank imports its transport
    from ftbench.engine.executor import Executor
    from ftbench.engine.worker import StageReplica, Worker
    from ftbench.measure.ops import DTYPES
    from ftbench.models.gpt import build_stage
    from ftbench.models.specs import resolve_model
    from ftbench.plan import grid_plan
    from ftbench.schedule import generate

    threads.apply(settings["threads"])
    stamps["imports"] = time.time()

    store = job_store(settings["timeout_s"])
    store.set(READY_KEY, "1")
    dist.init_process_group("gloo", store=dist.PrefixStore("default/", store), rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=settings["timeout_s"]))
    stamps["process_group"] = time.time()

    spec = resolve_model(settings["model"])
    device = torch.device(settings["device"])  # a restarted GPU rank rebuilds on its GPU
    module = build_stage(spec, settings["seed"], 0, spec.layers, True, True).to(device=device,
                                                                               dtype=DTYPES[settings["dtype"]])
    replica = StageReplica(0, module, settings["lr"], 0.0)
    stamps["model"] = time.time()

    expected = {n: tuple(p.shape) for n, p in replica.named_parameters().items()}
    _, shards = CheckpointStore(settings["checkpoint"]).load(expected=expected)
    shard = shards[settings["shard"]]
    replica.load(shard["model"], shard["optim"])
    stamps["checkpoint"] = time.time()

    m, b, s = settings["microbatches"], settings["microbatch_size"], settings["seq_len"]
    plan = grid_plan(generate("1f1b", 1, m), ((0, spec.layers),), 1, 1)
    worker = Worker(0)
    worker.replicas[(0, spec.layers)] = replica
    ids = torch.randint(0, spec.vocab, (b, s)).to(device)
    Executor({0: worker}).run(plan, lambda pipeline, microbatch: ids, float(m * b * (s - 1)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stamps["first_iteration"] = time.time()
    return stamps, store


def beat_until_killed(store, settings: dict, parent: int) -> None:
    """Beat as a dist rank does until the parent kills this process (or leaves, or the deadline)."""
    from ftbench.distributed.membership import Heartbeat

    Heartbeat(1, settings["timeout_s"]).start()
    store.set(BEATING_KEY, "1")
    deadline = time.time() + settings["timeout_s"]
    while time.time() < deadline and os.getppid() == parent:
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    settings = json.loads(argv[1])
    parent = os.getppid()
    stamps, store = restarted_rank(settings)
    store.set(RESTART_KEY, json.dumps(stamps))
    from ftbench.measure.links import exchange

    exchange(1, settings["links"], store)
    beat_until_killed(store, settings, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
