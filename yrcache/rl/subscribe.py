"""Subscribing: a rollout rank waits for versions and fetches exactly its slice.

See ``weights.py`` for the storage layout and the protocol.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import buffers, codec
from ..errors import ClusterUnavailableError
from .board import FORMAT, VersionBoard, _Tensor, decode_structure, parse_marker, part_suffix
from .publish import _check_cast, _check_version, _is_torch_dtype, _numpy_dtype, _torch, _torch_dtype  # noqa: F401
from ..types import Array, DType
from .remote import PartsUnavailable, direct_slots, drop_older, fetch_parts, is_remote, plan_spans, pool
from .reshard import Fused, Shard, _Plan, _compile, _run_plan, plan_fused, plan_shard
from .staging import _progress, _Stager
from .wants import Wants, span_ids

if TYPE_CHECKING:
    from .. import TieredStore

__all__ = ["WeightSubscriber"]

PREFAULT_MIN_BYTES = 1 << 20      # map the pages a fetch reads first when it reads this much
BUCKET_BYTES = 64 << 20          # host staging bucket for device / casting destinations
IN_FLIGHT_S = 0.5               # a wait timeout's look at the version in flight, at most


# --------------------------------------------------------------------------- fetch


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
    floating: bool
    shape: tuple
    plan: _Plan
    slots: tuple         # per part id of the plan: its index in _Compiled.refs (-1: not read)


class _Compiled(NamedTuple):
    """A fetch planned for one version structure and one layout.  Versions of
    an unchanged model share the structure, so each new version costs a
    marker read, one ``mget`` and the copies."""

    targets: tuple       # _Target, ...
    names: frozenset     # of the targets
    refs: tuple          # (tensor, rank) of every stored part the fetch reads, once each
    needed: int          # bytes of the result, in the stored dtypes
    version_bytes: int   # bytes of everything stored for a version


def _reads_decoded(c: _Compiled, plain: bool) -> bool:
    """Whether a fetch of ``c`` reads decoded values: a state under 1 MiB fetched without
    ``into``/``dtype`` (``plain``) does (small 1-D arrays are built in C, and a whole part
    is then one ``copy()``); any other reads the stored bytes (``mget_raw``: a process's
    first fetch of 122 parts spent 4 ms decoding them only to view them as bytes again)."""
    return plain and c.needed < PREFAULT_MIN_BYTES


def _read_parts(store: TieredStore, keys: list[str], decoded: bool) -> list:
    """The parts of one fetch in one atomic, pinned read (None where one is gone)."""
    return store.mget(keys) if decoded else store.mget_raw(keys)


def _whole_part(t: _Target, views: list) -> Any:
    """A copy of the stored part that is all of target ``t``, as it is stored (an
    ndarray or a CPU tensor); None when ``t`` is not one whole part (a slice, parts
    of several ranks, or a part of another shape)."""
    ops = t.plan.ops
    if len(ops) != 1:
        return None
    pid, so, do, n, rows, _ss, _ds = ops[0]
    v = views[t.slots[pid]]
    if so or do or rows != 1 or n != t.plan.nbytes or tuple(v.shape) != t.shape:
        return None
    if t.kind == "torch":     # (a part some tier holds on a device is gathered to the host)
        return v.clone() if v.device.type == "cpu" and v.dtype == getattr(_torch(), t.dtype) else None
    return v.copy() if isinstance(v, np.ndarray) and v.dtype.str == t.dtype else None


def _src_bytes(view: Any) -> np.ndarray:
    """Flat uint8 numpy view of a decoded part (no copy)."""
    if isinstance(view, np.ndarray):
        return view.reshape(-1).view(np.uint8)
    if view.numel() == 0:
        return np.empty(0, np.uint8)
    return view.reshape(-1).view(_torch().uint8).numpy()


class WeightSubscriber:
    """A rollout worker's reader of the weight set ``name``: wait for versions, fetch slices.

    ``last_fetch_stats`` describes the latest ``fetch``: ``bytes_copied`` (out
    of the arena), ``bytes_needed`` (the result, in the stored dtype; equal
    unless something is wrong), ``bytes_version`` (all stored bytes of the
    version), ``parts``, ``targets`` and ``seconds``; over a cluster store also
    ``bytes_network`` (pulled by this process), ``bytes_node_cache`` (landed
    in the node's arena by another of its processes) and ``bytes_local``
    (parts this node holds), which add up to ``bytes_needed``, and
    ``bytes_direct``: of ``bytes_network``, those received straight into the
    results (spans no other process of the node pulled last time, where they
    are one run of a new result or of a host ``into`` destination of the stored
    dtype: no copy after the socket).  A subscriber
    pickles as its store's name and its weight set's name.

    Examples:
        >>> import numpy as np
        >>> from yrcache import TieredStore
        >>> from yrcache.rl import Shard, WeightPublisher, WeightSubscriber
        >>> with TieredStore(dram="16MiB") as s:
        ...     _ = WeightPublisher(s, "policy").publish({"w": np.arange(8.0).reshape(2, 4)}, version=7)
        ...     sub = WeightSubscriber(s, "policy")
        ...     v = sub.wait(newer_than=None, timeout=1.0)
        ...     (v, sub.fetch(v, layout={"w": Shard(dim=1, index=1, count=2)})["w"].tolist())
        (7, [[2.0, 3.0], [6.0, 7.0]])
    """

    def __init__(self, store: TieredStore, name: str) -> None:
        self.store, self.name = store, name
        self.board = VersionBoard(store, name)
        self.last_fetch_stats: dict = {}
        self._compiled: OrderedDict = OrderedDict()   # (structure, layout) -> _Compiled
        self._pinned = None                         # reused pinned staging bucket (device into=)
        self._prepared = False                      # wait() planned a fetch while idle
        self._lock = threading.Lock()
        self._cached_version: int | None = None     # newest version this process pulled for its node
        self._last_whole: tuple[bytes, _Compiled] | None = None   # the last whole-state plan
        self._last_marker: tuple[bytes, dict] | None = None       # the last marker read, parsed
        # (marker bytes, marker, plan, part keys after the version prefix) of the last
        # whole-state fetch from this arena: the next version of an unchanged model has
        # the same marker bytes, so its marker and parts are read in one mget
        self._whole: tuple[bytes, dict, _Compiled, list[str]] | None = None
        self._remote = is_remote(store)             # parts on other machines (a cluster store)
        # which spans this subscriber pulls, recorded for its node's other processes
        self._wants = Wants(getattr(store, "node_store", None), name)

    def __reduce__(self):
        return (WeightSubscriber, (self.store, self.name))

    def latest(self) -> int | None:
        """The newest complete version, or None when nothing is published yet."""
        self.board.check_open()
        return self.board.latest()

    def versions(self) -> list[int]:
        """Every version readable now (complete and not reclaimed), ascending."""
        self.board.check_open()
        return self.board.complete_versions()

    def wait(self, newer_than: int | None = None, timeout: float | None = None,
             max_staleness: int | None = None) -> int:
        """Block until a complete version newer than ``newer_than`` exists; return the newest.

        With ``max_staleness=k`` return the newest complete version at once,
        even if it equals ``newer_than``, when the caller is at most ``k``
        versions behind the newest version the trainer has started to publish.
        Never returns a version older than ``newer_than``.  Raises
        ``TimeoutError`` after ``timeout`` seconds, ``StoreClosedError`` within a
        second of another thread closing the store.  Sleeps on a futex in the
        arena: wakes well under a millisecond after the publish, no polling.
        """
        self.board.check_open()
        if newer_than is not None:
            newer_than = _check_version(newer_than)
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not timeout >= 0):
            raise ValueError(f"timeout must be a number of seconds >= 0, or None; got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wants.fetched:
            self._wants.present()                # the node's other processes: land what they pull
        while True:
            self.board.check_open()              # the store closed by another thread: within 1 s
            seen = self.board.token()            # before checking: no lost wake-up
            latest = self.board.latest()
            if latest is not None:
                if newer_than is None or latest > newer_than:
                    return latest
                if max_staleness is not None and latest == newer_than \
                        and (self.board.head() or latest) - max_staleness <= newer_than:
                    return latest
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                down = "" if getattr(self.store, "member_present", None) is not False else (
                    f"; this node's member {getattr(self.store, 'member_id', None)} is not in the cluster "
                    "(it died or was stopped): restart `yrcache node` here")
                raise TimeoutError(f"no version of {self.name!r} newer than {newer_than} within "
                                   f"{timeout} s (latest complete here: {latest}){self._in_flight()}{down}")
            if latest is not None and not self._prepared:
                self._prepare(latest)            # idle time: plan a fetch before sleeping
                continue                         # (re-check: a version may have completed meanwhile)
            # Sleep in slices of at most 1 s: a publisher that died between its marker and
            # its wake-up cannot strand us (no busy polling either way).
            if self.board.wait_change(seen, 1.0 if left is None else min(left, 1.0)):
                continue
            if getattr(self.store, "member_present", None) is False:
                self.board.refresh()             # nobody mirrors the record into this node: read it

    def _in_flight(self) -> str:
        """For a timeout's message: the version in flight and the ranks it waits for (its
        records are read on a pool thread for at most ``IN_FLIGHT_S``, so a member that
        hangs cannot stretch the timeout: the message then goes without it)."""
        try:
            got = pool().submit(self.board.in_flight).result(IN_FLIGHT_S) if is_remote(self.store) \
                else self.board.in_flight()
        except Exception:  # noqa: BLE001 - the timeout is the error; this only explains it
            return ""
        if got is None:
            return ""
        version, world, missing, why = got
        return (f"; version {version} is in flight, waiting for rank(s) {', '.join(map(str, missing))} "
                f"of world={world} to publish it") if missing else f"; version {version} {why}"

    def _prepare(self, version: int) -> None:
        """Plan a whole-state fetch of ``version`` once, while ``wait`` would sleep anyway.

        The next version of an unchanged model reuses the plan, and a process's
        first plan is its slow one (first touches of code and data; after a
        fork, copy-on-write faults): this takes that cost off the wake-up path.
        """
        self._prepared = True
        try:
            self._compile(self._marker(version)[1]["structure"], None, version)
        except (KeyError, ValueError, TypeError, ClusterUnavailableError):
            pass                                 # retired, lost or unreadable: fetch() will say

    def _marker(self, version: int) -> tuple[bytes, dict]:
        """``version``'s marker: its bytes and its parsed form (shared with the last
        marker of the same bytes: do not mutate it)."""
        raw = self.store.get(self.board.complete_key(version))
        if raw is None:
            raise KeyError(self.board.why_gone(version, is_remote(self.store)))
        raw = bytes(raw)
        last = self._last_marker
        if last is not None and last[0] == raw:
            return last
        marker = parse_marker(raw)
        if marker.get("format") != FORMAT:
            raise ValueError(f"version {version} of {self.name!r} was published by another version of "
                             f"yrcache (format {marker.get('format')}, this one reads {FORMAT}); "
                             "run publishers and subscribers on the same yrcache")
        self._last_marker = got = (raw, marker)
        return got

    def _snapshot(self, version: int, plain: bool) -> tuple[dict, _Compiled, list[str], list] | None:
        """A whole-state fetch's marker and parts in one read, when ``version``'s
        marker is the same bytes as the last whole fetch's (the same publishers of an
        unchanged model: same plan, same part keys after the version prefix); None
        otherwise, and the caller reads the marker first.  The parts are read as
        ``_reads_decoded`` says."""
        last = self._whole
        if last is None:
            return None
        raw, marker, c, suffixes = last
        keys = self.board.marker_and_part_keys(version, suffixes)
        got = _read_parts(self.store, keys, _reads_decoded(c, plain))
        m = got[0]                                     # (meta, bytes) read raw, else the value
        if m is None or (m[1] if isinstance(m, tuple) else bytes(m)) != raw:
            return None
        return marker, c, keys[1:], got[1:]

    def _compile(self, structure: bytes, layout, version: int) -> _Compiled:
        """The fetch plan for ``layout`` over a version structure, cached."""
        last = self._last_whole
        if layout is None and last is not None and last[0] == structure:
            return last[1]          # the common case: the whole state of an unchanged model
        try:
            ck = (structure, tuple(layout.items()) if isinstance(layout, Mapping) else layout)
            hash(ck)
        except TypeError:          # an unhashable layout entry: plan it every time (or refuse it)
            ck = None
        with self._lock:
            hit = self._compiled.get(ck) if ck is not None else None
        if hit is not None:
            if layout is None:
                self._last_whole = (structure, hit)
            return hit
        c = self._targets(decode_structure(structure), layout, version)
        if layout is None:
            self._last_whole = (structure, c)
        if ck is not None:
            with self._lock:
                self._compiled[ck] = c
                while len(self._compiled) > 8:
                    self._compiled.popitem(last=False)
        return c

    def _targets(self, info: dict[str, _Tensor], layout, version: int) -> _Compiled:
        if layout is None:
            layout = {}
        if not isinstance(layout, Mapping):
            raise TypeError(f"layout must be a mapping of name -> Shard/Fused/None, not {type(layout).__name__}")

        def get(src: str) -> _Tensor:
            if src not in info:
                raise KeyError(f"version {version} of {self.name!r} has no tensor {src!r} "
                               f"(it has {sorted(info)[:20]})")
            return info[src]

        refs: dict[tuple[str, int], int] = {}

        def target(name: str, srcs: list[str], plan: _Plan) -> _Target:
            parts = [(s, p.rank) for s in srcs for p in info[s].parts]   # the plan's part ids
            slots = tuple(refs.setdefault(parts[i], len(refs)) if i in plan.used else -1
                          for i in range(len(parts)))
            t = info[srcs[0]]
            floating = (getattr(_torch(), t.dtype).is_floating_point if t.kind == "torch"
                        else np.dtype(t.dtype).kind == "f")
            return _Target(name, t.kind, t.dtype, t.itemsize, floating, plan.shape, plan, slots)

        targets: list[_Target] = []
        consumed: set[str] = set()
        for name, spec in layout.items():
            if spec is None or isinstance(spec, Shard):
                t = get(name)
                try:
                    plan = _plan_one(t.shape, t.parts, spec, t.itemsize)
                except ValueError as e:
                    raise ValueError(f"layout[{name!r}] for shape {t.shape}: {e}") from None
                targets.append(target(name, [name], plan))
            elif isinstance(spec, Fused):
                srcs = [get(s) for s in spec.sources]
                if len({(s.kind, s.dtype) for s in srcs}) != 1:
                    raise ValueError(f"Fused target {name!r}: sources {list(spec.sources)} are stored as "
                                     f"{[s.dtype for s in srcs]}; fused sources must share one dtype")
                plan = _plan_fused(spec, tuple((s, info[s].shape) for s in spec.sources),
                                   tuple((s, info[s].parts) for s in spec.sources), srcs[0].itemsize)
                targets.append(target(name, list(spec.sources), plan))
                consumed.update(spec.sources)
            else:
                raise TypeError(f"layout[{name!r}] must be a Shard, Fused or None, not {type(spec).__name__}")
        for name, t in info.items():
            if name not in layout and name not in consumed:
                targets.append(target(name, [name], _plan_one(t.shape, t.parts, None, t.itemsize)))
        return _Compiled(tuple(targets), frozenset(t.name for t in targets), tuple(refs),
                         sum(math.prod(t.shape) * t.itemsize for t in targets),
                         sum(math.prod(t.shape) * t.itemsize for t in info.values()))

    def fetch(self, version: int, layout: Mapping[str, Shard | Fused | None] | None = None,
              into: Mapping[str, Array] | None = None, dtype: DType | None = None) -> dict[str, Array]:
        """This worker's slice of ``version``: ``{name: tensor or ndarray}``.

        ``layout[name]`` is a ``Shard`` (cut like ``numpy.array_split``), a
        ``Fused`` target composed from several sources, or None (whole);
        tensors not named are fetched whole, except sources a ``Fused``
        consumes.  Only the byte ranges overlapping each slice are copied,
        from one atomic snapshot of the version's parts.  ``into[name]`` (a
        contiguous tensor on any device, or an ndarray) receives its slice in
        place.  ``dtype`` casts floating-point results.  Raises ``KeyError``
        when the version is not complete or was reclaimed.  Results without
        ``into`` are private CPU memory, their own; from 1 MiB their pages come
        from a per-process pool that takes them back when the result is dropped
        (``YRCACHE_RECV_POOL``), so a loop over versions does not page-fault
        every slice in again.

        ```python
        # rollout rank k of 4, tensor-parallel: column shard of w, fused QKV rows
        state = sub.fetch(v, layout={
            "w": Shard(dim=1, index=k, count=4),
            "qkv": Fused(["q", "k", "v"], dim=0, shard=Shard(0, k, 4)),
        }, into={"w": engine_w, "qkv": engine_qkv})   # straight into GPU parameters
        ```
        """
        t0 = time.perf_counter()
        version = _check_version(version)
        dtype = _check_cast(dtype)
        plain = not into and dtype is None
        snap = self._snapshot(version, plain) if layout is None and not self._remote else None
        if snap is not None:
            marker, c, keys, views = snap
        else:
            raw, marker = self._marker(version)
            c = self._compile(marker["structure"], layout, version)
            nonces = marker["nonces"]
            suffixes = [part_suffix(rank, nonces[rank], tensor) for tensor, rank in c.refs]
            keys, views = self.board.marker_and_part_keys(version, suffixes)[1:], None
            if layout is None and not self._remote:
                self._whole = (raw, marker, c, suffixes)
        into = dict(into) if into else {}
        extra = [n for n in into if n not in c.names] if into else None
        if extra:
            raise ValueError(f"into names {extra}, which this fetch does not return (it returns "
                             f"{sorted(c.names)[:20]})")
        for t in c.targets:                            # every destination, before anything is read
            if t.name in into:
                _check_into(t, into[t.name], dtype)
        targets, net, pre = c.targets, {}, {}
        if self._remote:                               # parts on other machines: ranged reads
            targets, bufs, net, pre = self._fetch_remote(c, version, marker, keys, into, dtype)
        else:
            decoded = _reads_decoded(c, plain)
            if views is None:                          # one atomic, pinned snapshot
                views = _read_parts(self.store, keys, decoded)
            if any(v is None for v in views):
                raise KeyError(self.board.why_gone(version, is_remote(self.store)))
            bufs = None if decoded else [np.frombuffer(body, np.uint8) for _meta, body in views]
        if c.needed >= PREFAULT_MIN_BYTES and views is not None:
            # The byte range each part is read in, mapped in one call per part (a
            # process that has not touched them would take a fault per 4 KiB).
            spans: dict[int, list[int]] = {}
            for t in c.targets:
                for pid, so, _do, run, rows, ss, _ds in t.plan.ops:
                    lo, hi = so, so + (rows - 1) * ss + run
                    sp = spans.setdefault(t.slots[pid], [lo, hi])
                    sp[0], sp[1] = min(sp[0], lo), max(sp[1], hi)
            self.store.prefault(*(bufs[i][lo:hi] for i, (lo, hi) in spans.items()))
        copied = 0
        out: dict[str, Any] = {}
        pin = bool(into) and any(codec.is_tensor(d) and d.device.type == "cuda" for d in into.values())
        if pin:
            self.store.pin_host_memory()             # the parts' DMA to the device, unstaged
        stager = None
        if into:                                       # (only into= destinations are staged)
            reuse, self._pinned = (self._pinned, None) if pin else (None, self._pinned)  # one fetch owns it
            stager = _Stager(min(BUCKET_BYTES, -(-c.needed // 64) * 64 + 64 * len(c.targets)), pin, reuse)
        with _progress(c.needed, self.name, version) as bar:
            try:
                for t in targets:
                    got = None
                    if bufs is None:                       # a small state read decoded: views are set
                        assert views is not None
                        got = _whole_part(t, views)
                        if got is None:
                            bufs = [_src_bytes(v) for v in views]
                    if got is None:
                        got = self._gather(t, [bufs[i] if i >= 0 else None for i in t.slots],
                                           into.get(t.name), dtype, stager, pre.get(t.name))
                    out[t.name] = got
                    copied += t.plan.nbytes
                    bar.update(t.plan.nbytes)
            finally:                                   # (copies in flight read the views)
                if stager is not None:
                    stager.flush()
        if pin and stager is not None:
            self._pinned = stager.buf
        del views, bufs                                # drop the pins: reclaimable now
        self.last_fetch_stats = {
            "version": version, "bytes_copied": copied, "bytes_needed": c.needed,
            "bytes_version": c.version_bytes, "parts": len(keys), "targets": len(c.targets),
            "seconds": time.perf_counter() - t0, **net}
        return out

    def _fetch_remote(self, c: _Compiled, version: int, marker: dict, keys: list[str], into: dict,
                      dtype: Any) -> tuple:
        """The parts over a cluster store: only the spans the plans read (pulled once per
        node); the targets' plans rewritten to read the packed spans. Results without
        ``into`` are made first: a part no other process of the node wants is received
        straight into its result (or its ``into`` destination, when that takes the stored
        bytes as they are) where it is one run of it (its ops then dropped)."""
        spans, remapped = plan_spans(c.targets, len(keys))
        placement = marker.get("placement") or []
        prefer = [list(placement[r].get(t, ())) if r < len(placement) else [] for t, r in c.refs]
        pre = {t.name: _new_result(t) for t in c.targets if t.name not in into}
        direct = direct_slots(c.targets, remapped, len(keys), [
            codec.as_bytes_view(pre[t.name]) if t.name in pre else
            None if dtype is not None else _as_stored(t, into[t.name]) for t in c.targets])
        private = self._wants.private(span_ids(self.name, c.refs, spans))
        try:
            bufs, packed, net = fetch_parts(self.store, self.name, version, keys, spans, prefer, private, direct)
        except PartsUnavailable as e:
            if not self.board.is_complete(version):
                raise KeyError(self.board.why_gone(version, is_remote(self.store))) from None
            raise PartsUnavailable(
                f"version {version} of {self.name!r}: part {e.args[0]!r} is on no live member (the "
                "members holding it died); wait() for a newer version") from None
        targets = tuple(t._replace(plan=t.plan._replace(ops=tuple(
            new if packed[t.slots[old[0]]] else old for old, new in zip(t.plan.ops, ops)
            if bufs[t.slots[old[0]]] is not None)))
            for t, ops in zip(c.targets, remapped))
        if self._cached_version != version:
            self._cached_version = version
            drop_older(self.store, self.board, self.name, version, int(marker.get("keep") or 1))
        return targets, bufs, net, pre

    def _gather(self, t: _Target, srcs: list, dst: Any, dtype: Any, stager: _Stager | None,
                res: Any = None) -> Any:
        """Target ``t`` gathered from ``srcs`` into ``dst`` (``into=``), or into ``res`` (a
        ``_new_result`` that may hold some of it already) or a new result."""
        want = None
        if dtype is not None and t.floating:
            want = _torch_dtype(dtype) if t.kind == "torch" else _numpy_dtype(dtype)
        if dst is None:
            res = _new_result(t) if res is None else res
            _run_plan(t.plan, srcs, codec.as_bytes_view(res))
            if want is None or want == res.dtype:
                return res
            return res.to(want) if t.kind == "torch" else res.astype(want)
        # ---- into= (checked by _check_into before anything was read)
        is_t = codec.is_tensor(dst)
        flat = _as_stored(t, dst)
        if flat is not None:                             # straight into the destination
            _run_plan(t.plan, srcs, flat)
            return dst
        if not is_t and t.kind == "numpy":               # numpy -> numpy cast: no torch needed
            tmp = np.empty(t.shape, dtype=np.dtype(t.dtype))
            _run_plan(t.plan, srcs, tmp.reshape(-1).view(np.uint8))
            np.copyto(dst, tmp, casting="unsafe")
            return dst
        nbytes = math.prod(t.shape) * t.itemsize         # gather in the stored dtype, then cast/move
        torch, sdt = _torch(), _stored_torch_dtype(t)
        assert stager is not None                        # (made for every fetch with into=)
        if is_t and stager.gather_on_device(t.plan.ops, srcs, nbytes, sdt, t.shape, dst):
            return dst
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


def _new_result(t: _Target) -> Any:
    """A new result for target ``t`` in its stored dtype (pooled pages from 1 MiB)."""
    if t.kind == "torch":
        torch = _torch()
        return buffers.empty_tensor(torch, getattr(torch, t.dtype), t.shape)
    return buffers.empty_array(t.dtype, t.shape)


def _check_into(t: _Target, dst: Any, dtype: Any) -> None:
    """Refuse an ``into=`` destination that cannot take target ``t``."""
    is_t = codec.is_tensor(dst)
    if not is_t and not isinstance(dst, np.ndarray):
        raise TypeError(f"into[{t.name!r}] must be a torch tensor or numpy array, not {type(dst).__name__}")
    if tuple(dst.shape) != tuple(t.shape):
        raise ValueError(f"into[{t.name!r}] has shape {tuple(dst.shape)}, but the fetched slice has "
                         f"shape {tuple(t.shape)}")
    if not (dst.is_contiguous() if is_t else dst.flags.c_contiguous and dst.flags.writeable):
        raise ValueError(f"into[{t.name!r}] must be contiguous and writable")
    if is_t and dst.device.type not in ("cpu", "cuda"):
        raise ValueError(f"into[{t.name!r}] is on device {dst.device}; fetch writes into CPU or CUDA "
                         "tensors (a meta tensor has no memory to write)")
    if t.floating and (not dst.dtype.is_floating_point and not dst.dtype.is_complex if is_t
                       else dst.dtype.kind in "biu"):
        raise TypeError(f"into[{t.name!r}] has dtype {dst.dtype}, but {t.name!r} is stored as {t.dtype}: an "
                        "integer or bool destination would truncate the weights silently; pass a "
                        "floating-point one")
    if dtype is not None and t.floating:
        want = _torch_dtype(dtype) if t.kind == "torch" else _numpy_dtype(dtype)
        if (_torch_dtype(want) if is_t else _numpy_dtype(want)) != dst.dtype:
            raise ValueError(f"fetch(dtype={dtype}) conflicts with into[{t.name!r}].dtype={dst.dtype}; "
                             "into tensors receive their own dtype (drop dtype= or match it)")


def _as_stored(t: _Target, dst: Any) -> Any:
    """An ``into=`` destination (``_check_into`` passed it) as flat bytes when it takes
    target ``t``'s stored bytes as they are (host memory, the stored dtype); else None."""
    if codec.is_tensor(dst):
        ok = dst.device.type == "cpu" and dst.dtype == _stored_torch_dtype(t)
    else:
        ok = dst.dtype == _stored_numpy_dtype(t)
    return codec.as_bytes_view(dst) if ok else None


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
