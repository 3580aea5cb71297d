"""yrcache.torch: CachedDataset and StoreDataset behind a real DataLoader.

DataLoader tests run workers under ``fork`` and ``spawn`` (the ``mp_context``
fixture); datasets live at module level so spawned workers can unpickle them.
Sample counts and sizes are tiny: a spawned worker's cost is importing torch.
Every loader is shut down before its test ends (``shut``), since the
``_no_leftover_children`` fixture fails a test that leaves a worker running.
"""

from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import pickle
import subprocess
import sys
import textwrap
import time
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, default_collate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from yrcache import StoreFullError, TieredStore  # noqa: E402
from yrcache.torch import CachedDataset, StoreDataset  # noqa: E402
from procs import seg_exists  # noqa: E402

N = 8
SLEEP = 0.02


# ------------------------------------------------------------------ datasets


class SlowDataset:
    """Sample ``i`` is ``(tensor filled with i, i)``; each call sleeps and counts itself."""

    def __init__(self, calls, n: int = N, shape: tuple[int, ...] = (4, 4), sleep: float = SLEEP):
        self.calls = calls          # a multiprocessing Value: calls across all workers
        self.n = n
        self.shape = shape
        self.sleep = sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        time.sleep(self.sleep)
        with self.calls.get_lock():
            self.calls.value += 1
        return torch.full(self.shape, float(i)), i


class NestedDataset:
    """Samples mixing every supported leaf type, nested."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return nested_sample(i)


def nested_sample(i: int):
    return {
        "image": torch.arange(48, dtype=torch.uint8).reshape(3, 4, 4) + i,
        "pair": (np.full((2, 3), i, dtype=np.float16), torch.tensor([i, -i], dtype=torch.bfloat16)),
        "label": i,
        "name": f"sample-{i}",
        "raw": bytes([i]) * 3,
        "score": np.float32(i) / 2,
        "flags": [True, None, 1.5],
    }


class CountingList:
    """A list-backed dataset that counts calls (in-process tests)."""

    def __init__(self, items):
        self.items = items
        self.calls = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        self.calls += 1
        return self.items[i]


# ------------------------------------------------------------------ helpers


def shut(loader: DataLoader) -> None:
    """Stop a loader's (persistent) workers now; fail if any is left."""
    it = loader._iterator
    loader._iterator = None
    if it is not None:
        it._shutdown_workers()
    del it
    gc.collect()
    left = multiprocessing.active_children()
    assert not left, f"DataLoader workers still running: {left}"


def same(a, b) -> None:
    """``a`` and ``b`` are equal samples: same structure, types, dtypes, shapes, values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if a.numel():      # as bytes: bfloat16, float8 and NaNs compare too
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):    # a numpy scalar (NaN included): as bytes
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b, (a, b)


def as_read(x, to_tensor: bool = True):
    """What CachedDataset should give back for a sample the dataset produced."""
    if isinstance(x, tuple):
        return tuple(as_read(v, to_tensor) for v in x)
    if isinstance(x, list):
        return [as_read(v, to_tensor) for v in x]
    if isinstance(x, dict):
        return {k: as_read(v, to_tensor) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().resolve_conj()
    if isinstance(x, np.ndarray):
        native = x.astype(x.dtype.newbyteorder("="), order="C")      # (0-d stays 0-d)
        return torch.from_numpy(native.copy()) if to_tensor else native
    if isinstance(x, (bytearray, memoryview)):
        return bytes(x)
    return x


class OpLog(TorchDispatchMode):
    """Records every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------- DataLoader


