"""Workers of the local backend and the training state they hold.

A worker (one simulated GPU) keeps one `StageReplica` per layer range it holds: the stage's
modules, AdamW state, the activation stash and the deferred weight-gradient store. Replicas
are keyed by their (first, end) block range, not by stage index: a worker running another
pipeline's micro-batches of the same layers (ReCycle) uses the same replica, and pipelines
with different partitions (Oobleck) hold different ranges. A failure
calls `Worker.destroy()`: every tensor is freed (parameters emptied, optimizer state and
stash dropped) and any later access raises `WorkerFailed`, so a strategy can only get the
state back through its own recovery actions.

Each replica's optimizer steps through its `StepUndo` (ftbench.engine.undo), which keeps the
gradient of the iteration's step until the iteration is committed: when a failure abandons
the iteration after the replica stepped, the engine undoes that step (the replica is back at
the iteration's start, to float rounding) instead of keeping a copy of its state.
"""
from __future__ import annotations

import torch

from ftbench.engine.deferred import WeightGradStore, make_deferrable
from ftbench.engine.undo import StepUndo
from ftbench.layers import Units, in_units
from ftbench.plan import LayerRange
from ftbench.models.gpt import Stage


class WorkerFailed(RuntimeError):
    """Something read the state of a worker that has failed."""


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The one optimizer definition, shared with the single-process reference (foreach off:
    the per-parameter loop makes every replica's arithmetic identical whatever its layout)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)


class StageReplica:
    """One copy of one stage's state on one worker."""

    def __init__(self, stage: int, module: Stage, lr: float, weight_decay: float):
        self.stage, self.layers = stage, (module.first, module.end)
        self.store = WeightGradStore()
        self._module = make_deferrable(module, self.store)
        self._optimizer = make_optimizer(module.parameters(), lr, weight_decay)
        self._undo = StepUndo(self._optimizer)  # the OPT op steps through it (Executor)
        self.names = module.hf_names()  # local parameter name -> Hugging Face GPT-2 name
        # (pipeline, microbatch) -> (stage input, stage output or loss, bytes); with recompute=full
        # (stage input, targets on the last stage else None, the input's bytes): B/BW rebuild the rest
        self.stash: dict = {}
        self.commit: dict | None = None  # in-memory commit (Elastic Horovod): {"iteration", "shard"}
        # DiLoCo's outer state by name: {"backup": the last sync's parameters, "momentum": the
        # outer Nesterov buffer} (ftbench.engine.outer_sync); None otherwise
        self.outer: dict | None = None
        self.pre_sync: dict | None = None  # the state before a sync in flight (dist: a death may cut it)
        self._fragments: dict = {}  # units -> parameters inside them (fragment_parameters)
        self.alive = True

    # -- guarded state ------------------------------------------------------------------
    def _check(self) -> None:
        if not self.alive:
            raise WorkerFailed(f"stage {self.stage} replica belongs to a failed worker; its state was destroyed")

    @property
    def module(self) -> Stage:
        self._check()
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self._check()
        return self._optimizer

    @property
    def undo(self) -> StepUndo:
        """The undo of this replica's last optimizer step (recorded while the iteration in
        flight can still be abandoned; cleared when it completes or starts)."""
        self._check()
        return self._undo

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by their Hugging Face name (the checkpoint and final-state key)."""
        return {self.names[n]: p for n, p in self.module.named_parameters()}

    def fragment_parameters(self, units: Units, n_layers: int) -> list[torch.nn.Parameter]:
        """This replica's parameters inside a fragment, in module order (a fixed order, the
        same on every replica, so contributions to a reduction line up)."""
        self._check()
        if units not in self._fragments:
            self._fragments[units] = [p for name, p in self.named_parameters().items()
                                      if in_units(name, units, n_layers)]
        return self._fragments[units]

    # -- state in and out ---------------------------------------------------------------
    def shard(self, units: Units | None = None, n_layers: int = 0) -> dict:
        """Weights and AdamW state, keyed by Hugging Face names, as independent copies; only
        those inside `units` (ftbench.layers) when given."""
        params = self.named_parameters()
        if units is not None:
            params = {n: p for n, p in params.items() if in_units(n, units, n_layers)}
        optim = {}
        for name, p in params.items():
            state = self.optimizer.state.get(p)
            if state:
                optim[name] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
        out = {"model": {n: p.detach().clone() for n, p in params.items()}, "optim": optim}
        if self.outer is not None:
            out["outer"] = {k: {n: v[n].detach().clone() for n in params} for k, v in self.outer.items()}
        return out

    def load(self, model: dict, optim: dict, grads: dict | None = None, outer: dict | None = None,
             keep_undo: bool = False) -> None:
        """Take weights and AdamW state (and DiLoCo's `outer` state) from merged shards (any
        partition). Any recorded step is forgotten (the state it would undo is replaced),
        unless `keep_undo` (a sync's heal, or its undoing: the state before the sync is the
        state after the step). With `grads` (Bamboo's refresh of a redundant copy: by name,
        the gradients the sender's optimizer step applied, the sender's pre-step state being
        this replica's present one), the load is that step: this replica's undo records it,
        so undoing gives the state before the load back."""
        opt = self.optimizer
        if not keep_undo:
            self._undo.clear()
        if grads is not None:
            params = self.named_parameters()
            for name, p in params.items():
                p.grad = grads[name].to(p) if name in grads else None
            self._undo.record()
            for p in params.values():
                p.grad = None
        with torch.no_grad():
            for name, p in self.named_parameters().items():
                if name not in model:
                    raise KeyError(name)
                p.copy_(model[name])
                opt.state.pop(p, None)
                if name in optim:
                    opt.state[p] = {k: _placed(v, p) for k, v in optim[name].items()}
            if outer is not None and self.outer is not None:
                for kind, values in self.outer.items():
                    for name in values:
                        values[name] = outer[kind][name].to(values[name]).clone()

    def reset_iteration(self) -> None:
        """Drop what an abandoned iteration left behind: stash, deferred W, gradients."""
        self.stash.clear()
        self.store.clear()
        if self.alive:
            self._optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Weights + gradients + AdamW moments held by this replica (the undo's gradient copy,
        `undo.bytes()`, is apart)."""
        n = sum(p.numel() * p.element_size() for p in self.module.parameters())
        outer = sum(t.numel() * t.element_size() for v in (self.outer or {}).values() for t in v.values())
        return 2 * n + outer + sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                                   for v in s.values() if torch.is_tensor(v))

    def destroy(self) -> None:
        if not self.alive:
            return
        for p in self._module.parameters():
            p.data = torch.empty(0)
            p.grad = None
        self._optimizer.state.clear()
        self._undo.clear()
        self.stash.clear()
        self.store.clear()
        self.commit = None
        self.outer = self.pre_sync = None
        self._fragments.clear()
        self.alive = False
        self._module = self._optimizer = self._undo = None


