"""Versioned RL weight publish/subscribe over a ``TieredStore``, with resharding.

Trainer rank ``r`` of ``M`` publishes its local shard of a state dict
(``WeightPublisher.publish``); rollout workers read exactly their slice in
their own layout (``WeightSubscriber.fetch``).  Nobody materialises a full
tensor: a fetch copies only the byte ranges of the stored parts that overlap
the requested slice (the slice math is ``rl/reshard.py``).

Storage layout (every key lives under the reserved prefix ``__rl__/<name>/``;
do not use keys starting with ``__rl__/`` for anything else)::

    __rl__/<name>/started/<v:020d>            a rank began publishing v (empty)
    __rl__/<name>/v/<v:020d>/p/<rank>/<nonce>/<tensor>   one stored part
    __rl__/<name>/v/<v:020d>/m/<rank:06d>     rank's JSON manifest of v
    __rl__/<name>/complete/<v:020d>           v is visible (JSON: world, keep, nonces)

A rank writes its parts, then its manifest; whichever rank then sees all
``world`` manifests writes the ``complete`` marker (idempotently) and bumps the
store's named word ``rl/<name>`` (``TieredStore.word``), which wakes every ``wait``.
Before writing, and again after its manifest, a rank checks that every
manifest of the version names its own ``world`` and raises ValueError if one
does not: ranks that disagree would wait for each other forever.
Versions, manifests and the marker sit behind ``VersionBoard`` so they can move
to etcd (a marker per version needs no compare-and-swap; a watch replaces the
futex).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import codec
from .board import FORMAT, RESERVED_PREFIX, VersionBoard, _Tensor, merge_manifests
from .reshard import Fused, Shard, plan_fused, plan_nbytes, plan_shard

__all__ = ["WeightPublisher", "WeightSubscriber", "VersionBoard", "Shard", "Fused", "RESERVED_PREFIX"]

PROGRESS_MIN_BYTES = 256 << 20   # show a progress bar for fetches at least this big (on a tty)
BUCKET_BYTES = 64 << 20          # host staging bucket for device / casting destinations


def _torch():
    return codec._torch()


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"version must be a non-negative int, got {type(version).__name__} {version!r}")
    version = int(version)
    if version < 0 or version >= 10 ** 20:
        raise ValueError(f"version must be in 0..10**20-1, got {version}")
    return version


class _Source(NamedTuple):
    value: Any
    kind: str
    dtype: str
    shape: tuple
    nbytes: int
    meta: bytes


def _torch_dtype(dtype: Any):
    torch = _torch()
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
    except (TypeError, ValueError):
        raise TypeError(f"dtype {dtype!r} has no torch equivalent; pass a torch.dtype") from None


def _numpy_dtype(dtype: Any) -> np.dtype:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        try:
            return torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            raise TypeError(f"numpy has no {dtype}; publish torch tensors to store or fetch "
                            f"{dtype} (numpy arrays can only be cast to numpy dtypes)") from None
    return np.dtype(dtype)


def _is_torch_dtype(dtype: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def _source(tname: str, value: Any, dtype: Any) -> _Source:
    """Describe one state-dict value as it will be stored (after the optional cast)."""
    if isinstance(value, np.ndarray) and dtype is not None and value.dtype.kind == "f" \
            and _is_torch_dtype(dtype):
        value = _torch().from_numpy(np.ascontiguousarray(value))  # cast to a torch dtype (bf16)
    if codec.is_tensor(value):
        t = value.detach()
        if t.layout != _torch().strided:
            raise TypeError(f"tensor {tname!r} is sparse; call .to_dense() before publishing")
        sd = _torch_dtype(dtype) if dtype is not None and t.is_floating_point() else t.dtype
        shape = tuple(t.shape)
        return _Source(t, "torch", str(sd).replace("torch.", ""), shape,
                       math.prod(shape) * sd.itemsize, codec.tensor_meta(sd, shape))
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise TypeError(f"tensor {tname!r} has numpy dtype {value.dtype}; numeric or bool only")
        sd = _numpy_dtype(dtype) if dtype is not None and value.dtype.kind == "f" else value.dtype
        sd = sd.newbyteorder("=") if sd.byteorder == ">" else sd
        return _Source(value, "numpy", sd.str, value.shape, value.size * sd.itemsize,
                       codec.array_meta(sd, value.shape))
    raise TypeError(f"state dict value {tname!r} is a {type(value).__name__}; "
                    "publish torch tensors or numpy arrays")


def _filler(src: _Source):
    def fill(u8: np.ndarray) -> None:
        if u8.size == 0:
            return
        if src.kind == "torch":
            torch, t = _torch(), src.value
            sd = getattr(torch, src.dtype)
            if t.device.type == "cpu" and t.dtype == sd and t.is_contiguous():
                np.copyto(u8, t.reshape(-1).view(torch.uint8).numpy())   # a plain memcpy
            else:   # cast and/or device->host in one copy
                torch.from_numpy(u8).view(sd).view(src.shape).copy_(t)
        else:
            np.copyto(u8.view(np.dtype(src.dtype)).reshape(src.shape), src.value, casting="unsafe")
    return fill


class WeightPublisher:
    """Trainer rank ``rank`` of ``world`` publishing versions of the weight set ``name``.

    ``keep`` newest complete versions stay readable; older ones are retired
    when a newer version completes (give every rank the same ``keep``).
    """

    def __init__(self, store, name: str, rank: int = 0, world: int = 1, keep: int = 2):
        for what, v, lo in (("rank", rank, 0), ("world", world, 1), ("keep", keep, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
        if rank >= world:
            raise ValueError(f"rank must be in 0..{world - 1} for world={world}, got {rank}")
        self.store, self.name, self.rank, self.world, self.keep = store, name, rank, world, keep
        self.board = VersionBoard(store, name)
        self.last_version: int | None = None
        self.last_publish_stats: dict = {}
        self._pending: set[int] = set()

    def publish(self, state: Mapping[str, Any], version: int, layout: Mapping[str, Shard | None] | None = None,
                dtype: Any = None) -> bool:
        """Publish this rank's part of ``state`` as ``version``; True if the version is now visible.

        ``layout[name] = Shard(dim, index=rank, count=world)`` marks a tensor as
        this rank's slab of a global tensor concatenated along ``dim`` in rank
        order; a tensor without an entry is replicated and stored by rank 0
        only.  ``dtype`` casts floating-point values on the way into the store
        (one copy; a numpy array given a torch dtype is stored as a tensor).
        The version becomes visible when every rank has published it.
        """
        t0 = time.perf_counter()
        version = _check_version(version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} of {self.name!r} is not newer than this rank's last "
                             f"published version {self.last_version}; versions must increase")
        latest = self.board.latest()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} of {self.name!r} is not newer than the latest complete "
                             f"version {latest}; versions are immutable, publish a higher one")
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of name -> tensor, not {type(state).__name__}")
        layout = dict(layout or {})
        for t, spec in layout.items():
            if t not in state:
                raise ValueError(f"layout names {t!r}, which is not in the state dict")
            if spec is None:
                continue
            if not isinstance(spec, Shard):
                raise TypeError(f"publish layout[{t!r}] must be a Shard or None, not {type(spec).__name__}")
            if (spec.index, spec.count) != (self.rank, self.world):
                raise ValueError(f"layout[{t!r}] = {spec} on rank {self.rank} of {self.world}: a publish "
                                 f"Shard must be Shard(dim, index={self.rank}, count={self.world})")
        sources = []
        for t, value in state.items():
            if not isinstance(t, str) or not t:
                raise ValueError(f"state dict keys must be non-empty str, got {t!r}")
            src = _source(t, value, dtype)
            spec = layout.get(t)
            dim = None if spec is None else spec.resolve_dim(len(src.shape))
            sources.append((t, src, dim))

        if any(src.kind == "torch" and src.value.device.type == "cuda" for _, src, _ in sources):
            self.store.pin_host_memory()   # the D2H copies below then run at pinned speed
        self._check_world(version)              # before writing anything
        self.board.begin(version)
        nonce = uuid.uuid4().hex[:12]
        tensors, written, nbytes = {}, [], 0
        try:
            for t, src, dim in sources:
                entry = {"kind": src.kind, "dtype": src.dtype, "shape": list(src.shape), "dim": dim,
                         "key": None}
                if dim is not None or self.rank == 0:
                    key = self.board.part_key(version, self.rank, nonce, t)
                    self.store.put_with(key, src.meta, src.nbytes, _filler(src))
                    written.append(key)
                    entry["key"] = key
                    nbytes += src.nbytes
                tensors[t] = entry
            self.board.record_rank(version, self.rank, {
                "format": FORMAT, "name": self.name, "version": version, "rank": self.rank,
                "world": self.world, "nonce": nonce, "tensors": tensors})
        except BaseException:
            for k in written:
                self.store.delete(k)
            raise
        # Again now that our manifest is there: of two ranks racing, the later one sees
        # the other.  Nothing is rolled back (peers of our world may already have read
        # our manifest); the parts go when a newer version retires this one.
        self._check_world(version)
        self.last_version = version
        visible = self._try_complete(version)
        latest = self.board.latest()
        for v in sorted(self._pending):     # an earlier version whose last rank died after its manifest
            try:
                if (latest is None or v > latest) and not self._try_complete(v):
                    continue
            except ValueError:
                pass                        # already reported to the rank that completed it
            self._pending.discard(v)
        if not visible:
            self._pending.add(version)
        self.last_publish_stats = {"bytes_written": nbytes, "parts": len(written),
                                   "seconds": time.perf_counter() - t0, "complete": visible}
        return visible

    def _check_world(self, version: int) -> None:
        """Refuse a version that another rank publishes with another ``world``.

        Ranks that disagree on ``world`` would each wait for a different set of
        manifests and the version would never complete, silently.
        """
        for rank, m in sorted(self.board.manifests(version).items()):
            if rank != self.rank and m.get("world") != self.world:
                raise ValueError(
                    f"version {version} of {self.name!r}: rank {rank} published it with world="
                    f"{m.get('world')}, but this rank {self.rank} has world={self.world}; every rank of a "
                    "weight set must pass the same world: fix the misconfigured rank, or publish a newer "
                    "version if that manifest is left over from an earlier run")

    def _try_complete(self, version: int) -> bool:
        """If every rank's manifest of ``version`` is there, validate, mark complete and reclaim."""
        if self.board.completion(version) is not None:
            return True
        manifests = self.board.rank_manifests(version, self.world)
        if any(m is None for m in manifests):
            return False
        merge_manifests(manifests, self.name, version)       # refuse an inconsistent version
        self.board.complete(version, {"version": version, "world": self.world, "keep": self.keep,
                                      "nonces": [m["nonce"] for m in manifests]})
        self._reclaim()
        return True

    def _reclaim(self) -> None:
        done = self.board.complete_versions()
        if len(done) <= self.keep:
            return
        threshold = done[-self.keep]
        for v in self.board.versions():
            if v < threshold:
                self.board.retire(v)

    def latest(self) -> int | None:
        """The newest complete version of this weight set, or None."""
        return self.board.latest()

    def __repr__(self) -> str:
        return (f"<WeightPublisher {self.name!r} rank {self.rank}/{self.world} keep={self.keep} "
                f"last={self.last_version}>")


