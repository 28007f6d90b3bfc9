"""Explicit per-kind op times with free communication: the textbook setting in which pipeline
bubbles have closed forms (GPipe/1F1B: (p-1)/(m+p-1); ZB-H1: (p-1)(T_F+T_B-T_W) per worker).
Useful for checking schedules and for drawing them without a model."""
from __future__ import annotations

from dataclasses import dataclass

from ftbench.schedule import B, BW, F, OPT, RF, RSYNC, W, Op


@dataclass
class UnitCosts:
    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    fused_backward: float | None = None  # BW time (None: B + W)
    optimizer: float = 0.0
    allreduce: float = 0.0
    transfer: float = 0.0  # per point-to-point hop between different workers
    stash: float = 1.0  # activation "bytes" per stashed micro-batch
    weight_stash: float = 0.0  # what W still needs after B
    static: float = 0.0  # state bytes per worker

    def op_time(self, op: Op) -> float:
        if op.kind == BW:
            return self.fused_backward if self.fused_backward is not None else self.backward_input + self.backward_weight
        return {F: self.forward, B: self.backward_input, W: self.backward_weight, OPT: self.optimizer,
                RF: self.forward, RSYNC: 0.0}[op.kind]

    def transfer_time(self, src_worker: int, dst_worker: int) -> float:
        return 0.0 if src_worker == dst_worker else self.transfer

    def allreduce_time(self, stage: int, pipeline: int, workers: list[int]) -> float:
        return self.allreduce if len(workers) > 1 else 0.0

    def pipeline_signature(self, pipeline: int, workers: list[int]) -> tuple:
        return ()  # every pipeline costs the same

    def stash_bytes(self, op: Op) -> float:
        return self.stash

    def weight_stash_bytes(self, op: Op) -> float:
        return self.weight_stash

    def static_bytes(self, worker: int) -> float:
        return self.static
