"""Bad input: every way of calling TieredStore wrongly fails loudly and clearly.

Keys, values, sizes, ttl, tier/write_mode values, store names, closed
handles, missing and foreign-owned stores, full stores and tiers that do not
exist yet (README, "Semantics worth knowing"; docs/architecture.md).
"""

from __future__ import annotations

import gc
import os
import pickle
import re
import sys

import numpy as np
import pytest

from yrcache import (
    StoreClosedError,
    StoreFullError,
    StoreNotFoundError,
    Tier,
    TieredStore,
    WriteMode,
    YrcacheError,
)

# conftest's store_name runs gc.collect() after every test; keep the objects
# that live for the whole session (numpy, yrcache, ...) out of its way.  torch
# is imported lazily: spawned children import this module and need no torch.
gc.freeze()


def shm_path(name: str) -> str:
    return f"/dev/shm/yrcache.{name}"


# ------------------------------------------------------------------ keys

BAD_KEYS = [
    pytest.param(b"key", TypeError, r"\bstr\b", id="bytes"),
    pytest.param(1, TypeError, r"\bstr\b", id="int"),
    pytest.param(None, TypeError, r"\bstr\b", id="None"),
    pytest.param(("a",), TypeError, r"\bstr\b", id="tuple"),
    pytest.param("", ValueError, r"(?i)empty", id="empty"),
    pytest.param("k" * 1025, ValueError, r"1024", id="1025-ascii"),
    pytest.param("é" * 512 + "k", ValueError, r"1024", id="1025-utf8-bytes"),
    pytest.param("🚀" * 257, ValueError, r"1024", id="1028-utf8-bytes"),
    pytest.param("a\x00b", ValueError, r"NUL", id="nul"),
    pytest.param("\x00", ValueError, r"NUL", id="only-nul"),
    pytest.param("a\ud800b", ValueError, r"(?i)surrogate|utf-8", id="lone-surrogate"),
    pytest.param("\udfff", ValueError, r"(?i)surrogate|utf-8", id="lone-low-surrogate"),
]

KEYED_CALLS = {
    "put": lambda s, k: s.put(k, b"v"),
    "setitem": lambda s, k: s.__setitem__(k, b"v"),
    "get": lambda s, k: s.get(k),
    "get_copy": lambda s, k: s.get(k, copy=True),
    "getitem": lambda s, k: s[k],
    "get_into": lambda s, k: s.get_into(k, bytearray(1)),
    "delete": lambda s, k: s.delete(k),
    "delitem": lambda s, k: s.__delitem__(k),
    "mset": lambda s, k: s.mset({k: b"v"}),
    "mset_pairs": lambda s, k: s.mset([(k, b"v")]),
    "mget": lambda s, k: s.mget(["fine", k]),
    "tier_of": lambda s, k: s.tier_of(k),
}


@pytest.fixture
def store(make_store):
    return make_store(dram="4MiB")


@pytest.mark.parametrize("call", list(KEYED_CALLS))
@pytest.mark.parametrize("key, exc, rule", BAD_KEYS)
def test_bad_keys_rejected_by_every_method(store, call, key, exc, rule):
    with pytest.raises(exc) as ei:
        KEYED_CALLS[call](store, key)
    assert type(ei.value) is exc, f"{type(ei.value).__name__}: {ei.value}"
    assert re.search(rule, str(ei.value)), f"message does not name the rule: {ei.value}"
    assert len(store) == 0
    assert list(store.keys()) == []


@pytest.mark.parametrize("key, exc, rule", BAD_KEYS)
def test_bad_keys_are_never_contained(store, key, exc, rule):
    assert (key in store) is False


def test_key_limits_are_exact(store):
    store["k" * 1024] = b"1024 ascii"
    store["é" * 512] = b"1024 utf-8 bytes"
    store["🚀" * 256] = b"1024 utf-8 bytes, 4 each"
    store["x"] = b"one"
    assert len(store) == 4
    assert store["k" * 1024].tobytes() == b"1024 ascii"
    assert sorted(store.keys()) == sorted(["k" * 1024, "é" * 512, "🚀" * 256, "x"])


