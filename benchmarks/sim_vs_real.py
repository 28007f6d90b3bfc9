"""The simulator against measured runs on this machine (issue 39 item 4).

    python benchmarks/sim_vs_real.py [--quick] [--profile PATH] [--out FOLDER]

Typical duration: on 2 shared cores, --quick 3-5 min (about 1 of it measuring the profile),
the full matrix 15-25 min (not yet measured in full), --tiny with --profile 20-40 s.

1. Measures this machine with `python -m ftbench.measure` (its --quick mode with --quick),
   writing the profile into FOLDER/conf/hardware/, unless --profile gives one already measured.
2. Runs each row for real (`local`, and `dist` with 2 processes; the full matrix adds 4
   processes, more than the cores) and on `sim` with that profile, the config otherwise the
   same, side by side in this run.
3. Prints predicted/measured per row and quantity, then one line per quantity,
   `<quantity>: median X %, worst Y %` of |predicted/measured - 1|, and draws
   FOLDER/sim_vs_real.png (predicted against measured, log-log, the y = x line).

Execution model, stated before any result and the same for every row: `local` runs every
worker's ops in one process, one at a time; `dist` runs one process per worker and its
processes share the host's cores. The simulator gives a plan's makespan with every worker in
parallel; no host does more than its cores at once, so each row's simulated run sets
`hardware.cores` (1 on `local`, min(processes, usable cores) on `dist`), and the simulator's
iteration is max(makespan, busy time / cores) (ftbench/loop.py, shared_cores_iteration).
Quantities: `iteration` (the median kept iteration, iteration 0 left out: it warms up),
`checkpoint stall` (median of the periodic saves), the first recovery's phases where `dist`
measures them (`detection`: death to regroup against the profile's `detection_s`; `restart`:
the job's processes ended and started again against RestartJob's modelled time; `reload`: the
checkpoint read back against RestoreCheckpoint's), `recovery` (the first recovery's time; not
on `local` where it holds a rendezvous, which one process does not perform) and `run time`
(the run's `time_s`). A restart on `local` is charged the profile's measured
restart (docs/backends.md); on `dist` the job's processes end and new ones start (measured). The
failures are the harness's, announced: the simulator's run of each row charges no detection
(`hardware.detection_s=0`; calibrate measures detection on its own).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETUP = ("model=gpt-tiny", "train.microbatches=4", "train.iterations=8", "report.check_fault_free=false",
         "report.gantt=false", "report.progress=false", "wandb.mode=disabled", "cluster.replacement_s=0")
ONE_FAILURE = "failures.events=[{iteration:5,node:1}]"
LATE_FAILURE = "failures.events=[{iteration:5,node:1,at:0.97}]"
FAULT_FREE = ("failures=none",)
QUANTITIES = ("iteration", "checkpoint stall", "detection", "restart", "reload", "recovery", "run time")
PHASES = {"restart": ("RestartJob", "restart_s"), "reload": ("RestoreCheckpoint", "state_transfer_s")}


GRIDS = {1: ("cluster.pp=1", "cluster.dp=1"), 2: ("cluster.pp=2", "cluster.dp=1"),
         4: ("cluster.pp=2", "cluster.dp=2"), 8: ("cluster.pp=4", "cluster.dp=2"),
         16: ("cluster.pp=4", "cluster.dp=4")}  # dist ranks -> the job's grid (one rank a worker)
EVERY = ("checkpoint", "checkfreq", "varuna", "swift", "elastic-horovod")  # strategies with strategy.every


CASES = {"fault-free": FAULT_FREE, "one failure": (ONE_FAILURE,), "one at 0.97": (LATE_FAILURE,)}


def rows(quick: bool, tiny: bool = False, ranks: tuple[int, ...] = (2, 4), strategies: tuple[str, ...] = (),
         backends: tuple[str, ...] = ("local", "dist"),
         cases: tuple[str, ...] = tuple(CASES)) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """(label, backend, processes, overrides): quick, a few strategies on local and 2 dist ranks;
    the full matrix every strategy (or `strategies`) x {fault-free, one failure, one at 0.97} x
    {local, dist with each of `ranks`}; tiny (the test's), one local row. A failure row on dist
    keeps a standby node (one more process), except on a one-rank job, where the failed node's
    replacement takes its place (cluster.replacement_s=0)."""
    if tiny:
        return [("checkpoint one failure", "local", 1, (*GRIDS[2], "strategy=checkpoint", "strategy.every=2",
                                                         ONE_FAILURE))]
    if quick:
        grid2, grid4 = GRIDS[2], GRIDS[4]
        return [("none fault-free", "local", 1, (*grid4, "strategy=none", *FAULT_FREE)),
                ("checkpoint one failure", "local", 1, (*grid4, "strategy=checkpoint", "strategy.every=2", ONE_FAILURE)),
                ("recycle one failure", "local", 1, (*grid4, "strategy=recycle", ONE_FAILURE)),
                ("none fault-free", "dist", 2, (*grid2, "strategy=none", *FAULT_FREE)),
                ("checkpoint one failure", "dist", 2, (*grid2, "strategy=checkpoint", "strategy.every=2",
                                                        "cluster.spares=1", ONE_FAILURE))]
    from ftbench.strategies import REGISTRY

    out = []
    for name in strategies or sorted(REGISTRY):
        extra = ("strategy.every=2",) if name in EVERY else ()
        for label in cases:
            failure = CASES[label]
            if name == "none" and failure != FAULT_FREE:
                continue
            runs = [("local", 1, GRIDS[4])] if "local" in backends else []
            runs += [("dist", n, GRIDS[n]) for n in ranks] if "dist" in backends else []
            for backend, processes, grid in runs:
                spares = ("cluster.spares=1",) if backend == "dist" and failure != FAULT_FREE and processes > 1 else ()
                struck = failure if processes > 1 else tuple(f.replace("node:1", "node:0") for f in failure)  # its only node
                out.append((f"{name} {label}", backend, processes, (*grid, f"strategy={name}", *extra, *spares, *struck)))
    return out


def environment(device: str) -> dict:
    """The runs' environment: on `--device cpu` no GPU is visible (dist would otherwise put
    every rank on one, as it does on a GPU machine), so the CPU matrix is the CPU's."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def measure_profile(folder: Path, quick: bool, device: str) -> Path:
    """This machine's profile, measured now, as FOLDER/conf/hardware/<name>.yaml."""
    path = folder / "conf" / "hardware" / "sim-vs-real.yaml"
    command = [sys.executable, "-m", "ftbench.measure", "--name", "sim-vs-real", "--out", str(path), "--device", device]
    subprocess.run(command + (["--quick"] if quick else []), cwd=ROOT, check=True, timeout=900, env=environment(device))
    return path


