"""The cluster's MGET in C (``_csrc/fast_wire.c``) against the Python code it stands in for
(and the member's ``KeyLock`` of ``_csrc/fast_own.c`` against ``threading.Lock``).

A member answers an MGET with one C call (``TieredStore.mget_wire``) and a pure client
encodes its request and parses the reply in C (``wire_entries``, ``wire_items``). Each
must give exactly what the general path gives (the reply byte for byte, the parsed items
field for field), fall back where the general path must answer, never crash on a
malformed body, and leave nothing pinned. docs/architecture.md, "Cluster mode".
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from yrcache import TieredStore
from yrcache._fast import keys_valid, wire_entries, wire_items
from yrcache.cluster import wire as tp
from yrcache.cluster.transport import Handler, Server
from yrcache.validate import MAX_KEY_BYTES, key_bytes

KiB = 1024


class _RawHandler(Handler):
    """The general path's answer: mget_raw plus the versions, as a member's Node gives it."""

    def __init__(self, store: TieredStore, versions: dict) -> None:
        self.store, self.versions = store, versions

    def get_many(self, keys):
        return [None if r is None else tp.Got(r[0], r[1], self.versions.get(k, (0, 0)), -1)
                for k, r in zip(keys, self.store.mget_raw(keys))]


class _Body:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def readinto(self, dst) -> None:
        dst[:] = self.body


def _general_reply(store: TieredStore, versions: dict, body: bytes) -> tuple[int, bytes]:
    server = Server.__new__(Server)
    server.handler = _RawHandler(store, versions)
    out: list = []
    server._mget(None, _Body(body), tp.Frame(tp.MGET, 0, 0, "", b"", len(body), (0, 0), 0, 0.0, 0, 0), out)
    head = tp.HDR.unpack(out[0][:tp.HDR.size])
    assert head[6] == 0 and head[7] == sum(memoryview(p).nbytes for p in out[1:])   # no meta; plen
    return head[-1], b"".join(bytes(p) for p in out[1:])                              # (length: keys)


@pytest.fixture
def store(make_store):
    return make_store(dram="64MiB")


def _values() -> dict:
    rng = np.random.default_rng(7)
    out: dict = {}
    for i in range(40):
        out[f"small/{i}"] = rng.bytes(int(rng.integers(0, 3 * KiB)))
    for i in range(10):
        out[f"arr/{i}"] = rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32)
    out["grid"] = rng.integers(0, 9, size=(17, 5), dtype=np.int16)
    for i in range(6):                                  # pinned by the read, copied into the reply
        out[f"mid/{i}"] = rng.bytes(int(rng.integers(5 * KiB, 64 * KiB)))
    out["empty"] = b""
    out["é/ü"] = b"unicode key"
    return out


def test_a_members_mget_reply_built_in_c_equals_the_general_path(store):
    values = _values()
    store.mset(values)
    keys = list(values)
    versions = {k: (1000 + i, 7 * i) for i, k in enumerate(keys) if i % 3}
    rng = np.random.default_rng(1)
    for _ in range(20):
        ask = [str(k) for k in rng.choice(keys + ["missing/1", "missing/2"], size=int(rng.integers(1, 80)))]
        body = tp.encode_entries((k, (0, 0)) for k in ask)
        got = store.mget_wire(bytearray(body), versions)
        assert got is not None, "every object is in DRAM and at most 64 KiB: the C path answers"
        assert got == _general_reply(store, versions, body)
        items = wire_items(bytearray(got[1]), got[0], tp.MAX_META, tp.Got)
        for k, item in zip(ask, items):
            if k.startswith("missing"):
                assert item is None
                continue
            meta, view = store.get_raw(k)
            assert (item.meta, bytes(item.buf), item.version) == (meta, bytes(view), versions.get(k, (0, 0)))
            del view
    assert store.stats()["pinned_bytes"] == 0, "the read's pins are all released"


def test_what_the_c_reply_leaves_to_the_general_path(store):
    store.put("big", np.zeros(64 * KiB + 1, np.uint8))         # sent from its pinned view instead
    store.put("small", b"x")
    body = tp.encode_entries([("small", (0, 0)), ("big", (0, 0))])
    assert store.mget_wire(bytearray(body), {}) is None
    assert store.stats()["pinned_bytes"] == 0
    for bad in (b"", b"\x05\x00" + bytes(16) + b"abc", tp.encode_entries([("ok", (0, 0))])[:-1],
                b"\x00\x00" + bytes(16), b"\x01\x00" + bytes(16) + b"\x00"):
        assert store.mget_wire(bytearray(bad), {}) is None      # the general path raises or answers


def test_a_pickled_object_is_left_to_the_general_path(make_store):
    store = make_store(pickle=True)
    store.put("obj", {"a": 1})                                      # it never travels: that path refuses
    store.put("b", b"x")
    assert store.mget_wire(bytearray(tp.encode_entries([("b", (0, 0)), ("obj", (0, 0))])), {}) is None
    assert store.stats()["pinned_bytes"] == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), cut=st.integers(0, 400), n=st.integers(0, 12))
def test_malformed_bodies_never_crash_either_side(store, data, cut, n):
    store.put("a", b"abc")
    got = store.mget_wire(bytearray(data), {})
    if got is not None:                                     # it parsed as an entry list: as Python does
        assert got[0] == len(tp.decode_entries(data))
    good = tp._GOT_ITEM.pack(1, 1, 3, 1, 2) + b"Babc" + tp._GOT_ITEM.pack(0, 0, 0, 0, 0)
    for body in (data, (good * 6)[:cut]):
        items = wire_items(bytearray(body), n, tp.MAX_META, tp.Got)
        assert items is None or (len(items) == n and all(i is None or bytes(i.buf) == b"abc" for i in items))
    assert store.stats()["pinned_bytes"] == 0


_keys = st.one_of(st.text(max_size=8), st.text(min_size=1020, max_size=1030), st.sampled_from(
    ["\x00", "a\x00b", "\ud800", "é" * 512, "é" * 513, ""]), st.integers(), st.binary(max_size=4))


@given(st.lists(_keys, max_size=6))
def test_request_keys_are_checked_and_encoded_as_the_python_code_does(keys):
    def valid(k) -> bool:
        try:
            key_bytes(k)
        except (TypeError, ValueError):
            return False
        return type(k) is str
    ok = all(valid(k) for k in keys)
    assert keys_valid(keys, MAX_KEY_BYTES) is ok
    body = wire_entries(keys, MAX_KEY_BYTES)
    if ok:
        assert body == tp.encode_entries((k, (0, 0)) for k in keys)
    else:
        assert body is None


_put_items = st.lists(st.tuples(st.text(min_size=1, max_size=12), st.binary(max_size=12), st.binary(max_size=64),
                                st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(-2**63, 2**63 - 1),
                                st.floats(allow_nan=False)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(items=_put_items, cut=st.integers(0, 2000), extra=st.integers(-1, 1))
def test_an_mput_body_parsed_in_c_equals_parse_mput(items, cut, extra):
    from yrcache._fast import wire_mput

    body = bytearray(b"".join(tp._PUT_ITEM.pack(len(k.encode()), len(m), len(p), h, w, pr, ex) + k.encode() + m + p
                              for k, m, p, h, w, pr, ex in items))
    want = [(k, m, p, (h, w), pr, ex) for k, m, p, h, w, pr, ex in items]
    assert wire_mput(body, len(items), tp.MAX_KEY, tp.MAX_META) == tp.parse_mput(body, len(items)) == want
    for bad, n in ((body[:cut], len(items)), (body, max(0, len(items) + extra))):   # cut short, or miscounted
        try:
            ref = tp.parse_mput(bad, n)
        except tp.ProtocolError:
            ref = None
        assert wire_mput(bad, n, tp.MAX_KEY, tp.MAX_META) == ref


_put_rows = st.lists(st.tuples(st.one_of(st.text(min_size=1, max_size=12), st.just("a\x00"), st.integers()),
                               st.binary(max_size=12), st.binary(max_size=80),
                               st.sampled_from([0, 0, 0, 0, 1, -1]),         # nbytes = len(payload) + this
                               st.integers(0, 2**64 - 1), st.integers(-2**63, 2**63 - 1),
                               st.one_of(st.floats(allow_nan=False), st.integers(0, 5))), max_size=8)


@settings(max_examples=300, deadline=None)
@given(rows=_put_rows)
def test_put_items_are_encoded_in_c_as_put_item_encodes_them(rows):
    from yrcache._fast import wire_puts
    from yrcache.cluster.peer import put_item

    items = [(k, m, p, len(p) + off, (h, 7), pr, ex) for k, m, p, off, h, pr, ex in rows]
    body = wire_puts(items, tp.MAX_KEY, tp.MAX_META, 64)
    fits = all(type(k) is str and valid_key(k) and n == len(p) <= 64 and type(ex) is float
               for k, _m, p, n, _v, _pr, ex in items)
    if not fits:
        assert body is None                  # the Python encoder takes these
    else:
        assert body == b"".join(put_item(it) for it in items)
        assert tp.parse_mput(bytearray(body), len(items)) == [(k, m, bytes(p), v, pr, ex)
                                                              for k, m, p, _n, v, pr, ex in items]


def valid_key(k: str) -> bool:
    try:
        key_bytes(k)
    except ValueError:
        return False
    return True


def test_a_key_lock_behaves_as_threading_lock():
    """``KeyLock`` (_csrc/fast_own.c) stands in for the member's 64 ``threading.Lock``s:
    not reentrant, a non-blocking acquire says whether it took it, a blocking one waits
    for the holder (another thread may release it), releasing a free lock raises."""
    import threading
    import time

    from yrcache._fast import KeyLock

    lk = KeyLock()
    assert not lk.locked() and lk.acquire() is True and lk.locked()
    assert lk.acquire(False) is False
    got = []
    t = threading.Thread(target=lambda: got.append((lk.acquire(), time.monotonic())))
    t.start()
    time.sleep(0.2)
    assert not got                                  # waiting for the holder, the GIL free meanwhile
    released = time.monotonic()
    lk.release()
    t.join(5)
    assert got and got[0][0] is True and got[0][1] >= released
    lk.release()                                    # another thread took it; this one may release it
    with pytest.raises(RuntimeError):
        lk.release()
    with lk:
        assert lk.locked()
    assert not lk.locked()
    with pytest.raises(KeyError):
        with lk:
            raise KeyError("an error inside")
    assert not lk.locked()
