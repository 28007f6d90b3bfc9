"""Sweeps as users run them (issue 25, item 6): paper-table cells in parallel batches through the
joblib launcher, a re-run that skips the cells already done, the SLURM recipe through the
submitit launcher (no SLURM here: its config, and what it would submit, are checked), and the
paper table's W&B run, offline."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A few quick simulator cells of ReCycle's table: one hour of simulated training each.
QUICK = ("+experiment=recycle-table", "model=gpt3-medium", "train.max_hours=1")


def _env(**changes: str) -> dict:
    """The environment of a CLI subprocess: no W&B settings of the caller's, one torch thread,
    and the checkout importable wherever the command runs (as an installed ftbench would be)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.update(changes)
    return env


def ftbench(cwd: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftbench", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def load_yaml(path: Path):
    from omegaconf import OmegaConf

    return OmegaConf.load(path)


def cell_summaries(sweep: Path) -> dict[tuple[str, str], dict]:
    """(strategy, column) -> summary of every cell under the sweep folder."""
    out = {}
    for path in sweep.rglob("summary.json"):
        summary = json.loads(path.read_text())
        out[(summary["strategy"], summary["table"]["column"])] = summary
    return out


# --------------------------------------------------------------------------- joblib

@pytest.mark.slow
def test_joblib_runs_table_cells_in_batches_of_n_jobs_and_a_rerun_skips_them(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    # 4 combinations, the DeepSpeed baseline's 30 min cell left out by the experiment: 3 cells,
    # launched 2 at a time (the launcher's n_jobs) by the ftbench sweeper: batches of 2 and 1.
    args = ["--multirun", *QUICK, "strategy=none,recycle", "table.column=fault-free,30m", "seed=0",
            "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}", "wandb.mode=disabled"]
    env = _env(WANDB_MODE="disabled")
    first = ftbench(tmp_path, *args, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "3 jobs (1 left out by hydra.sweeper.exclude)" in first.stderr, first.stderr[-3000:]
    assert "launched 2 at a time" in first.stderr, first.stderr[-3000:]
    # The joblib launcher's own log: what it was handed, batch by batch, and with how many workers.
    launches = re.findall(r"Joblib\.Parallel\(n_jobs=(\d+),.*? is launching (\d+) jobs", first.stdout)
    assert launches == [("2", "2"), ("2", "1")], first.stdout[-3000:]

    cells = cell_summaries(sweep)
    assert set(cells) == {("none", "fault-free"), ("recycle", "fault-free"), ("recycle", "30m")}
    assert {key: s["status"] for key, s in cells.items()} == dict.fromkeys(cells, "ok")
    assert (sweep / "table.md").stat().st_size > 0  # the report callback ran after the parallel jobs

    before = {key: s["throughput"] for key, s in cells.items()}
    second = ftbench(tmp_path, *args, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("skipped (report.skip_done)") == 3, second.stdout[-3000:]
    assert {key: s["throughput"] for key, s in cell_summaries(sweep).items()} == before


# --------------------------------------------------------------------------- SLURM (submitit)

def _readme_slurm_command() -> list[str]:
    """The SLURM sweep of docs/running.md, as its arguments."""
    text = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        command = block.replace("\\\n", " ").strip()
        if command.startswith("ftbench ") and "hydra/launcher=submitit_slurm" in command:
            return shlex.split(command)[1:]
    raise AssertionError("docs/running.md has no `ftbench ... hydra/launcher=submitit_slurm` example")


def _launcher_settings(args: list[str]) -> dict[str, str]:
    return {a.split("=", 1)[0][len("hydra.launcher."):]: a.split("=", 1)[1]
            for a in args if a.startswith("hydra.launcher.")}


# How submitit writes the README's launcher settings into the sbatch file.
SBATCH = {"partition": "--partition={}", "timeout_min": "--time={}", "gpus_per_node": "--gpus-per-node={}",
          "cpus_per_task": "--cpus-per-task={}", "mem_gb": "--mem={}GB"}


@pytest.fixture
def fake_slurm(monkeypatch):
    """submitit's SLURM executor with `srun` and `sbatch` taken out: the sweep goes through the
    launcher and submitit as on a cluster (every job pickled for its array task), and each sbatch
    file is recorded instead of submitted; a job's result reads back its pickled submission."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')")
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import DelayedSubmission
    from submitit.slurm.slurm import SlurmExecutor, SlurmJob

    submitted: list[dict] = []

    def submit(self, command):
        submitted.append({"sbatch": self._make_submission_file_text(command, "uid"),
                          "parameters": dict(self.parameters)})
        return SlurmJob(folder=self.folder, job_id=str(1000 + len(submitted)), tasks=[0])

    def results(job):
        task = DelayedSubmission.load(job.paths.submitted_pickle)  # what the array task would run
        submitted[-1].setdefault("jobs", []).append(list(task.args[0]))
        done = JobReturn(overrides=list(task.args[0]), status=JobStatus.COMPLETED)
        done.return_value = None
        return [done]

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    monkeypatch.setattr(SlurmExecutor, "_submit_command", submit)
    monkeypatch.setattr(SlurmJob, "results", results)
    return submitted


def _multirun(overrides: list[str]):
    """What `ftbench --multirun <overrides>` builds before it launches anything: the config (in
    MULTIRUN mode: comma lists left to the sweeper), its callbacks, and the sweeper with its
    launcher, as Hydra's own multirun does."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    from ftbench import cli

    with initialize_config_dir(config_dir=str(cli.CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = loader.load_configuration("config", cli.default_job_rule(cli.normalise(overrides)),
                                         run_mode=RunMode.MULTIRUN)
        callbacks = Callbacks(cfg)
        callbacks.on_multirun_start(config=cfg, config_name="config")
        sweeper = Plugins.instance().instantiate_sweeper(
            config=cfg, hydra_context=HydraContext(config_loader=loader, callbacks=callbacks),
            task_function=cli._hydra_main.__wrapped__)
        return cfg, sweeper


@pytest.mark.parametrize("table", [False, True], ids=["readme-example", "recycle-table"])
def test_the_slurm_recipe_composes_and_submits_one_array_as_documented(tmp_path, fake_slurm, table, capfd):
    readme = _readme_slurm_command()
    assert "--multirun" in readme
    documented = _launcher_settings(readme)
    assert set(SBATCH) <= set(documented), documented  # the settings the README shows
    if table:  # the paper table through the same launcher settings (docs/reproducing.md); one model
        # and two seeds keep it quick (every job's config is composed before the launch)
        args = ["+experiment=recycle-table", "model=gpt3-medium", "seed=0,1",
                *(a for a in readme if a.startswith("hydra"))]
    else:
        args = [a for a in readme if a != "--multirun"]
    cfg, sweeper = _multirun([*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"])

    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert {k: str(launcher[k]) for k in documented} == documented
    for name in ("account", "qos", "constraint", "array_parallelism"):  # "other settings" the README names
        assert name in launcher, name
    if table:
        assert type(sweeper).__name__ == "CellSweeper" and cfg.hydra.callbacks.table_report
        jobs, expected = sweeper.jobs(list(cfg.hydra.overrides.task))
        assert 1 < len(expected) < len(jobs)  # the experiment's exclusions apply under SLURM too
    else:
        expected = [["strategy=checkpoint", "seed=0"], ["strategy=checkpoint", "seed=1"],
                    ["strategy=checkpoint", "seed=2"], ["strategy=varuna", "seed=0"],
                    ["strategy=varuna", "seed=1"], ["strategy=varuna", "seed=2"]]

    sweeper.sweep(arguments=list(cfg.hydra.overrides.task))

    # One sbatch array with every job (not one submission per job or per batch of n_jobs)...
    assert len(fake_slurm) == 1, [s["parameters"].get("map_count") for s in fake_slurm]
    (array,) = fake_slurm
    swept = [[o for o in job if o.split("=")[0] in {e.split("=")[0] for e in expected[0]}] for job in array["jobs"]]
    assert swept == expected
    assert re.search(rf"#SBATCH --array=0-{len(expected) - 1}%\d+", array["sbatch"]), array["sbatch"]
    # ...with the README's settings as sbatch options.
    for key, option in SBATCH.items():
        assert f"#SBATCH {option.format(documented[key])}\n" in array["sbatch"], (key, array["sbatch"])
    assert load_yaml(tmp_path / "sweep" / "multirun.yaml").hydra.launcher.partition == documented["partition"]
    if table:
        assert "launched all at once" in capfd.readouterr().err


def test_hydra_flags_keep_their_values(tmp_path):
    from ftbench.cli import split_flags

    assert split_flags(["hydra/launcher=joblib", "--cfg", "hydra", "-p", "hydra.launcher", "seed=1"]) == (
        ["--cfg", "hydra", "-p", "hydra.launcher"], ["hydra/launcher=joblib", "seed=1"])
    assert split_flags(["--multirun", "seed=0,1", "--info", "searchpath", "-cn", "config"]) == (
        ["--multirun", "--info", "searchpath", "-cn", "config"], ["seed=0,1"])
    assert split_flags(["--info", "seed=1"]) == (["--info"], ["seed=1"])
    out = ftbench(tmp_path, "--cfg", "hydra", "-p", "hydra.launcher", env=_env(WANDB_MODE="disabled"))
    assert out.returncode == 0 and "BasicLauncher" in out.stdout, out.stderr[-3000:]


def test_readme_cfg_command_lists_the_slurm_launcher_settings(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')")
    text = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    shown = re.search(r"`ftbench (hydra/launcher=submitit_slurm --cfg hydra -p hydra\.launcher)` lists the "
                      r"launcher's\s+other settings \(([^)]*)\)", text)
    assert shown, "docs/running.md no longer says how to list the SLURM launcher's settings"
    out = ftbench(tmp_path, *shown.group(1).split(), env=_env(WANDB_MODE="disabled"))
    assert out.returncode == 0, out.stderr[-3000:]
    listed = {line.split(":")[0] for line in out.stdout.splitlines() if re.match(r"\w+:", line)}
    named = [n.strip() for n in shown.group(2).split(",") if n.strip() not in ("...", "")]
    assert named and set(named) <= listed, (named, out.stdout)
    assert "SlurmLauncher" in out.stdout


# --------------------------------------------------------------------------- W&B (offline)

@pytest.mark.slow
def test_a_table_sweep_logs_its_paper_table_to_wandb_offline_in_the_sweeps_group(tmp_path):
    from test_metrics import history_rows, of_type, wandb_records

    sweep = tmp_path / "sweep"
    env = _env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb-dir"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    out = ftbench(tmp_path, "--multirun", *QUICK, "strategy=recycle", "table.column=fault-free,30m", "seed=0",
                  f"hydra.sweep.dir={sweep}", env=env)
    assert out.returncode == 0, out.stderr[-3000:]

    # one group per sweep: the sweep folder's name with the date (ftbench.wandb_sink.wandb_group)
    assert load_yaml(sweep / "multirun.yaml").wandb.group is None
    from ftbench.wandb_sink import wandb_group
    group = wandb_group(sweep.name, sweep)
    assert group.endswith("_sweep")
    runs = {}
    for path in sweep.rglob("offline-run-*/run-*.wandb"):
        records = wandb_records(path)
        (run,) = of_type(records, "run")
        runs.setdefault(run.job_type, []).append((path, run, records))
    (table_run,) = runs["paper-table"]
    path, run, records = table_run
    assert path.parent.parent == sweep / "wandb"  # the sweep's own run, in the sweep folder
    assert run.run_group == group and run.display_name == f"{group}-recycle"
    cells = runs["recycle"]  # the cells' runs (job type: the strategy) are in the same group
    assert len(cells) == 2 and {r.run_group for _, r, _ in cells} == {group}

    first = history_rows(records)[0]
    assert first["paper_table/_type"] == "table-file"
    assert first["throughput_vs_failures/_type"] == first["throughput_over_time/_type"] == "image-file"
    logged = json.loads((path.parent / "files" / first["paper_table/path"]).read_text())
    rows = [dict(zip(logged["columns"], row)) for row in logged["data"]]
    written = list(csv.DictReader(open(sweep / "table.csv", encoding="utf-8")))
    assert [(r["system"], r["column"], r["status"]) for r in rows] == \
        [(r["system"], r["column"], r["status"]) for r in written] == \
        [("ReCycle", "fault-free", "ok"), ("ReCycle", "30m", "ok")]
    assert [r["throughput"] for r in rows] == pytest.approx([float(r["throughput"]) for r in written])
    assert rows[1]["paper"] == 22.27  # the paper's cell beside ours, as in table.md
    for name in ("throughput_vs_failures", "throughput_over_time"):
        assert (path.parent / "files" / first[f"{name}/path"]).stat().st_size > 0
