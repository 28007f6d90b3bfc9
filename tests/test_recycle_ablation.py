"""benchmarks/recycle_ablation.py on GPT-3 Medium, pp 4 x dp 2 and dp 4 (the table's grid), with
one and two failed workers: what docs/strategies/recycle.md says of its table."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "recycle_ablation.py"
_spec = importlib.util.spec_from_file_location("recycle_ablation", _PATH)
ablation = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("recycle_ablation", ablation)  # dataclasses look their module up there
_spec.loader.exec_module(ablation)

REL = 1e-12  # "at least", in float: the same op lengths summed in another order
FAILURE_SETS = [list(p) for p in ablation.FAILURE_SETS.values()]


@pytest.fixture(scope="module")
def cells():
    medium = next(s for s in ablation.table_setups() if s.model == "gpt3-medium")
    return {dp: ablation.measure(medium, dp, FAILURE_SETS) for dp in (2, 4)}


def test_the_setup_is_the_tables():
    setups = {s.model: s for s in ablation.table_setups()}
    assert set(setups) == {"gpt3-medium", "gpt3-3.35b", "gpt3-6.7b"}
    assert (setups["gpt3-medium"].pp, setups["gpt3-medium"].microbatches, setups["gpt3-medium"].table_dp) == (4, 8, 4)
    assert (setups["gpt3-6.7b"].pp, setups["gpt3-6.7b"].microbatches) == (8, 16)
    assert all(s.hardware == "recycle-testbed" for s in setups.values())


def test_fault_free_recycle_is_the_configured_1f1b(cells):
    for cell in cells.values():
        assert cell.reference.time is not None
        for level, o in cell.fault_free.items():
            assert o.time == pytest.approx(cell.reference.time, rel=REL), level
        assert not ablation.parity_notes([cell])


def test_levels_order_and_no_failure_is_faster_than_fault_free(cells):
    for dp, cell in cells.items():
        ref = cell.reference.time
        for positions in FAILURE_SETS:
            reroute, decoupled, staggered = (cell.failed(level, positions).time for level in ablation.LEVELS)
            bound = cell.bounds[tuple(positions)]
            assert None not in (reroute, decoupled, staggered), (dp, positions)
            assert reroute >= decoupled * (1 - REL) and decoupled >= staggered * (1 - REL), (dp, positions)
            assert staggered >= bound * (1 - REL) and bound >= ref, (dp, positions)
            # re-routing beats dropping the failed pipelines on the same 1F1B, where any pipeline is left
            drop = cell.drop[len({d for d, _ in positions})]
            assert drop.time is None or reroute < drop.time, (dp, positions)
        assert "oom" not in ablation.summary_table([cell], FAILURE_SETS)
        assert "no plan" not in ablation.summary_table([cell], FAILURE_SETS)


def test_a_doubled_peer_is_compute_bound_at_dp_2(cells):
    """dp 2: re-routing on 1F1B loses about a third, and the staggered plan is the work bound:
    the peer with twice the work computes the whole period."""
    cell, one = cells[2], FAILURE_SETS[0]
    ref = cell.reference.time
    assert -36 < ablation.change_value(ref, cell.failed("reroute", one).time) < -30
    staggered = cell.failed("staggered", one)
    assert staggered.time == pytest.approx(cell.bounds[tuple(one)], rel=1e-9)
    assert ablation.change_value(ref, cell.failed("decoupled", one).time) < -20  # far from the talk's 8 %
    limit = ablation.staggering_limit(staggered.result, 4)
    assert limit.position == (1, 1) and limit.bound_by == "own compute"
    assert limit.span == pytest.approx(staggered.time, rel=1e-6)


def test_at_the_tables_grid_the_staggered_plan_fits_in_the_bubbles(cells):
    """dp 4, one failure: decoupled loses under 10 %, and the staggered plan runs at the
    fault-free period (release-bound); with two failures stage 0's all-reduce binds."""
    cell, one, two = cells[4], FAILURE_SETS[0], FAILURE_SETS[1]
    ref = cell.reference.time
    assert -20 < ablation.change_value(ref, cell.failed("reroute", one).time) < -10
    assert -10 < ablation.change_value(ref, cell.failed("decoupled", one).time) < 0
    staggered = cell.failed("staggered", one)
    assert staggered.time == pytest.approx(ref, rel=1e-9)
    assert ablation.staggering_limit(staggered.result, 4).bound_by == "release times"
    limit = ablation.staggering_limit(cell.failed("staggered", two).result, 4)
    assert limit.position[1] == 0 and limit.bound_by == "all-reduce"
    assert limit.span == pytest.approx(cell.failed("staggered", two).time, rel=1e-6)
    text = ablation.talk_lines(list(cells.values()))
    assert "dp 2 (peer's extra work +100 %)" in text and "dp 4 (peer's extra work +33 %)" in text
