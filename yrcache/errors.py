"""Exceptions raised by yrcache.

Every leaf also subclasses the builtin a caller would already catch, so
``except MemoryError`` sees a full store and ``except FileNotFoundError`` sees
a store name that does not exist.  Missing keys raise plain ``KeyError``.
"""


class YrcacheError(Exception):
    """Base class of every yrcache error."""


class StoreFullError(YrcacheError, MemoryError):
    """No tier has room for the object (and the store may not drop any)."""


class StoreClosedError(YrcacheError, RuntimeError):
    """The store handle was closed; attach again to keep using the store."""


class StoreNotFoundError(YrcacheError, FileNotFoundError):
    """No store of that name exists on this node."""


class CorruptObjectError(YrcacheError, ValueError):
    """Stored bytes failed their checksum or could not be decoded."""


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
    "ClusterUnavailableError",
    "AuthenticationError",
]
