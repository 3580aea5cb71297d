"""The mechanics of moving one object between tiers (``placement.py`` decides which).

An object in a lower tier keeps a *stub* in the arena's index: a block with
no payload that records its size, codec header, priority, TTL, access count,
tier and the generation of its copy there.  So the arena stays the one index
every process shares: ``in``, ``len``, ``keys`` and ``tier_of`` never touch a
disk or a device, and reads from every process count towards promotion.

Every move is a copy followed by a *conditional* commit: the stub (spill) or
the full block (promotion) replaces the object only if its sequence number is
still the one that was copied.  A concurrent overwrite or delete wins and the
copy is thrown away, so a move never resurrects an old value.  A stub is
reserved *before* its copy is written: if the mover dies in between, the
sweep puts the stub on the retire list and the copy goes with it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CorruptObjectError, StoreClosedError, StoreFullError
from .policy import Candidate
from .tiers import dram
from .tiers.base import new_gen
from .tiers.dram import ANY_SEQ, C_EVICTIONS, C_PROMOTIONS, C_SPILLS, TIER_DRAM, TIER_HBM, TIER_SSD

if TYPE_CHECKING:
    from .tiers.device import DeviceTier
    from .tiers.disk import DiskTier


def key_repr(key: str) -> str:
    return repr(key[:60])


class Unlinker:
    """One daemon thread that removes files off the caller's path.

    It runs nothing but ``os.unlink`` (which releases the GIL), so it does not
    slow the threads that wait on it.  Re-created lazily after a fork.
    """

    def __init__(self) -> None:
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


class Mover:
    """Single moves between the tiers of one store handle."""

    def __init__(self, arena: dram.Arena, disk: DiskTier | None, device: DeviceTier | None = None):
        self._arena: dram.Arena | None = arena
        self.disk = disk          # the SSD tier, or None
        self.device = device      # this process's HBM tier, or None
        self.unlinker = Unlinker()

    @property
    def ssd(self) -> DiskTier:
        """The SSD tier, for the moves that need one (their callers checked ``disk``)."""
        assert self.disk is not None, "this store has no SSD tier"
        return self.disk

    @property
    def hbm_tier(self) -> DeviceTier:
        """This process's HBM tier, for the moves that need one."""
        assert self.device is not None, "this process has no HBM tier"
        return self.device

    @property
    def a(self) -> dram.Arena:
        a = self._arena
        if a is None:
            raise StoreClosedError("the store was closed while this operation ran; attach again")
        return a

    # ------------------------------------------------------ retire channel

    def drain(self) -> int:
        """Free the lower-tier bytes of stubs that left the arena's index.

        Every retirement of an SSD or HBM object (overwrite, delete, eviction,
        expiry found anywhere, even inside the C core) puts its stub on the
        arena's retire list; this takes the entries this process can serve
        (SSD copies; its own device tensors) and frees their bytes.  O(1)
        when nothing is pending.  Returns how many were freed.
        """
        tiers = (1 << TIER_SSD if self.disk is not None else 0) | (1 << TIER_HBM if self.device is not None else 0)
        return self.a.drain_retired(
            tiers, lambda rec: (self.ssd if rec.tier == TIER_SSD else self.hbm_tier).delete(rec.gen))

    def others_pending(self) -> bool:
        """Are retired stubs left that another process must serve (its HBM tensors)?"""
        return self.a.retired_pending() > 0

    def reclaim_expired(self) -> None:
        """Retire expired objects now, in every tier (before concluding a tier is full)."""
        self.a.expire(time.time())
        self.drain()

    # ------------------------------------------------------------ DRAM -> SSD

    def put_ssd(self, kb: bytes, meta: bytes, payload: Any, nbytes: int, priority: int,
                expire_at: float, access_count: int = 0, expected: int = ANY_SEQ) -> bool:
        """Write an object to SSD and publish its stub (if the key is still
        ``expected``); False when the arena has no room for the stub or the
        object changed meanwhile (then nothing is left behind)."""
        a = self.a
        gen = new_gen()
        res = a.reserve(kb, meta, nbytes, priority=priority, expire_at=expire_at, tier=TIER_SSD,
                        gen=gen, access_count=access_count)
        if res is None:
            return False
        with res:
            try:
                self.ssd.put(gen, meta, payload, key=kb.decode(), priority=priority,
                              expire_at=expire_at or None)
            except StoreFullError:
                self.reclaim_expired()    # expired objects may still hold SSD room
                self.ssd.put(gen, meta, payload, key=kb.decode(), priority=priority,
                              expire_at=expire_at or None)
            if res.commit(expected) is None:
                self.ssd.delete(gen)
                return False
        self.drain()    # what the stub replaced, in any tier
        return True

    def spill(self, c: Candidate) -> int:
        """Copy one DRAM object to SSD and replace it by a stub; bytes freed (0: lost a race)."""
        a = self.a
        kb = c.key.encode()
        info = a.get(kb, dram.PIN | dram.QUIET)
        if info is None:
            return 0
        info = a.copy_info(info)   # kept across the disk write
        try:
            if info.seq != c.seq or info.tier != TIER_DRAM:
                return 0
            if not self.put_ssd(kb, a.meta(info), a.payload(info), info.nbytes, info.priority,
                                info.expire_at, info.access_count, expected=c.seq):
                return 0
        finally:
            a.unpin(info.pin)
        a.count(C_SPILLS)
        return c.block_size

    def evict(self, c: Candidate) -> int:
        """Drop one object (cache mode only); bytes freed."""
        deleted, _ = self.a.delete(c.key.encode(), c.seq)
        if not deleted:
            return 0
        self.drain()
        self.a.count(C_EVICTIONS)
        return c.block_size

    # ------------------------------------------------------------ SSD -> DRAM

    def read_ssd(self, key: str, info) -> tuple[bytes, np.ndarray] | None:
        """(meta, a private copy of the payload) of an SSD object, or None if it
        moved meanwhile.  A copy that is gone while its stub is unchanged is lost:
        CorruptObjectError at once, never a retry loop."""
        buf = np.empty(info.nbytes, dtype=np.uint8)   # not zero-filled: readinto overwrites it
        try:
            return self.ssd.read_into(info.gen, buf), buf
        except KeyError:
            if self.stub_unchanged(key, info.seq):
                raise CorruptObjectError(
                    f"{key_repr(key)} is on SSD according to the store's index, but its disk copy "
                    f"(generation {info.gen:#x}) is missing from {self.ssd.path}; delete the key and "
                    "write it again") from None
            return None

    def stub_unchanged(self, key: str, seq: int) -> bool:
        """Is ``key`` still the object ``seq`` (a look that counts as no read)?"""
        info = self.a.get(key.encode(), dram.QUIET)
        return info is not None and info.seq == seq

    def promote_ssd(self, key: str, info, res: dram.Reservation) -> bool:
        """Fill a reserved DRAM block from the SSD copy (one ``readinto``, its
        checksum verified) and publish it in place of the stub.

        The SSD copy goes: its index entry at once, its file on a background
        thread (freeing a file's page cache takes milliseconds, which a read
        should not wait for).
        """
        with res:
            try:
                self.ssd.read_into(info.gen, res.buffer)
            except KeyError:
                return False
            if res.commit(info.seq) is None:
                return False
        self.ssd.delete(info.gen, later=self.unlinker.submit)
        self.drain()
        self.a.count(C_PROMOTIONS)
        return True

    # ------------------------------------------------------------ HBM <-> DRAM

    def demote_hbm(self, key: str, rec, res: dram.Reservation) -> int:
        """Copy one device tensor of this process into a reserved DRAM block
        (D2H) and publish it in place of its stub; bytes freed on the device."""
        with res:
            if self.hbm_tier.info(rec.gen) is None:
                return 0
            self.hbm_tier.read_into(rec.gen, res.buffer)
            if res.commit(rec.seq) is None:
                return 0
        self.drain()          # the retired stub: the tensor goes
        self.a.count(C_SPILLS)
        return rec.nbytes

    def put_hbm(self, kb: bytes, meta: bytes, value: Any, nbytes: int, priority: int, expire_at: float,
                access_count: int = 0, expected: int = ANY_SEQ) -> Any | None:
        """Keep a device copy and publish its stub (if the key is still
        ``expected``); the stored tensor, or None (no room for the stub, or the
        object changed meanwhile)."""
        a = self.a
        gen = new_gen()
        self.hbm_tier.put(gen, meta, value, key=kb.decode(), priority=priority, expire_at=expire_at or None)
        res = a.reserve(kb, meta, nbytes, priority=priority, expire_at=expire_at, tier=TIER_HBM,
                        holder=a.slot, gen=gen, access_count=access_count)
        if res is None or res.commit(expected) is None:
            if res is not None:
                res.abort()
            self.hbm_tier.delete(gen)
            return None
        self.drain()
        return self.hbm_tier.get(gen)

    # -------------------------------------------------------------- restarts

    def rebuild(self) -> int:
        """Fresh arena over an old SSD directory: stub every surviving disk blob.

        Of several generations of one key (a crash mid-move) the newest wins;
        expired ones go, and so do payload files that dead processes left
        without a record (``DiskTier.sweep``).
        """
        best: dict[str, Any] = {}
        stale: list[int] = []
        now = time.time()
        for e in list(self.ssd.entries()):
            if e.expire_at is not None and e.expire_at <= now:
                stale.append(e.gen)
                continue
            cur = best.get(e.key)
            if cur is None or e.created > cur.created:
                if cur is not None:
                    stale.append(cur.gen)
                best[e.key] = e
            else:
                stale.append(e.gen)
        for gen in stale:
            self.ssd.delete(gen)
        n = 0
        a = self.a
        for key, e in best.items():
            kb = key.encode()
            res = a.reserve(kb, e.meta, e.nbytes, priority=e.priority, expire_at=e.expire_at or 0.0,
                            tier=TIER_SSD, gen=e.gen)
            if res is not None:
                with res:
                    n += res.commit(0) is not None
        self.ssd.sweep()
        return n

    def vacuum(self) -> int:
        """Remove disk copies no stub refers to, and crash leftovers.  Only
        safe with no other writer (an adopter alone with the store)."""
        live = {r.gen for r, _ in self.a.scan(1 << TIER_SSD)}
        return self.ssd.vacuum(live=live.__contains__, min_age=0)

    def close(self) -> None:
        """Finish deferred work and let go of the arena (operations still
        running in other threads then raise StoreClosedError)."""
        try:
            if self._arena is not None:
                self.drain()
        finally:
            self.unlinker.join()
            self._arena = None
