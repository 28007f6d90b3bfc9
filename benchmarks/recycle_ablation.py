"""ReCycle ablation on the simulator: what each mechanism buys when workers fail.

For each `strategy.level` of strategies/recycle.py

  - reroute:   the failed worker's micro-batches go to its data-parallel peers at the same
               stage, on 1F1B with a fused backward (BW) and an optimizer barrier;
  - decoupled: + decoupled backprop (B and W split, W deferred into bubbles);
  - staggered: + staggered optimizer (no barrier between iterations: each stage steps when its
               own all-reduce ends; the simulator times the steady-state period)

the iteration time with failed workers is compared with two fault-free references:

  (a) the configured schedule, 1F1B, with no failure: `strategy=none`'s plan, which ReCycle
      runs fault-free with `strategy.fault_free=schedule`;
  (b) the level's own planned fault-free plan (`strategy.fault_free=planned`, the default):
      the planner's schedule of the fault-free grid with the level's mechanisms. This is the
      reference a failure plan is measured against: the same technique without the failure.
      Column (b) is a loss in every row of the full ablation (tests/test_recycle_reference.py
      checks it on random failure sets). The one gain we found comes from a failure that
      shrinks a stage's data-parallel group, whose ring all-reduce then moves less (nothing
      with one replica left): pp 8 x dp 2, reroute, a stage-0 worker failed.

As a baseline without re-routing, the failed workers' pipelines are dropped and the global
batch is spread over the remaining pipelines (1F1B and ZB-H1). Every line processes the same
global batch, so a throughput ratio is the inverse ratio of iteration times; changes are
given as throughput changes in % (negative: a loss).

Full ablation (the default, or --full): GPT-3 Medium on A100 40 GB at pp 4, GPT-3 3.35B on
A100 80 GB at pp 4, GPT-3 6.7B on A100 80 GB at pp 8 (the harness benchmark's depth,
conf/experiment/sim-6.7b-1024gpu.yaml; ReCycle's paper does not give its pp), 2 x pp
micro-batches per pipeline, one GPU per node, at dp 2, 4 and 8, with one failed worker
(pipeline 0, stage 1) and with two (pipeline 0 stage 1, then pipeline 1 stage 2: different
stages in different pipelines, so every stage keeps a replica even at dp 2). For each
staggered plan it names what limits staggering: the worker whose iteration span is the
period, the op that ends last on it and the all-reduce its step (hence its next iteration)
waits for. --quick runs dp 2 and 4 only. A side-by-side Gantt of the three levels for GPT-3
Medium, dp 4, one failure goes to --out (shared time axis).

Single setup (the old interface, used when any of --dp, --model, --hardware, --pp,
--microbatches, --stages is given): one failure at a time of worker (0, s) for each s in
--stages, with both references, and the Gantt of the first.

    python benchmarks/recycle_ablation.py [--full | --quick] [--overlap] [--out runs/recycle-ablation.png]
    python benchmarks/recycle_ablation.py --dp 4 [--microbatches 8] [--model gpt3-medium]
                                          [--hardware a100-40gb] [--pp 4] [--stages 1,2]

--overlap runs everything with train.overlap_grad_reduce=true: each layer fragment's gradient
all-reduce runs in per-layer buckets during the last micro-batch's backward (Megatron-LM's
--overlap-grad-reduce) instead of after it (DeepSpeed, the paper's baseline, the default);
references, plans and planners alike.

Plans are computed on the spot (strategy.plan_cache=null, plan_ahead=0). A plan that does not
fit in the GPU's memory, or a failure set that re-routing cannot absorb, prints as
"oom/unrecoverable" with the reason. For reference, the ReCycle talk (SOSP 2024) reports that
re-routing on plain 1F1B loses about 33 % of the fault-free throughput with one failure,
decoupled backprop brings that to about 8 %, and the staggered optimizer removes most of the
rest. The numbers printed here come out of the mechanisms as implemented (the planner's
schedules timed by the cost model); nothing is tuned to reproduce the paper's.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftbench.cli import compose  # noqa: E402
from ftbench.cluster import Cluster  # noqa: E402
from ftbench.context import RunContext  # noqa: E402
from ftbench.costs import PlanCosts  # noqa: E402
from ftbench.errors import ConfigError  # noqa: E402
from ftbench.failures import FailureEvent  # noqa: E402
from ftbench.report import plot_gantt_panels  # noqa: E402
from ftbench.schedule import BW, OPT, W, grid_worker  # noqa: E402
from ftbench.sim.simulator import SimResult, simulate  # noqa: E402
from ftbench.strategies import build_strategy  # noqa: E402
from ftbench.strategies.recycle import LEVELS  # noqa: E402

MECHANISM = {
    "reroute": "re-routing, 1F1B + fused BW, optimizer barrier",
    "decoupled": "re-routing + decoupled B/W (W into bubbles)",
    "staggered": "re-routing + decoupled B/W + staggered optimizer",
}
NAMES = {"gpt3-medium": "GPT-3 Medium", "gpt3-3.35b": "GPT-3 3.35B", "gpt3-6.7b": "GPT-3 6.7B"}


@dataclass(frozen=True)
class Setup:
    model: str
    hardware: str
    pp: int
    microbatches: int  # per pipeline
    overlap: bool = False  # train.overlap_grad_reduce (--overlap)


SETUPS = (Setup("gpt3-medium", "a100-40gb", 4, 8),
          Setup("gpt3-3.35b", "a100-80gb", 4, 8),
          Setup("gpt3-6.7b", "a100-80gb", 8, 16))
DPS = (2, 4, 8)
QUICK_DPS = (2, 4)
# Failed grid positions (pipeline, stage), failed in this order: one worker; then a second of
# another stage in another pipeline (every stage keeps a replica, even at dp 2).
FAILURE_SETS = {1: ((0, 1),), 2: ((0, 1), (1, 2))}
GANTT_SETUP, GANTT_DP, GANTT_FAILURES = SETUPS[0], 4, 1
# measured wall time of the default run
DURATION = "15-65 s on 2 shared cores (--quick: 10-40 s; one setup, e.g. --dp 4: about 10 s)"


# -- running the strategies ------------------------------------------------------------------

@dataclass
class Outcome:
    """A simulated plan, or why there is none (`failed`: 'oom/unrecoverable: ...')."""
    result: SimResult | None = None
    failed: str | None = None

    @property
    def time(self) -> float | None:
        return None if self.result is None else self.result.iteration_time


def config(setup: Setup, dp: int, level: str = "staggered", fault_free: str = "schedule"):
    return compose(["backend=sim", "failures=none", "strategy=recycle", f"strategy.level={level}",
                    f"strategy.fault_free={fault_free}", "strategy.plan_ahead=0", "strategy.plan_cache=null",
                    f"model={setup.model}", f"hardware={setup.hardware}", f"cluster.pp={setup.pp}",
                    f"cluster.dp={dp}", "cluster.gpus_per_node=1", f"train.microbatches={setup.microbatches}",
                    f"train.overlap_grad_reduce={str(setup.overlap).lower()}"])


def run_plan(ctx: RunContext, plan) -> Outcome:
    """Simulate a plan; one whose simulated peak memory exceeds the GPU's is an oom outcome."""
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer)
    capacity = ctx.cost_model.memory_bytes
    worst = max(result.peak_memory_bytes, key=result.peak_memory_bytes.get)
    if result.peak_memory_bytes[worst] > capacity:
        return Outcome(failed=f"oom/unrecoverable: worker {worst} needs {result.peak_memory_bytes[worst] / 1e9:.1f} GB "
                              f"of {capacity / 1e9:.1f} GB")
    return Outcome(result)


