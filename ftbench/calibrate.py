"""The one fitted number per model: `hardware.efficiency` fitted to a published fault-free cell.

A paper table's experiment (conf/experiment/) names a target fault-free throughput and the
system it was measured on (`calibrate.throughput`, `calibrate.strategy`). Before a cell runs,
its setup is simulated fault-free under that reference system and `hardware.efficiency` is
bisected until the simulated throughput meets the target. Throughput rises with efficiency
(compute shrinks, links and storage stay), so bisection in log space converges. Everything
under failures (recoveries, copies, restarts, lost work) then comes from the mechanisms at
that efficiency: nothing else is fitted.

Fits are cached by the reference run's whole config (efficiency aside), in memory and, for
sweeps, as JSON in the sweep folder, so every cell of a model shares one fit.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import tempfile
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from ftbench.errors import ConfigError

LOW, HIGH = 1e-4, 1.0  # efficiency bounds of the search
TOLERANCE = 1e-4  # relative width at which the bisection stops
REFERENCE_ITERATIONS = 3  # fault-free sim iterations are identical: a few give the steady rate
CACHE_FILE = ".calibration.json"

_MEMORY: dict[str, dict] = {}


def reference_config(cfg):
    """The reference run: this cell's setup, the reference system, no failures, a few iterations."""
    from ftbench.config import FailuresConfig, strategy_schemas

    ref = copy.deepcopy(cfg)
    given = OmegaConf.to_container(cfg.calibrate.strategy, resolve=True) if cfg.calibrate.strategy else {}
    name = given.get("name", "none")
    schemas = strategy_schemas()
    schema = schemas.get(name, schemas["checkpoint"])
    with open_dict(ref):
        ref.strategy = OmegaConf.merge(OmegaConf.structured(schema), given)
        ref.failures = OmegaConf.structured(FailuresConfig(kind="none"))
        ref.train.iterations = REFERENCE_ITERATIONS
        ref.train.max_hours = None
        ref.report.gantt = False
        ref.report.progress = False
        ref.wandb.mode = "disabled"
        ref.calibrate.throughput = None
        ref.backend = OmegaConf.merge(ref.backend, {"name": "sim", "clock": None})
        for item in cfg.calibrate.overrides:
            key, _, value = str(item).partition("=")
            if not value:
                raise ConfigError("calibrate.overrides", f"'{item}' is not a key=value setting",
                                  "write dotted settings such as cluster.nodes=30")
            OmegaConf.update(ref, key, _scalar(value), merge=True)
    return ref


def _scalar(text: str):
    """A dotted override's value as YAML reads it (30 -> int, 0.5 -> float, null -> None)."""
    import yaml

    return yaml.safe_load(text)


def _key(ref) -> str:
    plain = OmegaConf.to_container(ref, resolve=True)
    plain["hardware"].pop("efficiency", None)
    plain.pop("seed", None)  # fault-free sim runs do not depend on the seed
    plain.pop("table", None)
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _throughput(ref, efficiency: float) -> tuple[float, str, str | None]:
    from ftbench.assembly.sim import simulate

    trial = copy.deepcopy(ref)
    trial.hardware.efficiency = efficiency
    with tempfile.TemporaryDirectory() as tmp:
        summary = simulate(trial, Path(tmp))
    return summary["throughput"], summary["status"], summary.get("error")


def fit(cfg, cache_dir: Path | None = None) -> dict:
    """{efficiency, target, reached, reference, source}: the efficiency at which the reference
    system's fault-free run meets `calibrate.throughput` (cached)."""
    target = float(cfg.calibrate.throughput)
    if target <= 0:
        raise ConfigError("calibrate.throughput", f"{target:g} is not positive",
                          "give the published fault-free samples/s, or null for no fit")
    ref = reference_config(cfg)
    key = _key(ref) + f"-{target!r}"
    on_disk = _read_cache(cache_dir, key)
    cached = on_disk or _MEMORY.get(key)
    if cached is not None:
        _MEMORY[key] = cached
        if on_disk is None:  # fitted earlier in this process: this sweep's jobs in other processes share it too
            _write_cache(cache_dir, key, cached)
        return cached
    top, status, error = _throughput(ref, HIGH)
    reference = str(ref.strategy.name)
    if status != "ok":
        raise ConfigError("calibrate.strategy", f"the reference run ({reference}, fault-free) ended '{status}': "
                          f"{error}", "fit to a setup the reference system can run")
    if top < target:
        raise ConfigError("calibrate.throughput", f"even at efficiency {HIGH:g} the reference run ({reference}) "
                          f"trains {top:.3g} samples/s, below the target {target:g}",
                          "check the hardware profile and the grid against the paper's setup")
    lo, hi = LOW, HIGH
    reached = top
    while hi / lo > 1 + TOLERANCE:
        mid = math.sqrt(lo * hi)
        rate, _, _ = _throughput(ref, mid)
        if rate < target:
            lo = mid
        else:
            hi, reached = mid, rate
    result = {"efficiency": hi, "target": target, "reached": reached, "reference": reference,
              "source": str(cfg.calibrate.source)}
    _MEMORY[key] = result
    _write_cache(cache_dir, key, result)
    return result


def _read_cache(cache_dir: Path | None, key: str) -> dict | None:
    if cache_dir is None:
        return None
    try:
        return json.loads((Path(cache_dir) / CACHE_FILE).read_text()).get(key)
    except (OSError, ValueError):
        return None


def _write_cache(cache_dir: Path | None, key: str, result: dict) -> None:
    """Merge into the sweep's cache file, written atomically (joblib workers may race: the
    last writer wins, and every entry it lacks is fitted again, identically)."""
    if cache_dir is None:
        return
    path = Path(cache_dir) / CACHE_FILE
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(entries, tmp, indent=1, sort_keys=True)
    Path(tmp.name).replace(path)


def apply(cfg, cache_dir: Path | None = None) -> dict | None:
    """Fit and set cfg.hardware.efficiency when the config asks for a fit; the fit's record."""
    if cfg.calibrate.throughput is None:
        return None
    result = fit(cfg, cache_dir)
    cfg.hardware.efficiency = result["efficiency"]
    return result
