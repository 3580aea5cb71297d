"""HBM tier: torch tensors on one device, held by the process that put them.

Device memory belongs to a process (its CUDA context), so this tier is a
per-process table ``generation -> tensor`` (``shared = False``).  The arena's
index holds a stub for every HBM object (size, codec header, priority, the
holder's process slot and the generation), so every process on the node sees
the key, its size and its tier; ``hbm.py`` is the protocol by which another
process reads one.

Tests run this tier with ``device="cpu"``: the same code, with host memory
standing in for HBM.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from .. import codec
from ..errors import StoreFullError
from ..sizes import format_size
from .base import BlobInfo, BlobTier


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise ImportError("the HBM tier needs torch: pip install 'yrcache[torch]'") from None
    return torch


class _Blob(NamedTuple):
    tensor: Any          # contiguous tensor on the tier's device
    info: BlobInfo


def _check_gen(gen: Any) -> int:
    if type(gen) is not int:
        raise TypeError(f"a generation is an int, not {type(gen).__name__}")
    if not 0 < gen < 1 << 63:
        raise ValueError(f"a generation is in 1..2**63-1, got {gen}")
    return gen


class DeviceTier(BlobTier):
    """Tensors on ``device`` up to ``capacity`` bytes, private to this process.

    ``put`` keeps a copy on the device (device-to-device from a device
    tensor, host-to-device from host bytes), so a caller changing its own
    tensor later cannot change the stored object.  ``get`` returns the stored
    tensor itself (zero-copy).  Thread-safe.
    """

    name = "hbm"
    zero_copy = True
    shared = False

    def __init__(self, device: str, capacity: int):
        torch = _torch()
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a torch device ({e}); use e.g. 'cuda:0' or 'cpu'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} but CUDA is not available; use device='cpu' or drop hbm=")
        self._capacity = int(capacity)
        self._used = 0
        self._blobs: dict[int, _Blob] = {}
        self._lock = threading.Lock()

    def __contains__(self, gen: object) -> bool:
        return gen in self._blobs if type(gen) is int else False

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    def holds(self, value: Any) -> bool:
        """Is ``value`` a tensor already on this tier's device?"""
        return codec.is_tensor(value) and value.device == self.device

    def put(self, gen: int, meta: bytes, payload: Any, *, key: str, priority: int = 0,
            expire_at: float | None = None) -> None:
        """Keep a device copy of ``payload`` (a tensor, or host bytes described by ``meta``)."""
        _check_gen(gen)
        torch = _torch()
        if codec.is_tensor(payload):
            src = payload.detach()
        else:   # host bytes: the tensor they encode (no copy), or raw bytes
            raw = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
            src = codec.decoder(meta)(raw, raw.nbytes) if meta[:2] == b"T;" else torch.from_numpy(raw)
        nbytes = src.numel() * src.element_size()
        with self._lock:
            if gen in self._blobs:
                raise ValueError(f"generation {gen:#x} is already stored; a new copy takes a new generation")
            if self._used + nbytes > self._capacity:
                raise StoreFullError(
                    f"HBM tier on {self.device} is full: {format_size(self._used)} of "
                    f"{format_size(self._capacity)} used, {format_size(nbytes)} more do not fit; "
                    "raise hbm= or put the tensor in DRAM")
            self._used += nbytes     # claimed before the copy, which runs unlocked
        try:
            t = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            t.copy_(src)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise
        info = BlobInfo(gen, key, bytes(meta), nbytes, int(priority), expire_at, time.time())
        with self._lock:
            self._blobs[gen] = _Blob(t, info)

    def get(self, gen: int) -> Any | None:
        """The stored tensor itself (zero-copy), or None."""
        blob = self._blobs.get(gen)
        return blob.tensor if blob is not None else None

    def read_into(self, gen: int, out: Any) -> bytes:
        """Copy blob ``gen`` into ``out`` (a tensor on any device, or a host buffer)."""
        blob = self._blobs.get(_check_gen(gen))
        if blob is None:
            raise KeyError(gen)
        t = blob.tensor
        if codec.is_tensor(out):
            if out.numel() * out.element_size() != blob.info.nbytes:
                raise ValueError(f"out holds {out.numel() * out.element_size()} bytes, blob "
                                 f"{gen:#x} has {blob.info.nbytes}")
            out.view(-1).view(_torch().uint8).copy_(t.reshape(-1).view(_torch().uint8))
            return blob.info.meta
        dst = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
        if dst.nbytes != blob.info.nbytes:
            raise ValueError(f"out holds {dst.nbytes} bytes, blob {gen:#x} has {blob.info.nbytes}")
        if dst.nbytes:
            _torch().from_numpy(dst).copy_(t.reshape(-1).view(_torch().uint8))
        return blob.info.meta

    def delete(self, gen: int, *, later: Callable[[str], None] | None = None) -> bool:
        with self._lock:
            blob = self._blobs.pop(_check_gen(gen), None)
            if blob is not None:
                self._used -= blob.info.nbytes
        return blob is not None

    def info(self, gen: int) -> BlobInfo | None:
        blob = self._blobs.get(_check_gen(gen))
        return blob.info if blob is not None else None

    def entries(self) -> Iterator[BlobInfo]:
        with self._lock:
            infos = [b.info for b in self._blobs.values()]
        return iter(infos)

    def clear(self) -> None:
        """Forget every tensor (the device memory goes with the last reference)."""
        with self._lock:
            self._blobs.clear()
            self._used = 0
