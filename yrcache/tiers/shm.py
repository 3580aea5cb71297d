"""DRAM tier: one pre-faulted POSIX shared-memory arena per store.

The segment ``/dev/shm/yrcache.<name>`` holds everything: the key index, the
allocator, the pin table, the process table and a robust mutex (all in C, see
``_csrc/arena.c``).  Any process maps it by name and works on it directly; no
daemon, no socket.

Life cycle of a mapping (`Arena`): it registers a process slot, hands out
pinned zero-copy views, and is unmapped only when the store handle *and*
every view built on it are gone, so a view outlives ``close()``.  After a
``fork`` the child takes its own slot and re-pins the views it inherited, so
they stay valid whatever the parent does.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import weakref

import posix_ipc

from .._arena import ffi, lib
from ..errors import StoreNotFoundError, YrcacheError

PREFIX = "/yrcache."
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SHM_DIR = "/dev/shm"

# user words in the arena header
UW_FLAGS = 0      # bit 0: the owner closed its handle
FLAG_OWNER_CLOSED = 1

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


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime) of a process, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


def proc_starttime(pid: int | None = None) -> int:
    st = _proc_stat(pid or os.getpid())
    return st[1] if st else 0


def proc_alive(pid: int, starttime: int) -> bool:
    """True if ``pid`` is the same running process (not a zombie, not reused)."""
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == starttime


def check(rc: int, what: str) -> int:
    if rc < 0:
        raise YrcacheError(f"{what} failed: {ERRORS.get(rc, rc)}")
    return rc


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
        self._lock = threading.Lock()
        self.created = False
        if create:
            try:
                shm = posix_ipc.SharedMemory(self.shm_name, posix_ipc.O_CREX, mode=0o600, size=size)
                self.created = True
            except posix_ipc.ExistentialError:
                shm = None
        else:
            shm = None
        if shm is None:
            try:
                shm = posix_ipc.SharedMemory(self.shm_name)
            except posix_ipc.ExistentialError:
                raise StoreNotFoundError(
                    f"no store named {name!r} on this node (no {SHM_DIR}{self.shm_name}); "
                    "create it with TieredStore(name=...) first"
                ) from None
        try:
            st = os.fstat(shm.fd)
            self.size = st.st_size
            self._ident = (st.st_dev, st.st_ino)   # the name may later point elsewhere
            # tmpfs: a first-touch write costs ~10x a write to a resident page,
            # so the creator faults the whole arena in once, here, not on the
            # put path.  An attacher may map every page up front too (about
            # 0.14 s per GiB), sparing it a ~1 us fault per page it touches.
            self.base = lib.yr_map(shm.fd, self.size, 1 if prefault else 0)
        finally:
            shm.close_fd()
        if self.base == ffi.NULL:
            if self.created:
                posix_ipc.unlink_shared_memory(self.shm_name)
            raise YrcacheError(f"could not map store {name!r} ({self.size} bytes)")
        self.addr = int(ffi.cast("uintptr_t", self.base))
        self.cbase = ffi.cast("char *", self.base)
        self.mapped = True
        try:
            if self.created:
                if npins is None:
                    npins = max(1024, min(1 << 22, size // 4096))   # 16 B each
                check(lib.yr_arena_init(self.base, self.size, nprocs, npins), "arena init")
            elif lib.yr_arena_check(self.base, self.size) != 0:
                raise StoreNotFoundError(
                    f"{SHM_DIR}{self.shm_name} is not a usable yrcache store (being created, "
                    f"or from an incompatible version); remove it with `yrcache destroy {name}`"
                )
            self.is_owner = self.created if owner is None else owner
            self._register()
        except BaseException:
            self._unmap()
            if self.created:
                posix_ipc.unlink_shared_memory(self.shm_name)
            raise
        # views made by this process: pin -> block offset (re-pinned after fork)
        self._views: dict[int, int] = {}
        self._remap: dict[tuple[int, int], int] = {}
        self._handles = 1  # the store handle; views hold the Arena object itself
        _arenas.add(self)

    # -------------------------------------------------------------- slots

    def _register(self) -> None:
        self.starttime = proc_starttime()
        self.sweep()
        slot = lib.yr_proc_attach(self.base, os.getpid(), self.starttime, int(self.is_owner))
        if slot < 0:
            raise YrcacheError(
                f"store {self.name!r} has no free process slot (1023 processes attached); "
                "close stores in processes that no longer need them"
            )
        self._slot = slot
        self.pid = os.getpid()
        _install_exit_hook()

    def sweep(self) -> int:
        """Reclaim the slots of dead processes (their pins and unfinished puts).

        O(attached processes) plus, per dead process, O(pins + blocks).
        Returns the number of slots reclaimed.
        """
        n = 1024
        buf = ffi.new("yr_procinfo[]", n)
        cnt = lib.yr_proc_list(self.base, buf, n)
        reclaimed = 0
        for i in range(1, max(cnt, 0)):
            p = buf[i]
            if p.state and not proc_alive(p.pid, p.starttime):
                if lib.yr_proc_reclaim(self.base, i, p.pid, p.starttime) == 0:
                    reclaimed += 1
        return reclaimed

    def attached(self) -> list[tuple[int, int, bool]]:
        """(slot, pid, is_owner) of every live attached process slot."""
        n = 1024
        buf = ffi.new("yr_procinfo[]", n)
        cnt = lib.yr_proc_list(self.base, buf, n)
        return [(i, buf[i].pid, bool(buf[i].is_owner)) for i in range(1, max(cnt, 0))
                if buf[i].state and proc_alive(buf[i].pid, buf[i].starttime)]

    def take_ownership(self) -> None:
        """Become the owner (of a store whose owner closed it or died)."""
        lib.yr_user_word(self.base, UW_FLAGS)[0] &= ~FLAG_OWNER_CLOSED
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
        if not self.mapped or self.pid != os.getpid():
            return
        with self._lock:
            views = list(self._views.items())
        for pin, block in views:
            extra = lib.yr_pin_block(self.base, self._slot, block)
            if extra > 0:
                self._fork_pins.append((pin, extra, block))

    def after_fork_in_parent(self) -> None:
        self._fork_pins = []   # they belong to the child now

    def after_fork_in_child(self) -> None:
        """Own the pins the parent took for us; register a slot lazily otherwise."""
        self._lock = threading.Lock()
        self.is_owner = False   # ownership stays with the process that created the store
        parent, parent_slot = self.pid, self._slot
        handed = getattr(self, "_fork_pins", [])
        self._fork_pins = []
        self._views = {}
        self._remap = {}
        if not self.mapped or parent == os.getpid() or not handed:
            return
        self._register()
        for old, pin, block in handed:
            if lib.yr_pin_transfer(self.base, pin, parent_slot, self._slot) == 0:
                self._remap[(parent, old)] = pin
                self._views[pin] = block

    # --------------------------------------------------------------- pins

    def pinned_ptr(self, offset: int, pin: int, block: int):
        """A ``char *`` at ``offset`` that unpins ``pin`` when garbage collected.

        The hot path of every get: no lock (dict updates are atomic under
        the GIL; the unmap decision, which needs one, is off this path).
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
        if not self.mapped:
            return
        # Unpin before forgetting the view: while it is listed, nobody unmaps.
        lib.yr_unpin(self.base, pin)
        self._views.pop(pin, None)
        if not self._handles:
            self._maybe_unmap()

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
        """The store handle is done; unmap once no view needs the mapping."""
        if self._handles:
            self._handles = 0
            if self.is_owner and self.mapped:
                lib.yr_user_word(self.base, UW_FLAGS)[0] |= FLAG_OWNER_CLOSED
            self._maybe_unmap()

    def _maybe_unmap(self) -> None:
        with self._lock:
            if self._handles or self._views or not self.mapped:
                return
            if self.pid != os.getpid():   # inherited, never registered here
                self._unmap()
                return
            lib.yr_proc_detach(self.base, self._slot)
            owner_closed = lib.yr_user_word(self.base, UW_FLAGS)[0] & FLAG_OWNER_CLOSED
            if owner_closed:
                self.sweep()
                if lib.yr_proc_count(self.base) == 0:
                    self.unlink()
            self._unmap()

    def _unmap(self) -> None:
        if self.mapped:
            self.mapped = False
            lib.yr_unmap(self.base, self.size)

    def unlink(self) -> bool:
        """Remove the segment's name if it still names *this* segment.

        (A store destroyed and created again under the same name is another
        segment; an old handle must not unlink it.)  Mappings stay valid.
        """
        try:
            fd = os.open(f"{SHM_DIR}{self.shm_name}", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_dev, st.st_ino) != self._ident:
            return False
        try:
            posix_ipc.unlink_shared_memory(self.shm_name)
            return True
        except posix_ipc.ExistentialError:
            return False

    def __del__(self):
        # Only reached when no view and no handle refers to us.
        try:
            if self.mapped and self.pid == os.getpid():
                self._handles = 0
                self._views.clear()
                self._maybe_unmap()
        except Exception:
            pass


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
    """At exit: release this process's slots, so it does not count as attached."""
    for arena in list(_arenas):
        try:
            if arena.mapped and arena.pid == os.getpid():
                arena._handles = 0
                arena._views.clear()
                arena._maybe_unmap()
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
