"""Bad input and harness faults: each ends with one clear message naming the
setting to fix, or, for faults the harness can work around (an unwritable or wrong plan cache,
a checkpoint of another model shape, a full disk), a warning and a run that goes on."""
import errno
import json
import warnings

import pytest
import torch

import ftbench.checkpoint as ckpt
from ftbench.checkpoint import CheckpointStore, CheckpointWarning
from ftbench.failures import FailureEvent, FailureScript, check_reachable
from ftbench.planning.library import PlanCacheWarning, PlanLibrary, check_orders
from ftbench.planning.problem import PlanningProblem, StageTimes

from conftest import LOCAL, run

SIM = ("backend=sim", "model=gpt3-medium", "strategy=none", "failures=none", "train.iterations=5",
       "report.gantt=false")


def assert_config_error(summary: dict, setting: str, *words: str) -> None:
    assert summary["status"] == "error", summary
    assert summary["error"].startswith(f"Invalid setting `{setting}`:"), summary["error"]
    for word in words:
        assert word in summary["error"], summary["error"]


# -- settings that used to end in a traceback --------------------------------------------

@pytest.mark.parametrize("override,setting", [("train.lr=-1", "train.lr"),
                                              ("train.lr=inf", "train.lr"),
                                              ("train.weight_decay=-0.1", "train.weight_decay")])
def test_negative_optimizer_settings(tmp_path, override, setting):
    assert_config_error(run(tmp_path, *SIM, override), setting, ">= 0")


@pytest.mark.parametrize("strategy", ["checkpoint", "checkfreq", "varuna", "recycle"])
def test_keep_zero(tmp_path, strategy):
    fallback = ("strategy.fallback=checkpoint",) if strategy == "recycle" else ()  # recycle's checkpoints
    s = run(tmp_path, *SIM, f"strategy={strategy}", "strategy.keep=0", "strategy.every=4", *fallback)
    assert_config_error(s, "strategy.keep", "at least 1")


def test_huge_iteration_count_on_local_is_refused(tmp_path):
    s = run(tmp_path, *LOCAL, "strategy=none", "failures=none", "train.iterations=1000000000000")
    assert_config_error(s, "train.iterations", "backend=sim", "small iteration counts")


def test_huge_iteration_count_on_sim_is_fine(tmp_path):
    s = run(tmp_path, *SIM, "train.iterations=1000000000000", "train.max_hours=1")
    assert s["status"] == "ok" and 0 < s["iterations"] < 10**12


def test_trace_that_is_not_utf8(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"0,add,node0\n1000,remove,n\xe9ode0\n")
    s = run(tmp_path / "run", *SIM, "failures=trace", f"failures.path={trace}")
    assert_config_error(s, "failures.path", "not UTF-8", "line 2")


# -- the setting at fault is named ---------------------------------------------------------

def test_one_token_samples(tmp_path):
    assert_config_error(run(tmp_path, *SIM, "train.seq_len=1"), "train.seq_len", "at least 2 tokens")


def test_one_token_model_context(tmp_path):
    assert_config_error(run(tmp_path, *SIM, "model.seq_len=1"), "model.seq_len", "at least 2 tokens")


def test_one_token_vocabulary(tmp_path):
    assert_config_error(run(tmp_path, *SIM, "model.vocab=1"), "model.vocab", "model.vocab >= 2")


