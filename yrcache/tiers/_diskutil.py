"""The SSD tier's directory (``disk.py``), apart from its index and payloads.

* trust checks: what the tier opens must be writable by this uid alone;
* the owner lock: one store per tier directory (OFD locks on ``owner.lock``);
* temporary files: named after their writer, so that a dead writer's can be
  told from a live one's and removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
import weakref

from ..errors import StoreInUseError, UntrustedStoreError

# --------------------------------------------------------------------------
# trust: what the tier opens must be writable by this uid alone

FIX_HINT = ("remove it or chown/chmod it; yrcache only opens directories and files "
            "that only you can write")

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for an ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def foreign(st: os.stat_result) -> str | None:
    """Why ``st`` is not ours alone, or None if only we can write it."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"it belongs to another user (you are uid {euid})"
    if st.st_mode & 0o022:
        return "group or others may write to it"
    return None


def untrusted(what: str, path: str, st: os.stat_result, why: str) -> UntrustedStoreError:
    """The error refusing ``path`` (a ``what``: "directory" or "file") because ``why``."""
    return UntrustedStoreError(
        f"refusing SSD tier {what} {path} (owner uid {st.st_uid}, mode "
        f"0o{stat.S_IMODE(st.st_mode):03o}): {why}; {FIX_HINT}")


