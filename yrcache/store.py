"""TieredStore: the facade: validation, placement, routing, stats.

A ``TieredStore`` is a ``MutableMapping[str, value]`` over one shared-memory
arena (the DRAM tier).  Values come back as read-only zero-copy views that
pin their bytes: they stay valid and unchanged while referenced, even when the
key is overwritten or deleted, the store is closed, or the writer dies.
"""

from __future__ import annotations

import enum
import functools
import operator
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np

import json

from . import codec
from ._arena import ffi, lib
from .errors import StoreClosedError, StoreFullError, UntrustedStoreError, YrcacheError
from .mover import ANY_SEQ, TIER_DRAM, TIER_HBM, TIER_SSD, Mover, scan

if TYPE_CHECKING:
    from .hbm import HbmOwner
from .policy import Policy
from .sizes import format_size, parse_size
from .tiers import shm

MAX_KEY_BYTES = 1024
SMALL_VALUE = 64 * 1024        # at or below: copy under the arena lock in one C call
DEFAULT_DRAM = "1GiB"
_MISSING = object()
_RETRY = object()
_PLAIN_TYPES = (np.ndarray, bytes, bytearray)
HBM_READ_TIMEOUT = 10.0    # seconds a reader waits for another process to demote an HBM object


class Tier(enum.IntEnum):
    """Where an object lives: GPU memory, the shared DRAM arena or SSD files."""

    HBM = 0
    DRAM = 1
    SSD = 2


class WriteMode(enum.Enum):
    """Replication of a put in cluster mode (ignored by an embedded store)."""

    WRITE_THROUGH = "write_through"
    ASYNC = "async"
    NONE = "none"


_TIERS = {TIER_DRAM: Tier.DRAM, TIER_SSD: Tier.SSD, 3: Tier.HBM}


def key_bytes(key: Any) -> bytes:
    """Validate a key and return its UTF-8 bytes."""
    if type(key) is not str:
        if isinstance(key, str):
            key = str(key)
        else:
            raise TypeError(f"keys must be str, not {type(key).__name__}")
    try:
        kb = key.encode()
    except UnicodeEncodeError:
        raise ValueError(f"key {key[:40]!r} is not valid UTF-8 (lone surrogates?)") from None
    if not kb:
        raise ValueError("keys must be non-empty strings")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"key is {len(kb)} UTF-8 bytes; keys may be at most {MAX_KEY_BYTES} bytes")
    if b"\x00" in kb:
        raise ValueError(f"key {key[:40]!r} contains a NUL character, which keys may not")
    return kb


