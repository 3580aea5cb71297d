"""Pure slice math for resharding RL weights between trainer and rollout layouts.

A trainer with M ranks publishes each tensor as M *parts* that, concatenated in
rank order along one dim, form the global tensor (a tensor without a layout is
replicated and stored once, whole).  A rollout worker fetches a *box* of the
global tensor -- usually one ``Shard`` cut like ``numpy.array_split``, or a
``Fused`` target that concatenates the same shard of several tensors (fused
QKV).  This module turns "which box, from which parts" into a flat list of
byte-range copies, and nothing else: no I/O, no store access, no torch.

Everything is computed in elements and converted to bytes with the item size
at the end.  Copies are coalesced: when the innermost dims of a part's overlap
are covered completely in both the source part and the destination, the rows
are contiguous in both buffers and merge into one run, so a dim-0 shard of a
C-contiguous tensor costs one copy per overlapping part.

A copy plan is an ``int64`` array of shape ``(k, 4)`` whose columns are
``PLAN_COLUMNS``: the part id (index into the parts sequence given to the
planner), the byte offset in that part's buffer, the byte offset in the
destination buffer, and the byte count.  Rows of one part are adjacent and
in increasing destination order.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

__all__ = [
    "PLAN_COLUMNS",
    "Box",
    "Shape",
    "Shard",
    "Fused",
    "Part",
    "FusedPiece",
    "FusedLayout",
    "normalize_dim",
    "split_sizes",
    "split_bounds",
    "full_box",
    "shard_box",
    "box_shape",
    "published_global_shape",
    "publish_parts",
    "replicated_parts",
    "validate_parts",
    "plan_copy",
    "plan_shard",
    "fused_layout",
    "plan_fused",
    "plan_nbytes",
    "apply_plan",
]

#: Column names of a copy plan, in order.
PLAN_COLUMNS = ("part", "src_offset", "dst_offset", "nbytes")

Shape = tuple[int, ...]
#: A box is one ``(start, stop)`` element range per dimension.
Box = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------
# Small validated integers.
# --------------------------------------------------------------------------


def _as_int(value: Any, what: str) -> int:
    """Return *value* as a Python int, rejecting bools, floats and strings."""
    # bool is an int subclass; Shard(dim=True, ...) is almost surely a bug.
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{what} must be an int, got {type(value).__name__} {value!r}"
        ) from None


def _as_shape(shape: Any, what: str = "shape") -> Shape:
    """Return *shape* as a tuple of non-negative Python ints."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(
            f"{what} must be a sequence of ints, got {type(shape).__name__} {shape!r}"
        )
    dims = tuple(_as_int(s, f"{what} entry") for s in shape)
    for s in dims:
        if s < 0:
            raise ValueError(f"{what} must have non-negative sizes, got {dims}")
    return dims


def normalize_dim(dim: int, ndim: int) -> int:
    """Map a possibly negative *dim* into ``range(ndim)`` or raise ValueError."""
    dim = _as_int(dim, "dim")
    if ndim <= 0:
        raise ValueError(
            f"dim {dim} given for a 0-d tensor; a scalar cannot be split, "
            "publish or fetch it replicated (no Shard)"
        )
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"dim {dim} is out of range for a {ndim}-d tensor "
            f"(pass a dim in {-ndim}..{ndim - 1})"
        )
    return dim % ndim


# --------------------------------------------------------------------------
# array_split arithmetic.
# --------------------------------------------------------------------------


def _check_split(n: int, count: int) -> tuple[int, int]:
    n = _as_int(n, "size")
    count = _as_int(count, "count")
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    if count < 1:
        raise ValueError(f"count must be >= 1 (the number of parts), got {count}")
    return n, count


def split_sizes(n: int, count: int) -> list[int]:
    """Sizes of ``numpy.array_split(range(n), count)``: the first ``n % count`` are one longer."""
    n, count = _check_split(n, count)
    q, r = divmod(n, count)
    return [q + 1] * r + [q] * (count - r)


