"""The cluster data plane's client side: pooled, authenticated connections to a member.

A :class:`Peer` keeps a few idle :class:`Conn` per member; each answers the
server's nonce with ``HMAC-SHA256(token, nonce)`` once, when it connects.
Batches are pipelined (every request frame out first, then every reply), and
``send_puts`` packs runs of small puts into MPUT frames. The frame format is
``wire.py``; the server is ``transport.py``.
"""

from __future__ import annotations

import socket
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._fast import await_replies, wire_entries, wire_items, wire_puts
from ..errors import AuthenticationError, ClusterUnavailableError
from .settings import env_int, read_at_import
from .wire import (_GOT_ITEM, _PUT_ITEM, ADOPT, ALL, DELETE, ERROR, FLUSH, FULL, GET, GETV, HAVE, KEYS, MAGIC, MAX_BATCH,
                   MAX_KEY, MAX_META, MAX_SPANS, MGET, MPUT, NONCE, NOT_FOUND, OK, OP_NAMES, PING, PROTO, PUT, SMALL, SMALL_REPLY,
                   STAT, Frame, Got, ProtocolError, Reader, RemoteError, Span, alloc, decode_entries,
                   encode_entries, encode_spans, pack, proof, read_frame, recv_exact, spans_nbytes, split_address)


