"""The store conformance suite, run against the embedded DRAM store."""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import threading

import numpy as np
import pytest


from store_suite import StoreSuite  # noqa: E402

from yrcache import Tier, TieredStore  # noqa: E402
from yrcache.errors import StoreFullError, UntrustedStoreError  # noqa: E402
from procs import drop_failed_test_locals, finish, start  # noqa: E402

# Every test ends with gc.collect() (conftest's store_name); with torch loaded
# that walks ~10^6 long-lived objects, ~0.1-0.2 s a test.  Move what is alive
# after the imports out of the collector's sight (it lives for the whole run).
gc.freeze()


class TestEmbeddedStore(StoreSuite):
    """One process, one shared-memory arena (the DRAM tier)."""

    default_tier = Tier.DRAM
    has_check = True
    local_views = True

    @pytest.fixture
    def store_factory(self, store_name):
        made: list[TieredStore] = []

        def make(**kw):
            kw.setdefault("dram", "16MiB")
            # every store needs its own name: a second create of a live store's
            # name raises FileExistsError
            name = store_name if not made else f"{store_name}-{len(made)}"
            s = TieredStore(name=name, **kw)
            made.append(s)
            return s

        yield make
        drop_failed_test_locals()
        names = [s.name for s in made]
        for s in made:
            s.close()
        made.clear()
        if len(names) > 1:
            gc.collect()
            # store_name checks the first name; check the others here
            left = [n for n in names[1:] if os.path.exists(f"/dev/shm/yrcache.{n}")]
            for n in left:
                TieredStore.attach(n).destroy()
            assert not left, f"stores left behind in /dev/shm: {left}"

    def test_mget_is_one_snapshot(self, store):
        """DRAM values: ``mset`` and ``mget`` each take one lock hold, so a reader
        never sees half of a batch (small values are copied out inside it)."""
        store.mset({"a": np.zeros(64, np.int64), "b": np.zeros(64, np.int64)})
        stop = threading.Event()

        def writer():
            i = 0
            while not stop.is_set():
                i += 1
                store.mset({"a": np.full(64, i, np.int64), "b": np.full(64, i, np.int64)})

        t = threading.Thread(target=writer)
        t.start()
        try:
            for _ in range(2000):
                a, b = store.mget(["a", "b"])
                assert a[0] == b[0], "mget mixed two writes"
        finally:
            stop.set()
            t.join()


def test_listings_stay_sorted_through_ascending_runs_deletes_and_overwrites(make_store):
    """A put of a key above the last one inserted searches the sorted index from that
    insert's path (_csrc/sorted.c's finger). Deleting or overwriting nodes on that path,
    keys below it, and runs that jump around must all keep every listing right."""
    import random
    s = make_store(dram="64MiB")
    rng = random.Random(7)
    model: list[str] = []
    live: set[str] = set()
    for step in range(1500):
        op = rng.random()
        if op < 0.45:                                    # an ascending run from anywhere
            start = rng.randrange(5000)
            for i in range(start, start + rng.randrange(1, 25)):
                k = f"r/{i:05d}" if rng.random() < 0.9 else f"q/{i:05d}"
                s[k] = b"x"
                live.add(k)
                model.append(k)
        elif op < 0.7 and model:                         # delete recent keys (on the path)
            for k in model[-rng.randrange(1, 4):]:
                s.delete(k)
                live.discard(k)
        elif op < 0.85 and model:                        # overwrite recent keys
            for k in model[-rng.randrange(1, 4):]:
                s[k] = b"y"
                live.add(k)
        elif live:                                       # delete anything
            k = rng.choice(sorted(live))
            s.delete(k)
            live.discard(k)
        if step % 50 == 0:
            assert list(s.keys()) == sorted(live)
            assert list(s.keys(prefix="r/01")) == sorted(k for k in live if k.startswith("r/01"))
    assert list(s.keys()) == sorted(live) and len(s) == len(live)


