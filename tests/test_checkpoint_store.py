import re
import threading
import warnings

import pytest
import torch

import ftbench.checkpoint as ckpt
from ftbench.checkpoint import CheckpointStore, CheckpointWarning


class Opaque:
    """An arbitrary Python object: pickle can save it, weights_only loading must refuse it."""

    def __init__(self):
        self.x = 1


def stage_state(seed: int) -> dict:
    """A stage shard as a strategy builds it: model state dict + AdamW state keyed by name."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = [name for name, _ in model.named_parameters()]
    raw = opt.state_dict()
    optim = {
        "state": {names[i]: state for i, state in raw["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                         for g in raw["param_groups"]],
    }
    return {"model": model.state_dict(), "optim": optim, "iteration": seed, "note": "x"}


def shards(seed: int = 0) -> dict:
    return {"stage0": stage_state(seed), "stage1": stage_state(seed + 100)}


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path):
    store = CheckpointStore(tmp_path)
    data = shards()
    info = store.save(7, data)
    folder = tmp_path / "iter_00000007"
    assert info.iteration == 7 and info.path == folder and info.seconds >= 0
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "stage0.pt", "stage1.pt"]
    assert info.bytes == sum(p.stat().st_size for p in folder.iterdir())
    iteration, loaded = store.load()
    assert iteration == 7
    assert_same(loaded, data)
    assert isinstance(loaded["stage0"]["optim"]["state"]["0.weight"]["step"], torch.Tensor)


def test_load_uses_weights_only(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(1, shards())
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert store.load()[0] == 1
    assert calls == [True, True]


def test_arbitrary_object_is_not_loaded(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, shards())
    store.save(2, {"stage0": {"evil": Opaque()}})
    with pytest.warns(CheckpointWarning, match=r"iter_00000002.stage0\.pt: torch\.load failed"):
        assert store.load()[0] == 1


def test_truncated_shard_falls_back(tmp_path):
    store = CheckpointStore(tmp_path)
    first = shards(1)
    store.save(1, first)
    store.save(2, shards(2))
    bad = tmp_path / "iter_00000002" / "stage1.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.warns(CheckpointWarning, match=re.escape(str(bad)) + ".*falling back"):
        iteration, loaded = store.load()
    assert iteration == 1
    assert_same(loaded, first)


def test_flipped_byte_is_a_checksum_mismatch(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, shards(1))
    store.save(2, shards(2))
    bad = tmp_path / "iter_00000002" / "stage0.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match=re.escape(str(bad)) + ": sha256 mismatch"):
        assert store.load()[0] == 1


def test_missing_manifest_is_skipped(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, shards(1))
    store.save(2, shards(2))
    (tmp_path / "iter_00000002" / "manifest.json").unlink()
    assert store.iterations() == [1]
    with pytest.warns(CheckpointWarning, match="partial write"):
        assert store.load()[0] == 1


def test_nothing_valid_is_none(tmp_path):
    store = CheckpointStore(tmp_path / "new")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load() is None  # root does not even exist
    store.save(1, shards())
    (tmp_path / "new" / "iter_00000001" / "stage0.pt").unlink()
    with pytest.warns(CheckpointWarning, match="stage0.pt: cannot read"):
        assert store.load() is None


def test_keep_prunes_and_at_most(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for it in (10, 20, 30, 40):
        store.save(it, shards(it))
    assert store.iterations() == [40, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_00000030", "iter_00000040"]
    assert store.load(at_most=39)[0] == 30
    assert store.load(at_most=40)[0] == 40
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(at_most=29) is None


def test_resave_replaces_and_drops_abandoned_newer(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for it in (1, 2, 3):
        store.save(it, shards(it))
    store.save(2, {"stage9": {"w": torch.ones(2)}})  # training resumed from 1, reached 2 again
    assert store.iterations() == [2, 1]
    assert sorted(p.name for p in (tmp_path / "iter_00000002").iterdir()) == [
        "manifest.json", "stage9.pt"]
    iteration, loaded = store.load()
    assert iteration == 2 and loaded.keys() == {"stage9"}


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "stage 0", "é"])
def test_unsafe_shard_names_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="safe file name"):
        CheckpointStore(tmp_path).save(1, {name: {}})


def test_save_async_result_after_wait(tmp_path):
    store = CheckpointStore(tmp_path)
    data = shards()
    pending = store.save_async(5, data)
    assert pending.iteration == 5
    info = store.wait()
    assert pending.done() and pending.result() is info
    assert info.iteration == 5 and info.bytes > 0
    assert store.wait() is None
    assert_same(store.load()[1], data)


def test_second_save_async_waits_for_first(tmp_path, monkeypatch):
    release = threading.Event()
    real_write = ckpt._write_file

    def slow_write(path, data, *durable):
        if "iter_00000001" in str(path):
            assert release.wait(10)
        real_write(path, data, *durable)

    monkeypatch.setattr(ckpt, "_write_file", slow_write)
    store = CheckpointStore(tmp_path)
    first = store.save_async(1, shards(1))
    second_returned = threading.Event()

    def second():
        store.save_async(2, shards(2))
        second_returned.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_returned.wait(0.3)  # blocked on the first persist
    assert not first.done() and not (tmp_path / "iter_00000002").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load() is None  # the folder being written is not reported as broken
    release.set()
    thread.join(10)
    assert second_returned.is_set() and first.done()
    assert store.wait().iteration == 2
    assert store.iterations() == [2, 1]


def test_failed_persist_is_reraised(tmp_path, monkeypatch):
    def broken_write(path, data, *durable):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_file", broken_write)
    store = CheckpointStore(tmp_path)

    store.save_async(1, shards())
    with pytest.raises(OSError, match="disk full"):
        store.wait()
    assert store.wait() is None  # reported once, then gone

    store.save_async(2, shards())
    with pytest.raises(OSError, match="disk full"):
        store.save_async(3, shards())  # the next snapshot surfaces the previous failure

    pending = store.save_async(4, shards())
    with pytest.raises(OSError, match="disk full"):
        pending.result()
    assert store.wait() is None  # the caller already saw it via result()


def test_clear(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.save(1, shards())
    store.save_async(2, shards())
    store.clear()
    assert store.iterations() == [] and list((tmp_path / "ck").iterdir()) == []
    assert store.load() is None
