"""An owner asked to stop (SIGTERM, SIGHUP) removes its stores' names first.

Python's default action for these signals ends the process at once: no ``finally``, no
``atexit``, so an owner stopped by ``timeout``, Slurm or Kubernetes left its segment (and the
memory in it) in ``/dev/shm``. When a process creates or adopts a store from its main thread
and the signal still has its default action, yrcache installs a handler that does what the
owner's ``close()`` does to the name (``Arena.release_handle``: only a name, no lock taken),
then restores the default action and sends the signal again, so the process ends as it would
have, with the same status. A program that handles the signal itself keeps its handler (and
should close its stores there).
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