# --------------------------------------------------------------------------- fetch


class _Plan(NamedTuple):
    """A copy plan (``reshard.PLAN_COLUMNS`` rows) compiled into a few strided byte copies."""

    shape: tuple
    plan: np.ndarray
    used: tuple          # part ids the plan reads
    ops: tuple           # (part, src_off, dst_off, run, rows, src_stride, dst_stride)


def _compile(shape: tuple, plan: np.ndarray) -> _Plan:
    """Group each part's runs: equally long and equally spaced runs become one 2-d copy."""
    plan.flags.writeable = False
    ops = []
    pid, so, do, n = (plan[:, i].tolist() for i in range(4))
    i = 0
    while i < len(pid):
        j = i + 1
        if j < len(pid) and pid[j] == pid[i] and n[j] == n[i]:
            ss, ds = so[j] - so[i], do[j] - do[i]
            if ss > 0 and ds >= n[i]:
                while j < len(pid) and pid[j] == pid[i] and n[j] == n[i] \
                        and so[j] - so[j - 1] == ss and do[j] - do[j - 1] == ds:
                    j += 1
                ops.append((pid[i], so[i], do[i], n[i], j - i, ss, ds))
                i = j
                continue
        ops.append((pid[i], so[i], do[i], n[i], 1, 0, 0))
        i += 1
    return _Plan(shape, plan, tuple(sorted(set(pid))), tuple(ops))


