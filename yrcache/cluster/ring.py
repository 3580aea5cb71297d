"""Consistent-hash ring with virtual nodes: which members own a key (pure).

A member (a machine's store id, ``str``) is placed on a 64-bit circle at
``vnodes`` points, ``xxh3_64(f"{member}#{i}")`` for ``i`` in ``range(vnodes)``.
A key (``str`` as UTF-8, or ``bytes``; ``"k"`` and ``b"k"`` are the same key)
sits at ``xxh3_64(key)``; its owners are the first ``r`` *distinct* members met
walking clockwise from there, the first being the primary.  Both hashes use a
fixed seed, so every process, Python version and ``PYTHONHASHSEED`` agrees;
``hash()`` is never used.  Changing ``SEED`` or the vnode naming remaps every
key of a running cluster: treat both as a wire format.

Placement depends on the key and the membership only, never on free space or
load, so a restarted empty member attracts just its own share of new writes
(about ``1/n``), not every write as in Mooncake; the replicas it lost are
refilled by ``moves()`` instead.  Adding a member moves keys only *to* it
(about ``1/(n+1)`` of primaries); removing one moves only the keys it owned.

A ``Ring`` is an immutable value: ``with_member``/``without_member`` return new
rings, equality and hashing compare the membership and vnode counts.  Building
one costs O(V log V) for V virtual nodes in all; ``owners`` costs O(log V + r)
once the walk from the key's vnode has been seen (memoized per vnode), and a
short walk before that.

>>> ring = Ring(["node-a", "node-b", "node-c"])
>>> owners = ring.owners("policy/w1", 2)
>>> len(owners), len(set(owners)), owners[0] == ring.primary("policy/w1")
(2, 2, True)
>>> [m for m in ring.with_member("node-d").owners("policy/w1", 3) if m != "node-d"][:2] == owners
True
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, NamedTuple

import xxhash
from sortedcontainers import SortedDict

__all__ = ["SEED", "Ring", "KeyDiff", "Move", "key_position", "diff", "moves"]

SEED = 0x7972_6361_6368_6531  # b"yrcache1"; part of the placement format, never change

Key = str | bytes  # bare alias (no TypeAlias) so it also evaluates on Python 3.10


def key_position(key: Key) -> int:
    """The key's point on the ring, an unsigned 64-bit int (stable across processes)."""
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise TypeError(f"ring keys are str or bytes, not {type(key).__name__}")
    return int(xxhash.xxh3_64_intdigest(data, seed=SEED))


def _vnode_position(member: str, i: int) -> int:
    # "member#i" is injective: i has no '#', so the last '#' splits it back.
    return int(xxhash.xxh3_64_intdigest(f"{member}#{i}".encode("utf-8"), seed=SEED))


def _check_r(r: int) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r (copies per key) must be an int >= 1, got {r!r}")
    return r


