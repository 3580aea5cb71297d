"""TieredStore: the facade: validation, the mapping protocol, stats.

A ``TieredStore`` is a ``MutableMapping[str, value]`` over one shared-memory
arena (the DRAM tier, ``tiers/dram.py``), with optional SSD and HBM tiers.
Values come back as read-only zero-copy views that pin their bytes: they stay
valid and unchanged while referenced, even when the key is overwritten or
deleted, the store is closed, or the writer dies.  Where objects go and how
reads are served is ``placement.py``; settings are ``config.py``.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import codec
from .config import Settings, Tier, WriteMode, default_device, write_mode as _write_mode
from .errors import StoreClosedError, StoreNotFoundError, UntrustedStoreError, YrcacheError
from .mover import Mover
from .placement import RETRY, Placement
from .policy import Policy
from .sizes import format_size
from .store_ops import StoreOps, learn_flat, learn_view, unpin_hits
from .validate import check_iterable_keys, expire_at as _expire_at, key_bytes, priority as _priority
from .tiers.dram import SHM_DIR, TIER_DRAM, Arena, check_name, unlink_if
from .types import Value

if TYPE_CHECKING:
    from .hbm import HbmOwner
    from .tiers.disk import DiskTier

__all__ = ["TieredStore", "Tier", "WriteMode", "key_bytes"]

HBM_READ_TIMEOUT = 10.0    # seconds a reader waits for another process to demote an HBM object
_MISSING = object()
_PLAIN_TYPES = (np.ndarray, bytes, bytearray)


class TieredStore(StoreOps, MutableMapping[str, Value]):
    """An embedded tiered key-value store for bytes, arrays and tensors.

    ``TieredStore(name=..., dram="2GiB")`` creates a store (or adopts one whose
    owner died); ``TieredStore.attach(name)`` joins an existing one from any
    process on the node.  A store pickles as its name, so passing it to a
    ``multiprocessing`` child attaches there.

    Arguments (sizes are ints or strings such as ``"2GiB"``; ``YRCACHE_*``
    environment variables fill in what is not given):

    - ``dram``: the shared-memory arena; ``ssd``/``ssd_size``: a directory
      and its budget for the SSD tier; ``hbm``/``device``: GPU memory for
      the HBM tier; or ``capacity`` split by ``ratios`` (HBM, DRAM, SSD).
    - ``policy``: ``"spill"`` (move cold objects down, ``StoreFullError``
      when nothing fits) or ``"cache"`` (drop them); ``watermarks``: the
      (high, low) fill fractions between which a tier spills;
      ``promote_after``: reads of a lower-tier object before it moves up.
    - ``pickle``: store and read other Python objects (this process only
      reads pickles when True); ``prefault``: map the whole arena now;
      ``huge_pages``: ask for transparent huge pages (granted where
      /dev/shm is mounted ``huge=advise``); ``persist``: keep the store
      after its owner closes, until ``destroy()``.
    - ``cluster="etcd://host:port/name"`` (or ``YRCACHE_ETCD``): join a
      cluster, with ``listen``, ``replicas``, ``write_mode``, ``member``,
      ``token`` and ``lease_ttl``; the store
      returned is a ``ClusterStore`` (docs/cluster.md). ``cluster=False``
      ignores ``YRCACHE_ETCD``: a store of this node only.

    Examples:
        >>> with TieredStore(dram="16MiB") as s:
        ...     s["x"] = np.arange(3)
        ...     s["x"].tolist()
        [0, 1, 2]
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "TieredStore":
        """A cluster store (``yrcache.cluster.store.ClusterStore``) when ``cluster=`` is
        given or ``YRCACHE_ETCD`` is set (and ``cluster=False`` is not)."""
        if cls is TieredStore and not kwargs.get("_attach"):
            c = kwargs.get("cluster")
            if c or (c is None and os.environ.get("YRCACHE_ETCD")):
                return super().__new__(TieredStore._cluster_class)
        return super().__new__(cls)

    _cluster_class: type["TieredStore"]   # yrcache.cluster.store.ClusterStore registers itself

    def __init__(self, name: str | None = None, *, dram: int | str | None = None,
                 ssd: str | os.PathLike[str] | None = None, ssd_size: int | str | None = None,
                 hbm: int | str | None = None, device: str | None = None,
                 capacity: int | str | None = None, ratios: tuple[float, float, float] | None = None,
                 policy: str = "spill", pickle: bool = False, prefault: bool = True,
                 watermarks: tuple[float, float] = (0.9, 0.8), promote_after: int = 2,
                 persist: bool | None = None, huge_pages: bool = False,
                 cluster: str | bool | None = None, listen: str | None = None, replicas: int | None = None,
                 write_mode: WriteMode | str | None = None, member: bool | None = None,
                 token: str | None = None, lease_ttl: float | None = None, _attach: bool = False) -> None:
        self._arena: Arena | None = None
        self._placement: Placement = None  # type: ignore[assignment]  # set by _configure (close() checks)
        self._disk: DiskTier | None = None
        self._closed = False
        if cluster not in (None, False):
            raise TypeError("cluster= takes 'etcd://host:port/name' (a cluster store) or False (this node only)")
        if any(x is not None for x in (listen, replicas, member, token, lease_ttl)):
            raise TypeError("listen=, replicas=, member=, token= and lease_ttl= apply to a cluster store only: "
                            "pass cluster='etcd://host:port/name'")
        self._pickle = bool(pickle)
        self._write_mode = _write_mode(write_mode)
        if _attach:
            self.name = check_name(name)
            self._arena = Arena(self.name, prefault=prefault)
            self._configure(self._arena.read_config() or {})
            return
        st = Settings.build(dram=dram, ssd=ssd, ssd_size=ssd_size, hbm=hbm, device=device, capacity=capacity,
                            ratios=ratios, policy=policy, pickle=pickle, prefault=prefault,
                            watermarks=watermarks, promote_after=promote_after, persist=persist,
                            huge_pages=huge_pages)
        st.check_room(SHM_DIR)
        device_tier = None
        if st.hbm:
            from .tiers.device import DeviceTier

            device_tier = DeviceTier(st.device or default_device(), st.hbm)   # validates device= first
        self.name = check_name(name) if name is not None else f"yr-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        arena = _create_arena(self.name, st)
        adopted = not arena.created
        self._arena = arena
        try:
            if adopted:
                self._adopt(arena, st.dram if st.dram_explicit else None)
                config = arena.read_config() or st.shared()
                if persist is not None:   # an explicit choice overrides the recorded one
                    config["persist"] = bool(persist)
                    arena.write_config(config)
            else:
                config = st.shared()
                arena.write_config(config)
            arena.persist = bool(config.get("persist"))
            self._configure(config)
            if device_tier is not None:
                from .hbm import HbmOwner

                HbmOwner(self._placement, device_tier, self.pin_host_memory)
            if self._disk is not None and not adopted:
                self._placement.mover.rebuild()          # a fresh arena over an old SSD directory
            elif self._disk is not None and len(arena.attached()) == 1:
                self._placement.mover.vacuum()           # adopted, nobody else moving: drop stray copies
        except BaseException:
            if adopted:   # the segment holds someone's data: leave it for a later adoption
                arena.is_owner = False
                self.close()
            else:
                self.destroy()
            raise

    def _configure(self, config: dict) -> None:
        a = self._a
        if config.get("huge_pages") and not a.huge_pages:
            a.advise_huge()            # this process's mapping too (the pages are shared)
        policy = Policy(config.get("high", 0.9), config.get("low", 0.8), config.get("promote_after", 2))
        if config.get("ssd"):
            from .tiers.disk import DiskTier

            self._disk = DiskTier(config["ssd"], config.get("ssd_size"), owner=config.get("id"))
        self._placement = Placement(a, policy, Mover(a, self._disk), config.get("policy") == "cache", self.name)
        self._config = config

    def _adopt(self, arena: Arena, asked: int | None) -> None:
        """Take over an existing segment whose owner is gone; refuse a live one."""
        owners = [pid for slot, pid, owner in arena.attached() if owner and slot != arena.slot]
        if owners:
            arena.release_handle()
            raise FileExistsError(
                f"store {self.name!r} already exists and is owned by pid {owners[0]}; "
                f"use TieredStore.attach({self.name!r}) to share it, or pick another name")
        arena.take_ownership()
        if asked is not None and asked != arena.size:
            warnings.warn(
                f"store {self.name!r} already exists (its owner closed it persistent, or died) and was "
                f"adopted with its own size, {format_size(arena.size)}, not the {format_size(asked)} asked for; "
                f"to resize it, copy what you need, then destroy it (`yrcache destroy {self.name}`) "
                "and create it again", UserWarning, stacklevel=3)

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

        ```python
        # process A                                  # process B, same node
        s = TieredStore(name="exp1", dram="2GiB")    s = TieredStore.attach("exp1")
        s["w"] = torch.randn(1024, 1024)             w = s["w"]   # the same pages, no copy
        ```
        """
        return cls(name, pickle=pickle, prefault=prefault, _attach=True)

    # ------------------------------------------------------------- helpers

    @property
    def _a(self) -> Arena:
        a = self._arena
        if a is None or self._closed:
            name = getattr(self, "name", "?")
            raise StoreClosedError(f"store {name!r} is closed; attach again with TieredStore.attach({name!r}), or, "
                                   f"if its owner closed it (that removes it), make it again with TieredStore({name!r})")
        return a

    @property
    def pickle(self) -> bool:
        """True if this handle stores and reads pickled objects (opened with ``pickle=True``)."""
        return self._pickle

    @property
    def _hbm(self) -> HbmOwner | None:
        """This process's HBM tier, or None (a forked child has none)."""
        p = self._placement
        return p.hbm if p is not None else None

    def _check_open(self) -> None:
        self._a   # noqa: B018 - raises StoreClosedError when closed

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

    def put(self, key: str, value: Value, tier: Tier | None = None, priority: int = 0,
            ttl: float | None = None, write_mode: WriteMode | str | None = None) -> None:
        """Store ``value`` under ``key``, replacing any old value atomically.

        One copy into the arena (none more for a value that is not
        contiguous: it is made contiguous first).  Readers see the old object
        or the new one, never a mix; views of the old object stay valid.

        ``tier`` is a placement hint (default: DRAM, or HBM for a device
        tensor when this process has an HBM tier); ``priority`` orders
        demotion (lower leaves a fast tier first); ``ttl`` makes the object
        invisible after that many seconds; ``write_mode`` is validated (it
        matters only to a cluster store, docs/cluster.md).  Raises
        ``StoreFullError`` when no tier has room, ``TypeError`` for a value
        the store cannot hold.

        Examples:
            >>> with TieredStore(dram="16MiB") as s:
            ...     s.put("replay/0", np.arange(4), priority=-1, ttl=60)
            ...     s["replay/0"].tolist()
            [0, 1, 2, 3]
        """
        a = self._a    # holds the mapping while the put runs (a close() may drop ours)
        p = self._placement
        if tier is None and ttl is None and write_mode is None and p.plain \
                and type(value) in _PLAIN_TYPES and type(priority) is int and priority == 0:
            # The common case, kept short: a host value into DRAM, in one C call when
            # there is no room to make (the C side knows the header of bytes, and of
            # the array layouts puts have taught it).
            direct = p.direct
            done = direct and a.hot.put_value(key, value, a.prefaulted)
            if done:
                return
            meta, payload, nbytes = codec.encode(value, self._pickle)
            if done is None and payload is value:
                a.hot.learn(value, meta)
            if direct and a.hot.put(key, meta, payload, a.prefaulted):
                return
            p.put(key_bytes(key), meta, payload, nbytes, 0, 0.0)
            return
        kb = key_bytes(key)
        priority = _priority(priority)
        tier = self._check_tier(tier if tier is not None else p.default_for(value))
        _write_mode(write_mode)
        expire_at = _expire_at(ttl)
        if self._hbm is not None and self._hbm.takes(value, tier):
            if self._hbm.put(kb, value, priority, expire_at):
                return
        elif tier == Tier.HBM:
            raise TypeError(f"the HBM tier holds torch tensors, not {type(value).__name__}")
        if codec.is_tensor(value) and value.device.type == "cuda" and tier != Tier.SSD:
            # Straight from the device into the (pinned) arena block: one copy.
            self.pin_host_memory()
            t = value.detach().contiguous()
            self._placement.put(kb, codec.tensor_meta(t.dtype, t.shape), codec.device_filler(t),
                                t.numel() * t.element_size(), priority, expire_at, tier)
            return
        meta, payload, nbytes = codec.encode(value, self._pickle)
        self._placement.put(kb, meta, payload, nbytes, priority, expire_at, tier)

    def __setitem__(self, key: str, value: Value) -> None:
        """``store[key] = value``: ``put(key, value)`` with the default options."""
        self.put(key, value)

    # ---------------------------------------------------------------- gets

    def _value(self, a: Arena, info, key: str) -> Any:
        """Build the value of a pinned lookup (consumes the pin), or RETRY."""
        meta = a.meta(info)
        if meta[:1] == b"P" and not self._pickle:
            a.unpin(info.pin)
            raise self._no_pickle(key)
        return self._placement.read(key, info, meta, codec.decoder(meta))

    def _pinned_value(self, a: Arena, hit: tuple, key: str) -> Any:
        """The view of a DRAM object the hot path pinned (consumes the pin)."""
        meta, offset, nbytes, pin, block = hit
        if meta[:1] == b"P" and not self._pickle:
            a.unpin(pin)
            raise self._no_pickle(key)
        buf = a.pinned_buffer(offset, nbytes, pin, block)   # from here the pin goes with buf
        value = codec.decoder(meta)(buf, nbytes)
        learn_view(a, meta)
        return value

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

        Examples:
            >>> with TieredStore(dram="16MiB") as s:
            ...     s["k"] = np.arange(3)
            ...     v = s.get("k")
            ...     c = s.get("k", copy=True)
            ...     (v.flags.writeable, c.flags.writeable, s.get("missing", "default"))
            (False, True, 'default')
        """
        a = self._a
        if self._hbm is None:      # the hot path: a DRAM value or a miss in one C call (else: False)
            hit = a.hot.get(key)
            if hit.__class__ is tuple:
                if len(hit) == 2:  # (header + payload, header length): a small value copied out
                    data, mlen = hit
                    value = self._small_value(data, 0, mlen, len(data) - mlen, key)
                    learn_flat(a, data, mlen)
                else:              # (header, payload offset, size, pin, block): a pinned one
                    value = self._pinned_value(a, hit, key)
                return codec.private_copy(value) if copy else value
            if hit is None:
                return default
            if hit is not False:   # a small bytes value or 1-D array, built in C
                return codec.private_copy(hit) if copy else hit
        kb = key_bytes(key)
        deadline = None
        while True:
            got = a.read(kb, small=self._hbm is None)   # (an HBM holder promotes from pinned reads)
            if got is None:
                return default
            info, small = got
            if small is not None:      # a small DRAM value, copied out (no pin)
                mlen = info.meta_len
                value = self._small_value(small, 0, mlen, info.nbytes, key)
            else:
                value = self._value(a, info, key)
            if value is not RETRY:
                return codec.private_copy(value) if copy else value
            if deadline is None:
                deadline = time.monotonic() + HBM_READ_TIMEOUT
            elif time.monotonic() > deadline:
                raise YrcacheError(f"{key!r} could not be read within {HBM_READ_TIMEOUT:.0f} s: it kept "
                                   "moving between tiers, or the process holding it in HBM does not answer")

    def _small_value(self, data: bytes, meta_off: int, meta_len: int, nbytes: int, key: str) -> Any:
        """The value of a small object copied out by a read into ``data`` (its
        header at ``meta_off``, its payload right after): read-only, private (a
        tensor is a writable copy: torch has no read-only tensors; see README)."""
        meta = data[meta_off:meta_off + meta_len]
        if meta[:1] == b"P" and not self._pickle:
            raise self._no_pickle(key)
        return codec.copied_decoder(meta)(data, meta_off + meta_len, nbytes)

    def __getitem__(self, key: str) -> Value:
        """``store[key]``: the value as ``get`` returns it; ``KeyError`` when missing."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def mget(self, keys: Iterable[str], *, copy: bool = False) -> list[Value | None]:
        """Values of ``keys`` (``None`` for missing ones), looked up under one lock hold.

        The values are one snapshot: small DRAM values are copied out, the
        rest pinned as by ``get`` (zero-copy views; ``copy=True``: private
        copies).
        """
        a = self._a
        keys = keys if type(keys) is list else list(check_iterable_keys(keys))
        hits = a.hot.mget(keys) if self._hbm is None and keys else False   # one C call (or False)
        if hits is not False:
            out: list[Any] = []
            try:
                for key, hit in zip(keys, hits):
                    if hit.__class__ is not tuple:         # missing, or built in C
                        out.append(hit)
                    elif len(hit) == 5:                   # pinned
                        out.append(self._pinned_value(a, hit, key))
                    else:                                 # a small value, copied out
                        data, mlen = hit
                        out.append(self._small_value(data, 0, mlen, len(data) - mlen, key))
                        learn_flat(a, data, mlen)
            except BaseException:   # the failed one released its pin; release the rest
                unpin_hits(a, hits[len(out) + 1:])
                raise
            return [codec.private_copy(v) for v in out] if copy else out
        kbs = [key_bytes(k) for k in keys]
        if not kbs:
            return []
        infos, found, copied = a.mread(kbs, small=self._hbm is None)
        out = []
        try:
            for i, kb in enumerate(kbs):
                f, info = found[i], infos[i]
                if f == 2:           # a small DRAM value, copied out (no pin)
                    out.append(self._small_value(copied, info.meta_off, info.meta_len, info.nbytes, kb.decode()))
                else:
                    out.append(self._value(a, info, kb.decode()) if f else None)
        except BaseException:   # the failed one released its pin; release the rest
            for j in range(len(out) + 1, len(kbs)):
                if found[j] == 1:
                    a.unpin(infos[j].pin)
            raise
        out = [self.get(kbs[i].decode()) if v is RETRY else v for i, v in enumerate(out)]
        return [codec.private_copy(v) for v in out] if copy else out

    def __contains__(self, key: object) -> bool:
        """``key in store``: O(1), without reading the value; False for anything not a valid key."""
        if not isinstance(key, str):
            return False
        try:
            kb = key_bytes(key)
        except ValueError:
            return False
        return self._a.contains(kb)

    # ------------------------------------------------------------- deletes

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed.  Views of it stay valid."""
        deleted, retired = self._a.delete(key_bytes(key))
        if retired.existed and retired.tier != TIER_DRAM:
            self._placement.drain()
        return deleted

    def __delitem__(self, key: str) -> None:
        """``del store[key]``: ``delete(key)``; ``KeyError`` when missing."""
        if not self.delete(key):
            raise KeyError(key)

    def clear(self) -> None:
        """Remove every key."""
        for k in list(self.keys()):
            self.delete(k)

    # ------------------------------------------------------------ iterating

    def keys(self, prefix: str = "") -> Iterator[str]:  # type: ignore[override]
        """Iterate over keys starting with ``prefix``, in byte order.

        From the arena's sorted index: costs a logarithmic search plus the
        matches, whatever the store holds, and takes the lock once per batch
        of at most 128 keys, so concurrent writers are not stalled.  A key
        added or removed during the iteration may or may not appear; every
        other key appears once.  An iterator resumed after ``close()`` raises
        StoreClosedError.

        Examples:
            >>> with TieredStore(dram="16MiB") as s:
            ...     s.mset({"policy/w2": b"", "policy/w1": b"", "replay/0": b""})
            ...     list(s.keys(prefix="policy/"))
            ['policy/w1', 'policy/w2']
        """
        a = self._a
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        return a.keys(prefix.encode(), self._check_open)

    def __iter__(self) -> Iterator[str]:
        """Iterate over every key, in byte order (``keys()``)."""
        return self.keys()

    def __len__(self) -> int:
        """The number of objects in every tier (expired ones are dropped first)."""
        a = self._a
        a.expire(time.time())
        return a.stats().objects

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
                self._hbm.close()
            if self._placement is not None:      # None when the constructor failed early
                self._placement.close()
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
            unlink_if(self.name, self._ident)

    def __enter__(self) -> "TieredStore":
        """``with TieredStore(...) as s:`` closes the handle when the block ends."""
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the handle (``close()``)."""
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


def _create_arena(name: str, st: Settings) -> Arena:
    """Create the arena, or open the one another process made.  One found between its
    creator's making and locking it (a moment: not sized or not set up yet) is opened again."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            return Arena(name, create=True, size=st.dram, prefault=st.prefault, huge_pages=st.huge_pages)
        except StoreNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _attach_by_name(name: str, pickle: bool) -> TieredStore:
    return TieredStore.attach(name, pickle=pickle)
