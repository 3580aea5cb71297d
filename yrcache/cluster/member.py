"""A member's side of cluster mode: the node's versions, forwarding and rebalancing.

- :class:`Node`: the data-plane handler (a transport ``Handler``). It owns the
  versions of the objects in its arena: in cluster mode only the member process
  writes into the node's arena, so the versions live in its memory.
- :class:`Forwarder`: the background sender. It ships objects to the key's
  other owners (``ASYNC`` writes, hand-over after a membership change,
  re-replication after a member dies) and drops its own copy of an object it no
  longer owns once every owner holds it, or once an owner answers that it holds
  something newer. Its queue is bounded; ``flush`` waits for it.
- :class:`Rebalancer`: after each membership change (again a few seconds later),
  compares every local object's owners with what those owners hold (pipelined
  ``HAVE`` queries) and queues what is missing or misplaced; every
  ``YRCACHE_REPAIR_S`` it does the same for the objects written since its last
  pass (a write that missed an owner), and every tenth time for all of them.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._fast import KeyLock, OwnPuts
from ..config import Tier, WriteMode
from ..errors import ClusterUnavailableError, StoreClosedError, StoreFullError
from . import transport as tp
from .rebalance import Rebalancer, _surplus, _Worker
from .replication import BATCH, IDLE_S, LINGER_S, QUEUE_MAX, REBALANCE_RATE, TOMBSTONE_S, Version, check_wire_meta

if TYPE_CHECKING:
    from ..store import TieredStore
    from .replication import Router

log = logging.getLogger("yrcache.cluster")
#: Keys a node's processes keep in its arena for themselves (``ClusterStore.node_store``):
#: not the cluster's, so never listed, forwarded or rebalanced.
NODE_PREFIX = "__node__/"
#: Of those, copies of bytes the cluster holds elsewhere (``yrcache.rl``'s landed spans):
#: the member drops them when a write it owns finds no room, rather than refuse the write.
NODE_CACHE_PREFIX = NODE_PREFIX + "cache/"


class Node(tp.Handler):
    """The data-plane handler of one member: applies versioned writes to the local arena."""

    def __init__(self, local: TieredStore, member_id: str, router: Router, async_default: bool = False):
        self.local = local
        self.member_id = member_id
        self.router = router
        self.versions: dict[str, Version] = {}
        self.tombs: dict[str, tuple[Version, float]] = {}
        self.single: set[str] = set()        # WriteMode.NONE objects: one copy, on their first owner
        #: Handing over before leaving: every write this member takes is forwarded to the key's
        #: owners without it too (a writer that still counts it as an owner sent it no others).
        self.leaving = False
        self._locks = [KeyLock() for _ in range(64)]     # threading.Lock's API; OwnPuts takes them in C
        self.forwarder = Forwarder(self)
        self.rebalancer = Rebalancer(self)
        #: This member's own ASYNC puts of plain values in one C call (``ClusterStore.put``;
        #: None when the local store's puts need room made: an SSD tier, cache mode).
        #: ``Router.update`` keeps it ``active`` while this member is in the ring.
        self.own: OwnPuts | None = None
        if local._placement.direct:
            fw, a = self.forwarder, local._a
            modes = (WriteMode.ASYNC, "async") + ((None,) if async_default else ())
            self.own = OwnPuts(a.hot, router.clock, self.versions, self.tombs, self.single, self._locks, fw,
                               fw._q, modes, QUEUE_MAX, BATCH, a.prefaulted)
            self.serve = self.own.serve       # plain single PUTs and GETs from other processes, in C too

    def close(self) -> None:
        if self.own is not None:
            self.own.active = False
        self.rebalancer.close()
        self.forwarder.close()

    def lock(self, key: str) -> KeyLock:
        return self._locks[hash(key) & 63]

    def owners(self, key: str) -> list[str]:
        """Who should hold our copy of ``key``: one member for a ``NONE`` object."""
        return self.router.owners(key, 1 if key in self.single else None)

    def current(self, key: str) -> Version | None:
        v = self.versions.get(key)
        if v is None and self.tombs:
            t = self.tombs.get(key)
            return t[0] if t is not None else None
        return v

    def apply(self, key: str, meta: bytes, nbytes: int, fill: Any, version: Version,
              priority: int, expire_at: float, skip: Callable[[], None] | None = None, flags: int = 0) -> int:
        """Store ``key`` at ``version`` unless this member holds a newer one; ``fill``
        is the payload (a buffer) or a callable that writes it (``put_with``);
        ``flags``: the frame's (single copy, tier hint)."""
        with self.lock(key):
            status = self._apply_locked(key, meta, nbytes, fill, version, priority, expire_at, skip, flags)
        if status == tp.OK:
            self.router.clock.observe(version[0])
        return status

    def apply_with(self, key: str, put: Callable[[str, Any], None], value: Any, version: Version) -> bool:
        """``put(key, value)`` at ``version``, a version of this member's own clock (nothing
        to observe), unless this member holds a newer one; True once stored."""
        with self.lock(key):
            cur = self.current(key)
            if cur is not None and version <= cur:
                return False
            put(key, value)
            self._applied(key, version, 0)
        return True

    def _apply_locked(self, key: str, meta: bytes, nbytes: int, fill: Any, version: Version,
                      priority: int, expire_at: float, skip: Callable[[], None] | None, flags: int) -> int:
        """``apply`` with ``key``'s lock held (the clock left to the caller)."""
        cur = self.current(key)
        if cur is not None and version <= cur:
            if skip is not None:
                skip()
            return tp.SAME if version == cur else tp.STALE
        kw: dict[str, Any] = {}
        if expire_at or priority or flags >> tp.TIER_SHIFT:
            ttl, tier = _ttl_tier(expire_at, flags)
            kw = {"priority": priority, "ttl": ttl, "tier": tier}
        try:
            self.local.put_with(key, meta, nbytes, fill, **kw)
        except StoreFullError:
            if not self.shed_cache(key):
                raise
            self.local.put_with(key, meta, nbytes, fill, **kw)
        self._applied(key, version, flags)
        return tp.OK

    def shed_cache(self, why: str) -> bool:
        """Drop this node's cached copies (``NODE_CACHE_PREFIX``) to make room for a write of
        ``why``; False if there were none. Their processes pull the bytes again when they
        need them (a copy one of them is reading stays until it lets go)."""
        keys = list(self.local.keys(prefix=NODE_CACHE_PREFIX))
        for k in keys:
            self.local.delete(k)
        if keys:
            log.warning("%s: the arena is full: dropped %d cached copies to take a write of %r (the "
                        "node's processes fetch them again; give the node more YRCACHE_DRAM)",
                        self.member_id, len(keys), why[:80])
        return bool(keys)

    def _applied(self, key: str, version: Version, flags: int) -> None:
        """Remember that ``key`` is stored here at ``version`` (under its lock)."""
        self.versions[key] = version
        if self.tombs:
            self.tombs.pop(key, None)
        if flags & tp.F_SINGLE:
            self.single.add(key)
        elif self.single:
            self.single.discard(key)

    def remove(self, key: str, version: Version) -> int:
        with self.lock(key):
            cur = self.current(key)
            if cur is not None and version < cur:
                return tp.STALE
            existed = self.local.delete(key)
            self.versions.pop(key, None)
            self.single.discard(key)
            self.tombs[key] = (version, time.monotonic())
        if len(self.tombs) > 10_000:
            old = time.monotonic() - TOMBSTONE_S
            for k, (_, t) in list(self.tombs.items()):
                if t < old:
                    self.tombs.pop(k, None)
        return tp.OK if existed else tp.NOT_FOUND

    def drop_if(self, key: str, version: Version) -> None:
        """Remove our copy of ``key`` if it is still ``version`` (it was handed over)."""
        with self.lock(key):
            if self.versions.get(key) == version:
                self.local.delete(key)
                self.versions.pop(key, None)
                self.single.discard(key)

    def read(self, key: str, offset: int = 0, length: int = tp.ALL) -> tp.Got | None:
        got = self.local.get_raw(key)
        if got is None:
            return None
        meta, view = got
        if offset or length < view.nbytes:
            view = view[offset:offset + length]
        tier = int(self.local.tier_of(key)) if length == 0 else -1
        return tp.Got(meta, view, self.versions.get(key, (0, 0)), tier)

    # -- transport.Handler
    def put(self, f: tp.Frame, fill: Any, skip: Callable[[], None]) -> int:
        check_wire_meta(f.meta, f.plen)
        status = self.apply(f.key, f.meta, f.plen, fill, f.version, f.priority, f.expire_at, skip, f.flags)
        if status == tp.OK and (f.flags & tp.F_REPLICATE or self.leaving):
            self.forwarder.add(f.key, f.version)
        return status

    def adopt(self, f: tp.Frame) -> int:
        """A process of this machine stored ``f.key`` in the arena itself (``ClusterStore``'s
        ``_put_here``): take the object ``f.offset`` (its sequence number) at ``f.version``,
        as ``put`` would; drop it if this member holds a newer version."""
        key = f.key
        if key.startswith(NODE_PREFIX):
            raise ValueError(f"{key[:80]!r} is a node-private key, not the cluster's")
        kb, a = key.encode(), self.local._a
        with self.lock(key):
            got = a.peek(kb)
            if got is None or got[0].seq != f.offset:
                return tp.NOT_FOUND
            cur = self.current(key)
            if cur is not None and f.version <= cur:
                a.delete(kb, f.offset)
                return tp.SAME if f.version == cur else tp.STALE
            self._applied(key, f.version, f.flags)
        self.router.clock.observe(f.version[0])
        if f.flags & tp.F_REPLICATE or self.leaving:
            self.forwarder.add(key, f.version)
        return tp.OK

    def queue(self, key: str, version: Version) -> None:
        self.forwarder.add(key, version)

    def put_many(self, items: list[tp.PutItem], flags: int) -> list[int]:
        """The puts of one MPUT frame, each checked and applied as :meth:`put` does, under
        the locks of all their keys at once (taken in index order, so never against
        another batch), the clock advanced once for the batch."""
        locks = [self._locks[i] for i in sorted({hash(it[0]) & 63 for it in items})]
        out: list[int] = []
        top = 0
        for lk in locks:
            lk.acquire()
        try:
            for key, meta, payload, version, priority, expire_at in items:
                try:
                    check_wire_meta(meta, len(payload))
                    status = self._apply_locked(key, meta, len(payload), payload, version, priority, expire_at,
                                                None, flags)
                except Exception as e:   # noqa: BLE001 - this item failed, the batch goes on
                    status = tp.refused(f"put of {key[:80]!r}", e)
                out.append(status)
                if status == tp.OK and version[0] > top:
                    top = version[0]
        finally:
            for lk in reversed(locks):
                lk.release()
        if top:
            self.router.clock.observe(top)
        if flags & tp.F_REPLICATE or self.leaving:
            for it, status in zip(items, out):
                if status == tp.OK:
                    self.forwarder.add(it[0], it[3])
        return out

    def get(self, f: tp.Frame):
        return self.read(f.key, f.offset, f.length)

    def get_many(self, keys: list[str]) -> list[tp.Got | None]:
        try:
            raw = self.local.mget_raw(keys)
        except TypeError:                     # a pickled object among them: key by key
            return super().get_many(keys)
        get, new, Got = self.versions.get, tuple.__new__, tp.Got
        return [None if r is None else new(Got, (r[0], r[1], get(k, (0, 0)), -1)) for k, r in zip(keys, raw)]

    def mget_reply(self, body: bytearray) -> tuple[int, bytes] | None:
        return self.local.mget_wire(body, self.versions)

    def delete(self, f: tp.Frame) -> int:
        return self.remove(f.key, f.version)

    def keys(self, prefix: str) -> list[tuple[str, Version]]:
        return [(k, self.versions.get(k, (0, 0))) for k in self.local.keys(prefix)
                if not k.startswith(NODE_PREFIX)]

    def have(self, entries: list[tuple[str, Version]]) -> bytes:
        """Per entry: 1 if this member holds the key at that version or newer, 2 if it
        remembers a delete of it at that version or newer, else 0."""
        out = bytearray(len(entries))
        tombs = self.tombs
        for i, (k, v) in enumerate(entries):
            cur = self.versions.get(k)
            if cur is not None:
                out[i] = cur >= v and k in self.local
            elif tombs and (t := tombs.get(k)) is not None:
                out[i] = 2 * (t[0] >= v)
        return bytes(out)

    def stat(self) -> bytes:
        st = self.local.stats()
        return json.dumps({"member": self.member_id, "objects": len(self.versions),
                           "bytes": sum(t.get("used", 0) for t in st["tiers"].values()), "store": st,
                           "pending": self.forwarder.pending(),
                           "under_replicated": self.rebalancer.under_replicated}).encode()

    def flush(self, timeout: float) -> bool:
        return self.forwarder.wait(timeout)

    def stuck(self) -> str:
        return self.forwarder.stuck()