def test_interleaved_listings_in_one_thread_each_see_their_own_keys(make_store):
    """Listings reuse one per-thread buffer: two of them interleaved with puts, gets and
    batch reads on the same thread still yield exactly their own keys, batch after
    batch (1,300 keys each: eleven batches)."""
    s = make_store(dram="16MiB")
    s.mset({f"a/{i:05d}": b"x" for i in range(1300)})
    s.mset({f"b/{i:05d}": b"y" * 100 for i in range(1300)})
    ga, gb = s.keys("a/"), s.keys("b/")
    got_a, got_b = [], []
    for _ in range(1300):
        got_a.append(next(ga))
        s.put("c/x", b"z")                 # (a listing of another prefix, a batch read, a delete)
        assert list(s.keys("c/")) == ["c/x"] and s.delete("c/x")
        got_b.append(next(gb))
        assert bytes(s.mget([got_b[-1]])[0]) == b"y" * 100
    assert next(ga, None) is None and next(gb, None) is None
    assert got_a == [f"a/{i:05d}" for i in range(1300)] and got_b == [f"b/{i:05d}" for i in range(1300)]


def test_get_raw_returns_the_header_and_stored_bytes(store_name, tmp_path):
    with TieredStore(name=store_name, dram="16MiB", ssd=str(tmp_path / "ssd"), ssd_size="64MiB",
                     pickle=True) as s:
        big = np.arange(100_000, dtype=np.int64)
        s["big"] = big
        s["small"] = b"abc"
        s.put("cold", np.arange(10, dtype=np.int16), tier=Tier.SSD)
        s["obj"] = {"x": 1}
        meta, view = s.get_raw("big")
        assert meta == b"N;<i8;100000" and view.readonly and view.tobytes() == big.tobytes()
        s["big"] = np.zeros(3)                       # the view pins the bytes it shows
        assert view.tobytes() == big.tobytes()
        assert s.get_raw("small") == (b"B", memoryview(b"abc"))
        meta, view = s.get_raw("cold")
        assert meta == b"N;<i2;10" and view.tobytes() == np.arange(10, dtype=np.int16).tobytes()
        assert s.get_raw("missing") is None
        with pytest.raises(TypeError, match="pickled"):
            s.get_raw("obj")
        # mget_raw: the same answers for a batch (small, large, SSD, missing)
        got = s.mget_raw(["small", "big", "cold", "missing"])
        assert got[0] == (b"B", memoryview(b"abc")) and got[0][1].readonly and got[3] is None
        assert got[1][0] == b"N;<f8;3" and got[1][1].tobytes() == np.zeros(3).tobytes()
        assert got[2][0] == b"N;<i2;10" and got[2][1].tobytes() == np.arange(10, dtype=np.int16).tobytes()
        with pytest.raises(TypeError, match="pickled"):
            s.mget_raw(["big", "obj"])
        assert s.mget_raw([]) == []
        del view, got
        s.check()


class _Key(str):
    pass


def test_scans_and_expiry_walk_the_whole_index_a_bounded_batch_at_a_time(make_store):
    """A scan (the placement policy's) and an expiry sweep hold the lock for at most
    16384 buckets at a time; a 64 MiB store has 65536, so both take several holds and
    must still see every object."""
    import time

    from yrcache.tiers.dram import TIER_DRAM

    s = make_store(dram="64MiB")
    a = s._a
    for i in range(300):
        s.put(f"k{i}", b"x" * 100, ttl=0.2 if i % 3 == 0 else None)
    assert sorted(k for _, k in a.scan(1 << TIER_DRAM)) == sorted(f"k{i}" for i in range(300))
    time.sleep(0.3)
    assert a.expire(time.time()) == 100
    assert sorted(k for _, k in a.scan(1 << TIER_DRAM)) == sorted(f"k{i}" for i in range(300) if i % 3)
    assert len(s) == 200


