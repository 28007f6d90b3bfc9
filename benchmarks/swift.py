"""Swift against checkpoint restart, CheckFreq and Elastic Horovod, on the simulator.

    python benchmarks/swift.py [--quick] [--plot runs/swift.png] [--parallel 4]

Typical duration: 9-30 s (--quick: 8-40 s) on 2 shared cores, depending on load; every row is a simulated run.

Setups (one failure in each run; every strategy sees the same one):
  swift-eval   Swift's own evaluation setup as its scripts give it (conf/experiment/swift-eval.yaml
               names the source or the assumption behind every value): BERT-Large width, 128
               layers, one layer per GPU on 16 nodes x 8 GPUs over TCP, 1F1B, micro-batch 4,
               global batch 512, checkpoint every 100 iterations, one machine killed at
               iteration 150 of 300. dp = 1: Swift recovers by logging and replay.
  gpt3-*       GPT-3 Medium, 2.7B and 6.7B in the suite's usual grids (the ReCycle table's:
               pp 4 x dp 4, 6.7B pp 8 x dp 4; 2.7B pp 8 x dp 4, our assumption), one GPU per
               node, A100 80 GB, 8 (6.7B and 2.7B: 16) micro-batches of 1 x 2048 tokens, checkpoint
               every 100 iterations, node 2 (pipeline 0's stage 2) failing at iteration 150 of 300. dp = 4: Swift copies
               the lost stage from a live replica. --quick runs Medium only.
  gpt3-*-dp1   the same model on one pipeline (dp 1, the global batch kept): logging and replay.

Rows: `none` (no fault tolerance, fault-free: the common baseline); checkpoint restart
(files every 100 iterations); CheckFreq (its own tuned interval, snapshot then persist);
Elastic Horovod (in-memory commit every 10 iterations: our assumption, the paper does not
give it); Swift; Swift with parallel recovery (--parallel workers per replayed one; logging
setups only). Columns: the strategy's fault-free iteration time against `none`'s (logging's
overhead appears here: the log writes are overlapped and cost nothing unless storage cannot
keep up), the recovery time and lost iterations of the failure, and the run's total time; the
last column is the total time of the best of CheckFreq and Elastic Horovod over this row's
(Swift's headline: up to 1.16x). A strategy that cannot recover says why (Elastic Horovod
needs a live replica of every stage: none at dp 1).
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
# measured wall time of the default run
DURATION = "9-30 s on 2 shared cores, depending on load (--quick: 8-40 s)"
COMMON = ("backend=sim", "report.gantt=false", "report.progress=false", "wandb.mode=disabled",
          "report.check_fault_free=false")


def setups(quick: bool) -> list[tuple[str, tuple[str, ...]]]:
    out = [("swift-eval", ("+experiment=swift-eval",))]
    for model, (pp, dp, m) in GPT3.items():
        if quick and model != "gpt3-medium":
            continue
        base = (f"model={model}", "hardware=a100-80gb", f"cluster.pp={pp}", "cluster.gpus_per_node=1",
                "cluster.spares=1", "train.microbatch_size=1", "train.iterations=300", "failures=scripted",
                "failures.events=[{iteration:150,node:2}]")
        out.append((model, base + (f"cluster.dp={dp}", f"train.microbatches={m}")))
        out.append((f"{model}-dp1", base + ("cluster.dp=1", f"train.microbatches={m * dp}")))
    return out


def rows(parallel: int) -> list[tuple[str, tuple[str, ...]]]:
    return [("none", ("strategy=none", "failures=none", "failures.events=[]")),
            ("checkpoint", ("strategy=checkpoint", "strategy.every=100")),
            ("checkfreq", ("strategy=checkfreq", "strategy.every=null")),
            ("elastic-horovod", ("strategy=elastic-horovod", "strategy.every=10")),
            ("swift", ("strategy=swift", "strategy.every=100")),
            (f"swift parallel {parallel}", ("strategy=swift", "strategy.every=100",
                                            f"strategy.parallel_recovery={parallel}"))]


def one(folder: Path, overrides: tuple[str, ...]) -> dict:
    from ftbench.cli import compose  # here, not at the top: --help and the header come first
    from ftbench.run import execute

    return execute(compose(list(COMMON + overrides)), folder, echo=lambda *_: None)


def measure(quick: bool, parallel: int, echo=print) -> dict[str, dict[str, dict]]:
    """setup -> row label -> the run's summary, each row printed as it comes."""
    header = f"{'setup':<16} {'strategy':<18} {'iter s':>8} {'vs none':>8} {'recovery':>9} {'lost it':>7} " \
             f"{'total':>9} {'best/this':>9}"
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setup, base in setups(quick):
            echo(header if not results else "")
            got = results[setup] = {}
            for label, extra in rows(parallel):
                if label.startswith("swift parallel") and not setup.endswith(("-dp1", "eval")):
                    continue  # replication: nothing is replayed
                if "+experiment=swift-eval" in base:  # the experiment sets each system's own interval
                    extra = tuple(o for o in extra if not o.startswith("strategy.every"))
                s = got[label] = one(Path(tmp) / f"{setup}-{label}".replace(" ", "-"), base + extra)
                echo(_row(setup, label, s, got))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--quick", action="store_true", help="Swift's setup and GPT-3 Medium only")
    parser.add_argument("--parallel", type=int, default=4, help="parallel recovery's workers per replayed one")
    parser.add_argument("--plot", default="runs/swift.png",
                        help="total times as bars, written under runs/ unless given ('' for none)")
    args = parser.parse_args(argv)
    print(f"swift.py: a row per simulated run; typically {DURATION}", file=sys.stderr, flush=True)
    print("Swift vs checkpoint restart, CheckFreq, Elastic Horovod (sim; one failure per run; times in s)",
          flush=True)
    started = time.perf_counter()
    results = measure(args.quick, args.parallel, echo=lambda line: print(line, flush=True))
    print(f"\n{len(results)} setups in {time.perf_counter() - started:.0f} s. `best/this`: the best total time of "
          "CheckFreq and Elastic Horovod over this row's (above 1: faster than both).")
    if args.plot:
        _plot(results, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def _row(setup: str, label: str, s: dict, got: dict) -> str:
    base = got.get("none", {}).get("iteration_time_s")
    T = s.get("iteration_time_s")
    if s["status"] != "ok":
        return f"{setup:<16} {label:<18} {s['status']}: {s['error'][:90]}"
    rec = s["recoveries"][0] if s["recoveries"] else None
    best = [got[k]["time_s"] for k in ("checkfreq", "elastic-horovod") if k in got and got[k]["status"] == "ok"]
    ratio = f"{min(best) / s['time_s']:9.3f}" if best and label.startswith("swift") else f"{'':>9}"
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
