"""RL weight sync across nodes: a real etcd, real ``yrcache node`` members, spawned
trainer and rollout processes, loopback only.

A "node" is one member process with its own arena (store name); its trainer or
rollout processes attach to that arena. Which bytes travel is checked against an
expectation computed here from where the ring put each part, and against the
transport's own byte counter.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback

import numpy as np
import pytest

pytest.importorskip("pyetcd")
from cluster_util import TTL, ClusterHarness, wait_for  # noqa: E402
from procs import sigstop  # noqa: E402

from yrcache import TieredStore  # noqa: E402
from yrcache.errors import ClusterUnavailableError  # noqa: E402
from yrcache.rl import Shard, WeightPublisher, WeightSubscriber  # noqa: E402

SPAWN = mp.get_context("spawn")
SHAPES = {"a": (12, 18), "b": (7, 30), "bias": (30,)}
SPLIT = ("a", "b")                   # split on dim 0 over the trainers; "bias" is replicated


def reference(name: str, version: int) -> np.ndarray:
    shape = SHAPES[name]
    base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return base + np.float32(version * 1000 + 100 * sorted(SHAPES).index(name))


def trainer_state(rank: int, world: int, version: int) -> dict:
    state = {n: np.array_split(reference(n, version), world, axis=0)[rank] for n in SPLIT}
    if rank == 0:
        state["bias"] = reference("bias", version)
    return state


def _g(g: int | dict, name: str) -> int:
    """A process's slice index, or its index per tensor (processes sharing some slices)."""
    return g[name] if isinstance(g, dict) else g


def rollout_layout(g: int | dict, count: int) -> dict:
    return {"a": Shard(1, _g(g, "a"), count), "b": Shard(1, _g(g, "b"), count),
            "bias": Shard(0, _g(g, "bias"), count)}


def expected_slice(name: str, version: int, g: int | dict, count: int) -> np.ndarray:
    return np.array_split(reference(name, version), count, axis=0 if name == "bias" else 1)[_g(g, name)]


def remote_bytes(store, sub, version: int, g: int | dict, count: int, world: int, names=SHAPES) -> int:
    """Bytes of this slice (of ``names``) that sit in parts the ring placed on other nodes."""
    marker = sub.board.completion(version)
    me = store.member_id
    total = 0
    for name in names:
        gi = _g(g, name)
        ranks = range(world) if name in SPLIT else [0]
        for r in ranks:
            key = sub.board.part_key(version, r, marker["nonces"][r], name)
            if store.owners(key)[0] == me:
                continue
            if name == "bias":
                total += len(np.array_split(np.arange(30), count)[gi]) * 4
            else:
                rows = np.array_split(np.arange(SHAPES[name][0]), world)[r].size
                cols = np.array_split(np.arange(SHAPES[name][1]), count)[gi].size
                total += rows * cols * 4
    return total


def open_store(url: str, node: str, replicas: int = 1) -> TieredStore:
    return TieredStore(node, cluster=url, replicas=replicas, lease_ttl=2.0)


# ---- processes -----------------------------------------------------------------------
def trainer(url, node, rank, world, versions, barrier, out, replicas=1):
    try:
        with open_store(url, node, replicas) as s:
            pub = WeightPublisher(s, "policy", rank=rank, world=world, keep=2)
            for v in versions:
                pub.publish(trainer_state(rank, world, v), version=v,
                            layout={n: Shard(0, rank, world) for n in SPLIT})
                barrier.wait(60)
        out.put(("trainer", rank, "ok"))
    except BaseException:
        out.put(("trainer", rank, traceback.format_exc()))


def rollout(url, node, g, count, world, versions, barrier, out, start=None):
    try:
        with open_store(url, node) as s:
            sub = WeightSubscriber(s, "policy")
            prev = None
            for v in versions:
                got = sub.wait(newer_than=prev, timeout=60)
                assert got == v, (got, v)
                if start is not None:
                    start.wait(60)            # fetch together with the node's other process
                before = s.received_bytes
                res = sub.fetch(v, layout=rollout_layout(g, count))
                recv = s.received_bytes - before
                for name in SHAPES:
                    np.testing.assert_array_equal(res[name], expected_slice(name, v, g, count), err_msg=name)
                st = dict(sub.last_fetch_stats, received=recv,
                          remote=remote_bytes(s, sub, v, g, count, world),
                          remote_shared=remote_bytes(s, sub, v, g, count, world, names=("a", "bias")))
                out.put(("rollout", str(g), node, v, st))
                prev = v
                if barrier is not None:
                    barrier.wait(60)
        out.put(("rollout", str(g), "ok"))
    except BaseException:
        out.put(("rollout", str(g), traceback.format_exc()))


