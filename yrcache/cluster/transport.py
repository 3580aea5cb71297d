"""The cluster data plane: a framed binary protocol over TCP, and its server.

The client side (``Peer``, ``Conn``) is ``peer.py``, the frame format ``wire.py``;
this module re-exports both, so ``transport`` names the whole data plane.

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
from collections.abc import Callable
from typing import Any

from .._fast import wire_mput
from .wire import (  # noqa: F401  (the wire's names are part of this module's interface)
    _GOT_ITEM, _PUT_ITEM, ADOPT, ALL, DELETE, ERROR, F_REPLICATE, F_SINGLE, FLUSH, FULL, GET, HAVE, HDR, KEYS,
    GETV, MAGIC, MAX_BATCH, MAX_KEY, MAX_LIST, MAX_META, MAX_SPANS, MGET, MPUT, NONCE, NOT_FOUND, OK, OP_NAMES, PING,
    PROTO, PUT, SAME, SMALL, SMALL_REPLY, STALE, STAT, TIER_SHIFT, Frame, Got, ProtocolError, PutItem, Reader,
    RemoteError, Span, alloc, check_spans, decode_entries, decode_spans, encode_entries, encode_spans, gather, gather_into, is_loopback, pack, proof,
    parse_mput, read_frame, recv_exact, send_parts, spans_nbytes, split_address)
from .peer import RECEIVED, Conn, Land, Peer, put_frame, recv_puts, send_puts  # noqa: F401  (the client, for `transport.Peer` users)

log = logging.getLogger(__name__)
_MISSING = _GOT_ITEM.pack(0, 0, 0, 0, 0)      # an MGET reply's item for a key not held here
RUN_BYTES = 1 << 20      # small puts of an MPUT held in memory before they are applied


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

    def put_many(self, items: list[PutItem], flags: int) -> list[int]:
        """Store several puts held in memory (the items of one MPUT frame, whose
        ``flags`` they share); a status each."""
        out = []
        for key, meta, payload, version, priority, expire_at in items:
            f = Frame(PUT, flags, 0, key, meta, len(payload), version, priority, expire_at, 0, 0)
            try:
                out.append(self.put(f, payload, _nothing))
            except Exception as e:   # noqa: BLE001 - this item failed, the batch goes on
                out.append(refused(f"put of {key[:80]!r}", e))
        return out

    def get(self, f: Frame) -> Got | None:
        """``f.key``'s ``[offset, offset+length)`` (its meta, version and, for length 0, tier), or None."""
        raise NotImplementedError

    def adopt(self, f: Frame) -> int:
        """Take ``f.key``, which a process of this machine stored in the arena itself (the
        object whose sequence number is ``f.offset``), at ``f.version``: a put's status,
        ``NOT_FOUND`` if the arena no longer holds that object."""
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

    def mget_reply(self, body: bytearray) -> tuple[int, bytes] | None:
        """The whole reply body of an MGET whose request body (its entry list) is ``body``,
        and how many keys it answers, in one piece; None: answer it key by key (``get_many``)."""
        return None

    #: ``serve(buf, start, end)``: answer the whole frame at ``buf[start:end]`` at once, or
    #: None (the general path reads it). It returns ``(consumed, reply)``, or ``(consumed,
    #: reply, key, version)`` when ``queue(key, version)`` must follow. A member's node
    #: answers plain single PUTs and GETs in C this way (``OwnPuts.serve``).
    serve: Callable[[bytearray, int, int], tuple | None] | None = None

    def queue(self, key: str, version: tuple[int, int]) -> None:
        """Forward ``key`` at ``version`` to its other owners (after a ``serve`` that asks)."""
        raise NotImplementedError

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

    def stuck(self) -> str:
        """Why a ``flush`` that timed out did not finish (sent with its answer)."""
        return ""


def _nothing() -> None:
    pass


def refused(what: str, e: Exception) -> int:
    """The status of a put (``what``) that raised ``e``: ``FULL`` for no room, else
    ``ERROR`` (logged)."""
    if isinstance(e, MemoryError):
        return FULL
    log.info("%s refused: %s", what, e)
    return ERROR


