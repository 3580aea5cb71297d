"""How a ``ClusterStore`` process joins its cluster: it creates this machine's arena (then
it is the node's member: it serves the arena on a data port and registers in etcd) or
attaches to the arena that exists, or, as a pure client, only watches the member set; and
how a member leaves with a hand-over."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from .._fast import OwnPuts
from ..config import WriteMode
from ..errors import AuthenticationError, ClusterUnavailableError, StoreNotFoundError
from ..store import TieredStore
from . import transport as tp
from .membership import MemberInfo, Membership, check_name
from .member import Node
from .records import Mirror

if TYPE_CHECKING:
    from .replication import Router

log = logging.getLogger("yrcache.cluster")

HANDOVER_S = 120.0      # how long close(handover=True) waits for the objects to reach their owners
#: After its lease is revoked, how long a leaving member still takes (and forwards) writes
#: from processes that have not seen it go yet.
LEAVE_SETTLE_S = 0.5


class Joining:
    """Mixed into ``ClusterStore``: the set-up steps of its ``__init__``."""

    if TYPE_CHECKING:
        name: str
        cluster: str
        role: str
        member_id: str | None
        address: str | None
        _local: TieredStore | None
        _router: Router
        _node: Node | None
        _own: OwnPuts | None
        _server: tp.Server | None
        _membership: Membership | None
        _mirror: Mirror | None
        _mode_default: WriteMode

    def _open_local(self, pickle: bool, local: dict[str, Any]) -> None:
        """Create this machine's arena (we are its member) or attach to the one that exists."""
        if local.get("policy", "spill") != "spill":
            raise ValueError("a cluster member keeps every object it is given (policy='spill'): a cache "
                             "that dropped objects would drop replicas the cluster counts on")
        deadline = time.monotonic() + 30
        while True:
            try:
                try:
                    self._local = TieredStore(self.name, pickle=pickle, cluster=False, **local)
                    self.role = "member"
                except FileExistsError:
                    self._local = TieredStore.attach(self.name, pickle=pickle)
                    self.role = "attached"
                return
            except StoreNotFoundError:       # another process of this machine is creating it (or
                if time.monotonic() > deadline:  # its segment is there, not yet ready): look again
                    raise
                time.sleep(0.02)

    def _forget_old_objects(self) -> None:
        """A member starts empty: objects left in an adopted arena (or SSD directory) from an
        earlier run carry no version, so they could bring back keys deleted meanwhile; the
        cluster's other copies are the truth, and rebalancing fills this member again."""
        assert self._local is not None
        n = len(self._local)
        if n:
            log.warning("store %r held %d objects from an earlier run; a rejoining member starts "
                        "empty (the other members hold the current copies)", self.name, n)
            self._local.clear()

    def _serve(self, endpoints: str, ttl: float, listen: str | None, token: bytes | None) -> None:
        assert self._local is not None
        member_id = check_name("member id", os.environ.get("YRCACHE_NODE_ID")
                               or f"{socket.gethostname()}-{self.name}")
        router = self._router
        router.member_id = member_id
        self._node = router.node = Node(self._local, member_id, router, self._mode_default is WriteMode.ASYNC)
        router.on_change.append(self._node.rebalancer.poke)
        self._own = self._node.own
        self._server = tp.Server(self._node, listen or os.environ.get("YRCACHE_LISTEN") or "127.0.0.1:0", token)
        address = os.environ.get("YRCACHE_ADVERTISE") or self._server.address
        self._membership = Membership(endpoints, self.cluster, member_id, address, ttl=ttl,
                                      on_change=router.update, on_rejoin=self._node.rebalancer.catch_up,
                                      taken=functools.partial(_refuse_live_twin, member_id, token)).start()
        router.update(self._membership.members())
        self._mirror = Mirror(self._local, endpoints, self.cluster)
        cfg = dict(self._local._config)
        cfg.update(cluster_member=member_id, cluster_address=address, cluster=self.cluster, cluster_etcd=endpoints)
        self._local._a.write_config(cfg)
        self.member_id = member_id
        self.address = address

    def _watch(self, endpoints: str, ttl: float) -> None:
        self._membership = Membership(endpoints, self.cluster, f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                      "-", ttl=ttl, on_change=self._router.update, register=False).start()
        self._router.update(self._membership.members())
        self.member_id = self._router.member_id

    def _handover(self, give_up: threading.Event | None) -> None:
        """Leave the ring, ship every object to its owners without us, leave etcd, then ship
        what writers that still counted us as an owner sent meanwhile (the node forwards
        every write it takes from now on), before the data port closes."""
        node, membership = self._node, self._membership
        assert node is not None and membership is not None
        router, me = self._router, node.member_id
        node.leaving = True
        router.update({m: i for m, i in router.members.items() if m != me})
        if not router.members:
            return
        n = len(node.versions)
        log.info("handing %d objects over before leaving (up to %.0f s%s)", n, HANDOVER_S,
                 "; SIGTERM or Ctrl-C again to leave now" if give_up is not None else "")
        node.rebalancer.run_pass()
        if node.forwarder.wait(HANDOVER_S, give_up):
            membership.close()                       # the others drop us now: no new writes come
            time.sleep(LEAVE_SETTLE_S)               # (but from those that have not seen that yet)
            if node.forwarder.wait(HANDOVER_S / 4, give_up):
                log.info("handed over: every one of the %d objects here is on its other owners", n)
                return
        log.warning("leaving with %d objects not handed over (%s); those with no copy on another "
                    "member are lost", node.forwarder.pending(),
                    "asked to leave now" if give_up is not None and give_up.is_set() else
                    f"{HANDOVER_S:.0f} s passed")

    def _wait_member_id(self) -> str:
        assert self._local is not None
        end = time.monotonic() + 30
        while True:
            cfg = self._local._a.read_config() or {}
            if cfg.get("cluster_member"):
                if cfg.get("cluster", self.cluster) != self.cluster:
                    raise ValueError(
                        f"store {self.name!r} on this machine is served by member {cfg['cluster_member']!r} "
                        f"of cluster {cfg['cluster']!r}, but this process joins cluster {self.cluster!r}: "
                        f"set YRCACHE_CLUSTER={cfg['cluster']} (or cluster='etcd://.../{cfg['cluster']}'), "
                        "or another YRCACHE_NAME")
                return str(cfg["cluster_member"])
            if time.monotonic() > end:
                raise ClusterUnavailableError(
                    f"store {self.name!r} exists on this machine but its process never joined the cluster; "
                    "is it a cluster store? (same YRCACHE_ETCD for every process of a node)")
            time.sleep(0.02)


def _refuse_live_twin(member_id: str, token: bytes | None, info: MemberInfo) -> None:
    """Our member id is registered already: take it over if that member is gone (a
    predecessor whose lease has not run out), else raise. Two live members with one id
    would overwrite each other's etcd key, and each key would have two different sets of
    owners."""
    peer = tp.Peer(info.address, token, name=member_id, timeout=2.0)
    try:
        held_by = json.loads(peer.stat()).get("member")
    except AuthenticationError:     # a yrcache member answers there, with another token
        held_by = member_id
    except Exception:       # noqa: BLE001 - no member answers there (refused, silent, not yrcache)
        return
    finally:
        peer.close()
    if held_by == member_id:
        raise ClusterUnavailableError(
            f"member id {member_id!r} is in use by a live member at {info.address} (pid {info.pid}); give "
            "each machine its own YRCACHE_NODE_ID (the default is <hostname>-<store name>), or stop that one")
