"""The SSD tier: blobs addressed by generation, in a directory on local disk.

Layout of the tier directory (created owner-only, mode 0700)::

    path/index/        diskcache.Cache (SQLite): one record per blob, keyed by
                       its generation (an int), plus the ``used`` byte counter
                       (under a str key); small payloads live inline here
    path/data/XX/ID    payload files (XX = first two hex digits of ID), one
                       per blob at or above ``inline_threshold``; ID is
                       ``GEN.RANDOM.NS-PID-START`` (generation, lowest hex
                       digit first, then the writing process); written once
    path/tmp/          payloads being written and payloads being removed
                       (``NS-PID-START-ID[.del].tmp``, NS-PID-START: the writer
                       or remover)
    path/owner.lock    the owner id of the store holding the directory (only
                       with ``owner=``; see ``_diskutil.OwnerLock``)

A put writes the payload to a temporary file, renames it into ``data/`` and
only then adds the index record (and bumps ``used``) in one SQLite
transaction, so a reader finds the whole blob or none, and a writer killed at
any point leaves no visible trace.  A generation is written once and never
overwritten (``base.py``), so a blob's bytes never change.

Crashes.  Payload files are named by generation and writer, so none is lost
track of.  A file with no record (its writer or remover killed between index
and file) goes at ``delete(gen)``, which the store calls for every stub that
leaves its index (dead processes' unfinished moves too), and at ``sweep()``
once its writer is dead.  A deferred removal (``delete(later=)``) first
renames the file into ``tmp/`` under the remover's name; temp files of dead
processes go at open, ``clean_tmp()``, ``sweep()`` and ``vacuum()``.

The index is used through diskcache's public API only.  Its records are plain
bytes (a ``struct`` header, meta, key, then the inline payload or the file
id): nothing in it is pickled.  The tier stores and never decides: nothing
expires here and nothing is evicted; the key, priority and expiry of a blob
are recorded only so that ``entries()`` can rebuild the store's index.

Trust.  Another local user must not be able to feed us data or read ours.
The tier opens only a directory tree (the directory, which may be a symlink
to ours, and ``index/``, ``data/``, ``data/XX/``, ``tmp/``, which may not),
index files and ``owner.lock`` that this effective uid alone can write, else
``UntrustedStoreError``; it creates them 0700 and 0600.  A payload is read
only from a regular file of ours, opened without following symlinks or
blocking; anything else (a FIFO, device, directory, symlink, another user's
file) is ``CorruptObjectError`` before a byte is read.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import time
import uuid
from typing import Callable, Iterator

import diskcache
import xxhash

from ..errors import CorruptObjectError, StoreClosedError, StoreFullError, YrcacheError
from ..sizes import format_size, parse_size
from . import _diskio as dio
from . import _diskutil as du
from ._diskrec import _FILE, _GEN_MAX, _INLINE, _Rec, _check_fields, _check_gen, _decode, _encode, _short
from .base import BlobInfo, BlobTier

__all__ = ["DiskTier"]

_USED = "used"                 # the byte counter's index key; blob keys are ints

# vacuum() keeps unreferenced data files younger than this: a put may sit
# between rename and index commit for up to the SQLite busy timeout.
_ORPHAN_AGE = 300.0


def _gen_id(gen: int) -> str:
    """How a payload file's name begins: its generation in hex, lowest digit first, so that the
    files of consecutive generations spread over the 256 ``data/XX/`` directories."""
    return f"{gen:016x}"[::-1]


class DiskTier(BlobTier):
    """SSD tier: blobs (``meta`` + payload) addressed by generation, in a
    directory holding an index (diskcache) and payload files.

    Payloads below ``inline_threshold`` bytes are stored inside the index
    record; larger ones in files of their own.  Every payload carries an
    xxh3-64 checksum that is verified on every read.

    Several threads and processes may open the same directory at once; the
    index (SQLite in WAL mode) serialises writers, payload files are never
    modified after they are published.  ``capacity`` is per handle: each
    handle refuses puts that would push the shared ``used`` counter past its
    own capacity.  Handles opened with ``owner=`` must all carry the same
    owner id (one store per directory).

    Nothing here is zero-copy: ``put`` copies the payload to disk,
    ``read_into`` copies it from disk into the caller's buffer, ``get`` into
    a new ``bytearray``.
    """

    name = "ssd"
    zero_copy = False
    shared = True

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
            if not 0 < len(owner) <= du.MAX_OWNER or not owner.isprintable():
                raise ValueError(f"owner must be 1 to {du.MAX_OWNER} printable characters, got {owner!r}")
        self._path = os.path.abspath(os.fspath(path))
        self._index_dir = os.path.join(self._path, "index")
        self._data_dir = os.path.join(self._path, "data")
        self._tmp_dir = os.path.join(self._path, "tmp")
        self._inline_threshold = inline_threshold
        self._durable = bool(durable)
        self._closed = False
        self._lock: du.OwnerLock | None = None
        self._dropped: set[int] = set()     # generations this handle removed entirely (see delete)
        cap = parse_size(capacity, "ssd_size")

        du.make_dir(self._path, root=True)
        for d in (self._index_dir, self._data_dir, self._tmp_dir):
            du.make_dir(d)
        du.check_subdirs(self._data_dir)
        self._secure_files()           # before SQLite opens them
        if owner is not None:
            self._lock = du.OwnerLock(os.path.join(self._path, du.LOCK_NAME), owner, self._path)

        settings = dict(
            eviction_policy="none",        # the store decides what goes, never diskcache
            size_limit=1 << 62,
            cull_limit=0,
            statistics=False,
            tag_index=False,
            disk_min_file_size=1 << 40,    # records always stay inside SQLite
        )
        if self._durable:
            settings["sqlite_synchronous"] = 2
        self._cache: diskcache.Cache = None   # used only while open (_check_open)
        try:
            self._cache = diskcache.Cache(self._index_dir, **settings)
            # SQLite creates cache.db (and its -wal, -shm) with the umask's
            # mode; later -wal/-shm files copy cache.db's mode, so tightening
            # it once keeps every index file 0600.
            self._secure_files()
            self._cache.add(_USED, 0)
            du.clean_tmp(self._tmp_dir)
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
        """Payload bytes held (one counter shared by every handle and process).  O(1)."""
        self._check_open()
        return int(self._cache.get(_USED, 0))

    def __contains__(self, gen: object) -> bool:
        """True if blob ``gen`` is held (False for anything not a generation).  O(log blobs)."""
        try:
            gen = _check_gen(gen)
        except (TypeError, ValueError):
            return False
        self._check_open()
        return self._cache.get(gen) is not None

    def __repr__(self) -> str:
        """Path, and capacity or whether the handle is closed."""
        state = "closed" if self._closed else f"capacity={format_size(self._capacity)}"
        return f"<DiskTier {self._path} {state}>"

    def close(self) -> None:
        """Close this handle (idempotent); the blobs stay on disk.

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

    def put(self, gen: int, meta: bytes, payload, *, key: str, priority: int = 0,
            expire_at: float | None = None) -> None:
        """Store a copy of ``payload`` with ``meta`` as blob ``gen`` (never overwritten).

        ``payload`` is any C-contiguous buffer (bytes, memoryview, numpy
        array); it is written straight from the caller's memory (one copy,
        to the page cache).  ``key``, ``priority`` and ``expire_at`` are
        recorded for ``entries()`` only.  Atomic: readers find the whole blob
        or none.  Raises ``ValueError`` if ``gen`` is already held,
        ``StoreFullError`` when the payload does not fit under ``capacity``
        or the filesystem is full; then nothing is stored.
        """
        gen = self._gen(gen)
        key_b, meta, priority, expire_at = _check_fields(key, meta, priority, expire_at)
        mv = dio.as_bytes_view(payload, writable=False, what="payload")
        nbytes = mv.nbytes
        now = time.time()

        if nbytes < self._inline_threshold:
            checksum = xxhash.xxh3_64_intdigest(mv)
            rec = _encode(_INLINE, meta, key_b, nbytes, checksum, priority, expire_at, now, mv.tobytes())
            self._commit(gen, key, rec, nbytes, None)
            return

        # Cheap early refusals before writing gigabytes (both rechecked at commit).
        if self._cache.get(gen) is not None:
            raise self._taken(gen)
        self._check_room(key, nbytes, self.used)
        # Named by generation (delete(gen) finds it without a record) and writer
        # (sweep() knows a dead writer will never commit it).
        file_id = f"{_gen_id(gen)}.{uuid.uuid4().hex[:8]}.{du.writer_id()}"
        final = self._file_path(file_id)
        tmp = os.path.join(self._tmp_dir, du.tmp_prefix() + file_id + ".tmp")
        try:
            checksum = dio.write_payload(mv, tmp, final, durable=self._durable)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
                raise StoreFullError(
                    f"SSD tier at {self._path}: the filesystem ran out of space writing "
                    f"{format_size(nbytes)} for {_short(key)} ({exc.strerror}); free disk space "
                    f"or lower ssd_size= (currently {self._capacity} bytes)") from exc
            raise
        rec = _encode(_FILE, meta, key_b, nbytes, checksum, priority, expire_at, now, file_id.encode())
        self._commit(gen, key, rec, nbytes, final)

    def delete(self, gen: int, *, later: Callable[[str], None] | None = None) -> bool:
        """Remove blob ``gen``; True if it was there.

        The record (and its bytes in ``used``) goes at once.  ``later``: a
        callable that takes the path of the payload file (renamed into
        ``tmp/`` first) and removes it off the caller's thread; by default the
        file is removed here.  A reader that already opened the file still
        reads it whole.

        With no record, any payload file of ``gen`` is removed all the same
        (what a writer or remover killed mid-way left): call it only for a
        generation that nobody is writing.
        """
        gen = self._gen(gen)
        if self._drop([gen], later):
            if len(self._dropped) > 4096:   # only the next call needs it: never long
                self._dropped.clear()
            self._dropped.add(gen)
            return True
        if gen in self._dropped:        # we removed it whole (the common second call)
            self._dropped.discard(gen)
            return False
        du.remove_files_of(self._data_dir, f"{_gen_id(gen)}.")
        du.clean_tmp(self._tmp_dir)
        return False

    def clear(self) -> int:
        """Remove every blob (in batches, safe against concurrent writers); return how many.  O(blobs)."""
        n, batch = 0, []
        for gen in self._index_keys(blobs_only=True):
            batch.append(gen)
            if len(batch) == 500:
                n += self._drop(batch)
                batch = []
        return n + self._drop(batch)

    def vacuum(self, live: Callable[[int], bool] | None = None, min_age: float | None = None) -> int:
        """Remove what nothing needs; return how many things were removed.  O(blobs + files).

        * with ``live``: every blob whose generation ``live(gen)`` says is not
          live (``live`` must answer True for generations being written);
        * index entries that are not blobs of this version (left by an older
          yrcache, or damaged beyond decoding);
        * what ``sweep(min_age)`` removes.
        """
        self._check_open()
        candidates = du.stray_candidates(self._data_dir, _ORPHAN_AGE if min_age is None else min_age)
        referenced, dead, alien = set(), [], []
        for k in self._index_keys(blobs_only=False):
            raw = self._cache.get(k)
            try:
                rec = _decode(raw)
                gen = _check_gen(k)
            except (TypeError, ValueError):
                if raw is not None:
                    alien.append(k)
                continue
            if live is not None and not live(gen):
                dead.append(gen)
            elif rec.kind == _FILE:
                referenced.add(rec.raw[rec.tail:].decode())
        removed = sum(self._drop(dead[i:i + 500]) for i in range(0, len(dead), 500))
        for k in alien:
            removed += bool(self._cache.delete(k))
        return removed + du.remove_strays(candidates, referenced) + du.clean_tmp(self._tmp_dir)

    def sweep(self, min_age: float | None = None) -> int:
        """Remove crash leftovers; return how many.  O(files), plus O(blobs) if any is found.

        Payload files no record refers to, written by a dead process (it will
        never commit them) or untouched for ``min_age`` seconds (default: a few
        minutes, as a live put may be about to publish them; 0 when no other
        process writes the directory); temp files of dead processes.
        """
        self._check_open()
        candidates = du.stray_candidates(self._data_dir, _ORPHAN_AGE if min_age is None else min_age)
        removed = du.remove_strays(candidates, self._referenced()) if candidates else 0
        return removed + du.clean_tmp(self._tmp_dir)

    def clean_tmp(self) -> int:
        """Remove the temp files of dead processes (a write or a deferred
        removal they did not finish); return how many.  O(temp files)."""
        self._check_open()
        return du.clean_tmp(self._tmp_dir)

    def check(self) -> None:
        """Raise ``CorruptObjectError`` naming the first blob whose payload
        file is missing, is not a regular file only we can write, or has the
        wrong size (reads would fail on it), and ``YrcacheError`` if payload
        files that no record refers to were left by dead processes.  Reads no
        payload (checksums are verified on every read).  O(blobs + files);
        meant for a directory nobody is writing.
        """
        self._check_open()
        strays, ids = du.stray_candidates(self._data_dir, math.inf), set()   # dead writers' only
        for gen in self._index_keys(blobs_only=True):
            raw = self._cache.get(gen)
            if raw is None:
                continue
            rec = self._decode(gen, raw)
            if rec.kind == _INLINE:
                self._check_inline(gen, rec, memoryview(rec.raw)[rec.tail:])
                continue
            ids.add(rec.raw[rec.tail:].decode())
            fpath = self._file_path(rec.raw[rec.tail:].decode())
            why = dio.payload_problem(fpath, rec.nbytes)
            if why is not None and self._cache.get(gen) is not None:     # not deleted meanwhile
                raise self._corrupt(gen, rec.key, fpath, why)
        left = [p for name, p in strays if name not in ids]
        if left:
            raise YrcacheError(
                f"SSD tier at {self._path} holds {len(left)} payload files that no record refers "
                f"to, left by dead processes (e.g. {left[0]}); a new store over the directory "
                f"removes them (or DiskTier(path).sweep())")

    # ------------------------------------------------------------------- reads

    def info(self, gen: int) -> BlobInfo | None:
        """What the tier records about blob ``gen`` (no payload I/O), or None.  O(log blobs)."""
        gen = self._gen(gen)
        raw = self._cache.get(gen)
        return None if raw is None else self._info(gen, self._decode(gen, raw))

    def entries(self) -> Iterator[BlobInfo]:
        """Every blob, in generation order, lazily (for rebuilding the store's
        index and for checks).  O(blobs); blobs may be deleted while iterating.
        Index entries that do not decode are skipped (``vacuum`` removes them)."""
        for gen in self._index_keys(blobs_only=True):
            raw = self._cache.get(gen)
            if raw is not None:
                try:
                    rec = _decode(raw)
                except ValueError:
                    continue
                yield self._info(gen, rec)

    def read_into(self, gen: int, out) -> bytes:
        """Copy blob ``gen``'s payload into ``out`` and return its meta.

        ``out`` must be a writable C-contiguous buffer of exactly ``nbytes``
        (see ``info``); the file is read straight into it (no intermediate
        copy) and checked against its xxh3-64 checksum on the way.  Raises
        ``KeyError`` if there is no such blob (also when it is deleted
        before its file was opened), ``ValueError`` if ``out`` has the wrong
        size, ``CorruptObjectError`` if the payload is damaged or missing
        (``out`` then holds garbage).
        """
        gen = self._gen(gen)
        mv = dio.as_bytes_view(out, writable=True, what="out")
        rec = self._record(gen)
        if mv.nbytes != rec.nbytes:
            raise ValueError(f"out has {mv.nbytes} bytes but SSD blob {gen:016x} of "
                             f"{_short(rec.key)} has {rec.nbytes}; size it from info(gen).nbytes")
        return self._fill(gen, rec, mv)

    def get(self, gen: int) -> tuple[bytes, bytearray]:
        """Return ``(meta, payload)`` with the payload copied into a new bytearray.

        Same checks and errors as ``read_into``.
        """
        gen = self._gen(gen)
        rec = self._record(gen)
        if rec.kind == _INLINE:
            buf = bytearray(memoryview(rec.raw)[rec.tail:])
            self._check_inline(gen, rec, buf)
            return rec.meta, buf
        buf = bytearray(rec.nbytes)
        return self._fill(gen, rec, memoryview(buf)), buf

    # --------------------------------------------------------------- internals

    def _secure_files(self) -> None:
        db = os.path.join(self._index_dir, "cache.db")        # diskcache.core.DBNAME
        du.secure_files((os.path.join(self._path, du.LOCK_NAME), db, db + "-wal", db + "-shm", db + "-journal"))

    def _check_open(self) -> None:
        # diskcache would silently reconnect a closed Cache.
        if self._closed:
            raise StoreClosedError(f"SSD tier at {self._path} is closed; open a new DiskTier to use it")

    def _gen(self, gen: object) -> int:
        self._check_open()
        return _check_gen(gen)

    def _taken(self, gen: int) -> ValueError:
        return ValueError(f"generation {gen:016x} is already held by SSD tier {self._path}: a "
                          f"generation is written once; give the new copy a new one (base.new_gen())")

    def _check_room(self, key: str, nbytes: int, used_before: int) -> None:
        if nbytes and used_before + nbytes > self._capacity:
            raise StoreFullError(
                f"SSD tier at {self._path} is full: {format_size(used_before)} used of "
                f"{format_size(self._capacity)} capacity, object {_short(key)} needs "
                f"{format_size(nbytes)}; delete objects or raise ssd_size= "
                f"(currently {self._capacity} bytes)")

    def _file_path(self, file_id: str) -> str:
        return os.path.join(self._data_dir, file_id[:2], file_id)

    def _corrupt(self, gen: int, key: str | None, fpath: str | None, what: str) -> CorruptObjectError:
        where = f"payload file {fpath}" if fpath else f"index {self._index_dir}"
        of = f" of {_short(key)}" if key is not None else ""
        return CorruptObjectError(
            f"SSD blob {gen:016x}{of} in {self._path} is corrupt: {what} ({where}); "
            f"delete the key and write it again")

    def _decode(self, gen: int, raw: bytes) -> _Rec:
        try:
            return _decode(raw)
        except ValueError as exc:
            raise self._corrupt(gen, None, None, str(exc)) from None

    def _record(self, gen: int) -> _Rec:
        raw = self._cache.get(gen)
        if raw is None:
            raise KeyError(gen)
        return self._decode(gen, raw)

    @staticmethod
    def _info(gen: int, rec: _Rec) -> BlobInfo:
        return BlobInfo(gen, rec.key, rec.meta, rec.nbytes, rec.priority, rec.expire_at, rec.created)

    def _index_keys(self, *, blobs_only: bool) -> Iterator:
        """The index's keys in order (paged by diskcache), only generations if ``blobs_only``."""
        for k in self._cache.iterkeys():
            self._check_open()
            if k == _USED:
                continue
            if not blobs_only or (type(k) is int and 0 < k <= _GEN_MAX):
                yield k

    def _referenced(self) -> set[str]:
        """The file ids of every file blob (read after listing candidate files)."""
        ids = set()
        for gen in self._index_keys(blobs_only=True):
            raw = self._cache.get(gen)
            try:
                rec = _decode(raw)
            except ValueError:
                continue
            if rec.kind == _FILE:
                ids.add(rec.raw[rec.tail:].decode())
        return ids

    def _commit(self, gen: int, key: str, rec: bytes, nbytes: int, final: str | None) -> None:
        """Add record ``rec`` of ``gen`` (whose payload file, if any, is ``final``)."""
        try:
            with self._cache.transact():
                if not self._cache.add(gen, rec):
                    raise self._taken(gen)
                if nbytes:
                    used = self._cache.incr(_USED, nbytes)
                    self._check_room(key, nbytes, used - nbytes)   # raises -> rollback
        except BaseException:
            if final is not None:
                try:
                    os.unlink(final)
                except OSError:
                    pass
            raise

    def _drop(self, gens: list[int], later: Callable[[str], None] | None = None) -> int:
        """Remove the records of ``gens`` in one transaction, then their files; return how many."""
        files, n = [], 0
        if not gens:
            return 0
        with self._cache.transact():
            for gen in gens:
                raw = self._cache.get(gen)
                if raw is None or not self._cache.delete(gen):
                    continue
                n += 1
                try:
                    rec = _decode(raw)
                except ValueError:       # damaged: its size is unknown, its file an orphan
                    continue
                if rec.nbytes:
                    self._cache.incr(_USED, -rec.nbytes)
                if rec.kind == _FILE:
                    files.append(rec.raw[rec.tail:].decode())
        for file_id in files:
            p = self._file_path(file_id)
            if later is None:
                du.unlink(p)
                continue
            # Under our name in tmp/ first: if we die before the unlink, the
            # temp file of a dead process goes at the next clean_tmp().
            gone = os.path.join(self._tmp_dir, du.tmp_prefix() + file_id + ".del.tmp")
            try:
                os.rename(p, gone)
            except FileNotFoundError:
                continue                 # another process's delete(gen) removed it
            later(gone)
        return n

    def _check_inline(self, gen: int, rec: _Rec, body) -> None:
        if len(body) != rec.nbytes:
            raise self._corrupt(gen, rec.key, None, f"inline payload has {len(body)} bytes, "
                                                    f"the record says {rec.nbytes}")
        got = xxhash.xxh3_64_intdigest(body)
        if got != rec.checksum:
            raise self._corrupt(gen, rec.key, None, f"inline payload failed its xxh3_64 checksum "
                                                    f"(stored {rec.checksum:016x}, computed {got:016x})")

    def _fill(self, gen: int, rec: _Rec, mv: memoryview) -> bytes:
        """Copy ``rec``'s payload into ``mv`` (sized by the caller), verified; return the meta."""
        if rec.kind == _INLINE:
            body = memoryview(rec.raw)[rec.tail:]
            self._check_inline(gen, rec, body)
            mv[:] = body
            return rec.meta
        fpath = self._file_path(rec.raw[rec.tail:].decode())
        try:
            dio.read_payload(fpath, mv, rec.checksum, lambda why: self._corrupt(gen, rec.key, fpath, why))
        except FileNotFoundError:
            # Deleted after we looked it up (a generation is never rewritten,
            # so the record still there means the file went missing).
            if self._cache.get(gen) is None:
                raise KeyError(gen) from None
            raise self._corrupt(gen, rec.key, fpath, "its payload file is missing") from None
        return rec.meta
