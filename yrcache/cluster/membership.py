"""Cluster membership in etcd: lease-bound member keys and a watched member set.

This is the only yrcache module that imports the etcd client (``etcd-sdk-python``,
imported as ``pyetcd``; it needs ``protobuf`` too). etcd holds one key per member,
``/yrcache/<cluster>/nodes/<member_id>``, whose JSON value is
``{"address", "epoch", "pid"}`` (and ``"catching_up": true`` while it catches up, see
below) and which is bound to a lease: a member that closes
revokes it (the key goes at once), a member that dies stops refreshing it (the key
goes after ``ttl``). No per-object metadata is ever written to etcd.

Two daemon threads per :class:`Membership`:

- keepalive: refreshes the lease every ``ttl / 3``; if the lease is gone (etcd
  expired it while the process stalled, or someone deleted the key) it registers
  again under a new lease, keeping the same ``epoch``. A member dropped that way
  missed the writes made without it: with ``on_rejoin``, it first calls
  ``on_rejoin(done)``, then registers marked ``catching_up`` (readers ask it last)
  until the callee, having brought its copies up to date, calls ``done()``.
- watch: lists the prefix, then watches it from the listed revision + 1. No etcd
  client re-arms a watch after an etcd restart, so when the stream breaks this
  thread lists again and re-watches from the new revision + 1 (which also covers a
  compacted revision), with backoff, until :meth:`Membership.close`.

While etcd is unreachable, :meth:`Membership.members` keeps returning the last
known set, membership changes wait, and :meth:`Membership.stats` says
``"etcd": "unreachable"`` and since when. Nothing raised in a background thread
leaks out; failures are logged at warning level, at most once per 5 s per kind.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Union

from yrcache.errors import ClusterUnavailableError

__all__ = ["MemberInfo", "Membership", "parse_endpoints", "check_name", "MAX_NAME_LEN"]

log = logging.getLogger(__name__)


def _pyetcd() -> Any:
    """The etcd client, imported on first use (it is the ``cluster`` extra)."""
    try:
        import pyetcd
        import pyetcd.events
    except ImportError as e:
        raise ImportError(f"cluster mode needs the etcd client: pip install 'yrcache[cluster]' ({e})") from None
    return pyetcd

MAX_NAME_LEN = 128
_LOG_EVERY_S = 5.0
_MAX_BACKOFF_S = 0.5
START_S = 2.0          # start() tries etcd this long (a connect refused once by a busy etcd)
MULTI_RETRY_S = 2.0    # with several endpoints, how long one that failed is left alone

OnChange = Callable[[dict[str, "MemberInfo"]], None]
#: ``on_rejoin(done)``: bring the member's copies up to date, then call ``done()``
#: (see ``Membership``; called on the keepalive thread before the key is put again).
OnRejoin = Callable[[Callable[[], None]], None]


class _Refused(Exception):
    """``taken`` refused our start: its exception, raised from ``start``."""


@dataclass(frozen=True)
class MemberInfo:
    """One member as registered in etcd: its data address and start epoch.

    ``epoch`` is the member process's start time in nanoseconds: a restarted member
    (same id) shows a larger epoch, so peers can tell the incarnations apart.
    ``catching_up``: the member came back after etcd dropped it and may still hold
    copies the cluster has written past; reads ask it last.
    """

    member_id: str
    address: str
    epoch: int
    pid: int
    catching_up: bool = False


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid cluster name or member id, else raise.

    Rules: a non-empty ``str`` of at most :data:`MAX_NAME_LEN` characters, with no
    ``/`` (it would nest etcd keys), whitespace or control characters.
    """
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a str, not {type(value).__name__}")
    if not value or len(value) > MAX_NAME_LEN:
        raise ValueError(f"{kind} must be 1..{MAX_NAME_LEN} characters, got {len(value)}")
    if "/" in value or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{kind} {value!r} may not contain '/', whitespace or control characters")
    return value


