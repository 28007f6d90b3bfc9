"""CPU-contention and start-up benchmark.

1. Start-up: wall time of `python -c "import ftbench.cli"` and of `ftbench --help` (each in a
   fresh process, best and median of --repeats). Target: --help under 2 s on a quiet machine.
2. Contention: the default job (`python -m ftbench report.progress=false wandb.mode=disabled`,
   plus --overrides) in a subprocess, first on the machine as it is, then while --busy other
   CPU-bound processes (`while True: pass`) run; with the automatic thread count
   (backend.threads=null) and with threads forced to the host's core count (torch's default
   before threads were sized). Prints each run's wall time, the training time from summary.json, the
   thread count, and the busy / quiet ratio. Target: auto within 2x.

OMP_NUM_THREADS is removed from the runs' environment (it would cap the automatic choice).
"Quiet" is the machine as it is: the load average is printed so a noisy baseline shows.

    python benchmarks/contention.py [--busy 2] [--repeats 3] [--timeout 900] [--skip-host]
                                    [--overrides train.iterations=4 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# wall time of the default run, extrapolated from measured runs (MORE: what was measured)
DURATION = "about 4-6 min on 2 shared cores, extrapolated"
MORE = ("measured: --repeats 1 --skip-host took 2-3 min (the default job 35-65 s quiet, 80-105 s beside "
        "2 busy processes); the default adds the host-thread pair and 2 more start-up rounds")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    return env


def _timed(cmd: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess | None]:
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, None
    return time.perf_counter() - start, out


def startup(repeats: int) -> None:
    for label, cmd in (("import ftbench.cli", [sys.executable, "-c", "import ftbench.cli"]),
                       ("ftbench --help", [sys.executable, "-m", "ftbench", "--help"]),
                       ("ftbench --version", [sys.executable, "-m", "ftbench", "--version"])):
        times = []
        for _ in range(repeats):
            seconds, out = _timed(cmd, 120)
            if out is None or out.returncode != 0:
                raise SystemExit(f"{label} failed: {out.stderr if out else 'timeout'}")
            times.append(seconds)
        print(f"{label:<20} best {min(times):5.2f} s  median {statistics.median(times):5.2f} s"
              + ("  (target < 2 s)" if "help" in label else ""), flush=True)


def default_job(overrides: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "ftbench", "report.progress=false", "wandb.mode=disabled", *overrides,
               f"hydra.run.dir={tmp}/run"]
        wall, out = _timed(cmd, timeout)
        if out is None:
            return {"wall_s": wall, "status": f"timeout after {timeout:.0f} s"}
        try:
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        except OSError:
            return {"wall_s": wall, "status": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
        return {"wall_s": wall, "status": summary["status"], "time_s": summary.get("time_s"),
                "threads": summary.get("threads")}


class Busy:
    """`n` processes spinning on a core each, for as long as the with-block lasts."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}; {MORE}.")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes to run beside the job")
    ap.add_argument("--repeats", type=int, default=3, help="start-up measurements per command")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a job run is given up")
    ap.add_argument("--skip-host", action="store_true", help="skip the runs with threads = host cores")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra ftbench overrides for every job run")
    args = ap.parse_args()
    print(f"contention.py: start-up times, then the default job quiet and beside {args.busy} busy processes; "
          f"typically {DURATION}", file=sys.stderr, flush=True)

    from ftbench.threads import usable_cpus

    host = os.cpu_count() or 1
    print(f"host cores {host}, usable by this process {usable_cpus()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if not args.skip_startup:
        startup(args.repeats)

    settings = [("auto", [])] + ([] if args.skip_host else [(f"host ({host})", [f"backend.threads={host}"])])
    print(f"\ndefault job {' '.join(args.overrides) or '(as configured)'}: quiet, then beside {args.busy} "
          "busy processes", flush=True)
    print(f"{'threads':<12} {'load':<8} {'wall s':>8} {'train s':>8} {'used':>5}  status", flush=True)
    for label, extra in settings:
        results = {}
        for load in ("quiet", f"{args.busy} busy"):
            if load == "quiet":
                r = default_job(args.overrides + extra, args.timeout)
            else:
                with Busy(args.busy):
                    r = default_job(args.overrides + extra, args.timeout)
            results[load] = r
            train = f"{r['time_s']:8.1f}" if r.get("time_s") is not None else f"{'-':>8}"
            print(f"{label:<12} {load:<8} {r['wall_s']:8.1f} {train} {str(r.get('threads', '-')):>5}  {r['status']}",
                  flush=True)
        quiet, busy = results.values()
        ratio = busy["wall_s"] / quiet["wall_s"]
        timed_out = str(busy["status"]).startswith("timeout")
        print(f"{label:<12} busy / quiet wall time: {'>' if timed_out else ''}{ratio:.1f}x"
              + ("  (target <= 2x)" if label == "auto" else ""), flush=True)


if __name__ == "__main__":
    main()