def test_put_value_finds_headers_in_c_for_learned_array_layouts(make_store):
    """hot.put_value stores bytes, a bytearray and an ndarray whose layout (buffer
    format, item size, shape) a put has taught it, with the header the codec
    gives: arrays of the same shape but another dtype, arrays that are not
    contiguous, not native-endian or not exact ndarrays never take a wrong one."""
    s = make_store(dram="16MiB")
    hot, pf = s._a.hot, s._a.prefaulted
    assert hot.put_value("b", b"abc", pf) is True and hot.put_value("ba", bytearray(b"xy"), pf) is True
    assert bytes(s["b"]) == b"abc" and bytes(s["ba"]) == b"xy"
    f8 = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert hot.put_value("f", f8, pf) is None          # not learned yet: the caller encodes
    s["f"] = f8                                          # ... and teaches it
    assert hot.put_value("f", f8 + 1, pf) is True and s["f"].tolist() == (f8 + 1).tolist()
    rng = np.random.default_rng(5)
    dtypes = [np.bool_, np.int8, np.uint8, np.int16, np.float16, np.int32, np.uint32, np.float32,
              np.int64, np.uint64, np.float64, np.complex64, np.complex128, np.longdouble]
    shapes = [(), (0,), (3,), (2, 3), (3, 2), (6,), (1,) * 9]
    for _ in range(2):                                   # the second round through learned layouts
        for dt in dtypes:
            for shape in shapes:
                want = np.asarray(rng.random(shape) * 100).astype(dt)
                key = f"{np.dtype(dt).str}/{shape}"
                s[key] = want
                got = s[key]
                assert (got.dtype, got.shape) == (want.dtype, want.shape), key
                assert np.array_equal(got, want), key
    assert hot.put_value("x", np.zeros(6, np.int64), pf) is True
    assert s["x"].dtype == np.int64                     # not float64's or uint64's header
    assert hot.put_value("x", np.zeros((1,) * 9), pf) is None   # > 8 dims: never learned
    assert hot.put_value("x", np.arange(12.0).reshape(3, 4)[:, ::2], pf) is False   # not contiguous
    swapped = np.arange(6, dtype=">f8").reshape(2, 3)
    s["sw"] = swapped                                    # stored native: the codec converted it
    assert hot.put_value("sw", swapped, pf) is None and s["sw"].tolist() == swapped.tolist()
    assert s["sw"].dtype == np.float64

    class Sub(np.ndarray):
        pass
    assert hot.put_value("sub", np.zeros(6).view(Sub), pf) is False
    assert hot.put_value("s", "text", pf) is False and hot.put_value("", b"x", pf) is False
    # 32 layouts at most, the oldest replaced: every value still reads back right
    for n in range(1, 41):
        s[f"n{n}"] = np.arange(n, dtype=np.int32)
    for n in range(1, 41):
        s[f"n{n}"] = np.arange(n, dtype=np.int32) * 2
        assert s[f"n{n}"].tolist() == [2 * i for i in range(n)]
    assert hot.put_value("n40", np.arange(40, dtype=np.int32), pf) is True
    assert hot.put_value("n1", np.arange(1, dtype=np.int32), pf) is None    # replaced
    assert hot.learn(np.arange(3.0)[::2], b"N;<f8;2") is False      # what a buffer cannot describe


def test_pinned_arrays_are_built_by_the_c_get(make_store):
    """A larger ndarray whose header a get has taught the C hot path comes back
    built there: the same read-only zero-copy view as the general path (nobody can
    make it writable), reshaped, holding its pin until the last view built on it
    dies, listed for a fork in the meantime; mget builds them the same way."""
    s = make_store(dram="64MiB")
    hot, a = s._a.hot, s._a
    m = np.arange(6 << 10, dtype=np.float32).reshape(3, 2048)
    s["m"], s["v"] = m, np.arange(8 << 10, dtype=np.int16)
    t = hot.get("m")
    assert isinstance(t, tuple) and len(t) == 5              # not registered yet: the caller owns the pin
    a.unpin(t[3])
    first = s["m"]                                           # registers its header
    built = hot.get("m")
    assert type(built) is np.ndarray and type(built.base.base).__name__ == "Pin"
    assert (built.dtype, built.shape) == (np.float32, (3, 2048)) and np.array_equal(built, m)
    assert not built.flags.writeable
    with pytest.raises(ValueError):
        built.flags.writeable = True
    assert memoryview(built.base.base).readonly             # the pinned bytes are exported read-only
    with pytest.raises(TypeError):
        memoryview(built.base.base)[0:1] = b"x"
    assert built.ctypes.data == first.ctypes.data            # zero-copy: the same stored bytes
    assert len(a.views) == 2 and s.stats()["pinned_bytes"] >= m.nbytes     # two pins, one block
    s["m"] = m * 2                                           # an overwrite leaves both views valid
    assert np.array_equal(built, m) and np.array_equal(s["m"], m * 2)
    del first, built
    gc.collect()
    assert a.views == {} and s.stats()["pinned_bytes"] == 0
    s["v"] = np.arange(8 << 10, dtype=np.int16)
    assert isinstance(s["v"], np.ndarray) and type(hot.get("v").base).__name__ == "Pin"   # 1-D: no reshape
    c = s.get("v", copy=True)
    c[0] = 7
    assert c.flags.writeable and s["v"][0] == 0
    got = s.mget(["m", "v", "missing"])
    assert [type(g.base.base if g is not None and g.ndim > 1 else getattr(g, "base", None)).__name__
            for g in got] == ["Pin", "Pin", "NoneType"]
    assert np.array_equal(got[0], m * 2) and got[1].tolist() == list(range(8 << 10))
    del got, c
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
    # a header whose payload is not whole items is left to the general path
    s["odd"] = np.zeros(9999, np.uint8)
    assert hot.shaped(b"N;|u1;9999", np.dtype(np.uint16), 2, None, np.frombuffer) is True
    t = hot.get("odd")
    assert isinstance(t, tuple) and s["odd"].shape == (9999,)
    a.unpin(t[3])
    gc.collect()
    # 16 headers, the oldest replaced: every value still reads back right
    for n in range(20):
        s[f"n{n}"] = np.full(4096 + n, n, np.int32)
    for _ in range(2):
        for n in range(20):
            v = s[f"n{n}"]
            assert v.shape == (4096 + n,) and int(v[-1]) == n
    del v
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0 and a.views == {}
    # a view that outlives its store's handle still reads; dropping it later is harmless
    s["late"] = m
    s["late"].sum()
    late = s["late"]
    s.close()
    assert np.array_equal(late, m)
    del late
    gc.collect()


