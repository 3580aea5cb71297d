"""The cluster data plane: a framed binary protocol over TCP.

Every message is one fixed 72-byte header (:data:`HDR`), then the key, the codec
header (``meta``) and the payload, whose lengths the header gives. Nothing on the
wire is ever unpickled: a header is ``struct``-unpacked and checked against
limits (:data:`MAX_KEY`, :data:`MAX_META`, :data:`MAX_PAYLOAD`) before a byte of
its body is read, and garbage, an oversized or a truncated frame closes that one
connection; the server goes on serving the others.

A connection starts with a challenge: the server sends a random nonce and the
client answers with ``HMAC-SHA256(token, nonce)`` (``YRCACHE_TOKEN``; an empty
token when none is set, which is why a server without a token binds loopback
only). A wrong answer gets one refusal byte and a closed socket, which the
client raises as :class:`~yrcache.errors.AuthenticationError`.

Payloads travel without extra copies: the server hands a ``fill(dst)`` callback
to its handler, which receives with ``recv_into`` straight into the reserved
arena block; replies are sent from the pinned arena view. Batches (``mset``,
``mget``, hand-over) are pipelined: every request frame goes out first, then
every reply is read, so a batch of 100 costs about one round trip.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import AuthenticationError, ClusterUnavailableError
from .wire import (  # noqa: F401  (the wire's names are part of this module's interface)
    _GOT_ITEM, _PUT_ITEM, ALL, DELETE, ERROR, F_REPLICATE, F_SINGLE, FLUSH, FULL, GET, HAVE, HDR, KEYS,
    MAGIC, MAX_BATCH, MAX_KEY, MAX_LIST, MAX_META, MGET, MPUT, NONCE, NOT_FOUND, OK, OP_NAMES, PING,
    PROTO, PUT, SAME, SMALL, SMALL_REPLY, STALE, STAT, TIER_SHIFT, Frame, Got, ProtocolError, Reader,
    RemoteError, alloc, decode_entries, encode_entries, is_loopback, pack, proof, read_frame, recv_exact,
    send_parts, split_address)

log = logging.getLogger(__name__)


# ---- server ------------------------------------------------------------------------
class Handler:
    """What a :class:`Server` calls; a member's node implements it (see replication.py).

    Methods run on the connection's thread and may block; an exception other than
    a ``ConnectionError`` is answered with ``ERROR`` and its message.
    """

    def put(self, f: Frame, fill: Any, skip: Callable[[], None]) -> int:
        """Store ``f``'s payload and return a status. ``fill`` is the payload itself (a
        buffer, small ones) or a callable to call once with the destination (or call
        ``skip()`` instead, to drop the payload)."""
        raise NotImplementedError

    def get(self, f: Frame) -> Got | None:
        """``f.key``'s ``[offset, offset+length)`` (its meta, version and, for length 0, tier), or None."""
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[Got | None]:
        """Whole objects of several keys (an MGET); None where missing."""
        out: list[Got | None] = []
        for k in keys:
            try:
                out.append(self.get(Frame(GET, 0, 0, k, b"", 0, (0, 0), 0, 0.0, 0, ALL)))
            except Exception:       # noqa: BLE001 - this key reads as missing; the batch goes on
                out.append(None)
        return out

    def delete(self, f: Frame) -> int:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[tuple[str, tuple[int, int]]]:
        raise NotImplementedError

    def have(self, entries: list[tuple[str, tuple[int, int]]]) -> bytes:
        """One byte per entry: 1 if this member holds that version or a newer one."""
        raise NotImplementedError

    def stat(self) -> bytes:
        raise NotImplementedError

    def flush(self, timeout: float) -> bool:
        raise NotImplementedError


def _nothing() -> None:
    pass


