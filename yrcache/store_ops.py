"""The store's operations beside the mapping protocol: what is where, stats,
checks, named words and memory hints; puts of several values or of encoded
payloads (``mset``, ``put_with``, ``mput_raw``) and reads of the stored bytes
(``get_raw``, ``mget_raw``, ``get_into``).  ``TieredStore`` inherits them
(``store.py`` keeps the facade's core: ``put``, reads, deletes, keys, life cycle).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import codec, pinning
from .config import Tier, WriteMode, write_mode as _write_mode
from .placement import RETRY, SMALL_VALUE
from .errors import YrcacheError
from .node_locks import node_locks as _node_locks
from .tiers.dram import TIER_DRAM, Word, check
from .types import Value
from .validate import check_iterable_keys, expire_at as _expire_at, explain_pairs, key_bytes, mset_pairs, payload_nbytes, priority as _priority, timeout as _check_timeout

if TYPE_CHECKING:
    from .hbm import HbmOwner
    from .placement import Placement
    from .tiers.disk import DiskTier
    from .tiers.dram import Arena

_WORD_PREFIX = "user/"
_MISSING = object()
_Out = TypeVar("_Out")


class StoreOps:
    """Mixed into ``TieredStore``: needs ``_a``, ``_placement``, ``_config``, ``_hbm``, ``name``."""

    if TYPE_CHECKING:    # provided by TieredStore
        name: str
        _placement: Placement
        _disk: DiskTier | None
        _config: dict

        @property
        def _a(self) -> Arena: ...

        @property
        def _hbm(self) -> HbmOwner | None: ...

        def get(self, key: str, default: Any = None, *, copy: bool = False) -> Any: ...

        def put(self, key: str, value: Value, tier: Tier | None = None, priority: int = 0,
                ttl: float | None = None, write_mode: WriteMode | str | None = None) -> None: ...

        _pickle: bool

        def _check_open(self) -> None: ...

        def _check_tier(self, tier: Tier | None) -> Tier | None: ...

    def pin_host_memory(self) -> None:
        """Register the arena as pinned (page-locked) host memory for CUDA.

        Copies between the arena and a GPU then run at full PCIe speed, with
        no bounce through a pageable buffer.  Done once per process and
        mapping (and undone before the mapping goes); yrcache calls it at the
        first device copy, so CPU-only users never initialise CUDA.  A no-op
        without CUDA; if CUDA refuses, a warning is logged and copies stay
        correct at pageable speed.
        """
        pinning.register(self._a)

    def prefault(self, *values: Value) -> None:
        """Map arena pages now instead of one page fault per 4 KiB later.

        Without arguments: every page of the arena, as ``attach(prefault=True)``
        does up front (about 0.14 s per GiB), for a long-lived worker that
        attached lazily.  With values (views from ``get``/``mget``): only the
        pages under them, one call each, for a process about to read most of a
        large value.  A no-op for small values, values outside the arena and
        mappings that are already prefaulted.
        """
        a = self._a
        if not values:
            a.populate(a.addr, a.size, write=True)
            a.prefaulted = True
            return
        for v in values:
            if v is not None and not (codec.is_tensor(v) and v.device.type != "cpu"):
                a.populate(*codec.extent(v))

    def word(self, name: str) -> Word:
        """A named word of this store: a 64-bit ``value`` and a wake-up counter.

        Shared by every process of the store, created on first use, kept for
        the store's life.  ``w.seq`` then ``w.wait(seen, timeout)`` sleeps on
        a futex until someone calls ``w.wake()``; ``w.cas(old, new)`` updates
        ``value`` atomically.  No lock and no lookup after the first call.

        Examples:
            >>> from yrcache import TieredStore
            >>> with TieredStore(dram="16MiB") as s:
            ...     w = s.word("ready")
            ...     seen = w.seq
            ...     w.wake()
            ...     w.wait(seen, timeout=1.0)
            True
        """
        if not isinstance(name, str) or not 0 < len(name.encode()) <= 200 or "\x00" in name:
            raise ValueError(f"word names are 1-200 UTF-8 bytes without NUL, got {name!r}")
        return self._a.word(_WORD_PREFIX + name)

    def node_lock(self, key: str, timeout: float | None = None) -> AbstractContextManager[None]:
        """A lock shared by every process of this machine using this store: ``with
        s.node_lock(k):`` holds one of 2**20 locks, chosen by a hash of ``k`` (unrelated
        keys rarely share one). It is let go when the block ends or the holder dies (an
        OFD lock on the store's segment). Not reentrant. ``timeout`` (seconds; None:
        wait as long as it takes): the ``with`` raises ``TimeoutError`` if the lock is
        still held elsewhere by then."""
        if not isinstance(key, str):
            raise TypeError(f"node_lock takes a str key, got {type(key).__name__} {key!r}")
        return _node_locks(self.name, (key,), _check_timeout(timeout))

    def node_locks(self, keys: Iterable[str], timeout: float | None = None) -> AbstractContextManager[None]:
        """``node_lock`` of several keys at once: ``with s.node_locks(ks):`` holds all of
        them. Their locks are taken in one global order, so holders of overlapping sets
        never deadlock; do not take another node lock while holding these. ``timeout``:
        as ``node_lock``'s, for all of them (none is held after a ``TimeoutError``)."""
        if isinstance(keys, (str, bytes)):
            raise TypeError("node_locks takes several keys (a list of str); for one key use node_lock(key)")
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"node_locks takes str keys, got {type(k).__name__} {k!r}")
        return _node_locks(self.name, keys, _check_timeout(timeout))

    def get_raw(self, key: str) -> tuple[bytes, memoryview] | None:
        """``(meta, payload)`` of ``key`` as stored, without decoding it, or None.

        ``meta`` is the codec header; ``payload`` the stored bytes, read-only: a
        private copy for a small object, else a view that pins them.  For passing
        an object on as it is (cluster mode sends these over the wire).
        """
        a = self._a
        if self._hbm is None:       # a DRAM object or a miss in one C call (else: False)
            hit = a.hot.read(key)
            if hit is None:
                return None
            if hit is not False:
                return _raw_hit(a, hit, key)
        got = a.read(key_bytes(key), small=self._hbm is None)
        return None if got is None else self._raw_of(key, *got)

    def _raw_of(self, key: str, info: Any, small: bytes | None) -> tuple[bytes, memoryview] | None:
        """``get_raw``'s answer for an object read (and counted) already: ``small`` its
        copied bytes, or None when ``info`` holds a pin, which this takes over."""
        a = self._a
        meta = small[:info.meta_len] if small is not None else a.meta(info)
        if meta[:1] == b"P":
            if small is None:
                a.unpin(info.pin)
            raise TypeError(f"{key!r} holds a pickled object, which has no raw form: read it with get()")
        if small is not None:
            return meta, memoryview(small)[info.meta_len:]
        value = self._placement.read(key, info, meta, _raw_view)    # DRAM: a pinned view, as stored
        if value is RETRY:
            value = self.get(key, _MISSING)
            if value is _MISSING:
                return None
        if isinstance(value, memoryview):
            return meta, value
        _, payload, nbytes = codec.encode(value)        # read from SSD, or an HBM tensor
        return meta, memoryview(payload).cast("B").toreadonly() if nbytes else memoryview(b"")

    def mset(self, items: Mapping[str, Value] | Iterable[tuple[str, Value]], tier: Tier | None = None,
             priority: int = 0, ttl: float | None = None,
             write_mode: WriteMode | str | None = None) -> None:
        """Put several values; each one is atomic (the batch as a whole is not).

        Small values are stored 256 per hold of the arena lock; larger ones
        (and any that do not fit at once) one by one, as ``put`` does.
        ``items``: a mapping, or an iterable of ``(key, value)`` pairs; every
        key is validated before anything is stored.  When a value cannot be
        stored, the error (``StoreFullError``...) carries a note naming the
        values of the batch that were not stored; the others were.

        Examples:
            >>> from yrcache import TieredStore
            >>> with TieredStore(dram="16MiB") as s:
            ...     s.mset({"a": b"x", "b": b"y"})
            ...     [bytes(v) if v is not None else None for v in s.mget(["a", "b", "c"])]
            [b'x', b'y', None]
        """
        self._check_open()
        self._check_tier(tier)
        _write_mode(write_mode)
        expire_at = _expire_at(ttl)
        priority = _priority(priority)
        pairs = mset_pairs(items, check=False)
        try:
            self._mset(pairs, tier, priority, ttl, expire_at)
        except (TypeError, ValueError):
            explain_pairs(pairs)            # a bad item says so (not "cannot unpack int")
            raise

    def _mset(self, pairs: list, tier: Tier | None, priority: int, ttl: float | None,
              expire_at: float) -> None:
        p, learn = self._placement, False
        if tier is None and p.direct and pairs:
            # The common case in one C call: keys checked and headers found there (bytes,
            # arrays of learned layouts), 256 per lock hold, as far as they fit.
            a = self._a
            _ = a.slot                       # a forked child takes its own slot first
            got = a.hot.mput_values(pairs, priority, expire_at, SMALL_VALUE)
            if isinstance(got, tuple):
                if got[0] == len(pairs):
                    return
                pairs = pairs[got[0]:]       # the rest did not fit: the general path makes room
            elif isinstance(got, int):
                check(got, "mset", a.name)
            learn = got is None               # an array layout C does not know yet: teach it below
        for k, _ in pairs:
            key_bytes(k)            # validate every key before storing anything
        if tier is None and p.default_tier is not None:   # each value to its own default
            for k, v in pairs:
                self.put(k, v, priority=priority, ttl=ttl)
            return
        rest = []
        for k, v in pairs:
            if self._hbm is not None and self._hbm.takes(v, tier):
                self.put(k, v, tier=tier, priority=priority, ttl=ttl)
            else:
                row = (key_bytes(k), *codec.encode(v, self._pickle))
                if learn and row[2] is v and type(v) is np.ndarray:   # (a bytes header is not an array's)
                    self._a.hot.learn(v, row[1])
                rest.append(row)
        self._put_rows(rest, priority, expire_at, tier, tier != Tier.SSD)

    def put_with(self, key: str, meta: bytes, nbytes: int, fill: Callable[[np.ndarray], None] | Any, *,
                 priority: int = 0, ttl: float | None = None, tier: Tier | None = None) -> None:
        """Reserve ``nbytes`` for ``key``, let ``fill(view)`` write them, then publish.

        ``view`` is a writable flat uint8 ndarray over the arena block; ``fill``
        may cast or copy from a device straight into it (one copy in all).  If
        ``fill`` raises, nothing becomes visible.  ``meta`` comes from
        ``codec.tensor_meta``/``codec.array_meta``.  ``fill`` may also be a
        contiguous buffer of ``nbytes`` to copy (an already encoded payload).
        ``tier``: DRAM (the default) or SSD; these bytes are host memory, so HBM
        means DRAM here.
        """
        a = self._a
        t = self._check_tier(tier)
        nbytes = payload_nbytes(key, fill, nbytes)
        codec.check_header(meta, nbytes)
        if tier is None and ttl is None and priority == 0 and type(priority) is int and not callable(fill) \
                and self._placement.direct and a.hot.put(key, meta, fill, a.prefaulted):
            return     # an encoded buffer into DRAM in one C call
        self._placement.put(key_bytes(key), meta, fill, nbytes, _priority(priority), _expire_at(ttl),
                            None if t == Tier.HBM else t)

    def mput_raw(self, entries: list[tuple[str, bytes, Any, int]], *, priority: int = 0,
                 ttl: float | None = None, tier: Tier | None = None) -> None:
        """``put_with`` of several encoded objects ``(key, meta, payload, nbytes)``, each
        ``payload`` a contiguous buffer of exactly ``nbytes``: the small ones 256 per hold of
        the arena lock, the rest one by one. Each object is atomic, the batch is not;
        every key is validated before anything is stored."""
        self._check_open()
        t = self._check_tier(tier)
        expire_at, priority = _expire_at(ttl), _priority(priority)
        rows = []
        for k, meta, payload, n in entries:
            n = payload_nbytes(k, payload, n)
            codec.check_header(meta, n)
            rows.append((key_bytes(k), meta, payload, n))
        batch = t in (None, Tier.DRAM) and self._placement.default_tier is None
        self._put_rows(rows, priority, expire_at, None if t == Tier.HBM else t, batch)

    def _put_rows(self, rows: list[tuple[bytes, bytes, Any, int]], priority: int, expire_at: float,
                  tier: Tier | None, batch: bool) -> None:
        """Store encoded ``(key bytes, meta, payload, nbytes)`` rows: with ``batch``, the
        small ones 256 per hold of the arena lock (as many as fit), the rest one by one."""
        p = self._placement
        small = [e for e in rows if e[3] <= SMALL_VALUE] if batch else []
        done = p.put_many_small(small, priority, expire_at) if small else 0
        if done == len(rows):
            return
        stored = {id(e) for e in small[:done]}
        for i, e in enumerate(rows):
            if id(e) not in stored:
                try:
                    p.put(*e, priority, expire_at, tier)
                except Exception as err:       # say what the batch stored (Python 3.11+: a note)
                    left = [repr(r[0].decode()) for r in rows[i:] if id(r) not in stored]
                    if hasattr(err, "add_note"):
                        err.add_note(f"the batch stored every value but {len(left)}: "
                                     f"{', '.join(left[:8])}{' ...' if len(left) > 8 else ''}")
                    raise

    def mget_raw(self, keys: Iterable[str]) -> list[tuple[bytes, memoryview] | None]:
        """``get_raw`` of several keys, None where missing: when every object is in DRAM,
        all read under one lock hold (small ones copied out, the rest pinned views); else
        small objects copied out under one lock hold, the rest read one by one."""
        a = self._a
        keys = keys if type(keys) is list else list(check_iterable_keys(keys))
        hits = a.hot.mread(keys) if self._hbm is None and keys else False   # one C call (or False)
        out: list[tuple[bytes, memoryview] | None] = []
        if hits is not False:
            try:
                for k, hit in zip(keys, hits):
                    out.append(hit and _raw_hit(a, hit, k))
            except BaseException:   # the failed one released its pin; release the rest
                unpin_hits(a, hits[len(out) + 1:])
                raise
            return out
        kbs = [key_bytes(k) for k in keys]
        if not kbs:
            return []
        infos, found, copied = a.mread(kbs, small=self._hbm is None)
        body = memoryview(copied).toreadonly()
        try:
            for i, k in enumerate(keys):
                info = infos[i]
                if found[i] == 2:                   # a small DRAM object, copied out
                    mo, po = info.meta_off, info.payload_off
                    meta = copied[mo:mo + info.meta_len]
                    if meta[:1] == b"P":
                        raise TypeError(f"{k!r} holds a pickled object, which has no raw form: read it with get()")
                    out.append((meta, body[po:po + info.nbytes]))
                else:                               # pinned (and counted) by the read above
                    out.append(self._raw_of(k, info, None) if found[i] else None)
        except BaseException:       # the failed one released its pin; release the rest
            for j in range(len(out) + 1, len(kbs)):
                if found[j] == 1:
                    a.unpin(infos[j].pin)
            raise
        return out

    def mget_wire(self, body: bytearray, versions: dict[str, tuple[int, int]]) -> tuple[int, bytes] | None:
        """A cluster member's MGET reply for the request body ``body`` (``cluster/wire.py``:
        item header, codec header and payload per key, each version from ``versions``),
        read under one lock hold and copied into one ``bytes`` in C, with how many keys it
        answers; None when the general path must answer (``mget_raw``: an object outside
        DRAM, a large or pickled one, a malformed list)."""
        if self._hbm is not None:
            return None
        got = self._a.hot.mreply(body, versions)
        return None if got is False else got

    def get_into(self, key: str, out: _Out) -> _Out:
        """Copy the value of ``key`` into ``out`` (ndarray, tensor on any device, or buffer).

        One copy, straight from the arena; ``out`` must have the stored
        number of bytes (and, for arrays and tensors, the stored shape and
        dtype, numpy and torch dtypes compared by meaning: it copies bytes, it
        never casts; see ``codec.check_into``).  Returns ``out``.  Raises
        ``KeyError`` when missing, ``ValueError`` when ``out`` does not fit.

        Examples:
            >>> import numpy as np
            >>> from yrcache import TieredStore
            >>> with TieredStore(dram="16MiB") as s:
            ...     s["k"] = np.arange(4, dtype=np.int64)
            ...     out = np.empty(4, dtype=np.int64)
            ...     s.get_into("k", out).tolist()
            [0, 1, 2, 3]
        """
        a = self._a
        info = a.get(key_bytes(key))
        if info is None:
            raise KeyError(key)
        try:
            meta = a.meta(info)
            codec.check_into(key, meta, out, info.nbytes)
            if info.tier == TIER_DRAM:
                if codec.is_tensor(out) and out.device.type == "cuda":
                    self.pin_host_memory()
                codec.copy_bytes(a.payload(info), out)
                return out
        finally:
            a.unpin(info.pin)
        value = self.get(key, _MISSING)     # on SSD or in HBM: read it, then copy
        if value is _MISSING:
            raise KeyError(key)
        if codec.is_tensor(value) and value.device.type != "cpu" and codec.is_tensor(out):
            out.copy_(value)          # an HBM tensor of this process: device to device
        else:
            codec.copy_bytes(codec.flat_bytes(value), out)
        return out

    def info(self, key: str) -> dict[str, Any] | None:
        """What is stored under ``key``, without reading it: ``{"tier", "nbytes",
        "kind", "priority", "expire_at"}`` plus ``"dtype"`` and ``"shape"`` for
        arrays and tensors; None when missing.  No pin, no read counted.

        Examples:
            >>> import numpy as np
            >>> from yrcache import TieredStore
            >>> with TieredStore(dram="16MiB") as s:
            ...     s["x"] = np.zeros((2, 3), np.float32)
            ...     i = s.info("x")
            ...     (i["tier"], i["nbytes"], i["kind"], i["dtype"], i["shape"])
            (<Tier.DRAM: 1>, 24, 'ndarray', '<f4', (2, 3))
        """
        got = self._a.peek(key_bytes(key))
        if got is None:
            return None
        info, meta = got
        return {"tier": Tier(info.tier), "nbytes": info.nbytes, "priority": info.priority,
                "expire_at": info.expire_at or None, **codec.describe(meta)}

    def tier_of(self, key: str) -> Tier:
        """The tier that holds ``key`` now; ``KeyError`` when missing.  No pin, no read counted."""
        got = self._a.peek(key_bytes(key))
        if got is None:
            raise KeyError(key)
        return Tier(got[0].tier)

    @property
    def _multi_tier(self) -> bool:
        """Could any object live outside DRAM (here, or HBM in another process)?"""
        return self._disk is not None or self._hbm is not None or bool(self._config.get("hbm"))

    def stats(self) -> dict[str, Any]:
        """Capacity, use and counters of every tier (a fresh snapshot).

        O(objects in lower tiers) when the store has them (their stubs are
        counted by a scan of the index, filtered in C).
        """
        a = self._a
        a.sweep()
        a.expire(time.time())
        self._placement.flush()
        st = a.stats()
        tiers = self._placement.tier_stats(st, self._config.get("hbm", 0))
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
        self._placement.flush()

    def check(self) -> None:
        """Verify the store's invariants; raise ``YrcacheError`` naming the first broken one.

        The arena's own (heap, index, pins, counts), then across tiers: every
        SSD payload has a live stub and every SSD stub a payload file that
        reads can use (there, a regular file of ours, of its size: else
        ``CorruptObjectError``; checksums are left to reads); every
        device tensor of this process a live stub of the same object; and each
        lower tier's ``used`` equals the sum of what it holds.  O(objects);
        meant for tests and ``yrcache stat``, on a store nobody is writing.
        """
        a = self._a
        msg = a.check_invariants()
        if msg:
            raise YrcacheError(f"arena invariant violated: {msg}")
        if self._multi_tier:
            self._placement.check_tiers()


