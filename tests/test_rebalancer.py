"""The member's Rebalancer against stand-ins for its node and peers: which objects a
pass checks with their other owners (all of them after a membership change and every
``FULL_EVERY``-th periodic pass, otherwise those written since the previous pass),
and the router telling it when the member set changed, a restarted member included."""

from __future__ import annotations

import threading
import time
import types

import pytest

from yrcache.cluster import rebalance
from yrcache.cluster.membership import MemberInfo
from yrcache.cluster.replication import Router


def hlc(seconds_ago: float) -> int:
    return (time.time_ns() // 1000 - int(seconds_ago * 1e6)) << 8


class Peer:
    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def have(self, entries):
        self.asked.append([k for k, _ in entries])
        return bytes([1] * len(entries))        # the other owner holds everything


class Node:
    """What Rebalancer.run_pass uses of a member's Node: "b" is the other owner of every key."""

    member_id = "me"

    def __init__(self) -> None:
        self.versions: dict[str, tuple[int, int]] = {}
        self.peer = Peer()
        self.router = types.SimpleNamespace(peer=lambda m: self.peer, members={"me": None, "b": None},
                                            moving=lambda: False, moved_at=-3600.0)
        self.forwarder = types.SimpleNamespace(add=lambda *a: pytest.fail(f"nothing is missing: {a}"))

    def owners(self, key):
        return ["me", "b"]


@pytest.fixture
def rebalancer(monkeypatch):
    monkeypatch.setattr(rebalance, "REPAIR_S", 3600.0)      # its own thread: the first pass, then idle
    node = Node()
    node.versions = {"old": (hlc(3600), 1), "older": (hlc(7200), 1)}
    rb = rebalance.Rebalancer(node)
    deadline = time.monotonic() + 10
    while rb.passes < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rb.passes == 1 and rb.full_passes == 1
    yield rb, node
    rb.close()


def test_a_periodic_pass_checks_only_what_was_written_since_the_last_one(rebalancer):
    rb, node = rebalancer
    assert sorted(node.peer.asked[-1]) == ["old", "older"]           # the first pass: everything
    node.versions["new"] = (hlc(0), 1)
    node.versions["skewed"] = (hlc(rebalance.SKEW_S / 2), 1)         # a writer whose clock runs behind
    assert rb.run_pass(full=False) is False
    assert sorted(node.peer.asked[-1]) == ["new", "skewed"]
    n = len(node.peer.asked)
    assert rb.run_pass(full=False) is False
    assert len(node.peer.asked) == n or sorted(node.peer.asked[-1]) == ["new", "skewed"]   # within SKEW_S
    assert rb.run_pass() is False                                    # a full pass: everything again
    assert sorted(node.peer.asked[-1]) == ["new", "old", "older", "skewed"]
    assert rb.full_passes == 2 and rb.passes == 4


def test_a_membership_change_and_every_tenth_periodic_pass_check_everything(rebalancer, monkeypatch):
    rb, node = rebalancer
    full: list[bool] = []
    real = rb.run_pass
    done = threading.Event()

    def spy(full_pass: bool = True) -> bool:
        full.append(full_pass)
        out = real(full_pass)
        if len(full) >= 12:
            done.set()
        return out
    monkeypatch.setattr(rb, "run_pass", spy)
    monkeypatch.setattr(rebalance, "REPAIR_S", 0.01)
    rb.poke()                                    # the member set changed
    assert done.wait(30)
    with rb._cv:
        rb._due = None                           # idle again
    # the poke's pass, then periodic ones: all of them every FULL_EVERY-th
    assert full[0] is True
    periodic = full[1:]
    assert periodic[:rebalance.FULL_EVERY] == [False] * (rebalance.FULL_EVERY - 1) + [True]


def test_the_router_reports_a_restarted_member_as_a_change():
    router = Router(replicas=2, token=None)
    calls: list[int] = []
    router.on_change.append(lambda: calls.append(1))
    router.update({"a": MemberInfo("a", "127.0.0.1:1", 1, 10), "b": MemberInfo("b", "127.0.0.1:2", 1, 11)})
    assert len(calls) == 1
    router.update({"a": MemberInfo("a", "127.0.0.1:1", 1, 10), "b": MemberInfo("b", "127.0.0.1:2", 1, 11)})
    assert len(calls) == 1                       # nothing changed
    router.update({"a": MemberInfo("a", "127.0.0.1:1", 1, 10), "b": MemberInfo("b", "127.0.0.1:3", 2, 12)})
    assert len(calls) == 2                       # b restarted: a new epoch, same id
    router.update({"a": MemberInfo("a", "127.0.0.1:1", 1, 10)})
    assert len(calls) == 3
    router.close()


@pytest.mark.parametrize("ring", ["empty", "without me", "others own it"])
def test_a_copy_goes_only_when_a_ring_with_this_member_names_other_owners(rebalancer, ring):
    """A member back from a pause past its lease (every member was: a suspended VM) saw an
    empty ring for a moment, so no key had owners, and dropped every object it held."""
    rb, node = rebalancer
    dropped: list[str] = []
    node.drop_if = lambda key, version: dropped.append(key)
    node.owners = lambda key: [] if ring == "empty" else ["b"]
    node.router.members = {"b": None} if ring == "without me" else {"me": None, "b": None}
    rb.run_pass()
    assert sorted(dropped) == (["old", "older"] if ring == "others own it" else [])


def test_a_surplus_copy_stays_while_readers_may_not_know_the_new_ring(rebalancer):
    """Right after a member-set change a reader whose watch is behind still asks this member
    first: a surplus copy dropped then was a key found nowhere (a get returning None during a
    join, under load). It goes at the first full pass ``MOVING_S`` after the change."""
    rb, node = rebalancer
    dropped: list[str] = []
    node.drop_if = lambda key, version: dropped.append(key)
    node.owners = lambda key: ["b"]
    node.router.moved_at = time.monotonic()
    node.router.moving = lambda: time.monotonic() - node.router.moved_at < rebalance.MOVING_S
    rb.run_pass()
    assert dropped == [] and rb._full
    assert abs(rb._due - (node.router.moved_at + rebalance.MOVING_S)) < 1
    node.router.moved_at -= rebalance.MOVING_S      # the moment has passed
    rb.run_pass()
    assert sorted(dropped) == ["old", "older"]


def test_a_copy_an_owner_holds_a_newer_delete_of_goes(rebalancer):
    """``HAVE`` answers 2 for a key the owner deleted at the asked version or later: the
    member's older copy goes (it would come back to life once this member was read first)."""
    rb, node = rebalancer
    dropped: list[str] = []
    node.drop_if = lambda key, version: dropped.append(key)
    node.peer.have = lambda entries: bytes(2 if k == "old" else 1 for k, _ in entries)
    rb.run_pass()
    assert dropped == ["old"]


def test_a_member_catching_up_is_read_last_and_not_in_place():
    router = Router(replicas=2, token=None, member_id="b")
    router.update({m: MemberInfo(m, f"127.0.0.1:{i + 1}", 1, 10 + i, catching_up=m == "b")
                   for i, m in enumerate("abc")})
    assert router.late == {"b"}
    assert not router.reads_here() and router.asked_here(True) is None
    assert router.last_late(["b", "c", "a"]) == ["c", "a", "b"]
    router.update({m: MemberInfo(m, f"127.0.0.1:{i + 1}", 1, 10 + i) for i, m in enumerate("abc")})
    assert router.late == frozenset() and router.reads_here() and router.asked_here(True) == "b"
    router.close()
