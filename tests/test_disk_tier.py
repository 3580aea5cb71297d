"""Tests of the SSD tier (yrcache/tiers/disk.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yrcache.errors import CorruptObjectError, StoreClosedError, StoreFullError
from yrcache.tiers import disk
from yrcache.tiers.disk import DiskEntry, DiskTier, ObjectInfo

KIB = 1024
MIB = 1024 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def data_files(root) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(os.path.join(root, "data")):
        out.extend(os.path.join(dirpath, f) for f in files)
    return sorted(out)


def tmp_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "tmp")))


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    yield t
    t.close()


# ------------------------------------------------------------------ basics

def test_class_attributes_and_layout(tmp_path):
    root = tmp_path / "a" / "b" / "ssd"          # parents created too
    t = DiskTier(root, capacity="1MiB")
    assert DiskTier.name == "ssd" and DiskTier.zero_copy is False
    assert t.capacity == MIB
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for sub in ("index", "data", "tmp"):
        assert stat.S_IMODE(os.stat(root / sub).st_mode) == 0o700
    t.put("big", b"m", payload(100 * KIB))
    (f,) = data_files(root)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert "big" not in os.path.basename(f)      # named by id, not by key
    assert len(t) == t.objects == 1 and t.used == 100 * KIB


def test_unbounded_capacity_is_free_space_plus_used(tmp_path):
    import shutil
    t = DiskTier(tmp_path / "ssd")
    free = shutil.disk_usage(tmp_path).free
    assert abs(t.capacity - free) < 64 * MIB


@pytest.mark.parametrize("n", [0, 1, 1000, 64 * KIB - 1])
def test_round_trip_inline(tier, n):
    data = payload(n, seed=n)
    tier.put("k", b"meta-" + str(n).encode(), data, priority=3)
    assert data_files(tier.path) == []           # inline: no payload file
    meta, got = tier.get("k")
    assert meta == b"meta-" + str(n).encode()
    assert isinstance(got, bytearray) and bytes(got) == data
    out = bytearray(n)
    assert tier.read_into("k", out) == meta and bytes(out) == data
    assert tier.info("k") == ObjectInfo(meta, n, 3, None)
    assert "k" in tier and tier.used == n


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("n", [64 * KIB, 300 * KIB, 5 * MIB + 3])
def test_round_trip_file(tier, monkeypatch, n, pipeline):
    monkeypatch.setattr(disk, "_PIPELINE_READS", pipeline)
    data = payload(n, seed=n)
    tier.put("big/one", b"\x00hdr\xff", data)
    assert len(data_files(tier.path)) == 1
    out = np.empty(n, dtype=np.uint8)
    assert tier.read_into("big/one", out) == b"\x00hdr\xff"
    assert out.tobytes() == data
    meta, got = tier.get("big/one")
    assert bytes(got) == data and meta == b"\x00hdr\xff"
    assert tier.info("big/one").nbytes == n


def test_payload_kinds(tier):
    arr = np.arange(50_000, dtype=np.float32).reshape(100, 500)   # 200 KB, 2-D, not uint8
    tier.put("arr", b"f32", arr)
    out = np.empty_like(arr)
    tier.read_into("arr", out)                    # typed, 2-D destination
    np.testing.assert_array_equal(out, arr)
    tier.put("mv", b"", memoryview(b"abc"))
    tier.put("ba", b"", bytearray(b"xyz"))
    assert tier.get("mv")[1] == b"abc" and tier.get("ba")[1] == b"xyz"
    with pytest.raises(ValueError, match="contiguous"):
        tier.put("strided", b"", arr[:, ::2])
    with pytest.raises(TypeError):
        tier.put("nobuf", b"", 12345)


def test_empty_payload_as_file(tmp_path):
    t = DiskTier(tmp_path / "ssd", inline_threshold=0)
    t.put("empty", b"m", b"")
    assert len(data_files(t.path)) == 1
    assert t.get("empty") == (b"m", bytearray())
    assert t.read_into("empty", bytearray()) == b"m"


def test_inline_threshold_boundary(tmp_path):
    t = DiskTier(tmp_path / "ssd", inline_threshold=1000)
    t.put("below", b"", payload(999))
    assert data_files(t.path) == []
    t.put("at", b"", payload(1000))
    assert len(data_files(t.path)) == 1


def test_overwrite_replaces_and_removes_old_file(tier):
    tier.put("k", b"v1", payload(200 * KIB, 1))
    (f1,) = data_files(tier.path)
    tier.put("k", b"v2", payload(300 * KIB, 2))
    (f2,) = data_files(tier.path)
    assert f1 != f2 and not os.path.exists(f1)
    assert tier.get("k") == (b"v2", bytearray(payload(300 * KIB, 2)))
    assert tier.used == 300 * KIB and len(tier) == 1
    tier.put("k", b"v3", b"small")                # file -> inline
    assert data_files(tier.path) == []
    assert tier.get("k") == (b"v3", bytearray(b"small")) and tier.used == 5
    tier.put("k", b"v4", payload(100 * KIB, 4))   # inline -> file
    assert tier.get("k")[0] == b"v4" and tier.used == 100 * KIB and len(tier) == 1


def test_delete(tier):
    tier.put("a", b"", payload(100 * KIB))
    tier.put("b", b"", b"tiny")
    assert tier.delete("a") is True
    assert data_files(tier.path) == []
    assert tier.delete("a") is False
    assert "a" not in tier and tier.info("a") is None
    with pytest.raises(KeyError):
        tier.get("a")
    with pytest.raises(KeyError):
        tier.read_into("a", bytearray(100 * KIB))
    assert tier.used == 4 and len(tier) == 1
    assert tier.delete("b") and tier.used == 0 and len(tier) == 0


def test_keys_prefix_and_pagination(tier):
    names = [f"layer{i:04d}" for i in range(1200)] + ["lay", "laz", "", "ünï/cødé", "layer\U0001f600"]
    for n in names:
        tier.put(n, b"", b"x")
    assert list(tier.keys()) == sorted(names)
    assert list(tier.keys("layer")) == sorted(n for n in names if n.startswith("layer"))
    assert list(tier.keys("layer00")) == [f"layer{i:04d}" for i in range(100)]
    assert list(tier.keys("ünï")) == ["ünï/cødé"]
    assert list(tier.keys("nope")) == []
    assert set(tier) == set(names)
    assert len(tier) == len(names)


def test_key_validation(tier):
    tier.put("é" * 512, b"", b"ok")              # a 1024-byte user key
    tier.put("0123456789abcdef/" + "é" * 512, b"", b"ok")   # plus a mover prefix
    tier.put("é" * 2048, b"", b"ok")             # the hard limit: 4096 bytes
    assert tier.get("é" * 2048)[1] == b"ok"
    with pytest.raises(ValueError, match="4096"):
        tier.put("é" * 2048 + "x", b"", b"no")
    with pytest.raises(TypeError):
        tier.put(b"bytes-key", b"", b"no")
    with pytest.raises(ValueError):
        tier.put("\ud800", b"", b"no")
    assert 0 not in tier                          # bookkeeping keys stay hidden
    with pytest.raises(TypeError):
        tier.get(0)


def test_read_into_checks_out(tier):
    tier.put("k", b"", payload(100 * KIB))
    with pytest.raises(ValueError, match="102400"):
        tier.read_into("k", bytearray(10))
    with pytest.raises(TypeError, match="writable"):
        tier.read_into("k", bytes(100 * KIB))


# ----------------------------------------------------------------- capacity

def test_capacity_store_full(tmp_path):
    t = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    t.put("a", b"", payload(200 * KIB))
    with pytest.raises(StoreFullError) as ei:
        t.put("b", b"", payload(200 * KIB))
    assert isinstance(ei.value, MemoryError)
    msg = str(ei.value)
    assert "ssd_size=" in msg and "'b'" in msg and "200.0 KiB used" in msg
    assert "b" not in t and t.used == 200 * KIB
    assert len(data_files(t.path)) == 1 and tmp_files(t.path) == []   # nothing leaked
    with pytest.raises(StoreFullError):
        t.put("c", b"", payload(101 * KIB))
    t.put("c", b"", payload(100 * KIB))           # exactly full is fine
    t.put("a", b"", payload(150 * KIB))           # overwrite counts the old size back
    assert t.used == 250 * KIB
    t.delete("c")
    t.put("d", b"", b"x" * 1000)
    assert t.used == 150 * KIB + 1000


def test_capacity_is_rechecked_under_the_lock(tmp_path, monkeypatch):
    # Another handle fills the tier after b's early check but before b commits.
    a = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    b = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    real = DiskTier._write_file

    def racing(self, key, mv, final):
        if self is b:
            a.put("x", b"", payload(200 * KIB))
        return real(self, key, mv, final)

    monkeypatch.setattr(DiskTier, "_write_file", racing)
    with pytest.raises(StoreFullError):
        b.put("y", b"", payload(200 * KIB))
    assert "y" not in a and a.used == 200 * KIB
    assert len(data_files(a.path)) == 1                # b's file was removed again


# -------------------------------------------------------------- persistence

def test_persists_across_instances(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    big, small = payload(256 * KIB, 7), payload(10, 8)
    t.put("big", b"mb", big, priority=5, expire_at=time.time() + 3600)
    t.put("small", b"ms", small)
    t.close()
    with pytest.raises(StoreClosedError):
        t.get("big")
    with DiskTier(tmp_path / "ssd") as t2:
        assert t2.get("big") == (b"mb", bytearray(big))
        assert t2.get("small") == (b"ms", bytearray(small))
        assert t2.info("big").priority == 5
        assert t2.used == len(big) + len(small) and len(t2) == 2


def test_durable_mode(tmp_path):
    t = DiskTier(tmp_path / "ssd", durable=True)
    t.put("k", b"m", payload(300 * KIB))
    t.put("s", b"m", b"abc")
    t.close()
    t = DiskTier(tmp_path / "ssd")
    assert t.get("k")[1] == payload(300 * KIB) and t.get("s")[1] == b"abc"


# -------------------------------------------------------------- corruption

def test_flipped_byte_is_detected_for_that_object_only(tier):
    good, bad = payload(100 * KIB, 1), payload(200 * KIB, 2)
    tier.put("good", b"g", good)
    tier.put("bad", b"b", bad)
    (bad_file,) = [f for f in data_files(tier.path) if os.path.getsize(f) == 200 * KIB]
    with open(bad_file, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptObjectError) as ei:
        tier.read_into("bad", bytearray(200 * KIB))
    msg = str(ei.value)
    assert "'bad'" in msg and bad_file in msg and "delete the key and write it again" in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(CorruptObjectError):
        tier.get("bad")
    assert tier.get("good") == (b"g", bytearray(good))
    assert tier.info("bad").nbytes == 200 * KIB         # metadata still readable
    assert tier.delete("bad")                           # the advised fix works
    tier.put("bad", b"b", bad)
    assert tier.get("bad")[1] == bad


@pytest.mark.parametrize("pipeline", [False, True])
def test_flipped_byte_large_payload(tier, monkeypatch, pipeline):
    monkeypatch.setattr(disk, "_PIPELINE_READS", pipeline)
    tier.put("k", b"", payload(3 * MIB))
    (f,) = data_files(tier.path)
    with open(f, "r+b") as fh:
        fh.seek(3 * MIB - 1)
        last = fh.read(1)
        fh.seek(3 * MIB - 1)
        fh.write(bytes([last[0] ^ 0x80]))
    with pytest.raises(CorruptObjectError, match="checksum"):
        tier.get("k")


def test_truncated_and_missing_file(tier):
    tier.put("trunc", b"", payload(100 * KIB, 1))
    (f,) = data_files(tier.path)
    os.truncate(f, 50 * KIB)
    with pytest.raises(CorruptObjectError, match="truncated"):
        tier.read_into("trunc", bytearray(100 * KIB))
    tier.put("gone", b"", payload(100 * KIB, 2))
    (g,) = [x for x in data_files(tier.path) if x != f]
    os.unlink(g)
    with pytest.raises(CorruptObjectError, match="missing"):
        tier.get("gone")


# ------------------------------------------------------------------ expiry

def test_expire_at_in_the_past_is_invisible(tier):
    tier.put("k", b"old", payload(100 * KIB))
    tier.put("k", b"new", payload(100 * KIB), expire_at=time.time() - 1)
    assert "k" not in tier and tier.info("k") is None
    assert data_files(tier.path) == [] and tier.used == 0


def test_expiry_is_lazy_and_reclaims(tier):
    tier.put("soon", b"", payload(100 * KIB), expire_at=time.time() + 0.3)
    tier.put("later", b"", b"x", expire_at=time.time() + 3600)
    tier.put("never", b"", b"y")
    assert "soon" in tier and tier.used == 100 * KIB + 2
    time.sleep(0.4)
    assert list(tier.keys()) == ["later", "never"]     # scan reclaims "soon"
    assert tier.used == 2 and data_files(tier.path) == []
    tier.put("s2", b"", b"z", expire_at=time.time() + 0.2)
    time.sleep(0.3)
    assert "s2" not in tier and len(tier) == 2
    with pytest.raises(KeyError):
        tier.get("s2")
    tier.put("s3", b"", b"z", expire_at=time.time() + 0.2)
    time.sleep(0.3)
    assert tier.purge_expired() == 1 and len(tier) == 2


# ----------------------------------------------------- policy / maintenance

def test_entries(tier):
    t0 = time.time()
    tier.put("a", b"", payload(100 * KIB), priority=2)
    tier.put("b", b"", b"xy", priority=-1, expire_at=t0 + 1000)
    ents = list(tier.entries())
    assert [e.key for e in ents] == ["a", "b"]
    assert all(isinstance(e, DiskEntry) for e in ents)
    a, b = ents
    assert (a.nbytes, a.priority, a.expire_at) == (100 * KIB, 2, None)
    assert (b.nbytes, b.priority, b.expire_at) == (2, -1, t0 + 1000)
    assert t0 - 1 <= a.created <= b.created <= time.time() + 1
    # an eviction policy may delete while iterating
    for e in tier.entries():
        tier.delete(e.key)
    assert len(tier) == 0 and tier.used == 0


def test_clear(tier):
    for i in range(30):
        tier.put(f"k{i}", b"", payload(70 * KIB if i % 2 else 10, i))
    assert tier.clear() == 30
    assert len(tier) == 0 and tier.used == 0 and data_files(tier.path) == []
    tier.put("again", b"", b"1")
    assert list(tier.keys()) == ["again"]


def test_vacuum_removes_orphans_only(tier, monkeypatch):
    tier.put("live", b"", payload(100 * KIB))
    orphan_dir = os.path.join(tier.path, "data", "ab")
    os.makedirs(orphan_dir, exist_ok=True)
    orphan = os.path.join(orphan_dir, "ab" + "0" * 30)
    with open(orphan, "wb") as f:
        f.write(b"left over by a crash between rename and commit")
    assert tier.vacuum() == 0                           # too young to judge
    monkeypatch.setattr(disk, "_ORPHAN_AGE", -1.0)
    assert tier.vacuum() == 1
    assert not os.path.exists(orphan)
    assert tier.get("live")[1] == payload(100 * KIB)


def test_temp_file_cleanup_rules(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    tmpdir = os.path.join(t.path, "tmp")
    t.close()
    mine = disk._tmp_prefix() + "a" * 32 + ".tmp"       # a live writer (us)
    ns = disk._tmp_prefix().split("-")[0]
    dead = f"{ns}-999999999-12345-{'b' * 32}.tmp"       # no such pid
    reused = f"{ns}-{os.getpid()}-1-{'c' * 32}.tmp"     # our pid, other start time
    odd_new, odd_old = "whatever.tmp", "ancient.tmp"
    for name in (mine, dead, reused, odd_new, odd_old):
        with open(os.path.join(tmpdir, name), "wb") as f:
            f.write(b"partial")
    past = time.time() - 3600
    os.utime(os.path.join(tmpdir, odd_old), (past, past))
    DiskTier(tmp_path / "ssd").close()
    assert sorted(os.listdir(tmpdir)) == sorted([mine, odd_new])


# ----------------------------------------------------------- concurrency

def _slow_put_child(path: str, key: str, nbytes: int) -> None:
    """Start a put whose write stalls after 1 MiB (the parent SIGKILLs us)."""
    from yrcache.tiers import disk as d

    def stalling_write(fd, data):
        n = os.write(fd, data[:MIB])
        time.sleep(120)
        return n

    d._os_write = stalling_write
    t = d.DiskTier(path)
    t.put(key, b"new", np.full(nbytes, 7, dtype=np.uint8))


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkill_mid_put_leaves_no_trace(tmp_path, method, overwrite):
    root = str(tmp_path / "ssd")
    t = DiskTier(root)
    old = payload(100 * KIB, 3)
    if overwrite:
        t.put("k", b"old", old)
    used_before = t.used
    t.close()
    ctx = mp.get_context(method)
    p = ctx.Process(target=_slow_put_child, args=(root, "k", 8 * MIB))
    p.start()
    try:
        deadline = time.time() + 30
        while True:
            names = tmp_files(root)
            if names and os.path.getsize(os.path.join(root, "tmp", names[0])) >= MIB:
                break
            assert p.is_alive(), "child died before writing"
            assert time.time() < deadline, "child never started writing"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.join(10)
    assert p.exitcode == -signal.SIGKILL
    assert len(tmp_files(root)) == 1                     # half-written, left behind
    t = DiskTier(root)                                   # next open cleans it
    assert tmp_files(root) == []
    assert t.used == used_before
    if overwrite:
        assert t.get("k") == (b"old", bytearray(old))
        assert len(data_files(root)) == 1
    else:
        assert "k" not in t and len(t) == 0 and data_files(root) == []
    t.close()


def _writer_child(path: str, prefix: str, count: int, start) -> None:
    t = DiskTier(path)
    start.wait(10)
    for i in range(count):
        n = 80 * KIB if i % 3 == 0 else 100 + i
        t.put(f"{prefix}{i:03d}", prefix.encode(), payload(n, i), priority=i)
    t.close()


def test_two_processes_write_concurrently(tmp_path):
    root = str(tmp_path / "ssd")
    DiskTier(root).close()
    ctx = mp.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer_child, args=(root, pre, 40, start)) for pre in ("p/", "q/")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    t = DiskTier(root)
    expected = 0
    for pre in ("p/", "q/"):
        keys = list(t.keys(pre))
        assert len(keys) == 40
        for i, k in enumerate(keys):
            n = 80 * KIB if i % 3 == 0 else 100 + i
            expected += n
            assert t.get(k) == (pre.encode(), bytearray(payload(n, i)))
    assert t.used == expected and len(t) == 80
    assert len(data_files(root)) == 2 * 14


def _big_round_trip_child(path: str) -> None:
    t = DiskTier(path)
    data = payload(3 * MIB, 9)
    t.put("child", b"c", data)
    assert t.get("child") == (b"c", bytearray(data))
    out = bytearray(3 * MIB)
    t.read_into("child", out)
    assert out == data


def test_fork_after_hash_threads_exist(tmp_path, monkeypatch):
    # The parent parks helper hash threads; a forked child (which has none of
    # those threads) must not hand its chunks to them and hang.
    monkeypatch.setattr(disk, "_PIPELINE_READS", True)
    root = str(tmp_path / "ssd")
    t = DiskTier(root)
    t.put("parent", b"", payload(3 * MIB, 1))
    t.get("parent")
    assert disk._idle_workers
    p = mp.get_context("fork").Process(target=_big_round_trip_child, args=(root,))
    p.start()
    p.join(30)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert p.exitcode == 0
    assert t.get("child")[1] == payload(3 * MIB, 9)


def test_readers_never_see_torn_objects(tier):
    sizes = {b"A": 300 * KIB, b"B": 200 * KIB, b"C": 1000}
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def writer():
        i = 0
        while not stop.is_set():
            tag = b"ABC"[i % 3:i % 3 + 1]
            tier.put("k", tag, tag * sizes[tag])
            i += 1

    def reader():
        try:
            while not stop.is_set():
                meta, data = tier.get("k")
                assert len(data) == sizes[meta] and data.count(meta) == len(data)
                reads[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    tier.put("k", b"A", b"A" * sizes[b"A"])
    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(1.0)
    stop.set()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert reads[0] > 10
    assert len(data_files(tier.path)) <= 1 and tier.used == sizes[tier.get("k")[0]]


@pytest.mark.parametrize("same_size", [False, True])
def test_read_retries_when_overwritten_midway(tier, monkeypatch, same_size):
    v1, v2 = payload(100 * KIB, 1), payload(100 * KIB if same_size else 150 * KIB, 2)
    tier.put("k", b"v1", v1)
    real = DiskTier._read_file
    raced = []

    def racing(self, key, fpath, mv, rec):
        if not raced:                    # overwrite between lookup and open
            raced.append(fpath)
            self.put("k", b"v2", v2)
        return real(self, key, fpath, mv, rec)

    monkeypatch.setattr(DiskTier, "_read_file", racing)
    if same_size:
        out = bytearray(len(v1))
        assert tier.read_into("k", out) == b"v2" and out == v2
    else:
        assert tier.get("k") == (b"v2", bytearray(v2))
    assert raced and not os.path.exists(raced[0])


def test_read_of_deleted_object_midway_is_keyerror(tier, monkeypatch):
    tier.put("k", b"v1", payload(100 * KIB))
    real = DiskTier._read_file

    def racing(self, key, fpath, mv, rec):
        self.delete("k")
        return real(self, key, fpath, mv, rec)

    monkeypatch.setattr(DiskTier, "_read_file", racing)
    with pytest.raises(KeyError):
        tier.get("k")


# ------------------------------------------------------- model-based check

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["put", "delete"]),
                          st.sampled_from(["a", "b", "c", "ab"]),
                          st.sampled_from([0, 5, 99, 100, 101, 3000])), max_size=25))
def test_matches_a_dict_model(tmp_path_factory, ops):
    t = DiskTier(tmp_path_factory.mktemp("ssd"), inline_threshold=100)
    model: dict[str, bytes] = {}
    for i, (op, key, n) in enumerate(ops):
        if op == "put":
            data = payload(n, i)
            t.put(key, key.encode(), data)
            model[key] = data
        else:
            assert t.delete(key) == (key in model)
            model.pop(key, None)
    assert list(t.keys()) == sorted(model)
    assert list(t.keys("a")) == sorted(k for k in model if k.startswith("a"))
    for k, v in model.items():
        assert t.get(k) == (k.encode(), bytearray(v))
    assert t.used == sum(map(len, model.values())) and len(t) == len(model)
    assert len(data_files(t.path)) == sum(len(v) >= 100 for v in model.values())
    t.close()
