"""``yrcache node``: run this machine's cluster member from the environment.

Prints ``yrcache node <id> listening on HOST:PORT`` first, then logs joins,
leaves and rebalancing. SIGTERM (or Ctrl-C) hands this member's objects over to
their other owners before it exits (up to 120 s; a second SIGTERM or Ctrl-C
leaves at once); SIGKILL is a node death, which the others repair by
re-replicating.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from .settings import ENV_FALSE

EPILOG = """environment (docs/cluster.md):
  YRCACHE_ETCD        etcd endpoints host:port[,host:port] (required)
  YRCACHE_CLUSTER     cluster name (default: default)
  YRCACHE_NAME        this machine's store name; processes with the same value share it
  YRCACHE_LISTEN      data address to bind (default 127.0.0.1:0); YRCACHE_ADVERTISE: to announce
  YRCACHE_REPLICAS    copies of each object (default 2)
  YRCACHE_WRITE_MODE  write_through | async | none (default write_through)
  YRCACHE_TOKEN       shared secret every peer proves (required off loopback)
  YRCACHE_DRAM, YRCACHE_SSD, YRCACHE_SSD_SIZE   tier sizes and path
  YRCACHE_NODE_ID     member id (default <hostname>-<store name>)
  YRCACHE_LEASE_TTL   seconds before a silent member is dropped (default 10)
  YRCACHE_REPAIR_S, YRCACHE_REBALANCE_RATE, YRCACHE_POLL_US, YRCACHE_RECV_POOL: see the docs

example:
  YRCACHE_ETCD=127.0.0.1:2379 YRCACHE_NAME=node1 yrcache node"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="yrcache node", description="Run this machine's cluster member.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quiet", "-q", action="store_true", help="log warnings only")
    args = p.parse_args(list(argv) if argv is not None else None)
    if not os.environ.get("YRCACHE_ETCD"):
        print("yrcache node: set YRCACHE_ETCD=host:port (the etcd endpoints) first", file=sys.stderr)
        return 2
    if os.environ.get("YRCACHE_MEMBER", "").strip().lower() in ENV_FALSE:
        print(f"yrcache node: YRCACHE_MEMBER={os.environ['YRCACHE_MEMBER']!r} makes a process a pure client, "
              "but this process is the member: unset YRCACHE_MEMBER here", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from ..store import TieredStore
    from .store import ClusterStore

    stop, leave_now = threading.Event(), threading.Event()
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        got.append(signum)
        if stop.is_set():          # a second one: stop handing over, leave
            leave_now.set()
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    store = TieredStore()
    if not isinstance(store, ClusterStore) or store.role != "member":
        role = getattr(store, "role", "local")
        store.close()
        print(f"yrcache node: store {store.name!r} is already served by another process on this machine "
              f"(this one would be {role}); set another YRCACHE_NAME", file=sys.stderr)
        return 1
    print(f"yrcache node {store.member_id} listening on {store.address}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        t0 = time.monotonic()
        store.close(handover=True, give_up=leave_now)
        logging.getLogger("yrcache.cluster").info("left the cluster in %.1f s", time.monotonic() - t0)
    return 0 if got and got[0] == signal.SIGTERM else 130
