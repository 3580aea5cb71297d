"""RL parameter sync: versioned weight publish/subscribe with resharding.

``WeightPublisher`` (one per trainer rank) publishes its shard of a state dict
as an immutable version; ``WeightSubscriber`` (one per rollout rank) waits for
versions and fetches exactly its slice, in its own layout (``Shard``,
``Fused``).  See docs/rl-weight-sync.md.
"""

from .reshard import Fused, Shard
from .weights import WeightPublisher, WeightSubscriber

__all__ = ["WeightPublisher", "WeightSubscriber", "Shard", "Fused"]
