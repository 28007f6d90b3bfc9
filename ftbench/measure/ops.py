"""Per-op compute times with the engine's own code: F, B, W, BW and OPT as the executor runs them.

Each measured plan is one pipeline of three stages (ftbench.plan.grid_plan): the first stage
holds the embeddings and one block, the middle stage k blocks (k = 1, 2, 4), the last one
block and the LM head. Every op of an iteration runs through `WorkerExecutor.run` (deferred
weight-gradient matmuls, the step through StepUndo, the in-process transport), in the
executor's order, and is timed alone. ZB-H1 gives F, B and W; 1F1B gives the fused BW.
The middle stage's medians over k give a line per op kind: the intercept is the fixed
per-op cost (Python, autograd and kernel launches), the slope the cost of one block. The
embedding and the LM head (with its loss) are timed on their own, with the first and last
stages' own modules; the first and last stages' medians check the sum.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ftbench.engine.executor import Executor, WorkerExecutor
from ftbench.engine.worker import StageReplica, Worker
from ftbench.layers import GradientSync
from ftbench.measure.fit import Line, fit_line, median
from ftbench.models.gpt import build_stage, lm_loss_sum
from ftbench.plan import grid_plan
from ftbench.schedule import B, BW, F, OPT, OP_KINDS, W, generate

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
OP_NAMES = {kind: OP_KINDS[kind].cost for kind in (F, B, W, BW, OPT)}  # forward, backward_input, ...
STAGES = 3  # first (embeddings + 1 block), middle (k blocks), last (1 block + head)
POSITIONS = ("first", "middle", "last")


@dataclass
class Setup:
    spec: object  # ModelSpec
    microbatch_size: int
    seq_len: int
    dtype: str
    device: str
    microbatches: int  # per measured iteration
    warmup: int  # iterations (or unit repetitions) not timed
    iterations: int  # timed iterations per plan
    block_counts: tuple[int, ...]
    seed: int = 0
    lr: float = 1e-3

    @property
    def normaliser(self) -> float:
        return float(self.microbatches * self.microbatch_size * (self.seq_len - 1))


@dataclass
class OpTimes:
    """Medians in seconds per op kind and stage, keyed (position, blocks), position first/middle/last."""
    medians: dict = field(default_factory=dict)  # kind -> {(position, blocks): s}
    samples: dict = field(default_factory=dict)  # kind -> {(position, blocks): [s]}, pooled over plans
    params: dict = field(default_factory=dict)  # (position, blocks) -> parameters of that stage
    units: dict = field(default_factory=dict)  # "embedding"/"head" -> {kind: s}


def stage_layers(blocks: int) -> tuple[tuple[int, int], ...]:
    """Block ranges of the measured pipeline: 1 block, `blocks` blocks, 1 block."""
    return ((0, 1), (1, 1 + blocks), (1 + blocks, 2 + blocks))


def stage_blocks(stage: int, middle: int) -> int:
    return middle if stage == 1 else 1


def build_plan(generator: str, blocks: int, microbatches: int):
    return grid_plan(generate(generator, STAGES, microbatches), stage_layers(blocks), STAGES, 1)


def build_workers(plan, setup: Setup) -> dict[int, Worker]:
    """One worker per stage, each with a StageReplica as the local engine builds it."""
    dtype, workers = DTYPES[setup.dtype], {}
    for w, held in plan.holds.items():
        worker = workers[w] = Worker(w)
        for pipeline, stage in held:
            first, end = plan.layers(pipeline, stage)
            module = build_stage(setup.spec, setup.seed, first, end, stage == 0,
                                 plan.is_last_stage(pipeline, stage)).to(device=setup.device, dtype=dtype)
            worker.replicas[(first, end)] = StageReplica(stage, module, setup.lr, 0.0)
    return workers


def token_source(setup: Setup):
    """Fixed random input ids per micro-batch (their values do not change the time)."""
    generator = torch.Generator().manual_seed(setup.seed)
    shape = (setup.microbatch_size, setup.seq_len)
    batches = [torch.randint(0, setup.spec.vocab, shape, generator=generator).to(setup.device)
               for _ in range(setup.microbatches)]
    return lambda pipeline, microbatch: batches[microbatch]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_iteration(executor: Executor, plan, tokens, normaliser: float, device: str) -> list[tuple]:
    """One iteration in the executor's order (Executor.run's loop), each op timed: [(op, s)]."""
    _, order, members = executor.graph(plan)
    where = plan.schedule.index()
    execs = {w: WorkerExecutor(executor.workers[w], executor.transport, plan, tokens, normaliser)
             for w in plan.workers}
    times = []
    for node in order:
        if isinstance(node, GradientSync):  # one pipeline: nobody to sum with, run as the executor does
            for w in members[node]:
                execs[w].reduce_start(node, members[node])
            for w in members[node]:
                execs[w].reduce_wait(node, members[node])
            continue
        synchronize(device)
        start = time.perf_counter()
        execs[where[node]].run(node)
        synchronize(device)
        times.append((node, time.perf_counter() - start))
    for worker in executor.workers.values():  # the iteration is committed: its steps stay
        for replica in worker.replicas.values():
            replica.undo.clear()
    return times


@dataclass
class Measured:
    """One plan being measured: its executor and the op times collected so far."""
    generator: str
    blocks: int
    kinds: tuple[str, ...]  # the op kinds this plan measures
    plan: object
    executor: Executor
    collected: dict = field(default_factory=dict)  # (kind, stage) -> [s]


def prepare(generator: str, blocks: int, kinds, setup: Setup) -> Measured:
    plan = build_plan(generator, blocks, setup.microbatches)
    return Measured(generator, blocks, tuple(kinds), plan, Executor(build_workers(plan, setup)))


def run_rounds(measured: list[Measured], setup: Setup, say) -> None:
    """One iteration of each plan in turn, round after round, so that a burst of load from
    other processes (2 shared cores) falls on every block count alike."""
    tokens = token_source(setup)
    rounds = setup.warmup + setup.iterations
    collecting = gc.isenabled()
    gc.disable()  # a collection would land in whichever op allocates then: run it between rounds instead
    try:
        for i in range(rounds):
            run_round(measured, setup, tokens, i >= setup.warmup)
            gc.collect()
            if (i + 1) % max(1, rounds // 4) == 0 or i + 1 == rounds:
                say(f"ops: round {i + 1} of {rounds} ({len(measured)} plans each)")
    finally:
        if collecting:
            gc.enable()


def run_round(measured: list[Measured], setup: Setup, tokens, keep: bool) -> None:
    for m in measured:
        times = timed_iteration(m.executor, m.plan, tokens, setup.normaliser, setup.device)
        if keep:
            for op, seconds in times:
                m.collected.setdefault((op.kind, op.stage), []).append(seconds)


def record(m: Measured, out: OpTimes) -> None:
    """The plan's samples (the first and last stages are the same in every plan: pooled) and its
    stages' parameter counts into `out`; `medians` from everything recorded so far."""
    for (kind, stage), values in m.collected.items():
        if kind in m.kinds:
            key = (POSITIONS[stage], stage_blocks(stage, m.blocks))
            pooled = out.samples.setdefault(kind, {}).setdefault(key, [])
            pooled.extend(values)
            out.medians.setdefault(kind, {})[key] = median(pooled)
    for w, held in m.plan.holds.items():
        for pipeline, stage in held:
            module = m.executor.workers[w].replicas[m.plan.layers(pipeline, stage)].module
            out.params[(POSITIONS[stage], stage_blocks(stage, m.blocks))] = sum(p.numel() for p in module.parameters())


