"""Node locks: locks every process of a machine using one store shares
(``TieredStore.node_lock``/``node_locks``). Each is one byte of an OFD lock on
the store's segment, far past the arena, chosen by a hash of the key; the kernel
drops it when its holder dies. A thread lock per stripe in use excludes the
threads of one process, which share the file description.

Presence bytes (``hold_presence``/``present``), past the lock bytes, tell the
node's processes that a process is still alive: it holds one read-locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from .tiers._diskutil import _F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW, _ofd_lock
from .tiers.segment import check_trusted, seg_path

_LOCK_STRIPES = 1 << 20               # node locks: one lock byte each, chosen by a hash of the key
_LOCK_BASE = 1 << 40                   # lock bytes far past the arena, beside nothing else
_lock_fds: dict[str, tuple[int, int]] = {}     # store name -> (pid, fd): OFD locks are per open file
_PRESENCE_BASE = _LOCK_BASE + _LOCK_STRIPES     # presence bytes: after the lock bytes
_PRESENCE_SLOTS = 1 << 30
_presence: set[tuple[str, int]] = set()         # (store name, byte) this process holds


class _StripeLocks:
    """This process's thread lock per node-lock stripe in use (an OFD lock does not
    exclude threads sharing the fd), made on demand and dropped when unused."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.locks: dict[int, list[Any]] = {}      # stripe -> [Lock, users]

    def acquire(self, stripe: int, timeout: float = -1) -> bool:
        with self.guard:
            entry = self.locks.setdefault(stripe, [threading.Lock(), 0])
            entry[1] += 1
        try:
            got = entry[0].acquire(timeout=timeout)
        except BaseException:
            self._drop(stripe)
            raise
        if not got:
            self._drop(stripe)
        return got

    def release(self, stripe: int) -> None:
        self.locks[stripe][0].release()
        self._drop(stripe)

    def _drop(self, stripe: int) -> None:
        with self.guard:
            entry = self.locks[stripe]
            entry[1] -= 1
            if not entry[1]:
                del self.locks[stripe]


_stripes = _StripeLocks()


def _fresh_thread_locks() -> None:       # a forked child must not inherit a parent thread's hold
    global _stripes
    _stripes = _StripeLocks()
    _presence.clear()                    # (the parent's, held by the parent's file description)


os.register_at_fork(after_in_child=_fresh_thread_locks)


def _lock_fd(name: str) -> int:
    got = _lock_fds.get(name)
    if got is not None and got[0] == os.getpid():
        return got[1]
    path = seg_path(name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)   # (a forked child's own)
    try:
        check_trusted(os.fstat(fd), path)       # not another user's file under our store's name
    except BaseException:
        os.close(fd)
        raise
    _lock_fds[name] = (os.getpid(), fd)
    return fd


def _ofd_wait(fd: int, byte: int, deadline: float) -> bool:
    """Write-lock ``byte`` of ``fd``, trying until ``deadline`` (``time.monotonic()``):
    the kernel has no timed wait for an OFD lock, so poll, every 0.2 ms at first and
    at most every 5 ms. Whether it was taken."""
    pause = 0.0002
    while True:
        try:
            _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_WRLCK, byte)
            return True
        except (BlockingIOError, PermissionError):       # EAGAIN / EACCES: held elsewhere
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.005)


@contextlib.contextmanager
def node_locks(name: str, keys: Iterable[str], timeout: float | None = None) -> Iterator[None]:
    """Hold the node-lock stripes of ``keys``, taken in increasing order (so two holders
    of several never wait for each other in a circle), each the thread lock, then the
    OFD lock; let go in reverse. With ``timeout`` (seconds), ``TimeoutError`` once
    they are not all held by then (none is held after it)."""
    stripes = sorted({zlib.crc32(k.encode()) % _LOCK_STRIPES for k in keys})
    fd = _lock_fd(name)
    locks, held = _stripes, []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for stripe in stripes:
            if deadline is None:
                locks.acquire(stripe)
            elif not locks.acquire(stripe, max(0.0, deadline - time.monotonic())):
                raise _busy(name, len(stripes), timeout)
            try:
                if deadline is None:
                    _ofd_lock(fd, _F_OFD_SETLKW, fcntl.F_WRLCK, _LOCK_BASE + stripe)
                elif not _ofd_wait(fd, _LOCK_BASE + stripe, deadline):
                    raise _busy(name, len(stripes), timeout)
            except BaseException:
                locks.release(stripe)
                raise
            held.append(stripe)
        yield
    finally:
        for stripe in reversed(held):
            try:
                _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_UNLCK, _LOCK_BASE + stripe)
            finally:
                locks.release(stripe)


def _busy(name: str, n: int, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"{n} node lock(s) of store {name!r} still held by another process or thread "
                        f"after {timeout} s")


def hold_presence(name: str) -> int:
    """Read-lock a presence byte of store ``name``'s segment, free in this process, until
    ``drop_presence`` or this process dies; returns it (for ``present``)."""
    fd = _lock_fd(name)
    byte = _PRESENCE_BASE + secrets.randbelow(_PRESENCE_SLOTS)
    while (name, byte) in _presence:
        byte = _PRESENCE_BASE + secrets.randbelow(_PRESENCE_SLOTS)
    _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_RDLCK, byte)
    _presence.add((name, byte))
    return byte


def drop_presence(name: str, byte: int) -> None:
    """Let go of a byte ``hold_presence`` returned in this process (else a no-op)."""
    if (name, byte) in _presence:
        _presence.discard((name, byte))
        _ofd_lock(_lock_fd(name), _F_OFD_SETLK, fcntl.F_UNLCK, byte)


def present(name: str, byte: int) -> bool:
    """Whether a live process (this one included) holds presence byte ``byte`` of ``name``."""
    if (name, byte) in _presence:
        return True
    if not _PRESENCE_BASE <= byte < _PRESENCE_BASE + _PRESENCE_SLOTS:
        return False
    return _ofd_lock(_lock_fd(name), _F_OFD_GETLK, fcntl.F_WRLCK, byte) != fcntl.F_UNLCK
