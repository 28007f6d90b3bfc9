"""Swift's selective logging: the greedy merge of logging groups (ftbench.planning.swift)."""
import pytest

from ftbench.planning.swift import SelectiveLogging


def test_every_boundary_logged_at_first_none_at_last():
    s = SelectiveLogging([1.0, 2.0, 3.0], [10.0, 20.0], microbatches=4, interval=10)
    curve = s.curve()
    assert curve[0].groups == ((0, 0), (1, 1), (2, 2)) and curve[0].logged_boundaries == (0, 1)
    assert curve[0].log_bytes == 2 * 4 * (10 + 20) * 10  # both directions, every micro-batch, the interval
    # a machine alone replays its own stages: 4 micro-batches of t, over half the interval
    assert curve[0].recovery_s == pytest.approx(sum(4 * t * 5 for t in (1, 2, 3)) / 3)
    assert curve[-1].groups == ((0, 2),) and curve[-1].log_bytes == 0
    # whole pipeline replays 1F1B-style: fill (1+2+3) then 3 more micro-batches of the slowest
    assert curve[-1].recovery_s == pytest.approx((6 + 3 * 3) * 5)


def test_each_merge_saves_log_and_costs_recovery():
    s = SelectiveLogging([1.0, 3.0, 1.0, 2.0, 1.0, 1.0], [5.0, 1.0, 8.0, 2.0, 3.0], microbatches=8, interval=100)
    curve = s.curve()
    assert len(curve) == 6
    assert all(a.log_bytes > b.log_bytes and a.recovery_s < b.recovery_s for a, b in zip(curve, curve[1:]))


def test_the_cheapest_merge_per_byte_goes_first():
    # equal machines: the boundary with the most bytes saves most for the same added recovery
    assert SelectiveLogging([1.0] * 4, [1.0, 100.0, 1.0], 4, 10).curve()[1].groups == ((0, 0), (1, 2), (3, 3))
    # equal boundaries: merging beside the slow machine (2) makes both machines replay it
    assert SelectiveLogging([1.0, 1.0, 10.0, 1.0], [1.0] * 3, 4, 10).curve()[1].groups == ((0, 1), (2, 2), (3, 3))


def test_a_budget_picks_the_first_plan_that_fits_and_too_small_a_budget_is_refused():
    s = SelectiveLogging([1.0] * 4, [1.0, 2.0, 3.0], microbatches=2, interval=10)
    curve = s.curve()
    budget = (curve[1].log_bytes + curve[2].log_bytes) / 2
    plan = s.within(budget)
    assert plan == curve[2] and curve[1].log_bytes > budget
    assert s.within(curve[0].log_bytes) == curve[0]
    with pytest.raises(ValueError, match="below one iteration"):
        s.within(2 * 2 * 1.0 - 1)  # one iteration of the smallest boundary is 2 directions x 2 micro-batches


def test_parallel_recovery_divides_the_replay():
    one = SelectiveLogging([1.0, 2.0], [1.0], 4, 10).plan_of([(0, 1)])
    four = SelectiveLogging([1.0, 2.0], [1.0], 4, 10, parallel=4).plan_of([(0, 1)])
    assert four.recovery_s == pytest.approx(one.recovery_s / 4)


def test_the_benchmark_prints_a_curve_per_model_and_plots_them(tmp_path, capsys):
    """benchmarks/swift_logging.py as the README runs it (one model here, to stay quick)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import swift_logging
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert swift_logging.main(["--models", "gpt3-medium", "--pp", "4", "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "gpt3-medium" in out and out.count("\n| ") == 5  # header + a row per plan: 4, 3, 2, 1 groups
    assert (tmp_path / "c.png").stat().st_size > 0