def test_str_subclass_key_is_a_plain_key(store):
    class MyStr(str):
        pass

    store[MyStr("sub")] = b"v"
    assert store["sub"].tobytes() == b"v"
    assert [type(k) for k in store.keys()] == [str]


@pytest.mark.parametrize("prefix", [1, b"p"])
def test_keys_prefix_must_be_str(store, prefix):
    store["p1"] = b"x"
    with pytest.raises(TypeError):
        list(store.keys(prefix=prefix))


def test_keys_prefix_lone_surrogate(store):
    store["p1"] = b"x"
    with pytest.raises(ValueError):
        list(store.keys(prefix="\ud800"))


# ---------------------------------------------------------------- values


class Opaque:
    def __init__(self, x=1):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


UNSUPPORTED = [
    pytest.param(lambda: object(), id="object"),
    pytest.param(lambda: Opaque(), id="class-instance"),
    pytest.param(lambda: "a string", id="str"),
    pytest.param(lambda: [1, 2, 3], id="list"),
    pytest.param(lambda: {"a": 1}, id="dict"),
    pytest.param(lambda: (1, 2), id="tuple"),
    pytest.param(lambda: 3, id="int"),
    pytest.param(lambda: 1.5, id="float"),
    pytest.param(lambda: None, id="None"),
    pytest.param(lambda: True, id="bool"),
    pytest.param(lambda: np.float32(2.5), id="numpy-scalar"),
]

UNSUPPORTED_DTYPES = [
    pytest.param(lambda: np.array([object(), 1], dtype=object), "object", id="object-dtype"),
    pytest.param(lambda: np.array(["a", "bc"]), "<U2", id="str-dtype"),
    pytest.param(lambda: np.array([b"a", b"bc"]), "S2", id="bytes-dtype"),
    pytest.param(lambda: np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), "a", id="structured"),
    pytest.param(lambda: np.zeros(3, dtype="datetime64[s]"), "datetime64", id="datetime64"),
    pytest.param(lambda: np.zeros(3, dtype="V8"), "V8", id="void"),
]


@pytest.mark.parametrize("make", UNSUPPORTED)
def test_unsupported_values_raise_typeerror_saying_what_to_do(store, make):
    store["k"] = b"old"
    for put in (lambda v: store.put("k", v), lambda v: store.__setitem__("k", v),
                lambda v: store.mset({"k": v})):
        with pytest.raises(TypeError) as ei:
            put(make())
        msg = str(ei.value)
        assert "pickle=True" in msg, msg
        assert re.search(r"bytes|numpy|ndarray|tensor", msg), msg
    assert store["k"].tobytes() == b"old"
    assert len(store) == 1


@pytest.mark.parametrize("make, named", UNSUPPORTED_DTYPES)
def test_unsupported_numpy_dtypes_raise_typeerror(store, make, named):
    with pytest.raises(TypeError) as ei:
        store["k"] = make()
    msg = str(ei.value)
    assert named in msg, f"message does not name the dtype: {msg}"
    assert re.search(r"numeric|pickle=True", msg), f"message does not say what to do: {msg}"
    assert "k" not in store


def test_sparse_tensor_raises_typeerror(store):
    torch = pytest.importorskip("torch")
    gc.freeze()
    sp = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match="dense"):
        store["sp"] = sp
    assert "sp" not in store


def _odd_tensors():
    torch = pytest.importorskip("torch")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch warns that nested tensors are a prototype
        return {
            "quantized": (torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.quint8), "scale and zero point"),
            "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
            "jagged": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "nested"),
            "meta": (torch.empty(3, device="meta"), "meta tensor has no data"),
        }


@pytest.mark.parametrize("kind", ["quantized", "nested", "jagged", "meta"])
def test_tensors_whose_bytes_are_not_the_value_are_refused(store, kind):
    """Their bytes alone would read back as something else (a quantized tensor without its scale
    and zero point was read back as an unusable quint8 tensor), or they have none."""
    value, says = _odd_tensors()[kind]
    with pytest.raises(TypeError, match=says):
        store["t"] = value
    assert "t" not in store


