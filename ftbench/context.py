"""The resolved run: settings checked against each other, the model shape, the cost model.

`RunContext.from_config` is the one place that validates combinations of settings; every
failure is a ConfigError naming the setting and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from ftbench.config import BACKENDS, HardwareConfig
from ftbench.costs import CostModel
from ftbench.errors import ConfigError
from ftbench.failures import KINDS as FAILURE_KINDS
from ftbench.metrics import WandbSink
from ftbench.plan import Plan, grid_plan
from ftbench.schedule import GENERATORS, generate
from models.data import KINDS as DATA_KINDS
from models.specs import ModelSpec, resolve_model

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

    @classmethod
    def from_config(cls, cfg) -> "RunContext":
        _check_choices(cfg)
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
        seq_len = t.seq_len if t.seq_len is not None else spec.seq_len
        _positive("train.seq_len", seq_len)
        if seq_len > spec.seq_len:
            raise ConfigError("train.seq_len", f"{seq_len} is longer than {spec.name}'s context of {spec.seq_len} tokens",
                              f"use train.seq_len <= {spec.seq_len} or raise model.seq_len")
        microbatches, global_batch = _batch(t, cfg.cluster.dp)
        hardware = _plain(cfg.hardware)  # the cost model reads it in hot loops: no DictConfig there
        return cls(spec=spec, hardware=hardware,
                   cost_model=CostModel(spec, hardware, t.microbatch_size, seq_len),
                   backend=cfg.backend.name, schedule_name=cfg.schedule.name,
                   microbatches=microbatches, microbatch_size=t.microbatch_size, seq_len=seq_len,
                   global_batch=global_batch, iterations=t.iterations, max_hours=t.max_hours,
                   seed=cfg.seed, node_mtbf_hours=cfg.failures.mtbf_hours)

    def grid_plan(self, pp: int, dp: int, gpus_per_node: int = 1, schedule: str | None = None, node_of=None) -> Plan:
        """The regular grid under the configured (or given) schedule, layers balanced over stages.
        With a dp other than the configured one, the global batch is kept: its micro-batches
        are split over the dp pipelines as evenly as they go."""
        sched = generate(schedule or self.schedule_name, pp, self.split_microbatches(dp), dp)
        return grid_plan(sched, self.cost_model.balanced_partition(pp), pp, gpus_per_node, node_of=node_of)

    def split_microbatches(self, dp: int) -> tuple[int, ...]:
        """The global batch's micro-batches over dp pipelines (the first ones take one more)."""
        total = self.global_batch // self.microbatch_size
        if dp > total:
            raise ValueError(f"{dp} pipelines but only {total} micro-batches in the global batch")
        return tuple(total // dp + (1 if d < total % dp else 0) for d in range(dp))


def _plain(node):
    return OmegaConf.to_object(node) if isinstance(node, DictConfig) else node


def _positive(setting: str, value) -> None:
    if value is None or value < 1:
        raise ConfigError(setting, f"must be at least 1, got {value}", f"set {setting} to a positive integer")


def _check_choices(cfg) -> None:
    choices = {"backend": BACKENDS, "schedule": tuple(GENERATORS), "failures": FAILURE_KINDS,
               "wandb.mode": WandbSink.MODES, "backend.dtype": DTYPES, "train.data": DATA_KINDS}
    values = {"backend": cfg.backend.name, "schedule": cfg.schedule.name,
              "failures": cfg.failures.kind, "wandb.mode": cfg.wandb.mode, "backend.dtype": cfg.backend.dtype,
              "train.data": cfg.train.data}
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
    for key in ("peak_tflops", "memory_gb", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "storage_gbps"):
        if getattr(hw, key) <= 0:
            raise ConfigError(f"hardware.{key}", f"must be positive, got {getattr(hw, key)}",
                              f"set hardware.{key} to a positive number")
    if not 0 < hw.efficiency <= 1:
        raise ConfigError("hardware.efficiency", f"must be in (0, 1], got {hw.efficiency}",
                          "set the achieved fraction of peak FLOP/s, e.g. hardware.efficiency=0.5")
    if hw.link_latency_us < 0 or hw.restart_s < 0:
        raise ConfigError("hardware.link_latency_us" if hw.link_latency_us < 0 else "hardware.restart_s",
                          "must not be negative", "set a value >= 0")


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
