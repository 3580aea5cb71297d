"""Private buffers of 1 MiB or more, reused after their last view goes.

Faulting in fresh anonymous memory runs at 1.5-5 GiB/s on the machines we measure,
slower than loopback TCP or a memcpy, so a loop that receives or fetches large
values (a rollout worker taking every weight version) would spend much of its time
in page faults if every value got new memory. A buffer handed out here is a cffi
buffer over a pooled private ``mmap``; when the last view of it goes (a received
value, an ndarray or tensor built on it), its destructor puts the mapping back, up
to ``YRCACHE_RECV_POOL`` bytes per process (512 MiB; 0 keeps nothing).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np

from .sizes import env_size
from .tiers.dram import ffi      # the compiled core's: cffi.FFI() would import pycparser (~30 ms)

#: Smaller buffers come from the allocator; pooled ones are rounded up to a multiple of it.
STEP = 1 << 20


class BufferPool:
    """Writable private buffers of ``n`` bytes (``take``), their mappings reused once
    released (at most ``limit`` bytes kept)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pooled = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> Any:
        """A writable buffer of exactly ``n`` bytes (its contents undefined)."""
        size = -(-n // STEP) * STEP
        with self._lock:
            free = self._free.get(size)
            m = free.pop() if free else None
            if m is not None:
                self.pooled -= size
        if m is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(-1, size, flags=flags)
        export = ffi.from_buffer(m)
        ptr = ffi.gc(ffi.cast("char *", export), lambda _p, m=m, export=export: self._give(m, size))
        return ffi.buffer(ptr, n)          # keeps ptr (and so the mapping) alive while referenced

    def _give(self, m: mmap.mmap, size: int) -> None:
        # The list is made before the lock: an object allocated under it could start a
        # garbage collection that frees another pooled buffer, whose destructor would
        # then wait for this lock (appends and ints allocate nothing it tracks).
        fresh: list[mmap.mmap] = []
        with self._lock:
            if self.pooled + size <= self.limit:
                self._free.setdefault(size, fresh).append(m)
                self.pooled += size

    def _forked(self) -> None:
        """In a forked child: a lock another thread of the parent held at the fork would
        never be released here."""
        self._lock = threading.Lock()


try:
    POOL = BufferPool(env_size("YRCACHE_RECV_POOL", 512 << 20))
except ValueError:              # reported by the first cluster store (settings.check_environment)
    POOL = BufferPool(512 << 20)
os.register_at_fork(after_in_child=POOL._forked)


def alloc(n: int) -> Any:
    """A writable private buffer of ``n`` bytes: pooled from 1 MiB, else a bytearray."""
    return bytearray(n) if n < STEP else POOL.take(n)


def empty_array(dtype: Any, shape: tuple) -> np.ndarray:
    """``np.empty(shape, dtype)``, over a pooled buffer from 1 MiB."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < STEP:
        return np.empty(shape, dt)
    return np.frombuffer(POOL.take(n), dt).reshape(shape)


def empty_tensor(torch: Any, dtype: Any, shape: tuple) -> Any:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, over a pooled buffer from 1 MiB."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n < STEP:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(POOL.take(n), dtype=dtype).view(shape)