def test_get_into_a_tensor_without_memory_of_its_own_is_refused(store):
    torch = pytest.importorskip("torch")
    store["t"] = torch.ones(3)
    with pytest.raises(ValueError, match="cannot write into a meta tensor"):
        store.get_into("t", torch.empty(3, device="meta"))


@pytest.mark.parametrize("make", UNSUPPORTED + [pytest.param(p.values[0], id=p.id)
                                                for p in UNSUPPORTED_DTYPES])
def test_pickle_store_accepts_arbitrary_objects(make_store, make):
    s = make_store(dram="4MiB", pickle=True)
    value = make()
    s["k"] = value
    got = s["k"]
    if isinstance(value, np.ndarray):
        assert got.dtype == value.dtype and got.shape == value.shape
        if value.dtype != object:
            np.testing.assert_array_equal(got, value)
    elif type(value) is object:
        assert type(got) is object
    else:
        assert type(got) is type(value)
        assert got == value
    s.mset({"m": value})
    assert "m" in s


def test_pickle_store_round_trips_nested_objects(make_store):
    s = make_store(dram="4MiB", pickle=True)
    value = {"a": [1, 2.5, "x", None], "b": (Opaque(7), {3, 4}), "c": np.arange(3)}
    s["v"] = value
    got = s["v"]
    assert got["a"] == value["a"] and got["b"] == value["b"]
    np.testing.assert_array_equal(got["c"], value["c"])
    assert got is not value


# --------------------------------------------------- encoded payloads

BAD_ENCODED = [
    (b"B", 100, b"abc", ValueError, r"a payload of 3 bytes, but nbytes=100"),   # would read past it
    (b"B", -1, b"", ValueError, r"nbytes must be an int >= 0"),
    (b"B", 2.5, b"ab", ValueError, r"nbytes must be an int >= 0"),
    (b"B", True, b"a", ValueError, r"nbytes must be an int >= 0"),
    (b"B", 3, object(), TypeError, r"a function that fills the block or a contiguous buffer"),
    (b"N;<i8;4", 8, b"12345678", ValueError, r"says 32 bytes, but nbytes=8"),
    (b"N;nonsense;4", 8, b"12345678", ValueError, r"unreadable value header"),
    ("B", 3, b"abc", TypeError, r"meta must be bytes"),
    (b"N;<i8;5", 40, np.arange(10, dtype=np.int64)[::2], ValueError, r"not C-contiguous"),
]


@pytest.mark.parametrize("meta, nbytes, payload, exc, rule", BAD_ENCODED)
def test_encoded_payloads_are_checked_before_a_byte_is_copied(store, meta, nbytes, payload, exc, rule):
    """``put_with`` and ``mput_raw`` copy ``nbytes`` from the buffer they are given: a
    shorter buffer used to be read past its end (and stored what followed it)."""
    with pytest.raises(exc, match=rule):
        store.put_with("enc", meta, nbytes, payload)
    with pytest.raises(exc, match=rule):
        store.mput_raw([("enc/ok", b"B", b"ok", 2), ("enc", meta, payload, nbytes)])
    assert "enc" not in store and "enc/ok" not in store      # validated before anything is stored
    store.put_with("enc", b"N;<i8;1", 8, np.arange(1, dtype=np.int64))
    assert store["enc"].tolist() == [0]


# ------------------------------------------------------------ full store


def test_value_larger_than_store_raises_storefull(make_store):
    s = make_store(dram="1MiB")
    s["small"] = b"keep me"
    with pytest.raises(StoreFullError) as ei:
        s["huge"] = np.zeros(2 << 20, np.uint8)
    err = ei.value
    assert isinstance(err, MemoryError)
    assert isinstance(err, YrcacheError)
    assert "dram=" in str(err)
    assert "huge" not in s
    assert s["small"].tobytes() == b"keep me"
    s.check()
    s["after"] = b"still usable"
    assert len(s) == 2


