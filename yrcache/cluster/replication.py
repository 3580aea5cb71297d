"""Routing, versions and replication for cluster mode.

- :class:`Clock`: a hybrid logical clock. Every write carries ``(hlc, writer)``;
  a replica applies a write only if its version is higher than the one it holds
  (or a tombstone it remembers), so replicas converge whatever order concurrent
  writes arrive in.
- :class:`Node`: a member's side of the data plane (a transport ``Handler``). It
  owns the versions of the objects in its arena: in cluster mode only the member
  process writes into the node's arena, so the versions live in its memory.
- :class:`Forwarder`: the member's background sender. It ships objects to the
  key's other owners (``ASYNC`` writes, hand-over after a membership change,
  re-replication after a member dies) and drops its own copy of an object it no
  longer owns once every owner holds it. Its queue is bounded; ``flush`` waits
  for it.
- :class:`Rebalancer`: after each membership change (and again a few seconds
  later), compares every local object's owners with what those owners hold
  (pipelined ``HAVE`` queries) and queues what is missing or misplaced.
- :class:`Router`: the client side, in every process of a cluster store: the
  ring, a pooled :class:`~yrcache.cluster.transport.Peer` per member, and
  put/get/delete/keys with fail-over to the next owner and, while objects move,
  to the other members.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .. import codec
from ..config import Tier, WriteMode
from ..errors import AuthenticationError, ClusterUnavailableError, StoreClosedError
from . import transport as tp
from .membership import MemberInfo
from .ring import Ring

if TYPE_CHECKING:
    from ..store import TieredStore

log = logging.getLogger("yrcache.cluster")

Version = tuple[int, int]
PARALLEL_BYTES = 1 << 20      # owners that each get more than this are sent to from threads
OWNERS_CACHE = 1 << 16        # keys whose owners are remembered until the ring changes
QUEUE_MAX = 100_000           # objects waiting to be forwarded before an ASYNC put blocks
TOMBSTONE_S = 60.0            # how long a delete's version is remembered
SETTLE_S = 3.0                # a membership change is checked again this much later
REPAIR_S = float(os.environ.get("YRCACHE_REPAIR_S") or 30.0)   # and every member checks this often
BATCH = 256                   # objects the forwarder ships per pipelined round
LINGER_S = 0.002              # how long it waits for a burst to fill a batch


class Clock:
    """A hybrid logical clock: milliseconds << 16 | a counter, never going back."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()
        self.writer = int.from_bytes(os.urandom(8), "little") >> 1

    def next(self) -> Version:
        with self._lock:
            self._last = max(int(time.time() * 1000) << 16, self._last + 1)
            return self._last, self.writer

    def observe(self, hlc: int) -> None:
        with self._lock:
            if hlc > self._last:
                self._last = hlc


@functools.lru_cache(maxsize=4096)
def _wire_nbytes(meta: bytes) -> int | None:
    if meta[:1] == b"P":
        raise ValueError("pickled objects never travel between members; store bytes, arrays or tensors")
    return codec.payload_nbytes(meta)


def check_wire_meta(meta: bytes, nbytes: int) -> None:
    """Refuse a header that is pickled, unreadable or disagrees with the payload size."""
    want = _wire_nbytes(meta)
    if want is not None and want != nbytes:
        raise ValueError(f"header {meta[:60]!r} says {want} bytes, the frame carries {nbytes}")


def decode(meta: bytes, buf: Any, nbytes: int) -> Any:
    """A value over a received buffer (read-only, like a local view)."""
    return codec.decoder(meta)(memoryview(buf).toreadonly(), nbytes)


