"""The version manifest of a weight set, behind a small interface.

``VersionBoard`` records which ranks published which version, marks complete
versions, retires old ones and wakes waiters.  This implementation keeps JSON
manifests and markers in the store itself (under ``__rl__/<name>/``) and the
*record* of the weight set in two named words of the store: ``rl/<name>``
(the newest complete version, advanced by compare-and-set, and the futex that
wakes every ``wait``) and ``rl/<name>/head`` (the newest version begun).  So
``latest()`` is one atomic load and nothing on the wake path scans the store.
On a cluster store the two records are shared words (``ClusterStore.shared_word``):
kept in etcd, raised by a compare-and-swap transaction, and mirrored by each
node's member into that node's arena word, so ``wait`` still sleeps on a futex.  ``merge_manifests``
turns the ranks' manifests of one version into the global shape and parts of
every tensor.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

from .. import codec
from ..errors import ClusterUnavailableError, StoreClosedError
from .. import TieredStore
from .reshard import Part, publish_parts, replicated_parts

#: Keys under this prefix belong to ``yrcache.rl``.
RESERVED_PREFIX = "__rl__/"
FORMAT = 2          # of manifests and completion markers


MAX_NAME_BYTES = 128             # a weight set's name (its records are words of <= 200 bytes)


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or "/" in name or "\x00" in name \
            or not 0 < len(name.encode(errors="replace")) <= MAX_NAME_BYTES:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 60 else f"{name[:60]!r}... ({len(name)} chars)"
        raise ValueError(f"a weight set name is a str of 1-{MAX_NAME_BYTES} UTF-8 bytes without '/' or "
                         f"NUL, such as 'policy'; got {shown}")
    return name


class VersionBoard:
    """The version manifest of one weight set: which versions exist and what they hold.

    Manifests and markers live in the store under ``__rl__/<name>/``; the
    record (newest complete version, newest begun, wake-ups) in the store's
    named words ``rl/<name>`` and ``rl/<name>/head`` (``TieredStore.word``).
    """

    def __init__(self, store, name: str):
        if not isinstance(store, TieredStore):
            raise TypeError(f"the store of weight set {name!r} must be a TieredStore (TieredStore() or "
                            f"TieredStore.attach(name)), not {type(store).__name__} {store!r:.60}")
        self.store = store
        self.name = _check_name(name)
        self.prefix = f"{RESERVED_PREFIX}{name}/"
        self._word = self._head = None

    def check_open(self) -> None:
        """Raise ``StoreClosedError`` once the store is closed (the records are its words)."""
        if getattr(self.store, "closed", False):
            raise StoreClosedError(f"the store of weight set {self.name!r} is closed; open it again "
                                   f"(TieredStore(name=...)) and make a new publisher or subscriber")

    # ---------------------------------------------------------------- keys
    def version_prefix(self, version: int) -> str:
        """Prefix of every key (parts and manifests) that belongs to ``version``."""
        return f"{self.prefix}v/{version:020d}/"

    def part_key(self, version: int, rank: int, nonce: str, tensor: str) -> str:
        """The key a rank stores one tensor part under."""
        return self.version_prefix(version) + part_suffix(rank, nonce, tensor)

    def _manifest_key(self, version: int, rank: int) -> str:
        return f"{self.version_prefix(version)}m/{rank:06d}"

    def complete_key(self, version: int) -> str:
        """The key of ``version``'s completion marker."""
        return f"{self.prefix}complete/{version:020d}"

    def marker_and_part_keys(self, version: int, suffixes: list[str]) -> list[str]:
        """``version``'s marker key, then its part keys (``suffixes`` from ``part_suffix``),
        the version formatted once (a subscriber's wake-up path)."""
        v = f"{version:020d}"
        prefix = f"{self.prefix}v/{v}/"
        return [f"{self.prefix}complete/{v}", *[prefix + k for k in suffixes]]

    def _started_key(self, version: int) -> str:
        return f"{self.prefix}started/{version:020d}"

    def _listed(self, sub: str) -> list[int]:
        """The versions with a marker under ``sub`` (in proportion to them, not to the store)."""
        pre = self.prefix + sub
        out = []
        for k in self.store.keys(prefix=pre):
            try:
                out.append(int(k[len(pre):len(pre) + 20]))
            except ValueError:
                pass
        return out      # ascending: keys come in byte order, versions are zero-padded

    # ------------------------------------------------------------- writing
    def begin(self, version: int, rank: int, world: int) -> None:
        """Announce that ``rank`` of ``world`` started publishing ``version`` (for
        ``head``, and so that a rank of another world notices)."""
        self.store.put(self._started_key(version), json.dumps([rank, world]).encode())
        _raise_to(self.head_word, version + 1)

    def started_by(self, version: int) -> tuple[int, int] | None:
        """(rank, world) of the last rank that began publishing ``version``, or None."""
        raw = self.store.get(self._started_key(version))
        if raw is None or not bytes(raw):
            return None
        rank, world = json.loads(bytes(raw))
        return int(rank), int(world)

    def record_rank(self, version: int, rank: int, manifest: dict) -> None:
        """Record ``rank``'s manifest of ``version`` (after its parts are stored)."""
        self.store.put(self._manifest_key(version, rank),
                       json.dumps(manifest, separators=(",", ":")).encode())

    def complete(self, version: int, marker: dict | None = None, structure: bytes = b"",
                 wake: bool = True) -> bool:
        """Make ``version`` visible: write its marker (when given: a JSON header
        line, then the ``structure`` from ``encode_structure``), then advance
        the record (one compare-and-set, no scan), then wake every waiter
        (unless the caller wakes them later, once it has nothing left to do).
        Idempotent: a process that died in between is repaired by the next
        rank that completes the version (or any later one); a lost wake-up
        delays waiters by at most a second (``wait`` re-reads the record).
        True if this call advanced the record (of ranks that complete a version
        at once, exactly one: it alone retires old versions)."""
        if marker is not None:
            self.store.put(self.complete_key(version),
                           json.dumps(marker, separators=(",", ":")).encode() + b"\n" + structure)
        advanced = _raise_to(self.wake_word, version + 1)
        if wake:
            self.wake()
        return advanced

    def retire(self, version: int) -> None:
        """Hide ``version`` (marker first), then drop its manifests and parts.

        Readers that already hold views of its parts keep them; the memory
        is freed when the last view dies.
        """
        self.store.delete(self.complete_key(version))
        rest = [self._started_key(version), *self.store.keys(prefix=self.version_prefix(version))]
        many = getattr(self.store, "delete_many", None)     # a cluster: one batch per member
        if many is not None:
            many(rest)
            return
        for k in rest:                                      # its parts and manifests only
            self.store.delete(k)

    # ------------------------------------------------------------- reading
    def withdraw(self, version: int, rank: int) -> None:
        """Delete ``rank``'s manifest of ``version`` (not complete: its ranks disagree)."""
        self.store.delete(self._manifest_key(version, rank))

    def rank_manifests(self, version: int, world: int) -> list[dict | None]:
        """The manifests of ranks ``0..world-1`` of ``version`` (None where missing), one snapshot."""
        raw = self.store.mget([self._manifest_key(version, r) for r in range(world)])
        return [None if b is None else json.loads(bytes(b)) for b in raw]

    def is_complete(self, version: int) -> bool:
        """Whether ``version`` has its completion marker (one lookup, nothing read)."""
        return self.complete_key(version) in self.store

    def completion(self, version: int) -> dict | None:
        """The completion marker of ``version`` (its ``"structure"`` as bytes), or
        None when it is not (or no longer) visible."""
        raw = self.store.get(self.complete_key(version))
        return None if raw is None else parse_marker(bytes(raw))

    def complete_versions(self) -> list[int]:
        """Every visible version, ascending (a listing of their markers only)."""
        return self._listed("complete/")

    def versions(self, complete: list[int] | None = None, parts: bool = False) -> list[int]:
        """Every version with a marker (complete, in flight or abandoned), ascending;
        ``complete``: ``complete_versions()`` when the caller has it. ``parts``: also
        those with only parts left (their markers died with a member): a listing of
        every part, so only after the member set changed."""
        done = self._listed("complete/") if complete is None else complete
        return sorted(set(self._listed("started/")) | set(done) | set(self._listed("v/") if parts else ()))

    def why_gone(self, version: int, remote: bool) -> str:
        """Why ``version`` has no completion marker, for an error (``remote``: over a cluster,
        where a marker dies with the one member holding it)."""
        latest = self.latest()
        if latest is None or version > latest:
            return (f"version {version} of {self.name!r} is not complete (latest complete: {latest}); "
                    "wait() for it")
        done = self.complete_versions()
        newer = [d for d in done if d > version]
        keep = None
        for d in reversed(newer):           # the newest readable marker says how many are kept
            try:
                m = self.completion(d)
            except ClusterUnavailableError:
                continue
            if m is not None:
                keep = m.get("keep")
                break
        if isinstance(keep, int) and len(newer) >= keep:
            return (f"version {version} of {self.name!r} was reclaimed (keep={keep}), or never completed; "
                    f"readable: {done}: fetch one of those or wait() for a newer one")
        if not remote:                      # one arena: a marker is never lost, only retired
            return f"version {version} of {self.name!r} never completed (readable: {done}); fetch one of those"
        lost = (f"its completion record is on no live member (the member holding it died; replicas "
                f">= 2 keep a copy); readable: {done}: fetch one of those or wait() for a newer version")
        if version == latest:
            return f"version {version} of {self.name!r} is lost: {lost}"
        return f"version {version} of {self.name!r} is not readable: it never completed, or {lost}"

    def latest(self) -> int | None:
        """The newest visible version, or None: one atomic load of the record."""
        v = self.wake_word.value
        return v - 1 if v else None

    def in_flight(self) -> tuple[int, int, list[int], str] | None:
        """``(version, world, ranks whose manifest is missing, what holds it up when none is)``
        of the newest version begun but not complete, or None (nothing in flight, or its
        begin record is gone)."""
        head, latest = self.head(), self.latest()
        if head is None or (latest is not None and head <= latest):
            return None
        started = self.started_by(head)
        if started is None:
            return None
        world = started[1]
        manifests = self.rank_manifests(head, world)
        missing = [r for r, m in enumerate(manifests) if m is None]
        why = "" if missing else \
            ("is complete, but the rank that completed it died before raising the record; the next "
             "publish of any rank makes it visible") if self.is_complete(head) else \
            ("has every rank's manifest but no completion marker: its last rank is completing it, or "
             "died doing so (the next publish of any rank completes it)")
        return head, world, missing, why

    def head(self) -> int | None:
        """The newest version any rank has started publishing (>= ``latest()``)."""
        h = self.head_word.value
        latest = self.latest()
        return max(h - 1, latest if latest is not None else -1) if h else latest

    # -------------------------------------------------------------- waking
    @property
    def wake_word(self):
        """This weight set's record: a named word of the store (no other name
        shares it) whose value is the newest complete version + 1 and whose
        wake-up counter wakes every ``wait``."""
        if self._word is None:
            self._word = _record(self.store, f"rl/{self.name}")
        return self._word

    @property
    def head_word(self):
        """The newest version a rank has begun, + 1."""
        if self._head is None:
            self._head = _record(self.store, f"rl/{self.name}/head")
        return self._head

    def token(self) -> int:
        """The current wake-up counter; read it *before* checking, then ``wait_change``."""
        return self.wake_word.seq

    def wait_change(self, seen: int, timeout: float | None) -> bool:
        """Sleep until the counter differs from ``seen``; False on timeout."""
        return self.wake_word.wait(seen, timeout)

    def wake(self) -> None:
        """Bump the counter and wake every waiter."""
        self.wake_word.wake()

    def refresh(self) -> None:
        """Read the record from etcd into this node's copy (a cluster store; else nothing):
        what a node's member does on every change, for a process whose member is gone."""
        for word in (self.wake_word, self.head_word):
            read = getattr(word, "read", None)
            if read is not None:
                read()


