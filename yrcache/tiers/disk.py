"""The SSD tier: encoded objects kept in a directory on local disk.

Layout of the tier directory (created owner-only, mode 0700)::

    path/index/        diskcache.Cache (SQLite): one record per key, plus the
                       ``used`` byte counter; small payloads live inline here
    path/data/XX/ID    payload files (XX = first two hex digits of ID), one
                       per object at or above ``inline_threshold``; named by a
                       random id, never by key; written once, never modified
    path/tmp/          payloads being written (``NS-PID-START-ID.tmp``)
    path/owner.lock    the owner id of the store holding the directory (only
                       with ``owner=``); see "One store per directory" below

A put writes the payload to a temporary file, renames it into ``data/`` and
only then commits the index record (and the ``used`` counter) in one SQLite
transaction, so a reader sees the old object or the new one, never a torn
one, and a writer killed at any point leaves no visible trace.  Temporary
files of dead writers are removed when the tier is next opened; data files
orphaned by a crash between rename and commit are removed by ``vacuum()``.

Index records are plain bytes (a fixed ``struct`` header, then meta, then the
inline payload or the file name), so nothing in the index is pickled.

Trust.  Another local user must not be able to feed us data or read ours.
The tier opens only a directory tree that this effective uid alone can write:
the directory, ``index/``, ``data/``, ``data/XX/`` and ``tmp/`` must be real
directories (not symlinks) owned by us and not group- or world-writable, and
the same holds for the index files (``cache.db``, ``-wal``, ``-shm``) and
``owner.lock``; anything else raises ``UntrustedStoreError``.  Directories are
created 0700 and index files are tightened to 0600.  A payload file is opened
without following symlinks and without blocking, and anything but a regular
file of ours (a FIFO, device, directory, symlink, another user's file) is
reported as ``CorruptObjectError`` before a byte is read.

One store per directory.  Two stores over one directory would delete each
other's objects.  A handle opened with ``owner=ID`` claims the directory:
every such handle holds an open-file-description (OFD) read lock on byte 1 of
``owner.lock`` until ``close()``, and ``owner.lock`` holds the ID.  An opener
with another ID that finds the byte locked gets ``StoreInUseError``; byte 0 is
write-locked briefly by each opener so that probing and claiming is atomic.
The kernel drops the locks of a killed process, so a dead store's directory
is free again at once.
"""

from __future__ import annotations

import errno
import fcntl
import math
import operator
import os
import queue
import shutil
import stat
import struct
import threading
import time
import uuid
import weakref
from typing import Iterator, NamedTuple

import diskcache
import xxhash

from ..errors import (CorruptObjectError, StoreClosedError, StoreFullError, StoreInUseError,
                      UntrustedStoreError)
from ..sizes import format_size, parse_size

__all__ = ["DiskTier", "DiskEntry", "ObjectInfo"]

# --------------------------------------------------------------------------
# constants

#: Largest key, in UTF-8 bytes.  User keys are limited to 1024 bytes by the
#: store; the headroom is for prefixes callers add (e.g. a generation).
MAX_KEY_BYTES = 4096

# Index keys of the tier's own bookkeeping.  User keys are always ``str``;
# SQLite orders integers before all text, so these never show up in key scans.
_USED_KEY = 0

# Record: version, kind, reserved, meta_len, nbytes, checksum, priority,
# expire_at (NaN = never), created; then meta; then inline payload or file id.
_HDR = struct.Struct("<BBHIQQqdd")
_VERSION = 1
_KIND_INLINE = 0
_KIND_FILE = 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

# Payloads at least this large are hashed on a helper thread while they are
# written (xxh3 releases the GIL); smaller ones are hashed inline.
_PARALLEL_HASH_MIN = 2 << 20
_WRITE_CHUNK = 1 << 30     # stay below Linux's ~2 GiB per-write limit
# Reads: with spare cores, large payloads are read in _READ_CHUNK pieces and
# hashed on a helper thread behind the reader.  On small machines (measured
# on 2 vCPUs, where memory bandwidth, not CPU, is the limit) it is faster to
# read _HOT_CHUNK pieces and hash each while it is still in this core's L2.
try:
    _USABLE_CPUS = len(os.sched_getaffinity(0))
except (AttributeError, OSError):  # pragma: no cover - not Linux
    _USABLE_CPUS = os.cpu_count() or 1
_PIPELINE_READS = _USABLE_CPUS >= 4
_READ_CHUNK = 4 << 20
_HOT_CHUNK = 256 << 10

# Temporary files whose owner cannot be checked (another pid namespace, an
# unparseable name) are removed once untouched for this long.
_STALE_TMP_AGE = 60.0
# vacuum() keeps unreferenced data files younger than this: a put may sit
# between rename and index commit for up to the SQLite busy timeout.
_ORPHAN_AGE = 300.0

_RETRY = object()

# Indirection so tests can slow a write down (and kill the writer) mid-put.
_os_write = os.write


# --------------------------------------------------------------------------
# public records