def test_text_data_needs_a_byte_vocabulary(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    s = run(tmp_path / "run", *LOCAL, "strategy=none", "failures=none", "model.vocab=100", "train.data=text",
            f"train.data_path={text}")
    assert_config_error(s, "model.vocab", "256")


def test_text_data_needs_a_path(tmp_path):
    s = run(tmp_path, *LOCAL, "strategy=none", "failures=none", "train.data=text")
    assert_config_error(s, "train.data_path", "text file")


# -- events that can never fire ----------------------------------------------------------

def test_event_after_the_last_iteration(tmp_path):
    s = run(tmp_path, *SIM, "failures=scripted", "failures.events=[{iteration:50,node:1}]", "train.iterations=3")
    assert_config_error(s, "failures.events[0]", "iteration 50", "0..2")


def test_event_at_the_iteration_count_never_fires(tmp_path):
    s = run(tmp_path, *SIM, "failures=scripted", "failures.events=[{iteration:3,node:1,kind:join}]",
            "train.iterations=3")
    assert_config_error(s, "failures.events[0]", "iteration 3")


def test_event_after_max_hours(tmp_path):
    s = run(tmp_path, *SIM, "failures=scripted", "failures.events=[{time_s:99999,node:1}]", "train.max_hours=1",
            "train.iterations=1000000")
    assert_config_error(s, "failures.events[0]", "time_s 99999", "train.max_hours=1")


@pytest.mark.parametrize("events,words", [
    ("[{iteration:1,node:2},{time_s:3600,node:1}]", ["failures.events[1]`", "time_s 3600"]),  # the loop stops there
    ("[{time_s:10,node:1},{iteration:9,node:2},{time_s:7200,node:3}]", ["failures.events[1]`", "iteration 9"]),
    ("[{time_s:10,node:1},{time_s:7200,node:3,kind:join}]", ["failures.events[1]`", "join of node 3"]),
])
def test_events_past_the_end_are_named_by_index(tmp_path, events, words):
    """Timed and iteration events alike: refused where the run's end is known before it runs
    (train.iterations, train.max_hours); the event is named by its index."""
    s = run(tmp_path, *SIM, "failures=scripted", f"failures.events={events}", "train.max_hours=1",
            "train.iterations=5")
    assert_config_error(s, words[0].rstrip("`"), *words)


def test_reachable_events_pass():
    script = FailureScript([FailureEvent(1, iteration=2)], iter(()),
                           scripted_by_time=(FailureEvent(1, time_s=3599.0),))
    assert check_reachable(script, 3, 1.0) is script
    assert check_reachable(script, 3, None) is script  # no time limit: when the run ends is not known


def test_failure_of_a_node_that_does_not_exist(tmp_path):
    s = run(tmp_path, *SIM, "failures=scripted", "failures.events=[{iteration:1,node:99}]")
    assert_config_error(s, "failures.events[0]", "node 99", "0..7")


def test_failure_of_a_node_a_join_brings_in(tmp_path):
    s = run(tmp_path, *SIM, "failures=scripted", "failures.events=[{iteration:1,node:8,kind:join},{iteration:3,node:8}]")
    assert s["status"] == "ok", s["error"]


# -- unknown keys added with `+` ---------------------------------------------------------

@pytest.mark.parametrize("override,setting,suggestion", [
    ("+train.iters=5", "train.iters", "train.iterations"),
    ("+strategy.kep=3", "strategy.kep", "strategy.keep"),
    ("+iterations=5", "iterations", "train.iterations"),
])
def test_unknown_key_added_with_plus(tmp_path, override, setting, suggestion):
    s = run(tmp_path, *SIM, "strategy=checkpoint", override)
    assert_config_error(s, setting, f"did you mean {suggestion}", "no such setting")


def test_unknown_key_of_a_group_is_a_config_error_with_suggestions(tmp_path, monkeypatch, capsys):
    """A key no schema has, given without `+` (Hydra refuses it): the suggestions come from
    every schema, the strategies' included (a crash once, when a strategy's schema moved)."""
    error = cli_error(tmp_path, monkeypatch, capsys, *SIM, "failures=scripted", "failures.event=[]")
    assert "failures.event" in error and "did you mean failures.events" in error, error


# -- the ReCycle plan cache --------------------------------------------------------------

RECYCLE = (*SIM, "strategy=recycle", "cluster.dp=3", "failures=scripted", "failures.events=[{iteration:2,node:1}]")


def test_unwritable_plan_cache_warns_once_and_goes_on(tmp_path):
    blocker = tmp_path / "run" / "not-a-folder"  # inside the run folder, where the cache must be
    blocker.parent.mkdir()
    blocker.write_text("a file where the cache folder's parent should be")
    with pytest.warns(PlanCacheWarning) as caught:
        s = run(tmp_path / "run", *RECYCLE, "strategy.plan_cache=not-a-folder/cache")
    assert s["status"] == "ok", s["error"]
    assert len([w for w in caught if issubclass(w.category, PlanCacheWarning)]) == 1
    assert "memory only" in str(caught[0].message)


def small_problem() -> PlanningProblem:
    return PlanningProblem(pp=2, dp=2, microbatches=2, stages=(StageTimes(1.0, 1.0, 1.0, 0.5, 0.5),) * 2)


def wrong_orders(kind: str, orders: list) -> list:
    """A cached `orders` list ([d, s, ops] rows) spoiled one way."""
    rows = json.loads(json.dumps(orders))
    if kind == "position":
        rows.append([7, 9, rows[0][2]])  # a worker that does not exist
    elif kind == "op kind":
        rows[0][2][0][0] = "X"
    elif kind == "missing op":
        rows[0][2].pop()
    elif kind == "deadlock":
        rows[0][2].reverse()  # backward before forward on one worker
    elif kind == "malformed":
        rows[0][2][0][1] = [0]
    return rows


@pytest.mark.parametrize("kind", ["position", "op kind", "missing op", "deadlock", "malformed"])
def test_wrong_cached_plan_is_replanned_and_overwritten(tmp_path, kind):
    problem = small_problem()
    first = PlanLibrary(problem, cache_dir=tmp_path)
    form = ((), ())
    good = first.get(form)
    [path] = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    data["orders"] = wrong_orders(kind, data["orders"])
    path.write_text(json.dumps(data))

    with pytest.warns(PlanCacheWarning, match="does not fit"):
        again = PlanLibrary(problem, cache_dir=tmp_path).get(form)
    assert not again.cached and again.orders == good.orders
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reread = PlanLibrary(problem, cache_dir=tmp_path).get(form)  # the file was overwritten
    assert reread.cached and reread.orders == good.orders


def test_check_orders_accepts_a_planned_problem():
    problem = small_problem()
    orders = PlanLibrary(problem).get(((), ())).orders
    assert check_orders(problem, orders) is None
    assert "no order" in check_orders(problem, {k: v for k, v in list(orders.items())[1:]})


# -- checkpoints -------------------------------------------------------------------------

def shard(hidden: int, layer: int = 0) -> dict:
    w = torch.randn(hidden, hidden)
    return {"model": {f"h.{layer}.w": w, f"h.{layer}.b": torch.randn(hidden)},
            "optim": {f"h.{layer}.w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(w)}}}


def shapes(hidden: int) -> dict:
    return {f"h.{i}.w": (hidden, hidden) for i in range(2)} | {f"h.{i}.b": (hidden,) for i in range(2)}


def test_checkpoint_of_another_shape_falls_back_to_an_older_one(tmp_path):
    skipped = []
    store = CheckpointStore(tmp_path, keep=3, on_skip=lambda reason, it: skipped.append((it, reason)))
    store.save(4, {"stage0": shard(8, 0), "stage1": shard(8, 1)})
    store.save(8, {"stage0": shard(16, 0), "stage1": shard(16, 1)})  # same names, another model's shapes
    iteration, loaded = store.load(expected=shapes(8))
    assert iteration == 4 and loaded["stage0"]["model"]["h.0.w"].shape == (8, 8)
    assert [it for it, _ in skipped] == [8] and "shape [16, 16]" in skipped[0][1]
    assert store.load()[0] == 8  # without `expected`, hashes alone decide (as before)


@pytest.mark.parametrize("spoil,words", [
    (lambda s: s["stage1"]["model"].pop("h.1.b"), "no shard holds parameter 'h.1.b'"),
    (lambda s: s["stage1"]["model"].update({"h.9.w": torch.zeros(8, 8)}), "'h.9.w' is not in the model"),
    (lambda s: s["stage0"]["optim"]["h.0.w"].update({"exp_avg": torch.zeros(3)}), "optimizer state 'exp_avg'"),
])
def test_checkpoint_that_does_not_fit_is_skipped_with_a_warning(tmp_path, spoil, words):
    store = CheckpointStore(tmp_path)
    shards = {"stage0": shard(8, 0), "stage1": shard(8, 1)}
    spoil(shards)
    store.save(4, shards)
    with pytest.warns(CheckpointWarning, match=words.replace("[", r"\[").replace("]", r"\]")):
        assert store.load(expected=shapes(8)) is None


def disk_full_at(monkeypatch, folder: str, file: str = "manifest.json", code: int = errno.ENOSPC):
    real = ckpt._write_file

    def write(path, data, *durable):
        if folder in str(path) and path.name == file:
            raise OSError(code, "No space left on device" if code == errno.ENOSPC else "I/O error")
        real(path, data, *durable)

    monkeypatch.setattr(ckpt, "_write_file", write)


def test_full_disk_skips_the_checkpoint_and_removes_its_folder(tmp_path, monkeypatch):
    skipped = []
    store = CheckpointStore(tmp_path, on_skip=lambda reason, it: skipped.append((it, reason)))
    store.save(4, {"stage0": shard(8)})
    disk_full_at(monkeypatch, "iter_00000008")
    info = store.save(8, {"stage0": shard(8)})  # the shard lands, the manifest does not
    assert info.skipped and "No space left" in info.skipped
    assert not (tmp_path / "iter_00000008").exists()  # no folder without a manifest is left
    assert [it for it, _ in skipped] == [8]
    assert store.load()[0] == 4  # the older checkpoint is kept

    pending = store.save_async(8, {"stage0": shard(8)})
    assert pending.result().skipped and not (tmp_path / "iter_00000008").exists()


def test_full_disk_warns_by_default(tmp_path, monkeypatch):
    disk_full_at(monkeypatch, "iter_00000001", file="stage0.pt")
    with pytest.warns(CheckpointWarning, match="could not be written"):
        CheckpointStore(tmp_path).save(1, {"stage0": shard(8)})
    assert list(tmp_path.iterdir()) == []


def test_other_write_errors_raise_and_leave_no_partial_folder(tmp_path, monkeypatch):
    disk_full_at(monkeypatch, "iter_00000001", code=errno.EIO)
    with pytest.raises(OSError, match="checkpoint iteration 1 could not be written") as err:
        CheckpointStore(tmp_path).save(1, {"stage0": shard(8)})
    assert err.value.errno == errno.EIO
    assert list(tmp_path.iterdir()) == []


def test_local_run_goes_on_when_the_disk_is_full(tmp_path, monkeypatch):
    # The checkpoint before the failure (iteration 4) cannot be written: the restart falls back
    # to the initial weights and the run still trains the fault-free model.
    disk_full_at(monkeypatch, "iter_00000004")
    with pytest.warns(CheckpointWarning, match="could not be written"):
        s = run(tmp_path, *LOCAL, "strategy=checkpoint", "strategy.every=4", "cluster.spares=1",
                "report.check_fault_free=true")
    assert s["status"] == "ok", s["error"]
    assert s["matches_fault_free"] is True
    assert s["recoveries"][0]["restored_iteration"] == 0
    from ftbench.metrics import read_metrics

    skipped = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "checkpoint_skipped"]
    assert {r["iteration"] for r in skipped} == {4} and "could not be written" in skipped[0]["reason"]


def test_two_config_errors_in_the_same_second_keep_both_folders(tmp_path, monkeypatch, capsys):
    import json
    import time

    from ftbench.config_errors import explain_composition_error

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "2026-01-01" if "%Y" in fmt else "12-00-00")
    for bad in ("cluster.pp=two", "cluster.dp=three"):
        explain_composition_error(ValueError(f"bad value in {bad}"), [bad], tmp_path)
    folders = sorted((tmp_path / "runs" / "2026-01-01").iterdir())
    assert [f.name for f in folders] == ["12-00-00-config-error", "12-00-00-config-error-2"]
    overrides = [json.loads((f / "summary.json").read_text())["overrides"] for f in folders]
    assert overrides == [["cluster.pp=two"], ["cluster.dp=three"]]
    assert "12-00-00-config-error-2" in capsys.readouterr().err


def _having(field: str) -> list[str]:
    """The registered strategies whose settings include `field`, by name (the error lists them)."""
    from dataclasses import fields

    from ftbench.strategies import REGISTRY

    return sorted(name for name, cls in REGISTRY.items() if field in {f.name for f in fields(cls.config)})


@pytest.mark.parametrize("override,words", [
    ("strategy=checkpoint,varuna", ["add --multirun", "`ftbench --multirun strategy=checkpoint,varuna`"]),
    ("cluster.pp=two", ["cluster.pp takes an integer", "not 'two'"]),
    ("train.lr=fast", ["train.lr takes a number", "not 'fast'"]),
    ("report.gantt=maybe", ["report.gantt takes true or false"]),
    ("strategy.level=reroute", ["strategy.level is a setting of strategy=recycle only"]),
    ("strategy.every=3", [f"the strategies {', '.join(_having('every'))} only"]),
])
def test_hydras_rejections_name_the_fix(tmp_path, monkeypatch, capsys, override, words):
    """A comma list without --multirun keeps Hydra's hint; a value of the wrong type says the type."""
    from conftest import ROOT
    from ftbench.cli import compose
    from ftbench.config_errors import explain_composition_error

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as caught:
        compose(["backend=sim", "strategy=oobleck", override])
    assert explain_composition_error(caught.value, [override], ROOT / "conf") == 2
    (folder,) = (tmp_path / "runs").glob("*/*-config-error")
    error = json.loads((folder / "summary.json").read_text())["error"]
    assert error.startswith(f"Invalid setting `{override.split('=')[0]}`")
    for word in words:
        assert word in error, error


def test_braces_the_shell_expanded_get_a_hint_to_quote(tmp_path, monkeypatch):
    """Unquoted, `failures.events=[{iteration:3,node:5}]` reaches us as two arguments."""
    from conftest import ROOT
    from ftbench.cli import compose
    from ftbench.config_errors import explain_composition_error

    monkeypatch.chdir(tmp_path)
    split = ["backend=sim", "failures=scripted", "failures.events=[iteration:3]", "failures.events=[node:5]"]
    with pytest.raises(Exception) as caught:
        compose(split)
    explain_composition_error(caught.value, split, ROOT / "conf")
    (folder,) = (tmp_path / "runs").glob("*/*-config-error")
    assert "quote the override" in json.loads((folder / "summary.json").read_text())["error"]


# -- issue 36: accepted and ignored, a traceback, or the wrong setting named ------------------

def cli_error(tmp_path, monkeypatch, capsys, *args: str) -> str:
    """`ftbench args...` in this process: its exit code must be 2; returns the error paragraph."""
    from ftbench import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["ftbench", f"hydra.run.dir={tmp_path / 'run'}", *args])
    with pytest.raises(SystemExit) as caught:
        cli.main()
    assert caught.value.code == 2
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert " ".join(error.split()) in " ".join(capsys.readouterr().err.split())
    return error