def _record(store, name: str):
    """A record word: the store's named word, or on a cluster store its shared word (kept
    in etcd, mirrored into every node's arena word ``name``, so waits stay on a futex)."""
    shared = getattr(store, "shared_word", None)
    return shared(name) if shared is not None else store.word(name)


def _raise_to(word, value: int) -> bool:
    """Set ``word.value`` to ``value`` unless it is already as high (compare-and-set);
    True if this call raised it."""
    if hasattr(word, "raise_to"):        # a cluster's shared word: one etcd transaction
        return word.raise_to(value)
    while True:
        cur = word.value
        if cur >= value:
            return False
        if word.cas(cur, value):
            return True


def part_suffix(rank: int, nonce: str, tensor: str) -> str:
    """A part's key after its version's prefix (``VersionBoard.part_key``)."""
    return f"p/{rank}/{nonce}/{tensor}"


def parse_marker(raw: bytes) -> dict:
    """A completion marker's JSON header as a dict, its ``"structure"`` the bytes after it."""
    head, _, structure = raw.partition(b"\n")
    marker = json.loads(head)
    marker["structure"] = structure
    return marker


def encode_structure(info: dict[str, "_Tensor"]) -> bytes:
    """The merged description of a version (global shapes, dtypes, parts) as
    compact JSON, for its completion marker: subscribers read one marker
    instead of every rank's manifest.  It names no key (a part's key follows
    from the version, the part's rank and that rank's nonce), so it is the
    same bytes for every version of an unchanged model, and a subscriber
    reuses what it compiled from it."""
    return json.dumps({name: [t.kind, t.dtype, t.itemsize, list(t.shape),
                              [[p.rank, p.dim, p.offset, list(p.shape)] for p in t.parts]]
                       for name, t in info.items()}, separators=(",", ":")).encode()


