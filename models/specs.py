"""Shapes of the models the papers train, and the per-layer arithmetic the cost model needs.

GPT-3 sizes follow the GPT-3 paper (Brown et al. 2020, Table 2.1). "GPT-3 3.35B" is
ReCycle's size, not a GPT-3 paper size; we chose 32 layers, hidden 2880, 36 heads (head
dimension 80, as in GPT-3 2.7B): 3.34B parameters with tied embeddings, within 0.4 % of
3.35B, and 32 layers split evenly over 2, 4, 8, 16 or 32 stages. "gpt2-xl" is Oobleck's
GPT-2 (GPT-2 XL shape, ~1.5B). Parameter counts include the token and position embeddings;
the LM head shares the token embedding (GPT-2 style).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    seq_len: int = 2048
    arch: str = "gpt"  # gpt: causal decoder; bert: encoder (same per-layer costs here)

    # -- parameters --------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """One transformer block: QKV + projection + 4h MLP (weights and biases) + 2 LayerNorms."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq_len * self.hidden

    @property
    def head_params(self) -> int:
        """Final LayerNorm; the LM head weight is tied to the token embedding."""
        return 2 * self.hidden

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    # -- FLOPs per micro-batch of b samples of s tokens --------------------------------
    def layer_forward_flops(self, b: int, s: int) -> float:
        """Megatron's count: 24bsh^2 for the matmuls with weights, 4bs^2h for attention."""
        h = self.hidden
        return 24.0 * b * s * h * h + 4.0 * b * s * s * h

    def layer_backward_input_flops(self, b: int, s: int) -> float:
        """B: gradient w.r.t. inputs. Weight matmuls cost as much as forward; the two
        attention matmuls have no weights, so both of their operand gradients land in B."""
        h = self.hidden
        return 24.0 * b * s * h * h + 8.0 * b * s * s * h

    def layer_backward_weight_flops(self, b: int, s: int) -> float:
        """W: gradient w.r.t. weights, one matmul per weight matmul of the forward."""
        h = self.hidden
        return 24.0 * b * s * h * h

    def head_forward_flops(self, b: int, s: int) -> float:
        """LM head (logits over the vocabulary) on the last stage."""
        return 2.0 * b * s * self.hidden * self.vocab

    # -- activation memory per micro-batch (fp16, no recomputation) -------------------
    def layer_activation_bytes(self, b: int, s: int) -> float:
        """Korthikanti et al. 2022: sbh(34 + 5as/h) bytes per layer."""
        h, a = self.hidden, self.heads
        return s * b * h * (34.0 + 5.0 * a * s / h)

    def layer_weight_grad_stash_bytes(self, b: int, s: int) -> float:
        """What W still needs after B: the inputs of the four linear layers (2+2+2+8 sbh)."""
        return 14.0 * s * b * self.hidden

    def head_activation_bytes(self, b: int, s: int) -> float:
        """Logits kept in fp32 for the loss and its gradient."""
        return 4.0 * b * s * self.vocab

    def boundary_bytes(self, b: int, s: int) -> float:
        """The fp16 hidden state sent between stages (forward) or its gradient (backward)."""
        return 2.0 * b * s * self.hidden


MODEL_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        # A model small enough to train for real on a laptop CPU (byte-level vocabulary).
        ModelSpec("gpt-tiny", layers=8, hidden=64, heads=4, vocab=256, seq_len=32),
        ModelSpec("gpt2-xl", layers=48, hidden=1600, heads=25, seq_len=1024),
        ModelSpec("gpt3-medium", layers=24, hidden=1024, heads=16),
        ModelSpec("gpt3-xl", layers=24, hidden=2048, heads=16),
        ModelSpec("gpt3-2.7b", layers=32, hidden=2560, heads=32),
        ModelSpec("gpt3-3.35b", layers=32, hidden=2880, heads=36),
        ModelSpec("gpt3-6.7b", layers=32, hidden=4096, heads=32),
        ModelSpec("bert-large", layers=24, hidden=1024, heads=16, vocab=30522, seq_len=512,
                  arch="bert"),
    ]
}


def resolve_model(name: str, **overrides) -> ModelSpec:
    """The named spec with any non-None field overridden (config: model.layers=... etc.)."""
    from ftbench.errors import ConfigError

    if name not in MODEL_SPECS:
        raise ConfigError("model", f"unknown model '{name}'",
                          f"choose one of {', '.join(MODEL_SPECS)}")
    spec = replace(MODEL_SPECS[name], **{k: v for k, v in overrides.items() if v is not None})
    for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
        if getattr(spec, key) <= 0:
            raise ConfigError(f"model.{key}", f"must be positive, got {getattr(spec, key)}",
                              f"set model.{key} to a positive integer")
    if spec.vocab < 2:
        raise ConfigError("model.vocab", f"a vocabulary of {spec.vocab} token leaves nothing to predict",
                          "set model.vocab >= 2 (gpt-tiny's is 256), or drop it for the model's own")
    if spec.hidden % spec.heads:
        raise ConfigError("model.heads", f"hidden {spec.hidden} is not divisible by {spec.heads} heads",
                          "pick a head count that divides model.hidden")
    return spec
