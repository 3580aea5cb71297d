"""A member's catch-up after etcd dropped it and it registered again.

A member whose lease ran out while it could not refresh it (a stopped or paused
process, a suspended VM, a partition from etcd), or whose key etcd lost, was out of
every ring for a while: the writes and deletes of its keys went to the other
members. Its copies of those keys are old when it comes back; serving them would
return old values and bring back deleted keys. So, before it puts its key again,
the member asks the owners of each of its objects (in the ring with it and in the
ring without it) whether they hold a newer write or delete of it, and drops every
copy one of them does (:func:`drop_stale`). It registers marked ``catching_up``
(``MemberInfo``): every process, its own node's too, reads from it last. Once the
writers see it again (``REJOIN_SETTLE_S``) it asks once more, for what was written
between the first pass and its return, then clears the mark.

A delete is remembered ``TOMBSTONE_S`` (60 s): a member out of the cluster for
longer can bring back a key deleted meanwhile that no other member holds.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ClusterUnavailableError
from . import transport as tp
from .ring import Ring

if TYPE_CHECKING:
    from .member import Node

log = logging.getLogger("yrcache.cluster")

#: After registering again, how long a rejoining member waits before its second pass:
#: the time every writer takes to see it in the ring (an etcd watch event) and so to
#: send it the writes it would otherwise miss.
REJOIN_SETTLE_S = 1.0
#: Objects asked about per ``HAVE`` request.
CHUNK = 2000


def ask_have(router: Any, want: dict[str, list[tuple[str, tuple[int, int]]]]
             ) -> Iterator[tuple[str, list[tuple[str, tuple[int, int]]], bytes | None]]:
    """Ask each member ``m`` of ``want`` which of ``want[m]`` (key, version) it holds at
    that version or newer (``HAVE``, ``CHUNK`` entries a request): yields ``(m, entries,
    answer)``, one byte per entry (``Node.have``), or answer None for the entries of a
    member that left or did not answer (the rest of its entries at once)."""
    for m, entries in want.items():
        peer = router.peer(m)
        if peer is None:
            yield m, entries, None
            continue
        for i in range(0, len(entries), CHUNK):
            chunk = entries[i:i + CHUNK]
            try:
                bits = peer.have(chunk)
            except (ClusterUnavailableError, tp.RemoteError, OSError):
                yield m, entries[i:], None
                break
            yield m, chunk, bits


def drop_stale(node: Node) -> int:
    """Drop each local copy of which an owner holds a newer write or delete; return how
    many went. Owners that do not answer are skipped (logged)."""
    me, router = node.member_id, node.router
    ring = router.ring
    without = Ring([m for m in ring.members if m != me]) if me in ring else ring
    ask: dict[str, list[tuple[str, tuple[int, int]]]] = collections.defaultdict(list)
    for key, (hlc, writer) in list(node.versions.items()):
        r = 1 if key in node.single else router.replicas
        for m in dict.fromkeys(itertools.chain(ring.owners(key, r), without.owners(key, r))):
            if m != me:
                ask[m].append((key, (hlc, writer + 1)))     # "newer than ours": HAVE asks for >=
    dropped = 0
    for m, chunk, bits in ask_have(router, ask):
        if bits is None:
            log.warning("catching up: member %s did not answer; its newer copies are found by rebalancing", m)
            continue
        for (key, (hlc, writer)), b in zip(chunk, bits):
            if b and key in node.versions:
                node.drop_if(key, (hlc, writer - 1))
                dropped += key not in node.versions
    return dropped