# ---- the member side -------------------------------------------------------------------
class Node(tp.Handler):
    """The data-plane handler of one member: applies versioned writes to the local arena."""

    def __init__(self, local: TieredStore, member_id: str, router: Router):
        self.local = local
        self.member_id = member_id
        self.router = router
        self.versions: dict[str, Version] = {}
        self.tombs: dict[str, tuple[Version, float]] = {}
        self.single: set[str] = set()        # WriteMode.NONE objects: one copy, on their first owner
        self._locks = [threading.Lock() for _ in range(64)]
        self.forwarder = Forwarder(self)
        self.rebalancer = Rebalancer(self)

    def close(self) -> None:
        self.rebalancer.close()
        self.forwarder.close()

    def lock(self, key: str) -> threading.Lock:
        return self._locks[hash(key) & 63]

    def owners(self, key: str) -> list[str]:
        """Who should hold our copy of ``key``: one member for a ``NONE`` object."""
        return self.router.owners(key, 1 if key in self.single else None)

    def current(self, key: str) -> Version | None:
        v = self.versions.get(key)
        if v is None:
            t = self.tombs.get(key)
            return t[0] if t is not None else None
        return v

    def apply(self, key: str, meta: bytes, nbytes: int, fill: Any, version: Version,
              priority: int, expire_at: float, skip: Callable[[], None] | None = None, flags: int = 0) -> int:
        """Store ``key`` at ``version`` unless this member holds a newer one; ``fill``
        is the payload (a buffer) or a callable that writes it (``put_with``);
        ``flags``: the frame's (single copy, tier hint)."""
        with self.lock(key):
            cur = self.current(key)
            if cur is not None and version <= cur:
                if skip is not None:
                    skip()
                return tp.STALE
            ttl = None if not expire_at else max(expire_at - time.time(), 1e-3)
            t = (flags >> tp.TIER_SHIFT) & 7
            self.local.put_with(key, meta, nbytes, fill, priority=priority, ttl=ttl,
                                tier=Tier(t - 1) if t else None)
            self.versions[key] = version
            self.tombs.pop(key, None)
            if flags & tp.F_SINGLE:
                self.single.add(key)
            else:
                self.single.discard(key)
        self.router.clock.observe(version[0])
        return tp.OK

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
        value = self.local.get(key)
        if value is None:
            return None
        meta, payload, nbytes = codec.encode(value)
        view = memoryview(payload).cast("B") if nbytes else memoryview(b"")
        if offset or length < nbytes:
            view = view[offset:offset + length]
        tier = int(self.local.tier_of(key)) if length == 0 else -1
        return tp.Got(meta, view, self.versions.get(key, (0, 0)), tier)

    # -- transport.Handler
    def put(self, f: tp.Frame, fill: Any, skip: Callable[[], None]) -> int:
        check_wire_meta(f.meta, f.plen)
        status = self.apply(f.key, f.meta, f.plen, fill, f.version, f.priority, f.expire_at, skip, f.flags)
        if status == tp.OK and f.flags & tp.F_REPLICATE:
            self.forwarder.add(f.key, f.version)
        return status

    def get(self, f: tp.Frame):
        return self.read(f.key, f.offset, f.length)

    def get_many(self, keys: list[str]) -> list[tp.Got | None]:
        out: list[tp.Got | None] = []
        versions = self.versions
        for k, value in zip(keys, self.local.mget(keys)):
            if value is None:
                out.append(None)
                continue
            meta, payload, nbytes = codec.encode(value)
            out.append(tp.Got(meta, memoryview(payload).cast("B") if nbytes else memoryview(b""),
                              versions.get(k, (0, 0))))
        return out

    def delete(self, f: tp.Frame) -> int:
        return self.remove(f.key, f.version)

    def keys(self, prefix: str) -> list[tuple[str, Version]]:
        return [(k, self.versions.get(k, (0, 0))) for k in self.local.keys(prefix)]

    def have(self, entries: list[tuple[str, Version]]) -> bytes:
        out = bytearray(len(entries))
        for i, (k, v) in enumerate(entries):
            cur = self.versions.get(k)
            out[i] = cur is not None and cur >= v and k in self.local
        return bytes(out)

    def stat(self) -> bytes:
        st = self.local.stats()
        return json.dumps({"member": self.member_id, "objects": len(self.versions),
                           "bytes": sum(t.get("used", 0) for t in st["tiers"].values()), "store": st,
                           "pending": self.forwarder.pending(),
                           "under_replicated": self.rebalancer.under_replicated}).encode()

    def flush(self, timeout: float) -> bool:
        return self.forwarder.wait(timeout)


