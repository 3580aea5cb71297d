"""The HBM protocol: device tensors held by one process, read by every process.

Device memory belongs to the process that allocated it.  The holder keeps its
tensors in ``tiers/device.py`` and a stub of each in the arena's index (tier
HBM, its slot as holder, the tensor's generation), so every process sees the
key, its size and its tier.

Another process reads an HBM object like this (``request``): it sets the
stub's WANTED flag and wakes the holder through the arena's named word
``yrcache/hbm-request``; the holder's service thread copies the tensor into a
DRAM block (one D2H copy) and replaces the stub, then bumps
``yrcache/hbm-done``; the reader looks the key up again and gets the usual
zero-copy DRAM view.  When the holder closes its store while others are
attached it demotes every tensor first; when it dies, the sweep removes its
stubs (device memory dies with its process).

The holder side (``HbmOwner``) also places objects on the device: puts that
stay on the device (a D2D copy, no host copy), promotions of hot DRAM tensors
(one H2D copy), and demotions past the tier's high watermark.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from . import codec
from .config import Tier
from .errors import StoreFullError
from .tiers import dram
from .tiers.device import DeviceTier
from .tiers.dram import C_PROMOTIONS, FLAG_WANTED, TIER_HBM

if TYPE_CHECKING:
    from .placement import Placement

REQUEST_WORD = "yrcache/hbm-request"
DONE_WORD = "yrcache/hbm-done"
SERVICE_PERIOD = 0.5    # the holder also looks for work this often, woken or not


def request(a: dram.Arena, key: str, info) -> None:
    """Ask the holder of an HBM object to move it to DRAM, and wait briefly for it."""
    done = a.word(DONE_WORD)
    seen = done.seq
    a.set_flags(key.encode(), info.seq, set=FLAG_WANTED)
    a.word(REQUEST_WORD).wake()
    if not done.wait(seen, 0.2):
        a.sweep()   # the holder may be dead: its stubs go with it


class HbmOwner:
    """This process's HBM tier: places objects there and serves other processes' reads."""

    def __init__(self, placement: "Placement", device: DeviceTier, pin_cuda):
        self.p, self.device = placement, device
        self.mover = placement.mover
        self.policy = placement.policy
        placement.hbm = self
        placement.mover.device = device
        if device.device.type == "cuda":
            pin_cuda()
        self.a.word(REQUEST_WORD), self.a.word(DONE_WORD)    # created now, not by the thread later
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_loop, name="yrcache-hbm", daemon=True)
        self._thread.start()
        _owners.add(self)

    @property
    def a(self) -> dram.Arena:
        return self.p.a

    # --------------------------------------------------------------- puts

    def takes(self, value: Any, hint: Tier | None) -> bool:
        """Should ``put`` try HBM: a tensor with an HBM hint, or already on this device."""
        return codec.is_tensor(value) and (
            hint == Tier.HBM or (hint is None and value.device.type != "cpu" and self.device.holds(value)))

    def put(self, kb: bytes, value: Any, priority: int, expire_at: float) -> bool:
        """Keep a tensor on the device (no host copy); False if HBM has no room."""
        dev = self.device
        nbytes = value.numel() * value.element_size()
        if nbytes > dev.capacity:
            return False
        self.mover.drain()
        if not dev.fits(nbytes):
            self.mover.reclaim_expired()   # expired tensors still hold device memory
        need = self.policy.bytes_to_free(dev.used, dev.capacity, nbytes)
        if need:
            self.demote(need)
        if not dev.fits(nbytes):
            return False
        meta = codec.tensor_meta(value.dtype, value.shape)
        return self.mover.put_hbm(kb, meta, value, nbytes, priority, expire_at) is not None

    def wants(self, info, meta: bytes) -> bool:
        """Should a read of this DRAM object move it up (a hot tensor that fits)?"""
        return meta[:1] == b"T" and self.policy.should_promote(
            info.access_count, info.nbytes, int(self.policy.high * self.device.capacity))

    def promote(self, key: str, info, meta: bytes) -> Any:
        """A hot DRAM tensor moves up (one H2D copy); the device tensor, or None.

        ``info`` is a pinned lookup; on success the pin is released (the
        device tensor does not need the DRAM block), on failure it is kept
        for the caller's DRAM view.  A read never displaces an object of
        higher priority, nor fails for want of room.
        """
        dev = self.device
        need = self.policy.bytes_to_free(dev.used, dev.capacity, info.nbytes)
        if need:
            try:
                self.demote(need, max_priority=int(info.priority))
            except StoreFullError:
                return None
        if not dev.fits(info.nbytes):
            return None
        a = self.a
        t = self.mover.put_hbm(key.encode(), meta, a.payload(info), info.nbytes, info.priority,
                               info.expire_at, info.access_count, expected=info.seq)
        if t is None:
            return None
        a.count(C_PROMOTIONS)
        a.unpin(info.pin)
        return t

    # ----------------------------------------------------------- demotion

    def stubs(self) -> dict[str, Any]:
        """Index records of the HBM objects this process holds."""
        slot = self.a.slot
        return {k: r for r, k in self.a.scan(1 << TIER_HBM) if r.holder == slot}

    def demote(self, need: int, max_priority: int | None = None) -> int:
        """Move about ``need`` bytes of cold tensors (of at most ``max_priority``) to DRAM."""
        from .policy import Candidate

        stubs = self.stubs()
        cands = [Candidate(k, r.seq, r.nbytes, r.nbytes, r.priority, r.access_count, r.last_access, 0)
                 for k, r in stubs.items() if max_priority is None or r.priority <= max_priority]
        if max_priority is not None and sum(c.block_size for c in cands) < need:
            return 0   # it would take moving an object that matters more
        return sum(self.demote_one(c.key, stubs[c.key]) for c in self.policy.victims(cands, need))

    def demote_one(self, key: str, rec) -> int:
        """Copy one device tensor into DRAM (D2H) in place of its stub."""
        res = self.p.reserve_dram(key.encode(), self._meta(rec.gen), rec.nbytes, rec.priority,
                                  rec.expire_at, rec.access_count)
        if res is None:
            raise StoreFullError(f"no DRAM room to move {key[:60]!r} ({rec.nbytes} bytes) out of HBM; "
                                 "raise dram= or configure ssd=")
        return self.mover.demote_hbm(key, rec, res)

    def _meta(self, gen: int) -> bytes:
        info = self.device.info(gen)
        return info.meta if info is not None else b""

    # ----------------------------------------------------- other processes

    def serve(self) -> None:
        """Drop the tensors whose stubs retired; demote those other processes want."""
        self.mover.drain()
        for key, rec in self.stubs().items():
            if rec.flags & FLAG_WANTED:
                self.demote_one(key, rec)

    def _serve_loop(self) -> None:
        a = self.a   # the loop ends before close() lets go of the arena
        req, done = a.word(REQUEST_WORD), a.word(DONE_WORD)
        while not self._stop.is_set():
            seen = req.seq
            try:
                self.serve()
                done.wake()
            except Exception:   # keep serving; a failed demotion leaves the stub as it was
                time.sleep(0.01)
            req.wait(seen, SERVICE_PERIOD)

    def disown(self) -> None:
        """In a forked child: the device memory and the service thread stay with
        the parent; this process reads HBM objects by asking the holder."""
        self._stop.set()
        self.p.hbm = None
        self.mover.device = None

    def close(self) -> None:
        """Device memory goes with this handle: hand HBM objects to DRAM if anyone stays."""
        self._stop.set()
        self.a.word(REQUEST_WORD).wake()
        self._thread.join(5)
        try:
            if len(self.a.attached()) > 1:
                for key, rec in self.stubs().items():
                    self.demote_one(key, rec)
        finally:
            self.device.clear()
            self.p.hbm = None


_owners: "weakref.WeakSet[HbmOwner]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Device memory and the service thread stay with the parent; a forked
    # child reads HBM objects like any other process (by asking the holder).
    for owner in list(_owners):
        owner.disown()
    _owners.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