def decode_structure(raw: bytes) -> dict[str, "_Tensor"]:
    """The inverse of ``encode_structure``."""
    return {name: _Tensor(kind, dtype, itemsize, tuple(shape),
                          tuple(Part(r, d, o, tuple(ps)) for r, d, o, ps in parts))
            for name, (kind, dtype, itemsize, shape, parts) in json.loads(raw).items()}


class _Tensor(NamedTuple):
    """One published tensor merged over ranks: its global shape and where its parts live."""

    kind: str            # "torch" | "numpy"
    dtype: str           # stored dtype: torch name ("bfloat16") or numpy str ("<f4")
    itemsize: int
    shape: tuple
    parts: tuple         # tuple[Part, ...]: one per rank, or rank 0's alone when replicated


def _dtype_itemsize(kind: str, dtype: str) -> int:
    if kind == "torch":
        return getattr(codec._torch(), dtype).itemsize
    return np.dtype(dtype).itemsize


def _how(entry: dict) -> str:
    return "replicated (no layout entry)" if entry["dim"] is None else f"split on dim {entry['dim']}"


def merge_manifests(manifests: list[dict], name: str = "?", version: int = -1) -> dict[str, _Tensor]:
    """Merge the per-rank manifests of one version into ``{tensor: _Tensor}``.

    Raises ValueError when the ranks disagree (world, dtype, shard dim,
    shapes) or a sharded tensor is missing on some rank.
    """
    world = len(manifests)
    order: dict[str, None] = {}
    for m in manifests:
        if m.get("world") != world:
            raise ValueError(f"version {version} of {name!r}: rank {m.get('rank')} published with "
                             f"world={m.get('world')} but {world} ranks are expected")
        order.update(dict.fromkeys(m["tensors"]))
    out = {}
    for t in order:
        entries = [(r, m["tensors"].get(t)) for r, m in enumerate(manifests)]
        have = [(r, e) for r, e in entries if e is not None]
        r0, e0 = have[0]
        for r, e in have:
            if (e["kind"], e["dtype"]) != (e0["kind"], e0["dtype"]) or e["dim"] != e0["dim"]:
                raise ValueError(
                    f"version {version} of {name!r}: tensor {t!r} is {e['kind']}/{e['dtype']} {_how(e)} on "
                    f"rank {r} but {e0['kind']}/{e0['dtype']} {_how(e0)} on rank {r0}; every rank must "
                    "publish it alike (the same dtype and layout entry)")
        itemsize = _dtype_itemsize(e0["kind"], e0["dtype"])
        if e0["dim"] is None:
            if r0 != 0 or e0["key"] is None:
                raise ValueError(
                    f"version {version} of {name!r}: replicated tensor {t!r} (no layout entry) is on "
                    f"rank {r0} but not on rank 0, which stores replicated tensors; publish it from "
                    "rank 0 or give it a Shard layout")
            for r, e in have:
                if tuple(e["shape"]) != tuple(e0["shape"]):
                    raise ValueError(
                        f"version {version} of {name!r}: replicated tensor {t!r} has shape "
                        f"{tuple(e['shape'])} on rank {r} but {tuple(e0['shape'])} on rank 0; "
                        "pass a Shard layout if it is split")
            shape = tuple(e0["shape"])
            out[t] = _Tensor(e0["kind"], e0["dtype"], itemsize, shape, tuple(replicated_parts(shape)))
        else:
            missing = [r for r, e in entries if e is None]
            if missing:
                raise ValueError(f"version {version} of {name!r}: sharded tensor {t!r} is missing on "
                                 f"rank(s) {missing}; every rank must publish its part (it may be empty)")
            shapes = [tuple(e["shape"]) for _, e in entries]
            try:
                parts = publish_parts(shapes, e0["dim"])
            except ValueError as err:
                raise ValueError(f"version {version} of {name!r}: tensor {t!r}: {err}") from None
            gshape = list(shapes[0])
            gshape[e0["dim"]] = sum(s[e0["dim"]] for s in shapes)
            out[t] = _Tensor(e0["kind"], e0["dtype"], itemsize, tuple(gshape), tuple(parts))
    return out


# --------------------------------------------------------------------------- publish
