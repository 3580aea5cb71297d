"""Which spans land in a node's arena: only those another live subscriber of the node
pulled last time (``yrcache/rl/wants.py``); the rest are received straight into the
fetch's results. A real etcd and ``yrcache node`` members on loopback; the node's
processes are this test process and spawned ones.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("pyetcd")
from cluster_util import ClusterHarness, wait_for  # noqa: E402
from test_rl_cluster import (SHAPES, SPAWN, collect, expected_slice, first_version, open_store,  # noqa: E402
                             reference, remote_bytes, rollout, rollout_layout, trainer, trainer_state, url_of)

from yrcache.rl import Fused, Shard, WeightPublisher, WeightSubscriber  # noqa: E402
from yrcache.rl.wants import WANTS  # noqa: E402


@pytest.fixture
def harness(etcd, tmp_path):
    h = ClusterHarness(etcd, tmp_path, YRCACHE_REPLICAS="1")
    yield h
    h.close()


def _publish_remote(pub, rs, sub, after: int) -> int:
    """Publish the first version after ``after`` of which some part is on another node
    than ``rs``'s (a publisher's part keys differ by version only, so that is known)."""
    nonce = sub.board.completion(after)["nonces"][0]
    v = after + 1
    while all(rs.owners(sub.board.part_key(v, 0, nonce, n))[0] == rs.member_id for n in SHAPES):
        v += 1
    pub.publish(trainer_state(0, 1, v), version=v)
    assert sub.wait(newer_than=after, timeout=10) == v
    return v


def _fetch(store, sub, v, g, count=3, **kw):
    res = sub.fetch(v, layout=rollout_layout(g, count), **kw)
    for name in SHAPES:
        want = expected_slice(name, v, g, count)
        np.testing.assert_array_equal(res[name], want.astype(res[name].dtype), err_msg=name)
    return dict(sub.last_fetch_stats, remote=remote_bytes(store, sub, v, g, count, 1))


def test_processes_sharing_a_slice_pull_it_once_every_version(harness):
    """Two processes of a node fetch the same slice of 5 versions together: every
    version crosses the network once (the second and later too, when each knows the
    other wants it), and nothing goes straight into a result."""
    t0, r0, _ = harness.start(3)
    url, versions = url_of(harness), [1, 2, 3, 4, 5]
    out, barrier, start = SPAWN.Queue(), SPAWN.Barrier(3), SPAWN.Barrier(2)
    procs = [SPAWN.Process(target=trainer, args=(url, t0.name, 0, 1, versions, barrier, out))]
    procs += [SPAWN.Process(target=rollout, args=(url, r0.name, 1, 3, 1, versions, barrier, out, start))
              for _ in range(2)]
    for p in procs:
        p.start()
    per_version: dict[int, list[dict]] = {}
    for m in collect(out, procs):
        if m[0] == "rollout" and len(m) == 5:
            per_version.setdefault(m[3], []).append(m[4])
    assert sorted(per_version) == versions
    for v, sts in per_version.items():
        remote = sts[0]["remote"]
        assert len(sts) == 2 and sts[1]["remote"] == remote
        assert sum(s["bytes_network"] for s in sts) == remote, (v, sts)     # once per node
        assert sum(s["bytes_node_cache"] for s in sts) == remote, (v, sts)  # the other's, in place
        assert all(s["bytes_direct"] == 0 for s in sts), (v, sts)            # landed: shared
    assert sum(per_version[v][0]["remote"] for v in versions[1:]) > 0      # (parts did travel)


def test_a_slice_nobody_else_wants_goes_straight_into_the_results(harness):
    """After its first fetch, a subscriber alone on its node receives its spans
    straight into the results (in the stored dtype, cast after when asked) and into
    ``into=`` arrays of the stored dtype, privately then copied into other ``into=``
    arrays; nothing lands in the node's arena."""
    with first_version(harness) as (pub, rs, sub, _url):
        v = _publish_remote(pub, rs, sub, 1)
        st = _fetch(rs, sub, v, 2)
        assert st["bytes_direct"] == 0 and st["bytes_network"] == st["remote"] > 0   # first: landed
        landed = list(rs.node_store.keys(prefix="__node__/cache/rl/policy/"))
        assert landed
        for kw in ({}, {"dtype": np.float64}):
            v = _publish_remote(pub, rs, sub, v)
            st = _fetch(rs, sub, v, 2, **kw)
            assert st["bytes_direct"] == st["bytes_network"] == st["remote"] > 0, st
            assert not [k for k in rs.node_store.keys(prefix="__node__/cache/rl/policy/") if k not in landed]
        # into= destinations in the stored dtype take the bytes straight in too; in another
        # dtype, or not contiguous, they are received privately, then copied (nothing landed)
        for dt, straight in ((np.float32, True), (np.float64, False), (None, False)):
            v = _publish_remote(pub, rs, sub, v)
            if dt is None:                  # strided destinations: refused before any part is pulled
                into = {n: np.empty_like(expected_slice(n, v, 2, 3).T).T for n in SHAPES}
                into["bias"] = np.empty(2 * expected_slice("bias", v, 2, 3).size, np.float32)[::2]
                marker = len(bytes(rs.get(sub.board.complete_key(v))))
                before = rs.received_bytes
                with pytest.raises(ValueError, match="contiguous"):
                    sub.fetch(v, layout=rollout_layout(2, 3), into=into)
                assert rs.received_bytes - before <= marker  # the marker at most (0: this node holds it)
                continue
            into = {n: np.empty(expected_slice(n, v, 2, 3).shape, dt) for n in SHAPES}
            st = _fetch(rs, sub, v, 2, into=into)
            assert st["bytes_network"] == st["remote"] > 0, st
            assert st["bytes_direct"] == (st["bytes_network"] if straight else 0), (dt, st)
            for name in SHAPES:
                np.testing.assert_array_equal(into[name], expected_slice(name, v, 2, 3))
            assert not [k for k in rs.node_store.keys(prefix="__node__/cache/rl/policy/") if k not in landed]