class ObjectInfo(NamedTuple):
    """What ``DiskTier.info`` reports about one object (no payload)."""

    meta: bytes
    nbytes: int
    priority: int
    expire_at: float | None


class DiskEntry(NamedTuple):
    """One live object as seen by an eviction policy (``DiskTier.entries``)."""

    key: str
    nbytes: int
    priority: int
    expire_at: float | None
    created: float


class _Rec(NamedTuple):
    kind: int
    nbytes: int
    checksum: int
    priority: int
    expire_at: float | None
    created: float
    meta_end: int          # meta is raw[_HDR.size:meta_end]
    raw: bytes             # the whole encoded record


def _encode(kind: int, meta: bytes, nbytes: int, checksum: int, priority: int,
            expire_at: float | None, created: float, tail: bytes) -> bytes:
    exp = math.nan if expire_at is None else expire_at
    return b"".join((
        _HDR.pack(_VERSION, kind, 0, len(meta), nbytes, checksum, priority, exp, created),
        meta, tail,
    ))


def _decode(raw: bytes) -> _Rec:
    version, kind, _r, meta_len, nbytes, checksum, priority, exp, created = _HDR.unpack_from(raw)
    if version != _VERSION:
        raise ValueError(f"unknown index record version {version}")
    return _Rec(kind, nbytes, checksum, priority, None if exp != exp else exp, created,
                _HDR.size + meta_len, raw)


def _expired(rec: _Rec, now: float) -> bool:
    return rec.expire_at is not None and rec.expire_at <= now


# --------------------------------------------------------------------------
# process identity (for telling a live writer's temp file from a dead one's)

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


def _tmp_prefix() -> str:
    """``NS-PID-START-`` for this process (recomputed after a fork)."""
    global _ident_cache
    pid = os.getpid()
    if _ident_cache is None or _ident_cache[0] != pid:
        _ident_cache = (pid, f"{_pidns()}-{pid}-{_proc_start(pid) or 0}-")
    return _ident_cache[1]


def _tmp_owner_alive(name: str) -> bool | None:
    """True/False if the writer of temp file ``name`` is alive/dead; None if unknowable."""
    parts = name.split("-")
    if len(parts) != 4 or not parts[3].endswith(".tmp") or parts[0] != _pidns():
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


# --------------------------------------------------------------------------
# hashing helpers

class _HashWorker:
    """A parked daemon thread that feeds chunks, in order, into a hash state."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="yrcache-ssd-xxh3", daemon=True).start()

    def _run(self) -> None:
        get = self.q.get
        while True:
            state, chunk, done = get()
            if state is None:            # retire
                return
            if done is None:
                try:
                    state.update(chunk)
                except BaseException as exc:  # pragma: no cover - xxhash does not fail
                    state.failed = exc
            else:
                done.put(state)


# Idle workers, reused across calls: starting a thread per call costs more
# than hashing a few MiB.  Forgotten in a forked child (its threads are gone).
_idle_workers: list[_HashWorker] = []
_idle_lock = threading.Lock()
_MAX_IDLE_WORKERS = 8


def _forget_workers() -> None:
    global _idle_lock
    _idle_lock = threading.Lock()
    _idle_workers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


class _HashState:
    __slots__ = ("h", "failed", "update")

    def __init__(self) -> None:
        self.h = xxhash.xxh3_64()
        self.update = self.h.update
        self.failed: BaseException | None = None


class _ChunkHasher:
    """Hashes chunks with xxh3_64 on a helper thread (xxhash drops the GIL),
    in the order they are fed, while the caller does I/O."""

    def __init__(self) -> None:
        with _idle_lock:
            w = _idle_workers.pop() if _idle_workers else None
        self._w = w or _HashWorker()
        self._state = _HashState()

    def feed(self, chunk: memoryview) -> None:
        self._w.q.put((self._state, chunk, None))

    def finish(self) -> int:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._w.q.put((self._state, None, done))
        done.get()
        with _idle_lock:
            if len(_idle_workers) < _MAX_IDLE_WORKERS:
                _idle_workers.append(self._w)
                self._w = None
        if self._w is not None:
            self._w.q.put((None, None, None))
        if self._state.failed is not None:  # pragma: no cover
            raise self._state.failed
        return self._state.h.intdigest()


def _as_bytes_view(obj, *, writable: bool, what: str) -> memoryview:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol "
                        f"(bytes, memoryview, numpy array), got {type(obj).__name__}") from None
    if writable and mv.readonly:
        raise TypeError(f"{what} must be a writable buffer, got a read-only {type(obj).__name__}")
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _short(key: str) -> str:
    r = repr(key)
    return r if len(r) <= 120 else r[:117] + "..."


# --------------------------------------------------------------------------
# trust: what the tier opens must be writable by this uid alone

_FIX_HINT = ("remove it or chown/chmod it; yrcache only opens directories and files "
             "that only you can write")

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _foreign(st: os.stat_result) -> str | None:
    """Why ``st`` is not ours alone, or None if only we can write it."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"it belongs to another user (you are uid {euid})"
    if st.st_mode & 0o022:
        return "group or others may write to it"
    return None


