"""The member's Forwarder against stand-ins for its node and peers: what it reads and
sends while an owner it forwards to keeps failing, and when it tries that owner again."""

from __future__ import annotations

import time
import types

import numpy as np

from yrcache.cluster import member
from yrcache.cluster import transport as tp
from yrcache.errors import ClusterUnavailableError

V = (1 << 50, 7)


class Peer:
    def __init__(self) -> None:
        self.calls = 0
        self.down = True

    def mput(self, items, flags=0):
        self.calls += 1
        if self.down:
            raise ClusterUnavailableError("member b does not answer")
        return [tp.OK] * len(items)


class Node:
    """What Forwarder._send uses of a member's Node: "b" is the other owner of every key."""

    member_id = "me"

    def __init__(self) -> None:
        self.versions = {"k1": V, "k2": V}
        self.single: set[str] = set()
        self.reads: list[str] = []
        self.peer = Peer()
        self.router = types.SimpleNamespace(peer=lambda m: self.peer, members={"me": None, "b": None})
        self.rebalancer = types.SimpleNamespace(drop_surplus=lambda surplus: [self.drop_if(*s) for s in surplus])
        self.local = types.SimpleNamespace(info=lambda key: {})

    def read(self, key):
        self.reads.append(key)
        return tp.Got(b"B", np.zeros(16, np.uint8), V)

    def owners(self, key):
        return ["me", "b"]

    def drop_if(self, key, version):
        raise AssertionError("this member still owns the keys")


def test_an_owner_that_fails_rests_and_its_objects_are_not_read_meanwhile():
    node = Node()
    fw = member.Forwarder(node)          # its own thread idles: the queue stays empty
    try:
        batch = [("k1", (V, None)), ("k2", (V, None))]
        assert sorted(fw._send(batch)) == [("k1", V), ("k2", V)]       # failed: both to retry
        assert node.reads == ["k1", "k2"] and node.peer.calls == 1
        for _ in range(5):                 # while "b" rests: neither read nor sent, still retried
            assert sorted(fw._send(batch)) == [("k1", V), ("k2", V)]
        assert node.reads == ["k1", "k2"] and node.peer.calls == 1
        time.sleep(member.RETRY_MIN_S + 0.02)
        assert len(fw._send(batch)) == 2   # tried again after its pause, which then doubles
        assert len(node.reads) == 4 and node.peer.calls == 2
        rest = fw._failing["b"]
        assert rest[1] == 2 * member.RETRY_MIN_S and rest[0] > time.monotonic()
        node.peer.down = False
        time.sleep(rest[0] - time.monotonic() + 0.02)
        assert fw._send(batch) == [] and node.peer.calls == 3 and "b" not in fw._failing
    finally:
        fw.close()
