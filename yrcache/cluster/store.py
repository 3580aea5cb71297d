"""``TieredStore`` in cluster mode: the same mapping API, routed to the key's owners.

``TieredStore(cluster="etcd://host:port/name")`` (or ``TieredStore()`` with
``YRCACHE_ETCD`` set) returns a :class:`ClusterStore`. Per machine, one process is
the member: the first one to create the node's arena (``YRCACHE_NAME``) serves it
on the data port and registers in etcd. Other processes with the same environment
attach to that arena: they read what the node holds zero-copy and send writes to
the owners. ``member=False`` (``YRCACHE_MEMBER=0``) is a pure client: no arena,
every operation over TCP.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .. import codec
from .._fast import OwnPuts
from ..config import Tier, WriteMode, write_mode as _write_mode
from ..errors import ClusterUnavailableError, StoreClosedError
from ..store import TieredStore
from ..types import Value
from ..validate import check_iterable_keys, check_keys, expire_at as _expire_at, key_bytes, mset_pairs, payload_nbytes, priority as _priority, \
    sync_timeout as _sync_timeout
from . import transport as tp
from .membership import Membership, check_name
from .member import NODE_PREFIX, Node
from .records import Mirror, ProcessWords, SharedWord
from .settings import check_environment, check_tier, env_bool, env_int, env_seconds, parse_cluster
from .joining import Joining
from .sharing import HERE_MIN, NodeSharing
from .replication import Router, decode

log = logging.getLogger("yrcache.cluster")
_LIVE: dict[int, weakref.ref[ClusterStore]] = {}      # stores to close at exit (a mapping is unhashable)


@atexit.register
def _close_all() -> None:
    """Leave the cluster before the interpreter tears down (etcd's channel cannot close later)."""
    for ref in list(_LIVE.values()):
        s = ref()
        try:
            if s is not None:
                s.close()
        except Exception:       # noqa: BLE001 - exiting anyway
            pass


def _after_fork_in_child() -> None:
    for ref in list(_LIVE.values()):
        s = ref()
        if s is not None and not s._closed:
            s._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)

_MISSING = object()


