"""Publishing: a trainer rank stores its shard of a state dict as one version.

See ``weights.py`` for the storage layout and the protocol.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import codec
from ..errors import ClusterUnavailableError
from ..validate import MAX_KEY_BYTES, key_bytes
from .remote import pool
from .board import FORMAT, VersionBoard, encode_structure, merge_manifests
from ..types import Array, DType
from .reshard import Shard

if TYPE_CHECKING:
    from .. import TieredStore

__all__ = ["WeightPublisher"]

SETTLE_TTLS = 2.0                # WeightPublisher.settle_s by default: lease TTLs (and 1 s)
SETTLE_POLL_S = 0.05


def _torch():
    return codec._torch()


MAX_VERSION = 2 ** 63 - 1        # a step counter's range (int64); the records hold version + 1


def _check_version(version: Any) -> int:
    if type(version) is int and 0 <= version <= MAX_VERSION:
        return version
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"version must be a non-negative int, got {type(version).__name__} {version!r}")
    version = int(version)
    if version < 0 or version > MAX_VERSION:
        raise ValueError(f"version must be in 0..2**63-1 (an int64 step counter), got {version}")
    return version


def _check_cast(dtype: Any) -> Any:
    """``dtype=`` of publish and fetch: None, or the floating-point dtype to cast
    floating-point tensors to (integer and bool tensors are never cast)."""
    if dtype is None:
        return None
    if _is_torch_dtype(dtype):
        floating = dtype.is_floating_point
    else:
        try:
            floating = np.dtype(dtype).kind == "f"
        except TypeError:
            raise TypeError(f"dtype must be a torch or numpy floating-point dtype (torch.bfloat16, "
                            f"np.float16, ...), got {dtype!r}") from None
    if not floating:
        raise TypeError(f"dtype={dtype} is not a floating-point dtype: dtype= casts floating-point "
                        f"tensors (fp32 -> bf16) and leaves integer and bool ones as they are; to "
                        f"convert weights to {dtype}, convert them yourself before publishing or "
                        f"after fetching")
    return dtype


class _Source(NamedTuple):
    value: Any
    kind: str
    dtype: str
    shape: tuple
    nbytes: int
    meta: bytes


def _torch_dtype(dtype: Any):
    torch = _torch()
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
    except (TypeError, ValueError):
        raise TypeError(f"dtype {dtype!r} has no torch equivalent; pass a torch.dtype") from None


def _numpy_dtype(dtype: Any) -> np.dtype:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        try:
            return torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            raise TypeError(f"numpy has no {dtype}; publish torch tensors to store or fetch "
                            f"{dtype} (numpy arrays can only be cast to numpy dtypes)") from None
    return np.dtype(dtype)


def _is_torch_dtype(dtype: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def _source(tname: str, value: Any, dtype: Any) -> _Source:
    """Describe one state-dict value as it will be stored (after the optional cast)."""
    if isinstance(value, np.ndarray) and dtype is not None and value.dtype.kind == "f" \
            and _is_torch_dtype(dtype):
        # cast to a torch dtype (bf16); not ascontiguousarray, which makes a 0-d array 1-d
        value = _torch().from_numpy(value if value.flags.c_contiguous else value.copy())
    if codec.is_tensor(value):
        t = value.detach()
        if t.layout != _torch().strided or t.is_nested or t.is_quantized or t.is_meta:
            what = ("nested" if t.is_nested else "quantized" if t.is_quantized else "a meta tensor" if t.is_meta
                    else "sparse")
            raise TypeError(f"tensor {tname!r} is {what}; publish dense tensors with data (.to_dense(), "
                            ".dequantize(), materialized weights)")
        sd = _torch_dtype(dtype) if dtype is not None and t.is_floating_point() else t.dtype
        shape = tuple(t.shape)
        return _Source(t, "torch", str(sd).replace("torch.", ""), shape,
                       math.prod(shape) * sd.itemsize, codec.tensor_meta(sd, shape))
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise TypeError(f"tensor {tname!r} has numpy dtype {value.dtype}; numeric or bool only")
        sd = _numpy_dtype(dtype) if dtype is not None and value.dtype.kind == "f" else value.dtype
        sd = sd.newbyteorder("=") if sd.byteorder == ">" else sd
        return _Source(value, "numpy", sd.str, value.shape, value.size * sd.itemsize,
                       codec.array_meta(sd, value.shape))
    raise TypeError(f"state dict value {tname!r} is a {type(value).__name__}; "
                    "publish torch tensors or numpy arrays")


def _filler(src: _Source):
    """What ``put_with`` stores for ``src``: its own bytes when they need no cast or move
    (one C call copies them), else a function that casts them into the block."""
    v = src.value
    if isinstance(v, np.ndarray) and v.dtype == np.dtype(src.dtype) and v.flags.c_contiguous:
        return v
    if src.kind == "torch" and v.device.type == "cpu" and str(v.dtype) == f"torch.{src.dtype}" \
            and v.is_contiguous():
        return codec.as_bytes_view(v)

    def fill(u8: np.ndarray) -> None:
        if u8.size == 0:
            return
        if src.kind == "torch":
            torch, t = _torch(), src.value
            sd = getattr(torch, src.dtype)
            if t.device.type == "cpu" and t.dtype == sd and t.is_contiguous():
                np.copyto(u8, t.reshape(-1).view(torch.uint8).numpy())   # a plain memcpy
            else:   # cast and/or device->host in one copy
                if t.device.type != "cpu":   # cast on the device: torch would copy, then cast on the host
                    t = t.to(sd).contiguous()
                torch.from_numpy(u8).view(sd).view(src.shape).copy_(t)
        else:
            np.copyto(u8.view(np.dtype(src.dtype)).reshape(src.shape), src.value, casting="unsafe")
    return fill


class _Sends:
    """Calls run inline (``depth`` 0) or on a few threads, at most ``depth`` in flight."""

    def __init__(self, depth: int):
        self.depth = depth
        self.pending: list[Future] = []

    def run(self, fn: Any, *args: Any) -> None:
        if not self.depth:
            fn(*args)
            return
        if len(self.pending) >= self.depth:
            self.pending.pop(0).result()
        self.pending.append(pool().submit(fn, *args))

    def wait(self, raising: bool = True) -> None:
        """Wait for every call in flight; then raise the first error (if ``raising``)."""
        pending, self.pending = self.pending, []
        first: BaseException | None = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:      # noqa: BLE001 - the others must finish first
                first = first or e
        if first is not None and raising:
            raise first


class WeightPublisher:
    """Trainer rank ``rank`` of ``world`` publishing versions of the weight set ``name``.

    ``keep`` newest complete versions stay readable; older ones are retired
    when a newer version completes (give every rank the same ``keep``).
    ``store`` is any handle of the store (``TieredStore.attach`` in each
    trainer process). Over a cluster store, a publish that finds a member dead
    but still in the ring (its lease not yet expired) waits for the member set
    to change and writes again, for up to ``settle_s`` seconds.

    Examples:
        >>> import numpy as np
        >>> from yrcache import TieredStore
        >>> from yrcache.rl import Shard, WeightPublisher
        >>> with TieredStore(dram="16MiB") as s:
        ...     pubs = [WeightPublisher(s, "policy", rank=r, world=2) for r in range(2)]
        ...     pubs[0].publish({"w": np.zeros((2, 4))}, version=1, layout={"w": Shard(0, 0, 2)})
        ...     pubs[1].publish({"w": np.ones((3, 4))}, version=1, layout={"w": Shard(0, 1, 2)})
        ...     pubs[0].latest()
        False
        True
        1
    """

    def __init__(self, store: TieredStore, name: str, rank: int = 0, world: int = 1, keep: int = 2) -> None:
        for what, v, lo in (("rank", rank, 0), ("world", world, 1), ("keep", keep, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
        if rank >= world:
            raise ValueError(f"rank must be in 0..{world - 1} for world={world}, got {rank}")
        self.store, self.name, self.rank, self.world, self.keep = store, name, rank, world, keep
        self.board = VersionBoard(store, name)
        self.last_version: int | None = None
        self.last_publish_stats: dict = {}
        self._pending: set[int] = set()
        self._woke_nobody = False        # a version completed here, its waiters not woken yet
        self._structures: dict[tuple, bytes] = {}     # manifests' shapes -> merged structure
        self._nonce = ("", 0)            # (nonce, pid): one per publisher and process
        self._swept: int | None = None   # member_changes at the last look for unmarked versions
        self._unmarked: set[int] = set()  # versions only a listing of parts found, too new to retire yet
        #: Over a cluster, how long a publish that fails for want of a member (one died and
        #: stays in the ring until its lease expires) waits for the member set to change and
        #: tries again; None: two lease TTLs and a second; 0: it raises at once.
        self.settle_s: float | None = None

    def publish(self, state: Mapping[str, Array], version: int, layout: Mapping[str, Shard | None] | None = None,
                dtype: DType | None = None) -> bool:
        """Publish this rank's part of ``state`` as ``version``; True if the version is now visible.

        ``layout[name] = Shard(dim, index=rank, count=world)`` marks a tensor as
        this rank's slab of a global tensor concatenated along ``dim`` in rank
        order; a tensor without an entry is replicated and stored by rank 0
        only.  ``dtype`` casts floating-point values on the way into the store
        (one copy; a numpy array given a torch dtype is stored as a tensor).
        The version becomes visible when every rank has published it.
        """
        t0 = time.perf_counter()
        version = _check_version(version)
        dtype = _check_cast(dtype)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} of {self.name!r} is not newer than this rank's last "
                             f"published version {self.last_version}; versions must increase")
        latest = self.board.latest()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} of {self.name!r} is not newer than the latest complete "
                             f"version {latest}; versions are immutable, publish a higher one")
        if self.last_version is None and self.board.is_complete(version):
            # A restarted rank, and the version's last rank died between its marker and the
            # record: the version is complete (with the parts the dead ranks wrote); show it.
            if self.board.complete(version):
                self._reclaim()
            raise ValueError(f"version {version} of {self.name!r} is already complete (the rank that "
                             f"completed it died before making it visible; it is visible now); versions "
                             f"are immutable, publish a higher one")
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of name -> tensor, not {type(state).__name__}")
        layout = dict(layout or {})
        for t, spec in layout.items():
            if t not in state:
                raise ValueError(f"layout names {t!r}, which is not in the state dict")
            if spec is None:
                continue
            if not isinstance(spec, Shard):
                raise TypeError(f"publish layout[{t!r}] must be a Shard or None, not {type(spec).__name__}")
            if (spec.index, spec.count) != (self.rank, self.world):
                raise ValueError(f"layout[{t!r}] = {spec} on rank {self.rank} of {self.world}: a publish "
                                 f"Shard must be Shard(dim, index={self.rank}, count={self.world})")
        # The nonce tells this publisher's parts from those of another process publishing
        # the same rank and version (a restarted or misconfigured one). It is the same for
        # every version, so markers of an unchanged model are the same bytes, which a
        # subscriber then parses once.
        if self._nonce[1] != os.getpid():
            self._nonce = (os.urandom(6).hex(), os.getpid())
        nonce = self._nonce[0]
        sources = []
        for t, value in state.items():
            if not isinstance(t, str) or not t:
                raise ValueError(f"state dict keys must be non-empty str, got {t!r}")
            if len(t) > 200:      # shorter ones always fit (a name of <= 128 bytes, a rank < 10**6)
                self._check_key_room(version, nonce, t)
            src = _source(t, value, dtype)
            spec = layout.get(t)
            try:
                dim = None if spec is None else spec.resolve_dim(len(src.shape))
            except ValueError as e:
                raise ValueError(f"layout[{t!r}]: {e}") from None
            sources.append((t, src, dim))

        if any(src.kind == "torch" and src.value.device.type == "cuda" for _, src, _ in sources):
            self.store.pin_host_memory()   # the D2H copies below then run at pinned speed
        # Nothing of the version is visible before its manifest: a write that failed for want
        # of a member is tried again once the member set has changed.
        written, tensors, placement, nbytes = self._settled(self._write, version, sources, nonce)
        manifest = {"format": FORMAT, "name": self.name, "version": version, "rank": self.rank,
                    "world": self.world, "nonce": nonce, "tensors": tensors, "placement": placement}
        try:
            self._settled(self.board.record_rank, version, self.rank, manifest)
        except BaseException:
            self._drop(written)
            raise
        # Again now that our manifest is there: of two ranks racing, the later one sees
        # the other.  Nothing is rolled back (peers of our world may already have read
        # our manifest); the parts go when a newer version retires this one.
        if self.world > 1:       # (with world=1 the version completes now: a late rank of
            self._check_world(version)   # another world finds it complete and stops there)
        previous, self.last_version = self.last_version, version
        try:
            visible = self._settled(self._try_complete, version, manifest)
        except ValueError as e:             # the ranks disagree (merge_manifests): withdraw this
            self.board.withdraw(version, self.rank)     # rank's part, so it can publish it again
            self._drop(written)
            self.last_version = previous
            raise ValueError(f"{e}. This rank's part of version {version} was withdrawn: publish the "
                             "version again once the ranks agree, or a newer one") from None
        except BaseException:
            self._pending.add(version)      # the next publish completes it if it can
            raise
        latest = self.board.latest()
        for v in sorted(self._pending):     # an earlier version whose last rank died after its manifest
            try:
                if (latest is None or v > latest) and not self._try_complete(v):
                    continue
            except ValueError:
                pass                        # already reported to the rank that completed it
            self._pending.discard(v)
        if not visible:
            self._pending.add(version)
        if self._woke_nobody:
            # Last: woken subscribers take the CPU, so the publisher finishes first.
            self._woke_nobody = False
            self.board.wake()
        self.last_publish_stats = {"bytes_written": nbytes, "parts": len(written),
                                   "seconds": time.perf_counter() - t0, "complete": visible}
        return visible

    def _check_key_room(self, version: int, nonce: str, tensor: Any) -> None:
        """Refuse, before anything is written, a tensor name too long for its part's key."""
        try:
            key_bytes(self.board.part_key(version, self.rank, nonce, tensor))
        except ValueError:
            room = MAX_KEY_BYTES - len(self.board.part_key(version, self.rank, nonce, "").encode())
            raise ValueError(f"tensor name {tensor[:60]!r}... is {len(tensor.encode(errors='replace'))} "
                             f"UTF-8 bytes; in weight set {self.name!r} a tensor name may be at most "
                             f"{room} (its part's key holds the set's name too, and keys are at most "
                             f"{MAX_KEY_BYTES} bytes): shorten the name") from None

    def _settled(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; over a cluster, again each time the member set changes while it
        fails for want of a member (``ClusterUnavailableError``: one died and stays in the
        ring until its lease expires), for up to ``settle_s`` seconds in all."""
        deadline = None
        while True:
            seen = self._member_changes()
            try:
                return fn(*args)
            except ClusterUnavailableError:
                if seen is None:
                    raise
                if deadline is None:
                    wait = self.settle_s if self.settle_s is not None else \
                        SETTLE_TTLS * getattr(self.store, "lease_ttl", 10.0) + 1.0
                    deadline = time.monotonic() + wait
                while self._member_changes() == seen and time.monotonic() < deadline:
                    time.sleep(SETTLE_POLL_S)
                if self._member_changes() == seen:
                    raise

    def _member_changes(self) -> int | None:
        return getattr(self.store, "member_changes", None)

    def _write(self, version: int, sources: list, nonce: str) -> tuple[list[str], dict, dict, int]:
        """Check the world, announce the version and store this rank's parts: (their keys,
        the manifest's tensors, their placement, bytes). On failure the parts written are
        dropped."""
        self._check_world(version, nonce)       # before writing anything
        self.board.begin(version, self.rank, self.world)
        tensors, written, nbytes = {}, [], 0
        owners_of = getattr(self.store, "owners", None)
        placement: dict[str, list[str]] = {}
        # Over a cluster a part goes to its owner over TCP: keep a few in flight (the next
        # cast overlaps the last send); in one arena, one after the other.
        sends = _Sends(4 if owners_of is not None else 0)
        try:
            for t, src, dim in sources:
                entry = {"kind": src.kind, "dtype": src.dtype, "shape": list(src.shape), "dim": dim,
                         "key": None}
                if dim is not None or self.rank == 0:
                    key = self.board.part_key(version, self.rank, nonce, t)
                    written.append(key)
                    sends.run(self.store.put_with, key, src.meta, src.nbytes, _filler(src))
                    entry["key"] = key
                    if owners_of is not None:      # a cluster: readers go straight to them
                        placement[t] = owners_of(key)
                    nbytes += src.nbytes
                tensors[t] = entry
            sends.wait()
        except BaseException:
            sends.wait(raising=False)
            self._drop(written)
            raise
        return written, tensors, placement, nbytes

    def _drop(self, keys: list[str]) -> None:
        """Delete the parts of a publish that failed (those on a member that does not answer
        go when a newer version retires this one)."""
        for k in keys:
            try:
                self.store.delete(k)
            except ClusterUnavailableError:
                pass

    def _check_world(self, version: int, nonce: str | None = None) -> None:
        """Refuse a version that another rank publishes with another ``world``.

        Ranks that disagree on ``world`` would each wait for a different set of
        manifests and the version would never complete, silently.  With our
        ``nonce``: warn when another process has published our rank of it.
        """
        # O(1), no scan: the last rank that began the version, and the manifests
        # of our own world's ranks.  Of two ranks that disagree, each sees the
        # other's begin record or manifest by the time its manifest is written.
        manifests = self.board.rank_manifests(version, self.world)
        mine = manifests[self.rank]
        if nonce is not None and mine is not None and mine.get("nonce") != nonce:
            warnings.warn(f"rank {self.rank} of version {version} of {self.name!r} was published by another "
                          f"process (parts {mine.get('nonce')!r}); this publish replaces them. If that "
                          f"process is still running, two processes publish as rank {self.rank}: give each "
                          f"its own rank", RuntimeWarning, stacklevel=5)
        seen = [(rank, m.get("world")) for rank, m in enumerate(manifests) if m is not None]
        started = self.board.started_by(version)
        if started is not None:
            seen.append(started)
        for rank, world in seen:
            if rank != self.rank and world != self.world:
                raise ValueError(
                    f"version {version} of {self.name!r}: rank {rank} published it with world="
                    f"{world}, but this rank {self.rank} has world={self.world}; every rank of a "
                    "weight set must pass the same world: fix the misconfigured rank, or publish a newer "
                    "version if that manifest is left over from an earlier run")

    def _try_complete(self, version: int, mine: dict | None = None) -> bool:
        """If every rank's manifest of ``version`` is there, validate, mark complete and reclaim.
        ``mine``: this rank's manifest of it, when it was just written."""
        if self.board.is_complete(version):
            # Repairs the record if its completer died after the marker; then retire for it.
            if self.board.complete(version, wake=False):
                self._reclaim()
            self._woke_nobody = True
            return True
        got = [mine] if mine is not None and self.world == 1 else self.board.rank_manifests(version, self.world)
        manifests = [m for m in got if m is not None]
        if len(manifests) < len(got):
            return False
        advanced = self.board.complete(
            version, {"format": FORMAT, "world": self.world, "keep": self.keep,
                      "nonces": [m["nonce"] for m in manifests],
                      "placement": [m.get("placement", {}) for m in manifests]},
            self._structure(manifests, version), wake=False)
        self._woke_nobody = True
        if advanced:          # of ranks completing it at once, one retires (a dead one: the next)
            self._reclaim()
        return True

    def _structure(self, manifests: list[dict], version: int) -> bytes:
        """The merged structure of a version's manifests (``merge_manifests`` refuses an
        inconsistent one), remembered for the next versions of an unchanged model."""
        sig = tuple((m.get("world"), tuple((t, e["kind"], e["dtype"], tuple(e["shape"]), e["dim"], e["key"] is None)
                                           for t, e in m["tensors"].items())) for m in manifests)
        got = self._structures.get(sig)
        if got is None:
            got = encode_structure(merge_manifests(manifests, self.name, version))
            if len(self._structures) >= 8:
                self._structures.clear()
            self._structures[sig] = got
        return got

    def _reclaim(self) -> None:
        done = self.board.complete_versions()
        if len(done) < self.keep:
            return
        threshold = done[-self.keep]    # (with keep complete: abandoned and lost older ones go)
        # A member that died took the markers it held: once per member-set change (and at the
        # first reclaim) the parts themselves are listed, and the versions found that way that
        # are too new to go yet are remembered until they are.
        changes = self._member_changes()
        sweep = changes is not None and changes != self._swept
        if sweep:
            self._swept = changes
        found = set(self.board.versions(done, parts=sweep)) | self._unmarked
        for v in sorted(found):
            if v < threshold:
                self.board.retire(v)
        self._unmarked = {v for v in found if v >= threshold} - set(done)

    def latest(self) -> int | None:
        """The newest complete version of this weight set, or None."""
        self.board.check_open()
        return self.board.latest()

    def __repr__(self) -> str:
        return (f"<WeightPublisher {self.name!r} rank {self.rank}/{self.world} keep={self.keep} "
                f"last={self.last_version}>")
