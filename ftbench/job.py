"""What a run is built from, whichever backend runs it: the cluster and the failure script,
the clock, the summary's totals, and the progress bar. ftbench/run.py composes a run from
these; each backend's own assembly is in ftbench/assembly/sim.py, ftbench/assembly/local.py and
ftbench/distributed/worker.py."""
from __future__ import annotations

from pathlib import Path

from ftbench.cluster import Cluster
from ftbench.context import RunContext
from ftbench.errors import ConfigError
from ftbench.failures import FailureScript, build_failure_script
from ftbench.loop import CLOCKS
from ftbench.metrics import ettr
from ftbench.samples import sync_points


def setup(cfg, run_dir, shared_dir=None) -> tuple[RunContext, Cluster, FailureScript]:
    """The run's context, cluster and failure script; path settings resolve inside `run_dir`
    (and `shared_dir`, a sweep's folder)."""
    ctx = RunContext.from_config(cfg)
    ctx.run_dir, ctx.shared_dir = Path(run_dir), shared_dir  # path settings resolve inside them
    cluster, script = cluster_and_script(cfg, ctx)
    job_mtbf = cfg.failures.get("job_mtbf_hours")
    if ctx.node_mtbf_hours is None and job_mtbf and cfg.failures.kind == "poisson":
        ctx.node_mtbf_hours = job_mtbf * cluster.nodes  # as the failure script draws them (Young/Daly reads it)
    ctx.job_mtbf_s, ctx.failures_per_iteration = script.job_mtbf_s, script.failures_per_iteration
    return ctx, cluster, script


def common_fields(ctx, script) -> dict:
    """Summary fields every backend reports the same way."""
    return {"microbatches": ctx.microbatches, "global_batch": ctx.global_batch, "seq_len": ctx.seq_len,
            "failure_script": script.description, "model_parameters": ctx.spec.parameters,
            "op_times": ctx.cost_model.op_source}  # measured (the profile's calibrated lines) or flops


def cluster_and_script(cfg, ctx) -> tuple[Cluster, FailureScript]:
    """The cluster and the failure script. A trace's starting membership (the nodes it adds
    at its first instant) is the job: it sets cluster.nodes when that is unset, and must equal
    it when set. Nodes the trace adds later join as new node ids, and the cluster grows with
    them (Cluster.join)."""
    seed = cfg.failures.seed if cfg.failures.seed is not None else cfg.seed
    c = cfg.cluster
    if cfg.failures.kind != "trace":
        cluster = Cluster.from_config(c)
        return cluster, build_failure_script(cfg.failures, cluster.nodes, seed, iterations=ctx.iterations,
                                             max_hours=ctx.max_hours)
    script = build_failure_script(cfg.failures, c.nodes or 0, seed, iterations=ctx.iterations,
                                  max_hours=ctx.max_hours)
    initial = script.initial_nodes
    if c.nodes is not None and c.nodes != initial:
        raise ConfigError("cluster.nodes", f"it is {c.nodes} but the trace starts with {initial} node(s) "
                          f"({script.description})", f"drop cluster.nodes (the trace sets it) or set "
                          f"cluster.nodes={initial}")
    sized = sized_by_membership(cfg)
    if not sized and initial * c.gpus_per_node < c.pp * c.dp:
        raise ConfigError("cluster.dp", f"the grid pp x dp = {c.pp} x {c.dp} needs {c.pp * c.dp} GPUs but the trace "
                          f"starts with {initial} node(s) of {c.gpus_per_node} GPUs ({script.description})",
                          f"choose cluster.pp x cluster.dp <= {initial * c.gpus_per_node} (oobleck, bamboo and varuna "
                          "with strategy.start=fastest build their job from the live nodes and wait for the trace's "
                          "joins), or replay another trace")
    return Cluster.from_config(c, nodes=initial, require_grid=not sized), script


def sized_by_membership(cfg) -> bool:
    """Whether the strategy builds its job from the live nodes rather than on the configured
    pp x dp grid (oobleck; bamboo, pipelines of cluster.pp stages over the live nodes; varuna
    with strategy.start=fastest): on a trace it needs no grid of GPUs at the start, and where
    the nodes are too few to start it waits for the trace's joins (TooFewNodes)."""
    from ftbench.strategies import REGISTRY

    cls = REGISTRY.get(str(cfg.strategy.name))  # an unknown name is refused when the strategy is built
    return bool(cls.sized_by_membership(cfg.strategy)) if cls is not None else False


def clock_of(cfg) -> str:
    clock = cfg.backend.get("clock") or ("model" if cfg.backend.name == "sim" else "wall")
    if clock not in CLOCKS:
        raise ConfigError("backend.clock", f"unknown option '{clock}'", f"choose one of {', '.join(CLOCKS)}")
    if cfg.backend.name == "sim" and clock != "model":
        raise ConfigError("backend.clock", "the simulator has only the modelled clock",
                          "drop backend.clock, or set backend.clock=model")
    return clock


def totals(outcome, global_batch: int, local_steps=None) -> dict:
    """The run's totals. `samples`: those that counted, from the ledger (every kept
    iteration's plan); `samples_dropped`: the global batch's samples its kept iterations did
    not train (0 for a strategy that keeps the global batch). Under LocalSGD or DiLoCo
    (`local_steps`, ftbench.local_sgd), a sample counts when its group's window synced with
    it, and `syncs` lists the syncs (ftbench.samples.sync_points)."""
    ledger = getattr(outcome, "ledger", None)
    full = outcome.iterations * global_batch
    samples = sum((entry[1] - entry[0] + 1) * entry[2] for entry in ledger) if ledger else full
    extra = {}
    if local_steps is not None:
        points = sync_points(ledger or [[0, outcome.iterations - 1, global_batch, [[0, global_batch]]]]
                             if outcome.iterations else [], local_steps)
        samples, extra["syncs"] = sum(p[4] for p in points), points
    segments = outcome.plan_segments
    return {"iterations": outcome.iterations, "samples": samples, "samples_dropped": full - samples, **extra,
            "ledger": ledger or [], "time_s": outcome.time_s,
            "throughput": samples / outcome.time_s if outcome.time_s > 0 else 0.0,
            "ettr": ettr(outcome.productive_s, outcome.time_s), "productive_s": outcome.productive_s,
            "failures": outcome.failures, "recoveries": outcome.recoveries,
            "lost_iterations": sum(r.get("lost_iterations", 0) for r in outcome.recoveries),
            "plan_segments": segments, "final_shape": segments[-1]["shape"] if segments else None,
            "checkpoints": outcome.checkpoints, "status": outcome.status, "error": outcome.error}


class Progress:
    """tqdm when stderr is a terminal, a no-op callable otherwise: over iterations, or, for a
    run capped by train.max_hours, over its (simulated or wall) hours, so that a run that ends
    at its cap shows 100 %."""

    def __init__(self, ctx, enabled: bool, desc: str):
        self.ctx, self.enabled, self.desc, self.bar = ctx, enabled, desc, None
        self.hours = ctx.max_hours is not None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm
            if self.hours:
                self.bar = tqdm(total=float(self.ctx.max_hours), unit="h", desc=self.desc, disable=None, leave=True,
                                bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} h [{elapsed}<{remaining}]")
            else:
                self.bar = tqdm(total=self.ctx.iterations, unit="it", desc=self.desc, disable=None, leave=True)
        return self

    def __call__(self, iteration: int, time_s: float = 0.0) -> None:
        if self.bar is not None:
            done = min(time_s / 3600.0, self.bar.total) if self.hours else iteration
            self.bar.update(done - self.bar.n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