class Server:
    """A thread-per-connection TCP server for one member's :class:`Handler`."""

    def __init__(self, handler: Handler, listen: str = "127.0.0.1:0", token: bytes | None = None):
        host, port = split_address(listen)
        if not token and not is_loopback(host):
            raise ValueError(
                f"refusing to serve {listen!r} without a token: any host could read and write the "
                "store. Set YRCACHE_TOKEN (the same secret on every member and client), or listen "
                "on 127.0.0.1")
        self.handler = handler
        self.token = token or b""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.errors = 0                   # connections closed for bad frames or auth
        self._thread = threading.Thread(target=self._accept_loop, name="yrcache-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="yrcache-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10.0)
            nonce = os.urandom(NONCE)
            conn.sendall(MAGIC + bytes([PROTO]) + nonce)
            answer = bytearray(NONCE)
            recv_exact(conn, answer)
            if not hmac.compare_digest(bytes(answer), proof(self.token, nonce)):
                self.errors += 1
                conn.sendall(b"\x01")
                return
            conn.sendall(b"\x00")
            conn.settimeout(None)
            rd = Reader(conn)
            out: list[Any] = []          # replies corked while more requests are buffered
            while not self._closed:
                self._one(conn, rd, read_frame(rd), out)
                if out and not rd.buffered:
                    if len(out) == 1:
                        conn.sendall(out[0])
                    else:
                        send_parts(conn, out)
                    out.clear()
        except ProtocolError as e:
            self.errors += 1
            log.warning("closing a data connection: %s", e)
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _one(self, conn: socket.socket, rd: Reader, f: Frame, out: list[Any]) -> None:
        h = self.handler
        if f.plen and f.op not in (PUT, MPUT) and (f.op not in (HAVE, MGET) or f.plen > MAX_LIST):
            raise ProtocolError(f"a {OP_NAMES[f.op]} request with a {f.plen} B body")
        if f.op == MPUT:
            return self._mput(rd, f, out)
        if f.op == MGET:
            return self._mget(conn, rd, f, out)
        try:
            if f.op == PUT:
                out.append(pack(PUT, status=self._put(rd, f)))
            elif f.op == GET:
                got = h.get(f)
                if got is None:
                    out.append(pack(GET, status=NOT_FOUND))
                    return
                view = memoryview(got.buf).cast("B")
                out.append(pack(GET, meta=got.meta, plen=view.nbytes, version=got.version, offset=f.offset,
                                flags=got.tier + 1))
                if view.nbytes:
                    out.append(view)           # sent from the pinned arena view, not copied
            elif f.op == DELETE:
                out.append(pack(DELETE, status=h.delete(f)))
            elif f.op == KEYS:
                body = encode_entries(h.keys(f.key))
                out.append(pack(KEYS, plen=len(body)) + body)
            elif f.op == HAVE:
                entries = bytearray(f.plen)
                rd.readinto(entries)
                bits = h.have(decode_entries(entries))
                out.append(pack(HAVE, plen=len(bits)) + bits)
            elif f.op == STAT:
                body = h.stat()
                out.append(pack(STAT, plen=len(body)) + body)
            elif f.op == FLUSH:
                if out:
                    send_parts(conn, out)
                    out.clear()
                ok = h.flush(f.expire_at or 60.0)
                out.append(pack(FLUSH, status=OK if ok else ERROR))
            else:  # PING
                out.append(pack(PING))
        except (ConnectionError, ProtocolError):
            raise
        except Exception as e:     # noqa: BLE001 - answered, the connection stays usable
            status = FULL if isinstance(e, MemoryError) else ERROR
            msg = f"{type(e).__name__}: {e}".encode()[:MAX_META]
            out.append(pack(f.op, meta=msg, status=status))


    def _put(self, rd: Reader, f: Frame) -> int:
        """Hand one put to the handler: a small payload as a view of the read buffer, a
        large one as a ``fill(dst)`` that receives straight into the destination."""
        if f.plen <= SMALL:
            return self.handler.put(f, rd.take(f.plen), _nothing)
        state = [False]

        def fill(dst: Any) -> None:
            if state[0]:
                raise RuntimeError("put payload read twice")
            state[0] = True
            rd.readinto(memoryview(dst).cast("B")[:f.plen])

        def skip() -> None:
            if not state[0]:
                state[0] = True
                rd.skip(f.plen)
        try:
            return self.handler.put(f, fill, skip)
        finally:
            skip()

    def _mput(self, rd: Reader, f: Frame, out: list[Any]) -> None:
        """Apply a batch of puts; the reply's body is one status byte per item."""
        if f.length > MAX_BATCH:
            raise ProtocolError(f"an mput of {f.length} items (at most {MAX_BATCH})")
        left = f.plen
        statuses = bytearray()
        for _ in range(f.length):
            if left < _PUT_ITEM.size:
                raise ProtocolError("an mput body shorter than its items")
            klen, mlen, nbytes, hlc, writer, priority, expire_at = _PUT_ITEM.unpack(rd.take(_PUT_ITEM.size))
            if klen > MAX_KEY or mlen > MAX_META or _PUT_ITEM.size + klen + mlen + nbytes > left:
                raise ProtocolError("an mput item overruns its frame")
            body = bytes(rd.take(klen + mlen))
            try:
                key = body[:klen].decode()
            except UnicodeDecodeError:
                raise ProtocolError("a frame's key is not UTF-8") from None
            left -= _PUT_ITEM.size + klen + mlen + nbytes
            item = Frame(PUT, f.flags, 0, key, body[klen:], nbytes, (hlc, writer), priority, expire_at, 0, 0)
            try:
                status = self._put(rd, item)
            except (ConnectionError, ProtocolError):
                raise
            except MemoryError:
                status = FULL
            except Exception as e:      # noqa: BLE001 - this item failed, the batch goes on
                log.info("mput item %r refused: %s", key[:80], e)
                status = ERROR
            statuses.append(status)
        if left:
            raise ProtocolError(f"an mput body with {left} bytes after its items")
        out.append(pack(MPUT, plen=len(statuses)) + statuses)

    def _mget(self, conn: socket.socket, rd: Reader, f: Frame, out: list[Any]) -> None:
        """Read a batch: the reply's body is an item header, meta and payload per key."""
        body = bytearray(f.plen)
        rd.readinto(body)
        keys = decode_entries(body)
        if len(keys) > MAX_BATCH:
            raise ProtocolError(f"an mget of {len(keys)} keys (at most {MAX_BATCH})")
        parts: list[Any] = []
        total = 0
        for got in self.handler.get_many([k for k, _ in keys]):
            if got is None:
                parts.append(_GOT_ITEM.pack(0, 0, 0, 0, 0))
                total += _GOT_ITEM.size
                continue
            view = memoryview(got.buf).cast("B")
            parts.append(_GOT_ITEM.pack(1, len(got.meta), view.nbytes, got.version[0], got.version[1]) + got.meta)
            parts.append(view)
            total += _GOT_ITEM.size + len(got.meta) + view.nbytes
        out.append(pack(MGET, plen=total, length=len(keys)))
        out.extend(parts)                       # views of the pinned values, sent by send_parts