def run(folder: Path, backend: str, overrides: tuple[str, ...], profile: Path,
        device: str = "cpu") -> tuple[dict, list[dict]]:
    """One run from the CLI (its own process, as a user runs it); (summary, metrics lines). A
    run that wrote no summary is a row with status `crashed` and its last line of output."""
    search = f"hydra.searchpath=[file://{profile.parent.parent.resolve()}]"
    done = subprocess.run([sys.executable, "-m", "ftbench", f"backend={backend}", search, f"hardware={profile.stem}",
                           *SETUP, *overrides, f"hydra.run.dir={folder}"], cwd=ROOT, env=environment(device),
                          capture_output=True, text=True, timeout=900)
    try:
        summary = json.loads((folder / "summary.json").read_text())
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        return {"status": "crashed", "error": f"exit {done.returncode}: {last}"}, []
    return summary, lines


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def quantities(summary: dict, lines: list[dict], backend: str) -> dict[str, float]:
    out = {"run time": summary.get("time_s")}
    per_iteration = [x["iteration_s"] for x in lines if x.get("event") == "iteration" and x.get("iteration")]
    if per_iteration:
        out["iteration"] = statistics.median(per_iteration)
    stalls = [x["stall_s"] for x in lines if x.get("event") == "checkpoint" and x.get("iteration")]
    if stalls:
        out["checkpoint stall"] = statistics.median(stalls)
    recovery = (summary.get("recoveries") or [None])[0]
    # one process has no communicators: a rendezvous is not performed on local (dist measures it)
    if recovery and not (backend == "local" and "Rendezvous" in recovery["actions"]):
        out["recovery"] = recovery["recovery_s"]
    phases = (summary.get("measured_recoveries") or [None])[0]  # dist measures each phase
    if phases:
        out["detection"] = phases.get("death_to_regroup_s")
        for quantity, (action, key) in PHASES.items():
            if action in phases.get("actions", ()):
                out[quantity] = phases.get(key)
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and v > 0}