def node_holding_fewest(harness, nodes, version: int):
    """Of ``nodes``, the one whose member owns the fewest parts of ``version`` (one rank)."""
    with harness.client(replicas=1) as c:
        harness.wait_members(c, len(nodes))
        board = WeightSubscriber(c, "policy").board
        nonce = board.completion(version)["nonces"][0]
        owners = [c.owners(board.part_key(version, 0, nonce, name))[0] for name in SHAPES]
    return min(nodes, key=lambda n: owners.count(n.member_id))


def collect(out, procs, timeout=120):
    """Every message until all processes ended; raise with a child's traceback."""
    msgs, end = [], time.monotonic() + timeout
    while any(p.is_alive() for p in procs) or not out.empty():
        try:
            m = out.get(timeout=0.5)
        except queue.Empty:
            assert time.monotonic() < end, "processes did not finish"
            continue
        if m[-1] != "ok" and isinstance(m[-1], str):
            for p in procs:
                p.kill()
            pytest.fail(f"{m[0]} {m[1]} failed:\n{m[-1]}")
        msgs.append(m)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0, p.exitcode
    return msgs


@pytest.fixture
def harness(etcd, tmp_path):
    h = ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="1")
    yield h
    h.close()


def url_of(h: ClusterHarness) -> str:
    return f"etcd://{h.etcd.endpoint}/{h.cluster}"


@contextlib.contextmanager
def first_version(harness: ClusterHarness, nodes: int = 3):
    """``nodes`` nodes; a publisher on the first, a subscriber on the second, version 1
    published and seen: ``(publisher, the second node's store, subscriber, cluster url)``."""
    t0, r0 = harness.start(nodes)[:2]
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        pub.publish(trainer_state(0, 1, 1), version=1)
        assert sub.wait(timeout=10) == 1
        yield pub, rs, sub, url


# ---- the scenario ------------------------------------------------------------
def test_two_trainer_nodes_three_rollout_nodes_five_versions(harness):
    t0, t1, r0, r1, r2 = harness.start(5)
    url, versions, count = url_of(harness), list(range(1, 6)), 6
    barrier, out = SPAWN.Barrier(2 + count), SPAWN.Queue()
    procs = [SPAWN.Process(target=trainer, args=(url, n.name, r, 2, versions, barrier, out))
             for r, n in enumerate((t0, t1))]
    nodes = [r0, r0, r1, r1, r2, r2]
    procs += [SPAWN.Process(target=rollout, args=(url, nodes[g].name, g, count, 2, versions, barrier, out))
              for g in range(count)]
    for p in procs:
        p.start()
    msgs = collect(out, procs)
    fetched = [m for m in msgs if m[0] == "rollout" and len(m) == 5]
    assert len(fetched) == count * len(versions)          # every slice of every version, verified
    per_node: dict[tuple[str, int], list[dict]] = {}
    for _, _g, node, v, st in fetched:
        assert st["bytes_network"] == st["remote"], st                # only the needed remote bytes
        assert st["bytes_network"] + st["bytes_local"] == st["bytes_needed"], st
        assert st["bytes_node_cache"] == 0                           # slices differ: nothing shared
        # each knows the other's slice after the first version: straight into the results
        assert st["bytes_direct"] == (st["bytes_network"] if v > 1 else 0), (v, st)
        assert st["bytes_needed"] < st["bytes_version"] / 4
        # the transport saw the parts' bytes and at most the small completion marker besides
        assert st["bytes_network"] <= st["received"] <= st["bytes_network"] + 8192, st
        per_node.setdefault((node, v), []).append(st)
    for sts in per_node.values():      # a node's traffic is the union of its processes' ranges
        assert sum(s["bytes_network"] for s in sts) == sum(s["remote"] for s in sts)
    assert sum(s["bytes_network"] for sts in per_node.values() for s in sts) > 0   # parts did travel
    # keep=2: the members themselves hold parts of versions 4 and 5 only, and no node cache
    held = {k for n in (t0, t1, r0, r1, r2) for k in n.keys()}
    assert {int(k.split("/")[3]) for k in held if k.startswith("__rl__/policy/v/")} == {4, 5}
    for n in (r0, r1, r2):                 # a node's landed spans of retired versions are gone
        with open_store(url, n.name) as s:
            cached = {int(k.split("/")[3]) for k in s.node_store.keys(prefix="__node__/cache/rl/policy/")}
            assert cached <= {4, 5}, cached