def _run_plan(p: _Plan, srcs: list, dst: np.ndarray) -> None:
    """Execute a compiled plan: flat uint8 ``srcs[part]`` -> flat uint8 ``dst`` (bounds checked by numpy)."""
    for pid, so, do, n, rows, ss, ds in p.ops:
        src = srcs[pid]
        if rows == 1:
            dst[do:do + n] = src[so:so + n]
        else:
            np.ndarray((rows, n), np.uint8, dst, do, (ds, 1))[...] = \
                np.ndarray((rows, n), np.uint8, src, so, (ss, 1))


@functools.lru_cache(maxsize=8192)
def _plan_one(gshape: tuple, parts: tuple, shard: Shard | None, itemsize: int) -> _Plan:
    return _compile(*plan_shard(gshape, parts, shard, itemsize))


@functools.lru_cache(maxsize=2048)
def _plan_fused(target: Fused, shapes: tuple, parts: tuple, itemsize: int) -> _Plan:
    return _compile(*plan_fused(target, dict(shapes), dict(parts), itemsize))


class _Target(NamedTuple):
    name: str
    kind: str
    dtype: str
    itemsize: int
    shape: tuple
    plan: _Plan
    keys: tuple          # key of each part id in the plan


def _src_bytes(view: Any) -> np.ndarray:
    """Flat uint8 numpy view of a stored part (no copy)."""
    if isinstance(view, np.ndarray):
        return view.reshape(-1).view(np.uint8)
    if view.numel() == 0:
        return np.empty(0, np.uint8)
    return view.reshape(-1).view(_torch().uint8).numpy()


