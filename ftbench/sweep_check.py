"""The Hydra callback that ends a --multirun sweep (conf/config.yaml, `hydra.callbacks.sweep_check`):
it logs the sweep's W&B table, draws the sweep's plots (ftbench/sweep_plots.py) and makes a
sweep with no "ok" job exit non-zero."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ftbench.metrics import SUMMARY_FILE


def sweep_exit_code(statuses: list[Any]) -> int:
    """0 when some job ended "ok"; 2 when every job ended "error" (a setting to fix); 3 otherwise
    (no job ended "ok": all "oom"/"unrecoverable", a mix, or no summary at all)."""
    if "ok" in statuses:
        return 0
    if statuses and all(status == "error" for status in statuses):
        return 2
    return 3


def _summary_stamps(folder: Path) -> dict[Path, tuple[int, int]]:
    if not folder.is_dir():
        return {}
    stamps = {}
    for path in folder.rglob(SUMMARY_FILE):
        try:
            stat = path.stat()
        except OSError:
            continue
        stamps[path] = (stat.st_ino, stat.st_mtime_ns)
    return stamps


class SweepCheck(Callback):
    """Hydra callback (conf/config.yaml, `hydra.callbacks.sweep_check`): when a --multirun sweep
    ends and no job ended "ok", print why and exit with `sweep_exit_code` (3; 2 when every job
    was a setting error). It reads the summary.json files under the sweep folder that are new
    or rewritten since the sweep started (summaries are replaced atomically, so a rewrite has a
    new inode), which works whichever launcher ran the jobs: in this process, in joblib
    workers, or on SLURM (shared filesystem). A job that raised made Hydra fail already."""

    def __init__(self) -> None:
        self._sweep_dir: Path | None = None
        self._before: dict[Path, tuple[int, int]] = {}

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        self._before = _summary_stamps(self._sweep_dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        before = self._before if sweep_dir == self._sweep_dir else {}
        statuses: list[Any] = []
        for path, stamp in sorted(_summary_stamps(sweep_dir).items()):
            if before.get(path) == stamp:
                continue  # an older sweep's job in a reused folder
            try:
                statuses.append(json.loads(path.read_text(encoding="utf-8")).get("status"))
            except (OSError, ValueError, AttributeError):
                statuses.append(None)
        from omegaconf import OmegaConf

        mode = OmegaConf.select(config, "wandb.mode", default="disabled")
        if statuses and mode != "disabled":  # log_sweep_table honours WANDB_MODE=disabled too  # one W&B table of the sweep's summaries, in the sweep's group
            from ftbench.wandb_sink import log_sweep_table

            log_sweep_table(sweep_dir, OmegaConf.select(config, "wandb"))
        code = sweep_exit_code(statuses)
        if not code:
            from ftbench.sweep_plots import write_plots_quietly
            from ftbench.wandb_report import write_report_quietly

            plots = write_plots_quietly(sweep_dir)
            write_report_quietly(sweep_dir)
            counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(str(s) for s in statuses).items()))
            drawn = f" Plots: {', '.join(p.name for p in plots)}." if plots else ""
            print(f"ftbench: sweep done ({counts}).{drawn} Sweep folder: {sweep_dir}")
        if code:
            counts = ", ".join(f"{n} {status}" for status, n in
                               sorted(Counter(str(s) for s in statuses).items())) or f"no {SUMMARY_FILE}"
            print(f"ftbench: no job of the sweep ended 'ok' ({counts}); exit code {code}.\n"
                  f"Sweep folder: {sweep_dir}", file=sys.stderr)
            sys.exit(code)
