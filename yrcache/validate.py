"""Validation of the arguments of every call: keys, priorities, TTLs.

Bad input raises ``TypeError`` or ``ValueError`` with a message that names the
rule (docs: README, "Semantics worth knowing").
"""

from __future__ import annotations

import numbers
import operator
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ._fast import keys_valid

MAX_KEY_BYTES = 1024
_I64 = 1 << 63


def check_iterable_keys(keys: Any) -> Any:
    """The ``keys`` of a batch call: an iterable of keys, not one (a str would be its letters)."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise TypeError(f"pass an iterable of keys (a list of str), not one {type(keys).__name__} "
                        f"{keys[:40]!r}, which would be read letter by letter; for one key use get(key) "
                        f"or mget([key])")
    return keys


def mset_pairs(items: Any, check: bool = True) -> list:
    """The ``(key, value)`` pairs of an ``mset``: of a mapping, or each item a pair (looked
    at only with ``check``; else the caller has ``explain_pairs`` say what was wrong once
    something failed)."""
    if isinstance(items, Mapping):
        return list(items.items())
    if isinstance(items, (str, bytes, bytearray)) or not isinstance(items, Iterable):
        raise TypeError(f"mset takes a mapping or an iterable of (key, value) pairs, not {type(items).__name__}")
    pairs = list(items)
    if check:
        explain_pairs(pairs)
    return pairs


def explain_pairs(pairs: list) -> None:
    """Raise ``TypeError`` naming the first item of ``pairs`` that is not a (key, value) pair."""
    for i, p in enumerate(pairs):
        try:
            if isinstance(p, (str, bytes)):
                raise TypeError
            _key, _value = p
        except (TypeError, ValueError):
            raise TypeError(f"mset takes a mapping or (key, value) pairs; item {i} is "
                            f"{type(p).__name__} {p!r:.60}, not a pair") from None


def key_bytes(key: Any) -> bytes:
    """Validate a key and return its UTF-8 bytes."""
    if type(key) is not str:
        if isinstance(key, str):
            key = str(key)
        else:
            raise TypeError(f"keys must be str, not {type(key).__name__}")
    try:
        kb = key.encode()
    except UnicodeEncodeError:
        raise ValueError(f"key {key[:40]!r} is not valid UTF-8 (lone surrogates?)") from None
    if 0 < len(kb) <= MAX_KEY_BYTES and b"\x00" not in kb:      # the common case, one test
        return kb
    if not kb:
        raise ValueError("keys must be non-empty strings")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"key is {len(kb)} UTF-8 bytes; keys may be at most {MAX_KEY_BYTES} bytes")
    raise ValueError(f"key {key[:40]!r} contains a NUL character, which keys may not")


def check_keys(keys: list) -> None:
    """:func:`key_bytes` for every key of a list: one C call when they are all plain valid
    ``str`` keys (a batch read's 100 keys: ~2 us, not ~50), else key by key for the error."""
    if not keys_valid(keys, MAX_KEY_BYTES):
        for k in keys:
            key_bytes(k)


def priority(priority: Any) -> int:
    """Validate ``priority=``: an int that fits in 64 bits (numpy ints too, not bools or floats)."""
    if type(priority) is not int:
        if isinstance(priority, bool) or not hasattr(priority, "__index__"):
            raise TypeError(f"priority must be an int, not {type(priority).__name__} {priority!r}")
        priority = operator.index(priority)
    if not -_I64 <= priority < _I64:
        raise ValueError(f"priority must fit in 64 bits (-2**63 <= priority < 2**63), got {priority}")
    return priority


def payload_nbytes(key: str, payload: Any, nbytes: Any) -> int:
    """Validate ``nbytes`` of an encoded payload (an int >= 0) and, when ``payload`` is a
    buffer rather than a fill function, that it holds exactly that many bytes."""
    if type(nbytes) is int and type(payload) is bytes and len(payload) == nbytes:
        return nbytes             # the common case (an encoded small value), one test
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__") or operator.index(nbytes) < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    nbytes = operator.index(nbytes)
    if not callable(payload):
        try:
            view = memoryview(payload)
        except TypeError:
            raise TypeError(f"{key!r}: the payload must be a function that fills the block or a "
                            f"contiguous buffer, not {type(payload).__name__}") from None
        if not view.c_contiguous:
            raise ValueError(f"{key!r}: the payload buffer is not C-contiguous; pass "
                             "numpy.ascontiguousarray(...) of it")
        have = view.nbytes
        if have != nbytes:
            raise ValueError(f"{key!r}: a payload of {have} bytes, but nbytes={nbytes}")
    return nbytes


def expire_at(ttl: float | None) -> float:
    if ttl is None:
        return 0.0
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return time.time() + ttl


def timeout(value: float | None) -> float | None:
    """A wait's ``timeout``: None (no limit) or a number of seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"timeout must be a number of seconds >= 0, or None to wait as long as it "
                         f"takes; got {value!r}")
    return float(value)


#: A wait longer than this (~31 years) is a wait without limit.
FOREVER_S = 1e9


def wait_seconds(value: float | None) -> float | None:
    """A word's ``wait`` timeout: seconds, at least 0 (a negative one is 0: already past), or
    None for no limit (also for ``inf`` and anything over ``FOREVER_S``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):      # (numpy scalars too)
        raise TypeError(f"timeout must be a number of seconds or None, not {type(value).__name__} {value!r}")
    value = float(value)
    if value != value:
        raise ValueError("timeout is NaN: give a number of seconds, or None to wait as long as it takes")
    return None if value > FOREVER_S else max(float(value), 0.0)


def sync_timeout(value: float | None) -> float | None:
    """A write-through put's ``sync_timeout``: None (the store's default) or seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"sync_timeout must be a number of seconds > 0 (how long a write-through put "
                         f"waits for its owners), or None for the default; got {value!r}")
    return float(value)