class Forwarder:
    """Ships local objects to the owners that lack them, one thread, bounded queue."""

    def __init__(self, node: Node):
        self.node = node
        self._q: collections.OrderedDict[str, tuple[Version, tuple[str, ...] | None]] = collections.OrderedDict()
        self._cv = threading.Condition()
        self._busy = 0
        self._stop = False
        self.sent = 0
        self.sent_bytes = 0
        self._thread = threading.Thread(target=self._loop, name="yrcache-forward", daemon=True)
        self._thread.start()

    def add(self, key: str, version: Version, targets: tuple[str, ...] | None = None, block: bool = True) -> None:
        """Queue ``key``: send ``version`` to ``targets`` (default: its other owners)."""
        with self._cv:
            while block and len(self._q) >= QUEUE_MAX and not self._stop:
                self._cv.wait(0.1)
            self._q[key] = (version, targets)
            self._q.move_to_end(key)
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                if len(self._q) < BATCH:
                    self._cv.wait(LINGER_S)       # let a burst of writes gather into one batch
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
                    if not self._stop and k not in self._q:
                        self._q[k] = (v, None)
                self._cv.notify_all()
            if retry:
                time.sleep(0.05)

    def _send(self, batch: list[tuple[str, tuple[Version, tuple[str, ...] | None]]]) -> list[tuple[str, Version]]:
        """Ship a batch, pipelined per target member; return what must be tried again."""
        node, router = self.node, self.node.router
        per_target: dict[str, list] = collections.defaultdict(list)
        held = []
        for key, (version, targets) in batch:
            if node.versions.get(key) != version:
                continue                    # replaced or deleted since: that write forwards itself
            got = node.read(key)
            if got is None:
                continue
            if targets is None:
                targets = tuple(o for o in node.owners(key) if o != node.member_id)
            info = node.local.info(key) or {}
            item = (key, got.meta, got.buf, got.buf.nbytes, version, int(info.get("priority") or 0),
                    float(info.get("expire_at") or 0.0))
            held.append((key, version, targets))
            for m in targets:
                per_target[m].append(item)
        failed: set[str] = set()
        stale: set[str] = set()
        for m, items in per_target.items():
            peer = router.peer(m)
            try:
                if peer is None:
                    raise ClusterUnavailableError(f"member {m} left")
                for it, status in zip(items, peer.mput(items)):
                    if status == tp.STALE:      # it holds something newer (or a delete): ours is outdated
                        stale.add(it[0])
                self.sent += len(items)
                self.sent_bytes += sum(it[3] for it in items)
            except (ClusterUnavailableError, tp.RemoteError, OSError) as e:
                log.info("forwarding %d objects to %s: %s (will retry)", len(items), m, e)
                failed.update(it[0] for it in items)
        del per_target
        retry = []
        for key, version, _ in held:
            if key in failed:
                retry.append((key, version))
            elif key in stale or node.member_id not in node.owners(key):
                node.drop_if(key, version)      # handed over: nothing stays on a member that no longer owns it
        return retry


