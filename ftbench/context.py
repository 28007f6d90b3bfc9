"""The resolved run: settings checked against each other, the model shape, the cost model.

`RunContext.from_config` is the one place that validates combinations of settings; every
failure is a ConfigError naming the setting and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftbench.config import BACKENDS, HardwareConfig, check as check_config
from ftbench.costs import RECOMPUTE_MODES, CostModel
from ftbench.errors import ConfigError
from ftbench.failures import KINDS as FAILURE_KINDS
from ftbench.local_sgd import LocalSteps, local_steps
from ftbench.wandb_sink import WandbSink
from ftbench.plan import Plan, grid_plan
from ftbench.schedule import GENERATORS, generate
from ftbench.models.specs import ModelSpec, resolve_model

# models.data.KINDS, spelled out: importing models.data imports torch, which simulator runs never need
# (tests/test_startup.py checks the two agree).
DATA_KINDS = ("synthetic", "text")  # train.data

DTYPES = ("float32", "float64")  # backend.dtype


@dataclass
class RunContext:
    spec: ModelSpec
    hardware: HardwareConfig
    cost_model: CostModel
    backend: str
    schedule_name: str
    microbatches: int  # per pipeline per iteration
    microbatch_size: int
    seq_len: int
    global_batch: int
    iterations: int
    max_hours: float | None
    seed: int
    node_mtbf_hours: float | None = None  # failures.mtbf_hours (Poisson failures), for checkpoint-interval rules
    # the failure model's rate for the job (FailureScript.job_mtbf_s, failures_per_iteration), set
    # once the script is built: the checkpoint-interval rules' M when no node MTBF is given
    job_mtbf_s: float | None = None
    failures_per_iteration: float | None = None
    recompute: str = "none"  # train.recompute: none | full (activation recomputation; costs and the local engine)
    overlap_grad_reduce: bool = False  # train.overlap_grad_reduce: the cost model's all-reduce overlap (simulated timings)
    local_steps: LocalSteps | None = None  # train.data_parallel=localsgd|diloco (ftbench.local_sgd); None: synchronous
    run_dir: Path | None = None  # the run folder: every path setting resolves inside it (ftbench.folders)
    shared_dir: Path | None = None  # where a sweep's jobs share caches (the sweep folder; None: run_dir)

    @classmethod
    def from_config(cls, cfg) -> "RunContext":
        _check_keys(cfg)
        _check_choices(cfg)
        check_config(cfg)  # settings this run would ignore
        m = cfg.model
        spec = resolve_model(m.name, layers=m.layers, hidden=m.hidden, heads=m.heads,
                             vocab=m.vocab, seq_len=m.seq_len)
        _check_cluster(cfg.cluster, spec)
        _check_hardware(cfg.hardware)
        t = cfg.train
        _positive("train.iterations", t.iterations)
        _positive("train.microbatch_size", t.microbatch_size)
        if t.max_hours is not None and t.max_hours <= 0:
            raise ConfigError("train.max_hours", f"must be positive, got {t.max_hours}",
                              "give a number of hours above zero, or null for no time limit")
        _check_train(cfg, spec)
        seq_len = t.seq_len if t.seq_len is not None else spec.seq_len
        _positive("train.seq_len", seq_len)
        if seq_len > spec.seq_len:
            raise ConfigError("train.seq_len", f"{seq_len} is longer than {spec.name}'s context of {spec.seq_len} tokens",
                              f"use train.seq_len <= {spec.seq_len} or raise model.seq_len")
        microbatches, global_batch = _batch(t, cfg.cluster.dp)
        steps = local_steps(t, _split(global_batch // t.microbatch_size, cfg.cluster.dp), t.microbatch_size)
        hardware = _plain(cfg.hardware)  # the cost model reads it in hot loops: no DictConfig there
        return cls(spec=spec, hardware=hardware,
                   cost_model=CostModel(spec, hardware, t.microbatch_size, seq_len, t.recompute,
                                        bool(t.overlap_grad_reduce), steps),
                   backend=cfg.backend.name, schedule_name=cfg.schedule.name,
                   microbatches=microbatches, microbatch_size=t.microbatch_size, seq_len=seq_len,
                   global_batch=global_batch, iterations=t.iterations, max_hours=t.max_hours,
                   seed=cfg.seed, node_mtbf_hours=cfg.failures.mtbf_hours, recompute=t.recompute,
                   overlap_grad_reduce=bool(t.overlap_grad_reduce), local_steps=steps)

    def grid_plan(self, pp: int, dp: int, gpus_per_node: int = 1, schedule: str | None = None, node_of=None) -> Plan:
        """The regular grid under the configured (or given) schedule, layers balanced over stages.
        With a dp other than the configured one, the global batch is kept: its micro-batches
        are split over the dp pipelines as evenly as they go."""
        sched = generate(schedule or self.schedule_name, pp, self.split_microbatches(dp), dp)
        return grid_plan(sched, self.cost_model.balanced_partition(pp), pp, gpus_per_node, node_of=node_of)

    def split_microbatches(self, dp: int) -> tuple[int, ...]:
        """The global batch's micro-batches over dp pipelines (the first ones take one more)."""
        return _split(self.global_batch // self.microbatch_size, dp)


def _split(total: int, dp: int) -> tuple[int, ...]:
    """`total` micro-batches over dp pipelines (the first ones take one more)."""
    if dp > total:
        raise ValueError(f"{dp} pipelines but only {total} micro-batches in the global batch")
    return tuple(total // dp + (1 if d < total % dp else 0) for d in range(dp))


def _plain(node):
    return OmegaConf.to_object(node) if isinstance(node, DictConfig) else node


def _positive(setting: str, value) -> None:
    if value is None or value < 1:
        raise ConfigError(setting, f"must be at least 1, got {value}", f"set {setting} to a positive integer")


# Above this many iterations a local run is refused: it keeps per-iteration records (losses)
# in memory and trains every iteration for real; long horizons are the simulator's job.
LOCAL_MAX_ITERATIONS = 10**7


def schema_keys() -> list[str]:
    """Every dotted setting the schemas define (for suggestions)."""
    import dataclasses

    from ftbench import config

    out = []
    for group, schema in (("model", config.ModelConfig), ("hardware", config.HardwareConfig),
                          ("cluster", config.ClusterConfig), ("train", config.TrainConfig),
                          ("schedule", config.ScheduleConfig), ("backend", config.BackendConfig),
                          ("failures", config.FailuresConfig), ("wandb", config.WandbConfig),
                          ("report", config.ReportConfig)):
        out += [f"{group}.{f.name}" for f in dataclasses.fields(schema)]
    strategy = {f"strategy.{f.name}" for schema in config.strategy_schemas().values() for f in dataclasses.fields(schema)}
    return out + sorted(strategy) + ["seed"]


def _check_keys(cfg) -> None:
    """Refuse keys the schemas (ftbench.config) do not have. Hydra checks `group.key=value`
    overrides against them, but `+group.key=value` adds a key whatever its name (that is what
    `+` means), so a typo Hydra itself suggested (`+train.iters=5`) would be silently ignored."""
    import dataclasses
    import difflib

    from omegaconf import ListConfig

    known: list[str] = []  # every valid dotted key, for suggestions
    unknown: list[tuple[str, list[str]]] = []  # (dotted key, its siblings)

    def walk(node, prefix: str) -> None:
        if isinstance(node, ListConfig):
            for i, item in enumerate(node):
                if isinstance(item, (DictConfig, ListConfig)):
                    walk(item, f"{prefix}[{i}]")
            return
        schema = OmegaConf.get_type(node)
        fields = ([f.name for f in dataclasses.fields(schema)]
                  if isinstance(schema, type) and dataclasses.is_dataclass(schema) else None)
        if fields is not None:
            known.extend(prefix + f for f in fields)
        for key in node.keys():
            name = f"{prefix}{key}"
            if fields is not None and key not in fields and not (prefix == "" and key == "hydra"):
                unknown.append((name, [prefix + f for f in fields]))
                continue
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)) and not child._is_missing() and not child._is_none():
                walk(child, f"{name}.")

    if not isinstance(cfg, DictConfig):
        return
    walk(cfg, "")
    if not unknown:
        return
    name, siblings = unknown[0]
    leaf = name.rsplit(".", 1)[-1]

    def closest(keys: list[str]) -> list[str]:  # compare last parts: the shared prefix says nothing
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
        return [by_leaf[k] for k in difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.6)]

    # the same name under another group (`+iterations=5`), else close names among its
    # siblings, else close names anywhere
    elsewhere = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != name]
    close = elsewhere[:3] or closest(siblings) or closest([k for k in known if "." in k])
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    where = name.rsplit(".", 1)[0] if "." in name else ""
    valid = f"valid keys{' of ' + where if where else ''}: " + ", ".join(s.rsplit(".", 1)[-1] for s in siblings)
    raise ConfigError(name, "no such setting (a key added with `+` is not checked by Hydra, and nothing reads it)",
                      f"{hint}Set an existing key without `+`, e.g. {close[0] if close else siblings[0]}=...; "
                      f"{valid}")


