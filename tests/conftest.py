import math
import os
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"  # no network here; tests never talk to W&B
# Tests build tiny models, in this process and in CLI subprocesses: one intra-op thread each
# (set before torch is imported; ftbench.threads caps its automatic choice at it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[1]


# The quick tier (python -m pytest -m quick, about 2 minutes on 2 cores, for development): these
# files, which train no model for long and launch no dist job (schedules, plans, the simulator
# with every strategy, planners, checkpoint store, undo, configs, report), and the tests
# marked `quick` elsewhere (Swift's simulator tests). Their `slow`, `dist`, `full` and `chaos`
# tests stay out of it.
QUICK_FILES = {
    "test_actions.py", "test_checkpoint_sim.py", "test_checkpoint_store.py", "test_checkpoint_tiers.py", "test_config.py",
    "test_costs_measured.py", "test_dist_settings.py", "test_failures.py", "test_gpt_model.py", "test_layering.py",
    "test_layers.py", "test_lint.py", "test_merged_recoveries.py", "test_oobleck_nodes.py", "test_op_times.py",
    "test_recompute.py", "test_recycle_memory.py", "test_report.py", "test_run_folder.py", "test_samples_ledger.py",
    "test_schedule.py",
    "test_scorecard.py", "test_sim_grid_timer.py", "test_sim_parts.py", "test_sim_runs.py", "test_swift_logging.py",
    "test_transport.py", "test_undo.py",
}
OTHER_TIERS = ("slow", "dist", "full", "chaos")

