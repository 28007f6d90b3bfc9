"""gantt.png on local and dist draws what ran (issue 39 item 6): every compute op's measured
start and end in the first complete iteration of each plan, beside the cost model's picture
of the same plan (ftbench/engine/op_times.py)."""
import json

from conftest import LOCAL, run
from ftbench.engine.op_times import OpTimer, merged
from ftbench.schedule import Op


class _Plan:
    def __init__(self, name, shape):
        self.name, self.shape = name, shape


def test_the_first_complete_iteration_of_each_plan_is_timed_and_a_cut_one_is_not():
    timer, a, b = OpTimer(plans=2), _Plan("1f1b", "pp=2 dp=1"), _Plan("recycle", "pp=2 dp=1")
    assert timer.begin(a, 0) is timer
    timer.record(0, Op("F", 0, 0, 0), 1.0, 2.0)  # then a failure cuts it: no end()
    assert timer.begin(a, 0) is timer
    timer.record(0, Op("F", 0, 0, 0), 3.0, 4.0)
    timer.end()
    assert timer.begin(a, 1) is None  # a plan is timed once
    assert timer.begin(b, 2) is timer
    timer.end()
    assert timer.begin(_Plan("third", "pp=1 dp=1"), 3) is None  # at most `plans` of them
    assert [(e["plan"], e["iteration"], len(e["ops"])) for e in timer.timed] == [("1f1b", 0, 1), ("recycle", 2, 0)]
    assert timer.timed[0]["ops"][0] == {"worker": 0, "kind": "F", "stage": 0, "pipeline": 0, "microbatch": 0,
                                        "start": 3.0, "end": 4.0}


def test_the_leader_merges_every_ranks_ops_once(tmp_path):
    plan = _Plan("1f1b", "pp=2 dp=1")
    ranks = [OpTimer(), OpTimer()]
    for rank, timer in enumerate(ranks):
        timer.begin(plan, 0)
        timer.record(rank, Op("F", rank, 0, 0), rank + 0.0, rank + 0.5)
        timer.end()
        timer.write(tmp_path, rank)
    (tmp_path / "op-times" / "rank-7.json").write_text("{not json")  # a damaged file is left out
    (entry,) = merged(ranks[0].timed, tmp_path)
    assert [(op["worker"], op["start"]) for op in entry["ops"]] == [(0, 0.0), (1, 1.0)]
    assert json.loads((tmp_path / "op-times" / "rank-1.json").read_text())[0]["plan"] == "1f1b"


def test_a_local_run_draws_its_measured_iteration_beside_the_model(tmp_path, monkeypatch):
    import ftbench.gantt as gantt

    drawn = {}

    def capture(panels, path, title="", shared_axis=True):
        drawn.update(panels=panels, shared_axis=shared_axis)
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(gantt, "plot_gantt_panels", capture)
    summary = run(tmp_path, *LOCAL, "cluster.pp=2", "cluster.dp=1", "train.iterations=3", "strategy=none",
                  "failures=none", "report.gantt=true")
    assert summary["status"] == "ok" and (tmp_path / "gantt.png").exists()
    (measured, ops), (model, _) = drawn["panels"]
    assert measured.startswith("measured: 1f1b, pp=2 dp=1, iteration 0") and model.startswith("cost model:")
    assert drawn["shared_axis"] is False
    # every compute op of the iteration: 4 micro-batches x 2 stages x (F, BW), and 2 optimizer steps
    assert sorted(op["kind"] for op in ops) == ["BW"] * 8 + ["F"] * 8 + ["OPT"] * 2
    assert all(0.0 <= op["start"] < op["end"] for op in ops) and min(op["start"] for op in ops) == 0.0