class Rebalancer:
    """Finds local objects whose owners lack them (after joins, leaves and deaths)."""

    def __init__(self, node: Node):
        self.node = node
        self._due: float | None = time.monotonic()
        self._cv = threading.Condition()
        self._stop = False
        self.passes = 0
        self.under_replicated = 0
        self._thread = threading.Thread(target=self._loop, name="yrcache-rebalance", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        with self._cv:
            self._due = time.monotonic()
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (self._due is None or self._due > time.monotonic()):
                    self._cv.wait(None if self._due is None else max(0.0, self._due - time.monotonic()))
                if self._stop:
                    return
                self._due = None
            try:
                again = self.run_pass()
            except StoreClosedError:
                return
            except Exception as e:      # noqa: BLE001 - logged, tried again
                log.warning("rebalancing pass failed: %s", e)
                again = True
            with self._cv:
                if self._due is None:       # also a periodic pass: repairs what a failed write missed
                    self._due = time.monotonic() + (SETTLE_S if again else REPAIR_S)

    def run_pass(self) -> bool:
        """One pass over the local objects; True if something still needs doing."""
        node, router = self.node, self.node.router
        me = node.member_id
        want: dict[str, list[tuple[str, Version]]] = collections.defaultdict(list)
        mine = [(k, v) for k, v in list(node.versions.items())]
        for k, v in mine:
            for o in node.owners(k):
                if o != me:
                    want[o].append((k, v))
        missing: dict[str, list[str]] = collections.defaultdict(list)
        incomplete = False
        for m, entries in want.items():
            peer = router.peer(m)
            if peer is None:
                incomplete = True
                continue
            for i in range(0, len(entries), 2000):
                chunk = entries[i:i + 2000]
                try:
                    bits = peer.have(chunk)
                except (ClusterUnavailableError, tp.RemoteError, OSError):
                    incomplete = True
                    break
                for (k, _), b in zip(chunk, bits):
                    if not b:
                        missing[k].append(m)
        moved = 0
        for k, v in mine:
            owners = node.owners(k)
            targets = tuple(missing.get(k, ()))
            if targets:
                node.forwarder.add(k, v, targets)
                moved += 1
            elif me not in owners and not incomplete:
                node.drop_if(k, v)           # every owner has it: our copy is surplus
        self.under_replicated = moved
        self.passes += 1
        if moved:
            log.info("rebalancing: %d of %d objects queued for their owners", moved, len(mine))
        return incomplete or bool(moved)


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=8, thread_name_prefix="yrcache-send"))
    return _POOL[0]