def test_second_epoch_is_served_from_the_store(mp_context, make_store):
    """fork and spawn, two workers, persistent: epoch 2 never calls the dataset and
    returns the same batches as epoch 1."""
    store = make_store(dram="16MiB")
    calls = mp_context.Value("i", 0)
    ds = CachedDataset(SlowDataset(calls), store, key="slow/")
    loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context=mp_context)
    try:
        t0 = time.perf_counter()
        first = list(loader)
        t1 = time.perf_counter()
        assert calls.value == N
        assert sorted(store.keys(prefix="slow/")) == sorted(f"slow/{i}" for i in range(N))
        second = list(loader)
        t2 = time.perf_counter()
        assert calls.value == N, "the second epoch called the dataset: it was not served from the store"
        assert ds.stats() == {"hits": N, "misses": N, "uncached": 0}
        assert len(first) == len(second) == N // 2
        for (x1, y1), (x2, y2) in zip(first, second):
            assert x1.dtype == x2.dtype == torch.float32 and x1.shape == x2.shape == (2, 4, 4)
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert [int(v) for _, y in second for v in y] == list(range(N))
        assert torch.equal(second[1][0][0], torch.full((4, 4), 2.0))
        print(f"{mp_context.get_start_method()}: epoch 1 {t1 - t0:.3f}s, epoch 2 {t2 - t1:.3f}s")
    finally:
        shut(loader)
    assert seg_exists(store.name), "a worker's exit removed the store it only attached to"


def test_store_dataset_over_a_prefix(mp_context, make_store):
    """Keys listed once, sorted; numpy values become tensors; fork and spawn workers."""
    store = make_store(dram="16MiB")
    for i in (3, 0, 2, 1):
        store[f"feat/{i:02d}"] = np.full(5, i, dtype=np.int32)
    store["other/0"] = np.zeros(5, dtype=np.int32)
    ds = StoreDataset(store, prefix="feat/")
    assert len(ds) == 4 and [ds.key_of(i) for i in range(4)] == [f"feat/{i:02d}" for i in range(4)]
    store["feat/99"] = np.zeros(5, dtype=np.int32)        # after the listing: not served
    loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context=mp_context)
    try:
        for _ in range(2):
            batches = list(loader)
            assert [b.dtype for b in batches] == [torch.int32, torch.int32]
            assert torch.equal(torch.cat(batches), torch.arange(4, dtype=torch.int32)[:, None].expand(4, 5))
    finally:
        shut(loader)


def test_same_index_in_several_workers_at_once(make_store):
    """Workers producing one index concurrently (a sampler with repeats) agree, and a
    batch holding one missing index several times computes it once."""
    store = make_store(dram="16MiB")
    ctx = multiprocessing.get_context("fork")
    order = [0, 0, 1, 1, 0, 1, 2, 2, 2, 0]
    calls = ctx.Value("i", 0)
    ds = CachedDataset(SlowDataset(calls, n=3), store, key="dup/")
    loader = DataLoader(ds, batch_size=1, sampler=order, num_workers=2, multiprocessing_context=ctx)
    bcalls = ctx.Value("i", 0)
    bds = CachedDataset(SlowDataset(bcalls, n=3), store, key="dupb/")
    batched = DataLoader(bds, batch_size=5, sampler=order, num_workers=2, multiprocessing_context=ctx)
    try:
        assert [int(y) for _, y in loader] == order
        xs, ys = zip(*batched)
        assert torch.equal(torch.cat(xs)[:, 0, 0], torch.tensor(order, dtype=torch.float32))
        assert torch.cat(ys).tolist() == order
    finally:
        shut(loader)
        shut(batched)
    assert sorted(store.keys(prefix="dup/")) == ["dup/0", "dup/1", "dup/2"]
    s = ds.stats()
    assert s["hits"] + s["misses"] == len(order) and s["misses"] == calls.value <= 2 * 3
    s = bds.stats()
    assert s["hits"] + s["misses"] == len(order) and s["misses"] == bcalls.value <= 2 * 3