def _check_train(cfg, spec: ModelSpec) -> None:
    """Training settings that a backend would otherwise trip over with a traceback."""
    import math

    t = cfg.train
    for key in ("lr", "weight_decay"):
        value = getattr(t, key)
        if value is None or not math.isfinite(value) or value < 0:
            raise ConfigError(f"train.{key}", f"must be a finite number >= 0, got {value}",
                              f"set train.{key} to a non-negative value, e.g. train.{key}="
                              f"{1e-3 if key == 'lr' else 0.01}")
    if t.seq_len is not None and t.seq_len == 1:
        raise ConfigError("train.seq_len", "1 token per sample leaves nothing to predict: the loss is next-token "
                          "prediction and needs at least 2 tokens", "use train.seq_len >= 2")
    if t.seq_len is None and spec.seq_len < 2:
        raise ConfigError("model.seq_len", f"{spec.seq_len} token per sample leaves nothing to predict: the loss is "
                          "next-token prediction and needs at least 2 tokens", "use model.seq_len >= 2")
    if t.data == "text":
        if spec.vocab < 256:
            raise ConfigError("model.vocab", f"train.data=text uses byte-level tokens (256 values) but {spec.name} "
                              f"has a vocabulary of {spec.vocab}",
                              "set model.vocab=256 (or more), or use train.data=synthetic")
        if not t.data_path:
            raise ConfigError("train.data_path", "train.data=text needs a local text file",
                              "set train.data_path=<file>, or use train.data=synthetic")
    if cfg.backend.name != "sim" and t.iterations is not None and t.iterations > LOCAL_MAX_ITERATIONS:
        raise ConfigError("train.iterations", f"{t.iterations} iterations on backend={cfg.backend.name}: real "
                          f"training is for small iteration counts (at most {LOCAL_MAX_ITERATIONS:,}) and keeps "
                          "a record per iteration in memory",
                          "use backend=sim for long horizons, or give fewer train.iterations")