@pytest.mark.parametrize("args,setting,words", [
    (("table.column=15m", "model=gpt3-6.7b"), "table.column", ["'15m'", "fault-free, 6h, 2h, 30m"]),
    (("table.column=bogus",), "table.column", ["'bogus'", "choose one of fault-free, 6h, 2h, 30m"]),
    (("model=gpt3-xl",), "model", ["'gpt3-xl'", "gpt3-medium, gpt3-3.35b, gpt3-6.7b"]),
])
def test_a_cell_the_table_does_not_have(tmp_path, monkeypatch, capsys, args, setting, words):
    """Was an OmegaConf InterpolationResolutionError traceback from deep inside the run."""
    error = cli_error(tmp_path, monkeypatch, capsys, "+experiment=recycle-table", *args)
    assert error.startswith(f"Invalid setting `{setting}`:"), error
    for word in words:
        assert word in error, error


def test_table_column_outside_a_table(tmp_path):
    s = run(tmp_path, *SIM, "table.column=30m")
    assert_config_error(s, "table.column", "no paper table", "+experiment=recycle-table")


@pytest.mark.parametrize("backend", [SIM, LOCAL])
@pytest.mark.parametrize("override", ["backend.unannounced=stop", "backend.launcher=torchrun",
                                      "backend.store_port=29600"])
