"""LocalSGD and DiLoCo: data-parallel replicas that take their own optimizer steps and meet
every H steps (`train.data_parallel`, `train.sync_every`).

Synchronous data parallelism (the default) all-reduces every step's gradients, so every
replica of a stage holds the same weights. Under `localsgd` (Lin et al., "Don't Use Large
Mini-Batches, Use Local SGD", arXiv 1808.07217, as torchft 0.2's `LocalSGD` implements it)
each pipeline steps AdamW on its own samples' mean loss, with no gradient all-reduce, and
after every `sync_every`-th step the replicas of each stage average their parameters (AdamW's
moments stay each replica's own). Under `diloco` (Douillard et al., arXiv 2311.08105,
Algorithm 1; torchft's `DiLoCo`) the replicas instead average their pseudo-gradients, the
parameters at the last sync less their own now, and every replica applies the same outer
step, SGD with Nesterov momentum, to the parameters of the last sync (outer learning rate
0.7, momentum 0.9 and H = 500 are the paper's). The run's last iteration also syncs, so
the trained model is one model.

Replica groups (torchft): a pipeline's samples name it (its first micro-batch, `groups`). A
sync averages over the groups that trained every iteration of its window (`SyncWindow`);
a group present at the sync that did not (it joined during the window) is healing, as
torchft's recovering replicas are: it contributes nothing and takes the result, with the
AdamW (and DiLoCo outer) state of the lowest-numbered participating group (`heal_source`).
A group that left during the window contributes nothing: its window's samples are dropped.
All of this follows from which samples each iteration trained, so fault-free training
replayed under a run's samples ledger (ftbench.samples) makes the same syncs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ftbench.samples import pipeline_offsets

ALGORITHMS = ("synchronous", "localsgd", "diloco")  # train.data_parallel
LOCAL = ("localsgd", "diloco")

# The outer sync moves fp32 parameters (LocalSGD) or fp32 pseudo-gradients (DiLoCo): torchft
# all-reduces the model's own parameters, which mixed-precision training keeps in fp32.
OUTER_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class LocalSteps:
    """The run's LocalSGD or DiLoCo settings (RunContext.local_steps; None: synchronous)."""
    algorithm: str  # localsgd | diloco
    sync_every: int  # H: optimizer steps between syncs
    iterations: int  # train.iterations: the last one syncs too
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # each replica group's samples of an iteration, [first, end), on the configured grid (its
    # pipelines in order): what the ledger's sync points are read against (ftbench.samples)
    group_samples: tuple = ()

    def syncs_after(self, iteration: int) -> bool:
        """Whether iteration `iteration` ends with a sync."""
        return (iteration + 1) % self.sync_every == 0 or iteration + 1 == self.iterations

    def window(self, iteration: int) -> int:
        """The sync window iteration `iteration` belongs to."""
        return iteration // self.sync_every


def local_steps(train, counts: tuple = (), microbatch_size: int = 1) -> LocalSteps | None:
    """LocalSteps from the train settings and the grid's micro-batches per pipeline (`counts`);
    None for synchronous data parallelism."""
    algorithm = getattr(train, "data_parallel", "synchronous")
    if algorithm not in LOCAL:
        return None
    ranges, first = [], 0
    for n in counts:
        ranges.append((first * microbatch_size, (first + n) * microbatch_size))
        first += n
    return LocalSteps(algorithm, int(train.sync_every), int(train.iterations), float(train.outer_lr),
                      float(train.outer_momentum), tuple(ranges))


def finishes_iteration(strategy, algorithm: str) -> bool:
    """Whether a failure leaves the groups it does not touch to finish the iteration in flight
    (and the strategy recovers after it): `strategy` (class or instance) sets
    `finishes_local_step` and `algorithm` (train.data_parallel) is LocalSGD or DiLoCo."""
    return algorithm in LOCAL and getattr(strategy, "finishes_local_step", False)


def groups(plan) -> tuple[int, ...]:
    """Each pipeline's replica group: its first micro-batch in the iteration's numbering, the
    same whichever plan the group runs in (ftbench.samples.pipeline_offsets)."""
    return pipeline_offsets(plan)


def heal_source(participants) -> int:
    """The group a healing group takes its state from: the lowest-numbered participant."""
    if not participants:
        raise RuntimeError("a sync with no participating replica group: nothing to heal from")
    return min(participants)


class SyncWindow:
    """The groups that trained every iteration of the sync window in flight, fed each
    completed iteration's groups (`trained`)."""

    def __init__(self):
        self.window: int | None = None
        self.through: frozenset = frozenset()
        self.last: frozenset = frozenset()  # the groups of the last iteration trained
        self._before: tuple | None = None  # the state before an iteration not yet committed

    def trained(self, steps: LocalSteps, iteration: int, present: frozenset) -> None:
        """Iteration `iteration` trained the groups `present` (not yet committed: `revert`)."""
        self._before = (self.window, self.through, self.last)
        window = steps.window(iteration)
        self.through = present if window != self.window else self.through & present
        self.window, self.last = window, present

    def commit(self) -> None:
        self._before = None

    def revert(self) -> None:
        """The iteration `trained` last was abandoned: as before it."""
        if self._before is not None:
            self.window, self.through, self.last = self._before
            self._before = None


def stage_members(plan) -> dict[int, list[tuple[int, int]]]:
    """stage -> [(pipeline, worker)] in pipeline order: the replicas each stage's sync joins."""
    out: dict[int, list[tuple[int, int]]] = {}
    for w, held in plan.holds.items():
        for d, s in held:
            out.setdefault(s, []).append((d, w))
    for members in out.values():
        members.sort()
    return out


def outer_sync_s(cost_model, plan) -> float:
    """One sync on the modelled clock: each stage's ring all-reduce of its fp32 parameters over
    its replicas, one per pipeline (the stages' rings run side by side: the slowest decides)."""
    worst = 0.0
    for s, members in stage_members(plan).items():
        params = cost_model.stage(plan.layers(0, s), s == 0, plan.is_last_stage(0, s)).params
        one_node = len({plan.node_of[w] for _, w in members}) == 1
        worst = max(worst, cost_model.ring_s(OUTER_BYTES_PER_PARAM * params, len(members), one_node))
    return worst
