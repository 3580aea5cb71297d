"""What a cluster store offers the processes of one node beyond the mapping API:
shared words, the node's own arena (its words, locks and checks), owners and
ranged reads (``yrcache.rl`` across machines is built on them). ``ClusterStore``
inherits them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import codec
from ..errors import ClusterUnavailableError
from ..validate import key_bytes
from . import transport as tp
from .records import Mirror, ProcessWords, SharedWord

if TYPE_CHECKING:
    from ..store import TieredStore
    from .membership import Membership
    from .replication import Router


class NodeSharing:
    """Mixed into ``ClusterStore``: needs ``_local``, ``_membership``, ``_router``, ``_shared``,
    ``cluster`` and ``_check_open``/``_local_get``."""

    if TYPE_CHECKING:
        cluster: str
        _local: TieredStore | None
        _membership: Membership | None
        _router: Router
        _shared: dict[str, SharedWord]
        _mirror: Mirror | None
        _etcd: str
        _lock: threading.Lock

        def _check_open(self) -> None: ...

        def _local_get(self, key: str) -> Any: ...

    def shared_word(self, name: str) -> SharedWord:
        """The cluster-wide rising counter ``name``: kept in etcd, raised by compare-and-swap
        (``raise_to``), and mirrored by every node's member into that node's arena word
        ``name``, so ``wait`` sleeps on a local futex and wakes when any node raises it.
        A pure client (no arena) mirrors the words into its own memory, with an etcd
        watch of its own started on first use."""
        self._check_open()
        if self._membership is None:
            raise ClusterUnavailableError(
                "this process was forked from the one that opened the cluster store, and etcd's "
                "client does not survive a fork: open the store in this process (TieredStore() with "
                "the same environment attaches to the node), or start workers with 'spawn'")
        w = self._shared.get(name)
        if w is None:
            if self._local is not None:
                local = self._local.word(name)
            else:
                with self._lock:
                    if self._mirror is None:
                        self._mirror = Mirror(ProcessWords(), self._etcd, self.cluster)
                local = self._mirror.local.word(name)
            w = self._shared[name] = SharedWord(name, self.cluster, self._membership.client(), local)
        return w

    @property
    def node_store(self) -> TieredStore | None:
        """This machine's arena as an embedded store (None for a pure client): what is put
        there stays on this node, unreplicated and unversioned, for the node's processes
        to share (``yrcache.rl`` lands fetched weights there once per node). Use keys
        under ``NODE_PREFIX`` (``"__node__/"``): cluster key listings and rebalancing
        skip them, and a restarted member starts without them."""
        return self._local

    # -- the node's arena: a pure client has none
    def word(self, name: str) -> Any:
        """``TieredStore.word`` of this node's arena (a member or attached process)."""
        if self._local is None:
            raise NotImplementedError("a pure cluster client (member=False) has no local words")
        return self._local.word(name)

    def node_lock(self, key: str) -> Any:
        """``TieredStore.node_lock`` on this node's arena (a member or attached process)."""
        if self._local is None:
            raise NotImplementedError("a pure cluster client (member=False) has no node arena to lock; "
                                      "node_lock needs a process on a member's machine")
        return self._local.node_lock(key)

    def pin_host_memory(self) -> None:
        """``TieredStore.pin_host_memory`` of this node's arena (a no-op for a pure client)."""
        if self._local is not None:
            self._local.pin_host_memory()

    def prefault(self, *values: Any) -> None:
        """``TieredStore.prefault`` on this node's arena (a no-op for a pure client)."""
        if self._local is not None:
            self._local.prefault(*values)

    def check(self) -> None:
        """``TieredStore.check`` on this node's arena (the other members check their own)."""
        self._check_open()
        if self._local is not None:
            self._local.check()

    def owners(self, key: str) -> list[str]:
        """The member ids that own ``key`` now (the ring's answer, first owner first)."""
        key_bytes(key)
        return list(self._router.owners(key))

    def read_ranges(self, key: str, spans: Iterable[tuple[int, int, int, int]], *, into: Any = None,
                    prefer: Iterable[str] = ()) -> Any:
        """Only the bytes of ``spans`` of ``key``'s payload, packed in order, or None.

        A span ``(offset, run, rows, stride)`` is ``rows`` runs of ``run`` bytes, ``stride``
        apart. Served from this node's arena when it holds the key, else asked of the
        members in ``prefer`` first, then the owners; only the requested bytes travel,
        received straight into ``into`` (a writable buffer of the packed size) when given.
        Raises ``ClusterUnavailableError`` when no member that could hold it answers."""
        self._check_open()
        key_bytes(key)
        try:
            todo = [(int(o), int(r), int(n), int(st)) for o, r, n, st in spans]
        except (TypeError, ValueError):
            todo = [(-1, 0, 0, 0)]
        if len(todo) > tp.MAX_SPANS or any(min(sp) < 0 for sp in todo):
            raise ValueError(f"spans must be at most {tp.MAX_SPANS} (offset, run, rows, stride) "
                             "tuples of ints >= 0")
        n = tp.spans_nbytes(todo)
        dst = None
        if into is not None:
            dst = memoryview(into).cast("B")
            if dst.readonly or dst.nbytes != n:
                raise ValueError(f"into must be a writable buffer of {n} bytes (the spans' total)")
        value = self._local_get(key)
        if value is not None:
            out = dst if dst is not None else memoryview(bytearray(n))
            tp.gather_into(codec.flat_bytes(value).data, todo, out)
            return out
        got = self._router.read_spans(key, todo, into=None if dst is None else (lambda meta, k: dst),
                                      prefer=prefer, skip=self._router.member_id if self._local is not None else None)
        return None if got is None else memoryview(got.buf).cast("B")

    @property
    def received_bytes(self) -> int:
        """Object payload bytes this process has received from members so far (all handles)."""
        return tp.RECEIVED.value