def check_dir(path: str, st: os.stat_result) -> None:
    """Refuse a tier directory that is a symlink, or that another uid owns or may write."""
    if stat.S_ISLNK(st.st_mode):
        raise untrusted("directory", path, st, "it is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"SSD tier path {path} exists and is not a directory")
    why = foreign(st)
    if why:
        raise untrusted("directory", path, st, why)


def check_file(path: str, st: os.stat_result) -> None:
    """Refuse an index or lock file that is not a regular file only we can write."""
    if not stat.S_ISREG(st.st_mode):
        raise untrusted("file", path, st, f"it is {kind_of(st.st_mode)}, not a regular file")
    why = foreign(st)
    if why:
        raise untrusted("file", path, st, why)


def make_dir(d: str, *, root: bool = False, _parents: bool = True) -> None:
    """Create ``d`` mode 0700 (and missing parents), or check that the existing
    one is ours alone.  The tier directory itself (``root``) may be a symlink
    the user made: what must be ours is where it leads.  Inside it we never
    make symlinks, so none is accepted there.  A path that cannot be a
    directory (a dangling symlink on the way, a file, a virtual filesystem
    such as ``/proc``) raises an OSError that names it and says why."""
    try:
        os.mkdir(d, 0o700)
    except FileNotFoundError:
        parent = os.path.dirname(d)
        if not _parents:           # the parent is there and still "no such file"
            raise _blocked(d) or FileNotFoundError(
                f"cannot create SSD tier directory {d}: {parent} exists but does not let "
                f"directories be made in it (a virtual filesystem such as /proc or /sys?); "
                f"pass ssd= a directory on a local disk") from None
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:     # FileExistsError: a component is a dangling symlink or a file
            raise _blocked(d) or type(exc)(
                f"cannot create {exc.filename or parent}, a parent of SSD tier directory {d}: "
                f"{exc.strerror}; pass ssd= a directory on a local disk") from None
        make_dir(d, root=root, _parents=False)
    except FileExistsError:
        try:
            st = os.stat(d) if root else os.lstat(d)
        except FileNotFoundError:  # a symlink to nothing (stat follows it)
            raise _blocked(d) or FileNotFoundError(f"SSD tier path {d} vanished; try again") from None
        check_dir(d, st)
    except (NotADirectoryError, PermissionError) as exc:
        raise _blocked(d) or type(exc)(
            f"cannot create SSD tier directory {d}: {exc.strerror}; pass ssd= a directory "
            f"you may write on a local disk") from None
    else:
        os.chmod(d, 0o700)             # exact mode whatever the umask


def _blocked(d: str) -> OSError | None:
    """Why ``d`` cannot be made a directory, if a component of it is a
    dangling symlink (an unmounted disk?) or not a directory."""
    parts = [d]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    for p in reversed(parts):
        try:
            st = os.lstat(p)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode) and not os.path.exists(p):
            target = os.path.join(os.path.dirname(p), os.readlink(p))
            return FileNotFoundError(
                f"SSD tier path {d}: {p} is a symbolic link to {target}, which does not exist "
                f"(a disk that is not mounted?); mount the disk it points to or create {target} "
                f"if it belongs there, or pass ssd= another directory")
        if not stat.S_ISLNK(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            return NotADirectoryError(f"SSD tier path {d}: {p} exists and is not a directory")
    return None


def check_subdirs(d: str) -> None:
    """Check every directory (or symlink) right inside ``d`` (``data/XX/``:
    payloads are renamed into them by path)."""
    with os.scandir(d) as it:
        for ent in it:
            st = ent.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                check_dir(ent.path, st)


def secure_files(paths) -> None:
    """Refuse any of ``paths`` that exists and is not a regular file ours alone; make ours 0600."""
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        check_file(p, st)
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.chmod(p, 0o600)         # not a symlink (checked); nobody else can swap it


# --------------------------------------------------------------------------
# one store per directory: open-file-description locks on path/owner.lock

LOCK_NAME = "owner.lock"
MAX_OWNER = 256
# struct flock {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid;}
# as laid out on LP64 Linux (x86_64, aarch64): 32 bytes.  OFD locks need l_pid 0.
FLOCK = struct.Struct("hhxxxxqqixxxx")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_GATE = 0        # write-locked by an opener while it probes and claims
_CLAIM = 1       # read-locked by every open handle of the store holding the directory


def _ofd_lock(fd: int, cmd: int, ltype: int, byte: int) -> int:
    """One OFD lock command on one byte of ``fd``; returns the answer's l_type
    (for ``F_OFD_GETLK``: a conflicting lock's type, or ``F_UNLCK`` if none)."""
    res = fcntl.fcntl(fd, cmd, FLOCK.pack(ltype, os.SEEK_SET, byte, 1, 0))
    return FLOCK.unpack(res)[0]


class OwnerLock:
    """One handle's claim on a tier directory: a read lock on byte 1 of
    ``owner.lock``, whose content is the owner id of the claiming store.

    Every handle of the holding store keeps byte 1 read-locked until
    ``release()``; an opener with another id that finds it locked gets
    ``StoreInUseError``.  Byte 0 is write-locked briefly by each opener so
    that probing and claiming is atomic.  OFD locks belong to the open file
    description, not to the process, so two handles in one process see each
    other as two processes would, and the kernel drops a killed process's
    locks at once.
    """

    def __init__(self, path: str, owner: str, tier_path: str) -> None:
        self.path = path
        self.fd = -1
        self.held = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise untrusted("file", path, os.lstat(path), "it is a symbolic link") from None
            raise
        self.fd = fd
        _live_locks.add(self)        # from here on, a forked child drops or re-takes it
        try:
            check_file(path, os.fstat(fd))
            self._claim(owner, tier_path)
        except BaseException:
            self.release()
            raise

    def _claim(self, owner: str, tier_path: str) -> None:
        fd = self.fd
        _ofd_lock(fd, _F_OFD_SETLKW, fcntl.F_WRLCK, _GATE)     # serialise openers
        try:
            if _ofd_lock(fd, _F_OFD_GETLK, fcntl.F_WRLCK, _CLAIM) != fcntl.F_UNLCK:
                holder = os.pread(fd, 4 * MAX_OWNER + 1, 0).decode("utf-8", "replace").rstrip("\n")
                if holder != owner:
                    raise StoreInUseError(
                        f"SSD tier directory {tier_path} is in use by another store (owner id "
                        f"{holder!r}; this store's is {owner!r}); use one ssd= directory per "
                        f"store, or attach to the store that has it")
            else:                    # free (any id in the file is a closed store's)
                os.ftruncate(fd, 0)
                os.pwrite(fd, owner.encode() + b"\n", 0)
            _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_RDLCK, _CLAIM)
            self.held = True
        finally:
            _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_UNLCK, _GATE)

    def release(self) -> None:
        """Drop the claim (idempotent)."""
        fd, self.fd = self.fd, -1
        _live_locks.discard(self)
        if fd < 0:
            return
        try:
            if self.held:
                # Unlock explicitly rather than rely on close(): a stray copy
                # of this fd (a child forked while this handle was opening)
                # must not keep the directory claimed.
                _ofd_lock(fd, _F_OFD_SETLK, fcntl.F_UNLCK, _CLAIM)
        finally:
            self.held = False
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown, fd already gone
            pass

    def _reopen_in_child(self) -> None:
        """After fork: take the claim again on a description of our own.

        Otherwise the child shares the parent's description, and the parent's
        release() (which unlocks explicitly) would drop the child's claim too.
        """
        old = self.fd
        if old < 0:
            return
        if not self.held:            # a parent thread was opening it; not ours
            self.fd = -1
            _live_locks.discard(self)
            os.close(old)
            return
        try:
            try:
                new = os.open(f"/proc/self/fd/{old}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:          # no /proc: the directory is ours, the path is safe
                new = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                _ofd_lock(new, _F_OFD_SETLK, fcntl.F_RDLCK, _CLAIM)
            except BaseException:
                os.close(new)
                raise
        except OSError:
            # Keep sharing the parent's description: still claimed, but this
            # copy must never unlock it.
            self.held = False
            return
        self.fd = new
        os.close(old)                # just close: unlocking would drop the parent's claim


_live_locks: "weakref.WeakSet[OwnerLock]" = weakref.WeakSet()


def _reopen_locks_in_child() -> None:
    for lk in list(_live_locks):
        lk._reopen_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reopen_locks_in_child)


