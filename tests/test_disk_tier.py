"""Tests of the SSD tier (yrcache/tiers/disk.py): the tier suite, then what is SSD-only."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import stat
import threading
import time
import tracemalloc

import diskcache
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


from tier_suite import TierTests  # noqa: E402

from yrcache.errors import CorruptObjectError, StoreClosedError, StoreFullError, YrcacheError  # noqa: E402
from yrcache.tiers import _diskio, _diskutil, disk  # noqa: E402
from yrcache.tiers.base import BlobInfo, new_gen  # noqa: E402
from yrcache.tiers.disk import DiskTier  # noqa: E402

KIB = 1024
MIB = 1024 * 1024


class TestDiskTierConformance(TierTests):
    __test__ = True

    @pytest.fixture(params=[64 * KIB, 0], ids=["default", "all-files"])
    def tier(self, request, tmp_path):
        t = DiskTier(tmp_path / "ssd", capacity=self.CAPACITY, inline_threshold=request.param)
        yield t
        t.close()


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def data_files(root) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(os.path.join(root, "data")):
        out.extend(os.path.join(dirpath, f) for f in files)
    return sorted(out)


def tmp_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "tmp")))


def put(t: DiskTier, data, *, meta: bytes = b"m", key: str = "k", **kw) -> int:
    gen = new_gen()
    t.put(gen, meta, data, key=key, **kw)
    return gen


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    yield t
    t.close()


# ------------------------------------------------------------------ basics

def test_layout_and_modes(tmp_path):
    root = tmp_path / "a" / "b" / "ssd"          # parents created too
    t = DiskTier(root, capacity="1MiB")
    assert t.capacity == MIB and t.path == str(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for sub in ("index", "data", "tmp"):
        assert stat.S_IMODE(os.stat(root / sub).st_mode) == 0o700
    gen = put(t, payload(100 * KIB), key="big")
    (f,) = data_files(root)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    name = os.path.basename(f)
    # named by generation, a random part and the writer, never by key
    g, rand, writer = name.split(".")
    assert g == f"{gen:016x}"[::-1] and len(rand) == 8 and writer == _diskutil.writer_id()
    assert os.path.basename(os.path.dirname(f)) == name[:2]
    assert t.used == 100 * KIB
    # lowest hex digits first: consecutive generations go to different data/XX/ directories
    gens = [put(t, payload(100 * KIB), key=f"k{i}") for i in range(4)]
    assert len({os.path.basename(os.path.dirname(p)) for p in data_files(root)}) == 5, gens
    t.close()


def test_unbounded_capacity_is_free_space_plus_used(tmp_path):
    import shutil
    t = DiskTier(tmp_path / "ssd")
    free = shutil.disk_usage(tmp_path).free
    assert abs(t.capacity - free) < 64 * MIB
    t.close()


@pytest.mark.parametrize("n", [0, 1, 1000, 64 * KIB - 1])
def test_small_payloads_are_inline(tier, n):
    gen = put(tier, payload(n, n), meta=b"meta")
    assert data_files(tier.path) == []
    meta, got = tier.get(gen)
    assert meta == b"meta" and isinstance(got, bytearray) and bytes(got) == payload(n, n)


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("n", [64 * KIB, 300 * KIB, 5 * MIB + 3])
def test_large_payloads_are_files(tier, monkeypatch, n, pipeline):
    monkeypatch.setattr(_diskio, "_PIPELINE_READS", pipeline)
    data = payload(n, n)
    gen = put(tier, data, meta=b"\x00hdr\xff")
    (f,) = data_files(tier.path)
    assert os.path.getsize(f) == n
    out = np.empty(n, dtype=np.uint8)
    assert tier.read_into(gen, out) == b"\x00hdr\xff" and out.tobytes() == data
    assert tier.get(gen) == (b"\x00hdr\xff", bytearray(data))


def test_inline_threshold_boundary(tmp_path):
    t = DiskTier(tmp_path / "ssd", inline_threshold=1000)
    put(t, payload(999))
    assert data_files(t.path) == []
    put(t, payload(1000))
    assert len(data_files(t.path)) == 1
    t.close()


def test_empty_payload_as_file(tmp_path):
    t = DiskTier(tmp_path / "ssd", inline_threshold=0)
    gen = put(t, b"", meta=b"m")
    assert len(data_files(t.path)) == 1
    assert t.get(gen) == (b"m", bytearray())
    assert t.read_into(gen, bytearray()) == b"m"
    t.close()


def test_payload_kinds(tier):
    arr = np.arange(50_000, dtype=np.float32).reshape(100, 500)   # 200 KB, 2-D, not uint8
    gen = put(tier, arr, meta=b"f32")
    out = np.empty_like(arr)
    tier.read_into(gen, out)                      # typed, 2-D destination
    np.testing.assert_array_equal(out, arr)
    assert tier.get(put(tier, memoryview(b"abc")))[1] == b"abc"
    assert tier.get(put(tier, bytearray(b"xyz")))[1] == b"xyz"
    with pytest.raises(ValueError, match="contiguous"):
        put(tier, arr[:, ::2])
    with pytest.raises(TypeError):
        put(tier, 12345)
    with pytest.raises(TypeError, match="writable"):
        tier.read_into(gen, bytes(arr.nbytes))
    assert tier.used == arr.nbytes + 6


def test_argument_checks(tier):
    gen = new_gen()
    with pytest.raises(TypeError, match="key"):
        tier.put(gen, b"", b"x", key=b"bytes")
    with pytest.raises(ValueError, match="UTF-8"):
        tier.put(gen, b"", b"x", key="\ud800")
    with pytest.raises(TypeError, match="meta"):
        tier.put(gen, "str", b"x", key="k")
    with pytest.raises(ValueError, match="priority"):
        tier.put(gen, b"", b"x", key="k", priority=2**63)
    with pytest.raises(ValueError, match="NaN"):
        tier.put(gen, b"", b"x", key="k", expire_at=float("nan"))
    with pytest.raises(TypeError):
        tier.put(gen, b"", b"x", key="k", priority=1.5)
    with pytest.raises(TypeError):
        tier.put(gen, b"", b"x")                  # key is required
    with pytest.raises(TypeError, match="bool"):
        tier.put(True, b"", b"x", key="k")
    assert tier.used == 0 and list(tier.entries()) == []
    tier.put(np.int64(5), b"", b"x", key="k")     # any int-like generation
    assert 5 in tier and tier.info(np.uint64(5)).gen == 5
    key = "é" * 5000                              # no key length limit here
    assert tier.info(put(tier, b"v", key=key)).key == key


def test_generation_is_checked_before_writing(tier, monkeypatch):
    gen = put(tier, payload(100 * KIB, 1), meta=b"first")
    with pytest.raises(ValueError, match="already held"):
        tier.put(gen, b"second", payload(200 * KIB, 2), key="k")
    assert len(data_files(tier.path)) == 1 and tmp_files(tier.path) == []
    assert tier.get(gen) == (b"first", bytearray(payload(100 * KIB, 1)))


def test_generation_taken_while_writing(tmp_path, monkeypatch):
    # Another handle publishes the generation after b's early check, before b commits.
    a = DiskTier(tmp_path / "ssd")
    b = DiskTier(tmp_path / "ssd")
    gen = new_gen()
    real = _diskio.write_payload

    def racing(*args, **kw):
        monkeypatch.setattr(_diskio, "write_payload", real)     # race once
        a.put(gen, b"a", payload(100 * KIB, 1), key="k")
        return real(*args, **kw)

    monkeypatch.setattr(_diskio, "write_payload", racing)
    with pytest.raises(ValueError, match="already held"):
        b.put(gen, b"b", payload(150 * KIB, 2), key="k")
    assert a.get(gen) == (b"a", bytearray(payload(100 * KIB, 1)))
    assert a.used == 100 * KIB and len(data_files(a.path)) == 1      # b's file went again
    a.close()
    b.close()


def test_delete_later(tier):
    gen = put(tier, payload(100 * KIB))
    small = put(tier, b"tiny")
    (f,) = data_files(tier.path)
    handed = []
    assert tier.delete(gen, later=handed.append) is True
    # the file is the caller's to remove, moved under our name into tmp/ first
    # (so that if we die before removing it, it is a dead process's temp file)
    (moved,) = handed
    assert not os.path.exists(f) and os.path.exists(moved)
    assert moved == os.path.join(tier.path, "tmp", _diskutil.tmp_prefix() + os.path.basename(f) + ".del.tmp")
    assert gen not in tier and tier.used == 4       # the record went at once
    os.unlink(moved)
    assert tier.delete(small, later=handed.append) and handed == [moved]   # inline: no file
    assert tier.delete(gen, later=handed.append) is False and tier.used == 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_read_into_makes_no_intermediate_copy(tier, monkeypatch, pipeline):
    monkeypatch.setattr(_diskio, "_PIPELINE_READS", pipeline)
    n = 8 * MIB
    gen = put(tier, payload(n, 1))
    out = np.empty(n, dtype=np.uint8)
    tracemalloc.start()
    try:
        tier.read_into(gen, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * KIB, f"read_into allocated {peak} bytes (a copy?) for an {n}-byte payload"
    assert out.tobytes() == payload(n, 1)


# ----------------------------------------------------------------- capacity

def test_store_full_message(tmp_path):
    t = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    put(t, payload(200 * KIB))
    gen = new_gen()
    with pytest.raises(StoreFullError) as ei:
        t.put(gen, b"", payload(200 * KIB), key="b")
    msg = str(ei.value)
    assert "ssd_size=" in msg and "'b'" in msg and "200.0 KiB used" in msg
    assert gen not in t and t.used == 200 * KIB
    assert len(data_files(t.path)) == 1 and tmp_files(t.path) == []   # nothing leaked
    t.close()


def test_capacity_is_rechecked_under_the_lock(tmp_path, monkeypatch):
    # Another handle fills the tier after b's early check but before b commits.
    a = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    b = DiskTier(tmp_path / "ssd", capacity=300 * KIB)
    real = _diskio.write_payload

    def racing(*args, **kw):
        monkeypatch.setattr(_diskio, "write_payload", real)     # race once
        put(a, payload(200 * KIB))
        return real(*args, **kw)

    monkeypatch.setattr(_diskio, "write_payload", racing)
    gen = new_gen()
    with pytest.raises(StoreFullError):
        b.put(gen, b"", payload(200 * KIB), key="y")
    assert gen not in a and a.used == 200 * KIB
    assert len(data_files(a.path)) == 1                # b's file was removed again
    a.close()
    b.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_filesystem_full_is_store_full(tier, monkeypatch, err):
    def full(fd, data):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(_diskio, "_os_write", full)
    gen = new_gen()
    with pytest.raises(StoreFullError, match="ran out of space") as ei:
        tier.put(gen, b"", payload(100 * KIB), key="k")
    assert isinstance(ei.value.__cause__, OSError)
    assert gen not in tier and tier.used == 0
    assert data_files(tier.path) == [] and tmp_files(tier.path) == []


def test_other_write_errors_pass_through(tier, monkeypatch):
    def broken(fd, data):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(_diskio, "_os_write", broken)
    with pytest.raises(OSError) as ei:
        put(tier, payload(100 * KIB))
    assert not isinstance(ei.value, StoreFullError) and ei.value.errno == errno.EIO
    assert tmp_files(tier.path) == [] and tier.used == 0


# -------------------------------------------------------------- persistence

def test_persists_across_instances(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    big, small = payload(256 * KIB, 7), payload(10, 8)
    exp = time.time() + 3600
    g1 = put(t, big, meta=b"mb", key="big", priority=5, expire_at=exp)
    g2 = put(t, small, meta=b"ms", key="small")
    infos = sorted(t.entries())
    t.close()
    t.close()                                            # idempotent
    with pytest.raises(StoreClosedError):
        t.get(g1)
    with pytest.raises(StoreClosedError):
        list(t.entries())
    t2 = DiskTier(tmp_path / "ssd")
    assert sorted(t2.entries()) == infos                 # enough to rebuild an index
    assert t2.info(g1)[1:6] == ("big", b"mb", 256 * KIB, 5, exp)
    assert t2.get(g1) == (b"mb", bytearray(big))
    assert t2.get(g2) == (b"ms", bytearray(small))
    assert t2.used == len(big) + len(small)
    t2.close()


def test_durable_mode_fsyncs(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    t = DiskTier(tmp_path / "plain")
    put(t, payload(300 * KIB))
    t.close()
    assert synced == []
    t = DiskTier(tmp_path / "ssd", durable=True)
    g1 = put(t, payload(300 * KIB))
    assert len(synced) >= 3                  # the file, data/XX/ (new) and data/
    g2 = put(t, b"abc")
    t.close()
    t = DiskTier(tmp_path / "ssd")
    assert t.get(g1)[1] == payload(300 * KIB) and t.get(g2)[1] == b"abc"
    t.close()


# -------------------------------------------------------------- corruption

def test_flipped_byte_in_a_file_is_that_blob_only(tier):
    good, bad = payload(100 * KIB, 1), payload(200 * KIB, 2)
    g_good = put(tier, good, meta=b"g", key="good")
    g_bad = put(tier, bad, meta=b"b", key="bad")
    (bad_file,) = [f for f in data_files(tier.path) if os.path.getsize(f) == 200 * KIB]
    flip(bad_file, 12345)
    with pytest.raises(CorruptObjectError) as ei:
        tier.read_into(g_bad, bytearray(200 * KIB))
    msg = str(ei.value)
    assert "'bad'" in msg and f"{g_bad:016x}" in msg and bad_file in msg and "checksum" in msg
    assert "delete the key and write it again" in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(CorruptObjectError):
        tier.get(g_bad)
    assert tier.get(g_good) == (b"g", bytearray(good))
    assert tier.info(g_bad).nbytes == 200 * KIB          # metadata still readable
    assert tier.delete(g_bad) and tier.used == 100 * KIB
    assert tier.get(put(tier, bad))[1] == bad


def test_flipped_byte_in_an_inline_record_is_that_blob_only(tier):
    good, bad = payload(1000, 1), payload(1000, 2)
    g_good = put(tier, good, key="good")
    g_bad = put(tier, bad, key="bad")
    tier.close()
    index = diskcache.Cache(os.path.join(tier.path, "index"))
    raw = index.get(g_bad)
    i = len(raw) - 500                                   # a payload byte; header intact
    index.set(g_bad, raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    index.close()
    t = DiskTier(tier.path)
    with pytest.raises(CorruptObjectError, match="'bad'.*checksum"):
        t.read_into(g_bad, bytearray(1000))
    with pytest.raises(CorruptObjectError, match="checksum"):
        t.get(g_bad)
    assert t.get(g_good)[1] == good
    assert t.info(g_bad).nbytes == 1000
    t.close()


@pytest.mark.parametrize("pipeline", [False, True])
def test_flipped_byte_large_payload(tier, monkeypatch, pipeline):
    monkeypatch.setattr(_diskio, "_PIPELINE_READS", pipeline)
    gen = put(tier, payload(3 * MIB))
    (f,) = data_files(tier.path)
    flip(f, 3 * MIB - 1)
    with pytest.raises(CorruptObjectError, match="checksum"):
        tier.get(gen)
    with pytest.raises(CorruptObjectError, match="checksum"):
        tier.read_into(gen, bytearray(3 * MIB))


def test_truncated_longer_and_missing_files(tier):
    trunc = put(tier, payload(100 * KIB, 1))
    (f,) = data_files(tier.path)
    os.truncate(f, 50 * KIB)
    with pytest.raises(CorruptObjectError, match="truncated"):
        tier.read_into(trunc, bytearray(100 * KIB))
    longer = put(tier, payload(100 * KIB, 2))
    (g,) = [x for x in data_files(tier.path) if x != f]
    with open(g, "ab") as fh:
        fh.write(b"more")
    with pytest.raises(CorruptObjectError, match="102404 bytes"):
        tier.get(longer)
    gone = put(tier, payload(100 * KIB, 3))
    (h,) = [x for x in data_files(tier.path) if x not in (f, g)]
    os.unlink(h)
    with pytest.raises(CorruptObjectError, match="missing"):
        tier.get(gone)
    with pytest.raises(CorruptObjectError, match="missing"):
        tier.read_into(gone, bytearray(100 * KIB))
    assert gone in tier and tier.delete(gone)


def test_read_of_blob_deleted_midway_is_keyerror(tier, monkeypatch):
    gen = put(tier, payload(100 * KIB))
    real = _diskio.read_payload

    def racing(*args, **kw):
        tier.delete(gen)                 # between the index lookup and the open
        return real(*args, **kw)

    monkeypatch.setattr(_diskio, "read_payload", racing)
    with pytest.raises(KeyError):
        tier.get(gen)


def test_undecodable_record(tier):
    good = put(tier, b"fine")
    bad = put(tier, b"soon broken")
    tier.close()
    index = diskcache.Cache(os.path.join(tier.path, "index"))
    index.set(bad, b"\x07garbage")
    index.close()
    t = DiskTier(tier.path)
    with pytest.raises(CorruptObjectError, match="not a record"):
        t.info(bad)
    with pytest.raises(CorruptObjectError, match="not a record"):
        t.get(bad)
    assert bad in t and [e.gen for e in t.entries()] == [good]   # skipped, not fatal
    assert t.delete(bad) and bad not in t
    t.close()


# ----------------------------------------------------- maintenance

def test_clear(tier):
    for i in range(30):
        put(tier, payload(70 * KIB if i % 2 else 10, i))
    assert tier.clear() == 30
    assert list(tier.entries()) == [] and tier.used == 0 and data_files(tier.path) == []
    gen = put(tier, b"1")
    assert [e.gen for e in tier.entries()] == [gen]
    assert tier.clear() == 1 and tier.clear() == 0


def test_clear_many(tier):
    gens = {put(tier, b"x") for _ in range(1234)}
    assert {e.gen for e in tier.entries()} == gens
    assert tier.clear() == 1234 and tier.used == 0


def test_delete_while_iterating_entries(tier):
    for i in range(250):
        put(tier, payload(70 * KIB if i % 50 == 0 else 3, i))
    assert sum(tier.delete(e.gen) for e in tier.entries()) == 250
    assert tier.used == 0 and data_files(tier.path) == []


def _orphan(tier, name: str = "ab" + "0" * 30) -> str:
    d = os.path.join(tier.path, "data", name[:2])
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(b"left over by a crash between rename and commit")
    return p


def test_vacuum_removes_orphans_only(tier, monkeypatch):
    live = put(tier, payload(100 * KIB))
    small = put(tier, b"small")
    orphan = _orphan(tier)
    assert tier.vacuum() == 0                           # too young to judge
    monkeypatch.setattr(disk, "_ORPHAN_AGE", -1.0)
    assert tier.vacuum() == 1
    assert not os.path.exists(orphan) and len(data_files(tier.path)) == 1
    assert tier.get(live)[1] == payload(100 * KIB) and tier.get(small)[1] == b"small"
    assert tier.vacuum(min_age=0) == 0
    orphan = _orphan(tier)
    assert tier.vacuum(min_age=0) == 1 and not os.path.exists(orphan)


DAMAGE = {   # how a payload file is damaged -> what check() says
    "missing": (lambda f: os.unlink(f), "payload file is missing"),
    "truncated": (lambda f: os.truncate(f, 1000), r"1000 bytes, the index says 102400 \(truncated\)"),
    "longer": (lambda f: os.truncate(f, 200 * KIB), "204800 bytes, the index says 102400"),
    "fifo": (lambda f: (os.unlink(f), os.mkfifo(f, 0o600)), "it is a FIFO, not a regular file"),
    "directory": (lambda f: (os.unlink(f), os.mkdir(f, 0o700)), "it is a directory"),
    "symlink": (lambda f: (os.rename(f, f + ".x"), os.symlink(f + ".x", f)), "it is a symbolic link"),
    "writable by others": (lambda f: os.chmod(f, 0o666), "group or others may write to it"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_check_finds_damaged_payload_files(tier, damage):
    put(tier, payload(100 * KIB, 1), key="good")
    gen = put(tier, payload(100 * KIB), key="victim")
    put(tier, b"tiny", key="inline")
    tier.check()
    rec = disk._decode(tier._cache.get(gen))
    f = tier._file_path(rec.raw[rec.tail:].decode())
    how, says = DAMAGE[damage]
    how(f)
    with pytest.raises(CorruptObjectError, match=says) as e:
        tier.check()
    assert f"{gen:016x} of 'victim'" in str(e.value) and f in str(e.value)
    with pytest.raises(CorruptObjectError):             # reads agree
        tier.get(gen)
    tier.delete(gen)
    tier.check()


def test_delete_without_a_record_removes_the_files_of_its_generation(tier):
    """A writer killed between rename and commit, or a remover killed between
    the record and the file, leaves a payload file with no record; the store
    then deletes the generation (its stub was retired): the file goes."""
    gen, keep = put(tier, payload(100 * KIB)), put(tier, payload(100 * KIB, 1))
    rec = disk._decode(tier._cache.get(gen))
    f = tier._file_path(rec.raw[rec.tail:].decode())
    index = diskcache.Cache(os.path.join(tier.path, "index"))
    assert index.delete(gen)                  # the record alone goes, as if killed before the file
    index.close()
    assert len(data_files(tier.path)) == 2 and os.path.exists(f)
    assert tier.delete(gen) is False          # no record: nothing to report...
    assert not os.path.exists(f) and len(data_files(tier.path)) == 1    # ...but its file went
    assert tier.get(keep)[1] == payload(100 * KIB, 1)


def test_sweep_removes_strays_of_dead_writers_at_once(tier):
    keep = put(tier, payload(100 * KIB))
    ns = _diskutil.writer_id().split("-")[0]
    dead = _orphan(tier, f"{new_gen():016x}.0badc0de.{ns}-999999999-12345")    # no such process
    live = _orphan(tier, f"{new_gen():016x}.0badc0de.{_diskutil.writer_id()}")  # a put of ours, mid-commit
    with pytest.raises(YrcacheError, match="1 payload files that no record refers to, left by dead"):
        tier.check()
    assert tier.sweep() == 1                  # the dead writer's at once, whatever its age
    assert not os.path.exists(dead) and os.path.exists(live)
    tier.check()                              # a live writer's is no stray: it may yet commit
    assert tier.sweep(min_age=0) == 1 and not os.path.exists(live)
    assert tier.get(keep)[1] == payload(100 * KIB) and len(data_files(tier.path)) == 1


def test_vacuum_removes_blobs_that_are_not_live(tier):
    keep = {put(tier, payload(100 * KIB, i)) for i in range(3)} | {put(tier, b"k")}
    drop = {put(tier, payload(100 * KIB, 9)), put(tier, b"dropped")}
    asked = []

    def is_live(gen):
        asked.append(gen)
        return gen in keep

    assert tier.vacuum(live=is_live, min_age=0) == 2
    assert sorted(asked) == sorted(keep | drop)
    assert {e.gen for e in tier.entries()} == keep
    assert tier.used == 300 * KIB + 1 and len(data_files(tier.path)) == 3
    assert tier.vacuum(min_age=0) == 0                   # without live: blobs stay
    assert {e.gen for e in tier.entries()} == keep


def test_vacuum_removes_entries_of_another_layout(tier):
    gen = put(tier, payload(100 * KIB))
    tier.close()
    index = diskcache.Cache(os.path.join(tier.path, "index"))
    index.set(0, 12345)                                  # an older counter
    index.set("0123456789abcdef/key", b"\x01" * 60)      # an older record
    index.set(new_gen(), b"junk")                        # damaged beyond decoding
    index.close()
    t = DiskTier(tier.path)
    assert [e.gen for e in t.entries()] == [gen] and t.used == 100 * KIB
    assert t.vacuum(min_age=0) == 3
    index = diskcache.Cache(os.path.join(tier.path, "index"))
    assert sorted(map(str, index.iterkeys())) == sorted([str(gen), "used"])
    index.close()
    assert t.get(gen)[1] == payload(100 * KIB) and t.used == 100 * KIB
    t.close()


def test_temp_file_cleanup_rules(tmp_path):
    t = DiskTier(tmp_path / "ssd")
    tmpdir = os.path.join(t.path, "tmp")
    t.close()
    mine = _diskutil.tmp_prefix() + "a" * 32 + ".tmp"   # a live writer (us)
    ns = _diskutil.tmp_prefix().split("-")[0]
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
    t = DiskTier(tmp_path / "ssd")
    with open(os.path.join(tmpdir, dead), "wb") as f:
        f.write(b"partial")
    os.utime(os.path.join(tmpdir, odd_new), (past, past))
    assert t.vacuum() == 2                              # vacuum cleans up too
    assert os.listdir(tmpdir) == [mine]
    t.close()


# ----------------------------------------------------------- concurrency

def _slow_put_child(path: str, gen: int, nbytes: int) -> None:
    """Start a put whose write stalls after 1 MiB (the parent SIGKILLs us)."""
    from yrcache.tiers import _diskio as dio

    def stalling_write(fd, data):
        n = os.write(fd, data[:MIB])
        time.sleep(120)
        return n

    dio._os_write = stalling_write
    t = DiskTier(path)
    t.put(gen, b"new", np.full(nbytes, 7, dtype=np.uint8), key="k")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkill_mid_put_leaves_no_trace(tmp_path, method):
    root = str(tmp_path / "ssd")
    t = DiskTier(root)
    old = put(t, payload(100 * KIB, 3), meta=b"old")
    used_before = t.used
    t.close()
    gen = new_gen()
    ctx = mp.get_context(method)
    p = ctx.Process(target=_slow_put_child, args=(root, gen, 8 * MIB))
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
    assert t.used == used_before and gen not in t
    assert t.get(old) == (b"old", bytearray(payload(100 * KIB, 3)))
    assert [e.gen for e in t.entries()] == [old] and len(data_files(root)) == 1
    t.close()


def _writer_child(path: str, prefix: str, count: int, start) -> None:
    t = DiskTier(path)
    start.wait(10)
    for i in range(count):
        n = 80 * KIB if i % 3 == 0 else 100 + i
        put(t, payload(n, i), meta=prefix.encode(), key=f"{prefix}{i:03d}", priority=i)
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
    ents = list(t.entries())
    assert len(ents) == 80
    expected = 0
    for e in ents:
        i = int(e.key[2:])
        n = 80 * KIB if i % 3 == 0 else 100 + i
        expected += n
        assert (e.nbytes, e.priority, e.meta) == (n, i, e.key[:2].encode())
        assert t.get(e.gen) == (e.key[:2].encode(), bytearray(payload(n, i)))
    assert t.used == expected
    assert len(data_files(root)) == 2 * 14
    t.close()


def _big_round_trip_child(path: str, gen: int) -> None:
    t = DiskTier(path)
    data = payload(3 * MIB, 9)
    t.put(gen, b"c", data, key="child")
    assert t.get(gen) == (b"c", bytearray(data))
    out = bytearray(3 * MIB)
    t.read_into(gen, out)
    assert out == data


def test_fork_after_hash_threads_exist(tmp_path, monkeypatch):
    # The parent parks helper hash threads; a forked child (which has none of
    # those threads) must not hand its chunks to them and hang.
    monkeypatch.setattr(_diskio, "_PIPELINE_READS", True)
    root = str(tmp_path / "ssd")
    t = DiskTier(root)
    t.get(put(t, payload(3 * MIB, 1)))
    assert _diskio._idle_workers
    gen = new_gen()
    p = mp.get_context("fork").Process(target=_big_round_trip_child, args=(root, gen))
    p.start()
    p.join(30)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert p.exitcode == 0
    assert t.get(gen)[1] == payload(3 * MIB, 9)
    t.close()


def test_readers_never_see_torn_blobs(tier):
    # A writer keeps replacing the current copy (new generation, then delete
    # the old one); readers of any generation get all of its bytes or KeyError.
    sizes = {b"A": 300 * KIB, b"B": 200 * KIB, b"C": 1000}
    stop = threading.Event()
    errors: list[BaseException] = []
    reads, gone = [0], [0]
    current = [put(tier, b"A" * sizes[b"A"], meta=b"A")]

    def writer():
        i = 0
        while not stop.is_set():
            tag = b"ABC"[i % 3:i % 3 + 1]
            old, current[0] = current[0], put(tier, tag * sizes[tag], meta=tag)
            tier.delete(old)
            i += 1

    def reader():
        try:
            while not stop.is_set():
                try:
                    meta, data = tier.get(current[0])
                except KeyError:
                    gone[0] += 1
                    continue
                assert len(data) == sizes[meta] and data.count(meta) == len(data)
                reads[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(1.0)
    stop.set()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert reads[0] > 10
    assert [e.gen for e in tier.entries()] == [current[0]]
    assert len(data_files(tier.path)) <= 1 and tier.used == tier.info(current[0]).nbytes


# ------------------------------------------------------- model-based check

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["put", "delete"]),
                          st.integers(0, 5),
                          st.sampled_from([0, 5, 99, 100, 101, 3000])), max_size=25))
def test_matches_a_dict_model(tmp_path_factory, ops):
    t = DiskTier(tmp_path_factory.mktemp("ssd"), inline_threshold=100)
    model: dict[int, tuple[bytes, bytes]] = {}
    made: list[int] = []
    for i, (op, pick, n) in enumerate(ops):
        if op == "put" or not made:
            gen = new_gen()
            data = payload(n, i)
            t.put(gen, str(i).encode(), data, key=f"k{pick}", priority=pick)
            model[gen] = (str(i).encode(), data)
            made.append(gen)
        else:
            gen = made[pick % len(made)]
            assert t.delete(gen) == (gen in model)
            model.pop(gen, None)
    assert sorted(e.gen for e in t.entries()) == sorted(model)
    for gen, (meta, data) in model.items():
        assert t.get(gen) == (meta, bytearray(data))
        assert isinstance(t.info(gen), BlobInfo)
    assert t.used == sum(len(d) for _, d in model.values())
    assert len(data_files(t.path)) == sum(len(d) >= 100 for _, d in model.values())
    t.close()