class TieredStore(MutableMapping):
    """An embedded tiered key-value store for bytes, arrays and tensors.

    ``TieredStore(name=..., dram="2GiB")`` creates a store (or adopts one whose
    owner died); ``TieredStore.attach(name)`` joins an existing one from any
    process on the node.  A store pickles as its name, so passing it to a
    ``multiprocessing`` child attaches there.
    """

    def __init__(self, name: str | None = None, *, dram: int | str | None = None,
                 ssd: str | os.PathLike | None = None, ssd_size: int | str | None = None,
                 hbm: int | str | None = None, device: str | None = None,
                 capacity: int | str | None = None, ratios: tuple[float, float, float] | None = None,
                 policy: str = "spill", pickle: bool = False, prefault: bool = True,
                 watermarks: tuple[float, float] = (0.9, 0.8), promote_after: int = 2,
                 persist: bool | None = None,
                 cluster: str | None = None, listen: str | None = None, replicas: int | None = None,
                 write_mode: WriteMode | str | None = None, _attach: bool = False):
        self._arena: shm.Arena | None = None
        self._mover: Mover | None = None
        self._disk = None
        if cluster is not None or (os.environ.get("YRCACHE_ETCD") and not _attach):
            raise NotImplementedError(
                "cluster mode is not available in this version of yrcache; "
                "unset YRCACHE_ETCD and drop cluster= to use the embedded store"
            )
        self._hbm: HbmOwner | None = None
        device_tier = None
        hbm = hbm if hbm is not None else os.environ.get("YRCACHE_HBM")
        if policy not in ("spill", "cache"):
            raise ValueError(f"policy must be 'spill' or 'cache', not {policy!r}")
        self._pickle = bool(pickle)
        self._write_mode = _write_mode(write_mode)
        self._closed = False
        if _attach:
            self._arena = shm.Arena(name, prefault=prefault)
            self.name = name
            self._configure(self._read_config())
            return
        dram_b = parse_size(dram if dram is not None else os.environ.get("YRCACHE_DRAM"), "dram")
        ssd = ssd if ssd is not None else os.environ.get("YRCACHE_SSD")
        ssd_b = parse_size(ssd_size if ssd_size is not None else os.environ.get("YRCACHE_SSD_SIZE"), "ssd_size")
        hbm_b = parse_size(hbm, "hbm")
        cap_b = parse_size(capacity, "capacity")
        if cap_b is not None:
            r = _check_ratios(ratios)
            if r[0]:
                hbm_b = hbm_b or int(cap_b * r[0])
            dram_b = dram_b or int(cap_b * r[1])
            if r[2]:
                ssd_b = ssd_b or int(cap_b * r[2])
                if ssd is None:
                    raise ValueError("ratios give SSD a share: pass ssd= (a directory) as well")
        elif ratios is not None:
            raise ValueError("ratios= splits capacity=; pass capacity= as well")
        if dram_b is None:
            dram_b = parse_size(DEFAULT_DRAM)
        if dram_b < lib.yr_arena_min_size():
            raise ValueError(f"dram must be at least {format_size(lib.yr_arena_min_size())}, got {dram_b} bytes")
        free = shutil.disk_usage(shm.SHM_DIR).free if os.path.isdir(shm.SHM_DIR) else None
        if free is not None and dram_b > free:
            raise StoreFullError(f"cannot create a store of dram={format_size(dram_b)}: {shm.SHM_DIR} has "
                                 f"{format_size(free)} free; choose a smaller dram= (or add an SSD tier "
                                 "with ssd=), or free shared memory (`yrcache list`, `yrcache destroy NAME`)")
        if ssd_b is not None and ssd is None:
            raise ValueError("ssd_size= needs ssd= (the directory for the SSD tier)")
        high, low = (float(w) for w in watermarks)
        config = {"ssd": os.path.abspath(os.path.expanduser(os.fspath(ssd))) if ssd is not None else None,
                  "ssd_size": ssd_b, "policy": policy, "high": high, "low": low,
                  "promote_after": int(promote_after), "hbm": hbm_b or 0,
                  "persist": bool(persist), "id": uuid.uuid4().hex}
        Policy(high, low, int(promote_after))  # validates before anything is created
        if device is not None and not hbm_b:
            raise ValueError("device= places the HBM tier: give it a size with hbm= (or capacity= and ratios=)")
        if hbm_b:
            device = device or _default_device()
            from .tiers.device import DeviceTier

            device_tier = DeviceTier(device, hbm_b)   # validates device= before anything exists
        self.name = shm.check_name(name) if name is not None else f"yr-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        arena = shm.Arena(self.name, create=True, size=dram_b, prefault=prefault)
        adopted = not arena.created
        if adopted:
            explicit = dram is not None or cap_b is not None or os.environ.get("YRCACHE_DRAM")
            arena = self._adopt(arena, dram_b if explicit else None)
        self._arena = arena
        try:
            if adopted:
                old = self._read_config() or {}
                if persist is not None:   # an explicit choice overrides the recorded one
                    old["persist"] = bool(persist)
                    self._write_config(old)
                config = old or config
            else:
                self._write_config(config)
            arena.persist = bool(config.get("persist"))
            self._configure(config)
            if device_tier is not None:
                from .hbm import HbmOwner

                self._hbm = HbmOwner(arena, self._mover, self._policy, device_tier, self._ensure_cuda_pinned)
                _hbm_stores[id(self)] = weakref.ref(self)
            if self._disk is not None and not adopted:
                self._mover.rebuild()          # a fresh arena over an old SSD directory
            elif self._disk is not None and len(arena.attached()) == 1:
                self._mover.vacuum()           # adopted, nobody else moving: drop stray copies
        except BaseException:
            if adopted:   # the segment holds someone's data: leave it for a later adoption
                arena.is_owner = False
                self.close()
            else:
                self.destroy()
            raise

    def _configure(self, config: dict | None) -> None:
        config = config or {}
        self._policy = Policy(config.get("high", 0.9), config.get("low", 0.8), config.get("promote_after", 2))
        if config.get("ssd"):
            from .tiers.disk import DiskTier

            self._disk = DiskTier(config["ssd"], config.get("ssd_size"), owner=config.get("id"))
        self._mover = Mover(self._arena, self._disk, self._policy, config.get("policy") == "cache")
        self._config = config
        self._dram_capacity = self._raw_stats().capacity

    def _ensure_cuda_pinned(self) -> None:
        """Register the arena as pinned host memory (once per process and mapping).

        Copies between the arena and a GPU then run at full PCIe speed, with
        no bounce through a pageable buffer.  Done lazily, at the first
        device copy, so CPU-only users never initialise CUDA.
        """
        a = self._a
        if getattr(a, "cuda_pinned", False):
            return
        import torch

        if not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(a.addr, a.size, 0)
        a.cuda_pinned = int(err) == 0 if err is not None else True

    def _drop_hbm_after_fork(self) -> None:
        # Device memory and the service thread stay with the parent; a forked
        # child reads HBM objects like any other process (by asking the owner).
        if self._hbm is not None:
            self._hbm.disown()
            self._hbm = None

    def _write_config(self, config: dict) -> None:
        n = ffi.new("uint32_t *")
        area = lib.yr_config_area(self._arena.base, n)
        data = json.dumps(config).encode()
        if len(data) >= n[0]:
            raise ValueError(f"store settings too long ({len(data)} bytes); use a shorter ssd= path")
        ffi.memmove(area, data + b"\x00", len(data) + 1)

    def _read_config(self) -> dict | None:
        n = ffi.new("uint32_t *")
        data = ffi.string(lib.yr_config_area(self._arena.base, n), n[0])
        return json.loads(data) if data else None

    def _adopt(self, arena: shm.Arena, asked: int | None) -> shm.Arena:
        """Take over an existing segment whose owner is gone; refuse a live one."""
        owners = [pid for slot, pid, owner in arena.attached() if owner and slot != arena.slot]
        if owners:
            arena.release_handle()
            raise FileExistsError(
                f"store {self.name!r} already exists and is owned by pid {owners[0]}; "
                f"use TieredStore.attach({self.name!r}) to share it, or pick another name"
            )
        arena.take_ownership()
        if asked is not None and asked != arena.size:
            warnings.warn(
                f"store {self.name!r} already exists (its owner died) and was adopted with its own "
                f"size, {format_size(arena.size)}, not the {format_size(asked)} asked for; "
                f"to resize it, copy what you need, then destroy it (`yrcache destroy {self.name}`) "
                "and create it again", UserWarning, stacklevel=3)
        return arena

    @classmethod
    def attach(cls, name: str, *, pickle: bool = False, prefault: bool = False) -> "TieredStore":
        """Attach to the store ``name`` created by another process on this node.

        ``pickle=True`` lets this handle read (unpickle) objects stored with
        ``pickle=True``: only for stores whose every writer you trust.

        ``prefault=True`` maps every page of the arena now (about 0.14 s per
        GiB) instead of on first touch (about 1 us per 4 KiB page): worth it
        in a long-lived process that moves a lot of data, such as an RL
        trainer or rollout worker.  Raises ``StoreNotFoundError`` when no
        such store exists.  ``close()`` on the returned handle only detaches.
        """
        return cls(name, pickle=pickle, prefault=prefault, _attach=True)

    # ------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        self._a   # noqa: B018 - raises StoreClosedError when closed

    @property
    def _a(self) -> shm.Arena:
        a = self._arena
        if a is None or self._closed:
            raise StoreClosedError(
                f"store {getattr(self, 'name', '?')!r} is closed; attach again with "
                f"TieredStore.attach({getattr(self, 'name', '?')!r})"
            )
        return a

    def _full_error(self, nbytes: int) -> StoreFullError:
        st = self._raw_stats()
        dram = (f"{format_size(st.used)} of {format_size(st.capacity)} DRAM used "
                f"(largest free block {format_size(st.largest_free)}, "
                f"{format_size(st.pinned_bytes)} pinned by live views)")
        if self._disk is None:
            return StoreFullError(
                f"store {self.name!r} is full: cannot place {format_size(nbytes)}; {dram}, no SSD tier "
                "configured; delete keys, release views, or create the store with a larger dram= "
                "(or an SSD tier with ssd=)")
        d = self._disk
        return StoreFullError(
            f"store {self.name!r} is full: cannot place {format_size(nbytes)}; {dram}, and the SSD "
            f"tier at {d.path} holds {format_size(d.used)} of its {format_size(d.capacity)}; "
            "delete keys, release views, or raise dram= or ssd_size=")

    def _raw_stats(self):
        out = ffi.new("yr_stats *")
        lib.yr_get_stats(self._a.base, out)
        return out

    @property
    def _multi_tier(self) -> bool:
        """Could any object live outside DRAM (here, or HBM in another process)?"""
        return self._disk is not None or self._hbm is not None or bool(self._config.get("hbm"))

    def _check_tier(self, tier: Tier | None) -> Tier | None:
        if tier is None or tier == Tier.DRAM:
            return tier
        if not isinstance(tier, Tier):
            raise TypeError(f"tier must be a yrcache.Tier, not {tier!r}")
        if tier == Tier.SSD and self._disk is None:
            raise ValueError("tier=Tier.SSD needs an SSD tier: create the store with ssd=<directory>")
        if tier == Tier.HBM and self._hbm is None:
            raise ValueError("tier=Tier.HBM needs an HBM tier in this process: create the store "
                             "with hbm=<size> (and device=)")
        return tier

    # ---------------------------------------------------------------- puts

    def put(self, key: str, value: Any, tier: Tier | None = None, priority: int = 0,
            ttl: float | None = None, write_mode: WriteMode | str | None = None) -> None:
        """Store ``value`` under ``key``, replacing any old value atomically.

        One copy into the arena (zero for a value that is not contiguous: it
        is made contiguous first).  Readers see the old object or the new one,
        never a mix; views of the old object stay valid.
        """
        a = self._a
        kb = key_bytes(key)
        if tier is None and ttl is None and write_mode is None and self._hbm is None \
                and type(value) in _PLAIN_TYPES and priority == 0 and type(priority) is int:
            # The common case, kept short: a host value into DRAM.
            meta, payload, nbytes = codec.encode(value, self._pickle)
            return self._put_encoded(a, kb, meta, payload, nbytes, 0, 0.0)
        priority = _priority(priority)
        tier = self._check_tier(tier)
        _write_mode(write_mode)
        expire_at = _expire_at(ttl)
        if self._hbm is not None and self._hbm.takes(value, tier):
            if self._hbm.put(kb, value, priority, expire_at):
                return
        elif tier == Tier.HBM:
            raise TypeError(f"the HBM tier holds torch tensors, not {type(value).__name__}")
        if codec.is_tensor(value) and value.device.type == "cuda" and tier != Tier.SSD:
            # Straight from the device into the (pinned) arena block: one copy.
            self._ensure_cuda_pinned()
            t = value.detach().contiguous()
            nbytes = t.numel() * t.element_size()
            self._put_encoded(a, kb, codec.tensor_meta(t.dtype, t.shape), _device_filler(t), nbytes,
                              priority, expire_at, tier)
            return
        meta, payload, nbytes = codec.encode(value, self._pickle)
        self._put_encoded(a, kb, meta, payload, nbytes, priority, expire_at, tier)

    def _put_encoded(self, a: shm.Arena, kb: bytes, meta: bytes, payload: Any, nbytes: int,
                     priority: int, expire_at: float, tier: Tier | None = None) -> None:
        """Place one encoded object: DRAM unless told or forced otherwise.

        A new object goes to DRAM and, past the high watermark, the coldest
        objects move down to make room; only an object larger than the whole
        DRAM tier (or one DRAM cannot hold even after demoting everything
        movable) goes to SSD.  ``payload`` is a buffer, or a callable that
        fills the arena block.
        """
        block = nbytes + len(kb) + len(meta) + 256
        if tier == Tier.SSD or (self._disk is not None and block > self._dram_capacity):
            return self._put_ssd(a, kb, meta, payload, nbytes, priority, expire_at)
        if self._disk is not None or self._hbm is not None or self._mover.cache:
            self._mover.make_room(block)
        retired, poff = _scratch()
        attempt = functools.partial(self._attempt_put, a, kb, meta, payload, nbytes, priority,
                                    expire_at, retired, poff)
        rc = attempt()
        if rc == lib.YR_ENOSPC:
            # No room: reclaim what dead processes and expired keys hold...
            a.sweep()
            lib.yr_expire(a.base, time.time())
            rc = attempt()
            # ...then demote (or, in cache mode, drop) cold objects one at a
            # time, coldest first, until the object fits.
            if rc == lib.YR_ENOSPC:
                for _ in self._mover.demote_each():
                    rc = attempt()
                    if rc != lib.YR_ENOSPC:
                        break
        if rc == 0:
            if retired.existed and retired.tier != TIER_DRAM:
                self._mover.drain()     # free the replaced object's bytes in its tier
            return
        if rc not in (lib.YR_ENOSPC, lib.YR_ETOOBIG):
            shm.check(rc, f"put of {kb[:60]!r}")
        if self._disk is not None:
            return self._put_ssd(a, kb, meta, payload, nbytes, priority, expire_at)
        raise self._full_error(nbytes)

    def _attempt_put(self, a: shm.Arena, kb: bytes, meta: bytes, payload: Any, nbytes: int,
                     priority: int, expire_at: float, retired, poff) -> int:
        """One try at storing in DRAM: 0, or the arena's error code (ENOSPC: no block fits)."""
        if nbytes <= SMALL_VALUE and not callable(payload):
            src = ffi.from_buffer(payload) if nbytes else ffi.NULL
            return lib.yr_put_small_ex(a.base, a.slot, kb, len(kb), meta, len(meta), src, nbytes,
                                       priority, expire_at, retired)
        rc = lib.yr_reserve(a.base, a.slot, kb, len(kb), meta, len(meta), nbytes,
                            priority, expire_at, poff)
        return self._fill_and_commit(a, rc, poff[0], payload, nbytes, retired) if rc > 0 else rc

    def _put_ssd(self, a: shm.Arena, kb: bytes, meta: bytes, payload: Any, nbytes: int,
                 priority: int, expire_at: float) -> None:
        if self._disk is None:
            raise ValueError("tier=Tier.SSD needs an SSD tier: create the store with ssd=<directory>")
        if callable(payload):   # a filler writes into a buffer; give it a private one
            buf = np.empty(nbytes, dtype=np.uint8)
            payload(buf)
            payload = buf
        elif isinstance(payload, np.ndarray):
            payload = payload.reshape(-1).view(np.uint8)   # any dtype as flat bytes
        from .mover import disk_key, new_gen

        gen = new_gen()
        info = ffi.new("yr_objinfo *")
        info.nbytes, info.priority, info.expire_at = nbytes, priority, expire_at
        mover = self._mover
        stub = mover.reserve_stub(kb, meta, info, gen)
        if stub <= 0:
            mover.demote(4096)      # room for the stub itself
            stub = mover.reserve_stub(kb, meta, info, gen)
            if stub <= 0:
                raise self._full_error(nbytes)
        try:
            mover.put_on_disk(disk_key(gen, kb.decode()), meta, payload, priority, expire_at)
        except BaseException:
            lib.yr_abort(a.base, a.slot, stub)
            raise
        mover.commit_stub(stub, ANY_SEQ)

    def _fill_and_commit(self, a: shm.Arena, block: int, payload_off: int, payload: Any, nbytes: int,
                         retired) -> int:
        try:
            if callable(payload):
                payload(np.frombuffer(ffi.buffer(a.cbase + payload_off, nbytes), dtype=np.uint8))
            else:   # outside the lock; memcpy releases the GIL
                lib.yr_memcpy(a.cbase + payload_off, ffi.from_buffer(payload), nbytes)
        except BaseException:
            lib.yr_abort(a.base, a.slot, block)
            raise
        return lib.yr_commit_ex(a.base, a.slot, block, ANY_SEQ, retired)

    def put_with(self, key: str, meta: bytes, nbytes: int, fill, *, priority: int = 0,
                 ttl: float | None = None) -> None:
        """Reserve ``nbytes`` for ``key``, let ``fill(view)`` write them, then publish.

        ``view`` is a writable flat uint8 ndarray over the arena block; ``fill``
        may cast or copy from a device straight into it (one copy in all).  If
        ``fill`` raises, nothing becomes visible.  ``meta`` comes from
        ``codec.tensor_meta``/``codec.array_meta``.
        """
        a = self._a
        kb = key_bytes(key)
        self._put_encoded(a, kb, meta, fill, int(nbytes), _priority(priority), _expire_at(ttl))

    def mset(self, items: dict[str, Any] | Iterable[tuple[str, Any]], tier: Tier | None = None,
             priority: int = 0, ttl: float | None = None,
             write_mode: WriteMode | str | None = None) -> None:
        """Put several values; each one is atomic (the batch as a whole is not).

        Small values are stored under one hold of the arena lock; larger ones
        (and any that do not fit at once) one by one, as ``put`` does.
        """
        a = self._a
        tier = self._check_tier(tier)
        _write_mode(write_mode)
        expire_at = _expire_at(ttl)
        priority = _priority(priority)
        pairs = list(items.items() if isinstance(items, dict) else items)
        for k, _ in pairs:
            key_bytes(k)            # validate every key before storing anything
        rest = []
        for k, v in pairs:
            if self._hbm is not None and self._hbm.takes(v, tier):
                self.put(k, v, tier=tier, priority=priority, ttl=ttl)
            else:
                rest.append((key_bytes(k), *codec.encode(v, self._pickle)))
        small = [e for e in rest if e[3] <= SMALL_VALUE] if tier != Tier.SSD else []
        done = self._mput_small(a, small, priority, expire_at) if small else 0
        stored = {id(e) for e in small[:done]}
        for e in rest:
            if id(e) not in stored:
                self._put_encoded(a, e[0], e[1], e[2], e[3], priority, expire_at, tier)

    def _mput_small(self, a: shm.Arena, batch: list, priority: int, expire_at: float) -> int:
        """Store small values under one lock hold; returns how many fit."""
        self._mover.make_room(sum(len(kb) + len(meta) + n + 256 for kb, meta, _, n in batch))
        n = len(batch)
        keep = [ffi.from_buffer(p) if nb else ffi.NULL for _, _, p, nb in batch]
        retired = ffi.new("yr_retired[]", n)
        done = lib.yr_mput_small(
            a.base, a.slot, b"".join(e[0] for e in batch), [len(e[0]) for e in batch],
            b"".join(e[1] for e in batch), [len(e[1]) for e in batch], keep,
            [e[3] for e in batch], n, priority, expire_at, retired)
        shm.check(done, "mset")
        if any(retired[i].existed and retired[i].tier != TIER_DRAM for i in range(done)):
            self._mover.drain()
        return done

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value)

    # ---------------------------------------------------------------- gets

    def _view(self, a: shm.Arena, info, key: str | None = None) -> Any:
        """Build the value for a pinned lookup result (consumes the pin)."""
        meta = ffi.buffer(a.cbase + info.meta_off, info.meta_len)[:]
        if meta[:1] == b"P" and not self._pickle:
            a.unpin(info.pin)
            raise self._no_pickle(key)
        dec = codec.decoder(meta)
        if info.tier == TIER_HBM:
            a.unpin(info.pin)
            return self._from_hbm(key, info)
        if info.tier != TIER_DRAM:
            a.unpin(info.pin)   # a stub: the bytes live in a lower tier
            return self._from_lower(key, info, meta)
        if self._hbm is not None and self._hbm.wants(info, meta, self._policy):
            t = self._hbm.promote(key, info, meta)
            if t is not None:
                return t
        ptr = a.pinned_ptr(info.payload_off, info.pin, info.block_off)
        return dec(ffi.buffer(ptr, info.nbytes), info.nbytes)

    def _from_hbm(self, key: str, info) -> Any:
        """An HBM object: ours is returned as is; another process's is demoted on request."""
        a = self._a
        if self._hbm is not None and info.owner == a.slot:
            t = self._hbm.tier.get(key, info.seq)
            return t if t is not None else _RETRY
        kb = key.encode()
        from .mover import HBM_DONE, HBM_REQ, WANTED

        seen = a.notify_value(HBM_DONE)
        lib.yr_set_gen(a.base, kb, len(kb), info.seq, WANTED)
        a.notify_wake(HBM_REQ)
        if not a.notify_wait(HBM_DONE, seen, 0.2):
            a.sweep()   # the owner may be dead: its stubs go with it
        return _RETRY

    def _from_lower(self, key: str, info, meta: bytes) -> Any:
        """Read an object that lives on SSD: promote it if it is hot, else a private copy."""
        mover = self._mover
        free_above = int(self._policy.high * self._a.size)
        if mover.policy.should_promote(info.access_count, info.nbytes, free_above) and \
                mover.promote(key, info, meta):
            return _RETRY
        got = mover.read(key, info, meta)
        if got is None:
            return _RETRY       # it moved or changed while we looked: look again
        meta, buf = got
        if meta[:1] == b"P" and not self._pickle:
            raise self._no_pickle(key)
        return codec.decoder(meta)(buf, len(buf))

    def _no_pickle(self, key: str | None) -> UntrustedStoreError:
        return UntrustedStoreError(
            f"{key!r} holds a pickled object, and this handle of store {self.name!r} was opened "
            "without pickle=True; unpickling runs code chosen by whoever wrote it, so open the "
            "store with pickle=True (TieredStore(..., pickle=True) or TieredStore.attach(name, "
            "pickle=True)) only if you trust every process that writes to it")

    def get(self, key: str, default: Any = None, *, copy: bool = False) -> Any:
        """The value of ``key`` as a read-only zero-copy view, or ``default``.

        The view pins the stored bytes until its last reference dies.  With
        ``copy=True`` returns a private writable copy instead.  O(1) for a
        DRAM object; an SSD object is read (one copy) or promoted first.
        """
        a = self._a
        kb = key_bytes(key)
        info = ffi.new("yr_objinfo *")
        deadline = None
        while True:
            rc = lib.yr_get(a.base, a.slot, kb, len(kb), 1, info)
            if rc == lib.YR_ENOTFOUND:
                return default
            if rc == lib.YR_ENOPINS:
                raise YrcacheError(
                    f"store {self.name!r} has too many live views; drop references to values "
                    "you no longer need (each view pins its object)"
                )
            shm.check(rc, f"get of {key[:60]!r}")
            value = self._view(a, info, key)
            if value is not _RETRY:
                return codec.private_copy(value) if copy else value
            if deadline is None:
                deadline = time.monotonic() + HBM_READ_TIMEOUT
            elif time.monotonic() > deadline:
                break
        raise YrcacheError(f"{key!r} could not be read within {HBM_READ_TIMEOUT:.0f} s: it kept moving "
                           "between tiers, or the process holding it in HBM does not answer")

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def mget(self, keys: Iterable[str], *, copy: bool = False) -> list[Any]:
        """Values of ``keys`` (``None`` for missing ones), looked up under one lock hold."""
        a = self._a
        kbs = [key_bytes(k) for k in keys]
        n = len(kbs)
        if n == 0:
            return []
        infos = ffi.new("yr_objinfo[]", n)
        found = ffi.new("int32_t[]", n)
        klens = ffi.new("uint32_t[]", [len(k) for k in kbs])
        rc = lib.yr_mget(a.base, a.slot, b"".join(kbs), klens, n, 1, infos, found)
        if rc == lib.YR_ENOPINS:
            raise YrcacheError(f"store {self.name!r} has too many live views; drop unused values")
        shm.check(rc, "mget")
        out: list[Any] = []
        try:
            for i in range(n):
                out.append(self._view(a, infos[i], kbs[i].decode()) if found[i] else None)
        except BaseException:   # the failed one released its pin; release the rest
            for j in range(len(out) + 1, n):
                if found[j]:
                    a.unpin(infos[j].pin)
            raise
        out = [self.get(kbs[i].decode()) if v is _RETRY else v for i, v in enumerate(out)]
        return [codec.private_copy(v) for v in out] if copy else out

    def get_into(self, key: str, out: Any) -> Any:
        """Copy the value of ``key`` into ``out`` (ndarray, tensor on any device, or buffer).

        One copy, straight from the arena; ``out`` must have the stored
        number of bytes (and, for arrays and tensors, the stored shape and
        dtype, numpy and torch dtypes compared by meaning: it copies bytes, it
        never casts; see ``codec.check_into``).  Returns ``out``.  Raises
        ``KeyError`` when missing, ``ValueError`` when ``out`` does not fit.
        """
        a = self._a
        kb = key_bytes(key)
        info = ffi.new("yr_objinfo *")
        rc = lib.yr_get(a.base, a.slot, kb, len(kb), 1, info)
        if rc == lib.YR_ENOTFOUND:
            raise KeyError(key)
        shm.check(rc, f"get_into of {key[:60]!r}")
        if codec.is_tensor(out) and out.device.type == "cuda":
            self._ensure_cuda_pinned()
        if info.tier != TIER_DRAM:      # on SSD or in HBM: read it, then copy
            a.unpin(info.pin)
            value = self.get(key, _MISSING)
            if value is _MISSING:
                raise KeyError(key)
            if codec.is_tensor(value):
                meta = codec.tensor_meta(value.dtype, value.shape)
                if value.device.type != "cpu":      # an HBM tensor of this process
                    if codec.is_tensor(out):
                        codec.check_into(key, meta, out, value.numel() * value.element_size())
                        out.copy_(value)
                        return out
                    value = value.cpu()
            elif isinstance(value, np.ndarray):
                meta = codec.array_meta(value.dtype, value.shape)
            else:
                meta = b"B" if isinstance(value, memoryview) else b"P"
            if meta == b"P":
                codec.check_into(key, meta, out, 0)     # raises: a pickled object is no buffer
            _copy_out(key, meta, _as_u8(value), out)
            return out
        try:
            meta = bytes(ffi.buffer(ffi.cast("char *", a.addr + info.meta_off), info.meta_len))
            src = np.frombuffer(ffi.buffer(ffi.cast("char *", a.addr + info.payload_off), info.nbytes),
                                dtype=np.uint8)
            _copy_out(key, meta, src, out)
        finally:
            a.unpin(info.pin)
        return out

    def _info(self, key: str) -> tuple[bytes, int, Tier] | None:
        """(codec header, payload size, tier) of ``key`` without building a view."""
        a = self._a
        kb = key_bytes(key)
        info = ffi.new("yr_objinfo *")
        rc = lib.yr_get(a.base, a.slot, kb, len(kb), 3, info)
        if rc == lib.YR_ENOTFOUND:
            return None
        shm.check(rc, f"info of {key[:60]!r}")
        try:
            meta = bytes(ffi.buffer(ffi.cast("char *", a.addr + info.meta_off), info.meta_len))
        finally:
            a.unpin(info.pin)
        return meta, info.nbytes, _TIERS[info.tier]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            kb = key_bytes(key)
        except ValueError:
            return False
        return lib.yr_contains(self._a.base, kb, len(kb)) == 1

    def tier_of(self, key: str) -> Tier:
        """The tier that holds ``key`` now; ``KeyError`` when missing."""
        info = self._info(key)
        if info is None:
            raise KeyError(key)
        return info[2]

    # ------------------------------------------------------------- deletes

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed.  Views of it stay valid."""
        kb = key_bytes(key)
        retired = ffi.new("yr_retired *")
        rc = lib.yr_delete_ex(self._a.base, kb, len(kb), ANY_SEQ, retired)
        if retired.existed and retired.tier != TIER_DRAM:
            self._mover.drain()
        return rc == 0

    def __delitem__(self, key: str) -> None:
        if not self.delete(key):
            raise KeyError(key)

    # ------------------------------------------------------------ iterating

    def keys(self, prefix: str = "") -> Iterator[str]:  # type: ignore[override]
        """Iterate over keys starting with ``prefix`` (in no particular order).

        Takes the lock once per batch of keys, so concurrent writers are not
        stalled; a key added or removed during the iteration may or may not
        appear.
        """
        a = self._a
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        pb = prefix.encode() if prefix else b""
        return _iter_keys(self, a, pb)

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def __len__(self) -> int:
        a = self._a
        lib.yr_expire(a.base, time.time())
        return self._raw_stats().objects

    # --------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Capacity, use and counters of every tier (a fresh snapshot)."""
        a = self._a
        a.sweep()
        lib.yr_expire(a.base, time.time())
        if self._disk is not None:
            self._mover.flush()
            self._disk.purge_expired()
        st = self._raw_stats()
        # O(objects) when lower tiers exist: stubs are counted by a scan of the index.
        lower = [(r.tier, r.nbytes) for r, _ in scan(a) if r.tier != TIER_DRAM] if self._multi_tier else []
        in_hbm = [n for t, n in lower if t == TIER_HBM]
        disk = self._disk
        tiers: dict = {}
        if self._config.get("hbm"):   # the HBM tier lives in the creating process
            tiers["hbm"] = {"capacity": self._config["hbm"], "used": sum(in_hbm), "objects": len(in_hbm),
                            "device": str(self._hbm.tier.device) if self._hbm is not None else None}
        tiers["dram"] = {"capacity": st.capacity, "used": st.used, "objects": st.objects - len(lower),
                         "free": st.free_bytes, "largest_free": st.largest_free}
        if disk is not None:
            tiers["ssd"] = {"capacity": disk.capacity, "used": disk.used,
                            "objects": sum(1 for t, _ in lower if t == TIER_SSD), "path": disk.path}
        return {
            "name": self.name,
            "tiers": tiers,
            "hits": st.hits, "misses": st.misses, "puts": st.puts, "deletes": st.deletes,
            "spills": st.spills, "promotions": st.promotions, "evictions": st.evictions,
            "pinned_bytes": st.pinned_bytes, "orphans": st.orphans, "recoveries": st.recoveries,
            "processes": st.procs,
        }

    def flush(self) -> None:
        """Wait until background work is done (replication in cluster mode).
        Moves between tiers are synchronous in an embedded store."""
        self._check_open()
        self._mover.flush()

    # ------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        """True once ``close()`` (or ``destroy()``) was called on this handle."""
        return self._closed or self._arena is None

    def close(self) -> None:
        """Release this handle.  The owner's close removes the store's name
        (unless it was created with ``persist=True``): processes still
        attached keep working on their mappings, new attaches fail.  An
        attached process's close only detaches.  Views already returned stay
        valid; operations still running in other threads finish, later ones
        raise ``StoreClosedError``."""
        arena = self._arena
        if arena is None or self._closed:
            return
        self._closed = True
        self._ident = arena._ident
        try:
            if self._hbm is not None:
                _hbm_stores.pop(id(self), None)
                self._hbm.close()
            if self._mover is not None:      # None when the constructor failed early
                self._mover.close()
            if self._disk is not None:
                self._disk.close()
        finally:
            self._arena = None
            # The mapping goes once no view or running operation needs it.
            arena.release_handle()

    def destroy(self) -> None:
        """Remove the store now, whoever is attached (their mappings stay valid)."""
        a = self._arena
        if a is not None:
            a.unlink()
            self.close()
        elif getattr(self, "_ident", None) is not None:
            shm.unlink_if(self.name, self._ident)

    def __enter__(self) -> "TieredStore":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        return (_attach_by_name, (self.name, self._pickle))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} objects"
        return f"<TieredStore {self.name!r} {state}>"

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # Mapping equality/iteration helpers inherited from MutableMapping work
    # through __getitem__/__iter__/__len__; `clear` is faster done directly.
    def clear(self) -> None:
        for k in list(self.keys()):
            self.delete(k)

    def check(self) -> None:
        """Verify the store's invariants; raise ``YrcacheError`` naming the first broken one.

        The arena's own (heap, index, pins, counts), then across tiers: every
        SSD payload has a live stub and every SSD stub a payload; every
        device tensor of this process a live stub of the same object; and each
        lower tier's ``used`` equals the sum of what it holds.  O(objects);
        meant for tests and ``yrcache stat``, on a store nobody is writing.
        """
        a = self._a
        msg = ffi.new("char[256]")
        if lib.yr_check_invariants(a.base, msg, 256) != 0:
            raise YrcacheError(f"arena invariant violated: {ffi.string(msg).decode()}")
        if not self._multi_tier:
            return
        lib.yr_expire(a.base, time.time())
        self._mover.drain()
        soon = time.time() + 1.0     # objects about to expire may be gone from one tier already
        stubs = [(r, k) for r, k in scan(a) if r.tier != TIER_DRAM]
        if self._disk is not None:
            from .mover import disk_key

            on_disk = {e.key: e.nbytes for e in self._disk.entries()}
            want = {disk_key(r.gen, k): r for r, k in stubs if r.tier == TIER_SSD}
            for dk, r in want.items():
                if dk not in on_disk and not (r.expire_at and r.expire_at <= soon):
                    raise YrcacheError(f"SSD stub {dk!r} has no payload in {self._disk.path}")
            stray = [dk for dk, _ in on_disk.items() if dk not in want]
            if stray:
                raise YrcacheError(f"SSD payloads with no stub in the index: {stray[:5]}")
            if self._disk.used != sum(on_disk.values()):
                raise YrcacheError(f"SSD tier used {self._disk.used} != {sum(on_disk.values())} held")
        if self._hbm is not None:
            dev = self._hbm.tier
            mine = {k: r for r, k in stubs if r.tier == TIER_HBM and r.owner == a.slot}
            held = dev.items()
            for k, obj in held:
                r = mine.get(k)
                if r is None or r.seq != obj.seq:
                    raise YrcacheError(f"device tensor {k!r} (object {obj.seq}) has no live stub")
            total = sum(o.tensor.numel() * o.tensor.element_size() for _, o in held)
            if dev.used != total:
                raise YrcacheError(f"HBM tier used {dev.used} != {total} held")


