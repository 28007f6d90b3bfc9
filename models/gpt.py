"""A real GPT (transformers' GPT-2 blocks) cut into pipeline stages by layer ranges.

Every stage is a slice of one reference `GPT2LMHeadModel` built from a seed, so any
partition starts from the same weights and chaining the stages computes what the
reference computes (same modules, same causal mask, same call arguments).

The LM head is *not* tied to the token embedding (`tie_word_embeddings=False`): with
tying, one weight would live on both the first and the last stage and pipeline training
would have to all-reduce its gradient. Here each weight belongs to exactly one stage.
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask

from ftbench.models.specs import ModelSpec

# transformers 5 names create_causal_mask's cache argument `cache` (the old `past_key_values`
# is deprecated and goes in 5.40); older releases know only the old name.
_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

# Eager attention: plain matmul + softmax, deterministic on CPU and GPU (SDPA's fused
# kernels may pick different algorithms per device and are not always deterministic).
ATTN_IMPLEMENTATION = "eager"


def gpt2_config(spec: ModelSpec) -> GPT2Config:
    """GPT-2 config of `spec`: no dropout, untied LM head, no KV cache, eager attention."""
    return GPT2Config(
        n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads,
        vocab_size=spec.vocab, n_positions=spec.seq_len,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        tie_word_embeddings=False, use_cache=False,
        # Byte-level / synthetic vocabularies have no special tokens (GPT-2's 50256 would be
        # out of range and makes transformers warn).
        bos_token_id=None, eos_token_id=None,
        attn_implementation=ATTN_IMPLEMENTATION,
    )


# (spec, seed) -> the reference model. Never handed out: callers get deep copies.
_FULL_MODELS: dict[tuple[ModelSpec, int], GPT2LMHeadModel] = {}
_CACHE_SIZE = 4


def _build_model(config: GPT2Config, seed: int | None) -> GPT2LMHeadModel:
    """A model initialised on CPU under a forked RNG, so the caller's RNG state is untouched."""
    with torch.random.fork_rng(devices=[]):  # CPU only: init happens on CPU
        if seed is not None:
            torch.random.default_generator.manual_seed(seed)  # not torch.manual_seed: no CUDA
        model = GPT2LMHeadModel(config)
    return model.float().train()


def _cached_full_model(spec: ModelSpec, seed: int) -> GPT2LMHeadModel:
    key = (spec, seed)
    if key not in _FULL_MODELS:
        if len(_FULL_MODELS) >= _CACHE_SIZE:
            _FULL_MODELS.pop(next(iter(_FULL_MODELS)))  # drop the oldest
        _FULL_MODELS[key] = _build_model(gpt2_config(spec), seed)
    return _FULL_MODELS[key]


def init_full_model(spec: ModelSpec, seed: int) -> GPT2LMHeadModel:
    """The reference model: float32, train() mode, weights a function of `seed` alone."""
    return copy.deepcopy(_cached_full_model(spec, seed))


class Stage(nn.Module):
    """Blocks [first, end) of the transformer, plus the embeddings on the first stage and
    the final LayerNorm and LM head on the last.

    Module names mirror GPT2LMHeadModel's (blocks keyed by their global index in `h`), so a
    parameter's HF name is "transformer." + its name, or its name for `lm_head`.
    """

    def __init__(self, full: GPT2LMHeadModel, first: int, end: int, is_first: bool, is_last: bool):
        super().__init__()
        self.first, self.end, self.is_first, self.is_last = first, end, is_first, is_last
        self.config = copy.deepcopy(full.config)  # the mask depends on the attention implementation
        src = full.transformer
        if is_first:
            self.wte = copy.deepcopy(src.wte)
            self.wpe = copy.deepcopy(src.wpe)
        # Deep copies keep each block's `layer_idx` (their global index).
        self.h = nn.ModuleDict({str(i): copy.deepcopy(src.h[i]) for i in range(first, end)})
        if is_last:
            self.ln_f = copy.deepcopy(src.ln_f)
            self.lm_head = copy.deepcopy(full.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] on the first stage, else hidden states [b, s, h];
        returns hidden states, or logits [b, s, vocab] on the last stage."""
        seq_len = x.shape[1]
        # As GPT2Model.forward does without a cache: positions 0..s-1, batch dim 1.
        position_ids = torch.arange(seq_len, device=x.device).unsqueeze(0)
        if self.is_first:
            hidden = self.wte(x) + self.wpe(position_ids)
        else:
            hidden = x
        # Every stage rebuilds the mask from its input exactly as GPT2Model does from
        # inputs_embeds (only shape, dtype and device matter; no padding mask, no cache).
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, position_ids=position_ids,
            **{_CACHE_ARG: None},
        )
        for block in self.h.values():
            hidden = block(hidden, None, causal_mask, None, encoder_attention_mask=None,
                           use_cache=False, position_ids=position_ids)
        if self.is_last:
            hidden = self.lm_head(self.ln_f(hidden))
        return hidden

    def hf_names(self) -> dict[str, str]:
        """Own parameter name -> its name in GPT2LMHeadModel.state_dict()."""
        return {name: name if name.startswith("lm_head.") else f"transformer.{name}"
                for name, _ in self.named_parameters()}


def build_stage(spec: ModelSpec, seed: int, first: int, end: int,
                is_first: bool, is_last: bool) -> Stage:
    """One stage with fresh copies of the reference model's weights for its layers."""
    if not 0 <= first < end <= spec.layers:
        raise ValueError(f"bad layer range [{first}, {end}) for a {spec.layers}-layer model")
    return Stage(_cached_full_model(spec, seed), first, end, is_first, is_last)


