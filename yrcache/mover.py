"""Moving objects between the DRAM arena and the SSD tier.

An object spilled to SSD keeps a *stub* in the arena's index: a block with
no payload that records the object's size, codec header, priority, TTL,
access count and the generation of its disk copy.  So the arena stays the
one index every process shares: ``in``, ``len``, ``keys`` and ``tier_of``
never touch the disk, and reads from every process count towards promotion.

Every move is a copy followed by a *conditional* commit in the arena: the
stub (spill) or the full block (promotion) replaces the object only if the
object's sequence number is still the one that was copied.  A concurrent
overwrite or delete wins, and the copy made for the move is thrown away, so
a move never resurrects an old value.  Disk copies are named
``<generation>/<key>``; a crash between the disk write and the commit leaves
an unreferenced generation that ``vacuum()`` removes.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Iterator, NamedTuple

import numpy as np

from ._arena import ffi, lib
from .errors import CorruptObjectError, StoreClosedError, StoreFullError
from .policy import Candidate, Policy
from .tiers import shm

TIER_DRAM = 1
TIER_SSD = 2
TIER_HBM = 3
ANY_SEQ = (1 << 64) - 1
C_SPILLS, C_PROMOTIONS, C_EVICTIONS = 4, 5, 6
HBM_DONE, HBM_REQ = 14, 15     # futex words: "a demotion happened", "please demote"
WANTED = 1                     # an HBM stub's generation word when a reader waits


def key_repr(kb: bytes) -> str:
    return repr(kb[:60].decode(errors="replace"))


def disk_key(gen: int, key: str) -> str:
    return f"{gen:016x}/{key}"


def split_disk_key(dk: str) -> tuple[int, str] | None:
    head, sep, key = dk.partition("/")
    if not sep or len(head) != 16:
        return None
    try:
        return int(head, 16), key
    except ValueError:
        return None


def new_gen() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1 or 1


class ScanRec(NamedTuple):
    """What the arena's index says about one object (a copy)."""

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
    owner: int


class Unlinker:
    """One daemon thread that removes files off the caller's path.

    It runs nothing but ``os.unlink`` (which releases the GIL), so it does not
    slow the threads that wait on it.  Re-created lazily after a fork.
    """

    def __init__(self):
        self._q: queue.Queue | None = None
        self._pid = 0

    def submit(self, path: str) -> None:
        if self._q is None or self._pid != os.getpid():
            self._q, self._pid = queue.Queue(), os.getpid()
            threading.Thread(target=self._run, args=(self._q,), name="yrcache-unlink", daemon=True).start()
        self._q.put(path)

    @staticmethod
    def _run(q: queue.Queue) -> None:
        while True:
            path = q.get()
            try:
                os.unlink(path)
            except OSError:
                pass
            q.task_done()

    def join(self) -> None:
        if self._q is not None and self._pid == os.getpid():
            self._q.join()


def scan(a: shm.Arena, tier: int | None = None) -> Iterator[tuple[Any, str]]:
    """(scan record, key) of every live object (of ``tier``), a bucket batch per lock hold."""
    cursor = ffi.new("uint64_t *", 0)
    nrec, kbuf = 4096, 1 << 20
    recs = ffi.new("yr_scanrec[]", nrec)
    keys = ffi.new("char[]", kbuf)
    while True:
        n = lib.yr_scan(a.base, cursor, recs, nrec, keys, kbuf)
        if n < -1000:
            kbuf = max(kbuf * 2, -(n + 1000))
            nrec *= 2
            recs = ffi.new("yr_scanrec[]", nrec)
            keys = ffi.new("char[]", kbuf)
            continue
        shm.check(n, "scan")
        raw = ffi.buffer(keys, kbuf)
        batch = []
        for i in range(n):
            r = recs[i]
            if tier is None or r.tier == tier:
                k = raw[r.key_pos:r.key_pos + r.klen]
                if not k.startswith(b"\x00"):
                    batch.append((ScanRec(r.seq, r.nbytes, r.block_size, r.priority, r.access_count,
                                          r.last_access, r.expire_at, r.tier, r.pins, r.gen, r.owner),
                                  k.decode()))
        yield from batch   # copied out: the buffers are reused for the next batch
        if cursor[0] == 0:
            return


