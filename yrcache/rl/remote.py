"""Fetching a version's parts over a cluster store: ranged reads, pulled once per node.

On an embedded store a fetch reads its slices out of pinned views of whole parts.
On a cluster store (one with ``read_ranges``) a part may sit on another machine,
so for each part the fetch asks only for the byte spans its plan reads (read
amplification 1.00), several owners in parallel, and the plan then reads the
packed bytes. The received bytes land in the node's arena
(``ClusterStore.node_store``) under a key named after the part and the spans, so
another process of the node fetching the same slice of the same version reads
them zero-copy instead of pulling them again (versioned keys are immutable: no
invalidation); a per-key node lock makes the first fetcher pull while the others
wait for it (unless it is stopped: ``landers.py``). Spans no other process of the
node wants (``wants.py``) do not land there: they are received privately, straight
into the results where they are one run of one. Parts this node holds itself are
read in place, no copy, no network.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import buffers, codec
from ..errors import StoreFullError
from .landers import landing

#: Keys of a node's own arena that hold fetched weight bytes (``ClusterStore.node_store``).
NODE_CACHE = "__node__/cache/rl/"       # (cluster.member.NODE_CACHE_PREFIX: dropped when room is short)
SPANS_PER_READ = 4096          # (wire.MAX_SPANS)
_POOL: list[ThreadPoolExecutor] = []


def _forget_pool() -> None:
    """In a forked child: the parent's threads do not exist here, so its pool would take
    work and never run it."""
    _POOL.clear()


os.register_at_fork(after_in_child=_forget_pool)


def pool() -> ThreadPoolExecutor:
    """The threads ``yrcache.rl`` moves parts on over a cluster (sends of a publish,
    pulls of a fetch), made on first use."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=8, thread_name_prefix="yrcache-rl"))
    return _POOL[0]


def is_remote(store: Any) -> bool:
    """Whether ``store`` is a cluster store (its parts may live on other machines)."""
    return hasattr(store, "read_ranges")


class PartsUnavailable(KeyError):
    """A part of a complete version is on no live member."""

    def __str__(self) -> str:                      # KeyError would quote the message
        return str(self.args[0])


def plan_spans(targets: tuple, nslots: int) -> tuple[list[list[tuple]], tuple]:
    """The byte spans each stored part is read in, and the targets' plans rewritten to
    read those spans packed back to back (``wire.gather``'s order).

    Returns ``(spans per slot, remapped ops per target)``; a remapped op keeps its
    destination and reads ``rows`` runs of ``run`` bytes at ``packed offset``, ``run``
    apart.
    """
    spans: list[list[tuple]] = [[] for _ in range(nslots)]
    packed = [0] * nslots
    ops_out = []
    for t in targets:
        ops = []
        for pid, so, do, run, rows, ss, ds in t.plan.ops:
            slot = t.slots[pid]
            spans[slot].append((so, run, rows, ss if rows > 1 else run))
            ops.append((pid, packed[slot], do, run, rows, run, ds))
            packed[slot] += run * rows
        ops_out.append(tuple(ops))
    return spans, tuple(ops_out)


def cache_key(name: str, version: int, part: str, spans: list[tuple]) -> str:
    digest = hashlib.blake2b(repr((part, spans)).encode(), digest_size=16).hexdigest()
    return f"{NODE_CACHE}{name}/{version:020d}/{digest}"


class _Pull:
    """Where one part's bytes come from in this fetch, and the buffer they end up in."""

    __slots__ = ("slot", "key", "spans", "prefer", "into", "buf", "how", "nbytes")

    def __init__(self, slot: int, key: str, spans: list[tuple], prefer: list[str], into: Any):
        self.slot, self.key, self.spans, self.prefer, self.into = slot, key, spans, prefer, into
        self.buf: Any = None
        self.how = ""                  # network | node_cache (packed spans) | local (the whole part)
        self.nbytes = sum(run * rows for _, run, rows, _ in spans)


