"""`ftbench calibrate` / `python -m ftbench.measure`: arguments, checks, and the steps in order.

A bad argument ends with one line naming it and the fix (exit 2); Ctrl-C with one line (130).
Everything the measurements write goes to a temporary folder next to the output (or under
`--dir`), removed at the end; the second process is always killed and reaped.
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ftbench.paths import CONF_DIR

DTYPE_CHOICES = ("float32", "float64", "bfloat16", "float16")
BLOCKS = (1, 2, 4)
NAME = re.compile(r"[A-Za-z0-9_.-]+")


class MeasurementFailed(Exception):
    """A step that could not measure (the second process died, a folder filled up): one line, exit 1."""


class BadArgument(Exception):
    def __init__(self, setting: str, problem: str, fix: str):
        super().__init__(f"{setting}: {problem}; {fix}")


@dataclass(frozen=True)
class Effort:
    """How many repetitions each step takes (default or --quick)."""
    warmup: int
    iterations: int  # rounds of the op plans
    copy_mb: int
    copy_reps: int
    synthetic_mb: int
    storage_reps: int
    link_reps: int
    group_reps: int


DEFAULT = Effort(warmup=3, iterations=60, copy_mb=256, copy_reps=7, synthetic_mb=100, storage_reps=3,
                 link_reps=8, group_reps=5)
QUICK = Effort(warmup=2, iterations=12, copy_mb=64, copy_reps=3, synthetic_mb=32, storage_reps=1,
               link_reps=3, group_reps=2)


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Measure this machine with ftbench's own engine, transport and checkpoint store, and write a "
        "hardware profile (docs/calibrate.md). About a minute on 2 cores; --quick under 30 s."))
    p.add_argument("--model", default="gpt-tiny", help="model whose blocks are timed (default gpt-tiny)")
    p.add_argument("--microbatch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="compute dtype (default float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: as the local backend picks them, ftbench/threads.py)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per measured iteration (default 4)")
    p.add_argument("--name", default=None, help="profile name (default measured-<hostname>)")
    p.add_argument("--out", default=None, help="where to write the YAML (default conf/hardware/<name>.yaml)")
    p.add_argument("--dir", default=None, help="folder whose disk the checkpoint store measures "
                                                "(default: the output's folder)")
    p.add_argument("--quick", action="store_true", help="the fewest repetitions (for tests): noisier numbers")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the second process may take per step")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m ftbench.measure") -> int:
    args = parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    command = " ".join([prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    try:
        checked = check(args)
    except BadArgument as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    try:
        return calibrate(args, checked, command)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted (Ctrl-C); nothing written", file=sys.stderr)
        return 130
    except MeasurementFailed as err:
        print(f"{prog}: {err}; nothing written", file=sys.stderr)
        return 1


def default_name() -> str:
    return "measured-" + re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname() or "host")


def check(args) -> dict:
    """Every argument checked before anything is measured; the resolved model, paths, device."""
    from ftbench.errors import ConfigError
    from ftbench.models.specs import resolve_model

    try:
        spec = resolve_model(args.model)
    except ConfigError as err:
        raise BadArgument("--model", err.problem, err.fix) from None
    positive("--microbatch-size", args.microbatch_size, "set --microbatch-size 1 or more")
    positive("--microbatches", args.microbatches, "set --microbatches 1 or more (4 by default)")
    if args.threads is not None:
        positive("--threads", args.threads, "set --threads 1 or more, or leave it out")
    if args.timeout <= 0:
        raise BadArgument("--timeout", f"must be positive, got {args.timeout:g}", "set --timeout 120 or so")
    seq_len = spec.seq_len if args.seq_len is None else args.seq_len
    if not 2 <= seq_len <= spec.seq_len:
        raise BadArgument("--seq-len", f"{seq_len} is outside 2..{spec.seq_len} ({spec.name}'s context)",
                          f"use --seq-len between 2 and {spec.seq_len}, or leave it out")
    if spec.layers < max(BLOCKS) + 2:
        raise BadArgument("--model", f"{spec.name} has {spec.layers} blocks; the measured pipeline needs "
                          f"{max(BLOCKS) + 2}", "pick a model with more layers")
    name = args.name or default_name()
    if not NAME.fullmatch(name):
        raise BadArgument("--name", f"{name!r} has characters a file name should not",
                          "use letters, digits, '-', '_' and '.'")
    out = Path(args.out) if args.out else CONF_DIR / "hardware" / f"{name}.yaml"
    return {"spec": spec, "seq_len": seq_len, "name": name, "out": out, "device": check_device(args.device),
            "scratch": writable_scratch(out, args.dir)}


def positive(setting: str, value: int, fix: str) -> None:
    if value < 1:
        raise BadArgument(setting, f"must be at least 1, got {value}", fix)


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return device
        raise BadArgument("--device", f"{device} asked for but torch sees no CUDA GPU",
                          "use --device cpu, or install torch's CUDA build on a GPU machine")
    raise BadArgument("--device", f"unknown device {device!r}", "use --device cpu or --device cuda")


def writable_scratch(out: Path, folder: str | None) -> Path:
    """A new temporary folder next to the output (or in --dir): proves both writable."""
    if out.is_dir():
        raise BadArgument("--out", f"{out} is a folder", "give a file path, e.g. --out profiles/mine.yaml")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=".calibrate-", dir=out.parent)
        shutil.rmtree(probe)
    except OSError as err:
        raise BadArgument("--out", f"cannot write to {out.parent} ({err.strerror or err})",
                          "pick a writable path with --out") from None
    where = Path(folder) if folder else out.parent
    try:
        return Path(tempfile.mkdtemp(prefix=".calibrate-", dir=where))
    except OSError as err:
        raise BadArgument("--dir", f"cannot write to {where} ({err.strerror or err})",
                          "pick a writable folder with --dir") from None


class Progress:
    """Progress lines with the seconds since the start."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {line}", flush=True)


def calibrate(args, checked: dict, command: str) -> int:
    say = Progress()  # before torch's import, so the durations printed are the command's
    from ftbench.measure.restart import PeerFailed
    from ftbench.measure.steps import run_all

    scratch = checked["scratch"]
    try:
        profile = run_all(args, checked, QUICK if args.quick else DEFAULT, command, say)
        write_profile(profile, checked["out"])
    except PeerFailed as err:
        raise MeasurementFailed(str(err)) from None
    except OSError as err:
        raise MeasurementFailed(f"{getattr(err, 'filename', None) or 'a file'}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from ftbench.measure.profile import summary_lines

    print(f"wrote {checked['out']} in {time.perf_counter() - say.start:.0f} s "
          f"(use it as hardware={checked['name']} when it is in conf/hardware/)")
    for line in summary_lines(profile):
        print(line)
    return 0


def write_profile(profile: dict, out: Path) -> None:
    """The YAML, staged in a hidden file next to the output then moved into place (never half a
    file; next to it, so the move stays on one file system whatever --dir is)."""
    import yaml

    header = (f"# Measured by `ftbench calibrate` on {profile['provenance']['host']}, "
              f"{profile['provenance']['date']} (docs/calibrate.md).\n"
              "# Every number below was measured by that command; `provenance.sources` says how.\n")
    text = header + yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=120)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=f".{out.name}.", delete=False) as staged:
        staged.write(text)
    try:
        Path(staged.name).replace(out)
    finally:
        Path(staged.name).unlink(missing_ok=True)