def simulated(summary: dict, lines: list[dict], detection_s: float) -> dict[str, float]:
    """The simulator's figures; `detection_s` is the profile's (the simulated run charges none:
    the harness's failures are announced, but dist still detects each one, and measures it)."""
    out = {"run time": summary.get("time_s"), "iteration": summary.get("iteration_time_s")}
    stall = next((x["stall_s"] for x in lines if x.get("event") == "checkpoint_interval"), None)
    if stall:
        out["checkpoint stall"] = stall
    if summary.get("recoveries"):
        first = summary["recoveries"][0]
        out["recovery"] = first["recovery_s"]
        out["detection"] = detection_s
        for quantity, (action, _) in PHASES.items():
            out[quantity] = sum(s for a, s in zip(first["actions"], first.get("action_s", ())) if a == action)
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and v > 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few rows (3-5 min on 2 cores)")
    parser.add_argument("--tiny", action="store_true", help="one local row, for a test (with --profile: 20-40 s)")
    parser.add_argument("--profile", type=Path, help="a profile `ftbench calibrate` measured on this machine")
    parser.add_argument("--out", type=Path, default=Path("runs") / "sim-vs-real", help="(default: %(default)s)")
    parser.add_argument("--ranks", default="2,4", help="the full matrix's dist process counts, of "
                        f"{','.join(map(str, GRIDS))} (default %(default)s; a 16-core machine runs 16)")
    parser.add_argument("--strategies", default="", help="the full matrix's strategies, comma-separated (default: all)")
    parser.add_argument("--backends", default="local,dist", help="the full matrix's real backends (default %(default)s)")
    parser.add_argument("--cases", default=",".join(CASES), help="the full matrix's failure cases (default %(default)s)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: dist's one rank and the profile on the GPU (one GPU holds one NCCL rank: --ranks 1 "
                             "--backends dist); cpu hides any GPU from the runs (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        matrix = checked_matrix(args)
    except ValueError as err:
        print(f"sim_vs_real.py: {err}", file=sys.stderr)
        return 2
    args.out = args.out.resolve()  # the runs are subprocesses in the checkout: absolute paths
    started = time.perf_counter()
    print(f"sim vs real: {'quick' if args.quick else 'full'} matrix into {args.out}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile is None:
        print("measuring this machine (python -m ftbench.measure) ...", flush=True)
        try:
            profile = measure_profile(args.out, args.quick, args.device)
        except subprocess.CalledProcessError as err:
            print(f"sim_vs_real.py: the calibration failed (exit {err.returncode}; its lines above)", file=sys.stderr)
            return 1
    else:
        profile = args.profile
        if profile.parent.name != "hardware":
            print(f"--profile must be a file in a folder named hardware/ (as `ftbench calibrate --out` "
                  f"writes it), got {profile}", file=sys.stderr)
            return 2
    import yaml

    detection_s = float(yaml.safe_load(profile.read_text()).get("detection_s") or 0.0)
    ratios: dict[str, list[float]] = {q: [] for q in QUANTITIES}
    points = []
    print(f"{'row':<28} {'backend':<8} " + " ".join(f"{q:>18}" for q in QUANTITIES), flush=True)
    for index, (label, backend, processes, overrides) in enumerate(rows(args.quick, args.tiny, **matrix)):
        folder = args.out / f"{index:02d}"
        real_summary, real_lines = run(folder / "real", backend, overrides, profile, args.device)
        # the harness announces the failures it strikes on local and dist: nothing detects them
        # there, so the simulator's run of the same script charges no detection (hardware.detection_s)
        # the same machine's cores: one process on local, the ranks sharing the usable cores on dist
        cores = 1 if backend == "local" else min(processes, usable_cores())
        sim_summary, sim_lines = run(folder / "sim", "sim", (*overrides, "hardware.detection_s=0",
                                                             f"hardware.cores={cores}"), profile)
        if real_summary.get("status") != "ok" or sim_summary.get("status") != "ok":
            print(f"{label:<28} {backend}-{processes:<6} not compared: real {real_summary.get('status')}, "
                  f"sim {sim_summary.get('status')} ({real_summary.get('error') or sim_summary.get('error')})")
            continue
        measured = quantities(real_summary, real_lines, backend)
        predicted = simulated(sim_summary, sim_lines, detection_s)
        cells = []
        for q in QUANTITIES:
            if q in measured and q in predicted:
                ratio = predicted[q] / measured[q]
                ratios[q].append(ratio)
                points.append((q, measured[q], predicted[q]))
                cells.append(f"{predicted[q]:.3g}/{measured[q]:.3g}={ratio:.2f}")
            else:
                cells.append("-")
        print(f"{label:<28} {backend}-{processes:<6} " + " ".join(f"{c:>18}" for c in cells), flush=True)
    plot(points, args.out / "sim_vs_real.png")
    print(f"(predicted/measured; {time.perf_counter() - started:.0f} s; plot {args.out / 'sim_vs_real.png'})")
    for q in QUANTITIES:
        errors = [abs(r - 1) for r in ratios[q]]
        if errors:
            print(f"{q}: median {100 * statistics.median(errors):.0f} %, worst {100 * max(errors):.0f} % "
                  f"({len(errors)} rows)")
        else:
            print(f"{q}: no row measured it")
    return 0


def checked_matrix(args) -> dict:
    """--ranks, --strategies, --backends, --cases and --device, checked: ValueError names the setting and the fix."""
    from ftbench.strategies import REGISTRY

    try:
        ranks = tuple(int(x) for x in args.ranks.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ranks {args.ranks!r}: not numbers; give e.g. --ranks 2,4") from None
    if not ranks or any(n not in GRIDS for n in ranks):
        raise ValueError(f"--ranks {args.ranks!r}: each must be one of {sorted(GRIDS)}; give e.g. --ranks 2,4")
    strategies = tuple(x.strip() for x in args.strategies.split(",") if x.strip())
    unknown = sorted(set(strategies) - set(REGISTRY))
    if unknown:
        raise ValueError(f"--strategies: unknown {', '.join(unknown)}; pick from {', '.join(sorted(REGISTRY))}")
    backends = tuple(x.strip() for x in args.backends.split(",") if x.strip())
    if not backends or set(backends) - {"local", "dist"}:
        raise ValueError(f"--backends {args.backends!r}: give local, dist or local,dist")
    cases = tuple(x.strip() for x in args.cases.split(",") if x.strip())
    if not cases or set(cases) - set(CASES):
        raise ValueError(f"--cases {args.cases!r}: give some of {', '.join(CASES)}")
    if args.device == "cuda" and (ranks != (1,) or backends != ("dist",) or args.quick or args.tiny):
        raise ValueError("--device cuda: one GPU holds one NCCL rank and local runs on the CPU; "
                         "give --ranks 1 --backends dist (the full matrix, not --quick or --tiny)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA GPU here; run it on a GPU machine, or use --device cpu")
    return {"ranks": ranks, "strategies": strategies, "backends": backends, "cases": cases}


def plot(points: list[tuple[str, float, float]], path: Path) -> None:
    if not points:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    try:
        for q, marker in zip(QUANTITIES, "os^Dv<>"):
            xs = [m for name, m, _ in points if name == q]
            ys = [p for name, _, p in points if name == q]
            if xs:
                ax.scatter(xs, ys, marker=marker, label=q)
        low = min(min(m, p) for _, m, p in points) / 2
        high = max(max(m, p) for _, m, p in points) * 2
        ax.plot([low, high], [low, high], color="grey", linewidth=0.8, label="predicted = measured")
        ax.set(xscale="log", yscale="log", xlabel="measured (s)", ylabel="simulated (s)",
               title="the simulator against measured runs on this machine")
        ax.legend(frameon=False)
        fig.savefig(path, dpi=120, bbox_inches="tight", facecolor="white")
    finally:
        plt.close(fig)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("sim vs real: interrupted", file=sys.stderr)
        sys.exit(130)
