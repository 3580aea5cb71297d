"""A large write that only an attached process's own member takes goes into the node's
arena from that process (``ClusterStore._put_here``) and the member takes it at a
version (``ADOPT``), instead of crossing a loopback connection. A real etcd and real
``yrcache node`` members; loopback traffic is read from ``/proc/net/dev``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("pyetcd")
from cluster_util import ClusterHarness, wait_for  # noqa: E402

from yrcache import TieredStore, WriteMode, codec  # noqa: E402
from yrcache.cluster import transport as tp  # noqa: E402
from yrcache.cluster.sharing import HERE_MIN  # noqa: E402
from yrcache.cluster.wire import RemoteError  # noqa: E402

BIG = 4 << 20            # bytes of a large value: what crosses the loopback shows it


@pytest.fixture
def harness(etcd, tmp_path):
    h = ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="1")
    yield h
    h.close()


def loopback_bytes() -> int:
    """Bytes sent over ``lo`` so far (every process of this machine)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])        # transmitted bytes
    raise AssertionError("no lo in /proc/net/dev")


def key_owned_by(store, member: str, prefix: str) -> str:
    return next(k for k in (f"{prefix}{i}" for i in range(10_000)) if store.owners(k) == [member])


@contextlib.contextmanager
def two_nodes(h, replicas: int = 1):
    """Two members; a store attached to the first one's arena and a pure client, both
    seeing both members."""
    n1, n2 = h.start(2)
    url = f"etcd://{h.etcd.endpoint}/{h.cluster}"
    with TieredStore(n1.name, cluster=url, replicas=replicas, lease_ttl=2.0) as s, \
            h.client(replicas=replicas) as c:
        h.wait_members(s, 2)
        h.wait_members(c, 2)
        yield n1, n2, s, c


def sent(fn) -> int:
    before = loopback_bytes()
    fn()
    return loopback_bytes() - before