# ---- client ------------------------------------------------------------------------
class Conn:
    """One authenticated connection: its socket and its read buffer."""

    __slots__ = ("sock", "rd", "timeout")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.rd = Reader(sock)
        self.timeout: float | None = sock.gettimeout()

    def set_timeout(self, timeout: float | None) -> None:
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout

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
        return Got(f.meta, buf, f.version, f.flags - 1)


    def recv_mget(self, n: int) -> list[Got | None]:
        f = self.reply(MGET)
        if f.length != n:
            raise ProtocolError(f"asked for {n} keys, got {f.length}")
        out: list[Got | None] = []
        if f.plen <= SMALL_REPLY:             # one read, values are slices of it
            body = bytearray(f.plen)
            self.rd.readinto(body)
            view = memoryview(body)
            pos = 0
            for _ in range(n):
                found, mlen, nbytes, hlc, writer = _GOT_ITEM.unpack_from(body, pos)
                pos += _GOT_ITEM.size
                if not found:
                    out.append(None)
                    continue
                if mlen > MAX_META or pos + mlen + nbytes > f.plen:
                    raise ProtocolError("a bad item in an mget reply")
                out.append(Got(bytes(view[pos:pos + mlen]), view[pos + mlen:pos + mlen + nbytes], (hlc, writer)))
                pos += mlen + nbytes
            return out
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
        self._max_idle = pool
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()

    def _connect(self, timeout: float) -> Conn:
        try:
            s = socket.create_connection(self._hostport, timeout=timeout)   # the handshake too
        except OSError as e:
            raise ClusterUnavailableError(f"member {self.name} at {self.address} does not answer: {e}") from e
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
        """A pooled (or new) connection; give it back with :meth:`give_back`, or close it."""
        with self._lock:
            c = self._idle.pop() if self._idle else None
        if c is None:
            c = self._connect(timeout if timeout is not None else self.timeout)
        c.set_timeout(timeout if timeout is not None else self.timeout)
        return c

    def give_back(self, c: Conn) -> None:
        with self._lock:
            keep = len(self._idle) < self._max_idle and not self._closed and not c.rd.buffered
            if keep:
                self._idle.append(c)
        if not keep:
            c.sock.close()

    def error(self, e: BaseException, timeout: float | None = None) -> ClusterUnavailableError:
        """The error a caller sees when this member failed mid-request."""
        if isinstance(e, ClusterUnavailableError):
            return e
        if isinstance(e, TimeoutError):
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
                if attempt or isinstance(e, (ClusterUnavailableError, TimeoutError)):
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
            return c.reply(PUT).status
        return self._call(go, timeout)

    def get(self, key: str, offset: int = 0, length: int = ALL, *, into: Callable[[bytes, int], Any] | None = None,
            timeout: float | None = None) -> Got | None:
        """The object (or range) or None; ``into(meta, n)`` may supply the buffer to receive into."""
        def go(c: Conn) -> Got | None:
            c.sock.sendall(pack(GET, key.encode(), offset=offset, length=length))
            return c.recv_get(into)
        return self._call(go, timeout)

    def delete(self, key: str, version: tuple[int, int], timeout: float | None = None) -> bool:
        def go(c: Conn) -> bool:
            c.sock.sendall(pack(DELETE, key.encode(), version=version))
            return c.reply(DELETE).status == OK
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

    def flush(self, timeout: float = 60.0) -> bool:
        def go(c: Conn) -> bool:
            c.sock.sendall(pack(FLUSH, expire_at=timeout))
            return c.reply(FLUSH).status == OK
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
                out += c.recv_mget(len(keys[i:i + MAX_BATCH]))
            return out
        return self._call(go, timeout)


