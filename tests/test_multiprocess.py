"""Several real processes on one store: attach, zero-copy, concurrency, ownership, fork.

Every child runs both under ``fork`` and ``spawn`` (the ``mp_context``
fixture) unless it tests something only one start method has.  Child
functions live at module level so ``spawn`` can pickle them; they report back
through ``child_entry`` (a result, or the child's traceback).  torch is imported
lazily so that spawned children which do not need it start quickly.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import time

import numpy as np
import pytest

from yrcache import StoreNotFoundError, TieredStore
from yrcache.tiers import dram
from procs import finish, kill_all, seg_exists, start  # noqa: E402

MAGIC = np.uint64(0x5EEDC0DE12345678)
KEYS = [f"k{i}" for i in range(6)]


# ------------------------------------------------------------------ helpers


def make_value(rng: random.Random, lo: int = 7, hi: int = 18) -> np.ndarray:
    """A self-checking uint64 array of 2**lo..2**hi elements (1 KiB..2 MiB by default).

    ``[n, fill ^ MAGIC, fill, fill, ...]``: any mix of two values, a block
    reused under a reader or a wrong length shows up in ``check_value``.
    """
    n = int(2 ** rng.uniform(lo, hi))
    fill = np.uint64(rng.getrandbits(63) | 1)
    arr = np.full(n, fill, dtype=np.uint64)
    arr[0] = n
    arr[1] = fill ^ MAGIC
    return arr


def check_value(v) -> int:
    assert isinstance(v, np.ndarray), type(v)
    assert v.dtype == np.uint64 and v.ndim == 1, (v.dtype, v.shape)
    n = len(v)
    assert n >= 3 and int(v[0]) == n, f"torn value: length word {int(v[0])} in an array of {n}"
    fill = v[1] ^ MAGIC
    bad = np.flatnonzero(v[2:] != fill)
    assert bad.size == 0, f"torn value: {bad.size} of {n - 2} words differ from the fill, first at {bad[0] + 2}"
    return n


def big_array() -> np.ndarray:
    return np.arange(3 << 20, dtype=np.float32) * np.float32(0.5)   # 12 MiB


def tensor_value():
    import torch
    return (torch.arange(4096, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(64, 64)


# --------------------------------------------------------- attach and share


def _child_reads_and_writes(how, arg, pickled):
    """Attach (by name / via the pickled store / via pickle bytes), check the
    parent's values zero-copy, write values of our own."""
    import torch

    if how == "name":
        s = TieredStore.attach(arg)
    elif how == "arg":
        s = arg          # spawn: unpickled (attached by name); fork: inherited handle
    else:
        s = pickle.loads(pickled)
    assert isinstance(s, TieredStore) and not s.closed

    exp_big = big_array()
    a1 = s["p/big"]
    a2 = s.get("p/big")
    assert isinstance(a1, np.ndarray) and not a1.flags.writeable
    assert a1.dtype == np.float32 and a1.shape == exp_big.shape
    np.testing.assert_array_equal(a1, exp_big)
    # Zero copy: two gets are two views of the same stored bytes.
    assert np.shares_memory(a1, a2)
    assert a1.__array_interface__["data"][0] == a2.__array_interface__["data"][0]
    st = s.stats()
    assert st["pinned_bytes"] >= exp_big.nbytes, st
    assert st["processes"] >= 2, st

    t1 = s["p/t"]
    t2 = s["p/t"]
    assert isinstance(t1, torch.Tensor) and t1.dtype == torch.bfloat16 and t1.shape == (64, 64)
    assert t1.data_ptr() == t2.data_ptr()
    assert torch.equal(t1, tensor_value())
    assert bytes(s["p/raw"]) == b"parent" * 100

    # ...and the other direction.
    s.put("c/big", exp_big[::-1])
    s.put("c/t", tensor_value() * 2)
    s["c/raw"] = b"child" * 100
    s.put("c/pid", np.array([os.getpid()], dtype=np.int64))

    del a1, a2, t1, t2
    gc.collect()
    # The parent holds no views: our dropped views must have released their pins.
    assert s.stats()["pinned_bytes"] == 0
    s.check()
    s.close()
    return os.getpid()


@pytest.mark.parametrize("how", ["name", "arg", "pickle-bytes"])
def test_child_attaches_and_shares_values(mp_context, make_store, store_name, how):
    import torch

    s = make_store(dram="64MiB")
    s.put("p/big", big_array())
    s.put("p/t", tensor_value())
    s["p/raw"] = b"parent" * 100
    assert s.stats()["pinned_bytes"] == 0

    arg = store_name if how == "name" else s
    p, q = start(mp_context, _child_reads_and_writes, how, arg, pickle.dumps(s))
    child_pid = finish(p, q)

    # The parent's handle is unaffected by whatever the child closed.
    assert not s.closed and seg_exists(store_name)
    assert int(s["c/pid"][0]) == child_pid
    big = s["c/big"]
    np.testing.assert_array_equal(big, big_array()[::-1])
    assert big.flags.c_contiguous and not big.flags.writeable
    t = s["c/t"]
    assert t.dtype == torch.bfloat16 and torch.equal(t, tensor_value() * 2)
    assert bytes(s["c/raw"]) == b"child" * 100
    assert s.stats()["pinned_bytes"] > 0
    del big, t
    gc.collect()
    st = s.stats()
    assert st["pinned_bytes"] == 0 and st["processes"] == 1, st
    s.check()


