"""A member's background threads' base, and its :class:`Rebalancer`.

After each membership change (again a few seconds later), the rebalancer compares
every local object's owners with what those owners hold (pipelined ``HAVE`` queries)
and queues what is missing or misplaced; every ``YRCACHE_REPAIR_S`` it does the same
for the objects written since its last pass (a write that missed an owner), and every
tenth time for all of them. It also runs a rejoining member's catch-up
(:meth:`Rebalancer.catch_up`, see ``catchup``).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import StoreClosedError
from .catchup import REJOIN_SETTLE_S, ask_have, drop_stale
from .replication import MOVING_S, REPAIR_S, SETTLE_S, Version

if TYPE_CHECKING:
    from .member import Node

log = logging.getLogger("yrcache.cluster")


class _Worker:
    """A daemon thread running ``_loop`` over a condition variable, stopped by ``close``."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)


def _surplus(node: Any, key: str) -> bool:
    """Whether this member's copy of ``key`` may go: the ring names owners of it, none of them
    this member (the caller also checks that the ring it sees includes this member).  A ring
    with no members, or without this one, says nothing about who holds what: it is what a
    member sees when every member was stopped past its lease, or etcd came back empty, and
    dropping then lost every copy."""
    owners = node.owners(key)
    return bool(owners) and node.member_id not in owners


#: A periodic pass checks only the objects written since the previous pass began (a write
#: that missed an owner), less this much for writers' clocks that run behind; every
#: ``FULL_EVERY``-th periodic pass, and every pass after a membership change, checks all.
SKEW_S = 10.0
FULL_EVERY = 10


class Rebalancer(_Worker):
    """Finds local objects whose owners lack them (after joins, leaves and deaths), and
    every ``YRCACHE_REPAIR_S`` those written since its last pass that an owner lacks."""

    def __init__(self, node: Node):
        super().__init__("yrcache-rebalance")
        self.node = node
        self._due: float | None = time.monotonic()
        self._full = True               # the next pass checks every object, not only recent writes
        self._since = 0                 # a periodic pass checks the objects written from this hlc on
        self._since_full = 0            # periodic passes since the last full one
        self.passes = 0
        self.full_passes = 0
        self.under_replicated = 0
        self._rejoin: tuple[float, Callable[[], None], int] | None = None    # catch_up's second pass
        self._thread.start()

    def poke(self) -> None:
        """Check every object soon (the member set changed)."""
        with self._cv:
            self._due = time.monotonic()
            self._full = True
            self._cv.notify_all()

    def catch_up(self, done: Callable[[], None]) -> None:
        """``Membership``'s ``on_rejoin``: drop the copies the cluster wrote past while this
        member was out of it, now and again once every writer sees it back (this thread,
        ``REJOIN_SETTLE_S`` later), then ``done()`` (see ``catchup``)."""
        dropped = self._drop_stale()
        if dropped is None:
            return
        with self._cv:
            self._rejoin = (time.monotonic() + REJOIN_SETTLE_S, done, dropped)
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop:
                    now, at = time.monotonic(), min(self._due or math.inf, self._rejoin[0] if self._rejoin else math.inf)
                    if at <= now:
                        break
                    self._cv.wait(None if at == math.inf else at - now)
                if self._stop:
                    return
                rejoin = self._rejoin if self._rejoin and self._rejoin[0] <= time.monotonic() else None
                if rejoin is not None:
                    self._rejoin = None
                else:
                    self._due = None
                    full, self._full = self._full or self._since_full >= FULL_EVERY - 1, False
            if rejoin is not None:
                self._second_pass(*rejoin[1:])
                continue
            try:
                again = self.run_pass(full)
            except StoreClosedError:
                return
            except Exception as e:      # noqa: BLE001 - logged, tried again
                log.warning("rebalancing pass failed: %s", e)
                again = True
            with self._cv:
                self._full |= again
                self._since_full = 0 if full else self._since_full + 1
                if self._due is None:       # also a periodic pass: repairs what a failed write missed
                    self._due = time.monotonic() + (SETTLE_S if again else REPAIR_S)

    def _drop_stale(self) -> int | None:
        """``drop_stale``; None once the store is closed (0 when it failed: rebalancing
        finds the rest)."""
        try:
            return drop_stale(self.node)
        except StoreClosedError:
            return None
        except Exception as e:          # noqa: BLE001 - logged; the next pass goes on
            log.warning("catching up failed: %s", e)
            return 0

    def _second_pass(self, done: Callable[[], None], dropped: int) -> None:
        more = self._drop_stale()
        if more is None:
            return
        dropped += more
        log.warning("this member is back in the cluster after etcd dropped it: %d copies the "
                    "others had written past or deleted meanwhile were dropped", dropped)
        done()

    def drop_surplus(self, surplus: list[tuple[str, Version]]) -> None:
        """Drop this member's copies of keys every owner holds. Within ``MOVING_S`` of a
        member-set change a reader whose ring is older than ours (its watch is behind) still
        asks us first: then they stay, and a full pass runs again once the moment has passed."""
        if not surplus:
            return
        if not self.node.router.moving():
            for k, v in surplus:
                self.node.drop_if(k, v)
            return
        with self._cv:
            self._full = True
            self._due = min(self._due or math.inf, self.node.router.moved_at + MOVING_S + 0.1)
            self._cv.notify_all()

    def run_pass(self, full: bool = True) -> bool:
        """One pass over the local objects (``full`` False: only those written since the
        last pass began, less ``SKEW_S``); True if something still needs doing."""
        node, router = self.node, self.node.router
        me = node.member_id
        start = (time.time_ns() // 1000 - int(SKEW_S * 1e6)) << 8      # an hlc (fast_own.c)
        want: dict[str, list[tuple[str, Version]]] = collections.defaultdict(list)
        since = 0 if full else self._since
        mine = [(k, v) for k, v in list(node.versions.items()) if v[0] >= since]
        for k, v in mine:
            for o in node.owners(k):
                if o != me:
                    want[o].append((k, v))
        missing: dict[str, list[str]] = collections.defaultdict(list)
        deleted: set[str] = set()       # an owner deleted it after our write
        incomplete = False
        for m, chunk, bits in ask_have(router, want):
            if bits is None:
                incomplete = True
                continue
            for (k, _), b in zip(chunk, bits):
                if not b:
                    missing[k].append(m)
                elif b == 2:
                    deleted.add(k)
        moved = 0
        settled = me in router.members
        surplus = []
        for k, v in mine:
            targets = tuple(missing.get(k, ()))
            if k in deleted:
                node.drop_if(k, v)
            elif targets:
                node.forwarder.add(k, v, targets)
                moved += 1
            elif not incomplete and settled and _surplus(node, k):
                surplus.append((k, v))       # every owner has it: our copy is surplus
        self.drop_surplus(surplus)
        self.under_replicated = moved          # an incremental pass follows one that found none
        self.passes += 1
        self.full_passes += full
        if not incomplete:
            self._since = start
        if moved:
            log.info("rebalancing: %d of %d objects queued for their owners", moved, len(mine))
        return incomplete or bool(moved)
