"""Cluster-wide counters in etcd, mirrored into every node's arena words.

A *shared word* is a named, monotonically rising 64-bit counter of one cluster:
etcd holds it under ``/yrcache/<cluster>/words/<name>`` (its decimal value), and
every process raises it with a compare-and-swap transaction. The member process
of each node watches that prefix (:class:`WordWatch`) and copies every new value
into the node's arena word of the same name, then wakes it. So a process waits
for a shared word exactly as for a local one (a futex, no polling, no etcd
connection per waiter), and the processes of the writer's own node are woken by
the writer itself, before etcd is even asked to tell the others.

``yrcache.rl`` keeps the record of a weight set (its newest complete version)
in such a word when the store is a cluster store.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import ClusterUnavailableError
from ..validate import wait_seconds
from .membership import Membership, _pyetcd, check_name

log = logging.getLogger("yrcache.cluster")

MAX_WORD_NAME = 200
RETRY_S = 15.0          # how long a write of a shared word waits for etcd to come back


def words_prefix(cluster: str) -> str:
    return f"/yrcache/{cluster}/words/"


def check_word_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_WORD_NAME \
            or any(not c.isprintable() or c.isspace() for c in name):
        raise ValueError(f"a shared word's name is a printable str of 1..{MAX_WORD_NAME} bytes without "
                         f"whitespace, got {name!r}")
    return name


def _enc(value: int) -> bytes:
    return b"%020d" % value


def raise_local(word: Any, value: int) -> bool:
    """Raise an arena word to ``value`` unless it is already as high; True if it rose."""
    while True:
        cur = word.value
        if cur >= value:
            return False
        if word.cas(cur, value):
            return True


class WordWatch(Membership):
    """The shared words of one cluster, listed and watched (re-armed after etcd restarts
    exactly like the member set): ``on_change({name: value})`` after every change."""

    def __init__(self, endpoints: str, cluster: str, on_change: Any) -> None:
        super().__init__(endpoints, cluster, "words", "-", on_change=on_change, register=False)
        self.prefix = words_prefix(check_name("cluster name", cluster))

    def _parse(self, key: bytes, value: bytes) -> Any:
        try:
            return int(value)
        except ValueError:
            self._warn("parse", f"ignoring malformed shared word {key!r}")
            return None


#: Why a cluster store's etcd-backed parts do not work in a forked child.
FORKED = ("this process was forked from the one that opened the cluster store, and etcd's client "
          "(gRPC) does not survive a fork: start workers with the 'spawn' or 'forkserver' method and "
          "open the store there (a forked child of a process attached to a node waits through the "
          "node's arena: only a pure client's child cannot)")


class ProcessWord:
    """An arena word's interface over this process's memory (a pure client has no arena)."""

    def __init__(self) -> None:
        self.value = 0
        self.seq = 0
        self.orphaned = False          # in a forked child: nothing mirrors etcd into it
        self._cond = threading.Condition()

    def cas(self, expected: int, desired: int) -> bool:
        with self._cond:
            if self.value != expected:
                return False
            self.value = desired
            return True

    def wait(self, seen: int, timeout: float | None) -> bool:
        if self.orphaned:
            raise ClusterUnavailableError(FORKED)
        t = wait_seconds(timeout)
        with self._cond:
            return self._cond.wait_for(lambda: self.seq != seen, t)

    def wake(self) -> None:
        with self._cond:
            self.seq += 1
            self._cond.notify_all()


class ProcessWords:
    """``word(name)`` for a :class:`Mirror` in a process without an arena."""

    def __init__(self) -> None:
        self._words: dict[str, ProcessWord] = {}
        self._lock = threading.Lock()

    def forked(self) -> None:
        """In a forked child: its words are not mirrored any more (the watch is the parent's)."""
        self._lock = threading.Lock()
        for w in self._words.values():
            w.orphaned = True
            w._cond = threading.Condition()

    def word(self, name: str) -> ProcessWord:
        with self._lock:
            w = self._words.get(name)
            if w is None:
                w = self._words[name] = ProcessWord()
            return w


class Mirror:
    """Copies every shared word of the cluster into ``local.word(name)``: the node's arena
    words in a member, a pure client's :class:`ProcessWords` in a client."""

    def __init__(self, local: Any, endpoints: str, cluster: str) -> None:
        self.local = local
        self.watch = WordWatch(endpoints, cluster, self._apply).start()
        self._apply(self.watch.members())   # type: ignore[arg-type]

    def _apply(self, values: dict[str, int]) -> None:
        for name, value in values.items():
            try:
                word = self.local.word(name)
            except Exception as e:      # noqa: BLE001 - a full word table must not stop the watch
                log.warning("cannot mirror shared word %r: %s", name, e)
                continue
            if raise_local(word, value):
                word.wake()

    def close(self) -> None:
        self.watch.close()


class SharedWord:
    """A cluster-wide counter (see the module docstring): the interface of an arena word
    (``value``, ``seq``, ``wait``, ``wake``, ``cas``) plus :meth:`raise_to`.

    ``value`` and the waits are the node's arena word (kept current by the member's
    watch, and by this handle's own writes); ``cas`` and ``raise_to`` go to etcd.
    """

    __slots__ = ("name", "key", "local", "_client")

    def __init__(self, name: str, cluster: str, client: Any, local: Any) -> None:
        self.name = check_word_name(name)
        self.key = words_prefix(cluster) + name
        self.local = local
        self._client = client

    @property
    def value(self) -> int:
        return self.local.value

    @property
    def seq(self) -> int:
        return self.local.seq

    def wait(self, seen: int, timeout: float | None) -> bool:
        return self.local.wait(seen, timeout)

    def wake(self) -> None:
        """Wake this node's waiters (other nodes' members wake theirs when etcd tells them)."""
        self.local.wake()

    def _etcd(self, fn: Any, *args: Any) -> Any:
        """One etcd call, retried while etcd is unreachable (a restart) for up to RETRY_S."""
        start, pause = time.monotonic(), 0.05
        deadline = start + RETRY_S
        while True:
            try:
                return fn(*args)
            except Exception as e:      # noqa: BLE001 - grpc and pyetcd errors alike
                if time.monotonic() + pause > deadline:
                    raise ClusterUnavailableError(
                        f"etcd did not answer for {time.monotonic() - start:.0f} s updating shared word {self.name!r}: {e!r}") from e
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    def read(self) -> int:
        """The value in etcd now (one round trip); also raises the local mirror to it."""
        raw, _ = self._etcd(self._client.get, self.key)
        value = 0 if raw is None else int(raw)
        raise_local(self.local, value)
        return value

    def _txn(self, compare: Any, value: int) -> bool:
        tx = _pyetcd().transactions
        ok, _ = self._etcd(self._client.transaction, [compare], [tx.Put(self.key, _enc(value))], [])
        return bool(ok)

    def cas(self, expected: int, desired: int) -> bool:
        """Set the counter to ``desired`` if etcd holds ``expected`` (0: no value yet)."""
        tx = _pyetcd().transactions
        ok = self._txn(tx.Value(self.key) == _enc(expected), desired)
        if not ok and expected == 0:
            ok = self._txn(tx.Version(self.key) == 0, desired)
        if ok:
            raise_local(self.local, desired)
        else:
            self.read()
        return ok

    def raise_to(self, value: int) -> bool:
        """Raise the counter to ``value`` unless it is already as high: one transaction
        (values are stored as 20 zero-padded digits, so etcd compares them as numbers).
        True if this call raised it."""
        tx = _pyetcd().transactions
        raised = self._txn(tx.Value(self.key) < _enc(value), value)
        if not raised:
            # as high already, or no value yet (a missing key compares false)
            raised = self._txn(tx.Version(self.key) == 0, value)
            if not raised:
                self.read()
        raise_local(self.local, value)
        return raised

    def __repr__(self) -> str:
        return f"<SharedWord {self.name!r} value={self.value}>"