def test_processes_of_a_node_pull_a_shared_slice_once(harness):
    nodes = harness.start(3)
    url = url_of(harness)
    out, start, one = SPAWN.Queue(), SPAWN.Barrier(2), SPAWN.Barrier(1)   # (kept referenced)
    pub = SPAWN.Process(target=trainer, args=(url, nodes[0].name, 0, 1, [1], one, out))
    pub.start()
    assert collect(out, [pub]) == [("trainer", 0, "ok")]
    r0 = node_holding_fewest(harness, nodes, 1)           # 3 parts on 3 members: it lacks some
    procs = [SPAWN.Process(target=rollout, args=(url, r0.name, 1, 3, 1, [1], None, out, start)) for _ in range(2)]
    for p in procs:
        p.start()
    sts = [m[-1] for m in collect(out, procs) if len(m) == 5]
    assert len(sts) == 2
    remote = sts[0]["remote"]
    assert remote > 0
    assert sum(s["bytes_network"] for s in sts) == remote                 # crossed the network once
    assert sum(s["bytes_node_cache"] for s in sts) == remote              # the other read it zero-copy
    assert sum(s["received"] for s in sts) <= remote + 2 * 8192           # the transport agrees
    for s in sts:
        assert s["bytes_network"] + s["bytes_node_cache"] + s["bytes_local"] == s["bytes_needed"]
    # the landed spans are the node's own objects: the member never lists (so never moves) them
    from yrcache.cluster.member import NODE_CACHE_PREFIX
    from yrcache.cluster.store import ClusterStore
    from yrcache.rl.remote import NODE_CACHE

    assert NODE_CACHE.startswith(NODE_CACHE_PREFIX) and NODE_CACHE_PREFIX.startswith(ClusterStore.NODE_PREFIX)
    with open_store(url, r0.name) as s:
        assert any(k.startswith(NODE_CACHE) for k in s.node_store.keys())
        assert not any(k.startswith(ClusterStore.NODE_PREFIX) for k in s.keys())
        assert not any(k.startswith(ClusterStore.NODE_PREFIX) for k in r0.keys())


# ---- failures --------------------------------------------------------------------------
def test_wake_crosses_nodes_and_the_record_lives_in_etcd(harness, etcd):
    with first_version(harness, 2) as (pub, _rs, sub, _url):
        raw, _ = etcd.client().get(f"/yrcache/{harness.cluster}/words/rl/policy")
        assert int(raw) == 2                                   # newest complete version + 1
        seen = sub.board.token()
        t = time.monotonic()
        pub.publish(trainer_state(0, 1, 2), version=2)
        assert sub.board.wait_change(seen, 10)                 # a futex woken by r0's member
        assert time.monotonic() - t < 5 and sub.latest() == 2


