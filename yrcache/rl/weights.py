"""Versioned RL weight publish/subscribe over a ``TieredStore``, with resharding.

Trainer rank ``r`` of ``M`` publishes its local shard of a state dict
(``WeightPublisher.publish``); rollout workers read exactly their slice in
their own layout (``WeightSubscriber.fetch``).  Nobody materialises a full
tensor: a fetch copies only the byte ranges of the stored parts that overlap
the requested slice (the slice math is ``rl/reshard.py``).

Storage layout (every key lives under the reserved prefix ``__rl__/<name>/``;
do not use keys starting with ``__rl__/`` for anything else)::

    __rl__/<name>/started/<v:020d>            a rank began publishing v (empty)
    __rl__/<name>/v/<v:020d>/p/<rank>/<nonce>/<tensor>   one stored part
    __rl__/<name>/v/<v:020d>/m/<rank:06d>     rank's JSON manifest of v
    __rl__/<name>/complete/<v:020d>           v is visible (JSON: world, keep, nonces, placement)

A rank writes its parts, then its manifest; whichever rank then sees all
``world`` manifests writes the ``complete`` marker (idempotently) and bumps the
store's named word ``rl/<name>`` (``TieredStore.word``), which wakes every ``wait``.
Before writing, and again after its manifest, a rank checks that every
manifest of the version names its own ``world`` and raises ValueError if one
does not: ranks that disagree would wait for each other forever.
Versions, manifests and the marker sit behind ``VersionBoard`` so they can move
to etcd (a marker per version needs no compare-and-swap; a watch replaces the
futex).
"""

from __future__ import annotations

from .board import RESERVED_PREFIX, VersionBoard
from .publish import WeightPublisher
from .reshard import Fused, Shard
from .subscribe import WeightSubscriber

__all__ = ["WeightPublisher", "WeightSubscriber", "VersionBoard", "Shard", "Fused", "RESERVED_PREFIX"]
