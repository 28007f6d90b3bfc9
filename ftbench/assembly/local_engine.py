"""The local engine of a run: its data source, its checkpoint store and Swift's boundary log,
each inside the run folder. Shared by local runs and the fault-free references."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ftbench.checkpoint_schedule import keeps_files
from ftbench.engine.host_memory import run_host_memory
from ftbench.errors import ConfigError
from ftbench.folders import inside

if TYPE_CHECKING:
    from ftbench.engine.local import LocalEngine


def local_engine(cfg, ctx, strategy, run_dir: Path | None, log=None) -> LocalEngine:
    from ftbench.checkpoint import CheckpointStore, CheckpointWarning
    from ftbench.engine.local import LocalEngine
    from ftbench.models.data import make_source

    try:
        data = make_source(cfg.train.data, ctx.spec, ctx.seq_len, ctx.seed, cfg.train.data_path)
    except ValueError as err:
        raise ConfigError("train.data_path" if cfg.train.data == "text" else "train.data", str(err),
                          "point train.data_path at a local text file, or use train.data=synthetic") from None
    store = on_skip = None
    if run_dir is not None and keeps_files(strategy):
        if log is not None:  # a skipped checkpoint is a metrics line, not only a warning
            def on_skip(reason: str, iteration: int) -> None:
                log({"event": "checkpoint_skipped", "iteration": iteration, "reason": reason})
                warnings.warn(reason, CheckpointWarning, stacklevel=2)
        store = CheckpointStore(run_dir / "checkpoints", keep=cfg.strategy.get("keep", 2), on_skip=on_skip)
    boundary_log = None
    if run_dir is not None and strategy.log_dir:  # Swift's boundary log, in the run folder
        from ftbench.engine.boundary_log import BoundaryLog
        boundary_log = BoundaryLog(inside(run_dir, "strategy.log_dir", strategy.log_dir))
    engine = LocalEngine(ctx, data, cfg.train.lr, cfg.train.weight_decay, store, cfg.backend.dtype, boundary_log)
    engine.iteration_work = strategy.iteration_work  # (Swift's logging)
    engine.host_memory = run_host_memory(cfg, strategy, run_dir, on_skip)
    return engine