# -- the embedding and the LM head on their own ------------------------------------------
class Lap:
    """Seconds between successive `split()` calls (device work finished at each)."""

    def __init__(self, device: str):
        self.device = device
        synchronize(device)
        self.last = time.perf_counter()

    def split(self) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def unit_ops(replica: StageReplica, forward, setup: Setup, reps: int) -> dict[str, float]:
    """Median F, B, W and BW of `forward()` (a unit's forward on `replica`'s modules, returning
    its output and the gradient that output gets), B and W through the replica's store."""
    times: dict[str, list] = {F: [], B: [], W: [], BW: []}
    for rep in range(setup.warmup + reps):
        key = ("unit", rep)
        lap = Lap(setup.device)
        out, grad = forward()
        forward_s = lap.split()
        with replica.store.defer(key):
            torch.autograd.backward(out, grad)
        input_s = lap.split()
        replica.store.flush(key)
        weight_s = lap.split()
        out, grad = forward()
        lap.split()
        torch.autograd.backward(out, grad)
        fused_s = lap.split()
        replica.optimizer.zero_grad(set_to_none=True)
        if rep >= setup.warmup:
            for kind, seconds in ((F, forward_s), (B, input_s), (W, weight_s), (BW, fused_s)):
                times[kind].append(seconds)
    return {kind: median(values) for kind, values in times.items()}