class _Counter:
    """Payload bytes this process received from members (thread-safe)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


#: Object payload bytes this process has received over the data plane (GET, GETV, MGET).
RECEIVED = _Counter()

#: ``land(i, meta, nbytes, fill)``: where ``Peer.getv_many`` puts the bytes of read ``i``.
Land = Callable[[int, bytes, int, Callable[[Any], None]], None]
#: Requests of a pipelined batch sent before their replies are read. The member reads every
#: request before it answers it, so this much must fit in the sockets' buffers (>= 128 KiB
#: on Linux by default) or both ends would block writing.
PIPELINE_BYTES = 32 << 10
#: A small request polls for its reply up to this long before it sleeps (``_fast.round_trip``,
#: ``Conn.await_reply``; 0: never): a reply that finds the client awake spares the member a
#: wake-up, which on a virtual machine costs it more than a small put's work.
POLL_NS = read_at_import(env_int, "YRCACHE_POLL_US", 100, 0) * 1000
AWAIT_MAX = 1024         # sockets one await_replies waits for


def timed_out(e: BaseException) -> bool:
    """Did a send or receive on a :class:`Conn` run out of time? (its kernel timeout makes
    a blocking socket fail with ``EAGAIN``: ``BlockingIOError``)."""
    return isinstance(e, (TimeoutError, BlockingIOError))


class Conn:
    """One authenticated connection: its socket and its read buffer.

    The socket blocks, with the timeout in the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``):
    Python's own socket timeout polls before every send and receive, a system call that
    costs as much as the send itself (8 instead of 4 per write-through put to 2 owners)."""

    __slots__ = ("sock", "rd", "timeout")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.rd = Reader(sock)
        timeout = sock.gettimeout()
        sock.settimeout(None)
        self.timeout: float | None = None
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float | None) -> None:
        if timeout != self.timeout:
            us = 0 if timeout is None else max(1, round(timeout * 1e6))    # 0: none
            tv = struct.pack("@ll", us // 1_000_000, us % 1_000_000)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.timeout = timeout

    @property
    def timeout_ms(self) -> int:
        """The timeout in milliseconds (-1: none)."""
        return -1 if self.timeout is None else max(1, round(self.timeout * 1000))

    def await_reply(self, op: int) -> None:
        """Wait for the reply to the ``op`` request just sent (polling first, ``POLL_NS``);
        a ``TimeoutError`` if none comes within this connection's timeout."""
        if POLL_NS and not self.rd.buffered and await_replies((self.sock.fileno(),), POLL_NS,
                                                               (self.timeout_ms,), op) is not None:
            raise TimeoutError("no reply within the connection's timeout")

    def reply(self, op: int) -> Frame:
        f = read_frame(self.rd)
        if f.op != op:
            raise ProtocolError(f"asked {OP_NAMES[op]}, got a reply to {OP_NAMES.get(f.op, f.op)}")
        if f.status in (ERROR, FULL):
            msg = f.meta.decode(errors="replace")
            if f.status == FULL:
                raise RemoteError(f"member is full: {msg}", FULL)
            raise RemoteError(msg, ERROR)
        return f

    def body(self, n: int) -> bytes:
        buf = bytearray(n)
        self.rd.readinto(buf)
        return bytes(buf)

    def send_put(self, key: str, meta: bytes, payload: Any, nbytes: int, version: tuple[int, int],
                 priority: int, expire_at: float, flags: int) -> None:
        head = pack(PUT, key.encode(), meta, nbytes, flags=flags, version=version, priority=priority,
                    expire_at=expire_at)
        if not nbytes:
            self.sock.sendall(head)
        elif nbytes <= SMALL:
            self.sock.sendall(head + memoryview(payload).cast("B"))
        else:
            self.sock.sendall(head)
            self.sock.sendall(memoryview(payload).cast("B"))

    def recv_get(self, into: Callable[[bytes, int], Any] | None = None) -> Got | None:
        f = self.reply(GET)
        if f.status == NOT_FOUND:
            return None
        buf = into(f.meta, f.plen) if into is not None else alloc(f.plen)
        if f.plen:
            self.rd.readinto(memoryview(buf).cast("B")[:f.plen])
            RECEIVED.add(f.plen)
        return Got(f.meta, buf, f.version, f.flags - 1)


    def recv_mget(self, n: int) -> list[Got | None]:
        f = self.reply(MGET)
        if f.length != n:
            raise ProtocolError(f"asked for {n} keys, got {f.length}")
        RECEIVED.add(f.plen)
        out: list[Got | None] = []
        if f.plen <= SMALL_REPLY:             # one read, values are slices of it (parsed in C)
            body = bytearray(f.plen)
            self.rd.readinto(body)
            items = wire_items(body, n, MAX_META, Got)
            if items is None:
                raise ProtocolError("a bad item in an mget reply")
            return items
        for _ in range(n):
            found, mlen, nbytes, hlc, writer = _GOT_ITEM.unpack(self.rd.take(_GOT_ITEM.size))
            if not found:
                out.append(None)
                continue
            if mlen > MAX_META or nbytes > f.plen:
                raise ProtocolError("a bad item in an mget reply")
            meta = bytes(self.rd.take(mlen))
            buf = alloc(nbytes)
            if nbytes:
                self.rd.readinto(memoryview(buf).cast("B")[:nbytes])
            out.append(Got(meta, buf, (hlc, writer)))
        return out

    def send_mget(self, keys: Sequence[str]) -> None:
        body = wire_entries(keys if type(keys) is list else list(keys), MAX_KEY)
        if body is None:                      # a key the store does not take: the encoder says which
            body = encode_entries((k, (0, 0)) for k in keys)
        self.sock.sendall(pack(MGET, plen=len(body)) + body)




