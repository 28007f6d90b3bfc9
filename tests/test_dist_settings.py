"""backend=dist checks that start no process: settings refused before anything is launched
(failure kinds dist cannot place, kill and stall points that are malformed or can never
strike, dist-only settings on other backends), the kill and stall point parsers, and the
membership protocol's agreement against a store in this process. They carry no `dist` mark
(tests/test_dist.py has the tests that launch jobs)."""
import pytest

from conftest import run

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_failures_dist_cannot_place_are_refused(tmp_path):
    summary = run(tmp_path / "poisson", "backend=dist", "model=gpt-tiny", "failures=poisson",
                  "failures.mtbf_hours=1")
    assert summary["status"] == "error"
    assert "failures=poisson on backend=dist is not implemented yet" in summary["error"]
    assert "failures=scripted" in summary["error"]


@pytest.mark.parametrize("override,message", [
    ("backend.kill=3:2", "'3:2' is not RANK:ITERATION:OPS"),
    ("backend.kill=1:50:0", "iteration 50 is past the run's"),
    ("backend.unannounced=ignore", "unknown mode 'ignore'"),
    ("backend.stall=0:2:soon", "'0:2:soon' is not RANK:ITERATION:SECONDS"),
    ("backend.stall=0:50:3", "iteration 50 is past the run's"),
])
def test_bad_unannounced_settings_are_refused(tmp_path, override, message):
    summary = run(tmp_path, "backend=dist", "model=gpt-tiny", override)
    assert summary["status"] == "error" and message in summary["error"], summary["error"]
    assert override.split("=")[0] in summary["error"]


@pytest.mark.parametrize("overrides,message", [
    (("cluster.spares=1", "backend.kill=99:1:2"), "rank 99 does not exist: the job has 5 processes (ranks 0..4: "
                                                  "5 nodes, 1 per node"),
    (("strategy=checkpoint", "strategy.every=2", "backend.kill=1:2:save"),
     "no checkpoint follows iteration 2: strategy checkpoint saves every 2 iterations, after iterations [1]"),
    (("strategy=oobleck", "backend.kill=1:1:save"), "strategy oobleck writes no checkpoint"),
    (("failures=scripted", "failures.events=[{iteration:2,node:1}]", "backend.kill=3:1:recovery"),
     "no recovery is performed at iteration 1: the failure script's are at iterations [2]"),
    (("backend.stall=0:1:3",), "no recovery is performed at iteration 1: the failure script has no event"),
    # torchft under DiLoCo recovers from a failure in iteration 1 at 2 (the groups it leaves
    # alone finish 1 first), and at no other
    (("strategy=torchft", "train.data_parallel=diloco", "train.sync_every=2", "failures=scripted",
      "failures.events=[{iteration:1,node:1}]", "backend.kill=3:3:recovery"),
     "no recovery is performed at iteration 3: the failure script's are at iterations [1, 2]"),
    (("backend.stall=7:1:3",), "rank 7 does not exist"),
])
def test_a_kill_that_can_never_strike_is_refused(tmp_path, overrides, message):
    """backend.kill (and backend.stall) naming a rank the job lacks, or a checkpoint or a
    recovery the run never performs, would let a chaos run pass without its death."""
    summary = run(tmp_path, "backend=dist", "model=gpt-tiny", "cluster.pp=2", "cluster.dp=2", "train.iterations=4",
                  *overrides)
    assert summary["status"] == "error" and message in summary["error"], summary["error"]
    assert overrides[-1].split("=")[0] in summary["error"]


@pytest.mark.parametrize("backend,override", [("local", "backend.kill=1:1:2"), ("sim", "backend.stall=0:1:3")])
def test_dist_chaos_settings_are_refused_on_other_backends(tmp_path, backend, override):
    summary = run(tmp_path, f"backend={backend}", "model=gpt-tiny", override)
    assert summary["status"] == "error", summary
    assert f"backend={backend} has no processes to" in summary["error"] and override.split("=")[0] in summary["error"]


def test_kill_points():
    from ftbench.distributed.faults import parse_kill

    assert parse_kill("3:2:10") == (3, 2, 10)
    assert parse_kill("3:2:save") == (3, 2, "save")
    assert parse_kill("4:3:recovery") == (4, 3, "recovery")
    assert parse_kill("4:3:restart") is None and parse_kill("4:recovery") is None


def test_stall_points():
    from ftbench.distributed.faults import parse_stall

    assert parse_stall("0:3:12") == (0, 3, 12.0) and parse_stall("2:1:0.5") == (2, 1, 0.5)
    assert parse_stall("0:3:0") is None and parse_stall("0:3") is None and parse_stall("a:3:1") is None


def test_the_first_dead_set_posted_is_the_epochs_verdict(dist_store):
    """Two groups of survivors that each saw the other silent (a stall, not a death): the
    first to post decides; a rank it names is fenced, and any other view is refused."""
    from ftbench.distributed.membership import Fenced, MembershipError, agree

    assert agree(dist_store, 1, 0, [0], {1, 4, 5}, 2.0) >= 0  # rank 0 first: 1, 4 and 5 are dead
    with pytest.raises(Fenced, match=r"rank 1 is dead in the verdict of membership epoch 1 \(\[1, 4, 5\]\)"):
        agree(dist_store, 1, 1, [1, 4, 5], {0}, 2.0)
    with pytest.raises(MembershipError, match=r"the verdict is \[1, 4, 5\], rank 2 saw \[4\]"):
        agree(dist_store, 1, 2, [0, 2], {4}, 2.0)
    assert agree(dist_store, 2, 1, [1], {0}, 2.0) >= 0  # the next epoch has its own verdict


def test_agreement_waits_for_every_survivors_view(dist_store):
    from ftbench.distributed.membership import MembershipError, agree

    with pytest.raises(MembershipError, match=r"ranks \[2\] posted no view of membership epoch 1"):
        agree(dist_store, 1, 0, [0, 2], {1}, 0.5)


def test_a_rank_that_stops_with_an_error_says_so(dist_store):
    from ftbench.distributed.membership import aborted, post_abort

    post_abort(dist_store, 3, "DistTimeout: rank 3 waited more than 6 s")
    assert aborted(dist_store, [1, 2, 3]) == {3: "DistTimeout: rank 3 waited more than 6 s"}
    assert aborted(dist_store, [1, 2]) == {}


def test_the_agents_shutdown_timeout_is_given_only_where_torch_takes_it():
    # torch's LaunchConfig and LocalElasticAgent took shutdown_timeout in newer releases only;
    # torch 2.11 (a GPU machine's) refused it, and every dist launch ended with a TypeError
    from ftbench.distributed.protocol import SHUTDOWN_S, shutdown_timeout

    class Newer:
        def __init__(self, spec, shutdown_timeout: int = 30):
            pass

    class Older:
        def __init__(self, spec):
            pass

    assert shutdown_timeout(Newer) == {"shutdown_timeout": SHUTDOWN_S}
    assert shutdown_timeout(Older) == {}
    Older(None, **shutdown_timeout(Older))
