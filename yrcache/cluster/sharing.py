"""What a cluster store offers the processes of one node beyond the mapping API:
shared words, the node's own arena (its words, locks and checks), owners and
ranged reads (``yrcache.rl`` across machines is built on them). ``ClusterStore``
inherits them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import WriteMode
from ..errors import ClusterUnavailableError
from ..validate import key_bytes
from . import transport as tp
from .records import FORKED, Mirror, ProcessWords, SharedWord

if TYPE_CHECKING:
    from ..store import TieredStore
    from .membership import Membership
    from .replication import Router


def _checked_spans(spans: Iterable[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    try:
        todo = [(int(o), int(r), int(n), int(st)) for o, r, n, st in spans]
    except (TypeError, ValueError):
        todo = [(-1, 0, 0, 0)]
    if len(todo) > tp.MAX_SPANS or any(min(sp) < 0 for sp in todo):
        raise ValueError(f"spans must be at most {tp.MAX_SPANS} (offset, run, rows, stride) "
                         "tuples of ints >= 0")
    return todo


#: A write at least this large that only this node's member takes goes into the node's arena
#: from the writing process itself (``_put_here``), not over a loopback connection.
HERE_MIN = 256 << 10


class NodeSharing:
    """Mixed into ``ClusterStore``: needs ``_local``, ``_membership``, ``_router``, ``_shared``,
    ``cluster``, ``role`` and ``_check_open``."""

    if TYPE_CHECKING:
        cluster: str
        role: str
        _local: TieredStore | None
        _membership: Membership | None
        _router: Router
        _shared: dict[str, SharedWord]
        _mirror: Mirror | None
        _etcd: str
        _lock: threading.Lock

        def _check_open(self) -> None: ...


    def shared_word(self, name: str) -> SharedWord:
        """The cluster-wide rising counter ``name``: kept in etcd, raised by compare-and-swap
        (``raise_to``), and mirrored by every node's member into that node's arena word
        ``name``, so ``wait`` sleeps on a local futex and wakes when any node raises it.
        A pure client (no arena) mirrors the words into its own memory, with an etcd
        watch of its own started on first use."""
        self._check_open()
        if self._membership is None:
            raise ClusterUnavailableError(FORKED)
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
    def member_changes(self) -> int:
        """How many changes of the member set this process has seen (a member left, joined
        or restarted): an operation that failed because a member did not answer may work
        once this moves (a dead member leaves the ring ``lease_ttl`` seconds after it died)."""
        return self._router.changes

    @property
    def member_present(self) -> bool | None:
        """Whether the member serving this node's arena is in the ring now, as this process
        sees it (None for a pure client). While it is not, nobody mirrors the cluster's shared
        words into the arena: ``yrcache.rl`` waits read their record from etcd once a second."""
        if self._local is None:
            return None
        return self._router.member_id in self._router.members

    @property
    def node_store(self) -> TieredStore | None:
        """This machine's arena as an embedded store (None for a pure client): what is put
        there stays on this node, unreplicated and unversioned, for the node's processes
        to share (``yrcache.rl`` lands fetched weights there once per node). Use keys
        under ``NODE_PREFIX`` (``"__node__/"``): cluster key listings and rebalancing
        skip them, and a restarted member starts without them."""
        return self._local

    def _put_here(self, key: str, meta: bytes, nbytes: int, payload: Any, priority: int,
                  expire_at: float, mode: WriteMode) -> bool:
        """A large write whose one target is this node's member, from an attached process:
        the payload (a buffer, or a function that fills the block) goes straight into a block
        of the node's arena, committed only if the arena holds no object of ``key``, and the
        member takes it at a new version (``ADOPT``) as if it had been sent: no socket
        carries the bytes. False when this write does not qualify, finds no room, or the
        member does not take it (then nothing of it is left here and the caller sends it)."""
        router, local = self._router, self._local
        if local is None or self.role != "attached" or nbytes < HERE_MIN:
            return False
        me = router.member_id
        owners, flags = router.targets(key, mode) if me in router.members else ([], 0)
        peer = router.peer(me) if me is not None and owners == [me] else None
        if peer is None:
            return False
        kb, a = key.encode(), local._a
        block = a.reserve(kb, meta, nbytes, priority=priority, expire_at=expire_at)
        if block is None:
            return False                   # no room without moving others: the member makes it
        with block:
            if callable(payload):
                payload(block.buffer)
            else:
                block.fill_from(payload)
            done = block.commit(expected=0)    # only where no object of the key is: else the member decides
            if done is None:
                return False
            seq = done.new_seq
        try:
            status = peer.adopt(key, seq, router.clock.next(), flags)
        except Exception:  # noqa: BLE001 - not taken here: the caller sends it, and reports what fails then
            status = tp.NOT_FOUND
        except BaseException:
            a.delete(kb, seq)
            raise
        if status in (tp.OK, tp.SAME, tp.STALE):
            return True
        a.delete(kb, seq)                  # ours, if it is still there: the member did not take it
        return False

    # -- the node's arena: a pure client has none
    def word(self, name: str) -> Any:
        """``TieredStore.word`` of this node's arena (a member or attached process)."""
        if self._local is None:
            raise NotImplementedError("a pure cluster client (member=False) has no local words")
        return self._local.word(name)

    def node_lock(self, key: str, timeout: float | None = None) -> Any:
        """``TieredStore.node_lock`` on this node's arena (a member or attached process)."""
        if self._local is None:
            raise NotImplementedError("a pure cluster client (member=False) has no node arena to lock; "
                                      "node_lock needs a process on a member's machine")
        return self._local.node_lock(key, timeout)

    def node_locks(self, keys: Iterable[str], timeout: float | None = None) -> Any:
        """``TieredStore.node_locks`` on this node's arena (a member or attached process)."""
        if self._local is None:
            raise NotImplementedError("a pure cluster client (member=False) has no node arena to lock; "
                                      "node_locks needs a process on a member's machine")
        return self._local.node_locks(keys, timeout)

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
        todo = _checked_spans(spans)
        n = tp.spans_nbytes(todo)
        dst = None
        if into is not None:
            dst = memoryview(into).cast("B")
            if dst.readonly or dst.nbytes != n:
                raise ValueError(f"into must be a writable buffer of {n} bytes (the spans' total)")
        out: list[Any] = []

        def land(_i: int, _meta: bytes, _n: int, fill: Any) -> None:
            buf = dst if dst is not None else memoryview(tp.alloc(n)).cast("B")
            fill(buf)
            out.append(buf)
        self.read_ranges_many([(key, todo)], land, prefer=[prefer])
        return out[0] if out else None

    def read_ranges_many(self, reads: Sequence[tuple[str, Iterable[tuple[int, int, int, int]]]],
                         land: Callable[[int, bytes, int, Callable[[Any], None]], None], *,
                         prefer: Sequence[Iterable[str]] = ()) -> list[bool]:
        """``read_ranges`` of several keys at once: read ``i`` is ``reads[i] = (key, spans)``,
        asked of the members in ``prefer[i]`` first. The reads served by one member travel
        as one pipelined batch (a request each, one round trip for all), the members in
        parallel, so a fetch of many small ranges costs little more than its bytes.

        For each read that some member holds, ``land(i, meta, nbytes, fill)`` is called,
        possibly from several threads at once: ``meta`` is the object's codec header,
        ``nbytes`` the packed spans' size, and ``land`` must call ``fill(buf)`` once with a
        writable buffer of ``nbytes``, which then receives the bytes straight from the
        socket (inside a ``put_with`` filler, say: one copy from the network into an arena
        block). Returns, per read, whether it was found; raises ``ClusterUnavailableError``
        when a read was found nowhere while a member that could hold it did not answer,
        ``ValueError`` for spans outside the object."""
        self._check_open()
        todo = []
        for key, spans in reads:
            key_bytes(key)
            todo.append((key, _checked_spans(spans)))
        found = [False] * len(todo)
        remote = []
        here = self._local is not None and self._router.reads_here()
        for i, (key, sp) in enumerate(todo):
            raw = self._local.get_raw(key) if here and self._local is not None else None
            if raw is not None:
                meta, body = raw
                land(i, meta, tp.check_spans(body.nbytes, sp), functools.partial(tp.gather_into, body, sp))
                found[i] = True
            else:
                remote.append(i)
        if remote:
            got = self._router.read_spans_many(
                [todo[i] for i in remote], lambda k, meta, n, fill: land(remote[k], meta, n, fill),
                [prefer[i] if i < len(prefer) else () for i in remote],
                skip=self._router.asked_here(self._local is not None))
            for i, ok in zip(remote, got):
                found[i] = ok
        return found

    @property
    def received_bytes(self) -> int:
        """Object payload bytes this process has received from members so far (all handles)."""
        return tp.RECEIVED.value

