# Types of yrcache._fast, the C hot paths of a small get and put (yrcache/_csrc/fast.c).
from typing import Any, Literal

class HotPath:
    """Small gets and puts of one arena mapping, each in one C call (made by tiers/dram.py)."""

    def __init__(self, read_small: int, put: int, base: int, max_key: int, cap: int) -> None: ...
    def read(self, key: Any, /) -> tuple[bytes, int] | None | Literal[False]:
        """(header + payload, header length) of a small DRAM value, None for a miss, else False."""
    def put(self, key: Any, meta: bytes, payload: Any, slot: int, prefaulted: bool, /) -> bool:
        """True once the payload is stored in DRAM (priority 0, no ttl), else False (general path)."""
    def close(self) -> None:
        """Forget the mapping: later calls return False."""
