"""Page-locking a process's arena mapping for CUDA copies (``cudaHostRegister``), and undoing it.

CUDA keys a registration by virtual address.  A mapping unmapped while still
registered leaves its registration behind, and a later mapping at the same address
(another store, or the same one attached again) is then taken for pinned memory
whose pages are the old ones: a device copy into the new mapping lands in the old
pages and reads back as zeros.  So the process that registered a mapping undoes it
before the mapping goes (``tiers/dram.py`` calls :func:`unregister`), and a
registration found over a mapping of ours that we did not make is such a leftover:
it is undone, and ours made.

torch is imported only here and only once a CUDA copy is about to run, so CPU-only
users never initialise CUDA.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("yrcache")

ALREADY_REGISTERED = 712       # cudaErrorHostMemoryAlreadyRegistered


def _code(err: Any) -> int:
    """torch's cudart calls return a cudaError enum (older versions an int, or None)."""
    return 0 if err is None else int(err)


def _drain_error(torch: Any) -> None:
    """A failed runtime call leaves its error for the next check, which would raise it from
    whatever CUDA call the user makes next: check once now and drop it."""
    try:
        torch.empty(1, device="cuda").zero_()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the stale error itself, raised here instead of later
        pass


def _cuda() -> Any:
    """torch, when it has a CUDA device to copy to (else None).  Tests put a fake here."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def register(arena: Any) -> bool:
    """Register ``arena``'s mapping as pinned host memory, once per process.

    True when it is registered (now or before); False without CUDA, in a process
    that cannot use CUDA (a forked child of one that did), or when CUDA refuses
    (logged once: copies then run at pageable speed, and stay correct).
    """
    pid = os.getpid()
    done = getattr(arena, "cuda_pin", None)        # (pid, registered?) of the last try
    if done is None or done[0] != pid:
        done = arena.cuda_pin = (pid, _register(arena))
    return done[1]


def _register(arena: Any) -> bool:
    try:
        torch = _cuda()
        if torch is None:
            return False
        cudart = torch.cuda.cudart()
        err = _code(cudart.cudaHostRegister(arena.addr, arena.size, 0))
        if err == ALREADY_REGISTERED:      # a leftover of an earlier mapping at this address
            _drain_error(torch)
            _code(cudart.cudaHostUnregister(arena.addr))
            err = _code(cudart.cudaHostRegister(arena.addr, arena.size, 0))
    except Exception as e:  # noqa: BLE001 - CUDA unusable in this process (e.g. after fork)
        log.warning("store %r: CUDA copies run unpinned (%s: %s)", arena.name, type(e).__name__, e)
        return False
    if err:
        _drain_error(torch)
        log.warning("store %r: cudaHostRegister of its %d-byte arena failed (CUDA error %d); "
                    "copies between it and the GPU run at pageable speed", arena.name, arena.size, err)
        return False
    return True


def unregister(arena: Any) -> None:
    """Undo :func:`register` before ``arena`` is unmapped (only in the process that made it);
    device copies still running into or out of the mapping finish first."""
    if getattr(arena, "cuda_pin", None) != (os.getpid(), True):
        return
    arena.cuda_pin = None
    try:
        torch = _cuda()
        torch.cuda.synchronize()
        err = _code(torch.cuda.cudart().cudaHostUnregister(arena.addr))
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
        return
    if err:
        _drain_error(torch)
