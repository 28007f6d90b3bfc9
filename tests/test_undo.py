"""The engine's one undo of an optimizer step (ftbench.engine.undo): step then undo gives
the pre-step state back, redoing after an undo equals not having undone, and the undo keeps
no more than one gradient per parameter.

The bound, and why. An undo inverts in float64 the update the step applied, so what it cannot
give back is the step's own rounding into the parameter's dtype: each value the step rounded
(p * (1 - lr wd), p - update, lerp(m, d, 1 - b1), b2 v + (1 - b2) d^2, mu buf + (1 - damp) d)
is off by half an ulp of its own magnitude, the inverse's cast back adds another half, and
the inverse's divisions by b1, b2, mu and (1 - lr wd) (all near 1) barely grow that. Those
magnitudes are at most the larger of the tensor's pre-step and post-step values (the post-
step side matters: a zero-initialised bias has a zero pre-step norm). So every tensor meets

    |undone - before| <= ULPS * eps(dtype) * max(|before|_inf, |after|_inf)

with ULPS = 4 (measured here: under 2, so a factor 2 of headroom), for params, exp_avg,
momentum_buffer and exp_avg_sq alike; a redo after the undo inherits the same bound, scaled by
the undone step's magnitudes too. What the second moment loses is relative to its own pre-step
value: v = (v' - (1 - b2) g^2) / b2 cancels where the new gradient dominates v', leaving few or
no correct digits of a small v. With AdamW's decoupled decay its error is bounded by the
post-step v' element by element (test_second_moment_loses_digits_only_relative_to_v_after),
which is why redoing the step restores v' to the same few ulps. (With L2 decay, Adam's d = g +
wd p can cancel too, so there only the norm bound holds.) Step counts come back exactly, and a
first step's state is removed, so the next step matches a fresh optimizer bit for bit.
"""
import copy

import pytest
import torch

from ftbench.engine.undo import StepUndo, UndoError, check_supported

torch.set_num_threads(1)

ULPS = 4
DTYPES = [torch.float32, torch.float64]
LR = {"adamw": 1e-2, "adam": 1e-2, "sgd": 0.1, "sgd-nesterov": 0.1, "sgd-dampening": 0.1, "sgd-plain": 0.1}


def make_optimizer(kind: str, params, weight_decay: float, **extra):
    """The optimizers undo supports, as the engine and the Swift paper configure them."""
    lr = LR[kind]
    if kind == "adamw":  # ftbench.engine.worker.make_optimizer's definition
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **{"foreach": False, **extra})
    if kind == "adam":  # L2 weight decay: the decay enters the moments through the gradient
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **{"foreach": False, **extra})
    sgd = {"sgd": {"momentum": 0.9}, "sgd-nesterov": {"momentum": 0.9, "nesterov": True},
           "sgd-dampening": {"momentum": 0.9, "dampening": 0.3}, "sgd-plain": {}}[kind]
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **sgd, **extra)


def make_params(dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    """A weight, a tensor of values below the update's size, and a zero-initialised bias
    (its pre-step norm is zero: the bound must stand on the post-step side)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=gen, dtype=dtype)),
            torch.nn.Parameter(torch.randn(24, generator=gen, dtype=dtype) * 1e-3),
            torch.nn.Parameter(torch.zeros(8, dtype=dtype))]


def set_grads(params, seed: int) -> None:
    """Gradients over five orders of magnitude, with some exact zeros (entries a
    micro-batch did not touch): small and dominating gradients in the same tensor."""
    gen = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        scale = 10 ** (torch.rand(p.shape, generator=gen, dtype=p.dtype) * 5 - 4)
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
        g[torch.rand(p.shape, generator=gen) < 0.1] = 0
        p.grad = g


def other_gradient(grad, gen):
    """A different gradient of the same size per element: each entry's sign drawn afresh and
    its magnitude scaled by 0.5 to 2. What a redone iteration can see (recomputed on weights a
    few ulps away, or on other data), short of an unrelated gradient far smaller than the
    undone one somewhere: there the undone v's error, a few ulps of the undone step's g^2,
    would weigh (g_undone / g_redo)^2 times more in that element's Adam update."""
    sign = torch.randint(0, 2, grad.shape, generator=gen).to(grad.dtype) * 2 - 1
    return grad * sign * (0.5 + 1.5 * torch.rand(grad.shape, generator=gen, dtype=grad.dtype))


def snapshot(optimizer, params) -> list[tuple[torch.Tensor, dict]]:
    """Each parameter and its optimizer state, as independent copies."""
    return [(p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in optimizer.state[p].items()} if p in optimizer.state else None)
            for p in params]