class Ring:
    """An immutable consistent-hash ring over member ids.

    ``members``: distinct non-empty ``str`` ids (a single ``str`` is refused,
    since iterating it would make one member per character).  ``vnodes``: points
    per member of weight 1.  ``weights``: optional relative weights (e.g. capacity
    in GiB / 100); a member of weight ``w`` gets ``max(1, round(vnodes * w))``
    points and so about ``w`` times the share of a weight-1 member.
    """

    __slots__ = ("_vnodes", "_counts", "_points", "_owner_at", "_sorted_members", "_walks")

    def __init__(self, members: Iterable[str] = (), vnodes: int = 128,
                 weights: Mapping[str, float] | None = None) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be an int >= 1, got {vnodes!r}")
        if isinstance(members, (str, bytes)):
            raise TypeError(f"members must be an iterable of member ids, not one {type(members).__name__} "
                            f"({members!r}); write [{members!r}]")
        ids = list(members)
        seen: set[str] = set()
        for m in ids:
            if not isinstance(m, str):
                raise TypeError(f"member ids are str, got {type(m).__name__} {m!r}")
            if not m:
                raise ValueError("member ids must be non-empty strings, got ''")
            if m in seen:
                raise ValueError(f"duplicate member {m!r}: each member may appear once")
            seen.add(m)
        weights = dict(weights or {})
        unknown = sorted(set(weights) - seen)
        if unknown:
            raise ValueError(f"weights name {unknown!r}, which are not members; add them to members")
        counts: dict[str, int] = {}
        for m in sorted(ids):
            w = weights.get(m, 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"weight of member {m!r} must be a finite number > 0, got {w!r}")
            counts[m] = max(1, round(vnodes * w))
        self._vnodes = vnodes
        self._counts = counts
        points: SortedDict = SortedDict()
        for m, n in counts.items():
            for i in range(n):
                p = _vnode_position(m, i)
                # A 64-bit collision is astronomically rare; the smaller id wins so
                # the ring still never depends on insertion order.
                other = points.get(p)
                if other is None or m < other:
                    points[p] = m
        self._points = points
        self._owner_at: tuple[str, ...] = tuple(points.values())
        self._sorted_members: tuple[str, ...] = tuple(counts)
        # vnode index -> the distinct members met walking clockwise from it (a
        # prefix, extended on demand).  A pure cache: equal rings answer equally.
        self._walks: dict[int, tuple[str, ...]] = {}

    # -- value semantics ---------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        """The member ids, sorted."""
        return self._sorted_members

    @property
    def vnodes(self) -> int:
        """Points per member of weight 1."""
        return self._vnodes

    def vnode_count(self, member: str) -> int:
        """How many points ``member`` has on the ring (``ValueError`` if absent)."""
        try:
            return self._counts[member]
        except KeyError:
            raise ValueError(f"member {member!r} is not in the ring") from None

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, member: object) -> bool:
        return member in self._counts

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ring):
            return NotImplemented
        return self._counts == other._counts

    def __hash__(self) -> int:
        return hash(tuple(self._counts.items()))

    def __repr__(self) -> str:
        return f"Ring({list(self._sorted_members)!r}, vnodes={self._vnodes})"

    def __reduce__(self) -> tuple[object, ...]:
        weights = {m: n / self._vnodes for m, n in self._counts.items()}
        return (Ring, (self._sorted_members, self._vnodes, weights))

    def with_member(self, member: str, weight: float = 1.0) -> Ring:
        """A new ring with ``member`` added (``ValueError`` if already present)."""
        if member in self._counts:
            raise ValueError(f"duplicate member {member!r}: it is already in the ring")
        weights = {m: n / self._vnodes for m, n in self._counts.items()}
        weights[member] = weight
        return Ring([*self._sorted_members, member], self._vnodes, weights)

    def without_member(self, member: str) -> Ring:
        """A new ring with ``member`` removed (``ValueError`` if absent)."""
        if member not in self._counts:
            raise ValueError(f"member {member!r} is not in the ring")
        weights = {m: n / self._vnodes for m, n in self._counts.items() if m != member}
        return Ring([m for m in self._sorted_members if m != member], self._vnodes, weights)

    # -- placement ----------------------------------------------------------
    def owners(self, key: Key, r: int) -> list[str]:
        """The ``min(r, len(self))`` distinct members holding ``key``, primary first.

        ``owners(key, r)`` is always a prefix of ``owners(key, r + 1)``.  Returns a
        new list.  O(log V + r) after the first walk from the key's vnode.
        """
        _check_r(r)
        want = min(r, len(self._counts))
        if want == 0:
            return []
        start = self._points.bisect_left(key_position(key))
        if start == len(self._owner_at):
            start = 0  # past the last point: wrap to the first
        walk = self._walks.get(start)
        if walk is None or len(walk) < want:
            walk = self._walk(start, want)
            self._walks[start] = walk
        return list(walk[:want])

    def primary(self, key: Key) -> str:
        """The first owner of ``key`` (``ValueError`` on an empty ring)."""
        if not self._counts:
            raise ValueError("the ring has no members, so no key has an owner; add a member first")
        return self.owners(key, 1)[0]

    def _walk(self, start: int, want: int) -> tuple[str, ...]:
        owner_at, n = self._owner_at, len(self._owner_at)
        found: list[str] = []
        seen: set[str] = set()
        i = start
        while len(found) < want:
            m = owner_at[i]
            if m not in seen:
                seen.add(m)
                found.append(m)
            i += 1
            if i == n:
                i = 0
        return tuple(found)


class KeyDiff(NamedTuple):
    """How one key's owners change between two rings (lists in owner order)."""

    key: Key
    old: list[str]
    new: list[str]
    gained: list[str]   # new owners that must receive a copy
    lost: list[str]     # old owners that may drop theirs once the copies landed


class Move(NamedTuple):
    """One copy a membership change requires: ``key`` from ``source`` to ``target``.

    ``source`` is ``None`` when no old owner of the key is alive: every copy the
    ring knew of is gone, and the caller must find one elsewhere or report loss.
    """

    key: Key
    source: str | None
    target: str


def diff(old: Ring, new: Ring, key: Key, r: int) -> KeyDiff:
    """The owner change of one key from ``old`` to ``new`` with ``r`` copies. O(log V + r)."""
    before, after = old.owners(key, r), new.owners(key, r)
    gained = [m for m in after if m not in before]
    lost = [m for m in before if m not in after]
    return KeyDiff(key, before, after, gained, lost)


def moves(old: Ring, new: Ring, keys: Iterable[Key], r: int,
          alive: Iterable[str] | None = None) -> list[Move]:
    """The copies that bring ``keys`` from ``old``'s placement to ``new``'s.

    Only what must move moves: a target never already held the key.  The source
    is the first old owner (primary first) that is in ``alive``, by default the
    members of ``new``; pass ``alive=old.members`` for a graceful leave, where
    the leaving member can still hand its keys over.  Keys whose owners do not
    change produce nothing.  Drops (``diff(...).lost``) are the caller's, after
    the copies land.  Pure; O(len(keys) * (log V + r)).
    """
    _check_r(r)
    live = set(new.members if alive is None else alive)
    out: list[Move] = []
    for key in keys:
        d = diff(old, new, key, r)
        if not d.gained:
            continue
        source = next((m for m in d.old if m in live), None)
        out.extend(Move(key, source, t) for t in d.gained)
    return out
