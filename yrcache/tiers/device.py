"""HBM tier: torch tensors on one device, held by the process that put them.

Device memory belongs to a process (its CUDA context), so this tier is a
per-process table ``key -> tensor``.  The arena's index holds a *stub* for
every HBM object (size, codec header, priority, the owner's process slot),
so every process on the node sees the key, its size and its tier.

How another process reads an HBM object: its ``get`` marks the stub
"wanted" and wakes the owner through a futex word in the arena; a small
service thread in the owner copies the tensor into the DRAM arena (one D2H
copy into an arena block) and replaces the stub, after which the reader gets
the usual zero-copy DRAM view.  If the owner dies, its device memory dies
with it: the next sweep removes its stubs.

Tests run this tier with ``device="cpu"``: the same code, with host memory
standing in for HBM.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple


class DeviceObject(NamedTuple):
    tensor: Any          # contiguous tensor on the tier's device
    meta: bytes
    seq: int             # the arena stub's sequence number
    priority: int


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise ImportError("the HBM tier needs torch: pip install 'yrcache[torch]'") from None
    return torch


class DeviceTier:
    """Tensors on ``device`` up to ``capacity`` bytes, private to this process.

    ``put`` keeps a device-to-device copy of the tensor (no host copy), so a
    caller changing its own tensor later cannot change the stored object.
    Thread-safe.
    """

    name = "hbm"
    zero_copy = True

    def __init__(self, device: str, capacity: int):
        torch = _torch()
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a torch device ({e}); use e.g. 'cuda:0' or 'cpu'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} but CUDA is not available; use device='cpu' or drop hbm=")
        self.capacity = int(capacity)
        self.used = 0
        self._objects: dict[str, DeviceObject] = {}
        self._lock = threading.RLock()

    @property
    def objects(self) -> int:
        return len(self._objects)

    def holds(self, value: Any) -> bool:
        """Is ``value`` a tensor already on this tier's device?"""
        torch = _torch()
        return isinstance(value, torch.Tensor) and value.device == self.device

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def store(self, key: str, tensor: Any, meta: bytes, seq: int, priority: int) -> None:
        """Record ``tensor`` (already a private device copy) as the object ``seq`` of ``key``."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None:
                self.used -= old.tensor.numel() * old.tensor.element_size()
            self._objects[key] = DeviceObject(tensor, meta, seq, priority)
            self.used += nbytes

    def copy_in(self, value: Any) -> Any:
        """A private contiguous copy of ``value`` on the device (D2D, or H2D)."""
        t = value.detach()
        out = _torch().empty(t.shape, dtype=t.dtype, device=self.device)
        out.copy_(t)
        return out

    def get(self, key: str, seq: int) -> Any | None:
        """The tensor of object ``seq`` of ``key`` if this process holds it."""
        obj = self._objects.get(key)
        return obj.tensor if obj is not None and obj.seq == seq else None

    def drop(self, key: str, seq: int | None = None) -> None:
        """Forget ``key`` (only the object ``seq`` when given)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None and (seq is None or obj.seq == seq):
                del self._objects[key]
                self.used -= obj.tensor.numel() * obj.tensor.element_size()

    def items(self) -> list[tuple[str, DeviceObject]]:
        with self._lock:
            return list(self._objects.items())

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self.used = 0


class DemotionService:
    """Owner-side thread: serves other processes' reads of HBM objects.

    Sleeps on futex word ``req`` of the arena; on a wake it demotes every
    stub marked wanted, drops tensors whose stub is gone (deleted or
    overwritten elsewhere), then bumps word ``done``.
    """

    def __init__(self, serve, arena, req: int, done: int):
        self._serve = serve
        self._arena = arena
        self._req, self._done = req, done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="yrcache-hbm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        a = self._arena
        while not self._stop.is_set():
            seen = a.notify_value(self._req)
            try:
                if self._serve():
                    a.notify_wake(self._done)
            except Exception:   # keep serving; a failed demotion leaves the stub as it was
                time.sleep(0.01)
            a.notify_wait(self._req, seen, 0.5)

    def stop(self) -> None:
        self._stop.set()
        self._arena.notify_wake(self._req)
        self._thread.join(5)
        self._arena = None
