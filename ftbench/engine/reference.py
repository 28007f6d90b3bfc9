"""Plain single-process training of the same GPT2LMHeadModel on the same samples: the
yardstick for the local backend's correctness (tests) and its overhead (benchmarks)."""
from __future__ import annotations

import torch

from ftbench.engine.worker import make_optimizer
from ftbench.models.data import batch
from ftbench.models.gpt import init_full_model, lm_loss_sum


def train_single_process(spec, seed: int, data, iterations: int, global_batch: int, microbatch_size: int,
                         lr: float, weight_decay: float = 0.0, dtype=torch.float32):
    """Gradient accumulation over the global batch in sample order, one AdamW step per
    iteration. Returns (losses, final state dict in the Hugging Face layout)."""
    model = init_full_model(spec, seed).to(dtype)
    optimizer = make_optimizer(model.parameters(), lr, weight_decay)
    losses = []
    for i in range(iterations):
        total = 0.0
        for first in range(0, global_batch, microbatch_size):
            ids = batch(data, i, range(first, first + microbatch_size))
            # The mean over the global batch's tokens (HF's `labels=` loss, without its float32 cast).
            loss = lm_loss_sum(model(input_ids=ids).logits, ids) / (global_batch * (ids.shape[1] - 1))
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