def _ttl_tier(expire_at: float, flags: int) -> tuple[float | None, Tier | None]:
    """A frame's expiry as the ttl left, and its tier hint (from ``flags``)."""
    t = (flags >> tp.TIER_SHIFT) & 7
    return (None if not expire_at else max(expire_at - time.time(), 1e-3)), (Tier(t - 1) if t else None)

RETRY_MIN_S = 0.05        # a target that failed is tried again after this, doubling ...
RETRY_MAX_S = 1.0         # ... up to this
RETRY_LOG_S = 30.0        # and its failures are logged at most this often


class Forwarder(_Worker):
    """Ships local objects to the owners that lack them, one thread, bounded queue."""

    def __init__(self, node: Node):
        super().__init__("yrcache-forward")
        self.node = node
        self._q: collections.OrderedDict[str, tuple[Version, tuple[str, ...] | None]] = collections.OrderedDict()
        self._busy = 0
        self.sent = 0
        self.sent_bytes = 0
        self._burst = [0, 0, 0.0]          # objects, bytes and start of the current backlog (for the log)
        # A target that failed: [next try, pause, when last logged].  It is tried again after a
        # pause that doubles up to RETRY_MAX_S and logged at most every RETRY_LOG_S, so a member
        # that cannot be reached (dead while etcd is down, so still in the member set) costs
        # neither a connection attempt nor a log line every 50 ms.
        self._failing: dict[str, list[float]] = {}
        self._why: dict[str, str] = {}     # what the last send to each failing target raised
        # Asleep until woken (nothing queued for IDLE_S); else it looks every LINGER_S by itself.
        self._asleep = False
        self._thread.start()

    def add(self, key: str, version: Version, targets: tuple[str, ...] | None = None, block: bool = True) -> None:
        """Queue ``key``: send ``version`` to ``targets`` (default: its other owners).

        The thread is woken only from its long sleep or for a full batch: waking
        another thread is a system call and, on a VM, an interrupt to an idle vCPU
        (tens of microseconds on the writer's clock), and a woken forwarder would
        wait ``LINGER_S`` for a batch anyway."""
        with self._cv:
            while block and len(self._q) >= QUEUE_MAX and not self._stop:
                self._cv.wait(0.1)
            queued = self._q.get(key)
            if queued is None or queued[0] <= version:     # never an older version over a newer one
                self._q[key] = (version, targets)
                self._q.move_to_end(key)
            if self._asleep or len(self._q) >= BATCH:
                self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def stuck(self) -> str:
        """Why the objects still queued have not gone: each failing target's last error."""
        return "; ".join(f"to {m}: {why}" for m, why in list(self._why.items())[:4])

    def wait(self, timeout: float, give_up: threading.Event | None = None) -> bool:
        """Until nothing is queued or being sent (True), ``timeout`` passes or ``give_up`` is set."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = end - time.monotonic()
                if left <= 0 or (give_up is not None and give_up.is_set()):
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle_since = time.monotonic()
                while not self._q and not self._stop:
                    if time.monotonic() - idle_since < IDLE_S:
                        self._cv.wait(LINGER_S)   # a look every LINGER_S: writers need not wake us
                        continue
                    # set before the last look: OwnPuts queues without the lock, then reads it
                    self._asleep = True
                    if not self._q:
                        self._cv.wait()
                    self._asleep = False
                    if self._q and len(self._q) < BATCH and not self._stop:
                        self._cv.wait(LINGER_S)   # let a burst of writes gather into one batch
                if self._stop:
                    return
                batch = [self._q.popitem(last=False) for _ in range(min(BATCH, len(self._q)))]
                self._busy += len(batch)
                self._cv.notify_all()
            retry: list[tuple[str, Version]] = []
            try:
                retry = self._send(batch)
            except StoreClosedError:
                return
            except Exception as e:      # noqa: BLE001 - logged, retried
                log.warning("forwarding %d objects failed: %s", len(batch), e)
                retry = [(k, v) for k, (v, _) in batch]
            with self._cv:
                self._busy -= len(batch)
                for k, v in retry:
                    if not self._stop:
                        self._q.setdefault(k, (v, None))    # one step: OwnPuts may queue k meanwhile
                self._cv.notify_all()
                drained = not self._q and not self._busy
            if retry:
                time.sleep(0.05)
            elif drained and self._burst[0] >= 100:
                n, nbytes, t0 = self._burst
                log.info("forwarded %d objects (%.1f MiB) in %.1f s; nothing left to send", n, nbytes / 2**20,
                         time.monotonic() - t0)
            if drained:
                self._burst = [0, 0, 0.0]

    def _send(self, batch: list[tuple[str, tuple[Version, tuple[str, ...] | None]]]) -> list[tuple[str, Version]]:
        """Ship a batch, pipelined per target member; return what must be tried again."""
        node, router = self.node, self.node.router
        per_target: dict[tuple[str, int], list] = collections.defaultdict(list)   # (member, frame flags)
        held = []
        failed: set[str] = set()
        moves = any(targets is not None for _, (_, targets) in batch)
        now = time.monotonic()
        for key, (version, targets) in batch:
            if node.versions.get(key) != version:
                continue                    # replaced or deleted since: that write forwards itself
            if targets is None:
                targets = tuple(o for o in node.owners(key) if o != node.member_id)
            if targets and all(m in self._failing and now < self._failing[m][0] for m in targets):
                held.append((key, version))     # every target is resting: not even read until then
                failed.add(key)
                continue
            got = node.read(key)
            if got is None:
                continue
            info = node.local.info(key) or {}
            item = (key, got.meta, got.buf, got.buf.nbytes, version, int(info.get("priority") or 0),
                    float(info.get("expire_at") or 0.0))
            held.append((key, version))
            flags = tp.F_SINGLE if key in node.single else 0      # a NONE object stays one copy there too
            if info.get("tier") == Tier.SSD:
                flags |= (int(Tier.SSD) + 1) << tp.TIER_SHIFT       # and a cold one stays cold
            for m in targets:
                per_target[(m, flags)].append(item)
        stale: set[str] = set()
        for (m, flags), items in per_target.items():
            peer = router.peer(m)
            fail = self._failing.get(m)
            if fail is not None and time.monotonic() < fail[0]:
                failed.update(it[0] for it in items)
                continue
            try:
                if peer is None:
                    raise ClusterUnavailableError(f"member {m} left")
                t0 = time.monotonic()
                for it, status in zip(items, peer.mput(items, flags=flags)):
                    if status == tp.STALE:      # it holds something newer (or a delete): ours is outdated
                        stale.add(it[0])
                nbytes = sum(it[3] for it in items)
                self.sent += len(items)
                self.sent_bytes += nbytes
                if not self._burst[0]:
                    self._burst[2] = t0
                self._burst[0] += len(items)
                self._burst[1] += nbytes
                if fail is not None:
                    del self._failing[m]
                    self._why.pop(m, None)
                    log.info("forwarding to %s works again", m)
                if moves:                       # rebalancing yields to the application's traffic
                    time.sleep(max(0.0, nbytes / REBALANCE_RATE - (time.monotonic() - t0)))
            except (ClusterUnavailableError, tp.RemoteError, OSError) as e:
                now = time.monotonic()
                if fail is None:
                    fail = self._failing[m] = [0.0, RETRY_MIN_S, -RETRY_LOG_S]
                else:
                    fail[1] = min(RETRY_MAX_S, fail[1] * 2)
                fail[0] = now + fail[1]
                self._why[m] = str(e)
                if now - fail[2] >= RETRY_LOG_S:
                    fail[2] = now
                    log.info("forwarding %d objects to %s: %s (trying again, at most every %.1f s; "
                             "logged every %.0f s)", len(items), m, e, RETRY_MAX_S, RETRY_LOG_S)
                failed.update(it[0] for it in items)
        del per_target
        retry = []
        settled = node.member_id in router.members
        surplus = []
        for key, version in held:
            if key in failed:
                retry.append((key, version))
            elif key in stale:
                node.drop_if(key, version)      # an owner holds a newer one
            elif settled and _surplus(node, key):
                surplus.append((key, version))  # handed over: nothing stays on a member that no longer owns it
        node.rebalancer.drop_surplus(surplus)
        return retry
