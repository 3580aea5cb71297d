"""DRAM tier: one shared-memory arena per store, and the one interface to its C core.

The segment ``/dev/shm/yrcache.<name>`` holds the key index of every tier, the
allocator, the pins, the process table, named words and a robust mutex (C,
``_csrc/``); any process maps it by name and works on it directly.  This is
the only module that calls the C core: the rest of yrcache speaks to an
``Arena``.  Trust, liveness (a lock byte per process slot) and the life
cycle of a mapping: docs/architecture.md, "The arena" and "Security".
"""

from __future__ import annotations

import errno
import json
import os
import threading
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from .._arena import ffi, lib
from .._fast import HotPath
from .. import pinning, stopping
from ..errors import StoreFullError, StoreNotFoundError, YrcacheError
from . import _fork
from ..validate import MAX_KEY_BYTES, wait_seconds
from .dram_types import ANY_SEQ, MREAD_BYTES, POPULATE_MIN, SMALL_READ, ScanRec, damaged, records, split_keys, \
    word_value_error
from .segment import (SHM_DIR, allocate, check_name, check_trusted, creation_done, destroy,  # noqa: F401
                      list_stores, no_room, open_segment, proc_starttime, seg_path, shm_name, unlink_if)

# The C core's constants (one definition, in _csrc/arena.h).
TIER_HBM, TIER_DRAM, TIER_SSD = lib.YR_TIER_HBM, lib.YR_TIER_DRAM, lib.YR_TIER_SSD
FLAG_WANTED = lib.YR_FLAG_WANTED
PIN, QUIET = lib.YR_PIN, lib.YR_QUIET
C_SPILLS, C_PROMOTIONS, C_EVICTIONS = lib.YR_C_SPILLS, lib.YR_C_PROMOTIONS, lib.YR_C_EVICTIONS
MIN_SIZE = lib.yr_arena_min_size()

ERRORS = {lib.YR_ENOTFOUND: "not found", lib.YR_ENOSPC: "the store is full", lib.YR_ENOPINS: "no room left for the pin of another "
          "view; drop references to values you no longer need (each view pins its object)",
          lib.YR_EBADARENA: "not a yrcache arena (or an incompatible version)",
          lib.YR_ENOPROCS: "too many attached processes", lib.YR_ELOCK: "the arena lock is unrecoverable",
          lib.YR_ESTATE: "unexpected object state", lib.YR_ETOOBIG: "object larger than the arena",
          lib.YR_EBUFFER: "buffer too small", lib.YR_ECHANGED: "the object changed"}
_NO_ROOM = (lib.YR_ENOSPC, lib.YR_ETOOBIG)
_HOT = tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, f))) for f in ("yr_read", "yr_put", "yr_mread", "yr_unpin",
                                                                       "yr_mput_small"))


def check(rc: int, what: str, name: str | None = None) -> int:
    if rc == lib.YR_EDAMAGED:
        raise damaged(what, name)
    if rc < 0:
        raise (StoreFullError if rc in _NO_ROOM else YrcacheError)(f"{what} failed: {ERRORS.get(rc, rc)}")
    return rc