def test_a_subscriber_that_waits_makes_the_others_land_itsfirst_version(harness):
    """A joins first and fetches alone (straight into its results); B then waits: A's
    next fetch lands everything, so B reads that version from the node's arena."""
    with first_version(harness) as (pub, rs, a, _url):
        _fetch(rs, a, 1, 0)                                   # A's first fetch
        v = _publish_remote(pub, rs, a, 1)
        st = _fetch(rs, a, v, 0)
        assert st["bytes_direct"] == st["bytes_network"] == st["remote"] > 0, st    # alone: straight in
        b = WeightSubscriber(rs, "policy")
        assert b.wait(newer_than=1, timeout=10) == v          # B is there, wanting everything
        v = _publish_remote(pub, rs, a, v)
        sa, sb = _fetch(rs, a, v, 0), _fetch(rs, b, v, 0)
        assert sa["bytes_direct"] == 0 and sa["bytes_network"] == sa["remote"] > 0, sa
        assert sb["bytes_network"] == 0 and sb["bytes_node_cache"] == sa["remote"], sb
        # B moves to another slice: what each pulls, the other now does not want
        v = _publish_remote(pub, rs, a, v)
        sb = _fetch(rs, b, v, 1)
        sa = _fetch(rs, a, v, 0)
        assert sa["bytes_direct"] == sa["bytes_network"] == sa["remote"] > 0, sa
        assert sb["bytes_direct"] == sb["bytes_network"] == sb["remote"] > 0, sb


def _waiter(url, node, ready):
    with open_store(url, node) as s:
        sub = WeightSubscriber(s, "policy")
        sub.wait(timeout=30)
        ready.set()
        signal.pause()                    # (holding sub: its record goes when it is collected)


def test_a_dead_subscribers_record_stops_counting(harness):
    """Another process's subscriber waits (wanting everything): ours lands. It is
    SIGKILLed: its record is dropped at our next fetch, which goes straight in."""
    with first_version(harness) as (pub, rs, sub, url):
        _fetch(rs, sub, 1, 0)                                 # (the first fetch lands anyway)
        ready = SPAWN.Event()
        other = SPAWN.Process(target=_waiter, args=(url, rs.name, ready))
        other.start()
        try:
            assert ready.wait(60)
            records = list(rs.node_store.keys(prefix=WANTS))
            assert len(records) == 2
            v = _publish_remote(pub, rs, sub, 1)
            st = _fetch(rs, sub, v, 0)
            assert st["bytes_direct"] == 0 and st["bytes_network"] > 0     # it is alive: land
            os.kill(other.pid, signal.SIGKILL)
            other.join(10)
        finally:
            other.kill()
        v = _publish_remote(pub, rs, sub, v)
        st = _fetch(rs, sub, v, 0)
        assert st["bytes_direct"] == st["bytes_network"] > 0, st          # dead: straight in
        wait_for(lambda: len(list(rs.node_store.keys(prefix=WANTS))) == 1, 5, "the dead record dropped")