def test_large_writes_to_the_own_member_skip_the_socket_and_read_back_everywhere(harness):
    """put and put_with of values of 256 KiB or more to keys this node's member owns move
    (almost) no bytes over loopback, the member lists them at a version, and the other
    node and a pure client read them; a key owned elsewhere, a small value, a tier hint
    and a key the arena already holds are sent as before; every write reads back."""
    big = np.arange(BIG // 8, dtype=np.int64)
    with two_nodes(harness) as (n1, n2, s, c):
        assert s.role == "attached"
        mine, mine2, mine3 = (key_owned_by(s, n1.member_id, p) for p in ("a", "b", "c"))
        theirs = key_owned_by(s, n2.member_id, "d")
        assert sent(lambda: s.put(mine, big)) < BIG // 4
        meta = codec.array_meta(np.dtype(np.float32), (BIG // 4,))
        assert sent(lambda: s.put_with(mine2, meta, BIG, lambda u8: u8.view(np.float32).__setitem__(
            slice(None), 1.5))) < BIG // 4
        assert sent(lambda: s.put(theirs, big)) >= BIG                   # another node's: sent
        assert sent(lambda: s.put(mine3, big, write_mode=WriteMode.ASYNC)) < BIG // 4
        held = n1.keys()
        assert held[mine] > (0, 0) and held[mine2] > (0, 0) and held[mine3] > (0, 0)
        for store in (s, c):
            np.testing.assert_array_equal(store[mine], big)
            np.testing.assert_array_equal(store[mine2], np.full(BIG // 4, 1.5, np.float32))
            np.testing.assert_array_equal(store[theirs], big)
        # the arena holds the key now: a write of it is the member's to order, so it is sent
        assert sent(lambda: s.put(mine, big + 1)) >= BIG
        np.testing.assert_array_equal(c[mine], big + 1)
        c[mine] = big + 2                                               # a newer version from elsewhere
        np.testing.assert_array_equal(s[mine], big + 2)
        assert n1.keys()[mine] > held[mine]
        # deleted, then written again from here: in place, at a version past the delete
        assert c.delete(mine2) and mine2 not in c
        assert sent(lambda: s.put(mine2, big)) < BIG // 4
        np.testing.assert_array_equal(c[mine2], big)
        # small values, and writes with a tier hint, go as before
        small = np.arange(HERE_MIN // 8 - 1, dtype=np.int64)
        assert sent(lambda: s.put(key_owned_by(s, n1.member_id, "e"), small)) >= small.nbytes
        from yrcache import Tier

        assert sent(lambda: s.put(key_owned_by(s, n1.member_id, "f"), big, tier=Tier.DRAM)) >= BIG


def test_batched_large_writes_to_the_own_member_skip_the_socket(harness):
    """mset and mput_raw make their large values for this node's member in place too; the
    rest of the batch (another node's keys, small values) is sent; a key written twice in
    one batch is sent, and its later value wins."""
    big = np.arange(BIG // 8, dtype=np.int64)
    with two_nodes(harness) as (n1, n2, s, c):
        a, b, d, e = (key_owned_by(s, n1.member_id, p) for p in ("a", "b", "d", "e"))
        theirs = key_owned_by(s, n2.member_id, "t")
        assert sent(lambda: s.mset({a: big, b: big + 1, "small": b"x" * 100})) < BIG // 4
        assert sent(lambda: s.mset([(theirs, big), (a, big + 2)])) >= BIG                # theirs: sent
        meta = codec.array_meta(np.dtype(np.int64), big.shape)
        assert sent(lambda: s.mput_raw([(d, meta, (big + 3).tobytes(), BIG)])) < BIG // 4
        assert sent(lambda: s.mset([(e, b"y" * 10), (e, big + 4)])) >= BIG               # twice: sent
        for store in (s, c):
            for k, want in ((a, big + 2), (b, big + 1), (d, big + 3), (e, big + 4), (theirs, big)):
                np.testing.assert_array_equal(store[k], want)
            assert bytes(store["small"]) == b"x" * 100
        held = n1.keys()
        assert all(held[k] > (0, 0) for k in (a, b, d, e))


def test_an_async_write_made_in_place_reaches_the_other_owner(etcd, tmp_path, monkeypatch):
    """With two copies, an ASYNC write's one target is this node's member: it is made in
    place, and the member's forwarder copies it to the key's other owner, same version."""
    h = ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="2")
    try:
        big = np.arange(BIG // 8, dtype=np.int64)
        with two_nodes(h, replicas=2) as (n1, n2, s, c):
            adopted, adopt = [], tp.Peer.adopt
            monkeypatch.setattr(tp.Peer, "adopt", lambda self, key, *a, **k: (adopted.append(key),
                                                                             adopt(self, key, *a, **k))[1])
            s.put("twice", big, write_mode=WriteMode.ASYNC)     # (its copy then crosses the loopback)
            assert adopted == ["twice"]
            s.flush()
            wait_for(lambda: "twice" in n2.keys(), 10, "the second copy")
            assert n1.keys()["twice"] == n2.keys()["twice"] > (0, 0)
            n1.sigkill()                                    # the second copy answers alone
            np.testing.assert_array_equal(c["twice"], big)
    finally:
        h.close()


def test_adopt_takes_only_this_processes_object_at_a_newer_version(harness):
    """ADOPT from any peer: an object the arena does not hold (wrong key or sequence
    number) is NOT_FOUND and nothing changes; an older version than the member's
    tombstone is STALE and the object is dropped; node-private keys are refused."""
    (n1,) = harness.start(1)
    url = f"etcd://{harness.etcd.endpoint}/{harness.cluster}"
    with TieredStore(n1.name, cluster=url, replicas=1, lease_ttl=2.0) as s:
        harness.wait_members(s, 1)
        peer, a = n1.peer(), s.node_store._a
        try:
            s.put("k", np.arange(8))
            seq = a.peek(b"k")[0].seq
            v = n1.keys()["k"]
            assert peer.adopt("k", seq + 1000, (v[0] + 5, v[1])) == tp.NOT_FOUND
            assert peer.adopt("nope", seq, (v[0] + 5, v[1])) == tp.NOT_FOUND
            assert n1.keys()["k"] == v                                    # unchanged
            assert s.delete("k")                                          # a tombstone at a newer version
            block = a.reserve(b"k", codec.array_meta(np.dtype(np.int64), (8,)), 64)
            with block:
                block.fill_from(np.arange(8) + 100)
                seq = block.commit(expected=0).new_seq
            assert peer.adopt("k", seq, v) == tp.STALE                    # older than the delete
            assert not a.contains(b"k") and "k" not in s                   # dropped, not resurrected
            with pytest.raises(RemoteError, match="node-private"):
                peer.adopt("__node__/x", 1, (v[0] + 9, v[1]))
        finally:
            peer.close()
