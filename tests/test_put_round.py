"""A small put to owners that are all remote: one C call sends the frame on every
connection and reads every reply's header (``_fast.round_trip``), and the router
(``Router._put_round``) turns what each connection gave into the store's answers.

First ``round_trip`` on socket pairs (every kind of reply and failure), then a
client's router against stand-in members: real ``Server``s on loopback whose
handler stores, refuses, fills up, stalls or hangs up.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from yrcache import WriteMode
from yrcache._fast import await_replies, round_stats, round_trip
from yrcache.cluster import transport as tp
from yrcache.cluster.membership import MemberInfo
from yrcache.cluster.replication import Router
from yrcache.errors import ClusterUnavailableError

FRAME = b"a request frame"


def reply(status: int = tp.OK, meta: bytes = b"", op: int = tp.PUT) -> bytes:
    return tp.pack(op, meta=meta, status=status)


@pytest.fixture
def pairs():
    made: list[socket.socket] = []

    def make(n: int) -> list[tuple[socket.socket, socket.socket]]:
        out = [socket.socketpair() for _ in range(n)]
        for a, b in out:
            made.extend((a, b))
        return out
    yield make
    for s in made:
        s.close()


def test_round_trip_sends_everywhere_then_reads_each_header(pairs):
    ps = pairs(3)
    answers = [reply(), reply(tp.STALE), reply(tp.ERROR, b"ValueError: no")]

    def members():
        for _, theirs in ps:
            assert theirs.recv(64) == FRAME
        for (_, theirs), ans in zip(ps, answers):     # every frame was out before any reply
            theirs.sendall(ans)
    t = threading.Thread(target=members)
    t.start()
    got = round_trip(tuple(mine.fileno() for mine, _ in ps), FRAME, tp.PUT, 0)
    t.join()
    # plain replies are their status; one with a message after it is its header, the
    # message left unread on the socket for the caller
    assert got[:2] == [tp.OK, tp.STALE]
    assert got[2] == answers[2][:tp.HDR.size] and ps[2][0].recv(64) == b"ValueError: no"


def test_round_trip_leaves_replies_to_other_ops_and_garbage_to_the_caller(pairs):
    ps = pairs(2)
    ps[0][1].sendall(reply(op=tp.GET))
    ps[1][1].sendall(b"G" * tp.HDR.size)
    got = round_trip(tuple(mine.fileno() for mine, _ in ps), FRAME, tp.PUT, 0)
    assert got == [reply(op=tp.GET), b"G" * tp.HDR.size]


def test_round_trip_says_which_sockets_failed_and_whether_the_frame_went_out(pairs):
    ps = pairs(3)
    ps[0][0].shutdown(socket.SHUT_WR)       # a stale connection: the frame cannot go out
    ps[1][1].close()                        # the member is gone: nothing goes out either
    ps[2][1].sendall(reply()[:10])          # a header cut short, then the member hangs up
    ps[2][1].shutdown(socket.SHUT_WR)
    got = round_trip(tuple(mine.fileno() for mine, _ in ps), FRAME, tp.PUT, 0)
    assert got[0] == (False, errno.EPIPE)
    assert got[1][0] is False and got[1][1] in (errno.EPIPE, errno.ECONNRESET)
    assert got[2] == (True, 0)


class Stop(Exception):
    pass


@contextlib.contextmanager
def alarm_raises_stop(after: float = 0.2):
    """SIGALRM after ``after`` seconds, its handler raising ``Stop``."""
    def raise_stop(signum, frame):
        raise Stop
    old = signal.signal(signal.SIGALRM, raise_stop)
    signal.setitimer(signal.ITIMER_REAL, after)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_round_trip_stops_for_a_signal_whose_handler_raises(pairs):
    ps = pairs(1)
    t0 = time.monotonic()
    with alarm_raises_stop(), pytest.raises(Stop):
        round_trip((ps[0][0].fileno(),), FRAME, tp.PUT, 0)      # the member never answers
    assert time.monotonic() - t0 < 5


def answer(theirs: socket.socket, rounds: int, delay: float = 0.0) -> threading.Thread:
    """A member on the far end of a socket pair: ``rounds`` times, read a frame and answer it."""
    def run():
        for _ in range(rounds):
            assert theirs.recv(64) == FRAME
            if delay:
                time.sleep(delay)
            theirs.sendall(reply())
    t = threading.Thread(target=run)
    t.start()
    return t


def test_round_trip_polls_for_quick_replies_and_sleeps_for_slow_ones(pairs):
    (mine, theirs), = pairs(1)
    fds = (mine.fileno(),)
    _, polled, slept = round_stats(tp.PUT)
    t = answer(theirs, 200)                 # answered at once: polled for, up to 10 ms
    assert [round_trip(fds, FRAME, tp.PUT, 10_000_000) for _ in range(200)] == [[tp.OK]] * 200
    t.join()
    latency, polled2, slept2 = round_stats(tp.PUT)
    assert polled2 - polled >= 100, (polled2 - polled, slept2 - slept, latency)
    t = answer(theirs, 1, delay=0.1)        # one late reply: polled for twice the usual time, then slept for
    cpu = time.thread_time()
    assert round_trip(fds, FRAME, tp.PUT, 10_000_000) == [tp.OK]
    cpu = time.thread_time() - cpu
    t.join()
    assert cpu < 0.05, f"{cpu:.3f} s of CPU for one reply 0.1 s late: it polled on"
    assert round_stats(tp.PUT)[2] == slept2 + 1
    latency, polled2, slept2 = round_stats(tp.PUT)
    t = answer(theirs, 30, delay=0.02)      # 20 ms a reply: past a 1 ms limit, so no polling
    cpu = time.thread_time()
    assert [round_trip(fds, FRAME, tp.PUT, 1_000_000) for _ in range(30)] == [[tp.OK]] * 30
    cpu = time.thread_time() - cpu
    t.join()
    assert cpu < 0.2, f"{cpu:.3f} s of CPU for 30 rounds of 20 ms: it polled past its limit"
    latency, polled3, slept3 = round_stats(tp.PUT)
    assert slept3 - slept2 >= 28 and polled3 - polled2 <= 2 and latency > 1_000_000
    t = answer(theirs, 10)                  # poll_ns 0: never polls, learns nothing
    assert [round_trip(fds, FRAME, tp.PUT, 0) for _ in range(10)] == [[tp.OK]] * 10
    t.join()
    assert round_stats(tp.PUT) == (latency, polled3, slept3)


def test_a_receive_timeout_still_ends_a_round_after_its_polling(pairs):
    (mine, _), = pairs(1)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 100_000))
    t0 = time.monotonic()
    assert round_trip((mine.fileno(),), FRAME, tp.PUT, 1_000_000) == [(True, errno.EAGAIN)]
    assert 0.09 < time.monotonic() - t0 < 5


def test_round_trip_checks_its_arguments(pairs):
    ps = pairs(1)
    fd = ps[0][0].fileno()
    with pytest.raises(TypeError, match="round_trip"):
        round_trip([fd], FRAME, tp.PUT, 0)          # a list, not a tuple
    with pytest.raises(TypeError, match="round_trip"):
        round_trip((fd,) * 17, FRAME, tp.PUT, 0)
    with pytest.raises(TypeError, match="round_trip"):
        round_trip((fd,), FRAME, tp.PUT, -1)
    with pytest.raises(TypeError, match="round_trip"):
        round_trip((fd,), FRAME, tp.PUT)
    with pytest.raises(TypeError):
        round_trip((fd,), "a str", tp.PUT, 0)
    with pytest.raises(ValueError):
        round_trip((-1,), FRAME, tp.PUT, 0)


def test_await_replies_waits_for_every_socket_and_names_the_silent_ones(pairs):
    ps = pairs(4)
    ps[0][1].sendall(b"an answer")
    ps[1][1].close()                        # closed: ready (the caller's receive says so)
    t = threading.Timer(0.05, ps[3][1].sendall, (b"late",))     # comes while it sleeps
    t.start()
    fds = tuple(mine.fileno() for mine, _ in ps)
    puts, gets = round_stats(tp.PUT), round_stats(tp.GET)
    t0 = time.monotonic()
    assert await_replies(fds, 1_000_000, (500,) * 4, tp.GET) == (2,)   # the silent one, at its limit
    assert 0.45 < time.monotonic() - t0 < 5
    t.join()
    t0 = time.monotonic()
    assert await_replies(fds, 1_000_000, (-1, -1, 200, 5000), tp.GET) == (2,)    # each its own limit
    assert 0.15 < time.monotonic() - t0 < 2
    assert await_replies(fds[:2], 1_000_000, (500,) * 2, tp.GET) is None
    # each op learns its own latency; a round with a silent socket teaches nothing
    assert round_stats(tp.PUT) == puts and sum(round_stats(tp.GET)[1:]) == sum(gets[1:]) + 1
    assert ps[0][0].recv(64) == b"an answer" and ps[3][0].recv(64) == b"late"     # nothing consumed
    t0 = time.monotonic()
    assert await_replies(fds, 0, (500,) * 4, tp.GET) is None    # poll_ns 0: nothing waited for
    assert time.monotonic() - t0 < 0.4


def test_await_replies_stops_for_a_signal_whose_handler_raises(pairs):
    ps = pairs(1)
    with alarm_raises_stop(), pytest.raises(Stop):
        await_replies((ps[0][0].fileno(),), 1_000_000, (-1,), tp.GET)    # no limit: only the signal ends it
    with pytest.raises(ValueError, match="await_replies"):
        await_replies((ps[0][0].fileno(),), 1_000_000, (-2,), tp.GET)
    with pytest.raises(TypeError, match="await_replies"):
        await_replies((ps[0][0].fileno(),), 1_000_000, -1, tp.GET)
    with pytest.raises(TypeError, match="await_replies"):
        await_replies((ps[0][0].fileno(),) * 1025, 1_000_000, (10,) * 1025, tp.GET)
    with pytest.raises(TypeError, match="await_replies"):
        await_replies((ps[0][0].fileno(),), 1_000_000, (10,), 16)
    with pytest.raises(ValueError, match="round_stats"):
        round_stats(16)


# ---- the router against stand-in members


class Member(tp.Handler):
    """Stores puts, or answers each as ``mode`` says: "refuse" (an error), "full",
    "stall" (answers after 1 s) or "hang up" (closes the connection unanswered)."""

    def __init__(self) -> None:
        self.mode = "store"
        self.puts: list[tuple[str, bytes, tuple[int, int]]] = []

    def put(self, f, fill, skip):
        if self.mode == "refuse":
            raise ValueError("this member refuses the put")
        if self.mode == "full":
            raise MemoryError("no room for it")
        if self.mode == "stall":
            time.sleep(1.0)
        if self.mode == "hang up":
            raise ConnectionError("hung up")
        self.puts.append((f.key, bytes(fill), f.version))
        return tp.OK

    def get(self, f):
        if self.mode == "stall":
            time.sleep(3.0)
        for key, value, version in reversed(self.puts):
            if key == f.key:
                return tp.Got(b"B", value, version)
        return None


@pytest.fixture
def cluster():
    """A client's router over members "a" and "b" (replicas=2: both own every key)."""
    members = {m: Member() for m in "ab"}
    servers = {m: tp.Server(h, "127.0.0.1:0") for m, h in members.items()}
    router = Router(replicas=2, token=None)
    router.update({m: MemberInfo(m, s.address, 1, 0) for m, s in servers.items()})
    yield router, members
    router.close()
    for s in servers.values():
        s.close()


