"""Which spans the subscribers of one node pull, so a fetch shares only what another wants.

A fetch over a cluster store lands the spans it pulls in the node's arena, where
the node's other processes fetching the same spans read them zero-copy. Landing
costs a copy: from the arena into the result. So each subscriber records in the
node's arena (``Wants``) the spans it pulled last, and a fetch lands only the spans
another live subscriber of the node pulled last time; it receives the rest
privately, straight into its result tensors where their bytes are one contiguous
run of a result. A subscriber's first fetch lands everything (processes that
start together pull each span once), and a subscriber that has waited but not
fetched yet wants everything (a process that has just joined gets its first
version from the arena). A record is live while its process is: it holds a shared
OFD lock on one byte of the store's segment, which the kernel lets go when the
process dies. Getting it wrong costs bytes, never correctness: a span nobody
landed is pulled by whoever needs it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from .. import node_locks
from ..errors import StoreFullError

WANTS = "__node__/rl-wants/"      # + weight set name + "/" + subscriber id (32 hex digits)
_ALL = 1                          # flag: wants everything (waited, not fetched yet)
_HEAD = 9                         # presence byte (8 bytes, little-endian), flags (1 byte)
_ID = 16                          # bytes of one span id


def span_ids(name: str, refs: tuple, spans: list[list[tuple]]) -> list[bytes]:
    """A version-free id per stored part of a fetch: its weight set, tensor, rank and spans."""
    return [hashlib.blake2b(repr((name, ref, sp)).encode(), digest_size=_ID).digest()
            for ref, sp in zip(refs, spans)]


class Wants:
    """One subscriber's record in its node's arena (``node`` None: a pure client, which
    shares with nobody and receives everything privately)."""

    def __init__(self, node: Any, name: str) -> None:
        self.node, self.name = node, name
        self.prefix = f"{WANTS}{name}/"
        self.key = self.prefix + uuid.uuid4().hex
        self.presence = -1             # the byte this subscriber holds locked while alive
        self.fetched = False
        self._lock = threading.Lock()  # (a subscriber may be shared by threads)

    def _record(self, flags: int, ids: list[bytes]) -> None:
        with self._lock:
            if self.presence < 0:
                self.presence = node_locks.hold_presence(self.node.name)
                weakref.finalize(self, _forget, self.node, self.key, self.presence, os.getpid())
        head = self.presence.to_bytes(8, "little") + bytes([flags])
        try:
            self.node.put(self.key, np.frombuffer(head + b"".join(sorted(set(ids))), np.uint8))
        except (StoreFullError, MemoryError):
            pass                       # no room: the others land less for us (bytes, not errors)

    def present(self) -> None:
        """Before a first fetch (``wait``): record that this subscriber wants everything."""
        if self.node is not None and self.presence < 0:
            self._record(_ALL, [])

    def private(self, ids: list[bytes]) -> list[bool]:
        """Record ``ids`` as this fetch's spans; per id, whether no other live subscriber of
        the node wants it, so it need not land in the node's arena. All False on a first
        fetch or while another subscriber wants everything; all True for a pure client."""
        if self.node is None:
            return [True] * len(ids)
        first, self.fetched = not self.fetched, True
        self._record(0, ids)
        if first:
            return [False] * len(ids)
        others = self._others()
        if others is None:
            return [False] * len(ids)
        return [i not in others for i in ids]

    def _others(self) -> set[bytes] | None:
        """The span ids other live subscribers of this weight set want (None: everything)."""
        node, n = self.node, len(self.prefix)
        keys = [k for k in node.keys(prefix=self.prefix) if k != self.key and len(k) == n + 32]
        out: set[bytes] = set()
        for k, rec in zip(keys, node.mget(keys) if keys else ()):
            raw = b"" if rec is None else bytes(np.asarray(rec, np.uint8))
            if len(raw) < _HEAD or (len(raw) - _HEAD) % _ID:
                continue
            if not node_locks.present(node.name, int.from_bytes(raw[:8], "little")):
                node.delete(k)             # its process died: the record goes with it
                continue
            if raw[8] & _ALL:
                return None
            out.update(raw[i:i + _ID] for i in range(_HEAD, len(raw), _ID))
        return out


def _forget(node: Any, key: str, presence: int, pid: int) -> None:
    if os.getpid() != pid:             # a forked child's copy: the record is its parent's
        return
    try:
        node.delete(key)
    except Exception:  # noqa: BLE001 - a closed store: the record is stale and gets dropped by others
        pass
    node_locks.drop_presence(node.name, presence)
