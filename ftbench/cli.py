"""Command line: `ftbench [overrides]` or `python -m ftbench [overrides]` (Hydra).

Exit codes: 0 when the run finished with status "ok"; 2 for a setting the user must fix
(status "error"); 3 when the run ended early as a result ("oom", "unrecoverable"). In a
--multirun sweep a job that ends early is a result like any other: the sweep goes on.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ftbench.config import register_configs
from ftbench.run import execute

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
EXIT_CODES = {"ok": 0, "error": 2, "oom": 3, "unrecoverable": 3}

register_configs()


def compose(overrides):
    """The config `ftbench <overrides>` would run, without a run folder (tests, benchmarks)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg) -> None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multirun else None
    summary = execute(cfg, Path(hc.runtime.output_dir), wandb_group=group)
    status = summary["status"]
    if status != "ok":
        message = textwrap.fill(f"ftbench: run ended with status '{status}'. {summary['error']}", width=100)
        print(f"\n{message}\nRun folder: {hc.runtime.output_dir}", file=sys.stderr)
        if not multirun:
            sys.exit(EXIT_CODES.get(status, 1))


if __name__ == "__main__":
    main()