def test_no_segment_left_when_the_script_ends(store_name, tmp_path):
    """A script that owns a store and leaves a loader with live persistent workers
    exits normally: nothing under /dev/shm stays, and no warning is printed."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np, torch
        from torch.utils.data import DataLoader
        from yrcache import TieredStore
        from yrcache.torch import CachedDataset, StoreDataset

        class Data:
            def __len__(self):
                return 6
            def __getitem__(self, i):
                return np.full((3, 3), i, np.float64), {{"y": i}}

        if __name__ == "__main__":
            store = TieredStore(name={store_name!r}, dram="16MiB")      # never closed explicitly
            ds = CachedDataset(Data(), store, key="d/")
            loader = DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True,
                                multiprocessing_context="fork")
            for epoch in range(2):
                for x, y in loader:
                    assert x.dtype == torch.float64 and x.shape == (3, 3, 3)
            assert ds.stats() == {{"hits": 6, "misses": 6, "uncached": 0}}, ds.stats()
            for i in range(4):
                store[f"arr/{{i}}"] = np.arange(4, dtype=np.float32) + i
            arrays = DataLoader(StoreDataset(store, prefix="arr/"), batch_size=2, num_workers=2,
                                multiprocessing_context="fork")
            assert [b.shape for b in arrays] == [(2, 4), (2, 4)]
            print("done", flush=True)
    """))
    r = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stdout + r.stderr
    assert r.stderr == "", r.stderr
    assert not seg_exists(store_name), f"the script left /dev/shm/yrcache.{store_name} behind"


def test_import_does_not_import_torch():
    code = "import sys, yrcache.torch\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------ in-process


@pytest.mark.parametrize("batched", [False, True])
def test_nested_samples_round_trip(make_store, batched):
    """Tuples, lists, dicts of tensors (bfloat16 too), arrays, numpy scalars, bytes,
    str, int, float, bool and None come back equal, with their dtypes and shapes,
    on the miss and on every hit; ndarrays as tensors by default."""
    store = make_store(dram="16MiB")
    samples = [
        nested_sample(0),
        (torch.arange(12, dtype=torch.float64).reshape(3, 4).t(), 7),           # non-contiguous
        [torch.tensor(3.5), torch.empty(0, 3, dtype=torch.int64), torch.tensor([True, False])],
        {"be": np.arange(6, dtype=">i4").reshape(2, 3), "strided": np.arange(20.0)[::3],
         "c": np.array([1 + 2j, 3 - 4j], dtype=np.complex64), "u": np.arange(3, dtype=np.uint16)},
        (np.int16(-3), np.bool_(True), float("nan"), -0.0, 2**70, "", b"", bytearray(b"xy"), None),
        torch.randn(64, 64),                                                  # 16 KiB: a pinned view
        (torch.tensor([1 + 1j], dtype=torch.complex64).conj(), torch.zeros(2, dtype=torch.float8_e4m3fn)),
    ]
    data = CountingList(samples)
    ds = CachedDataset(data, store, key="n/")
    for _ in range(3):
        got = ds.__getitems__(list(range(len(samples)))) if batched else [ds[i] for i in range(len(samples))]
        for want, have in zip(samples, got):
            same(as_read(want), have)
    assert data.calls == len(samples)
    assert ds.stats() == {"hits": 2 * len(samples), "misses": len(samples), "uncached": 0}
    arrays = CachedDataset(samples, store, key="a/", to_tensor=False)
    for i in (3, 3):
        got = arrays[i]
        same(as_read(samples[i], to_tensor=False), got)
        assert not got["be"].flags.writeable
    assert type(arrays[4][0]) is np.int16 and type(arrays[4][1]) is np.bool_


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8"]
numpy_leaves = arrays(dtype=st.sampled_from(DTYPES), shape=array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
tensor_leaves = st.one_of(
    numpy_leaves.map(lambda a: torch.from_numpy(a.astype(a.dtype.newbyteorder("="))).clone()),
    numpy_leaves.filter(lambda a: a.dtype in (np.float16, np.float32)).map(lambda a: torch.from_numpy(a.astype(np.float32)).bfloat16()))
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                   st.binary(max_size=16), numpy_leaves, tensor_leaves,
                   numpy_leaves.filter(lambda a: a.ndim == 0 and a.dtype.isnative).map(lambda a: a[()]))