def _stopping_lander(url, node, version, out):
    """Fetch slice 0 of ``version``, stopping this process (SIGSTOP) once it holds the
    node locks of the spans it is about to land; report the fetch after SIGCONT."""
    import yrcache.rl.remote as remote

    pull = remote._receive_many

    def stop_then_pull(store, pulls, node, cks=None):
        if cks is not None:                       # landing: its node locks are held
            os.kill(os.getpid(), signal.SIGSTOP)
        return pull(store, pulls, node, cks)
    remote._receive_many = stop_then_pull
    try:
        with open_store(url, node) as s:
            sub = WeightSubscriber(s, "policy")
            out.put(("lander", _fetch(s, sub, version, 0)))
    except BaseException as e:  # noqa: BLE001 - the test reports it
        out.put(("lander", repr(e)))


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rfind(b")") + 2:].split()[0].decode()


def test_a_stopped_lander_does_not_hang_the_nodes_other_fetchers(harness):
    """A process of the node is stopped (SIGSTOP) while it holds the node locks of the
    spans it lands. Another process fetching the same spans waits ``PATIENCE_S``, sees
    the lander stopped and pulls them itself; the lander, continued, ends its fetch;
    both get the right bytes and the lander's record goes."""
    from concurrent.futures import ThreadPoolExecutor

    from yrcache.rl.landers import LANDERS, PATIENCE_S

    with first_version(harness) as (pub, rs, sub, url):
        v = _publish_remote(pub, rs, sub, 1)
        out = SPAWN.Queue()
        lander = SPAWN.Process(target=_stopping_lander, args=(url, rs.name, v, out))
        lander.start()
        try:
            wait_for(lambda: _state(lander.pid) == "T", 60, "the lander stopped while landing")
            assert len(list(rs.node_store.keys(prefix=LANDERS))) == 1
            with ThreadPoolExecutor(1) as ex:
                t = time.monotonic()
                ours = ex.submit(_fetch, rs, sub, v, 0)          # our first fetch: it would land too
                try:
                    st = ours.result(timeout=30)
                finally:
                    os.kill(lander.pid, signal.SIGCONT)
            assert PATIENCE_S <= time.monotonic() - t < 15
            assert st["bytes_network"] == st["remote"] > 0 and st["bytes_node_cache"] == 0, st
            who, theirs = out.get(timeout=60)
            assert isinstance(theirs, dict), theirs
            assert theirs["bytes_network"] == theirs["remote"] == st["remote"], theirs
            lander.join(30)
            assert lander.exitcode == 0
        finally:
            if lander.is_alive():
                os.kill(lander.pid, signal.SIGCONT)
                lander.kill()
        assert not list(rs.node_store.keys(prefix=LANDERS))


def test_parts_that_are_not_one_run_of_the_result_are_copied_after(harness):
    """Column blocks (two ranks' ``Shard(1)`` parts) of whole tensors: each part's
    rows are strided in the result, so they are received privately and copied into
    place, never straight in (which would be wrong bytes)."""
    t0, r0, _ = harness.start(3)
    url = url_of(harness)
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        pubs = [WeightPublisher(ts, "policy", rank=r, world=2) for r in range(2)]
        sub = WeightSubscriber(rs, "policy")
        for v in (1, 2, 3, 4):
            for r, pub in enumerate(pubs):
                state = {n: np.array_split(reference(n, v), 2, axis=1)[r] for n in ("a", "b")}
                if r == 0:
                    state["bias"] = reference("bias", v)
                pub.publish(state, v, layout={n: Shard(1, r, 2) for n in ("a", "b")})
            assert sub.wait(newer_than=v - 1 if v > 1 else None, timeout=10) == v
            res = sub.fetch(v)
            for name in SHAPES:
                np.testing.assert_array_equal(res[name], reference(name, v), err_msg=(name, v))
            st = sub.last_fetch_stats
            assert st["bytes_direct"] <= 30 * 4 and st["bytes_node_cache"] == 0, st   # "bias" at most


