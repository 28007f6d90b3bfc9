"""Seeded random failure scripts (ftbench/chaos.py): the generator, the verdicts, and a handful
of random cases per strategy against fault-free training. `benchmarks/random_failures.py`
runs hundreds of them."""
import shlex

import pytest

from ftbench.chaos import (STRATEGIES, classify, event_notes, events_text, random_case, run_case)

SEEDS = range(200)


def _setting(case, key):
    return next(o.split("=", 1)[1] for o in case.setup if o.startswith(key + "="))


def test_the_same_seed_gives_the_same_case():
    for seed in range(20):
        for strategy in STRATEGIES:
            assert random_case(seed, strategy) == random_case(seed, strategy)
    cases = {random_case(seed, "checkpoint").description for seed in range(20)}
    assert len(cases) == 20
    # One seed, one setup and one failure script for every strategy (one fault-free reference).
    assert len({(random_case(7, s).setup, events_text(random_case(7, s).events)) for s in STRATEGIES}) == 1


def test_cases_are_valid_small_setups_with_valid_node_ids():
    for seed in SEEDS:
        case = random_case(seed, "recycle")
        pp, dp, gpus = (int(_setting(case, k)) for k in ("cluster.pp", "cluster.dp", "cluster.gpus_per_node"))
        assert pp in (2, 3, 4) and 1 <= dp <= 4 and gpus in (1, 2) and (pp * dp) % gpus == 0
        assert int(_setting(case, "cluster.spares")) in (0, 1, 2)
        iterations = int(_setting(case, "train.iterations"))
        assert 6 <= iterations <= 12 and 2 <= int(_setting(case, "train.microbatches")) <= 4
        assert _setting(case, "schedule") in ("gpipe", "1f1b", "zb-h1")
        nodes, down = pp * dp // gpus, set()
        assert case.events
        for e in case.events:
            assert e.get("kind", "fail") in ("fail", "join") and ("iteration" in e) != ("time_s" in e)
            if "time_s" in e:
                assert e["time_s"] >= 0 and (e.get("kind") == "join") == (e["node"] >= nodes)
                continue
            assert 0 <= e["iteration"] < iterations
            if e.get("kind") == "join":  # a node that failed earlier, or an id new to the job
                assert e["node"] in down or e["node"] >= nodes
                down.discard(e["node"])
            else:
                assert e["node"] < nodes
                down.add(e["node"])


def test_seeds_cover_every_kind_of_event():
    seen = set()
    for seed in SEEDS:
        seen.update(random_case(seed, "checkpoint").notes)
    assert {"fail", "burst", "fail-while-down", "rejoin", "fail-after-rejoin", "join-new",
            "join-and-fail", "time"} <= seen
    assert event_notes([{"iteration": 2, "node": 1}, {"iteration": 4, "node": 1}], nodes=3) == ["fail", "fail-while-down"]


def test_strategy_settings_come_with_the_strategy():
    for seed in range(30):
        assert random_case(seed, "none").strategy_overrides == ("strategy=none",)
        for s in ("checkpoint", "checkfreq", "elastic-horovod", "varuna", "swift"):
            every = dict(o.split("=") for o in random_case(seed, s).strategy_overrides)["strategy.every"]
            assert every in ("1", "2", "3", "4") or (s == "checkfreq" and every == "null")
        fallback = dict(o.split("=") for o in random_case(seed, "recycle").strategy_overrides)["strategy.fallback"]
        assert fallback in ("none", "checkpoint")
        assert dict(o.split("=") for o in random_case(seed, "bamboo").strategy_overrides)["strategy.overload"] \
            in ("null", "0.05")
    with pytest.raises(ValueError):
        random_case(0, "no-such-strategy")


def test_the_description_is_a_command_line_for_the_overrides_and_they_compose():
    from ftbench.cli import compose

    assert events_text([{"iteration": 2, "node": 1}, {"time_s": 0.5, "node": 9, "kind": "join"}]) == \
        "[{iteration:2,node:1},{time_s:0.5,node:9,kind:join}]"
    for seed, strategy in zip(range(6), STRATEGIES):
        case = random_case(seed, strategy)
        assert shlex.split(case.description) == ["ftbench", *case.overrides]
        cfg = compose(case.overrides)
        assert cfg.strategy.name == strategy and cfg.failures.kind == "scripted"
        assert len(cfg.failures.events) == len(case.events)
        ref = compose(case.reference_overrides)
        assert ref.strategy.name == "none" and ref.failures.kind == "none"


def test_classify():
    ok = {"status": "ok", "error": None}
    assert classify(ok, None) == "ok"
    assert classify({"status": "oom", "error": "stage 0 needs 3 GB"}, None) == "oom"
    assert classify({"status": "unrecoverable", "error": "every replica of stage 1 failed"}, None) == "unrecoverable"
    assert classify({"status": "unrecoverable", "error": ""}, None) == "crashed"
    assert classify({"status": "unrecoverable", "error": None}, None) == "crashed"
    assert classify({"status": "error", "error": "Invalid setting"}, None) == "crashed"
    assert classify({"status": "exception", "error": "KeyError: 3"}, None) == "crashed"
    assert classify({**ok, "losses": [], "final_state": None}, ([1.0], {})) == "different"


# -- whole random cases ---------------------------------------------------------------------

def _small(seed) -> bool:
    """Quick local cases (a few workers, few iterations) whose events replay exactly."""
    case = random_case(seed, "none")
    workers = int(_setting(case, "cluster.pp")) * int(_setting(case, "cluster.dp"))
    return workers <= 6 and int(_setting(case, "train.iterations")) <= 9 and not case.wall_clock_events


LOCAL_SEEDS = [s for s in range(100) if _small(s)][:2]
SIM_SEEDS = range(100, 104)


def _assert_sound(result):
    assert result.outcome not in ("different", "crashed"), \
        f"{result.outcome}: {result.detail}\nreproduce: {result.case.description}"
    if result.outcome == "unrecoverable":
        assert result.detail.strip()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [LOCAL_SEEDS[0], *(pytest.param(s, marks=pytest.mark.full) for s in LOCAL_SEEDS[1:])])
def test_random_failures_on_local_train_the_fault_free_model_or_say_why_not(tmp_path, seed, strategy):
    # run_case runs the same setup fault-free once per seed (cached) and compares losses and weights.
    _assert_sound(run_case(random_case(seed, strategy, "local"), tmp_path, timeout_s=120))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_random_failures_on_sim_end_ok_or_say_why_not(tmp_path, strategy):
    for seed in SIM_SEEDS:
        _assert_sound(run_case(random_case(seed, strategy, "sim"), tmp_path, timeout_s=60))
