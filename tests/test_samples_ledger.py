"""The training-semantics ledger (issue 42 item 2, its first part): every run records, per
iteration the final model holds, the samples that counted; the summary gives the samples
dropped beside throughput and ETTR. Every strategy here keeps the global batch."""
from __future__ import annotations

import pytest

from conftest import run
from ftbench.loop import SamplesLedger
from ftbench.strategies import REGISTRY

SETUP = ("backend=sim", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=3", "train.iterations=8",
         "train.microbatches=2", "cluster.replacement_s=0.2", "cluster.spares=1", "report.gantt=false",
         "failures=scripted", "failures.events=[{iteration:3,node:1},{iteration:5,node:4}]")


def test_runs_merge_and_a_rollback_drops_what_is_redone():
    ledger = SamplesLedger()
    ledger.add(0, 3, 6)
    ledger.add(3, 2, 6)
    ledger.add(5, 1, 4)
    assert ledger.entries() == [[0, 4, 6], [5, 5, 4]] and ledger.samples() == 34
    ledger.rollback(4)  # iterations 4 and 5 are redone
    assert ledger.entries() == [[0, 3, 6]] and ledger.samples() == 24
    ledger.add(4, 2, 6)
    assert ledger.entries() == [[0, 5, 6]]


@pytest.mark.parametrize("strategy", sorted(set(REGISTRY) - {"none"}))
def test_every_strategy_keeps_the_global_batch_through_failures(tmp_path, strategy):
    """Two failures on sim (restarts, re-routes, reshapes, morphs, failovers): every kept
    iteration's plan trains the global batch, so nothing is dropped."""
    summary = run(tmp_path, *SETUP, f"strategy={strategy}", *REGISTRY[strategy].tests.conformance)
    assert summary["status"] == "ok", summary["error"]
    assert summary["samples_dropped"] == 0
    assert summary["samples"] == summary["iterations"] * summary["global_batch"]
    covered = [i for first, last, each in summary["ledger"] for i in range(first, last + 1)]
    assert covered == list(range(summary["iterations"]))
    assert {each for _, _, each in summary["ledger"]} == {summary["global_batch"]}


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
    assert first[2] == 6 and rest and all(each == 4 for _, _, each in rest)  # dp 3 -> 2 after node 1
    dropped = sum((last - f + 1) * 2 for f, last, _ in rest)
    assert summary["samples_dropped"] == dropped > 0
    assert summary["throughput"] == pytest.approx(summary["samples"] / summary["time_s"])
