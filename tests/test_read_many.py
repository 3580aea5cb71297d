"""Batched ranged reads (``read_ranges_many``): one pipelined batch per member, the
members in parallel, failover to another owner, and what ``land`` may and may not do.
A real etcd and real ``yrcache node`` members on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("pyetcd")
from cluster_util import ClusterHarness  # noqa: E402

from yrcache import TieredStore  # noqa: E402
from yrcache.cluster import peer as peer_mod  # noqa: E402


def value(i: int, n: int = 64 << 10) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 2654435761 + i * 97) >> 13).astype(np.uint8)


def reads_for(keys: list[str]) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
    """Per key: a run, then a strided column (and every third key a second strided block)."""
    out = []
    for i, k in enumerate(keys):
        spans = [(i, 100 + i, 1, 100 + i), (4096 + i, 24, 40, 1000)]
        if i % 3 == 0:
            spans.append((30000, 512, 16, 2048))
        out.append((k, spans))
    return out


def expected(data: np.ndarray, spans) -> bytes:
    flat = data.reshape(-1)
    return b"".join(flat[o + r * st:o + r * st + run].tobytes() for o, run, rows, st in spans for r in range(rows))


class Landed:
    """A ``land`` that keeps each read's bytes (in buffers of its own) and its thread."""

    def __init__(self) -> None:
        self.got: dict[int, bytes] = {}
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def __call__(self, i: int, meta: bytes, n: int, fill) -> None:
        buf = bytearray(n)
        fill(buf)
        with self.lock:
            assert i not in self.got, f"read {i} landed twice"
            self.got[i] = bytes(buf)
            self.threads.add(threading.get_ident())


@pytest.fixture
def calls(monkeypatch):
    """member id -> the statuses of each ``Peer.getv_many`` it was asked."""
    seen: dict[str, list[list]] = {}
    real = peer_mod.Peer.getv_many

    def spy(self, reads, land, timeout=None):
        out, error = real(self, reads, land, timeout)
        seen.setdefault(self.name, []).append(list(out))
        return out, error
    monkeypatch.setattr(peer_mod.Peer, "getv_many", spy)
    return seen


def test_a_batch_goes_to_each_member_once_and_lands_every_read(etcd, tmp_path, calls, monkeypatch):
    with ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="1") as h:
        nodes = h.start(3)
        url = f"etcd://{h.etcd.endpoint}/{h.cluster}"
        keys = [f"obj/{i}" for i in range(60)]
        with TieredStore(nodes[0].name, cluster=url, replicas=1, lease_ttl=2.0) as s, h.client(replicas=1) as c:
            h.wait_members(c, 3)
            for i, k in enumerate(keys):
                s[k] = value(i)
            reads = reads_for(keys) + [("no/such/key", [(0, 1, 1, 1)])]
            owner = {k: c.owners(k)[0] for k in keys}
            for store, local in ((c, None), (s, s.member_id)):
                calls.clear()
                landed = Landed()
                found = store.read_ranges_many(reads, landed)
                assert found == [True] * len(keys) + [False]
                for i, k in enumerate(keys):
                    assert landed.got[i] == expected(value(i), reads[i][1]), k
                # one pipelined batch per member with the keys it owns; the missing key then
                # goes round the other members, one more batch of one read each
                others = {n.member_id for n in nodes} - {local}
                assert set(calls) == others and all(len(v) <= 2 for v in calls.values())
                for m in others:
                    assert len(calls[m][0]) >= sum(owner[k] == m for k in keys if owner[k] != local)
                    assert sum(len(b) for b in calls[m]) == sum(owner[k] == m for k in keys) + 1
                if store is c:
                    assert len(landed.threads) > 1           # the members were read in parallel
            # requests well past the sockets' buffers, sent a window at a time
            monkeypatch.setattr(peer_mod, "PIPELINE_BYTES", 300)
            calls.clear()
            landed = Landed()
            many = reads_for(keys) * 40
            assert c.read_ranges_many(many, landed) == [True] * len(many)
            assert all(landed.got[i] == expected(value(i % 60), many[i][1]) for i in range(len(many)))
            assert {m: len(v) for m, v in calls.items()} == {m: 1 for m in set(owner.values())}


