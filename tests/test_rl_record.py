"""RL weight sync at node scale: the per-name version record, wake-ups that
never strand or cross names, crashes at every step of a publish, and a model
of interleaved publishers (issue "RL weight sync at node scale")."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from yrcache import TieredStore
from yrcache.rl import Shard, WeightPublisher, WeightSubscriber, subscribe
from yrcache.rl.board import VersionBoard
from procs import finish, kill_and_join, start, wait_or_die


def state(v: int, n: int = 256) -> dict:
    return {"w": np.full(n, v, dtype=np.float32), "b": np.arange(8, dtype=np.int64) + v}


def rl_keys(store, name="policy") -> list[str]:
    return list(store.keys(prefix=f"__rl__/{name}/"))


# -------------------------------------------------------------- the record


def test_latest_and_head_come_from_the_record_not_a_scan(make_store, monkeypatch):
    store = make_store()
    pub = WeightPublisher(store, "policy")
    sub = WeightSubscriber(store, "policy")
    assert sub.latest() is None
    pub.publish(state(1), version=1)
    calls = []
    real = type(store).keys
    monkeypatch.setattr(type(store), "keys", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    assert sub.latest() == 1 and sub.board.head() == 1
    assert sub.wait(newer_than=0, timeout=1) == 1
    assert sub.wait(newer_than=1, timeout=0.05, max_staleness=0) == 1
    assert calls == [], "latest/head/wait listed keys"
    assert store.word("rl/policy").value == 2          # newest complete version + 1


def test_a_lost_wake_up_delays_a_waiter_at_most_a_second(make_store, monkeypatch):
    """The completing process dies between the marker and the wake (here: the
    wake is suppressed).  The waiter re-reads the record every second."""
    store = make_store()
    pub = WeightPublisher(store, "policy")
    pub.publish(state(1), version=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(
        WeightSubscriber(store, "policy").wait(newer_than=1, timeout=5)))
    waiter.start()
    time.sleep(0.1)
    monkeypatch.setattr(VersionBoard, "wake", lambda self: None)
    t0 = time.monotonic()
    pub.publish(state(2), version=2)
    waiter.join(6)
    assert got == [2], "the waiter missed a complete version"
    assert time.monotonic() - t0 < 2.0


def _wait_once(name, weight_set, newer_than, timeout):
    s = TieredStore.attach(name)
    try:
        return WeightSubscriber(s, weight_set).wait(newer_than=newer_than, timeout=timeout)
    except TimeoutError:
        return "timeout"
    finally:
        s.close()


def _publish_versions(name, weight_set, versions):
    s = TieredStore.attach(name)
    try:
        pub = WeightPublisher(s, weight_set)
        for v in versions:
            pub.publish(state(v), version=v)
    finally:
        s.close()


def _follow(name, weight_set, last):
    """Wait for each new version of ``weight_set`` up to ``last``; the versions woken to."""
    s = TieredStore.attach(name)
    try:
        sub, seen = WeightSubscriber(s, weight_set), []
        while not seen or seen[-1] < last:
            seen.append(sub.wait(newer_than=seen[-1] if seen else 0, timeout=30))
        return seen
    finally:
        s.close()


def test_names_never_wake_each_other(make_store, store_name):
    """Three weight sets published at once, each by its own process: each
    subscriber follows its own to the end (no stall), and a subscriber of a
    fourth sleeps through all of it (no wake crosses names)."""
    store = make_store()
    names = ("actor", "model", "llama", "critic")     # "actor", "model", "llama" once shared a word
    for n in names:
        WeightPublisher(store, n).publish(state(0), version=0)
    words = {n: store.word(f"rl/{n}") for n in names}
    seqs = {n: w.seq for n, w in words.items()}
    ctx = multiprocessing.get_context("fork")
    sleeper = start(ctx, _wait_once, store_name, "actor", 0, 2.0)
    followers = {n: start(ctx, _follow, store_name, n, 30) for n in names[1:]}
    publishers = [start(ctx, _publish_versions, store_name, n, range(1, 31)) for n in names[1:]]
    for p, q in publishers:
        finish(p, q)
    for n, (p, q) in followers.items():
        seen = finish(p, q)
        assert seen[-1] == 30 and seen == sorted(set(seen)), (n, seen)
    assert words["actor"].seq == seqs["actor"], "another name's publish bumped actor's word"
    assert all(words[n].seq == seqs[n] + 30 for n in names[1:]), "a publish woke its own name other than once"
    assert finish(*sleeper) == "timeout"         # slept through 90 publishes of other names
    WeightPublisher(store, "actor").publish(state(1), version=1)
    assert words["actor"].seq == seqs["actor"] + 1


def test_retire_deletes_the_parts_of_old_versions_only(make_store):
    store = make_store()
    pubs = [WeightPublisher(store, "policy", rank=r, world=2, keep=2) for r in range(2)]
    for v in range(1, 6):
        for p in pubs:
            p.publish(state(v), version=v)
    versions = {int(k.split("/")[3]) for k in rl_keys(store) if "/v/" in k}
    assert versions == {4, 5}
    sub = WeightSubscriber(store, "policy")
    assert sub.versions() == [4, 5] and sub.latest() == 5
    np.testing.assert_array_equal(sub.fetch(5)["w"], np.full(256, 5, np.float32))


# ----------------------------------------------------------- fetch plans


def test_new_versions_of_an_unchanged_model_reuse_the_plan_made_while_idle(make_store, monkeypatch):
    store = make_store()
    pubs = [WeightPublisher(store, "policy", rank=r, world=2) for r in range(2)]
    sub = WeightSubscriber(store, "policy")
    planned = []
    real = subscribe.decode_structure
    monkeypatch.setattr(subscribe, "decode_structure", lambda raw: planned.append(raw) or real(raw))

    def publish(v):
        full = np.arange(64, dtype=np.float32).reshape(8, 8) + v
        for r, p in enumerate(pubs):
            p.publish({"w": full[4 * r:4 * r + 4], "b": np.arange(3) + v}, version=v,
                      layout={"w": Shard(0, r, 2)})
        return full

    publish(1)
    with pytest.raises(TimeoutError):
        sub.wait(newer_than=1, timeout=0.05)         # idle: plans a whole fetch of version 1
    assert len(planned) == 1
    for v in range(2, 6):                            # every version has new part keys
        full = publish(v)
        got = sub.fetch(sub.wait(newer_than=v - 1, timeout=5))
        np.testing.assert_array_equal(got["w"], full)
        np.testing.assert_array_equal(got["b"], np.arange(3) + v)
        sliced = sub.fetch(v, layout={"w": Shard(1, 1, 2)})
        np.testing.assert_array_equal(sliced["w"], full[:, 4:])
    assert len(planned) == 2                         # one per layout, none per version


def test_a_changed_model_gets_a_new_plan(make_store):
    store = make_store()
    pub = WeightPublisher(store, "policy", keep=3)
    sub = WeightSubscriber(store, "policy")
    pub.publish(state(1), version=1)
    assert sub.fetch(1)["w"].shape == (256,)
    pub.publish(state(2, 300), version=2)                              # a resized tensor
    pub.publish({**state(3), "extra": np.arange(5)}, version=3)       # one more tensor
    got2, got3, got1 = sub.fetch(2), sub.fetch(3), sub.fetch(1)
    np.testing.assert_array_equal(got2["w"], state(2, 300)["w"])
    assert sorted(got3) == ["b", "extra", "w"] and got3["extra"].tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(got1["w"], state(1)["w"])
    np.testing.assert_array_equal(sub.fetch(2, layout={"w": Shard(0, 1, 2)})["w"], state(2, 300)["w"][150:])


def _publish_from_child(pub, v):
    pub.publish({"w": np.full(4, v, np.float32)}, version=v)


@pytest.mark.parametrize("rows", [2, 600])
def test_an_unchanged_model_is_read_in_one_mget_and_a_restarted_publisher_is_found(make_store, monkeypatch, rows):
    """The marker of an unchanged model is the same bytes every version: a subscriber
    reads marker and parts in one mget. A new publisher (a restarted trainer) has new
    part keys: its version is still found, and what fetch returns is the subscriber's own.
    A state under 1 MiB is read decoded (``mget``), a larger one as stored bytes
    (``mget_raw``)."""
    import torch
    store = make_store()
    reads: list = []
    real_get, real_mget, real_mget_raw = store.get, store.mget, store.mget_raw
    monkeypatch.setattr(store, "get", lambda k, *a, **kw: reads.append("get") or real_get(k, *a, **kw))
    monkeypatch.setattr(store, "mget", lambda ks, **kw: reads.append(("mget", len(ks))) or real_mget(ks, **kw))
    monkeypatch.setattr(store, "mget_raw", lambda ks: reads.append(("raw", len(ks))) or real_mget_raw(ks))
    read = "raw" if rows > 2 else "mget"

    def st(v):
        return {"w": np.arange(rows * 512, dtype=np.float32).reshape(rows, 512) + v, "t": torch.arange(4) + v}
    sub = WeightSubscriber(store, "policy")
    pub = WeightPublisher(store, "policy", keep=2)
    pub.publish(st(1), version=1)
    sub.fetch(1)
    for v in (2, 3):
        pub.publish(st(v), version=v)
        reads.clear()
        got = sub.fetch(v)
        assert reads == [(read, 3)], reads                 # marker + 2 parts, one mget
        np.testing.assert_array_equal(got["w"], st(v)["w"])
        assert torch.equal(got["t"], st(v)["t"])
        got["w"] += 100                                    # writable, and the fetch's own
        got["t"] += 100
        again = sub.fetch(v)
        np.testing.assert_array_equal(again["w"], st(v)["w"])
        assert torch.equal(again["t"], st(v)["t"])
    restarted = WeightPublisher(store, "policy", keep=2)
    restarted.publish(st(4), version=4)
    reads.clear()
    got = sub.fetch(4)
    assert reads == [(read, 3), "get", (read, 2)], reads   # marker differs: read it, then the parts
    np.testing.assert_array_equal(got["w"], st(4)["w"])
    assert torch.equal(got["t"], st(4)["t"])
    with pytest.raises(KeyError, match="reclaimed"):
        sub.fetch(2)                                       # keep=2: gone, not served from a cache


def test_a_forked_publisher_writes_parts_of_its_own(make_store):
    """A publisher used in a forked child does not reuse its parent's part keys."""
    store = make_store()
    pub = WeightPublisher(store, "policy", keep=3)
    pub.publish({"w": np.full(4, 1, np.float32)}, version=1)
    child = multiprocessing.get_context("fork").Process(target=_publish_from_child, args=(pub, 2))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    pub.publish({"w": np.full(4, 3, np.float32)}, version=3)
    board = VersionBoard(store, "policy")
    nonces = [board.completion(v)["nonces"] for v in (1, 2, 3)]
    assert nonces[0] == nonces[2] != nonces[1]
    np.testing.assert_array_equal(WeightSubscriber(store, "policy").fetch(3)["w"], np.full(4, 3, np.float32))


