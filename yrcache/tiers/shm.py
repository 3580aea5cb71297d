"""DRAM tier: one pre-faulted POSIX shared-memory arena per store.

The segment ``/dev/shm/yrcache.<name>`` holds everything: the key index, the
allocator, the pin table, the process table and a robust mutex (all in C, see
``_csrc/arena.c``).  Any process maps it by name and works on it directly; no
daemon, no socket.

Trust: a segment is mapped only if it is owned by this process's user and
nobody else may read or write it (created 0600; anything else raises
``UntrustedStoreError`` before a byte of it is read).

Liveness: each mapping takes a process slot and holds a lock on that slot's
byte of the segment through an open file description of its own; a slot is
dead exactly when nobody holds its lock (the kernel drops it with the
process), whatever PID namespace either process runs in.

Life cycle of a mapping (`Arena`): it registers a process slot, hands out
pinned zero-copy views, and is unmapped only when nothing in the process
refers to it any more: the store handle, every view, and every operation
still running in another thread or paused in an iterator.  So a view
outlives ``close()``, and closing a store while another thread uses it is
an error there (``StoreClosedError``), never a crash.  After a ``fork`` the
child takes its own slot and re-pins the views it inherited, so they stay
valid whatever the parent does.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import threading
import warnings
import weakref

import posix_ipc

from .._arena import ffi, lib
from ..errors import StoreFullError, StoreNotFoundError, UntrustedStoreError, YrcacheError
from ..sizes import format_size

PREFIX = "/yrcache."
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SHM_DIR = "/dev/shm"

ERRORS = {
    lib.YR_ENOTFOUND: "not found",
    lib.YR_ENOSPC: "no space",
    lib.YR_EBADARENA: "not a yrcache arena (or an incompatible version)",
    lib.YR_ENOPINS: "too many live views",
    lib.YR_ENOPROCS: "too many attached processes",
    lib.YR_ELOCK: "the arena lock is unrecoverable",
    lib.YR_ESTATE: "unexpected object state",
    lib.YR_ETOOBIG: "object larger than the arena",
}


def check_name(name: str) -> str:
    """Validate a store name (it becomes a file name under /dev/shm)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid store name {name!r}: use 1-200 characters from letters, digits, '.', '_' and '-'"
        )
    return name


def shm_name(name: str) -> str:
    return PREFIX + check_name(name)


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


def check(rc: int, what: str) -> int:
    if rc < 0:
        raise YrcacheError(f"{what} failed: {ERRORS.get(rc, rc)}")
    return rc


def check_trusted(st: os.stat_result, path: str) -> None:
    """Refuse a segment that is not ours alone (another user's, or open to others)."""
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UntrustedStoreError(
            f"{path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}; yrcache maps only "
            f"segments owned by you (uid {os.geteuid()}) that nobody else can read or write (0600). "
            "If you do not know who made it, do not use it: remove it (as its owner or root) or "
            "pick another store name"
        )


def _open_segment(name: str, create: bool, size: int) -> tuple[int, bool]:
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
                f"no store named {name!r} on this node (no {SHM_DIR}{shm_name(name)}); "
                "create it with TieredStore(name=...) first"
            ) from None
        except posix_ipc.PermissionsError:
            raise UntrustedStoreError(
                f"{SHM_DIR}{shm_name(name)} exists but is not yours to open; pick another store name"
            ) from None
    try:
        fd = os.dup(shm.fd)   # close-on-exec; kept for the slot lock
    finally:
        shm.close_fd()
    return fd, created


_arenas: "weakref.WeakSet[Arena]" = weakref.WeakSet()
_pid = os.getpid()   # kept current by the at-fork hook: os.getpid() is a syscall