def test_land_must_take_the_bytes_and_its_errors_reach_the_caller(etcd, tmp_path):
    with ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="1") as h:
        nodes = h.start(2)
        url = f"etcd://{h.etcd.endpoint}/{h.cluster}"
        with TieredStore(nodes[0].name, cluster=url, replicas=1, lease_ttl=2.0) as s, h.client(replicas=1) as c:
            h.wait_members(c, 2)
            keys = [f"k{i}" for i in range(8)]
            for i, k in enumerate(keys):
                s[k] = value(i)
            reads = reads_for(keys)

            def boom(i, meta, n, fill):
                raise KeyError("the caller's own error")
            with pytest.raises(KeyError, match="the caller's own error"):
                c.read_ranges_many(reads, boom)
            with pytest.raises(RuntimeError, match="without calling fill"):
                c.read_ranges_many(reads, lambda i, meta, n, fill: None)

            def wrong_size(i, meta, n, fill):
                fill(bytearray(n + 1))
            with pytest.raises(ValueError, match=r"one writable buffer of \d+ bytes"):
                c.read_ranges_many(reads, wrong_size)
            with pytest.raises(ValueError, match="outside an object"):
                c.read_ranges_many([(keys[0], [(65000, 1000, 1, 1000)])], Landed())
            with pytest.raises(ValueError, match="tuples of ints >= 0"):
                c.read_ranges_many([(keys[0], [(0, -1, 1, 1)])], Landed())
            landed = Landed()                        # the connections dropped above were replaced
            assert c.read_ranges_many(reads, landed) == [True] * len(keys)
            assert all(landed.got[i] == expected(value(i), reads[i][1]) for i in range(len(keys)))
            # nothing to read; no spans; the same read twice
            assert c.read_ranges_many([], Landed()) == []
            landed = Landed()
            odd = [(keys[1], []), reads[2], reads[2], (keys[3], [(7, 0, 5, 9), (9, 3, 0, 1)])]
            for store in (c, s):
                landed = Landed()
                assert store.read_ranges_many(odd, landed) == [True] * 4
                assert landed.got == {0: b"", 1: expected(value(2), reads[2][1]),
                                      2: expected(value(2), reads[2][1]), 3: b""}
            for n in nodes:                          # and the members kept serving
                assert n.proc.poll() is None


def test_reads_fall_over_to_another_owner_when_a_member_dies_unannounced(etcd, tmp_path, calls):
    with ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="2", YRCACHE_LEASE_TTL="30") as h:
        nodes = h.start(3)
        with h.client(replicas=2) as c:
            h.wait_members(c, 3)
            keys = [f"r/{i}" for i in range(40)]
            for i, k in enumerate(keys):
                c[k] = value(i)
            victim = nodes[0]
            first = [k for k in keys if c.owners(k)[0] == victim.member_id]
            assert first
            victim.sigkill()
            assert victim.member_id in c._router.members   # its lease (30 s) still runs
            calls.clear()
            landed = Landed()
            reads = reads_for(keys)
            assert c.read_ranges_many(reads, landed) == [True] * len(keys)
            assert all(landed.got[i] == expected(value(i), reads[i][1]) for i in range(len(keys)))
            # the dead member's batch failed as a whole; each of its reads went to its second owner
            assert calls[victim.member_id] == [[None] * len(first)]
            assert sum(len(b) for m, v in calls.items() if m != victim.member_id for b in v) == len(keys)


def test_a_read_whose_transfer_broke_is_read_again_even_if_land_swallowed_the_error(etcd, tmp_path, monkeypatch):
    from yrcache.cluster import wire

    with ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="2") as h:
        h.start(3)
        with h.client(replicas=2) as c:
            h.wait_members(c, 3)
            keys = [f"b/{i}" for i in range(12)]
            for i, k in enumerate(keys):
                c[k] = value(i)
            real = wire.Reader.readinto
            broke = []

            def flaky(self, dst):              # the first payload breaks off half-way
                if not broke and memoryview(dst).nbytes > 100:
                    broke.append(1)
                    real(self, memoryview(dst).cast("B")[:50])
                    raise ConnectionError("peer closed the connection (simulated)")
                return real(self, dst)
            monkeypatch.setattr(wire.Reader, "readinto", flaky)
            got: dict[int, bytes] = {}

            def swallowing(i, meta, n, fill):
                buf = bytearray(n)
                try:
                    fill(buf)
                except ConnectionError:
                    return                     # a careless land: the read must not count as done
                got[i] = bytes(buf)
            reads = reads_for(keys)
            assert c.read_ranges_many(reads, swallowing) == [True] * len(keys)
            # the broken read was asked again (on a fresh connection) and landed whole
            assert broke and all(got[i] == expected(value(i), reads[i][1]) for i in range(len(keys)))