def test_store_pickles_by_name(make_store, store_name):
    s = make_store()
    s["x"] = b"1"
    data = pickle.dumps(s)
    assert len(data) < 200, "a store must travel by name, not by value"
    s2 = pickle.loads(data)
    try:
        assert s2 is not s and s2.name == store_name
        assert bytes(s2["x"]) == b"1"
    finally:
        s2.close()
    assert seg_exists(store_name)


# ------------------------------------------------- concurrent writers/readers


def _writer(name, seed, barrier, duration):
    s = TieredStore.attach(name)
    rng = random.Random(seed)
    puts = deletes = 0
    barrier.wait(60)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        r = rng.random()
        if r < 0.08:
            deletes += s.delete(rng.choice(KEYS))
        elif r < 0.16:
            s.mset({k: make_value(rng) for k in rng.sample(KEYS, 2)})
            puts += 2
        else:
            s.put(rng.choice(KEYS), make_value(rng))
            puts += 1
    s.check()
    s.close()
    return puts, deletes


def _reader(name, seed, barrier, duration):
    s = TieredStore.attach(name)
    rng = random.Random(seed)
    held = []          # (view, snapshot of its header) kept across overwrites
    reads = hits = 0
    barrier.wait(60)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        if rng.random() < 0.2:
            vals = s.mget(rng.sample(KEYS, 3))
        else:
            vals = [s.get(rng.choice(KEYS))]
        for v in vals:
            reads += 1
            if v is None:
                continue
            hits += 1
            check_value(v)
            held.append((v, int(v[0]), int(v[1])))
        del vals, v
        while len(held) > 6:
            held.pop(rng.randrange(len(held)))
        # A held view never changes, whatever the writers did since.
        for v, n, w in held:
            assert int(v[0]) == n and int(v[1]) == w
        if rng.random() < 0.05:
            for v, _, _ in held:
                check_value(v)
    for v, _, _ in held:
        check_value(v)
    del held
    gc.collect()
    s.close()
    return reads, hits


def test_concurrent_writers_and_readers(mp_context, make_store, store_name):
    s = make_store(dram="96MiB")
    rng = random.Random(1)
    for k in KEYS:
        s.put(k, make_value(rng))
    duration = 2.5
    barrier = mp_context.Barrier(5)
    children = []
    try:
        for i in range(2):
            children.append(start(mp_context, _writer, store_name, 100 + i, barrier, duration))
        for i in range(2):
            children.append(start(mp_context, _reader, store_name, 200 + i, barrier, duration))
        barrier.wait(60)
        results = [finish(p, q, timeout=90) for p, q in children]
    finally:
        kill_all([p for p, _ in children])
    (p1, d1), (p2, d2), (r1, h1), (r2, h2) = results
    assert p1 > 20 and p2 > 20, results
    assert h1 > 20 and h2 > 20, results

    s.check()
    st = s.stats()
    assert st["pinned_bytes"] == 0, st
    assert st["orphans"] == 0, st
    assert st["processes"] == 1, st
    assert st["puts"] >= p1 + p2 + len(KEYS)
    for k in KEYS:
        v = s.get(k)
        if v is not None:
            check_value(v)
    del v
    s.clear()
    st = s.stats()
    assert st["tiers"]["dram"]["used"] == 0, st
    assert st["tiers"]["dram"]["largest_free"] == st["tiers"]["dram"]["capacity"], st


# --------------------------------------------------------------- ownership


def _attached_waits(name, inherited, attached, go, mode):
    """Attach, report, wait for ``go``, check the store still works, then close.

    ``inherited`` is the parent's store object (fork: the inherited handle;
    spawn: one more attachment); a child that does not use it closes it.
    """
    inherited.close()
    s = TieredStore.attach(name)
    v = s["x"]
    attached.set()
    assert go.wait(30)
    # The owner is gone (closed or destroyed); we keep a working store/mapping.
    assert bytes(v) == b"owner data"
    if mode == "use":
        s["from-child"] = b"y"
        assert bytes(s["from-child"]) == b"y"
        s.check()
    del v
    gc.collect()
    s.close()
    return seg_exists(name)