def send_puts(c: Conn, items: Sequence[tuple[str, bytes, Any, int, tuple[int, int], int, float]],
              flags: int = 0) -> list[int]:
    """Write puts as few frames: runs of small items go as MPUT frames, each large one
    as its own PUT (sent from its buffer). Returns the items per frame (0: a PUT)."""
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
    for key, meta, payload, nbytes, version, priority, expire_at in items:
        if nbytes > SMALL:
            close_run()
            out.extend(pack(PUT, key.encode(), meta, nbytes, flags=flags, version=version, priority=priority,
                            expire_at=expire_at))
            c.sock.sendall(out)
            c.sock.sendall(memoryview(payload).cast("B"))
            out = bytearray()
            frames.append(0)
            continue
        kb = key.encode()
        run += _PUT_ITEM.pack(len(kb), len(meta), nbytes, version[0], version[1], priority, expire_at)
        run += kb
        run += meta
        if nbytes:
            run += memoryview(payload).cast("B")
        n += 1
        if n >= MAX_BATCH or len(run) > (1 << 20):
            close_run()
            c.sock.sendall(out)
            out = bytearray()
    close_run()
    if out:
        c.sock.sendall(out)
    return frames


def recv_puts(c: Conn, frames: list[int]) -> list[int]:
    """The statuses of the puts :func:`send_puts` sent, in order."""
    statuses: list[int] = []
    for n in frames:
        if n == 0:
            statuses.append(c.reply(PUT).status)
        else:
            f = c.reply(MPUT)
            if f.plen != n:
                raise ProtocolError(f"an mput of {n} items answered with {f.plen} statuses")
            statuses += c.body(n)
    bad = [x for x in statuses if x in (ERROR, FULL)]
    if bad:
        raise RemoteError(f"the member refused {len(bad)} of {len(statuses)} puts"
                          + (" (it is full)" if FULL in bad else ""), FULL if FULL in bad else ERROR)
    return statuses