_hbm_stores: dict[int, "weakref.ref[TieredStore]"] = {}   # stores are unhashable (Mapping)


def _after_fork_in_child() -> None:
    for ref in list(_hbm_stores.values()):
        store = ref()
        if store is not None:
            store._drop_hbm_after_fork()
    _hbm_stores.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _attach_by_name(name: str, pickle: bool) -> TieredStore:
    return TieredStore.attach(name, pickle=pickle)


def _iter_keys(store: TieredStore, a: shm.Arena, prefix: bytes) -> Iterator[str]:
    cursor = ffi.new("uint64_t *", 0)
    size = 1 << 16
    while True:
        store._check_open()   # the iterator keeps the mapping, not the store, open
        buf = ffi.new("char[]", size)
        n = lib.yr_keys(a.base, cursor, buf, size, prefix, len(prefix))
        if n < -1000:  # one bucket needs a bigger buffer
            size = max(size * 2, -(n + 1000))
            continue
        shm.check(n, "keys")
        raw = ffi.buffer(buf, size)
        pos = 0
        out = []
        for _ in range(n):
            klen = int.from_bytes(raw[pos:pos + 4], "little")
            out.append(raw[pos + 4:pos + 4 + klen].decode())
            pos += 4 + klen
        yield from out
        if cursor[0] == 0:
            return


