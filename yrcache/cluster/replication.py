"""Routing, versions and replication for cluster mode.

- ``Clock`` (``yrcache._fast.Clock``, in C): a hybrid logical clock, microseconds
  << 8 | a counter, never going back. Every write carries ``(hlc, writer)``; a
  replica applies a write only if its version is higher than the one it holds (or
  a tombstone it remembers), so replicas converge whatever order concurrent writes
  arrive in.
- the member side (``Node``, ``Forwarder``, ``Rebalancer``) is in ``member.py``.
- :class:`Router`: the client side, in every process of a cluster store: the
  ring, a pooled :class:`~yrcache.cluster.transport.Peer` per member, and
  put/get/delete/keys with fail-over to the next owner and, while objects move,
  to the other members.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from .. import _fast, codec
from ..config import Tier, WriteMode
from ..errors import ClusterUnavailableError
from ..sizes import env_size
from . import transport as tp
from .membership import MemberInfo
from .fanout import FanOut
from .ranged import RangedReads
from .peer import AWAIT_MAX, POLL_NS
from .ring import Ring
from .settings import env_seconds, read_at_import

if TYPE_CHECKING:
    from .member import Node

log = logging.getLogger("yrcache.cluster")

Version = tuple[int, int]
OWNERS_CACHE = 1 << 16        # keys whose owners are remembered until the ring changes
QUEUE_MAX = 100_000           # objects waiting to be forwarded before an ASYNC put blocks
TOMBSTONE_S = 60.0            # how long a delete's version is remembered
SETTLE_S = 3.0                # a membership change is checked again this much later
REPAIR_S = read_at_import(env_seconds, "YRCACHE_REPAIR_S", 30.0, True)   # and every member checks this often
REBALANCE_RATE = read_at_import(env_size, "YRCACHE_REBALANCE_RATE", 1 << 30, 1)   # bytes/s of moves
BATCH = 256                   # objects the forwarder ships per pipelined round
LINGER_S = 0.002              # how long it waits for a burst to fill a batch
IDLE_S = 1.0                  # with nothing to send this long, it sleeps until a write wakes it
FLUSH_POLL_S = 0.2            # flush() asks a member that does not answer again this often
FLUSH_SLACK_S = 0.5           # and waits this much past its timeout for the answers
MOVING_S = 10.0               # after a member-set change, a read that finds nothing asks again


Clock = _fast.Clock   # the hybrid logical clock, in C (_csrc/fast_own.c): OwnPuts reads it in the same call


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
    """A value over a received (private) buffer: read-only like a local view, except a
    tensor, which torch needs writable (as the embedded store's small tensors)."""
    if meta == b"B":                # bytes: what codec.decoder gives, without its lookups
        return memoryview(buf).toreadonly()
    view = memoryview(buf)
    return codec.decoder(meta)(view if meta[:1] == b"T" else view.toreadonly(), nbytes)


def _first(owners: list[str], skip: str | None, late: frozenset[str] = frozenset()) -> str | None:
    """The owner a read asks first: the first one, unless it is ``skip`` (asked locally)
    or ``late`` (catching up after etcd dropped it)."""
    for m in owners[:2]:
        if m != skip and m not in late:
            return m
    return None


_POOL: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's pool (a forked child's copy of its parent's has no threads)."""
    pool = _POOL.get(os.getpid())
    if pool is None:
        _POOL.clear()
        pool = _POOL[os.getpid()] = ThreadPoolExecutor(max_workers=8, thread_name_prefix="yrcache-send")
    return pool


# ---- the client side -------------------------------------------------------------------
class Router(RangedReads, FanOut):
    """Where a key lives and how to reach it, for every process of a cluster store."""

    pool = staticmethod(_pool)          # the sending threads (RangedReads reads with them too)

    def __init__(self, replicas: int, token: bytes | None, member_id: str | None = None):
        self.replicas = replicas
        self.token = token
        self.member_id = member_id          # this node's member (ours or the one we attach to)
        self.node: Node | None = None       # set in the member process
        self.clock = Clock()
        self.ring = Ring()
        self._owners: dict[str, list[str]] = {}
        self.members: dict[str, MemberInfo] = {}
        #: Members catching up after etcd dropped them (``MemberInfo.catching_up``): their
        #: copies of keys written meanwhile may be old, so every read asks them last.
        self.late: frozenset[str] = frozenset()
        self._peers: dict[str, tp.Peer] = {}
        self._lock = threading.Lock()
        self.on_change: list[Callable[[], None]] = []
        self.changes = 0                    # member-set changes seen (a member left, joined or restarted)
        self.moved_at = -MOVING_S           # when the member set last changed (``moving``)

    def update(self, members: dict[str, MemberInfo]) -> None:
        with self._lock:
            old = {m: i.epoch for m, i in self.members.items()}
            self.members = dict(members)
            self.late = frozenset(m for m, i in members.items() if i.catching_up)
            if self.node is not None and self.node.own is not None:
                self.node.own.active = self.node.member_id in members
            self.ring = Ring(sorted(members))
            self._owners = {}
            for mid, p in list(self._peers.items()):
                info = members.get(mid)
                if info is None or info.address != p.address:
                    p.close()
                    del self._peers[mid]
        if {m: i.epoch for m, i in members.items()} != old:     # a member restarted counts too
            self.changes += 1
            if set(members) != set(old):
                if old:                     # (not a process's first listing)
                    self.moved_at = time.monotonic()
                log.info("members: %s", ", ".join(sorted(members)) or "none")
            for cb in self.on_change:
                cb()

    def forked(self) -> None:
        """In a forked child: pooled connections of its own (a socket shared with the parent
        would interleave two processes' frames) and a writer id of its own (two writers with
        one id could give two different writes the same version); versions still rise."""
        self._lock = threading.Lock()
        self._peers = {}
        self.on_change = []
        clock = Clock()
        clock.observe(self.clock.last)
        self.clock = clock

    def close(self) -> None:
        with self._lock:
            for p in self._peers.values():
                p.close("this store was closed")
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

    def moving(self) -> bool:
        """Whether objects may be moving between members: the member set changed less than
        ``MOVING_S`` ago. A read that found a key nowhere then asks every member once more:
        a hand-over can take it from a member not yet asked to one already asked."""
        return time.monotonic() - self.moved_at < MOVING_S

    def reads_here(self) -> bool:
        """Whether this process may read its node's arena in place: its member is in the
        ring and not catching up (its copies are the cluster's current ones)."""
        return self.member_id in self.members and self.member_id not in self.late

    def asked_here(self, local: bool) -> str | None:
        """The member a read of a process with a ``local`` arena skips because it read that
        arena in place (see ``reads_here``), or None."""
        return self.member_id if local and self.reads_here() else None

    def last_late(self, members: Iterable[str]) -> list[str]:
        """``members`` in their order, those catching up moved to the end."""
        late = self.late
        out = list(members)
        return out if not late else sorted(out, key=late.__contains__)

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

    def put_local_async(self, key: str, put: Callable[[str, Any], None], value: Any) -> bool:
        """An ``ASYNC`` put of this member's own: ``put(key, value)`` into the local store
        under the key's lock (unless it holds a newer version), then queued for the other
        owners. False when this process is not a member of the ring now (the caller sends it)."""
        node = self.node
        if node is None or node.member_id not in self.members:
            return False
        version = self.clock.next()
        if node.apply_with(key, put, value, version):
            node.forwarder.add(key, version)
        return True

    def put(self, key: str, meta: bytes, payload: Any, nbytes: int, priority: int, expire_at: float,
            mode: WriteMode, timeout: float | None, tier: Tier | None = None) -> None:
        node = self.node
        tflags = (int(tier) + 1) << tp.TIER_SHIFT if tier is not None else 0
        if mode is WriteMode.ASYNC and node is not None and node.member_id in self.members:
            # the common hybrid case, kept short: into our own arena, then queued
            version = self.clock.next()
            if node.apply(key, meta, nbytes, payload, version, priority, expire_at, flags=tflags) == tp.OK:
                node.forwarder.add(key, version)
            return
        self._need_members()
        owners, flags = self.targets(key, mode)
        flags |= tflags
        items = [(key, meta, payload, nbytes, self.clock.next(), priority, expire_at)]
        failed = self.fan_out(dict.fromkeys(owners, items), flags, timeout)
        if failed:
            rest = ("the others hold it and it is copied to the rest when the member set settles"
                    if len(failed) < len(owners) else "nobody holds it: put it again")
            raise ClusterUnavailableError(
                f"put {key!r}: {len(failed)} of {len(owners)} owners did not take the write "
                f"({'; '.join(failed)}); {rest}")

    def mread(self, per_member: dict[str, list[str]]) -> tuple[dict[str, tp.Got | None], set[str]]:
        """Pipelined reads from several members at once (every request out first, then the
        replies): ``({key: Got or None}, members that did not answer)``; a key only a
        silent member was asked for is absent from the first."""
        out: dict[str, tp.Got | None] = {}
        failed: set[str] = set()
        sent = []
        for m, keys in per_member.items():
            peer = self.peer(m)
            if peer is None:
                failed.add(m)
                continue
            chunks = [keys[i:i + tp.MAX_BATCH] for i in range(0, len(keys), tp.MAX_BATCH)]
            try:
                c = peer.borrow()
                for chunk in chunks:
                    c.send_mget(chunk)
            except (ClusterUnavailableError, OSError):
                failed.add(m)
                continue
            sent.append((m, peer, c, chunks))
        late = _fast.await_replies(tuple(c.sock.fileno() for _, _, c, _ in sent), POLL_NS,
                                   tuple(c.timeout_ms for _, _, c, _ in sent), tp.MGET) if 0 < len(sent) <= AWAIT_MAX else None
        for j, (m, peer, c, chunks) in enumerate(sent):
            if late and j in late:              # silent for the whole timeout: not waited for again
                c.sock.close()
                failed.add(m)
                continue
            try:
                got: dict[str, tp.Got | None] = {}
                for chunk in chunks:
                    got.update(zip(chunk, c.recv_mget(len(chunk))))
                peer.give_back(c)
            except (ConnectionError, OSError, tp.RemoteError):
                c.sock.close()
                failed.add(m)
                continue
            for k, g in got.items():        # held by several: the newest (see ``read``)
                if g is not None and ((o := out.get(k)) is None or g.version > o.version):
                    out[k] = g
        return out, failed

    def mread_all(self, keys: list[str], skip: str | None = None) -> dict[str, tp.Got | None]:
        """Read ``keys`` the way ``read`` reads one: from each key's first owner (one
        batch per member), then what they lacked from every member at once (the second
        owners, or wherever a hand-over left it), so a batch of misses costs two
        round trips, not one per key and member. A key whose owners all failed to
        answer is read once more on its own (``read`` raises if they still do not)."""
        first: dict[str, list[str]] = {}
        owners_of: dict[str, list[str]] = {}
        late = self.late
        for k in keys:
            owners = owners_of[k] = self.owners(k)
            for m in owners:                  # a member this batch asks anyway: fewer round trips
                if m in first and m != skip and m not in late:
                    first[m].append(k)
                    break
            else:
                owner = _first(owners, skip, late)
                if owner is not None:
                    first.setdefault(owner, []).append(k)
        out, failed = self.mread(first)
        rest = [k for k in keys if out.get(k) is None]
        if rest:        # every member, those just asked too: a hand-over may have moved a key there since
            ask = self.last_late(m for m in self.ring.members if m != skip and m not in failed)
            got, failed2 = self.mread(dict.fromkeys(ask, rest))
            if self.moving() and (gone := [k for k in rest if got.get(k) is None]):
                again, failed3 = self.mread(dict.fromkeys([m for m in ask if m not in failed2], gone))
                got.update((k, g) for k, g in again.items() if g is not None)
                failed2 |= failed3
            failed |= failed2
            for k in rest:
                out[k] = got.get(k)
                if out[k] is None and owners_of[k] and all(o in failed for o in owners_of[k]):
                    out[k] = self.read(k, skip=skip)
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

    def delete_many(self, keys: list[str]) -> int:
        """Delete ``keys`` from every member: one pipelined batch per member, the members in
        parallel; how many keys some member held."""
        version = self.clock.next()
        found = [False] * len(keys)

        def one(m: str) -> list[bool]:
            node = self.node
            if node is not None and m == node.member_id:
                return [node.remove(k, version) == tp.OK for k in keys]
            peer = self.peer(m)
            out: list[bool] = []
            for i in range(0, len(keys), tp.MAX_BATCH):
                out += peer.delete_many(keys[i:i + tp.MAX_BATCH], version) if peer is not None \
                    else [False] * len(keys[i:i + tp.MAX_BATCH])
            return out
        futures = [_pool().submit(one, m) for m in self._need_members()]
        for f in futures:
            try:
                found = [a or b for a, b in zip(found, f.result())]
            except ClusterUnavailableError:
                pass
        return sum(found)

    # -- reads
    def read(self, key: str, offset: int = 0, length: int = tp.ALL, skip: str | None = None,
             into: Callable[[bytes, int], Any] | None = None) -> tp.Got | None:
        """Fetch ``key`` from its first owner; if it lacks the key, ask every member at once
        (a probe of length 0: the second owners, or wherever a hand-over left or just moved
        it) and read it from the one that holds the newest version (the first, in owner
        order, of equals). A miss costs two round trips, whatever the number of members."""
        owners = self.owners(key)
        errors: list[str] = []
        first = _first(owners, skip, self.late)
        if first is not None:
            got = self._read_from(first, key, offset, length, into, owners, errors)
            if got is not None:
                return got
        # ``first`` again too (unless it failed): a hand-over may have moved the key there since.
        rest = self.last_late(m for m in itertools.chain(owners, (m for m in self.ring.members if m not in owners))
                              if m != skip and not (m == first and errors))
        probes = self._probe(rest, key, owners, errors)
        if not any(probes.values()) and self.moving():      # (it may have been on its way between two)
            probes = self._probe(rest, key, owners, errors)
        # The newest copy: a member back after etcd dropped it (asked last) may be the one
        # that takes a key's writes now while another still holds the copy it took meanwhile.
        hits = [(m, g) for m in rest if (g := probes.get(m)) is not None]
        for m, hit in sorted(hits, key=lambda h: h[1].version, reverse=True):
            if length == 0:
                return hit
            got = self._read_from(m, key, offset, length, into, owners, errors)
            if got is not None:
                return got
        if owners and errors and len(errors) >= len(owners):   # (a skipped owner was asked locally)
            raise ClusterUnavailableError(f"get {key!r}: no owner answered ({'; '.join(errors)})")
        return None

    def _read_from(self, m: str, key: str, offset: int, length: int, into: Callable[[bytes, int], Any] | None,
                   owners: list[str], errors: list[str]) -> tp.Got | None:
        """``key`` from member ``m`` (this process's own node in place), or None; an owner
        that does not answer is noted in ``errors``."""
        node = self.node
        try:
            if node is not None and m == node.member_id:
                return node.read(key, offset, length)
            peer = self.peer(m)
            return peer.get(key, offset, length, into=into) if peer is not None else None
        except ClusterUnavailableError as e:
            if m in owners:
                errors.append(f"{m}: {e}")
            return None

    def _probe(self, members: list[str], key: str, owners: list[str], errors: list[str]) -> dict[str, tp.Got | None]:
        """Ask ``members`` at once whether they hold ``key`` (a read of length 0 each:
        every request out, then every reply)."""
        out: dict[str, tp.Got | None] = {}
        sent = []
        node = self.node
        for m in members:
            if node is not None and m == node.member_id:
                out[m] = node.read(key, 0, 0)
                continue
            peer = self.peer(m)
            if peer is None:
                continue
            try:
                c = peer.borrow()
                c.sock.sendall(tp.pack(tp.GET, key.encode(), offset=0, length=0))
            except (ClusterUnavailableError, OSError) as e:
                if m in owners:
                    errors.append(f"{m}: {peer.error(e)}")
                continue
            sent.append((m, peer, c))
        for m, peer, c in sent:
            try:
                out[m] = c.recv_get()
                peer.give_back(c)
            except (ConnectionError, OSError, tp.RemoteError) as e:
                c.sock.close()
                if m in owners:
                    errors.append(f"{m}: {peer.error(e)}")
        return out

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

    def flush(self, timeout: float = 60.0) -> list[str]:
        """Wait until every member has forwarded what it queued, for up to ``timeout``
        seconds: the members are asked at once, and one that does not answer is asked again
        until it answers or leaves the ring (its lease). What stopped it: one line per
        member that did not finish."""
        deadline, node = time.monotonic() + timeout, self.node
        while True:
            asks = {}
            for m in list(self.members):
                rest = max(0.0, deadline - time.monotonic())
                if node is not None and m == node.member_id:
                    asks[m] = _pool().submit(lambda t: None if node.forwarder.wait(t) else node.stuck(), rest)
                elif (peer := self.peer(m)) is not None:      # (one that left: nothing to wait for)
                    asks[m] = _pool().submit(peer.flush, rest)
            done, _ = wait(asks.values(), timeout=max(0.0, deadline - time.monotonic()) + FLUSH_SLACK_S)
            left = []
            for m, ask in asks.items():
                if ask not in done:
                    left.append(f"{m} does not answer")
                elif (e := ask.exception()) is not None:
                    if not isinstance(e, ClusterUnavailableError):
                        raise e
                    left.append(f"{m} does not answer ({e})")
                elif (why := ask.result()) is not None:
                    left.append(f"{m} is still forwarding" + (f" ({why})" if why else ""))
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(min(FLUSH_POLL_S, max(0.0, deadline - time.monotonic())))
