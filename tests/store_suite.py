"""A conformance suite for anything that claims to be a yrcache store.

Like zarr's ``StoreTests``: subclass :class:`StoreSuite` in a ``test_*.py``
module and provide the ``store_factory`` fixture::

    class TestEmbeddedStore(StoreSuite):
        @pytest.fixture
        def store_factory(self, ...):
            def make(**kw):          # kw: only ``pickle=True`` is ever passed
                return <a fresh, empty, open store>
            yield make
            <close/destroy every store made>

``store`` (a fresh store) and ``pickle_store`` (``pickle=True``) are derived
from it; a subclass may override them too.  Class attributes describe what
the store under test is expected to do:

* ``default_tier``   -- the ``Tier`` a plain ``put`` lands in, or ``None`` to
  accept any tier;
* ``has_check``      -- the store offers ``check()`` (internal invariants);
* ``local_views``    -- views pin memory of this process (``pinned_bytes``
  moves while a view is alive);
* ``copies``         -- how many copies of each object ``stats()["tiers"]``
  counts (a cluster's replicas).

Only the public API (README, docs/architecture.md) is used here, so the same tests
run against other tiers and against a cluster.
"""

from __future__ import annotations

import gc
import pickle
import random
import time
import unittest
from collections import Counter

import numpy as np
import pytest

from yrcache import Tier, codec

try:  # torch is a test dependency, but keep the non-torch tests usable without it
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device")

NUMPY_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "longdouble", "complex64", "complex128", "clongdouble",
]

TORCH_DTYPES = [
    "bfloat16", "float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
]

# a large payload takes the reserve/fill/commit path, a small one the one-call path
SMALL = 1000
LARGE = 200_000


# ---------------------------------------------------------------- helpers


def sample_array(dtype, shape=(3, 5), seed=0) -> np.ndarray:
    """Deterministic, NaN-free values of ``dtype`` (exercising every byte)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "b":
        a = rng.integers(0, 2, n).astype(bool)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    elif dt.kind == "f":
        a = (rng.standard_normal(n) * 1000).astype(dt)
    else:  # complex
        a = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    return a.reshape(shape)


def sample_tensor(name: str, shape=(4, 6), seed=0):
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        if dtype.itemsize == 1:  # float8: build from float32, no randn kernel
            return (torch.randn(shape, generator=g) * 4).to(dtype)
        return torch.randn(shape, dtype=dtype, generator=g) * 100
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def tensor_bytes(t) -> bytes:
    """The raw bytes of a tensor (works for every dtype, bool and float8 included)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_tensor_same(got, want) -> None:
    assert isinstance(got, torch.Tensor), type(got)
    assert got.device.type == "cpu"
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert tensor_bytes(got) == tensor_bytes(want)


def assert_array_same(got, want) -> None:
    assert isinstance(got, np.ndarray), type(got)
    assert got.shape == want.shape
    assert got.dtype == want.dtype.newbyteorder("=")
    np.testing.assert_array_equal(got, want)


def assert_value_same(got, want) -> None:
    """Compare a value read back from a store with what was put."""
    if torch is not None and isinstance(want, torch.Tensor):
        assert_tensor_same(got, want)
    elif isinstance(want, np.ndarray):
        assert_array_same(got, want)
    elif isinstance(want, (bytes, bytearray, memoryview)):
        assert isinstance(got, memoryview), type(got)
        assert got.readonly
        assert got.tobytes() == bytes(want)
    else:
        assert got == want


def drop(*_):
    """Run the collector so that dropped views really unpin."""
    gc.collect()


