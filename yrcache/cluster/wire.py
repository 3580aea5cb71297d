"""The cluster wire format: frames, their limits, and buffered socket reads.

Every message is one fixed 72-byte header (:data:`HDR`), then the key, the codec
header (``meta``) and the payload, whose lengths the header gives. Nothing on the
wire is ever unpickled: a header is ``struct``-unpacked and checked against
limits (:data:`MAX_KEY`, :data:`MAX_META`, :data:`MAX_PAYLOAD`) before a byte of
its body is read. ``transport.py`` runs the connections.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import buffers
from ..errors import YrcacheError

MAGIC = b"YR"
PROTO = 1
# magic, proto, op, flags, status, klen, mlen, plen, hlc, writer, priority, expire_at, offset, length
HDR = struct.Struct("<2sBBHHIIQQQqdQQ")
assert HDR.size == 72
MAX_KEY = 1024                  # validate.MAX_KEY_BYTES
MAX_META = 4096                 # codec.MAX_META
MAX_PAYLOAD = 1 << 40           # a frame larger than this is garbage, not an object
MAX_LIST = 64 << 20             # a KEYS/HAVE body
NONCE = 32
ALL = (1 << 64) - 1             # length of a read that wants the whole object

# ops
PUT, GET, DELETE, KEYS, HAVE, STAT, FLUSH, PING, MPUT, MGET, GETV, ADOPT = range(1, 13)
OP_NAMES = {PUT: "put", GET: "get", DELETE: "delete", KEYS: "keys", HAVE: "have", STAT: "stat",
            FLUSH: "flush", PING: "ping", MPUT: "mput", MGET: "mget", GETV: "getv", ADOPT: "adopt"}
MAX_BATCH = 4096                # items in one MPUT/MGET frame
# flags
F_REPLICATE = 1                 # put: the receiver forwards the object to the key's other owners
F_SINGLE = 2                    # put: WriteMode.NONE, the object keeps one copy (its first owner)
TIER_SHIFT = 8                  # put: flags >> 8 is the tier hint + 1 (0: none)
# statuses
OK, NOT_FOUND, STALE, FULL, ERROR, SAME = range(6)   # STALE: it holds a newer version; SAME: this one

_ENTRY = struct.Struct("<HQQ")  # a KEYS/HAVE entry: klen, hlc, writer (then the key)
# an MPUT item: klen, mlen, nbytes, hlc, writer, priority, expire_at (then key, meta, payload)
_PUT_ITEM = struct.Struct("<HHQQQqd")
# an MGET reply item: found, mlen, nbytes, hlc, writer (then meta, payload); the request body is keys
_GOT_ITEM = struct.Struct("<BxHQQQ")
# a GETV request's span: offset, run, rows, stride (rows runs of run bytes, stride apart)
SPAN = struct.Struct("<QQQQ")
MAX_SPANS = MAX_BATCH


class ProtocolError(YrcacheError, ConnectionError):
    """A peer sent something that is not a valid yrcache frame."""


class RemoteError(YrcacheError, RuntimeError):
    """A peer answered a request with an error (its message says which)."""

    def __init__(self, msg: str, status: int = ERROR):
        super().__init__(msg)
        self.status = status


class Frame(NamedTuple):
    """A decoded request or reply header plus its key and codec header."""
    op: int
    flags: int
    status: int
    key: str
    meta: bytes
    plen: int
    version: tuple[int, int]
    priority: int
    expire_at: float
    offset: int
    length: int


class Got(NamedTuple):
    """An object (or a range of it) read from a member."""
    meta: bytes
    buf: Any
    version: tuple[int, int]
    tier: int = -1            # the holder's Tier, for reads of length 0 (probes); -1: not asked


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) -> ``(host, port)``; raise ``ValueError`` otherwise."""
    if not isinstance(address, str):
        raise TypeError(f"an address is a str 'host:port', not {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not host:port (port 0..65535)")
    return host, int(port)


def proof(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, b"yrcache-v1" + nonce, hashlib.sha256).digest()


def pack(op: int, key: bytes = b"", meta: bytes = b"", plen: int = 0, *, flags: int = 0, status: int = 0,
         version: tuple[int, int] = (0, 0), priority: int = 0, expire_at: float = 0.0,
         offset: int = 0, length: int = 0) -> bytes:
    """One frame's header, key and meta (the payload, if any, is sent after them)."""
    return HDR.pack(MAGIC, PROTO, op, flags, status, len(key), len(meta), plen, version[0], version[1],
                    priority, expire_at, offset, length) + key + meta


# A large payload is received with the socket's low-water mark raised, so the kernel wakes
# the receiver once per LOWAT bytes instead of once per segment, which also spares the sender
# work (docs/benchmarks.md: a 64 MiB get went from 0.9-1.0x to 1.2-1.3x of a plain recv_into
# loop in bench_cluster.py, and the CPU of a cross-node weight sync fell 6%).  The kernel
# tests its wake-up against the socket's mark and the bytes not yet read, not against what a
# recv still wants: a recv that took c < LOWAT bytes and sleeps for the rest wakes only when
# LOWAT more have come.  So the mark stays up only while a recv starts with at least 2 * LOWAT
# bytes to come (then more than LOWAT follow whatever it took), or the last bytes never wake it.
LOWAT = 512 << 10


