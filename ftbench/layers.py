"""Model state identified by layers: the unit axis, fragments and their gradient syncs.

A model of L transformer blocks is a line of L + 2 *units*: unit 0 is the token and position
embeddings, units 1..L are blocks 0..L-1, unit L + 1 is the final LayerNorm and LM head
(untied, so every parameter lives in exactly one unit). A stage holds one contiguous range of
units. Pipelines may cut the line differently (Oobleck's heterogeneous pipelines); cutting it
at the union of every pipeline's stage boundaries gives *fragments*, and each fragment's
gradient is summed over every stage that holds it. A regular grid has one fragment per stage.
"""
from __future__ import annotations

from dataclasses import dataclass

Units = tuple[int, int]  # [lo, hi) on the unit axis
Position = tuple[int, int]  # (pipeline, stage)


@dataclass(frozen=True)
class GradientSync:
    """The gradient all-reduce of one fragment over the stages that hold it: a node of the
    dependency graph that no worker runs (it occupies the network, not a GPU)."""
    units: Units
    holders: tuple[Position, ...]  # in pipeline order: the fixed summation order

    @property
    def stage(self) -> int:
        """The first holder's stage (for drawing; a fragment may sit at different stage indices)."""
        return self.holders[0][1]

    @property
    def pipeline(self) -> int:
        return self.holders[0][0]


def model_layers(partition) -> int:
    """L: the transformer blocks the partition covers (each pipeline's last stage ends there)."""
    return max(stages[-1][1] for stages in partition)


def stage_units(layers: tuple[int, int], first: bool, last: bool, n_layers: int) -> Units:
    """The units a stage holds: its blocks, plus the embeddings if first and the head if last."""
    return (0 if first else layers[0] + 1, n_layers + 2 if last else layers[1] + 1)


def unit_of(hf_name: str, n_layers: int) -> int:
    """The unit a Hugging Face GPT-2 parameter belongs to."""
    if hf_name.startswith("transformer.h."):
        return int(hf_name.split(".")[2]) + 1
    if hf_name.startswith(("transformer.wte.", "transformer.wpe.")):
        return 0
    if hf_name.startswith(("transformer.ln_f.", "lm_head.")):
        return n_layers + 1
    raise ValueError(f"{hf_name} is not a GPT-2 parameter")


def in_units(hf_name: str, units: Units, n_layers: int) -> bool:
    return units[0] <= unit_of(hf_name, n_layers) < units[1]


class Layout:
    """Every gradient sync of a plan, and per (pipeline, stage) the syncs its step waits for."""

    def __init__(self, syncs: list[GradientSync]):
        self.syncs = syncs
        self.of_position: dict[Position, list[GradientSync]] = {}
        for sync in syncs:
            for pos in sync.holders:
                self.of_position.setdefault(pos, []).append(sync)


def fragment_layout(stages: tuple[int, ...], partition) -> Layout:
    """Fragments of `partition` (per pipeline, per stage: its (first, end) block range)."""
    n = model_layers(partition)
    ranges = {(d, s): stage_units(layers, s == 0, s == stages[d] - 1, n)
              for d in range(len(stages)) for s, layers in enumerate(partition[d][:stages[d]])}
    cuts = sorted({c for lo_hi in ranges.values() for c in lo_hi})
    syncs = []
    # Holders of each fragment, found by walking every stage's range once (pipelines are in
    # order, so each fragment's holder list is in pipeline order).
    holders: dict[Units, list[Position]] = {}
    index = {c: i for i, c in enumerate(cuts)}
    for pos in sorted(ranges):
        lo, hi = ranges[pos]
        for i in range(index[lo], index[hi]):
            holders.setdefault((cuts[i], cuts[i + 1]), []).append(pos)
    for units in sorted(holders):
        syncs.append(GradientSync(units, tuple(holders[units])))
    return Layout(syncs)


def stage_layout(stages: tuple[int, ...]) -> Layout:
    """Without a partition (a schedule timed on its own): stage s of the pipelines with the
    same stage count are replicas, one sync per such stage."""
    syncs = []
    for count in sorted(set(stages)):
        pipelines = [d for d, n in enumerate(stages) if n == count]
        syncs += [GradientSync((s, s + 1), tuple((d, s) for d in pipelines)) for s in range(count)]
    return Layout(syncs)