def assert_within_ulps(actual, expected, *others) -> None:
    """|actual - expected| <= ULPS eps max(|expected|_inf, |others|_inf): the module docstring's
    bound, with `others` the tensors whose rounding the comparison inherits."""
    eps = torch.finfo(expected.dtype).eps
    scale = max(t.abs().max().item() for t in (expected, *others))
    torch.testing.assert_close(actual, expected, rtol=0, atol=ULPS * eps * scale)


def assert_state_close(actual, expected, *others) -> None:
    """Params and every state tensor within the bound; state entries alike; steps exact."""
    for (p, state), (p_exp, state_exp), *other in zip(actual, expected, *others):
        assert_within_ulps(p, p_exp, *(o[0] for o in other))
        assert (state is None) == (state_exp is None)
        if state is None:
            continue
        assert state.keys() == state_exp.keys()
        for key, value in state_exp.items():
            if key == "step":
                assert torch.equal(state[key], value)  # a count: exact
            else:
                assert_within_ulps(state[key], value, *(o[1][key] for o in other if o[1]))


def history(kind: str, dtype, weight_decay: float, steps: int, **extra):
    """A setup that has taken `steps` steps (0: none yet)."""
    params = make_params(dtype)
    optimizer = make_optimizer(kind, params, weight_decay, **extra)
    for i in range(steps):
        set_grads(params, i)
        optimizer.step()
    return params, optimizer


KINDS = list(LR)
CASES = [(kind, dtype, wd, steps) for kind in KINDS for dtype in DTYPES for wd in (0.0, 0.1) for steps in (0, 4)]
IDS = [f"{kind}-{str(dtype)[6:]}-wd{wd}-step{steps + 1}" for kind, dtype, wd, steps in CASES]


@pytest.mark.parametrize("kind,dtype,weight_decay,steps", CASES, ids=IDS)
def test_undo_returns_the_state_before_the_step(kind, dtype, weight_decay, steps):
    """Step 1 (state created by the step) and step 5 (state updated) of every optimizer, float32
    and float64 parameters, weight decay on and off: undo gives back the pre-step state."""
    params, optimizer = history(kind, dtype, weight_decay, steps)
    undo = StepUndo(optimizer)
    set_grads(params, steps)
    before = snapshot(optimizer, params)
    undo.step()
    after = snapshot(optimizer, params)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(after, before))  # the step did something
    undo.undo()
    undone = snapshot(optimizer, params)
    assert_state_close(undone, before, after)
    assert all((state["exp_avg_sq"] >= 0).all() for _, state in undone if state and "exp_avg_sq" in state)
    if steps == 0:  # as if it had never stepped: no state at all, not zeros
        assert len(optimizer.state) == 0


def _stepped_and_undone(kind, dtype, weight_decay, steps):
    """A fresh history, one more step through StepUndo and its undo: (params, optimizer, the
    state after the step, the state after the undo)."""
    params, optimizer = history(kind, dtype, weight_decay, steps)
    undo = StepUndo(optimizer)
    set_grads(params, steps)
    undo.step()
    after = snapshot(optimizer, params)
    undo.undo()
    return params, optimizer, after, snapshot(optimizer, params)


