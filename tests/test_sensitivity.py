"""The sensitivity table: one row per sweep folder of the same experiment, its own settings,
the reproduction's checks and how each system's cells move."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from ftbench.sensitivity import main, summarize

SPEC = {"name": "t", "rows": {"recycle": "ReCycle", "oobleck": "Oobleck"},
        "columns": {"fault-free": {}, "6h": {"hours": 6}, "30m": {"hours": 0.5}}, "models": {"m": {"label": "M"}},
        "paper": {"m": {"ReCycle": {"6h": 10.0, "30m": 8.0}, "Oobleck": {"6h": 9.0, "30m": 6.0}}}}


def _sweep(folder, overrides, cells):
    """A sweep folder as Hydra and the cells leave it: multirun.yaml and one summary per cell."""
    folder.mkdir(parents=True)
    cfg = {"table": SPEC, "hydra": {"overrides": {"task": ["+experiment=t", "seed=0,1", *overrides]},
                                    "sweeper": {"params": {"seed": "0,1"}}}}
    OmegaConf.save(OmegaConf.create(cfg), folder / "multirun.yaml")
    for k, (strategy, column, throughput) in enumerate(cells):
        cell = folder / f"cell{k}"
        cell.mkdir()
        (cell / "summary.json").write_text(json.dumps(
            {"model": "m", "strategy": strategy, "table": {"name": "t", "column": column}, "seed": 0,
             "status": "ok", "throughput": throughput, "ettr": 0.9}))
    return folder


def test_each_folder_gives_its_settings_checks_and_movement(tmp_path, capsys):
    as_paper = _sweep(tmp_path / "a", [], [("recycle", "6h", 10.0), ("recycle", "30m", 8.0),
                                          ("oobleck", "6h", 9.0), ("oobleck", "30m", 6.0)])
    # longer repairs: both lose more, and Oobleck overtakes nothing; ReCycle twice as high
    other = _sweep(tmp_path / "b", ["failures.repair_hours=4", "wandb.mode=disabled"], [("recycle", "6h", 20.0), ("recycle", "30m", 10.0),
                                                                 ("oobleck", "6h", 9.0), ("oobleck", "30m", 3.0)])
    a, b = summarize(as_paper), summarize(other)
    # (the harness's own settings, W&B here, change no cell and are not the setup's)
    assert a["settings"] == "the experiment as given" and b["settings"] == "`failures.repair_hours=4`"
    assert a["orderings"] == (2, 2) and a["within"] == (4, 4)
    assert b["orderings"] == (2, 2) and b["within"] == (1, 4)
    assert a["systems"]["ReCycle"]["ratio"] == 1.0 and b["systems"]["ReCycle"]["ratio"] == (2.0 * 1.25) ** 0.5
    assert b["systems"]["Oobleck"]["kept"] == 3.0 / 9.0 and b["systems"]["Oobleck"]["kept_paper"] == 6.0 / 9.0
    assert main([str(as_paper), str(other), str(tmp_path / "missing")]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 4 and "`failures.repair_hours=4` (b)" in out.out
    assert "skipped" in out.err and main([str(tmp_path / "missing")]) == 2
