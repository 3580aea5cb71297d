"""yrcache: a memory-centric tiered tensor store.

``TieredStore`` keeps bytes, numpy arrays and torch tensors in a shared-memory
arena that every process on the node reads zero-copy.  See README.md and
docs/architecture.md.
"""

from .errors import (
    AuthenticationError,
    ClusterUnavailableError,
    CorruptObjectError,
    StoreClosedError,
    StoreFullError,
    StoreInUseError,
    StoreNotFoundError,
    UntrustedStoreError,
    YrcacheError,
)
from .store import TieredStore, Tier, WriteMode
from .cluster import store as _cluster_store  # noqa: F401  (registers ClusterStore with TieredStore)

__version__ = "0.1.0"

__all__ = [
    "TieredStore",
    "Tier",
    "WriteMode",
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