#: Connections that have not proved the token yet, at once (each holds a thread for up to
#: HANDSHAKE_S): more wait in the listen queue, so a flood of them cannot exhaust threads.
MAX_HANDSHAKES = 64
HANDSHAKE_S = 10.0


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
        try:
            self._sock.bind((host, port))
        except OSError as e:              # in use, no such host, not this machine's address
            self._sock.close()
            raise type(e)(e.errno, f"cannot listen on {listen!r} (listen= or YRCACHE_LISTEN): "
                                   f"{e.strerror}; pick a free port on an address of this machine, "
                                   f"or port 0 for any free one") from None
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)     # a handshake ended
        self._closed = False
        self._handshakes = 0              # connections that have not proved the token yet
        self.errors = 0                   # connections closed for bad frames or auth, or no thread
        self._thread = threading.Thread(target=self._accept_loop, name="yrcache-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        with self._room:
            self._closed = True
            self._room.notify_all()
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
            with self._room:
                while self._handshakes >= MAX_HANDSHAKES and not self._closed:
                    self._room.wait(1.0)
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._handshakes += 1
                self._conns.add(conn)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn,), name="yrcache-conn", daemon=True).start()
            except (RuntimeError, OSError) as e:    # no thread to spare, or the peer left: keep accepting
                self.errors += 1
                log.warning("closing a data connection: %s", e)
                self._handshake_over()
                self._forget(conn)

    def _handshake_over(self) -> None:
        with self._room:
            self._handshakes -= 1
            self._room.notify()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        shaking = True
        try:
            conn.settimeout(HANDSHAKE_S)
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
            self._handshake_over()
            shaking = False
            rd = Reader(conn)
            out: list[Any] = []          # replies corked while more requests are buffered
            serve = self.handler.serve
            while not self._closed:
                done = None
                if serve is not None:
                    if rd.end - rd.start < HDR.size:
                        rd.fill()
                    done = serve(rd.buf, rd.start, rd.end)
                if done is not None:       # a plain PUT or GET answered in one call
                    rd.consumed(done[0])
                    out.append(done[1])
                    if len(done) > 2:
                        self.handler.queue(done[2], done[3])
                else:
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
            if shaking:
                self._handshake_over()
            self._forget(conn)

    def _one(self, conn: socket.socket, rd: Reader, f: Frame, out: list[Any]) -> None:
        h = self.handler
        if f.plen and f.op not in (PUT, MPUT) and (f.op not in (HAVE, MGET, GETV) or f.plen > MAX_LIST):
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
            elif f.op == GETV:
                req = bytearray(f.plen)
                rd.readinto(req)
                spans = decode_spans(req)
                got = h.get(f._replace(offset=0, length=ALL))
                if got is None:
                    out.append(pack(GETV, status=NOT_FOUND))
                    return
                view = memoryview(got.buf).cast("B")
                total = check_spans(view.nbytes, spans)     # ValueError (outside it): ERROR
                out.append(pack(GETV, meta=got.meta, plen=total, version=got.version))
                send_parts(conn, out)
                out.clear()
                for part in gather(view, spans):           # one span in memory at a time
                    conn.sendall(part)
            elif f.op == DELETE:
                out.append(pack(DELETE, status=h.delete(f)))
            elif f.op == ADOPT:
                out.append(pack(ADOPT, status=h.adopt(f)))
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
                out.append(pack(FLUSH, status=OK) if ok else
                           pack(FLUSH, meta=h.stuck().encode()[:MAX_META], status=ERROR))
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
        """Apply a batch of puts; the reply's body is one status byte per item. A body of
        at most ``RUN_BYTES`` is read and parsed whole and goes to the handler's
        ``put_many`` at once; a larger one is read item by item, runs of small items
        handed on together and a large one received straight into its destination."""
        if f.length > MAX_BATCH:
            raise ProtocolError(f"an mput of {f.length} items (at most {MAX_BATCH})")
        if f.plen <= RUN_BYTES:
            whole = bytearray(f.plen)
            rd.readinto(whole)
            items = wire_mput(whole, f.length, MAX_KEY, MAX_META)     # parsed in C (None: malformed)
            out.append(pack(MPUT, plen=f.length) +
                       self._put_run(items if items is not None else parse_mput(whole, f.length), f.flags))
            return
        left = f.plen
        statuses = bytearray()
        run: list[PutItem] = []
        held = 0
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
            if nbytes <= SMALL:
                run.append((key, body[klen:], bytes(rd.take(nbytes)), (hlc, writer), priority, expire_at))
                held += nbytes
                if held < RUN_BYTES:
                    continue
            statuses += self._put_run(run, f.flags)
            run, held = [], 0
            if nbytes > SMALL:
                item = Frame(PUT, f.flags, 0, key, body[klen:], nbytes, (hlc, writer), priority, expire_at, 0, 0)
                statuses.append(self._put_item(rd, item))
        statuses += self._put_run(run, f.flags)
        if left:
            raise ProtocolError(f"an mput body with {left} bytes after its items")
        out.append(pack(MPUT, plen=len(statuses)) + statuses)

    def _put_item(self, rd: Reader, item: Frame) -> int:
        try:
            return self._put(rd, item)
        except (ConnectionError, ProtocolError):
            raise
        except Exception as e:      # noqa: BLE001 - this item failed, the batch goes on
            return refused(f"put of {item.key[:80]!r}", e)

    def _put_run(self, run: list[PutItem], flags: int) -> bytes:
        """The statuses of a run of puts held in memory, applied by the handler at once."""
        if not run:
            return b""
        try:
            return bytes(self.handler.put_many(run, flags))
        except Exception as e:      # noqa: BLE001 - the batch failed as a whole
            return bytes([refused(f"an mput of {len(run)} items", e)]) * len(run)

    def _mget(self, conn: socket.socket, rd: Reader, f: Frame, out: list[Any]) -> None:
        """Read a batch: the reply's body is an item header, meta and payload per key."""
        body = bytearray(f.plen)
        rd.readinto(body)
        whole = self.handler.mget_reply(body)
        if whole is not None:                   # built in one C call (small objects, all in DRAM)
            out.append(pack(MGET, plen=len(whole[1]), length=whole[0]))
            out.append(whole[1])
            return
        keys = decode_entries(body)
        if len(keys) > MAX_BATCH:
            raise ProtocolError(f"an mget of {len(keys)} keys (at most {MAX_BATCH})")
        parts: list[Any] = []
        total, size, item = 0, _GOT_ITEM.size, _GOT_ITEM.pack
        for got in self.handler.get_many([k for k, _ in keys]):
            if got is None:
                parts.append(_MISSING)
                total += size
                continue
            meta, buf, (hlc, writer) = got[0], got[1], got[2]
            view = memoryview(buf).cast("B")
            parts.append(item(1, len(meta), view.nbytes, hlc, writer) + meta)
            parts.append(view)
            total += size + len(meta) + view.nbytes
        out.append(pack(MGET, plen=total, length=len(keys)))
        out.extend(parts)                       # views of the pinned values, sent by send_parts