class _Stager:
    """Host staging buckets for destinations that cannot be written in place (a device
    tensor, or a dtype other than the stored one).  For device destinations the bucket is
    pinned and copies run asynchronously; a bucket is reused only after a synchronize."""

    def __init__(self, bucket: int, pin: bool, buf=None):
        self.bucket, self.pin, self.used, self.pending = bucket, pin, 0, set()
        self.buf = buf if buf is not None and buf.numel() >= bucket else None

    def take(self, nbytes: int):
        torch = _torch()
        need = -(-nbytes // 64) * 64                  # keep every slice 64-byte aligned
        if need > self.bucket:
            return torch.empty(nbytes, dtype=torch.uint8)   # one-off; copies from it are synchronous
        if self.used + need > self.bucket:
            self.flush()
        if self.buf is None:
            self.buf = torch.empty(self.bucket, dtype=torch.uint8, pin_memory=self.pin)
        out = self.buf[self.used:self.used + nbytes]
        self.used += need
        return out

    def copy(self, staged, dst) -> None:
        if dst.device.type == "cuda" and self.pin and staged.is_pinned():
            dst.copy_(staged, non_blocking=True)   # async H2D (+ cast on the device)
            self.pending.add(dst.device)
        else:
            dst.copy_(staged)

    def flush(self) -> None:
        for dev in self.pending:
            _torch().cuda.synchronize(dev)
        self.pending, self.used = set(), 0


class WeightSubscriber:
    """A rollout worker's reader of the weight set ``name``: wait for versions, fetch slices.

    ``last_fetch_stats`` describes the latest ``fetch``: ``bytes_copied`` (out
    of the arena), ``bytes_needed`` (the result, in the stored dtype; equal
    unless something is wrong), ``bytes_version`` (all stored bytes of the
    version), ``parts``, ``targets`` and ``seconds``.
    """

    def __init__(self, store, name: str):
        self.store, self.name = store, name
        self.board = VersionBoard(store, name)
        self.last_fetch_stats: dict = {}
        self._infos: OrderedDict = OrderedDict()   # version -> (marker, merged tensors)
        self._pinned = None                         # reused pinned staging bucket (device into=)
        self._lock = threading.Lock()

    def __reduce__(self):
        return (WeightSubscriber, (self.store, self.name))

    def latest(self) -> int | None:
        """The newest complete version, or None when nothing is published yet."""
        return self.board.latest()

    def versions(self) -> list[int]:
        """Every version readable now (complete and not reclaimed), ascending."""
        return self.board.complete_versions()

    def wait(self, newer_than: int | None = None, timeout: float | None = None,
             max_staleness: int | None = None) -> int:
        """Block until a complete version newer than ``newer_than`` exists; return the newest.

        With ``max_staleness=k`` return the newest complete version at once,
        even if it equals ``newer_than``, when the caller is at most ``k``
        versions behind the newest version the trainer has started to publish.
        Never returns a version older than ``newer_than``.  Raises
        ``TimeoutError`` after ``timeout`` seconds.  Sleeps on a futex in the
        arena: wakes well under a millisecond after the publish, no polling.
        """
        if newer_than is not None:
            newer_than = _check_version(newer_than)
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self.board.token()            # before checking: no lost wake-up
            latest = self.board.latest()
            if latest is not None:
                if newer_than is None or latest > newer_than:
                    return latest
                if max_staleness is not None and latest == newer_than \
                        and self.board.head() - max_staleness <= newer_than:
                    return latest
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no version of {self.name!r} newer than {newer_than} within "
                                   f"{timeout} s (latest complete: {latest})")
            # Sleep in slices of at most 1 s: a publisher that died between its marker and
            # its wake-up cannot strand us (no busy polling either way).
            self.board.wait_change(seen, 1.0 if left is None else min(left, 1.0))

    def _info(self, version: int) -> dict[str, _Tensor]:
        marker = self.board.completion(version)
        if marker is None:
            raise KeyError(self._gone(version))
        with self._lock:
            hit = self._infos.get(version)
        if hit is not None and hit[0] == marker:
            return hit[1]
        manifests = self.board.rank_manifests(version, marker["world"])
        if any(m is None for m in manifests) or [m["nonce"] for m in manifests] != marker["nonces"]:
            raise KeyError(self._gone(version))
        info = merge_manifests(manifests, self.name, version)
        with self._lock:
            self._infos[version] = (marker, info)
            while len(self._infos) > 4:
                self._infos.popitem(last=False)
        return info

    def _gone(self, version: int) -> str:
        latest = self.board.latest()
        if latest is None or version > latest:
            return (f"version {version} of {self.name!r} is not complete (latest complete: {latest}); "
                    "wait() for it")
        m = self.board.completion(latest)
        keep = m.get("keep", "?") if m else "?"
        return f"version {version} of {self.name!r} was reclaimed (keep={keep}); wait for a newer one"

    def _targets(self, info: dict[str, _Tensor], layout, version: int) -> list[_Target]:
        if layout is None:
            layout = {}
        if not isinstance(layout, Mapping):
            raise TypeError(f"layout must be a mapping of name -> Shard/Fused/None, not {type(layout).__name__}")

        def get(src: str) -> _Tensor:
            if src not in info:
                raise KeyError(f"version {version} of {self.name!r} has no tensor {src!r} "
                               f"(it has {sorted(info)[:20]})")
            return info[src]

        targets, consumed = [], set()
        for name, spec in layout.items():
            if spec is None or isinstance(spec, Shard):
                t = get(name)
                plan = _plan_one(t.shape, t.parts, spec, t.itemsize)
                targets.append(_Target(name, t.kind, t.dtype, t.itemsize, plan.shape, plan, t.keys))
            elif isinstance(spec, Fused):
                srcs = [get(s) for s in spec.sources]
                if len({(s.kind, s.dtype) for s in srcs}) != 1:
                    raise ValueError(f"Fused target {name!r}: sources {list(spec.sources)} are stored as "
                                     f"{[s.dtype for s in srcs]}; fused sources must share one dtype")
                plan = _plan_fused(spec, tuple((s, info[s].shape) for s in spec.sources),
                                   tuple((s, info[s].parts) for s in spec.sources), srcs[0].itemsize)
                keys = tuple(k for s in srcs for k in s.keys)
                targets.append(_Target(name, srcs[0].kind, srcs[0].dtype, srcs[0].itemsize, plan.shape, plan,
                                       keys))
                consumed.update(spec.sources)
            else:
                raise TypeError(f"layout[{name!r}] must be a Shard, Fused or None, not {type(spec).__name__}")
        for name, t in info.items():
            if name not in layout and name not in consumed:
                plan = _plan_one(t.shape, t.parts, None, t.itemsize)
                targets.append(_Target(name, t.kind, t.dtype, t.itemsize, plan.shape, plan, t.keys))
        return targets

    def fetch(self, version: int, layout: Mapping[str, Any] | None = None, into: Mapping[str, Any] | None = None,
              dtype: Any = None) -> dict[str, Any]:
        """This worker's slice of ``version``: ``{name: tensor or ndarray}``.

        ``layout[name]`` is a ``Shard`` (cut like ``numpy.array_split``), a
        ``Fused`` target composed from several sources, or None (whole);
        tensors not named are fetched whole, except sources a ``Fused``
        consumes.  Only the byte ranges overlapping each slice are copied,
        from one atomic snapshot of the version's parts.  ``into[name]`` (a
        contiguous tensor on any device, or an ndarray) receives its slice in
        place.  ``dtype`` casts floating-point results.  Raises ``KeyError``
        when the version is not complete or was reclaimed.
        """
        t0 = time.perf_counter()
        version = _check_version(version)
        info = self._info(version)
        targets = self._targets(info, layout, version)
        into = dict(into or {})
        names = {t.name for t in targets}
        extra = [n for n in into if n not in names]
        if extra:
            raise ValueError(f"into names {extra}, which this fetch does not return (it returns "
                             f"{sorted(names)[:20]})")
        keys = list(dict.fromkeys(t.keys[p] for t in targets for p in t.plan.used))
        views = self.store.mget(keys)                  # one atomic, pinned snapshot
        if any(v is None for v in views):
            raise KeyError(self._gone(version))
        bufs = {k: _src_bytes(v) for k, v in zip(keys, views)}
        needed = sum(math.prod(t.shape) * t.itemsize for t in targets)
        copied = 0
        out: dict[str, Any] = {}
        pin = any(codec.is_tensor(d) and d.device.type == "cuda" for d in into.values())
        reuse, self._pinned = (self._pinned, None) if pin else (None, self._pinned)  # one fetch owns it
        stager = _Stager(min(BUCKET_BYTES, -(-needed // 64) * 64 + 64 * len(targets)), pin, reuse)
        from tqdm.auto import tqdm
        with tqdm(total=needed, unit="B", unit_scale=True, desc=f"{self.name} v{version}",
                  disable=not sys.stderr.isatty() or needed < PROGRESS_MIN_BYTES) as bar:
            for t in targets:
                out[t.name] = self._gather(t, bufs, into.get(t.name), dtype, stager)
                n = plan_nbytes(t.plan.plan)
                copied += n
                bar.update(n)
            stager.flush()
        if pin:
            self._pinned = stager.buf
        del views, bufs                                # drop the pins: reclaimable now
        self.last_fetch_stats = {
            "version": version, "bytes_copied": copied, "bytes_needed": needed,
            "bytes_version": sum(math.prod(t.shape) * t.itemsize for t in info.values()),
            "parts": len(keys), "targets": len(targets), "seconds": time.perf_counter() - t0}
        return out

    def _gather(self, t: _Target, bufs: dict, dst: Any, dtype: Any, stager: _Stager) -> Any:
        srcs = [bufs.get(k) for k in t.keys]
        floating = (getattr(_torch(), t.dtype).is_floating_point if t.kind == "torch"
                    else np.dtype(t.dtype).kind == "f")
        want = None
        if dtype is not None and floating:
            want = _torch_dtype(dtype) if t.kind == "torch" else _numpy_dtype(dtype)
        if dst is None:
            if t.kind == "torch":
                torch = _torch()
                res = torch.empty(t.shape, dtype=getattr(torch, t.dtype))
                _run_plan(t.plan, srcs, codec.as_bytes_view(res))
                return res if want is None or want == res.dtype else res.to(want)
            res = np.empty(t.shape, dtype=np.dtype(t.dtype))
            _run_plan(t.plan, srcs, res.reshape(-1).view(np.uint8))
            return res if want is None or want == res.dtype else res.astype(want)
        # ---- into=
        is_t = codec.is_tensor(dst)
        if not is_t and not isinstance(dst, np.ndarray):
            raise TypeError(f"into[{t.name!r}] must be a torch tensor or numpy array, not {type(dst).__name__}")
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(f"into[{t.name!r}] has shape {tuple(dst.shape)}, but the fetched slice has "
                             f"shape {tuple(t.shape)}")
        if not (dst.is_contiguous() if is_t else dst.flags.c_contiguous and dst.flags.writeable):
            raise ValueError(f"into[{t.name!r}] must be contiguous and writable")
        if want is not None and (_torch_dtype(want) if is_t else _numpy_dtype(want)) != dst.dtype:
            raise ValueError(f"fetch(dtype={dtype}) conflicts with into[{t.name!r}].dtype={dst.dtype}; "
                             "into tensors receive their own dtype (drop dtype= or match it)")
        same = dst.dtype == (_stored_torch_dtype(t) if is_t else _stored_numpy_dtype(t))
        if same and (not is_t or dst.device.type == "cpu"):   # straight into the destination
            _run_plan(t.plan, srcs, codec.as_bytes_view(dst))
            return dst
        if not is_t and t.kind == "numpy":               # numpy -> numpy cast: no torch needed
            tmp = np.empty(t.shape, dtype=np.dtype(t.dtype))
            _run_plan(t.plan, srcs, tmp.reshape(-1).view(np.uint8))
            np.copyto(dst, tmp, casting="unsafe")
            return dst
        nbytes = math.prod(t.shape) * t.itemsize         # gather in the stored dtype, then cast/move
        torch, sdt = _torch(), _stored_torch_dtype(t)
        staged = stager.take(nbytes)
        _run_plan(t.plan, srcs, staged.numpy())
        typed = staged.view(sdt).view(t.shape) if nbytes else torch.empty(t.shape, dtype=sdt)
        if is_t:
            stager.copy(typed, dst)
        else:
            np.copyto(dst, (typed.float() if sdt == torch.bfloat16 else typed).numpy(), casting="unsafe")
        return dst

    def __repr__(self) -> str:
        return f"<WeightSubscriber {self.name!r} latest={self.latest()}>"


def _stored_torch_dtype(t: _Target):
    """The torch dtype of a target's stored bytes (None when torch has none)."""
    torch = _torch()
    if t.kind == "torch":
        return getattr(torch, t.dtype)
    return _torch_dtype(np.dtype(t.dtype))


def _stored_numpy_dtype(t: _Target):
    """The numpy dtype of a target's stored bytes (None for bfloat16)."""
    if t.kind == "numpy":
        return np.dtype(t.dtype)
    try:
        return _numpy_dtype(getattr(_torch(), t.dtype))
    except TypeError:
        return None
