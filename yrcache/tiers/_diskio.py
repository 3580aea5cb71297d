"""The SSD tier's payload files (``disk.py``): written once, read back verified.

A payload is written to a temporary file and renamed into place; its xxh3-64
is computed while it is written and checked while it is read, on a parked
helper thread for large payloads (xxhash drops the GIL).  A payload file is
opened without following symlinks and without blocking, and refused before a
byte is read unless it is a regular file only we can write.

Fork: a forked child forgets the parent's parked hash threads (they do not
exist in the child).
"""

from __future__ import annotations

import errno
import os
import queue
import stat
import threading
from typing import Callable

import xxhash

from ._diskutil import foreign, kind_of

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

# Indirection so tests can slow a write down (and kill the writer) mid-put.
_os_write = os.write


# --------------------------------------------------------------------------
# hashing on a helper thread

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


class _HashState:
    __slots__ = ("h", "failed", "update")

    def __init__(self) -> None:
        self.h = xxhash.xxh3_64()
        self.update = self.h.update
        self.failed: BaseException | None = None


class ChunkHasher:
    """xxh3-64 of chunks fed in order, computed on a helper thread (xxhash
    drops the GIL) while the caller does I/O.  The chunks are not copied:
    the caller must not change them before ``finish()``."""

    def __init__(self) -> None:
        with _idle_lock:
            w = _idle_workers.pop() if _idle_workers else None
        self._w: _HashWorker | None = w or _HashWorker()
        self._state = _HashState()

    def feed(self, chunk: memoryview) -> None:
        """Queue ``chunk`` (no copy) for hashing after the chunks fed before it."""
        assert self._w is not None, "feed() after finish()"
        self._w.q.put((self._state, chunk, None))

    def finish(self) -> int:
        """Wait for every fed chunk; return the digest and park the thread."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        assert self._w is not None, "finish() called twice"
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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


# --------------------------------------------------------------------------
# buffers and files

def as_bytes_view(obj, *, writable: bool, what: str) -> memoryview:
    """A flat unsigned-byte view of buffer ``obj`` (no copy); TypeError/ValueError
    naming ``what`` for a non-buffer, a read-only one where ``writable``, or a
    non-contiguous one."""
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


def fsync_dir(path: str) -> None:
    """fsync a directory (makes a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# payload files

def write_payload(mv: memoryview, tmp: str, final: str, *, durable: bool) -> int:
    """Write ``mv`` to a new file ``tmp`` (mode 0600), rename it to ``final``;
    return its xxh3-64.  One copy (into the page cache; ``durable``: fsynced,
    with its directory).  On any error ``tmp`` is removed and the error raised."""
    nbytes = mv.nbytes
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:        # tmp/ removed under us: recreate
        os.makedirs(os.path.dirname(tmp), 0o700, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    hasher = None
    try:
        try:
            if nbytes >= _PARALLEL_HASH_MIN:
                hasher = ChunkHasher()
                hasher.feed(mv)          # hashed on the helper while we write
            write, off = _os_write, 0
            while off < nbytes:
                n = write(fd, mv[off:off + _WRITE_CHUNK])
                if n <= 0:
                    raise OSError(errno.EIO, f"write to {tmp} made no progress")
                off += n
            if durable:
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
            if durable:
                fsync_dir(os.path.dirname(os.path.dirname(final)))
            os.rename(tmp, final)
        if durable:
            fsync_dir(os.path.dirname(final))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return checksum


def _open_payload(fpath: str, corrupt: Callable[[str], Exception]):
    """Open payload file ``fpath`` for reading: ``(unbuffered file, size)``.

    Trusted only if it is a regular file owned by us and not writable by
    group or others, as every payload we write is; anything else (a FIFO,
    device, directory, symlink, another user's file) raises ``corrupt(why)``
    before a byte is read.  O_NONBLOCK makes opening a FIFO return at once
    instead of waiting for a writer; it changes nothing for regular files.
    FileNotFoundError passes through.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(fpath, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise corrupt("it is a symbolic link, not a file yrcache wrote") from None
        if exc.errno == errno.ENXIO:   # a socket, or a device with no driver
            raise corrupt("it is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise corrupt(f"it is {kind_of(st.st_mode)}, not a regular file")
        why = foreign(st)
        if why:
            raise corrupt(f"{why} (owner uid {st.st_uid}, mode 0o{stat.S_IMODE(st.st_mode):03o})")
        return open(fd, "rb", buffering=0), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_payload(fpath: str, mv: memoryview, checksum: int, corrupt: Callable[[str], Exception]) -> None:
    """Fill ``mv`` from payload file ``fpath`` with ``readinto`` (no intermediate
    copy), hashing it on the way.  A file that is not ours, not ``mv.nbytes``
    long or fails ``checksum`` raises ``corrupt(why)`` (``mv`` then holds
    garbage); FileNotFoundError passes through."""
    nbytes = mv.nbytes
    f, size = _open_payload(fpath, corrupt)
    with f:
        if size != nbytes:
            raise corrupt(f"the file has {size} bytes, the index says {nbytes}"
                          + (" (truncated)" if size < nbytes else ""))
        if nbytes >= _PARALLEL_HASH_MIN:
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
        readinto, off = f.readinto, 0
        if _PIPELINE_READS and nbytes >= _PARALLEL_HASH_MIN:
            hasher = ChunkHasher()
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
        raise corrupt(f"the file ended after {off} of {nbytes} bytes (truncated)")
    if got != checksum:
        raise corrupt(f"the payload failed its xxh3_64 checksum (stored {checksum:016x}, computed {got:016x})")


def payload_problem(fpath: str, nbytes: int) -> str | None:
    """Why a read of payload file ``fpath`` (``nbytes`` long) would fail before
    its checksum: missing, not a regular file only we can write, or the
    wrong size; None if none of these.  One ``lstat``, no read."""
    try:
        st = os.lstat(fpath)
    except FileNotFoundError:
        return "its payload file is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"it is {kind_of(st.st_mode)}, not a regular file"
    why = foreign(st)
    if why:
        return f"{why} (owner uid {st.st_uid}, mode 0o{stat.S_IMODE(st.st_mode):03o})"
    if st.st_size != nbytes:
        return (f"the file has {st.st_size} bytes, the index says {nbytes}"
                + (" (truncated)" if st.st_size < nbytes else ""))
    return None