# --------------------------------------------------------------------------
# process identity (for telling a live writer's temp file from a dead one's)

# Temporary files whose owner cannot be checked (another pid namespace, an
# unparseable name) are removed once untouched for this long.
STALE_TMP_AGE = 60.0

_ident_cache: tuple[int, str] | None = None


def _proc_start(pid: int) -> str | None:
    """Start time (clock ticks since boot) of ``pid``, or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ""            # exists but unreadable
    # Field 22; the command name (field 2) may contain spaces and parens.
    fields = data[data.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else ""


def _pidns() -> str:
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return "0"


def tmp_prefix() -> str:
    """``NS-PID-START-``: how this process's temp file names begin (fresh after a fork)."""
    global _ident_cache
    pid = os.getpid()
    if _ident_cache is None or _ident_cache[0] != pid:
        _ident_cache = (pid, f"{_pidns()}-{pid}-{_proc_start(pid) or 0}-")
    return _ident_cache[1]


def writer_id() -> str:
    """``NS-PID-START``: this process, as payload file names record their writer."""
    return tmp_prefix()[:-1]


def writer_alive(ident: str) -> bool | None:
    """True/False if the process ``NS-PID-START`` is alive/dead; None if unknowable
    (another pid namespace, not such a name)."""
    parts = ident.split("-")
    if len(parts) != 3 or parts[0] != _pidns():
        return None
    try:
        pid = int(parts[1])
    except ValueError:
        return None
    start = _proc_start(pid)
    if start is None:
        return False
    if start == "" or parts[2] == "0":
        # /proc entry unreadable or the writer could not read its own: fall
        # back to "a process with that pid exists".
        return True
    return start == parts[2]


def _tmp_owner_alive(name: str) -> bool | None:
    """True/False if the writer of temp file ``name`` is alive/dead; None if unknowable."""
    parts = name.split("-", 3)
    if len(parts) != 4 or not parts[3].endswith(".tmp"):
        return None
    return writer_alive("-".join(parts[:3]))


def clean_tmp(tmp_dir: str) -> int:
    """Remove the temp files in ``tmp_dir`` of dead writers (or, where the
    writer cannot be told, untouched for ``STALE_TMP_AGE``); return how many."""
    removed = 0
    now = time.time()
    try:
        names = os.listdir(tmp_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        p = os.path.join(tmp_dir, name)
        alive = _tmp_owner_alive(name)
        if alive is None:
            try:
                if now - os.stat(p).st_mtime < STALE_TMP_AGE:
                    continue
            except FileNotFoundError:
                continue
        elif alive:
            continue
        removed += _removed(p)
    return removed


def _removed(path: str) -> int:
    """1 if this call removed file ``path``, 0 if it was gone already."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------
# payload files no record refers to (a writer or remover killed mid-way)

def stray_candidates(data_dir: str, min_age: float) -> list[tuple[str, str]]:
    """``(name, path)`` of the payload files in ``data_dir/XX/`` that may be
    removed if no record refers to them: those whose writer (named in the
    file name) is dead, and any untouched for ``min_age`` seconds.

    The writer is judged before the caller reads the index: a writer dead
    now never commits later, so a file it left unreferenced stays so."""
    now, alive, out = time.time(), {}, []
    with os.scandir(data_dir) as subs:
        for sub in subs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as it:
                for ent in it:
                    try:
                        st = ent.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    writer = ent.name.rpartition(".")[2]      # GEN.RANDOM.NS-PID-START
                    if writer not in alive:
                        alive[writer] = writer_alive(writer)
                    if alive[writer] is False or now - max(st.st_mtime, st.st_ctime) >= min_age:
                        out.append((ent.name, ent.path))
    return out


def remove_strays(candidates: list[tuple[str, str]], referenced: set[str]) -> int:
    """Remove the candidates whose name is not in ``referenced``; return how many."""
    return sum(_removed(p) for name, p in candidates if name not in referenced)


def unlink(path: str) -> None:
    """Remove file ``path`` if it is there."""
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        # Gone already, or a directory planted in its place: not ours to remove.
        pass


def remove_files_of(data_dir: str, prefix: str) -> int:
    """Remove the payload files of one generation (names starting ``prefix``,
    ``GEN.``, see disk._gen_id) whatever their writer; return how many.  O(files / 256)."""
    sub = os.path.join(data_dir, prefix[:2])
    try:
        names = os.listdir(sub)
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(sub, name))
                removed += 1
            except (FileNotFoundError, IsADirectoryError):
                pass
    return removed
