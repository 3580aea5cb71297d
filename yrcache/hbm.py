"""The HBM side of a store, in the process that holds the device memory.

``tiers/device.py`` keeps the tensors; this module places objects there:
puts that stay on the device, promotions of hot DRAM tensors (one H2D copy),
the service thread that demotes tensors other processes ask for, and the
hand-over to DRAM when the owner closes.  See docs/architecture.md, "Tiers".
"""

from __future__ import annotations

from typing import Any

from . import codec
from ._arena import ffi, lib
from .errors import StoreFullError
from .mover import ANY_SEQ, C_PROMOTIONS, HBM_DONE, HBM_REQ, TIER_HBM, Mover
from .policy import Policy
from .tiers import shm
from .tiers.device import DemotionService, DeviceTier


class HbmOwner:
    """Places objects in this process's HBM tier and serves other processes' reads."""

    def __init__(self, arena: shm.Arena, mover: Mover, policy: Policy, tier: DeviceTier, pin_cuda):
        self.a, self.mover, self.policy, self.tier = arena, mover, policy, tier
        mover.hbm = tier
        if tier.device.type == "cuda":
            pin_cuda()
        self._service: DemotionService | None = DemotionService(mover.serve_hbm, arena, HBM_REQ, HBM_DONE)

    def takes(self, value: Any, tier_hint) -> bool:
        """Should ``put`` try HBM: a tensor with an HBM hint, or already on this device."""
        from .store import Tier

        return codec.is_tensor(value) and (
            tier_hint == Tier.HBM or (tier_hint is None and value.device.type != "cpu" and self.tier.holds(value)))

    def put(self, kb: bytes, value: Any, priority: int, expire_at: float) -> bool:
        """Keep a tensor on the device (a D2D copy, no host copy); False if HBM has no room."""
        a, hbm = self.a, self.tier
        nbytes = value.numel() * value.element_size()
        if nbytes > hbm.capacity:
            return False
        self.mover.drain()
        if not hbm.fits(nbytes):
            self.mover.reclaim_expired()   # expired tensors still hold device memory
        need = self.policy.bytes_to_free(hbm.used, hbm.capacity, nbytes)
        if need:
            self.mover.demote_hbm(need)
        if not hbm.fits(nbytes):
            return False
        t = hbm.copy_in(value)
        meta = codec.tensor_meta(t.dtype, t.shape)
        key = kb.decode()
        poff = ffi.new("uint64_t *")
        retired = ffi.new("yr_retired *")
        for attempt in (0, 1):
            off = lib.yr_reserve_ex(a.base, a.slot, kb, len(kb), meta, len(meta), 0, nbytes,
                                    priority, expire_at, TIER_HBM, a.slot, 0, 0, poff)
            if off > 0:
                shm.check(lib.yr_commit_ex(a.base, a.slot, off, ANY_SEQ, retired), "commit")
                hbm.store(key, t, meta, retired.new_seq, priority)
                self.mover.drain()   # what the put replaced, in whatever tier
                return True
            if attempt or not self.mover.demote(4096):
                break
        return False

    def wants(self, info, meta: bytes, policy: Policy) -> bool:
        """Should a read of this DRAM object move it up (a hot tensor that fits)?"""
        return meta[:1] == b"T" and policy.should_promote(
            info.access_count, info.nbytes, int(policy.high * self.tier.capacity))

    def promote(self, key: str, info, meta: bytes) -> Any:
        """A hot DRAM tensor moves up (one H2D copy); the device tensor, or None.

        ``info`` is a pinned lookup; on success the pin is released (the
        device tensor does not need the DRAM block), on failure it is kept
        for the caller's DRAM view.  A read never displaces an object of
        higher priority, nor fails for want of room.
        """
        a, hbm = self.a, self.tier
        need = self.policy.bytes_to_free(hbm.used, hbm.capacity, info.nbytes)
        if need:
            try:
                self.mover.demote_hbm(need, max_priority=int(info.priority))
            except StoreFullError:
                return None
        if not hbm.fits(info.nbytes):
            return None
        view = codec.decoder(meta)(ffi.buffer(a.cbase + info.payload_off, info.nbytes), info.nbytes)
        t = hbm.copy_in(view)
        del view
        kb = key.encode()
        poff = ffi.new("uint64_t *")
        off = lib.yr_reserve_ex(a.base, a.slot, kb, len(kb), meta, len(meta), 0, info.nbytes,
                                info.priority, info.expire_at, TIER_HBM, a.slot, 0,
                                info.access_count, poff)
        if off <= 0:
            return None
        retired = ffi.new("yr_retired *")
        if lib.yr_commit_ex(a.base, a.slot, off, info.seq, retired) != 0:
            lib.yr_abort(a.base, a.slot, off)
            return None
        hbm.store(key, t, meta, retired.new_seq, int(info.priority))
        lib.yr_count(a.base, C_PROMOTIONS, 1)
        a.unpin(info.pin)
        return t

    def disown(self) -> None:
        """In a forked child: the device memory and the service thread stay with
        the parent; this process reads HBM objects by asking the owner."""
        self._service = None
        self.mover.hbm = None

    def close(self) -> None:
        """Device memory goes with this handle: hand HBM objects to DRAM if anyone stays."""
        if self._service is not None:
            self._service.stop()
            self._service = None
        try:
            if len(self.a.attached()) > 1:
                stubs = self.mover.hbm_stubs()
                for key, _obj in self.tier.items():
                    if key in stubs:
                        self.mover.demote_hbm_one(key, stubs[key])
        finally:
            self.tier.clear()
            self.a = None
