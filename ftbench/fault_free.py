"""The after-run check against fault-free training, shared by the local and dist backends.

Fault-free training of the same setup runs on the local backend in the run's dtype
(`fault_free_reference`) and the run is judged against it
(`ftbench.equivalence`). A float32 run that is not bit for bit the reference is judged against
a measured noise floor: the same fault-free training once more in float64. That floor
depends only on the setup, not on the strategy or the failures, so it is measured once per
setup in a process (a sweep or a test session judging several strategies of one setup pays
for it once). A run equal to the reference bit for bit needs no floor and gets none.

The reference itself is trained for every check, unless the process asks to keep references
(`_REFERENCES` a dict, as the test session does: many tests judge several failure scripts of
one setup and strategy): then it is trained once per setup and strategy, and each check gets
its own copy. Fault-free training depends on its config alone (a test relies on it:
tests/test_local.py, the same config twice gives bit-identical losses).
"""
from __future__ import annotations

import json

from ftbench.assembly.local_engine import local_engine
from ftbench.cluster import Cluster
from ftbench.equivalence import NoiseFloor, identical, noise_floor, summary_fields
from ftbench.errors import ResultError
from ftbench.failures import FailureScript
from ftbench.job import Progress
from ftbench.loop import run_loop
from ftbench.samples import replayed
from ftbench.sim.cache import SimCache
from ftbench.strategies.none import NoFaultTolerance
from ftbench.threads import configure as configure_threads

_FLOORS: dict[str, NoiseFloor] = {}  # setup -> its float32 noise floor (this process)
# What fault-free training does not depend on: the strategy, the failures, reporting.
_NOT_SETUP = ("strategy", "failures", "report", "wandb", "hydra", "calibrate", "table")
# setup and strategy -> (losses, final weights) of fault-free training; None: not kept (the default)
_REFERENCES: dict[str, tuple[list[float], dict]] | None = None
# What the reference does not depend on, the strategy aside (its run context is the run's).
_NOT_REFERENCE = ("failures", "report", "wandb", "hydra")


def check(cfg, ctx, losses: list[float], state: dict, progress: bool = False, ledger=None) -> dict:
    """The summary's equivalence keys (`ftbench.equivalence.summary_fields`) for a run that
    trained `losses` and final weights `state` under `ledger` (its summary's: fault-free
    training is replayed under it where it dropped samples), and the reference's losses
    (`fault_free_losses`, drawn beside the run's in loss.png)."""
    replay = replayed(ledger, ctx.global_batch)
    ref_losses, ref_state = reference(cfg, ctx, progress=progress, replay=replay)
    floor = None
    if cfg.backend.dtype == "float32" and not identical(losses, state, ref_losses, ref_state):
        floor = float32_floor(cfg, ctx, ref_losses, ref_state, progress, replay=replay)
    return {**summary_fields(losses, state, ref_losses, ref_state, floor), "fault_free_losses": list(ref_losses)}


def reference(cfg, ctx, progress: bool = False, replay=None) -> tuple[list[float], dict]:
    """Losses and final weights of fault-free training of this run's setup
    (`fault_free_reference`, under `replay`); with references kept (`_REFERENCES`), trained once
    per setup, strategy and replayed ledger in this process, and a copy returned."""

    key = _setup_key(cfg, _NOT_REFERENCE, replay) if _REFERENCES is not None else None
    if key is None:
        return fault_free_reference(cfg, ctx, progress=progress, replay=replay)
    if key not in _REFERENCES:
        _REFERENCES[key] = fault_free_reference(cfg, ctx, progress=progress, replay=replay)
    losses, state = _REFERENCES[key]
    return list(losses), {name: tensor.clone() for name, tensor in state.items()}


def float32_floor(cfg, ctx, ref_losses, ref_state, progress: bool = False, replay=None) -> NoiseFloor | None:
    """The noise floor of float32 fault-free training (`ref_*`) of this setup under `replay`,
    measured against the same training in float64; None when float64 training would not fit
    in this machine's memory (the check then falls back to float tolerance)."""
    from omegaconf import OmegaConf

    from ftbench.engine.local import check_fits_host

    key = _setup_key(cfg, _NOT_SETUP, replay)
    if key is not None and key in _FLOORS:
        return _FLOORS[key]
    try:
        check_fits_host(ctx, cfg.cluster.dp, "float64")
    except ResultError:
        return None
    exact = OmegaConf.merge(cfg, {"backend": {"dtype": "float64"}})
    floor = noise_floor(ref_losses, ref_state, *fault_free_reference(exact, ctx, progress=progress, replay=replay))
    if key is not None:
        _FLOORS[key] = floor
    return floor


def _setup_key(cfg, left_out: tuple[str, ...] = _NOT_SETUP, replay=None) -> str | None:
    """The settings fault-free training depends on, and the ledger it replays, as text (None:
    not comparable)."""
    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 an unresolvable config is measured, not cached
        return None
    kept = {k: v for k, v in resolved.items() if k not in left_out}
    if replay is not None:
        kept["replayed ledger"] = sorted(replay.items())
    return json.dumps(kept, sort_keys=True, default=str)


def fault_free_reference(cfg, ctx, progress: bool = False, replay=None) -> tuple[list[float], dict]:
    """Losses and final weights of the same training with no failures and no fault tolerance;
    with `replay` ({iteration: sample ranges}, ftbench.samples.replayed), each of those
    iterations trains only those samples, their mean loss (the run's ledger replayed: the
    other micro-batches run and count 0, their exact-zero gradients changing no sum)."""
    configure_threads(cfg.backend, ctx.spec)  # the same count as the run it checks
    from ftbench.engine.backend import LocalBackend

    strategy = NoFaultTolerance(cfg.strategy, ctx)
    cluster = Cluster.from_config(cfg.cluster)
    engine = local_engine(cfg, ctx, strategy, None)
    engine.replayed = replay
    with Progress(ctx, progress, "fault-free check") as bar:
        outcome = run_loop(ctx, strategy, cluster, FailureScript([], iter(())), LocalBackend(engine),
                           SimCache(ctx.cost_model), lambda record: None, bar)
    return outcome.losses, engine.final_state()