def _raw_view(buf: Any, nbytes: int) -> memoryview:
    return memoryview(buf).cast("B").toreadonly()


def learn_flat(a: Arena, data: bytes, mlen: int) -> None:
    """After a small value copied out as ``data`` (header of ``mlen`` bytes, then
    payload) was decoded in Python: if it is a 1-D array, have the C hot path build
    the values of its header from now on."""
    if data[:1] == b"N":
        meta = data[:mlen]
        dt = codec.flat_dtype(meta)
        if dt is not None:
            a.hot.flat(meta, dt, dt.itemsize, np.frombuffer)


def learn_view(a: Arena, meta: bytes) -> None:
    """After a pinned value with header ``meta`` was built in Python: if it is an
    ndarray or a tensor numpy has a dtype for, have the C hot path build the
    values of its header from now on."""
    layout = codec.array_layout(meta)
    if layout is not None:
        dtype, shape = layout
        a.hot.shaped(meta, dtype, dtype.itemsize, None if len(shape) == 1 else shape, np.frombuffer)
        return
    tlayout = codec.tensor_layout(meta)
    if tlayout is not None:
        dtype, shape, view_as = tlayout
        a.hot.shaped(meta, dtype, dtype.itemsize, None if len(shape) == 1 else shape, np.frombuffer,
                     sys.modules["torch"].from_numpy, view_as)


def unpin_hits(a: Arena, hits: list) -> None:
    """Release the pins of hot-path reads nobody took over (the pinned items of
    ``HotPath.mread`` or ``HotPath.mget``: 5-tuples; the rest pin nothing)."""
    for hit in hits:
        if hit.__class__ is tuple and len(hit) == 5:
            a.unpin(hit[3])


def _raw_hit(a: Arena, hit: tuple, key: str) -> tuple[bytes, memoryview]:
    """``get_raw``'s answer from a hot-path read: a copy, or a view that holds the pin."""
    if len(hit) == 2:
        data, mlen = hit
        meta, body = data[:mlen], memoryview(data)[mlen:]
    else:
        meta, offset, nbytes, pin, block = hit
        if meta[:1] == b"P":
            a.unpin(pin)
        else:
            body = _raw_view(a.pinned_buffer(offset, nbytes, pin, block), nbytes)
    if meta[:1] == b"P":
        raise TypeError(f"{key!r} holds a pickled object, which has no raw form: read it with get()")
    return meta, body
