"""Issue 29: a death that one rank notices reaches every survivor within seconds, whatever it
waits on, while a peer that is alive but slow is still waited for up to the deadline.

Three processes under the elastic launcher, each with its heartbeat and the job's alarm
(ftbench.distributed.membership.Alarm), and a deadline of 60 s on every wait, so that giving
up in seconds cannot be mistaken for reaching the deadline."""
import faulthandler
import time

import pytest

from test_dist import leftover_descendants

dist = pytest.importorskip("torch.distributed")
# `dist` marks the tests that start processes; the others run in this process
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TIMEOUT_S = 60.0  # every wait's deadline: far above anything these tests wait


def _watched_transport():
    """This rank's transport, watched as on the per-node layout (its heartbeat beating)."""
    import torch

    from ftbench.distributed.membership import Alarm, Heartbeat, job_store
    from ftbench.distributed.transport import DistTransport
    from ftbench.distributed.worker import env_ranks

    torch.set_num_threads(1)
    # a rank stuck this long dumps its threads' stacks into its log, so a hang can be read
    faulthandler.dump_traceback_later(TIMEOUT_S / 2, exit=False)
    rank, world, _, _ = env_ranks()
    Heartbeat(rank, TIMEOUT_S).start()
    transport = DistTransport(rank, world, TIMEOUT_S, torch.device("cpu"), torch.float32, (1,))
    transport.watch(Alarm(job_store(TIMEOUT_S), rank))
    return transport


def _outcome(call) -> tuple[str, float, str]:
    """(the exception's type or "done", seconds it took, its message or the result)."""
    started = time.perf_counter()
    try:
        result = call()
    except Exception as err:  # noqa: BLE001 - what a wait ends with is the result here
        return type(err).__name__, time.perf_counter() - started, str(err)
    return "done", time.perf_counter() - started, repr(result)


def _straggler_then_alarm(straggle_s: float) -> dict:
    """Rank 2 joins a sum `straggle_s` late (beating); then posts the alarm instead of joining."""
    import torch

    t = _watched_transport()
    if t.rank == 2:
        time.sleep(straggle_s)
    slow = _outcome(lambda: t.all_sum(torch.ones(1), "sum with a straggler").item())
    if t.rank == 2:
        time.sleep(1.0)
        t.alarm.post("rank 2 gives up (a test)")
        time.sleep(4.0)  # alive and beating: only the alarm can end the others' wait
        return {"slow": slow}
    return {"slow": slow, "told": _outcome(lambda: t.all_sum(torch.ones(1), "sum that rank 2 never joins"))}


# Spawned, as ranks are on GPUs and under torchrun: forked from this long-lived pytest process,
# after other launches in it, a rank once hung before joining the first group (2 runs in 7;
# not reproduced since). Spawned ranks whose groups are still closing in a daemon thread used
# to abort at exit in gloo's teardown (3 runs in 8); they end through worker.exit_now now.
@pytest.mark.dist
def test_a_slow_peer_is_waited_for_and_an_alarm_ends_a_collective_at_once(tmp_path):
    from ftbench.distributed.launch import launch
    from ftbench.distributed.membership import WATCH_STALE_S

    straggle_s = WATCH_STALE_S + 1.5  # slower than a silent heartbeat takes to be noticed
    results = launch(_straggler_then_alarm, (straggle_s,), 3, TIMEOUT_S, 120.0, tmp_path, start_method="spawn")
    for rank in range(3):
        assert results[rank]["slow"][::2] == ("done", "3.0"), results[rank]["slow"]
    for rank in (0, 1):
        kind, seconds, message = results[rank]["told"]
        assert kind == "Told", message
        assert "told by rank 2 (rank 2 gives up (a test))" in message and "sum that rank 2 never joins" in message
        assert 0.5 < seconds < 10, seconds  # the alarm came 1 s in: seconds, not the 60 s deadline
    assert leftover_descendants() == []


