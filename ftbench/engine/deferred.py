"""Decoupled backward (zero-bubble B/W) without doing shared work twice.

The weight matmuls of a stage (GPT-2's Conv1D layers and the LM head's Linear) run through
`_DeferrableMatmul`. In a fused backward (BW) it returns the weight gradient as usual. While
a B op runs, it returns only the input gradient (and the cheap bias gradient) and records the
two operands of the weight-gradient matmul, the layer input x and the output gradient gy;
the W op later computes x^T gy for each recorded matmul. Every FLOP of the backward is done
once: B + W cost one full backward. Parameters outside matmuls (LayerNorm, embeddings) get
their gradients in B; they are cheap and need nothing stashed.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


class WeightGradStore:
    """Per stage replica: the weight-gradient matmuls B left for W, keyed by micro-batch."""

    def __init__(self):
        self.recording = None  # the key of the B op running now, or None (fused backward)
        self.pending: dict[object, list] = {}

    @contextmanager
    def defer(self, key):
        self.recording = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.recording = None

    def record(self, weight: nn.Parameter, x: torch.Tensor, gy: torch.Tensor, transposed: bool) -> None:
        self.pending[self.recording].append((weight, x, gy, transposed))

    def flush(self, key) -> None:
        """Run the W op of `key`: accumulate every recorded weight gradient."""
        for weight, x, gy, transposed in self.pending.pop(key):
            grad = gy.t() @ x if transposed else x.t() @ gy
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad.add_(grad)

    def clear(self) -> None:
        self.pending.clear()
        self.recording = None


class _DeferrableMatmul(torch.autograd.Function):
    """y = x W + b (Conv1D, W: [in, out]) or y = x W^T + b (Linear, W: [out, in])."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, transposed):
        x2 = x.reshape(-1, x.shape[-1])
        y = x2 @ (weight.t() if transposed else weight)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, weight)
        # The Parameter itself, for W: a saved tensor may come back as an alias (saved-tensor
        # hooks), and a gradient set on an alias would never reach the optimizer.
        ctx.param = weight
        ctx.store, ctx.transposed, ctx.has_bias, ctx.in_shape = store, transposed, bias is not None, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gy2 @ (weight if ctx.transposed else weight.t()) if ctx.needs_input_grad[0] else None
        gbias = gy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gweight = None
        if ctx.needs_input_grad[1]:
            if ctx.store.recording is not None:
                ctx.store.record(ctx.param, x2, gy2, ctx.transposed)
            else:
                gweight = gy2.t() @ x2 if ctx.transposed else x2.t() @ gy2
        return (gx.reshape(ctx.in_shape) if gx is not None else None), gweight, gbias, None, None


def _forward(module, store: WeightGradStore, transposed: bool):
    def forward(x):
        return _DeferrableMatmul.apply(x, module.weight, module.bias, store, transposed)
    return forward


def make_deferrable(stage: nn.Module, store: WeightGradStore) -> nn.Module:
    """Route the stage's weight matmuls through the store (in place; returns the stage)."""
    for module in stage.modules():
        if isinstance(module, Conv1D):
            module.forward = _forward(module, store, transposed=False)
        elif isinstance(module, nn.Linear):
            module.forward = _forward(module, store, transposed=True)
    return stage