def embedding_forward(replica: StageReplica, setup: Setup, tokens):
    """The first stage's embedding lookup, as Stage.forward does it."""
    module = replica.module
    ids = tokens(0, 0)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    grad = torch.randn(*ids.shape, setup.spec.hidden, device=ids.device, dtype=DTYPES[setup.dtype])
    return lambda: (module.wte(ids) + module.wpe(positions), grad)


def head_forward(replica: StageReplica, setup: Setup, tokens):
    """The last stage's final LayerNorm, LM head and loss share, as the executor computes them."""
    module = replica.module
    ids = tokens(0, 0)
    hidden = torch.randn(*ids.shape, setup.spec.hidden, device=ids.device, dtype=DTYPES[setup.dtype])

    def forward():
        x = hidden.detach().requires_grad_()
        return lm_loss_sum(module.lm_head(module.ln_f(x)), ids) / setup.normaliser, None
    return forward


def measure_units(workers: dict[int, Worker], setup: Setup, reps: int) -> dict[str, dict]:
    """F, B, W, BW of the embedding (first stage) and the LM head (last stage) alone."""
    replicas = {r.stage: r for worker in workers.values() for r in worker.replicas.values()}
    tokens = token_source(setup)
    first, last = replicas[0], replicas[STAGES - 1]
    return {"embedding": unit_ops(first, embedding_forward(first, setup, tokens), setup, reps),
            "head": unit_ops(last, head_forward(last, setup, tokens), setup, reps)}


# -- the whole measurement and its lines ---------------------------------------------------
def measure_ops(setup: Setup, say) -> OpTimes:
    """Every plan, both schedules, and the units; `say(line)` reports progress."""
    measured = [prepare(generator, blocks, kinds, setup) for blocks in setup.block_counts
                for generator, kinds in (("zb-h1", (F, B, W, OPT)), ("1f1b", (BW,)))]
    run_rounds(measured, setup, say)
    out = OpTimes()
    for m in measured:
        record(m, out)
    for blocks in setup.block_counts:
        say(f"ops: {blocks}-block stage: " + ", ".join(f"{kind} {ms(out, kind, blocks)}" for kind in (F, B, W, BW, OPT)))
    out.units = measure_units(measured[0].executor.workers, setup, setup.iterations * setup.microbatches)
    say("ops: embedding alone " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in out.units["embedding"].items())
        + "; head alone " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in out.units["head"].items()))
    return out


def ms(out: OpTimes, kind: str, blocks: int) -> str:
    return f"{out.medians[kind][('middle', blocks)] * 1e3:.3f} ms"


def block_line(out: OpTimes, kind: str) -> tuple[Line, list[int], list[float]]:
    """The middle stage's medians against its block count, and their line."""
    points = sorted((blocks, s) for (where, blocks), s in out.medians[kind].items() if where == "middle")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return fit_line(xs, ys), xs, ys


def step_line(out: OpTimes) -> tuple[Line, list[int], list[float]]:
    """Every stage's OPT median against its parameter count, and their line."""
    points = sorted((out.params[key], s) for key, s in out.medians[OPT].items())
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return fit_line(xs, ys), xs, ys
