"""Cost and memory model: op times, link times and per-worker memory, from a model shape and
a hardware profile.

Compute time is FLOPs / (peak x efficiency) plus a fixed cost per op (`op_overhead_s`:
launch and dispatch, which dominate small ops); `efficiency` is the one calibration factor per
(model, hardware). A profile measured by `ftbench calibrate` on the machine at hand
(`hardware.measured`) gives each op kind's time as a fixed cost plus a cost per block (and the
embedding and head units, and the optimizer step per parameter): where the run's model,
micro-batch size and sequence length are the measured ones, op times are those lines
(`CostModel.op_source` says which the run used). Links are alpha-beta (latency + bytes / bandwidth) with no contention:
point-to-point sends overlap compute; the gradient all-reduce is a ring. Memory is
mixed-precision Adam (16 bytes per parameter: fp16 weights and gradients, fp32 master
weights, first and second moments; ZeRO paper, Rajbhandari et al. 2020) plus stashed
activations (Korthikanti et al. 2022). Activation recomputation (`train.recompute`): `none`
stashes every activation from F to the backward; `full` stashes only each stage's input per
micro-batch and re-runs the stage's forward right before its backward, so B (and BW) take
one more forward and the full activations of one micro-batch live only while its backward
runs (`StageCost.recompute_bytes`). Gradient all-reduce overlap (`train.overlap_grad_reduce`,
as Megatron-LM's --overlap-grad-reduce): off (the default, DeepSpeed's pipeline engine, the
ReCycle paper's baseline), a layer fragment's all-reduce starts after its last weight gradient;
on, it runs in per-layer buckets while the last micro-batch's backward produces them
(ftbench.sim.simulator.overlapped_sync_s has the formula). Not modelled: allocator
fragmentation, the CUDA context, tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ftbench.layers import GradientSync, Units
from ftbench.plan import LayerRange, Plan
from ftbench.schedule import OP_KINDS, Op
from ftbench.actions import CHECKPOINT_BYTES_PER_PARAM
from ftbench.models.specs import ModelSpec

ADAM_STATE_BYTES_PER_PARAM = 16
ADAM_STEP_TRAFFIC_BYTES_PER_PARAM = 28  # read fp16 grad, r/w fp32 master, m, v; write fp16 weight
GRAD_BYTES_PER_PARAM = 2  # fp16 gradients on the wire
RECOMPUTE_MODES = ("none", "full")  # train.recompute


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage for one micro-batch (times in seconds, sizes in bytes)."""
    forward_s: float
    backward_input_s: float  # with recompute=full, includes the recomputed forward
    backward_weight_s: float
    params: int
    activation_bytes: float  # stashed from F until the backward (recompute=full: the stage's input)
    weight_stash_bytes: float  # the part W still needs after B
    recompute_bytes: float = 0.0  # recompute=full: the activations rebuilt for one backward, held while it runs
    backward_s: float | None = None  # the fused backward (BW), one op; None: B + W

    @property
    def fused_backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s if self.backward_s is None else self.backward_s


# `hardware.measured.ops`: the op kinds a calibrated profile times, each a line in the blocks
MEASURED_OPS = ("forward", "backward_input", "backward_weight", "backward", "step")


def measured_ops(hardware, spec: ModelSpec, microbatch_size: int, seq_len: int) -> dict | None:
    """The calibrated op lines when the profile measured this model at this micro-batch size
    and sequence length, else None (op times then come from FLOPs)."""
    measured = getattr(hardware, "measured", None)
    if not measured:
        return None
    same = (measured.get("model"), measured.get("microbatch_size"), measured.get("seq_len")) == \
        (spec.name, microbatch_size, seq_len)
    ops = measured.get("ops") or {}
    return ops if same and all(kind in ops for kind in MEASURED_OPS) else None


