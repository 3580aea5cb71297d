"""Cluster mode for yrcache, being built piece by piece.

``ring.py`` is the pure consistent-hash ring (which members own a key); the
membership, transport and replication pieces are in progress.  Until they are
wired in, ``TieredStore(cluster=...)`` (or ``YRCACHE_ETCD`` in the environment)
still raises ``NotImplementedError``.
"""