class Reservation:
    """A block reserved for an object: fill ``buffer``, then ``commit`` (or ``abort``).

    A context manager: leaving the ``with`` block without a commit (an
    exception while filling, a lost race) aborts, so nothing half-written
    ever becomes visible and the block goes back to the heap.
    """

    __slots__ = ("arena", "block", "payload_off", "nbytes", "done")

    def __init__(self, arena: "Arena", block: int, payload_off: int, nbytes: int):
        self.arena, self.block, self.payload_off, self.nbytes = arena, block, payload_off, nbytes
        self.done = False

    @property
    def buffer(self) -> np.ndarray:
        """The block's payload as a writable flat uint8 array (no copy)."""
        return np.frombuffer(ffi.buffer(self.arena.cbase + self.payload_off, self.nbytes), dtype=np.uint8)

    def fill_from(self, src: Any) -> None:
        """Copy a contiguous buffer of ``nbytes`` into the block (memcpy, the GIL released)."""
        if self.nbytes:
            lib.yr_memcpy(self.arena.cbase + self.payload_off, ffi.from_buffer(src), self.nbytes)

    def commit(self, expected: int = ANY_SEQ):
        """Publish the object; what it replaced (this thread's scratch ``yr_retired``,
        valid until its next call), or None if the key is no longer ``expected``."""
        a = self.arena
        out = _scratch()[1]
        rc = lib.yr_commit(a.base, a.slot, self.block, expected, out)
        if rc == lib.YR_ECHANGED:     # still reserved: the caller's ``with`` (or abort()) frees it
            return None
        check(rc, "commit", a.name)
        self.done = True
        return out

    def abort(self) -> None:
        if not self.done:
            self.done = True
            lib.yr_abort(self.arena.base, self.arena.slot, self.block)

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class Word:
    """A named word of the arena: a 64-bit value and a wake-up counter.  ``wait(seen, timeout)`` sleeps
    on a futex until the counter differs from ``seen`` (read ``seq`` first); ``wake()`` bumps it and
    wakes every process waiting.  No lock, no lookup, no syscall unless someone sleeps."""

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
            raise word_value_error(expected, desired) from None

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Sleep until ``seq`` differs from ``seen``; False on timeout (``validate.wait_seconds``)."""
        t = wait_seconds(timeout)
        rc = lib.yr_futex_wait(ffi.addressof(self.ptr, "seq"), seen, -1.0 if t is None else t)
        if rc < 0:
            raise OSError(-rc, f"waiting on a word: {os.strerror(-rc)}")
        return rc == 0

    def wake(self) -> None:
        lib.yr_futex_wake(ffi.addressof(self.ptr, "seq"))


_tls = threading.local()


def _scratch():
    """Per-thread out-structs for the hot paths (ffi.new costs more than the C call)."""
    try:
        return _tls.s
    except AttributeError:
        small = ffi.new("char[]", SMALL_READ)
        _tls.s = (ffi.new("yr_desc *"), ffi.new("yr_retired *"), ffi.new("uint64_t *"),
                  ffi.new("yr_objinfo *"), small, ffi.new("char[]", MREAD_BYTES), ffi.buffer(small))
        return _tls.s


class Arena:
    """A process's mapping of one store's arena: its slot, its pins, and the
    object operations of the C core.  Thread-safe: the C core serialises on
    the arena's robust mutex; the Python-side pin book is guarded by a lock.
    """

    def __init__(self, name: str, *, create: bool = False, size: int = 0,
                 prefault: bool = True, huge_pages: bool = False, nprocs: int = 1024,
                 npins: int | None = None):
        self.name = check_name(name)
        self.path = seg_path(name)
        self._lock = threading.Lock()
        self.mapped = self.persist = self.attached_here = False
        self._fd = -1
        self._slot = 0
        self.pid = 0
        self.prefaulted = bool(prefault)
        self.huge_pages = bool(huge_pages)
        fd, self.created = open_segment(name, create, size)
        self._fd = fd
        try:
            st = os.fstat(fd)
            check_trusted(st, self.path)
            self.size = st.st_size
            self._ident = (st.st_dev, st.st_ino)   # the name may later point elsewhere
            if not self.size and not self.created:  # its creator has made it, not sized it yet
                raise StoreNotFoundError(f"{self.path} is being created (no size yet); if no process is "
                                         f"creating it, remove it with `yrcache destroy {name}`")
            # tmpfs: a first-touch write costs ~10x a write to a resident page, so the creator
            # faults the arena in once, here; an attacher may map it up front (~0.14 s per GiB).
            self.base = self._map_new(prefault) if self.created else lib.yr_map(fd, self.size, int(prefault))
            if self.base == ffi.NULL:
                raise YrcacheError(f"could not map store {name!r} ({self.size} bytes)")
            self.addr = int(ffi.cast("uintptr_t", self.base))
            self.cbase = ffi.cast("char *", self.base)
            self.hot = HotPath(*_HOT, self.addr, MAX_KEY_BYTES, SMALL_READ)   # a small get or put in one C call
            self.hot.anchor = weakref.ref(self)   # the views it builds hold this Arena (and the mapping)
            self.mapped = True
            if self.created:
                if npins is None:
                    npins = max(1024, min(1 << 22, size // 4096))   # 16 B each; more grow on demand
                check(lib.yr_arena_init(self.base, self.size, nprocs, npins), "arena init")
            elif lib.yr_arena_check(self.base, self.size) != 0:
                raise StoreNotFoundError(
                    f"{self.path} is not a usable yrcache store (being created, damaged, or from an "
                    f"incompatible version); remove it with `yrcache destroy {name}`"
                )
            self.is_owner = self.created
            if self.created:
                stopping.watch(self)
            self.register()
            creation_done(fd)
        except BaseException:
            self._unmap()
            if self.created:
                unlink_if(self.name, getattr(self, "_ident", None))
            raise
        self.capacity = self.stats().capacity          # heap bytes
        # views made by this process: pin -> block offset (re-pinned after fork)
        self.views: dict[int, int] = {}
        self.remap: dict[tuple[int, int], int] = {}
        self.handle = True   # the store handle; views hold the Arena object itself
        self._words: dict[str, Word] = {}
        _fork.ARENAS.add(self)

    def _map_new(self, prefault: bool):
        """Map a new segment with all its memory given to it now, so that an
        over-committed /dev/shm fails here with StoreFullError, not later
        with SIGBUS at the first write (tmpfs allocates pages lazily).  Huge
        pages are asked for before the pages are made, through the mapping
        (fallocate would make small ones)."""
        if prefault or self.huge_pages:
            base = lib.yr_map(self._fd, self.size, 0)
            if base == ffi.NULL:
                return base
            if self.huge_pages:
                lib.yr_advise_huge(base, self.size)
            rc = lib.yr_populate_write(base, self.size)
            if rc == 0:
                return base
            lib.yr_unmap(base, self.size)
            if rc != -errno.EINVAL:     # EINVAL: a kernel without MADV_POPULATE_WRITE
                raise no_room(self.name, self.size, "its pages could not be allocated" if rc in (-errno.EFAULT, -errno.ENOMEM)
                                    else os.strerror(-rc))
        allocate(self._fd, self.name, self.size)
        return lib.yr_map(self._fd, self.size, int(prefault))

    # ------------------------------------------------------------ settings

    def read_config(self) -> dict | None:
        data = ffi.string(lib.yr_config_area(self.base), lib.YR_CONFIG_BYTES)
        return json.loads(data) if data else None

    def write_config(self, config: dict) -> None:
        data = json.dumps(config).encode()
        if len(data) >= lib.YR_CONFIG_BYTES:
            raise ValueError(f"store settings too long ({len(data)} bytes); use a shorter ssd= path")
        ffi.memmove(lib.yr_config_area(self.base), data + b"\x00", len(data) + 1)

    # -------------------------------------------------------------- slots

    def register(self) -> None:
        """Take a process slot (and its lock byte) for this process."""
        self.sweep()
        slot = lib.yr_proc_attach(self.base, self._fd, os.getpid(), proc_starttime(), int(self.is_owner))
        if slot < 0:
            raise YrcacheError(f"store {self.name!r} has no free process slot (all attached); "
                               "close stores in processes that no longer need them")
        self._slot = self.hot.slot = slot
        self.pid = os.getpid()
        self.attached_here = True
        _fork.install_exit_hook()

    def _own_slot(self) -> int:
        return self._slot if self.pid == os.getpid() else 0

    def sweep(self) -> int:
        """Reclaim the slots of dead processes (their pins, unfinished puts and
        HBM stubs): those whose lock byte nobody holds.  Returns how many."""
        return max(0, lib.yr_proc_sweep(self.base, self._fd, self._own_slot()))

    def attached(self) -> list[tuple[int, int, bool]]:
        """(slot, pid, is_owner) of every live attached process slot."""
        n = 1024
        buf = ffi.new("yr_procinfo[]", n)
        cnt = lib.yr_proc_list(self.base, self._fd, self._own_slot(), buf, n)
        return [(i, buf[i].pid, bool(buf[i].is_owner)) for i in range(1, max(cnt, 0)) if buf[i].alive]

    def take_ownership(self) -> None:
        """Become the owner (of a store whose owner died)."""
        self.is_owner = True
        lib.yr_proc_set_owner(self.base, self.slot, 1)
        stopping.watch(self)

    @property
    def slot(self) -> int:
        """This process's slot; a forked child takes its own on first use."""
        if self.pid != _fork.PID:
            with self._lock:
                if self.pid != os.getpid():
                    self.register()
        return self._slot

    # --------------------------------------------------------------- pins

    def pinned_buffer(self, offset: int, nbytes: int, pin: int, block: int):
        """A buffer over ``nbytes`` at ``offset`` that unpins ``pin`` when the
        last view built on it dies (its closure keeps this mapping alive)."""
        self.views[pin] = block
        pid = _fork.PID
        ptr = ffi.gc(self.cbase + offset, lambda _p: self._release(pid, pin))
        return ffi.buffer(ptr, nbytes)

    def _release(self, pid: int, pin: int) -> None:
        try:
            if pid != _fork.PID:   # a view inherited across fork: release our own pin
                pin = self.remap.pop((pid, pin), 0)
                if not pin:
                    return
            if self.attached_here:   # after a detach at exit the pin is no longer ours
                lib.yr_unpin(self.base, pin)
                self.views.pop(pin, None)
        except Exception:  # interpreter shutdown: the process's death frees the pin
            pass

    def unpin(self, pin: int) -> None:
        lib.yr_unpin(self.base, pin)

    def pin_block(self, block: int) -> int:
        """One more pin on a live or orphaned block (>0), or an error (<0)."""
        return lib.yr_pin_block(self.base, self._slot, block)

    def transfer_pin(self, pin: int, from_slot: int) -> bool:
        return lib.yr_pin_transfer(self.base, pin, from_slot, self._slot) == 0

    # ------------------------------------------------------------ objects

    def reserve(self, kb: bytes, meta: bytes, nbytes: int, *, priority: int = 0, expire_at: float = 0.0,
                tier: int = TIER_DRAM, holder: int = 0, gen: int = 0,
                access_count: int = 0) -> Reservation | None:
        """Reserve a block for an object (with room for its payload when it
        lives here, a stub otherwise); None when no block fits."""
        alloc = nbytes if tier == TIER_DRAM else 0
        d, _, poff = _scratch()[:3]
        d.alloc_bytes, d.nbytes, d.priority, d.expire_at = alloc, nbytes, priority, expire_at
        d.access_count, d.gen, d.tier, d.holder = access_count, gen, tier, holder
        off = lib.yr_reserve(self.base, self.slot, kb, len(kb), meta, len(meta), d, poff)
        if off in _NO_ROOM:
            return None
        check(off, "reserve", self.name)
        if alloc >= POPULATE_MIN and not self.prefaulted:
            lib.yr_populate(self.cbase + poff[0], alloc, 1)
        return Reservation(self, off, poff[0], alloc)

    def fits(self, kb: bytes, meta: bytes, nbytes: int) -> bool:
        """Could this object ever be stored here (its smallest block fits the empty heap)?"""
        return bool(lib.yr_fits(self.base, len(kb), len(meta), nbytes))

    def advise_huge(self) -> bool:
        """Ask for transparent huge pages on this mapping (``MADV_HUGEPAGE``); True if taken.  They
        back it only where /dev/shm is mounted ``huge=advise``/``within_size``/``always``."""
        self.huge_pages = lib.yr_advise_huge(self.base, self.size) == 0
        return self.huge_pages

    def populate(self, addr: int, nbytes: int, write: bool = False) -> bool:
        """Map the pages of ``[addr, addr + nbytes)`` now if they lie in this
        arena and this mapping was not prefaulted; True if it did."""
        if self.prefaulted or nbytes < POPULATE_MIN or not self.addr <= addr < self.addr + self.size:
            return False
        nbytes = min(nbytes, self.addr + self.size - addr)
        return lib.yr_populate(self.cbase + (addr - self.addr), nbytes, int(write)) == 0

    def put(self, kb: bytes, meta: bytes, data: Any, nbytes: int, priority: int, expire_at: float) -> Any:
        """Store a DRAM value from a buffer in one call (the copy of a large one
        runs outside the arena lock, without the GIL); what it replaced, or None
        when no block fits."""
        out = _scratch()[1]
        populate = nbytes >= POPULATE_MIN and not self.prefaulted
        rc = lib.yr_put(self.base, self.slot, kb, len(kb), meta, len(meta),
                        ffi.from_buffer(data) if nbytes else ffi.NULL, nbytes, priority, expire_at, populate, out)
        if rc in _NO_ROOM:
            return None
        check(rc, "put", self.name)
        return out

    def mput_small(self, batch: list, priority: int, expire_at: float) -> tuple[int, int]:
        """Store (key, meta, payload, nbytes) rows, each payload one contiguous buffer of nbytes, 256
        per lock hold, until one does not fit: (how many stored, how many replaced a lower tier's)."""
        _ = self.slot                    # a forked child takes its own slot first (the C call needs it)
        got = self.hot.mput(batch, priority, expire_at)     # one C call, no cffi marshalling
        return got if isinstance(got, tuple) else (check(got, "mset", self.name), 0)

    def get(self, kb: bytes, flags: int = PIN, info=None):
        """Look ``kb`` up: a ``yr_objinfo`` (pinned with PIN), or None when missing.

        Without ``info`` the result is this thread's scratch record, valid
        until the thread's next lookup: copy it (``copy_info``) to keep it.
        """
        if info is None:
            info = _scratch()[3]
        rc = lib.yr_get(self.base, self.slot, kb, len(kb), flags, info)
        if rc == lib.YR_ENOTFOUND:
            return None
        check(rc, "get", self.name)
        return info

    def mread(self, kbs: list[bytes], small: bool = True) -> tuple[Any, Any, bytes]:
        """Read several keys in one lock hold: (infos, found, copied), ``found[i]``
        0 (missing), 1 (pinned, as ``get``) or 2 (a small DRAM object copied into
        ``copied`` at ``infos[i].meta_off`` (header) and ``.payload_off``)."""
        n = len(kbs)
        infos, found, buf = ffi.new("yr_objinfo[]", n), ffi.new("int32_t[]", n), _scratch()[5]
        used = check(lib.yr_mread(self.base, self.slot, b"".join(kbs), [len(k) for k in kbs], n, infos, found,
                                  buf, MREAD_BYTES, SMALL_READ if small else 0, 0), "mget", self.name)
        return infos, found, ffi.unpack(buf, used) if used else b""

    def read(self, kb: bytes, small: bool = True) -> tuple[Any, bytes | None] | None:  # type: ignore[return]  # check() raises
        """A read of ``kb``: None when missing, else (info, copy) where ``copy``
        is the codec header and payload of a small DRAM object (``bytes``, no pin
        taken), or None when ``info`` is a pinned lookup (the scratch record, as
        ``get``'s)."""
        scratch = _scratch()
        info = scratch[3]
        rc = lib.yr_read(self.base, self.slot, kb, len(kb), info, scratch[4], SMALL_READ if small else 0, 0)
        if rc == 1:
            return info, scratch[6][:info.meta_len + info.nbytes]   # bytes (a slice of ffi.buffer)
        if rc == 0:
            return info, None
        if rc == lib.YR_ENOTFOUND:
            return None
        check(rc, "read", self.name)

    @staticmethod
    def copy_info(info):
        """A private copy of a lookup result (the scratch one is reused)."""
        out = ffi.new("yr_objinfo *")
        out[0] = info[0] if ffi.typeof(info).kind == "pointer" else info   # a record of mget's array
        return out

    def peek(self, kb: bytes) -> tuple[Any, bytes] | None:
        """(info, codec header) of ``kb`` without a pin or a read counted; None when missing."""
        info = ffi.new("yr_objinfo *")
        meta = ffi.new("char[]", 4096)
        rc = lib.yr_peek(self.base, kb, len(kb), info, meta, 4096)
        if rc == lib.YR_ENOTFOUND:
            return None
        check(rc, "peek", self.name)
        return info, ffi.buffer(meta, info.meta_len)[:]

    def meta(self, info) -> bytes:
        """The codec header of a pinned lookup."""
        return ffi.buffer(self.cbase + info.meta_off, info.meta_len)[:]

    def payload(self, info) -> np.ndarray:
        """The payload of a pinned lookup as a flat uint8 array (valid while pinned)."""
        return np.frombuffer(ffi.buffer(self.cbase + info.payload_off, info.nbytes), dtype=np.uint8)

    def contains(self, kb: bytes) -> bool:
        return check(lib.yr_contains(self.base, kb, len(kb)), "contains", self.name) == 1

    def delete(self, kb: bytes, expected: int = ANY_SEQ) -> tuple[bool, Any]:
        """Remove ``kb`` (if still the object ``expected``): (whether a live object was deleted, what left
        the index -- an expired object too, not counted as deleted; valid until this thread's next call)."""
        out = _scratch()[1]
        rc = lib.yr_delete(self.base, kb, len(kb), expected, out)
        return rc != lib.YR_ENOTFOUND and check(rc, "delete", self.name) == 0, out

    def set_flags(self, kb: bytes, seq: int, set: int = 0, clear: int = 0) -> bool:
        return lib.yr_set_flags(self.base, kb, len(kb), seq, set, clear) == 0

    def count(self, which: int, n: int = 1) -> None:
        lib.yr_count(self.base, which, n)

    def expire(self, now: float) -> int:
        return lib.yr_expire(self.base, now)

    def stats(self):
        out = ffi.new("yr_stats *")
        check(lib.yr_get_stats(self.base, out), "stats", self.name)
        return out

    @property
    def used(self) -> int:
        """Bytes in allocated blocks, read without the lock."""
        return lib.yr_used(self.base)

    def check_invariants(self) -> str | None:
        msg = ffi.new("char[256]")
        return ffi.string(msg).decode() if lib.yr_check_invariants(self.base, msg, 256) else None

    # ----------------------------------------------------------- iteration

    def keys(self, prefix: bytes = b"", alive: Callable[[], None] = lambda: None) -> Iterator[str]:
        """Keys starting with ``prefix`` in byte order from the sorted index: at most 128 per lock hold,
        each batch a logarithmic search plus its matches; ``alive()`` runs before each batch and key (may raise)."""
        after, size = b"", MREAD_BYTES
        while True:
            alive()
            _, _, more, _, _, buf = _scratch()[:6]      # parsed before we yield: reusable
            n = lib.yr_keys(self.base, prefix, len(prefix), after, len(after), buf, size, 128, more)
            check(n, "keys", self.name)
            out, last = split_keys(ffi.buffer(buf, size), n), not more[0]
            for k in out:
                alive()                     # (resumed after a close: raise, as the next batch would)
                yield k.decode()
            if last:
                return
            after = out[-1]

    def scan(self, tiers: int = ~0) -> Iterator[tuple[ScanRec, str]]:
        """(record, key) of every live object whose tier is in the bit mask
        ``tiers`` (e.g. ``1 << TIER_SSD``), filtered in C, a batch per lock hold."""
        cursor = ffi.new("uint64_t *", 0)
        need = ffi.new("uint64_t *")
        nrec, kbuf = 4096, 1 << 20
        recs = ffi.new("yr_scanrec[]", nrec)
        keys = ffi.new("char[]", kbuf)
        while True:
            n = lib.yr_scan(self.base, cursor, tiers & 0xFFFFFFFF, recs, nrec, keys, kbuf, need)
            if n == lib.YR_EBUFFER:
                nrec, kbuf = max(nrec, need[0]) * 2, max(kbuf, need[0]) * 2
                recs = ffi.new("yr_scanrec[]", nrec)
                keys = ffi.new("char[]", kbuf)
                continue
            check(n, "scan", self.name)
            yield from records(recs, ffi.buffer(keys, kbuf), n)   # copied out: the buffers are reused
            if cursor[0] == 0:
                return

    def drain_retired(self, tiers: int, free: Callable[[ScanRec], Any]) -> int:
        """``free(record)`` the bytes of each retired object of ``tiers`` this
        process must serve, then drop their stubs (a process killed in between
        leaves them listed: the next drain frees again).  O(1) if none pending."""
        recs, keys, n, done = ffi.new("yr_scanrec[]", 256), ffi.new("char[]", 256 * 1024), 256, 0
        while n == 256 and lib.yr_retired_pending(self.base):
            n = check(lib.yr_drain_retired(self.base, self.slot, tiers, recs, 256, keys, 256 * 1024), "drain", self.name)
            batch = records(recs, ffi.buffer(keys, 256 * 1024), n)
            for rec, _key in batch:
                free(rec)
            lib.yr_release_retired(self.base, [rec.gen for rec, _key in batch], n)
            done += n
        return done

    def retired_pending(self) -> int:
        return lib.yr_retired_pending(self.base)

    # -------------------------------------------------------------- words

    def word(self, name: str) -> Word:
        """The named word ``name`` (created on first use), cached per mapping."""
        w = self._words.get(name)
        if w is None:
            off = lib.yr_word_at(self.base, name.encode(), len(name.encode()))
            check(off, f"word {name!r}", self.name)
            w = self._words[name] = Word(self, off)
        return w

    # ----------------------------------------------------------- closing
    def release_handle(self) -> None:
        """The store handle is done.  The owner unlinks the segment's name
        (unless the store persists): processes still attached keep their
        mappings, new attaches fail.  The mapping itself goes when nothing in
        this process refers to this Arena any more (see ``__del__``)."""
        if self.handle:
            self.handle = False
            if self.is_owner and not self.persist:
                self.unlink()

    def detach(self) -> None:
        """Give the process slot back (its pins with it).  Views of this
        process must not be used afterwards: only for exit and finalisation."""
        with self._lock:
            if self.mapped and self.attached_here and self.pid == os.getpid():
                self.attached_here = False
                self.hot.slot = 0
                lib.yr_proc_detach(self.base, self._fd, self._slot)

    def _unmap(self) -> None:
        if self.mapped:
            self.mapped = False
            self.hot.close()
            pinning.unregister(self)      # CUDA's registration must not outlive the mapping
            lib.yr_unmap(self.base, self.size)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> bool:
        """Remove the segment's name if it still names *this* segment.  (A store destroyed and
        created again under the same name is another segment; an old handle must not unlink it.)"""
        return unlink_if(self.name, self._ident)

    def __del__(self):
        # Reached when no handle, view or running operation refers to us.
        try:
            if self.handle:
                self.release_handle()
            self.detach()
            self._unmap()
        except Exception:
            pass

