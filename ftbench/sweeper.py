"""`hydra/sweeper=ftbench`: Hydra's basic sweeper (the cartesian product of `params` and the
command line's comma lists), minus the combinations an experiment excludes, with one
progress bar over the whole sweep.

A paper table is not a full product: the fault-free baseline has only a fault-free cell, and a
fault-free cell is the same for every seed. An experiment says so with `exclude`, a list of
rules; a job is left out when it matches every key of one rule (a value, or a list of values):

    hydra:
      sweeper:
        exclude:
          - {strategy: none, table.column: [6h, 2h, 30m]}
          - {table.column: fault-free, seed: [1, 2]}

Jobs are launched in batches (the launcher's `n_jobs` at a time, one at a time for the basic
launcher), so the bar moves as cells finish, whichever launcher runs them.
"""
from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


@dataclass
class CellSweeperConf:
    _target_: str = "hydra_plugins.ftbench_sweeper.cell_sweeper.CellSweeper"
    max_batch_size: Optional[int] = None  # jobs per launch (null: the launcher's n_jobs, else 1)
    params: Optional[Dict[str, str]] = None  # key -> comma list, as hydra.sweeper.params of the basic sweeper
    exclude: List[Any] = field(default_factory=list)  # rules {key: value or [values]}; a job matching one is left out
    progress: bool = True  # one progress bar over the sweep's jobs (stderr)


def _job_values(job: Sequence[str]) -> dict[str, str]:
    values = {}
    for override in job:
        key, _, value = override.partition("=")
        values[key.lstrip("+~")] = value
    return values


def _matches(rule: dict, values: dict[str, str]) -> bool:
    for key, wanted in rule.items():
        options = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        if key not in values or values[key] not in {str(o) for o in options}:
            return False
    return True


def keep_jobs(jobs: list[list[str]], exclude: list[dict]) -> list[list[str]]:
    """The jobs no rule of `exclude` matches."""
    rules = [dict(rule) for rule in exclude]
    return [job for job in jobs if not any(_matches(rule, _job_values(job)) for rule in rules)]


def product(overrides: list) -> list[list[str]]:
    """Every combination of the parsed overrides' values, as `key=value` lists (the basic
    sweeper's cartesian product, in its order: the last key varies fastest). A key given twice
    keeps its last values: the command line's replace the experiment's `params`."""
    lists: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise ValueError(f"{key}: the ftbench sweeper takes comma lists, range() and choice(), "
                                 "not intervals")
            lists[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            lists[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*lists.values())]


class CellSweeper(Sweeper):
    """Written beside Hydra's BasicSweeper rather than derived from it: Hydra re-executes its
    core plugin modules when it scans for plugins, so a subclass would hold a stale base."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 exclude: Optional[List[Any]] = None, progress: bool = True) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.params = params or {}
        self.exclude = [OmegaConf.to_container(r) if OmegaConf.is_config(r) else dict(r) for r in exclude or []]
        self.progress = progress
        self.config = self.launcher = self.hydra_context = None
        self.batch_size: Optional[int] = None  # jobs per launch, set by sweep()

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def _batch_size(self) -> int:
        if self.max_batch_size:
            return self.max_batch_size
        n_jobs = OmegaConf.select(self.config, "hydra.launcher.n_jobs", default=None)
        if isinstance(n_jobs, int) and n_jobs > 0:
            return n_jobs
        if isinstance(n_jobs, int):  # joblib's -1: every core
            return os.cpu_count() or 1
        target = str(OmegaConf.select(self.config, "hydra.launcher._target_", default=""))
        return 1 if "BasicLauncher" in target or not target else 10**9  # cluster launchers: one submission

    def jobs(self, arguments: List[str]) -> tuple[list[list[str]], list[list[str]]]:
        """(every combination, the ones `exclude` keeps) of `params` and the command line's
        sweep overrides, as `key=value` lists: what `sweep` launches, without launching."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        params = [f"{key}={value}" for key, value in self.params.items()]
        jobs = product(parser.parse_overrides([*params, *arguments]))
        return jobs, keep_jobs(jobs, self.exclude)

    def sweep(self, arguments: List[str]) -> Any:
        jobs, kept = self.jobs(arguments)
        size = self.batch_size = self._batch_size()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        # The batch size is said, so that a user (and a test) sees what the launcher was given.
        at_once = "all at once" if size >= len(kept) else f"{size} at a time"
        print(f"ftbench: {len(kept)} jobs ({len(jobs) - len(kept)} left out by hydra.sweeper.exclude) "
              f"into {sweep_dir}, launched {at_once}", file=sys.stderr, flush=True)
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(kept), unit="job", desc="sweep", file=sys.stderr, disable=None, leave=True)
        returns = []
        try:
            for first in range(0, len(kept), size):
                batch = kept[first:first + size]
                self.validate_batch_is_legal(batch)
                results = self.launcher.launch(batch, initial_job_idx=first)
                for result in results:
                    _ = result.return_value  # re-raises a job's exception, as the basic sweeper does
                returns.append(results)
                if bar is not None:
                    bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()
        return returns