# --------------------------------------------------------------- crashes


def _rank_dies(name, rank, version, where):
    s = TieredStore.attach(name)
    pub = WeightPublisher(s, "policy", rank=rank, world=2)
    if where == "after parts":
        real = VersionBoard.record_rank
        VersionBoard.record_rank = lambda self, *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    elif where == "after manifest":
        real = VersionBoard.record_rank

        def record_then_die(self, *a, **k):
            real(self, *a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        VersionBoard.record_rank = record_then_die
    elif where == "completing: after the marker":
        real = VersionBoard.complete

        def marker_then_die(self, version, marker=None, structure=b"", wake=True):
            self.store.put(self.complete_key(version), json.dumps(marker).encode() + b"\n" + structure)
            os.kill(os.getpid(), signal.SIGKILL)
        VersionBoard.complete = marker_then_die
    pub.publish(state(version), version=version)
    return "survived"


@pytest.mark.parametrize("where", ["after parts", "after manifest", "completing: after the marker"])
def test_a_rank_killed_mid_publish(make_store, store_name, where):
    store = make_store()
    pubs = [WeightPublisher(store, "policy", rank=r, world=2) for r in range(2)]
    for p in pubs:
        p.publish(state(1), version=1)
    if where.startswith("completing"):
        pubs[0].publish(state(2), version=2)     # rank 1 is the one that completes
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_rank_dies, args=(store_name, 1, 2, where), daemon=True)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    sub = WeightSubscriber(store, "policy")
    assert sub.latest() == 1, "a version became visible without all its ranks"
    np.testing.assert_array_equal(sub.fetch(1)["w"], state(1)["w"])
    store.stats()                                # sweeps the dead rank: its reservations go
    fresh = WeightPublisher(store, "policy", rank=1, world=2)   # the restarted rank
    if where == "after parts":        # no manifest of rank 1: the version waits for it
        assert pubs[0].publish(state(2), version=2) is False
        assert fresh.publish(state(2), version=2) is True
    elif where == "after manifest":   # everything of rank 1 was written: rank 0 completes it
        assert pubs[0].publish(state(2), version=2) is True
    else:                             # the marker without the record: the version is complete
        with pytest.raises(TimeoutError, match="version 2 is complete, but the rank that completed it died"):
            sub.wait(newer_than=1, timeout=0)
        # a restarted rank that publishes it again is told (its new bytes would not be
        # the version's), and the version is made visible
        with pytest.raises(ValueError, match="version 2 of 'policy' is already complete"):
            fresh.publish(state(2), version=2)
    assert sub.latest() == 2
    np.testing.assert_array_equal(sub.fetch(2)["w"], state(2)["w"])
    for v in (3, 4):
        pubs[0].publish(state(v), version=v)
        fresh.publish(state(v), version=v)
    assert sub.latest() == 4 and sub.versions() == [3, 4]
    np.testing.assert_array_equal(sub.fetch(4)["w"], state(4)["w"])
    st = store.stats()
    assert st["orphans"] == 0 and st["pinned_bytes"] == 0, st
    store.check()


