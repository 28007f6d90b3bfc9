"""ReCycle ablation on the simulator: what each mechanism buys when workers fail.

The ReCycle talk (Gandhi et al., SOSP 2024; the authors' MLSys seminar) reports, on an example
pipeline it does not publish, that re-routing a failed worker's micro-batches on 1F1B loses
about 33 % of the fault-free throughput, decoupled backprop brings that to about 8 %, and the
staggered optimizer removes most of the rest. This script measures the same three steps
(`strategy.level` of strategies/recycle.py) as they are implemented:

  - reroute:   the failed worker's micro-batches go to its data-parallel peers at the same
               stage, on 1F1B with a fused backward (BW) and an optimizer barrier;
  - decoupled: + decoupled backprop (B and W split, W deferred into bubbles);
  - staggered: + staggered optimizer (no barrier between iterations: each stage steps when its
               own all-reduce ends; the simulator times the steady-state period).

Every adapted plan adds work to the configured schedule (ftbench/release.py): each surviving
worker runs its own F and B/BW in their fault-free order, none before its fault-free start,
and steps no earlier than the fault-free step; re-routed micro-batches and deferred W fill the
bubbles. With the staggered optimizer the slots repeat every fault-free period. So no plan is
faster than fault-free, and the one reference is fault-free 1F1B: the configured schedule,
which ReCycle runs with no failure exactly as `strategy=none` does (the script checks that
each level's fault-free plan times the same).

Setup, fixed by a rule chosen before measuring (the talk's pipeline is not published):
  - the models, grids and testbed of this project's ReCycle table, read from
    conf/experiment/recycle-table.yaml (`table.models`: GPT-3 Medium and 3.35B at pp 4 with
    8 micro-batches per pipeline, 6.7B at pp 8 with 16; micro-batch 1 x 2048 tokens; hardware
    recycle-testbed, A100 80 GB with one 25 GB/s NIC per GPU; one GPU per node, so a failure
    takes one worker);
  - hardware.efficiency at the profile's 0.5, not the table's per-model fit, which matches the
    paper's samples/s under a global batch that is our assumption (--efficiency to change it);
  - the table's dp (4), and dp 2 and 8 beside it: a failure gives each surviving peer of the
    failed stage 1/(dp - 1) more work (100 %, 33 %, 14 %), which is what the bubbles must
    absorb, and the talk does not say what its example's was;
  - failed workers (pipeline, stage): (0,1); then also (1,2), another stage in another
    pipeline, so every stage keeps a replica even at dp 2.
Every level runs the same setups and failure sets.

Besides the levels: "drop" removes the failed workers' pipelines and spreads the global batch
over the others, on the same 1F1B; "work bound" is max(fault-free time, the most any
survivor must compute), with the failed stage's micro-batches spread as evenly as whole
micro-batches go: no plan at any level can beat it (B + W costs what BW costs). Every line
processes the same global batch, so throughput ratios are inverse iteration-time ratios;
changes are throughput changes in % (negative: a loss). For each staggered plan the script
names what sets its period: the fault-free period (release times), or the worker whose span
is the period, its last op and the all-reduce its step waits for.

    python benchmarks/recycle_ablation.py [--quick] [-v] [--overlap] [--efficiency E] [--out PNG]
    python benchmarks/recycle_ablation.py --dp 4 [--model gpt3-medium] [--pp 4] [--microbatches 8]
                                          [--hardware recycle-testbed] [--stages 1,2]

--quick runs dp 2 and 4 only. -v adds every setup's full table. --overlap runs everything with
train.overlap_grad_reduce=true (each layer's gradient all-reduce during the last micro-batch's
backward, Megatron-LM's --overlap-grad-reduce) instead of after it (DeepSpeed, the paper's
baseline; the default). The single-setup form (any of --dp, --model, --hardware, --pp,
--microbatches, --stages) fails worker (0, s) for each s in --stages, one at a time. A Gantt of
fault-free 1F1B and the three levels on one time axis (GPT-3 Medium, dp 4, one failure; the
single setup: its first failure) goes to runs/recycle-ablation.png or --out.

Plans are computed on the spot (strategy.plan_cache=null, plan_ahead=0). A plan whose peak
memory exceeds the GPU prints as "oom", a failure set that ReCycle cannot re-route as
"no plan", each with its reason below the table. Nothing here is tuned to the talk's numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "conf" / "experiment" / "recycle-table.yaml"
DPS = (2, 4, 8)
QUICK_DPS = (2, 4)
# Failed grid positions (pipeline, stage), failed in this order: one worker; then a second of
# another stage in another pipeline (every stage keeps a replica, even at dp 2).
FAILURE_SETS = {1: ((0, 1),), 2: ((0, 1), (1, 2))}
GANTT_MODEL, GANTT_DP, GANTT_FAILURES = "gpt3-medium", 4, 1
TALK = {"reroute": -33.0, "decoupled": -8.0}  # the talk's throughput changes, in %
# measured wall time of the default run
DURATION = "13-30 s on 2 shared cores (--quick: 9-20 s; one setup, e.g. --dp 4: 4-10 s)"
REL = 1e-9  # float tolerance of "the same time" (sums of the same op lengths in another order)


def _announce(argv) -> None:
    """The first line, on stderr, before the heavy imports."""
    if any(a in ("-h", "--help") for a in argv):
        return
    one = any(a.split("=")[0] in ("--dp", "--pp", "--microbatches", "--model", "--hardware", "--stages")
              for a in argv)
    what = "one setup" if one else "dp 2 and 4" if "--quick" in argv else "the full ablation"
    print(f"recycle_ablation.py: ReCycle's levels on the simulator, {what}, progress on stderr; "
          f"typically {DURATION}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _announce(sys.argv[1:])

sys.path.insert(0, str(ROOT))

from ftbench.cli import compose  # noqa: E402
from ftbench.cluster import Cluster  # noqa: E402
from ftbench.context import RunContext  # noqa: E402
from ftbench.costs import PlanCosts  # noqa: E402
from ftbench.failures import FailureEvent  # noqa: E402
from ftbench.gantt import plot_gantt_panels  # noqa: E402
from ftbench.schedule import BW, OPT, W, grid_worker  # noqa: E402
from ftbench.sim.simulator import SimResult, simulate  # noqa: E402
from ftbench.strategies import build_strategy  # noqa: E402
from ftbench.strategies.recycle import LEVELS  # noqa: E402

MECHANISM = {
    "reroute": "re-routing, 1F1B + fused BW, optimizer barrier",
    "decoupled": "re-routing + decoupled B/W (W into bubbles)",
    "staggered": "re-routing + decoupled B/W + staggered optimizer",
}


@dataclass(frozen=True)
class Setup:
    model: str
    label: str
    pp: int
    microbatches: int  # per pipeline
    hardware: str = "recycle-testbed"
    table_dp: int | None = None  # the table's dp for this model (None: not a table setup)
    overlap: bool = False  # train.overlap_grad_reduce (--overlap)
    efficiency: float | None = None  # hardware.efficiency (None: the profile's)


def table_setups() -> tuple[Setup, ...]:
    """The ReCycle table's models and grids (conf/experiment/recycle-table.yaml, table.models)."""
    from omegaconf import OmegaConf

    models = OmegaConf.load(TABLE).table.models
    return tuple(Setup(name, str(m.label), int(m.pp), int(m.microbatches), table_dp=int(m.dp))
                 for name, m in models.items())


