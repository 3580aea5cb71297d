"""Layouts of sharded tensors: shapes, ``Shard``/``Fused`` targets, boxes and parts.

A trainer with M ranks publishes each tensor as M *parts* that, concatenated in
rank order along one dim, form the global tensor (a tensor without a layout is
replicated and stored once, whole).  A rollout worker fetches a *box* of the
global tensor: usually one ``Shard`` cut like ``numpy.array_split``, or a
``Fused`` target that concatenates the same shard of several tensors (fused
QKV).  Pure: no I/O, no store, no torch; ``reshard.py`` plans the copies.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

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

    Examples:
        >>> Shard(dim=0, index=1, count=3).bounds((10, 4))    # rows 4..6 of 10
        (4, 7)
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

    Examples:
        >>> Fused(["q", "k", "v"], dim=0, shard=Shard(0, index=1, count=2)).sources
        ('q', 'k', 'v')
    """

    sources: Sequence[str]      # stored as a tuple
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