def direct_slots(targets: tuple, remapped: tuple, nslots: int, outs: list[Any]) -> list[Any]:
    """Per stored part: the bytes of a result its packed spans are, exactly, or None.

    ``outs[i]`` is target ``i``'s result as flat bytes, allocated before the pull (None:
    not yet). A part qualifies when one op of one target reads it (``remapped``, from
    ``plan_spans``) and writes one contiguous run of that result: its spans can then be
    received straight into the result, with no copy after.
    """
    uses, dst = [0] * nslots, [None] * nslots
    for t, ops, out in zip(targets, remapped, outs):
        for pid, _packed, do, run, rows, _ss, ds in ops:
            slot = t.slots[pid]
            uses[slot] += 1
            if out is not None and (rows == 1 or ds == run):
                dst[slot] = out[do:do + run * rows]
    return [d if u == 1 else None for d, u in zip(dst, uses)]


def fetch_parts(store: Any, name: str, version: int, keys: list[str], spans: list[list[tuple]],
                prefer: list[list[str]], private: list[bool] | None = None,
                direct: list[Any] | None = None) -> tuple[list[Any], list[bool], dict[str, int]]:
    """Each part's bytes for this fetch: ``(buffers, packed?, byte counts)``.

    A buffer is the whole part (``packed`` False: this node holds it), the packed
    spans, or None: received straight into ``direct[i]`` (a result's bytes, from
    ``direct_slots``), which only a ``private`` part is (one no other process of the
    node wants: not landed in the node's arena; a pure client's parts all are).
    Byte counts: ``bytes_network`` (pulled by this process), ``bytes_node_cache``
    (landed by another process of the node), ``bytes_local`` (read from parts this
    node holds); ``bytes_direct``: of ``bytes_network``, those received straight into
    ``direct``. Raises ``PartsUnavailable`` for a part no live member holds.
    """
    node, n = store.node_store, len(keys)
    if private is None or node is None:            # (a pure client has no node to share with)
        private = [node is None] * n
    direct = direct or [None] * n
    pulls = [_Pull(i, k, sp, pf, direct[i] if private[i] else None)
             for i, (k, sp, pf) in enumerate(zip(keys, spans, prefer))]
    many, alone = [], []
    for p in pulls:
        local = node.get(p.key) if node is not None else None
        if local is not None:
            p.buf, p.how = _flat(local), "local"
        elif not p.nbytes:
            p.buf, p.how = np.empty(0, np.uint8), "network"
        elif private[p.slot]:
            if len(p.spans) > SPANS_PER_READ:      # more than a frame carries: on its own
                p.buf, p.how = _receive(store, p, p.into), "network"
            else:
                alone.append(p)
        elif len(p.spans) > SPANS_PER_READ:
            _pull(store, node, name, version, p)
        else:
            many.append(p)
    if alone:
        _receive_many(store, alone, None)
    if many:
        _pull_many(store, node, name, version, many)
    counts = {"bytes_network": 0, "bytes_node_cache": 0, "bytes_local": 0, "bytes_direct": 0}
    bufs = []
    for p in pulls:
        counts[f"bytes_{p.how}"] += p.nbytes
        straight = p.into is not None and p.buf is p.into
        counts["bytes_direct"] += p.nbytes if straight else 0
        bufs.append(None if straight else p.buf)
    return bufs, [p.how != "local" for p in pulls], counts


def _pull_many(store: Any, node: Any, name: str, version: int, pulls: list[_Pull]) -> None:
    """Pull several parts' spans in one ``read_ranges_many`` (a pipelined batch per
    member): each lands in the node's arena under its cache key while this process
    holds the node locks of all of them, so a process of the node fetching the same
    spans waits, then reads them there."""
    cks = [cache_key(name, version, p.key, p.spans) for p in pulls]
    with landing(node, cks) as landed:
        if not landed:                             # their lander is stopped: pull them privately
            _receive_many(store, pulls, None)
            return
        rest, rest_cks = [], []
        for p, ck in zip(pulls, cks):
            cached = node.get(ck)
            if cached is not None:
                p.buf, p.how = _flat(cached), "node_cache"
            else:
                rest.append(p)
                rest_cks.append(ck)
        if rest:
            _receive_many(store, rest, node, rest_cks)