# -- running the strategies ------------------------------------------------------------------

@dataclass
class Outcome:
    """A simulated plan, or why there is none (`failed`: 'oom: ...' or 'no plan: ...')."""
    result: SimResult | None = None
    failed: str | None = None

    @property
    def time(self) -> float | None:
        return None if self.result is None else self.result.iteration_time

    @property
    def short(self) -> str:
        return (self.failed or "").split(":")[0]


def config(setup: Setup, dp: int, level: str = "staggered"):
    extra = [] if setup.efficiency is None else [f"hardware.efficiency={setup.efficiency}"]
    return compose(["backend=sim", "failures=none", "strategy=recycle", f"strategy.level={level}",
                    "strategy.plan_ahead=0", "strategy.plan_cache=null", f"model={setup.model}",
                    f"hardware={setup.hardware}", f"cluster.pp={setup.pp}", f"cluster.dp={dp}",
                    "cluster.gpus_per_node=1", f"train.microbatches={setup.microbatches}",
                    f"train.overlap_grad_reduce={str(setup.overlap).lower()}", *extra])


def run_plan(ctx: RunContext, plan) -> Outcome:
    """Simulate a plan (the steady-state period when staggered); one whose simulated peak
    memory exceeds the GPU's is an oom outcome."""
    result = simulate(plan.schedule, PlanCosts(ctx.cost_model, plan), staggered=plan.staggered_optimizer)
    capacity = ctx.cost_model.memory_bytes
    worst = max(result.peak_memory_bytes, key=result.peak_memory_bytes.get)
    if result.peak_memory_bytes[worst] > capacity:
        return Outcome(failed=f"oom: worker {worst} needs {result.peak_memory_bytes[worst] / 1e9:.1f} GB "
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
            out.append(Outcome(failed=f"no plan: {recovery.unrecoverable or 'none returned'}"))
        else:
            out.append(run_plan(ctx, recovery.plan))
    for node in reversed(failed_nodes):
        cluster.join(node)
        strategy.on_event(FailureEvent(node=node, kind="join", iteration=2), cluster, 2)
    return out


@dataclass
class Cell:
    """One setup (model, dp) and everything measured on it."""
    setup: Setup
    dp: int
    global_batch: int
    reference: Outcome  # fault-free 1F1B: strategy=none's plan
    fault_free: dict[str, Outcome]  # level -> ReCycle's own fault-free run (the same plan)
    levels: dict[str, dict[tuple, Outcome]]  # level -> failed positions -> outcome
    drop: dict[int, Outcome]  # failed pipelines -> 1F1B on the others, same global batch
    bounds: dict[tuple, float] = field(default_factory=dict)  # failed positions -> work bound (s)

    def failed(self, level: str, positions) -> Outcome:
        return self.levels[level][tuple(positions)]


def chains_of(failure_sets) -> list[list]:
    """The failure sets that are no prefix of another: each is failed in turn, and its
    prefixes' outcomes come with it."""
    return [list(p) for p in failure_sets
            if not any(len(q) > len(p) and list(q[:len(p)]) == list(p) for q in failure_sets)]


def work_bound(reference: SimResult, setup: Setup, dp: int, positions) -> float:
    """max(the fault-free time, the most compute any worker must do) with the workers at
    `positions` failed: the failed stage's dp x m micro-batches spread over its survivors as
    evenly as whole micro-batches go (each keeps its own), at their fault-free F + BW times,
    plus the stage's step. B + W costs BW, so this bounds every level, barrier or staggered."""
    pp, m = setup.pp, setup.microbatches
    compute, step = {}, {}
    for w, op, s, e in reference.ops:
        if w // pp == 0:  # pipeline 0's workers: one per stage
            if op.kind == OPT:
                step[op.stage] = e - s
            else:
                compute[op.stage] = compute.get(op.stage, 0.0) + (e - s)
    bound = reference.iteration_time
    for stage in {s for _, s in positions}:
        survivors = dp - sum(1 for _, s in positions if s == stage)
        most = math.ceil(dp * m / survivors)
        bound = max(bound, compute[stage] / m * most + step.get(stage, 0.0))
    return bound


def measure(setup: Setup, dp: int, failure_sets, progress=None) -> Cell:
    """Run every level on one setup. `failure_sets`: lists of positions, each failed in turn;
    a set that is a prefix of another shares its runs."""
    ctx = RunContext.from_config(config(setup, dp))
    reference = run_plan(ctx, ctx.grid_plan(setup.pp, dp, 1))
    levels, fault_free = {}, {}
    for level in LEVELS:
        cfg = config(setup, dp, level)
        lctx = RunContext.from_config(cfg)
        cluster = Cluster.from_config(cfg.cluster)
        strategy = build_strategy(cfg.strategy, lctx)
        fault_free[level] = run_plan(lctx, strategy.plan(cluster))
        levels[level] = {}
        for chain in chains_of(failure_sets):
            for i, o in enumerate(fail_in_turn(strategy, lctx, cluster, chain, setup.pp)):
                levels[level][tuple(chain[:i + 1])] = o
        if progress:
            progress(level)
    lost = sorted({len({d for d, _ in p}) for p in failure_sets})
    drop = {n: (run_plan(ctx, ctx.grid_plan(setup.pp, dp - n, 1)) if dp > n
                else Outcome(failed="no pipeline left")) for n in lost}
    bounds = ({tuple(p): work_bound(reference.result, setup, dp, p) for p in failure_sets}
              if reference.result is not None else {})
    return Cell(setup, dp, ctx.global_batch, reference, fault_free, levels, drop, bounds)


# -- what sets the staggered period ---------------------------------------------------------

@dataclass
class Limit:
    """Why a staggered plan's period is what it is: in steady state every worker's iterations
    start one period apart and each worker starts its next iteration only after its own
    optimizer step, so the period is at least every worker's span (first op start to step
    end). The critical worker's span is the period; its step waits for its last op or for
    its stage's all-reduce, which waits for that stage's last weight gradient anywhere.
    With release times the period is also at least the fault-free one (`released`)."""
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
    released: float | None = None  # the fault-free period the release times repeat with

    @property
    def release_bound(self) -> bool:
        """The period is the fault-free one: the slots, not the work, set it."""
        return self.released is not None and self.period <= self.released * (1 + REL)

    @property
    def bound_by(self) -> str:
        if self.release_bound:
            return "release times"
        if self.allreduce is not None and self.allreduce[2] > self.last_op[1] + 1e-12:
            return "all-reduce"
        return "own compute"

    def describe(self, pp: int) -> str:
        """One line, times relative to the critical worker's iteration start."""
        if self.release_bound:
            return (f"period {self.period * 1e3:.2f} ms = the fault-free period: the slots repeat with it and "
                    f"the re-routed work fits in the bubbles (a delay it causes is carried as a constant lag)")
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
    simulated iteration: the worker with the longest span (of several, the least idle), its last op, and the all-reduce
    its optimizer step waits for."""
    rows: dict[int, list] = {}
    for w, op, s, e in result.ops:
        rows.setdefault(w, []).append((op, s, e))
    spans = {}
    for w, ops in rows.items():
        steps = [(s, e) for op, s, e in ops if op.kind == OPT]
        spans[w] = (max(e for _, e in steps) if steps else max(e for _, _, e in ops)) - min(s for _, s, _ in ops)
    busy = {v: sum(e - s for op, s, e in ops if op.kind != OPT) for v, ops in rows.items()}
    longest = max(spans.values())
    # of the workers whose span is the period, the one with the least idle time
    w = max((v for v in spans if spans[v] >= longest - 1e-6 * longest), key=lambda v: (busy[v], -v))
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
    also = tuple(v for v in sorted(spans) if v != w and spans[v] >= longest - 1e-6 * longest)
    released = result.schedule.released.period if result.schedule is not None and \
        result.schedule.released is not None else None
    return Limit(result.iteration_time, w, position, spans[w], (ops[0][0], ops[0][1]), (last[0], last[2]),
                 busy[w], allreduce, allreduce_input, step, also, released)


# -- printing --------------------------------------------------------------------------------

def change_value(reference: float | None, t: float | None) -> float | None:
    """Throughput change relative to a reference, in % (negative: a loss)."""
    if reference is None or t is None:
        return None
    return (reference / t - 1) * 100


def change(reference: float | None, t: float | None) -> str:
    """The same as text, e.g. '-14.6 %'."""
    value = change_value(reference, t)
    if value is None:
        return "-"
    return f"{0.0 if abs(value) < 0.05 else value:+.1f} %"


def removed(reference: float | None, before: float | None, after: float | None) -> str:
    """The share of the loss at `before` that `after` removes (throughput terms), e.g. '100 %'."""
    lost_before, lost_after = change_value(reference, before), change_value(reference, after)
    if lost_before is None or lost_after is None or lost_before > -0.05:
        return "-"  # nothing to remove
    return f"{(lost_before - lost_after) / lost_before * 100:.0f} %"


def positions_label(positions) -> str:
    return "+".join(f"({d},{s})" for d, s in positions) if positions else "none"


def peer_share(dp: int) -> str:
    """The extra work a failure gives each surviving peer of its stage, on average."""
    return f"+{100 / (dp - 1):.0f} %"


def fmt_table(head, rows, left=(0,)) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def markdown(head, rows) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def ms(outcome: Outcome) -> str:
    return f"{outcome.time * 1e3:.2f} ms" if outcome.time is not None else outcome.short


def setup_label(cell: Cell) -> str:
    s = cell.setup
    return f"{s.label} (pp {s.pp} x dp {cell.dp}{', table' if cell.dp == s.table_dp else ''})"


def parity_notes(cells: list[Cell]) -> list[str]:
    """Lines for every level whose fault-free run does not time as fault-free 1F1B (none expected)."""
    notes = []
    for cell in cells:
        for level, o in cell.fault_free.items():
            if o.time is None or cell.reference.time is None or \
                    abs(o.time - cell.reference.time) > REL * cell.reference.time:
                notes.append(f"WARNING {setup_label(cell)}: {level} fault-free {ms(o)} != 1F1B {ms(cell.reference)}")
    return notes


def summary_table(cells: list[Cell], failure_sets) -> str:
    """One Markdown row per (model, dp, failures): each level's iteration time and change vs
    fault-free 1F1B, the share of the decoupled loss the staggered optimizer removes,
    dropping the failed pipelines, and the work bound. Reasons for missing cells follow."""
    head = ["setup", "peer's extra work", "failed", "1F1B fault-free", *LEVELS, "staggered removes",
            "drop pipelines (1F1B)", "work bound"]
    rows, notes = [], []
    for cell in cells:
        ref = cell.reference.time
        for positions in failure_sets:
            row = [setup_label(cell), peer_share(cell.dp), positions_label(positions), ms(cell.reference)]
            for level in LEVELS:
                o = cell.failed(level, positions)
                row.append(o.short if o.failed else f"{o.time * 1e3:.1f} ms: {change(ref, o.time)}")
                if o.failed:
                    notes.append(f"{setup_label(cell)}, {level}, {positions_label(positions)} failed: {o.failed}")
            row.append(removed(ref, cell.failed("decoupled", positions).time, cell.failed("staggered", positions).time))
            lost = len({d for d, _ in positions})
            d = cell.drop[lost]
            row.append(d.short if d.failed else f"{d.time * 1e3:.1f} ms: {change(ref, d.time)}")
            bound = cell.bounds.get(tuple(positions))
            row.append("-" if bound is None else f"{bound * 1e3:.1f} ms: {change(ref, bound)}")
            rows.append(row)
    return markdown(head, rows) + "".join(f"\n  {n}" for n in notes + parity_notes(cells))


def talk_lines(cells: list[Cell]) -> str:
    """Per dp, one failure: the range of each level's change over the models, beside the talk's."""
    positions = FAILURE_SETS[1]
    lines = [f"The talk: reroute {TALK['reroute']:+.0f} %, decoupled {TALK['decoupled']:+.0f} %, "
             "staggered removes most of the rest. Here, one failure, over the models:"]
    for dp in sorted({c.dp for c in cells}):
        at = [c for c in cells if c.dp == dp]
        parts = []
        for level in LEVELS:
            values = [change_value(c.reference.time, c.failed(level, positions).time) for c in at]
            values = [v for v in values if v is not None]
            parts.append(f"{level} {_span(values)}" if values else f"{level} -")
        shares = [removed(c.reference.time, c.failed("decoupled", positions).time,
                          c.failed("staggered", positions).time) for c in at]
        bounds = [change_value(c.reference.time, c.bounds.get(tuple(positions))) for c in at]
        bounds = [b for b in bounds if b is not None]
        lines.append(f"  dp {dp} (peer's extra work {peer_share(dp)}): " + ", ".join(parts)
                     + f"; staggered removes {', '.join(shares)} of the decoupled loss"
                     + (f"; work bound {_span(bounds)}" if bounds else ""))
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    fmt = lambda v: f"{0.0 if abs(v) < 0.05 else v:+.1f}"  # noqa: E731
    return f"{fmt(lo)} %" if fmt(lo) == fmt(hi) else f"{fmt(lo)} to {fmt(hi)} %"


def cell_table(cell: Cell, failure_sets) -> str:
    """Every line of one setup: the reference, each level failed, dropping the pipeline(s)."""
    ref = cell.reference.time
    rows = [("1F1B fault-free (= none = recycle, no failure)", ms(cell.reference), change(ref, ref),
             "the configured schedule, fused BW")]
    notes = [f"1F1B fault-free: {cell.reference.failed}"] if cell.reference.failed else []
    for positions in failure_sets:
        for level in LEVELS:
            o = cell.failed(level, positions)
            rows.append((f"{level} failed {positions_label(positions)}", ms(o), change(ref, o.time), MECHANISM[level]))
            if o.failed:
                notes.append(f"{level} failed {positions_label(positions)}: {o.failed}")
        bound = cell.bounds.get(tuple(positions))
        if bound is not None:
            rows.append((f"work bound {positions_label(positions)}", f"{bound * 1e3:.2f} ms", change(ref, bound),
                         "max(fault-free, the busiest survivor's compute)"))
    for lost, o in cell.drop.items():
        rows.append((f"drop {lost} pipeline{'s' if lost > 1 else ''} (1F1B)", ms(o), change(ref, o.time),
                     f"dp {cell.dp} -> {cell.dp - lost} pipelines, same global batch"))
        if o.failed:
            notes.append(f"drop {lost}: {o.failed}")
    out = fmt_table(("line", "iteration", "vs fault-free", "mechanism"), rows, left=(0, 3))
    return out + "".join(f"\n  {n}" for n in notes + parity_notes([cell]))


def last_step(result: SimResult, pp: int) -> str:
    """The worker whose optimizer step ends a barrier iteration last, e.g. '(0,3)'."""
    w = max((r for r in result.ops if r[1].kind == OPT), key=lambda r: (r[3], -r[0]))[0]
    return f"({w // pp},{w % pp})"


def limits_text(cells: list[Cell], failure_sets) -> str:
    lines = []
    for cell in cells:
        for positions in failure_sets:
            staggered = cell.failed("staggered", positions)
            decoupled = cell.failed("decoupled", positions)
            head = f"{setup_label(cell)}, failed {positions_label(positions)}"
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
    if cell.reference.result is not None:
        panels.append((f"fault-free 1F1B (what ReCycle runs with no failure), {cell.reference.time * 1e3:.2f} ms",
                       cell.reference.result.timeline()))
    for level in LEVELS:
        o = cell.failed(level, positions)
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


def efficiency_note(setup: Setup, dp: int) -> str:
    eff = config(setup, dp).hardware.efficiency
    given = "given with --efficiency" if setup.efficiency is not None else "the profile's, not the table's fit"
    return f"hardware.efficiency {eff:g} ({given})"


def gantt_out(args) -> str:
    if args.out is not None:
        return args.out
    return "runs/recycle-ablation-overlap.png" if args.overlap else "runs/recycle-ablation.png"


def legend(failure_sets_text: str) -> str:
    return ("Cells: iteration time and throughput change vs fault-free 1F1B (negative: a loss); every line runs "
            "the same global batch.\n"
            f"Failed workers (pipeline, stage): {failure_sets_text}.\n"
            "peer's extra work: 1/(dp - 1), what each surviving peer of the failed stage takes on average. "
            "staggered removes: the share of the decoupled loss the staggered optimizer removes. drop: the "
            "failed workers' pipelines removed, the global batch on the others (1F1B). work bound: max(fault-free, "
            "the busiest survivor's compute with whole micro-batches spread evenly), which no level can beat.")


def full(args) -> None:
    dps = QUICK_DPS if args.quick else DPS
    failure_sets = [list(p) for p in FAILURE_SETS.values()]
    began = time.perf_counter()
    setups = [dataclasses.replace(s, overlap=args.overlap, efficiency=args.efficiency) for s in table_setups()]
    total, done, cells = len(setups) * len(dps) * len(LEVELS), 0, []
    for setup in setups:
        for dp in dps:
            def progress(level, setup=setup, dp=dp):
                nonlocal done
                done += 1
                print(f"\r[{done}/{total}] {setup.model} dp {dp} {level:<9}  {time.perf_counter() - began:5.1f} s",
                      end="", file=sys.stderr, flush=True)
            cells.append(measure(setup, dp, failure_sets, progress))
    print(file=sys.stderr)

    print("ReCycle ablation (simulator): the models and grids of the ReCycle table "
          "(conf/experiment/recycle-table.yaml), dp varied around the table's.")
    print("Setups: " + "; ".join(f"{s.label} at pp {s.pp}, {s.microbatches} micro-batches per pipeline (table: dp "
                                 f"{s.table_dp})" for s in setups)
          + f"; dp {', '.join(map(str, dps))}" + (" (--quick: dp 8 left out)" if args.quick else "")
          + f"; micro-batch 1 x 2048 tokens; {setups[0].hardware}, one GPU per node; {efficiency_note(setups[0], dps[0])}.")
    print(overlap_note(args.overlap))
    print(legend("(0,1); then (0,1)+(1,2), two stages in two pipelines") + "\n")
    print(summary_table(cells, failure_sets))
    print("\n" + talk_lines(cells))
    print("\nWhat sets the staggered period (its last simulated iteration; times from the start of the previous one):")
    print(limits_text(cells, failure_sets))
    if args.verbose:
        for cell in cells:
            s = cell.setup
            print(f"\n{s.label} on {s.hardware}, pp {s.pp} x dp {cell.dp}, {s.microbatches} micro-batches per "
                  f"pipeline ({cell.global_batch} samples per iteration)\n")
            print(cell_table(cell, failure_sets))
    chart = next((c for c in cells if c.setup.model == GANTT_MODEL and c.dp == GANTT_DP), None)
    if chart is not None:
        positions = failure_sets[GANTT_FAILURES - 1]
        out = gantt(chart, positions, gantt_out(args))
        print(f"\nGantt ({chart.setup.label}, dp {GANTT_DP}, {positions_label(positions)} failed): {out}")
    print(f"({time.perf_counter() - began:.1f} s)")


def single(args) -> None:
    setups = {s.model: s for s in table_setups()}
    model = args.model or "gpt3-medium"
    base = setups.get(model, Setup(model, model, 4, 8))
    setup = Setup(model, base.label, args.pp or base.pp, args.microbatches or base.microbatches,
                  args.hardware or base.hardware, base.table_dp, args.overlap, args.efficiency)
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
    print(f"ReCycle ablation: {setup.label} on {setup.hardware}, pp {setup.pp} x dp {dp}, "
          f"{setup.microbatches} micro-batches per pipeline ({cell.global_batch} samples per iteration), "
          f"one GPU per node; {efficiency_note(setup, dp)}")
    print(f"throughput change in % vs fault-free 1F1B (same global batch everywhere), negative = loss; "
          f"a failure gives each peer of its stage {peer_share(dp)} work")
    print(overlap_note(args.overlap) + "\n")
    print(cell_table(cell, failure_sets))
    print("\nWhat sets the staggered period:")
    print(limits_text([cell], failure_sets))
    out = gantt(cell, failure_sets[0], gantt_out(args))
    print(f"\nGantt: {out}   ({time.perf_counter() - began:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    ap.add_argument("--full", action="store_true", help="the full ablation (the default without setup options)")
    ap.add_argument("--quick", action="store_true", help="full ablation at dp 2 and 4 only")
    ap.add_argument("--verbose", "-v", action="store_true", help="full ablation: also every setup's table")
    ap.add_argument("--dp", type=int, help="single setup: data-parallel pipelines (at least 2; default 4)")
    ap.add_argument("--pp", type=int, help="single setup: pipeline stages (default: the table's for the model)")
    ap.add_argument("--microbatches", type=int, help="single setup: micro-batches per pipeline (default: the table's)")
    ap.add_argument("--model", help="single setup: model (default gpt3-medium)")
    ap.add_argument("--hardware", help="single setup: hardware (default recycle-testbed)")
    ap.add_argument("--stages", help="single setup: stages whose worker in pipeline 0 fails, one at a time "
                                     "(comma-separated; default 1,2)")
    ap.add_argument("--efficiency", type=float, default=None,
                    help="hardware.efficiency for every run (default: the hardware profile's, 0.5)")
    ap.add_argument("--overlap", action="store_true",
                    help="overlap each gradient all-reduce with the last micro-batch's backward "
                         "(train.overlap_grad_reduce=true; default: after it)")
    ap.add_argument("--out", default=None, help="Gantt of fault-free 1F1B and the three levels (default "
                                                "runs/recycle-ablation.png, with --overlap runs/recycle-ablation-overlap.png)")
    args = ap.parse_args()
    one = any(v is not None for v in (args.dp, args.pp, args.microbatches, args.model, args.hardware, args.stages))
    if one and (args.full or args.quick):
        ap.error("--full/--quick run the fixed set of setups; leave out --dp/--pp/--model/... (or use those alone)")
    single(args) if one else full(args)


if __name__ == "__main__":
    main()