def test_store_full_then_room_after_delete(make_store):
    s = make_store(dram="1MiB")
    chunk = 100 * 1024
    put = []
    with pytest.raises(StoreFullError) as ei:
        for i in range(64):
            s[f"c{i}"] = np.full(chunk, i % 256, np.uint8)
            put.append(f"c{i}")
    assert 3 <= len(put) < 64
    assert isinstance(ei.value, MemoryError) and "dram=" in str(ei.value)
    failed = f"c{len(put)}"
    assert failed not in s
    for i, k in enumerate(put):
        assert s[k][0] == i % 256 and s[k].nbytes == chunk
    s.check()
    s.delete(put[0])
    s.delete(put[1])
    s[failed] = np.full(chunk, 7, np.uint8)
    assert s[failed][0] == 7
    s.check()


def test_failed_overwrite_keeps_old_value(make_store):
    s = make_store(dram="1MiB")
    s["k"] = np.arange(1000)
    with pytest.raises(StoreFullError):
        s["k"] = np.zeros(2 << 20, np.uint8)
    np.testing.assert_array_equal(s["k"], np.arange(1000))
    with pytest.raises(StoreFullError):
        s.mset({"k": np.zeros(2 << 20, np.uint8)})
    np.testing.assert_array_equal(s["k"], np.arange(1000))


# --------------------------------------------------------- closed handle

CLOSED_CALLS = {
    "put": lambda s: s.put("a", b"x"),
    "setitem": lambda s: s.__setitem__("a", b"x"),
    "get": lambda s: s.get("a"),
    "get_default": lambda s: s.get("a", 1),
    "getitem": lambda s: s["a"],
    "get_into": lambda s: s.get_into("a", bytearray(1)),
    "mget": lambda s: s.mget(["a"]),
    "mset": lambda s: s.mset({"a": b"x"}),
    "delete": lambda s: s.delete("a"),
    "delitem": lambda s: s.__delitem__("a"),
    "contains": lambda s: "a" in s,
    "len": lambda s: len(s),
    "iter": lambda s: list(iter(s)),
    "keys": lambda s: list(s.keys()),
    "keys_prefix": lambda s: list(s.keys(prefix="a")),
    "values": lambda s: list(s.values()),
    "items": lambda s: list(s.items()),
    "tier_of": lambda s: s.tier_of("a"),
    "stats": lambda s: s.stats(),
    "flush": lambda s: s.flush(),
    "check": lambda s: s.check(),
    "clear": lambda s: s.clear(),
    "update": lambda s: s.update({"a": b"x"}),
    "setdefault": lambda s: s.setdefault("a", b"x"),
    "pop": lambda s: s.pop("a"),
    "pop_default": lambda s: s.pop("a", None),
    "popitem": lambda s: s.popitem(),
    "eq": lambda s: s == {"a": b"x"},
    "enter": lambda s: s.__enter__(),
}


@pytest.mark.parametrize("how", ["owner", "attached", "destroyed"])
def test_every_method_raises_storeclosed_after_close(make_store, store_name, how):
    owner = make_store(dram="1MiB")
    owner["a"] = b"x"
    if how == "owner":
        s = owner
        s.close()
    elif how == "attached":
        s = TieredStore.attach(store_name)
        s.close()
        assert owner["a"].tobytes() == b"x"  # detaching left the owner alone
    else:
        s = owner
        s.destroy()
    assert s.closed
    for name, call in CLOSED_CALLS.items():
        with pytest.raises(StoreClosedError) as ei:
            call(s)
        assert isinstance(ei.value, RuntimeError), name
        assert "closed" in str(ei.value), (name, str(ei.value))
    s.close()  # closing again is harmless
    assert "closed" in repr(s)


def test_attach_to_missing_store(store_name):
    with pytest.raises(StoreNotFoundError) as ei:
        TieredStore.attach(store_name)
    assert isinstance(ei.value, FileNotFoundError)
    assert isinstance(ei.value, YrcacheError)
    assert store_name in str(ei.value)
    assert not os.path.exists(shm_path(store_name))


def test_attach_after_owner_closed(store_name):
    s = TieredStore(name=store_name, dram="1MiB")
    s.close()
    with pytest.raises(StoreNotFoundError):
        TieredStore.attach(store_name)


