"""The DRAM tier's plain-Python parts: its read sizes, the index record of a
scan, and the parsing of the batches the C core fills in.

Nothing here calls the C core (``dram.py`` alone does, and hands these
functions the buffers it got back); ``dram.py`` re-exports every name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import CorruptObjectError

ANY_SEQ = (1 << 64) - 1    # a commit or delete that does not depend on the current object
#: A DRAM object whose header and payload fit in this many bytes is copied out
#: by a read instead of pinned: copying 4 KiB costs less than a pin and its release.
SMALL_READ = 4096 + 256   # a 4 KiB value and its header
#: Room for the small objects one ``mread`` copies out (larger batches pin the rest).
MREAD_BYTES = 1 << 16
#: A mapping that was not prefaulted maps the pages of a copy at least this big
#: in one call first, instead of taking a fault per 4 KiB page during the copy.
POPULATE_MIN = 1 << 20


class ScanRec(NamedTuple):
    """What the index says about one object (a copy)."""

    seq: int
    nbytes: int
    block_size: int
    priority: int
    access_count: int
    last_access: float
    expire_at: float
    tier: int
    pins: int
    gen: int
    holder: int
    flags: int


def records(recs: Any, raw: Any, n: int) -> list[tuple[ScanRec, str]]:
    """(record, key) of the first ``n`` ``yr_scanrec``s of a scan or drain, their
    keys in the buffer ``raw`` (copied out: the C buffers are reused)."""
    return [(ScanRec(*(getattr(r, f) for f in ScanRec._fields)), raw[r.key_pos:r.key_pos + r.klen].decode())
            for r in (recs[i] for i in range(n))]


def split_keys(raw: Any, n: int) -> list[bytes]:
    """The ``n`` keys of a ``yr_keys`` batch in ``raw``: each a little-endian u32
    length, then its bytes."""
    out, pos = [], 0
    for _ in range(n):
        klen = int.from_bytes(raw[pos:pos + 4], "little")
        out.append(raw[pos + 4:pos + 4 + klen])
        pos += 4 + klen
    return out


def damaged(what: str, name: str | None) -> CorruptObjectError:
    """The error of a call that met a damaged arena (``YR_EDAMAGED``): its lists
    contradict its blocks, so no lookup, put or listing in it can be trusted."""
    seg = f"/dev/shm/yrcache.{name}" if name else "its shared-memory segment"
    return CorruptObjectError(
        f"{what} failed: store {name or ''!r} is damaged: the lists in {seg} no longer match its blocks (was "
        f"the segment written by something other than yrcache?); remove it with `yrcache destroy {name or 'NAME'}` "
        "and store its data again")


def word_value_error(expected: Any, desired: Any) -> ValueError:
    """What ``Word.cas`` raises for a value the word cannot hold."""
    for what, v in (("expected", expected), ("desired", desired)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
            return ValueError(f"a word holds an unsigned 64-bit value: {what} must be an int in "
                              f"0..2**64-1, got {v!r}")
    return ValueError(f"word values must be ints in 0..2**64-1, got {expected!r} and {desired!r}")
