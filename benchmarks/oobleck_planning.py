"""Oobleck's planning time: pipeline templates and instantiation for GPT-3 6.7B (32 layers),
for every job size up to 30 nodes (target: under 5 s) and for 1,024 nodes (target: under
60 s), with 1 and 4 GPUs per node.

    python benchmarks/oobleck_planning.py [--hardware a100-40gb] [--f 1]

Per setup it prints n0, the template range, the time to make every template, the time to
instantiate every live-node count from (f+1)*n0 to N (30 nodes) or the job itself
(1,024 nodes), and the time to build the job's plan (pipelines_plan over every GPU).
"""
from __future__ import annotations

import argparse
import sys
import time

# measured wall time of the default run
DURATION = "1-5 s on 2 shared cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Typical duration: {DURATION}.")
    parser.add_argument("--hardware", default="a100-40gb")
    parser.add_argument("--model", default="gpt3-6.7b")
    parser.add_argument("--f", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=256, help="micro-batches of the global batch")
    parser.add_argument("--stage-per", choices=("node", "gpu"), default="node", help="strategy.stage_per")
    args = parser.parse_args()
    print(f"oobleck_planning.py: Oobleck's planning time, {args.model}, 30 and 1,024 nodes; typically {DURATION}",
          file=sys.stderr, flush=True)

    from ftbench.cli import compose
    from ftbench.context import RunContext
    from ftbench.plan import pipelines_plan
    from ftbench.planning.oobleck import Templates, instantiate, split_batch, template_range

    ctx = RunContext.from_config(compose(["backend=sim", f"model={args.model}", f"hardware={args.hardware}"]))
    print(f"{args.model} ({ctx.spec.layers} layers) on {args.hardware}, f={args.f}, {args.microbatches} micro-batches, "
          f"stage per {args.stage_per}", flush=True)
    print(f"{'nodes':>6} {'GPUs/node':>9} {'n0':>3} {'templates':>10} {'make (s)':>9} {'instantiate (s)':>16} "
          f"{'plan (s)':>9}  pipelines", flush=True)
    for nodes, gpus in ((30, 1), (30, 4), (1024, 1), (1024, 4)):
        started = time.perf_counter()
        t = Templates(ctx.cost_model, gpus, args.stage_per)
        n0 = t.n0()
        lo, hi = template_range(n0, nodes, args.f)
        sizes = [n for n in range(lo, min(hi, t.longest) + 1) if t.get(n) is not None]
        made = time.perf_counter() - started
        started = time.perf_counter()
        counts = range((args.f + 1) * n0, nodes + 1) if nodes <= 30 else (nodes,)
        for live in counts:
            found = instantiate(t, sizes, live, args.f, args.microbatches)
            assert found is not None and sum(found[0]) == live, (live, found)
        inst = time.perf_counter() - started
        chosen, _ = found
        started = time.perf_counter()
        lanes = t.lanes_of(chosen)
        split = split_batch(lanes, args.microbatches)
        specs, node, at = [], 0, 0
        for n in chosen:
            gpus_of = [list(range(k * gpus, (k + 1) * gpus)) for k in range(node, node + n)]
            for lane in range(t.lanes):
                workers = [w for g_ in gpus_of for w in g_] if t.lanes == 1 else [g_[lane] for g_ in gpus_of]
                specs.append((workers, lanes[at].partition, split[at]))
                at += 1
            node += n
        plan = pipelines_plan("1f1b", specs, lambda w, g=gpus: w // g)
        built = time.perf_counter() - started
        summary = ", ".join(f"{chosen.count(n)} x {n}" for n in sorted(set(chosen), reverse=True))
        print(f"{nodes:>6} {gpus:>9} {n0:>3} {f'{lo}..{min(hi, t.longest)}':>10} {made:>9.3f} {inst:>16.3f} "
              f"{built:>9.3f}  {summary} ({len(plan.workers)} GPUs)", flush=True)


if __name__ == "__main__":
    main()
