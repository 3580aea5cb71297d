"""An owner asked to stop (SIGTERM, SIGHUP) removes its stores' names first.

Python's default action for these signals ends the process at once: no ``finally``, no
``atexit``, so an owner stopped by ``timeout``, Slurm or Kubernetes left its segment (and the
memory in it) in ``/dev/shm``. When a process creates or adopts a store from its main thread
and the signal still has its default action, yrcache installs a handler that does what the
owner's ``close()`` does to the name (``Arena.release_handle``: only a name, no lock taken),
then restores the default action and sends the signal again, so the process ends as it would
have, with the same status. A program that handles the signal itself keeps its handler (and
should close its stores there). A forked child starts with the default action.
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
_paused: list[int] = []           # handlers set to the default action while forking


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
    # A child must not start with the handler: Python drops a signal that arrives before
    # its after-fork reset, so a child signalled at once (p.start(); p.terminate()) would
    # live on. It owns no store anyway; it gets the default action (a fork from another
    # thread cannot change handlers: that child keeps this one, which ends it as before).
    _paused.clear()
    if threading.current_thread() is threading.main_thread():
        for sig in _installed:
            if signal.getsignal(sig) is _stop:
                signal.signal(sig, signal.SIG_DFL)
                _paused.append(sig)


def _after_fork_in_parent() -> None:
    for sig in _paused:
        signal.signal(sig, _stop)
    _paused.clear()


def _after_fork_in_child() -> None:
    _installed.difference_update(_paused)     # (a store the child makes installs it again)
    _paused.clear()
    _owned.clear()


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