def test_random_layouts_and_versions_never_give_wrong_bytes(harness):
    """Seeded random publisher shardings and subscriber layouts (changing between
    versions, so records go stale, slices are shared, part-shared or not at all),
    fetched by two subscribers of one node: every result equals the reference."""
    t0, r0, _ = harness.start(3)
    url, rng = url_of(harness), np.random.default_rng(7)
    shapes = {f"t{i}": (int(rng.integers(1, 9)), int(rng.integers(1, 13))) for i in range(5)}
    shapes.update(f0=(3, 6), f1=(2, 6))          # fused by two targets at once: a part read twice
    with open_store(url, t0.name) as ts, open_store(url, r0.name) as rs:
        world = 2
        pubs = [WeightPublisher(ts, "fuzz", rank=r, world=world) for r in range(world)]
        dims = {n: int(rng.integers(0, 2)) for n in shapes}
        subs = [WeightSubscriber(rs, "fuzz") for _ in range(2)]
        direct = shared = 0
        for v in range(1, 13):
            full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
            for r, pub in enumerate(pubs):
                pub.publish({n: np.array_split(x, world, axis=dims[n])[r] for n, x in full.items()}, v,
                            layout={n: Shard(dims[n], r, world) for n in shapes})
            for sub in subs:
                assert sub.wait(newer_than=v - 1 if v > 1 else None, timeout=10) == v
                layout = {}
                for n in shapes:
                    if rng.random() < 0.8:
                        k = int(rng.integers(1, 4))
                        layout[n] = Shard(int(rng.integers(0, 2)), int(rng.integers(0, k)), k)
                want = {n: x if n not in layout else
                        np.array_split(x, layout[n].count, axis=layout[n].dim)[layout[n].index]
                        for n, x in full.items()}
                if rng.random() < 0.5:
                    cut = Shard(int(rng.integers(0, 2)), 1, 2)
                    layout |= {"x": Fused(["f0", "f1"], dim=0, shard=cut), "y": Fused(["f0", "f1"], dim=0)}
                    del want["f0"], want["f1"]            # each source cut on its own, then joined
                    want |= {"x": np.concatenate([np.array_split(full[f], 2, axis=cut.dim)[1] for f in ("f0", "f1")]),
                             "y": np.concatenate([full["f0"], full["f1"]])}
                    layout.pop("f0", None), layout.pop("f1", None)
                kw = {"dtype": np.float64} if rng.random() < 0.2 else {}
                res = sub.fetch(v, layout=layout, **kw)
                assert sorted(res) == sorted(want)
                for n, x in want.items():
                    np.testing.assert_array_equal(res[n], x.astype(res[n].dtype), err_msg=(v, n, layout.get(n)))
                direct += sub.last_fetch_stats["bytes_direct"]
                shared += sub.last_fetch_stats["bytes_node_cache"]
        assert direct > 0 and shared > 0              # (both ways were taken)


def test_lander_records_of_dead_processes_go_and_other_namespaces_count_as_running(make_store):
    """``lander_stopped`` drops a record whose process is gone (or whose pid is another
    process now), skips one from another pid namespace, and sees a stopped one."""
    import struct
    import subprocess
    import sys

    from yrcache.rl.landers import LANDERS, _me, _proc_stat, lander_stopped

    s = make_store()
    me = struct.unpack("<QQQ", _me())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s.put(LANDERS + "dead", np.frombuffer(struct.pack("<QQQ", dead.pid, 1, me[2]), np.uint8))
    s.put(LANDERS + "reused", np.frombuffer(struct.pack("<QQQ", me[0], me[1] + 1, me[2]), np.uint8))
    s.put(LANDERS + "running", np.frombuffer(_me(), np.uint8))
    assert not lander_stopped(s)
    assert sorted(s.keys(prefix=LANDERS)) == [LANDERS + "running"]
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: _state(stopped.pid) == "T", 10, "stopped")
        rec = struct.pack("<QQQ", stopped.pid, _proc_stat(stopped.pid)[1], me[2] + 1)
        s.put(LANDERS + "elsewhere", np.frombuffer(rec, np.uint8))
        assert not lander_stopped(s)                     # another namespace's pid: not judged
        s.put(LANDERS + "here", np.frombuffer(rec[:16] + struct.pack("<Q", me[2]), np.uint8))
        assert lander_stopped(s)
    finally:
        stopped.kill()
        stopped.wait()