def fail_in_turn(strategy, ctx: RunContext, cluster: Cluster, positions, pp: int) -> list[Outcome]:
    """Fail the workers at `positions` one after another (each failure adds to the previous
    ones); the outcome after each. Every failed node rejoins at the end."""
    out, failed_nodes = [], []
    for d, s in positions:
        if out and out[-1].failed:
            out.append(Outcome(failed=out[-1].failed))  # a failure set that already could not run
            continue
        node = cluster.node_of(grid_worker(d, s, pp))
        cluster.fail(node)
        failed_nodes.append(node)
        recovery = strategy.on_event(FailureEvent(node=node, kind="fail", iteration=1), cluster, 1)
        if recovery.unrecoverable or recovery.plan is None:
            out.append(Outcome(failed=f"oom/unrecoverable: {recovery.unrecoverable or 'no plan'}"))
        else:
            out.append(run_plan(ctx, recovery.plan))
    for node in reversed(failed_nodes):
        cluster.join(node)
        strategy.on_event(FailureEvent(node=node, kind="join", iteration=2), cluster, 2)
    return out


@dataclass
class LevelRuns:
    planned: Outcome  # the level's own planned fault-free plan (strategy.fault_free=planned)
    failed: dict[tuple, Outcome] = field(default_factory=dict)  # failed positions -> outcome


