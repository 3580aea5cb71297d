# Types of yrcache._fast, the C hot paths of get, put and mget (yrcache/_csrc/fast.c).
from typing import Any, Literal

class HotPath:
    """Small gets and puts of one arena mapping, each in one C call (made by tiers/dram.py)."""

    slot: int
    """This process's slot in the arena (0: none yet, e.g. in a child right after fork)."""

    def __init__(self, *addresses_base_max_key_cap: int) -> None:
        """HotPath(read, put, mread, unpin, base, max_key, cap): C function and mapping addresses."""
    def mread(self, keys: list, /) -> list | Literal[False]:
        """Per key None, (data, meta_len) or (meta, payload_off, nbytes, pin, block), in one
        lock hold; False: take the general path (nothing is pinned then)."""
    def mget(self, keys: list, /) -> list | Literal[False]:
        """``mread``, except that small bytes values and 1-D arrays of registered headers
        come back as ``get`` returns them."""
    def read(self, key: Any, /) -> tuple[bytes, int] | tuple[bytes, int, int, int, int] | None | Literal[False]:
        """(header + payload, header length) of a small DRAM value; (header, payload offset,
        size, pin, block) of a larger one it pinned; None for a miss; else False."""
    def get(self, key: Any, /) -> memoryview | Any | tuple[bytes, int] | tuple[bytes, int, int, int, int] | None | Literal[False]:
        """``read``, except that a small bytes value, or a small 1-D array of a header
        registered with ``flat``, comes back as ``TieredStore.get`` returns it (read-only,
        over a private copy)."""
    def flat(self, meta: bytes, dtype: Any, itemsize: int, frombuffer: Any, /) -> bool:
        """From now on ``get`` builds the small values with this 1-D ndarray header as
        ``frombuffer(private copy, dtype)``; False when 16 headers are registered already."""
    def put(self, key: Any, meta: bytes, payload: Any, prefaulted: bool, /) -> bool:
        """True once the payload is stored in DRAM (priority 0, no ttl), else False (general path)."""
    def close(self) -> None:
        """Forget the mapping: later calls return False."""
