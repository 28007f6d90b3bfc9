"""How many CPU threads torch may use in a local (and, later, dist) run.

torch's default is one intra-op thread per host core. When other processes keep those cores
busy, its OpenMP threads wait on each other at every op and a run gets many times slower
(the default job: 11 s with one thread, over 5 min with the default under two busy
processes on a 2-core machine). So the count comes from what this process may really use:

- `usable_cpus()`: the CPUs in the process's affinity mask, capped by the cgroup CPU quota
  (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), never the host's cores;
- `pick_threads(spec, usable)`: 1 for models whose matmuls are too small for threads to pay
  (below `MIN_HIDDEN_PER_THREAD`, measured: see `benchmarks/contention.py`), otherwise up to
  one thread per usable CPU;
- `apply(threads)`: torch.set_num_threads, and the inter-op pool's size once per process
  (torch allows setting it only before its first parallel work).

`backend.threads` overrides the choice; `OMP_NUM_THREADS`, when set, caps the automatic one.
Importing this module does not import torch.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Below this hidden size a micro-batch's matmuls take microseconds, and a second thread costs
# more in synchronisation than it saves, even on a quiet machine (gpt-tiny has hidden 64).
MIN_HIDDEN_PER_THREAD = 256
# Each further thread needs about this much more hidden size to pay for itself.
HIDDEN_PER_THREAD = 256

_interop_set = False


def usable_cpus(cgroup_root: Path | str = CGROUP_ROOT, proc_self_cgroup: Path | str = "/proc/self/cgroup") -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup CPU quota (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_self_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: Path | str = CGROUP_ROOT,
                     proc_self_cgroup: Path | str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors; None if unlimited
    or unknown. Reads cgroup v2 `cpu.max` ("max 100000" or "200000 100000") and cgroup v1
    `cpu.cfs_quota_us` (-1: unlimited) / `cpu.cfs_period_us`."""
    root = Path(cgroup_root)
    quotas = []
    for directory in _cgroup_dirs(root, Path(proc_self_cgroup)):
        quota = _v2_quota(directory / "cpu.max")
        if quota is None:
            quota = _v1_quota(directory / "cpu.cfs_quota_us", directory / "cpu.cfs_period_us")
        if quota is not None:
            quotas.append(quota)
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, proc_self_cgroup: Path) -> list[Path]:
    """The process's cgroup directories (v2 unified; v1 cpu controller) and their ancestors, up to
    the mount points; the mount points alone when /proc/self/cgroup says nothing usable."""
    mounts = [root, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
    relative: list[tuple[Path, str]] = []
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            relative.append((root, path))
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            relative.extend((mount, path) for mount in mounts[1:])
    dirs: list[Path] = []
    for mount, path in relative:
        current = mount / path.lstrip("/")
        while True:
            if current not in dirs:
                dirs.append(current)
            if current == mount or mount not in current.parents:
                break
            current = current.parent
    for mount in mounts:
        if mount not in dirs:
            dirs.append(mount)
    return dirs


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        fields = cpu_max.read_text().split()
    except OSError:
        return None
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota = float(fields[0])
        period = float(fields[1]) if len(fields) > 1 else 100000.0
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota = float(quota_file.read_text().strip())
        period = float(period_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def pick_threads(spec, usable: int) -> int:
    """Intra-op threads for a model of `spec`'s shape on `usable` CPUs: 1 below
    MIN_HIDDEN_PER_THREAD, then one more per HIDDEN_PER_THREAD of hidden size, at most `usable`."""
    usable = max(1, int(usable))
    hidden = int(getattr(spec, "hidden", 0) or 0)
    if hidden < MIN_HIDDEN_PER_THREAD:
        return 1
    return max(1, min(usable, hidden // HIDDEN_PER_THREAD))


def env_cap() -> int | None:
    """OMP_NUM_THREADS when it is a positive integer (the user's explicit cap), else None."""
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def choose(setting, spec, usable: int | None = None) -> int:
    """`backend.threads` when set (a positive integer), otherwise pick_threads capped by OMP_NUM_THREADS."""
    if setting is not None:
        try:
            threads = int(setting)
        except (TypeError, ValueError):
            threads = 0
        if threads < 1 or threads != setting:
            from ftbench.errors import ConfigError

            raise ConfigError("backend.threads", f"must be a positive integer or null, got {setting!r}",
                              "set backend.threads=1 (or more), or backend.threads=null to pick from the CPUs")
        return threads
    threads = pick_threads(spec, usable_cpus() if usable is None else usable)
    cap = env_cap()
    return min(threads, cap) if cap is not None else threads


def apply(threads: int) -> int:
    """Make torch use `threads` intra-op threads; size the inter-op pool too if nothing has yet.
    Returns the intra-op count torch reports afterwards."""
    import torch

    global _interop_set
    threads = max(1, int(threads))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if not _interop_set:
        _interop_set = True  # one try per process: torch refuses a second call, or one after parallel work
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            pass
    return torch.get_num_threads()


def configure(backend_cfg, spec) -> int:
    """Choose from `backend.threads` and the model, apply, return the count (for the summary)."""
    setting = backend_cfg.get("threads") if hasattr(backend_cfg, "get") else getattr(backend_cfg, "threads", None)
    return apply(choose(setting, spec))