def _check_choices(cfg) -> None:
    choices = {"backend": BACKENDS, "schedule": tuple(GENERATORS), "failures": FAILURE_KINDS,
               "wandb.mode": WandbSink.MODES, "backend.dtype": DTYPES, "train.data": DATA_KINDS,
               "train.recompute": RECOMPUTE_MODES}
    values = {"backend": cfg.backend.name, "schedule": cfg.schedule.name,
              "failures": cfg.failures.kind, "wandb.mode": cfg.wandb.mode, "backend.dtype": cfg.backend.dtype,
              "train.data": cfg.train.data, "train.recompute": cfg.train.recompute}
    for setting, value in values.items():
        if value not in choices[setting]:
            raise ConfigError(setting, f"unknown option '{value}'", f"choose one of {', '.join(choices[setting])}")


def _check_cluster(c, spec: ModelSpec) -> None:
    _positive("cluster.pp", c.pp)
    _positive("cluster.dp", c.dp)
    _positive("cluster.gpus_per_node", c.gpus_per_node)
    if c.pp > spec.layers:
        raise ConfigError("cluster.pp", f"{c.pp} pipeline stages but {spec.name} has only {spec.layers} layers",
                          f"use cluster.pp <= {spec.layers}")
    if c.spares < 0:
        raise ConfigError("cluster.spares", f"must not be negative, got {c.spares}", "set cluster.spares >= 0")
    if c.replacement_s < 0:
        raise ConfigError("cluster.replacement_s", f"must not be negative, got {c.replacement_s}",
                          "set cluster.replacement_s >= 0 (seconds)")
    if c.nodes is not None:
        _positive("cluster.nodes", c.nodes)


def _check_hardware(hw) -> None:
    for key in ("peak_tflops", "memory_gb", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "storage_gbps",
                "host_gbps"):
        if getattr(hw, key) <= 0:
            raise ConfigError(f"hardware.{key}", f"must be positive, got {getattr(hw, key)}",
                              f"set hardware.{key} to a positive number")
    if not 0 < hw.efficiency <= 1:
        raise ConfigError("hardware.efficiency", f"must be in (0, 1], got {hw.efficiency}",
                          "set the achieved fraction of peak FLOP/s, e.g. hardware.efficiency=0.5")
    for key in ("link_latency_us", "restart_s", "rendezvous_s", "checkpoint_file_s", "checkpoint_load_file_s"):
        if getattr(hw, key) < 0:
            raise ConfigError(f"hardware.{key}", f"must not be negative, got {getattr(hw, key)}", "set a value >= 0")
    cores = getattr(hw, "cores", None)
    if cores is not None and (not isinstance(cores, int) or cores < 1):
        raise ConfigError("hardware.cores", f"must be a whole number of at least 1, got {cores}",
                          "give the cores the job's workers share on one machine (1 for local), or null")


def _batch(t, dp: int) -> tuple[int, int]:
    """Micro-batches per pipeline and the global batch, from whichever of them is set."""
    per_microbatch_row = dp * t.microbatch_size
    if t.global_batch is not None:
        _positive("train.global_batch", t.global_batch)
        if t.global_batch % per_microbatch_row:
            raise ConfigError("train.global_batch",
                              f"{t.global_batch} samples do not split into dp={dp} pipelines x micro-batches "
                              f"of {t.microbatch_size}", f"use a multiple of cluster.dp*train.microbatch_size = {per_microbatch_row}")
        m = t.global_batch // per_microbatch_row
        if t.microbatches is not None and t.microbatches != m:
            raise ConfigError("train.microbatches",
                              f"{t.microbatches} disagrees with train.global_batch={t.global_batch}, which gives {m} "
                              f"per pipeline", "set only one of train.microbatches and train.global_batch")
        return m, t.global_batch
    m = t.microbatches if t.microbatches is not None else 8
    _positive("train.microbatches", m)
    return m, m * per_microbatch_row
