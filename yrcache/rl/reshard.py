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
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from .layout import (Box, Fused, Part, Shape, Shard, _as_int, _as_shape, _check_box, box_shape,  # noqa: F401
                     full_box, normalize_dim, publish_parts, published_global_shape, replicated_parts,
                     shard_box, split_bounds, split_sizes, validate_parts)

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


class _Plan(NamedTuple):
    """A copy plan (``PLAN_COLUMNS`` rows) compiled into a few strided byte copies."""

    shape: tuple
    used: tuple          # part ids the plan reads
    ops: tuple           # (part, src_off, dst_off, run, rows, src_stride, dst_stride)
    nbytes: int          # bytes the plan copies


def _compile(shape: tuple, plan: np.ndarray) -> _Plan:
    """Group each part's runs: equally long and equally spaced runs become one 2-d copy.

    Runs ``m`` and ``m + 1`` link when they read the same part with the same
    length, forward in both buffers without overlap; a group is a stretch of
    links with one source and one destination stride. Found with numpy, so a
    column slice of a 4096-row tensor (4096 runs, one copy) costs a few array
    operations, not a Python step per run."""
    pid, so, do, n = (plan[:, i] for i in range(4))
    k = len(pid)
    ss, ds = np.diff(so), np.diff(do)
    link = (pid[1:] == pid[:-1]) & (n[1:] == n[:-1]) & (ss > 0) & (ds >= n[:-1])
    # a stretch of links ends before a link that is missing or changes a stride
    same = link[1:] & link[:-1] & (ss[1:] == ss[:-1]) & (ds[1:] == ds[:-1])
    last = np.flatnonzero(~same).tolist() + [k - 2]        # the last link of each stretch
    ends = np.repeat(last, np.diff([-1] + last)).tolist() if k > 1 else []
    link_l = link.tolist()
    ops = []
    i = 0
    while i < k:                  # a step per copy, reading numbers only where one starts
        if i < k - 1 and link_l[i]:
            e = ends[i] + 1                                  # the group's last run
            ops.append((int(pid[i]), int(so[i]), int(do[i]), int(n[i]), e - i + 1, int(ss[i]), int(ds[i])))
            i = e + 1
        else:
            ops.append((int(pid[i]), int(so[i]), int(do[i]), int(n[i]), 1, 0, 0))
            i += 1
    # (every run is in one copy, so the copies name every part read; not np.unique,
    # whose first call in a process costs ~20 ms of imports)
    return _Plan(shape, tuple(sorted({op[0] for op in ops})), tuple(ops), plan_nbytes(plan))


def _run_plan(p: _Plan, srcs: list, dst: np.ndarray) -> None:
    """Execute a compiled plan: flat uint8 ``srcs[part]`` -> flat uint8 ``dst`` (bounds checked by numpy)."""
    for pid, so, do, n, rows, ss, ds in p.ops:
        src = srcs[pid]
        if rows == 1:
            dst[do:do + n] = src[so:so + n]
        else:
            np.ndarray((rows, n), np.uint8, dst, do, (ds, 1))[...] = \
                np.ndarray((rows, n), np.uint8, src, so, (ss, 1))


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
    for p in sorted(set(pid.tolist())):       # (np.unique's first call imports numpy.ma: ~20 ms)
        srcs[p] = _flat_bytes(src_buffers[p], False, f"src_buffers[{p}]")
        need = int((soff[pid == p] + n[pid == p]).max())
        if need > srcs[p].size:
            raise ValueError(
                f"plan reads up to byte {need} of part {p} but its buffer has {srcs[p].size}"
            )
    # equally long, equally spaced runs of a part go as one strided copy
    _run_plan(_compile((), plan), [srcs.get(i) for i in range(len(src_buffers))], dst)