def put(router: Router, key: str, value: bytes, timeout: float | None = None) -> None:
    router.put(key, b"B", value, len(value), 0, 0.0, WriteMode.WRITE_THROUGH, timeout)


def pooled(router: Router, m: str) -> int:
    peer = router.peer(m)
    assert peer is not None
    return len(peer._idle)


def test_a_small_put_reaches_both_owners_at_one_version_and_keeps_the_connections(cluster):
    router, members = cluster
    value = np.arange(256, dtype=np.uint32).tobytes()
    for i in range(3):
        put(router, f"k{i}", value)
    for m in "ab":
        assert [(k, v) for k, v, _ in members[m].puts] == [(f"k{i}", value) for i in range(3)]
        assert pooled(router, m) == 1               # one connection each, reused
    assert [p[2] for p in members["a"].puts] == [p[2] for p in members["b"].puts]


@pytest.mark.parametrize("mode, says", [("refuse", "ValueError: this member refuses the put"),
                                        ("full", "member is full"),
                                        ("hang up", "closed the connection")])
def test_an_owner_that_does_not_store_the_put_is_named_with_why(cluster, mode, says):
    router, members = cluster
    put(router, "warm", b"x")
    members["b"].mode = mode
    with pytest.raises(ClusterUnavailableError, match="1 of 2 owners") as e:
        put(router, "k", b"value")
    msg = str(e.value)
    assert "(b (" in msg and says in msg and "the others hold it" in msg
    assert members["a"].puts[-1][:2] == ("k", b"value")
    assert pooled(router, "a") == 1 and pooled(router, "b") == 0    # b's connection is dropped
    members["b"].mode = "store"
    put(router, "k2", b"again")                     # and a new one serves the next put
    assert members["b"].puts[-1][:2] == ("k2", b"again")


