"""The measurements in order, each with its progress lines; the profile from their results."""
from __future__ import annotations

import torch

from ftbench import threads
from ftbench.measure.detection import measure_detection
from ftbench.measure.links import allreduce_sizes, exchange, p2p_sizes
from ftbench.measure.memory import copy_bandwidth
from ftbench.measure.ops import OP_NAMES, Setup, block_line, measure_ops, step_line
from ftbench.measure.profile import build_profile, host_memory_gb, provenance
from ftbench.measure.restart import Peer
from ftbench.measure.storage import MODEL_SHARD, measure_storage

RESTART_MICROBATCHES = 1  # the restarted process's first iteration: one micro-batch through the whole model


def run_all(args, checked: dict, effort, command: str, say) -> dict:
    spec, device = checked["spec"], checked["device"]
    count = threads.apply(threads.choose(args.threads, spec))
    setup = Setup(spec, args.microbatch_size, checked["seq_len"], args.dtype, device, args.microbatches,
                  effort.warmup, effort.iterations, (1, 2, 4))
    say(f"calibrate: {spec.name}, micro-batch {setup.microbatch_size} x {setup.seq_len} tokens, {args.dtype}, "
        f"{device}, {count} thread{'s' if count > 1 else ''}{' (quick)' if args.quick else ''}")
    times = measure_ops(setup, say)
    lines = {OP_NAMES[kind]: block_line(times, kind) for kind in ("F", "B", "W", "BW")}
    memory = copy_bandwidth(effort.copy_mb * 2**20, device, effort.copy_reps)
    say(f"memory: copy {memory['hbm_gbps']:.2f} GB/s (read + write), snapshot {memory['host_gbps']:.2f} GB/s")
    storage = measure_storage(checked["scratch"], setup, effort.synthetic_mb, effort.storage_reps, say)
    links, restart, detection = second_process(args, checked, setup, effort, count, say)
    prov = provenance(command, gpu_name(device), torch.__version__, count, threads.usable_cpus())
    return build_profile(checked["name"], setup, times, lines, step_line(times), memory, storage, links,
                         restart, detection, prov, device_memory_gb(device))


def second_process(args, checked: dict, setup: Setup, effort, count: int, say):
    """Restart phases, links and detection, with one second process started once."""
    link_settings = {"reps": effort.link_reps, "p2p_sizes": p2p_sizes(args.quick),
                     "allreduce_sizes": allreduce_sizes(args.quick), "group_reps": effort.group_reps,
                     "timeout_s": args.timeout}
    settings = {"model": setup.spec.name, "seed": setup.seed, "dtype": setup.dtype, "device": setup.device,
                "lr": setup.lr,
                "threads": count, "timeout_s": args.timeout, "checkpoint": str(checked["scratch"] / "model"),
                "shard": MODEL_SHARD, "microbatches": RESTART_MICROBATCHES,
                "microbatch_size": setup.microbatch_size, "seq_len": setup.seq_len, "links": link_settings}
    peer = Peer(checked["scratch"], args.timeout)
    try:
        say("restart: starting a fresh process (interpreter, imports, process group, model, checkpoint, "
            "first iteration)")
        peer.start(settings)
        peer.join_group()
        restart = peer.restart_phases()
        say(f"restart: {restart['total_s']:.2f} s to the end of the first iteration (" + ", ".join(
            f"{k[:-2]} {v:.2f} s" for k, v in restart.items() if k != "total_s") + ")")
        links = exchange(0, link_settings, peer.store, say)
        detection = measure_detection(peer, say)
    finally:
        peer.stop()
    return links, restart, detection


def gpu_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return torch.cuda.get_device_name(0) + " (not used)" if torch.cuda.is_available() else "none"


def device_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9
    return host_memory_gb()
