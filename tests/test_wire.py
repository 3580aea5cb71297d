"""``wire.recv_exact`` and the socket's receive low-water mark.

A large payload is received with SO_RCVLOWAT raised so the kernel wakes the receiver once
per ``LOWAT`` bytes. The kernel wakes a reader only when ``LOWAT`` unread bytes have come,
whatever the recv still wants, so the mark must come down before the last bytes (or they
would never wake the reader) and go back to 1 afterwards (the frame reader's small recvs
would stall). Three kinds of socket run here: a member's handler's, blocking (the thread
sleeps inside recv, after taking what had come); a pooled client connection's, blocking with
the timeout in the kernel (``SO_RCVTIMEO``, as ``peer.Conn`` sets it: 8 s here); and one with
a Python timeout (Python polls, then reads without blocking). A reader that would sleep for
ever is rescued after 5 s by shutting the socket down, and a test fails when that rescue was
needed.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from yrcache.cluster import wire


class Spy(socket.socket):
    """A socket that notes the mark at each ``recv_into`` and may act before it."""

    def __init__(self, sock: socket.socket, before=None) -> None:
        timeout = sock.gettimeout()
        super().__init__(fileno=sock.detach())
        self.settimeout(timeout)
        self.marks: list[int] = []
        self.wanted: list[int] = []         # what each recv_into asked for
        self.before = before
        self.rescued = threading.Event()

    def rescue(self) -> None:
        self.rescued.set()
        self.shutdown(socket.SHUT_RDWR)

    def recv_into(self, buf, nbytes=0, *args):
        self.marks.append(_lowat(self))
        self.wanted.append(nbytes)
        if self.before:
            self.before(len(self.marks))
        return super().recv_into(buf, nbytes, *args)

    def check_marks(self) -> None:
        """The mark was up exactly while a recv started with 2 x LOWAT bytes still to come."""
        assert self.marks[0] == wire.LOWAT
        assert self.marks[1:] == [wire.LOWAT if want >= 2 * wire.LOWAT else 1 for want in self.wanted[1:]]


@pytest.fixture(params=["blocking", "kernel timeout", "python timeout"])
def pair(request):
    """A connected loopback TCP pair: (receiver, sender), the receiver a ``Spy``.

    The receiver's buffer is 4 MiB, fixed, so a sender can queue a megabyte before it reads.
    """
    with socket.socket() as lsock:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        tx = socket.create_connection(lsock.getsockname())
        rx, _ = lsock.accept()
    rx.settimeout(5 if request.param == "python timeout" else None)
    if request.param == "kernel timeout":
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 8, 0))
    spy = Spy(rx)
    watchdog = threading.Timer(5, spy.rescue)
    watchdog.start()
    yield spy, tx
    watchdog.cancel()
    assert not spy.rescued.is_set(), "a recv slept until the watchdog shut the socket down"
    spy.close()
    tx.close()


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def _payload(n: int) -> bytes:
    return bytes(range(256)) * (n // 256)


def test_a_tail_that_arrives_late_still_wakes_the_receiver(pair):
    rx, tx = pair
    head, tail = _payload(2 * wire.LOWAT), b"tail" * 25
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
        wire.recv_exact(rx, buf)            # timeout or "peer closed": the mark stayed above the tail
    finally:
        t.join()
    assert buf == head + tail
    assert marks == [1]
    assert _lowat(rx) == 1


def test_a_recv_that_took_part_of_the_rest_and_sleeps_for_the_others_is_woken(pair):
    # 1.25 MiB: the first recv takes 700 KiB; the second finds 100 KiB, and a blocking one
    # takes them and sleeps for the last 480 KiB, fewer than the mark: with the mark still up
    # nothing would wake it (a polling one would take all 580 KiB once 512 KiB were there).
    rx, tx = pair
    payload = _payload(2 * wire.LOWAT + (256 << 10))
    first, second = 700 << 10, 100 << 10
    timers = []

    def before(call: int) -> None:
        if call == 2:
            tx.sendall(payload[first:first + second])
            time.sleep(0.1)
            timers.append(threading.Timer(0.3, tx.sendall, (payload[first + second:],)))
            timers[-1].start()

    tx.sendall(payload[:first])
    time.sleep(0.1)
    rx.before = before
    buf = bytearray(len(payload))
    try:
        wire.recv_exact(rx, buf)
    finally:
        for t in timers:
            t.join()
    assert buf == payload
    rx.check_marks()


def test_the_mark_is_raised_for_a_large_payload_only_and_always_put_back(pair):
    rx, tx = pair
    tx.sendall(b"x" * 100)
    wire.recv_exact(rx, bytearray(100))
    assert rx.marks == [1]                  # a small payload leaves the mark alone
    rx.marks.clear()
    rx.wanted.clear()
    tx.sendall(b"y" * (4 * wire.LOWAT))
    wire.recv_exact(rx, bytearray(4 * wire.LOWAT))
    rx.check_marks()
    assert _lowat(rx) == 1
    tx.sendall(b"z" * wire.LOWAT)
    tx.close()                              # the peer goes away mid-payload
    with pytest.raises(ConnectionError, match=f"after {wire.LOWAT} of"):
        wire.recv_exact(rx, bytearray(3 * wire.LOWAT))
    assert _lowat(rx) == 1