def test_pinned_tensors_are_built_by_the_c_get(make_store):
    """A larger tensor whose header a get has taught the C hot path comes back built
    there, as the general path builds it: a tensor over the stored bytes (torch has no
    read-only tensors; no warning about one), with its dtype (bfloat16 through int16)
    and shape; a dtype numpy has no twin for (float8) stays on the general path."""
    import warnings

    torch = pytest.importorskip("torch")
    s = make_store(dram="64MiB")
    hot, a = s._a.hot, s._a
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = (torch.arange(3 * 4096) % 7).to(dt).reshape(3, 4096)
        s["t"] = t
        first = s["t"]                           # decoded in Python: registers the header
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = hot.get("t")
            (again,) = s.mget(["t"])
        assert type(got) is torch.Tensor and (got.dtype, tuple(got.shape)) == (dt, (3, 4096))
        assert torch.equal(got, t) and torch.equal(again, t)
        assert got.data_ptr() == first.data_ptr() == again.data_ptr()   # zero-copy, one block
        del first, got, again
        gc.collect()
        assert s.stats()["pinned_bytes"] == 0 and a.views == {}
    s["f8"] = torch.ones(20_000).to(torch.float8_e4m3fn)
    assert s["f8"].dtype == torch.float8_e4m3fn
    t = hot.get("f8")
    assert isinstance(t, tuple)
    a.unpin(t[3])


