"""Where a fetch's results go on their way: host staging buckets for destinations that
cannot be written in place, and a progress bar for big fetches on a terminal."""

from __future__ import annotations

import sys
from typing import Any

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

    def flush(self) -> None:
        for dev in self.pending:
            _torch().cuda.synchronize(dev)
        self.pending, self.used = set(), 0