class Thing:
    """A plain picklable object for ``pickle=True`` stores."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Thing) and other.x == self.x

    def __hash__(self):
        return hash(repr(self.x))

    def __repr__(self):
        return f"Thing({self.x!r})"


def run_side_by_side(store, seed: int, steps: int = 400) -> None:
    """Drive ``store`` and a ``dict`` with the same operations; results must match."""
    rnd = random.Random(seed)
    ref: dict = {}
    keys = [f"k{i}" for i in range(12)] + ["ключ", "键/🔑"]
    values = [0, 1, -5, 2**70, 1.5, "", "text", "ü" * 10, (1, 2), [1, [2, 3]], {"a": 1},
              None, True, b"raw", Thing(3), frozenset({1, 2})]

    def same(what, a, b):
        assert a == b, f"step {step} ({what}): store gave {a!r}, dict gave {b!r}"

    def norm(x):  # bytes come back as read-only memoryviews
        return x.tobytes() if isinstance(x, memoryview) else x

    def outcome(fn):
        try:
            return ("ok", fn())
        except KeyError as e:
            return ("KeyError", e.args)

    for step in range(steps):  # noqa: B007 - read by same() in its messages
        op = rnd.choice(["set", "set", "set", "getitem", "get", "get_default", "del", "pop",
                         "pop_default", "setdefault", "update", "update_kw", "contains",
                         "len", "popitem", "eq", "views"])
        k = rnd.choice(keys)
        v = rnd.choice(values)
        if op == "set":
            store[k] = v
            ref[k] = v
        elif op == "getitem":
            same(op, outcome(lambda: norm(store[k])), outcome(lambda: ref[k]))
        elif op == "get":
            same(op, norm(store.get(k)), ref.get(k))
        elif op == "get_default":
            same(op, norm(store.get(k, "dflt")), ref.get(k, "dflt"))
        elif op == "del":
            def d(m):
                del m[k]
            same(op, outcome(lambda: d(store)), outcome(lambda: d(ref)))
        elif op == "pop":
            same(op, outcome(lambda: norm(store.pop(k))), outcome(lambda: ref.pop(k)))
        elif op == "pop_default":
            same(op, norm(store.pop(k, 404)), ref.pop(k, 404))
        elif op == "setdefault":
            same(op, norm(store.setdefault(k, v)), ref.setdefault(k, v))
        elif op == "update":
            other = {rnd.choice(keys): rnd.choice(values) for _ in range(3)}
            if rnd.random() < 0.5:
                store.update(other)
                ref.update(other)
            else:
                store.update(list(other.items()))
                ref.update(list(other.items()))
        elif op == "update_kw":
            store.update(kw1=v, kw2=k)
            ref.update(kw1=v, kw2=k)
        elif op == "contains":
            same(op, k in store, k in ref)
        elif op == "len":
            same(op, len(store), len(ref))
        elif op == "popitem":
            if not ref:
                with pytest.raises(KeyError):
                    store.popitem()
            else:
                pk, pv = store.popitem()
                assert pk in ref, f"popitem returned {pk!r}, not a key of the store"
                same(op, norm(pv), ref.pop(pk))
                assert pk not in store
        elif op == "eq":
            assert store == ref
            assert ref == store
            assert not (store != ref)
            if ref:
                assert store != {}
            assert store != {**ref, "zz-not-there": 1}
        elif op == "views":
            same("keys", sorted(store), sorted(ref))
            same("items", sorted((k2, repr(norm(v2))) for k2, v2 in store.items()),
                 sorted((k2, repr(v2)) for k2, v2 in ref.items()))
            same("values", Counter(repr(norm(v2)) for v2 in store.values()),
                 Counter(map(repr, ref.values())))
    assert store == ref
    assert dict(store) == ref


# ------------------------------------------------------------------ suite


class StoreSuite:
    """Conformance tests for a store; subclasses provide ``store_factory``."""

    default_tier: Tier | None = Tier.DRAM
    has_check = True
    local_views = True
    ttl_slack = 0.3  # seconds a ttl may outlive its nominal expiry
    copies = 1       # copies of each object the tiers' counts include (a cluster's replicas)

    # ------------------------------------------------------------ hooks

    @pytest.fixture
    def store_factory(self):
        raise NotImplementedError("subclasses of StoreSuite must provide a store_factory fixture")

    @pytest.fixture
    def store(self, store_factory):
        return store_factory()

    @pytest.fixture
    def pickle_store(self, store_factory):
        return store_factory(pickle=True)

    def check(self, store) -> None:
        if self.has_check:
            store.check()

    # ------------------------------------------------ put / get / []

    def test_put_then_get_and_getitem(self, store):
        assert store.put("a", b"hello") is None
        v = store.get("a")
        assert isinstance(v, memoryview) and v.readonly
        assert v.tobytes() == b"hello"
        assert store["a"].tobytes() == b"hello"
        store["b"] = b"world"
        assert store.get("b").tobytes() == b"world"

    def test_missing_key_dict_semantics(self, store):
        assert store.get("missing") is None
        sentinel = object()
        assert store.get("missing", sentinel) is sentinel
        assert store.get("missing", default=7) == 7
        with pytest.raises(KeyError) as ei:
            store["missing"]
        assert ei.value.args == ("missing",)
        store["present"] = b"x"
        assert store.get("present", sentinel) is not sentinel

    def test_overwrite_replaces_value_and_type(self, store):
        store["k"] = b"first"
        store["k"] = np.arange(5, dtype=np.int32)
        assert_array_same(store["k"], np.arange(5, dtype=np.int32))
        store["k"] = b""
        assert store["k"].tobytes() == b""
        assert len(store) == 1

    def test_large_and_small_payloads(self, store):
        for n in (0, 1, SMALL, 65535, 65536, 65537, LARGE, 3 * LARGE + 7):
            data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
            store[f"n{n}"] = data
        for n in (0, 1, SMALL, 65535, 65536, 65537, LARGE, 3 * LARGE + 7):
            data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
            assert store[f"n{n}"].tobytes() == data, n
        self.check(store)

    def test_get_copy_bytes_is_private_and_writable(self, store):
        store["b"] = b"abcdef"
        c = store.get("b", copy=True)
        mv = memoryview(c)
        assert not mv.readonly
        mv[0] = ord("Z")
        assert bytes(c) == b"Zbcdef"
        assert store["b"].tobytes() == b"abcdef"

    def test_get_copy_array_is_private_and_writable(self, store):
        a = sample_array("float64", (50, 40))
        store["a"] = a
        view = store["a"]
        c = store.get("a", copy=True)
        assert isinstance(c, np.ndarray) and c.flags.writeable
        assert not np.shares_memory(c, view)
        assert_array_same(c, a)
        c[...] = -1
        assert_array_same(store["a"], a)
        assert_array_same(view, a)

    def test_get_copy_missing_returns_default(self, store):
        assert store.get("nope", copy=True) is None
        assert store.get("nope", 5, copy=True) == 5

    @needs_torch
    def test_get_copy_tensor_is_private(self, store):
        t = torch.arange(100, dtype=torch.float32)
        store["t"] = t
        c = store.get("t", copy=True)
        assert_tensor_same(c, t)
        c += 1
        assert_tensor_same(store["t"], t)

    def test_put_copies_the_input(self, store):
        buf = bytearray(b"0123456789")
        arr = np.arange(10)
        store["buf"] = buf
        store["arr"] = arr
        buf[0] = ord("X")
        arr[0] = 99
        assert store["buf"].tobytes() == b"0123456789"
        assert store["arr"][0] == 0

    # --------------------------------------------------- bytes-like

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "memoryview_int32",
                                      "memoryview_2d", "memoryview_strided", "empty", "large"])
    def test_bytes_like_roundtrip_as_readonly_memoryview(self, store, kind):
        raw = bytes(range(256)) * 4
        value = {
            "bytes": raw,
            "bytearray": bytearray(raw),
            "memoryview": memoryview(raw),
            "memoryview_int32": memoryview(np.arange(256, dtype=np.int32)),
            "memoryview_2d": memoryview(np.arange(24, dtype=np.int16).reshape(4, 6)),
            "memoryview_strided": memoryview(np.arange(200, dtype=np.uint8))[::3],
            "empty": b"",
            "large": raw * 300,
        }[kind]
        expected = memoryview(value).tobytes()
        store["v"] = value
        got = store["v"]
        assert isinstance(got, memoryview)
        assert got.readonly
        assert got.nbytes == len(expected)
        assert got.tobytes() == expected
        with pytest.raises(TypeError):
            got[0:1] = b"\x00" if len(expected) else b""

    # --------------------------------------------------------- numpy

    @pytest.mark.parametrize("dtype", NUMPY_DTYPES)
    def test_numpy_dtypes_roundtrip(self, store, dtype):
        a = sample_array(dtype, (7, 9), seed=hash(dtype) % 1000)
        store["a"] = a
        got = store["a"]
        assert_array_same(got, a)
        assert got.dtype == np.dtype(dtype)
        assert not got.flags.writeable
        big = sample_array(dtype, (LARGE // np.dtype(dtype).itemsize + 3,), seed=1)
        store["big"] = big
        assert_array_same(store["big"], big)

    @pytest.mark.parametrize("dtype", ["float64", "int8", "bool", "complex64"])
    def test_numpy_zero_d_array_keeps_its_shape(self, store, dtype):
        a = np.array(sample_array(dtype, (1,))[0], dtype=dtype)
        assert a.shape == ()
        store["z"] = a
        got = store["z"]
        assert isinstance(got, np.ndarray)
        assert got.shape == (), f"0-d array came back with shape {got.shape}"
        assert got.dtype == a.dtype
        assert got[()] == a[()]
        assert store.get("z", copy=True).shape == ()

    @pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2), (2, 0)])
    def test_numpy_empty_arrays(self, store, shape):
        a = np.zeros(shape, dtype=np.float32)
        store["e"] = a
        got = store["e"]
        assert_array_same(got, a)
        assert got.size == 0

    @pytest.mark.parametrize("how", ["strided", "transposed", "fortran", "reversed",
                                     "sliced_2d", "broadcast"])
    def test_numpy_non_contiguous_stored_contiguous(self, store, how):
        base = np.arange(2 * 3 * 40, dtype=np.float64).reshape(6, 40)
        a = {
            "strided": base.reshape(-1)[::3],
            "transposed": base.T,
            "fortran": np.asfortranarray(base),
            "reversed": base[::-1, ::-1],
            "sliced_2d": base[1:5, 2::7],
            "broadcast": np.broadcast_to(np.arange(5.0), (4, 5)),
        }[how]
        store["a"] = a
        got = store["a"]
        assert got.flags.c_contiguous
        assert_array_same(got, a)

    @pytest.mark.parametrize("dtype", [">i2", ">i4", ">i8", ">u4", ">f4", ">f8", ">c8", ">c16"])
    def test_numpy_big_endian_values_preserved(self, store, dtype):
        a = sample_array(np.dtype(dtype).newbyteorder("="), (5, 7), seed=3).astype(dtype)
        assert a.dtype.byteorder == ">"
        store["be"] = a
        got = store["be"]
        # the values must be the same; the byte order may be the native one
        assert got.dtype.newbyteorder("=") == a.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, a)
        assert got.tolist() == a.tolist()

    def test_ndarray_view_is_read_only(self, store):
        store["a"] = np.arange(10)
        v = store["a"]
        assert not v.flags.writeable
        with pytest.raises(ValueError):
            v[0] = 5
        with pytest.raises(ValueError):
            v += 1
        # numpy lets the flag be turned back on when the memory underneath is
        # writable; a read-only view must not allow that (it would change the
        # stored object for every reader)
        with pytest.raises(ValueError):
            v.flags.writeable = True
        assert store["a"][0] == 0
        # the same for small values read by mget and for other shapes
        store["m"] = np.ones((2, 3))
        for got in [*store.mget(["a", "m"]), store["m"]]:
            with pytest.raises(ValueError):
                got.flags.writeable = True

    def test_memoryview_view_is_read_only(self, store):
        store["b"] = b"abc"
        v = store["b"]
        assert v.readonly
        with pytest.raises(TypeError):
            v[0] = 1
        assert store["b"].tobytes() == b"abc"

    # --------------------------------------------------------- torch

    @needs_torch
    @pytest.mark.parametrize("dtype", TORCH_DTYPES)
    def test_torch_dtypes_roundtrip(self, store, dtype):
        if not hasattr(torch, dtype):
            pytest.skip(f"torch {torch.__version__} has no {dtype}")
        t = sample_tensor(dtype, (5, 8), seed=len(dtype))
        store["t"] = t
        got = store["t"]
        assert_tensor_same(got, t)
        if dtype in ("float32", "int64", "bool", "bfloat16", "complex64"):
            assert torch.equal(got, t)
        big = sample_tensor(dtype, (LARGE // t.element_size() + 1,), seed=2)
        store["tbig"] = big
        assert_tensor_same(store["tbig"], big)

    @needs_torch
    def test_torch_zero_d_and_empty(self, store):
        for key, t in {"z": torch.tensor(2.5), "zi": torch.tensor(7, dtype=torch.int8),
                       "e": torch.empty(0, 3), "e2": torch.zeros(4, 0, dtype=torch.bfloat16)}.items():
            store[key] = t
            assert_tensor_same(store[key], t)

    @needs_torch
    @pytest.mark.parametrize("how", ["transposed", "strided", "offset", "permuted", "expanded"])
    def test_torch_non_contiguous(self, store, how):
        base = torch.arange(240, dtype=torch.float32).reshape(6, 40)
        t = {
            "transposed": base.T,
            "strided": base.reshape(-1)[::7],
            "offset": base[2:4],
            "permuted": base.reshape(2, 3, 40).permute(2, 0, 1),
            "expanded": torch.arange(5.0).expand(4, 5),
        }[how]
        store["t"] = t
        got = store["t"]
        assert got.is_contiguous()
        assert torch.equal(got, t)

    @needs_torch
    def test_torch_requires_grad_is_stored_as_data(self, store):
        t = torch.ones(3, requires_grad=True) * 2
        store["g"] = t
        got = store["g"]
        assert not got.requires_grad
        assert torch.equal(got, t.detach())

    @needs_cuda
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
    def test_cuda_tensor_roundtrip(self, store, dtype):
        t = sample_tensor(dtype, (33, 17), seed=4).cuda()
        store["t"] = t
        got = store["t"]
        # a CPU tensor over the stored bytes, or a device tensor if it lives in HBM
        assert got.device.type in ("cpu", "cuda")
        assert_tensor_same(got.cpu(), t.cpu())
        out = torch.empty_like(t)
        assert store.get_into("t", out) is out
        assert out.device == t.device
        assert_tensor_same(out.cpu(), t.cpu())
        with pytest.raises(ValueError):
            store.get_into("t", torch.empty(17, 33, dtype=t.dtype, device=t.device))

    # ------------------------------------------------- view lifetime

    def test_views_survive_overwrite_delete_and_reuse(self, store):
        a = sample_array("float32", (LARGE // 4,), seed=5)
        store["k"] = a
        store["s"] = b"small-old"
        v = store["k"]
        vs = store["s"]
        store["k"] = np.zeros_like(a)
        store["s"] = b"small-new"
        assert_array_same(v, a)
        assert vs.tobytes() == b"small-old"
        assert store["s"].tobytes() == b"small-new"
        store.delete("k")
        store.delete("s")
        # churn: freed blocks are reused, but never the pinned ones
        for i in range(30):
            store[f"fill{i}"] = np.full_like(a, i)
            store[f"sm{i}"] = b"Y" * 9
            if i % 3:
                store.delete(f"fill{i}")
        assert_array_same(v, a)
        assert vs.tobytes() == b"small-old"
        self.check(store)

    def test_views_survive_close(self, store_factory):
        s = store_factory()
        a = sample_array("int64", (1000,), seed=9)
        s["a"] = a
        s["b"] = b"bytes"
        va, vb = s["a"], s["b"]
        s.close()
        assert s.closed
        assert_array_same(va, a)
        assert vb.tobytes() == b"bytes"
        del va, vb
        drop()

    def test_view_outlives_dropped_handle(self, store_factory):
        s = store_factory()
        s["a"] = np.arange(1000)
        v = s["a"]
        s.close()
        del s
        drop()
        assert v.sum() == sum(range(1000))

    # ----------------------------------------------------- get_into

    def test_get_into_ndarray(self, store):
        a = sample_array("float32", (30, 20), seed=11)
        store["a"] = a
        out = np.empty((30, 20), dtype=np.float32)
        assert store.get_into("a", out) is out
        assert_array_same(out, a)
        big = sample_array("int16", (LARGE,), seed=12)
        store["big"] = big
        out = np.zeros(LARGE, np.int16)
        store.get_into("big", out)
        assert_array_same(out, big)

    def test_get_into_bytearray(self, store):
        store["b"] = b"0123456789"
        out = bytearray(10)
        store.get_into("b", out)
        assert out == b"0123456789"
        with pytest.raises(ValueError):
            store.get_into("b", bytearray(9))
        with pytest.raises(ValueError):
            store.get_into("b", bytearray(11))

    @needs_torch
    def test_get_into_cpu_tensor(self, store):
        t = sample_tensor("bfloat16", (16, 8), seed=1)
        store["t"] = t
        out = torch.empty(16, 8, dtype=torch.bfloat16)
        assert store.get_into("t", out) is out
        assert_tensor_same(out, t)
        with pytest.raises(ValueError):
            store.get_into("t", torch.empty(8, 16, dtype=torch.bfloat16))
        with pytest.raises(ValueError):
            store.get_into("t", torch.empty(16, 9, dtype=torch.bfloat16))

    def test_get_into_shape_mismatch(self, store):
        store["a"] = np.arange(12, dtype=np.float64).reshape(3, 4)
        with pytest.raises(ValueError):
            store.get_into("a", np.empty((4, 3), np.float64))
        with pytest.raises(ValueError):
            store.get_into("a", np.empty((12,), np.float64))
        with pytest.raises(ValueError):
            store.get_into("a", np.empty((3, 5), np.float64))
        out = np.full((3, 4), -1.0)
        store.get_into("a", out)
        np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4))

    def test_get_into_missing_and_read_only_out(self, store):
        with pytest.raises(KeyError):
            store.get_into("missing", np.empty(3))
        store["a"] = np.arange(3.0)
        ro = np.empty(3)
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            store.get_into("a", ro)
        with pytest.raises((ValueError, TypeError)):
            store.get_into("a", bytes(24))

    # ------------------------------------------------- mset / mget

    def test_mset_mget(self, store):
        store.mset({"a": b"1", "b": np.arange(3), "c": b"3" * LARGE})
        store.mset([("d", b"4"), ("e", b"5")])
        got = store.mget(["a", "missing", "b", "c", "a", "e"])
        assert isinstance(got, list) and len(got) == 6
        assert got[0].tobytes() == b"1"
        assert got[1] is None
        np.testing.assert_array_equal(got[2], np.arange(3))
        assert got[3].tobytes() == b"3" * LARGE
        assert got[4].tobytes() == b"1"
        assert got[5].tobytes() == b"5"
        assert store.mget([]) == []
        assert store.mget(["x", "y"]) == [None, None]
        assert store.mget(k for k in ["d"])[0].tobytes() == b"4"
        assert len(store) == 5

    def test_raw_batches_store_and_return_objects_as_encoded(self, store):
        """``mput_raw`` stores encoded objects (small ones in one batch, large ones one by
        one) that ``mget_raw`` returns as stored: header and read-only payload bytes."""
        values = {"raw/b": b"abc", "raw/a": np.arange(5, dtype=np.int16), "raw/big": np.arange(LARGE // 8),
                  "raw/empty": b""}
        rows = [(k, *codec.encode(v)) for k, v in values.items()]
        store.mput_raw(rows)
        got = store.mget_raw(["raw/b", "raw/missing", "raw/a", "raw/big", "raw/empty"])
        assert got[1] is None and len(got) == 5
        for (_, meta, payload, n), (gmeta, gview) in zip(rows, got[:1] + got[2:]):
            assert gmeta == meta and gview.readonly and gview.nbytes == n
            assert gview.tobytes() == memoryview(payload).cast("B").tobytes()[:n]
        np.testing.assert_array_equal(store["raw/big"], values["raw/big"])
        assert store.mget_raw([]) == []
        assert [g[0] for g in store.mget_raw(k for k in ["raw/b", "raw/a"])] == [rows[0][1], rows[1][1]]

    def test_mget_of_many_small_values_beside_large_ones(self, store):
        small = {f"s{i:02d}": np.full(700, i, np.float32) for i in range(40)}   # ~110 KiB in all
        store.mset(small)
        store.mset({"big": b"L" * LARGE, "t": b"tiny"})
        names = ["big"] + list(small) + ["missing", "t", "s00"]
        got = store.mget(names)
        assert got[0].tobytes() == b"L" * LARGE
        for name, v in zip(small, got[1:41]):
            np.testing.assert_array_equal(v, small[name])
            assert not v.flags.writeable
        assert got[41] is None and got[42].tobytes() == b"tiny"
        np.testing.assert_array_equal(got[43], small["s00"])
        store["s01"] = np.zeros(700, np.float32)         # what was read stays as it was
        np.testing.assert_array_equal(got[2], small["s01"])

    def test_mget_copy(self, store):
        store.mset({"a": np.arange(4), "b": b"xy"})
        a, b, c = store.mget(["a", "b", "c"], copy=True)
        assert a.flags.writeable
        a[0] = 100
        assert store["a"][0] == 0
        assert bytes(b) == b"xy" and not memoryview(b).readonly
        assert c is None

    def test_mset_overwrites(self, store):
        store["a"] = b"old"
        v = store["a"]
        store.mset({"a": b"new"})
        assert store["a"].tobytes() == b"new"
        assert v.tobytes() == b"old"

    # ------------------------------------- delete / in / len / iter / keys

    def test_delete_del_contains_len(self, store):
        assert len(store) == 0
        assert "a" not in store
        store["a"] = b"1"
        store["b"] = b"2"
        assert "a" in store and "b" in store
        assert len(store) == 2
        assert store.delete("a") is True
        assert store.delete("a") is False
        assert "a" not in store
        assert len(store) == 1
        del store["b"]
        with pytest.raises(KeyError):
            del store["b"]
        assert len(store) == 0
        assert list(store) == []
        assert 5 not in store  # a non-str is never a key (dict semantics)

    def test_iter_and_keys(self, store):
        names = ["policy/w1", "policy/w2", "value/v1", "policyx", "p"]
        for n in names:
            store[n] = n.encode()
        it = store.keys()
        assert hasattr(it, "__next__")
        assert sorted(it) == sorted(names)
        assert sorted(iter(store)) == sorted(names)
        assert sorted(store.keys(prefix="policy/")) == ["policy/w1", "policy/w2"]
        assert sorted(store.keys(prefix="policy")) == ["policy/w1", "policy/w2", "policyx"]
        assert sorted(store.keys(prefix="p")) == ["p", "policy/w1", "policy/w2", "policyx"]
        assert list(store.keys(prefix="nothing")) == []
        assert sorted(store.keys(prefix="")) == sorted(names)
        assert all(type(k) is str for k in store)

    def test_many_keys(self, store):
        n = 5000
        names = [f"batch/{i % 7}/key-{i:06d}-" + "x" * (i % 40) for i in range(n)]
        store.mset({k: i.to_bytes(4, "little") for i, k in enumerate(names)})
        assert len(store) == n
        listed = list(store.keys())
        assert len(listed) == n, "a key was repeated or lost across key batches"
        assert set(listed) == set(names)
        assert len(list(store)) == n
        for j in range(7):
            want = {k for k in names if k.startswith(f"batch/{j}/")}
            got = list(store.keys(prefix=f"batch/{j}/"))
            assert len(got) == len(want) and set(got) == want
        sub = list(store.keys(prefix="batch/3/key-0012"))
        assert set(sub) == {k for k in names if k.startswith("batch/3/key-0012")}
        for k in names[::2]:
            del store[k]
        assert len(store) == n // 2
        assert set(store.keys()) == set(names[1::2])
        assert store[names[4999]].tobytes() == (4999).to_bytes(4, "little")
        self.check(store)

    def test_keys_tolerates_deleting_while_iterating(self, store):
        names = [f"d/{i:05d}/" + "y" * 30 for i in range(3000)]
        store.mset({k: b"v" for k in names})
        seen = []
        for k in store.keys(prefix="d/"):
            seen.append(k)
            store.delete(k)
        assert sorted(seen) == sorted(names)
        assert len(store) == 0
        self.check(store)

    @pytest.mark.parametrize("key", ["ключ", "模型/权重", "emoji/🚀", "e\u0301", "tab\tand\nnewline",
                                     " ", "a" * 1024, "é" * 512, "🚀" * 256, "/", "x:y\\z"])
    def test_unicode_and_boundary_keys(self, store, key):
        assert len(key.encode()) <= 1024
        store[key] = key.encode()
        assert key in store
        assert store[key].tobytes() == key.encode()
        assert list(store.keys()) == [key]
        assert list(store.keys(prefix=key)) == [key]
        assert list(store.keys(prefix=key[:1])) == [key]
        assert store.mget([key])[0].tobytes() == key.encode()
        assert store.delete(key) is True
        assert key not in store

    def test_key_of_1024_bytes_accepted_1025_rejected(self, store):
        store["k" * 1024] = b"ok"
        assert store["k" * 1024].tobytes() == b"ok"
        with pytest.raises(ValueError):
            store["k" * 1025] = b"no"
        with pytest.raises(ValueError):
            store["é" * 512 + "a"] = b"no"  # 1025 UTF-8 bytes, 513 characters
        assert list(store.keys()) == ["k" * 1024]

    def test_distinct_similar_keys(self, store):
        keys = ["a", "a ", "A", "a/", "a\u00e9", "ae\u0301", "aa", "a" * 2]
        for i, k in enumerate(dict.fromkeys(keys)):
            store[k] = bytes([i])
        for i, k in enumerate(dict.fromkeys(keys)):
            assert store[k].tobytes() == bytes([i])
        assert len(store) == len(set(keys))

    # ---------------------------------------------------- tier_of

    def test_tier_of(self, store):
        store["a"] = b"x"
        tier = store.tier_of("a")
        assert isinstance(tier, Tier)
        if self.default_tier is not None:
            assert tier == self.default_tier
        with pytest.raises(KeyError):
            store.tier_of("missing")

    def test_explicit_default_tier_and_options_accepted(self, store):
        tier = self.default_tier or Tier.DRAM
        store.put("a", b"1", tier=tier, priority=5)
        store.put("b", b"2", priority=-3, write_mode="none")
        store.mset({"c": b"3"}, tier=tier, priority=1)
        assert [v.tobytes() for v in store.mget(["a", "b", "c"])] == [b"1", b"2", b"3"]
        assert store.tier_of("a") == tier
        assert store.flush() is None

    # ----------------------------------------------------- stats

    def test_stats_shape(self, store):
        st = store.stats()
        assert isinstance(st, dict)
        for k in ("tiers", "hits", "misses", "puts", "spills", "promotions", "evictions",
                  "pinned_bytes"):
            assert k in st, k
        for k in ("hits", "misses", "puts", "spills", "promotions", "evictions", "pinned_bytes"):
            assert isinstance(st[k], int) and st[k] >= 0, k
        assert set(st["tiers"]) <= {"hbm", "dram", "ssd"}
        assert st["tiers"]
        for tier, t in st["tiers"].items():
            for k in ("capacity", "used", "objects"):
                assert isinstance(t[k], int) and t[k] >= 0, (tier, k)
            assert t["used"] <= t["capacity"]
        if self.default_tier is Tier.DRAM:
            assert st["tiers"]["dram"]["capacity"] > 0

    def test_stats_counters_move(self, store):
        s0 = store.stats()
        store["a"] = b"1" * 100
        s1 = store.stats()
        assert s1["puts"] == s0["puts"] + 1
        store.mset({"b": b"2", "c": np.arange(10)})
        s2 = store.stats()
        assert s2["puts"] == s1["puts"] + 2
        objects = sum(t["objects"] for t in s2["tiers"].values())
        assert objects == 3 * self.copies and len(store) == 3
        assert sum(t["used"] for t in s2["tiers"].values()) > sum(t["used"] for t in s0["tiers"].values())

        store.get("a")
        store["b"]
        s3 = store.stats()
        assert s3["hits"] == s2["hits"] + 2
        assert s3["misses"] == s2["misses"]
        store.get("nope")
        with pytest.raises(KeyError):
            store["nope2"]
        s4 = store.stats()
        assert s4["misses"] == s3["misses"] + 2
        assert s4["hits"] == s3["hits"]
        store.mget(["a", "nope", "c"])
        s5 = store.stats()
        assert s5["hits"] == s4["hits"] + 2
        assert s5["misses"] == s4["misses"] + 1
        for k in ("spills", "promotions", "evictions"):
            assert s5[k] == s0[k]
        store.delete("a")
        store.delete("b")
        store.delete("c")
        drop()
        s6 = store.stats()
        assert sum(t["objects"] for t in s6["tiers"].values()) == 0
        assert sum(t["used"] for t in s6["tiers"].values()) == sum(t["used"] for t in s0["tiers"].values())

    def test_stats_pinned_bytes_follow_views(self, store):
        if not self.local_views:
            pytest.skip("views of this store pin no local memory")
        store["a"] = np.zeros(LARGE, np.uint8)
        drop()
        base = store.stats()["pinned_bytes"]
        v = store["a"]
        held = store.stats()["pinned_bytes"]
        assert held >= base + LARGE
        v2 = store["a"]  # a second view of the same object pins no more bytes
        assert store.stats()["pinned_bytes"] == held
        store["a"] = b"replaced"  # the old object stays pinned while viewed
        assert store.stats()["pinned_bytes"] >= base + LARGE
        del v, v2
        drop()
        assert store.stats()["pinned_bytes"] == base

    # ------------------------------------------- MutableMapping, pickle=True

    def test_pickle_store_holds_arbitrary_objects(self, pickle_store):
        s = pickle_store
        objs = {"dict": {"a": [1, 2]}, "str": "text", "int": 42, "none": None,
                "tuple": (1, "2", 3.0), "thing": Thing([1, 2]), "set": {1, 2, 3}}
        for k, v in objs.items():
            s[k] = v
        for k, v in objs.items():
            assert s[k] == v
            assert k in s
        assert s.get("none", "dflt") is None  # a stored None is not "missing"
        # arrays and bytes keep their zero-copy forms in a pickle store
        s["arr"] = np.arange(4)
        assert isinstance(s["arr"], np.ndarray) and not s["arr"].flags.writeable
        s["raw"] = b"raw"
        assert isinstance(s["raw"], memoryview)

    def test_pickle_store_returns_private_objects(self, pickle_store):
        pickle_store["l"] = [1, 2]
        a = pickle_store["l"]
        a.append(3)
        assert pickle_store["l"] == [1, 2]

    def test_mapping_methods(self, pickle_store):
        s = pickle_store
        s.update({"a": 1, "b": 2})
        s.update([("c", 3)])
        s.update(d=4)
        assert s == {"a": 1, "b": 2, "c": 3, "d": 4}
        assert {"a": 1, "b": 2, "c": 3, "d": 4} == s
        assert s != {"a": 1}
        assert s != {"a": 1, "b": 2, "c": 3, "d": 5}
        assert s.setdefault("a", 100) == 1
        assert s.setdefault("e", 5) == 5
        assert s["e"] == 5
        assert s.pop("e") == 5
        assert s.pop("e", "gone") == "gone"
        with pytest.raises(KeyError):
            s.pop("e")
        assert sorted(s.keys()) == ["a", "b", "c", "d"]
        assert sorted(s.values()) == [1, 2, 3, 4]
        assert sorted(s.items()) == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
        assert dict(s) == {"a": 1, "b": 2, "c": 3, "d": 4}
        popped = {}
        while s:
            k, v = s.popitem()
            popped[k] = v
        assert popped == {"a": 1, "b": 2, "c": 3, "d": 4}
        with pytest.raises(KeyError):
            s.popitem()
        s.update(x=1, y=2)
        s.clear()
        assert len(s) == 0 and s == {}
        assert not s

    def test_dict_side_by_side(self, pickle_store):
        run_side_by_side(pickle_store, seed=1234, steps=500)
        self.check(pickle_store)

    def test_generic_mapping_protocol(self, store_factory):
        """CPython's own mapping conformance tests (test.mapping_tests)."""
        mapping_tests = pytest.importorskip("test.mapping_tests")

        class Conformance(mapping_tests.BasicTestMappingProtocol):
            def _empty_mapping(self_):
                return store_factory(pickle=True)

        result = unittest.TestResult()
        unittest.defaultTestLoader.loadTestsFromTestCase(Conformance).run(result)
        problems = result.failures + result.errors
        assert result.testsRun >= 10
        assert not problems, "\n\n".join(f"{t.id()}:\n{tb}" for t, tb in problems)

    # ------------------------------------------------------- ttl

    def test_ttl_expires(self, store):
        store.put("short", b"s", ttl=0.2)
        store.put("big", np.zeros(LARGE, np.uint8), ttl=0.2)
        store.mset({"m1": b"1", "m2": b"2"}, ttl=0.2)
        store.put("long", b"l", ttl=60)
        store.put("forever", b"f")
        assert {"short", "big", "m1", "m2", "long", "forever"} == set(store.keys())
        assert store["short"].tobytes() == b"s"
        time.sleep(0.2 + self.ttl_slack)
        for k in ("short", "big", "m1", "m2"):
            assert k not in store, k
            assert store.get(k) is None
            with pytest.raises(KeyError):
                store[k]
        assert store.mget(["short", "long"])[0] is None
        assert set(store.keys()) == {"long", "forever"}
        assert len(store) == 2
        assert store["long"].tobytes() == b"l"
        self.check(store)

    def test_ttl_overwrite_without_ttl_is_permanent(self, store):
        store.put("k", b"temp", ttl=0.2)
        store.put("k", b"kept")
        store.put("j", b"perm")
        store.put("j", b"temp", ttl=0.2)
        time.sleep(0.2 + self.ttl_slack)
        assert store["k"].tobytes() == b"kept"
        assert "j" not in store

    def test_expired_view_stays_valid(self, store):
        store.put("k", np.arange(1000), ttl=0.2)
        v = store["k"]
        time.sleep(0.2 + self.ttl_slack)
        assert "k" not in store
        np.testing.assert_array_equal(v, np.arange(1000))

    # ------------------------------------------------ pickling the handle

    def test_store_pickles_by_name(self, store):
        store["shared"] = b"yes"
        other = pickle.loads(pickle.dumps(store))
        try:
            assert other["shared"].tobytes() == b"yes"
            other["from-other"] = b"hi"
            assert store["from-other"].tobytes() == b"hi"
        finally:
            other.close()
        assert store["shared"].tobytes() == b"yes"  # closing the copy left ours open

    def test_context_manager(self, store_factory):
        s = store_factory()
        with s as entered:
            assert entered is s
            s["a"] = b"1"
        assert s.closed

    # ------------------------------------------------------ churn

    def test_invariants_after_heavy_churn(self, store):
        rnd = random.Random(7)
        model: dict[str, bytes] = {}
        held = []
        sizes = [0, 1, 17, 4096, 65536, 65537, 100_000, 300_000]
        for step in range(1500):
            k = f"c{rnd.randrange(60)}"
            r = rnd.random()
            if r < 0.55:
                n = rnd.choice(sizes)
                data = bytes([step % 256]) * n
                store[k] = data
                model[k] = data
            elif r < 0.75:
                assert store.delete(k) == (k in model)
                model.pop(k, None)
            elif r < 0.9:
                v = store.get(k)
                if k in model:
                    assert v.tobytes() == model[k]
                    if len(held) < 20:
                        held.append((v, model[k]))
                else:
                    assert v is None
            elif held:
                held.pop(rnd.randrange(len(held)))
            if step % 250 == 0:
                self.check(store)
        self.check(store)
        assert len(store) == len(model)
        assert set(store.keys()) == set(model)
        for k, want in model.items():
            assert store[k].tobytes() == want
        for v, want in held:
            assert v.tobytes() == want
        del held, v
        drop()
        store.clear()
        assert len(store) == 0
        self.check(store)
        st = store.stats()
        assert st["pinned_bytes"] == 0 or not self.local_views
