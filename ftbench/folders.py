"""Where a run may write: inside its own folder, and nowhere else.

A path setting (Swift's `strategy.log_dir`, ReCycle's `strategy.plan_cache`) names a folder
relative to the run folder (or, for a cache a sweep's jobs share, the sweep folder). It is
checked twice: as text when the strategy is built (`relative_setting`: not empty, not
absolute, no `..`, not the folder itself, none of the names the run writes itself), and
against the disk when the folder is used (`inside`: resolved through symlinks it must stay
strictly inside, and be a folder if it exists). Both raise ConfigError (exit 2), naming the
setting, so that no setting can make a run write to or delete what it does not own.
"""
from __future__ import annotations

from pathlib import Path, PurePath

from ftbench.errors import ConfigError

# What a run writes at its folder's top level itself: a path setting may not name one of them.
RESERVED = frozenset({".hydra", "checkpoints", "dist", "final_model", "logs", "wandb", "metrics.jsonl",
                      "summary.json", "error.txt", "ftbench.log", "gantt.png"})


def relative_setting(setting: str, value) -> PurePath:
    """`value` as a relative folder name below a run folder, or ConfigError naming `setting`."""
    fix = f"give a folder name relative to the run folder, e.g. {setting}={_example(setting)}"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(setting, f"must name a folder inside the run folder, got {value!r}", fix)
    path = PurePath(value)
    if path.is_absolute() or value.startswith("~"):
        raise ConfigError(setting, f"'{value}' is outside the run folder (an absolute path): a run writes and "
                          "deletes only inside its own folder", fix)
    if ".." in path.parts:
        raise ConfigError(setting, f"'{value}' climbs out with '..': a run writes and deletes only inside its "
                          "own folder", fix)
    parts = [p for p in path.parts if p != "."]
    if not parts:
        raise ConfigError(setting, f"'{value}' is the run folder itself, which holds the run's other outputs", fix)
    if parts[0] in RESERVED:
        raise ConfigError(setting, f"'{value}' is inside '{parts[0]}', which the run writes itself", fix)
    return PurePath(*parts)


def inside(root: Path | str, setting: str, value) -> Path:
    """The folder `value` names below `root`, checked on disk: after resolving symlinks it is
    strictly inside `root`, and it is a folder if it exists (not a file, device or pipe)."""
    relative = relative_setting(setting, value)
    base = Path(root).resolve()
    target = (base / relative).resolve()
    if base not in target.parents:
        raise ConfigError(setting, f"'{value}' leads outside the run folder {base} (to {target}, through a "
                          "symlink): a run writes and deletes only inside its own folder",
                          f"remove the link, or give another folder name, e.g. {setting}={_example(setting)}")
    if target.exists() and not target.is_dir():
        raise ConfigError(setting, f"'{value}' exists and is not a folder ({target})",
                          f"give a folder name that is free, e.g. {setting}={_example(setting)}")
    return base / relative


def _example(setting: str) -> str:
    return {"strategy.log_dir": "swift-logs", "strategy.plan_cache": "plan-cache"}.get(setting, "my-folder")
