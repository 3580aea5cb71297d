"""Placement: where a put goes, where a read is served from, what moves.

The router between the store's facade and its tiers.  It asks the pure
``policy.py`` what to demote and whether to promote, and has ``mover.py``
carry single moves out.  Rules (docs/architecture.md, "Tiers"):

* A put goes to DRAM unless told otherwise (``tier=Tier.SSD``; a device
  tensor for this process's HBM tier).  Past the high watermark the coldest
  objects move down first.  Only an object larger than the whole DRAM tier,
  or one DRAM cannot hold even after everything movable moved, goes straight
  to SSD.  With no room anywhere: ``StoreFullError`` (``policy="cache"``
  drops the coldest objects instead, but never for an object that no tier
  could hold: that one fails at once).
* A read is served where the object lives: DRAM zero-copy; SSD as a private
  copy, or promoted into DRAM once read ``promote_after`` times; HBM from
  this process's device, or demoted to DRAM by the process that holds it.
  A read never drops anything and never displaces a higher-priority object.

This is the seam where cluster mode's remote tier plugs in.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from . import codec
from .errors import StoreClosedError, StoreFullError, YrcacheError
from .mover import Mover
from .policy import Candidate, Policy
from .sizes import format_size
from .tiers import dram
from .tiers.dram import ANY_SEQ, TIER_DRAM, TIER_HBM, TIER_SSD

if TYPE_CHECKING:
    from .config import Tier
    from .hbm import HbmOwner

RETRY = object()   # the object moved or changed while it was read: look it up again
SMALL_VALUE = 64 * 1024   # at or below: copied under the arena lock in one C call


def _overhead(kb: bytes, meta: bytes) -> int:
    return len(kb) + len(meta) + 256


class Placement:
    """Routes the puts and reads of one store handle between its tiers."""

    def __init__(self, arena: dram.Arena, policy: Policy, mover: Mover, cache: bool, name: str):
        self._arena: dram.Arena | None = arena
        self.policy, self.mover, self.cache, self.name = policy, mover, cache, name
        self.disk = mover.disk
        self.hbm: HbmOwner | None = None    # when this process holds the HBM tier
        #: Where a put without ``tier=`` goes: None for DRAM (and a device
        #: tensor to this process's HBM tier), or a Tier for every value it
        #: can hold (the tier conformance suites run the store suite this way).
        self.default_tier: Tier | None = None

    @property
    def plain(self) -> bool:
        """Does a put without options go straight to DRAM (the fast path)?"""
        return self.hbm is None and self.default_tier is None

    @property
    def direct(self) -> bool:
        """Does a put without options go to DRAM in one call, with no room to make for it?"""
        return self.hbm is None and self.default_tier is None and self.disk is None and not self.cache

    def default_for(self, value: Any) -> Tier | None:
        """The tier a put of ``value`` without ``tier=`` aims at."""
        if self.default_tier == TIER_HBM and not codec.is_tensor(value):
            return None                # the HBM tier holds tensors only
        return self.default_tier

    @property
    def a(self) -> dram.Arena:
        a = self._arena
        if a is None:
            raise StoreClosedError("the store was closed while this operation ran; attach again")
        return a

    def close(self) -> None:
        """Let go of the arena (operations still running in other threads then
        raise StoreClosedError; the ones inside the C core finish first)."""
        try:
            self.mover.close()
        finally:
            self._arena = None

    @property
    def moves(self) -> bool:
        """Can objects leave DRAM at all (an SSD tier, or dropping in cache mode)?"""
        return self.disk is not None or self.cache

    # ---------------------------------------------------------------- puts

    def put(self, kb: bytes, meta: bytes, payload: Any, nbytes: int, priority: int, expire_at: float,
            tier: int | None = None) -> None:
        """Place one encoded object.  ``payload``: a buffer, or a callable that
        fills a flat uint8 array (one copy straight into the arena block)."""
        a = self.a
        is_buffer = not callable(payload)     # a buffer: one C call does it all
        if is_buffer and self.direct:
            # The common case, kept short: a value into a DRAM-only store.
            if a.put(kb, meta, payload, nbytes, priority, expire_at) is not None:
                return
        elif tier == TIER_SSD or (self.disk is not None and nbytes + _overhead(kb, meta) > a.capacity):
            return self.put_ssd(kb, meta, payload, nbytes, priority, expire_at)
        elif self.moves or self.hbm is not None:
            if self.disk is None and not a.fits(kb, meta, nbytes):
                raise self.full_error(nbytes)     # larger than all of DRAM: make no room in vain
            self.make_room(nbytes + _overhead(kb, meta))
        retired = self._put_dram(a, kb, meta, payload, nbytes, priority, expire_at, is_buffer)
        if retired is None:
            # No room: reclaim what dead processes and expired keys hold, then
            # demote (or, in cache mode, drop) cold objects one at a time,
            # coldest first, until the object fits.
            a.sweep()
            self.mover.reclaim_expired()
            retired = self._put_dram(a, kb, meta, payload, nbytes, priority, expire_at, is_buffer)
            if retired is None:
                for _ in self.demote_each():
                    retired = self._put_dram(a, kb, meta, payload, nbytes, priority, expire_at, is_buffer)
                    if retired is not None:
                        break
        if retired is None:
            if self.disk is not None:
                return self.put_ssd(kb, meta, payload, nbytes, priority, expire_at)
            raise self.full_error(nbytes)
        if retired.existed and retired.tier != TIER_DRAM:
            self.drain()     # free the replaced object's bytes in its tier

    @staticmethod
    def _put_dram(a: dram.Arena, kb: bytes, meta: bytes, payload: Any, nbytes: int, priority: int,
                  expire_at: float, buffer: bool) -> Any:
        """One try at storing in DRAM: what the object replaced, or None (no room)."""
        if buffer:
            return a.put(kb, meta, payload, nbytes, priority, expire_at)
        res = a.reserve(kb, meta, nbytes, priority=priority, expire_at=expire_at)
        if res is None:
            return None
        with res:
            if callable(payload):
                payload(res.buffer)
            else:   # outside the lock; memcpy releases the GIL
                res.fill_from(payload)
            return res.commit()

    def put_ssd(self, kb: bytes, meta: bytes, payload: Any, nbytes: int, priority: int,
                expire_at: float) -> None:
        if self.disk is None:
            raise ValueError("tier=Tier.SSD needs an SSD tier: create the store with ssd=<directory>")
        if callable(payload):   # a filler writes into a buffer; give it a private one
            buf = np.empty(nbytes, dtype=np.uint8)
            payload(buf)
            payload = buf
        elif isinstance(payload, np.ndarray):
            payload = payload.reshape(-1).view(np.uint8)   # any dtype as flat bytes
        if not self.mover.put_ssd(kb, meta, payload, nbytes, priority, expire_at):
            self.demote(4096)      # room for the stub itself
            if not self.mover.put_ssd(kb, meta, payload, nbytes, priority, expire_at):
                raise self.full_error(nbytes)

    def put_many_small(self, batch: list, priority: int, expire_at: float) -> int:
        """Store small values, 256 per lock hold; returns how many fit."""
        if self.moves:
            self.make_room(sum(_overhead(kb, meta) + n for kb, meta, _, n in batch))
        done, lower = self.a.mput_small(batch, priority, expire_at)
        if lower:
            self.drain()
        return done

    def full_error(self, nbytes: int) -> StoreFullError:
        st = self.a.stats()
        dram_ = (f"{format_size(st.used)} of {format_size(st.capacity)} DRAM used "
                 f"(largest free block {format_size(st.largest_free)}, "
                 f"{format_size(st.pinned_bytes)} pinned by live views)")
        if self.disk is None:
            return StoreFullError(
                f"store {self.name!r} is full: cannot place {format_size(nbytes)}; {dram_}, no SSD tier "
                "configured; delete keys, release views, or create the store with a larger dram= "
                "(or an SSD tier with ssd=)")
        d = self.disk
        return StoreFullError(
            f"store {self.name!r} is full: cannot place {format_size(nbytes)}; {dram_}, and the SSD "
            f"tier at {d.path} holds {format_size(d.used)} of its {format_size(d.capacity)}; "
            "delete keys, release views, or raise dram= or ssd_size=")

    # ---------------------------------------------------------------- room

    def drain(self) -> None:
        """Free retired lower-tier bytes (the retire channel, see mover.py)."""
        self.mover.drain()
        if self.hbm is None and self.mover.others_pending():
            self.hbm_request_word().wake()   # device tensors of other processes: their holders drop them

    def hbm_request_word(self) -> dram.Word:
        from .hbm import REQUEST_WORD

        return self.a.word(REQUEST_WORD)

    def make_room(self, incoming: int, max_priority: int | None = None, evict: bool = True) -> None:
        """Demote cold objects if ``incoming`` bytes would pass the high watermark
        (only objects of at most ``max_priority``, when given; dropping none
        unless ``evict``)."""
        if not self.moves:
            return
        self.drain()
        need = self.policy.bytes_to_free(self.a.used, self.a.capacity, incoming)
        if need:
            for _ in self.demote_each(need, max_priority, evict):
                pass

    def demote(self, need: int) -> int:
        """Move (or, in cache mode with no SSD room, drop) about ``need`` bytes out of DRAM."""
        return sum(self.demote_each(need))

    def demote_each(self, need: int | None = None, max_priority: int | None = None,
                    evict: bool = True) -> Iterator[int]:
        """Demote victims coldest first, yielding the bytes freed after each.

        A caller that only needs one block to fit stops as soon as it does,
        so fragmentation costs an extra victim, not the whole tier.
        """
        if not self.moves:
            return
        self.drain()
        cands = [Candidate(k, r.seq, r.nbytes, r.block_size, r.priority, r.access_count, r.last_access, r.pins)
                 for r, k in self.a.scan(1 << TIER_DRAM)
                 if max_priority is None or r.priority <= max_priority]
        drop = self.cache and evict
        for c in self.policy.victims(cands, need if need is not None else sum(x.block_size for x in cands)):
            got = 0
            if self.disk is not None:
                try:
                    got = self.mover.spill(c)
                except StoreFullError:
                    if not drop:
                        return
                    if self.evict_from_ssd(c.nbytes):
                        got = self.mover.spill(c)
            if not got and drop:
                got = self.mover.evict(c)
            if got:
                yield got

    def evict_from_ssd(self, need: int) -> int:
        """Cache mode: drop the coldest SSD objects until ``need`` bytes are free there."""
        cands = [Candidate(k, r.seq, r.nbytes, r.nbytes, r.priority, r.access_count, r.last_access, 0)
                 for r, k in self.a.scan(1 << TIER_SSD)]
        need = self.mover.ssd.used + need - self.mover.ssd.capacity
        return sum(self.mover.evict(c) for c in self.policy.victims(cands, need))

    def reserve_dram(self, kb: bytes, meta: bytes, nbytes: int, priority: int, expire_at: float,
                     access_count: int, max_priority: int | None = None,
                     evict: bool = True) -> dram.Reservation | None:
        """A DRAM block for an object moving up, demoting colder objects (of at
        most ``max_priority``) if needed; None when there is no room that way."""
        self.make_room(nbytes + _overhead(kb, meta), max_priority, evict)

        def attempt() -> dram.Reservation | None:
            return self.a.reserve(kb, meta, nbytes, priority=priority, expire_at=expire_at,
                                  access_count=access_count)

        res = attempt()
        if res is None:
            for _ in self.demote_each(None, max_priority, evict):
                res = attempt()
                if res is not None:
                    break
        return res

    # ---------------------------------------------------------------- reads

    def read(self, key: str, info, meta: bytes, decoder: Callable) -> Any:
        """The value of a pinned lookup (the pin is consumed), or RETRY."""
        a = self.a
        if info.tier == TIER_DRAM:
            if self.hbm is not None and self.hbm.wants(info, meta):
                info = a.copy_info(info)     # the promotion looks other objects up
                t = self.hbm.promote(key, info, meta)
                if t is not None:
                    return t
            return decoder(a.pinned_buffer(info.payload_off, info.nbytes, info.pin, info.block_off), info.nbytes)
        info = a.copy_info(info)
        a.unpin(info.pin)        # a stub: the bytes live in a lower tier
        if info.tier == TIER_SSD:
            return self.read_ssd(key, info, meta)
        if self.hbm is not None and info.holder == a.slot:
            t = self.hbm.device.get(info.gen)
            return t if t is not None else RETRY
        from .hbm import request

        request(a, key, info)
        return RETRY

    def read_ssd(self, key: str, info, meta: bytes) -> Any:
        """An SSD object: promoted into DRAM if it is hot, else a private copy."""
        free_above = int(self.policy.high * self.a.capacity)
        if self.policy.should_promote(info.access_count, info.nbytes, free_above):
            res = self.reserve_dram(key.encode(), meta, info.nbytes, info.priority, info.expire_at,
                                    info.access_count, max_priority=info.priority,
                                    evict=False)   # a read never drops anything
            if res is not None and self.mover.promote_ssd(key, info, res):
                return RETRY
        got = self.mover.read_ssd(key, info)
        if got is None:
            return RETRY        # it moved or changed while we looked: look again
        meta, buf = got
        return codec.decoder(meta)(buf, len(buf))

    # ---------------------------------------------------------------- misc

    def tier_stats(self, st, hbm_capacity: int) -> dict:
        """Capacity, use and objects per tier (``st``: the arena's stats).  O(objects
        in lower tiers): their stubs are counted by a scan of the index, filtered in C."""
        lower = [(r.tier, r.nbytes) for r, _ in self.a.scan(1 << TIER_SSD | 1 << TIER_HBM)] \
            if self.disk is not None or hbm_capacity else []
        in_hbm = [n for t, n in lower if t == TIER_HBM]
        tiers: dict = {}
        if hbm_capacity:   # the HBM tier lives in the creating process
            tiers["hbm"] = {"capacity": hbm_capacity, "used": sum(in_hbm), "objects": len(in_hbm),
                            "device": str(self.hbm.device.device) if self.hbm is not None else None}
        tiers["dram"] = {"capacity": st.capacity, "used": st.used, "objects": st.objects - len(lower),
                         "free": st.free_bytes, "largest_free": st.largest_free}
        if self.disk is not None:
            d = self.disk
            tiers["ssd"] = {"capacity": d.capacity, "used": d.used,
                            "objects": sum(1 for t, _ in lower if t == TIER_SSD), "path": d.path}
        return tiers

    def check_tiers(self) -> None:
        """Cross-tier invariants: every SSD copy and every device tensor of this
        process has a live stub and every stub its copy; each tier's ``used``
        equals what it holds; every SSD payload file is there, whole (by size)
        and of the right kind, and none is a dead process's stray.  Raises
        YrcacheError.  O(objects)."""
        a = self.a
        a.sweep()                    # what dead processes left behind goes first
        a.expire(time.time())
        self.drain()
        soon = time.time() + 1.0     # objects about to expire may be gone from one tier already
        stubs = list(a.scan(1 << TIER_SSD | 1 << TIER_HBM))
        for tier, code in ((self.disk, TIER_SSD), (self.hbm.device if self.hbm is not None else None, TIER_HBM)):
            if tier is None:
                continue
            name = tier.name.upper()
            held = {e.gen: e for e in tier.entries()}
            want = {r.gen: (r, k) for r, k in stubs if r.tier == code and (code == TIER_SSD or r.holder == a.slot)}
            for gen, (r, k) in want.items():
                if gen not in held and not (r.expire_at and r.expire_at <= soon):
                    raise YrcacheError(f"{name} stub of {k!r} has no copy (generation {gen:#x}) in its tier")
            stray = [(e.key, hex(g)) for g, e in held.items() if g not in want]
            if stray:
                raise YrcacheError(f"{name} copies with no stub in the index: {stray[:5]}")
            total = sum(e.nbytes for e in held.values())
            if tier.used != total:
                raise YrcacheError(f"{name} tier used {tier.used} != {total} held")
        if self.disk is not None:
            self.disk.check()        # every payload file there, of the right kind and size; no strays

    def flush(self) -> None:
        """Free retired lower-tier bytes; wait for files whose removal was deferred
        (and remove those that dead processes deferred)."""
        self.drain()
        self.mover.unlinker.join()
        if self.disk is not None:
            self.disk.clean_tmp()


__all__ = ["Placement", "RETRY", "ANY_SEQ", "SMALL_VALUE"]
