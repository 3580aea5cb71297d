"""A store's settings: constructor arguments and ``YRCACHE_*`` variables -> one object.

An argument given to ``TieredStore(...)`` wins over the environment, which
wins over the defaults.  The settings every process of a store must share
(tiers, policy, watermarks, identity) are recorded in the arena when it is
created (``Settings.shared``) and read back by every process that attaches.
"""

from __future__ import annotations

import enum
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import StoreFullError
from .policy import Policy
from .sizes import format_size, parse_size
from .tiers.dram import MIN_SIZE as MIN_DRAM

DEFAULT_DRAM = "1GiB"


class Tier(enum.IntEnum):
    """Where an object lives: GPU memory, the shared DRAM arena or SSD files.

    Examples:
        >>> from yrcache import TieredStore, Tier
        >>> with TieredStore(dram="16MiB") as s:
        ...     s.put("x", b"abc")
        ...     s.tier_of("x") is Tier.DRAM
        True
    """

    HBM = 0
    DRAM = 1
    SSD = 2


class WriteMode(enum.Enum):
    """Replication of a put in cluster mode (ignored by an embedded store).

    ``WRITE_THROUGH``: ``put`` returns once every replica holds the object;
    ``ASYNC``: once the local copy is written, replicas follow; ``NONE``: no
    replicas.  Strings name the same modes.

    Examples:
        >>> from yrcache import WriteMode
        >>> WriteMode("async") is WriteMode.ASYNC
        True
    """

    WRITE_THROUGH = "write_through"
    ASYNC = "async"
    NONE = "none"


_MODES = {m.value: m for m in WriteMode}


def write_mode(mode: WriteMode | str | None) -> WriteMode | None:
    """Validate a ``write_mode=`` argument."""
    if mode is None or isinstance(mode, WriteMode):
        return mode
    found = _MODES.get(mode) if type(mode) is str else None     # (no Enum lookup: a cold put's ~3 us)
    if found is not None:
        return found
    try:
        return WriteMode(mode)
    except ValueError:
        raise ValueError(f"write_mode must be one of {[m.value for m in WriteMode]}, got {mode!r}") from None


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _size(arg: Any, what: str, env: str) -> int | None:
    """A size argument, else its environment variable (an error names the one it came from)."""
    return parse_size(arg, what) if arg is not None else parse_size(_env(env), f"{env} (the environment's {what})")


def _ratios(ratios) -> tuple[float, float, float]:
    if ratios is None:
        return (0.0, 1.0, 0.0)
    r = tuple(float(x) for x in ratios)
    if len(r) != 3 or any(x < 0 for x in r) or abs(sum(r) - 1.0) > 1e-6:
        raise ValueError(f"ratios must be three non-negative shares (hbm, dram, ssd) summing to 1, got {ratios!r}")
    return r


@dataclass
class Settings:
    """Everything a new store is created with (validated)."""

    dram: int
    dram_explicit: bool          # dram= (or capacity=, YRCACHE_DRAM) was given, not defaulted
    ssd: str | None
    ssd_size: int | None
    hbm: int
    device: str | None
    policy: str
    high: float
    low: float
    promote_after: int
    persist: bool | None
    pickle: bool
    prefault: bool
    huge_pages: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def build(cls, *, dram=None, ssd=None, ssd_size=None, hbm=None, device=None, capacity=None,
              ratios=None, policy="spill", pickle=False, prefault=True, watermarks=(0.9, 0.8),
              promote_after=2, persist=None, huge_pages=False) -> "Settings":
        """Validate the constructor's arguments (falling back on ``YRCACHE_*``)."""
        if policy not in ("spill", "cache"):
            raise ValueError(f"policy must be 'spill' or 'cache', not {policy!r}")
        dram_b = _size(dram, "dram", "YRCACHE_DRAM")
        explicit = dram_b is not None
        ssd = ssd if ssd is not None else _env("YRCACHE_SSD")
        ssd_b = _size(ssd_size, "ssd_size", "YRCACHE_SSD_SIZE")
        hbm_b = _size(hbm, "hbm", "YRCACHE_HBM")
        cap_b = parse_size(capacity, "capacity")
        if cap_b is not None:
            explicit = True
            r = _ratios(ratios)
            if r[0]:
                hbm_b = hbm_b or int(cap_b * r[0])
            dram_b = dram_b or int(cap_b * r[1])
            if r[2]:
                ssd_b = ssd_b or int(cap_b * r[2])
                if ssd is None:
                    raise ValueError("ratios give SSD a share: pass ssd= (a directory) as well")
        elif ratios is not None:
            raise ValueError("ratios= splits capacity=; pass capacity= as well")
        if dram_b is None:
            dram_b = parse_size(DEFAULT_DRAM)
        if dram_b < MIN_DRAM:
            raise ValueError(f"dram must be at least {format_size(MIN_DRAM)}, got {dram_b} bytes")
        if ssd is not None and not os.fspath(ssd):
            raise ValueError("ssd= is an empty path: pass the directory for the SSD tier (for example "
                             "ssd='/mnt/nvme/yrcache'), or leave ssd= out for a store without one")
        if ssd_b is not None and ssd is None:
            raise ValueError("ssd_size= needs ssd= (the directory for the SSD tier)")
        if device is not None and not hbm_b:
            raise ValueError("device= places the HBM tier: give it a size with hbm= (or capacity= and ratios=)")
        high, low = (float(w) for w in watermarks)
        Policy(high, low, int(promote_after))   # validates
        return cls(dram=dram_b, dram_explicit=explicit,
                   ssd=os.path.abspath(os.path.expanduser(os.fspath(ssd))) if ssd is not None else None,
                   ssd_size=ssd_b, hbm=hbm_b or 0, device=device, policy=policy, high=high, low=low,
                   promote_after=int(promote_after), persist=persist, pickle=bool(pickle),
                   prefault=bool(prefault), huge_pages=bool(huge_pages))

    def check_room(self, shm_dir: str) -> None:
        """Refuse a DRAM tier larger than the free space of ``shm_dir`` (early, clear)."""
        if not os.path.isdir(shm_dir):
            return
        free = shutil.disk_usage(shm_dir).free
        if self.dram > free:
            raise StoreFullError(
                f"cannot create a store of dram={format_size(self.dram)}: {shm_dir} has "
                f"{format_size(free)} free; choose a smaller dram= (or add an SSD tier with ssd=), "
                "or free shared memory (`yrcache list`, `yrcache destroy NAME`)")

    def shared(self) -> dict[str, Any]:
        """What every process of the store reads back from the arena."""
        return {"ssd": self.ssd, "ssd_size": self.ssd_size, "policy": self.policy, "high": self.high,
                "low": self.low, "promote_after": self.promote_after, "hbm": self.hbm,
                "persist": bool(self.persist), "huge_pages": self.huge_pages, "id": self.id}


def default_device() -> str:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("hbm= needs a CUDA device and none is available; pass device='cpu' "
                         "to run the HBM tier on host memory, or drop hbm=")
    return "cuda:0"
