"""Checkpoint files for the checkpoint-restart strategies (plain, CheckFreq, ...).

A checkpoint is one iteration's state split into named shards (one per pipeline stage):

    root/iter_{iteration:08d}/{shard}.pt       torch.save of the shard (loaded weights_only)
    root/iter_{iteration:08d}/manifest.json    {"iteration", "format", "shards", "created"}

The manifest is written last and atomically, so a folder without one is a partial write by
definition. Loading verifies size and sha256 of every shard (and, given `expected`, every
parameter's name and shape) and falls back to the next older checkpoint when anything is off.
A save that runs out of space (ENOSPC, EDQUOT, EFBIG) removes its partial folder and is
skipped: training goes on and a restart falls back to the newest older checkpoint, which is
kept. Any other failed write also removes its partial folder, then raises. Every skipped
checkpoint (unusable on load, or not written) goes to `on_skip(reason, iteration)`; by default
a CheckpointWarning. One store owns its root: two stores (or processes) writing the same root
are not supported.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ftbench.metrics import fsync_dir

FORMAT = 1
MANIFEST = "manifest.json"
_FOLDER = re.compile(r"iter_(\d{8,})")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Write errors that mean "no room": the checkpoint is skipped, not the run ended.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass
class CheckpointInfo:
    iteration: int
    path: Path  # the checkpoint's folder
    bytes: int  # total bytes written (shards and manifest)
    seconds: float  # wall time of the write (for async: of the persist)
    skipped: str | None = None  # why nothing was written (disk full): no checkpoint at `iteration`


class CheckpointWarning(UserWarning):
    """A checkpoint on disk could not be used (or pruned); the store carried on without it."""


class _Invalid(Exception):
    """Why one checkpoint failed verification; `path` is the file (or folder) at fault."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def _check_name(name: str) -> None:
    # Shard names become file names: no separators, no "." / ".." tricks.
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or set(name) == {"."}:
        raise ValueError(f"shard name {name!r} is not a safe file name (use letters, digits, _ - .)")


def _write_file(path: Path, data: bytes | memoryview, durable: bool = True) -> None:
    """Atomically write `data` to `path`: readers see no file or the whole file (`durable`: on
    the disk before it is renamed into place)."""
    # Same folder, so os.replace is a rename; the leading dot keeps it out of shard names' way.
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class PendingCheckpoint:
    """A persist running in a background thread; `result()` joins it and re-raises its error."""

    def __init__(self, iteration: int, persist: Callable[[], CheckpointInfo]):
        self.iteration = iteration
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._reported = False  # the error reached a caller once; the store need not repeat it
        # Not a daemon: interpreter exit waits for the persist instead of cutting it short.
        self._thread = threading.Thread(target=self._run, args=(persist,),
                                        name=f"checkpoint-{iteration}")
        self._thread.start()

    def _run(self, persist: Callable[[], CheckpointInfo]) -> None:
        try:
            self._info = persist()
        except BaseException as error:  # kept for the caller; a thread has nobody else to tell
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> CheckpointInfo:
        """Wait for the persist; raise the exception it raised, if any."""
        self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._info is not None
        return self._info


def warn_skip(reason: str, iteration: int) -> None:
    """The default `on_skip`: a CheckpointWarning."""
    warnings.warn(CheckpointWarning(reason), stacklevel=3)