def _lowat(sock: socket.socket, n: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
        return True
    except OSError:         # closed under us: the recv reports it
        return False


def recv_exact(sock: socket.socket, buf: Any) -> None:
    """Fill the writable buffer ``buf`` from ``sock`` or raise ``ConnectionError``."""
    view = memoryview(buf).cast("B")
    got, n = 0, view.nbytes
    raised = n >= 2 * LOWAT and _lowat(sock, LOWAT)
    try:
        while got < n:
            if raised and n - got < 2 * LOWAT:
                _lowat(sock, 1)
                raised = False
            k = sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
            got += k
    finally:
        if raised:
            _lowat(sock, 1)


class Reader:
    """Buffered reads from one socket: a batch of pipelined frames costs one ``recv``.

    Headers, keys and metas are parsed out of a 64 KiB buffer; a payload is copied
    from what is already buffered and the rest received straight into its
    destination (an arena block) with ``recv_into``.
    """

    SIZE = 1 << 16

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(self.SIZE)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    @property
    def buffered(self) -> int:
        return self.end - self.start

    def _want(self, n: int) -> None:
        if self.end - self.start >= n:
            return
        if self.start:
            k = self.end - self.start
            self.view[:k] = self.view[self.start:self.end]
            self.start, self.end = 0, k
        while self.end < n:
            got = self.sock.recv_into(self.view[self.end:])
            if not got:
                raise ConnectionError(f"peer closed the connection ({self.end} of {n} bytes of a frame)")
            self.end += got

    def fill(self) -> None:
        """Receive what the socket has (at least one byte) after what is buffered."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == self.SIZE:
            self._want(self.end - self.start + 1)
            return
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise ConnectionError("peer closed the connection")
        self.end += got

    def push(self, data: bytes) -> None:
        """Put ``data``, received by other means, in front of what comes next (nothing is buffered)."""
        assert self.start == self.end, "push onto a buffered reader"
        n = len(data)
        self.view[:n] = data
        self.start, self.end = 0, n

    def consumed(self, n: int) -> None:
        """Drop the next ``n`` buffered bytes (a frame answered from the buffer)."""
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0

    def take(self, n: int) -> memoryview:
        """The next ``n`` (<= 64 KiB) bytes, valid until the next call."""
        self._want(n)
        out = self.view[self.start:self.start + n]
        self.start += n
        return out

    def readinto(self, dst: Any) -> None:
        out = memoryview(dst).cast("B")
        n = out.nbytes
        have = min(n, self.end - self.start)
        if have:
            out[:have] = self.view[self.start:self.start + have]
            self.start += have
        if have < n:
            recv_exact(self.sock, out[have:])

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (the body of a put that lost to a newer version)."""
        have = min(n, self.end - self.start)
        self.start += have
        n -= have
        while n:
            k = min(n, self.SIZE)
            recv_exact(self.sock, self.view[:k])
            n -= k
        if self.start == self.end:
            self.start = self.end = 0


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Send buffers in order with as few syscalls as it takes (``sendmsg``, no joining copy)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = sock.sendmsg(views[:512])
        while n:
            k = views[0].nbytes
            if n >= k:
                n -= k
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
        while views and not views[0].nbytes:
            views.pop(0)


def read_frame(rd: Reader) -> Frame:
    """Read and check one header, its key and meta; the payload is left to read."""
    (magic, proto, op, flags, status, klen, mlen, plen, hlc, writer, priority, expire_at,
     offset, length) = HDR.unpack(rd.take(HDR.size))
    if magic != MAGIC or proto != PROTO:
        raise ProtocolError(f"not a yrcache frame (magic {bytes(magic)!r}, protocol {proto})")
    if op not in OP_NAMES or klen > MAX_KEY or mlen > MAX_META or plen > MAX_PAYLOAD:
        raise ProtocolError(f"bad frame: op {op}, key {klen} B, meta {mlen} B, payload {plen} B")
    if klen or mlen:
        body = bytes(rd.take(klen + mlen))
        try:
            key = body[:klen].decode()
        except UnicodeDecodeError:
            raise ProtocolError("a frame's key is not UTF-8") from None
        meta = body[klen:]
    else:
        key, meta = "", b""
    return Frame(op, flags, status, key, meta, plen, (hlc, writer), priority, expire_at, offset, length)


def alloc(n: int) -> Any:
    """A writable buffer of ``n`` bytes to receive an object into (pooled from 1 MiB)."""
    return buffers.alloc(n)


#: One put of an MPUT as the server hands it on: key, meta, payload, version, priority, expire_at.
PutItem = tuple[str, bytes, bytes, tuple[int, int], int, float]


def parse_mput(body: bytes | bytearray, n: int) -> list[PutItem]:
    """The ``n`` items of an MPUT body held in memory whole (a ``ProtocolError`` if they
    do not fill it exactly or one breaks a limit); payloads are copied out of ``body``."""
    view = memoryview(body)
    out: list[PutItem] = []
    pos, end, size, unpack = 0, len(body), _PUT_ITEM.size, _PUT_ITEM.unpack_from
    for _ in range(n):
        if pos + size > end:
            raise ProtocolError("an mput body shorter than its items")
        klen, mlen, nbytes, hlc, writer, priority, expire_at = unpack(body, pos)
        pos += size
        if klen > MAX_KEY or mlen > MAX_META or pos + klen + mlen + nbytes > end:
            raise ProtocolError("an mput item overruns its frame")
        try:
            key = str(view[pos:pos + klen], "utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("a frame's key is not UTF-8") from None
        pos += klen + mlen
        out.append((key, bytes(view[pos - mlen:pos]), bytes(view[pos:pos + nbytes]), (hlc, writer),
                    priority, expire_at))
        pos += nbytes
    if pos != end:
        raise ProtocolError(f"an mput body with {end - pos} bytes after its items")
    return out


def encode_entries(entries: Iterable[tuple[str, tuple[int, int]]]) -> bytes:
    """``[(key, (hlc, writer))]`` -> the body of a KEYS reply or a HAVE request."""
    out = bytearray()
    for key, (hlc, writer) in entries:
        kb = key.encode()
        out += _ENTRY.pack(len(kb), hlc, writer)
        out += kb
    return bytes(out)


def decode_entries(body: bytes | bytearray | memoryview) -> list[tuple[str, tuple[int, int]]]:
    out = []
    pos, n = 0, len(body)
    while pos < n:
        if pos + _ENTRY.size > n:
            raise ProtocolError("truncated entry list")
        klen, hlc, writer = _ENTRY.unpack_from(body, pos)
        pos += _ENTRY.size
        if klen > MAX_KEY or pos + klen > n:
            raise ProtocolError("bad entry in an entry list")
        out.append((bytes(body[pos:pos + klen]).decode(), (hlc, writer)))
        pos += klen
    return out


SMALL = 1 << 16        # payloads up to this size travel in the same send as their header
SMALL_REPLY = 1 << 20  # an mget reply up to this size is read in one piece


Span = tuple[int, int, int, int]     # offset, run, rows, stride


def encode_spans(spans: Iterable[Span]) -> bytes:
    """``[(offset, run, rows, stride)]`` -> the body of a GETV request."""
    return b"".join(SPAN.pack(*s) for s in spans)


def decode_spans(body: bytes | bytearray | memoryview) -> list[Span]:
    if len(body) % SPAN.size or len(body) // SPAN.size > MAX_SPANS:
        raise ProtocolError(f"a getv body of {len(body)} bytes is not 1..{MAX_SPANS} spans")
    return [SPAN.unpack_from(body, i) for i in range(0, len(body), SPAN.size)]


def spans_nbytes(spans: Iterable[Span]) -> int:
    """How many bytes a ranged read of ``spans`` returns."""
    return sum(run * rows for _, run, rows, _ in spans)


def check_spans(nbytes: int, spans: list[Span]) -> int:
    """The bytes ``spans`` read from an object of ``nbytes``; ``ValueError`` for a span
    outside it (or rows that overlap, ``stride < run``)."""
    total = 0
    for off, run, rows, stride in spans:
        if not rows or not run:
            continue
        if off + (rows - 1) * stride + run > nbytes or (rows > 1 and stride < run):
            raise ValueError(f"span ({off}, {run}, {rows}, {stride}) is outside an object of {nbytes} bytes")
        total += run * rows
    return total


def gather(view: Any, spans: list[Span]) -> Iterator[Any]:
    """The bytes of ``spans`` of the flat buffer ``view``, in order, one buffer per span
    (a run as a view, no copy; strided rows gathered into a block, one at a time, so
    memory stays bounded whatever the request). Check them first with ``check_spans``."""
    src = memoryview(view).cast("B")
    for off, run, rows, stride in spans:
        if not rows or not run:
            continue
        if rows == 1:
            yield src[off:off + run]
        else:
            yield np.ndarray((rows, run), np.uint8, src, off, (stride, 1)).copy()


def gather_into(view: Any, spans: list[Span], dst: Any) -> None:
    """Copy the bytes of ``spans`` of ``view`` into ``dst`` back to back (checked)."""
    out = memoryview(dst).cast("B")
    if check_spans(memoryview(view).nbytes, spans) != out.nbytes:
        raise ValueError(f"the spans hold {spans_nbytes(spans)} bytes, the destination {out.nbytes}")
    pos = 0
    for part in gather(view, spans):
        v = memoryview(part).cast("B")
        out[pos:pos + v.nbytes] = v
        pos += v.nbytes