def test_dist_only_settings_off_dist(tmp_path, backend, override):
    s = run(tmp_path, *backend, "strategy=none", "failures=none", override)
    assert_config_error(s, override.split("=")[0], "only backend=dist reads it", "use backend=dist")


def test_min_nodes_too_deep_names_min_nodes(tmp_path):
    s = run(tmp_path, *SIM, "model=gpt-tiny", "strategy=oobleck", "strategy.min_nodes=99")
    assert_config_error(s, "strategy.min_nodes", "8 nodes", "at most 4")


@pytest.mark.parametrize("args,setting,words", [
    (("failures.events=[{iteration:3,node:1}",), "failures.events",
     ["1 '[' but 0 ']'", "single quotes"]),
    (("failures.events=[{iteration:3,node:1},{iteration:4,node:2,at:late}]",), "failures.events[1].at",
     ["'late'", "takes a number"]),
    (("failures.events=[{iteration:3,node:1,at:late}]",), "failures.events[0].at", ["'late'"]),
    (("failures.events=[{iteration:3,node:1,tme_s:5}]",), "failures.events[0].tme_s",
     ["did you mean time_s", "node, iteration, time_s, kind, at"]),
])
def test_events_hydra_rejects_name_the_event(tmp_path, monkeypatch, capsys, args, setting, words):
    """An unbalanced bracket named `backend` (the first key the parse error happened to hold);
    a bad field of an event named the field alone (`at`)."""
    error = cli_error(tmp_path, monkeypatch, capsys, "backend=sim", "failures=scripted", *args)
    assert error.startswith(f"Invalid setting `{setting}`:"), error
    for word in words:
        assert word in error, error


