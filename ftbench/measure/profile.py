"""The hardware profile from the measurements: the YAML, its provenance, the summary lines.

Top-level keys are HardwareConfig's (ftbench/config.py), so the file loads as
`hardware=<name>`; `measured` holds the lines and raw medians the cost model uses when a
run's model, micro-batch size and sequence length are the measured ones, and everything a
reader needs to check each fit against its points.
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
from pathlib import Path

from ftbench.measure.fit import Line, fit_line, median

GB = 1e9
OPS = ("forward", "backward_input", "backward_weight", "backward")  # OP_KINDS' cost names of F, B, W, BW
KIND_OF = {"forward": "F", "backward_input": "B", "backward_weight": "W", "backward": "BW"}


def op_line(times, kind: str, line: Line, blocks, medians) -> dict:
    """One op kind's entry: fixed + per block, the units alone, and the points of the fit."""
    units = times.units
    entry = {"fixed_s": line.intercept, "per_block_s": line.slope,
             "embedding_s": units["embedding"][kind], "head_s": units["head"][kind],
             "residual": line.residual, "blocks": list(blocks), "medians_s": list(medians)}
    checks = {}
    for where, unit in (("first", "embedding"), ("last", "head")):
        measured = times.medians[kind].get((where, 1))
        if measured:
            predicted = line.intercept + line.slope + units[unit][kind]
            checks[f"{where}_stage_s"] = {"measured": measured, "predicted": predicted}
    entry["checks"] = checks
    return entry


def block_flops(spec, b: int, s: int) -> float:
    """F + B + W FLOPs of one block and micro-batch (ModelSpec's counts)."""
    return (spec.layer_forward_flops(b, s) + spec.layer_backward_input_flops(b, s)
            + spec.layer_backward_weight_flops(b, s))


def p2p_entry(p2p: dict) -> dict:
    sizes = sorted(p2p)
    line = fit_line(sizes, [p2p[s] for s in sizes], relative=True)
    return {"latency_s": line.intercept, "gbps": 1.0 / line.slope / GB if line.slope > 0 else float("nan"),
            "residual": line.residual, "sizes": sizes, "seconds": [p2p[s] for s in sizes]}