def build_stages(spec: ModelSpec, seed: int, layer_ranges: list[tuple[int, int]]) -> list[Stage]:
    """Stages for contiguous `layer_ranges` covering [0, spec.layers)."""
    expected = 0
    for first, end in layer_ranges:
        if first != expected or end <= first:
            raise ValueError(f"layer ranges {layer_ranges} must be contiguous, non-empty and "
                             f"start at 0 (range ({first}, {end}) should start at {expected})")
        expected = end
    if expected != spec.layers or not layer_ranges:
        raise ValueError(f"layer ranges {layer_ranges} must cover [0, {spec.layers})")
    last = len(layer_ranges) - 1
    return [build_stage(spec, seed, first, end, i == 0, i == last)
            for i, (first, end) in enumerate(layer_ranges)]


def tokens_per_sample(seq_len: int) -> int:
    """Next-token predictions per sample: the last token predicts nothing."""
    return seq_len - 1


def lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, in at least float32: logits[:, :-1] predict input_ids[:, 1:].

    Divide by (global batch * tokens_per_sample(seq_len)) and sum over micro-batches to get
    GPT2LMHeadModel(input_ids, labels=input_ids).loss on the whole global batch.
    """
    vocab = logits.shape[-1]
    predictions = logits[:, :-1].reshape(-1, vocab)
    if predictions.dtype in (torch.float16, torch.bfloat16):
        predictions = predictions.float()
    targets = input_ids[:, 1:].reshape(-1).to(logits.device)
    return nn.functional.cross_entropy(predictions, targets, reduction="sum")


def state_dict_from_stages(stages: list[Stage]) -> dict[str, torch.Tensor]:
    """Detached clones of the stages' parameters, under GPT2LMHeadModel's names."""
    state = {}
    for stage in stages:
        names = stage.hf_names()
        for name, param in stage.named_parameters():
            state[names[name]] = param.detach().clone()
    return state


def save_pretrained(stages_or_state_dict, spec: ModelSpec, path) -> Path:
    """Write the stages (or a state dict in HF layout) as a GPT2LMHeadModel checkpoint that
    `GPT2LMHeadModel.from_pretrained(path)` loads. Returns the path."""
    if isinstance(stages_or_state_dict, dict):
        state = stages_or_state_dict
    else:
        state = state_dict_from_stages(list(stages_or_state_dict))
    model = _build_model(gpt2_config(spec), seed=None)
    model.to(next(iter(state.values())).dtype)  # keep the trained precision (float64 on the local backend)
    result = model.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=False)
    # Only non-parameter buffers (older transformers' attn.bias masks) may be missing.
    buffers = {name for name, _ in model.named_buffers()}
    bad_missing = [k for k in result.missing_keys if k not in buffers]
    if bad_missing or result.unexpected_keys:
        raise ValueError(f"state dict does not match GPT2LMHeadModel: missing {bad_missing}, "
                         f"unexpected {result.unexpected_keys}")
    path = Path(path)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a run's console shows its own progress, not HF's file writes
    model.save_pretrained(path)
    return path