def test_a_subscriber_whose_member_died_still_hears_of_versions_and_fetches_them(harness):
    from cluster_util import NodeProc

    t0, r0, x = harness.start(3)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        pub.publish(trainer_state(0, 1, 1), version=1)
        assert sub.wait(timeout=10) == 1 and rs.member_present is True
        r0.sigkill()                       # the member that mirrors the records into r0's arena
        wait_for(lambda: rs.member_present is False and r0.member_id not in ts._router.members, 15,
                 "the dead member's lease expired")
        for v in (2, 3):                   # read from etcd meanwhile, the parts pulled from the others
            assert pub.publish(trainer_state(0, 1, v), version=v) is True
            assert sub.wait(newer_than=v - 1, timeout=10) == v
            res = sub.fetch(v, layout=rollout_layout(0, 3))
            for name in SHAPES:
                np.testing.assert_array_equal(res[name], expected_slice(name, v, 0, 3))
        with pytest.raises(TimeoutError, match=f"member {r0.member_id} is not in the cluster"):
            sub.wait(newer_than=3, timeout=0.5)
        harness.nodes.append(NodeProc(harness.env, r0.name, harness.tmp))    # restarted: same name
        wait_for(lambda: rs.member_present is True, 15, "the member is back")
        pub.publish(trainer_state(0, 1, 4), version=4)
        assert sub.wait(newer_than=3, timeout=10) == 4
        res = sub.fetch(4, layout=rollout_layout(2, 3))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, 4, 2, 3))


def test_etcd_restart_between_versions(harness, etcd):
    with first_version(harness) as (pub, _rs, sub, _url):
        etcd.kill()
        etcd.start()
        pub.publish(trainer_state(0, 1, 2), version=2)          # the record's transaction retries
        assert sub.wait(newer_than=1, timeout=20) == 2          # r0's watch was armed again
        res = sub.fetch(2, layout=rollout_layout(2, 3))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, 2, 2, 3))


def test_a_trainer_node_dying_mid_publish_leaves_the_previous_version(tmp_path, etcd):
    with ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="2") as h:
        t0, t1, r0, _ = h.start(4)
        url = url_of(h)
        stores = [open_store(url, n.name, 2) for n in (t0, r0)]
        ts, rs = stores
        try:
            p0 = WeightPublisher(ts, "policy", rank=0, world=2)
            out, one = SPAWN.Queue(), SPAWN.Barrier(1)
            p1 = SPAWN.Process(target=trainer, args=(url, t1.name, 1, 2, [1], one, out, 2))
            p1.start()
            p0.publish(trainer_state(0, 2, 1), version=1, layout={n: Shard(0, 0, 2) for n in SPLIT})
            collect(out, [p1])
            sub = WeightSubscriber(rs, "policy")
            assert sub.wait(timeout=10) == 1
            # version 2: rank 0 publishes, then rank 1's node dies before rank 1 does
            assert not p0.publish(trainer_state(0, 2, 2), version=2, layout={n: Shard(0, 0, 2) for n in SPLIT})
            t1.sigkill()
            with pytest.raises(TimeoutError, match=r"version 2 is in flight, waiting for rank\(s\) 1 of world=2"):
                sub.wait(newer_than=1, timeout=1.0)            # the unfinished version stays invisible
            with pytest.raises(KeyError, match="not complete"):
                sub.fetch(2)
            wait_for(lambda: t1.member_id not in rs._router.members, 15, "the dead member's lease expired")
            res = sub.fetch(1, layout=rollout_layout(0, 2))   # still whole, from the other copies
            for name in SHAPES:
                np.testing.assert_array_equal(res[name], expected_slice(name, 1, 0, 2))
        finally:
            for s in stores:
                s.close()


