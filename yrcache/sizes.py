"""Parsing and printing of byte sizes ("512MiB", "2GiB", "1.5GB", 4096)."""

from __future__ import annotations

import os
import re
from typing import overload

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


@overload
def parse_size(value: int | float | str, what: str = ...) -> int: ...
@overload
def parse_size(value: None, what: str = ...) -> None: ...
@overload
def parse_size(value: int | float | str | None, what: str = ...) -> int | None: ...


def parse_size(value: int | float | str | None, what: str = "size") -> int | None:
    """Return ``value`` as a number of bytes; ``None`` stays ``None``.

    Accepts non-negative ints and strings such as ``"512MiB"``, ``"2GiB"``,
    ``"1.5GB"`` (SI units are powers of 1000, IEC units powers of 1024).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string such as '2GiB', not bool")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{what} must be a finite number of bytes, got {value!r}")
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be an int or a string such as '2GiB', got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot parse {what} {value!r}: use bytes as an int or a number with a unit "
            "such as '512MiB', '2GiB' or '1.5GB'"
        )
    n = float(m.group(1)) * _UNITS[unit]
    if n != n or n == float("inf"):
        raise ValueError(f"{what} must be a finite size, got {value!r}")
    return int(n)


def env_size(name: str, default: int, minimum: int = 0) -> int:
    """The size in the environment variable ``name`` (bytes, or ``"512MiB"``), ``default``
    when unset or empty; a ``ValueError`` naming the variable when it is not a size of at
    least ``minimum`` bytes."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        n = parse_size(raw, name)
    except ValueError:
        n = -1
    if n < minimum:
        raise ValueError(f"{name}={raw!r} is not a size of at least {minimum} bytes: give bytes or a "
                         "number with a unit such as '512MiB' or '1GiB'")
    return n


def format_size(n: float) -> str:
    """Human-readable IEC size: ``format_size(3 << 30) == '3.0 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
