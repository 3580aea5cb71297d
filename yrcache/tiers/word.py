"""A named word of the arena (``TieredStore.word``): a 64-bit value and a wake-up counter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._arena import ffi, lib

if TYPE_CHECKING:
    from .dram import Arena

__all__ = ["Word"]


class Word:
    """A named word of the arena: a 64-bit value and a wake-up counter.

    ``wait(seen, timeout)`` sleeps on a futex until the counter differs from
    ``seen`` (read it first with ``seq``); ``wake()`` bumps it and wakes every
    process waiting.  No lock, no lookup, no syscall unless someone sleeps.
    """

    __slots__ = ("arena", "ptr")

    def __init__(self, arena: "Arena", off: int):
        self.arena = arena          # keeps the mapping alive
        self.ptr = ffi.cast("yr_word *", arena.cbase + off)

    @property
    def seq(self) -> int:
        return self.ptr.seq

    @property
    def value(self) -> int:
        return self.ptr.value

    def cas(self, expected: int, desired: int) -> bool:
        """Set ``value`` to ``desired`` if it is ``expected`` (atomically); both are 0..2**64-1."""
        try:
            return bool(lib.yr_word_cas(self.ptr, expected, desired))
        except (OverflowError, TypeError):
            for what, v in (("expected", expected), ("desired", desired)):
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
                    raise ValueError(f"a word holds an unsigned 64-bit value: {what} must be an int in "
                                     f"0..2**64-1, got {v!r}") from None
            raise

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Sleep until ``seq`` differs from ``seen``; False on timeout."""
        rc = lib.yr_futex_wait(ffi.addressof(self.ptr, "seq"), seen,
                               -1.0 if timeout is None else max(timeout, 0.0))
        return rc != 1

    def wake(self) -> None:
        lib.yr_futex_wake(ffi.addressof(self.ptr, "seq"))