class Peer:
    """Pooled, authenticated connections to one member's data port."""

    def __init__(self, address: str, token: bytes | None = None, name: str = "", timeout: float = 30.0,
                 pool: int = 8):
        self.address = address
        self.name = name or address
        self._hostport = split_address(address)
        self._token = token or b""
        self.timeout = timeout
        self._idle: list[Conn] = []
        self._busy: weakref.WeakSet[socket.socket] = weakref.WeakSet()    # connecting or lent out
        self._max_idle = pool
        self._lock = threading.Lock()
        self._closed = ""               # why requests are refused, once closed

    def close(self, why: str = "left the cluster") -> None:
        """Close the idle connections and cut those in use: a request waiting on a member
        that left the cluster (a hung process whose lease expired, a partition) fails now
        with ``ClusterUnavailableError``, not at its timeout, and the caller moves on."""
        with self._lock:
            self._closed = why
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for c in idle:
            c.sock.close()
        for sock in busy:
            try:
                sock.shutdown(socket.SHUT_RDWR)     # its user closes it
            except OSError:
                pass

    def _connect(self, timeout: float) -> Conn:
        try:
            s = socket.create_connection(self._hostport, timeout=timeout)   # the handshake too
        except OSError as e:
            raise ClusterUnavailableError(f"member {self.name} at {self.address} does not answer: {e}") from e
        with self._lock:
            self._busy.add(s)           # close() cuts a handshake with a member that left, too
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = bytearray(3 + NONCE)
            recv_exact(s, hello)
            if bytes(hello[:2]) != MAGIC or hello[2] != PROTO:
                raise ProtocolError(f"{self.address} is not a yrcache member (protocol {hello[2]})")
            s.sendall(proof(self._token, bytes(hello[3:])))
            verdict = bytearray(1)
            recv_exact(s, verdict)
        except (OSError, ConnectionError) as e:
            s.close()
            raise ClusterUnavailableError(f"member {self.name} at {self.address}: handshake failed: {e}") from e
        if verdict[0] != 0:
            s.close()
            raise AuthenticationError(
                f"member {self.name} at {self.address} refused our token: set YRCACHE_TOKEN to the "
                "cluster's shared secret (the same on every member and client)")
        return Conn(s)

    def borrow(self, timeout: float | None = None) -> Conn:
        """A pooled (or new) connection; give it back with :meth:`give_back`, or close it.
        ``ClusterUnavailableError`` once the member has left (:meth:`close`)."""
        with self._lock:
            self._check_open()
            c = self._idle.pop() if self._idle else None
        if c is None:
            c = self._connect(timeout if timeout is not None else self.timeout)
        c.set_timeout(timeout if timeout is not None else self.timeout)
        with self._lock:
            if self._closed:            # it left while we connected
                c.sock.close()
                self._check_open()
            self._busy.add(c.sock)
        return c

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterUnavailableError(f"member {self.name} at {self.address}: {self._closed}")

    def give_back(self, c: Conn) -> None:
        with self._lock:
            self._busy.discard(c.sock)
            keep = len(self._idle) < self._max_idle and not self._closed and not c.rd.buffered
            if keep:
                self._idle.append(c)
        if not keep:
            c.sock.close()

    def error(self, e: BaseException, timeout: float | None = None) -> ClusterUnavailableError:
        """The error a caller sees when this member failed mid-request."""
        if isinstance(e, ClusterUnavailableError):
            return e
        if timed_out(e):
            return ClusterUnavailableError(
                f"member {self.name} at {self.address} did not answer within "
                f"{timeout if timeout is not None else self.timeout:g} s")
        return ClusterUnavailableError(f"member {self.name} at {self.address}: {e}")

    def _call(self, fn: Callable[[Conn], Any], timeout: float | None = None) -> Any:
        for attempt in (0, 1):
            c = None
            try:
                c = self.borrow(timeout)
                out = fn(c)
                self.give_back(c)
                return out
            except (AuthenticationError, RemoteError):
                if c is not None:
                    c.sock.close()
                raise
            except (ConnectionError, OSError) as e:
                if c is not None:
                    c.sock.close()
                # a pooled connection may have been closed by a restarted peer: retry once on a
                # fresh one (a put is idempotent: the same version is SAME the second time)
                if attempt or isinstance(e, ClusterUnavailableError) or timed_out(e):
                    raise self.error(e, timeout) from e
            except BaseException:
                if c is not None:
                    c.sock.close()
                raise
        raise AssertionError("unreachable")

    # -- single requests
    def put(self, key: str, meta: bytes, payload: Any, nbytes: int, version: tuple[int, int], *,
            priority: int = 0, expire_at: float = 0.0, flags: int = 0, timeout: float | None = None) -> int:
        """Send one object; return ``OK``, ``SAME`` (it had this version) or ``STALE`` (a newer one)."""
        def go(c: Conn) -> int:
            c.send_put(key, meta, payload, nbytes, version, priority, expire_at, flags)
            c.await_reply(PUT)
            return c.reply(PUT).status
        return self._call(go, timeout)

    def adopt(self, key: str, seq: int, version: tuple[int, int], flags: int = 0,
              timeout: float | None = None) -> int:
        """Ask the member to take ``key``, stored in its arena by this process as the object
        ``seq``, at ``version``: ``OK``, ``SAME``, ``STALE`` or ``NOT_FOUND`` (no such object)."""
        def go(c: Conn) -> int:
            c.sock.sendall(pack(ADOPT, key.encode(), flags=flags, version=version, offset=seq))
            return c.reply(ADOPT).status
        return self._call(go, timeout)

    def get(self, key: str, offset: int = 0, length: int = ALL, *, into: Callable[[bytes, int], Any] | None = None,
            timeout: float | None = None) -> Got | None:
        """The object (or range) or None; ``into(meta, n)`` may supply the buffer to receive into."""
        def go(c: Conn) -> Got | None:
            c.sock.sendall(pack(GET, key.encode(), offset=offset, length=length))
            c.await_reply(GET)
            return c.recv_get(into)
        return self._call(go, timeout)

    def getv(self, key: str, spans: Sequence[Span], *, into: Callable[[bytes, int], Any] | None = None,
             timeout: float | None = None) -> Got | None:
        """The bytes of ``spans`` of ``key``'s payload, packed in order (``wire.gather``),
        or None; ``into(meta, n)`` may supply the buffer to receive into."""
        if len(spans) > MAX_SPANS:
            raise ValueError(f"a ranged read of {len(spans)} spans (at most {MAX_SPANS})")
        want = spans_nbytes(spans)
        body = encode_spans(spans)

        def go(c: Conn) -> Got | None:
            c.sock.sendall(pack(GETV, key.encode(), plen=len(body)) + body)
            f = c.reply(GETV)
            if f.status == NOT_FOUND:
                return None
            if f.plen != want:
                raise ProtocolError(f"asked for {want} bytes of {key!r}, got {f.plen}")
            buf = into(f.meta, f.plen) if into is not None else alloc(f.plen)
            if f.plen:
                c.rd.readinto(memoryview(buf).cast("B")[:f.plen])
            RECEIVED.add(f.plen)
            return Got(f.meta, buf, f.version)
        return self._call(go, timeout)

    def getv_many(self, reads: Sequence[tuple[str, Sequence[Span]]], land: Land,
                  timeout: float | None = None) -> tuple[list[bool | None], ClusterUnavailableError | None]:
        """Ranged reads of several keys on one connection, pipelined: up to ``PIPELINE_BYTES``
        of requests go out in one send, then their replies are read in order. For each
        reply that holds bytes, ``land(i, meta, nbytes, fill)`` is called (``i``: the read's
        index) and must call ``fill(buf)`` once with a writable buffer of ``nbytes``, which
        receives the packed spans straight from the socket.

        Returns, per read, True (landed), False (the member does not hold the key) or None
        (not done: the member failed or stopped answering), and the error that stopped it.
        Spans the member refuses raise ``ValueError``; what ``land`` raises propagates
        (the connection is dropped either way)."""
        out: list[bool | None] = [None] * len(reads)
        error = None
        frames = []
        for key, spans in reads:
            if len(spans) > MAX_SPANS:
                raise ValueError(f"a ranged read of {len(spans)} spans (at most {MAX_SPANS})")
            body = encode_spans(spans)
            frames.append(pack(GETV, key.encode(), plen=len(body)) + body)
        done = 0
        for attempt in (0, 1):
            c = None
            try:
                c = self.borrow(timeout)
                while done < len(reads):
                    j, size = done + 1, len(frames[done])
                    while j < len(reads) and size + len(frames[j]) <= PIPELINE_BYTES:
                        size += len(frames[j])
                        j += 1
                    c.sock.sendall(b"".join(frames[done:j]))
                    for k in range(done, j):
                        out[k] = self._land_one(c, k, reads[k], land)
                        done = k + 1
                self.give_back(c)
                c = None
                break
            except RemoteError as e:          # it refused a read's spans (outside the object)
                raise ValueError(f"read of {reads[done][0]!r} from member {self.name}: {e}") from None
            except (ConnectionError, OSError) as e:
                # a pooled connection a restarted member closed: once more on a fresh one
                if attempt or done or isinstance(e, ClusterUnavailableError) or timed_out(e):
                    error = self.error(e, timeout)
                    break
            finally:
                if c is not None:
                    c.sock.close()
        return out, error

    @staticmethod
    def _land_one(c: Conn, i: int, read: tuple[str, Sequence[Span]], land: Land) -> bool:
        f = c.reply(GETV)
        if f.status == NOT_FOUND:
            return False
        want = spans_nbytes(read[1])
        if f.plen != want:
            raise ProtocolError(f"asked for {want} bytes of {read[0]!r}, got {f.plen}")
        state = [0]                 # fill: 0 not called, 1 done, 2 failed part-way

        def fill(buf: Any) -> None:
            dst = memoryview(buf).cast("B")
            if state[0] or dst.readonly or dst.nbytes != want:
                raise ValueError(f"fill takes one writable buffer of {want} bytes, once")
            state[0] = 2
            if want:
                c.rd.readinto(dst)
            RECEIVED.add(want)
            state[0] = 1
        land(i, f.meta, want, fill)
        if state[0] == 2:           # land swallowed the error: the read is not done, the connection broken
            raise ConnectionError(f"the connection broke while receiving {read[0]!r}")
        if not state[0]:
            raise RuntimeError("land() returned without calling fill(buf)")
        return True

    def delete(self, key: str, version: tuple[int, int], timeout: float | None = None) -> bool:
        def go(c: Conn) -> bool:
            c.sock.sendall(pack(DELETE, key.encode(), version=version))
            return c.reply(DELETE).status == OK
        return self._call(go, timeout)

    def delete_many(self, keys: Sequence[str], version: tuple[int, int],
                    timeout: float | None = None) -> list[bool]:
        """Delete several keys, pipelined (every frame out, then every reply)."""
        def go(c: Conn) -> list[bool]:
            c.sock.sendall(b"".join(pack(DELETE, k.encode(), version=version) for k in keys))
            return [c.reply(DELETE).status == OK for _ in keys]
        return self._call(go, timeout)

    def keys(self, prefix: str = "") -> list[tuple[str, tuple[int, int]]]:
        def go(c: Conn) -> list[tuple[str, tuple[int, int]]]:
            c.sock.sendall(pack(KEYS, prefix.encode()))
            return decode_entries(c.body(c.reply(KEYS).plen))
        return self._call(go)

    def have(self, entries: Sequence[tuple[str, tuple[int, int]]]) -> bytes:
        body = encode_entries(entries)

        def go(c: Conn) -> bytes:
            c.sock.sendall(pack(HAVE, plen=len(body)) + body)
            return c.body(c.reply(HAVE).plen)
        return self._call(go)

    def stat(self) -> bytes:
        def go(c: Conn) -> bytes:
            c.sock.sendall(pack(STAT))
            return c.body(c.reply(STAT).plen)
        return self._call(go)

    def flush(self, timeout: float = 60.0) -> str | None:
        """None once the member forwarded everything it queued, within ``timeout`` (> 0)
        seconds; else why not (its failing targets' last errors; may be empty)."""
        def go(c: Conn) -> str | None:
            c.sock.sendall(pack(FLUSH, expire_at=max(timeout, 0.001)))   # (0 would mean its 60 s)
            try:
                c.reply(FLUSH)
                return None
            except RemoteError as e:    # its answer when the time ran out
                if e.status == ERROR:
                    return str(e)
                raise
        return self._call(go, timeout + 5)

    def ping(self, timeout: float | None = None) -> None:
        def go(c: Conn) -> None:
            c.sock.sendall(pack(PING))
            c.reply(PING)
        self._call(go, timeout)

    # -- pipelined batches
    def mput(self, items: Sequence[tuple[str, bytes, Any, int, tuple[int, int], int, float]], *,
             flags: int = 0, timeout: float | None = None) -> list[int]:
        """Put ``(key, meta, payload, nbytes, version, priority, expire_at)`` items in one pipeline."""
        def go(c: Conn) -> list[int]:
            return recv_puts(c, send_puts(c, items, flags))
        return self._call(go, timeout)

    def mget(self, keys: Sequence[str], timeout: float | None = None) -> list[Got | None]:
        def go(c: Conn) -> list[Got | None]:
            out: list[Got | None] = []
            for i in range(0, len(keys), MAX_BATCH):
                c.send_mget(keys[i:i + MAX_BATCH])
                c.await_reply(MGET)
                out += c.recv_mget(len(keys[i:i + MAX_BATCH]))
            return out
        return self._call(go, timeout)