def test_small_bytes_and_1d_arrays_are_built_by_the_c_get(make_store):
    """hot.get builds a small bytes value, and a small 1-D array once its header is
    registered (by the first get), itself: the same read-only private values as the
    general path, unaffected by later writes, with copy=True still a writable copy."""
    s = make_store(dram="16MiB")
    hot = s._a.hot
    s["b"], s["a"], s["m"] = b"abc", np.arange(5, dtype=np.float32), np.ones((2, 3))
    got = hot.get("b")
    assert isinstance(got, memoryview) and got.readonly and bytes(got) == b"abc" and got.format == "B"
    assert hot.get("missing") is None and hot.get("a\x00") is False
    assert isinstance(hot.get("a"), tuple)                   # not registered yet
    first = s["a"]                                           # registers its header
    built = hot.get("a")
    assert isinstance(built, np.ndarray) and not built.flags.writeable
    assert (built.dtype, built.shape, built.tolist()) == (np.float32, (5,), [0, 1, 2, 3, 4])
    assert isinstance(hot.get("m"), tuple) and s["m"].shape == (2, 3)   # 2-D: never registered
    v, b = s["a"], s["b"]
    s["a"], s["b"] = np.full(5, 9, np.float32), b"xyz"
    del s["a"]
    assert v.tolist() == first.tolist() == [0, 1, 2, 3, 4] and bytes(b) == b"abc"   # private copies
    s["a"] = np.arange(5, dtype=np.float32)
    c = s.get("a", copy=True)
    c[0] = 7
    assert c.flags.writeable and s["a"][0] == 0 and isinstance(s.get("b", copy=True), bytearray)
    # a header whose payload is not whole items is left to the general path
    s["u3"] = np.arange(3, dtype=np.uint8)
    assert hot.flat(b"N;|u1;3", np.dtype(np.uint16), 2, np.frombuffer) is True
    assert isinstance(hot.get("u3"), tuple) and s["u3"].tolist() == [0, 1, 2]
    # at most 16 headers; the rest are still read right
    for n in range(1, 20):
        s[f"n{n}"] = np.arange(n, dtype=np.int16)
        assert s[f"n{n}"].tolist() == list(range(n))
        assert s[f"n{n}"].tolist() == list(range(n))
    assert hot.flat(b"N;<i2;99", np.dtype(np.int16), 2, np.frombuffer) is False
    assert isinstance(hot.get("n19"), tuple) and isinstance(hot.get("n1"), np.ndarray)
    # mget builds them the same way, in one lock hold
    got = hot.mget(["b", "a", "m", "missing"])
    assert [type(g) for g in got] == [memoryview, np.ndarray, tuple, type(None)]
    vals = s.mget(["b", "a", "m", "n19", "missing"])
    assert bytes(vals[0]) == b"xyz" and vals[1].tolist() == [0, 1, 2, 3, 4] and vals[2].shape == (2, 3)
    assert vals[3].tolist() == list(range(19)) and vals[4] is None and not vals[1].flags.writeable
    # a batch that fails midway releases the pins after the failure, and only those
    with TieredStore.attach(s.name, pickle=True) as trusting:
        trusting["obj"] = {"x": 1}
    s["five"], s["big"] = b"12345", np.ones(64 << 10, np.uint8)
    with pytest.raises(UntrustedStoreError):
        s.mget(["obj", "five", "a", "big"])
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0 and bytes(s["five"]) == b"12345"
    # what unpin_hits releases: the 5-tuples only, never a value that happens to have 5 items
    from yrcache.store_ops import unpin_hits

    class Pins:
        released: list = []

        def unpin(self, pin):
            self.released.append(pin)
    unpin_hits(Pins(), [memoryview(b"12345"), np.arange(5), None, (b"N", 0, 8, 42, 0), (b"B\x00", 1)])
    assert Pins.released == [42]


