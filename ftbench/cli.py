"""Command line: `ftbench [overrides]` or `python -m ftbench [overrides]` (Hydra).

`ftbench --version` is answered before Hydra starts; `ftbench --help` is Hydra's app help
with the template in conf/config.yaml. Neither imports torch: ftbench.run imports the local
backend only when a local run starts (tests/test_startup.py).

Exit codes: 0 when the run finished with status "ok"; 2 for a setting the user must fix
(status "error"); 3 when the run ended early as a result ("oom", "unrecoverable"); 4 when a
local run's own equivalence check found it trained another model than fault-free training
(status "diverged": a bug in a strategy or the harness); 5 when a dist process died where no
failure was scripted and backend.unannounced=stop ended the run (status "died"). In a
--multirun sweep a job that ends early is a result like any other: the sweep goes on, and
exits 0 when at least one job ended "ok"; when none did, 3 (2 when every job was a setting
error), from the Hydra callback ftbench.sweep_check.SweepCheck (conf/config.yaml,
hydra.callbacks), which reads the sweep's summary.json files whatever launcher ran the jobs.
Hydra's own failures (an unknown option, a job that raised) exit 1.
"""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ftbench.config import check_resolves, check_table_cell, register_configs
from ftbench.errors import ConfigError
from ftbench.paths import CONF_DIR
from ftbench.run import AVAILABLE_BACKENDS, execute

EXIT_CODES = {"ok": 0, "error": 2, "oom": 3, "unrecoverable": 3, "diverged": 4, "died": 5, "interrupted": 130}
DISTRIBUTION = "ftbench"


def version_text() -> str:
    """`ftbench --version`: this package's version, then Hydra's and torch's, all read from the
    installed packages' metadata (importing torch would take seconds)."""
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    own = installed(DISTRIBUTION) or _pyproject_version() or "unknown"
    others = [f"{label} {v}" for label, v in (("hydra", installed("hydra-core")), ("torch", installed("torch"))) if v]
    return f"ftbench {own}" + (f" ({', '.join(others)})" if others else "")


def _pyproject_version() -> str | None:
    """The version in the checkout's pyproject.toml (running from a checkout that is not installed)."""
    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    except OSError:
        return None
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.MULTILINE)
    return match.group(1) if match else None


def _help_groups(choices=None) -> str:
    """The config groups and their options for `ftbench --help` (conf/config.yaml's template):
    the folders of conf/ that hold option files, the option this command line selects marked
    with *. Unlike Hydra's $APP_CONFIG_GROUPS it leaves out the internal schema/ groups and
    marks backends that are not implemented yet."""
    chosen = dict(choices or {})
    lines = []
    for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in folder.glob("*.yaml"))
        if not options:
            continue
        shown = []
        for option in options:
            label = f"*{option}" if chosen.get(folder.name) == option else option
            if folder.name == "backend" and option not in AVAILABLE_BACKENDS:
                label += " (not yet)"
            shown.append(label)
        lines.append(f"  {folder.name + ':':<12}{', '.join(shown)}")
    return "\n".join(lines)


def _register_help_resolver() -> None:
    if not OmegaConf.has_resolver("ftbench_help_groups"):
        OmegaConf.register_new_resolver("ftbench_help_groups", _help_groups)


register_configs()
_register_help_resolver()


def compose(overrides):
    """The config `ftbench <overrides>` would run, without a run folder (tests, benchmarks)."""
    return _compose_raw(default_job_rule(normalise(overrides)))


def normalise(overrides) -> list[str]:
    """`+experiment=X` (the spelling of Hydra's docs and the lightning-hydra template) means
    `experiment=X` here: conf/config.yaml lists `experiment: null` so that both work."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


def _compose_raw(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


# Changing any of these makes a run another job than the embedded default one, so the default
# job's scripted failure (node 5 in iteration 5 of gpt-tiny on pp 4 x dp 2) no longer applies.
OTHER_JOB = ("backend", "model", "cluster", "cluster.pp", "cluster.dp", "cluster.gpus_per_node", "cluster.nodes",
             "cluster.placement")
DEFAULT_JOB_FAILURE_ITERATION = 5  # conf/failures/scripted.yaml
_DEFAULTS: list = []  # the default job's composed config, once


def default_job_rule(overrides) -> list[str]:
    """The default job's failure script applies to the default job only: with another backend,
    model or grid than the default job's, or too few iterations to reach it, and no `failures`
    setting of the user's own, the run has no failures (`failures=none`). Experiments pin
    their own."""
    overrides = list(overrides)
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    if any(k == "failures" or k.startswith("failures.") or k == "experiment" for k in keys):
        return overrides
    short = "train.iterations" in keys and _all_at_most(keys["train.iterations"], DEFAULT_JOB_FAILURE_ITERATION)
    if short or any(k in OTHER_JOB and not _is_default(k, v) for k, v in keys.items()):
        return [*overrides, "failures=none"]
    return overrides


def _is_default(key: str, value: str) -> bool:
    """Whether `key=value` leaves the default job as it is (e.g. backend=local, cluster.dp=2)."""
    if not _DEFAULTS:
        _DEFAULTS.append(_compose_raw([]))
    default = _DEFAULTS[0]
    if key == "cluster":
        return value == "default"
    if key in ("backend", "model"):
        return value == default[key].name
    return OmegaConf.select(default, key) is not None and str(OmegaConf.select(default, key)) == value


def _all_at_most(value: str, limit: int) -> bool:
    try:
        return all(int(v) <= limit for v in value.split(","))
    except ValueError:
        return False


# Hydra's flags that take a value as the next argument (`--cfg hydra`, `-p hydra.launcher`), and
# `--info`, whose value is optional (hydra._internal.utils.get_args_parser).
_FLAG_VALUES = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun"}
_FLAG_OPTIONAL_VALUES = {"--info", "-i"}


def split_flags(args) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides) of a command line, in their order:
    `--cfg hydra -p hydra.launcher model=x` gives (["--cfg", "hydra", "-p", "hydra.launcher"],
    ["model=x"]). A flag's value is never taken for an override."""
    flags: list[str] = []
    overrides: list[str] = []
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            overrides.append(arg)
        else:
            flags.append(arg)
            takes = arg in _FLAG_VALUES or (arg in _FLAG_OPTIONAL_VALUES and i + 1 < len(args)
                                            and "=" not in args[i + 1] and not args[i + 1].startswith("-"))
            if takes and i + 1 < len(args):
                i += 1
                flags.append(args[i])
        i += 1
    return flags, overrides


