"""Undo a replica's last optimizer step by inverting it (Swift, Zhong et al., PPoPP 2023).

A failure can land after some stages have applied the interrupted iteration's optimizer step
and before others have. To redo the iteration from one consistent state, the stages that
stepped go back one step. Keeping a full copy of weights and optimizer state from before the
step would do it, at three times the weights' memory for AdamW. Swift keeps only what the
step consumed, the gradient, and computes the previous state from the current one: every
update of AdamW and SGD is invertible given the gradient and the hyper-parameters in force.

`StepUndo` is that mechanism for one optimizer (one stage replica): `record()` right before
`optimizer.step()` (or `step()`, which does both) keeps a copy of each stepped parameter's
gradient plus scalars (the param groups' hyper-parameters, step counts, the lr schedule's
state); `undo()` gives params, exp_avg, exp_avg_sq, step and momentum_buffer back their
pre-step values and rewinds the schedule; `clear()` drops the copy once the iteration can no
longer be interrupted. `bytes()` is what it keeps: one gradient per stepped parameter.

The inverse is exact algebra done in float64 from the post-step state, which is what the
step itself used (AdamW's bias-corrected moments, SGD's new momentum buffer). What it cannot
give back is the step's own rounding into the parameter's dtype: float32 parameters come back
to within a few ulps of the tensor's largest element, float64 ones to within a few of theirs.
Scalars are rounded the way torch's kernels applied them (a Python float multiplying a
float32 tensor is a float32 number), so the inverse undoes what was done, not what was meant.

Supported: torch.optim.AdamW and Adam (decoupled or L2 weight decay, bias correction,
maximize) and SGD (momentum, dampening, nesterov, weight decay, maximize), with the
per-parameter loop or foreach (same formula, same roundings). Anything whose update cannot
be inverted from the gradient alone (amsgrad keeps a running max), or whose arithmetic
differs (capturable, differentiable, fused), raises ValueError naming the option.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

__all__ = ["StepUndo", "UndoError", "check_supported"]


class UndoError(RuntimeError):
    """undo() was asked for a step it did not record (none recorded, or already undone)."""


@dataclass
class _Kept:
    """What one stepped parameter needs for its inverse (no more than its gradient)."""
    param: torch.Tensor
    grad: torch.Tensor  # the gradient the step applied, in the parameter's dtype
    had_state: bool  # the parameter had an entry in optimizer.state (possibly empty)
    first: bool  # the step created the state (AdamW's lazy init, SGD's first momentum buffer)
    step: float = 0.0  # AdamW: the step count before the step
    zero_moments: bool = False  # AdamW: step 0 with all-zero moments (state loaded, never stepped)


@dataclass
class _Group:
    hyper: dict  # the group's entries except params, as they were when the step ran
    kept: list[_Kept]


def _applied(x: float, dtype: torch.dtype) -> float:
    """`x` as torch's kernels apply a Python scalar to a tensor of `dtype`: rounded to the
    kernel's compute type (float64 for float64 tensors, float32 otherwise). Inverting with
    the rounded scalar removes up to half an ulp per scalar from the error of the undo."""
    return float(torch.tensor(x, dtype=torch.float64 if dtype == torch.float64 else torch.float32))


def _kind(optimizer) -> str:
    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        return "adam"
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    # exact types only: a subclass may override step() and with it the arithmetic
    raise ValueError(f"undo supports torch.optim.AdamW, Adam and SGD; got {type(optimizer).__name__}, "
                     "whose update it cannot invert")


def check_supported(optimizer) -> None:
    """Raise ValueError naming the first option whose step this module cannot invert exactly."""
    kind = _kind(optimizer)
    name = type(optimizer).__name__
    for attr in ("grad_scale", "found_inf"):
        if getattr(optimizer, attr, None) is not None:
            raise ValueError(f"{name} with {attr} set (AMP's fused unscaling) changes the step; undo cannot invert it")
    for i, group in enumerate(optimizer.param_groups):
        where = f"{name} param group {i}"
        for option in ("fused", "differentiable") + (("capturable",) if kind == "adam" else ()):
            if group.get(option):
                raise ValueError(f"{where}: {option}=True computes the step differently; undo inverts only "
                                 f"the plain per-parameter (or foreach) update")
        scalars = ["lr"] + (["eps", "weight_decay"] if kind == "adam" else ["momentum", "dampening", "weight_decay"])
        for option in scalars:
            if torch.is_tensor(group[option]):
                raise ValueError(f"{where}: {option} as a Tensor is not supported by undo; use a float")
        if kind == "adam":
            if group["amsgrad"]:
                raise ValueError(f"{where}: amsgrad=True keeps a running max of the second moment, which the "
                                 "gradient alone cannot undo")
            b1, b2 = group["betas"]
            if torch.is_tensor(b1) or torch.is_tensor(b2):
                raise ValueError(f"{where}: betas as Tensors are not supported by undo; use floats")
            if b1 == 0 or b2 == 0:
                raise ValueError(f"{where}: betas={group['betas']}: a zero beta forgets the previous moment, "
                                 "so the step cannot be undone")
        if group["lr"] * group["weight_decay"] == 1 and (kind == "sgd" or group.get("decoupled_weight_decay")):
            raise ValueError(f"{where}: lr * weight_decay = 1 zeroes the parameters; the step cannot be undone")


class StepUndo:
    """The undo of the last optimizer step of one optimizer (a stage replica's).

    Call `record()` right before `optimizer.step()` (or `step()` for both), `undo()` to go
    back to the state before that step, `clear()` when the iteration is committed (so that
    an undo cannot reach back one iteration too far). `scheduler`, a torch lr_scheduler of
    this optimizer stepped after each optimizer step, is rewound too."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler=None):
        check_supported(optimizer)
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
            raise ValueError("the lr scheduler given to StepUndo drives another optimizer")
        self.optimizer, self.scheduler = optimizer, scheduler
        self._kind = _kind(optimizer)
        self._groups: list[_Group] | None = None
        self._schedule: dict | None = None
        self._undone = False

    @property
    def recorded(self) -> bool:
        """A step is recorded and not undone: undo() would act."""
        return self._groups is not None

    def bytes(self) -> int:
        """Memory this undo keeps: one copy of each stepped parameter's gradient (the scalars
        beside them are negligible). What a worker's peak memory counts for undo."""
        if self._groups is None:
            return 0
        return sum(k.grad.numel() * k.grad.element_size() for g in self._groups for k in g.kept)

    def clear(self) -> None:
        """Drop the recorded step (its gradients are freed): the iteration is committed."""
        self._groups, self._schedule, self._undone = None, None, False

    def step(self, closure=None):
        """record() then optimizer.step(closure): the one call an executor's OPT op needs."""
        self.record()
        return self.optimizer.step(closure)

    # -- record ---------------------------------------------------------------------------
    def record(self) -> None:
        """Keep what undoing the coming step needs: every parameter the step will update (those
        with a gradient, as the optimizers skip the rest) with a copy of its gradient, and the
        scalars in force. Replaces any earlier record."""
        check_supported(self.optimizer)
        self.clear()  # free the previous copies before taking new ones: never two at once
        opt, adam = self.optimizer, self._kind == "adam"
        groups = []
        for group in opt.param_groups:
            momentum = not adam and group["momentum"] != 0
            kept = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise ValueError("undo supports dense real parameters and gradients only")
                had_state = p in opt.state
                state = opt.state[p] if had_state else {}
                k = _Kept(p, p.grad.detach().clone(), had_state, first=False)
                if adam:
                    k.first = len(state) == 0
                    if not k.first:
                        k.step = float(state["step"])
                        k.zero_moments = k.step == 0 and not state["exp_avg"].any() \
                            and not state["exp_avg_sq"].any()
                elif momentum:
                    k.first = state.get("momentum_buffer") is None
                kept.append(k)
            groups.append(_Group({key: v for key, v in group.items() if key != "params"}, kept))
        if self.scheduler is not None:
            self._schedule = copy.deepcopy(self.scheduler.state_dict())
        self._groups = groups

    # -- undo -----------------------------------------------------------------------------
    def undo(self) -> None:
        """Give every parameter the step updated, and its optimizer state, the values it had
        before the step (to the step's rounding, see the module docstring); parameters the
        step created state for get none, as if they had never stepped. Rewinds the param
        groups' hyper-parameters and the lr schedule to what they were at record()."""
        if self._groups is None:
            raise UndoError("undo: that step was already undone; a step can be undone once" if self._undone
                            else "undo: no optimizer step recorded (call record() right before optimizer.step(), "
                                 "or StepUndo.step())")
        if len(self._groups) != len(self.optimizer.param_groups):
            raise UndoError("undo: the optimizer's param groups changed since record()")
        invert = self._undo_adam if self._kind == "adam" else self._undo_sgd
        self._check_stepped()
        with torch.no_grad():
            for group, rec in zip(self.optimizer.param_groups, self._groups):
                for k in rec.kept:
                    invert(k, rec.hyper)
                group.update(rec.hyper)  # lr (and betas/momentum if a schedule cycles them) as the step saw them
        if self.scheduler is not None:
            self.scheduler.load_state_dict(self._schedule)
        self.clear()
        self._undone = True

    def _check_stepped(self) -> None:
        """Check, before changing anything (an undo half done would be worse than none), that
        the state the inverse reads is there: AdamW counts its steps, so every recorded
        parameter must have taken exactly the recorded one; SGD with momentum must hold a
        momentum buffer for each."""
        for rec in self._groups:
            for k in rec.kept:
                state = self.optimizer.state.get(k.param) or {}
                if self._kind == "adam":
                    now = float(state["step"]) if "step" in state else None
                    if now != k.step + 1:
                        raise UndoError(f"undo: a parameter's step count is {now} where the recorded step left "
                                        f"{k.step + 1:g}: the optimizer did not take exactly that one step "
                                        "since record()")
                elif rec.hyper["momentum"] != 0 and state.get("momentum_buffer") is None:
                    raise UndoError("undo: a parameter SGD stepped with momentum has no momentum buffer: the "
                                    "optimizer did not take the recorded step, or its state was replaced")

    def _forget(self, k: _Kept, key: str | None) -> None:
        """The step created this state: remove it (`key`, or all of it), as before any step,
        so the next step initialises it afresh and matches a first step bit for bit."""
        state = self.optimizer.state
        if key is None:
            state[k.param].clear()
        else:
            state[k.param].pop(key, None)
        if not k.had_state:
            del state[k.param]

    def _undo_adam(self, k: _Kept, h: dict) -> None:
        """torch's single-tensor Adam(W) step t, from (p, m, v) to (p', m', v'):
            p  <- p * (1 - lr*wd)                          decoupled weight decay (AdamW)
            d  =  g  (AdamW)  or  g + wd*p  (Adam's L2)   g negated under maximize
            m' =  lerp(m, d, 1-b1),   v' = b2 v + (1-b2) d^2
            p' =  p - lr/(1-b1^t) * m' / (sqrt(v')/sqrt(1-b2^t) + eps)
        m' and v' are in the state, so the last line inverts directly; then the decay, then
        the moments, each solved for the previous value."""
        p, state, dtype = k.param, self.optimizer.state[k.param], k.param.dtype
        b1, b2 = h["betas"]
        lr, wd, eps = h["lr"], h["weight_decay"], h["eps"]
        t = k.step + 1
        g = k.grad.double().neg() if h["maximize"] else k.grad.double()
        m1, v1 = state["exp_avg"].double(), state["exp_avg_sq"].double()
        denom = v1.sqrt() / _applied((1 - b2 ** t) ** 0.5, dtype) + _applied(eps, dtype)
        p0 = p.double() + _applied(lr / (1 - b1 ** t), dtype) * m1 / denom
        if wd != 0 and h["decoupled_weight_decay"]:
            p0 /= _applied(1 - lr * wd, dtype)
        p.copy_(p0)
        if k.first:
            self._forget(k, None)
            return
        state["step"] -= 1
        if k.zero_moments:  # exactly zero, not zero to rounding: the next step is then a first step's twin
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
            return
        d = g + _applied(wd, dtype) * p0 if wd != 0 and not h["decoupled_weight_decay"] else g
        w = _applied(1 - b1, dtype)  # lerp's weight: m' = m + w (d - m) = (1-w) m + w d
        state["exp_avg"].copy_((m1 - w * d) / (1 - w))
        # v' - (1-b2) d^2 cancels where the new gradient dominates v': the result is exact only
        # to the rounding of v', and never negative (a tiny negative v would poison sqrt later)
        v0 = (v1 - _applied(1 - b2, dtype) * d * d) / _applied(b2, dtype)
        state["exp_avg_sq"].copy_(v0.clamp_min_(0))

    def _undo_sgd(self, k: _Kept, h: dict) -> None:
        """torch's SGD step, from (p, buf) to (p', buf'):
            d    =  g + wd*p                       (g negated under maximize)
            buf' =  mu buf + (1-damp) d,  or d on the first step (no dampening)
            u    =  buf'  |  d + mu buf' (nesterov)  |  d (no momentum)
            p'   =  p - lr u
        Without nesterov, u = buf' is known and p = p' + lr buf'. Otherwise u holds p
        through d: p' = p (1 - lr wd) - lr (g + mu buf'), one linear equation per element."""
        p, dtype = k.param, k.param.dtype
        lr, wd, mu = _applied(h["lr"], dtype), _applied(h["weight_decay"], dtype), _applied(h["momentum"], dtype)
        g = k.grad.double().neg() if h["maximize"] else k.grad.double()
        state = self.optimizer.state.get(p, {})
        if h["momentum"] != 0:
            buf1 = state["momentum_buffer"].double()
            if h["nesterov"]:
                p0 = (p.double() + lr * (g + mu * buf1)) / (1 - lr * wd)
            else:
                p0 = p.double() + lr * buf1
            p.copy_(p0)
            if k.first:
                self._forget(k, "momentum_buffer")
                return
            d = g + wd * p0 if h["weight_decay"] != 0 else g
            state["momentum_buffer"].copy_((buf1 - _applied(1 - h["dampening"], dtype) * d) / mu)
        else:
            p.copy_((p.double() + lr * g) / (1 - lr * wd))
