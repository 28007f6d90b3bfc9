"""One file of Swift's boundary log, verified like a checkpoint shard (ftbench.checkpoint).

A file is a header line and the torch.save of the sender's messages:

    ftbench-swift-log 1\\n
    {"iteration": i, "src": w, "bytes": n, "sha256": "..."}\\n
    <n bytes: torch.save({key: tensor})>

The header is written with the payload in one atomic replace, so a file is whole or absent.
Before a replay uses a file its header must name the iteration and sender asked for (a log
of another iteration copied over it is refused) and the payload must have the recorded size
and sha256 (truncation, garbage, one flipped bit). Anything off raises `LogInvalid`, naming
the file and what is wrong; the replay then falls back (ftbench.errors.ReplayUnavailable).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch

from ftbench.engine.transport import TransportError

MAGIC = b"ftbench-swift-log 1\n"


class LogInvalid(TransportError):
    """A log file a replay needs is missing or does not verify; `path` is the file."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def write(path: Path, iteration: int, src: int, messages: dict) -> int:
    """Write `messages` (what `src` sent in `iteration`) to `path` atomically; its size in bytes."""
    buffer = io.BytesIO()
    torch.save(messages, buffer)
    data = buffer.getbuffer()
    header = json.dumps({"iteration": iteration, "src": src, "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + header + b"\n")
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a file
    return len(MAGIC) + len(header) + 1 + len(data)


def verified_payload(path: Path, iteration: int, src: int) -> memoryview:
    """The payload of `path` once its header names (`iteration`, `src`) and its size and
    sha256 match; LogInvalid otherwise."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise LogInvalid(path, f"no log of worker {src} for iteration {iteration} (missing)") from None
    except OSError as error:
        raise LogInvalid(path, f"cannot read ({error.strerror or error})") from None
    end = raw.find(b"\n", len(MAGIC))
    if not raw.startswith(MAGIC) or end < 0:
        raise LogInvalid(path, f"no log header ({len(raw)} bytes: empty, truncated or overwritten)")
    try:
        header = json.loads(raw[len(MAGIC):end])
        recorded = (header["iteration"], header["src"])
        size, digest = header["bytes"], header["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise LogInvalid(path, f"unreadable log header ({error})") from None
    if recorded != (iteration, src):
        raise LogInvalid(path, f"holds iteration {recorded[0]} of worker {recorded[1]}, not iteration "
                               f"{iteration} of worker {src}")
    data = memoryview(raw)[end + 1:]
    if len(data) != size:
        raise LogInvalid(path, f"payload of {len(data)} bytes, the header says {size}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise LogInvalid(path, "sha256 mismatch")
    return data


def load(path: Path, iteration: int, src: int) -> dict:
    """The verified messages of `path`."""
    data = verified_payload(path, iteration, src)
    try:
        # weights_only: a log file must never be able to run code on load
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # a payload that verifies was written by us: this is a bug, said plainly
        raise LogInvalid(path, f"torch.load failed ({type(error).__name__})") from None


def replay_sources(plan, readers, replayed) -> list[int]:
    """The workers whose log files `readers` (workers of a replay by `replayed`) read: the
    holders of stages next to theirs across a logged boundary that do not replay."""
    holder = {(d, s): w for w, held in plan.holds.items() for d, s in held}
    found = set()
    for w in readers:
        for d, s in plan.holds[w]:
            if s > 0 and (d, s - 1) in plan.logged:
                found.add(holder[(d, s - 1)])  # its activations come from the log
            if (d, s) in plan.logged:
                found.add(holder[(d, s + 1)])  # its output's gradients come from the log
    return sorted(found - set(replayed))