@pytest.mark.parametrize("strategy,override,words", [
    ("swift", "strategy.start=fastest", ["strategy.start is a setting of strategy=varuna only"]),
    ("checkpoint", "strategy.overhead_bound=0.5", ["strategy.overhead_bound is a setting of strategy=checkfreq only"]),
    ("varuna", "strategy.overhead_bound=0.5", ["strategy=checkfreq only"]),
    ("elastic-horovod", "strategy.keep=3", ["strategy.keep is a setting of the strategies", "checkpoint", "varuna"]),
    ("checkfreq", "strategy.mtbf_hours=5", ["strategy.mtbf_hours is a setting of the strategies", "checkpoint"]),
])
def test_a_field_of_another_strategy(tmp_path, monkeypatch, capsys, strategy, override, words):
    """Each strategy's schema holds its own fields only: another strategy's field is refused
    when the config is composed, naming the strategies that have it."""
    error = cli_error(tmp_path, monkeypatch, capsys, "backend=sim", f"strategy={strategy}", override)
    assert error.startswith(f"Invalid setting `{override.split('=')[0]}`:"), error
    for word in words:
        assert word in " ".join(error.split()), error


def test_recycles_checkpoint_settings_need_its_fallback(tmp_path):
    """ReCycle's schema has the checkpoint fields for its fallback; without the fallback they
    would do nothing (ReCycle.check_settings)."""
    s = run(tmp_path, *SIM, "strategy=recycle", "strategy.every=3")
    assert_config_error(s, "strategy.every", "strategy.fallback=checkpoint")