def test_losing_a_member_that_holds_parts_is_a_clear_error_then_the_next_version_works(harness):
    t0, r0 = harness.start(2)
    harness.env["YRCACHE_LEASE_TTL"] = "6"      # the victims: 4-6 s in the ring after they die
    x1, x2 = harness.start(2)
    harness.env["YRCACHE_LEASE_TTL"] = str(TTL)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        extra = {f"e{i}": np.full(8, i, np.float32) for i in range(24)}   # parts on every member
        pub.publish({**trainer_state(0, 1, 1), **extra}, version=1)
        assert sub.wait(timeout=10) == 1
        marker = sub.board.completion(1)
        keys = [sub.board.part_key(1, 0, marker["nonces"][0], n) for n in [*SHAPES, *extra]]
        holders = {rs.owners(k)[0] for k in keys}
        victim = next((n for n in (x1, x2) if n.member_id in holders), None)
        assert victim is not None, holders     # 27 parts over 4 members: some are on x1 or x2
        victim.sigkill()
        with pytest.raises((KeyError, ClusterUnavailableError), match="no live member|answered|died"):
            sub.fetch(1)                        # never wrong bytes
        # The dead member owns some of version 2's parts and stays in the ring until its
        # lease expires: a publish then waits for the member set to change and tries again.
        v2 = {**trainer_state(0, 1, 2), **extra}
        assert victim.member_id in {ts.owners(sub.board.part_key(2, 0, marker["nonces"][0], n))[0] for n in v2}
        pub.settle_s = 0                        # no waiting: the dead owner fails it
        with pytest.raises(ClusterUnavailableError, match="did not take the write|no owner answered"):
            pub.publish(v2, version=2)
        assert sub.latest() == 1 and victim.member_id in ts._router.members
        pub.settle_s = 15
        t = time.monotonic()
        assert pub.publish(v2, version=2) is True
        # published once the ring changed (4-6 s after the death), not at the 15 s limit
        assert victim.member_id not in ts._router.members and time.monotonic() - t < 14
        assert sub.wait(newer_than=1, timeout=10) == 2
        res = sub.fetch(2, layout=rollout_layout(1, 2))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, 2, 1, 2))


def test_a_hung_member_costs_a_publish_its_lease_not_the_request_timeout(harness):
    """A member that stops answering but keeps its connections (SIGSTOP) while it owns
    parts of the next version: the publish's writes to it end when its lease expires and
    the publish completes on the new ring, seconds later, not after the 30 s request timeout."""
    t0, r0 = harness.start(2)
    harness.env["YRCACHE_LEASE_TTL"] = "6"      # x: 4-6 s in the ring after it stops
    x, = harness.start(1)
    harness.env["YRCACHE_LEASE_TTL"] = str(TTL)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        harness.wait_members(rs, 3)
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        extra = {f"e{i}": np.full(8, i, np.float32) for i in range(24)}
        pub.publish({**trainer_state(0, 1, 1), **extra}, version=1)
        assert sub.wait(timeout=10) == 1
        nonce = sub.board.completion(1)["nonces"][0]
        v2 = {**trainer_state(0, 1, 2), **extra}
        assert x.member_id in {ts.owners(sub.board.part_key(2, 0, nonce, n))[0] for n in v2}
        # a weight set with a version in flight whose begin record is on x
        other = WeightSubscriber(rs, "other")
        v = next(v for v in range(1, 1000) if rs.owners(other.board._started_key(v))[0] == x.member_id)
        WeightPublisher(ts, "other", rank=0, world=2).publish({"w": np.ones((2, 2))}, v, layout={"w": Shard(0, 0, 2)})
        with pytest.raises(TimeoutError, match=f"version {v} is in flight, waiting for rank"):
            other.wait(timeout=0.2)
        sigstop(x.proc.pid)
        try:
            t = time.monotonic()
            with pytest.raises(TimeoutError) as ei:
                other.wait(timeout=0.2)      # the look at the in-flight version is cut short
            assert time.monotonic() - t < 2.5 and "in flight" not in str(ei.value)
            t = time.monotonic()
            assert pub.publish(v2, version=2) is True
            took = time.monotonic() - t
        finally:
            x.proc.send_signal(signal.SIGCONT)
        assert took < 14, took                 # x's lease (6 s), not the 30 s request timeout
        assert sub.wait(newer_than=1, timeout=10) == 2
        res = sub.fetch(2, layout=rollout_layout(0, 2))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, 2, 0, 2))


