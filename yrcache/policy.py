"""Placement policy: watermarks, victims, promotion.  Pure: no I/O, no values.

The policy sees what the arena's index reports about each object (size,
priority, access count, last access time, pins) and decides *which* objects
move; the store does the moving.  The clock is an argument, so tests are
deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple


class Candidate(NamedTuple):
    """One object as the policy sees it."""

    key: str
    seq: int
    nbytes: int          # payload bytes
    block_size: int      # bytes it occupies in its tier (headers included)
    priority: int
    access_count: int
    last_access: float
    pins: int


@dataclass(frozen=True)
class Policy:
    """Watermarks and promotion rule of a store.

    ``high``/``low``: when a tier's use passes ``high`` x capacity, cold
    objects move down until use is at most ``low`` x capacity.
    ``promote_after``: reads of an object in a lower tier before it moves up.
    """

    high: float = 0.9
    low: float = 0.8
    promote_after: int = 2

    def __post_init__(self):
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={self.low}, high={self.high}")
        if self.promote_after < 1:
            raise ValueError(f"promote_after must be >= 1, got {self.promote_after}")

    def bytes_to_free(self, used: int, capacity: int, incoming: int) -> int:
        """How much to move out before ``incoming`` more bytes go in (0: nothing)."""
        if used + incoming <= self.high * capacity:
            return 0
        return int(used + incoming - self.low * capacity)

    def victims(self, candidates: Iterable[Candidate], need: int) -> list[Candidate]:
        """The objects to demote to free ``need`` bytes, coldest first.

        Order: unpinned before pinned (moving a pinned object frees nothing
        until its views die), then lower priority, then least recently used.
        O(n log n) in the number of candidates.
        """
        if need <= 0:
            return []
        order = sorted(candidates, key=lambda c: (c.pins > 0, c.priority, c.last_access, -c.block_size))
        out: list[Candidate] = []
        freed = 0
        for c in order:
            if freed >= need:
                break
            out.append(c)
            freed += c.block_size
        return out

    def should_promote(self, access_count: int, nbytes: int, free_above: int) -> bool:
        """Move an object read from a lower tier up?

        Yes once it has been read ``promote_after`` times, and only if it fits
        in the upper tier at all (``free_above``: bytes the upper tier could
        hold after demoting everything colder).
        """
        return access_count >= self.promote_after and nbytes <= free_above
