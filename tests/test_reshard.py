"""Tests for yrcache.rl.reshard: the pure slice math behind RL weight resharding."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yrcache.rl.reshard import (
    PLAN_COLUMNS,
    Fused,
    Part,
    Shard,
    apply_plan,
    box_shape,
    full_box,
    fused_layout,
    normalize_dim,
    plan_copy,
    plan_fused,
    plan_nbytes,
    plan_shard,
    publish_parts,
    published_global_shape,
    replicated_parts,
    shard_box,
    split_bounds,
    split_sizes,
    validate_parts,
)

DTYPES = [np.int8, np.int16, np.float32, np.float64]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def make_global(shape, dtype):
    """A global tensor whose every element is distinct (mod dtype range)."""
    # int8 wraps every 256 elements; wider types are distinct for our sizes.
    return np.arange(math.prod(shape), dtype=np.int64).astype(dtype).reshape(shape)


def split_by_sizes(full, sizes, dim):
    """Cut *full* into consecutive parts of the given sizes along *dim*."""
    cuts = np.cumsum(sizes)[:-1]
    return [np.ascontiguousarray(p) for p in np.split(full, cuts, axis=dim)]


def part_overlaps(part: Part, box) -> bool:
    """Independent overlap check used to judge the planner."""
    for k, (b0, b1) in enumerate(box):
        p0 = part.offset if k == part.dim else 0
        p1 = p0 + part.shape[k]
        if min(b1, p1) - max(b0, p0) <= 0:
            return False
    return True


def execute(plan, buffers, out_shape, dtype, fill=None):
    out = np.empty(out_shape, dtype=dtype)
    if fill is not None:
        out.view(np.uint8)[...] = fill
    apply_plan(plan, buffers, out)
    return out


def check_dst_coverage(plan, nbytes):
    """Every destination byte is written exactly once."""
    hits = np.zeros(nbytes, dtype=np.int64)
    for _, _, d, n in plan.tolist():
        hits[d:d + n] += 1
    assert (hits == 1).all()


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------


@st.composite
def sizes_summing_to(draw, n, m):
    """m non-negative sizes summing to n (arbitrary, not array_split)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=m - 1, max_size=m - 1)))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def scenarios(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    replicated = draw(st.booleans())
    if replicated:
        pub_dim, sizes = None, None
    else:
        pub_dim = draw(st.integers(-ndim, ndim - 1))
        m = draw(st.integers(1, 5))
        sizes = draw(sizes_summing_to(shape[pub_dim], m))
    fetch_dim = draw(st.integers(-ndim, ndim - 1))
    n = draw(st.integers(1, 5))
    return shape, dtype, pub_dim, sizes, fetch_dim, n


def publish(full, pub_dim, sizes):
    """Local parts, their buffers and layout as M publishing ranks would store them."""
    if pub_dim is None:
        return replicated_parts(full.shape), [np.ascontiguousarray(full)]
    locals_ = split_by_sizes(full, sizes, pub_dim)
    parts = publish_parts([a.shape for a in locals_], pub_dim)
    assert published_global_shape([a.shape for a in locals_], pub_dim) == full.shape
    return parts, locals_


# --------------------------------------------------------------------------
# array_split arithmetic
# --------------------------------------------------------------------------


@given(st.integers(0, 200), st.integers(1, 20))
def test_split_matches_array_split(n, count):
    pieces = np.array_split(np.arange(n), count)
    assert split_sizes(n, count) == [len(p) for p in pieces]
    for i, p in enumerate(pieces):
        start, stop = split_bounds(n, count, i)
        assert list(range(start, stop)) == p.tolist()


def test_split_errors():
    with pytest.raises(ValueError, match="count"):
        split_sizes(5, 0)
    with pytest.raises(ValueError, match="index"):
        split_bounds(5, 2, 2)
    with pytest.raises(ValueError, match="index"):
        split_bounds(5, 2, -1)
    with pytest.raises(ValueError):
        split_sizes(-1, 2)


# --------------------------------------------------------------------------
# Property: M publishers -> N subscribers
# --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_reshard_roundtrip(scenario):
    shape, dtype, pub_dim, sizes, fetch_dim, n = scenario
    full = make_global(shape, dtype)
    itemsize = full.itemsize
    parts, buffers = publish(full, pub_dim, sizes)
    expected_pieces = np.array_split(full, n, axis=fetch_dim)
    for i in range(n):
        shard = Shard(fetch_dim, i, n)
        box = shard_box(shape, shard)
        out_shape, plan = plan_shard(shape, parts, shard, itemsize)
        assert out_shape == expected_pieces[i].shape == box_shape(box)
        assert plan.dtype == np.int64 and plan.shape[1] == len(PLAN_COLUMNS)

        out = execute(plan, buffers, out_shape, dtype)
        np.testing.assert_array_equal(out, expected_pieces[i])

        # No read amplification: exactly the box's bytes.
        box_bytes = math.prod(out_shape) * itemsize
        assert plan_nbytes(plan) == box_bytes
        check_dst_coverage(plan, box_bytes)

        # Only (and all) overlapping parts are referenced.
        used = set(plan[:, 0].tolist())
        overlapping = {j for j, p in enumerate(parts) if part_overlaps(p, box)}
        assert used == overlapping
        # Reads stay inside each part's own buffer.
        for pid, s, _, nb in plan.tolist():
            assert 0 <= s and s + nb <= buffers[pid].nbytes
            assert nb > 0


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_untouched_parts_not_read(scenario):
    """Buffers of non-overlapping parts may be garbage (even empty) without effect."""
    shape, dtype, pub_dim, sizes, fetch_dim, n = scenario
    full = make_global(shape, dtype)
    parts, buffers = publish(full, pub_dim, sizes)
    for i in range(n):
        shard = Shard(fetch_dim, i, n)
        box = shard_box(shape, shard)
        out_shape, plan = plan_shard(shape, parts, shard, full.itemsize)
        poisoned = [
            b if part_overlaps(p, box) else np.empty(0, dtype=np.uint8)
            for p, b in zip(parts, buffers)
        ]
        out = execute(plan, poisoned, out_shape, dtype)
        np.testing.assert_array_equal(out, np.array_split(full, n, axis=fetch_dim)[i])


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_arbitrary_box_into_bigger_destination(scenario, data):
    """An arbitrary box placed inside a bigger output; bytes outside stay untouched."""
    shape, dtype, pub_dim, sizes, _, _ = scenario
    full = make_global(shape, dtype)
    parts, buffers = publish(full, pub_dim, sizes)
    box, origin, dshape = [], [], []
    for s in shape:
        a = data.draw(st.integers(0, s))
        b = data.draw(st.integers(a, s))
        pad_lo, pad_hi = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
        box.append((a, b))
        origin.append(pad_lo)
        dshape.append(pad_lo + (b - a) + pad_hi)
    box = tuple(box)
    plan = plan_copy(shape, parts, box, full.itemsize, dst_shape=dshape, dst_origin=origin)
    out = execute(plan, buffers, tuple(dshape), dtype, fill=0xAB)

    sel = tuple(slice(o, o + (b - a)) for o, (a, b) in zip(origin, box))
    np.testing.assert_array_equal(out[sel], full[tuple(slice(a, b) for a, b in box)])
    mask = np.ones(dshape, dtype=bool)
    mask[sel] = False
    sentinel = np.full(out.shape, 0, dtype=dtype)
    sentinel.view(np.uint8)[...] = 0xAB
    np.testing.assert_array_equal(out[mask], sentinel[mask])
    assert plan_nbytes(plan) == math.prod(box_shape(box)) * full.itemsize


# --------------------------------------------------------------------------
# Coalescing
# --------------------------------------------------------------------------


def test_dim0_shard_is_one_copy_per_overlapping_part():
    shape = (10, 6, 4)
    full = make_global(shape, np.float32)
    parts, buffers = publish(full, 0, [3, 3, 4])
    for n in (1, 2, 3, 4, 7):
        for i in range(n):
            shard = Shard(0, i, n)
            box = shard_box(shape, shard)
            _, plan = plan_shard(shape, parts, shard, 4)
            overlapping = [j for j, p in enumerate(parts) if part_overlaps(p, box)]
            assert plan[:, 0].tolist() == overlapping
            out = execute(plan, buffers, box_shape(box), np.float32)
            np.testing.assert_array_equal(out, np.array_split(full, n, axis=0)[i])
    # Shard(0, 1, 4) of 10 rows is [3, 6): exactly rank 1's part, one copy.
    _, plan = plan_shard(shape, parts, Shard(0, 1, 4), 4)
    assert plan.tolist() == [[1, 0, 0, 3 * 6 * 4 * 4]]


def test_replicated_full_fetch_is_one_copy():
    shape = (5, 7, 3)
    parts = replicated_parts(shape)
    out_shape, plan = plan_shard(shape, parts, None, 2)
    assert out_shape == shape
    assert plan.tolist() == [[0, 0, 0, 5 * 7 * 3 * 2]]


def test_inner_dim_shard_is_one_run_per_row():
    # Fetching columns of a row-split tensor: one run per row per part.
    shape = (6, 8)
    full = make_global(shape, np.int16)
    parts, buffers = publish(full, 0, [2, 4])
    _, plan = plan_shard(shape, parts, Shard(1, 0, 2), 2)
    assert len(plan) == 6
    assert (plan[:, 3] == 4 * 2).all()
    # Fetching rows of a column-split tensor: one run per row per part too.
    parts, buffers = publish(full, 1, [3, 5])
    _, plan = plan_shard(shape, parts, Shard(0, 1, 2), 2)
    assert len(plan) == 3 * 2
    out = execute(plan, buffers, (3, 8), np.int16)
    np.testing.assert_array_equal(out, full[3:])


def test_middle_dim_partial_coalesces_inner():
    # Slicing dim 1 of a (4, 6, 5) tensor: each (i, j-range) block of 5-element
    # rows is contiguous, so one run per index of dim 0.
    shape = (4, 6, 5)
    _, plan = plan_shard(shape, replicated_parts(shape), Shard(1, 1, 3), 1)
    assert len(plan) == 4
    assert (plan[:, 3] == 2 * 5).all()


def test_zero_size_box_plans_nothing():
    shape = (0, 4)
    _, plan = plan_shard(shape, replicated_parts(shape), Shard(0, 0, 3), 4)
    assert plan.shape == (0, 4)
    _, plan = plan_shard((3, 4), replicated_parts((3, 4)), Shard(0, 4, 5), 4)
    assert plan.shape == (0, 4)  # array_split gives an empty 5th part of 3 rows


def test_scalar_replicated():
    parts = replicated_parts(())
    out_shape, plan = plan_shard((), parts, None, 8)
    assert out_shape == ()
    assert plan.tolist() == [[0, 0, 0, 8]]
    src = np.array(3.5)
    out = np.empty((), dtype=np.float64)
    apply_plan(plan, [src], out)
    assert out == 3.5
    with pytest.raises(ValueError, match="0-d"):
        shard_box((), Shard(0, 0, 1))


# --------------------------------------------------------------------------
# Fused targets
# --------------------------------------------------------------------------


def _publish_qkv(m=3):
    rng = np.random.default_rng(0)
    shapes = {"q": (12, 5), "k": (4, 5), "v": (7, 5)}
    fulls = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    parts, buffers = {}, {}
    for name, full in fulls.items():
        sizes = split_sizes(full.shape[0], m)
        sizes = sizes[::-1]  # not array_split order: uneven the other way round
        parts[name], buffers[name] = publish(full, 0, sizes)
    return shapes, fulls, parts, buffers


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_fused_qkv_dim0(n):
    shapes, fulls, parts, buffers = _publish_qkv()
    flat = [b for name in "qkv" for b in buffers[name]]
    for i in range(n):
        target = Fused(["q", "k", "v"], dim=0, shard=Shard(0, i, n))
        out_shape, plan = plan_fused(target, shapes, parts, 4)
        expected = np.concatenate(
            [np.array_split(fulls[x], n, axis=0)[i] for x in "qkv"], axis=0
        )
        assert out_shape == expected.shape
        out = execute(plan, flat, out_shape, np.float32)
        np.testing.assert_array_equal(out, expected)
        assert plan_nbytes(plan) == expected.nbytes
        check_dst_coverage(plan, expected.nbytes)


def test_fused_whole_sources():
    shapes, fulls, parts, buffers = _publish_qkv()
    flat = [b for name in "qkv" for b in buffers[name]]
    target = Fused(["q", "k", "v"])
    assert target.sources == ("q", "k", "v") and target.shard is None
    out_shape, plan = plan_fused(target, shapes, parts, 4)
    out = execute(plan, flat, out_shape, np.float32)
    np.testing.assert_array_equal(out, np.concatenate([fulls[x] for x in "qkv"]))
    # Whole sources along dim 0: one copy per stored part.
    assert len(plan) == sum(len(parts[x]) for x in "qkv")


def test_fused_along_dim1_with_column_shard():
    rng = np.random.default_rng(1)
    shapes = {"gate": (6, 5), "up": (6, 9)}
    fulls = {k: rng.integers(0, 1000, s).astype(np.int32) for k, s in shapes.items()}
    parts, buffers = {}, {}
    for name, full in fulls.items():
        parts[name], buffers[name] = publish(full, 1, [1, full.shape[1] - 1])
    flat = buffers["gate"] + buffers["up"]
    for n in (1, 2, 3):
        for i in range(n):
            target = Fused(("gate", "up"), dim=-1, shard=Shard(1, i, n))
            layout = fused_layout(target, shapes)
            assert [p.source for p in layout.pieces] == ["gate", "up"]
            out_shape, plan = plan_fused(target, shapes, parts, 4)
            expected = np.concatenate(
                [np.array_split(fulls[x], n, axis=1)[i] for x in ("gate", "up")], axis=1
            )
            out = execute(plan, flat, out_shape, np.int32)
            np.testing.assert_array_equal(out, expected)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fused_property(data):
    ndim = data.draw(st.integers(1, 3))
    fdim = data.draw(st.integers(0, ndim - 1))
    base = data.draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    k = data.draw(st.integers(1, 4))
    names = [f"t{j}" for j in range(k)]
    shapes, fulls, parts, buffers = {}, {}, {}, {}
    use_shard = data.draw(st.booleans())
    sdim = data.draw(st.integers(-ndim, ndim - 1))
    n = data.draw(st.integers(1, 4))
    for name in names:
        s = list(base)
        # Sources differ only along the fuse dim, so the pieces agree off it
        # whatever dim the shard cuts.
        s[fdim] = data.draw(st.integers(0, 5))
        shapes[name] = tuple(s)
        fulls[name] = make_global(s, np.int16) + 1000 * len(fulls)
        pdim = data.draw(st.integers(0, ndim - 1))
        m = data.draw(st.integers(1, 3))
        sizes = data.draw(sizes_summing_to(s[pdim], m))
        parts[name], buffers[name] = publish(fulls[name], pdim, sizes)
    shard = Shard(sdim, data.draw(st.integers(0, n - 1)), n) if use_shard else None
    target = Fused(names, dim=fdim, shard=shard)
    out_shape, plan = plan_fused(target, shapes, parts, 2)
    pieces = [
        np.array_split(fulls[x], n, axis=sdim)[shard.index] if shard else fulls[x]
        for x in names
    ]
    expected = np.concatenate(pieces, axis=fdim)
    assert out_shape == expected.shape
    flat = [b for x in names for b in buffers[x]]
    out = execute(plan, flat, out_shape, np.int16)
    np.testing.assert_array_equal(out, expected)
    assert plan_nbytes(plan) == expected.nbytes


def test_fused_mismatch_raises():
    shapes = {"a": (4, 5), "b": (4, 6)}
    with pytest.raises(ValueError, match="dim"):
        fused_layout(Fused(["a", "b"], dim=0), shapes)
    # Along dim 1 they do fuse.
    layout = fused_layout(Fused(["a", "b"], dim=1), shapes)
    assert layout.shape == (4, 11)
    assert layout.pieces[1].dst_origin == (0, 5)
    with pytest.raises(ValueError, match="ndim"):
        fused_layout(Fused(["a", "c"]), {"a": (4, 5), "c": (4,)})
    with pytest.raises(KeyError):
        fused_layout(Fused(["a", "z"]), shapes)


def test_fused_validation():
    with pytest.raises(TypeError, match="list"):
        Fused("qkv")
    with pytest.raises(ValueError):
        Fused([])
    with pytest.raises(TypeError):
        Fused(["q", 3])
    with pytest.raises(TypeError):
        Fused(["q"], shard=(0, 0, 1))
    f = Fused(["q", "k"], 0, Shard(0, 0, 2))
    assert isinstance(f.sources, tuple)
    hash(f)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.dim = 1


# --------------------------------------------------------------------------
# Shard validation and errors
# --------------------------------------------------------------------------


def test_shard_validation():
    with pytest.raises(ValueError, match="index"):
        Shard(0, 2, 2)
    with pytest.raises(ValueError, match="index"):
        Shard(0, -1, 2)
    with pytest.raises(ValueError, match="count"):
        Shard(0, 0, 0)
    with pytest.raises(TypeError):
        Shard(0.0, 0, 1)
    with pytest.raises(TypeError):
        Shard(True, 0, 1)
    with pytest.raises(TypeError):
        Shard("0", 0, 1)
    s = Shard(np.int64(1), np.int32(0), 2)
    assert s == Shard(1, 0, 2) and type(s.dim) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.index = 1


def test_negative_dims_normalise():
    shape = (3, 4, 5)
    assert normalize_dim(-1, 3) == 2
    assert Shard(-1, 0, 2).resolve_dim(3) == 2
    assert shard_box(shape, Shard(-1, 1, 2)) == shard_box(shape, Shard(2, 1, 2))
    assert shard_box(shape, Shard(-3, 0, 2)) == ((0, 2), (0, 4), (0, 5))
    parts = publish_parts([(3, 4, 2), (3, 4, 3)], -1)
    assert [p.dim for p in parts] == [2, 2]
    assert published_global_shape([(3, 4, 2), (3, 4, 3)], -1) == shape
    with pytest.raises(ValueError, match="out of range"):
        shard_box(shape, Shard(3, 0, 1))
    with pytest.raises(ValueError, match="out of range"):
        shard_box(shape, Shard(-4, 0, 1))


def test_global_shape_errors():
    assert published_global_shape([(2, 3), (4, 3), (0, 3)], 0) == (6, 3)
    assert published_global_shape([(2, 3)] * 3, None) == (2, 3)
    with pytest.raises(ValueError, match="dim 1"):
        published_global_shape([(2, 3), (4, 4)], 0)
    with pytest.raises(ValueError, match="ndim"):
        published_global_shape([(2, 3), (4,)], 0)
    with pytest.raises(ValueError, match="replicated"):
        published_global_shape([(2, 3), (2, 4)], None)
    with pytest.raises(ValueError):
        published_global_shape([], 0)


def test_parts_must_tile():
    g = (6, 2)
    with pytest.raises(ValueError, match="gap"):
        validate_parts(g, [Part(0, 0, 0, (2, 2)), Part(1, 0, 3, (3, 2))])
    with pytest.raises(ValueError, match="overlap"):
        validate_parts(g, [Part(0, 0, 0, (4, 2)), Part(1, 0, 3, (3, 2))])
    with pytest.raises(ValueError, match="cover"):
        validate_parts(g, [Part(0, 0, 0, (4, 2))])
    with pytest.raises(ValueError, match="concat dim"):
        validate_parts(g, [Part(0, 0, 0, (3, 2)), Part(1, 1, 0, (6, 1))])
    with pytest.raises(ValueError, match="global shape"):
        validate_parts(g, [Part(0, 0, 0, (6, 3))])
    # Plain tuples work too, in any order.
    assert len(validate_parts(g, [(1, 0, 2, (4, 2)), (0, 0, 0, (2, 2))])) == 2


def test_plan_copy_errors():
    g = (4, 4)
    parts = replicated_parts(g)
    with pytest.raises(ValueError, match="fit"):
        plan_copy(g, parts, ((0, 5), (0, 4)), 4)
    with pytest.raises(ValueError, match="pair"):
        plan_copy(g, parts, ((0, 4),), 4)
    with pytest.raises(ValueError, match="itemsize"):
        plan_copy(g, parts, full_box(g), 0)
    with pytest.raises(ValueError, match="dst_shape"):
        plan_copy(g, parts, full_box(g), 4, dst_shape=(4, 4), dst_origin=(1, 0))


def test_apply_plan_checks_bounds():
    g = (4, 4)
    _, plan = plan_shard(g, replicated_parts(g), None, 4)
    src = np.zeros(g, dtype=np.float32)
    with pytest.raises(ValueError, match="dst_buffer"):
        apply_plan(plan, [src], np.empty(15, dtype=np.float32))
    with pytest.raises(ValueError, match="part"):
        apply_plan(plan, [np.zeros(3, dtype=np.float32)], np.empty(g, dtype=np.float32))
    with pytest.raises(ValueError, match="source buffers"):
        apply_plan(plan, [], np.empty(g, dtype=np.float32))
    with pytest.raises(ValueError, match="read-only"):
        apply_plan(plan, [src], bytes(64))
    # Buffer-protocol objects work as well as arrays.
    dst = bytearray(64)
    apply_plan(plan, [np.arange(16, dtype=np.float32).tobytes()], dst)
    np.testing.assert_array_equal(np.frombuffer(dst, np.float32), np.arange(16))


# --------------------------------------------------------------------------
# Scale: planning must never enumerate elements
# --------------------------------------------------------------------------


def test_large_plan_shapes_only():
    g = (16384, 16384)
    parts = publish_parts([(2048, 16384)] * 8, 0)
    total = 0
    for i in range(4):
        out_shape, plan = plan_shard(g, parts, Shard(1, i, 4), 4)
        assert out_shape == (16384, 4096)
        assert len(plan) == 16384  # one run per row, rows split over 8 parts
        assert set(plan[:, 0].tolist()) == set(range(8))
        total += plan_nbytes(plan)
    assert total == 16384 * 16384 * 4
    # Column-split publisher, row-split subscriber: 4096 rows x 8 parts runs.
    parts = publish_parts([(16384, 2048)] * 8, 1)
    _, plan = plan_shard(g, parts, Shard(0, 3, 4), 4)
    assert len(plan) == 4096 * 8 and plan_nbytes(plan) == 4096 * 16384 * 4
    # Same dim on both sides: one copy per overlapping part.
    parts = publish_parts([(2048, 16384)] * 8, 0)
    _, plan = plan_shard(g, parts, Shard(0, 1, 4), 4)
    assert len(plan) == 2


# --------------------------------------------------------------------------
# The subscriber's compiled plans (equally spaced runs as one 2-d copy)
# --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.sampled_from([1, 2, 3, 8]), st.integers(0, 6),
                          st.integers(1, 5)), max_size=12))