@pytest.mark.parametrize("strategy,override", [("varuna", "strategy.start=fastest"),
                                               ("checkfreq", "strategy.overhead_bound=0.05"),
                                               ("recycle", "strategy.every=3")])
def test_a_field_of_the_strategy_itself_is_fine(tmp_path, strategy, override):
    extra = ("strategy.fallback=checkpoint",) if strategy == "recycle" else ()
    s = run(tmp_path, *SIM, f"strategy={strategy}", override, *extra)
    assert s["status"] == "ok", s["error"]


@pytest.mark.parametrize("override,setting", [
    ("train.lr=nan", "train.lr"), ("train.max_hours=nan", "train.max_hours"),
    ("cluster.replacement_s=nan", "cluster.replacement_s"), ("hardware.peak_tflops=nan", "hardware.peak_tflops"),
    ("failures.events=[{time_s:nan,node:1}]", "failures.events[0].time_s"),
])
def test_nan_is_refused_everywhere(tmp_path, override, setting):
    """Range checks (x > 0) let nan through: train.max_hours=nan ran with no time limit."""
    extra = ("failures=scripted",) if override.startswith("failures.") else ()
    assert_config_error(run(tmp_path, *SIM, *extra, override), setting, "nan is not a number")


@pytest.mark.parametrize("override,setting,words", [
    ("hardware.host_gbps=0", "hardware.host_gbps", ["must be positive"]),  # was a ZeroDivisionError (checkfreq)
    ("hardware.rendezvous_s=-1", "hardware.rendezvous_s", ["must not be negative"]),  # was a negative recovery time
])
def test_hardware_rates_and_times(tmp_path, override, setting, words):
    s = run(tmp_path, *SIM, "strategy=checkfreq", "failures=scripted", "failures.events=[{iteration:2,node:1}]",
            override)
    assert_config_error(s, setting, *words)


