"""Every config option composes and resolves; bad values are named with their fix."""
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from conftest import compose
from ftbench.cli import CONF_DIR
from ftbench.context import RunContext
from ftbench.errors import ConfigError

GROUPS = ["model", "strategy", "cluster", "failures", "backend", "hardware", "schedule", "experiment"]
STABLE = {
    "backend": {"sim", "local", "dist"},
    "model": {"gpt-tiny", "gpt2-xl", "gpt3-medium", "gpt3-xl", "gpt3-2.7b", "gpt3-3.35b", "gpt3-6.7b", "bert-large"},
    "strategy": {"none"},
    "schedule": {"gpipe", "1f1b", "zb-h1"},
    "hardware": {"a100-40gb", "a100-80gb", "v100-16gb", "h100", "h200", "cpu"},
    "failures": {"none", "scripted", "interval", "poisson", "trace"},
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_the_stable_option_names_exist():
    for group, names in STABLE.items():
        assert names <= set(options(group)), group


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_resolves(group, option):
    cfg = compose(f"{group}={option}")
    ctx = RunContext.from_config(cfg)
    assert ctx.microbatches >= 1 and ctx.global_batch >= 1


def test_stable_override_names_compose():
    cfg = compose("cluster.pp=2", "cluster.dp=3", "cluster.nodes=7", "cluster.gpus_per_node=1", "cluster.spares=1",
                  "cluster.replacement_s=30", "train.iterations=5", "train.max_hours=1.5", "train.microbatches=4",
                  "train.microbatch_size=2", "train.seq_len=16", "seed=3", "wandb.mode=offline",
                  "failures=scripted", "failures.events=[{iteration:3,node:5},{time_s:2.5,node:1,kind:join}]")
    assert cfg.failures.events[0].iteration == 3 and cfg.failures.events[1].kind == "join"
    assert RunContext.from_config(cfg).global_batch == 3 * 4 * 2
    for extra in (["failures=interval", "failures.every=6h"], ["failures=poisson", "failures.mtbf_hours=100"],
                  ["failures=trace", "failures.path=1h.csv"], ["train.global_batch=24"]):
        RunContext.from_config(compose(*extra))


@pytest.mark.parametrize("override,setting", [
    ("cluster.pp=abc", "cluster.pp"),
    ("train.nosuch=1", "train.nosuch"),
    ("model=nosuch", "model"),
    ("schedule=nosuch", "schedule"),
    ("hardware=nosuch", "hardware"),
])
def test_bad_overrides_fail_composition_naming_the_setting(override, setting):
    with pytest.raises((HydraException, OmegaConfBaseException)) as err:
        compose(override)
    assert setting in str(err.value)


@pytest.mark.parametrize("overrides,setting", [
    (["cluster.pp=0"], "cluster.pp"),
    (["cluster.dp=0"], "cluster.dp"),
    (["cluster.pp=9"], "cluster.pp"),  # gpt-tiny has 8 layers
    (["train.global_batch=15"], "train.global_batch"),  # not a multiple of dp=2
    (["train.global_batch=16", "train.microbatches=3"], "train.microbatches"),
    (["train.microbatches=0"], "train.microbatches"),
    (["train.iterations=0"], "train.iterations"),
    (["train.max_hours=-1"], "train.max_hours"),
    (["train.seq_len=4096"], "train.seq_len"),
    (["model.heads=5"], "model.heads"),
    (["hardware.efficiency=1.5"], "hardware.efficiency"),
    (["hardware.memory_gb=0"], "hardware.memory_gb"),
    (["backend.name=gpu"], "backend"),
    (["schedule.name=interleaved"], "schedule"),
    (["wandb.mode=sometimes"], "wandb.mode"),
    (["cluster.spares=-1"], "cluster.spares"),
])
def test_semantic_errors_name_the_setting_and_the_fix(overrides, setting):
    with pytest.raises(ConfigError) as err:
        RunContext.from_config(compose(*overrides))
    assert err.value.setting == setting
    assert setting in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize("overrides,setting", [
    (["failures.every=6h"], "failures.every"),  # forgot failures=interval
    (["failures=interval", "failures.every=soon"], "failures.every"),
    (["failures=scripted", "failures.events=[{iteration:1,node:99}]"], "failures.events[0]"),
    (["failures=trace", "failures.path=nosuch.csv"], "failures.path"),
    (["cluster.nodes=3"], "cluster.nodes"),  # pp*dp = 8 workers need 8 nodes
    (["failures=trace", "failures.path=6h.csv", "cluster.nodes=8"], "cluster.nodes"),  # 30 nodes in the trace, 8 set
    (["failures=trace", "failures.path=6h.csv", "cluster.pp=8", "cluster.dp=4"], "cluster.dp"),  # a grid of 32 on 30
    (["strategy.name=nosuch"], "strategy"),
    (["backend=dist", "failures=poisson", "failures.mtbf_hours=1"], "failures"),  # dist: scripted failures only
])
def test_run_level_errors_become_an_error_status(run_config, overrides, setting):
    s = run_config(*overrides)
    assert s["status"] == "error"
    assert f"`{setting}`" in s["error"]


def test_experiment_file_pins_the_benchmark_setup():
    cfg = compose("experiment=sim-6.7b-1024gpu")
    assert (cfg.model.name, cfg.cluster.pp, cfg.cluster.dp, cfg.train.microbatches) == ("gpt3-6.7b", 8, 128, 64)
    assert cfg.failures.kind == "poisson"


def test_trace_copies_keep_their_provenance():
    traces = Path(CONF_DIR) / "traces"
    readme = (traces / "README.md").read_text()
    for name in ("6h.csv", "1h.csv", "10m.csv", "aws-p3-trace.csv"):
        assert (traces / name).exists() and name in readme
    assert (traces / "LICENSE-oobleck-bamboo-traces.txt").exists()
