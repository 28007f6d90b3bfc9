"""The equivalence check: a run under failures must train the model fault-free training trains.

No strategy here changes the global batch, so per-iteration losses must agree (rtol 1e-5)
and final weights must agree to float tolerance (`torch.testing.assert_close`). Used by the
local backend after a run (the summary's `matches_fault_free`) and by the tests.
"""
from __future__ import annotations

import math

import torch

LOSS_RTOL = 1e-5


def compare(losses: list[float], state: dict[str, torch.Tensor], ref_losses: list[float],
            ref_state: dict[str, torch.Tensor]) -> str | None:
    """None when equivalent, else a one-line description of the first difference."""
    if len(losses) != len(ref_losses):
        return f"{len(losses)} losses against {len(ref_losses)} fault-free"
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if math.isnan(a) or not math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=0.0):
            return f"iteration {i}: loss {a!r} against {b!r} fault-free"
    if set(state) != set(ref_state):
        return f"parameter names differ: {sorted(set(state) ^ set(ref_state))[:3]}"
    for name in sorted(state):
        try:
            torch.testing.assert_close(state[name], ref_state[name])
        except AssertionError as err:
            first = str(err).strip().splitlines()
            return f"final weight {name} differs: {first[0] if first else err}"
    return None


def load_state(path) -> dict[str, torch.Tensor]:
    """A final_state folder (save_pretrained layout) as a state dict."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path, dtype="auto")  # as saved: float64 stays float64
    return {k: v for k, v in model.state_dict().items() if not k.endswith(".attn.bias")}


def divergence_error(difference: str, dtype: str, segments: list[dict] | None) -> str:
    """The run's error when it differs from fault-free training. In float32 a run whose shape
    changed (a data-parallel width or pipeline shape another than the reference's) sums
    gradients in another order; Adam turns that rounding, in gradients near its epsilon, into
    differences above float32 tolerance, so the message says how to tell it from a bug."""
    error = f"training under failures differs from fault-free training: {difference}"
    if dtype == "float32" and len({s.get("shape") for s in segments or []}) > 1:
        error += (" (this float32 run changed shape, which sums gradients in another order and Adam "
                  "amplifies that rounding; check it in float64: backend.dtype=float64)")
    return error