def test_processes_with_different_slices_pull_the_parts_they_share_once(harness):
    """Two processes of a node, fetching at once: the same slices of "a" and "bias",
    different slices of "b". The spans they share cross the network once."""
    nodes = harness.start(4)
    url = url_of(harness)
    out, start, one = SPAWN.Queue(), SPAWN.Barrier(2), SPAWN.Barrier(1)
    pub = SPAWN.Process(target=trainer, args=(url, nodes[0].name, 0, 1, [1], one, out))
    pub.start()
    assert collect(out, [pub]) == [("trainer", 0, "ok")]
    r0 = node_holding_fewest(harness, nodes, 1)           # 3 parts on 4 members: it holds none
    gs = [{"a": 1, "b": 0, "bias": 1}, {"a": 1, "b": 2, "bias": 1}]
    procs = [SPAWN.Process(target=rollout, args=(url, r0.name, g, 3, 1, [1], None, out, start)) for g in gs]
    for p in procs:
        p.start()
    sts = [m[-1] for m in collect(out, procs) if len(m) == 5]
    assert len(sts) == 2
    shared = sts[0]["remote_shared"]
    assert shared == sts[1]["remote_shared"] and sts[0]["remote"] > shared > 0, sts
    union = sts[0]["remote"] + sts[1]["remote"] - shared
    assert sum(s["bytes_network"] for s in sts) == union                  # shared spans: once
    assert sum(s["bytes_node_cache"] for s in sts) == shared              # the other's, read in place
    assert sum(s["received"] for s in sts) <= union + 2 * 8192
    for s in sts:
        assert s["bytes_network"] + s["bytes_node_cache"] + s["bytes_local"] == s["bytes_needed"]


# ---- ranged reads (the data plane under the fetch) -----------------------------------------
def test_read_ranges_returns_only_the_spans_and_refuses_bad_ones(harness):
    from yrcache.cluster import transport as tp

    nodes = harness.start(2)
    url = url_of(harness)
    data = np.arange(64 * 100, dtype=np.uint8).reshape(64, 100) * 3
    with open_store(url, nodes[0].name) as s, harness.client(replicas=1) as c:
        harness.wait_members(c, 2)
        s["m"] = data
        spans = [(5, 10, 1, 10), (200, 7, 20, 100)]       # a run, then 20 rows of a 7-byte column
        want = np.concatenate([data.reshape(-1)[5:15], data[2:22, 0:7].reshape(-1)])
        for store in (s, c):                               # local arena / over the network
            before = store.received_bytes
            got = store.read_ranges("m", spans)
            np.testing.assert_array_equal(np.frombuffer(got, np.uint8), want)
            into = bytearray(want.nbytes)
            store.read_ranges("m", spans, into=into)
            assert bytes(into) == want.tobytes()
            if store is c:
                assert store.received_bytes - before == 2 * want.nbytes      # the spans, nothing more
        assert c.read_ranges("missing", spans) is None
        for store in (s, c):                               # the stored bytes, without decoding
            meta, raw = store.get_raw("m")
            assert bytes(raw) == data.tobytes() and raw.readonly and meta[:1] == b"N"
        assert c.get_raw("missing") is None
        s["m2"] = b"x"
        assert c.delete_many(["m2", "missing"]) == 1        # pipelined, every member
        assert "m2" not in c and s.get("m2") is None
        s.check()                                          # this node's arena is consistent
        with pytest.raises(ValueError, match="writable buffer of 150 bytes"):
            c.read_ranges("m", spans, into=bytearray(10))
        with pytest.raises(ValueError, match="tuples of ints >= 0"):
            c.read_ranges("m", [(-1, 2, 1, 2)])
        with pytest.raises(ValueError, match="outside an object"):
            s.read_ranges("m", [(6390, 20, 1, 20)])        # past the end, served locally
        owner = next(n for n in nodes if n.member_id == c.owners("m")[0])
        peer = owner.peer()
        try:
            with pytest.raises(tp.RemoteError, match="outside an object"):
                peer.getv("m", [(0, 50, 2, 10)])           # rows overlapping: refused, not read
            assert bytes(peer.getv("m", [(0, 4, 1, 4)]).buf) == data.reshape(-1)[:4].tobytes()
            with pytest.raises(ValueError, match="at most"):   # more spans than a frame may carry
                peer.getv("m", [(0, 1, 1, 1)] * (tp.MAX_SPANS + 1))
            # a server that gets one anyway (or a torn span list) drops the connection
            body = tp.encode_spans([(0, 1, 1, 1)] * (tp.MAX_SPANS + 1))
            c2 = peer.borrow()
            c2.sock.sendall(tp.pack(tp.GETV, b"m", plen=len(body)) + body)
            with pytest.raises(ConnectionError):
                c2.reply(tp.GETV)
            c2.sock.close()
            assert bytes(peer.getv("m", [(1, 2, 1, 2)]).buf) == data.reshape(-1)[1:3].tobytes()
        finally:
            peer.close()