def _copy_out(key: str, meta: bytes, src: np.ndarray, out: Any) -> None:
    """Copy the stored bytes ``src`` into ``out`` once ``codec.check_into`` allows it."""
    codec.check_into(key, meta, out, src.nbytes)
    if codec.is_tensor(out) and out.device.type != "cpu":
        import torch

        out.view(-1).view(torch.uint8).copy_(torch.from_numpy(src), non_blocking=False)
        return
    np.copyto(codec.as_bytes_view(out), src)


_tls = threading.local()


def _scratch():
    """Per-thread out-structs for the put path (ffi.new costs more than the C call)."""
    try:
        return _tls.put
    except AttributeError:
        _tls.put = (ffi.new("yr_retired *"), ffi.new("uint64_t *"))
        return _tls.put


def _device_filler(t: Any):
    def fill(dst: np.ndarray) -> None:
        if dst.size:
            import torch

            torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8))
    return fill


def _default_device() -> str:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("hbm= needs a CUDA device and none is available; pass device='cpu' "
                         "to run the HBM tier on host memory, or drop hbm=")
    return "cuda:0"


def _as_u8(value: Any) -> np.ndarray:
    """Flat uint8 view of a value returned by ``get`` (no copy)."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8)
    if codec.is_tensor(value):
        return codec.as_bytes_view(value)
    return np.frombuffer(value, dtype=np.uint8)


def _check_ratios(ratios) -> tuple[float, float, float]:
    if ratios is None:
        return (0.0, 1.0, 0.0)
    r = tuple(float(x) for x in ratios)
    if len(r) != 3 or any(x < 0 for x in r) or abs(sum(r) - 1.0) > 1e-6:
        raise ValueError(f"ratios must be three non-negative shares (hbm, dram, ssd) summing to 1, got {ratios!r}")
    return r  # type: ignore[return-value]


_I64 = 1 << 63


def _priority(priority: Any) -> int:
    """Validate ``priority=``: an int that fits in 64 bits (numpy ints too, not bools or floats)."""
    if type(priority) is not int:
        if isinstance(priority, bool) or not hasattr(priority, "__index__"):
            raise TypeError(f"priority must be an int, not {type(priority).__name__} {priority!r}")
        priority = operator.index(priority)
    if not -_I64 <= priority < _I64:
        raise ValueError(f"priority must fit in 64 bits (-2**63 <= priority < 2**63), got {priority}")
    return priority


def _expire_at(ttl: float | None) -> float:
    if ttl is None:
        return 0.0
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return time.time() + ttl


def _write_mode(mode: WriteMode | str | None) -> WriteMode | None:
    if mode is None or isinstance(mode, WriteMode):
        return mode
    try:
        return WriteMode(mode)
    except ValueError:
        raise ValueError(f"write_mode must be one of {[m.value for m in WriteMode]}, got {mode!r}") from None