def test_memoize_off_sim(tmp_path):
    s = run(tmp_path, *LOCAL, "strategy=none", "failures=none", "backend.memoize=false")
    assert_config_error(s, "backend.memoize", "only backend=sim reads it")


def test_a_value_of_the_wrong_type_says_why(tmp_path, monkeypatch, capsys):
    """The problem is OmegaConf's reason, not 'Error merging override train.iterations=1.5'."""
    error = cli_error(tmp_path, monkeypatch, capsys, "backend=sim", "train.iterations=1.5")
    assert error.startswith("Invalid setting `train.iterations`: Value '1.5'"), error
    assert "takes an integer" in error


@pytest.mark.parametrize("overrides,setting,words", [
    (("failures=scripted", "failures.events=[{iteration:1,node:1}]", "failures.count=5"), "failures.count",
     ["failures is 'scripted', which ignores it", "failures=interval or failures=poisson or failures=trace"]),
    (("failures=scripted", "failures.events=[{iteration:1,node:1}]", "failures.seed=3"), "failures.seed",
     ["which ignores it"]),
    (("failures=interval", "failures.every=1h", "failures.end_at_last_event=false"), "failures.end_at_last_event",
     ["failures=trace"]),
    (("report.progress_every_s=0",), "report.progress_every_s", ["positive"]),
    (("report.progress_every_s=-5",), "report.progress_every_s", ["positive"]),
    (("wandb.project=",), "wandb.project", ["empty"]),
    (("train.data_path=corpus.txt",), "train.data_path", ["train.data=synthetic reads no file", "train.data=text"]),
])
def test_settings_nothing_reads(tmp_path, overrides, setting, words):
    """Found trying more bad input: each was accepted and ignored (progress_every_s=0 printed
    progress lines without pause)."""
    assert_config_error(run(tmp_path, *SIM, *overrides), setting, *words)


def test_a_table_entry_of_the_wrong_type(tmp_path, monkeypatch, capsys):
    """An interpolation that does not resolve (a cell read into cluster.pp) was a traceback."""
    error = cli_error(tmp_path, monkeypatch, capsys, "+experiment=recycle-table", "model=gpt3-medium",
                      "table.models.gpt3-medium.pp=abc")
    assert error.startswith("Invalid setting `cluster.pp`:"), error
    assert "Value 'abc'" in error and "${cell:models,pp}" in error


def test_a_table_without_columns(tmp_path):
    s = run(tmp_path, *SIM, "+experiment=swift-eval", "table.column=x", "train.iterations=2")
    assert_config_error(s, "table.column", "has no columns")