# The extended tier (python -m pytest -m extended; CI's second step): the default tier's costliest
# cases whose mechanism another default-tier case runs too (named in each comment), so that
# `pytest -q` fits 15 minutes on 2 cores. By file: a test's name takes each of its default-tier
# cases, a name with its [id] that case alone. `full` and `chaos` cases stay in their tiers.
EXTENDED = {
    # the tier a recovery names: its sim case; local's restore of either tier: the test of newer
    # checkpoints forgotten; training equal after restores: test_local's checkpoint presets; a real
    # restart on dist: test_dist_failures' checkpoint restart onto a standby
    "test_checkpoint_tiers.py": ("test_a_recovery_restores_the_tier_it_names[local]",
                                 "test_a_recovery_restores_the_tier_it_names[dist]"),
    # real kills on dist: test_dist_failures' and test_dist_swift's (state copied between processes
    # on dist is in this tier only: here, Oobleck's, Swift's live replica); failover and
    # reconfiguration: on local below (the two cases kept run both), against sim in test_conformance
    "test_bamboo.py": ("test_dist_processes_fail_over_and_reconfigure_after_real_kills",
                       "test_redundant_stages_train_the_fault_free_model[failover]",  # in [reconfiguration] too
                       "test_redundant_stages_train_the_fault_free_model[two-failovers]",
                       # seeded failure scripts: test_random_failures' local case of each strategy
                       "test_seeded_random_failures_train_the_fault_free_model",
                       # eager copies: on sim (test_a_lazy_failover_charges_the_load_in_the_run), in memory
                       "test_eager_redundant_forwards_train_the_fault_free_model"),
    # as Bamboo's: merge, borrow and join on local ([borrow] and [join] each merge first)
    "test_oobleck.py": ("test_dist_processes_reinstantiate_after_real_kills",
                        "test_heterogeneous_pipelines_train_the_fault_free_model[merge]",
                        "test_seeded_random_failures_train_the_fault_free_model",  # as Bamboo's
                        # a node's GPUs as lanes of one stage: on sim, test_oobleck_scale's [lanes-overlap]
                        "test_one_stage_per_node_shared_by_its_gpus_trains_the_fault_free_model"),
    # Kept on dist: the checkpoint restart onto a standby (a scripted kill, its heartbeat silence
    # detected, the processes relaunched), ReCycle's unannounced death (a failed wait, rolled back,
    # told to every survivor in seconds), test_dist_swift's replay, test_dist's 1F1B run and
    # deadlines. Moved: an unannounced death at other points (during a checkpoint, Elastic
    # Horovod's) or stopping the run; a death in a recovery (on local: test_local's node lost
    # during a recovery); a straggler past the deadline (a wait failed with nobody dead:
    # test_dist_robustness' detection, test_dist's peer that never answers)
    "test_dist_failures.py": ("test_a_death_during_a_recovery_is_recovered",
                              "test_an_unannounced_death_is_rolled_back_and_recovered"
                              "[elastic-horovod-3:2:7-1-dead0-extra0]",
                              "test_a_death_during_a_checkpoint_is_recovered",
                              "test_an_unannounced_death_stops_the_run_when_asked",
                              "test_a_straggler_past_the_deadline_stops_every_rank_with_its_error",
                              # the in-place restart's parts on dist: the rendezvous (ReCycle's unannounced
                              # death) and a reload from files (the checkpoint restart onto a standby)
                              "test_in_process_restart_keeps_the_survivors_processes_after_a_real_kill"),
    "test_dist_robustness.py": ("test_a_replay_whose_standby_dies_uses_the_next_live_standby",
                                "test_a_dist_bug_exits_1_with_what_was_done"),  # a rank's bug: launched here
    # a slow peer (as the straggler); a departure told at once (ReCycle's unannounced death: seconds)
    "test_dist_propagation.py": ("test_a_slow_peer_is_waited_for_and_an_alarm_ends_a_collective_at_once",
                                 "test_a_rank_that_leaves_ends_its_peers_receives_and_group_creations"),
    # torchrun's two agents (its settings and a rank started on a store stay); Elastic Horovod: on local
    "test_dist_torchrun.py": ("test_torchrun_nodes_survive_the_death_of_node_0",),
    # Swift on dist: the replay from the logs; damaged logs and the undo: on local (test_swift,
    # test_swift_log_integrity)
    "test_dist_swift.py": ("test_a_damaged_log_is_found_before_the_replay_and_the_job_restarts_from_the_checkpoint",
                           "test_a_lost_stage_with_a_live_replica_is_copied_after_undoing_steps"),
    "test_dist.py": ("test_dist_zero_bubble_equals_local",),  # dist pipelines: the 1F1B case; zb-h1: on local
    # Ctrl-C in the fault-free check: its local case; joblib sweeps: test_sweep_launchers;
    # SIGTERM is handled as Ctrl-C (test_ctrl_c_*)
    "test_cli.py": ("test_ctrl_c_during_a_dist_runs_fault_free_check_keeps_the_runs_summary",
                    "test_a_joblib_sweep_records_and_exits_like_the_basic_launcher",
                    "test_sigterm_is_handled_like_ctrl_c_and_keeps_what_was_done"),
    "test_docs.py": ("test_dist_command_runs",),  # the dist CLI: test_dist's 1F1B case
    # a strategy from another package: test_checkpoint_tiers runs docs/extending.md's on sim and local
    "test_extending.py": ("test_a_strategy_from_another_package_runs_through_conformance_and_the_random_scripts",),
    # the other failure points and seeds (each strategy keeps one point, one seeded script)
    "test_failure_point.py": (
        "test_seeded_random_failures_at_drawn_points_train_the_fault_free_model[oobleck]",
        "test_seeded_random_failures_at_drawn_points_train_the_fault_free_model[recycle]",
        "test_seeded_random_failures_at_drawn_points_train_the_fault_free_model[bamboo]",
        "test_without_the_undo_training_differs_from_fault_free[oobleck]",  # [recycle] stays
        "test_without_the_undo_training_differs_from_fault_free[bamboo]"),
    "test_swift.py": (
        # benchmarks/swift.py's runs, as the other benchmarks' below (its --help: test_benchmarks_help)
        "test_the_benchmark_compares_swift_with_the_baselines",
        "test_the_benchmarks_ratio_moves_with_the_run_length_and_the_restart_cost",
        # the replay's shapes: [two stages a node] stays (placement=stage: test_placement)
        "test_replays_of_every_shape_are_exact[every replica lost]",
        "test_replays_of_every_shape_are_exact[merged groups]",
        "test_replays_of_every_shape_are_exact[zb-h1]",
        "test_replays_of_every_shape_are_exact[at a checkpoint]",
        "test_swift_keeps_less_beside_training_state_than_elastic_horovod",  # on sim: its test there
        "test_a_failure_after_steps_trains_the_fault_free_model[logging-0.9]",  # 0.97 of each stays
        "test_a_failure_after_steps_trains_the_fault_free_model[logging-0.999]",
        "test_a_failure_after_steps_trains_the_fault_free_model[replication-0.9]",
        "test_a_failure_after_steps_trains_the_fault_free_model[replication-0.999]",
        "test_seeded_random_failures_train_the_fault_free_model[swift-a-dp1]",  # [swift-b-dp1] stays
        "test_seeded_random_failures_train_the_fault_free_model[swift-a-dp2]",
        "test_seeded_random_failures_train_the_fault_free_model[swift-b-dp2]"),
    "test_local.py": ("test_shrink_then_grow_back_matches_fault_free[varuna-setup1]",  # Varuna's: conformance
                      "test_zb_h1_under_failures_matches_too",  # zb-h1 against GPT-2 and in Swift's replays
                      "test_pipelined_training_matches_single_process_gpt2[gpipe]",  # [1f1b], [zb-h1] stay
                      "test_local_ettr_is_lower_with_a_failure",  # ETTR: test_local_ettr_counts_the_kept_iterations
                      # Elastic Horovod's two failures: its shrink and grow back, test_random_failures
                      "test_checkpoint_presets_train_the_fault_free_model[elastic-horovod-setup5-failures5]"),
    # rerouting: [one failure], [two stages, one iteration], [failure then rejoin]; whole pipelines
    # lost: test_recycle_normalise's first case (its second: rejoins, as [failure then rejoin])
    "test_recycle.py": ("test_rerouted_training_matches_fault_free[two failures in one stage]",
                        "test_rerouted_training_matches_fault_free[whole pipeline lost]"),
    "test_recycle_normalise.py": (
        "test_whole_failed_pipelines_with_idle_workers_train_the_fault_free_model"
        "[[{iteration:3,node:1},{iteration:5,node:5},{iteration:7,node:1,kind:join}]]",),
    # one case per planner stays: [reroute-ample-memory], [reroute]
    "test_recycle_reference.py": (
        "test_a_failure_never_makes_the_heuristics_plans_faster[reroute-tight-memory]",
        "test_a_failure_never_makes_the_heuristics_plans_faster[decoupled-ample-memory]",
        "test_a_failure_never_makes_the_heuristics_plans_faster[decoupled-tight-memory]",
        "test_a_failure_never_makes_the_heuristics_plans_faster[staggered-ample-memory]",
        "test_a_failure_never_makes_the_heuristics_plans_faster[staggered-tight-memory]",
        "test_a_failure_never_makes_the_milps_plans_faster[decoupled]"),
    # the largest grid of each: the smaller ones run the same comparison; the benchmarks' own runs
    # (benchmarks/sim_scale.py, sim_vs_real.py): their parts are tested, test_benchmarks_help runs each --help
    "test_sim_scale.py": ("test_varuna_candidate_times_equal_simulating_the_whole_grid[8-2048]",
                          "test_the_scale_benchmark_measures_each_strategy_in_its_own_process_and_stops_it_at_the_limit"),
    "test_sim_vs_real.py": ("test_the_tiny_matrix_prints_a_row_and_a_line_per_quantity",),
    "test_overlap_grad_reduce.py": ("test_varuna_candidate_times_equal_the_whole_grid_with_overlap[8-2048]",),
    "test_oobleck_scale.py": ("test_runs_on_the_fast_paths_compute_what_the_reference_paths_compute[one-gpu]",),
    # damaged logs: [truncated] and [one flipped bit] stay
    "test_swift_log_integrity.py": tuple(
        f"test_a_damaged_log_restarts_from_the_checkpoint_and_trains_the_fault_free_model[{how}]"
        for how in ("empty", "wrong iteration", "deleted", "garbage")),
    "test_planner_milp.py": ("test_milp_optimum_is_never_slower_than_the_heuristic[failed3-True]",),  # 7 stay
    "test_journal.py": ("test_replaying_the_journal_gives_the_loop_back_exactly[checkpoint]",  # [recycle] stays
                        "test_replaying_the_journal_gives_the_loop_back_exactly[varuna]"),
    # sweeps: a table sweep, its report and a rerun skipping done cells: test_sweep_launchers' joblib
    # case; SLURM: its README example; a W&B report built: the test publishing without a login
    "test_tables.py": ("test_a_table_sweep_writes_its_report_and_a_rerun_skips_done_cells",),
    "test_sweep_launchers.py": ("test_the_slurm_recipe_composes_and_submits_one_array_as_documented[recycle-table]",
                                # a paper table logged to W&B: test_tables', test_metrics' sweep table
                                "test_a_table_sweep_logs_its_paper_table_to_wandb_offline_in_the_sweeps_group"),
    "test_wandb_report.py": ("test_a_sweeps_report_names_only_what_its_runs_logged",),
    # Varuna's checkpoint after a change: on sim in its other tests (the run loop's rule, shared)
    "test_varuna_checkpoints.py": ("test_local_writes_the_post_change_checkpoint_and_matches_fault_free",),
    # one tensor per strategy stays
    "test_equivalence_floor.py": (
        "test_a_copied_tensor_off_by_a_tenth_of_a_percent_is_caught[transformer.wte.weight-elastic-horovod-setup0]",
        "test_a_copied_tensor_off_by_a_tenth_of_a_percent_is_caught[transformer.h.3.ln_2.bias-checkpoint-setup1]"),
}


