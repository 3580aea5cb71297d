"""The protocol of a lower tier: blobs addressed by generation.

A store has one key space, the arena's index (``tiers/dram.py``).  An object
whose bytes live in a lower tier keeps a *stub* there that names the tier and
a **generation**: a random 63-bit number drawn for every copy written to a
tier.  The tier itself is a blob store addressed by generation: it never
sees a lookup by key, never decides what expires or what goes first (the
index and ``policy.py`` do), and a copy is never overwritten in place (a new
copy gets a new generation), so a reader holding an old generation reads the
old bytes or finds them gone, never a mix.

A blob is a codec header (``meta``, see ``codec.py``) and a payload.  The key,
priority and expiry it was stored with travel along only so that the index
can be rebuilt from a tier that outlives the arena (the SSD tier after a
restart, see ``entries``).

The interface is small on purpose (zarr-python's ``abc/store.py`` is the
model): a few abstract methods, capabilities as class attributes, derived
operations here.  ``tests/tier_suite.py`` is the one conformance suite every
tier passes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator, NamedTuple


class BlobInfo(NamedTuple):
    """What a tier records about one blob (no payload)."""

    gen: int
    key: str                 # the store key it was written for (to rebuild the index)
    meta: bytes              # codec header
    nbytes: int              # payload bytes
    priority: int
    expire_at: float | None  # unix time, None: never
    created: float           # unix time the blob was written


def new_gen() -> int:
    """A fresh generation: random, non-zero, below 2**63."""
    return int.from_bytes(os.urandom(8), "little") >> 1 or 1


class BlobTier(ABC):
    """A tier below DRAM: blobs (``meta`` + payload) addressed by generation.

    Thread-safe.  ``put`` copies the payload in; ``read_into`` copies it out
    into a caller's buffer (one copy each).  A tier with ``zero_copy`` also
    hands out its own memory through ``get``.
    """

    #: ``"ssd"`` or ``"hbm"``: the name in ``stats()["tiers"]``.
    name: ClassVar[str]
    #: ``get(gen)`` returns the tier's own memory (no copy).
    zero_copy: ClassVar[bool] = False
    #: Every process on the node sees the same blobs (False: only this process).
    shared: ClassVar[bool] = True

    # ------------------------------------------------------------- capacity

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Most payload bytes this tier holds."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Payload bytes held now."""

    def fits(self, nbytes: int) -> bool:
        """Would ``nbytes`` more fit under ``capacity``?"""
        return self.used + nbytes <= self.capacity

    # --------------------------------------------------------------- blobs

    @abstractmethod
    def put(self, gen: int, meta: bytes, payload: Any, *, key: str, priority: int = 0,
            expire_at: float | None = None) -> None:
        """Store a copy of ``payload`` as blob ``gen`` (a new generation: never overwritten).

        Raises ``StoreFullError`` when it does not fit; then nothing is stored.
        """

    @abstractmethod
    def read_into(self, gen: int, out: Any) -> bytes:
        """Copy blob ``gen``'s payload into ``out`` (exactly ``nbytes`` long); return its meta.

        ``KeyError`` if there is no such blob; ``CorruptObjectError`` if its
        bytes are damaged (``out`` then holds garbage).
        """

    @abstractmethod
    def delete(self, gen: int, *, later: Callable[[str], None] | None = None) -> bool:
        """Remove blob ``gen``; True if it was there.  ``later``, where the tier
        has files, takes a path to remove off the caller's thread."""

    @abstractmethod
    def info(self, gen: int) -> BlobInfo | None:
        """What the tier records about blob ``gen``, or None."""

    @abstractmethod
    def entries(self) -> Iterator[BlobInfo]:
        """Every blob (for rebuilding the index and for checks).  O(blobs)."""

    def __contains__(self, gen: object) -> bool:
        return type(gen) is int and 0 < gen < 1 << 63 and self.info(gen) is not None

    def close(self) -> None:  # noqa: B027 - a default, not abstract: most tiers hold nothing to close
        """Release this handle; the blobs of a shared tier stay."""