def schedule_runs(setup: Setup, dp: int, level: str, chain) -> tuple[Outcome, dict[tuple, Outcome]]:
    """ReCycle with strategy.fault_free=schedule: (its fault-free run, the configured 1F1B,
    reference (a); {failed positions: outcome} with the workers of `chain` failed in turn: the
    failure plans do not depend on the fault-free setting)."""
    cfg = config(setup, dp, level, "schedule")
    ctx = RunContext.from_config(cfg)
    cluster = Cluster.from_config(cfg.cluster)
    strategy = build_strategy(cfg.strategy, ctx)
    fault_free = run_plan(ctx, strategy.plan(cluster))
    outcomes = fail_in_turn(strategy, ctx, cluster, chain, setup.pp)
    return fault_free, {tuple(chain[:i + 1]): o for i, o in enumerate(outcomes)}


def planned_fault_free(setup: Setup, dp: int, level: str) -> Outcome:
    """The level's own planned fault-free plan (strategy.fault_free=planned, the default)."""
    cfg = config(setup, dp, level, "planned")
    ctx = RunContext.from_config(cfg)
    strategy = build_strategy(cfg.strategy, ctx)
    try:
        return run_plan(ctx, strategy.plan(Cluster.from_config(cfg.cluster)))
    except ConfigError as error:  # the planned fault-free plan does not fit in memory
        return Outcome(failed=f"oom/unrecoverable: {error}")


def drop_pipelines(setup: Setup, dp: int, lost: int) -> dict[str, Outcome]:
    """The global batch on dp - lost pipelines (the failed workers' pipelines dropped)."""
    ctx = RunContext.from_config(config(setup, dp))
    if dp - lost < 1:
        return {s: Outcome(failed="oom/unrecoverable: no pipeline left") for s in ("1f1b", "zb-h1")}
    return {sched: run_plan(ctx, ctx.grid_plan(setup.pp, dp - lost, 1, sched)) for sched in ("1f1b", "zb-h1")}


@dataclass
class Cell:
    """One setup (model, dp) and everything measured on it."""
    setup: Setup
    dp: int
    global_batch: int
    reference: Outcome  # ReCycle fault-free = the configured 1F1B
    levels: dict[str, LevelRuns]
    drop: dict[int, dict[str, Outcome]]  # failed pipelines -> schedule -> outcome


