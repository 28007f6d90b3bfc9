"""Typed configuration: one dataclass per Hydra config group, registered in the ConfigStore.

The YAML files in `conf/` fill these schemas; Hydra rejects unknown keys and wrong types
while composing. Semantic checks that need several settings at once (pp versus layers,
micro-batches versus the global batch, ...) live in `check()` and raise `ConfigError`,
whose message names the setting and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import uuid

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ftbench.errors import ConfigError


@dataclass
class ModelConfig:
    """A model shape. `name` picks a spec from `models/specs.py`; other fields override it."""
    name: str = "gpt-tiny"  # key of models.specs.MODEL_SPECS
    layers: Optional[int] = None  # transformer blocks (None: from the spec)
    hidden: Optional[int] = None  # model width (None: from the spec)
    heads: Optional[int] = None  # attention heads (None: from the spec)
    vocab: Optional[int] = None  # vocabulary size (None: from the spec)
    seq_len: Optional[int] = None  # default sequence length (None: from the spec)


@dataclass
class HardwareConfig:
    """One GPU kind and its links. Numbers are vendor peaks; `efficiency` is the calibration."""
    name: str = "a100-40gb"  # profile name, for reports
    peak_tflops: float = 312.0  # dense fp16/bf16 peak per GPU, TFLOP/s
    efficiency: float = 0.5  # achieved fraction of peak for transformer ops: the one calibration factor per (model, hardware)
    memory_gb: float = 40.0  # GPU memory, GB (1e9 bytes)
    hbm_gbps: float = 1555.0  # GPU memory bandwidth, GB/s (bounds the optimizer step)
    intra_node_gbps: float = 300.0  # per-GPU bandwidth to GPUs in the same node (NVLink), GB/s
    inter_node_gbps: float = 25.0  # per-GPU bandwidth to other nodes (InfiniBand/Ethernet), GB/s
    link_latency_us: float = 10.0  # fixed cost of one message, microseconds
    storage_gbps: float = 2.0  # checkpoint storage bandwidth per node, GB/s
    restart_s: float = 60.0  # time to restart the training processes and rebuild communicators, s
    rendezvous_s: float = 5.0  # time for surviving processes to agree on membership and rebuild communicators, s
    host_gbps: float = 25.0  # GPU <-> host memory copy bandwidth per GPU (PCIe), GB/s: snapshots and in-memory commits
    op_overhead_s: float = 0.0  # fixed cost of one compute op (launch, dispatch), s: `ftbench calibrate` measures it
    detection_s: float = 0.0  # from a death nobody announced until the survivors agree on it, s
    # fixed cost of writing one checkpoint file (serialise, sha256, write, fsync; a checkpoint's
    # manifest is one more), s: `ftbench calibrate` measures it
    checkpoint_file_s: float = 0.0
    # fixed cost of reading one checkpoint file back and verifying it (open, read, sha256,
    # unpickle), s: `ftbench calibrate` measures it
    checkpoint_load_file_s: float = 0.0
    cores: Optional[int] = None  # cores the job's workers share on one machine (local: 1, one process); null: a device each
    measured: Optional[Any] = None  # op times `ftbench calibrate` measured for one model, micro-batch and seq_len
    provenance: Optional[Any] = None  # where a measured profile comes from: host, CPU/GPU, torch, date, command


@dataclass
class ClusterConfig:
    """The worker grid: node id = pipeline * pp + stage when gpus_per_node is 1."""
    pp: int = 4  # pipeline stages per pipeline
    dp: int = 2  # data-parallel pipelines
    nodes: Optional[int] = None  # nodes in the job (None: pp*dp/gpus_per_node); strategies that pick their own shape use it
    gpus_per_node: int = 1  # GPUs (workers) per node; a node failure takes all of them
    spares: int = 0  # standby nodes that can replace failed ones
    replacement_s: float = 45.0  # time for a replacement node to come up, s
    placement: str = "pipeline"  # pipeline (a node holds consecutive stages of one pipeline) | stage (one stage of gpus_per_node pipelines)


@dataclass
class TrainConfig:
    """What one run trains. Stops at `iterations` or `max_hours`, whichever comes first."""
    iterations: int = 20  # training iterations (optimizer steps)
    max_hours: Optional[float] = None  # stop after this many hours (simulated hours on sim)
    microbatches: Optional[int] = None  # micro-batches per pipeline per iteration (None: global_batch/(dp*microbatch_size), else 8)
    microbatch_size: int = 1  # samples per micro-batch
    seq_len: Optional[int] = None  # tokens per sample (None: the model's seq_len)
    global_batch: Optional[int] = None  # samples per iteration (None: dp*microbatches*microbatch_size); kept fixed under failures
    lr: float = 1e-3  # AdamW learning rate (local/dist backends)
    weight_decay: float = 0.0  # AdamW weight decay (local/dist backends)
    data: str = "synthetic"  # synthetic (seeded token stream) | text (a local file, byte-level tokens); local/dist
    data_path: Optional[str] = None  # text: the file to read
    recompute: str = "none"  # activation recomputation: none | full (stash only each stage's input; re-run F before the backward)
    overlap_grad_reduce: bool = False  # all-reduce gradients in per-layer buckets during the last micro-batch's backward (Megatron's --overlap-grad-reduce); false: after it (DeepSpeed)
    data_parallel: str = "synchronous"  # synchronous (gradients all-reduced every step) | localsgd | diloco: each pipeline steps on its own gradients, replicas meet every sync_every steps (ftbench/local_sgd.py)
    sync_every: int = 500  # localsgd/diloco: optimizer steps between syncs (H = 500: DiLoCo, arXiv 2311.08105)
    outer_lr: float = 0.7  # diloco: the outer Nesterov SGD's learning rate (DiLoCo, arXiv 2311.08105)
    outer_momentum: float = 0.9  # diloco: the outer SGD's Nesterov momentum (DiLoCo, arXiv 2311.08105)


@dataclass
class ScheduleConfig:
    """The pipeline schedule generator for one iteration."""
    name: str = "1f1b"  # gpipe | 1f1b | zb-h1


@dataclass
class BackendConfig:
    """Which executor runs plans."""
    name: str = "sim"  # sim | local | dist
    memoize: bool = True  # sim: simulate each distinct plan once
    dtype: str = "float32"  # local/dist: float32 | float64 (parameters, activations, optimizer state)
    clock: Optional[str] = None  # model | wall; None: model on sim, wall on local/dist (see ftbench/loop.py)
    threads: Optional[int] = None  # local/dist: torch threads; None: from usable CPUs and model size (threads.py)
    timeout_s: float = 60.0  # dist: deadline of every point-to-point and collective wait, s
    deadline_s: Optional[float] = None  # dist: deadline of the whole job, s; None: timeout_s x (iterations + 10)
    unannounced: str = "recover"  # dist: a death no failure script announced (a crash): recover | stop
    kill: Optional[str] = None  # dist, chaos tests: "RANK:ITERATION:OPS", that process dies unannounced there
    stall: Optional[str] = None  # dist, chaos tests: "RANK:ITERATION:SECONDS", that process pauses in that recovery
    launcher: str = "self"  # dist: self (this machine) | torchrun (this process coordinates torchrun's ranks)
    store_port: int = 29500  # dist, launcher=torchrun: the port of the job's store this process hosts


@dataclass
class FailureEventConfig:
    """One scripted membership change. Give `iteration` or `time_s`, not both."""
    node: int = 0  # node id (worker id when gpus_per_node is 1)
    iteration: Optional[int] = None  # the iteration during which it strikes
    time_s: Optional[float] = None  # wall/simulated seconds since start
    kind: str = "fail"  # fail | join
    at: Optional[float] = None  # with `iteration`: where in it the failure strikes, a fraction in [0, 1) of the iteration's simulated timeline (None: failures.at)


@dataclass
class FailuresConfig:
    """Where failures come from. `kind` is set by the group option (failures=...)."""
    kind: str = "none"  # none | scripted | interval | poisson | trace
    events: List[FailureEventConfig] = field(default_factory=list)  # scripted: the events
    at: Optional[float] = None  # scripted: where in its iteration an event by iteration strikes, a fraction in [0, 1) of the simulated timeline (None: 0.5); an event's own `at` wins
    every: Optional[str] = None  # interval: period, e.g. 30m, 6h, 1d
    count: Optional[int] = None  # interval/poisson/trace: stop after this many failures (None: no limit)
    mtbf_hours: Optional[float] = None  # poisson: mean time between failures of one node, hours
    job_mtbf_hours: Optional[float] = None  # poisson, instead of mtbf_hours: mean hours between failures of the whole job: one Poisson process striking a live node at random (Young/Daly reads a node MTBF of this x nodes)
    repair_hours: Optional[float] = None  # poisson: a failed node rejoins after this long (None: never)
    path: Optional[str] = None  # trace: CSV of `milliseconds,add|remove,nodeN` rows (times shifted so the first row is t=0)
    end_at_last_event: bool = True  # trace: the run ends at the trace's last event (as the Oobleck artifact does), or earlier at train.iterations / train.max_hours; false: only those end it
    seed: Optional[int] = None  # RNG seed of interval/poisson (None: the run's seed)


@dataclass
class WandbConfig:
    """Weights & Biases sink. Offline runs land in the run folder, which holds all `wandb sync`
    needs (artifacts too): from inside it, `wandb sync wandb/offline-run-*` uploads them."""
    mode: str = "${oc.env:WANDB_MODE,offline}"  # offline | online | disabled (default: $WANDB_MODE, else offline)
    project: str = "ftbench"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user); None: the default one
    group: Optional[str] = None  # W&B group; None: one group per sweep (the sweep folder's name)


@dataclass
class ReportConfig:
    """What the run draws into its folder."""
    gantt: bool = True  # PNG Gantt chart of one simulated iteration
    progress: bool = True  # progress bar on the console (a terminal), else progress lines (progress_every_s)
    progress_every_s: Optional[float] = 30.0  # console not a terminal (nohup, SLURM, CI): a progress line this often, s (null: none)
    check_fault_free: bool = True  # local: after a run, train again without failures and compare losses and weights
    skip_done: bool = False  # --multirun: a job whose folder already holds an "ok" summary.json of the same overrides is not run again


@dataclass
class CalibrateConfig:
    """Fit `hardware.efficiency`, the one fitted number per model, to a published fault-free
    cell: the efficiency at which the reference system's fault-free run (on sim, this setup)
    trains at `throughput`. Everything under failures then comes from the mechanisms."""
    throughput: Optional[float] = None  # target fault-free samples/s (null: no fit, hardware.efficiency as given)
    strategy: Any = field(default_factory=lambda: {"name": "none"})  # the reference system: a strategy config, e.g. {name: oobleck}
    overrides: List[str] = field(default_factory=list)  # dotted settings of the reference run only, e.g. [cluster.nodes=30]
    source: str = ""  # where the target comes from (shown in reports)


@dataclass
class TableConfig:
    """A paper table as a sweep (conf/experiment/*-table*.yaml): which cell this run is, the
    per-model and per-column setups that interpolate into the run's settings, and the
    published cells the sweep's report sets ours beside. Unused outside such experiments."""
    name: Optional[str] = None  # the table (e.g. recycle, oobleck-table2); null: this run is no table cell
    title: str = ""  # the table's caption in reports
    column: Optional[str] = None  # this cell's column (a key of `columns`)
    columns: Any = field(default_factory=dict)  # column -> its settings (failure rate, trace, ...)
    models: Any = field(default_factory=dict)  # model -> its setup (grid, batch, fitted target, ...)
    rows: Any = field(default_factory=dict)  # strategy -> the paper's row label
    strategies: Any = field(default_factory=dict)  # strategy -> its own settings in this table (e.g. {varuna: {save_s: 11.2}})
    paper: Any = field(default_factory=dict)  # model -> row label -> column -> published value ("OOM" or a number)
    sources: Any = field(default_factory=dict)  # setting -> where its value comes from, or "assumption: ..."
    anchors: Any = field(default_factory=list)  # reported whole-job figures shown beside the table as context, never scored
    timeline: Any = field(default_factory=dict)  # {model, column} of throughput_over_time.png (empty: the first model, the last column)


@dataclass
class FTBenchConfig:
    """The whole run. Group defaults are listed in conf/config.yaml."""
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: Any = field(default_factory=lambda: {"name": "none"})  # Any: each strategy brings its own schema
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    table: TableConfig = field(default_factory=TableConfig)
    seed: int = 0  # seeds data, failure draws and everything random


def strategy_schemas() -> dict[str, type]:
    """Each registered strategy's settings schema, by strategy name (ftbench/strategies)."""
    from ftbench.strategies import REGISTRY

    return {name: cls.config for name, cls in REGISTRY.items()}


BACKENDS = ("sim", "local", "dist")  # backend=...; which of them run is ftbench.run's business


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore. Group YAML files are typed by the top-level
    schema; strategies differ in fields, so each `conf/strategy/X.yaml` pulls its schema from
    the `schema/strategy` group, kept apart so it is not offered as a strategy option."""
    from hydra_plugins.ftbench_sweeper.cell_sweeper import register as register_sweeper

    from ftbench.paths import CONF_DIR

    cs = ConfigStore.instance()
    cs.store(name="ftbench_schema", node=FTBenchConfig)
    register_sweeper()  # hydra/sweeper=ftbench: the paper tables' sweeps
    for name, node in strategy_schemas().items():
        cs.store(group="schema/strategy", name=name, node=node)
        if not (CONF_DIR / "strategy" / f"{name}.yaml").exists():  # another package's: no YAML file needed
            cs.store(group="strategy", name=name, node=node)
    if not OmegaConf.has_resolver("cell"):
        OmegaConf.register_new_resolver("cell", _cell)
    if not OmegaConf.has_resolver("run_id"):
        # A short random id per process (cached), so runs started in the same second get
        # distinct folders.
        OmegaConf.register_new_resolver("run_id", lambda: uuid.uuid4().hex[:4], use_cache=True)


def _cell(section: str, key: str, *more: str, _root_: Any) -> Any:
    """`${cell:models,pp}`: this run's entry of a paper table's section, looked up by the run's
    model (`models`) or column (`columns`) as a literal key (model names hold dots, e.g.
    gpt3-3.35b, which a plain `${table.models.${model.name}.pp}` would split). Further keys go
    deeper: `${cell:models,pp,${strategy.name}}` is the model's `pp` entry for this strategy."""
    table = _root_.table
    owner = {"models": str(_root_.model.name), "columns": str(table.column)}.get(section)
    if owner is None:
        raise ConfigError(f"table.{section}", "cells are looked up in `models` or `columns` only",
                          "write ${cell:models,FIELD} or ${cell:columns,FIELD}")
    entries = table.get(section) or {}
    if owner not in entries:
        raise ConfigError("model" if section == "models" else "table.column",
                          f"'{owner}' is not in this table's {section} ({', '.join(map(str, entries)) or 'none'})",
                          f"pick one of {', '.join(map(str, entries))}")
    value, where = entries[owner], f"table.{section}.{owner}"
    for part in (key, *more):
        if not hasattr(value, "keys") or part not in value:
            raise ConfigError(where, f"it has no '{part}'", f"add {part} to it")
        value, where = value[part], f"{where}.{part}"
    return value


# -- settings the schema accepts but this run would ignore --------------------------------

# backend.* settings that only backend=dist reads (backend.kill and backend.stall are refused
# off dist by ftbench.distributed.launch.refuse_dist_settings, which also checks their form).
DIST_ONLY = ("unannounced", "launcher", "deadline_s", "store_port")


def check(cfg) -> None:
    """Refuse settings that Hydra's schema accepts but that this run would silently ignore
    (RunContext.from_config calls it, before anything runs)."""
    check_table_cell(cfg)
    _check_numbers(cfg)
    _check_strategy_fields(cfg.strategy)
    every = cfg.report.get("progress_every_s")
    if every is not None and not every > 0:  # 0 would print lines without pause
        raise ConfigError("report.progress_every_s", f"must be a positive number of seconds, got {every}",
                          "set e.g. report.progress_every_s=30, or null for no progress lines")
    if not str(cfg.wandb.project).strip():
        raise ConfigError("wandb.project", "is empty", "name the W&B project, e.g. wandb.project=ftbench")
    _check_local_steps(cfg)
    if cfg.train.data_path is not None and cfg.train.data != "text":
        raise ConfigError("train.data_path", f"train.data={cfg.train.data} reads no file, so it would be ignored",
                          "add train.data=text to train on the file, or drop train.data_path")
    backend = str(cfg.backend.name)
    if backend != "sim" and cfg.backend.get("memoize", True) is not True:
        raise ConfigError("backend.memoize", f"only backend=sim reads it, and backend={backend} would ignore it",
                          "drop backend.memoize, or use backend=sim")
    if backend != "dist":
        for key in DIST_ONLY:
            default = getattr(BackendConfig, key)
            if cfg.backend.get(key, default) != default:
                raise ConfigError(f"backend.{key}", f"only backend=dist reads it, and backend={backend} would "
                                  "ignore it", f"drop backend.{key}, or use backend=dist")


def _check_local_steps(cfg) -> None:
    """LocalSGD and DiLoCo settings: read only under them, and only by a strategy that keeps
    each replica's own state (Strategy.trains_local_steps)."""
    from ftbench.local_sgd import ALGORITHMS, LOCAL
    from ftbench.strategies import strategy_class

    t = cfg.train
    algorithm = t.get("data_parallel", "synchronous")
    if algorithm not in ALGORITHMS:
        raise ConfigError("train.data_parallel", f"'{algorithm}' is not one of {', '.join(ALGORITHMS)}",
                          "choose synchronous (the default), localsgd or diloco")
    if algorithm not in LOCAL:
        for key in ("sync_every", "outer_lr", "outer_momentum"):
            if t.get(key) != getattr(TrainConfig, key):
                raise ConfigError(f"train.{key}", "only train.data_parallel=localsgd or diloco reads it, and "
                                  "synchronous training would ignore it",
                                  f"drop train.{key}, or set train.data_parallel=localsgd (or diloco)")
        return
    if t.sync_every is None or t.sync_every < 1:
        raise ConfigError("train.sync_every", f"must be at least 1, got {t.sync_every}",
                          "set train.sync_every to the optimizer steps between syncs, e.g. 500")
    if algorithm != "diloco":
        for key in ("outer_lr", "outer_momentum"):
            if t.get(key) != getattr(TrainConfig, key):
                raise ConfigError(f"train.{key}", "only DiLoCo's outer optimizer reads it, and "
                                  f"train.data_parallel={algorithm} would ignore it",
                                  f"drop train.{key}, or set train.data_parallel=diloco")
    if not 0 <= t.outer_momentum < 1 or not t.outer_lr > 0:
        raise ConfigError("train.outer_lr" if not t.outer_lr > 0 else "train.outer_momentum",
                          f"outer_lr must be above 0 and outer_momentum in [0, 1), got {t.outer_lr} and "
                          f"{t.outer_momentum}", "use DiLoCo's train.outer_lr=0.7 train.outer_momentum=0.9")
    name = str(cfg.strategy.get("name"))
    if not strategy_class(name).trains_local_steps:
        able = ", ".join(f"strategy={n}" for n in _local_step_strategies())
        raise ConfigError("train.data_parallel", f"strategy={name} assumes synchronous data parallelism (every "
                          f"replica of a stage holds the same state), which {algorithm} does not keep",
                          f"use {able}, or train.data_parallel=synchronous")


def _local_step_strategies() -> list[str]:
    from ftbench.strategies import REGISTRY

    return sorted(n for n, cls in REGISTRY.items() if cls.trains_local_steps)


def _check_numbers(node, prefix: str = "") -> None:
    """No setting means anything by nan, and every comparison with it is false, so range checks
    (`train.max_hours > 0`, `hardware.peak_tflops > 0`) would let it through."""
    import math

    from omegaconf import DictConfig, ListConfig

    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for key, value in items:
        name = f"{prefix}[{key}]" if isinstance(node, ListConfig) else f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, (DictConfig, ListConfig)):
            _check_numbers(value, name)
        elif isinstance(value, float) and math.isnan(value):
            raise ConfigError(name, "nan is not a number", f"give {name} a number (or null where it may be unset)")


def _check_strategy_fields(strategy) -> None:
    """The strategy's own checks of settings it would ignore (Strategy.check_settings)."""
    from ftbench.strategies import strategy_class

    strategy_class(str(strategy.get("name"))).check_settings(strategy)


def table_experiments() -> list[str]:
    """The experiments (conf/experiment/*.yaml) that are paper tables: a table with columns."""
    import re

    from ftbench.paths import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")
                  if re.search(r"^table:[ \t]*\n(([ \t]+.*)?\n)*?[ \t]+columns:", p.read_text(encoding="utf-8"), flags=re.MULTILINE))


def check_resolves(cfg) -> None:
    """Every interpolation resolves to a value its setting takes: one reading a paper table's
    entry of the wrong type (`cluster.pp: ${cell:models,pp}`) would otherwise fail inside
    OmegaConf on first use, with a traceback."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):  # one of ours, raised by a resolver (_cell)
            raise err.__cause__ from None
        key = getattr(err, "full_key", None) or "the config"
        raise ConfigError(key, f"its value does not resolve: {str(err).splitlines()[0]}",
                          f"correct what {key} reads (an interpolation, e.g. a paper table's cell), or set "
                          f"{key} directly") from None


def check_table_cell(cfg) -> None:
    """A paper table's cell is one the table has: its settings are looked up by table.column and
    model (`${cell:...}`), which would otherwise fail deep inside OmegaConf, on first use. Outside
    a table, table.column would be ignored. Reads no interpolated value."""
    table = cfg.table
    if not table.name:
        if table.column is not None:
            experiments = table_experiments() or ["..."]
            raise ConfigError("table.column", f"'{table.column}' is set but this run is no paper table's cell "
                              "(table.name is null), so nothing reads it",
                              f"add a table's experiment ({' or '.join(f'+experiment={e}' for e in experiments)}), "
                              "or drop table.column")
        return
    for setting, section, value in (("table.column", "columns", table.column), ("model", "models", cfg.model.name)):
        entries = table.get(section)
        keys = [str(k) for k in entries.keys()] if entries else []
        if keys and str(value) not in keys:
            raise ConfigError(setting, f"'{value}' is not in table '{table.name}' ({section}: {', '.join(keys)})",
                              f"choose one of {', '.join(keys)}")
    if table.column is not None and not table.get("columns"):
        raise ConfigError("table.column", f"table '{table.name}' has no columns, so nothing reads it",
                          "drop table.column")
