"""Waiting for the process of a node that lands spans, unless it is stopped.

The first process of a node to fetch some spans pulls them and lands them in the
node's arena while it holds their node locks; the node's other processes fetching
the same spans wait for those locks, then read the spans there. A holder that
dies lets go (the kernel drops its locks), but one that is stopped (SIGSTOP,
Ctrl-Z, a debugger at a breakpoint) holds them for as long as it stays stopped,
and every process waiting behind it would hang with it. So a lander names itself
in the node's arena (``LANDERS``: its pid, the start time of that pid, its pid
namespace) while it holds the locks, and a waiter that has waited ``PATIENCE_S``
looks at the landers: if one of them is stopped, it stops waiting and pulls the
spans itself, privately. A slow lander that runs is waited for, however long it
takes, so a node still pulls a span once. Getting it wrong costs bytes, never
correctness: a waiter that gives up pulls what it needs from the members.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
import uuid
from typing import Any

import numpy as np

from ..errors import StoreFullError

log = logging.getLogger(__name__)

LANDERS = "__node__/rl-landers/"  # + 32 hex digits: one record per landing in progress
PATIENCE_S = 1.0                  # how long a waiter waits before it looks at the landers
_RECORD = struct.Struct("<QQQ")   # pid, its start time (clock ticks after boot), pid namespace inode


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of process ``pid`` (``/proc/<pid>/stat``), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()     # (the command name may hold spaces and parens)
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _me() -> bytes:
    """This process's record (made once per process: a forked child makes its own)."""
    return _record_of(os.getpid())


@functools.lru_cache(maxsize=4)
def _record_of(pid: int) -> bytes:
    stat = _proc_stat(pid)
    return _RECORD.pack(pid, stat[1] if stat else 0, _pid_namespace())


def lander_stopped(node: Any) -> bool:
    """Whether a process landing spans in ``node``'s arena is stopped (records of landers
    that have died are deleted on the way). A lander in another pid namespace than ours
    counts as running: its pid means nothing here."""
    keys = list(node.keys(prefix=LANDERS))
    if not keys:
        return False
    ns = _pid_namespace()
    for key, rec in zip(keys, node.mget(keys)):
        raw = b"" if rec is None else bytes(np.asarray(rec, np.uint8))
        if len(raw) != _RECORD.size:
            continue
        pid, start, their_ns = _RECORD.unpack(raw)
        if their_ns != ns:
            continue
        stat = _proc_stat(pid)
        if stat is None or stat[1] != start:       # it died (its pid may be another's now)
            node.delete(key)
            continue
        if stat[0] in ("T", "t"):
            return True
    return False


@contextlib.contextmanager
def landing(node: Any, keys: list[str]) -> Any:
    """Hold the node locks of ``keys`` (cache keys of spans this process may land), named
    as their lander: yields True; or yields False, holding nothing, when a process
    holding some of them is stopped (the caller pulls them privately instead)."""
    with contextlib.ExitStack() as stack:
        while not _enter(stack, node.node_locks(keys, timeout=PATIENCE_S)):
            if lander_stopped(node):
                log.warning("a process of this node landing weight spans is stopped; pulling "
                            "%d part(s) without it", len(keys))
                break
        else:
            record = LANDERS + uuid.uuid4().hex
            try:
                node.put(record, np.frombuffer(_me(), np.uint8))
                stack.callback(_forget, node, record)
            except (StoreFullError, MemoryError):
                pass                       # unnamed: a waiter behind it waits, as it always could
            yield True
            return
        yield False


def _enter(stack: contextlib.ExitStack, locks: Any) -> bool:
    try:
        stack.enter_context(locks)
        return True
    except TimeoutError:
        return False


def _forget(node: Any, record: str) -> None:
    try:
        node.delete(record)
    except Exception:  # noqa: BLE001 - a closed store: a waiter drops the record once we are gone
        pass
