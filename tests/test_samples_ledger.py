"""The training-semantics ledger (issue 42 item 2): every run records, per iteration the final
model holds, the samples that counted; the summary gives the samples dropped beside throughput
and ETTR. Every strategy but torchft keeps the global batch (tests/test_torchft.py: what it
drops, and fault-free training replayed under its ledger)."""
from __future__ import annotations

import pytest

from conftest import run
from ftbench.samples import SamplesLedger, replayed, sample_ranges
from ftbench.strategies import REGISTRY

SETUP = ("backend=sim", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=3", "train.iterations=8",
         "train.microbatches=2", "cluster.replacement_s=0.2", "cluster.spares=1", "report.gantt=false",
         "failures=scripted", "failures.events=[{iteration:3,node:1},{iteration:5,node:4}]")


def test_runs_merge_and_a_rollback_drops_what_is_redone():
    whole, some = ((0, 6),), ((0, 2), (4, 6))
    ledger = SamplesLedger()
    ledger.add(0, 3, whole)
    ledger.add(3, 2, whole)
    ledger.add(5, 1, some)
    assert ledger.entries() == [[0, 4, 6, [[0, 6]]], [5, 5, 4, [[0, 2], [4, 6]]]] and ledger.samples() == 34
    ledger.rollback(4)  # iterations 4 and 5 are redone
    assert ledger.entries() == [[0, 3, 6, [[0, 6]]]] and ledger.samples() == 24
    ledger.add(4, 2, whole)
    assert ledger.entries() == [[0, 5, 6, [[0, 6]]]]
    assert replayed(ledger.entries(), 6) is None  # nothing to replay: every iteration trained all
    ledger.add(6, 1, some)
    assert replayed(ledger.entries(), 6) == {6: some}


def test_a_plan_names_the_samples_it_trains():
    """Pipelines train consecutive micro-batches unless the plan keeps their own offsets (a
    replica group going on while another is out keeps its samples)."""
    from dataclasses import replace

    from conftest import compose
    from ftbench.context import RunContext

    ctx = RunContext.from_config(compose(*SETUP[:5]))
    grid = ctx.grid_plan(2, 3, 1)
    assert sample_ranges(grid, ctx.microbatch_size) == ((0, ctx.global_batch),)
    b = ctx.microbatch_size
    two = ctx.grid_plan(2, 2, 1)
    m = two.schedule.microbatches[0]
    assert two.schedule.microbatches == (m, m)
    two = replace(two, sample_offsets=(0, 2 * m))  # the first and the third of three pipelines of m each
    assert sample_ranges(two, b) == ((0, m * b), (2 * m * b, 3 * m * b))


@pytest.mark.parametrize("strategy", sorted(n for n, cls in REGISTRY.items() if n != "none" and cls.keeps_global_batch))
def test_every_strategy_that_keeps_the_global_batch_drops_nothing(tmp_path, strategy):
    """Two failures on sim (restarts, re-routes, reshapes, morphs, failovers): every kept
    iteration's plan trains the global batch, so nothing is dropped."""
    summary = run(tmp_path, *SETUP, f"strategy={strategy}", *REGISTRY[strategy].tests.conformance)
    assert summary["status"] == "ok", summary["error"]
    assert summary["samples_dropped"] == 0
    assert summary["samples"] == summary["iterations"] * summary["global_batch"]
    covered = [i for first, last, *_ in summary["ledger"] for i in range(first, last + 1)]
    assert covered == list(range(summary["iterations"]))
    assert {(each, str(ranges)) for _, _, each, ranges in summary["ledger"]} == {
        (summary["global_batch"], str([[0, summary["global_batch"]]]))}


def test_a_plan_that_trains_fewer_samples_shows_in_the_ledger(tmp_path, monkeypatch):
    """The ledger reads what each plan trains: an Elastic Horovod whose fewer pipelines kept
    their own micro-batches (not the global batch's) drops one pipeline's samples per
    iteration after the failure, and the summary and throughput say so."""
    from ftbench.context import RunContext

    monkeypatch.setattr(RunContext, "split_microbatches", lambda self, dp: (2,) * dp)
    summary = run(tmp_path, *SETUP[:-1], "failures.events=[{iteration:3,node:1}]", "strategy=elastic-horovod",
                  "report.check_fault_free=false")
    assert summary["status"] == "ok", summary["error"]
    first, *rest = summary["ledger"]
    assert first[2] == 6 and rest and all(each == 4 for _, _, each, _ in rest)  # dp 3 -> 2 after node 1
    dropped = sum((last - f + 1) * 2 for f, last, _, _ in rest)
    assert summary["samples_dropped"] == dropped > 0
    assert summary["throughput"] == pytest.approx(summary["samples"] / summary["time_s"])