def test_owner_close_unlinks_while_a_child_is_attached(mp_context, make_store, store_name):
    """The ownership rule (docs/architecture.md, "Ownership and lifetime"): the
    owner's close removes the name at once; an attached child keeps working on
    its mapping, and new attaches fail."""
    s = make_store()
    s["x"] = b"owner data"
    attached, go = mp_context.Event(), mp_context.Event()
    p, q = start(mp_context, _attached_waits, store_name, s, attached, go, "use")
    try:
        assert attached.wait(30)
        s.close()
        assert s.closed
        assert not seg_exists(store_name)
        with pytest.raises(StoreNotFoundError):
            TieredStore.attach(store_name)
        go.set()
        still_there = finish(p, q)     # the child read, wrote and checked its mapping
    finally:
        kill_all([p])
    assert not still_there
    assert not seg_exists(store_name)


def _attach_put_close(name):
    s = TieredStore.attach(name)
    s["child"] = b"c"
    s.close()
    assert s.closed
    return seg_exists(name)


def test_attached_close_only_detaches(mp_context, make_store, store_name):
    s = make_store()
    p, q = start(mp_context, _attach_put_close, store_name)
    assert finish(p, q) is True
    assert seg_exists(store_name)
    assert bytes(s["child"]) == b"c"
    # Same in-process: a second handle from attach() only detaches.
    s2 = TieredStore.attach(store_name)
    s2["x"] = b"1"
    s2.close()
    assert seg_exists(store_name)
    assert bytes(s["x"]) == b"1"
    assert s.stats()["processes"] == 1
    s.close()
    assert not seg_exists(store_name)


def test_destroy_forces_unlink(mp_context, make_store, store_name):
    s = make_store()
    s["x"] = b"owner data"
    attached, go = mp_context.Event(), mp_context.Event()
    p, q = start(mp_context, _attached_waits, store_name, s, attached, go, "use")
    try:
        assert attached.wait(30)
        s.destroy()
        assert s.closed
        assert not seg_exists(store_name)
        with pytest.raises(StoreNotFoundError):
            TieredStore.attach(store_name)
        go.set()
        finish(p, q)     # the child still reads and writes its mapping
    finally:
        kill_all([p])
    assert not seg_exists(store_name)


def _old_attached_closes_late(name, inherited, attached, go):
    inherited.close()
    s = TieredStore.attach(name)
    attached.set()
    assert go.wait(30)
    s.close()


def test_old_attachment_does_not_unlink_recreated_store(mp_context, make_store, store_name):
    """destroy(), then a new store under the same name: a process still attached
    to the destroyed one must not unlink the new one when it closes."""
    s = make_store()
    attached, go = mp_context.Event(), mp_context.Event()
    p, q = start(mp_context, _old_attached_closes_late, store_name, s, attached, go)
    new = None
    try:
        assert attached.wait(30)
        s.destroy()
        new = TieredStore(name=store_name, dram="4MiB")
        new["fresh"] = b"new store"
        go.set()
        finish(p, q)
        assert seg_exists(store_name), "closing a handle of the destroyed store unlinked the new store"
        assert bytes(TieredStore.attach(store_name)["fresh"]) == b"new store"
    finally:
        kill_all([p])
        if new is not None:
            new.close()
        gc.collect()
        dram.destroy(store_name)


def test_view_outlives_close_in_process(make_store, store_name):
    s = make_store()
    s["a"] = np.arange(1000, dtype=np.int64)
    v = s["a"]
    s.close()
    # The owner's close removes the name; the view keeps the mapping.
    assert not seg_exists(store_name)
    np.testing.assert_array_equal(v, np.arange(1000))
    w = v[10:20]      # a derived view keeps the pin too
    del v
    gc.collect()
    assert w.sum() == sum(range(10, 20))
    del w
    gc.collect()


def _view_outlives_close(name, inherited, closed, go):
    inherited.close()
    s = TieredStore.attach(name)
    v = s["a"]
    s.close()
    closed.set()
    assert go.wait(30)
    # Owner and our own handle are closed, the name is gone; the view still reads the data.
    assert not seg_exists(name)
    np.testing.assert_array_equal(v, np.arange(1000))
    del v
    gc.collect()
    return seg_exists(name)


def test_view_outlives_close_in_child(mp_context, make_store, store_name):
    s = make_store()
    s["a"] = np.arange(1000, dtype=np.int64)
    closed, go = mp_context.Event(), mp_context.Event()
    p, q = start(mp_context, _view_outlives_close, store_name, s, closed, go)
    try:
        assert closed.wait(30)
        s.close()
        assert not seg_exists(store_name)
        go.set()
        still_there = finish(p, q)
    finally:
        kill_all([p])
    assert not still_there


def _attach_close_exit(name, attached, go):
    s = TieredStore.attach(name)
    attached.set()
    assert go.wait(30)
    s.close()