def split_bounds(n: int, count: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part *index* of ``numpy.array_split(range(n), count)``."""
    n, count = _check_split(n, count)
    index = _as_int(index, "index")
    if not 0 <= index < count:
        raise ValueError(f"index must be in 0..{count - 1} for count={count}, got {index}")
    q, r = divmod(n, count)
    # The first r parts have q + 1 elements, so part i starts after i parts of
    # size q plus one extra element for each of the min(i, r) longer parts.
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


# --------------------------------------------------------------------------
# Targets.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """Part *index* of *count* of a tensor cut along *dim* like ``numpy.array_split``.

    On fetch it selects that array_split part of the global tensor.  On
    publish it names the concat dim and the publishing rank; the publisher's
    split is given by the ranks' actual part sizes.  A negative *dim* is
    normalised against the tensor's ndim when resolved (``resolve_dim``).
    """

    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        dim = _as_int(self.dim, "Shard.dim")
        index = _as_int(self.index, "Shard.index")
        count = _as_int(self.count, "Shard.count")
        if count < 1:
            raise ValueError(
                f"Shard.count must be >= 1 (pass the number of parts, e.g. "
                f"Shard(dim, index=rank, count=world_size)), got {count}"
            )
        if not 0 <= index < count:
            raise ValueError(
                f"Shard.index must be in 0..{count - 1} for count={count} "
                f"(pass this worker's rank within the group), got {index}"
            )
        # Store plain ints so equality/hash do not depend on numpy int types.
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "count", count)

    def resolve_dim(self, ndim: int) -> int:
        """The shard dim normalised for a tensor of *ndim* dimensions."""
        return normalize_dim(self.dim, ndim)

    def bounds(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(start, stop)`` along the shard dim of this part of a tensor of *shape*."""
        shape = _as_shape(shape)
        d = self.resolve_dim(len(shape))
        return split_bounds(shape[d], self.count, self.index)


@dataclass(frozen=True)
class Fused:
    """A fetch target concatenating the same shard of several tensors.

    The result is ``cat([x_k for x in sources], dim)`` where ``x_k`` is
    ``shard`` applied to source ``x`` on its own (array_split along
    ``shard.dim``), or the whole source when ``shard`` is None.  All other
    dims of the pieces must agree.
    """

    sources: tuple[str, ...]
    dim: int = 0
    shard: Shard | None = None

    def __post_init__(self) -> None:
        sources = self.sources
        if isinstance(sources, (str, bytes)):
            raise TypeError(
                f"Fused.sources must be a list of tensor names, got the single "
                f"string {sources!r}; pass [{sources!r}]"
            )
        try:
            sources = tuple(sources)
        except TypeError:
            raise TypeError(
                f"Fused.sources must be a list of tensor names, got "
                f"{type(self.sources).__name__}"
            ) from None
        if not sources:
            raise ValueError("Fused.sources must name at least one tensor")
        for name in sources:
            if not isinstance(name, str):
                raise TypeError(
                    f"Fused.sources must contain tensor names (str), got {name!r}"
                )
        if self.shard is not None and not isinstance(self.shard, Shard):
            raise TypeError(
                f"Fused.shard must be a Shard or None, got {type(self.shard).__name__}"
            )
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "dim", _as_int(self.dim, "Fused.dim"))


# --------------------------------------------------------------------------
# Boxes.
# --------------------------------------------------------------------------


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of *shape*."""
    return tuple((0, s) for s in _as_shape(shape))


def shard_box(shape: Sequence[int], shard: Shard | None) -> Box:
    """The box of *shape* selected by *shard* (the whole tensor for None)."""
    shape = _as_shape(shape)
    if shard is None:
        return full_box(shape)
    if not isinstance(shard, Shard):
        raise TypeError(f"expected a Shard or None, got {type(shard).__name__}")
    d = shard.resolve_dim(len(shape))
    box = list(full_box(shape))
    box[d] = split_bounds(shape[d], shard.count, shard.index)
    return tuple(box)


def box_shape(box: Box) -> Shape:
    """The shape of the tensor a box selects."""
    return tuple(stop - start for start, stop in box)


def _check_box(box: Any, shape: Shape, what: str = "box") -> Box:
    try:
        box = tuple((_as_int(a, f"{what} start"), _as_int(b, f"{what} stop")) for a, b in box)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{what} must be one (start, stop) pair of ints per dim: {exc}"
        ) from None
    if len(box) != len(shape):
        raise ValueError(
            f"{what} has {len(box)} (start, stop) pairs for a {len(shape)}-d tensor; "
            "pass one pair per dim"
        )
    for (a, b), s in zip(box, shape):
        if not 0 <= a <= b <= s:
            raise ValueError(f"{what} {box} does not fit in shape {shape}")
    return box


# --------------------------------------------------------------------------
# Publish side.
# --------------------------------------------------------------------------


class Part(NamedTuple):
    """One stored part: rank *rank*'s slab at *offset* along *dim* of the global tensor."""

    rank: int
    dim: int
    offset: int
    shape: Shape