def _fetch_and_hang(name, ready):
    s = TieredStore.attach(name)
    sub = WeightSubscriber(s, "policy")
    got = sub.fetch(sub.latest())                # holds views of version 1
    assert got["w"][0] == 1
    ready.set()
    time.sleep(120)


def test_a_subscriber_killed_mid_fetch(make_store, store_name):
    store = make_store()
    pub = WeightPublisher(store, "policy", keep=1)
    pub.publish(state(1, 64 * 1024), version=1)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_fetch_and_hang, args=(store_name, ready), daemon=True)
    p.start()
    try:
        wait_or_die(ready, p)
        pub.publish(state(2, 64 * 1024), version=2)    # retires version 1 while it is held
    finally:
        kill_and_join(p)
    st = store.stats()                           # the dead subscriber's pins go
    assert st["orphans"] == 0 and st["pinned_bytes"] == 0, st
    pub.publish(state(3, 64 * 1024), version=3)
    assert WeightSubscriber(store, "policy").versions() == [3]
    store.check()


# ----------------------------------------------------------------- model


def _rank_server(name, rank, conn):
    """A publishing rank in its own process: publishes the versions it is sent."""
    s = TieredStore.attach(name)
    pub = WeightPublisher(s, "p", rank=rank, world=2, keep=2)
    try:
        while (v := conn.recv()) is not None:
            try:
                conn.send(("ok", pub.publish(state(v, 16), version=v)))
            except Exception as e:   # noqa: BLE001 - the model asserts on it
                conn.send(("err", repr(e)))
    finally:
        s.close()