class CheckpointStore:
    def __init__(self, root: Path | str, keep: int = 2,
                 on_skip: Callable[[str, int], None] | None = None, durable: bool = True):
        """`keep`: the newest complete checkpoints left on disk after each successful save.
        `on_skip(reason, iteration)`: told of every checkpoint skipped, unusable on load or not
        written for lack of space (default: `warn_skip`, a CheckpointWarning); a run loop
        passes one that also logs a metrics line. A save skipped in the background persist
        thread calls it from that thread."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        # False: no fsync (files standing in for memory, ftbench.engine.host_memory: nothing
        # outlives a power loss there either); every write is still atomic and verified on load
        self.durable = durable
        self.on_skip = on_skip if on_skip is not None else warn_skip
        self._pending: PendingCheckpoint | None = None
        # Shared by pruning (in the persist thread) and load(), so neither sees the other halfway.
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------

    def folder(self, iteration: int) -> Path:
        return self.root / f"iter_{iteration:08d}"

    def save(self, iteration: int, shards: dict[str, dict]) -> CheckpointInfo:
        """Write a checkpoint now (after any pending persist finishes: one writer at a time)."""
        self._validate(iteration, shards)
        self.wait()
        return self._persist(iteration, shards)

    def save_async(self, iteration: int, shards: dict[str, dict]) -> PendingCheckpoint:
        """Persist `shards` in a background thread and return at once.

        The caller must already have snapshotted the shards (CPU copies nobody mutates). Only
        one persist runs at a time: as in CheckFreq, a new snapshot waits for the previous
        persist to finish, so if one is still running this call blocks on it first, and
        re-raises its exception if it failed.
        """
        self._validate(iteration, shards)
        self.wait()
        self._pending = PendingCheckpoint(iteration, lambda: self._persist(iteration, shards))
        return self._pending

    @property
    def pending(self) -> PendingCheckpoint | None:
        """The persist started last, until someone waits for it."""
        return self._pending

    def discard(self, iteration: int) -> None:
        """Remove one checkpoint (a persist that a failure interrupted never completed)."""
        with self._lock:
            folder = self.folder(iteration)
            if folder.is_dir():
                self._remove(folder)

    def discard_after_persist(self, iterations) -> None:
        """Wait for the running persist, then remove these checkpoints (the run loop's ledger
        says which are lost or superseded)."""
        self.wait()
        for iteration in iterations:
            self.discard(iteration)

    def wait(self) -> CheckpointInfo | None:
        """Join the running (or finished, unclaimed) persist; re-raise its exception."""
        pending = self._pending
        if pending is None:
            return None
        pending._thread.join()
        # Forget it only once finished: load() uses it to tell "being written" from "broken".
        if self._pending is pending:
            self._pending = None
        if pending._error is not None and pending._reported:
            return None  # the caller already got this error from pending.result()
        return pending.result()

    @staticmethod
    def _validate(iteration: int, shards: dict[str, dict]) -> None:
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        if not shards:
            raise ValueError("a checkpoint needs at least one shard")
        for name in shards:
            _check_name(name)

    def _persist(self, iteration: int, shards: dict[str, dict]) -> CheckpointInfo:
        start = time.perf_counter()
        folder = self.folder(iteration)
        try:
            total = self._write(iteration, folder, shards)
        except OSError as error:
            # Never leave a folder without a manifest behind: it would read as a partial write.
            with self._lock:
                shutil.rmtree(folder, ignore_errors=True)
            what = f"checkpoint iteration {iteration} could not be written to {folder}"
            if error.errno not in NO_SPACE:
                message = f"{what}: {error.strerror or error}"
                # OSError(errno, text) gives the errno's subclass (PermissionError, ...) again
                raise (OSError(error.errno, message) if error.errno is not None else OSError(message)) from error
            reason = (f"{what}: {error.strerror or error}; skipped (training goes on, a restart falls back "
                      "to the newest older checkpoint)")
            self.on_skip(reason, iteration)
            return CheckpointInfo(iteration, folder, 0, time.perf_counter() - start, skipped=reason)
        seconds = time.perf_counter() - start

        with self._lock:
            self._prune(iteration)
        return CheckpointInfo(iteration, folder, total, seconds)

    def _write(self, iteration: int, folder: Path, shards: dict[str, dict]) -> int:
        """Write the shards, then the manifest; the bytes written."""
        if folder.exists():
            # Re-saving an iteration replaces it; under the lock so load() never reads a mix.
            with self._lock:
                self._remove(folder)
        folder.mkdir(parents=True, exist_ok=True)

        total, entries = 0, {}
        for name, shard in shards.items():
            # Serialize first so the hash is of exactly the bytes that land on disk.
            buffer = io.BytesIO()
            torch.save(shard, buffer)
            data = buffer.getbuffer()
            _write_file(folder / f"{name}.pt", data, self.durable)
            entries[name] = {"file": f"{name}.pt", "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest()}
            total += len(data)
            del data  # release the view so the buffer can be freed
        if self.durable:
            fsync_dir(folder)  # shards durable before the manifest can claim them

        manifest = {"iteration": iteration, "format": FORMAT, "shards": entries,
                    "created": datetime.now(timezone.utc).isoformat()}
        text = (json.dumps(manifest, indent=2) + "\n").encode()
        _write_file(folder / MANIFEST, text, self.durable)
        if self.durable:
            fsync_dir(folder)
        return total + len(text)

    def _prune(self, saved: int) -> None:
        """Keep `saved` and the keep-1 newest complete checkpoints before it; drop the rest.

        Folders newer than `saved` go too: training resumed from an older checkpoint, so they
        belong to an abandoned run and load() must not resume from them.
        """
        older = [it for it in self.iterations() if it < saved][: self.keep - 1]
        keep = {saved, *older}
        for iteration, folder in self._folders():
            if iteration not in keep:
                try:
                    self._remove(folder)
                except OSError as error:  # the save itself succeeded; disk space is secondary
                    warnings.warn(CheckpointWarning(f"could not prune {folder}: {error}"),
                                  stacklevel=2)

    @staticmethod
    def _remove(folder: Path) -> None:
        # Manifest first: an interrupted removal then leaves a "partial" folder, not a bad one.
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder)

    # -- reading ---------------------------------------------------------------------------

    def _folders(self) -> list[tuple[int, Path]]:
        """Every checkpoint folder, complete or not, newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _FOLDER.fullmatch(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def iterations(self) -> list[int]:
        """Iterations with a manifest on disk, newest first (not verified)."""
        return [it for it, folder in self._folders() if (folder / MANIFEST).is_file()]

    def load(self, at_most: int | None = None, expected: dict | None = None
             ) -> tuple[int, dict[str, dict]] | None:
        """The newest checkpoint (iteration <= at_most, if given) that verifies, or None.

        `expected`: {parameter name: shape} of the whole model being restored. When given, a
        checkpoint must hold exactly those parameters (over all shards' "model" dicts), with
        those shapes, and AdamW state only for them with matching tensor shapes; one written by
        a model of another shape into the same folder is skipped like a corrupt one.
        Each unusable checkpoint on the way goes to `on_skip`, naming the file at fault.
        """
        pending = self._pending
        # The folder a persist is writing right now has no manifest yet: not a fault.
        busy = pending.iteration if pending is not None and not pending.done() else None
        with self._lock:
            for iteration, folder in self._folders():
                if (at_most is not None and iteration > at_most) or iteration == busy:
                    continue
                try:
                    shards = self._read(iteration, folder)
                    if expected is not None:
                        _check_shapes(folder, shards, expected)
                    return iteration, shards
                except _Invalid as bad:
                    self.on_skip(f"checkpoint iteration {iteration} unusable: {bad.path}: {bad.reason}; "
                                 "falling back to the previous checkpoint", iteration)
        return None

    @staticmethod
    def _read(iteration: int, folder: Path) -> dict[str, dict]:
        path = folder / MANIFEST
        if not path.is_file():
            raise _Invalid(folder, f"no {MANIFEST} (partial write)")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            entries = manifest["shards"]
            version, recorded = manifest["format"], manifest["iteration"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise _Invalid(path, f"unreadable manifest ({error})") from None
        if version != FORMAT:
            raise _Invalid(path, f"unknown format {version!r}")
        if recorded != iteration:
            raise _Invalid(path, f"manifest says iteration {recorded!r}")
        if not isinstance(entries, dict) or not entries:
            raise _Invalid(path, "manifest lists no shards")

        shards = {}
        for name, entry in entries.items():
            try:
                file, size, digest = entry["file"], entry["bytes"], entry["sha256"]
                _check_name(file)  # never follow a manifest out of its folder
            except (KeyError, TypeError, ValueError) as error:
                raise _Invalid(path, f"bad entry for shard {name!r} ({error})") from None
            shard_path = folder / file
            try:
                data = shard_path.read_bytes()
            except OSError as error:
                raise _Invalid(shard_path, f"cannot read ({error.strerror or error})") from None
            if len(data) != size:
                raise _Invalid(shard_path, f"size {len(data)} bytes, manifest says {size}")
            if hashlib.sha256(data).hexdigest() != digest:
                raise _Invalid(shard_path, "sha256 mismatch")
            try:
                # weights_only: a checkpoint file must never be able to run code on load.
                shards[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as error:
                first = (str(error).strip().splitlines() or [""])[0]  # unpickler errors run long
                raise _Invalid(shard_path, f"torch.load failed ({type(error).__name__}: {first})"
                               ) from None
        return shards

    def clear(self) -> None:
        """Remove everything under root, after any pending persist finishes.

        A failed pending persist is not re-raised here: its checkpoint is being discarded anyway.
        """
        pending = self._pending
        if pending is not None:
            pending._thread.join()
            self._pending = None
        with self._lock:
            if not self.root.is_dir():
                return
            for entry in self.root.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


def _check_shapes(folder: Path, shards: dict, expected: dict) -> None:
    """Raise _Invalid unless `shards` hold exactly the parameters of `expected` with its shapes."""
    want = {name: tuple(shape) for name, shape in expected.items()}
    seen: set[str] = set()
    for shard_name, shard in shards.items():
        path = folder / f"{shard_name}.pt"
        model = shard.get("model") if isinstance(shard, dict) else None
        optim = shard.get("optim", {}) if isinstance(shard, dict) else None
        if not isinstance(model, dict) or not isinstance(optim, dict):
            raise _Invalid(path, "not a shard of {'model': ..., 'optim': ...}")
        for name, tensor in model.items():
            if name not in want:
                raise _Invalid(path, f"parameter {name!r} is not in the model being restored "
                                     "(a checkpoint of another model shape?)")
            shape = tuple(getattr(tensor, "shape", ()))
            if not torch.is_tensor(tensor) or shape != want[name]:
                raise _Invalid(path, f"parameter {name!r} has shape {list(shape)}, the model needs "
                                     f"{list(want[name])} (a checkpoint of another model shape?)")
            seen.add(name)
        for name, state in optim.items():
            if name not in want or not isinstance(state, dict):
                raise _Invalid(path, f"optimizer state for {name!r}, which is not a parameter of the model")
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want[name]:
                    raise _Invalid(path, f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, "
                                         f"the parameter has {list(want[name])}")
    missing = sorted(set(want) - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise _Invalid(folder, f"no shard holds parameter {missing[0]!r}{more}")