def extended(item) -> bool:
    """Whether `item` is in the extended tier (EXTENDED, and every conformance case but each
    strategy's "one failure": sim against local, the mechanism, for every strategy)."""
    if item.get_closest_marker("full") or item.get_closest_marker("chaos"):
        return False
    if item.path.name == "test_conformance.py" and item.originalname == "test_sim_and_local_agree":
        return not item.name.endswith("-one failure]")
    names = EXTENDED.get(item.path.name, ())
    return item.name in names or item.originalname in names


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    named = set()
    for item in items:
        if item.path.name in QUICK_FILES and not any(item.get_closest_marker(m) for m in OTHER_TIERS):
            item.add_marker(pytest.mark.quick)
        if extended(item):
            item.add_marker(pytest.mark.extended)
            named |= {(item.path.name, item.name), (item.path.name, item.originalname)}
    # a misspelt name would leave its test in the default tier without a word: each must name a
    # test of its file, where the whole file was collected (no test selected by its node id)
    if not any("::" in arg for arg in config.args):
        files = {item.path.name for item in items}
        unknown = [f"{file}::{name}" for file, names in EXTENDED.items() if file in files
                   for name in names if (file, name) not in named]
        if unknown:
            raise pytest.UsageError("tests/conftest.py EXTENDED names no test: " + ", ".join(unknown))


