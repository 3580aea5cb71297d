"""``wire.recv_exact`` and the socket's receive low-water mark.

A large payload is received with SO_RCVLOWAT raised so the kernel wakes the receiver once
per ``LOWAT`` bytes. The kernel tests that mark, not what a recv asked for, so the mark
must come down before the last ``LOWAT`` bytes (a tail that arrives late would never wake
the receiver) and go back to 1 afterwards (the frame reader's small recvs would stall).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from yrcache.cluster import wire


@pytest.fixture
def pair():
    """A connected loopback TCP pair: (receiver, sender), closed afterwards."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        tx = socket.create_connection(lsock.getsockname())
        rx, _ = lsock.accept()
    rx.settimeout(5)
    yield rx, tx
    rx.close()
    tx.close()


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_a_tail_that_arrives_late_still_wakes_the_receiver(pair):
    rx, tx = pair
    head, tail = bytes(range(256)) * (2 * wire.LOWAT // 256), b"tail" * 25
    marks = []

    def send():
        tx.sendall(head)
        time.sleep(0.3)                     # the receiver has taken the head and waits for the tail
        marks.append(_lowat(rx))            # what the receiver sleeps on now
        tx.sendall(tail)

    t = threading.Thread(target=send)
    t.start()
    buf = bytearray(len(head) + len(tail))
    try:
        wire.recv_exact(rx, buf)            # socket.timeout here: the mark stayed above the tail
    finally:
        t.join()
    assert buf == head + tail
    assert marks == [1]
    assert _lowat(rx) == 1


def test_the_mark_is_raised_for_a_large_payload_only_and_always_put_back(pair, monkeypatch):
    rx, tx = pair
    seen = []
    recv_into = socket.socket.recv_into

    class Spy(socket.socket):
        def recv_into(self, *args):
            seen.append(_lowat(self))
            return recv_into(self, *args)

    spy = Spy(fileno=rx.detach())
    spy.settimeout(5)
    try:
        tx.sendall(b"x" * 100)
        wire.recv_exact(spy, bytearray(100))
        assert seen == [1]                  # a small payload leaves the mark alone
        seen.clear()
        tx.sendall(b"y" * (4 * wire.LOWAT))
        wire.recv_exact(spy, bytearray(4 * wire.LOWAT))
        assert seen[0] == wire.LOWAT and _lowat(spy) == 1
        tx.sendall(b"z" * wire.LOWAT)
        tx.close()                          # the peer goes away mid-payload
        with pytest.raises(ConnectionError, match=f"after {wire.LOWAT} of"):
            wire.recv_exact(spy, bytearray(3 * wire.LOWAT))
        assert _lowat(spy) == 1
    finally:
        spy.close()
