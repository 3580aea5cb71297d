"""A member's single PUT and GET frames answered in C (``OwnPuts.serve``, _csrc/fast_own.c).

``transport.Server`` hands each whole, plain frame to ``serve`` before its general path.
Its replies must be byte for byte what ``wire.pack`` makes, its puts must keep the version
rule (``Node.apply``: the key's lock, SAME/STALE, the tombstones, the clock, the queue),
and everything else (options, other headers, partial or malformed frames, large or
pinned objects) must be left untouched for the general path, which says what is wrong.
The whole server path runs in tests/test_cluster.py (every node answers this way).
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from yrcache._fast import Clock, KeyLock, OwnPuts
from yrcache.cluster import wire as tp

KiB = 1024


class _Forwarder:
    _asleep = False


@pytest.fixture
def member(make_store):
    """A store with what a member's Node gives OwnPuts (versions, locks, queue, clock)."""
    store = make_store(dram="64MiB")
    m = collections.namedtuple("M", "store own versions tombs single queue clock fw locks")(
        store, None, {}, {}, set(), collections.OrderedDict(), Clock(), _Forwarder(), [KeyLock() for _ in range(64)])
    own = OwnPuts(store._a.hot, m.clock, m.versions, m.tombs, m.single, m.locks, m.fw, m.queue, (), 1000, 256, True)
    own.active = True
    return m._replace(own=own)


def put_frame(key: str, value: bytes, version, *, meta=b"B", flags=0, priority=0, expire_at=0.0) -> bytearray:
    return bytearray(tp.pack(tp.PUT, key.encode(), meta, len(value), flags=flags, version=version,
                             priority=priority, expire_at=expire_at) + value)


def get_frame(key: str, offset=0, length=tp.ALL) -> bytearray:
    return bytearray(tp.pack(tp.GET, key.encode(), offset=offset, length=length))


def test_a_put_is_stored_versioned_observed_and_answered_as_pack_makes(member):
    own, store, versions = member.own, member.store, member.versions
    value = os.urandom(3 * KiB)
    frame = put_frame("k", value, (1 << 60, 9)) + b"next frame"
    got = own.serve(frame, 0, len(frame))
    assert got == (len(frame) - 10, tp.pack(tp.PUT, status=tp.OK))
    assert bytes(store.get("k")) == value and versions["k"] == (1 << 60, 9)
    assert member.clock.last == 1 << 60 and member.clock.next()[0] > 1 << 60       # observed
    assert "k" not in member.queue                                                   # not asked to forward
    # the same version again, then an older one: SAME, STALE, nothing stored
    for version, status in (((1 << 60, 9), tp.SAME), ((1 << 60, 8), tp.STALE), ((5, 1), tp.STALE)):
        f = put_frame("k", b"other", version)
        assert own.serve(f, 0, len(f)) == (len(f), tp.pack(tp.PUT, status=status))
    assert bytes(store.get("k")) == value
    # a delete's tombstone counts as the key's version; a newer put replaces both
    member.tombs["gone"] = ((1 << 61, 0), 0.0)
    f = put_frame("gone", b"late", (1 << 60, 0))
    assert own.serve(f, 0, len(f))[1] == tp.pack(tp.PUT, status=tp.STALE) and "gone" not in store
    f = put_frame("gone", b"later", (1 << 62, 0), flags=tp.F_REPLICATE)
    assert own.serve(f, 0, len(f))[1] == tp.pack(tp.PUT, status=tp.OK)
    assert bytes(store.get("gone")) == b"later" and "gone" not in member.tombs
    assert member.queue["gone"] == ((1 << 62, 0), None)                              # F_REPLICATE: queued
    # a learned array layout: its header is accepted for exactly its size
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    store.put("arr", arr)                                                            # teaches the layout
    meta = store.get_raw("arr")[0]
    f = put_frame("arr2", (arr * 2).tobytes(), (1 << 62, 1), meta=meta)
    assert own.serve(f, 0, len(f))[1] == tp.pack(tp.PUT, status=tp.OK)
    assert np.array_equal(store.get("arr2"), arr * 2)
    f = put_frame("arr3", arr.tobytes()[:-4], (1 << 62, 1), meta=meta)             # 4 bytes short
    assert own.serve(f, 0, len(f)) is None and "arr3" not in store


def test_the_forwarder_is_woken_by_the_caller(member):
    member.fw._asleep = True
    f = put_frame("k", b"v", (1 << 60, 1), flags=tp.F_REPLICATE)
    consumed, reply, key, version = own_serve(member, f)
    assert (consumed, reply, key, version) == (len(f), tp.pack(tp.PUT, status=tp.OK), "k", (1 << 60, 1))
    assert member.queue["k"] == ((1 << 60, 1), None)                                 # queued already


def own_serve(member, frame):
    return member.own.serve(frame, 0, len(frame))