def test_a_stale_pooled_connection_is_replaced_and_the_put_sent_again(cluster):
    router, members = cluster
    put(router, "warm", b"x")
    peer = router.peer("b")
    assert peer is not None
    peer._idle[0].sock.shutdown(socket.SHUT_WR)     # the frame cannot go out on it
    put(router, "k", b"value")
    assert members["b"].puts[-1][:2] == ("k", b"value") and len(members["b"].puts) == 2


def test_an_owner_that_does_not_answer_in_time_is_named(cluster):
    router, members = cluster
    members["a"].mode = "stall"
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match=r"a \(member a at .* did not answer within 0.2 s"):
        put(router, "k", b"value", timeout=0.2)
    assert time.monotonic() - t0 < 0.9
    assert members["b"].puts[-1][:2] == ("k", b"value")


def test_no_owner_takes_it(cluster):
    router, members = cluster
    for h in members.values():
        h.mode = "refuse"
    with pytest.raises(ClusterUnavailableError, match="2 of 2 owners .* nobody holds it: put it again"):
        put(router, "k", b"value")


def test_the_poll_limit_comes_from_the_environment_and_is_checked(monkeypatch):
    from yrcache.cluster.settings import env_int
    monkeypatch.setenv("YRCACHE_POLL_US", "250")
    assert env_int("YRCACHE_POLL_US", 100, minimum=0) == 250
    monkeypatch.setenv("YRCACHE_POLL_US", "")
    assert env_int("YRCACHE_POLL_US", 100, minimum=0) == 100
    for bad, says in (("-1", "below 0"), ("fast", "not an integer")):
        monkeypatch.setenv("YRCACHE_POLL_US", bad)
        with pytest.raises(ValueError, match=f"YRCACHE_POLL_US='{bad}' is {says}"):
            env_int("YRCACHE_POLL_US", 100, minimum=0)


def test_a_read_waits_for_a_silent_member_once_for_its_timeout(cluster):
    router, members = cluster
    put(router, "k", b"value")
    assert router.peer("a").get("k").buf == b"value"
    members["a"].mode = "stall"
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match="member a at .* did not answer within 0.5 s"):
        router.peer("a").get("k", timeout=0.5)
    assert 0.45 < time.monotonic() - t0 < 0.95        # once, not once more in the receive
    router.peer("a").timeout = 0.5
    t0 = time.monotonic()
    got, failed = router.mread({"a": ["k"], "b": ["k"]})
    assert failed == {"a"} and got["k"].buf == b"value"
    assert 0.45 < time.monotonic() - t0 < 0.95