def test_compiled_plan_copies_exactly_what_the_plan_says(groups):
    """``subscribe._compile`` folds runs of one part that are equally long and
    equally spaced in both buffers into one strided copy: running the compiled
    plan writes the same bytes as the plan's rows one by one, in at most as many
    copies, and a stretch of ``k`` equally spaced runs is one copy."""
    from yrcache.rl.reshard import _compile, _run_plan
    rows, at = [], 0
    for pid, so, n, gap, reps in groups:          # reps runs, each `n + gap` further on
        for r in range(reps):
            rows.append((pid, so + r * (n + 1), at, n))
            at += n + gap
    plan = np.array(rows, dtype=np.int64).reshape(-1, 4)
    srcs = [np.arange(100, dtype=np.uint8) + 37 * i for i in range(3)]
    want = np.zeros(at + 1, dtype=np.uint8)
    apply_plan(plan, srcs, want)
    compiled = _compile((at + 1,), plan)
    got = np.zeros(at + 1, dtype=np.uint8)
    _run_plan(compiled, srcs, got)
    np.testing.assert_array_equal(got, want)
    assert sum(op[4] for op in compiled.ops) == len(rows) and len(compiled.ops) <= len(rows)
    assert compiled.used == tuple(sorted({r[0] for r in rows}))
    if len(groups) == 1 and groups[0][4] > 1:
        assert len(compiled.ops) == 1


def test_column_shard_of_a_tall_tensor_compiles_to_one_copy_per_part():
    from yrcache.rl.reshard import _compile
    parts = publish_parts([(2048, 256), (2048, 256)], 0)
    shape, plan = plan_shard((4096, 256), parts, Shard(1, 1, 4), 4)
    assert len(plan) == 4096
    assert [op[:1] + op[4:] for op in _compile(shape, plan).ops] == [(0, 2048, 1024, 256), (1, 2048, 1024, 256)]
