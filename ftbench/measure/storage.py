"""Checkpoint save and load bandwidth with the project's CheckpointStore, on the disk of the
folder given (the output's folder by default: where runs write their checkpoints).

A save is what a run's save is: torch.save of each shard, its sha256, the file written and
fsynced, then the manifest. A load reads and verifies every shard (size, sha256, parameter
shapes) and unpickles it with weights_only. Two states are measured: the whole model's (a
single replica of every layer after one AdamW step, so the Adam moments are there) and a
synthetic one of about `synthetic_mb` MB in a few tensors, whose bandwidth is the profile's.
Loads right after a save may be served from the page cache, as a restart on the same node
would be.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ftbench.checkpoint import CheckpointStore
from ftbench.engine.worker import StageReplica
from ftbench.measure.fit import median
from ftbench.measure.ops import DTYPES, Setup
from ftbench.models.gpt import build_stage, lm_loss_sum

MODEL_SHARD = "model"  # the shard name of the whole-model checkpoint (the restarted process loads it)


def whole_model(setup: Setup) -> StageReplica:
    """Every layer in one replica, after one training step (weights and both Adam moments)."""
    spec = setup.spec
    module = build_stage(spec, setup.seed, 0, spec.layers, True, True).to(device=setup.device,
                                                                          dtype=DTYPES[setup.dtype])
    replica = StageReplica(0, module, setup.lr, 0.0)
    ids = torch.randint(0, spec.vocab, (setup.microbatch_size, setup.seq_len), device=setup.device)
    lm_loss_sum(replica.module(ids), ids).backward()
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=True)
    return replica


def expected_shapes(shards: dict) -> dict:
    return {name: tuple(t.shape) for shard in shards.values() for name, t in shard["model"].items()}


def save_and_load(root: Path, shards: dict, reps: int) -> dict:
    """Median seconds of a save and of a verified load of `shards` into a store at `root`."""
    store = CheckpointStore(root, keep=1)
    expected = expected_shapes(shards)
    saves, loads, nbytes = [], [], 0
    for rep in range(reps):
        start = time.perf_counter()
        info = store.save(rep, shards)
        saves.append(time.perf_counter() - start)
        nbytes = info.bytes
        start = time.perf_counter()
        loaded = store.load(expected=expected)
        loads.append(time.perf_counter() - start)
        if loaded is None or loaded[0] != rep:
            raise RuntimeError(f"the checkpoint just written to {root} did not load back")
    return {"bytes": nbytes, "save_s": median(saves), "load_s": median(loads),
            "save_gbps": nbytes / median(saves) / 1e9, "load_gbps": nbytes / median(loads) / 1e9,
            "saves": saves, "loads": loads}


SHARDS = 8  # the synthetic state split into this many files: each file's fixed cost, from the difference


def synthetic_shards(megabytes: float, files: int = 1) -> dict:
    """About `megabytes` MB of float32 in 8 tensors, as `files` shards in the engine's layout
    (the same tensors however many files)."""
    per_tensor = int(megabytes * 1e6 / 4 / 8)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.rand(per_tensor, generator=generator) for _ in range(8)]
    shards: dict = {}
    for i, tensor in enumerate(tensors):
        name = "synthetic" if files == 1 else f"synthetic{i % files}"
        shards.setdefault(name, {"model": {}, "optim": {}})["model"][f"transformer.h.{i}.mlp.c_fc.weight"] = tensor
    return shards


def file_cost(single: dict, split: dict, files: int, which: str = "save_s") -> float:
    """The fixed cost of one checkpoint file, written (`save_s`) or read back and verified
    (`load_s`): the same bytes as `files` shards instead of one take that many files more (at
    least 0: noise can invert two close medians)."""
    return max(0.0, (split[which] - single[which]) / (files - 1))


def measure_storage(folder: Path, setup: Setup, synthetic_mb: float, reps: int, say) -> dict:
    """Both states; leaves the whole-model checkpoint in `folder/model` for the restart."""
    replica = whole_model(setup)
    model = save_and_load(folder / "model", {MODEL_SHARD: replica.shard()}, reps)
    say(f"storage: {setup.spec.name} state {model['bytes'] / 1e6:.1f} MB: save {model['save_gbps']:.3f} GB/s, "
        f"load {model['load_gbps']:.3f} GB/s")
    synthetic = save_and_load(folder / "synthetic", synthetic_shards(synthetic_mb), reps)
    say(f"storage: synthetic {synthetic['bytes'] / 1e6:.0f} MB: save {synthetic['save_gbps']:.3f} GB/s, "
        f"load {synthetic['load_gbps']:.3f} GB/s")
    split = save_and_load(folder / "split", synthetic_shards(synthetic_mb, SHARDS), reps)
    file_s = file_cost(synthetic, split, SHARDS)
    load_file_s = file_cost(synthetic, split, SHARDS, "load_s")
    say(f"storage: the same in {SHARDS} files: save {split['save_s'] * 1e3:.1f} ms against "
        f"{synthetic['save_s'] * 1e3:.1f} ms: {file_s * 1e3:.2f} ms per file; load {split['load_s'] * 1e3:.1f} ms "
        f"against {synthetic['load_s'] * 1e3:.1f} ms: {load_file_s * 1e3:.2f} ms per file")
    return {"model": model, "synthetic": synthetic, "split": {**split, "files": SHARDS}, "file_s": file_s,
            "load_file_s": load_file_s}