class ClusterStore(Joining, NodeSharing, TieredStore):
    """A :class:`~yrcache.TieredStore` whose keys live on an etcd-coordinated cluster.

    It overrides the operations that touch data (``put``, ``get``, ``delete``,
    ``keys``...); ``s[k]``, ``del s[k]``, iteration and ``clear`` come from the
    facade and go through them.

    ``role`` is ``"member"`` (this process serves the node's arena), ``"attached"``
    (another process of this machine does) or ``"client"`` (``member=False``).
    """

    #: Keys of ``node_store`` under this prefix are the node's own: never listed, forwarded
    #: or rebalanced by the member.
    NODE_PREFIX = NODE_PREFIX

    def __init__(self, name: str | None = None, *, cluster: str | None = None, listen: str | None = None,
                 replicas: int | None = None, write_mode: WriteMode | str | None = None,
                 member: bool | None = None, token: str | None = None, lease_ttl: float | None = None,
                 pickle: bool = False, **local: Any) -> None:
        self._closed = False
        self.member_id: str | None = None     # this machine's member (None for a pure client)
        self.address: str | None = None       # its data address (a member only)
        self._local: TieredStore | None = None
        self._membership: Membership | None = None
        self._server: tp.Server | None = None
        self._node: Node | None = None
        self._own: OwnPuts | None = None      # the member's own ASYNC puts in C (Node.own)
        self._mirror: Mirror | None = None
        self._shared: dict[str, SharedWord] = {}
        self._lock = threading.Lock()
        check_environment()
        endpoints, self.cluster = parse_cluster(cluster)
        self._etcd = endpoints
        check_name("cluster name", self.cluster)
        self._args = dict(name=name, cluster=cluster, listen=listen, replicas=replicas, write_mode=write_mode,
                          member=member, token=token, lease_ttl=lease_ttl, pickle=pickle, **local)
        self._pickle = bool(pickle)
        self.replicas = replicas if replicas is not None else env_int("YRCACHE_REPLICAS", 2)
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= 16:
            raise ValueError(f"replicas must be an int from 1 to 16, got {self.replicas!r}")
        self._mode_default: WriteMode = _write_mode(write_mode or os.environ.get("YRCACHE_WRITE_MODE")) \
            or WriteMode.WRITE_THROUGH
        if member is None:
            member = env_bool("YRCACHE_MEMBER", True)
        tok = token if token is not None else os.environ.get("YRCACHE_TOKEN")
        token_b = tok.encode() if tok else None
        ttl = lease_ttl if lease_ttl is not None else env_seconds("YRCACHE_LEASE_TTL", 10.0)
        #: This process's etcd lease TTL in seconds: a dead member leaves the ring this long
        #: after it died (when the members use the same TTL).
        self.lease_ttl = ttl
        self.name = name or os.environ.get("YRCACHE_NAME") or f"yrcache-{self.cluster}"
        _LIVE[id(self)] = weakref.ref(self)
        self._router = Router(self.replicas, token_b)
        self._ops = dict.fromkeys(("hits", "misses", "puts", "deletes"), 0)
        try:
            if not member:
                self.role = "client"
                self._watch(endpoints, ttl)
                return
            self._open_local(pickle, local)
            if self.role == "member":
                self._forget_old_objects()
                self._serve(endpoints, ttl, listen, token_b)
            else:
                self._router.member_id = self._wait_member_id()
                self._watch(endpoints, ttl)
        except BaseException:
            self.close()
            raise

    # ---- helpers -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"cluster store {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def _mode(self, write_mode: WriteMode | str | None) -> WriteMode:
        return _write_mode(write_mode) or self._mode_default

    def _encode(self, value: Value) -> tuple[bytes, Any, int]:
        try:
            meta, payload, nbytes = codec.encode(value, self._pickle)
        except TypeError:
            meta = b"P"
        if meta[:1] == b"P":
            raise TypeError(f"cannot store a {type(value).__name__} in a cluster: pickled objects never "
                            "travel between members; store bytes, numpy arrays or tensors") from None
        return meta, payload, nbytes

    def _local_get(self, key: str) -> Any:
        if self._local is None or not self._router.reads_here():
            return None
        return self._local.get(key)

    # ---- writes ------------------------------------------------------------------------
    def put(self, key: str, value: Value, tier: Tier | None = None, priority: int = 0,
            ttl: float | None = None, write_mode: WriteMode | str | None = None,
            sync_timeout: float | None = None) -> None:
        """Store ``value`` on the key's owners (see ``write_mode``); ``tier`` applies on each owner."""
        sync_timeout = _sync_timeout(sync_timeout)
        own = self._own
        if own is not None:
            # the common hybrid case, an ASYNC put with no options, in one C call
            # (_csrc/fast_own.c): the key's lock, a version, the local put, the queue
            done = own.put(key, value, tier, priority, ttl, write_mode)
            if done is True:
                self._ops["puts"] += 1
                return
            if done:                # stored at this version: the queue is full or the forwarder asleep
                own_node = self._node
                assert own_node is not None
                own_node.forwarder.add(key, done)
                self._ops["puts"] += 1
                return
        self._check_open()
        router = self._router
        if tier is None and ttl is None and priority == 0 and type(priority) is int and type(value) in _PLAIN \
                and not getattr(value, "dtype", _BYTES).hasobject and self._local is not None \
                and router.node is not None and self._mode(write_mode) is WriteMode.ASYNC:
            # an ndarray of a layout the C side has not learned (local.put teaches it), or
            # the key's lock busy: the same steps in Python
            if router.put_local_async(key, self._local.put, value):
                self._ops["puts"] += 1
                return
        key_bytes(key)
        meta, payload, nbytes = self._encode(value)
        pri, exp, mode, tier = _priority(priority), _expire_at(ttl) or 0.0, self._mode(write_mode), check_tier(tier)
        if tier is not None or not self._put_here(key, meta, nbytes, payload, pri, exp, mode):
            self._router.put(key, meta, payload, nbytes, pri, exp, mode, sync_timeout, tier)
        self._ops["puts"] += 1

    def put_with(self, key: str, meta: bytes, nbytes: int, fill: Any, *, priority: int = 0,
                 ttl: float | None = None, tier: Tier | None = None, write_mode: WriteMode | str | None = None,
                 sync_timeout: float | None = None) -> None:
        """``TieredStore.put_with`` for a cluster: ``fill(view)`` writes the payload into a
        private buffer (``fill`` may also be that buffer), which is then sent to the owners."""
        self._check_open()
        sync_timeout = _sync_timeout(sync_timeout)
        key_bytes(key)
        nbytes = payload_nbytes(key, fill, nbytes)
        codec.check_header(meta, nbytes)
        if meta[:1] == b"P":
            raise TypeError("pickled objects never travel between members")
        pri, exp, mode, tier = _priority(priority), _expire_at(ttl) or 0.0, self._mode(write_mode), check_tier(tier)
        if tier is None and self._put_here(key, meta, nbytes, fill, pri, exp, mode):
            self._ops["puts"] += 1
            return
        if callable(fill):
            buf = tp.alloc(nbytes)
            fill(np.frombuffer(buf, np.uint8, nbytes))
        else:
            buf = fill
        self._router.put(key, meta, buf, nbytes, pri, exp, mode, sync_timeout, tier)
        self._ops["puts"] += 1

    def mset(self, items: Mapping[str, Value] | Iterable[tuple[str, Value]], tier: Tier | None = None,
             priority: int = 0, ttl: float | None = None, write_mode: WriteMode | str | None = None,
             sync_timeout: float | None = None) -> None:
        """Put several values, pipelined per owner; each is atomic, the batch is not."""
        self._check_open()
        pairs = mset_pairs(items)
        check_keys([k for k, _ in pairs])
        self._put_encoded([(k, *self._encode(v)) for k, v in pairs], tier, priority, ttl, write_mode, sync_timeout)

    def mput_raw(self, entries: list[tuple[str, bytes, Any, int]], *, priority: int = 0,
                 ttl: float | None = None, tier: Tier | None = None, write_mode: WriteMode | str | None = None,
                 sync_timeout: float | None = None) -> None:
        """``TieredStore.mput_raw`` for a cluster: encoded objects ``(key, meta, payload,
        nbytes)`` sent to their owners as ``mset`` sends values."""
        self._check_open()
        rows = []
        for k, meta, payload, n in entries:
            key_bytes(k)
            n = payload_nbytes(k, payload, n)
            if callable(payload):
                raise TypeError(f"{k!r}: mput_raw takes buffers; use put_with for a fill function")
            codec.check_header(meta, n)
            if meta[:1] == b"P":
                raise TypeError("pickled objects never travel between members")
            rows.append((k, meta, payload, n))
        self._put_encoded(rows, tier, priority, ttl, write_mode, sync_timeout)

    def _put_encoded(self, rows: list[tuple[str, bytes, Any, int]], tier: Tier | None, priority: int,
                     ttl: float | None, write_mode: WriteMode | str | None, sync_timeout: float | None) -> None:
        pr, exp, mode = _priority(priority), _expire_at(ttl) or 0.0, self._mode(write_mode)
        sync_timeout = _sync_timeout(sync_timeout)
        router = self._router
        router._need_members()
        if tier is None and self._local is not None and any(r[3] >= HERE_MIN for r in rows):
            # large values for this node's member made in place, as put does; a key written
            # twice in the batch is sent, where the later row gets the later version
            seen = Counter(k for k, *_ in rows)
            n = len(rows)
            rows = [r for r in rows if not (r[3] >= HERE_MIN and seen[r[0]] == 1
                                            and self._put_here(r[0], r[1], r[3], r[2], pr, exp, mode))]
            self._ops["puts"] += n - len(rows)
            if not rows:
                return
        by_member: dict[str, list] = {}
        flags = 0
        hlc, writer = router.clock.next_many(len(rows)), router.clock.writer
        for i, (k, meta, payload, nbytes) in enumerate(rows):
            targets, flags = router.targets(k, mode)
            item = (k, meta, payload, nbytes, (hlc + i, writer), pr, exp)    # one tuple for all owners
            for m in targets:
                by_member.setdefault(m, []).append(item)
        t = check_tier(tier)
        if t is not None:
            flags |= (int(t) + 1) << tp.TIER_SHIFT
        failed = router.fan_out(by_member, flags, sync_timeout)
        if failed:
            raise ClusterUnavailableError(f"mset: owners did not take their writes: {'; '.join(failed)}")
        self._ops["puts"] += len(rows)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every member; True if one held it."""
        self._check_open()
        key_bytes(key)
        found = self._router.delete(key)
        self._ops["deletes"] += found
        return found

    def delete_many(self, keys: Iterable[str]) -> int:
        """Remove several keys from every member in one pipelined batch per member; how many
        existed."""
        self._check_open()
        keys = list(check_iterable_keys(keys))
        for k in keys:
            key_bytes(k)
        found = self._router.delete_many(keys) if keys else 0
        self._ops["deletes"] += found
        return found

    # ---- reads -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None, *, copy: bool = False) -> Any:
        """The value of ``key``: zero-copy from this node's arena when it holds one, else
        fetched from an owner (fail-over to the next) into a private buffer."""
        self._check_open()
        key_bytes(key)
        value = self._local_get(key)
        if value is None:
            got = self._router.read(key, skip=self._router.asked_here(self._local is not None))
            if got is None:
                self._ops["misses"] += 1
                return default
            value = decode(got.meta, got.buf, len(got.buf))
        self._ops["hits"] += 1
        return codec.private_copy(value) if copy else value

    def read_range(self, key: str, offset: int, length: int) -> memoryview | None:
        """Bytes ``[offset, offset + length)`` of ``key``'s payload (only those travel), or None."""
        self._check_open()
        key_bytes(key)
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        value = self._local_get(key)
        if value is not None:
            return memoryview(codec.flat_bytes(value).data)[offset:offset + length].toreadonly()
        skip = self._router.asked_here(self._local is not None)    # (asked locally above)
        got = self._router.read(key, offset, length, skip=skip)
        return None if got is None else memoryview(got[1]).toreadonly()

    def mget(self, keys: Iterable[str], *, copy: bool = False) -> list[Value | None]:
        """Values of ``keys`` (None where missing): local ones zero-copy, the rest pipelined per owner."""
        self._check_open()
        keys = list(check_iterable_keys(keys))
        check_keys(keys)
        out: list[Any] = [None] * len(keys)
        router = self._router
        todo: list[int] | range = range(len(keys))
        if self._local is not None and router.reads_here():     # ours zero-copy
            todo = []
            for i, k in enumerate(keys):
                v = self._local.get(k)
                if v is None:
                    todo.append(i)
                else:
                    out[i] = codec.private_copy(v) if copy else v
        skip = router.asked_here(self._local is not None)
        got = router.mread_all(keys if len(todo) == len(keys) else [keys[i] for i in todo], skip=skip)
        hits = len(keys) - len(todo)
        for i in todo:
            g = got.get(keys[i])
            if g is not None:
                v = decode(g.meta, g.buf, len(g.buf))
                out[i] = codec.private_copy(v) if copy else v
                hits += 1
        self._ops["hits"] += hits
        self._ops["misses"] += len(keys) - hits
        return out

    def get_raw(self, key: str) -> tuple[bytes, memoryview] | None:
        """``(meta, payload)`` of ``key`` as stored (see ``TieredStore.get_raw``): this
        node's pinned copy when it holds one, else received from an owner."""
        self._check_open()
        key_bytes(key)
        if self._local is not None and self._local_get(key) is not None:
            got = self._local.get_raw(key)
            if got is not None:
                return got
        g = self._router.read(key, skip=self._router.asked_here(self._local is not None))
        if g is None:
            return None
        return g.meta, memoryview(g.buf).cast("B").toreadonly()

    def mget_raw(self, keys: Iterable[str]) -> list[tuple[bytes, memoryview] | None]:
        """``(meta, payload)`` of several keys as stored (see ``TieredStore.mget_raw``): this
        node's copies in place, the rest received from their owners as ``mget`` does."""
        self._check_open()
        keys = list(check_iterable_keys(keys))
        check_keys(keys)
        out: list[tuple[bytes, memoryview] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._local is not None and self._router.reads_here():
            todo = []
            for i, r in enumerate(self._local.mget_raw(keys)):
                if r is None:
                    todo.append(i)
                else:
                    out[i] = r
        router = self._router
        got = router.mread_all([keys[i] for i in todo],
                               skip=router.asked_here(self._local is not None))
        for i in todo:
            g = got.get(keys[i])
            if g is not None:
                out[i] = (g.meta, memoryview(g.buf).cast("B").toreadonly())
        return out

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        self._check_open()
        try:
            key_bytes(key)
        except ValueError:              # as TieredStore: no such key (and nothing sent)
            return False
        if self._local_get(key) is not None:
            return True
        return self._router.read(key, 0, 0) is not None

    def keys(self, prefix: str = "") -> Iterator[str]:  # type: ignore[override]
        """Every key on the cluster (a union over the members), sorted."""
        self._check_open()
        return iter(sorted(self._router.keys(prefix)))

    def __len__(self) -> int:
        self._check_open()
        return len(self._router.keys(""))

    # ---- the rest of the store API -----------------------------------------------------
    def get_into(self, key: str, out: Any) -> Any:
        """Copy ``key``'s value into ``out`` (see ``TieredStore.get_into``): from this node's
        arena when it holds a copy, else received from an owner straight into ``out``."""
        self._check_open()
        if self._local is not None and self._local_get(key) is not None:
            return self._local.get_into(key, out)
        try:
            dst = codec.as_bytes_view(out)
        except TypeError:                  # a device tensor: through host memory
            dst = None
        if dst is not None:
            def into(meta: bytes, n: int) -> Any:
                codec.check_into(key, meta, out, n)
                return dst
            got = self._router.read(key, into=into)
            if got is None:
                raise KeyError(key)
            if got.buf is not dst:
                codec.check_into(key, got.meta, out, len(got.buf))
                codec.copy_bytes(np.frombuffer(got.buf, np.uint8), out)
            return out
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        codec.check_into(key, codec.encode(value)[0], out, codec.flat_bytes(value).nbytes)
        codec.copy_bytes(codec.flat_bytes(value), out)
        return out

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every member has forwarded what it queued (``ASYNC`` writes, hand-overs),
        for up to ``timeout`` seconds (a member that dies meanwhile is waited for until its
        lease ends and the ring drops it); ``TimeoutError`` names the members that did not."""
        self._check_open()
        if self._local is not None:
            self._local.flush()
        left = self._router.flush(timeout)
        if left:
            raise TimeoutError(f"replication did not finish within {timeout:g} s: {'; '.join(left)}")

    def stats(self) -> dict[str, Any]:
        """The embedded store's keys, for the cluster: ``tiers`` and the moved/pinned
        counters summed over the members (every copy counts), ``hits``/``misses``/``puts``/
        ``deletes`` of this handle; plus the role, etcd state and each member's objects,
        bytes and forwarding backlog under ``members``."""
        self._check_open()
        members = self._router.stats()
        tiers: dict[str, dict[str, int]] = {}
        moved = dict.fromkeys(("spills", "promotions", "evictions", "pinned_bytes", "orphans", "recoveries"), 0)
        for m in members:
            st = m.pop("store", None) or {}
            for name, t in st.get("tiers", {}).items():
                agg = tiers.setdefault(name, {})
                for k, v in t.items():
                    if isinstance(v, int):
                        agg[k] = agg.get(k, 0) + v
            for k in moved:
                moved[k] += int(st.get(k, 0))
        return {"name": self.name, "cluster": self.cluster, "role": self.role, "member_id": self.member_id,
                "replicas": self.replicas, "write_mode": self._mode_default.value, "tiers": tiers,
                **self._ops, **moved,
                "etcd": self._membership.stats() if self._membership else None,
                "members": members,
                "under_replicated": sum(m.get("under_replicated", 0) for m in members),
                "local": self._local.stats() if self._local is not None else None}

    def info(self, key: str) -> dict[str, Any] | None:
        self._check_open()
        if self._local is not None and self._local_get(key) is not None:
            return self._local.info(key)
        got = self._router.read(key, 0, 0)
        if got is None:
            return None
        return {"tier": Tier(got.tier) if got.tier >= 0 else None, "nbytes": None,
                "kind": codec.describe(got.meta)["kind"], "remote": True}

    def tier_of(self, key: str) -> Tier:
        """The tier the first member that answers holds ``key`` in; ``KeyError`` if none does."""
        i = self.info(key)
        if i is None or i["tier"] is None:
            raise KeyError(key)
        return i["tier"]

    # ---- life cycle --------------------------------------------------------------------
    def _forked(self) -> None:
        """In a child forked from this process (a DataLoader worker): the child is an attached
        process of this node, not its member. Writes go over TCP to the member (the parent
        keeps the versions and the forwarder), the parent's connections, lease and etcd client
        stay the parent's (closing them here would end its membership), and the child keeps the
        member set it was forked with (no watch of its own)."""
        self._router.forked()
        self._own = None
        if self.role == "member":
            self.role = "attached"
        self._node = self._router.node = None
        if self._mirror is not None and isinstance(self._mirror.local, ProcessWords):
            self._mirror.local.forked()     # a pure client's words: nobody updates them here
        self._server = self._membership = self._mirror = None
        self._shared = {}
        self._lock = threading.Lock()

    def close(self, handover: bool = False, give_up: threading.Event | None = None) -> None:
        """Leave the cluster and release this handle. ``handover=True`` (a member only)
        first moves this node's objects to their other owners (``yrcache node`` on SIGTERM),
        waiting up to 120 s for them, or until ``give_up`` is set (``yrcache node`` sets it
        on a second SIGTERM or Ctrl-C)."""
        if self._closed:
            return
        self._closed = True
        self._own = None
        _LIVE.pop(id(self), None)
        if handover and self._node is not None and self._membership is not None:
            self._handover(give_up)
        for part in (self._mirror, self._membership, self._server):
            if part is not None:
                try:
                    part.close()
                except Exception as e:      # noqa: BLE001 - close the rest regardless
                    log.warning("closing %s: %s", type(part).__name__, e)
        if self._node is not None:
            self._node.close()
        self._router.close()
        if self._local is not None:
            self._local.close()

    def destroy(self) -> None:
        local = self._local
        self.close()
        if local is not None and self.role == "member":
            local.destroy()

    def __reduce__(self):
        return (_rebuild, (self._args,))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.role} of {len(self._router.members)} members"
        return f"<ClusterStore {self.name!r} cluster={self.cluster!r} {state}>"

    def __del__(self):
        if sys.is_finalizing():        # too late to talk to etcd; atexit already closed us
            return
        try:
            self.close()
        except Exception:
            pass


TieredStore._cluster_class = ClusterStore


_PLAIN = (np.ndarray, bytes, bytearray)   # values the local store encodes without pickle
_BYTES = np.dtype(np.uint8)


def _rebuild(args: dict) -> ClusterStore:
    return ClusterStore(**args)
