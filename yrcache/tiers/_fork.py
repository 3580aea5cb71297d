"""What happens to arena mappings across ``fork`` and at exit.

Fork: the parent pins every live view once more just before the fork, and
the child takes those pins over into a slot of its own right after it (the
child could not pin them itself in time: between the fork and its first step
the parent may drop a view and the block be reused).  The child also opens
its own descriptor of each segment: the inherited one shares the parent's
open file description, and with it the parent's slot lock.

Exit: an owner's store is removed (unless it persists) and every slot of
this process is given back, from ``atexit`` and from multiprocessing's
finalizers (its children leave by ``os._exit``).  Nothing is unmapped at
exit: code that runs later may still hold views.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from typing import Any

#: Every live arena mapping of this process (dram.Arena adds itself).
ARENAS: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: This process's pid, kept current across forks (os.getpid() is a syscall,
#: and the hot paths ask for it).
PID = os.getpid()


def _before_fork() -> None:
    for arena in list(ARENAS):
        arena.fork_pins, arena.fork_unpinned = [], 0
        try:
            if not arena.mapped or arena.pid != os.getpid() or not arena.attached_here:
                continue
            with arena._lock:
                views = list(arena.views.items())
            for pin, block in views:
                extra = arena.pin_block(block)
                if extra > 0:
                    arena.fork_pins.append((pin, extra, block))
                else:
                    arena.fork_unpinned += 1
        except Exception:
            pass


def _after_fork_in_parent() -> None:
    for arena in list(ARENAS):
        arena.fork_pins = []   # they belong to the child now


def _after_fork_in_child() -> None:
    global _exit_hook_pid, PID
    _exit_hook_pid = 0
    PID = os.getpid()
    for arena in list(ARENAS):
        try:
            _adopt_in_child(arena)
        except Exception:  # never break the child over a store it may not use
            pass


def _adopt_in_child(arena) -> None:
    """Own the pins the parent took for us; register a slot lazily otherwise."""
    arena.hot.slot = 0       # the C hot paths wait for the child's own slot
    arena._lock = threading.Lock()
    arena.is_owner = False   # ownership stays with the process that created the store
    arena.handle = False     # the parent's handle; a child's store object re-opens it
    _reopen_fd(arena)
    parent, parent_slot = arena.pid, arena._slot
    handed = getattr(arena, "fork_pins", [])
    unpinned = getattr(arena, "fork_unpinned", 0)
    arena.fork_pins = []
    arena.views, arena.remap = {}, {}
    arena.attached_here = False
    if unpinned:
        warnings.warn(
            f"yrcache: {unpinned} view(s) of store {arena.name!r} inherited across fork could not "
            "be pinned for this child (the arena has no room for more pins); they may change "
            "under it. Release views before forking, or give the store more dram=",
            RuntimeWarning, stacklevel=1)
    if not arena.mapped or parent == os.getpid() or not handed:
        return
    arena.register()
    for old, pin, block in handed:
        if arena.transfer_pin(pin, parent_slot):
            arena.remap[(parent, old)] = pin
            arena.views[pin] = block


def _reopen_fd(arena) -> None:
    """A descriptor of the child's own: an inherited one shares the parent's open
    file description, and with it the parent's slot lock."""
    if arena._fd < 0:
        return
    try:
        fd = os.open(f"/proc/self/fd/{arena._fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        fd = -1
    os.close(arena._fd)
    arena._fd = fd


def _detach_all() -> None:
    """At exit: an owner's store goes (unless it persists), and this process's
    slots are given back."""
    for arena in list(ARENAS):
        try:
            if arena.mapped and arena.pid == os.getpid():
                arena.release_handle()
                arena.detach()
        except Exception:
            pass


_exit_hook_pid = 0
_FORK_TOKEN = type("_ForkToken", (), {})()


def _reinstall_exit_hook(_token) -> None:
    # multiprocessing clears its finalizers in a forked child after our
    # at-fork hook ran: install ours again if this process holds a slot.
    global _exit_hook_pid
    _exit_hook_pid = 0
    if any(a.mapped and a.pid == os.getpid() for a in list(ARENAS)):
        install_exit_hook()


def install_exit_hook() -> None:
    """atexit, and multiprocessing's finalizers (its children leave by os._exit)."""
    global _exit_hook_pid
    if _exit_hook_pid == os.getpid():
        return
    _exit_hook_pid = os.getpid()
    atexit.register(_detach_all)
    from multiprocessing import util

    util.Finalize(None, _detach_all, exitpriority=-100)


def _register_hooks() -> None:
    from multiprocessing import util

    util.register_after_fork(_FORK_TOKEN, _reinstall_exit_hook)
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


_register_hooks()