class CostModel:
    def __init__(self, spec: ModelSpec, hardware, microbatch_size: int, seq_len: int,
                 recompute: str = "none", overlap_grad_reduce: bool = False, local_steps=None):
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.spec, self.hw = spec, hardware
        self.b, self.s = microbatch_size, seq_len
        self.recompute = recompute
        # train.overlap_grad_reduce: all-reduce gradients in per-layer buckets during the last
        # micro-batch's backward (the simulator reads it off PlanCosts; see the module docstring)
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        # train.data_parallel=localsgd|diloco (ftbench.local_sgd.LocalSteps): no gradient
        # all-reduce in an iteration, a sync every sync_every (ftbench.sim.cache); None: synchronous
        self.local_steps = local_steps
        self.flop_rate = hardware.peak_tflops * 1e12 * hardware.efficiency
        self.overhead_s = float(getattr(hardware, "op_overhead_s", 0.0) or 0.0)
        self.ops = measured_ops(hardware, spec, microbatch_size, seq_len)
        self.op_source = "measured" if self.ops is not None else "flops"

    def key(self) -> tuple:
        hw = self.hw
        return (self.spec, self.b, self.s, hw.peak_tflops, hw.efficiency, hw.hbm_gbps,
                hw.intra_node_gbps, hw.inter_node_gbps, hw.link_latency_us, hw.memory_gb, self.recompute,
                self.overlap_grad_reduce, self.overhead_s, repr(self.ops),
                None if self.local_steps is None else (self.local_steps.algorithm, self.local_steps.sync_every))

    # -- compute ------------------------------------------------------------------------
    @lru_cache(maxsize=None)
    def stage(self, layers: LayerRange, first: bool, last: bool) -> StageCost:
        spec, b, s = self.spec, self.b, self.s
        n = layers[1] - layers[0]
        f = n * spec.layer_forward_flops(b, s)
        bi = n * spec.layer_backward_input_flops(b, s)
        bw = n * spec.layer_backward_weight_flops(b, s)
        params = n * spec.layer_params
        act = n * spec.layer_activation_bytes(b, s)
        wstash = n * spec.layer_weight_grad_stash_bytes(b, s)
        if first:
            params += spec.embedding_params
        if last:  # final LayerNorm and the LM head (a copy of the tied embedding)
            head = spec.head_forward_flops(b, s)
            f, bi, bw = f + head, bi + head, bw + head
            params += spec.head_params + spec.vocab * spec.hidden
            act += spec.head_activation_bytes(b, s)
            wstash += spec.boundary_bytes(b, s)
        recompute = 0.0
        if self.recompute == "full":
            # F keeps only the stage's input; the backward first re-runs F (with autograd) to
            # rebuild the activations, which live until that backward ends.
            bi += f
            act, recompute = spec.boundary_bytes(b, s), act
        if self.ops is not None:
            return self._measured_stage(n, first, last, params, act, wstash, recompute)
        o = self.overhead_s
        f_s, bi_s, bw_s = f / self.flop_rate + o, bi / self.flop_rate + o, bw / self.flop_rate + o
        return StageCost(f_s, bi_s, bw_s, params, act, wstash, recompute, bi_s + bw_s - o)

    def _measured_stage(self, blocks: int, first: bool, last: bool, params: int, act: float, wstash: float,
                        recompute: float) -> StageCost:
        """A stage's op times from the calibrated lines: fixed + per block, plus the embedding
        and head units where the stage holds them (recompute=full: B re-runs the forward)."""
        def line(kind: str) -> float:
            m = self.ops[kind]
            return (m["fixed_s"] + m["per_block_s"] * blocks + (m.get("embedding_s", 0.0) if first else 0.0)
                    + (m.get("head_s", 0.0) if last else 0.0))

        f, bi, bw, fused = line("forward"), line("backward_input"), line("backward_weight"), line("backward")
        if self.recompute == "full":
            bi, fused = bi + f, fused + f
        return StageCost(f, bi, bw, params, act, wstash, recompute, fused)

    def unit_params(self, units: Units) -> int:
        """Parameters in a range of units (ftbench.layers: 0 embeddings, 1..L blocks, L+1 head);
        a stage's units hold exactly `stage(...).params`."""
        spec, (lo, hi) = self.spec, units
        blocks = max(0, min(hi, spec.layers + 1) - max(lo, 1))
        params = blocks * spec.layer_params
        if lo == 0:
            params += spec.embedding_params
        if hi == spec.layers + 2:
            params += spec.head_params + spec.vocab * spec.hidden
        return params

    def optimizer_s(self, params: int) -> float:
        """Adam is memory-bound: its time is the state traffic over HBM bandwidth (measured:
        the calibrated line in the parameters)."""
        if self.ops is not None:
            return self.ops["step"]["fixed_s"] + self.ops["step"]["per_param_s"] * params
        return ADAM_STEP_TRAFFIC_BYTES_PER_PARAM * params / (self.hw.hbm_gbps * 1e9)

    def state_copy_s(self, params: int) -> float:
        """Writing a received copy of a stage's weights and optimizer state into its buffers."""
        return CHECKPOINT_BYTES_PER_PARAM * params / (self.hw.hbm_gbps * 1e9)

    # -- communication ------------------------------------------------------------------
    def link_s(self, nbytes: float, same_node: bool) -> float:
        bw = self.hw.intra_node_gbps if same_node else self.hw.inter_node_gbps
        return self.hw.link_latency_us * 1e-6 + nbytes / (bw * 1e9)

    def boundary_s(self, same_node: bool) -> float:
        """Sending a stage's output activation (or its gradient) to the next worker."""
        return self.link_s(self.spec.boundary_bytes(self.b, self.s), same_node)

    def allreduce_s(self, params: int, replicas: int, same_node: bool) -> float:
        """Ring all-reduce of fp16 gradients: 2(n-1)/n of the bytes and 2(n-1) latencies. None
        under LocalSGD or DiLoCo (`local_steps`): each replica steps on its own gradients."""
        if self.local_steps is not None:
            return 0.0
        return self.ring_s(GRAD_BYTES_PER_PARAM * params, replicas, same_node)

    def ring_s(self, nbytes: float, replicas: int, same_node: bool) -> float:
        """A ring all-reduce of `nbytes` over `replicas`: 2(n-1)/n of the bytes, 2(n-1) latencies."""
        if replicas <= 1:
            return 0.0
        bw = self.hw.intra_node_gbps if same_node else self.hw.inter_node_gbps
        steps = 2 * (replicas - 1)
        return steps * self.hw.link_latency_us * 1e-6 + steps / replicas * nbytes / (bw * 1e9)

    # -- memory -------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> float:
        return self.hw.memory_gb * 1e9

    # -- partition ----------------------------------------------------------------------
    @lru_cache(maxsize=None)
    def balanced_partition(self, stages: int) -> tuple[LayerRange, ...]:
        """Contiguous layer ranges minimising the slowest stage's F+B+W time, with the
        embedding on the first stage and the LM head on the last (the head costs about as
        much as a few layers, so an even split would make the last stage the bottleneck)."""
        L = self.spec.layers

        def cost(i: int, j: int, k: int) -> float:
            c = self.stage((i, j), k == 0, k == stages - 1)
            return c.forward_s + c.backward_input_s + c.backward_weight_s

        # best[k][j]: min over splits of layers [0, j) into stages 0..k-1 of the max stage cost
        inf = float("inf")
        best = [[inf] * (L + 1) for _ in range(stages + 1)]
        cut = [[0] * (L + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for k in range(1, stages + 1):
            for j in range(k, L - (stages - k) + 1):
                for i in range(k - 1, j):
                    value = max(best[k - 1][i], cost(i, j, k - 1))
                    if value < best[k][j] - 1e-15:
                        best[k][j], cut[k][j] = value, i
        ranges, j = [], L
        for k in range(stages, 0, -1):
            i = cut[k][j]
            ranges.append((i, j))
            j = i
        return tuple(reversed(ranges))


class PlanCosts:
    """The simulator's view of a plan: seconds per op and per transfer, bytes per stash."""

    def __init__(self, model: CostModel, plan: Plan):
        self.model, self.plan = model, plan
        self._stages: dict[tuple[int, int], StageCost] = {}  # (pipeline, stage) -> its costs
        self._by_layers: dict[tuple, StageCost] = {}  # (layers, first, last) -> its costs
        self._own: dict[int, tuple] = {}  # stage -> ((True, stage),): pipeline_signature's usual form
        self._boundary: dict[bool, float] = {}  # same node? -> seconds of a boundary transfer

    def key(self) -> tuple:
        return (self.model.key(), self.plan.key())

    @property
    def overlap_grad_reduce(self) -> bool:
        """train.overlap_grad_reduce: the simulator overlaps each fragment's all-reduce with the
        last micro-batch's backward, in one bucket per layer unit of the fragment."""
        return self.model.overlap_grad_reduce

    def _stage(self, pipeline: int, stage: int) -> StageCost:
        cost = self._stages.get((pipeline, stage))
        if cost is None:  # replicas of one layer range share a cost (thousands of pipelines at scale)
            of = (self.plan.layers(pipeline, stage), stage == 0, self.plan.is_last_stage(pipeline, stage))
            cost = self._by_layers.get(of)
            if cost is None:
                cost = self._by_layers[of] = self.model.stage(*of)
            self._stages[(pipeline, stage)] = cost
        return cost

    def op_time(self, op: Op) -> float:
        """The op's seconds, by its kind's `cost` in the op-kind table (ftbench.schedule.OP_KINDS)."""
        c = self._stage(op.pipeline, op.stage)
        row = OP_KINDS.get(op.kind)
        cost = row.cost if row is not None else None
        if cost == "forward":
            return c.forward_s
        if cost == "backward_input":
            return c.backward_input_s
        if cost == "backward_weight":
            return c.backward_weight_s
        if cost == "backward":
            return c.fused_backward_s
        if cost == "step":
            return self.model.optimizer_s(c.params)
        if cost == "copy":
            return self.model.state_copy_s(c.params)
        raise ValueError(f"no cost for {op}")

    def state_transfer_time(self, src_worker: int, dst_worker: int, op: Op) -> float:
        """Sending the weights and optimizer state of `op`'s stage to the worker that runs `op`
        (an op whose kind `receives` "state": Bamboo's RSYNC)."""
        if src_worker == dst_worker:
            return 0.0
        node = self.plan.node_of
        return self.model.link_s(CHECKPOINT_BYTES_PER_PARAM * self._stage(op.pipeline, op.stage).params,
                                 node[src_worker] == node[dst_worker])

    def transfer_time(self, src_worker: int, dst_worker: int) -> float:
        if src_worker == dst_worker:
            return 0.0
        node = self.plan.node_of
        same = node[src_worker] == node[dst_worker]
        seconds = self._boundary.get(same)
        if seconds is None:
            seconds = self._boundary[same] = self.model.boundary_s(same)
        return seconds

    @property
    def partition(self):
        """The plan's layer split: the simulator cuts the all-reduce into its fragments."""
        return self.plan.partition

    def sync_time(self, sync: GradientSync, workers: list[int]) -> float:
        """One fragment's ring all-reduce: its own parameter bytes over its member workers."""
        return self._ring(self.model.unit_params(sync.units), workers)

    def allreduce_time(self, stage: int, pipeline: int, workers: list[int]) -> float:
        """A whole stage's all-reduce (for callers that time stages, not fragments)."""
        return self._ring(self._stage(pipeline, stage).params, workers)

    def _ring(self, params: int, workers: list[int]) -> float:
        nodes = {self.plan.node_of[w] for w in workers}
        return self.model.allreduce_s(params, len(set(workers)), len(nodes) == 1)

    def pipeline_signature(self, pipeline: int, workers: list[int]) -> tuple:
        """What decides a self-contained pipeline's timing and memory besides its op order:
        its layer split, which hops stay within a node, and the state each worker keeps (a
        replica of another pipeline by its layers), so that two pipelines with equal
        signatures and orders have equal static_bytes worker for worker."""
        plan = self.plan
        nodes = [plan.node_of[w] for w in workers]
        hops = tuple([a == b for a, b in zip(nodes, nodes[1:])])
        kept = []
        holds, own = plan.holds, self._own
        for w in workers:
            held = holds.get(w, ())
            if len(held) == 1 and held[0][0] == pipeline:  # the grid's case: its own stage only
                s = held[0][1]
                form = own.get(s) or own.setdefault(s, ((True, s),))
            else:
                form = tuple((True, s) if d == pipeline else (False, s, plan.layers(d, s), plan.is_last_stage(d, s))
                             for d, s in held)
            if plan.host:  # which of them sit in host memory (not counted on the device)
                form += tuple(("host", d == pipeline, s) for d, s in held if (w, d, s) in plan.host)
            kept.append(form)
        return (plan.partition[pipeline], hops, tuple(kept))

    def run_signatures(self, workers: list[int], run: int) -> list[tuple] | None:
        """pipeline_signature(d, workers[d * run:(d + 1) * run]) for every pipeline d of a
        generated grid, computed in bulk; None unless every worker keeps only its own stage
        (then pipeline by pipeline)."""
        plan = self.plan
        dp = len(workers) // run
        if len(plan.partition) < dp:
            return None
        grid = plan.grid()  # built as a grid over these workers in this order: its holds are so (plan.GridLayout)
        if grid is None or grid.pp != run or grid.workers != workers:
            held = list(map(plan.holds.get, workers))
            if held != [((d, s),) for d in range(dp) for s in range(run)]:
                return None
        nodes = list(map(plan.node_of.__getitem__, workers))
        same = [a == b for a, b in zip(nodes, nodes[1:])]
        own = self._own
        kept = tuple(own.get(s) or own.setdefault(s, ((True, s),)) for s in range(run))
        partition = plan.partition
        return [(partition[d], tuple(same[d * run:(d + 1) * run - 1]), kept) for d in range(dp)]

    def stash_bytes(self, op: Op) -> float:
        return self._stage(op.pipeline, op.stage).activation_bytes

    def weight_stash_bytes(self, op: Op) -> float:
        return self._stage(op.pipeline, op.stage).weight_stash_bytes

    def recompute_bytes(self, op: Op) -> float:
        """The activations a backward (B/BW) rebuilds and holds while it runs (0 without recompute)."""
        return self._stage(op.pipeline, op.stage).recompute_bytes

    def static_bytes(self, worker: int) -> float:
        """Weights, gradients and Adam state of every replica the worker keeps on its device
        (not those the plan keeps in host memory: Plan.host)."""
        host = self.plan.host
        return float(sum(ADAM_STATE_BYTES_PER_PARAM * self._stage(d, s).params
                         for d, s in self.plan.holds.get(worker, ()) if not host or (worker, d, s) not in host))