def compose(*overrides: str):
    """The config the CLI would build for these overrides (no run folder, no Hydra job)."""
    from ftbench.cli import compose as cli_compose

    return cli_compose(overrides)


def run(tmp_path, *overrides: str) -> dict:
    """Execute a run into tmp_path (as the CLI would) and return its summary."""
    from ftbench.run import execute

    cfg = compose("report.progress=false", *overrides)
    return execute(cfg, tmp_path, echo=lambda *_: None)


@pytest.fixture
def run_config(tmp_path):
    return lambda *overrides: run(tmp_path, *overrides)


# Small local runs: gpt-tiny, pp=4 x dp=2, 4 micro-batches of 1 sample per pipeline.
LOCAL = ("backend=local", "model=gpt-tiny", "train.iterations=10", "train.microbatches=4",
         "report.check_fault_free=false", "report.gantt=false", "cluster.replacement_s=0")


_FAULT_FREE: dict[tuple[str, ...], tuple[list[float], dict]] = {}  # overrides -> (losses, final weights)


def fault_free(tmp_path, *overrides: str) -> tuple[list[float], dict]:
    """(losses, final weights) of fault-free training of `overrides` (strategy=none,
    failures=none), trained once per test session: several tests judge strategies and
    failures against the same setup, and fault-free training depends on its config alone."""
    from ftbench.equivalence import load_state

    key = (*overrides, "strategy=none", "failures=none")
    if key not in _FAULT_FREE:
        reference = run(tmp_path / "fault-free", *key)
        assert reference["status"] == "ok", reference["error"]
        _FAULT_FREE[key] = (reference["losses"], load_state(reference["final_state"]))
    return _FAULT_FREE[key]