def _untrusted(what: str, path: str, st: os.stat_result, why: str) -> UntrustedStoreError:
    return UntrustedStoreError(
        f"refusing SSD tier {what} {path} (owner uid {st.st_uid}, mode "
        f"0o{stat.S_IMODE(st.st_mode):03o}): {why}; {_FIX_HINT}")


def _check_dir(path: str, st: os.stat_result) -> None:
    """Refuse a tier directory that is a symlink, or that another uid owns or may write."""
    if stat.S_ISLNK(st.st_mode):
        raise _untrusted("directory", path, st, "it is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"SSD tier path {path} exists and is not a directory")
    why = _foreign(st)
    if why:
        raise _untrusted("directory", path, st, why)


def _check_file(path: str, st: os.stat_result) -> None:
    """Refuse an index or lock file that is not a regular file only we can write."""
    if not stat.S_ISREG(st.st_mode):
        raise _untrusted("file", path, st, f"it is {_kind(st.st_mode)}, not a regular file")
    why = _foreign(st)
    if why:
        raise _untrusted("file", path, st, why)


# --------------------------------------------------------------------------
# one store per directory: open-file-description locks on path/owner.lock

_LOCK_NAME = "owner.lock"
# struct flock {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid;}
# as laid out on LP64 Linux (x86_64, aarch64): 32 bytes.  OFD locks need l_pid 0.
_FLOCK = struct.Struct("hhxxxxqqixxxx")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_GATE = 0        # write-locked by an opener while it probes and claims
_CLAIM = 1       # read-locked by every open handle of the store holding the directory
_MAX_OWNER = 256


def _ofd_lock(fd: int, cmd: int, ltype: int, byte: int) -> int:
    """One OFD lock command on one byte of ``fd``; returns the answer's l_type
    (for ``F_OFD_GETLK``: a conflicting lock's type, or ``F_UNLCK`` if none)."""
    res = fcntl.fcntl(fd, cmd, _FLOCK.pack(ltype, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(res)[0]


class _OwnerLock:
    """One handle's claim on a tier directory: a read lock on byte 1 of
    ``owner.lock``, whose content is the owner id of the claiming store.

    OFD locks belong to the open file description, not to the process, so two
    handles in one process see each other as two processes would.
    """

    def __init__(self, path: str, owner: str, tier_path: str) -> None:
        self.path = path
        self.fd = -1
        self.held = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                st = os.lstat(path)
                raise _untrusted("file", path, st, "it is a symbolic link") from None
            raise
        self.fd = fd
        _live_locks.add(self)        # from here on, a forked child drops or re-takes it
        try:
            _check_file(path, os.fstat(fd))
            self._claim(owner, tier_path)
        except BaseException:
            self.release()
            raise

    def _claim(self, owner: str, tier_path: str) -> None:
        fd = self.fd
        _ofd_lock(fd, _F_OFD_SETLKW, fcntl.F_WRLCK, _GATE)     # serialise openers
        try:
            if _ofd_lock(fd, _F_OFD_GETLK, fcntl.F_WRLCK, _CLAIM) != fcntl.F_UNLCK:
                holder = os.pread(fd, 4 * _MAX_OWNER + 1, 0).decode("utf-8", "replace").rstrip("\n")
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
        close() (which unlocks explicitly) would drop the child's claim too.
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


_live_locks: "weakref.WeakSet[_OwnerLock]" = weakref.WeakSet()


def _reopen_locks_in_child() -> None:
    for lk in list(_live_locks):
        lk._reopen_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reopen_locks_in_child)


# --------------------------------------------------------------------------
# the tier

class DiskTier:
    """SSD tier: a directory holding an index (diskcache) and payload files.

    Objects arrive already encoded: ``meta`` (codec header, opaque here) and
    ``payload`` (a contiguous buffer).  Payloads below ``inline_threshold``
    bytes are stored inside the index record; larger ones in files of their
    own.  Every payload carries an xxh3_64 checksum that is verified on read.

    Several threads and processes may open the same directory at once; the
    index (SQLite in WAL mode) serialises writers, payload files are never
    modified after they are published.  ``capacity`` is per handle: each
    handle refuses puts that would push the shared ``used`` counter past its
    own capacity.  Handles opened with ``owner=`` must all carry the same
    owner id (one store per directory; see the module docstring).

    Trusted: only a directory tree, index files and payload files owned by
    this effective uid and not writable by group or others.  Refused: any
    other directory or index file (``UntrustedStoreError`` when opening) and
    any payload that is not such a regular file (``CorruptObjectError`` when
    reading it).

    Nothing here is zero-copy (``zero_copy = False``): ``put`` copies the
    payload to disk, ``read_into`` copies it from disk into the caller's
    buffer, ``get`` into a new ``bytearray``.
    """

    name = "ssd"
    zero_copy = False

    def __init__(self, path: str | os.PathLike, capacity: int | str | None = None, *,
                 inline_threshold: int = 64 * 1024, durable: bool = False,
                 owner: str | None = None) -> None:
        """Open (creating if missing, mode 0700) the tier directory ``path``.

        ``capacity`` bounds the payload bytes stored (an int or a size string
        such as ``"200GiB"``); ``None`` means the filesystem's free space plus
        what the tier already holds, measured now.  ``durable=True`` fsyncs
        every payload file and its directory before the index commit and
        switches the index to ``synchronous=FULL`` (which then sticks to the
        directory for all openers).  Stale temporary files left by dead
        writers are removed here.

        ``owner``: the id shared by every process of one store.  The handle
        then holds the directory for that owner until ``close()``; opening it
        with another id meanwhile raises ``StoreInUseError``.  ``None`` (unit
        tests, tools) neither takes nor checks the claim.

        Raises ``UntrustedStoreError`` if the directory, a subdirectory or an
        index file is a symlink, belongs to another uid or is writable by
        group or others.
        """
        if isinstance(inline_threshold, bool) or not isinstance(inline_threshold, int) \
                or inline_threshold < 0:
            raise ValueError(f"inline_threshold must be a non-negative int, got {inline_threshold!r}")
        if owner is not None:
            if not isinstance(owner, str):
                raise TypeError(f"owner must be a str or None, got {type(owner).__name__}")
            if not 0 < len(owner) <= _MAX_OWNER or not owner.isprintable():
                raise ValueError(f"owner must be 1 to {_MAX_OWNER} printable characters, got {owner!r}")
        self._path = os.path.abspath(os.fspath(path))
        self._index_dir = os.path.join(self._path, "index")
        self._data_dir = os.path.join(self._path, "data")
        self._tmp_dir = os.path.join(self._path, "tmp")
        self._inline_threshold = inline_threshold
        self._durable = bool(durable)
        self._closed = False
        self._lock: _OwnerLock | None = None
        cap = parse_size(capacity, "ssd_size")

        for d in (self._path, self._index_dir, self._data_dir, self._tmp_dir):
            self._make_dir(d)
        self._check_data_dirs()
        self._secure_files()           # before SQLite opens them
        if owner is not None:
            self._lock = _OwnerLock(os.path.join(self._path, _LOCK_NAME), owner, self._path)

        settings = dict(
            eviction_policy="none",        # the tier decides what goes, never diskcache
            size_limit=1 << 62,
            cull_limit=0,
            statistics=False,
            tag_index=False,
            disk_min_file_size=1 << 40,    # records always stay inside SQLite
        )
        if self._durable:
            settings["sqlite_synchronous"] = 2
        self._cache = None
        try:
            self._cache = diskcache.Cache(self._index_dir, **settings)
            # SQLite creates cache.db (and its -wal, -shm) with the umask's
            # mode; later -wal/-shm files copy cache.db's mode, so tightening
            # it once keeps every index file 0600.
            self._secure_files()
            self._cache.add(_USED_KEY, 0)
            self._clean_tmp()
            if cap is None:
                cap = shutil.disk_usage(self._path).free + self.used
            self._capacity = int(cap)
        except BaseException:
            if self._cache is not None:
                self._cache.close()
            if self._lock is not None:
                self._lock.release()
            raise

    # ----------------------------------------------------------------- basics

    @property
    def path(self) -> str:
        """Absolute path of the tier directory."""
        return self._path

    @property
    def capacity(self) -> int:
        """Most payload bytes this handle lets the tier hold."""
        return self._capacity

    @property
    def used(self) -> int:
        """Payload bytes held (shared by all processes; includes expired
        objects not yet reclaimed)."""
        self._check_open()
        return int(self._cache.get(_USED_KEY, 0))

    @property
    def objects(self) -> int:
        """Number of objects held (includes expired ones not yet reclaimed)."""
        self._check_open()
        return max(0, len(self._cache) - 1)

    def __len__(self) -> int:
        """Number of objects held; same as ``objects``."""
        return self.objects

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is held and not expired."""
        if not isinstance(key, str):
            return False
        return self._lookup(key) is not None

    def __repr__(self) -> str:
        """Path, and whether the handle is closed."""
        state = "closed" if self._closed else f"capacity={format_size(self._capacity)}"
        return f"<DiskTier {self._path} {state}>"

    def __enter__(self) -> "DiskTier":
        """Return self; ``close()`` on exit."""
        return self

    def __exit__(self, *exc) -> None:
        """Close the handle."""
        self.close()

    def close(self) -> None:
        """Close this handle (idempotent); the data stays on disk.

        With ``owner=``, the directory is free for another owner once every
        handle of this owner (in any process) is closed or its process died.
        """
        if not self._closed:
            self._closed = True
            try:
                self._cache.close()
            finally:
                if self._lock is not None:
                    self._lock.release()

    # ------------------------------------------------------------------ writes

    def put(self, key: str, meta: bytes, payload, *, priority: int = 0,
            expire_at: float | None = None) -> None:
        """Store ``payload`` (copied to disk) with ``meta`` under ``key``, replacing any old object.

        ``payload`` is any C-contiguous buffer (bytes, memoryview, numpy
        array); it is written straight from the caller's memory, no Python
        copy.  Atomic: concurrent readers see the old object or the new one.
        ``expire_at`` (unix time) already past means the key is simply
        removed.  Raises ``StoreFullError`` when the object does not fit.
        """
        self._check_open()
        self._check_key(key)
        try:
            meta = bytes(memoryview(meta))
        except TypeError:
            raise TypeError(f"meta must be bytes, got {type(meta).__name__}") from None
        priority = operator.index(priority)
        if not _I64_MIN <= priority <= _I64_MAX:
            raise ValueError(f"priority must fit in 64 bits, got {priority!r}")
        if expire_at is not None:
            expire_at = float(expire_at)
            if expire_at != expire_at:
                raise ValueError("expire_at must be a unix time or None, not NaN")
        mv = _as_bytes_view(payload, writable=False, what="payload")
        nbytes = mv.nbytes
        now = time.time()
        if expire_at is not None and expire_at <= now:
            self.delete(key)
            return

        if nbytes < self._inline_threshold:
            checksum = xxhash.xxh3_64_intdigest(mv)
            rec = _encode(_KIND_INLINE, meta, nbytes, checksum, priority, expire_at, now, mv.tobytes())
            self._commit(key, rec, nbytes, None)
            return

        # Cheap early refusal before writing gigabytes (rechecked under lock).
        old = self._cache.get(key)
        old_n = _decode(old).nbytes if old is not None else 0
        if nbytes > old_n:
            self._check_room(key, nbytes, self.used - old_n)

        file_id = uuid.uuid4().hex
        final = self._file_path(file_id)
        checksum = self._write_file(key, mv, final)
        rec = _encode(_KIND_FILE, meta, nbytes, checksum, priority, expire_at, now, file_id.encode())
        self._commit(key, rec, nbytes, final)

    def delete(self, key: str, *, unlink=None) -> bool:
        """Remove ``key``; True if it was there (expired objects count as absent).

        ``unlink``: a callable that removes the payload file later (e.g. on a
        background thread); by default it is removed here.
        """
        self._check_open()
        if not isinstance(key, str):
            return False
        with self._cache.transact():
            raw = self._cache.get(key)
            if raw is None:
                return False
            rec = _decode(raw)
            self._cache.delete(key)
            self._cache.incr(_USED_KEY, -rec.nbytes)
        if unlink is not None and rec.kind == _KIND_FILE:
            unlink(self._file_path(rec.raw[rec.meta_end:].decode()))
        else:
            self._unlink_payload(rec)
        return not _expired(rec, time.time())

    def clear(self) -> int:
        """Remove every object (in batches, safe against concurrent writers); return how many."""
        n = 0
        while True:
            self._check_open()
            batch = self._page("", 1000, inclusive=True)
            if not batch:
                return n
            doomed = []
            with self._cache.transact():
                for key, _ in batch:
                    raw = self._cache.get(key)
                    if raw is None:
                        continue
                    rec = _decode(raw)
                    self._cache.delete(key)
                    self._cache.incr(_USED_KEY, -rec.nbytes)
                    doomed.append(rec)
            for rec in doomed:
                self._unlink_payload(rec)
            n += len(doomed)

    def purge_expired(self) -> int:
        """Delete every expired object now; return how many were deleted."""
        purged = [0]
        for _ in self._scan("", purged):
            pass
        return purged[0]

    def vacuum(self, min_age: float | None = None) -> int:
        """Remove files no index record refers to (crash leftovers); return how many.

        Walks the whole directory and index: O(objects).  Files younger than
        ``min_age`` seconds (default: a few minutes) are kept, since a
        concurrent put may still be about to publish them; pass 0 when no
        other process writes the directory.  Also purges expired objects and
        stale temp files.
        """
        min_age = _ORPHAN_AGE if min_age is None else min_age
        self._check_open()
        now = time.time()
        candidates = []
        for sub in os.scandir(self._data_dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for ent in os.scandir(sub.path):
                try:
                    st = ent.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode) and now - max(st.st_mtime, st.st_ctime) >= min_age:
                    candidates.append((ent.name, ent.path))
        live = set()
        for _key, rec in self._scan(""):          # also purges expired objects
            if rec.kind == _KIND_FILE:
                live.add(rec.raw[rec.meta_end:].decode())
        removed = 0
        for name, p in candidates:
            if name not in live:
                try:
                    os.unlink(p)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed + self._clean_tmp()

    # ------------------------------------------------------------------- reads

    def info(self, key: str) -> ObjectInfo | None:
        """Meta, size, priority and expiry of ``key``; None if absent or expired. No payload I/O."""
        self._check_open()
        self._check_key(key)
        rec = self._lookup(key)
        if rec is None:
            return None
        return ObjectInfo(rec.raw[_HDR.size:rec.meta_end], rec.nbytes, rec.priority, rec.expire_at)

    def read_into(self, key: str, out) -> bytes:
        """Copy the payload of ``key`` into ``out`` and return its meta.

        ``out`` must be a writable C-contiguous buffer of exactly ``nbytes``
        (see ``info``); the file is read straight into it (no intermediate
        copy) and then checked against its xxh3_64 checksum.  Raises
        ``KeyError`` if absent or expired, ``CorruptObjectError`` if the
        payload is damaged or missing (``out`` then holds garbage).
        """
        self._check_open()
        self._check_key(key)
        mv = _as_bytes_view(out, writable=True, what="out")
        rec = self._lookup(key)
        for _attempt in range(8):
            if rec is None:
                raise KeyError(key)
            if mv.nbytes != rec.nbytes:
                raise ValueError(f"out has {mv.nbytes} bytes but object {_short(key)} "
                                 f"has {rec.nbytes}; size it from info(key).nbytes")
            meta = self._fill(key, rec, mv)
            if meta is not _RETRY:
                return meta
            rec = self._lookup(key)
        raise TimeoutError(f"object {_short(key)} kept changing while being read; retry")

    def get(self, key: str) -> tuple[bytes, bytearray]:
        """Return ``(meta, payload)`` with the payload copied into a new bytearray.

        Same checks and errors as ``read_into``.
        """
        self._check_open()
        self._check_key(key)
        for _attempt in range(8):
            rec = self._lookup(key)
            if rec is None:
                raise KeyError(key)
            if rec.kind == _KIND_INLINE:
                buf = bytearray(memoryview(rec.raw)[rec.meta_end:])
                return self._check_inline(key, rec, buf), buf
            buf = bytearray(rec.nbytes)
            meta = self._fill(key, rec, memoryview(buf))
            if meta is not _RETRY:
                return meta, buf
        raise TimeoutError(f"object {_short(key)} kept changing while being read; retry")

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Iterate, in sorted order, over live keys starting with ``prefix`` (lazily, in pages)."""
        for key, _rec in self._scan(prefix):
            yield key

    def __iter__(self) -> Iterator[str]:
        """Iterate over all live keys; same as ``keys()``."""
        return self.keys()

    def entries(self) -> Iterator[DiskEntry]:
        """Iterate over live objects as ``DiskEntry`` records for an eviction policy.

        Expired objects met on the way are deleted, not yielded.  Safe to
        delete objects while iterating.
        """
        for key, rec in self._scan(""):
            yield DiskEntry(key, rec.nbytes, rec.priority, rec.expire_at, rec.created)

    # --------------------------------------------------------------- internals

    def _make_dir(self, d: str) -> None:
        """Create ``d`` mode 0700, or check that the existing one is ours alone."""
        try:
            os.mkdir(d, 0o700)
        except FileNotFoundError:          # missing parents of the tier directory
            os.makedirs(os.path.dirname(d), exist_ok=True)
            self._make_dir(d)
        except FileExistsError:
            # The tier directory may be a symlink the user made: what must be
            # ours is where it leads.  Inside it we never make symlinks.
            _check_dir(d, os.stat(d) if d == self._path else os.lstat(d))
        else:
            os.chmod(d, 0o700)             # exact mode whatever the umask

    def _check_data_dirs(self) -> None:
        """Check every ``data/XX/``: payloads are renamed into them by path."""
        with os.scandir(self._data_dir) as it:
            for ent in it:
                st = ent.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    _check_dir(ent.path, st)

    def _secure_files(self) -> None:
        """Refuse index and lock files that are not ours alone; make ours 0600."""
        db = os.path.join(self._index_dir, "cache.db")        # diskcache.core.DBNAME
        for p in (os.path.join(self._path, _LOCK_NAME), db, db + "-wal", db + "-shm", db + "-journal"):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            _check_file(p, st)
            if stat.S_IMODE(st.st_mode) != 0o600:
                os.chmod(p, 0o600)         # not a symlink (checked); nobody else can swap it

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"SSD tier at {self._path} is closed; open a new DiskTier to use it")

    @staticmethod
    def _check_key(key: object) -> None:
        if not isinstance(key, str):
            raise TypeError(f"keys must be str, got {type(key).__name__}")
        try:
            n = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"key {_short(key)} is not valid UTF-8 (lone surrogate)") from None
        if n > MAX_KEY_BYTES:
            raise ValueError(f"key {_short(key)} is {n} UTF-8 bytes; at most {MAX_KEY_BYTES} allowed")

    def _check_room(self, key: str, nbytes: int, used_without: int) -> None:
        if used_without + nbytes > self._capacity:
            raise StoreFullError(
                f"SSD tier at {self._path} is full: {format_size(used_without)} used of "
                f"{format_size(self._capacity)} capacity, object {_short(key)} needs "
                f"{format_size(nbytes)}; delete objects or raise ssd_size= "
                f"(currently {self._capacity} bytes)")

    def _file_path(self, file_id: str) -> str:
        return os.path.join(self._data_dir, file_id[:2], file_id)

    def _corrupt(self, key: str, fpath: str | None, what: str) -> CorruptObjectError:
        where = f"payload file {fpath}" if fpath else f"index {self._index_dir}"
        return CorruptObjectError(
            f"object {_short(key)} in SSD tier {self._path} is corrupt: {what} ({where}); "
            f"delete the key and write it again")

    def _lookup(self, key: str) -> _Rec | None:
        """Live record of ``key``; deletes it (lazily) if expired."""
        self._check_open()
        raw = self._cache.get(key)
        if raw is None:
            return None
        rec = _decode(raw)
        if _expired(rec, time.time()):
            self._drop_if_same(key, raw)
            return None
        return rec

    def _drop_if_same(self, key: str, raw: bytes) -> bool:
        with self._cache.transact():
            if self._cache.get(key) != raw:
                return False
            rec = _decode(raw)
            self._cache.delete(key)
            self._cache.incr(_USED_KEY, -rec.nbytes)
        self._unlink_payload(rec)
        return True

    def _unlink_payload(self, rec: _Rec) -> None:
        if rec.kind == _KIND_FILE:
            try:
                os.unlink(self._file_path(rec.raw[rec.meta_end:].decode()))
            except (FileNotFoundError, IsADirectoryError):
                # A directory planted in place of the payload is not ours to
                # remove; the key is gone all the same.
                pass

    def _commit(self, key: str, rec: bytes, nbytes: int, final: str | None) -> None:
        """Publish record ``rec`` (whose payload file, if any, is ``final``)."""
        try:
            with self._cache.transact():
                old = self._cache.get(key)
                old_rec = _decode(old) if old is not None else None
                delta = nbytes - (old_rec.nbytes if old_rec else 0)
                if delta:
                    used = self._cache.incr(_USED_KEY, delta)
                    if delta > 0 and used > self._capacity:
                        self._check_room(key, nbytes, used - nbytes)   # raises -> rollback
                self._cache.set(key, rec)
        except BaseException:
            if final is not None:
                try:
                    os.unlink(final)
                except OSError:
                    pass
            raise
        if old_rec is not None:
            self._unlink_payload(old_rec)

    def _write_file(self, key: str, mv: memoryview, final: str) -> int:
        """Write ``mv`` to a temp file, rename it to ``final``; return its xxh3_64."""
        nbytes = mv.nbytes
        tmp = os.path.join(self._tmp_dir, _tmp_prefix() + os.path.basename(final) + ".tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:        # tmp/ removed under us: recreate
            os.makedirs(self._tmp_dir, 0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        hasher = None
        try:
            try:
                if nbytes >= _PARALLEL_HASH_MIN:
                    hasher = _ChunkHasher()
                    hasher.feed(mv)          # hashed on the helper while we write
                write, off = _os_write, 0
                while off < nbytes:
                    n = write(fd, mv[off:off + _WRITE_CHUNK])
                    if n <= 0:
                        raise OSError(errno.EIO, f"write to {tmp} made no progress")
                    off += n
                if self._durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
                if hasher is not None:
                    checksum = hasher.finish()
            if hasher is None:
                checksum = xxhash.xxh3_64_intdigest(mv)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(final), 0o700, exist_ok=True)
                if self._durable:
                    _fsync_dir(self._data_dir)
                os.rename(tmp, final)
            if self._durable:
                _fsync_dir(os.path.dirname(final))
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
                raise StoreFullError(
                    f"SSD tier at {self._path}: the filesystem ran out of space writing "
                    f"{format_size(nbytes)} for {_short(key)} ({exc.strerror}); free disk space "
                    f"or lower ssd_size= (currently {self._capacity} bytes)") from exc
            raise
        return checksum

    def _check_inline(self, key: str, rec: _Rec, body) -> bytes:
        if len(body) != rec.nbytes:
            raise self._corrupt(key, None, f"inline payload has {len(body)} bytes, "
                                           f"the record says {rec.nbytes}")
        got = xxhash.xxh3_64_intdigest(body)
        if got != rec.checksum:
            raise self._corrupt(key, None, f"inline payload failed its xxh3_64 checksum "
                                           f"(stored {rec.checksum:016x}, computed {got:016x})")
        return rec.raw[_HDR.size:rec.meta_end]

    def _fill(self, key: str, rec: _Rec, mv: memoryview):
        """Copy ``rec``'s payload into ``mv`` (sized by the caller); return the
        meta, or ``_RETRY`` if the object changed under us."""
        if rec.kind == _KIND_INLINE:
            body = memoryview(rec.raw)[rec.meta_end:]
            meta = self._check_inline(key, rec, body)
            mv[:] = body
            return meta
        fpath = self._file_path(rec.raw[rec.meta_end:].decode())
        try:
            self._read_file(key, fpath, mv, rec)
        except FileNotFoundError:
            # An overwrite/delete may have removed the file after we looked
            # the key up: look again; missing for real = corrupt.
            again = self._cache.get(key)
            if again == rec.raw:
                raise self._corrupt(key, fpath, "its payload file is missing") from None
            return _RETRY
        return rec.raw[_HDR.size:rec.meta_end]

    def _open_payload(self, key: str, fpath: str):
        """Open payload file ``fpath`` for reading, as an unbuffered file object.

        Trusted only if it is a regular file owned by us and not writable by
        group or others, as every payload we write is; anything else (a FIFO,
        device, directory, symlink, another user's file) is refused with
        ``CorruptObjectError`` before a byte is read.  O_NONBLOCK makes
        opening a FIFO return at once instead of waiting for a writer; it
        changes nothing for regular files.  FileNotFoundError passes through.
        """
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(fpath, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._corrupt(key, fpath, "it is a symbolic link, not a file yrcache wrote") from None
            if exc.errno == errno.ENXIO:   # a socket, or a device with no driver
                raise self._corrupt(key, fpath, "it is not a regular file") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._corrupt(key, fpath, f"it is {_kind(st.st_mode)}, not a regular file")
            why = _foreign(st)
            if why:
                raise self._corrupt(key, fpath, f"{why} (owner uid {st.st_uid}, mode "
                                                f"0o{stat.S_IMODE(st.st_mode):03o})")
            return open(fd, "rb", buffering=0), st.st_size
        except BaseException:
            os.close(fd)
            raise

    def _read_file(self, key: str, fpath: str, mv: memoryview, rec: _Rec) -> None:
        """Fill ``mv`` from ``fpath`` and verify it; FileNotFoundError passes through."""
        nbytes = rec.nbytes
        f, size = self._open_payload(key, fpath)
        with f:
            if size != nbytes:
                raise self._corrupt(key, fpath, f"the file has {size} bytes, the index says {nbytes}"
                                    + (" (truncated)" if size < nbytes else ""))
            if nbytes >= _PARALLEL_HASH_MIN:
                try:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except (AttributeError, OSError):
                    pass
            readinto, off = f.readinto, 0
            if _PIPELINE_READS and nbytes >= _PARALLEL_HASH_MIN:
                hasher = _ChunkHasher()
                step = min(_READ_CHUNK, max(256 << 10, nbytes // 8))
                try:
                    while off < nbytes:
                        chunk = mv[off:off + step]
                        n = readinto(chunk)
                        if not n:
                            break
                        hasher.feed(chunk[:n])
                        off += n
                finally:
                    got = hasher.finish()
            else:
                state = xxhash.xxh3_64()
                update = state.update
                while off < nbytes:
                    chunk = mv[off:off + _HOT_CHUNK]
                    n = readinto(chunk)
                    if not n:
                        break
                    update(chunk[:n])
                    off += n
                got = state.intdigest()
        if off != nbytes:
            raise self._corrupt(key, fpath, f"the file ended after {off} of {nbytes} bytes (truncated)")
        if got != rec.checksum:
            raise self._corrupt(key, fpath, f"the payload failed its xxh3_64 checksum "
                                            f"(stored {rec.checksum:016x}, computed {got:016x})")

    def _page(self, after: str, limit: int, *, inclusive: bool) -> list[tuple[str, bytes]]:
        # Direct query on diskcache's table (schema stable since diskcache 3):
        # one indexed range scan instead of a lookup per key.  Text keys sort
        # after our integer bookkeeping keys.
        op = ">=" if inclusive else ">"
        rows = self._cache._sql(
            f"SELECT key, value FROM Cache WHERE key {op} ? AND raw = 1 ORDER BY key LIMIT ?",
            (after, limit)).fetchall()
        return [(k, bytes(v)) for k, v in rows if isinstance(k, str) and isinstance(v, (bytes, memoryview))]

    def _scan(self, prefix: str, purged: list | None = None) -> Iterator[tuple[str, _Rec]]:
        """Yield ``(key, record)`` of live objects with ``prefix``, in key order, in pages."""
        after, inclusive = prefix, True
        while True:
            self._check_open()
            page = self._page(after, 500, inclusive=inclusive)
            if not page:
                return
            now = time.time()
            live, done = [], False
            for key, raw in page:
                if not key.startswith(prefix):
                    done = True
                    break
                rec = _decode(raw)
                if _expired(rec, now):
                    if self._drop_if_same(key, raw) and purged is not None:
                        purged[0] += 1
                else:
                    live.append((key, rec))
            yield from live
            if done:
                return
            after, inclusive = page[-1][0], False

    def _clean_tmp(self) -> int:
        """Remove temp files of dead writers (or untouched for a minute when unknowable)."""
        removed = 0
        now = time.time()
        try:
            names = os.listdir(self._tmp_dir)
        except FileNotFoundError:
            return 0
        for name in names:
            p = os.path.join(self._tmp_dir, name)
            alive = _tmp_owner_alive(name)
            if alive is None:
                try:
                    if now - os.stat(p).st_mtime < _STALE_TMP_AGE:
                        continue
                except FileNotFoundError:
                    continue
            elif alive:
                continue
            try:
                os.unlink(p)
                removed += 1
            except FileNotFoundError:
                pass
        return removed
