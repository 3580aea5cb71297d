"""The SSD tier's index records (``disk.py``): plain bytes, never pickled.

Record: version, kind, reserved, meta_len, key_len, nbytes, checksum,
priority, expire_at (NaN = never), created; then meta, key (UTF-8), and the
inline payload or the file id.
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Any, NamedTuple

_GEN_MAX = (1 << 63) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

_HDR = struct.Struct("<BBHIIQQqdd")
_VERSION = 2
_INLINE, _FILE = 0, 1


class _Rec(NamedTuple):
    kind: int
    nbytes: int
    checksum: int
    priority: int
    expire_at: float | None
    created: float
    meta: bytes
    key: str
    raw: bytes             # the whole encoded record
    tail: int              # raw[tail:] is the inline payload or the file id


def _encode(kind: int, meta: bytes, key: bytes, nbytes: int, checksum: int, priority: int,
            expire_at: float | None, created: float, tail: bytes) -> bytes:
    exp = math.nan if expire_at is None else expire_at
    hdr = _HDR.pack(_VERSION, kind, 0, len(meta), len(key), nbytes, checksum, priority, exp, created)
    return b"".join((hdr, meta, key, tail))


def _decode(raw: object) -> _Rec:
    """The record in ``raw``; ValueError if it is not one this module writes."""
    if not isinstance(raw, bytes) or len(raw) < _HDR.size:
        raise ValueError("the index record is not a record of this yrcache version")
    version, kind, _r, meta_len, key_len, nbytes, checksum, priority, exp, created = _HDR.unpack_from(raw)
    m, k = _HDR.size + meta_len, _HDR.size + meta_len + key_len
    if version != _VERSION or kind not in (_INLINE, _FILE) or k > len(raw):
        raise ValueError(f"the index record (version {version}) is not a record of this yrcache version")
    return _Rec(kind, nbytes, checksum, priority, None if exp != exp else exp, created,
                raw[_HDR.size:m], raw[m:k].decode("utf-8"), raw, k)


def _check_gen(gen: Any) -> int:
    if isinstance(gen, bool):
        raise TypeError("a generation is an int in 1..2**63-1, got a bool")
    try:
        g = operator.index(gen)
    except TypeError:
        raise TypeError(f"a generation is an int in 1..2**63-1, got {type(gen).__name__} "
                        f"{gen!r:.40}") from None
    if not 0 < g <= _GEN_MAX:
        raise ValueError(f"a generation is an int in 1..2**63-1, got {g}")
    return g


def _short(key: str) -> str:
    r = repr(key)
    return r if len(r) <= 120 else r[:117] + "..."


def _check_fields(key: Any, meta: Any, priority: Any,
                  expire_at: Any) -> tuple[bytes, bytes, int, float | None]:
    """A put's record fields, checked: ``(key as UTF-8, meta bytes, priority, expire_at)``."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    try:
        key_b = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"key {_short(key)} is not valid UTF-8 (lone surrogate)") from None
    try:
        meta = bytes(memoryview(meta))
    except TypeError:
        raise TypeError(f"meta must be bytes, got {type(meta).__name__}") from None
    priority = operator.index(priority)
    if not _I64_MIN <= priority <= _I64_MAX:
        raise ValueError(f"priority must fit in 64 bits, got {priority!r}")
    if expire_at is not None:
        expire_at = float(expire_at)
        if expire_at != expire_at:
            raise ValueError("expire_at must be a unix time or None, not NaN")
    return key_b, meta, priority, expire_at