samples_strategy = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=5), kids, max_size=3)), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sample=samples_strategy, to_tensor=st.booleans())
def test_any_sample_round_trips(make_store, sample, to_tensor):
    """Property: whatever nesting of supported values a dataset returns comes back
    equal (types, dtypes, shapes, bytes), on the miss and on a hit."""
    store = getattr(make_store, "shared", None)
    if store is None:                      # one store for every example of this run
        store = make_store.shared = make_store(dram="16MiB")
    ds = CachedDataset([sample], store, key=f"h/{store.stats()['puts']}/", to_tensor=to_tensor)
    same(as_read(sample, to_tensor), ds[0])
    same(as_read(sample, to_tensor), ds[0])
    assert ds.stats() == {"hits": 1, "misses": 1, "uncached": 0}


def test_views_are_zero_copy_and_collate_copies_once(make_store):
    """A hit is a view of the stored bytes (two reads share one address, its pages
    are pinned); default_collate copies each tensor once (one stack), and a
    numpy leaf no more (it came back as a tensor); nothing warns."""
    store = make_store(dram="16MiB")
    samples = [(torch.full((32, 32), float(i)), np.full((16, 16), i, np.float32), i) for i in range(4)]
    ds = CachedDataset(samples, store, key="z/")
    for i in range(4):
        ds[i]
    a, b = ds[2], ds[2]
    assert a[0].data_ptr() == b[0].data_ptr() and a[1].data_ptr() == b[1].data_ptr()
    assert store.stats()["pinned_bytes"] >= 32 * 32 * 4
    del a, b
    gc.collect()
    assert store.stats()["pinned_bytes"] == 0
    batch = ds.__getitems__([0, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with OpLog() as log:
            x, arr, y = default_collate(batch)
    assert [op for op in log.ops if op not in ("lift_fresh",)] == ["stack", "stack"], log.ops
    assert torch.equal(x[3], samples[3][0]) and torch.equal(arr[1], torch.from_numpy(samples[1][1]))
    assert y.tolist() == [0, 1, 2, 3]


COPYING_OPS = {"stack", "cat", "copy_", "clone", "_to_copy", "contiguous", "index_select"}


def logged_collate(store, batch):
    """default_collate, returning the aten ops it ran too, and whether every sample's
    tensors lie inside the store object of their key (runs in the worker)."""
    def inside(t, blob):
        return blob.data_ptr() <= t.data_ptr() < blob.data_ptr() + blob.numel()

    views = True
    for x, arr, y in batch:
        blob = store.get(f"w/{y}")
        views = views and inside(x, blob) and inside(arr, blob)
    with OpLog() as log:
        out = default_collate(batch)
    return out, log.ops, views


def test_worker_collation_copies_each_sample_once(make_store):
    """In a worker, default_collate stacks the zero-copy views straight into torch's
    shared memory: one copying op per tensor field, and the batch is not copied
    again on its way to the main process."""
    store = make_store(dram="16MiB")
    samples = [(torch.full((32, 32), float(i)), np.full(2048, i, np.float32), i) for i in range(4)]
    ds = CachedDataset(samples, store, key="w/")
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=functools.partial(logged_collate, store),
                        multiprocessing_context="fork")
    try:
        for _ in range(2):                      # a miss epoch, then a hit epoch
            ((x, arr, y), ops, views), = list(loader)
            assert views, "__getitems__ returned copies, not views of the stored samples"
            assert [op for op in ops if op in COPYING_OPS] == ["stack", "stack"], ops
            assert x.is_shared() and torch.equal(x[2], samples[2][0])
            assert arr.dtype == torch.float32 and torch.equal(arr[3], torch.from_numpy(samples[3][1]))
    finally:
        shut(loader)
    assert ds.stats() == {"hits": 4, "misses": 4, "uncached": 0}


def test_store_full_returns_the_sample_uncached(make_store):
    store = make_store(dram="1MiB")
    samples = [torch.full((128, 128), float(i)) for i in range(32)]      # 64 KiB each, 2 MiB in all
    data = CountingList(samples)
    ds = CachedDataset(data, store, key="f/")
    with pytest.warns(RuntimeWarning, match="is full") as record:
        got = [ds[i] for i in range(len(samples))]
    assert len([w for w in record if w.category is RuntimeWarning]) == 1
    for want, have in zip(samples, got):
        same(want, have)
    s = ds.stats()
    assert s["misses"] == 32 and s["uncached"] > 0 and s["hits"] == 0
    cached = set(store.keys(prefix="f/"))
    assert 0 < len(cached) == 32 - s["uncached"]
    with pytest.raises(StoreFullError):
        store.put("f/x", samples[0])         # the store really was full
    del got
    gc.collect()
    assert ds.clear() == len(cached) and not list(store.keys(prefix="f/"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds._local_full_until = 0.0           # (skip the one-second wait before putting again)
        same(samples[5], ds[5])
    assert "f/5" in store


def test_keys(make_store):
    store = make_store(dram="16MiB")
    a, b = CountingList([b"a", b"b"]), CountingList([b"c", b"d"])
    da, db = CachedDataset(a, store), CachedDataset(b, store)
    assert da.prefix != db.prefix and da.prefix.startswith("cached/")
    assert CachedDataset(a, store).prefix == da.prefix                # the same object: the same cache
    assert (da[1], db[1]) == (b"b", b"d")
    assert CachedDataset(a, store)[1] == b"b" and a.calls == 1
    assert da[-1] == b"b" and a.calls == 1
    assert CachedDataset(a, store, key="t/{:03d}").key_of(7) == "t/007"
    assert CachedDataset(a, store, key=hex).key_of(255) == "0xff"
    c = CachedDataset(a, store, key="c/", priority=-3, ttl=60)
    c[0]
    assert "c/0" in store and c.key_of(1) == "c/1"
    info = store.info("c/0")
    assert info["priority"] == -3 and info["expire_at"] > time.time() + 50
    with pytest.raises(ValueError, match="template"):
        CachedDataset(a, store, key="t/{name}")
    with pytest.raises(IndexError):
        CachedDataset(CountingList([1]), store, key="i/")[5]
    five = CachedDataset(CountingList([0, 1, 2, 3, 4]), store, key="n/")
    for bad in (-6, -9, 5):          # -6 read sample 4 and cached it as "n/-1"
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a dataset of 5"):
            five[bad]
        with pytest.raises(IndexError):
            five.__getitems__([0, bad])
    assert five[-5] == 0 and five.dataset.calls == 1 and not list(store.keys(prefix="n/-"))
    store["clash/0"] = np.zeros(3)
    with pytest.raises(ValueError, match="did not write"):
        CachedDataset(a, store, key="clash/")[0]


def test_unsupported_samples(make_store, store_name):
    store = make_store(dram="16MiB")
    for bad in [object(), {1: torch.zeros(1)}, np.array(["a"]), np.ma.masked_array([1, 2], mask=[0, 1]),
                (1, {2, 3})]:
        with pytest.raises(TypeError, match="cannot store|str keys"):
            CachedDataset([bad], store, key="bad/")[0]
    assert not list(store.keys(prefix="bad/"))
    pstore = make_store(name=store_name + "-p", dram="16MiB", pickle=True)
    ds = CachedDataset([(Fraction(1, 3), torch.ones(2), {3, 4})], pstore, key="p/")
    for _ in range(2):
        got = ds[0]
        assert got[0] == Fraction(1, 3) and got[2] == {3, 4} and torch.equal(got[1], torch.ones(2))
    plain = TieredStore.attach(pstore.name)        # a handle without pickle=True refuses to unpickle
    try:
        with pytest.raises(PermissionError, match="pickle=True"):
            CachedDataset([None], plain, key="p/")[0]
    finally:
        plain.close()


def test_datasets_pickle_and_are_torch_datasets(make_store):
    store = make_store(dram="16MiB")
    ds = CachedDataset(CountingList([torch.ones(3)]), store, key="k/")
    sd = StoreDataset(store, keys=["k/0", "missing"], transform=lambda v: v)
    for obj in (ds, sd):
        assert isinstance(obj, torch.utils.data.Dataset)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert isinstance(clone, CachedDataset) and isinstance(clone, torch.utils.data.Dataset)
    assert clone.key == "k/" and torch.equal(clone[0], torch.ones(3))
    assert ds.stats() == clone.stats() == {"hits": 1, "misses": 1, "uncached": 0}   # counters are shared
    clone.store.close()
    both = ds + ds
    assert len(both) == 2
    with pytest.raises(KeyError, match="no longer in store"):
        sd[1]
    sd2 = pickle.loads(pickle.dumps(StoreDataset(store, keys=["k/0"])))
    assert sd2.key_of(0) == "k/0"
    sd2.store.close()


def test_store_dataset_values(make_store):
    store = make_store(dram="16MiB")
    store["b"] = b"bytes"
    store["a"] = np.arange(3, dtype=np.int8)
    store["t"] = torch.arange(3, dtype=torch.bfloat16)
    ds = StoreDataset(store, keys=["t", "a", "b"])
    assert [ds.key_of(i) for i in range(3)] == ["t", "a", "b"]
    t, a, b = (ds[i] for i in range(3))
    assert t.dtype == torch.bfloat16 and torch.equal(t, torch.arange(3, dtype=torch.bfloat16))
    assert a.dtype == torch.int8 and a.tolist() == [0, 1, 2]
    assert b == b"bytes" and type(b) is bytes
    assert isinstance(StoreDataset(store, keys=["a"], to_tensor=False)[0], np.ndarray)
    assert StoreDataset(store, keys=["a"], transform=lambda v: v.sum().item())[0] == 3
    store["big"] = np.zeros(4096, dtype=np.float32)          # 16 KiB: a view of the shared pages
    c = StoreDataset(store, keys=["big"], copy=True)[0]
    c += 1
    assert not store["big"].any()
    assert len(StoreDataset(store)) == 4
    assert ds.__getitems__([2, 0])[0] == b"bytes"
    with pytest.raises(ValueError, match="no keys under prefix"):
        StoreDataset(store, prefix="nothing/")
    with pytest.raises(ValueError, match="not both"):
        StoreDataset(store, keys=["a"], prefix="a")
    with pytest.raises(TypeError, match="prefix="):
        StoreDataset(store, keys="a")
    with pytest.raises(IndexError):
        ds[3]


def test_datasets_made_again_for_one_key_reuse_their_counters(make_store):
    """Every CachedDataset object made three named words of its own, never freed: 2,000
    short-lived datasets took 1.5 MiB of the store, and a 16 MiB store filled with words
    alone. Datasets of one key string share three words now; stats() counts from the
    moment each object was made."""
    s = make_store(dram="16MiB")
    CachedDataset([b"a", b"b"], s, key="a/")[0]
    used = s.stats()["tiers"]["dram"]["used"]
    for _ in range(500):
        ds = CachedDataset([b"a", b"b"], s, key="a/")
        ds[0]
        ds[1]
    assert s.stats()["tiers"]["dram"]["used"] - used < 4096             # sample a/1, no new words
    assert ds.stats() == {"hits": 2, "misses": 0, "uncached": 0}
    fresh = CachedDataset([b"a", b"b"], s, key="a/")
    assert fresh.stats() == {"hits": 0, "misses": 0, "uncached": 0}
    fresh[0]
    assert fresh.stats()["hits"] == 1 and ds.stats()["hits"] == 3      # alive together: shared counts


def test_a_wrapped_getitems_that_returns_too_few_samples_is_an_error(make_store):
    """zip() cut the batch short and the missing samples came back as None."""
    class Short:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return b"x%d" % i

        def __getitems__(self, idx):
            return [self[i] for i in idx][:-1]

    ds = CachedDataset(Short(), make_store(dram="16MiB"), key="short/")
    with pytest.raises(ValueError, match="returned 2 samples for 3 indices"):
        ds.__getitems__([0, 1, 2])


def test_an_iterable_without_an_index_is_refused_at_once(make_store):
    """CachedDataset(iter(samples), ...) was accepted and failed later, at len()."""
    with pytest.raises(TypeError, match="wraps a map-style dataset"):
        CachedDataset(iter([b"a", b"b"]), make_store(dram="16MiB"), key="it/")