def parse_endpoints(endpoints: Union[str, list[str]]) -> list[tuple[str, int]]:
    """Parse etcd endpoints ``"host:port[,host:port...]"`` (or a list of them).

    Only plain ``host:port`` is accepted (IPv6 as ``[::1]:2379``); a URL such as
    ``etcd://host:port/cluster`` is the store's ``cluster=`` form and is split by
    the caller into endpoints and cluster name before it gets here.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[tuple[str, int]] = []
    for raw in items:
        if not isinstance(raw, str):
            raise TypeError(f"etcd endpoint must be a str 'host:port', not {type(raw).__name__}")
        item = raw.strip()
        if "://" in item or "/" in item:
            raise ValueError(f"etcd endpoint {item!r}: give host:port, not a URL")
        host, sep, port_s = item.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ValueError(f"etcd endpoint {item!r} is not host:port (port 1..65535)")
        out.append((host, int(port_s)))
    if not out:
        raise ValueError("no etcd endpoints given; pass 'host:port[,host:port]'")
    return out


class Membership:
    """A member (or, with ``register=False``, a pure watcher) of one yrcache cluster.

    ``on_change(members)`` is called from the watch thread with a fresh dict each
    time the member set changes (also for the first listing); it must not block
    for long. Use as a context manager or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, endpoints: Union[str, list[str]], cluster: str, member_id: str,
                 address: str, *, ttl: float = 10.0, on_change: OnChange | None = None,
                 register: bool = True, on_rejoin: OnRejoin | None = None,
                 taken: Callable[[MemberInfo], None] | None = None) -> None:
        self._endpoints = parse_endpoints(endpoints)
        self.cluster = check_name("cluster name", cluster)
        self.member_id = check_name("member id", member_id)
        if not isinstance(address, str) or not address or len(address) > 1024:
            raise ValueError("address must be a non-empty str of at most 1024 characters")
        if not isinstance(ttl, (int, float)) or not 1.0 <= ttl <= 3600.0:
            raise ValueError(f"ttl must be between 1 and 3600 seconds, got {ttl!r}")
        self.address = address
        self.ttl = float(ttl)
        self.register = register
        self.prefix = f"/yrcache/{self.cluster}/nodes/"
        self.key = self.prefix + self.member_id
        self.epoch = time.time_ns()
        self._on_change = on_change
        self._on_rejoin = on_rejoin
        self._taken = taken
        self._catching_up = 0                 # the rejoin being caught up (0: none)
        self._rejoins = 0
        self._rpc_timeout = max(0.5, min(self.ttl / 3, 5.0))
        self._client: Any = None
        self._lock = threading.Lock()
        self._members: dict[str, MemberInfo] = {}
        self._revision = 0
        self._lease_id: int | None = None
        self._check_key = threading.Event()   # the watch saw our key go: verify it
        self._wake = threading.Event()        # wakes the keepalive thread early
        self._stop = threading.Event()
        self._events: queue.Queue[object] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._unreachable_since: float | None = None
        self._last_error: str | None = None
        self._last_log: dict[str, float] = {}
        self._counts = {"watch_arms": 0, "registrations": 0, "lease_refreshes": 0}
        self._state = "new"

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> Membership:
        """Connect, register (unless ``register=False``), list the members, start threads.

        Raises :class:`~yrcache.errors.ClusterUnavailableError` if etcd does not
        answer within ``START_S`` seconds; nothing is left running then.
        """
        if self._state != "new":
            raise RuntimeError(f"Membership {self.member_id!r} was already started")
        self._client = self._make_client()
        deadline = time.monotonic() + START_S
        while True:
            try:
                if self.register:
                    self._check_taken()
                    self._register()
                self._list()
                break
            except _Refused as refused:
                self._client.close()
                self._state = "closed"
                raise refused.args[0] from None
            except Exception as exc:
                if time.monotonic() < deadline:     # one refused connect (etcd busy): again
                    time.sleep(0.25)
                    continue
                self._client.close()
                self._state = "closed"
                where = ",".join(f"{h}:{p}" for h, p in self._endpoints)
                why = " ".join(str(exc).split())[:300] or type(exc).__name__   # (gRPC's are many lines)
                raise ClusterUnavailableError(
                    f"etcd at {where} did not answer for {START_S:g} s ({why}); start etcd "
                    "there or fix the endpoints") from exc
        self._state = "running"
        targets = [self._watch_loop] + ([self._keepalive_loop] if self.register else [])
        for target in targets:
            t = threading.Thread(target=target, daemon=True,
                                 name=f"yrcache-{target.__name__[1:]}-{self.member_id}")
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Stop the threads and revoke the lease, so peers see this member go at once.

        Idempotent. If etcd is unreachable the key expires after ``ttl`` instead.
        """
        if self._state != "running":
            self._state = "closed"
            return
        self._state = "closed"
        self._stop.set()
        self._wake.set()
        self._events.put(None)
        for t in self._threads:
            t.join(timeout=self._rpc_timeout + 2.0)
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                self._client.revoke_lease(lease_id)
            except Exception as exc:
                log.warning("membership %s: could not revoke lease at close (%r); "
                            "the key expires in %.0f s", self.member_id, exc, self.ttl)
        try:
            self._client.close()
        except Exception:  # pragma: no cover - grpc close does not fail in practice
            pass

    def __enter__(self) -> Membership:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- queries ---------------------------------------------------------------
    def members(self) -> dict[str, MemberInfo]:
        """The current member set (a copy): the last known one while etcd is unreachable."""
        with self._lock:
            return dict(self._members)

    def client(self) -> Any:
        """The etcd client (for other keys of this cluster; valid until :meth:`close`)."""
        if self._client is None:
            raise RuntimeError("membership not started")
        return self._client

    def stats(self) -> dict[str, Any]:
        """Health and counters: ``etcd`` is ``"ok"``, ``"unreachable"``, ``"new"`` or ``"closed"``."""
        with self._lock:
            if self._state != "running":
                etcd = self._state
            else:
                etcd = "ok" if self._unreachable_since is None else "unreachable"
            return {"etcd": etcd, "unreachable_since": self._unreachable_since,
                    "members": len(self._members), "revision": self._revision,
                    "lease_ttl": self.ttl, "lease_id": self._lease_id,
                    "registered": self.register and self.member_id in self._members,
                    "member_id": self.member_id, "cluster": self.cluster,
                    "epoch": self.epoch, "last_error": self._last_error, **self._counts}

    # ---- etcd plumbing ---------------------------------------------------------
    def _make_client(self) -> Any:
        # pyetcd marks an endpoint failed for time_retry (default 300 s) after one
        # UNAVAILABLE and refuses it meanwhile; grpc's reconnect backoff grows to
        # 120 s. Both would delay recovery after an etcd restart far past the TTL.
        opts = [("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)]
        # With several endpoints a dead one is skipped for longer: one that comes back within
        # 0.2 s of failing was tried again at once, so each retry went to the dead endpoint.
        pyetcd = _pyetcd()
        retry = 0.2 if len(self._endpoints) == 1 else MULTI_RETRY_S
        eps = [pyetcd.Endpoint(h, p, secure=False, time_retry=retry, opts=opts)
               for h, p in self._endpoints]
        return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=self._rpc_timeout,
                                               failover=True)

    def _value(self) -> str:
        d: dict[str, Any] = {"address": self.address, "epoch": self.epoch, "pid": os.getpid()}
        if self._catching_up:
            d["catching_up"] = True
        return json.dumps(d)

    def _check_taken(self) -> None:
        """Our key already in etcd when we (re)register: a predecessor whose lease has not
        run out yet, or another process with our id (one that took it over while we were
        stopped). ``taken(info)`` raises to refuse."""
        if self._taken is None:
            return
        value, meta = self._client.get(self.key)
        info = None if meta is None else self._parse(self.key.encode(), value)
        if info is not None and (info.address, info.epoch) != (self.address, self.epoch):
            try:
                self._taken(info)
            except Exception as exc:
                raise _Refused(exc) from None

    def _register(self) -> None:
        """Put our key under a fresh lease (the old one, if any, is gone)."""
        if self._counts["registrations"]:
            self._check_taken()
            self._begin_rejoin()
        lease = self._client.lease(max(1, math.ceil(self.ttl)))
        self._client.put(self.key, self._value(), lease=lease.id)
        self._lease_id = lease.id
        self._counts["registrations"] += 1

    def _ensure_key(self) -> None:
        """Re-put our key if the watch saw it vanish while our lease still lives, and its
        value if that is not ours (it still says we catch up, after we have)."""
        value, meta = self._client.get(self.key)
        if meta is None:
            self._check_taken()
            self._begin_rejoin()
            self._client.put(self.key, self._value(), lease=self._lease_id)
        elif value != self._value().encode():
            self._client.put(self.key, self._value(), lease=self._lease_id)

    def _begin_rejoin(self) -> None:
        """We were out of the member set and put our key again next: with ``on_rejoin``, it
        says we catch up, and ``on_rejoin(done)`` is called first (it drops what it can tell
        is old now, the rest once every writer sees us again, then calls ``done``)."""
        if self._on_rejoin is None:
            return
        with self._lock:
            self._rejoins += 1
            gen = self._catching_up = self._rejoins

        def done() -> None:
            with self._lock:
                if self._catching_up != gen:      # a later rejoin is being caught up now
                    return
                self._catching_up = 0
            self._check_key.set()                 # the keepalive thread puts the value again
            self._wake.set()
        try:
            self._list()                          # the member set as the others see it now
        except Exception as exc:
            self._failed("list", exc)
        try:
            self._on_rejoin(done)
        except Exception:
            log.exception("membership %s: on_rejoin failed", self.member_id)
            done()

    def _list(self) -> int:
        """Replace the member set with a fresh listing; return its revision."""
        resp = self._client.get_prefix_response(self.prefix)
        members = {}
        for kv in resp.kvs:
            info = self._parse(kv.key, kv.value)
            if info is not None:
                members[kv.key.decode("utf-8", "replace")[len(self.prefix):]] = info
        rev = int(resp.header.revision)
        self._set_members(members, rev)
        return rev

    def _parse(self, key: bytes, value: bytes) -> MemberInfo | None:
        mid = key.decode("utf-8", "replace")[len(self.prefix):]
        try:
            d = json.loads(value)
            return MemberInfo(mid, str(d["address"]), int(d["epoch"]), int(d["pid"]), d.get("catching_up") is True)
        except (ValueError, KeyError, TypeError) as exc:
            self._warn("parse", f"ignoring malformed member key {mid!r}: {exc!r}")
            return None

    def _set_members(self, members: dict[str, MemberInfo], rev: int) -> None:
        with self._lock:
            changed = members != self._members
            self._members = members
            self._revision = max(self._revision, rev)
        self._ok()
        if self.register and self._state == "running" and self.member_id not in members:
            self._check_key.set()
            self._wake.set()
        if changed and self._on_change is not None:
            try:
                self._on_change(dict(members))
            except Exception:
                log.exception("membership %s: on_change callback failed", self.member_id)

    def _apply(self, resp: Any) -> None:
        members = self.members()
        rev = int(resp.header.revision)
        for ev in resp.events:
            mid = ev.key.decode("utf-8", "replace")[len(self.prefix):]
            if isinstance(ev, _pyetcd().events.DeleteEvent):
                members.pop(mid, None)
            else:
                info = self._parse(ev.key, ev.value)
                if info is not None:
                    members[mid] = info
            rev = max(rev, int(ev.mod_revision))
        self._set_members(members, rev)

    # ---- health and logging ----------------------------------------------------
    def _ok(self) -> None:
        if self._unreachable_since is not None:
            self._warn("reachable", "etcd reachable again after "
                       f"{time.time() - self._unreachable_since:.1f} s")
        with self._lock:
            self._unreachable_since = None

    def _failed(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            if self._unreachable_since is None:
                self._unreachable_since = time.time()
            self._last_error = f"{kind}: {exc!r}"
        self._warn(kind, f"etcd {kind} failed ({exc!r}); serving the last known "
                   f"{len(self._members)} members, retrying")

    def _warn(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -math.inf) >= _LOG_EVERY_S:
            self._last_log[kind] = now
            log.warning("membership %s: %s", self.member_id, msg)

    # ---- threads ---------------------------------------------------------------
    def _keepalive_loop(self) -> None:
        period = self.ttl / 3
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if self._lease_id is None:
                    self._register()
                else:
                    resp = list(self._client.refresh_lease(self._lease_id))
                    if not resp or resp[-1].TTL <= 0:
                        self._warn("lease", f"lease {self._lease_id:x} expired; registering again")
                        self._lease_id = None
                        continue
                    self._counts["lease_refreshes"] += 1
                    if self._check_key.is_set():
                        self._check_key.clear()
                        self._ensure_key()
                self._ok()
                wait = period
            except _Refused as refused:     # another live member took our id while we were out
                log.error("membership %s: not registering again: %s; this process is no longer a "
                          "member of the cluster: stop it", self.member_id, refused.args[0])
                return
            except Exception as exc:
                self._failed("keepalive", exc)
                wait = min(period, _MAX_BACKOFF_S)
            self._wake.wait(wait)   # early when closing or the watch saw our key vanish

    def _watch_loop(self) -> None:
        backoff = 0.05
        first = True
        while not self._stop.is_set():
            watch_id = None
            events: queue.Queue[object] = queue.Queue()
            self._events = events
            try:
                # The first listing was done by start(); after a break, list again
                # (etcd may have lost events to compaction) and watch from rev + 1.
                rev = self._revision if first else self._list()
                first = False
                watch_id = self._client.add_watch_prefix_callback(
                    self.prefix, events.put, start_revision=rev + 1)
                self._counts["watch_arms"] += 1
                self._ok()
                backoff = 0.05
                while not self._stop.is_set():
                    try:
                        item = events.get(timeout=1.0)
                    except queue.Empty:
                        continue
                    if item is None or isinstance(item, BaseException):
                        # None: the stream ended (the client reset it after an error).
                        raise ConnectionError(f"watch stream broke: {item!r}")
                    self._apply(item)
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._failed("watch", exc)
            if watch_id is not None:
                try:
                    self._client.cancel_watch(watch_id)
                except Exception:
                    pass
            self._stop.wait(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