def _leaving_rank() -> dict:
    """Rank 1 leaves the epoch while rank 0 waits to receive from it and rank 2 waits to build a
    group with it; rank 1 has a collective in flight that nobody else joins."""
    import torch

    from ftbench.engine.transport import ACT

    t = _watched_transport()
    out = {}
    if t.rank in (0, 1):
        t._pairs[(1, 0)] = t._new_group((0, 1), "from1to0")
    if t.rank in (1, 2):
        t._groups[(1, 2)] = t._new_group((1, 2), "fragment")
    if t.rank == 0:
        out["receive"] = _outcome(lambda: t.receive((ACT, 0, 0, 0), src=1, dst=0))
    elif t.rank == 1:
        work = t._groups[(1, 2)].pg.allreduce([torch.ones(1)])  # never completes: rank 2 does not join
        time.sleep(1.0)
        out["abandon"] = _outcome(lambda: t.abandon("rank 1 leaves (a test)"))
        del work
        time.sleep(4.0)  # alive and beating while the others notice
    else:
        out["build"] = _outcome(lambda: t._new_group((1, 2), "never built by rank 1"))
    return out


@pytest.mark.dist
def test_a_rank_that_leaves_ends_its_peers_receives_and_group_creations(tmp_path):
    from ftbench.distributed.launch import launch

    results = launch(_leaving_rank, (), 3, TIMEOUT_S, 120.0, tmp_path, start_method="spawn")
    kind, seconds, message = results[1]["abandon"]
    assert kind == "done" and seconds < 2, (seconds, message)  # the collective in flight does not hold it
    kind, seconds, message = results[0]["receive"]
    assert kind == "ConnectionLost" and "the connection closed" in message, message
    assert 0.5 < seconds < 10, seconds
    kind, seconds, message = results[2]["build"]
    assert kind == "Told" and "build the process group 'never built by rank 1'" in message, message
    assert "told by rank 1 (rank 1 leaves (a test))" in message
    assert 0.5 < seconds < 10, seconds
    assert leftover_descendants() == []


def test_a_heartbeat_dates_the_last_beat(tmp_path):
    """The counter each beat moves is the wall-clock time of the beat, in ms: a survivor dates
    a death from it (measured_recoveries' death_to_regroup_s)."""
    from datetime import timedelta

    from ftbench.distributed.launch import free_port
    from ftbench.distributed.membership import STORE_ENV, Heartbeat, beats, last_beat_s

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STORE_ENV, f"127.0.0.1:{port}")
        from ftbench.distributed.membership import job_store

        store = job_store(5.0)
        beat = Heartbeat(7, 5.0).start()
        try:
            first = beats(store, [7])[7]
            time.sleep(0.3)
            assert beats(store, [7])[7] > first  # it moves
            assert abs(last_beat_s(store, [7])[7] - time.time()) < 1.0
        finally:
            beat.stop()
        time.sleep(0.3)
        stopped = last_beat_s(store, [7])[7]
        time.sleep(0.3)
        assert last_beat_s(store, [7])[7] == stopped and time.time() - stopped >= 0.25
    del server


def test_the_first_alarm_of_an_epoch_stands(tmp_path):
    from datetime import timedelta

    from ftbench.distributed.launch import free_port
    from ftbench.distributed.membership import Alarm

    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    store = dist.PrefixStore("test/", server)
    one, two = Alarm(store, 1), Alarm(store, 2)
    assert one.posted() is None
    assert one.post("a closed connection") == {"rank": 1, "why": "a closed connection"}
    assert two.post("told") == {"rank": 1, "why": "a closed connection"}  # the first stands
    two.epoch = 1
    assert two.posted() is None  # the next epoch starts without one


