"""Where a fetch's results go on their way: host staging buckets for destinations that
cannot be written in place, and a progress bar for big fetches on a terminal."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

from .publish import _torch

PROGRESS_MIN_BYTES = 256 << 20   # show a progress bar for fetches at least this big (on a tty)


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int) -> None:
        pass


_NO_BAR = _NoBar()


def _progress(total: int, name: str, version: int):
    """A progress bar for a big fetch on a terminal; nothing (not even the import) otherwise."""
    if total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return _NO_BAR
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"{name} v{version}")


DEVICE_SPAN_MAX = 4   # a CUDA destination reads whole source spans over PCIe up to this many times its bytes
DEVICE_TYPES = ("cuda",)   # destinations gathered on their device (tests add "cpu" to run the path)


def _readable(torch, u8: np.ndarray):
    """A CPU tensor over flat bytes that the copies only read.  torch has no read-only
    tensors and warns about read-only arrays (the arena's views are): the same memory,
    through an array that does not say so.  Valid while ``u8`` is."""
    if not isinstance(u8, np.ndarray):
        u8 = np.frombuffer(u8, np.uint8)
    if not u8.flags.writeable:
        u8 = np.ctypeslib.as_array((ctypes.c_uint8 * u8.size).from_address(u8.ctypes.data))
    return torch.from_numpy(u8)


class _Stager:
    """Host staging buckets for destinations that cannot be written in place (a device
    tensor, or a dtype other than the stored one).  For device destinations the bucket is
    pinned and copies run asynchronously; a bucket is reused only after a synchronize."""

    def __init__(self, bucket: int, pin: bool, buf=None):
        self.bucket, self.pin, self.used = bucket, pin, 0
        self.pending: set[Any] = set()    # devices with copies in flight
        self.buf = buf if buf is not None and buf.numel() >= bucket else None

    def take(self, nbytes: int):
        torch = _torch()
        need = -(-nbytes // 64) * 64                  # keep every slice 64-byte aligned
        if need > self.bucket:
            return torch.empty(nbytes, dtype=torch.uint8)   # one-off; copies from it are synchronous
        if self.used + need > self.bucket:
            self.flush()
        if self.buf is None:
            self.buf = torch.empty(self.bucket, dtype=torch.uint8, pin_memory=self.pin)
        out = self.buf[self.used:self.used + nbytes]
        self.used += need
        return out

    def copy(self, staged, dst) -> None:
        if dst.device.type == "cuda" and self.pin and staged.is_pinned():
            dst.copy_(staged, non_blocking=True)   # async H2D (+ cast on the device)
            self.pending.add(dst.device)
        else:
            dst.copy_(staged)

    def gather_on_device(self, ops, srcs, nbytes: int, stored, shape, dst) -> bool:
        """Gather a slice for CUDA destination ``dst`` on the device: each op's source span
        (rows with the gaps between them) goes over in one DMA from the pinned arena, and
        the rows are picked (and cast into ``dst``'s dtype) there.  That beats gathering
        rows on the host into a bucket while the spans are at most ``DEVICE_SPAN_MAX``
        times the bytes needed (a dim-1 half of a matrix: 2x) and lie in pinned memory
        (the arena, not a private receive buffer).  False: not done, stage."""
        if dst.device.type not in DEVICE_TYPES or not nbytes:
            return False
        spans = [(rows - 1) * ss + n for _pid, _so, _do, n, rows, ss, _ds in ops]
        if sum(spans) > DEVICE_SPAN_MAX * nbytes:
            return False
        torch = _torch()
        hosts = [_readable(torch, srcs[op[0]][op[1]:op[1] + span]) for op, span in zip(ops, spans)]
        if dst.device.type == "cuda" and not all(h.is_pinned() for h in hosts):
            return False      # (bytes received privately: torch would stage 2x the bytes itself)
        out = dst.view(-1).view(torch.uint8) if dst.dtype == stored else \
            torch.empty(nbytes, dtype=torch.uint8, device=dst.device)
        for (_pid, _so, do, n, rows, ss, ds), host in zip(ops, hosts):
            src = host.to(dst.device, non_blocking=True)
            out.as_strided((rows, n), (ds, 1), do).copy_(src.as_strided((rows, n), (ss, 1)))
        if out.data_ptr() != dst.data_ptr():
            dst.copy_(out.view(stored).view(shape))   # the cast, on the device
        if dst.device.type == "cuda":
            self.pending.add(dst.device)    # the sources are read until a synchronize
        return True

    def flush(self) -> None:
        for dev in self.pending:
            _torch().cuda.synchronize(dev)
        self.pending, self.used = set(), 0