def _receive_many(store: Any, pulls: list[_Pull], node: Any, cks: list[str] | None = None) -> None:
    """Pull ``pulls`` with one ``read_ranges_many``: each into the node's arena under its
    cache key in ``cks``, or privately (no ``cks``, or no room in the arena): into its
    ``into`` or a pooled buffer."""
    again = []

    def land(i: int, _meta: bytes, n: int, fill: Any) -> None:
        p = pulls[i]
        p.how = "network"
        if cks is not None:
            took = []

            def fill_block(u8: Any) -> None:
                took.append(u8)
                fill(u8)
            try:
                node.put_with(cks[i], codec.array_meta(np.dtype(np.uint8), (n,)), n, fill_block)
                cached = node.get(cks[i])
            except (StoreFullError, MemoryError):
                cached = None                      # no room in the node's arena: keep it private
            if cached is not None:
                p.buf = _flat(cached)
                return
            if took:                               # received, then gone: pull it again, privately
                again.append(p)
                return
        p.buf = p.into if p.into is not None else buffers.empty_array(np.uint8, (n,))
        fill(p.buf)
    found = store.read_ranges_many([(p.key, p.spans) for p in pulls], land, prefer=[p.prefer for p in pulls])
    for p, ok in zip(pulls, found):
        if not ok:
            raise PartsUnavailable(p.key)
    for p in again:
        p.buf = _receive(store, p, None)


def _flat(value: Any) -> np.ndarray:
    flat = codec.flat_bytes(value)
    return flat if isinstance(flat, np.ndarray) else np.frombuffer(flat, np.uint8)


def _pull(store: Any, node: Any, name: str, version: int, p: _Pull) -> None:
    ck = cache_key(name, version, p.key, p.spans)
    with landing(node, [ck]) as landed:            # the node's first fetcher pulls, the rest wait
        if not landed:
            p.buf, p.how = _receive(store, p, None), "network"
            return
        cached = node.get(ck)
        if cached is None:
            try:
                node.put_with(ck, codec.array_meta(np.dtype(np.uint8), (p.nbytes,)), p.nbytes,
                              lambda u8: _receive(store, p, u8))
                cached = node.get(ck)
            except (StoreFullError, MemoryError):
                cached = None
            if cached is None:                     # no room in the node's arena: keep it private
                p.buf, p.how = _receive(store, p, None), "network"
                return
            p.how = "network"
        else:
            p.how = "node_cache"
    p.buf = _flat(cached)


def _receive(store: Any, p: _Pull, into: Any) -> Any:
    dst = buffers.empty_array(np.uint8, (p.nbytes,)) if into is None else into
    pos = 0
    for i in range(0, len(p.spans), SPANS_PER_READ):      # a frame carries at most so many
        chunk = p.spans[i:i + SPANS_PER_READ]
        n = sum(run * rows for _, run, rows, _ in chunk)
        if store.read_ranges(p.key, chunk, into=dst[pos:pos + n], prefer=p.prefer) is None:
            raise PartsUnavailable(p.key)
        pos += n
    return dst


def drop_older(store: Any, board: Any, name: str, version: int, keep: int) -> None:
    """Free the node's landed bytes of versions older than ``version`` that the publishers
    retire (``keep``): those with ``keep`` landed versions in ``(v, version]`` (every
    landed version was complete, so ``version`` completing retired them), or no longer
    complete."""
    node = store.node_store
    if node is None:
        return
    pre = f"{NODE_CACHE}{name}/"
    by_version: dict[int, list[str]] = {}
    for k in node.keys(prefix=pre):
        try:
            by_version.setdefault(int(k[len(pre):len(pre) + 20]), []).append(k)
        except ValueError:
            continue
    landed = sorted(by_version)
    for v in landed:
        if v >= version:
            break
        newer = sum(1 for u in landed if v < u <= version)
        if newer >= keep or not board.is_complete(v):
            for k in by_version[v]:
                node.delete(k)
