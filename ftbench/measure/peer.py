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


def import_everything(settings: dict) -> None:
    """What a restarted dist rank imports before it can train: torch, transformers, the engine,
    the checkpoint store and the dist transport (each module's first import happens here)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from ftbench import threads
    from ftbench.checkpoint import CheckpointStore  # noqa: F401
    from ftbench.distributed.membership import job_store  # noqa: F401
    from ftbench.distributed.transport import Group  # noqa: F401
    from ftbench.engine.executor import Executor  # noqa: F401
    from ftbench.engine.worker import StageReplica, Worker  # noqa: F401
    from ftbench.models.gpt import build_stage  # noqa: F401
    from ftbench.plan import grid_plan  # noqa: F401

    threads.apply(settings["threads"])


def join_group(settings: dict):
    """Rank 1 of the calibration's 2-rank gloo group, on its store; returns the store."""
    import datetime

    import torch.distributed as dist

    from ftbench.distributed.membership import job_store

    store = job_store(settings["timeout_s"])
    store.set(READY_KEY, "1")
    dist.init_process_group("gloo", store=dist.PrefixStore("default/", store), rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=settings["timeout_s"]))
    return store


def build_model(settings: dict):
    """The whole model in one stage replica (AdamW included), on the calibrated device."""
    import torch

    from ftbench.engine.worker import StageReplica
    from ftbench.measure.ops import DTYPES
    from ftbench.models.gpt import build_stage
    from ftbench.models.specs import resolve_model

    spec = resolve_model(settings["model"])
    module = build_stage(spec, settings["seed"], 0, spec.layers, True, True)
    module = module.to(device=torch.device(settings["device"]), dtype=DTYPES[settings["dtype"]])
    return StageReplica(0, module, settings["lr"], 0.0)


def load_checkpoint(replica, settings: dict) -> None:
    """The newest checkpoint of the store the parent wrote: read, verified, loaded."""
    from ftbench.checkpoint import CheckpointStore

    expected = {n: tuple(p.shape) for n, p in replica.named_parameters().items()}
    _, shards = CheckpointStore(settings["checkpoint"]).load(expected=expected)
    shard = shards[settings["shard"]]
    replica.load(shard["model"], shard["optim"])


def first_iteration(replica, settings: dict) -> None:
    """One training iteration through the executor on a one-stage plan."""
    import torch

    from ftbench.engine.executor import Executor
    from ftbench.engine.worker import Worker
    from ftbench.plan import grid_plan
    from ftbench.schedule import generate

    layers = replica.layers
    m, b, s = settings["microbatches"], settings["microbatch_size"], settings["seq_len"]
    plan = grid_plan(generate("1f1b", 1, m), (layers,), 1, 1)
    worker = Worker(0)
    worker.replicas[layers] = replica
    device = torch.device(settings["device"])
    ids = torch.randint(0, replica.module.config.vocab_size, (b, s)).to(device)
    Executor({0: worker}).run(plan, lambda pipeline, microbatch: ids, float(m * b * (s - 1)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def restarted_rank(settings: dict) -> tuple[dict, object]:
    """The phases of a restart, each stamped at its end; returns (stamps, the job's store)."""
    stamps = {"started": STARTED}
    import_everything(settings)
    stamps["imports"] = time.time()
    store = join_group(settings)
    stamps["process_group"] = time.time()
    replica = build_model(settings)
    stamps["model"] = time.time()
    load_checkpoint(replica, settings)
    stamps["checkpoint"] = time.time()
    first_iteration(replica, settings)
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
