"""benchmarks/recycle_ablation.py on its smallest setup: GPT-3 Medium, pp 4 x dp 2, one failure."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "recycle_ablation.py"
_spec = importlib.util.spec_from_file_location("recycle_ablation", _PATH)
ablation = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("recycle_ablation", ablation)  # dataclasses look their module up there
_spec.loader.exec_module(ablation)


def test_levels_order_and_the_staggering_limit_is_a_critical_span():
    failed = [(0, 1)]
    cell = ablation.measure(ablation.SETUPS[0], 2, [failed])
    reroute, decoupled, staggered = (cell.levels[level].failed[tuple(failed)].time
                                     for level in ("reroute", "decoupled", "staggered"))
    assert reroute >= decoupled >= staggered
    # Both references exist and every row prints: no oom in this small setup.
    assert cell.reference.time is not None and all(r.planned.time is not None for r in cell.levels.values())
    assert "oom" not in ablation.summary_table([cell], [failed])
    # The staggered period is the span of its critical worker (steady state).
    limit = ablation.staggering_limit(cell.levels["staggered"].failed[tuple(failed)].result, 4)
    assert limit.span == pytest.approx(staggered, rel=1e-6)
