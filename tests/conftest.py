import os
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"  # no network here; tests never talk to W&B
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[1]


def compose(*overrides: str):
    """The config the CLI would build for these overrides (no run folder, no Hydra job)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from ftbench.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run(tmp_path, *overrides: str) -> dict:
    """Execute a run into tmp_path (as the CLI would) and return its summary."""
    from ftbench.run import execute

    cfg = compose("report.progress=false", *overrides)
    return execute(cfg, tmp_path, echo=lambda *_: None)


@pytest.fixture
def run_config(tmp_path):
    return lambda *overrides: run(tmp_path, *overrides)
