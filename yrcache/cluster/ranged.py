"""Ranged reads of many keys for a cluster store's router: one pipelined batch of
``GETV`` frames per member, the members in parallel, each read going on to its
next member when one lacks the key or fails. ``Router`` inherits them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ClusterUnavailableError
from . import transport as tp

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from .member import Node
    from .membership import MemberInfo
    from .ring import Ring


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, what it raised)``."""
    try:
        return fn(*args), None
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller once every job is done
        return None, e


class RangedReads:
    """Mixed into ``Router``: needs ``owners``, ``peer``, ``last_late``, ``ring``, ``members``, ``node``
    and ``pool`` (the router's sending threads)."""

    if TYPE_CHECKING:
        ring: Ring
        members: dict[str, MemberInfo]
        node: Node | None

        def owners(self, key: str, r: int | None = None) -> list[str]: ...

        def peer(self, member_id: str) -> tp.Peer | None: ...

        def last_late(self, members: Iterable[str]) -> list[str]: ...

        def pool(self) -> ThreadPoolExecutor: ...

    def read_spans_many(self, reads: Sequence[tuple[str, list[tp.Span]]], land: tp.Land,
                        prefer: Sequence[Iterable[str]] = (), skip: str | None = None) -> list[bool]:
        """Ranged reads of several keys: each asked of its ``prefer``-red members first, then
        its owners, then the other members, until one holds it; the reads that go to one
        member travel as one pipelined batch (``Peer.getv_many``), the members in parallel.
        ``land(i, meta, nbytes, fill)`` takes the bytes of read ``i`` (see ``getv_many``),
        maybe from several threads at once. Returns whether each read was found; raises
        ``ClusterUnavailableError`` for a read found nowhere while a member that could hold
        it did not answer."""
        orders = []
        for i, (key, _spans) in enumerate(reads):
            first = prefer[i] if i < len(prefer) else ()
            orders.append(self.last_late(m for m in dict.fromkeys(itertools.chain(first, self.owners(key),
                                                                               self.ring.members)) if m != skip))
        found = [False] * len(reads)
        errors: list[list[str]] = [[] for _ in reads]
        tried = [0] * len(reads)
        todo = list(range(len(reads)))
        while todo:
            batches: dict[str, list[int]] = {}
            for i in todo:
                while tried[i] < len(orders[i]) and orders[i][tried[i]] not in self.members:
                    tried[i] += 1
                if tried[i] < len(orders[i]):
                    batches.setdefault(orders[i][tried[i]], []).append(i)
            jobs = [(m, idx, [reads[i] for i in idx]) for m, idx in batches.items()]
            futures = [self.pool().submit(self._read_batch, m, rs, land, idx) for m, idx, rs in jobs[1:]]
            outcomes = []
            for m, idx, rs in jobs[:1]:
                outcomes.append(_outcome(self._read_batch, m, rs, land, idx))
            outcomes += [_outcome(f.result) for f in futures]      # all done before anything raises
            for (m, idx, _), (res, exc) in zip(jobs, outcomes):
                if exc is not None:
                    raise exc
                statuses, error = res
                for i, st in zip(idx, statuses):
                    found[i] = bool(st)
                    tried[i] += 1
                    if st is None and error is not None:
                        errors[i].append(f"{m}: {error}")
            todo = [i for i in todo if not found[i] and tried[i] < len(orders[i])]
        for i, (key, _spans) in enumerate(reads):
            if not found[i] and errors[i]:
                raise ClusterUnavailableError(f"read of {key!r}: no member holding it answered "
                                              f"({'; '.join(errors[i])})")
        return found

    def _read_batch(self, m: str, reads: list[tuple[str, list[tp.Span]]], land: tp.Land,
                    index: list[int]) -> tuple[list[bool | None], ClusterUnavailableError | None]:
        """``reads`` from member ``m`` (this process's own node in place); ``land`` gets the
        caller's indices."""
        def land_as(k: int, meta: bytes, n: int, fill: Callable[[Any], None]) -> None:
            land(index[k], meta, n, fill)
        node = self.node
        if node is None or m != node.member_id:
            peer = self.peer(m)
            if peer is None:
                return [None] * len(reads), ClusterUnavailableError(f"member {m} left")
            return peer.getv_many(reads, land_as)
        out: list[bool | None] = []
        for k, (key, spans) in enumerate(reads):
            got = node.read(key)
            if got is not None:
                n = tp.check_spans(memoryview(got.buf).nbytes, spans)    # ValueError: outside it
                land_as(k, got.meta, n, functools.partial(tp.gather_into, got.buf, spans))
            out.append(got is not None)
        return out, None