class InterleavedPublishers(RuleBasedStateMachine):
    """Two ranks, each its own process, publish versions in any order (some
    skipped, some at the same moment: both ranks racing to complete one
    version, retiring old ones as they go); a subscriber in a third process
    must never see an incomplete version, and never lose the newest complete."""

    @initialize()
    def setup(self):
        self.name = f"model-rl-{os.getpid()}-{id(self):x}"
        self.store = TieredStore(name=self.name, dram="16MiB")
        ctx = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        for r in range(2):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_server, args=(self.name, r, theirs), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        self.sub = WeightSubscriber(self.store, "p")
        self.done: dict[int, set[int]] = {}     # version -> ranks that published it
        self.next = [0, 0]                      # next version each rank may publish

    def teardown(self):
        for c in getattr(self, "conns", []):
            c.send(None)
        for p in getattr(self, "procs", []):
            p.join(10)
            if p.is_alive():
                kill_and_join(p)
        if hasattr(self, "store"):
            self.store.destroy()

    def _version(self, ranks, skip):
        v = max(self.next[r] for r in ranks) + skip
        latest = self.sub.latest()
        return latest + 1 if latest is not None and v <= latest else v

    def _publish(self, ranks, v):
        for r in ranks:                         # all sent before any reply is read: they race
            self.conns[r].send(v)
        for r in ranks:
            status, visible = self.conns[r].recv()
            assert status == "ok", visible
            self.next[r] = v + 1
            self.done.setdefault(v, set()).add(r)
        if len(ranks) == 2:
            assert self.sub.latest() == v, "both ranks published, the version is not visible"

    @rule(rank=st.integers(0, 1), skip=st.integers(0, 2))
    def publish(self, rank, skip):
        self._publish([rank], self._version([rank], skip))

    @rule(skip=st.integers(0, 2))
    def publish_both_at_once(self, skip):
        self._publish([0, 1], self._version([0, 1], skip))

    @invariant()
    def latest_is_the_newest_complete(self):
        if not hasattr(self, "sub"):
            return
        complete = [v for v, ranks in self.done.items() if ranks == {0, 1}]
        want = max(complete) if complete else None
        assert self.sub.latest() == want
        if want is not None:
            got = self.sub.fetch(want)
            np.testing.assert_array_equal(got["w"], np.full(16, want, np.float32))
            assert got["b"].tolist() == list(range(want, want + 8))
            kept = {int(k.split("/")[3]) for k in rl_keys(self.store, "p") if "/v/" in k}
            assert not kept & set(sorted(complete)[:-2]), "a complete version older than the newest 2 (keep=2) has parts"


TestInterleavedPublishers = InterleavedPublishers.TestCase
TestInterleavedPublishers.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
