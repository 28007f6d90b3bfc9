"""Swift against checkpoint restart, CheckFreq and Elastic Horovod, on the simulator.

    python benchmarks/swift.py [--quick] [--plot runs/swift.png] [--parallel 4] [--iterations N] [--restart-s S]
    python benchmarks/swift.py --grid    # best/this against the run length and the restart cost

Typical duration: 9-30 s (--quick: 6-40 s; --grid: 30-60 s) on 2 shared cores, depending on load;
every row is a simulated run.

Setups (one failure in each run; every strategy sees the same one):
  swift-eval   Swift's own evaluation setup as its scripts give it (conf/experiment/swift-eval.yaml
               names the source or the assumption behind every value): BERT-Large width, 128
               layers, one layer per GPU on 16 nodes x 8 GPUs over TCP, 1F1B, micro-batch 4,
               global batch 512, one machine killed at iteration 150 of 300. dp = 1: Swift
               recovers by logging and replay.
  gpt3-*       GPT-3 Medium, 2.7B and 6.7B in the suite's usual grids (the ReCycle table's:
               pp 4 x dp 4, 6.7B pp 8 x dp 4; 2.7B pp 8 x dp 4, our assumption), one GPU per
               node, A100 80 GB, 8 (6.7B and 2.7B: 16) micro-batches of 1 x 2048 tokens, node 2
               (pipeline 0's stage 2) failing at iteration 150 of 300. dp = 4: Swift copies
               the lost stage from a live replica. --quick runs Medium only.
  gpt3-*-dp1   the same model on one pipeline (dp 1, the global batch kept): logging and replay.

Run length and restart cost: the kill at iteration 150 is Swift's scripts'; the 300 iterations
are our assumption (as long again after the failure as before it). A process restart costs
hardware.restart_s, 60 s in both profiles used (v100-16gb, a100-80gb; the schema's default, an
assumption). --iterations N runs N iterations with the failure still at 150 (N > 150);
--restart-s S sets hardware.restart_s. --grid runs the setups with the largest best/this
(Swift's own, GPT-3 Medium dp 1) and GPT-3 Medium dp 4 at iterations 300/1000/3000 x restart
30/60/300 s (--iterations or --restart-s, if given, fix that axis) and prints best/this per
cell instead of the table (no plot).

Rows, each interval set here explicitly: `none` (no fault tolerance, fault-free: the common
baseline); checkpoint restart (files at the Young/Daly interval from the run's failure rate,
one failure per run: what an operator would run); CheckFreq (its own interval from its overhead
rule, snapshot then persist); Elastic Horovod (in-memory commit every 10 iterations: our
assumption, the paper does not give it); Swift (checkpoint every 100 iterations, as its
scripts); Swift with parallel recovery (--parallel workers per replayed one; logging setups
only). Columns: the strategy's fault-free iteration time against `none`'s (logging's overhead
appears here: the log writes are overlapped and cost nothing unless storage cannot keep up),
the recovery time and lost iterations of the failure, and the run's total time; the last
column is the total time of the best of CheckFreq and Elastic Horovod over this row's (Swift's
headline: up to 1.16x). A strategy that cannot recover says why (Elastic Horovod needs a live
replica of every stage: none at dp 1).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (label, overrides) of each setup
GPT3 = {"gpt3-medium": (4, 4, 8), "gpt3-2.7b": (8, 4, 16), "gpt3-6.7b": (8, 4, 16)}  # pp, dp, micro-batches
ITERATIONS = 300  # our assumption (swift-eval.yaml): as long again after the failure as before it
FAILURE_AT = 150  # the iteration Swift's scripts kill a machine at (swift-eval.yaml); the GPT-3 setups' too
# --grid: the setups with the largest best/this, and one with a replica beside them
GRID_SETUPS = ("swift-eval", "gpt3-medium-dp1", "gpt3-medium")
GRID_ITERATIONS = (300, 1000, 3000)
GRID_RESTART_S = (30.0, 60.0, 300.0)
# measured wall time of the default run
DURATION = "9-30 s on 2 shared cores, depending on load (--quick: 6-40 s; --grid: 30-60 s)"
COMMON = ("backend=sim", "report.gantt=false", "report.progress=false", "wandb.mode=disabled",
          "report.check_fault_free=false")


def setups(quick: bool, iterations: int | None = None, restart_s: float | None = None
           ) -> list[tuple[str, tuple[str, ...]]]:
    """(setup, overrides); `iterations` (None: 300) and `restart_s` (None: the profile's)."""
    tail = (f"hardware.restart_s={restart_s}",) if restart_s is not None else ()
    out = [("swift-eval", ("+experiment=swift-eval", f"train.iterations={iterations or ITERATIONS}") + tail)]
    for model, (pp, dp, m) in GPT3.items():
        if quick and model != "gpt3-medium":
            continue
        base = (f"model={model}", "hardware=a100-80gb", f"cluster.pp={pp}", "cluster.gpus_per_node=1",
                "cluster.spares=1", "train.microbatch_size=1", f"train.iterations={iterations or ITERATIONS}",
                "failures=scripted", f"failures.events=[{{iteration:{FAILURE_AT},node:2}}]") + tail
        out.append((model, base + (f"cluster.dp={dp}", f"train.microbatches={m}")))
        out.append((f"{model}-dp1", base + ("cluster.dp=1", f"train.microbatches={m * dp}")))
    return out


def rows(parallel: int) -> list[tuple[str, tuple[str, ...]]]:
    """(label, overrides): every interval explicit (on swift-eval they win over the experiment's
    table.strategies, which agrees except for checkpoint restart's 100)."""
    return [("none", ("strategy=none", "failures=none", "failures.events=[]")),
            ("checkpoint", ("strategy=checkpoint", "strategy.every=null")),  # Young/Daly from the script's rate
            ("checkfreq", ("strategy=checkfreq", "strategy.every=null")),  # CheckFreq's overhead rule
            ("elastic-horovod", ("strategy=elastic-horovod", "strategy.every=10")),
            ("swift", ("strategy=swift", "strategy.every=100")),
            (f"swift parallel {parallel}", ("strategy=swift", "strategy.every=100",
                                            f"strategy.parallel_recovery={parallel}"))]


def _wanted(setup: str, label: str, grid: bool) -> bool:
    replica = not setup.endswith(("-dp1", "eval"))
    if label.startswith("swift parallel"):
        return not replica  # replication: nothing is replayed
    if grid:  # only what best/this reads; Elastic Horovod cannot recover without a replica
        return label in ("checkfreq", "swift") or (label == "elastic-horovod" and replica)
    return True


def one(folder: Path, overrides: tuple[str, ...]) -> dict:
    from ftbench.cli import compose  # here, not at the top: --help and the header come first
    from ftbench.run import execute

    overrides = list(COMMON + overrides)  # as the command line's: they win over an experiment's table
    return execute(compose(overrides), folder, echo=lambda *_: None, overrides=overrides)


def measure(quick: bool, parallel: int, echo=print, iterations: int | None = None,
            restart_s: float | None = None) -> dict[str, dict[str, dict]]:
    """setup -> row label -> the run's summary, each row printed as it comes."""
    header = f"{'setup':<16} {'strategy':<18} {'iter s':>8} {'vs none':>8} {'recovery':>9} {'lost it':>7} " \
             f"{'total':>9} {'best/this':>9}"
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setup, base in setups(quick, iterations, restart_s):
            echo(header if not results else "")
            got = results[setup] = {}
            for label, extra in rows(parallel):
                if not _wanted(setup, label, grid=False):
                    continue
                s = got[label] = one(Path(tmp) / f"{setup}-{label}".replace(" ", "-"), base + extra)
                echo(_row(setup, label, s, got))
    return results


def grid(parallel: int, iterations=GRID_ITERATIONS, restarts=GRID_RESTART_S, only=GRID_SETUPS,
         echo=print) -> dict[tuple[str, int, float], dict[str, dict]]:
    """(setup, iterations, restart_s) -> row label -> summary, for the rows best/this reads;
    a line per cell as it comes."""
    echo(f"{'setup':<16} {'iters':>5} {'restart':>7} {'checkfreq':>9} {'(rec)':>6} {'e-horovod':>9} "
         f"{'swift':>8} {'(rec)':>6} {'swift p' + str(parallel):>8} {'best/swift':>10} {'best/p' + str(parallel):>8}")
    out: dict[tuple[str, int, float], dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setup in only:
            for n in iterations:
                for restart in restarts:
                    base = dict(setups(False, n, restart))[setup]
                    got = out[(setup, n, restart)] = {}
                    for label, extra in rows(parallel):
                        if _wanted(setup, label, grid=True):
                            folder = Path(tmp) / f"{setup}-{n}-{restart}-{label}".replace(" ", "-")
                            got[label] = one(folder, base + extra)
                    echo(_cell(setup, n, restart, got, parallel))
            echo("")
    return out


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--quick", action="store_true", help="Swift's setup and GPT-3 Medium only")
    parser.add_argument("--parallel", type=int, default=4, help="parallel recovery's workers per replayed one")
    parser.add_argument("--iterations", type=_positive(int), default=None,
                        help=f"iterations per run (default {ITERATIONS}; the failure stays at iteration {FAILURE_AT})")
    parser.add_argument("--restart-s", type=_positive(float), default=None,
                        help="hardware.restart_s, a process restart in seconds (default: the profile's, 60)")
    parser.add_argument("--grid", action="store_true",
                        help=f"best/this of {', '.join(GRID_SETUPS)} at iterations "
                             f"{'/'.join(map(str, GRID_ITERATIONS))} x restart "
                             f"{'/'.join(f'{r:g}' for r in GRID_RESTART_S)} s instead of the table "
                             "(--iterations, --restart-s: fix that axis)")
    parser.add_argument("--plot", default="runs/swift.png",
                        help="total times as bars, written under runs/ unless given ('' for none; not with --grid)")
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations <= FAILURE_AT:
        parser.error(f"--iterations must be above {FAILURE_AT}, the failure's iteration")
    print(f"swift.py: a row per simulated run; typically {DURATION}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    if args.grid:
        iterations = (args.iterations,) if args.iterations else GRID_ITERATIONS
        restarts = (args.restart_s,) if args.restart_s else GRID_RESTART_S
        print("best/this against the run length and the restart cost (sim; one failure at iteration "
              f"{FAILURE_AT}; total times and CheckFreq's and Swift's recovery in s)", flush=True)
        cells = grid(args.parallel, iterations, restarts, echo=lambda line: print(line, flush=True))
        print(f"{len(cells)} cells in {time.perf_counter() - started:.0f} s. `best/swift`, `best/p{args.parallel}`: "
              "the best total time of CheckFreq and Elastic Horovod over Swift's, serial and parallel recovery.")
        return 0
    print("Swift vs checkpoint restart, CheckFreq, Elastic Horovod (sim; one failure per run; times in s)",
          flush=True)
    results = measure(args.quick, args.parallel, echo=lambda line: print(line, flush=True),
                      iterations=args.iterations, restart_s=args.restart_s)
    print(f"\n{len(results)} setups in {time.perf_counter() - started:.0f} s. `best/this`: the best total time of "
          "CheckFreq and Elastic Horovod over this row's (above 1: faster than both).")
    if args.plot:
        _plot(results, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def _best(got: dict) -> float | None:
    """The best total time of CheckFreq and Elastic Horovod among those that recovered."""
    best = [got[k]["time_s"] for k in ("checkfreq", "elastic-horovod") if k in got and got[k]["status"] == "ok"]
    return min(best) if best else None


def _cell(setup: str, n: int, restart: float, got: dict, parallel: int) -> str:
    best = _best(got)

    def total(label):
        s = got.get(label)
        return "" if s is None else f"{s['time_s']:.1f}" if s["status"] == "ok" else s["status"][:9]

    def rec(label):
        s = got.get(label)
        return f"{s['recoveries'][0]['recovery_s']:.1f}" if s and s["status"] == "ok" and s["recoveries"] else ""

    def ratio(label):
        s = got.get(label)
        return f"{best / s['time_s']:.3f}" if best and s and s["status"] == "ok" else ""

    p = f"swift parallel {parallel}"
    return (f"{setup:<16} {n:>5} {restart:>7g} {total('checkfreq'):>9} {rec('checkfreq'):>6} "
            f"{total('elastic-horovod') or 'n/a':>9} {total('swift'):>8} {rec('swift'):>6} {total(p):>8} "
            f"{ratio('swift'):>10} {ratio(p):>8}")


def _row(setup: str, label: str, s: dict, got: dict) -> str:
    base = got.get("none", {}).get("iteration_time_s")
    T = s.get("iteration_time_s")
    if s["status"] != "ok":
        return f"{setup:<16} {label:<18} {s['status']}: {s['error'][:90]}"
    rec = s["recoveries"][0] if s["recoveries"] else None
    best = _best(got)
    ratio = f"{best / s['time_s']:9.3f}" if best and label.startswith("swift") else f"{'':>9}"
    return (f"{setup:<16} {label:<18} {T:8.3f} {T / base if base else float('nan'):8.3f} "
            f"{rec['recovery_s'] if rec else 0.0:9.1f} {rec['lost_iterations'] if rec else 0:7d} "
            f"{s['time_s']:9.1f} {ratio}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(results), 4)
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, (setup, got) in zip(axes.flat, results.items()):
        labels = [k for k in got if k != "none"]
        values = [got[k]["time_s"] if got[k]["status"] == "ok" else 0.0 for k in labels]
        bars = ax.bar(range(len(labels)), values, color=["#888", "#4a7", "#d84", "#47c", "#47c"][:len(labels)])
        for bar, k in zip(bars, labels):
            if got[k]["status"] != "ok":
                ax.text(bar.get_x() + bar.get_width() / 2, 0, got[k]["status"], rotation=90, ha="center",
                        va="bottom", fontsize=7)
        if got.get("none", {}).get("status") == "ok":
            ax.axhline(got["none"]["time_s"], color="k", lw=0.8, ls="--", label="fault-free (none)")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(setup, fontsize=9)
        ax.set_ylabel("total time of the run (s)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
