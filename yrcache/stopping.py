"""An owner asked to stop (SIGTERM, SIGHUP) removes its stores' names first.

Python's default action for these signals ends the process at once: no ``finally``, no
``atexit``, so an owner stopped by ``timeout``, Slurm or Kubernetes left its segment (and the
memory in it) in ``/dev/shm``. When a process creates or adopts a store from its main thread
and the signal still has its default action, yrcache installs a handler that does what the
owner's ``close()`` does to the name (``Arena.release_handle``: only a name, no lock taken),
then restores the default action and sends the signal again, so the process ends as it would
have, with the same status. A program that handles the signal itself keeps its handler (and
should close its stores there). A forked child starts with the default action (the forking
thread holds the signals back until the child has it).
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from typing import Any

__all__ = ["watch"]

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_owned: weakref.WeakSet[Any] = weakref.WeakSet()    # arenas this process owns
_installed: set[int] = set()
_mask: list[Any] = []             # the forking thread's signal mask, while it forks


def watch(arena: Any) -> None:
    """Remove ``arena``'s name (unless it persists) if this process is told to stop."""
    _owned.add(arena)
    if threading.current_thread() is not threading.main_thread():
        return                  # signal.signal works in the main thread only
    for sig in SIGNALS:
        if sig not in _installed and signal.getsignal(sig) is signal.SIG_DFL:
            try:
                signal.signal(sig, _stop)
            except ValueError:  # not the main interpreter
                return
            _installed.add(sig)


def _before_fork() -> None:
    # A child must not start with the handler: Python drops a signal that reaches a child
    # before its after-fork reset, so a child signalled at once (p.start(); p.terminate())
    # would live on. The forking thread (any thread: the mask is per thread, and the child
    # inherits it) holds the signals back until the child has the default action again.
    _mask.clear()
    if _installed:
        _mask.append(signal.pthread_sigmask(signal.SIG_BLOCK, _installed))


def _after_fork_in_parent() -> None:
    if _mask:
        signal.pthread_sigmask(signal.SIG_SETMASK, _mask.pop())


def _after_fork_in_child() -> None:
    _owned.clear()              # it owns no store (a store it makes installs the handler again)
    for sig in list(_installed):
        try:
            if signal.getsignal(sig) is _stop:
                signal.signal(sig, signal.SIG_DFL)   # (the forking thread is the child's main one)
        except ValueError:
            pass
    _installed.clear()
    if _mask:                   # a signal held back is delivered now, with the default action
        signal.pthread_sigmask(signal.SIG_SETMASK, _mask.pop())


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _stop(signum: int, frame: Any) -> None:
    pid = os.getpid()
    for arena in list(_owned):
        if arena.pid == pid:    # (a forked child inherits the handler, not the ownership)
            try:
                arena.release_handle()
            except Exception:   # noqa: BLE001 - the process is going; the others still go
                pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(pid, signum)