def test_forked_child_does_not_leak_segment_after_owner_close(make_store, store_name):
    """A forked child only attaches by name and closes what it attached: once it
    exits after the owner closed, no process is attached and the segment must be
    gone (the child never used the store object it inherited by forking)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    s = make_store()
    attached, go = ctx.Event(), ctx.Event()
    p, q = start(ctx, _attach_close_exit, store_name, attached, go)
    try:
        assert attached.wait(30)
        s.close()
        go.set()
        finish(p, q)
        gc.collect()
        leaked = seg_exists(store_name)
    finally:
        kill_all([p])
        dram.destroy(store_name)
    assert not leaked, ("segment leaked: the forked child's after-fork slot (inherited, never "
                        "used, never closed) kept it alive past the last close")


# ----------------------------------------------------------- fork specifics


def _forked_reads_inherited(box, expected_sum, started, parent_done, s):
    view = box.pop()          # (the arguments would keep it alive otherwise)
    started.set()
    assert parent_done.wait(30)
    # The parent deleted the key, dropped its view and wrote other data over
    # every free byte: only our own pin keeps the block.
    assert not view.flags.writeable
    assert int(view[0]) == 12345, f"inherited view overwritten: first word {int(view[0])}"
    assert np.all(view[1:] == np.arange(1, len(view), dtype=np.int64)), "inherited view overwritten"
    assert int(view.sum()) == expected_sum
    del view
    gc.collect()
    st = s.stats()    # the pin the child took over went with the view (not the parent's pin)
    assert st["pinned_bytes"] == 0 and st["orphans"] == 0, st
    return True


def _fork_view_scenario(make_store, wait_for_child: bool, built_in_c: bool = False):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    s = make_store(dram="8MiB")
    arr = np.arange(256 * 1024, dtype=np.int64)    # 2 MiB
    arr[0] = 12345
    s.put("shared", arr)
    expected_sum = int(arr.sum())
    if built_in_c:     # the first view teaches the C hot path the header; the second is built there
        assert s["shared"][0] == 12345
    box = [s["shared"]]     # the only reference to the view, in the parent and (copied) in the child
    assert (type(box[0].base).__name__ == "Pin") == built_in_c
    started, parent_done = ctx.Event(), ctx.Event()
    p, q = start(ctx, _forked_reads_inherited, box, expected_sum, started, parent_done, s)
    try:
        if wait_for_child:
            assert started.wait(30)
        # Delete and drop in the parent: only the child's re-pin keeps the block.
        assert s.delete("shared")
        box.clear()
        gc.collect()
        if wait_for_child:
            st = s.stats()
            assert st["orphans"] == 1 and st["pinned_bytes"] >= arr.nbytes, st
        # Fill every free byte with other data: a freed block would be overwritten.
        fill = 0
        while True:
            try:
                s.put(f"junk{fill}", np.full(64 * 1024, -1, dtype=np.int64))
                fill += 1
            except MemoryError:
                break
        assert fill > 0
        parent_done.set()
        assert finish(p, q) is True
    finally:
        kill_all([p])
    st = s.stats()   # sweeps the exited child
    assert st["pinned_bytes"] == 0 and st["orphans"] == 0, st
    s.check()
    for k in list(s.keys(prefix="junk")):
        del s[k]
    s.put("big-again", np.zeros(512 * 1024, dtype=np.int64))   # 4 MiB: the space is back


def test_fork_child_keeps_inherited_view(make_store):
    """The child is running when the parent deletes the key and drops its view."""
    _fork_view_scenario(make_store, wait_for_child=True)


def test_fork_child_keeps_inherited_view_right_after_fork(make_store):
    """The parent deletes and drops its view as soon as ``Process.start()``
    returns, possibly before the child ran its at-fork hook: the inherited view
    must be protected from the fork itself, not from whenever the child runs."""
    _fork_view_scenario(make_store, wait_for_child=False)


@pytest.mark.parametrize("wait_for_child", [True, False])
def test_fork_child_keeps_inherited_view_built_in_c(make_store, wait_for_child):
    """The same, with a view the C hot path built (its pin released by C in the
    process that took it, by the Arena in a child that inherited it)."""
    _fork_view_scenario(make_store, wait_for_child=wait_for_child, built_in_c=True)


def _forked_uses_inherited_store(s, key):
    v = s[key]
    assert bytes(v) == b"from parent"
    s[key + "/child"] = b"from child"
    del v
    gc.collect()
    s.check()
    return s.stats()["processes"]


def test_fork_child_uses_inherited_store(make_store):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    s = make_store()
    s["k"] = b"from parent"
    p, q = start(ctx, _forked_uses_inherited_store, s, "k")
    assert finish(p, q) == 2
    assert bytes(s["k/child"]) == b"from child"
    st = s.stats()
    assert st["processes"] == 1 and st["pinned_bytes"] == 0, st