def test_small_gets_and_puts_in_one_c_call_match_the_general_path(make_store):
    """Small gets and puts take one C call (yrcache/_csrc/fast.c); everything they
    cannot do falls back to the general path.  Both must give the same values,
    counters and errors, on both sides of every size limit."""
    s = make_store(dram="16MiB", pickle=True)
    hot = s._a.hot
    values = {
        "b": b"abc", "empty": b"", "ba": bytearray(b"xy"), "mv": memoryview(b"0123")[::2],
        "i8": np.arange(7, dtype=np.int8), "f8-2d": np.ones((3, 4)), "zero-d": np.array(3.5),
        "none": np.zeros(0, np.float32), "c16": np.arange(3) * 1j, "obj": {"x": [1, 2]},
        "4096": np.arange(1024, dtype=np.int32),               # a 4 KiB payload: copied out
        "4097": np.zeros(4097, np.uint8), "64k": np.ones(64 << 10, np.uint8),
        "1m": np.ones((1 << 20) + 1, np.uint8),
        "é/ключ": np.arange(3), _Key("sub"): b"str subclass",
    }
    before = s.stats()
    for k, v in values.items():
        s[k] = v
    assert s.stats()["puts"] - before["puts"] == len(values)
    def same(got, v):
        if isinstance(v, dict):
            return got == v
        expect = np.asarray(v) if isinstance(v, np.ndarray) else bytes(v)
        as_read = np.asarray(got) if isinstance(v, np.ndarray) else bytes(got)
        read_only = not (got.flags.writeable if isinstance(got, np.ndarray) else not got.readonly)
        typed = not isinstance(v, np.ndarray) or (got.shape, got.dtype) == (v.shape, v.dtype)
        return np.array_equal(as_read, expect) and typed and read_only

    for k, v in values.items():
        assert same(s[k], v) and same(s[k], v), k     # (the second get of a 1-D array: built in C)
    assert s.get("missing", "default") == "default"
    after = s.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2 * len(values), 1)
    # mget: the same values, read in one C call and one lock hold
    got = s.mget([*values, "missing"])
    assert got[-1] is None and all(same(g, v) for g, v in zip(got, values.values()))
    after_m = s.stats()
    assert (after_m["hits"] - after["hits"], after_m["misses"] - after["misses"]) == (len(values), 1)
    del got
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
    hits = hot.mread(["b", "64k", "missing"])
    assert hits[0] == (b"Babc", 1) and len(hits[1]) == 5 and hits[2] is None
    s._a.unpin(hits[1][3])
    assert hot.mread(["b", b"bytes"]) is False and hot.mread(("b",)) is False and hot.mread([]) is False
    # what the C calls answer themselves, and what they leave to the general path
    assert hot.read("b")[0] == b"Babc" and hot.read("missing") is None
    meta, off, n, pin, block = hot.read("64k")           # pinned: the caller releases the pin
    assert (meta, n) == (b"N;|u1;65536", 64 << 10) and s.stats()["pinned_bytes"] >= n
    assert s._a.pinned_buffer(off, n, pin, block)[:3] == b"\x01\x01\x01"
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
    assert hot.read(_Key("b")) is False and hot.read("a\x00b") is False
    assert hot.put("p", b"B", b"x", True) is True and s["p"].tobytes() == b"x"
    assert hot.put("p", b"B", np.ones((2, 2))[:, 0], True) is False     # not contiguous
    assert hot.put("p", b"B", b"x" * (s._a.capacity + 1), True) is False  # no room
    # bad keys raise through the general path, as they always did
    for bad, err in [(b"bytes", TypeError), ("", ValueError), ("a\x00", ValueError),
                     ("\ud800", ValueError), ("k" * 1025, ValueError)]:
        with pytest.raises(err):
            s.get(bad)
        with pytest.raises(err):
            s[bad] = b"x"
    # a batch that fails midway releases the pins it took for the items after the failure
    with pytest.raises(TypeError, match="pickled"):
        s.mget_raw(["obj", "64k", "1m"])
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
    s.close()
    assert hot.read("b") is False and hot.put("p", b"B", b"x", True) is False   # gone
    assert hot.mread(["b"]) is False


class _Counting:
    """A HotPath stand-in that counts its mput_values calls (the C type takes no patches)."""

    def __init__(self, hot):
        self.hot, self.calls = hot, []

    def mput_values(self, pairs, *rest):
        self.calls.append(len(pairs))
        return self.hot.mput_values(pairs, *rest)

    def __getattr__(self, name):
        return getattr(self.hot, name)


def test_mset_in_one_c_call_matches_puts_one_by_one(make_store):
    """``mset`` of bytes and arrays of learned layouts checks its keys and finds its
    headers in C and stores them in one call; every other value, a large one, a bad key,
    a full store take the general path. Values, counters and errors are those of puts."""
    s = make_store(dram="4MiB", pickle=True)

    def same(got, v):
        if isinstance(v, dict):
            return got == v
        if isinstance(v, np.ndarray):
            return (type(got), got.shape, got.dtype) == (np.ndarray, v.shape, v.dtype) and np.array_equal(got, v)
        return bytes(got) == bytes(v)
    values = {"b": b"abc", "empty": b"", "ba": bytearray(b"xy"), "mv": memoryview(b"0123")[::2],
              "i8": np.arange(7, dtype=np.int8), "f8-2d": np.ones((3, 4)), "zero-d": np.array(3.5),
              "strided": np.arange(10)[::2], "obj": {"x": [1, 2]}, "64k": np.ones(64 << 10, np.uint8),
              "64k+1": np.ones((64 << 10) + 1, np.uint8), "é/ключ": np.arange(3), _Key("sub"): b"str subclass"}
    s.mset({"y": np.arange(2, dtype=np.uint8), "x": b"abc"})   # (before any array layout is learned)
    s.put("z", np.zeros(3, np.uint8))      # the same buffer layout as b"abc": still an array
    assert same(s["z"], np.zeros(3, np.uint8)) and same(s["x"], b"abc")
    for _ in range(2):                     # the second time, the array layouts are learned
        before = s.stats()["puts"]
        s.mset(values)
        assert s.stats()["puts"] - before == len(values)
        assert all(same(s[k], v) for k, v in values.items())
    s._a.hot = counting = _Counting(s._a.hot)
    plain = {f"p{i}": (b"x" * i if i % 2 else np.full(i, i, np.int32)) for i in range(50)}
    s.mset(plain)
    assert counting.calls == [50], "a batch of bytes and learned arrays did not take the one C call"
    assert all(same(s[k], v) for k, v in plain.items())
    many = {f"m{i}": bytes([i % 251]) * (i % 1500) for i in range(1000)}    # 256 per lock hold
    s.mset(many)
    assert counting.calls[-1] == 1000 and all(same(s[k], v) for k, v in many.items())
    for k in many:
        del s[k]
    for bad, err in [({"ok": b"1", "": b"2"}, ValueError), ({"ok": b"1", 5: b"2"}, TypeError),
                     ({"ok": b"1", "a\x00": b"2"}, ValueError), ({"ok": b"1", "k" * 1025: b"2"}, ValueError)]:
        with pytest.raises(err):
            s.mset(bad)
        assert "ok" not in s, "a batch with a bad key stored something"
    # more than fits: the C call stores what fits, then the general path says the store is full
    with pytest.raises(StoreFullError):
        s.mset({f"big{i}": np.full(60 << 10, i, np.uint8) for i in range(80)})     # 4.7 MiB > 4 MiB
    assert same(s["big0"], np.full(60 << 10, 0, np.uint8))
    s._a.hot = counting.hot
    s.check()


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))