# ---- the client side -------------------------------------------------------------------
class Router:
    """Where a key lives and how to reach it, for every process of a cluster store."""

    def __init__(self, replicas: int, token: bytes | None, member_id: str | None = None):
        self.replicas = replicas
        self.token = token
        self.member_id = member_id          # this node's member (ours or the one we attach to)
        self.node: Node | None = None       # set in the member process
        self.clock = Clock()
        self.ring = Ring()
        self._owners: dict[str, list[str]] = {}
        self.members: dict[str, MemberInfo] = {}
        self._peers: dict[str, tp.Peer] = {}
        self._lock = threading.Lock()
        self.changed = threading.Event()
        self.on_change: list[Callable[[], None]] = []

    def update(self, members: dict[str, MemberInfo]) -> None:
        with self._lock:
            old = set(self.members)
            self.members = dict(members)
            self.ring = Ring(sorted(members))
            self._owners = {}
            for mid, p in list(self._peers.items()):
                info = members.get(mid)
                if info is None or info.address != p.address:
                    p.close()
                    del self._peers[mid]
        if set(members) != old:
            log.info("members: %s", ", ".join(sorted(members)) or "none")
            self.changed.set()
            for cb in self.on_change:
                cb()

    def close(self) -> None:
        with self._lock:
            for p in self._peers.values():
                p.close()
            self._peers.clear()

    def owners(self, key: str, r: int | None = None) -> list[str]:
        """The members that own ``key`` (``r``: how many; default ``replicas``). The
        default answer is cached until the ring changes: do not mutate it."""
        cache = self._owners          # read before the ring: update() replaces the ring first
        if r is None:
            got = cache.get(key)
            if got is not None:
                return got
        ring = self.ring
        n = len(ring)
        if not n:
            return []
        out = ring.owners(key, min(r or self.replicas, n))
        if r is None:
            if len(cache) >= OWNERS_CACHE:
                cache.clear()
            cache[key] = out
        return out

    def peer(self, member_id: str) -> tp.Peer | None:
        with self._lock:
            p = self._peers.get(member_id)
            if p is None:
                info = self.members.get(member_id)
                if info is None:
                    return None
                p = self._peers[member_id] = tp.Peer(info.address, self.token, name=member_id)
            return p

    def _need_members(self) -> list[str]:
        if not len(self.ring):
            raise ClusterUnavailableError(
                "the cluster has no members yet: start one with `yrcache node` (same YRCACHE_ETCD "
                "and YRCACHE_CLUSTER), or check that etcd is reachable")
        return list(self.ring.members)

    # -- writes
    def put_to(self, member: str, key: str, meta: bytes, payload: Any, nbytes: int, version: Version,
               priority: int, expire_at: float, flags: int = 0, timeout: float | None = None) -> int:
        node = self.node
        if node is not None and member == node.member_id:
            status = node.apply(key, meta, nbytes, payload, version, priority, expire_at, flags=flags)
            if status == tp.OK and flags & tp.F_REPLICATE:
                node.forwarder.add(key, version)
            return status
        peer = self.peer(member)
        if peer is None:
            raise ClusterUnavailableError(f"member {member} left the cluster")
        return peer.put(key, meta, payload, nbytes, version, priority=priority, expire_at=expire_at,
                        flags=flags, timeout=timeout)

    def targets(self, key: str, mode: WriteMode) -> tuple[list[str], int]:
        """Where a write goes first and the frame flags that say what follows."""
        if mode is WriteMode.ASYNC:
            return [self.member_id if self.member_id in self.members else self.owners(key)[0]], tp.F_REPLICATE
        if mode is WriteMode.NONE:
            return self.owners(key, 1), tp.F_SINGLE
        return self.owners(key), 0

    def put(self, key: str, meta: bytes, payload: Any, nbytes: int, priority: int, expire_at: float,
            mode: WriteMode, timeout: float | None, tier: Tier | None = None) -> None:
        self._need_members()
        owners, flags = self.targets(key, mode)
        if tier is not None:
            flags |= (int(tier) + 1) << tp.TIER_SHIFT
        item = (key, meta, payload, nbytes, self.clock.next(), priority, expire_at)
        failed = self.fan_out({m: [item] for m in owners}, flags, timeout)
        if failed:
            rest = ("the others hold it and it is copied to the rest when the member set settles"
                    if len(failed) < len(owners) else "nobody holds it: put it again")
            raise ClusterUnavailableError(
                f"put {key!r}: {len(failed)} of {len(owners)} owners did not take the write "
                f"({'; '.join(failed)}); {rest}")

    def fan_out(self, per_member: dict[str, list], flags: int, timeout: float | None) -> list[str]:
        """Send each member its pipeline of puts at once, then collect the replies
        (one round trip for all owners); this member's own share is applied while
        the others work. Returns ``"member (why)"`` for each member that failed."""
        node = self.node
        failed: list[str] = []
        sent: list[tuple[str, tp.Peer, tp.Conn, list[int]]] = []
        big = [m for m, items in per_member.items() if sum(it[3] for it in items) > PARALLEL_BYTES]
        if len(big) > 1:                    # large payloads: one sending thread per member
            pool = _pool()
            futs = {m: pool.submit(self._put_items, m, items, flags, timeout) for m, items in per_member.items()}
            return [err for f in futs.values() if (err := f.result())]
        for m, items in per_member.items():
            if node is not None and m == node.member_id:
                continue
            peer = self.peer(m)
            if peer is None:
                failed.append(f"{m} (left the cluster)")
                continue
            try:
                c = peer.borrow(timeout)
            except AuthenticationError:
                raise
            except (ClusterUnavailableError, OSError) as e:
                failed.append(f"{m} ({peer.error(e, timeout)})")
                continue
            try:
                frames = tp.send_puts(c, items, flags)
            except (ConnectionError, OSError):
                c.sock.close()
                err = self._put_items(m, items, flags, timeout)   # a stale pooled connection: once more
                if err:
                    failed.append(err)
                continue
            sent.append((m, peer, c, frames))
        if node is not None and node.member_id in per_member:
            try:
                err = self._put_items(node.member_id, per_member[node.member_id], flags, timeout)
            except Exception as e:      # noqa: BLE001 - the remote replies are still to be read
                err = f"{node.member_id} ({type(e).__name__}: {e})"
            if err:
                failed.append(err)
        for m, peer, c, frames in sent:
            try:
                tp.recv_puts(c, frames)
                peer.give_back(c)
            except tp.RemoteError as e:         # the rest of its replies are unread: drop the connection
                c.sock.close()
                failed.append(f"{m} ({e})")
            except (ConnectionError, OSError) as e:
                c.sock.close()
                failed.append(f"{m} ({peer.error(e, timeout)})")
        return failed

    def _put_items(self, m: str, items: list, flags: int, timeout: float | None) -> str | None:
        node = self.node
        try:
            if node is not None and m == node.member_id:
                for key, meta, payload, nbytes, version, priority, expire_at in items:
                    self.put_to(m, key, meta, payload, nbytes, version, priority, expire_at, flags)
                return None
            peer = self.peer(m)
            if peer is None:
                return f"{m} (left the cluster)"
            peer.mput(items, flags=flags, timeout=timeout)
        except (ClusterUnavailableError, tp.RemoteError) as e:
            return f"{m} ({e})"
        return None

    def mread(self, per_member: dict[str, list[str]]) -> dict[str, tp.Got | None]:
        """Pipelined reads from several members at once (requests out first, then replies);
        a key a member does not answer for maps to None (the caller fails over)."""
        out: dict[str, tp.Got | None] = {}
        sent = []
        for m, keys in per_member.items():
            peer = self.peer(m)
            if peer is None:
                continue
            keys = keys[:tp.MAX_BATCH]          # the rest fail over one by one
            try:
                c = peer.borrow()
                c.send_mget(keys)
            except (ClusterUnavailableError, OSError):
                continue
            sent.append((peer, c, keys))
        for peer, c, keys in sent:
            try:
                for k, g in zip(keys, c.recv_mget(len(keys))):
                    out[k] = g
                peer.give_back(c)
            except (ConnectionError, OSError, tp.RemoteError):
                c.sock.close()
        return out

    def delete(self, key: str) -> bool:
        version = self.clock.next()
        found = False
        for m in self._need_members():
            node = self.node
            try:
                if node is not None and m == node.member_id:
                    found |= node.remove(key, version) == tp.OK
                else:
                    peer = self.peer(m)
                    if peer is not None:
                        found |= peer.delete(key, version)
            except ClusterUnavailableError:
                pass
        return found

    # -- reads
    def read(self, key: str, offset: int = 0, length: int = tp.ALL, skip: str | None = None,
             into: Callable[[bytes, int], Any] | None = None) -> tp.Got | None:
        """Fetch ``key`` from its owners, then (while objects move) from the other members."""
        owners = self.owners(key)
        others = [m for m in self.ring.members if m not in owners]
        errors = []
        for m in owners + others:
            if m == skip:
                continue
            node = self.node
            try:
                if node is not None and m == node.member_id:
                    got = node.read(key, offset, length)
                else:
                    peer = self.peer(m)
                    got = peer.get(key, offset, length, into=into) if peer is not None else None
            except ClusterUnavailableError as e:
                if m in owners:
                    errors.append(f"{m}: {e}")
                continue
            if got is not None:
                return got
        if owners and len(errors) >= len([m for m in owners if m != skip]) > 0:
            raise ClusterUnavailableError(f"get {key!r}: no owner answered ({'; '.join(errors)})")
        return None

    def keys(self, prefix: str) -> set[str]:
        out: set[str] = set()
        for m in self._need_members():
            node = self.node
            if node is not None and m == node.member_id:
                out.update(k for k, _ in node.keys(prefix))
                continue
            peer = self.peer(m)
            if peer is None:
                continue
            try:
                out.update(k for k, _ in peer.keys(prefix))
            except ClusterUnavailableError:
                continue
        return out

    def stats(self) -> list[dict]:
        out = []
        for m in sorted(self.members):
            node = self.node
            try:
                if node is not None and m == node.member_id:
                    out.append(json.loads(node.stat()))
                else:
                    peer = self.peer(m)
                    if peer is not None:
                        out.append(json.loads(peer.stat()))
            except (ClusterUnavailableError, ValueError) as e:
                out.append({"member": m, "error": str(e)})
        return out

    def flush(self, timeout: float = 60.0) -> bool:
        ok = True
        for m in list(self.members):
            node = self.node
            if node is not None and m == node.member_id:
                ok &= node.forwarder.wait(timeout)
                continue
            peer = self.peer(m)
            if peer is not None:
                try:
                    ok &= peer.flush(timeout)
                except ClusterUnavailableError:
                    ok = False
        return ok


def group(keys: Iterable[str], owner: Callable[[str], str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    for k in keys:
        out[owner(k)].append(k)
    return out