def published_global_shape(local_shapes: Sequence[Sequence[int]], dim: int | None) -> Shape:
    """Global shape of per-rank parts concatenated along *dim* (None: replicated).

    Sizes along *dim* are summed; every other dim must agree across ranks.
    With ``dim=None`` the tensor is replicated and all shapes must be equal.
    """
    shapes = [_as_shape(s, "local shape") for s in local_shapes]
    if not shapes:
        raise ValueError("pass at least one local shape (one per publishing rank)")
    first = shapes[0]
    for rank, s in enumerate(shapes):
        if len(s) != len(first):
            raise ValueError(
                f"rank {rank} has a {len(s)}-d part but rank 0 a {len(first)}-d one "
                f"({s} vs {first}); all ranks must publish the same ndim"
            )
    if dim is None:
        for rank, s in enumerate(shapes):
            if s != first:
                raise ValueError(
                    f"replicated tensor has shape {s} on rank {rank} but {first} "
                    "on rank 0; pass a Shard dim if it is split"
                )
        return first
    d = normalize_dim(dim, len(first))
    for rank, s in enumerate(shapes):
        for k, (a, b) in enumerate(zip(s, first)):
            if k != d and a != b:
                raise ValueError(
                    f"rank {rank} part {s} differs from rank 0 part {first} in "
                    f"dim {k}, but only the concat dim {d} may differ"
                )
    out = list(first)
    out[d] = sum(s[d] for s in shapes)
    return tuple(out)


def publish_parts(local_shapes: Sequence[Sequence[int]], dim: int) -> list[Part]:
    """Parts for ranks ``0..M-1`` whose *local_shapes* concatenate along *dim*."""
    shapes = [_as_shape(s, "local shape") for s in local_shapes]
    gshape = published_global_shape(shapes, dim)
    d = normalize_dim(dim, len(gshape))
    parts, offset = [], 0
    for rank, s in enumerate(shapes):
        parts.append(Part(rank, d, offset, s))
        offset += s[d]
    return parts


def replicated_parts(shape: Sequence[int]) -> list[Part]:
    """The single part of a replicated tensor (stored once, whole, by rank 0)."""
    return [Part(0, 0, 0, _as_shape(shape))]


def validate_parts(global_shape: Sequence[int], parts: Sequence[Any]) -> list[Part]:
    """Check that *parts* tile *global_shape* exactly along one dim; return them normalised.

    Every part must span the full global extent in all dims but its own, all
    parts must share that dim, and sorted by offset they must cover it with
    no gap and no overlap -- otherwise a plan would leave holes in the
    destination or copy some bytes twice.
    """
    gshape = _as_shape(global_shape, "global shape")
    ndim = len(gshape)
    out: list[Part] = []
    for i, p in enumerate(parts):
        try:
            rank, dim, offset, shape = p
        except (TypeError, ValueError):
            raise TypeError(
                f"part {i} must be (rank, dim, offset, shape), got {p!r}"
            ) from None
        shape = _as_shape(shape, f"part {i} shape")
        if len(shape) != ndim:
            raise ValueError(
                f"part {i} shape {shape} is {len(shape)}-d but the global shape "
                f"{gshape} is {ndim}-d"
            )
        if ndim == 0:
            # A scalar is never split; its only part is the whole value.
            dim, offset = _as_int(dim, "part dim"), _as_int(offset, "part offset")
            if dim != 0 or offset != 0:
                raise ValueError(f"part {i} of a 0-d tensor must be (rank, 0, 0, ())")
        else:
            dim = normalize_dim(dim, ndim)
            offset = _as_int(offset, f"part {i} offset")
        out.append(Part(_as_int(rank, f"part {i} rank"), dim, offset, shape))
    if not out:
        raise ValueError("pass at least one part")
    if ndim == 0:
        if len(out) != 1:
            raise ValueError(f"a 0-d tensor has exactly one part, got {len(out)}")
        return out
    d = out[0].dim
    for i, p in enumerate(out):
        if p.dim != d:
            raise ValueError(
                f"part {i} is split along dim {p.dim} but part 0 along dim {d}; "
                "all parts of a tensor share one concat dim"
            )
        for k, (a, b) in enumerate(zip(p.shape, gshape)):
            if k != d and a != b:
                raise ValueError(
                    f"part {i} shape {p.shape} must match global shape {gshape} "
                    f"in every dim but the concat dim {d}"
                )
    # Sort by (offset, size) so zero-size parts at the cursor come first.
    cursor = 0
    for i in sorted(range(len(out)), key=lambda j: (out[j].offset, out[j].shape[d])):
        p = out[i]
        if p.offset != cursor:
            kind = "gap" if p.offset > cursor else "overlap"
            raise ValueError(
                f"parts do not tile dim {d} of {gshape}: {kind} at element "
                f"{min(cursor, p.offset)} (part {i} starts at {p.offset})"
            )
        cursor += p.shape[d]
    if cursor != gshape[d]:
        raise ValueError(
            f"parts cover {cursor} of {gshape[d]} elements along dim {d} of {gshape}"
        )
    return out


