"""Shared-memory segments by name: naming, opening owner-only, allocation, trust, removal.

No C here: ``dram.py`` maps what this opens.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re

import posix_ipc

from ..errors import StoreFullError, StoreNotFoundError, UntrustedStoreError
from ..sizes import format_size

PREFIX = "/yrcache."
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SHM_DIR = "/dev/shm"


def check_name(name: object) -> str:
    """Validate a store name (it becomes a file name under /dev/shm)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid store name {name!r}: use 1-200 characters from letters, digits, '.', '_' and '-'"
        )
    return name


def shm_name(name: str) -> str:
    return PREFIX + check_name(name)


def seg_path(name: str) -> str:
    return SHM_DIR + shm_name(name)


def list_stores() -> list[str]:
    """Names of the yrcache stores on this node (segments in /dev/shm)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(PREFIX) - 1:] for e in entries if e.startswith(PREFIX[1:]))


def proc_starttime(pid: int | None = None) -> int:
    """Start time of a process in clock ticks (shown by ``yrcache stat``; 0 if unknown)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    return int(data[data.rindex(b")") + 2:].split()[19])


def check_trusted(st: os.stat_result, path: str) -> None:
    """Refuse a segment that is not ours alone (another user's, or open to others)."""
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UntrustedStoreError(
            f"{path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}; yrcache maps only "
            f"segments owned by you (uid {os.geteuid()}) that nobody else can read or write (0600). "
            "If you do not know who made it, do not use it: remove it (as its owner or root) or "
            "pick another store name"
        )


def unlink_if(name: str, ident: tuple[int, int] | None) -> bool:
    """Unlink the segment ``name`` if it is still the one with (st_dev, st_ino) ``ident``."""
    try:
        fd = os.open(seg_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if ident is not None and (st.st_dev, st.st_ino) != ident:
        return False
    return destroy(name)


def destroy(name: str) -> bool:
    """Unlink a store's segment by name; processes that have it mapped keep it."""
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


def open_segment(name: str, create: bool, size: int) -> tuple[int, bool]:
    """(fd, created): our own descriptor of the segment, created 0600 if asked."""
    shm = None
    created = False
    if create:
        try:
            shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=0o600, size=size)
            created = True
        except posix_ipc.ExistentialError:
            pass
    if shm is None:
        try:
            shm = posix_ipc.SharedMemory(shm_name(name))
        except posix_ipc.ExistentialError:
            raise StoreNotFoundError(
                f"no store named {name!r} on this node (no {seg_path(name)}); "
                "create it with TieredStore(name=...) first"
            ) from None
        except posix_ipc.PermissionsError:
            raise UntrustedStoreError(
                f"{seg_path(name)} exists but is not yours to open; pick another store name"
            ) from None
    try:
        fd = os.dup(shm.fd)   # close-on-exec; kept for the slot lock
    finally:
        shm.close_fd()
    # The creator holds an exclusive flock until it is registered as the owner, an
    # opener a shared one until it has checked the arena and registered (both end
    # with creation_done, or by closing fd). So an opener either finds no arena yet
    # (and the creator waits for it to leave) or a creator already registered: a
    # concurrent create of the same name never adopts a live creator's arena.
    fcntl.flock(fd, fcntl.LOCK_EX if created else fcntl.LOCK_SH)
    return fd, created


def creation_done(fd: int) -> None:
    """This process is registered in the arena: release open_segment's flock."""
    fcntl.flock(fd, fcntl.LOCK_UN)


def allocate(fd: int, name: str, size: int) -> None:
    """Give the new segment ``fd`` all its memory now: an over-committed /dev/shm
    fails here with StoreFullError, not later with SIGBUS at a first write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        raise no_room(name, size, e.strerror) from None


def no_room(name: str, size: int, why: str | None) -> StoreFullError:
    """The error for a new segment that /dev/shm cannot back."""
    return StoreFullError(
        f"cannot create store {name!r}: {SHM_DIR} has no room for {format_size(size)} ({why}); "
        "choose a smaller dram=, free shared memory (`yrcache list`, `yrcache destroy NAME`), "
        f"or enlarge {SHM_DIR}")