def test_bf16_torch_weights_cross_nodes_and_members_never_import_torch(harness):
    torch = pytest.importorskip("torch")
    t0, r0, x = harness.start(3)
    url = url_of(harness)
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) / 7
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        pub.publish({"w": full, "b": full[0]}, version=3, dtype=torch.bfloat16)
        assert sub.wait(timeout=10) == 3
        res = sub.fetch(3, layout={"w": Shard(1, 2, 3), "b": Shard(0, 0, 2)})
        assert res["w"].dtype == torch.bfloat16
        assert torch.equal(res["w"], full.to(torch.bfloat16)[:, 32:48])
        assert torch.equal(res["b"], full[0].to(torch.bfloat16)[:24])
        direct = 0
        # later versions: received straight into the result tensors (nobody else wants them),
        # cast after when asked
        for v in (4, 5, 6, 7):
            pub.publish({"w": full + v, "b": full[0] + v}, version=v, dtype=torch.bfloat16)
            assert sub.wait(newer_than=v - 1, timeout=10) == v
            res = sub.fetch(v, layout={"w": Shard(1, 2, 3), "b": Shard(0, 0, 2)},
                            dtype=torch.float32 if v % 2 else None)
            assert res["w"].dtype == (torch.float32 if v % 2 else torch.bfloat16)
            assert torch.equal(res["w"], (full + v).to(torch.bfloat16)[:, 32:48].to(res["w"].dtype))
            assert torch.equal(res["b"], (full[0] + v).to(torch.bfloat16)[:24].to(res["b"].dtype))
            direct += sub.last_fetch_stats["bytes_direct"]
        # into= CPU tensors of the stored dtype take the bytes straight in too
        into = {"w": torch.empty(64, 16, dtype=torch.bfloat16), "b": torch.empty(24, dtype=torch.bfloat16)}
        for v in (8, 9):
            pub.publish({"w": full + v, "b": full[0] + v}, version=v, dtype=torch.bfloat16)
            assert sub.wait(newer_than=v - 1, timeout=10) == v
            res = sub.fetch(v, layout={"w": Shard(1, 2, 3), "b": Shard(0, 0, 2)}, into=into)
            assert res["w"] is into["w"] and torch.equal(into["w"], (full + v).to(torch.bfloat16)[:, 32:48])
            assert torch.equal(into["b"], (full[0] + v).to(torch.bfloat16)[:24])
            direct += sub.last_fetch_stats["bytes_direct"]
        assert direct > 0                        # (2 parts on 3 nodes: some were remote)
        # the members stored and served tensors' bytes without loading torch (seconds each)
        for node in (t0, r0, x):
            maps = open(f"/proc/{node.proc.pid}/maps").read()
            assert "libtorch" not in maps, node.name


def test_a_pure_client_subscribes_with_its_own_watch(harness):
    t0, _, _ = harness.start(3)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, harness.client(replicas=1) as c:
        assert c.role == "client" and c.node_store is None
        harness.wait_members(c, 3)
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(c, "policy")
        pub.publish(trainer_state(0, 1, 1), version=1)
        assert sub.wait(timeout=10) == 1                    # the client's own etcd watch
        seen = sub.board.token()
        pub.publish(trainer_state(0, 1, 2), version=2)
        assert sub.board.wait_change(seen, 10) and sub.wait(newer_than=1, timeout=10) == 2
        res = sub.fetch(2, layout=rollout_layout(0, 3))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, 2, 0, 3))
        st = sub.last_fetch_stats
        assert st["bytes_network"] == st["bytes_needed"] and st["bytes_local"] == 0   # no arena
        # A forked child: the client's watch stays the parent's, so the inherited subscriber
        # says so (it timed out silently). (The child opens no store: gRPC, under etcd's client,
        # may abort in a forked child that makes a channel.)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                        # the child: report, then exit at once
            try:
                sub.wait(newer_than=2, timeout=5)
                out = "wait returned"
            except BaseException as e:                      # noqa: BLE001 - reported to the parent
                out = f"{type(e).__name__}: {e}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung")
            time.sleep(0.1)
        with os.fdopen(r) as f:
            got = f.read()
        assert got.startswith("ClusterUnavailableError: this process was forked"), got