_REFERENCES: dict = {}  # the session's references of the runs' own check (ftbench.fault_free._REFERENCES)


@pytest.fixture(autouse=True)
def fault_free_references(request):
    """A run's own check (report.check_fault_free) trains its setup's fault-free reference
    once per session (ftbench.fault_free keeps references when asked), except in a test that
    monkeypatches: what it patches may be what the reference runs, so it trains its own and
    keeps none."""
    if "monkeypatch" in request.fixturenames:
        yield
        return
    from ftbench import fault_free

    fault_free._REFERENCES = _REFERENCES
    try:
        yield
    finally:
        fault_free._REFERENCES = None


def assert_matches_fault_free(tmp_path, setup=(), faults=()) -> dict:
    """The equivalence check: run `setup` under `faults` (strategy and failure overrides), then
    the same setup fault-free (strategy=none, failures=none; once per session, `fault_free`);
    per-iteration losses must agree to rtol 1e-5 and the saved final weights to
    `torch.testing.assert_close`'s tolerance. Returns the faulty run's summary."""
    from ftbench.equivalence import compare, load_state

    faulty = run(tmp_path / "faulty", *LOCAL, *setup, *faults)
    assert faulty["status"] == "ok", faulty["error"]
    difference = compare(faulty["losses"], load_state(faulty["final_state"]), *fault_free(tmp_path, *LOCAL, *setup))
    assert difference is None, difference
    return faulty


def seeded_failures(tag: str, nodes: int, count: int, draw_at: bool = False) -> str:
    """`failures.events=[...]`: `count` failures of distinct nodes below `nodes`, at distinct
    iterations 1..8 in order, drawn from the seed string `tag` (not picked by hand). With
    `draw_at`, each also strikes at a point `at` of its iteration drawn uniformly from [0, 1)
    (to 4 decimals, rounded down), after the other draws: the nodes and iterations are those
    of the same tag without it."""
    import random

    rng = random.Random(tag)
    failed = rng.sample(range(nodes), count)
    iterations = sorted(rng.sample(range(1, 9), count))
    points = [f",at:{math.floor(rng.random() * 1e4) / 1e4}" for _ in range(count)] if draw_at else [""] * count
    return "failures.events=[" + ",".join(f"{{iteration:{i},node:{n}{at}}}"
                                          for i, n, at in zip(iterations, failed, points)) + "]"


@pytest.fixture
def dist_store():
    """A torch.distributed TCPStore on a free local port (under a prefix), as a job's store."""
    from datetime import timedelta

    import torch.distributed as dist

    from ftbench.distributed.launch import free_port

    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    yield dist.PrefixStore("test/", server)


@pytest.fixture
def spawned_ranks(monkeypatch):
    """A dist job launched from this long-lived test process starts its ranks by spawn (as on
    GPUs), not fork: a rank forked from it after other launches has, rarely, hung before
    joining its first group (not explained yet; see docs/distributed.md). The CLI's runs fork
    from a fresh process, as users' do."""
    from ftbench.distributed import worker

    monkeypatch.setattr(worker, "start_method", lambda: "spawn")


def strategy_package(folder: Path) -> tuple[str, str]:
    """docs/extending.md's example strategy module and entry point as an installed package on
    `folder` (a dist-info folder is what an install leaves for importlib.metadata): put
    `folder` on PYTHONPATH and it is `strategy=<name>`. Returns (name, the module's code)."""
    import re

    page = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    name, target = re.search(r'\[project\.entry-points\."ftbench\.strategies"\]\n([\w-]+) = "([\w.:]+)"', page).groups()
    module = target.split(":")[0]
    (folder / module).mkdir(parents=True)
    (folder / module / "__init__.py").write_text(code, encoding="utf-8")
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[ftbench.strategies]\n{name} = {target}\n", encoding="utf-8")
    return name, code