def test_unpickle_of_a_gone_store_raises_storenotfound(store_name):
    s = TieredStore(name=store_name, dram="1MiB")
    blob = pickle.dumps(s)
    s.close()
    with pytest.raises(StoreNotFoundError):
        pickle.loads(blob)


# ------------------------------------------------------------------ sizes

BAD_SIZES = [
    pytest.param("12XB", ValueError, id="unknown-unit"),
    pytest.param("", ValueError, id="empty"),
    pytest.param("GiB", ValueError, id="unit-only"),
    pytest.param("1.5.5GiB", ValueError, id="two-dots"),
    pytest.param("-1MiB", ValueError, id="negative-str"),
    pytest.param("ten MiB", ValueError, id="words"),
    pytest.param(-1, ValueError, id="negative-int"),
    pytest.param(-1.5, ValueError, id="negative-float"),
    pytest.param(float("nan"), ValueError, id="nan"),
    pytest.param(float("inf"), ValueError, id="inf"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param(False, TypeError, id="bool-false"),
    pytest.param([1 << 20], TypeError, id="list"),
    pytest.param(b"1MiB", TypeError, id="bytes"),
    pytest.param(1000, ValueError, id="below-minimum"),
    pytest.param("0", ValueError, id="zero"),
]


@pytest.mark.parametrize("size, exc", BAD_SIZES)
def test_bad_dram_sizes(store_name, size, exc):
    with pytest.raises(exc) as ei:
        TieredStore(name=store_name, dram=size)
    assert type(ei.value) is exc or isinstance(ei.value, exc), repr(ei.value)
    assert "dram" in str(ei.value)
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("size, exc", [p for p in BAD_SIZES if p.id not in ("below-minimum", "zero")])
def test_bad_capacity_sizes(store_name, size, exc):
    with pytest.raises(exc) as ei:
        TieredStore(name=store_name, capacity=size)
    assert "capacity" in str(ei.value)
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("size, nbytes", [("1MiB", 1 << 20), ("2.5MiB", int(2.5 * (1 << 20))),
                                          ("2000000", 2_000_000), ("1.5MB", 1_500_000),
                                          (3 << 20, 3 << 20), (" 2 mib ", 2 << 20)])
def test_good_sizes_accepted(store_name, size, nbytes):
    s = TieredStore(name=store_name, dram=size)
    try:
        cap = s.stats()["tiers"]["dram"]["capacity"]
        assert 0.5 * nbytes < cap <= nbytes
    finally:
        s.close()


@pytest.mark.parametrize("ratios", [(0.5, 0.5), (0.2, 0.2, 0.2), (-0.5, 1.5, 0.0), (0, 1, 0, 0)])
def test_bad_ratios(store_name, ratios):
    with pytest.raises(ValueError, match="ratios"):
        TieredStore(name=store_name, capacity="4MiB", ratios=ratios)


def test_ratios_without_capacity(store_name):
    with pytest.raises(ValueError, match="capacity"):
        TieredStore(name=store_name, ratios=(0, 1, 0))


def test_bad_policy(store_name):
    with pytest.raises(ValueError, match="policy"):
        TieredStore(name=store_name, dram="1MiB", policy="lru")


# -------------------------------------------------------------------- ttl

BAD_TTLS = [
    pytest.param(0, id="zero"),
    pytest.param(-1, id="negative"),
    pytest.param(-0.001, id="negative-float"),
    pytest.param(float("nan"), id="nan"),
    pytest.param("1", id="str"),
    pytest.param(True, id="bool"),
    pytest.param([1], id="list"),
]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_bad_ttl(store, ttl):
    with pytest.raises((ValueError, TypeError)) as ei:
        store.put("k", b"v", ttl=ttl)
    assert "ttl" in str(ei.value)
    with pytest.raises((ValueError, TypeError)):
        store.mset({"k": b"v"}, ttl=ttl)
    assert "k" not in store


def test_good_ttl_values(store):
    store.put("a", b"v", ttl=1)
    store.put("b", b"v", ttl=0.5)
    store.put("c", b"v", ttl=None)
    store.put("d", b"v", ttl=3600.0)
    assert len(store) == 4


# --------------------------------------------------------- tier / write_mode


@pytest.mark.parametrize("tier", ["dram", "DRAM", 5, -1, object()])
def test_bad_tier_values(store, tier):
    with pytest.raises((TypeError, ValueError)) as ei:
        store.put("k", b"v", tier=tier)
    assert "tier" in str(ei.value).lower()
    with pytest.raises((TypeError, ValueError)):
        store.mset({"k": b"v"}, tier=tier)
    assert "k" not in store


def test_tier_dram_and_none_accepted(store):
    store.put("a", b"1", tier=Tier.DRAM)
    store.put("b", b"2", tier=None)
    store.mset({"c": b"3"}, tier=Tier.DRAM)
    assert store.tier_of("a") == Tier.DRAM and len(store) == 3


@pytest.mark.parametrize("mode", ["bogus", "WRITE-THROUGH", "", 3, object()])
def test_bad_write_mode(store, store_name, mode):
    with pytest.raises((ValueError, TypeError)) as ei:
        store.put("k", b"v", write_mode=mode)
    assert "write_mode" in str(ei.value)
    with pytest.raises((ValueError, TypeError)):
        store.mset({"k": b"v"}, write_mode=mode)
    assert "k" not in store
    with pytest.raises((ValueError, TypeError)):
        TieredStore(name=store_name + "-wm", dram="1MiB", write_mode=mode)
    assert not os.path.exists(shm_path(store_name + "-wm"))


@pytest.mark.parametrize("mode", [None, WriteMode.WRITE_THROUGH, WriteMode.ASYNC, WriteMode.NONE,
                                  "write_through", "async", "none"])
def test_good_write_modes_accepted(store, mode):
    store.put("k", b"v", write_mode=mode)
    store.mset({"m": b"v"}, write_mode=mode)
    assert store["k"].tobytes() == b"v" and "m" in store


# ------------------------------------------------------------- store names

BAD_NAMES = [
    pytest.param("a/b", id="slash"),
    pytest.param("/abs", id="leading-slash"),
    pytest.param("", id="empty"),
    pytest.param("x" * 201, id="too-long"),
    pytest.param("with space", id="space"),
    pytest.param("é", id="non-ascii"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\nb", id="newline"),
    pytest.param(5, id="int"),
    pytest.param(b"name", id="bytes"),
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_store_names(name):
    before = set(os.listdir("/dev/shm"))
    with pytest.raises((ValueError, TypeError)) as ei:
        TieredStore(name=name, dram="1MiB")
    assert "name" in str(ei.value)
    with pytest.raises((ValueError, TypeError)):
        TieredStore.attach(name)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_longest_store_name_accepted():
    name = (f"t{os.getpid()}-" + "n" * 200)[:200]
    s = TieredStore(name=name, dram="1MiB")
    try:
        assert os.path.exists(shm_path(name))
    finally:
        s.close()
    assert not os.path.exists(shm_path(name))


# ------------------------------------------------- names owned by others


def _own_store(name, ready, done):
    from yrcache import TieredStore

    s = TieredStore(name=name, dram="1MiB")
    s["from-child"] = b"hi"
    ready.set()
    done.wait(60)
    s.close()


def _crash_owning(name):
    from yrcache import TieredStore

    s = TieredStore(name=name, dram="1MiB")
    s["left-behind"] = b"old"
    os._exit(0)  # no close: the segment stays, its owner is dead


def test_create_over_live_owner_raises_fileexists(mp_context, store_name):
    ready, done = mp_context.Event(), mp_context.Event()
    p = mp_context.Process(target=_own_store, args=(store_name, ready, done))
    p.start()
    try:
        assert ready.wait(60), "child never created its store"
        with pytest.raises(FileExistsError) as ei:
            TieredStore(name=store_name, dram="1MiB")
        assert store_name in str(ei.value)
        assert "attach" in str(ei.value)
        # the refused create neither damaged nor detached the owner's store
        other = TieredStore.attach(store_name)
        try:
            assert other["from-child"].tobytes() == b"hi"
            other.check()
        finally:
            other.close()
    finally:
        done.set()
        p.join(60)
    assert p.exitcode == 0
    assert not os.path.exists(shm_path(store_name))


def test_create_over_dead_owner_adopts(mp_context, store_name):
    p = mp_context.Process(target=_crash_owning, args=(store_name,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert os.path.exists(shm_path(store_name))
    s = TieredStore(name=store_name, dram="1MiB")
    try:
        assert s["left-behind"].tobytes() == b"old"
        s.check()
    finally:
        s.close()
    assert not os.path.exists(shm_path(store_name))


# ------------------------------------------- tiers the store does not have
#
# Until a tier landed, asking for it raised NotImplementedError; once it
# exists, asking a store that was not given it raises ValueError.  Either
# way the message names the tier, and nothing is created or stored.


def _cuda_available() -> bool:
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available()


@pytest.mark.parametrize("kw", [
    pytest.param(dict(hbm="1GiB"), id="hbm-without-device"),
    pytest.param(dict(capacity="8MiB", ratios=(0.5, 0.5, 0.0)), id="hbm-share-without-device"),
    pytest.param(dict(device="cuda:0"), id="device-without-hbm"),
    pytest.param(dict(device="cpu"), id="cpu-device-without-hbm"),
])
def test_hbm_tier_needs_size_and_device(store_name, kw):
    if "device" not in kw and _cuda_available():
        pytest.skip("with CUDA present an HBM tier on the default device is legitimate")
    with pytest.raises((NotImplementedError, ValueError)) as ei:
        TieredStore(name=store_name, dram="1MiB", **kw)
    assert re.search(r"(?i)hbm", str(ei.value)), str(ei.value)
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("device", ["nonsense", "gpu:0", "cuda:x"])
def test_bad_device_values(store_name, device):
    with pytest.raises((ValueError, TypeError)) as ei:
        TieredStore(name=store_name, dram="1MiB", hbm="2MiB", device=device)
    assert "device" in str(ei.value), str(ei.value)
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("size, exc", [p for p in BAD_SIZES if p.id in
                                       ("unknown-unit", "negative-int", "nan", "bool", "list")])
def test_bad_hbm_sizes(store_name, size, exc):
    with pytest.raises(exc) as ei:
        TieredStore(name=store_name, dram="1MiB", hbm=size, device="cpu")
    assert "hbm" in str(ei.value)
    assert not os.path.exists(shm_path(store_name))


def test_put_to_hbm_without_an_hbm_tier(store):
    torch = pytest.importorskip("torch")
    for call in (lambda: store.put("k", torch.ones(4), tier=Tier.HBM),
                 lambda: store.mset({"k": torch.ones(4)}, tier=Tier.HBM)):
        with pytest.raises((NotImplementedError, ValueError)) as ei:
            call()
        assert re.search(r"(?i)hbm", str(ei.value)), str(ei.value)
    assert "k" not in store


def test_put_to_ssd_without_an_ssd_tier(store):
    for call in (lambda: store.put("k", b"v", tier=Tier.SSD),
                 lambda: store.mset({"k": b"v"}, tier=Tier.SSD)):
        with pytest.raises((NotImplementedError, ValueError)) as ei:
            call()
        assert re.search(r"(?i)ssd", str(ei.value)), str(ei.value)
    assert "k" not in store


def test_ssd_size_without_ssd(store_name):
    with pytest.raises((NotImplementedError, ValueError)) as ei:
        TieredStore(name=store_name, dram="1MiB", ssd_size="10MiB")
    assert re.search(r"(?i)ssd", str(ei.value)), str(ei.value)
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("call", ["mget", "mget_raw"])
def test_a_batch_call_given_one_key_says_so(store, call):
    """A str is an iterable of its letters: mget("ab") looked up "a" and "b"."""
    store["a"] = b"x"
    with pytest.raises(TypeError, match="not one str 'ab'"):
        getattr(store, call)("ab")
    assert getattr(store, call)(iter(["a", "b"]))[1] is None    # other iterables still do


def test_empty_ssd_path_is_refused(store_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                   # "" used to make the tier right here
    with pytest.raises(ValueError, match="ssd= is an empty path: pass the directory"):
        TieredStore(name=store_name, dram="1MiB", ssd="")
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(shm_path(store_name))


def _ssd_path(tmp_path, case: str) -> tuple[str, type, str]:
    """An ssd= that cannot be a directory, the error it must raise and what that says."""
    if case == "in /proc":
        return "/proc/yrcache-ssd", FileNotFoundError, r"cannot create SSD tier directory /proc/yrcache-ssd: " \
            r"/proc exists but does not let directories be made in it"
    if case == "deep in /proc":
        return "/proc/yrcache/ssd", FileNotFoundError, r"cannot create /proc/yrcache, a parent of SSD tier"
    nvme = tmp_path / "nvme"                       # a mount point with nothing mounted on it
    nvme.mkdir()
    link = tmp_path / "link"
    os.symlink(nvme / "yrcache", link)
    dangling = rf"{link} is a symbolic link to {nvme / 'yrcache'}, which does not exist \(a disk that is not mounted\?\)"
    if case == "dangling symlink":
        return str(link), FileNotFoundError, dangling
    if case == "under a dangling symlink":
        return str(link / "a" / "ssd"), FileNotFoundError, dangling
    (tmp_path / "file").write_bytes(b"")
    return str(tmp_path / "file" / "ssd"), NotADirectoryError, rf"{tmp_path / 'file'} exists and is not a directory"


@pytest.mark.parametrize("case", ["in /proc", "deep in /proc", "dangling symlink", "under a dangling symlink",
                                  "under a file"])
def test_ssd_path_that_cannot_be_a_directory_is_explained(store_name, tmp_path, case):
    if "proc" in case and not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    ssd, exc, says = _ssd_path(tmp_path, case)
    with pytest.raises(exc, match=says):
        TieredStore(name=store_name, dram="1MiB", ssd=ssd)
    assert not os.path.exists(tmp_path / "nvme" / "yrcache"), "made a directory where the disk should be"
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("env,what", [("YRCACHE_DRAM", "dram"), ("YRCACHE_SSD_SIZE", "ssd_size"),
                                      ("YRCACHE_HBM", "hbm")])
def test_a_bad_size_in_the_environment_names_the_variable(store_name, monkeypatch, env, what):
    monkeypatch.setenv(env, "bogus")
    with pytest.raises(ValueError, match=f"cannot parse {env} \\(the environment's {what}\\) 'bogus'"):
        TieredStore(name=store_name)
    assert not os.path.exists(shm_path(store_name))


def test_a_batch_that_does_not_fit_says_what_it_stored(make_store):
    """mset is not atomic: the error names the values it did not store (the rest are there)."""
    s = make_store(dram="8MiB")
    s["old"] = b"keep"
    batch = {"m1": np.ones(1000), "old": b"new", "m2": np.ones(2_000_000), "m3": np.ones(10), "m4": np.ones(100_000)}
    with pytest.raises(StoreFullError) as ei:
        s.mset(batch)
    if sys.version_info >= (3, 11):                 # exception notes
        assert ei.value.__notes__ == ["the batch stored every value but 2: 'm2', 'm4'"]
    assert sorted(s.keys()) == ["m1", "m3", "old"] and bytes(s["old"]) == b"new"


@pytest.mark.parametrize("items, says", [([1, 2], "item 0 is int 1, not a pair"),
                                         ([("a", b"x"), ("b",)], "item 1 is tuple ('b',), not a pair"),
                                         ("ab", "not str"), (5, "not int")])
def test_mset_of_something_that_is_not_pairs_says_what_to_pass(store, items, says):
    """``s.mset([1, 2])`` raised "cannot unpack non-iterable int object"."""
    with pytest.raises(TypeError, match="mset takes a mapping or") as e:
        store.mset(items)
    assert says in str(e.value)
    assert len(store) == 0


def test_mset_takes_pairs_as_lists_too(store):
    store.mset([["a", b"x"], ("b", b"y")])
    assert bytes(store["a"]) == b"x" and bytes(store["b"]) == b"y"