def host_memory_gb() -> float:
    """Physical memory, capped by the cgroup's memory limit when it has one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total / GB


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def provenance(command: str, gpu: str, torch_version: str, threads: int, usable: int) -> dict:
    return {"host": socket.gethostname(), "cpu": cpu_name(), "usable_cpus": usable, "gpu": gpu,
            "torch": torch_version, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "threads": threads}


SOURCES = {
    "peak_tflops": "measured: F+B+W FLOPs of one block (models/specs.py) over the per-block slopes of F, B and W",
    "efficiency": "1.0: peak_tflops already is the achieved rate",
    "memory_gb": "this machine's memory (host RAM, cgroup limit; GPU memory on a GPU)",
    "hbm_gbps": "measured: large tensor copy, bytes read + written per second",
    "intra_node_gbps": "measured: gloo point-to-point between 2 processes, 1 / slope of the size line",
    "inter_node_gbps": "not measurable on one machine: the intra-node (2-process) value",
    "link_latency_us": "measured: gloo point-to-point, intercept of the size line",
    "storage_gbps": "measured: CheckpointStore save and verified load of the synthetic state (each less its two "
                    "files' fixed cost), the smaller",
    "checkpoint_file_s": "measured: the synthetic state saved as 8 files against 1, the difference over 7",
    "checkpoint_load_file_s": "measured: the synthetic state loaded and verified as 8 files against 1, the "
                              "difference over 7",
    "host_gbps": "measured: snapshot of a large tensor (clone on CPU, device to host on a GPU)",
    "restart_s": "measured: a fresh process from its start until it loads the checkpoint (the load and the first "
                 "iteration, measured beside it, are charged on their own)",
    "rendezvous_s": "measured: a 2-rank gloo Group (ftbench.distributed.transport) built to its first all-reduce",
    "op_overhead_s": "measured: median of the intercepts of F, B and W",
    "detection_s": "measured: SIGKILL of a beating rank to the survivors' new group (membership.detect, agree)",
}


def ops_section(times, lines: dict, step: tuple) -> dict:
    ops = {kind: op_line(times, KIND_OF[kind], *lines[kind]) for kind in OPS}
    step_line, params, step_medians = step
    ops["step"] = {"fixed_s": step_line.intercept, "per_param_s": step_line.slope, "residual": step_line.residual,
                   "params": list(params), "medians_s": list(step_medians)}
    return ops


def checkpoint_section(storage: dict) -> dict:
    """The synthetic state's bandwidths (the profile's; a save's less its two files' fixed cost,
    charged on its own), each file's fixed cost, and the model's own checkpoint."""
    synthetic, file_s, load_file_s = storage["synthetic"], storage["file_s"], storage["load_file_s"]
    writing = max(synthetic["save_s"] - 2 * file_s, 1e-9)  # its shard and its manifest
    reading = max(synthetic["load_s"] - 2 * load_file_s, 1e-9)
    return {"save_gbps": synthetic["bytes"] / writing / 1e9, "load_gbps": synthetic["bytes"] / reading / 1e9,
            "bytes": synthetic["bytes"], "save_s": synthetic["save_s"], "load_s": synthetic["load_s"],
            "file_s": file_s, "load_file_s": load_file_s, "split": {k: storage["split"][k] for k in ("files", "save_s", "load_s")},
            "model_state": {k: storage["model"][k] for k in ("bytes", "save_s", "load_s")}}


def measured_section(setup, threads: int, ops: dict, memory: dict, storage: dict, links: dict, restart: dict,
                     detection: dict) -> dict:
    allreduce = links["allreduce"]
    return {"model": setup.spec.name, "microbatch_size": setup.microbatch_size, "seq_len": setup.seq_len,
            "dtype": setup.dtype, "threads": threads, "device": setup.device, "ops": ops,
            "p2p": p2p_entry(links["p2p"]),
            "allreduce": {"ranks": 2, "sizes": sorted(allreduce), "seconds": [allreduce[k] for k in sorted(allreduce)]},
            "checkpoint": checkpoint_section(storage), "memory": memory, "group_s": list(links["groups"]),
            "restart_phases": restart, "detection": detection}


def build_profile(name: str, setup, times, lines: dict, step: tuple, memory: dict, storage: dict, links: dict,
                  restart: dict, detection: dict, prov: dict, memory_gb: float) -> dict:
    """Every key of the profile, as plain floats, ints, strings, lists and dicts."""
    ops = ops_section(times, lines, step)
    m = measured_section(setup, prov["threads"], ops, memory, storage, links, restart, detection)
    fitted = ("forward", "backward_input", "backward_weight")
    slopes = sum(ops[kind]["per_block_s"] for kind in fitted)
    p2p, checkpoint = m["p2p"], m["checkpoint"]
    return plain({
        "name": name,
        "peak_tflops": block_flops(setup.spec, setup.microbatch_size, setup.seq_len) / slopes / 1e12,
        "efficiency": 1.0,
        "memory_gb": memory_gb,
        "hbm_gbps": memory["hbm_gbps"],
        "intra_node_gbps": p2p["gbps"],
        "inter_node_gbps": p2p["gbps"],
        "link_latency_us": p2p["latency_s"] * 1e6,
        "storage_gbps": min(checkpoint["save_gbps"], checkpoint["load_gbps"]),
        "host_gbps": memory["host_gbps"],
        # the simulator charges the reload (RestoreCheckpoint) and the next iteration on their own
        "restart_s": restart["total_s"] - restart["checkpoint_s"] - restart["first_iteration_s"],
        "rendezvous_s": median(links["groups"]),
        "op_overhead_s": max(0.0, median([ops[kind]["fixed_s"] for kind in fitted])),
        "detection_s": detection["total_s"],
        "checkpoint_file_s": checkpoint["file_s"],
        "checkpoint_load_file_s": checkpoint["load_file_s"],
        "measured": m,
        "provenance": {**prov, "sources": dict(SOURCES)},
    })


def plain(value):
    """Plain YAML types all the way down (torch's version string is a str subclass)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def summary_lines(profile: dict) -> list[str]:
    """One line per quantity: its value and how well its fit (or its repeats) held."""
    m = profile["measured"]
    rows = []
    for kind in (*OPS, "step"):
        line = m["ops"][kind]
        if kind == "step":
            value = f"fixed {line['fixed_s'] * 1e3:.3f} ms + {line['per_param_s'] * 1e9:.3f} ns/parameter"
        else:
            value = (f"fixed {line['fixed_s'] * 1e3:.3f} ms + {line['per_block_s'] * 1e3:.3f} ms/block "
                     f"(embedding {line['embedding_s'] * 1e3:.3f} ms, head {line['head_s'] * 1e3:.3f} ms)")
        rows.append((kind, value, f"fit residual {line['residual'] * 100:.1f} % over {len(line['medians_s'])} points"))
    p2p = m["p2p"]
    rows += [
        ("op_overhead_s", f"{profile['op_overhead_s'] * 1e3:.3f} ms", "median of the F, B, W intercepts"),
        ("peak_tflops", f"{profile['peak_tflops']:.4f} TFLOP/s", "from the per-block slopes"),
        ("link_latency_us", f"{profile['link_latency_us']:.1f} us",
         f"fit residual {p2p['residual'] * 100:.1f} % over {len(p2p['sizes'])} sizes"),
        ("intra_node_gbps", f"{profile['intra_node_gbps']:.3f} GB/s", "same fit"),
        ("allreduce", ", ".join(f"{size // 1024} KB {t * 1e3:.2f} ms" for size, t in
                                zip(m["allreduce"]["sizes"], m["allreduce"]["seconds"])), "medians"),
        ("hbm_gbps", f"{profile['hbm_gbps']:.2f} GB/s", f"spread {m['memory']['copy_spread'] * 100:.1f} %"),
        ("host_gbps", f"{profile['host_gbps']:.2f} GB/s", f"spread {m['memory']['snapshot_spread'] * 100:.1f} %"),
        ("storage_gbps", f"{profile['storage_gbps']:.3f} GB/s",
         f"save {m['checkpoint']['save_gbps']:.3f}, load {m['checkpoint']['load_gbps']:.3f} GB/s of "
         f"{m['checkpoint']['bytes'] / 1e6:.0f} MB"),
        ("checkpoint_file_s", f"{profile['checkpoint_file_s'] * 1e3:.2f} ms",
         f"{m['checkpoint']['split']['files']} files against 1, {m['checkpoint']['split']['save_s'] * 1e3:.1f} "
         f"against {m['checkpoint']['save_s'] * 1e3:.1f} ms"),
        ("checkpoint_load_file_s", f"{profile['checkpoint_load_file_s'] * 1e3:.2f} ms",
         f"{m['checkpoint']['split']['files']} files against 1, {m['checkpoint']['split']['load_s'] * 1e3:.1f} "
         f"against {m['checkpoint']['load_s'] * 1e3:.1f} ms"),
        ("restart_s", f"{profile['restart_s']:.2f} s", "phases " + ", ".join(
            f"{k[:-2]} {v:.2f}" for k, v in m["restart_phases"].items() if k != "total_s")),
        ("rendezvous_s", f"{profile['rendezvous_s'] * 1e3:.1f} ms", f"median of {len(m['group_s'])}"),
        ("detection_s", f"{profile['detection_s']:.2f} s",
         f"detect {m['detection']['detect_s']:.2f} s (heartbeat stale {m['detection']['stale_s']:g} s "
         f"+ settle {m['detection']['settle_s']:g} s), agree + regroup "
         f"{(m['detection']['agree_s'] + m['detection']['regroup_s']) * 1e3:.1f} ms"),
    ]
    width = max(len(r[0]) for r in rows)
    out = [f"{q:<{width}}  {v}  [{how}]" for q, v, how in rows]
    negative = [kind for kind in (*OPS, "step") if m["ops"][kind]["fixed_s"] < 0]
    if negative:
        out.append(f"note: negative fixed cost of {', '.join(negative)}: the medians are not on a line (other "
                   "processes' load?); op_overhead_s is at least 0; rerun without --quick or on a quieter machine")
    return out