def measure(setup: Setup, dp: int, failure_sets, progress=None) -> Cell:
    """Run every level on one setup. `failure_sets`: lists of positions, each failed in turn;
    a set that is a prefix of another shares its runs."""
    chains = [list(p) for p in failure_sets
              if not any(len(q) > len(p) and list(q[:len(p)]) == list(p) for q in failure_sets)]
    levels, reference = {}, None
    for level in LEVELS:
        runs = LevelRuns(planned_fault_free(setup, dp, level))
        for chain in chains:
            fault_free, failed = schedule_runs(setup, dp, level, chain)
            runs.failed.update(failed)
            if reference is None:
                reference = fault_free  # the configured schedule: the same plan for every level
        levels[level] = runs
        if progress:
            progress(level)
    lost = sorted({len({d for d, _ in p}) for p in failure_sets})
    drop = {n: drop_pipelines(setup, dp, n) for n in lost}
    ctx = RunContext.from_config(config(setup, dp))
    return Cell(setup, dp, ctx.global_batch, reference, levels, drop)


# -- what limits staggering -----------------------------------------------------------------

@dataclass
class Limit:
    """Why a staggered plan's period is what it is: in steady state every worker's iterations
    start one period apart and each worker starts its next iteration only after its own
    optimizer step, so the period is at least every worker's span (first op start to step
    end). The critical worker's span is the period; its step waits for its last op or for
    its stage's all-reduce, which waits for that stage's last weight gradient anywhere."""
    period: float
    worker: int
    position: tuple[int, int]  # (pipeline, stage)
    span: float
    first_op: tuple  # (op, start)
    last_op: tuple  # (op, end): the last compute op on the critical worker
    busy: float  # compute seconds of the critical worker before its step
    allreduce: tuple | None  # (stage, start, end) of the all-reduce its step waits for, or None
    allreduce_input: tuple | None  # (op, worker, end): its last weight gradient (which starts it without overlap)
    step: tuple  # (start, end) of its optimizer step
    also: tuple = ()  # other workers whose span is the period too

    @property
    def bound_by(self) -> str:
        if self.allreduce is not None and self.allreduce[2] > self.last_op[1] + 1e-12:
            return "all-reduce"
        return "own compute"

    def describe(self, pp: int) -> str:
        """One line, times relative to the critical worker's iteration start."""
        t0 = self.first_op[1]
        at = lambda t: f"+{(t - t0) * 1e3:.1f}"  # noqa: E731
        d, s = self.position
        op, end = self.last_op
        equal = abs(self.span - self.period) <= 1e-6 * self.period
        text = (f"critical worker ({d},{s}), stage {s}: span {self.span * 1e3:.2f} ms "
                f"{'= the period' if equal else f'< the period {self.period * 1e3:.2f} ms'}; "
                f"first op {_op(self.first_op[0])}, last op {_op(op)} ends at {at(end)} ms "
                f"({self.busy * 1e3:.1f} ms compute, {(end - t0 - self.busy) * 1e3:.1f} ms idle)")
        if self.allreduce is not None and self.bound_by == "all-reduce":
            st, a0, a1 = self.allreduce
            text += (f"; its step waits {(a1 - end) * 1e3:.1f} ms for the stage {st} all-reduce "
                     f"({at(a0)} to {at(a1)} ms, {(a1 - a0) * 1e3:.1f} ms")
            if self.allreduce_input is not None:
                src_op, src_w, src_end = self.allreduce_input
                # with train.overlap_grad_reduce the row is drawn as the all-reduce's length ending
                # when it ends, so it may begin before its last input ends
                how = "started by" if src_end <= a0 + 1e-12 else "overlapping"
                text += f", {how} {_op(src_op)} on ({src_w // pp},{src_w % pp})"
            text += ")"
        elif self.allreduce is not None:
            text += f"; the stage {self.allreduce[0]} all-reduce is over by then: its own compute binds"
        s0, s1 = self.step
        text += f"; step {(s1 - s0) * 1e3:.1f} ms, then its next iteration starts"
        if self.also:
            more = ", ".join(f"({v // pp},{v % pp})" for v in self.also[:4]) + (" ..." if len(self.also) > 4 else "")
            text += f" (same span: {more})"
        return text


def _op(op) -> str:
    if op.kind == OPT:
        return f"OPT(stage {op.stage})"
    return f"{op.kind}(p{op.pipeline} mb{op.microbatch})"


