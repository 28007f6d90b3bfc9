"""Training data for the real GPT: token samples that are pure functions of
(seed, iteration, index), so every worker, restart and partition sees the same batches.
Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def _generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from a stable hash of `parts` (Python's hash() is salted)."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return gen


class SyntheticTokens:
    """Samples from a first-order Markov chain over the vocabulary, built from `seed`.

    Each token has `BRANCHES` possible successors (seeded random choices) with fixed,
    skewed probabilities, so the next token is nearly determined by the current one
    (about 1 nat of entropy versus ln(vocab) for uniform noise). A tiny model picks the
    bigram table up within a few dozen steps, so its loss visibly falls. The chain is shared
    by the whole dataset; the start token and every step are drawn from a generator
    seeded by (seed, iteration, index).
    """

    BRANCHES = 4
    BRANCH_PROBS = (0.7, 0.15, 0.1, 0.05)

    def __init__(self, vocab: int, seq_len: int, seed: int):
        if vocab < 2 or seq_len < 2:
            raise ValueError(f"synthetic tokens need vocab >= 2 and seq_len >= 2, "
                             f"got vocab {vocab}, seq_len {seq_len}")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        gen = _generator(seed, -1)  # -1: the chain's own stream, apart from any sample's
        branches = min(self.BRANCHES, vocab)
        # successors[t]: the tokens that may follow t (O(vocab) to build, so large vocabularies
        # are cheap; a rare repeat just merges two branches); cumulative[k]: P(branch <= k).
        self.successors = torch.randint(vocab, (vocab, branches), generator=gen)
        probs = torch.tensor(self.BRANCH_PROBS[:branches], dtype=torch.float64)
        self.cumulative = (probs / probs.sum()).cumsum(0)

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = _generator(self.seed, iteration, index)
        start = torch.randint(self.vocab, (1,), generator=gen).item()
        # Inverse-CDF choice of a branch per step, from one draw of uniforms.
        choices = torch.searchsorted(self.cumulative, torch.rand(self.seq_len - 1, generator=gen,
                                                                  dtype=torch.float64))
        choices = choices.clamp(max=len(self.cumulative) - 1)  # rounding at the top end
        tokens = [start]
        for branch in choices.tolist():
            tokens.append(self.successors[tokens[-1], branch].item())
        return torch.tensor(tokens, dtype=torch.long)


class TextFileTokens:
    """Windows of `seq_len` bytes of a local text file; token = byte value (vocab 256)."""

    vocab = 256

    def __init__(self, path, seq_len: int, seed: int):
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        if not self.path.is_file():
            raise ValueError(f"text data file {self.path} does not exist")
        data = self.path.read_bytes()
        if len(data) < seq_len + 1:
            raise ValueError(f"text data file {self.path} has {len(data)} bytes; "
                             f"need at least seq_len + 1 = {seq_len + 1}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = _generator(self.seed, iteration, index)
        offset = torch.randint(len(self.tokens) - self.seq_len + 1, (1,), generator=gen).item()
        return self.tokens[offset:offset + self.seq_len].long()


def batch(source, iteration: int, indices) -> torch.Tensor:
    """Samples `indices` of `iteration`, stacked into [len(indices), seq_len]."""
    return torch.stack([source.sample(iteration, int(i)) for i in indices])


KINDS = ("synthetic", "text")  # the choices of train.data


def make_source(kind: str, spec, seq_len: int, seed: int, path=None):
    """The data source `kind` ("synthetic" or "text") for a model of `spec`."""
    if kind == "synthetic":
        return SyntheticTokens(spec.vocab, seq_len, seed)
    if kind == "text":
        if spec.vocab < 256:
            raise ValueError(f"model {spec.name} has vocab {spec.vocab}; byte-level text needs "
                             "model.vocab to be at least 256")
        if path is None:
            raise ValueError("text data needs a path to a local text file")
        return TextFileTokens(path, seq_len, seed)
    raise ValueError(f"unknown data kind '{kind}': choose 'synthetic' or 'text'")
