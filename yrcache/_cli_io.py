"""File input and output of ``yrcache get`` and ``yrcache put``: raw bytes or
.npy files, written completely or not at all, read straight into the arena."""

from __future__ import annotations

import errno
import io
import os
import stat
import sys
from typing import IO, TYPE_CHECKING, Any, Callable

from ._cli_base import CliError, display_key
from .sizes import format_size

if TYPE_CHECKING:
    from .store import TieredStore

_NPY_MAGIC = b"\x93NUMPY"


def _as_array(key: str, value: Any, info: dict) -> Any:
    """The value as a numpy array for a .npy file (a tensor shares its memory)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    if info["kind"] == "tensor":
        try:
            return value.numpy()
        except (TypeError, RuntimeError):
            raise CliError(f"'{display_key(key)}' is a {info['dtype']} tensor, which numpy has no dtype "
                           "for; write its raw bytes instead (--out FILE not ending in .npy)") from None
    raise CliError(f"'{display_key(key)}' holds bytes, not an array, so it has no .npy form; "
                   "write its raw bytes instead (--out FILE not ending in .npy, no --npy)")


class _WriteAll:
    """A binary file whose ``write`` writes every byte or raises.  When a pipe's
    reader leaves during a large write, ``BufferedWriter.write`` can return the
    short count of what went through instead of raising (seen with CPython
    3.11): ignoring it, ``get ... | head`` would end with status 0 as if the
    whole value had been written."""

    def __init__(self, f: IO[bytes]):
        self._f = f

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            n = self._f.write(mv[done:])
            if not n:                     # None: a non-blocking stream that would block
                raise OSError(errno.EAGAIN, "the output would block; nothing more was written")
            done += n
        return done

    def flush(self) -> None:
        self._f.flush()


def _writer(key: str, value: Any, info: dict, npy: bool) -> Callable[[IO[bytes]], None]:
    """``write(f)``: the value as a .npy file, or its raw bytes (C order, native byte order)."""
    import numpy as np

    from . import codec

    if npy:
        arr = _as_array(key, value, info)

        def write_npy(f: IO[bytes]) -> None:
            np.save(_WriteAll(f), arr, allow_pickle=False)
        return write_npy
    flat = codec.flat_bytes(value)

    def write_raw(f: IO[bytes]) -> None:
        _WriteAll(f).write(flat.data)
    return write_raw


def _write_file(path: str, write: Callable[[IO[bytes]], None]) -> int | None:
    """Write to ``path``; the size of the file written (None if it is no regular file).
    A file this call created is removed again if writing fails."""
    created = not os.path.lexists(path)
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            st = os.fstat(f.fileno())
            return st.st_size if stat.S_ISREG(st.st_mode) else None
    except BaseException:
        if created and os.path.isfile(path):
            os.unlink(path)               # no half-written file left behind
        raise


def _read_stdin(limit: int | None = None) -> bytes:
    if sys.stdin.isatty():
        print("yrcache: reading the value from stdin (end with Ctrl-D)", file=sys.stderr)
    return _read_all(sys.stdin.buffer, "stdin", limit)


def _read_all(f: Any, src: str, limit: int | None) -> bytes:
    """All of a stream of unknown size (stdin, a pipe, a device), refused past ``limit``
    bytes (the store's capacity: ``/dev/zero`` would otherwise fill this machine's memory)."""
    if limit is None:
        return f.read()
    out = bytearray()
    while chunk := f.read(min(1 << 20, limit + 1 - len(out))):
        out += chunk
        if len(out) > limit:
            raise CliError(f"{src} gives more bytes than the store can hold ({format_size(limit)}, or a third "
                           "of this machine's free memory: store a file instead); nothing was stored")
    return bytes(out)


def _capacity(s: TieredStore) -> int:
    """The most bytes a value read from a stream may have: what all of ``s``'s tiers hold,
    and at most a third of this machine's free memory (the stream is buffered here, then copied)."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(sum(int(t.get("capacity", 0)) for t in s.stats()["tiers"].values()), free // 3)


def _load_npy(path: str, forced: bool, limit: int | None = None) -> Any:
    """The array in the .npy file ``path`` (``-``: stdin, refused past ``limit`` bytes),
    memory-mapped when it is a file."""
    import numpy as np

    src = "stdin" if path == "-" else path
    if path == "-":
        fobj: Any = io.BytesIO(_read_stdin(limit))
        head = fobj.getvalue()[:6]
    else:
        with open(path, "rb") as f:
            head = f.read(6)
        fobj = path
    if head != _NPY_MAGIC:
        raise CliError(f"{src} is not a .npy file (it does not start with the .npy magic); "
                       + ("drop --npy to store its bytes" if forced else "store its bytes with --raw"))
    try:
        if path != "-":
            try:
                return np.load(fobj, mmap_mode="r", allow_pickle=False)   # no copy of the file
            except ValueError:
                pass                      # e.g. an empty array, which cannot be mapped
        return np.load(fobj, allow_pickle=False)
    except ValueError as e:
        raise CliError(f"cannot read {src} as .npy: {e}") from None


def _put_file(s: TieredStore, key: str, path: str, ttl: float | None, priority: int) -> None:
    """Store a file's bytes; a regular file is read straight into the arena (one copy)."""
    if path == "-":
        s.put(key, _read_stdin(_capacity(s)), ttl=ttl, priority=priority)
        return
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):                 # a pipe or device: size unknown
            s.put(key, _read_all(f, path, _capacity(s)), ttl=ttl, priority=priority)
            return
        nbytes = st.st_size

        def fill(view: Any) -> None:
            f.seek(0)
            mv, done = memoryview(view), 0
            while done < nbytes:
                n = f.readinto(mv[done:])
                if not n:
                    raise CliError(f"{path} shrank while it was read; nothing was stored")
                done += n
            if f.read(1):
                raise CliError(f"{path} grew while it was read; nothing was stored")

        s.put_with(key, b"B", nbytes, fill, priority=priority, ttl=ttl)
