"""Activation recomputation (`train.recompute=full`): the cost model charges one more forward
to every backward and keeps only each stage's input between F and the backward; the simulator
holds a backward's rebuilt activations while it runs; the local backend really recomputes and
trains exactly what `recompute=none` trains."""
import pytest
import torch

from conftest import LOCAL, compose, run
from ftbench.context import RunContext
from ftbench.costs import PlanCosts
from ftbench.equivalence import compare, load_state
from ftbench.schedule import B, BW, F, W, Op, one_f_one_b, zb_h1
from ftbench.sim.simulator import simulate
from ftbench.sim.unit_costs import UnitCosts

SIM_6_7B = ("backend=sim", "model=gpt3-6.7b", "hardware=a100-80gb", "cluster.pp=8", "cluster.dp=1",
            "train.microbatches=8", "strategy=none", "failures=none", "train.iterations=2", "report.gantt=false")


def _ctx(*overrides) -> RunContext:
    return RunContext.from_config(compose(*SIM_6_7B, *overrides))


# -- cost model ---------------------------------------------------------------------------

@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True)])
def test_full_recompute_adds_one_forward_to_the_backward_and_stashes_only_the_input(first, last):
    none, full = _ctx(), _ctx("train.recompute=full")
    spec, b, s = none.spec, none.microbatch_size, none.seq_len
    a, c = none.cost_model.stage((4, 8), first, last), full.cost_model.stage((4, 8), first, last)
    assert c.forward_s == a.forward_s and c.backward_weight_s == a.backward_weight_s
    assert c.backward_input_s == pytest.approx(a.backward_input_s + a.forward_s, rel=1e-12)
    assert c.params == a.params and c.weight_stash_bytes == a.weight_stash_bytes
    assert c.activation_bytes == spec.boundary_bytes(b, s) < a.activation_bytes
    assert c.recompute_bytes == a.activation_bytes and a.recompute_bytes == 0.0
    assert none.cost_model.key() != full.cost_model.key()  # cached plans and simulations never mix modes


def test_plan_costs_of_full_recompute():
    none, full = _ctx(), _ctx("train.recompute=full")
    plan_none, plan_full = none.grid_plan(8, 1), full.grid_plan(8, 1)
    pn, pf = PlanCosts(none.cost_model, plan_none), PlanCosts(full.cost_model, plan_full)
    assert pn.key() != pf.key()
    for stage in (0, 7):
        op = lambda kind: Op(kind, stage, 0, 0)  # noqa: E731
        f = pn.op_time(op(F))
        assert pf.op_time(op(F)) == pytest.approx(f)
        assert pf.op_time(op(B)) == pytest.approx(pn.op_time(op(B)) + f)
        assert pf.op_time(op(BW)) == pytest.approx(pn.op_time(op(BW)) + f)
        assert pf.op_time(op(W)) == pytest.approx(pn.op_time(op(W)))
        assert pn.stash_bytes(op(B)) > 0
        assert pf.recompute_bytes(op(B)) == pytest.approx(pn.stash_bytes(op(B)))
        assert pn.recompute_bytes(op(B)) == 0.0


# -- simulator ----------------------------------------------------------------------------

class _Recomputing(UnitCosts):
    def recompute_bytes(self, op: Op) -> float:
        return 10.0


@pytest.mark.parametrize("schedule", [one_f_one_b, zb_h1])
def test_a_backward_holds_its_rebuilt_activations_on_top_of_the_stash(schedule):
    p, m = 4, 8
    plain = simulate(schedule(p, m), UnitCosts(stash=1.0, weight_stash=0.0))
    recomputing = simulate(schedule(p, m), _Recomputing(stash=1.0, weight_stash=0.0))
    # stage 0 stashes p inputs before its first backward, which then rebuilds 10 more
    assert max(plain.peak_activation_bytes.values()) == pytest.approx(p)
    assert max(recomputing.peak_activation_bytes.values()) == pytest.approx(p + 10.0)
    assert recomputing.peak_memory_bytes[0] == pytest.approx(p + 10.0)


def test_gpt3_6_7b_pp8_needs_less_memory_and_more_time_with_full_recompute(tmp_path):
    none = run(tmp_path / "none", *SIM_6_7B)
    full = run(tmp_path / "full", *SIM_6_7B, "train.recompute=full")
    assert none["status"] == full["status"] == "ok"
    peak = lambda s: max(s["peak_memory_bytes"])  # noqa: E731
    assert peak(full) < 0.5 * peak(none)  # about 20 GB instead of 47 GB
    assert full["iteration_time_s"] > 1.2 * none["iteration_time_s"]  # every backward runs F again


# -- local backend ------------------------------------------------------------------------

SMALL = ("cluster.pp=2", "cluster.dp=2", "train.iterations=4", "train.microbatches=4")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """schedule -> summary of fault-free training without recomputation (the reference)."""
    root = tmp_path_factory.mktemp("reference")
    return {sched: run(root / sched, *LOCAL, *SMALL, f"schedule={sched}", "strategy=none", "failures=none")
            for sched in ("1f1b", "zb-h1")}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])  # zb-h1: decoupled B and W
def test_local_full_recompute_trains_bit_identically(tmp_path, fault_free, schedule):
    ref = fault_free[schedule]
    s = run(tmp_path, *LOCAL, *SMALL, f"schedule={schedule}", "strategy=none", "failures=none",
            "train.recompute=full")
    assert ref["status"] == s["status"] == "ok", s["error"]
    assert s["losses"] == ref["losses"]
    mine, theirs = load_state(s["final_state"]), load_state(ref["final_state"])
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # worker 0 (stage 0) stashes two micro-batches' inputs instead of their activations
    assert s["peak_memory_bytes"][0] < ref["peak_memory_bytes"][0]


def test_local_full_recompute_under_a_failure_matches_fault_free(tmp_path, fault_free):
    s = run(tmp_path, *LOCAL, *SMALL, "schedule=1f1b", "train.recompute=full", "strategy=checkpoint",
            "strategy.every=2", "failures=scripted", "failures.events=[{iteration:3,node:1}]")
    assert s["status"] == "ok", s["error"]
    assert s["failures"] == len(s["recoveries"]) == 1
    ref = fault_free["1f1b"]
    assert compare(s["losses"], load_state(s["final_state"]), ref["losses"], load_state(ref["final_state"])) is None


# -- bad input ----------------------------------------------------------------------------

def test_an_unknown_recompute_mode_names_the_setting(tmp_path):
    s = run(tmp_path, *SIM_6_7B, "train.recompute=partial")
    assert s["status"] == "error"
    assert s["error"].startswith("Invalid setting `train.recompute`:"), s["error"]
    assert "partial" in s["error"] and "none, full" in s["error"]
