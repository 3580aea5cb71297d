"""A cluster store's writes to several members at once: each member's pipeline of
puts out first, then every reply; a small put to owners that are all remote in one C
call that also polls for the replies (``_fast.round_trip``). ``Router`` inherits them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .. import _fast
from ..errors import AuthenticationError, ClusterUnavailableError
from . import transport as tp
from .peer import POLL_NS

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from .member import Node

PARALLEL_BYTES = 1 << 20      # owners that each get more than this are sent to from threads
ROUND_MAX = 16                # sockets one _fast.round_trip takes (replicas are at most 16)


class FanOut:
    """Mixed into ``Router``: needs ``node``, ``peer``, ``put_to`` and ``pool`` (the
    router's sending threads)."""

    if TYPE_CHECKING:
        node: Node | None

        def peer(self, member_id: str) -> tp.Peer | None: ...

        def pool(self) -> ThreadPoolExecutor: ...

        def put_to(self, member: str, key: str, meta: bytes, payload: Any, nbytes: int,
                   version: tuple[int, int], priority: int, expire_at: float, flags: int = 0,
                   timeout: float | None = None) -> int: ...

    def fan_out(self, per_member: dict[str, list], flags: int, timeout: float | None) -> list[str]:
        """Send each member its pipeline of puts at once, then collect the replies
        (one round trip for all owners); this member's own share is applied while
        the others work. Returns ``"member (why)"`` for each member that failed."""
        node = self.node
        failed: list[str] = []
        sent: list[tuple[str, tp.Peer, tp.Conn, list[int]]] = []
        big = [m for m, items in per_member.items() if sum(it[3] for it in items) > PARALLEL_BYTES]
        if len(big) > 1:                    # large payloads: one sending thread per member
            pool = self.pool()
            futs = {m: pool.submit(self._put_items, m, items, flags, timeout) for m, items in per_member.items()}
            return [err for f in futs.values() if (err := f.result())]
        packed: dict[int, bytes] = {}       # a small item sent to several owners: packed once
        frame = None                        # one small put to several owners: framed once
        one = next(iter(per_member.values()), None)
        if one is not None and len(one) == 1 and one[0][3] <= tp.SMALL and \
                all(items is one for items in per_member.values()):
            frame = tp.put_frame(one[0], flags)
            if (node is None or node.member_id not in per_member) and len(per_member) <= ROUND_MAX:
                return self._put_round(list(per_member), frame, one, flags, timeout)
        for m, items in per_member.items():
            if node is not None and m == node.member_id:
                continue
            borrowed = self._borrow(m, timeout, failed)
            if borrowed is None:
                continue
            peer, c = borrowed
            try:
                frames = tp.send_puts(c, items, flags, frame, packed)
            except (ConnectionError, OSError):
                c.sock.close()
                err = self._put_items(m, items, flags, timeout)   # a stale pooled connection: once more
                if err:
                    failed.append(err)
                continue
            sent.append((m, peer, c, frames))
        if node is not None and node.member_id in per_member:
            try:
                err = self._put_items(node.member_id, per_member[node.member_id], flags, timeout)
            except Exception as e:      # noqa: BLE001 - the remote replies are still to be read
                err = f"{node.member_id} ({type(e).__name__}: {e})"
            if err:
                failed.append(err)
        for m, peer, c, frames in sent:
            self._collect(m, peer, c, frames, timeout, failed)
        return failed

    @staticmethod
    def _collect(m: str, peer: tp.Peer, c: tp.Conn, frames: list[int], timeout: float | None,
                 failed: list[str]) -> None:
        """Read member ``m``'s replies to ``frames`` and give ``c`` back, or close it and
        say why in ``failed`` (after an error the rest of its replies are unread)."""
        try:
            tp.recv_puts(c, frames)
            peer.give_back(c)
        except tp.RemoteError as e:
            c.sock.close()
            failed.append(f"{m} ({e})")
        except (ConnectionError, OSError) as e:
            c.sock.close()
            failed.append(f"{m} ({peer.error(e, timeout)})")

    def _borrow(self, m: str, timeout: float | None, failed: list[str]) -> tuple[tp.Peer, tp.Conn] | None:
        """A connection to member ``m``, or None with why in ``failed``."""
        peer = self.peer(m)
        if peer is None:
            failed.append(f"{m} (left the cluster)")
            return None
        try:
            return peer, peer.borrow(timeout)
        except AuthenticationError:
            raise
        except (ClusterUnavailableError, OSError) as e:
            failed.append(f"{m} ({peer.error(e, timeout)})")
            return None

    def _put_round(self, members: list[str], frame: bytes, items: list, flags: int,
                   timeout: float | None) -> list[str]:
        """One small put to members that are all remote: ``frame`` out on every
        connection, then every reply in, in one C call (``_fast.round_trip``)."""
        failed: list[str] = []
        held = [(m, *b) for m in members if (b := self._borrow(m, timeout, failed)) is not None]
        try:
            replies = _fast.round_trip(tuple(c.sock.fileno() for _, _, c in held), frame, tp.PUT, POLL_NS)
        except BaseException:       # a signal's error mid-round: the connections' state is unknown
            for _, _, c in held:
                c.sock.close()
            raise
        for (m, peer, c), reply in zip(held, replies):
            if isinstance(reply, tuple):            # the socket failed
                c.sock.close()
                sent, errno = reply
                if not sent:                        # a stale pooled connection: once more
                    if err := self._put_items(m, items, flags, timeout):
                        failed.append(err)
                    continue
                e = OSError(errno, os.strerror(errno)) if errno else ConnectionError("the member closed the connection")
                failed.append(f"{m} ({peer.error(e, timeout)})")
                continue
            if isinstance(reply, int):
                if reply not in (tp.FULL, tp.ERROR):
                    peer.give_back(c)
                    continue
                reply = tp.pack(tp.PUT, status=reply)
            c.rd.push(reply)                        # an error's reply: its message follows the header
            self._collect(m, peer, c, [0], timeout, failed)
        return failed

    def _put_items(self, m: str, items: list, flags: int, timeout: float | None) -> str | None:
        node = self.node
        try:
            if node is not None and m == node.member_id:
                for key, meta, payload, nbytes, version, priority, expire_at in items:
                    self.put_to(m, key, meta, payload, nbytes, version, priority, expire_at, flags)
                return None
            peer = self.peer(m)
            if peer is None:
                return f"{m} (left the cluster)"
            peer.mput(items, flags=flags, timeout=timeout)
        except (ClusterUnavailableError, tp.RemoteError) as e:
            return f"{m} ({e})"
        return None