def staggering_limit(result: SimResult, pp: int) -> Limit:
    """The binding constraint of a staggered plan's period (see Limit), from the last
    simulated iteration: the worker with the longest span, its last op, and the all-reduce
    its optimizer step waits for."""
    rows: dict[int, list] = {}
    for w, op, s, e in result.ops:
        rows.setdefault(w, []).append((op, s, e))
    spans = {}
    for w, ops in rows.items():
        steps = [(s, e) for op, s, e in ops if op.kind == OPT]
        spans[w] = (max(e for _, e in steps) if steps else max(e for _, _, e in ops)) - min(s for _, s, _ in ops)
    w = max(spans, key=lambda v: (spans[v], -v))
    ops = sorted(rows[w], key=lambda r: r[1])
    compute = [r for r in ops if r[0].kind != OPT]
    step = next(((s, e) for op, s, e in ops if op.kind == OPT), (compute[-1][2], compute[-1][2]))
    last = compute[-1]
    position = divmod(w, pp)
    allreduce = allreduce_input = None
    # The all-reduces the step waits for: those of the fragments this position holds (one per
    # stage on a regular grid); the one ending last binds.
    syncs = set(result.layout.of_position.get(position, ())) if result.layout is not None else set()
    mine = [(node, start, end) for node, members, start, end in result.allreduces
            if node in syncs or (not syncs and w in members)]
    if mine:
        node, a0, a1 = max(mine, key=lambda r: r[2])
        allreduce = (node.stage, a0, a1)
        holders = set(node.holders)
        # its inputs all end by its end (by its start without overlap: the same one either way)
        grads = [(op, v, e) for v, op, _, e in result.ops
                 if op.kind in (W, BW) and (op.pipeline, op.stage) in holders and e <= a1 + 1e-12]
        if grads:
            allreduce_input = max(grads, key=lambda r: r[2])
    also = tuple(v for v in sorted(spans) if v != w and spans[v] >= spans[w] - 1e-6 * spans[w])
    return Limit(result.iteration_time, w, position, spans[w], (ops[0][0], ops[0][1]), (last[0], last[2]),
                 sum(e - s for _, s, e in compute), allreduce, allreduce_input, step, also)


# -- printing --------------------------------------------------------------------------------

def change(reference: float | None, t: float | None) -> str:
    """Throughput change relative to a reference, in %, e.g. '-14.6 %'."""
    if reference is None or t is None:
        return "-"
    value = (reference / t - 1) * 100
    return f"{0.0 if abs(value) < 0.05 else value:+.1f} %"


def positions_label(positions) -> str:
    return "+".join(f"({d},{s})" for d, s in positions) if positions else "none"


def fmt_table(head, rows, left=(0,)) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def ms(outcome: Outcome) -> str:
    return f"{outcome.time * 1e3:.2f} ms" if outcome.time is not None else "oom/unrecoverable"


def cell_table(cell: Cell, failure_sets) -> str:
    """Every line of one setup: references, each level fault-free (planned) and failed,
    dropping the pipeline(s)."""
    ref = cell.reference.time
    rows = [("1F1B fault-free (= none)", ms(cell.reference), change(ref, ref), "-",
             "the configured schedule, fused BW (reference a)")]
    notes = [f"1F1B fault-free: {cell.reference.failed}"] if cell.reference.failed else []
    for level, runs in cell.levels.items():
        own = runs.planned.time
        rows.append((f"{level} planned fault-free", ms(runs.planned), change(ref, own), change(own, own),
                     "strategy.fault_free=planned (reference b)"))
        if runs.planned.failed:
            notes.append(f"{level} planned fault-free: {runs.planned.failed}")
    for positions in failure_sets:
        for level, runs in cell.levels.items():
            o = runs.failed[tuple(positions)]
            rows.append((f"{level} failed {positions_label(positions)}", ms(o), change(ref, o.time),
                         change(runs.planned.time, o.time), MECHANISM[level]))
            if o.failed:
                notes.append(f"{level} failed {positions_label(positions)}: {o.failed}")
    for lost, by_sched in cell.drop.items():
        for sched, name in (("1f1b", "1F1B"), ("zb-h1", "ZB-H1")):
            o = by_sched[sched]
            rows.append((f"drop {lost} pipeline{'s' if lost > 1 else ''} {name}", ms(o), change(ref, o.time), "-",
                         f"dp {cell.dp} -> {cell.dp - lost} pipelines, same global batch"))
            if o.failed:
                notes.append(f"drop {lost} {name}: {o.failed}")
    out = fmt_table(("line", "iteration", "vs 1F1B fault-free", "vs own planned fault-free", "mechanism"),
                    rows, left=(0, 4))
    return out + "".join(f"\n  {n}" for n in notes)


