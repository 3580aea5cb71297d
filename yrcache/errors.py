"""Exceptions raised by yrcache.

Every leaf also subclasses the builtin a caller would already catch, so
``except MemoryError`` sees a full store and ``except FileNotFoundError`` sees
a store name that does not exist.  Missing keys raise plain ``KeyError``.
"""


class YrcacheError(Exception):
    """Base class of every yrcache error.

    Examples:
        >>> from yrcache import TieredStore, YrcacheError
        >>> try:
        ...     TieredStore.attach("no-such-store")
        ... except YrcacheError as e:              # a StoreNotFoundError
        ...     print(type(e).__name__)
        StoreNotFoundError
    """


class StoreFullError(YrcacheError, MemoryError):
    """No tier has room for the object (and the store may not drop any).

    Examples:
        >>> import numpy as np
        >>> from yrcache import TieredStore, StoreFullError
        >>> with TieredStore(dram="8MiB") as s:
        ...     try:
        ...         s["big"] = np.zeros(16 << 20, np.uint8)
        ...     except StoreFullError:            # also a MemoryError
        ...         print("full")
        full
    """


class StoreClosedError(YrcacheError, RuntimeError):
    """The store handle was closed; attach again to keep using the store."""


class StoreNotFoundError(YrcacheError, FileNotFoundError):
    """No store of that name exists on this node."""


class CorruptObjectError(YrcacheError, ValueError):
    """Stored bytes failed their checksum or could not be decoded, or the store's
    shared memory is damaged (its lists contradict its blocks: the message names
    ``yrcache destroy NAME``)."""


class UntrustedStoreError(YrcacheError, PermissionError):
    """A shared-memory segment or SSD directory is not ours alone.

    It is owned by another user, or other users may write to it; yrcache
    never maps, reads or unpickles such data.  The message names the path and
    says how to fix it (remove it, or fix its owner and mode).
    """


class StoreInUseError(YrcacheError, RuntimeError):
    """An SSD directory is already held by another live store.

    Two stores over one ``ssd=`` directory would delete each other's
    objects; use one directory per store, or attach to the store that holds it.
    """


class ClusterUnavailableError(YrcacheError, ConnectionError):
    """The cluster (etcd or enough peers) could not be reached."""


class AuthenticationError(YrcacheError, PermissionError):
    """A peer failed to prove the shared cluster token."""


__all__ = [
    "YrcacheError",
    "StoreFullError",
    "StoreClosedError",
    "StoreNotFoundError",
    "CorruptObjectError",
    "UntrustedStoreError",
    "StoreInUseError",
    "ClusterUnavailableError",
    "AuthenticationError",
]
