"""Where a cluster store's settings come from: ``cluster=`` or the ``YRCACHE_*``
environment (``ClusterStore.__init__`` reads the rest), and the checks of its
arguments that the embedded store does not make.
"""

from __future__ import annotations

import os
from typing import Any, Callable
from urllib.parse import urlparse

from ..config import Tier

#: What ``YRCACHE_MEMBER`` (and other boolean variables) count as true, and as false.
ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("0", "false", "no", "off")


def parse_cluster(cluster: str | None) -> tuple[str, str]:
    """``etcd://h:p[,h:p]/name`` (or the environment) -> ``(endpoints, cluster name)``."""
    if cluster:
        if not isinstance(cluster, str) or not cluster.startswith("etcd://"):
            raise ValueError(f"cluster= takes 'etcd://host:port[,host:port]/name', got {cluster!r}")
        u = urlparse(cluster)
        name = u.path.strip("/") or os.environ.get("YRCACHE_CLUSTER") or "default"
        return u.netloc, name
    endpoints = os.environ.get("YRCACHE_ETCD")
    if not endpoints:
        raise ValueError("no etcd to join: pass cluster='etcd://host:port/name' or set YRCACHE_ETCD "
                         "(and YRCACHE_CLUSTER) in the environment")
    return endpoints, os.environ.get("YRCACHE_CLUSTER") or "default"


def _env(name: str, default: Any, parse: Callable[[str], Any], what: str) -> Any:
    """``parse`` of the environment variable ``name``, ``default`` when unset or empty
    (``ValueError`` naming the variable when ``parse`` refuses it)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """The integer in the environment variable ``name``, ``default`` when unset or empty
    (``ValueError`` if it is not an integer, or below ``minimum``)."""
    value = _env(name, default, int, "an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={os.environ[name]!r} is below {minimum}: give an integer >= {minimum}")
    return value


def _yes_no(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ENV_TRUE or low in ENV_FALSE:
        return low in ENV_TRUE
    raise ValueError(raw)


def env_bool(name: str, default: bool) -> bool:
    """The yes/no in the environment variable ``name``, ``default`` when unset or empty."""
    return _env(name, default, _yes_no, "a yes/no value: use 1/0, true/false, yes/no or on/off")


def env_seconds(name: str, default: float, forever: bool = False) -> float:
    """The number of seconds (> 0) in the environment variable ``name``, ``default`` when unset
    (``forever``: ``inf`` too)."""
    value = _env(name, default, float, "a number of seconds")
    if not 0 < value < float("inf") and not (forever and value == float("inf")):
        raise ValueError(f"{name}={os.environ[name]!r}: give a number of seconds > 0"
                         + (" (or inf: never)" if forever else ""))
    return value


def read_at_import(read: Callable[..., Any], name: str, default: Any, *args: Any) -> Any:
    """``read(name, default, *args)`` for a module constant: ``default`` when the variable is
    malformed, so that importing yrcache never fails on it (``check_environment``, called by
    every cluster store, reports it)."""
    try:
        return read(name, default, *args)
    except ValueError:
        return default


def check_environment() -> None:
    """Refuse malformed settings that modules read at import (``read_at_import``)."""
    from ..sizes import env_size
    env_seconds("YRCACHE_REPAIR_S", 30.0, True)
    env_size("YRCACHE_REBALANCE_RATE", 1 << 30, 1)
    env_size("YRCACHE_RECV_POOL", 512 << 20)
    env_int("YRCACHE_POLL_US", 100, 0)


def check_tier(tier: Tier | None) -> Tier | None:
    """``tier=`` of a write, checked here: each owner applies it to its own store."""
    if tier is None:
        return None
    if not isinstance(tier, Tier):
        raise TypeError(f"tier must be a yrcache.Tier, not {type(tier).__name__}")
    return tier