# --------------------------------------------------------------------------
# The copy planner.
# --------------------------------------------------------------------------


def _c_strides(shape: Shape) -> list[int]:
    """Element strides of a C-contiguous array of *shape*."""
    strides, acc = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = acc
        acc *= shape[k]
    return strides


def _box_copies(
    extent: Shape,
    src_shape: Shape,
    src_start: Sequence[int],
    dst_shape: Shape,
    dst_start: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, int]:
    """Element offsets (src, dst) of the coalesced runs copying one sub-box, and the run length."""
    ndim = len(extent)
    # Find the outermost dim j such that dims j+1.. are fully covered in both
    # arrays: then every index into dims 0..j-1 addresses one contiguous run of
    # prod(extent[j:]) elements in the source and in the destination.
    j = ndim - 1 if ndim else 0
    while j > 0 and extent[j] == src_shape[j] == dst_shape[j]:
        j -= 1
    run = math.prod(extent[j:])
    sstr, dstr = _c_strides(src_shape), _c_strides(dst_shape)
    src = np.array([sum(a * s for a, s in zip(src_start, sstr))], dtype=np.int64)
    dst = np.array([sum(a * s for a, s in zip(dst_start, dstr))], dtype=np.int64)
    # Enumerate the outer index grid in C order, one dim at a time, so the
    # cost is O(number of runs) and never O(number of elements).
    for k in range(j):
        step = np.arange(extent[k], dtype=np.int64)
        src = (src[:, None] + step * sstr[k]).ravel()
        dst = (dst[:, None] + step * dstr[k]).ravel()
    return src, dst, run