class Arena:
    """A process's mapping of one store's shared-memory arena.

    Thread-safe: the C core serialises on the arena's robust mutex; the
    Python-side pin book is guarded by a lock.
    """

    def __init__(self, name: str, *, create: bool = False, size: int = 0,
                 prefault: bool = True, nprocs: int = 1024, npins: int | None = None,
                 owner: bool | None = None):
        self.name = check_name(name)
        self.shm_name = shm_name(name)
        self.path = f"{SHM_DIR}{self.shm_name}"
        self._lock = threading.Lock()
        self.mapped = False
        self.persist = False
        self._fd = -1
        self._slot = 0
        fd, self.created = _open_segment(name, create, size)
        self._fd = fd
        try:
            st = os.fstat(fd)
            check_trusted(st, self.path)
            self.size = st.st_size
            self._ident = (st.st_dev, st.st_ino)   # the name may later point elsewhere
            # tmpfs: a first-touch write costs ~10x a write to a resident page,
            # so the creator faults the whole arena in once, here, not on the
            # put path.  An attacher may map every page up front too (about
            # 0.14 s per GiB), sparing it a ~1 us fault per page it touches.
            self.base = self._map_new(prefault) if self.created else lib.yr_map(fd, self.size, int(prefault))
            if self.base == ffi.NULL:
                raise YrcacheError(f"could not map store {name!r} ({self.size} bytes)")
            self.addr = int(ffi.cast("uintptr_t", self.base))
            self.cbase = ffi.cast("char *", self.base)
            self.mapped = True
            if self.created:
                if npins is None:
                    npins = max(1024, min(1 << 22, size // 4096))   # 16 B each; more grow on demand
                check(lib.yr_arena_init(self.base, self.size, nprocs, npins), "arena init")
            elif lib.yr_arena_check(self.base, self.size) != 0:
                raise StoreNotFoundError(
                    f"{self.path} is not a usable yrcache store (being created, damaged, or from an "
                    f"incompatible version); remove it with `yrcache destroy {name}`"
                )
            self.is_owner = self.created if owner is None else owner
            self._register()
        except BaseException:
            self._unmap()
            if self.created:
                unlink_if(self.name, getattr(self, "_ident", None))
            raise
        # views made by this process: pin -> block offset (re-pinned after fork)
        self._views: dict[int, int] = {}
        self._remap: dict[tuple[int, int], int] = {}
        self._handle = True   # the store handle; views hold the Arena object itself
        _arenas.add(self)

    def _map_new(self, prefault: bool):
        """Map a new segment with all its memory given to it now, so that an
        over-committed /dev/shm fails here with StoreFullError, not later
        with SIGBUS at the first write (tmpfs allocates pages lazily)."""
        if prefault:
            base = lib.yr_map(self._fd, self.size, 0)
            if base == ffi.NULL:
                return base
            rc = lib.yr_populate_write(base, self.size)
            if rc == 0:
                return base
            lib.yr_unmap(base, self.size)
            if rc != -errno.EINVAL:     # EINVAL: a kernel without MADV_POPULATE_WRITE
                raise self._no_room("its pages could not be allocated" if rc in (-errno.EFAULT, -errno.ENOMEM)
                                    else os.strerror(-rc))
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise self._no_room(e.strerror) from None
        return lib.yr_map(self._fd, self.size, int(prefault))

    def _no_room(self, why: str) -> StoreFullError:
        return StoreFullError(
            f"cannot create store {self.name!r}: {SHM_DIR} has no room for "
            f"{format_size(self.size)} ({why}); choose a smaller dram=, free shared memory "
            f"(`yrcache list`, `yrcache destroy NAME`), or enlarge {SHM_DIR}"
        )

    # -------------------------------------------------------------- slots

    def _register(self) -> None:
        self.starttime = proc_starttime()
        self.sweep()
        slot = lib.yr_proc_attach(self.base, self._fd, os.getpid(), self.starttime, int(self.is_owner))
        if slot < 0:
            raise YrcacheError(
                f"store {self.name!r} has no free process slot (all attached); "
                "close stores in processes that no longer need them"
            )
        self._slot = slot
        self.pid = os.getpid()
        self.attached_here = True
        _install_exit_hook()

    def sweep(self) -> int:
        """Reclaim the slots of dead processes (their pins and unfinished puts).

        A slot is dead when no process holds its lock byte.  O(slots) plus,
        per dead process, O(pins + blocks).  Returns the number reclaimed.
        """
        return max(0, lib.yr_proc_sweep(self.base, self._fd, self._own_slot()))

    def _own_slot(self) -> int:
        return self._slot if getattr(self, "pid", None) == os.getpid() else 0

    def attached(self) -> list[tuple[int, int, bool]]:
        """(slot, pid, is_owner) of every live attached process slot."""
        n = 1024
        buf = ffi.new("yr_procinfo[]", n)
        cnt = lib.yr_proc_list(self.base, self._fd, self._own_slot(), buf, n)
        return [(i, buf[i].pid, bool(buf[i].is_owner)) for i in range(1, max(cnt, 0)) if buf[i].alive]

    def take_ownership(self) -> None:
        """Become the owner (of a store whose owner died)."""
        self.is_owner = True
        lib.yr_proc_set_owner(self.base, self.slot, 1)

    @property
    def slot(self) -> int:
        """This process's slot; a forked child takes its own on first use."""
        if self.pid != _pid:
            with self._lock:
                if self.pid != os.getpid():
                    self._register()
        return self._slot

    def before_fork(self) -> None:
        """Pin every live view once more, for the child to take over.

        The child cannot pin them itself in time: between the fork and its
        first step the parent may drop a view and the block be reused.
        """
        self._fork_pins = []
        self._fork_unpinned = 0
        if not self.mapped or self.pid != os.getpid() or not self.attached_here:
            return
        with self._lock:
            views = list(self._views.items())
        for pin, block in views:
            extra = lib.yr_pin_block(self.base, self._slot, block)
            if extra > 0:
                self._fork_pins.append((pin, extra, block))
            elif extra == lib.YR_ENOPINS:
                self._fork_unpinned += 1

    def after_fork_in_parent(self) -> None:
        self._fork_pins = []   # they belong to the child now

    def after_fork_in_child(self) -> None:
        """Own the pins the parent took for us; register a slot lazily otherwise."""
        self._lock = threading.Lock()
        self.is_owner = False   # ownership stays with the process that created the store
        self._handle = False    # the parent's handle; a child's store object re-opens it
        self._reopen_fd()
        parent, parent_slot = self.pid, self._slot
        handed = getattr(self, "_fork_pins", [])
        unpinned = getattr(self, "_fork_unpinned", 0)
        self._fork_pins = []
        self._views = {}
        self._remap = {}
        self.attached_here = False
        if unpinned:
            warnings.warn(
                f"yrcache: {unpinned} view(s) of store {self.name!r} inherited across fork could "
                "not be pinned for this child (the arena has no room for more pins); they may "
                "change under it. Release views before forking, or give the store more dram=",
                RuntimeWarning, stacklevel=1)
        if not self.mapped or parent == os.getpid() or not handed:
            return
        self._register()
        for old, pin, block in handed:
            if lib.yr_pin_transfer(self.base, pin, parent_slot, self._slot) == 0:
                self._remap[(parent, old)] = pin
                self._views[pin] = block

    def _reopen_fd(self) -> None:
        """A descriptor of our own: the inherited one shares the parent's
        open file description, and with it the parent's slot lock."""
        if self._fd < 0:
            return
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            fd = -1
        os.close(self._fd)
        self._fd = fd

    # --------------------------------------------------------------- pins

    def pinned_ptr(self, offset: int, pin: int, block: int):
        """A ``char *`` at ``offset`` that unpins ``pin`` when garbage collected.

        The hot path of every get: no lock (dict updates are atomic under
        the GIL).  The closure keeps this Arena, hence the mapping, alive.
        """
        self._views[pin] = block
        pid = _pid
        return ffi.gc(self.cbase + offset, lambda _p: self._release(pid, pin))

    def _release(self, pid: int, pin: int) -> None:
        try:
            self._release_pin(pid, pin)
        except Exception:  # interpreter shutdown: the process's death frees the pin
            pass

    def _release_pin(self, pid: int, pin: int) -> None:
        if pid != _pid:  # a view inherited across fork: release our own pin
            pin = self._remap.pop((pid, pin), 0)
            if not pin:
                return
        if not self.attached_here:   # detached at exit: the pin is no longer ours
            return
        lib.yr_unpin(self.base, pin)
        self._views.pop(pin, None)

    def unpin(self, pin: int) -> None:
        lib.yr_unpin(self.base, pin)

    @property
    def live_views(self) -> int:
        return len(self._views)

    # ------------------------------------------------------------ notify

    NOTIFY_WORDS = 16

    def notify_value(self, index: int) -> int:
        """Current value of futex word ``index`` (0-15); bumps on every wake."""
        return lib.yr_notify_word(self.base, index)[0]

    def notify_wait(self, index: int, seen: int, timeout: float | None) -> bool:
        """Sleep until word ``index`` differs from ``seen`` or ``timeout`` passes.

        A futex in the shared arena: no polling, no socket; wakes within
        microseconds of ``notify_wake``.  Returns False on timeout.
        """
        rc = lib.yr_futex_wait(lib.yr_notify_word(self.base, index), seen,
                               -1.0 if timeout is None else max(timeout, 0.0))
        return rc != 1

    def notify_wake(self, index: int) -> None:
        """Bump word ``index`` and wake every process waiting on it."""
        lib.yr_futex_wake(lib.yr_notify_word(self.base, index))

    # ----------------------------------------------------------- closing

    def release_handle(self) -> None:
        """The store handle is done.  The owner unlinks the segment's name
        (unless the store persists): processes still attached keep their
        mappings, new attaches fail.  The mapping itself goes when nothing in
        this process refers to this Arena any more (see ``__del__``)."""
        if self._handle:
            self._handle = False
            if self.is_owner and not self.persist:
                self.unlink()

    def detach(self) -> None:
        """Give the process slot back (its pins with it).  Views of this
        process must not be used afterwards: only for exit and finalisation."""
        with self._lock:
            if self.mapped and self.attached_here and self.pid == os.getpid():
                self.attached_here = False
                lib.yr_proc_detach(self.base, self._fd, self._slot)

    def _unmap(self) -> None:
        if self.mapped:
            self.mapped = False
            lib.yr_unmap(self.base, self.size)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> bool:
        """Remove the segment's name if it still names *this* segment.

        (A store destroyed and created again under the same name is another
        segment; an old handle must not unlink it.)  Mappings stay valid.
        """
        return unlink_if(self.name, self._ident)

    def __del__(self):
        # Reached when no handle, view or running operation refers to us.
        try:
            if self._handle:
                self.release_handle()
            self.detach()
            self._unmap()
        except Exception:
            pass


def unlink_if(name: str, ident: tuple[int, int] | None) -> bool:
    """Unlink the segment ``name`` if it is still the one with (st_dev, st_ino) ``ident``."""
    try:
        fd = os.open(f"{SHM_DIR}{shm_name(name)}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if ident is not None and (st.st_dev, st.st_ino) != ident:
        return False
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


def destroy(name: str) -> bool:
    """Unlink a store's segment by name; processes that have it mapped keep it."""
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


def _before_fork() -> None:
    for arena in list(_arenas):
        try:
            arena.before_fork()
        except Exception:
            pass


def _after_fork_in_parent() -> None:
    for arena in list(_arenas):
        arena.after_fork_in_parent()


def _after_fork_in_child() -> None:
    global _exit_hook_pid, _pid
    _exit_hook_pid = 0
    _pid = os.getpid()
    for arena in list(_arenas):
        try:
            arena.after_fork_in_child()
        except Exception:  # never break the child over a store it may not use
            pass


def _detach_all() -> None:
    """At exit: an owner's store goes (unless it persists), and this process's
    slots are given back.  Nothing is unmapped: code that runs later in the
    exit may still hold views, and the mappings go with the process."""
    for arena in list(_arenas):
        try:
            if arena.mapped and getattr(arena, "pid", None) == os.getpid():
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
    if any(a.mapped and a.pid == os.getpid() for a in list(_arenas)):
        _install_exit_hook()


def _install_exit_hook() -> None:
    """atexit, and multiprocessing's finalizers (its children leave by os._exit)."""
    global _exit_hook_pid
    if _exit_hook_pid == os.getpid():
        return
    _exit_hook_pid = os.getpid()
    atexit.register(_detach_all)
    from multiprocessing import util

    util.Finalize(None, _detach_all, exitpriority=-100)


def _register_mp_hook() -> None:
    from multiprocessing import util

    util.register_after_fork(_FORK_TOKEN, _reinstall_exit_hook)


_register_mp_hook()
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