def test_a_version_whose_records_died_with_a_member_is_said_lost_and_its_parts_are_freed(harness):
    """replicas=1 and the one member holding both records of the newest version V (its
    begin record and its completion marker) is SIGKILLed: a waiter times out (no
    ``ClusterUnavailableError`` out of ``wait``), ``fetch(V)`` says the version is lost
    (not "reclaimed"), and once newer versions retire V its parts on the survivors go
    too, though no marker names V any more."""
    t0, r0 = harness.start(2)
    harness.env["YRCACHE_LEASE_TTL"] = "4"      # the victim: 3-4 s in the ring after it dies
    (victim,) = harness.start(1)
    harness.env["YRCACHE_LEASE_TTL"] = str(TTL)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        harness.wait_members(rs, 3)
        pub, sub = WeightPublisher(ts, "policy"), WeightSubscriber(rs, "policy")
        extra = {f"e{i}": np.full(8, i, np.float32) for i in range(24)}   # parts on every member
        pub.publish({**trainer_state(0, 1, 1), **extra}, version=1)
        b = sub.board
        v = next(v for v in range(2, 10_000)
                 if {ts.owners(b._started_key(v))[0], ts.owners(b.complete_key(v))[0]} == {victim.member_id})
        pub.publish({**trainer_state(0, 1, v), **extra}, version=v)
        assert sub.wait(newer_than=1, timeout=10) == v
        survivors = [t0, r0]

        def parts_of(version: int) -> int:
            return sum(k.startswith(b.version_prefix(version)) for n in survivors for k in n.keys())
        assert parts_of(v) > 0                  # 27 parts over 3 members: some on the survivors
        victim.sigkill()
        fresh = WeightSubscriber(rs, "policy")
        with pytest.raises(TimeoutError):       # its marker's owner does not answer: still just waiting
            fresh.wait(newer_than=v, timeout=1)
        wait_for(lambda: victim.member_id not in rs._router.members, 15, "the victim's lease to run out")
        with pytest.raises(KeyError, match=f"version {v} of 'policy' is lost: .*no live member"):
            sub.fetch(v)
        for w in (v + 1, v + 2):                # keep=2: these two retire v (and 1)
            assert pub.publish({**trainer_state(0, 1, w), **extra}, version=w) is True
        assert sub.versions() == [v + 1, v + 2]
        assert parts_of(v) == 0 and parts_of(1) == 0
        with pytest.raises(KeyError, match="reclaimed"):
            sub.fetch(v)
        res = sub.fetch(v + 2, layout=rollout_layout(1, 2))
        for name in SHAPES:
            np.testing.assert_array_equal(res[name], expected_slice(name, v + 2, 1, 2))


def test_a_member_drops_its_nodes_cached_copies_to_take_a_write_it_owns(harness):
    """A node's landed spans (``__node__/cache/``) fill its small arena: a write the member
    owns (a part of a new version) takes their room instead of failing with "member is
    full" until a fetch of a newer version would free them (it never could, since no newer
    version could be published)."""
    (big,) = harness.start(1)
    harness.env["YRCACHE_DRAM"] = "8MiB"
    (small,) = harness.start(1)
    url = url_of(harness)
    from yrcache.rl.remote import NODE_CACHE
    with open_store(url, big.name) as bs, open_store(url, small.name) as ss:
        harness.wait_members(bs, 2)
        node, cached = ss.node_store, 0
        while True:                              # the node's copies, as fetches land them
            try:
                node.put(f"{NODE_CACHE}policy/{1:020d}/{cached}", np.full(256 << 10, 7, np.uint8))
            except MemoryError:
                break
            cached += 1
        assert cached >= 16
        mine = [k for k in (f"w{i}" for i in range(200)) if bs.owners(k) == [small.member_id]][:3]
        for k in mine:                           # 1 MiB each: no room for them but the copies'
            bs.put(k, np.full(1 << 20, 3, np.uint8))
        for k in mine:
            assert (np.asarray(bs.get(k)) == 3).all()
        assert not list(node.keys(prefix="__node__/cache/"))
    assert "dropped" in small.log.read_text()