def test_a_waits_error_says_what_happened():
    """gloo's errors as what happened: a closed connection, or the deadline."""
    from ftbench.distributed.transport import ConnectionLost, DistTimeout, DistTransport

    t = DistTransport.__new__(DistTransport)
    t.timeout_s = 60.0
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. This is "
                          "typically caused by a remote worker crashing.")
    err = t._failure(closed, "worker 1 (rank 1)", "receive x")
    assert isinstance(err, ConnectionLost) and "waited more than" not in str(err)
    assert "the connection closed (Connection closed by peer [127.0.0.1]:4242)" in str(err)
    err = t._failure(RuntimeError("[../unbound_buffer.cc:78] Timed out waiting 60000ms for recv"), "rank 1", "x")
    assert isinstance(err, DistTimeout) and "waited more than 60 s (backend.timeout_s)" in str(err)


class _Work:
    """A gloo work whose timed look runs out ("Operation timed out!") and which completes right
    after, before is_completed() is asked (the race gloo's Work::wait leaves open); `error`: the
    collective itself failed."""

    def __init__(self, completes: bool, error: Exception | None = None):
        self.completes, self.error = completes, error

    def wait(self, timeout=None):
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.completes


def test_a_look_that_runs_out_as_the_collective_completes_is_no_failure():
    """Issue 36: a joining rank's first loss sum failed as "gloo reported a timeout after 0.5 s"
    when its second 0.25 s look ran out just before the sum completed (1 look in 2000 on 1 ms
    looks in a two-process gloo test); the sum's own outcome counts, not the look's."""
    from ftbench.distributed.transport import _waited

    assert _waited(_Work(completes=False), 0.25) is False  # still running: look again
    assert _waited(_Work(completes=True), 0.25) is True  # completed meanwhile: done
    failed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # its own error, not the look's
        _waited(_Work(completes=True, error=failed), 0.25)


RANK_MAIN = """
import atexit, sys, threading, time
from ftbench.distributed.worker import rank_main

atexit.register(print, "torn down")  # what the process's teardown would run: it must not

def work(fail):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # still busy at exit
    print("work done", flush=False)  # exit_now flushes it
    if fail:
        raise RuntimeError("rank breaks (a test)")
    return 7

print("returned", rank_main(work, sys.argv[1] == "fail"), flush=False)
"""


@pytest.mark.dist
@pytest.mark.parametrize("fail", [False, True])
def test_a_rank_ends_at_once_with_its_status_and_its_output(tmp_path, fail):
    """rank_main's exit (worker.exit_now): the rank's status and its unflushed output, without
    the process's teardown (where gloo aborted under a group still closing in a thread)."""
    import subprocess
    import sys

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RANK_MAIN, "fail" if fail else "ok"], capture_output=True,
                          text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert "work done" in done.stdout and "torn down" not in done.stdout
    if fail:
        assert done.returncode == 1 and "rank breaks (a test)" in done.stderr
    else:
        assert done.returncode == 0 and "returned 7" in done.stdout, done.stderr


class _Beats:
    """A store whose rank 0 beats at every look and whose rank 1 is silent."""

    def __init__(self):
        self.count = 0

    def add(self, key, amount):
        if key == "hb/0":
            self.count += 1
            return self.count
        return 42


def test_detection_goes_on_from_the_silence_a_failed_wait_watched():
    """detect() counts the silence the wait's Liveness already saw (issue 29: a death while
    every survivor builds a group with the dead rank is noticed by silence, not a closed
    connection), and only for the beat it saw: a beat that has moved since starts over."""
    from ftbench.distributed.membership import SETTLE_S, STALE_S, detect

    started = time.perf_counter()
    dead, took = detect(_Beats(), [0, 1], 30.0, observed={1: (42, started - STALE_S)})
    assert dead == {1} and took < SETTLE_S + 0.5, took  # not the STALE_S of watching again
    dead, took = detect(_Beats(), [0, 1], 30.0, observed={1: (41, started - STALE_S)})
    assert dead == {1} and took >= STALE_S + SETTLE_S, took