def plan_copy(
    global_shape: Sequence[int],
    parts: Sequence[Any],
    box: Box,
    itemsize: int,
    *,
    dst_shape: Sequence[int] | None = None,
    dst_origin: Sequence[int] | None = None,
) -> np.ndarray:
    """Byte-range copies that gather *box* of the global tensor out of *parts*.

    *parts* are ``(rank, dim, offset, shape)`` entries tiling *global_shape*
    (see ``validate_parts``); each part's buffer is C-contiguous of its local
    shape.  The box lands C-contiguously in the destination, by default a
    buffer of exactly ``box_shape(box)``; pass *dst_shape* and *dst_origin*
    to place it at an element offset inside a bigger array (a ``Fused``
    output).  Returns an ``(k, 4)`` int64 array with ``PLAN_COLUMNS``; only
    parts that overlap the box appear, and the byte counts sum to exactly the
    box's bytes.
    """
    gshape = _as_shape(global_shape, "global shape")
    itemsize = _as_int(itemsize, "itemsize")
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1 byte, got {itemsize}")
    plist = validate_parts(gshape, parts)
    box = _check_box(box, gshape)
    bshape = box_shape(box)
    ndim = len(gshape)
    if dst_shape is None:
        dshape = bshape
    else:
        dshape = _as_shape(dst_shape, "dst_shape")
    origin = (0,) * ndim if dst_origin is None else tuple(
        _as_int(o, "dst_origin entry") for o in dst_origin
    )
    if len(dshape) != ndim or len(origin) != ndim:
        raise ValueError(
            f"dst_shape {dshape} and dst_origin {origin} must both be {ndim}-d "
            f"like the global shape {gshape}"
        )
    for o, b, s in zip(origin, bshape, dshape):
        if not 0 <= o <= s - b:
            raise ValueError(
                f"box of shape {bshape} at dst_origin {origin} does not fit in "
                f"dst_shape {dshape}"
            )

    chunks: list[np.ndarray] = []
    for pid, p in enumerate(plist):
        # The part occupies [offset, offset + size) along its dim and the full
        # extent elsewhere; intersect that with the requested box.
        pstart = [0] * ndim
        if ndim:
            pstart[p.dim] = p.offset
        lo = [max(b0, ps) for (b0, _), ps in zip(box, pstart)]
        hi = [min(b1, ps + s) for (_, b1), ps, s in zip(box, pstart, p.shape)]
        extent = tuple(h - lo_d for lo_d, h in zip(lo, hi))
        if any(e <= 0 for e in extent):
            continue  # no overlap: this part is never touched
        src_start = [lo_d - ps for lo_d, ps in zip(lo, pstart)]
        dst_start = [lo_d - b0 + o for lo_d, (b0, _), o in zip(lo, box, origin)]
        src, dst, run = _box_copies(extent, p.shape, src_start, dshape, dst_start)
        rows = np.empty((len(src), 4), dtype=np.int64)
        rows[:, 0] = pid
        rows[:, 1] = src * itemsize
        rows[:, 2] = dst * itemsize
        rows[:, 3] = run * itemsize
        chunks.append(rows)
    if not chunks:
        return np.empty((0, 4), dtype=np.int64)
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def plan_shard(
    global_shape: Sequence[int],
    parts: Sequence[Any],
    shard: Shard | None,
    itemsize: int,
) -> tuple[Shape, np.ndarray]:
    """Output shape and copy plan for fetching *shard* (None: the whole tensor)."""
    box = shard_box(global_shape, shard)
    return box_shape(box), plan_copy(global_shape, parts, box, itemsize)


class FusedPiece(NamedTuple):
    """Where one source of a ``Fused`` target comes from and lands."""

    source: str
    box: Box  # the box to read, in the source's global coordinates
    dst_origin: Shape  # element index of the box's first element in the output


class FusedLayout(NamedTuple):
    """Output shape of a ``Fused`` target and its per-source pieces in order."""

    shape: Shape
    pieces: tuple[FusedPiece, ...]


def fused_layout(target: Fused, shapes: Mapping[str, Sequence[int]]) -> FusedLayout:
    """Output shape and per-source read box / output position of *target*.

    *shapes* maps each source name to its global shape.  Pieces are placed
    one after another along ``target.dim`` of the output; every other dim
    must match across pieces (ValueError otherwise).
    """
    if not isinstance(target, Fused):
        raise TypeError(f"expected a Fused target, got {type(target).__name__}")
    gshapes = []
    for name in target.sources:
        try:
            gshapes.append(_as_shape(shapes[name], f"shape of {name!r}"))
        except KeyError:
            raise KeyError(f"no global shape given for Fused source {name!r}") from None
    ndim = len(gshapes[0])
    for name, s in zip(target.sources, gshapes):
        if len(s) != ndim:
            raise ValueError(
                f"Fused sources must have the same ndim: {target.sources[0]!r} is "
                f"{ndim}-d but {name!r} has shape {s}"
            )
    d = normalize_dim(target.dim, ndim)
    boxes = [shard_box(s, target.shard) for s in gshapes]
    first = box_shape(boxes[0])
    pieces, pos = [], 0
    for name, box in zip(target.sources, boxes):
        bs = box_shape(box)
        for k, (a, b) in enumerate(zip(bs, first)):
            if k != d and a != b:
                raise ValueError(
                    f"cannot fuse along dim {d}: piece of {name!r} has shape {bs} but "
                    f"piece of {target.sources[0]!r} has {first}; all dims but {d} "
                    "must match"
                )
        origin = [0] * ndim
        origin[d] = pos
        pieces.append(FusedPiece(name, box, tuple(origin)))
        pos += bs[d]
    out = list(first)
    out[d] = pos
    return FusedLayout(tuple(out), tuple(pieces))


