"""The console summary of one run (`format_summary`), printed at its end and logged."""
from __future__ import annotations

from typing import Any

from ftbench.metrics import peak_memory_max, recovery_totals, summary_ettr


def human_duration(seconds: Any) -> str:
    """3.9 ms, 12.3 s, 4.5 min, 2.25 h, 3.1 d."""
    if not isinstance(seconds, (int, float)):
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if abs(seconds) >= size:
            return f"{_short(seconds / size)} {unit}"
    if seconds == 0:
        return "0 s"
    return f"{_short(seconds * 1000)} ms"  # tiny simulated models finish in milliseconds


def _memory(peak_bytes: float | None) -> str:
    if peak_bytes is None:
        return "-"
    if peak_bytes >= 1e8:
        return f"{peak_bytes / 1e9:.2f} GB per worker (max)"
    return f"{peak_bytes / 1e6:.3g} MB per worker (max)"  # toy models would read 0.00 GB


def _short(value: float) -> str:
    """About three significant digits without scientific notation."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01 or value == 0:
        return f"{value:.2f}"
    return f"{value:.2g}"


def failure_count(value: Any) -> Any:
    """`failures` is a count, but a list of failure records is counted too."""
    return len(value) if isinstance(value, (list, tuple)) else value


def _percent(ratio: float | None) -> str:
    """0.97312 -> '97.3 %'; a ratio short of 1 never reads as 100.0 % (at most 99.9 %)."""
    if ratio is None:
        return "-"
    return f"{min(ratio * 100, 99.9) if ratio < 1 else 100.0:.1f} %"


def _or_dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _final_shape(s: dict) -> str:
    """' (ended pp=4 dp=1)' when the run ended in another shape than it started in."""
    final = s.get("final_shape")
    return f" (ended {final})" if final and final != f"pp={s.get('pp')} dp={s.get('dp')}" else ""


def format_summary(summary: dict) -> str:
    """A short aligned table of one run for the console."""
    s = summary
    # the modelled clock (sim, or local/dist with backend.clock=model) is simulated time
    sim = s.get("backend") == "sim" or s.get("clock") == "model"
    totals = recovery_totals(s)
    peak = peak_memory_max(s)
    throughput = s.get("throughput")
    iterations = _or_dash(s.get("iterations"))
    if s.get("samples") is not None:
        dropped = s.get("samples_dropped") or 0  # the samples ledger: a step without some replicas
        iterations += f" ({s['samples']} samples" + (f", {dropped} of the global batch dropped)" if dropped else ")")
    microbatches = _or_dash(s.get("microbatches"))
    if s.get("global_batch") is not None:
        microbatches += f" (global batch {s['global_batch']})"
    status = _or_dash(s.get("status"))
    if s.get("status") != "ok" and s.get("error"):
        status += f": {s['error']}"
    charged = sum(float(r.get("charged_restart_s") or 0.0) for r in s.get("recoveries") or [] if isinstance(r, dict))
    clock_time = human_duration(s.get("time_s"))
    if charged:  # local: restarts a process cannot perform on itself, charged at the measured profile's cost
        clock_time += f" ({human_duration(charged)} of it charged for process restarts: hardware.restart_s)"
    rows = [
        *([("swept", swept)] if (swept := swept_values(s)) else []),
        ("strategy", _or_dash(s.get("strategy"))),
        ("backend", _or_dash(s.get("backend"))),
        ("model", _or_dash(s.get("model"))),
        ("pp x dp", f"{_or_dash(s.get('pp'))} x {_or_dash(s.get('dp'))}" + _final_shape(s)),
        ("micro-batches", microbatches),
        ("iterations", iterations),
        ("simulated time" if sim else "wall time", clock_time),
        ("throughput", f"{_short(throughput)} samples/s"
         if isinstance(throughput, (int, float)) else "-"),
        ("ETTR", _percent(summary_ettr(s))),
        ("failures", _or_dash(failure_count(s.get("failures")))),
        ("recoveries", f"{totals['count']}{_causes(s)} (total {human_duration(totals['recovery_s'])})"),
        ("lost iterations", str(totals["lost_iterations"])),
        ("peak memory", _memory(peak)),
        ("status", status),
    ]
    measured = measured_recovery(s)
    if measured:
        rows.insert(next(i for i, (name, _) in enumerate(rows) if name == "recoveries") + 1, ("measured (dist)", measured))
    if s.get("matches_fault_free") is not None:  # local runs that ran the equivalence check
        verdict = "yes" if s["matches_fault_free"] else f"NO ({s.get('fault_free_difference')})"
        rows.append(("matches fault-free", verdict + _against_floor(s)))
    if s.get("run_dir"):  # where everything else is: the last line, found at a glance
        rows.append(("run folder", str(s["run_dir"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def swept_values(s: dict) -> str:
    """'strategy=checkpoint, seed=1': the values this run of a sweep ran with, as given."""
    given = {}
    for item in s.get("overrides") or []:
        key, _, value = str(item).lstrip("+~").partition("=")
        given[key] = value
    return ", ".join(f"{k}={given[k]}" for k in s.get("swept") or [] if k in given)


def _causes(s: dict) -> str:
    """' (after 3 failures and 2 joins)': what the recoveries answered (joins grow a job back)."""
    causes = [r.get("cause") for r in s.get("recoveries") or [] if isinstance(r, dict)]
    fails, joins = causes.count("fail"), causes.count("join")
    if not joins:
        return ""
    return f" (after {fails} failure{'s' if fails != 1 else ''} and {joins} join{'s' if joins != 1 else ''})"


def measured_recovery(s: dict) -> str:
    """dist: the measured recovery beyond the run loop's own: death to regroup (detection,
    agreement, new groups), which happens before a recovery's actions start."""
    measured = [r for r in s.get("measured_recoveries") or [] if isinstance(r, dict)]
    regroup = [float(r["death_to_regroup_s"]) for r in measured if isinstance(r.get("death_to_regroup_s"), (int, float))]
    if not regroup:
        return ""
    worst = max(regroup)
    return (f"death to regroup {human_duration(sum(regroup))} over {len(regroup)} "
            f"(worst {human_duration(worst)}), before the recoveries' actions above")


def _against_floor(s: dict) -> str:
    """A float32 verdict's numbers: the largest difference beside its measured noise floor."""
    seen, floor = s.get("fault_free_difference_max"), s.get("fault_free_noise_floor")
    if not seen or not floor:
        return ""
    def g(x) -> str:
        return f"{x:.2g}" if isinstance(x, (int, float)) else str(x)
    return (f"; {seen['parameter']} off by {g(seen['weights'])}, float32 noise floor {g(floor['weights'])}"
            f" (x{floor['factor']} allowed); losses off by {g(seen['loss'])}, floor {g(floor['loss'])}")