class Worker:
    def __init__(self, worker_id: int):
        self.id = worker_id
        self._replicas: dict[LayerRange, StageReplica] | None = {}
        self.peak_activation_bytes = 0

    @property
    def alive(self) -> bool:
        return self._replicas is not None

    @property
    def replicas(self) -> dict[LayerRange, StageReplica]:
        if self._replicas is None:
            raise WorkerFailed(f"worker {self.id} has failed; its parameters, gradients, optimizer state "
                               "and stash were destroyed")
        return self._replicas

    def replica(self, layers: LayerRange | int) -> StageReplica:
        """The replica of a layer range (plan.layers(pipeline, stage)). An int is a stage index,
        accepted when exactly one held replica has it (a convenience for tests and tools)."""
        replicas = self.replicas
        if isinstance(layers, int):
            found = [r for r in replicas.values() if r.stage == layers]
            if len(found) != 1:
                raise KeyError(f"worker {self.id} holds {len(found)} replicas of stage {layers} "
                               f"(it holds layers {sorted(replicas)})")
            return found[0]
        if layers not in replicas:
            raise KeyError(f"worker {self.id} holds no replica of layers {layers} (it holds {sorted(replicas)})")
        return replicas[layers]

    def destroy(self) -> None:
        for replica in (self._replicas or {}).values():
            replica.destroy()
        self._replicas = None


def _placed(value, param):
    """A copy of one AdamW state entry where AdamW keeps it for `param`: the moments on the
    parameter's device (a checkpoint read on a GPU machine arrives on the CPU), the step count
    on the CPU, as a fresh AdamW (neither fused nor capturable) creates it."""
    if not torch.is_tensor(value):
        return value
    return value.to(param.device if value.dim() else "cpu", copy=True)