def test_what_a_put_leaves_to_the_general_path(member):
    v = b"x" * 100
    frames = [put_frame("k", v, (9, 9), flags=tp.F_SINGLE), put_frame("k", v, (9, 9), flags=(2 << tp.TIER_SHIFT)),
              put_frame("k", v, (9, 9), priority=3), put_frame("k", v, (9, 9), expire_at=1e10),
              put_frame("k", v, (9, 9), meta=b"P"), put_frame("k", v, (9, 9), meta=b""),
              put_frame("k", v, (9, 9), meta=b"Nfloat32:<f4:(25,)"),                 # a header C does not know
              put_frame("k", b"y" * (64 * KiB + 1), (9, 9)),                          # large: received into place
              bytearray(tp.pack(tp.PUT, b"\xff\xfe", b"B", 1) + b"z"),                # a key that is not UTF-8
              bytearray(tp.pack(tp.PUT, b"a\x00b", b"B", 1) + b"z"),
              bytearray(tp.pack(tp.PUT, b"", b"B", 1) + b"z"),
              bytearray(tp.pack(tp.PUT, b"k" * 1025, b"B", 1) + b"z"),
              bytearray(b"XX" + put_frame("k", v, (9, 9))[2:]),                       # not our magic
              bytearray(tp.pack(tp.KEYS, b"k")), bytearray(tp.pack(tp.DELETE, b"k", version=(9, 9)))]
    whole = put_frame("k", v, (9, 9))
    frames += [whole[:n] for n in (0, 1, tp.HDR.size - 1, tp.HDR.size, tp.HDR.size + 1, len(whole) - 1)]
    for f in frames:
        assert own_serve(member, f) is None, bytes(f[:40])
    assert "k" not in member.store and not member.versions and not member.queue
    member.own.active = False                                                        # not in the ring
    assert own_serve(member, whole) is None
    member.own.active = True
    held = member.locks[hash("k") & 63]
    with held:                                                                       # another writer of "k"
        assert own_serve(member, whole) is None
    assert own_serve(member, whole)[1] == tp.pack(tp.PUT, status=tp.OK)


def test_a_get_is_answered_as_the_general_path_sends_it(member):
    store, own = member.store, member.own
    rng = np.random.default_rng(3)
    values = {"small": rng.bytes(100), "mid": rng.bytes(40 * KiB), "empty": b"",
              "arr": rng.standard_normal((6, 5)).astype(np.float32), "é": b"unicode"}
    for k, v in values.items():
        store.put(k, v)
    member.versions.update({"small": (77, 3), "arr": (1 << 62, 5)})
    for k in values:
        meta, view = store.get_raw(k)
        want = tp.pack(tp.GET, meta=meta, plen=view.nbytes, version=member.versions.get(k, (0, 0))) + bytes(view)
        del view
        for length in (tp.ALL, 64 * KiB):
            f = get_frame(k, length=length)
            assert own.serve(f, 0, len(f)) == (len(f), want), k
    f = get_frame("missing")
    assert own.serve(f, 0, len(f)) == (len(f), tp.pack(tp.GET, status=tp.NOT_FOUND))
    store.put("big", np.zeros(64 * KiB + 1, np.uint8))                               # sent from its pinned view
    for f in (get_frame("big"), get_frame("small", offset=1), get_frame("small", length=10),
              get_frame("small", length=0), bytearray(tp.pack(tp.GET, b"small", b"B")),
              bytearray(tp.pack(tp.GET, b"small", plen=3) + b"abc")):
        assert own.serve(f, 0, len(f)) is None
    assert store.stats()["pinned_bytes"] == 0, "every pin the reads took is released"


def test_frames_are_found_anywhere_in_the_buffer(member):
    a, b = put_frame("a", b"1" * 10, (5, 5)), get_frame("a")
    buf = bytearray(b"junk") + a + b + bytearray(100)
    consumed, _ = member.own.serve(buf, 4, 4 + len(a) + len(b))
    assert consumed == len(a)
    consumed, reply = member.own.serve(buf, 4 + len(a), 4 + len(a) + len(b))
    assert consumed == len(b) and reply.endswith(b"1" * 10)
    with pytest.raises(ValueError):
        member.own.serve(buf, 0, len(buf) + 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), op=st.sampled_from([tp.PUT, tp.GET]), klen=st.integers(0, 2000),
       mlen=st.integers(0, 5000), plen=st.integers(0, 1 << 20), cut=st.integers(0, 400))
def test_garbage_is_left_to_the_general_path_or_answered_whole(member, data, op, klen, mlen, plen, cut):
    head = bytearray(tp.HDR.pack(tp.MAGIC, tp.PROTO, op, 0, 0, klen, mlen, plen, 1, 1, 0, 0.0, 0, tp.ALL))
    for buf in (bytearray(data), (head + bytearray(data))[:cut] + bytearray(data)):
        got = member.own.serve(buf, 0, len(buf))
        assert got is None or 0 < got[0] <= len(buf)
    assert member.store.stats()["pinned_bytes"] == 0
