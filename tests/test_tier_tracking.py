"""Objects are never lost track of across tiers: expiry reaches the tier that
holds the bytes, new writes land in the fast tier, moves never resurrect an
old value, a dead owner's HBM stubs go, a lost disk copy is an error at once,
and inherited views stay pinned however many there are."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import numpy as np
import pytest

from yrcache import CorruptObjectError, StoreFullError, Tier, TieredStore
from yrcache.tiers import dram
from procs import finish, kill_all, kill_and_join, seg_exists, start, wait_or_die

KiB, MiB = 1024, 1024 * 1024


def tensor(n_bytes: int, fill: float = 1.0):
    import torch

    return torch.full((n_bytes // 4,), fill, dtype=torch.float32)


# --------------------------------------------------------------------- TTL


def test_expired_hbm_tensor_gives_its_device_memory_back(make_store):
    pytest.importorskip("torch")
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    s.put("t", tensor(600 * KiB), tier=Tier.HBM, ttl=0.1)
    assert s.tier_of("t") == Tier.HBM
    time.sleep(0.15)
    assert "t" not in s
    s.put("u", tensor(600 * KiB, 2.0), tier=Tier.HBM)
    assert s.tier_of("u") == Tier.HBM, "the expired tensor still held the device tier"
    assert s._hbm.device.used == 600 * KiB
    assert s.stats()["tiers"]["hbm"]["used"] == 600 * KiB
    s.check()


def test_expired_ssd_object_gives_its_room_back(make_store, tmp_path):
    s = make_store(dram="1MiB", ssd=tmp_path / "ssd", ssd_size="1MiB")
    s.put("x", np.ones(700 * KiB, np.uint8), tier=Tier.SSD, ttl=0.1)
    time.sleep(0.15)
    s.put("y", np.full(700 * KiB, 2, np.uint8), tier=Tier.SSD)     # room only if x's is back
    assert s.tier_of("y") == Tier.SSD
    assert s.stats()["tiers"]["ssd"]["used"] == 700 * KiB
    s.check()


def test_expiry_found_by_a_lookup_frees_the_disk_copy(make_store, tmp_path):
    s = make_store(dram="1MiB", ssd=tmp_path / "ssd")
    s.put("x", np.ones(300 * KiB, np.uint8), tier=Tier.SSD, ttl=0.1)
    s.put("keep", np.ones(300 * KiB, np.uint8), tier=Tier.SSD)
    time.sleep(0.15)
    assert s.get("x") is None           # the C core retires the expired stub here
    s.flush()
    assert s._disk.used == 300 * KiB
    files = [f for _, _, fs in os.walk(tmp_path / "ssd" / "data") for f in fs]
    assert len(files) == 1, files
    s.check()


@pytest.mark.parametrize("how", ["mset", "mput_raw"])
def test_a_batch_over_disk_objects_frees_their_copies_at_once(make_store, tmp_path, how):
    s = make_store(dram="4MiB", ssd=tmp_path / "ssd")
    for i in range(3):
        s.put(f"k{i}", np.ones(100 * KiB, np.uint8), tier=Tier.SSD)
    assert s._disk.used == 300 * KiB
    if how == "mset":
        s.mset({f"k{i}": b"small" for i in range(3)})
    else:
        s.mput_raw([(f"k{i}", b"B", b"small", 5) for i in range(3)])
    assert [bytes(s.get(f"k{i}")) for i in range(3)] == [b"small"] * 3
    assert all(s.tier_of(f"k{i}") == Tier.DRAM for i in range(3))
    assert s._disk.used == 0, "the disk copies the batch replaced are still held"
    s.check()


# --------------------------------------------------------------- placement


def test_new_write_lands_in_dram_and_pushes_the_coldest_down(make_store, tmp_path):
    s = make_store(dram="80MiB", ssd=tmp_path / "ssd")
    a = np.full(64 * MiB, 1, np.uint8)
    b = np.full(64 * MiB, 2, np.uint8)
    s["a"] = a
    s["b"] = b
    assert s.tier_of("b") == Tier.DRAM, "a new write must land in DRAM"
    assert s.tier_of("a") == Tier.SSD, "the colder object must move down"
    assert (s["b"] == 2).all() and (s.get("a", copy=True) == 1).all()
    # Only an object larger than the whole DRAM tier goes straight to SSD.
    s["c"] = np.full(100 * MiB, 3, np.uint8)
    assert s.tier_of("c") == Tier.SSD
    assert s.tier_of("b") == Tier.DRAM
    s.check()


def test_store_full_message_with_an_ssd_tier(make_store, tmp_path):
    """The error names the SSD tier and what to raise, never "no SSD tier configured"."""
    s = make_store(dram="1MiB", ssd=tmp_path / "ssd", ssd_size="512KiB")
    with pytest.raises(StoreFullError) as e:
        s["big"] = np.ones(2 * MiB, np.uint8)      # refused by the SSD tier itself
    for msg in (str(e.value), str(s._placement.full_error(2 * MiB))):   # and by the store (no room for a stub)
        assert "no SSD tier configured" not in msg
        assert "SSD" in msg and "ssd_size=" in msg and str(tmp_path / "ssd") in msg


# ---------------------------------------------------------- moves and races


def test_promotion_never_commits_over_a_newer_value(make_store, store_name, tmp_path):
    """A promotion copies the SSD object into DRAM; an overwrite lands from
    another handle while it copies.  The promotion must lose (its commit is
    conditional on the object it copied), never bring the old value back."""
    s = make_store(dram="4MiB", ssd=tmp_path / "ssd", promote_after=1)
    s.put("k", np.full(100 * KiB, 1, np.uint8), tier=Tier.SSD)
    other = TieredStore.attach(store_name)
    disk = s._disk
    real = disk.read_into
    raced = []

    def read_then_overwrite(key, out):
        meta = real(key, out)
        if not raced:
            raced.append(key)
            other.put("k", np.full(100 * KiB, 2, np.uint8))
        return meta

    disk.read_into = read_then_overwrite
    try:
        got = s["k"]
    finally:
        disk.read_into = real
    assert raced, "the promotion did not read from SSD"
    assert (got == 2).all(), "a read after the overwrite returned the old value"
    assert (s["k"] == 2).all() and (other["k"] == 2).all(), "the promotion resurrected the old value"
    assert s.tier_of("k") == Tier.DRAM
    other.close()
    s.check()


def test_missing_disk_copy_is_corrupt_at_once(make_store, tmp_path):
    s = make_store(dram="1MiB", ssd=tmp_path / "ssd")
    s.put("x", np.ones(100 * KiB, np.uint8), tier=Tier.SSD)
    s._disk.clear()                       # the index record vanishes behind the store's back
    t0 = time.monotonic()
    with pytest.raises(CorruptObjectError, match="disk copy"):
        s.get("x")
    assert time.monotonic() - t0 < 1.0, "a missing record must not be retried for seconds"


@pytest.mark.parametrize("damage", ["missing", "truncated", "fifo"])
def test_check_reports_a_damaged_disk_copy(make_store, tmp_path, damage):
    """check() verifies that every SSD stub has a payload file reads can use
    (present, a regular file of ours, of its size), without reading it."""
    s = make_store(dram="1MiB", ssd=tmp_path / "ssd")
    s.put("x", np.ones(300 * KiB, np.uint8), tier=Tier.SSD)
    (f,) = [os.path.join(d, n) for d, _, ns in os.walk(tmp_path / "ssd" / "data") for n in ns]
    s.put("y", np.ones(300 * KiB, np.uint8), tier=Tier.SSD)
    s.check()
    if damage == "missing":
        os.unlink(f)
    elif damage == "truncated":
        os.truncate(f, 1000)
    else:
        os.unlink(f)
        os.mkfifo(f, 0o600)
    with pytest.raises(CorruptObjectError, match="'x'.*(missing|truncated|FIFO)"):
        s.check()
    with pytest.raises(CorruptObjectError, match="'x'"):
        s.get("x")
    s.delete("x")
    s.check()


def _own_hbm_and_wait(name, ready):
    s = TieredStore(name=name, dram="4MiB", hbm="1MiB", device="cpu")
    import torch

    s.put("gpu", torch.ones(1000), tier=Tier.HBM)
    s.put("host", np.arange(10))
    ready.set()
    time.sleep(120)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_hbm_stubs_of_a_dead_owner_are_swept(store_name, method):
    pytest.importorskip("torch")
    ctx = multiprocessing.get_context(method)
    ready = ctx.Event()
    p = ctx.Process(target=_own_hbm_and_wait, args=(store_name, ready), daemon=True)
    p.start()
    try:
        try:
            wait_or_die(ready, p, 60)
        finally:
            kill_and_join(p)
        s = TieredStore.attach(store_name)     # attaching sweeps the dead owner's slot
        assert "gpu" not in s and s.get("gpu") is None
        assert list(s.keys()) == ["host"]
        assert s.stats()["tiers"]["hbm"]["objects"] == 0
        np.testing.assert_array_equal(s["host"], np.arange(10))
        s.check()
        s.close()
    finally:
        dram.destroy(store_name)


# -------------------------------------------------------------------- pins


def _check_inherited(views, expected, parent_done):
    assert parent_done.wait(60)
    changed = sum(1 for v, e in zip(views, expected) if bytes(v) != e)
    return changed


def test_every_inherited_view_stays_pinned_when_the_pool_runs_low(make_store):
    """600 views of 600 objects held at fork in a 4 MiB store (1024 pin records
    laid out): the child needs 600 more.  None may change under the child when
    the parent drops its views, deletes every key and fills the store with
    other data.  (Values of 4.5 KiB: reads of smaller ones are private copies,
    which pin nothing.)"""
    ctx = multiprocessing.get_context("fork")
    s = make_store(dram="4MiB")
    keys = [f"k{i}" for i in range(600)]
    for i, k in enumerate(keys):
        s[k] = i.to_bytes(4, "little") * 1152
    views = [s[k] for k in keys]
    assert s.stats()["pinned_bytes"] >= 600 * 4608
    expected = [bytes(v) for v in views]
    parent_done = ctx.Event()
    p, q = start(ctx, _check_inherited, views, expected, parent_done)
    try:
        del views
        gc.collect()
        for k in keys:
            del s[k]
        n = 0
        while True:                      # a block freed too early would be reused here
            try:
                s[f"junk{n}"] = b"\xff" * 4608
            except MemoryError:
                break
            n += 1
        parent_done.set()
        assert finish(p, q) == 0, "inherited views changed under the child"
    finally:
        kill_all([p])
    s.check()


def test_one_process_holding_many_views_does_not_starve_others(make_store, store_name):
    s = make_store(dram="4MiB")
    s["k"] = np.arange(1024)                     # 8 KiB: read through a pin
    hoard = [s["k"] for _ in range(5000)]        # far past the 1024 records laid out
    assert s.stats()["pinned_bytes"] >= 8192
    other = TieredStore.attach(store_name)
    try:
        assert other.tier_of("k") == Tier.DRAM
        out = np.empty(1024, dtype=np.int64)
        other.get_into("k", out)
        np.testing.assert_array_equal(out, np.arange(1024))
        np.testing.assert_array_equal(other["k"], np.arange(1024))
    finally:
        other.close()
    del hoard
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
    s.check()


# ---------------------------------------------------------- small misuses


@pytest.mark.parametrize("bad, exc", [(1.5, TypeError), ("1", TypeError), (True, TypeError),
                                      (None, TypeError), (2**63, ValueError), (-2**63 - 1, ValueError),
                                      (10**30, ValueError)])
def test_priority_must_be_an_int64(make_store, bad, exc):
    s = make_store()
    for call in (lambda: s.put("k", b"v", priority=bad), lambda: s.mset({"k": b"v"}, priority=bad),
                 lambda: s.put_with("k", b"B", 1, lambda v: None, priority=bad)):
        with pytest.raises(exc, match="priority"):
            call()
    assert "k" not in s


def test_priority_accepts_int64_range_and_numpy_ints(make_store):
    s = make_store()
    s.put("lo", b"v", priority=-2**63)
    s.put("hi", b"v", priority=2**63 - 1)
    s.put("np", b"v", priority=np.int32(5))
    assert len(s) == 3


def test_adopting_with_another_dram_size_warns(store_name):
    s = TieredStore(name=store_name, dram="4MiB", persist=True)
    s.close()
    try:
        with pytest.warns(UserWarning, match="adopted with its own size, 4.0 MiB"):
            adopter = TieredStore(name=store_name, dram="8MiB", persist=False)
        assert adopter.stats()["tiers"]["dram"]["capacity"] < 4 * MiB
        adopter.close()
    finally:
        dram.destroy(store_name)
    assert not seg_exists(store_name)


# ---------------------------------------------------- one store per directory


def test_two_stores_cannot_share_one_ssd_directory(make_store, tmp_path, store_name):
    from yrcache import StoreInUseError

    ssd = tmp_path / "ssd"
    s = make_store(ssd=ssd)
    s.put("mine", np.ones(10, np.uint8), tier=Tier.SSD)
    with pytest.raises(StoreInUseError, match="one ssd= directory per store"):
        TieredStore(name=store_name + "-b", dram="4MiB", ssd=ssd)
    assert not seg_exists(store_name + "-b")
    other = TieredStore.attach(store_name)        # the same store's processes share it
    assert (other["mine"] == 1).all()
    other.close()
    assert (s["mine"] == 1).all()
    s.check()


def _ssd_owner(name, ssd, ready):
    s = TieredStore(name=name, dram="4MiB", ssd=ssd)
    s.put("x", np.ones(10, np.uint8), tier=Tier.SSD)
    ready.set()
    time.sleep(120)


def test_ssd_directory_of_a_killed_store_can_be_taken_over(store_name, tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_ssd_owner, args=(store_name, str(tmp_path / "ssd"), ready), daemon=True)
    p.start()
    try:
        try:
            wait_or_die(ready, p, 60)
        finally:
            kill_and_join(p)
        dram.destroy(store_name)          # the DRAM tier is gone; the SSD directory remains
        s = TieredStore(name=store_name + "-new", dram="4MiB", ssd=tmp_path / "ssd")
        assert (s.get("x", copy=True) == 1).all()      # found on the old directory
        s.close()
    finally:
        dram.destroy(store_name)
        dram.destroy(store_name + "-new")


def test_get_into_checks_dtypes_across_numpy_and_torch(make_store, tmp_path):
    torch = pytest.importorskip("torch")
    s = make_store(ssd=tmp_path / "ssd")
    s["np"] = np.arange(8, dtype=np.float32)
    s["t"] = torch.arange(8, dtype=torch.float32)
    s.put("ssd", np.arange(8, dtype=np.float32), tier=Tier.SSD)
    for key in ("np", "t", "ssd"):
        with pytest.raises(ValueError, match="dtype"):
            s.get_into(key, torch.empty(8, dtype=torch.int32))     # same bytes, another dtype
        with pytest.raises(ValueError, match="dtype"):
            s.get_into(key, np.empty(8, dtype=np.int32))
        out_t = s.get_into(key, torch.empty(8, dtype=torch.float32))
        out_n = s.get_into(key, np.empty(8, dtype=np.float32))
        assert out_t.tolist() == list(range(8)) and out_n.tolist() == list(range(8))
        raw = s.get_into(key, bytearray(32))                        # a plain buffer: bytes only
        assert bytes(raw) == np.arange(8, dtype=np.float32).tobytes()


def _die_after_disk_write(name):
    import signal

    s = TieredStore.attach(name)
    real = s._disk.put

    def put_then_die(*args, **kw):
        real(*args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)    # the copy is on disk, its stub not committed

    s._disk.put = put_then_die
    s.put("x", np.ones(200 * KiB, np.uint8), tier=Tier.SSD)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_writer_killed_between_disk_write_and_commit_leaves_no_stray_copy(make_store, store_name,
                                                                          tmp_path, method):
    s = make_store(dram="4MiB", ssd=tmp_path / "ssd")
    ctx = multiprocessing.get_context(method)
    p = ctx.Process(target=_die_after_disk_write, args=(store_name,), daemon=True)
    p.start()
    p.join(60)
    assert p.exitcode == -9
    assert "x" not in s
    s.stats()                                  # sweeps the dead writer: its stub is retired...
    assert s._disk.used == 0                   # ...and its disk copy removed, no vacuum needed
    files = [f for _, _, fs in os.walk(tmp_path / "ssd" / "data") for f in fs]
    assert files == []
    s.check()