@pytest.mark.parametrize("kind,dtype,weight_decay,steps", CASES, ids=IDS)
def test_redo_after_undo_equals_the_step(kind, dtype, weight_decay, steps):
    """The use case: undo the interrupted iteration's step, then take the step again, with the
    same gradient (step-undo-step equals step) and with a different one (equals that step
    taken from the original state). The bound carries through one step: AdamW normalises the
    update per element, and momentum and weight decay scale errors by factors below one."""
    params, optimizer, after, undone = _stepped_and_undone(kind, dtype, weight_decay, steps)
    twin_params, twin = history(kind, dtype, weight_decay, steps)  # never undone
    set_grads(params, steps)
    optimizer.step()
    assert_state_close(snapshot(optimizer, params), after, undone)

    # a different gradient after the undo
    params, optimizer, after, undone = _stepped_and_undone(kind, dtype, weight_decay, steps)
    gen = torch.Generator().manual_seed(77)
    for p, q in zip(params, twin_params):
        q.grad = p.grad = other_gradient(p.grad, gen)
    optimizer.step()
    twin.step()
    # the undone state's error is a few ulps of the undone step's magnitudes (`after`), which
    # the new step need not share (a smaller gradient here): the bound keeps that scale
    assert_state_close(snapshot(optimizer, params), snapshot(twin, twin_params), undone, after)


@pytest.mark.parametrize("kind", KINDS)
def test_first_step_undone_leaves_a_fresh_optimizer(kind):
    """Undoing step 1 removes the state the step created (empty, not zeros), so the next step
    is bit for bit the step a fresh optimizer takes from the same parameters."""
    params, optimizer = history(kind, torch.float32, 0.1, 0)
    undo = StepUndo(optimizer)
    set_grads(params, 0)
    undo.step()
    undo.undo()
    assert optimizer.state_dict()["state"] == {}
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make_optimizer(kind, fresh_params, 0.1)
    set_grads(params, 5)
    set_grads(fresh_params, 5)
    optimizer.step()
    fresh.step()
    for (p, state), (q, fresh_state) in zip(snapshot(optimizer, params), snapshot(fresh, fresh_params)):
        assert torch.equal(p, q)
        assert (state is None) == (fresh_state is None)
        for key in fresh_state or {}:
            assert torch.equal(state[key], fresh_state[key])


def test_adamw_state_at_step_zero_comes_back_exactly_zero():
    """State that exists but never stepped (step 0, zero moments, e.g. loaded) comes back as
    exact zeros, not zeros to rounding: the next step is then a first step's twin."""
    params = make_params(torch.float32)
    optimizer = make_optimizer("adamw", params, 0.1)
    for p in params:
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    undo = StepUndo(optimizer)
    set_grads(params, 0)
    undo.step()
    undo.undo()
    for p in params:
        state = optimizer.state[p]
        assert state["step"].item() == 0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_second_moment_loses_digits_only_relative_to_v_after():
    """Where the new gradient dominates v (a small v before, a large g now), the undone v has
    few correct digits relative to itself, but its error stays within a few ulps of the
    post-step v element by element: redoing the step gets v' back to that precision."""
    params, optimizer = history("adamw", torch.float32, 0.0, 3)
    with torch.no_grad():
        for p in params:  # small second moments (some exactly zero), then gradients 1e4 times their root
            optimizer.state[p]["exp_avg_sq"].mul_(1e-6)[::2] = 0
            p.grad = torch.randn_like(p) * 1e4
    undo = StepUndo(optimizer)
    before = snapshot(optimizer, params)
    undo.step()
    after = snapshot(optimizer, params)
    undo.undo()
    eps = torch.finfo(torch.float32).eps
    lost = 0.0
    for (_, undone), (_, pre), (_, post) in zip(snapshot(optimizer, params), before, after):
        v_after = post["exp_avg_sq"].double()
        torch.testing.assert_close(undone["exp_avg_sq"].double() / v_after, pre["exp_avg_sq"].double() / v_after,
                                   rtol=0, atol=ULPS * eps)
        # a second moment is never negative, even where cancellation leaves less than an ulp
        assert (undone["exp_avg_sq"] >= 0).all()
        rel = ((undone["exp_avg_sq"] - pre["exp_avg_sq"]).abs() / pre["exp_avg_sq"].clamp_min(1e-30)).max().item()
        lost = max(lost, rel)
    assert lost > 1e3 * eps  # relative to v before, digits are lost indeed (the bound above is not vacuous)