def main() -> None:
    """The `ftbench` console script: `--version` and `calibrate` here, everything else through Hydra."""
    args = sys.argv[1:]
    if args[:1] == ["calibrate"]:  # measure this machine (ftbench.measure): argparse, not Hydra
        from ftbench.measure.cli import main as calibrate

        sys.exit(calibrate(args[1:], prog="ftbench calibrate"))
    if "--version" in args or "-V" in args:
        print(version_text())
        return
    flags, overrides = split_flags(args)
    overrides = normalise(overrides)
    if not flags:  # a single run: Hydra's own rejections become a setting error (exit 2), with a run folder
        from ftbench.config_errors import explain_composition_error

        try:
            check_before_run(compose(default_job_rule(overrides)))
        except Exception as err:  # noqa: BLE001 - Hydra raises several kinds for a bad command line
            sys.exit(explain_composition_error(err, overrides, CONF_DIR))
    sys.argv[1:] = [*flags, *default_job_rule(overrides)]
    try:
        _hydra_main()
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (run.Terminated): one line, not a traceback
        from ftbench.run import Terminated

        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted (Ctrl-C)"
        folder = getattr(err, "run_dir", None)
        kept = f"; {folder} keeps what was done (summary.json, metrics.jsonl)" if folder else ""
        print(f"\nftbench: {what}{kept}", file=sys.stderr)
        sys.exit(143 if isinstance(err, Terminated) else 130)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg) -> None:
    from ftbench.run_tables import swept_keys

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multirun else None
    overrides = list(hc.overrides.task)
    try:  # before anything reads the cell's settings: a missing cell fails inside OmegaConf
        check_before_run(cfg)
    except ConfigError as err:
        _refuse(err, Path(hc.runtime.output_dir), cfg, overrides, multirun)
        return
    if multirun and cfg.report.skip_done and _done(Path(hc.runtime.output_dir), overrides):
        print(f"ftbench: {hc.runtime.output_dir} already holds this job's ok summary.json: skipped "
              "(report.skip_done)")
        return
    # This job's overrides (a sweep's job: its own values), and the keys the sweep varies, read
    # from the multirun.yaml Hydra saved before launching: the same answer in every launcher.
    summary = execute(cfg, Path(hc.runtime.output_dir), wandb_group=group, overrides=overrides,
                      swept=swept_keys(hc.sweep.dir) if multirun else [],
                      cache_dir=Path(hc.sweep.dir) if multirun else None)
    status = summary["status"]
    if status != "ok":
        # (names such as in-process-restart stay whole: a reader searches for them)
        message = textwrap.fill(f"ftbench: run ended with status '{status}'. {summary['error']}", width=100,
                                break_on_hyphens=False)
        print(f"\n{message}\nRun folder: {hc.runtime.output_dir}", file=sys.stderr)
        if not multirun:
            sys.exit(EXIT_CODES.get(status, 1))


def check_before_run(cfg) -> None:
    """What must hold before a run reads its settings: a paper table's cell is one the table has,
    and every interpolation resolves (both fail deep inside OmegaConf otherwise)."""
    check_table_cell(cfg)
    check_resolves(cfg)


def _refuse(err: ConfigError, run_dir: Path, cfg, overrides: list[str], multirun: bool) -> None:
    """A setting error found before the run starts: its summary.json (a sweep's report counts
    it), the paragraph, and exit 2 outside a sweep."""
    from ftbench.metrics import SUMMARY_KEYS, write_summary

    summary = {**dict.fromkeys(SUMMARY_KEYS), "strategy": str(cfg.strategy.name), "backend": str(cfg.backend.name),
               "model": str(cfg.model.name), "iterations": 0, "failures": 0, "recoveries": [], "status": "error",
               "error": str(err), "overrides": overrides}
    write_summary(run_dir, summary)
    print(textwrap.fill(f"ftbench: {err}", width=100, break_on_hyphens=False) + f"\nRun folder: {run_dir}",
          file=sys.stderr)
    if not multirun:
        sys.exit(EXIT_CODES["error"])


def _done(run_dir: Path, overrides: list[str]) -> bool:
    """Whether `run_dir` holds an "ok" summary of a job with these overrides (a re-run sweep's
    finished cell). Its summary is rewritten as it was (a new file), so the sweep's end
    (SweepCheck, the table report) counts it among this sweep's jobs."""
    import json

    from ftbench.metrics import SUMMARY_FILE, write_summary

    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if summary.get("status") != "ok" or summary.get("overrides") != overrides:
        return False
    write_summary(run_dir, summary)
    return True


if __name__ == "__main__":
    main()
