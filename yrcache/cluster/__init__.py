"""Cluster mode: many machines' stores behind one key space (docs/cluster.md).

``store.py`` is what ``TieredStore(cluster=...)`` returns; ``replication.py``
routes, versions and fans out writes; ``member.py`` is a member's side (its
versions, forwarding, rebalancing); ``transport.py`` (server), ``peer.py``
(client) and ``wire.py`` (frames) are the TCP data plane; ``membership.py``
(the only etcd user) and ``ring.py`` (consistent hashing) decide who owns
what; ``node.py`` is ``yrcache node``.
"""