def _schedules(optimizer):
    return {"lambda": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.7 ** epoch),
            "step": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
            # OneCycleLR cycles AdamW's beta1 too: the inverse must use the betas the step used
            "onecycle": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)}


@pytest.mark.parametrize("schedule", ["lambda", "step", "onecycle"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_learning_rate_schedule_is_rewound(kind, schedule):
    """The step ran with the lr (and betas) before the schedule's step; undo inverts with those
    and puts the schedule back: last_epoch, the group's lr, get_last_lr. Then the rerun
    iteration (step, schedule step) lands where the run without a failure lands."""
    runs = []
    for with_undo in (True, False):
        params = make_params(torch.float32)
        optimizer = make_optimizer(kind, params, 0.1)
        scheduler = _schedules(optimizer)[schedule]
        undo = StepUndo(optimizer, scheduler)
        for i in range(5):
            set_grads(params, i)
            undo.step()
            scheduler.step()
        set_grads(params, 5)
        before = snapshot(optimizer, params)
        groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
        last_epoch, last_lr = scheduler.last_epoch, scheduler.get_last_lr()
        if with_undo:
            undo.step()
            scheduler.step()
            after = snapshot(optimizer, params)
            assert optimizer.param_groups[0]["lr"] != groups_before[0]["lr"]  # the schedule moved on
            undo.undo()
            assert scheduler.last_epoch == last_epoch and scheduler.get_last_lr() == last_lr
            assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups_before
            assert_state_close(snapshot(optimizer, params), before, after)
            set_grads(params, 5)
        for i in range(5, 8):
            if i > 5:
                set_grads(params, i)
            optimizer.step()
            scheduler.step()
        runs.append((snapshot(optimizer, params), scheduler.get_last_lr(), scheduler.last_epoch))
    (state, lr, epoch), (state_ref, lr_ref, epoch_ref) = runs
    assert (lr, epoch) == (lr_ref, epoch_ref)
    # three steps after an undo within ULPS: an Adam step does not grow a relative error, and
    # SGD's momentum 0.9 and decay 1 - lr wd scale it by less than one per step
    assert_state_close(state, state_ref, state_ref)


def test_maximize_and_foreach_invert_the_same_formula():
    """maximize negates the gradient; foreach runs the same formula with the same roundings
    (and SGD's foreach nesterov adds the momentum into .grad in place, which is why record
    keeps a copy rather than a reference)."""
    for kind, weight_decay, extra in [("adamw", 0.1, {"maximize": True}), ("sgd-nesterov", 0.1, {"maximize": True}),
                                      ("adamw", 0.1, {"foreach": True}), ("sgd-nesterov", 0.0, {"foreach": True})]:
        params, optimizer = history(kind, torch.float32, weight_decay, 3, **extra)
        undo = StepUndo(optimizer)
        set_grads(params, 3)
        before = snapshot(optimizer, params)
        undo.step()
        after = snapshot(optimizer, params)
        undo.undo()
        assert_state_close(snapshot(optimizer, params), before, after)


def test_parameters_without_gradient_are_left_alone():
    """Like the optimizers, undo skips parameters that had no gradient: they and their state
    are untouched, and the undo keeps nothing for them."""
    params, optimizer = history("adamw", torch.float32, 0.1, 2)
    undo = StepUndo(optimizer)
    set_grads(params, 2)
    params[0].grad = None
    held, held_state = params[0].detach().clone(), copy.deepcopy(optimizer.state[params[0]])
    undo.step()
    undo.undo()
    assert torch.equal(params[0], held)
    assert all(torch.equal(optimizer.state[params[0]][k], v) for k, v in held_state.items())


def test_bytes_is_one_gradient_copy_per_stepped_parameter():
    """What undo keeps is the gradient each stepped parameter applied, no more (no weights, no
    moments): the memory a worker reports for it."""
    params = make_params(torch.float32) + [torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    undo = StepUndo(optimizer)
    assert undo.bytes() == 0
    set_grads(params, 0)
    params[1].grad = None
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    undo.step()
    assert undo.bytes() == grads == 4 * (16 * 8 + 8) + 8 * 5
    undo.clear()
    assert undo.bytes() == 0 and not undo.recorded


def test_undo_without_a_recorded_step_or_twice_raises():
    params, optimizer = history("adamw", torch.float32, 0.1, 1)
    undo = StepUndo(optimizer)
    with pytest.raises(UndoError, match="no optimizer step recorded"):
        undo.undo()
    set_grads(params, 1)
    undo.step()
    undo.undo()
    with pytest.raises(UndoError, match="already undone"):
        undo.undo()
    undo.step()
    undo.clear()  # the iteration committed: nothing to undo any more
    with pytest.raises(UndoError, match="no optimizer step recorded"):
        undo.undo()


def test_undo_refuses_a_step_it_did_not_record():
    """AdamW counts steps: recorded but not stepped, or stepped twice, is refused before
    anything changes; SGD with momentum must hold the buffers the step made."""
    params, optimizer = history("adamw", torch.float32, 0.1, 1)
    undo = StepUndo(optimizer)
    set_grads(params, 1)
    undo.record()
    held = snapshot(optimizer, params)
    with pytest.raises(UndoError, match="exactly that one step"):
        undo.undo()
    assert_state_close(snapshot(optimizer, params), held, held)
    optimizer.step()
    optimizer.step()
    with pytest.raises(UndoError, match="exactly that one step"):
        undo.undo()
    params, optimizer = history("sgd", torch.float32, 0.1, 0)
    undo = StepUndo(optimizer)
    set_grads(params, 0)
    undo.record()
    with pytest.raises(UndoError, match="no momentum buffer"):
        undo.undo()


@pytest.mark.parametrize("build,option", [
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True, foreach=False), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, capturable=True, foreach=False), "capturable"),
    (lambda ps: torch.optim.AdamW(ps, differentiable=True), "differentiable"),
    (lambda ps: torch.optim.AdamW(ps, fused=True), "fused"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), "fused"),
    (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3), foreach=False), "lr as a Tensor"),
    (lambda ps: torch.optim.AdamW(ps, betas=(0.0, 0.999), foreach=False), "betas"),
    (lambda ps: torch.optim.SGD(ps, lr=10.0, weight_decay=0.1), "lr \\* weight_decay"),
    (lambda ps: torch.optim.RMSprop(ps), "RMSprop"),
])
def test_unsupported_optimizers_and_options_are_named(build, option):
    with pytest.raises(ValueError, match=option):
        StepUndo(build(make_params(torch.float32)))


def test_an_option_switched_on_later_is_refused_at_record():
    params, optimizer = history("adamw", torch.float32, 0.1, 1)
    undo = StepUndo(optimizer)
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        undo.record()


def test_the_engines_optimizer_is_supported():
    """ftbench.engine.worker.make_optimizer builds what undo inverts."""
    from ftbench.engine.worker import make_optimizer as engine_optimizer

    check_supported(engine_optimizer(make_params(torch.float32), 1e-3, 0.1))


def test_loaded_adamw_state_lies_where_adamw_keeps_it():
    # a checkpoint is read onto the CPU; on a GPU machine the moments must follow the
    # parameters (the "meta" device stands in for a GPU here) and the step count stay on the CPU
    from ftbench.engine.worker import _placed

    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    moment, step = torch.ones(3), torch.tensor(4.0)
    assert _placed(moment, param).device.type == "meta"
    assert _placed(step, param).device.type == "cpu" and _placed(step, param) is not step
    here = _placed(moment, torch.nn.Parameter(torch.zeros(3)))
    assert torch.equal(here, moment) and here.data_ptr() != moment.data_ptr()  # a copy, as before
    assert _placed(7, param) == 7