def plan_fused(
    target: Fused,
    shapes: Mapping[str, Sequence[int]],
    parts: Mapping[str, Sequence[Any]],
    itemsize: int,
) -> tuple[Shape, np.ndarray]:
    """Output shape and one copy plan for a ``Fused`` target.

    Part ids in the plan index the flat list
    ``[p for name in target.sources for p in parts[name]]`` -- pass the
    buffers in that order to ``apply_plan``.
    """
    layout = fused_layout(target, shapes)
    plans, base = [], 0
    for piece in layout.pieces:
        plist = parts[piece.source]
        plan = plan_copy(
            shapes[piece.source],
            plist,
            piece.box,
            itemsize,
            dst_shape=layout.shape,
            dst_origin=piece.dst_origin,
        )
        plan[:, 0] += base
        plans.append(plan)
        base += len(plist)
    return layout.shape, np.concatenate(plans)


def plan_nbytes(plan: np.ndarray) -> int:
    """Total bytes a plan copies."""
    return int(np.asarray(plan)[:, 3].sum()) if len(plan) else 0


# --------------------------------------------------------------------------
# Reference executor.
# --------------------------------------------------------------------------


def _flat_bytes(buf: Any, writable: bool, what: str) -> np.ndarray:
    """A flat uint8 view (never a copy) of a C-contiguous buffer."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        # reshape(-1) of a C-contiguous array is a view; view(uint8) then
        # reinterprets its bytes without copying.
        flat = buf.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"{what} must be a numpy array or support the buffer protocol, "
                f"got {type(buf).__name__} (for a torch tensor pass "
                "t.view(torch.uint8).numpy())"
            ) from None
        if not mv.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        flat = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if writable and not flat.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return flat


def apply_plan(plan: np.ndarray, src_buffers: Sequence[Any], dst_buffer: Any) -> None:
    """Execute *plan*: copy each planned byte range from ``src_buffers[part]`` into *dst_buffer*.

    Buffers are C-contiguous numpy arrays or buffer-protocol objects; only the
    planned ranges are read or written.  Bounds are checked before anything
    is copied.
    """
    plan = np.asarray(plan, dtype=np.int64)
    if plan.ndim != 2 or plan.shape[1] != 4:
        raise ValueError(f"plan must be a (k, 4) array of {PLAN_COLUMNS}, got shape {plan.shape}")
    if not len(plan):
        return
    dst = _flat_bytes(dst_buffer, True, "dst_buffer")
    pid, soff, doff, n = plan.T
    if pid.min() < 0 or pid.max() >= len(src_buffers):
        raise ValueError(
            f"plan references part {int(pid.max())} but {len(src_buffers)} "
            "source buffers were given"
        )
    if (soff < 0).any() or (doff < 0).any() or (n < 0).any():
        raise ValueError("plan has negative offsets or sizes")
    if int((doff + n).max()) > dst.size:
        raise ValueError(
            f"plan writes up to byte {int((doff + n).max())} but dst_buffer has {dst.size}"
        )
    srcs: dict[int, np.ndarray] = {}
    for p in np.unique(pid):
        p = int(p)
        srcs[p] = _flat_bytes(src_buffers[p], False, f"src_buffers[{p}]")
        need = int((soff[pid == p] + n[pid == p]).max())
        if need > srcs[p].size:
            raise ValueError(
                f"plan reads up to byte {need} of part {p} but its buffer has {srcs[p].size}"
            )
    # Runs of one part are adjacent.  When they are equally long and equally
    # spaced in both buffers (the usual "slice along an inner dim" case), copy
    # them as one strided 2-d view instead of a Python loop over rows.
    cuts = np.flatnonzero(np.diff(pid)) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(plan)]):
        lo, hi = int(lo), int(hi)
        src = srcs[int(pid[lo])]
        s, d, k = soff[lo:hi], doff[lo:hi], n[lo:hi]
        if hi - lo > 2 and (k == k[0]).all():
            ss, ds = np.diff(s), np.diff(d)
            if (ss == ss[0]).all() and (ds == ds[0]).all() and ss[0] > 0 and ds[0] >= k[0]:
                # ds >= run length keeps destination rows disjoint, so the
                # strided write is well defined.
                view = np.lib.stride_tricks.as_strided
                rows, run = hi - lo, int(k[0])
                dv = view(dst[int(d[0]):], shape=(rows, run), strides=(int(ds[0]), 1), writeable=True)
                sv = view(src[int(s[0]):], shape=(rows, run), strides=(int(ss[0]), 1), writeable=False)
                dv[...] = sv
                continue
        for a, b, m in zip(s.tolist(), d.tolist(), k.tolist()):
            dst[b:b + m] = src[a:a + m]