def summary_table(cells: list[Cell], failure_sets) -> str:
    """One Markdown row per (model, dp, failures): each level's change vs (a) the configured
    1F1B fault-free and (b) the level's own planned fault-free, and dropping the pipelines."""
    head = ["model (pp)", "dp", "failed", "1F1B fault-free"]
    head += [f"{level} (a) / (b)" for level in LEVELS] + ["drop pipelines, 1F1B", "drop, ZB-H1"]
    rows = []
    for cell in cells:
        ref = cell.reference.time
        for positions in failure_sets:
            row = [f"{NAMES.get(cell.setup.model, cell.setup.model)} (pp {cell.setup.pp})", str(cell.dp),
                   positions_label(positions), ms(cell.reference)]
            for level in LEVELS:
                runs = cell.levels[level]
                o = runs.failed[tuple(positions)]
                row.append("oom/unrecoverable" if o.failed else
                           f"{o.time * 1e3:.1f} ms: {change(ref, o.time)} / {change(runs.planned.time, o.time)}")
            lost = len({d for d, _ in positions})
            for sched in ("1f1b", "zb-h1"):
                d = cell.drop[lost][sched]
                row.append(("no pipeline left" if lost >= cell.dp else "oom/unrecoverable") if d.failed
                           else f"{d.time * 1e3:.1f} ms: {change(ref, d.time)}")
            rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def planned_table(cells: list[Cell]) -> str:
    """The levels' planned fault-free plans vs the configured 1F1B (what fault_free=planned costs or buys)."""
    head = ["model (pp)", "dp", "1F1B fault-free"] + [f"{level} planned" for level in LEVELS]
    rows = []
    for cell in cells:
        ref = cell.reference.time
        row = [f"{NAMES.get(cell.setup.model, cell.setup.model)} (pp {cell.setup.pp})", str(cell.dp),
               ms(cell.reference)]
        for level in LEVELS:
            p = cell.levels[level].planned
            row.append("oom/unrecoverable" if p.failed else f"{p.time * 1e3:.1f} ms ({change(ref, p.time)})")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def last_step(result: SimResult, pp: int) -> str:
    """The worker whose optimizer step ends a barrier iteration last, e.g. '(0,7)'."""
    w = max((r for r in result.ops if r[1].kind == OPT), key=lambda r: (r[3], -r[0]))[0]
    return f"({w // pp},{w % pp})"


def limits_text(cells: list[Cell], failure_sets) -> str:
    lines = []
    for cell in cells:
        for positions in failure_sets:
            staggered = cell.levels["staggered"].failed[tuple(positions)]
            decoupled = cell.levels["decoupled"].failed[tuple(positions)]
            head = (f"{NAMES.get(cell.setup.model, cell.setup.model)} pp {cell.setup.pp} x dp {cell.dp}, "
                    f"failed {positions_label(positions)}")
            if staggered.failed:
                lines.append(f"{head}: {staggered.failed}")
                continue
            limit = staggering_limit(staggered.result, cell.setup.pp)
            gain = change(decoupled.time, staggered.time)
            barrier = ("" if decoupled.result is None else
                       f" (with the barrier, decoupled ends with the step of {last_step(decoupled.result, cell.setup.pp)})")
            lines.append(f"{head}: staggered {gain} vs decoupled{barrier}; {limit.describe(cell.setup.pp)}")
    return "\n".join(lines)