@pytest.mark.parametrize("created_prefaulted", [True, False])
def test_prefault_maps_the_pages_of_a_value_in_one_call(make_store, created_prefaulted):
    """store.prefault(view), in a mapping that has not touched the value (attach
    without prefault), maps every page under it at once (docs/architecture.md,
    "Huge pages"): the mapping's resident shared memory grows by the value's size,
    and reading every page afterwards takes (almost) no page faults. A large put
    into such a mapping finds its block mapped before it writes, also in a store
    created without prefault, whose untouched pages the kernel cannot map 16 at a
    time (each is initialised on its first fault)."""
    s = make_store(dram="128MiB", prefault=created_prefaulted)
    n = 24 << 20
    s.put("v", np.arange(n, dtype=np.uint8))
    t = TieredStore.attach(s.name, prefault=False)
    try:
        v = t.get("v")
        before = _rss_shmem()
        t.prefault(v)
        assert _rss_shmem() - before >= n - (64 << 10)
        want = int(np.arange(n, dtype=np.uint8)[::4096].astype(np.int64).sum())
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        got = sum(int(v[i]) for i in range(0, n, 4096))       # one byte of every page
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0 < 32
        assert got == want
        del v
        seen = []

        def fill(view):                      # the block as the put hands it over, unwritten
            seen.append(_rss_shmem() - before2)
            view[:] = 7
        before2 = _rss_shmem()
        t.put_with("w", b"B", n, fill)
        assert seen[0] >= n - (64 << 10), (seen, n)
        assert bytes(t.get("w")[-3:]) == b"\x07\x07\x07"
    finally:
        t.close()


def _large_puts_round_trip(name: str) -> list[int]:
    """In a fresh process: large puts of odd lengths from unaligned sources, enough of
    each size class that its first copies (timed, both ways) and the later ones (the
    way chosen) all run; the sizes whose stored bytes differ."""
    s = TieredStore.attach(name)
    bad = []
    try:
        for n in ((9 << 20) + 5, (130 << 20) + 7):
            for i in range(6):    # unaligned, and a tail after the last 64-byte line of each length
                a = np.random.default_rng(i).integers(0, 255, n + 11 * i + 3, dtype=np.uint8)[3:]
                s.put("big", a)
                v = s.get("big")
                if not np.array_equal(v, a):
                    bad.append(n)
                del v
    finally:
        s.close()
    return bad


def test_large_puts_store_exact_bytes_whichever_way_the_copy_goes(make_store, store_name):
    """A large copy is streamed past the caches or done by memcpy, the way each process
    measures faster on its first copies of a size class (``_csrc/os.c``)."""
    make_store(dram="320MiB")
    p, q = start(multiprocessing.get_context("spawn"), _large_puts_round_trip, store_name)
    assert finish(p, q, timeout=120) == []
