"""A member's data server against connections that never prove the token.

Each connection the server accepts gets a thread that waits up to ``HANDSHAKE_S`` for the
token's proof. At most ``MAX_HANDSHAKES`` such connections are served at once, the others
wait in the listen queue, so a flood of connections that never answer cannot exhaust the
process's threads; a connection whose thread cannot start is closed, and the server goes on
accepting peers.
"""

from __future__ import annotations

import socket
import threading

import pytest
from cluster_util import wait_for

from yrcache.cluster import transport as tp


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(tp, "MAX_HANDSHAKES", 3)
    srv = tp.Server(tp.Handler(), "127.0.0.1:0", token=b"secret")
    yield srv
    srv.close()


def _silent(srv: tp.Server, timeout: float = 5) -> socket.socket:
    """A connection that waits for the challenge (up to ``timeout``) and never answers it."""
    s = socket.create_connection((srv.host, srv.port), timeout=5)
    s.settimeout(timeout)
    try:
        assert len(s.recv(64)) > 0
    except BaseException:
        s.close()
        raise
    return s


def _ping(srv: tp.Server) -> None:
    peer = tp.Peer(srv.address, token=b"secret", timeout=5)
    try:
        peer.ping()
    finally:
        peer.close()


def test_connections_past_the_handshake_limit_wait_for_a_slot(server):
    silent = [_silent(server) for _ in range(3)]
    threads = threading.active_count()
    queued = socket.create_connection((server.host, server.port), timeout=5)
    queued.settimeout(0.5)
    with pytest.raises(TimeoutError):              # not accepted: no challenge, no thread
        queued.recv(64)
    assert threading.active_count() == threads
    silent.pop().close()                           # a handshake ends: the queued one is served
    queued.settimeout(5)
    assert len(queued.recv(64)) > 0
    queued.close()
    for s in silent:
        s.close()
    _ping(server)                                  # every slot given back: peers get in
    assert server.errors == 0


def test_a_thread_that_cannot_start_costs_one_connection_not_the_server(server, monkeypatch):
    start = threading.Thread.start
    failures = [RuntimeError("can't start new thread")]

    def flaky(self):
        if self.name == "yrcache-conn" and failures:
            raise failures.pop()
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", flaky)
    lost = socket.create_connection((server.host, server.port), timeout=5)
    assert lost.recv(64) == b""                    # closed
    lost.close()
    assert server.errors == 1
    silent = [_silent(server) for _ in range(3)]   # the lost connection gave its slot back
    for s in silent:
        s.close()
    wait_for(lambda: not server._handshakes, 5, "the silent connections' handshakes to end")
    _ping(server)


def test_a_listen_address_that_cannot_be_served_says_which_and_what_to_do():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        for listen, why in ((f"127.0.0.1:{port}", "Address already in use"), ("no-such-host.invalid:1234", "")):
            with pytest.raises(OSError, match=rf"cannot listen on '{listen}' \(listen= or YRCACHE_LISTEN\): {why}.*port 0"):
                tp.Server(tp.Handler(), listen, token=b"secret")
    finally:
        taken.close()