class Mover:
    """Spills, promotions and evictions for one store handle."""

    def __init__(self, arena: shm.Arena, disk, policy: Policy, cache: bool, hbm=None):
        self._arena: shm.Arena | None = arena
        self.disk = disk          # DiskTier or None
        self.policy = policy
        self.cache = cache        # may drop cold objects when nothing else helps
        self.hbm = hbm            # DeviceTier of this process, or None
        self.unlinker = Unlinker()
        self._drain_bufs = None

    @property
    def a(self) -> shm.Arena:
        a = self._arena
        if a is None:
            raise StoreClosedError("the store was closed while this operation ran; attach again")
        return a

    # ------------------------------------------------------ retire channel

    def drain(self, wake_others: bool = True) -> int:
        """Free the lower-tier bytes of stubs that left the arena's index.

        Every retirement of an SSD or HBM object (overwrite, delete, eviction,
        expiry found anywhere, even inside the C core) puts its stub on the
        arena's retire list; this takes the entries this process can serve
        (SSD copies; its own device tensors), frees their bytes and the
        stubs.  O(1) when nothing is pending.  Returns how many were freed.
        """
        a = self.a
        if not lib.yr_retired_pending(a.base):
            return 0
        tiers = (1 << TIER_SSD if self.disk is not None else 0) | (1 << TIER_HBM if self.hbm is not None else 0)
        if self._drain_bufs is None:
            self._drain_bufs = (ffi.new("yr_scanrec[]", 256), ffi.new("char[]", 256 * 1024))
        recs, keys = self._drain_bufs
        done = 0
        while True:
            n = shm.check(lib.yr_drain_retired(a.base, a.slot, tiers, recs, 256, keys, 256 * 1024), "drain")
            raw = ffi.buffer(keys, 256 * 1024)
            for i in range(n):
                r = recs[i]
                key = raw[r.key_pos:r.key_pos + r.klen].decode()
                if r.tier == TIER_SSD:
                    self.disk.delete(disk_key(r.gen, key))
                else:
                    self.hbm.drop(key, r.seq)
            done += n
            if n < 256:
                break
        if wake_others and lib.yr_retired_pending(a.base):
            a.notify_wake(HBM_REQ)   # device tensors of other processes: their owners drop them
        return done

    def reclaim_expired(self) -> None:
        """Retire expired objects now, in every tier (before concluding a tier is full)."""
        a = self.a
        lib.yr_expire(a.base, time.time())
        self.drain()
        if self.disk is not None:
            self.disk.purge_expired()

    # --------------------------------------------------------------- demote

    def candidates(self) -> list[Candidate]:
        return [Candidate(k, r.seq, r.nbytes, r.block_size, r.priority, r.access_count,
                          r.last_access, r.pins) for r, k in scan(self.a, TIER_DRAM)]

    def make_room(self, incoming: int, max_priority: int | None = None, evict: bool = True) -> None:
        """Demote cold objects if ``incoming`` bytes would pass the high watermark
        (only objects of at most ``max_priority``, when given; dropping none
        unless ``evict``)."""
        if self.disk is None and not self.cache:
            return
        self.drain()
        st = ffi.new("yr_stats *")
        lib.yr_get_stats(self.a.base, st)
        need = self.policy.bytes_to_free(st.used, st.capacity, incoming)
        if need:
            for _ in self.demote_each(need, max_priority, evict):
                pass

    def demote(self, need: int) -> int:
        """Move (or, in cache mode with no SSD room, drop) about ``need`` bytes out of DRAM."""
        freed = 0
        for got in self.demote_each(need):
            freed += got
        return freed

    def demote_each(self, need: int | None = None, max_priority: int | None = None,
                    evict: bool = True) -> Iterator[int]:
        """Demote victims coldest first, yielding the bytes freed after each.

        A caller that only needs one block to fit stops as soon as it does,
        so fragmentation costs an extra victim, not the whole tier.
        """
        if self.disk is None and not self.cache:
            return
        self.drain()
        cands = [c for c in self.candidates() if max_priority is None or c.priority <= max_priority]
        for c in self.policy.victims(cands, need if need is not None else sum(x.block_size for x in cands)):
            got = 0
            if self.disk is not None:
                try:
                    got = self.spill(c, evict)
                except StoreFullError:
                    if not (self.cache and evict):
                        return
            if not got and self.cache and evict:
                got = self.evict(c)
            if got:
                yield got

    def spill(self, c: Candidate, evict: bool = True) -> int:
        """Copy one DRAM object to SSD and replace it by a stub; bytes freed (0: lost a race)."""
        a = self.a
        kb = c.key.encode()
        info = ffi.new("yr_objinfo *")
        if lib.yr_get(a.base, a.slot, kb, len(kb), 3, info) != 0:
            return 0
        try:
            if info.seq != c.seq or info.tier != TIER_DRAM:
                return 0
            meta = bytes(ffi.buffer(a.cbase + info.meta_off, info.meta_len))
            src = np.frombuffer(ffi.buffer(a.cbase + info.payload_off, info.nbytes), dtype=np.uint8)
            if self.cache and evict and self.disk.used + info.nbytes > self.disk.capacity:
                self.evict_from_ssd(self.disk.used + info.nbytes - self.disk.capacity)
            gen = new_gen()
            dk = disk_key(gen, c.key)
            stub = self.reserve_stub(kb, meta, info, gen)
            if stub <= 0:
                return 0
            try:
                self.put_on_disk(dk, meta, src, int(info.priority), info.expire_at)
            except BaseException:
                lib.yr_abort(a.base, a.slot, stub)
                raise
            if not self.commit_stub(stub, expected=c.seq):
                self.disk.delete(dk)
                return 0
        finally:
            a.unpin(info.pin)
        lib.yr_count(a.base, C_SPILLS, 1)
        return c.block_size

    def put_on_disk(self, dk: str, meta: bytes, payload, priority: int, expire_at: float) -> None:
        try:
            self.disk.put(dk, meta, payload, priority=priority, expire_at=expire_at or None)
        except StoreFullError:
            self.reclaim_expired()    # expired objects may still hold SSD room
            self.disk.put(dk, meta, payload, priority=priority, expire_at=expire_at or None)

    def reserve_stub(self, kb: bytes, meta: bytes, info, gen: int) -> int:
        """Reserve the SSD stub of an object *before* its disk copy is written:
        if this process dies before the commit, the sweep puts the stub on the
        retire list and the copy goes with it.  The block, or <= 0."""
        a = self.a
        poff = ffi.new("uint64_t *")
        return lib.yr_reserve_ex(a.base, a.slot, kb, len(kb), meta, len(meta), 0, info.nbytes,
                                 info.priority, info.expire_at, TIER_SSD, 0, gen, info.access_count, poff)

    def commit_stub(self, stub: int, expected: int) -> bool:
        """Publish a reserved stub if the object is still ``expected``; else drop it."""
        a = self.a
        retired = ffi.new("yr_retired *")
        if lib.yr_commit_ex(a.base, a.slot, stub, expected, retired) != 0:
            lib.yr_abort(a.base, a.slot, stub)
            return False
        self.drain()     # what the stub replaced, in any tier
        return True

    def evict(self, c: Candidate) -> int:
        """Drop one object (cache mode only); bytes freed."""
        retired = ffi.new("yr_retired *")
        kb = c.key.encode()
        if lib.yr_delete_ex(self.a.base, kb, len(kb), c.seq, retired) != 0:
            return 0
        self.drain()
        lib.yr_count(self.a.base, C_EVICTIONS, 1)
        return c.block_size

    def evict_from_ssd(self, need: int) -> int:
        """Cache mode: drop the coldest SSD objects until ``need`` bytes are free there."""
        cands = [Candidate(k, r.seq, r.nbytes, r.nbytes, r.priority, r.access_count, r.last_access, 0)
                 for r, k in scan(self.a, TIER_SSD)]
        freed = 0
        for c in self.policy.victims(cands, need):
            freed += self.evict(c)
        return freed

    # ------------------------------------------------------------------ HBM

    def reserve_dram(self, kb: bytes, meta: bytes, nbytes: int, priority: int, expire_at: float,
                     access_count: int, max_priority: int | None = None,
                     evict: bool = True) -> tuple[int, int]:
        """Reserve a DRAM block, demoting colder objects (of at most
        ``max_priority``) if needed; (block, payload offset)."""
        a = self.a
        poff = ffi.new("uint64_t *")
        self.make_room(nbytes + len(kb) + len(meta) + 256, max_priority, evict)

        def attempt() -> int:
            off = lib.yr_reserve_ex(a.base, a.slot, kb, len(kb), meta, len(meta), nbytes, nbytes,
                                    priority, expire_at, TIER_DRAM, 0, 0, access_count, poff)
            if off <= 0 and off not in (lib.YR_ENOSPC, lib.YR_ETOOBIG):
                shm.check(off, "reserve")
            return off

        off = attempt()
        if off == lib.YR_ENOSPC:
            for _ in self.demote_each(None, max_priority, evict):
                off = attempt()
                if off != lib.YR_ENOSPC:
                    break
        if off > 0:
            return off, poff[0]
        raise StoreFullError(f"no DRAM room to move {key_repr(kb)} ({nbytes} bytes) out of HBM; "
                             "raise dram= or configure ssd=")

    def hbm_stubs(self) -> dict[str, Any]:
        """Scan records of the HBM stubs this process owns."""
        slot = self.a.slot
        return {k: r for r, k in scan(self.a, TIER_HBM) if r.owner == slot}

    def demote_hbm(self, need: int, max_priority: int | None = None) -> int:
        """Move about ``need`` bytes of cold tensors (of at most ``max_priority``) from HBM to DRAM."""
        stubs = self.hbm_stubs()
        cands = [Candidate(k, r.seq, r.nbytes, r.nbytes, r.priority, r.access_count, r.last_access, 0)
                 for k, r in stubs.items() if max_priority is None or r.priority <= max_priority]
        if max_priority is not None and sum(c.block_size for c in cands) < need:
            return 0   # it would take moving an object that matters more
        freed = 0
        for c in self.policy.victims(cands, need):
            freed += self.demote_hbm_one(c.key, stubs[c.key])
        return freed

    def demote_hbm_one(self, key: str, rec) -> int:
        """Copy one device tensor into an arena block (D2H) and replace its stub."""
        obj = self.hbm._objects.get(key)
        if obj is None or obj.seq != rec.seq:
            return 0
        t = obj.tensor
        nbytes = t.numel() * t.element_size()
        kb = key.encode()
        off, poff = self.reserve_dram(kb, obj.meta, nbytes, rec.priority, rec.expire_at, rec.access_count)
        a = self.a
        try:
            if nbytes:
                import torch

                dst = np.frombuffer(ffi.buffer(ffi.cast("char *", a.addr + poff), nbytes), dtype=np.uint8)
                torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8))
        except BaseException:
            lib.yr_abort(a.base, a.slot, off)
            raise
        retired = ffi.new("yr_retired *")
        if lib.yr_commit_ex(a.base, a.slot, off, rec.seq, retired) != 0:
            lib.yr_abort(a.base, a.slot, off)
            return 0
        self.hbm.drop(key, rec.seq)
        lib.yr_count(a.base, C_SPILLS, 1)
        return nbytes

    def serve_hbm(self) -> bool:
        """Drop the device tensors whose stubs retired; demote those other processes asked for."""
        self.drain(wake_others=False)
        for key, rec in self.hbm_stubs().items():
            if rec.gen == WANTED:
                self.demote_hbm_one(key, rec)
        return True

    # ---------------------------------------------------------------- reads

    def read(self, key: str, info, meta: bytes) -> tuple[bytes, np.ndarray] | None:
        """Bytes of an SSD object (a private copy), or None if it moved meanwhile."""
        buf = np.empty(info.nbytes, dtype=np.uint8)   # not zero-filled: readinto overwrites it
        try:
            return self.disk.read_into(disk_key(info.gen, key), buf), buf
        except (KeyError, ValueError):   # gone, or replaced by another size: look again...
            if self.stub_unchanged(key, info.seq):   # ...unless nothing moved: the copy is lost
                raise CorruptObjectError(
                    f"{key_repr(key.encode())} is on SSD according to the store's index, but its disk "
                    f"copy {disk_key(info.gen, key)!r} is missing from {self.disk.path}; delete the "
                    "key and write it again") from None
            return None

    def stub_unchanged(self, key: str, seq: int) -> bool:
        """Is ``key`` still the object ``seq`` (a look that counts as no read)?"""
        a = self.a
        kb = key.encode()
        info = ffi.new("yr_objinfo *")
        return lib.yr_get(a.base, a.slot, kb, len(kb), 2, info) == 0 and info.seq == seq

    def promote(self, key: str, info, meta: bytes) -> bool:
        """Bring an SSD object into DRAM (one ``readinto`` into the arena block).

        The SSD copy goes: its index entry at once, its file on a background
        thread (freeing a file's page cache takes milliseconds, which a read
        should not wait for).  A promotion never displaces an object of
        higher priority.
        """
        a = self.a
        kb = key.encode()
        try:
            off, poff = self.reserve_dram(kb, meta, info.nbytes, info.priority, info.expire_at,
                                          info.access_count, max_priority=info.priority,
                                          evict=False)   # a read never drops anything
        except StoreFullError:
            return False
        dk = disk_key(info.gen, key)
        try:
            dst = np.frombuffer(ffi.buffer(a.cbase + poff, info.nbytes), dtype=np.uint8)
            self.disk.read_into(dk, dst)
        except KeyError:
            lib.yr_abort(a.base, a.slot, off)
            return False
        except BaseException:
            lib.yr_abort(a.base, a.slot, off)
            raise
        retired = ffi.new("yr_retired *")
        if lib.yr_commit_ex(a.base, a.slot, off, info.seq, retired) != 0:
            lib.yr_abort(a.base, a.slot, off)
            return False
        self.disk.delete(dk, unlink=self.unlinker.submit)
        lib.yr_count(a.base, C_PROMOTIONS, 1)
        return True

    def flush(self) -> None:
        """Free retired lower-tier bytes; wait for files whose removal was deferred."""
        self.drain()
        self.unlinker.join()

    def close(self) -> None:
        """Finish deferred work and let go of the arena (operations still
        running in other threads then raise StoreClosedError)."""
        try:
            if self._arena is not None:
                self.drain()
        finally:
            self.unlinker.join()
            self._arena = None

    # ------------------------------------------------------------- restarts

    def rebuild(self) -> int:
        """Fresh arena over an old SSD directory: stub every surviving disk object.

        Of several generations of one key (a crash mid-move) the newest wins.
        """
        best: dict[str, tuple[float, int, str]] = {}
        stale: list[str] = []
        for e in list(self.disk.entries()):
            parsed = split_disk_key(e.key)
            if parsed is None:
                continue
            gen, key = parsed
            cur = best.get(key)
            if cur is None or e.created > cur[0]:
                if cur:
                    stale.append(cur[2])
                best[key] = (e.created, gen, e.key)
            else:
                stale.append(e.key)
        for dk in stale:
            self.disk.delete(dk)
        n = 0
        for key, (_, gen, dk) in best.items():
            info = self.disk.info(dk)
            if info is None:
                continue
            fake = ffi.new("yr_objinfo *")
            fake.nbytes = info.nbytes
            fake.priority = info.priority
            fake.expire_at = info.expire_at or 0.0
            stub = self.reserve_stub(key.encode(), bytes(info.meta), fake, gen)
            if stub > 0 and self.commit_stub(stub, expected=0):
                n += 1
        return n

    def vacuum(self) -> int:
        """Remove disk copies no stub refers to, and files no index entry refers
        to (crash leftovers).  Only safe with no other writer."""
        live = {disk_key(r.gen, k) for r, k in scan(self.a, TIER_SSD)}
        removed = 0
        for e in list(self.disk.entries()):
            if e.key not in live:
                self.disk.delete(e.key)
                removed += 1
        return removed + self.disk.vacuum(min_age=0)