def gantt(cell: Cell, positions, out: str) -> Path:
    panels = []
    for level, runs in cell.levels.items():
        o = runs.failed[tuple(positions)]
        if o.result is None:
            continue
        extra = ", previous + current iteration (steady state)" if level == "staggered" else ""
        panels.append((f"{level}: {positions_label(positions)} failed, {o.time * 1e3:.2f} ms per iteration{extra}",
                       o.result.timeline()))
    s = cell.setup
    return plot_gantt_panels(panels, out, title=f"ReCycle levels, {s.model}, pp {s.pp} x dp {cell.dp}, "
                                                f"{s.microbatches} micro-batches, {positions_label(positions)} failed"
                                                + (", all-reduce overlapped" if s.overlap else ""))


# -- main ------------------------------------------------------------------------------------

def overlap_note(overlap: bool) -> str:
    return ("Gradient all-reduce overlapped with the last micro-batch's backward, in per-layer buckets "
            "(train.overlap_grad_reduce=true)." if overlap else
            "Gradient all-reduce after the last micro-batch's backward (train.overlap_grad_reduce=false; "
            "--overlap for the overlapped one).")


def gantt_out(args) -> str:
    if args.out is not None:
        return args.out
    return "runs/recycle-ablation-overlap.png" if args.overlap else "runs/recycle-ablation.png"


def full(args) -> None:
    dps = QUICK_DPS if args.quick else DPS
    failure_sets = [list(p) for p in FAILURE_SETS.values()]
    began = time.perf_counter()
    cells = []
    setups = [dataclasses.replace(s, overlap=args.overlap) for s in SETUPS]
    total = len(setups) * len(dps) * len(LEVELS)
    done = 0
    for setup in setups:
        for dp in dps:
            def progress(level, setup=setup, dp=dp):
                nonlocal done
                done += 1
                print(f"\r[{done}/{total}] {setup.model} dp {dp} {level:<9}  {time.perf_counter() - began:5.1f} s",
                      end="", file=sys.stderr, flush=True)
            cells.append(measure(setup, dp, failure_sets, progress))
    print(file=sys.stderr)

    print("ReCycle ablation (simulator). One GPU per node; micro-batch 1 x 2048 tokens; "
          "2 x pp micro-batches per pipeline.")
    print("Setups: " + "; ".join(f"{NAMES[s.model]} on {s.hardware} at pp {s.pp}, {s.microbatches} micro-batches"
                                 for s in SETUPS) + f"; dp {', '.join(map(str, dps))}"
          + (" (--quick: dp 8 left out)" if args.quick else "") + ".")
    print("Failed workers (pipeline, stage): (0,1); then (0,1)+(1,2), two stages in two pipelines.")
    print(overlap_note(args.overlap))
    print("(a) = throughput change vs 1F1B fault-free (strategy none; ReCycle with strategy.fault_free=schedule); "
          "(b) = vs the level's own planned fault-free plan (strategy.fault_free=planned, ReCycle's default).")
    print("Dropping the pipelines: the failed workers' pipelines are removed and the others carry the global "
          "batch (1F1B or ZB-H1), change vs (a).\n")
    print(summary_table(cells, failure_sets))
    print("\nPlanned fault-free plans (strategy.fault_free=planned) vs the configured 1F1B:\n")
    print(planned_table(cells))
    print("\nWhat limits staggering (the staggered plan's critical worker, in its last simulated iteration; "
          "times from the start of the previous one):")
    print(limits_text(cells, failure_sets))
    if args.verbose:
        for cell in cells:
            s = cell.setup
            print(f"\n{s.model} on {s.hardware}, pp {s.pp} x dp {cell.dp}, {s.microbatches} micro-batches per "
                  f"pipeline ({cell.global_batch} samples per iteration)\n")
            print(cell_table(cell, failure_sets))
    chart = next((c for c in cells if dataclasses.replace(c.setup, overlap=False) == GANTT_SETUP
                  and c.dp == GANTT_DP), None)
    if chart is not None:
        out = gantt(chart, failure_sets[GANTT_FAILURES - 1], gantt_out(args))
        print(f"\nGantt ({GANTT_SETUP.model}, dp {GANTT_DP}, {positions_label(failure_sets[GANTT_FAILURES - 1])} "
              f"failed): {out}")
    print(f"({time.perf_counter() - began:.1f} s)")