def put_frame(item: tuple[str, bytes, Any, int, tuple[int, int], int, float], flags: int = 0) -> bytes:
    """One small put as a PUT frame with its payload inline: what :func:`send_puts`
    sends for a batch of one, built once when several owners get the same put."""
    key, meta, payload, nbytes, version, priority, expire_at = item
    head = pack(PUT, key.encode(), meta, nbytes, flags=flags, version=version, priority=priority,
                expire_at=expire_at)
    return head + memoryview(payload).cast("B") if nbytes else head


MPUT_BYTES = 1 << 20     # an MPUT frame's body is closed once it passes this


def put_item(item: tuple[str, bytes, Any, int, tuple[int, int], int, float]) -> bytes:
    """One small put as an item of an MPUT frame's body (header, key, meta, payload)."""
    key, meta, payload, nbytes, version, priority, expire_at = item
    kb = key.encode()
    head = _PUT_ITEM.pack(len(kb), len(meta), nbytes, version[0], version[1], priority, expire_at)
    return b"".join((head, kb, meta, memoryview(payload).cast("B"))) if nbytes else head + kb + meta


def send_puts(c: Conn, items: Sequence[tuple[str, bytes, Any, int, tuple[int, int], int, float]],
              flags: int = 0, frame: bytes | None = None, packed: dict[int, bytes] | None = None) -> list[int]:
    """Write puts as few frames: one small put as a PUT (``frame``, when the caller
    built it), runs of small items as MPUT frames, each large one as its own PUT
    (sent from its buffer). ``packed`` keeps each small item's bytes by ``id(item)``,
    so an item sent to several owners is packed once. Returns the items per frame
    (0: a PUT)."""
    if len(items) == 1 and items[0][3] <= SMALL:
        c.sock.sendall(frame if frame is not None else put_frame(items[0], flags))
        return [0]
    if len(items) <= MAX_BATCH and type(items) is list:     # all small: one frame, its body built in C
        body = wire_puts(items, MAX_KEY, MAX_META, SMALL)
        if body is not None and len(body) <= MPUT_BYTES:
            c.sock.sendall(pack(MPUT, plen=len(body), flags=flags, length=len(items)) + body)
            return [len(items)]
    frames: list[int] = []
    out = bytearray()
    run = bytearray()
    n = 0

    def close_run() -> None:
        nonlocal run, n
        if n:
            out.extend(pack(MPUT, plen=len(run), flags=flags, length=n))
            out.extend(run)
            frames.append(n)
            run, n = bytearray(), 0
    for item in items:
        key, meta, payload, nbytes, version, priority, expire_at = item
        if nbytes > SMALL:
            close_run()
            out.extend(pack(PUT, key.encode(), meta, nbytes, flags=flags, version=version, priority=priority,
                            expire_at=expire_at))
            c.sock.sendall(out)
            c.sock.sendall(memoryview(payload).cast("B"))
            out = bytearray()
            frames.append(0)
            continue
        rec = packed.get(id(item)) if packed is not None else None
        if rec is None:
            rec = put_item(item)
            if packed is not None:
                packed[id(item)] = rec
        run += rec
        n += 1
        if n >= MAX_BATCH or len(run) > MPUT_BYTES:
            close_run()
            c.sock.sendall(out)
            out = bytearray()
    close_run()
    if out:
        c.sock.sendall(out)
    return frames


def recv_puts(c: Conn, frames: list[int]) -> list[int]:
    """The statuses of the puts :func:`send_puts` sent, in order."""
    statuses = bytearray()
    for n in frames:
        if n == 0:
            statuses.append(c.reply(PUT).status)
        else:
            f = c.reply(MPUT)
            if f.plen != n:
                raise ProtocolError(f"an mput of {n} items answered with {f.plen} statuses")
            statuses += c.body(n)
    full, bad = statuses.count(FULL), statuses.count(ERROR)
    if full or bad:
        raise RemoteError(f"the member refused {full + bad} of {len(statuses)} puts"
                          + (" (it is full)" if full else ""), FULL if full else ERROR)
    return list(statuses)