def single(args) -> None:
    setup = Setup(args.model or "gpt3-medium", args.hardware or "a100-40gb", args.pp or 4, args.microbatches or 8,
                  overlap=args.overlap)
    dp = args.dp or 4
    stages = [int(s) for s in (args.stages or "1,2").split(",") if s.strip()]
    if dp < 2:
        raise SystemExit("--dp must be at least 2: a failed worker needs a data-parallel peer")
    if not stages or any(not 0 <= s < setup.pp for s in stages):
        raise SystemExit(f"--stages must name stages in 0..{setup.pp - 1}")
    began = time.perf_counter()
    failure_sets = [[(0, s)] for s in stages]
    cell = measure(setup, dp, failure_sets,
                   lambda level: print(f"\r{level:<9} {time.perf_counter() - began:5.1f} s", end="",
                                       file=sys.stderr, flush=True))
    print(file=sys.stderr, flush=True)
    print(f"ReCycle ablation: {setup.model} on {setup.hardware}, pp {setup.pp} x dp {dp}, "
          f"{setup.microbatches} micro-batches per pipeline ({cell.global_batch} samples per iteration)")
    print("throughput change in % (same global batch everywhere), negative = loss")
    print(overlap_note(args.overlap) + "\n")
    print(cell_table(cell, failure_sets))
    print("\nWhat limits staggering:")
    print(limits_text([cell], failure_sets))
    out = gantt(cell, failure_sets[0], gantt_out(args))
    print(f"\nGantt: {out}   ({time.perf_counter() - began:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    ap.add_argument("--full", action="store_true", help="the full ablation (the default without setup options)")
    ap.add_argument("--quick", action="store_true", help="full ablation at dp 2 and 4 only")
    ap.add_argument("--verbose", "-v", action="store_true", help="full ablation: also every setup's table")
    ap.add_argument("--dp", type=int, help="single setup: data-parallel pipelines (at least 2; default 4)")
    ap.add_argument("--pp", type=int, help="single setup: pipeline stages (default 4)")
    ap.add_argument("--microbatches", type=int, help="single setup: micro-batches per pipeline (default 8)")
    ap.add_argument("--model", help="single setup: model (default gpt3-medium)")
    ap.add_argument("--hardware", help="single setup: hardware (default a100-40gb)")
    ap.add_argument("--stages", help="single setup: stages whose worker in pipeline 0 fails, one at a time "
                                     "(comma-separated; default 1,2)")
    ap.add_argument("--overlap", action="store_true",
                    help="overlap each gradient all-reduce with the last micro-batch's backward "
                         "(train.overlap_grad_reduce=true; default: after it)")
    ap.add_argument("--out", default=None, help="Gantt of the three levels (default runs/recycle-ablation.png, "
                                                "with --overlap runs/recycle-ablation-overlap.png)")
    args = ap.parse_args()
    one = any(v is not None for v in (args.dp, args.pp, args.microbatches, args.model, args.hardware, args.stages))
    if one and (args.full or args.quick):
        ap.error("--full/--quick run the fixed set of setups; leave out --dp/--pp/--model/... (or use those alone)")
    print(f"recycle_ablation.py: ReCycle's levels on the simulator, "
          f"{'one setup' if one else 'dp 2 and 4' if args.quick else 'the full ablation'}, progress on stderr; "
          f"typically {DURATION}", file=sys.stderr, flush=True)
    single(args) if one else full(args)


if __name__ == "__main__":
    main()
