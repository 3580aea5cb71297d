"""The SSD tier against other local users and against two stores sharing a directory.

Another user is simulated by chown-ing to uid 65534 (``nobody``), which needs
root; the tests skip without it.  Every test removes what it made.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from contextlib import closing

import pytest

import procs
from yrcache.errors import CorruptObjectError, StoreInUseError, UntrustedStoreError
from yrcache.tiers import _diskutil, disk
from yrcache.tiers.base import new_gen
from yrcache.tiers.disk import DiskTier

pytestmark = pytest.mark.timeout(60)

KIB = 1024
NOBODY = 65534
HINT = "remove it or chown/chmod it"
K, CHILD = 0x6B, 0xC41D                 # generations written by one handle, read by another
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) & 0xFF for i in range(n))


@pytest.fixture
def root(tmp_path):
    """A tier path that does not exist yet; everything under tmp_path
    (the tier, symlink targets, copies, files chown-ed to nobody) is removed afterwards."""
    yield tmp_path / "ssd"
    for p in tmp_path.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    assert list(tmp_path.iterdir()) == []


def put(tier: DiskTier, meta: bytes, data: bytes, key: str = "k") -> int:
    gen = new_gen()
    tier.put(gen, meta, data, key=key)
    return gen


def payload_path(tier: DiskTier, gen: int) -> str:
    """The payload file of blob ``gen``, found through its index record."""
    rec = disk._decode(tier._cache.get(gen))
    assert rec.kind == disk._FILE
    return tier._file_path(rec.raw[rec.tail:].decode())


def mode_of(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# ------------------------------------------------------------------ 1. trust

DIRS = ["", "index", "data", "data/ab", "tmp"]


@needs_root
@pytest.mark.parametrize("attack", ["other-user", "world-writable"])
@pytest.mark.parametrize("sub", DIRS)
def test_untrusted_directory_is_refused(root, sub, attack):
    DiskTier(root).close()
    d = root / sub
    d.mkdir(exist_ok=True)
    if attack == "other-user":
        os.chown(d, NOBODY, NOBODY)          # keeps mode 0700: ownership alone refuses
    else:
        os.chmod(d, 0o777)
    with pytest.raises(UntrustedStoreError) as ei:
        DiskTier(root)
    msg = str(ei.value)
    assert isinstance(ei.value, PermissionError)
    assert str(d) in msg and HINT in msg
    assert ("owner uid 65534" in msg) if attack == "other-user" else ("mode 0o777" in msg)
    os.chown(d, 0, 0)
    os.chmod(d, 0o700)
    DiskTier(root).close()                  # fixed as the message says: opens again


@needs_root
def test_precreated_directory_of_another_user_is_refused(root):
    # The README once suggested /var/tmp/exp2: anyone could create it first.
    root.mkdir(0o777)
    os.chmod(root, 0o777)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(UntrustedStoreError, match="another user"):
        DiskTier(root)
    assert os.listdir(root) == []           # refused before anything was written


def test_world_writable_directory_of_ours_is_refused(root):
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UntrustedStoreError, match=r"0o777.*group or others may write"):
        DiskTier(root)
    assert os.listdir(root) == []
    os.chmod(root, 0o755)                   # readable by others is fine
    DiskTier(root).close()


@pytest.mark.parametrize("sub", ["index", "data", "tmp", "data/ab"])
def test_symlinked_subdirectory_is_refused(root, tmp_path, sub):
    DiskTier(root).close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(0o700)
    d = root / sub
    if d.exists():
        os.rename(d, elsewhere / "moved")
    os.symlink(elsewhere, d)
    with pytest.raises(UntrustedStoreError, match="symbolic link"):
        DiskTier(root)
    shutil.rmtree(elsewhere)


def test_tier_directory_may_be_a_symlink_to_our_own(root, tmp_path):
    real = tmp_path / "real"
    os.symlink(real, root)
    DiskTier(real).close()
    with closing(DiskTier(root)) as t:
        t.put(K, b"", b"v", key="k")
    shutil.rmtree(real)
    os.unlink(root)


INDEX_FILES = ["index/cache.db", "index/cache.db-wal", "index/cache.db-shm", "owner.lock"]


@needs_root
@pytest.mark.parametrize("attack", ["other-user", "world-writable", "symlink"])
@pytest.mark.parametrize("name", INDEX_FILES)
def test_untrusted_index_file_is_refused(root, tmp_path, name, attack):
    # A first handle stays open so that SQLite's -wal and -shm files exist.
    first = DiskTier(root, owner="me")
    first.put(K, b"", b"v", key="k")
    p = root / name
    assert p.exists()
    if attack == "other-user":
        os.chown(p, NOBODY, NOBODY)
    elif attack == "world-writable":
        os.chmod(p, 0o666)
    else:
        target = tmp_path / "target"
        shutil.copyfile(p, target)
        os.chmod(target, 0o600)
        os.unlink(p)
        os.symlink(target, p)
    try:
        for owner in (None, "me"):
            with pytest.raises(UntrustedStoreError) as ei:
                DiskTier(root, owner=owner)
            assert str(p) in str(ei.value) and HINT in str(ei.value)
    finally:
        first.close()


def test_index_and_lock_files_are_private(root):
    with closing(DiskTier(root, owner="me")) as t:
        t.put(K, b"", b"v", key="k")
        names = ["index/cache.db", "index/cache.db-wal", "index/cache.db-shm", "owner.lock"]
        for name in names:
            assert mode_of(root / name) == 0o600, name
    # An index left 0644 (an older version, another umask) is tightened on open.
    for name in ("index/cache.db", "owner.lock"):
        os.chmod(root / name, 0o644)
    with closing(DiskTier(root, owner="me")) as t:
        assert t.get(K)[1] == b"v"
        for name in names:
            assert mode_of(root / name) == 0o600, name


# ----------------------------------------------------- 2. payload files

def _plant_fifo(p, tmp_path):
    os.unlink(p)
    os.mkfifo(p, 0o600)


def _plant_symlink(p, tmp_path):
    # A valid copy of the payload: only the link itself is wrong.
    target = tmp_path / "copy"
    shutil.copyfile(p, target)
    os.unlink(p)
    os.symlink(target, p)


def _plant_directory(p, tmp_path):
    os.unlink(p)
    os.mkdir(p, 0o700)


def _plant_foreign(p, tmp_path):
    os.chown(p, NOBODY, NOBODY)              # contents intact


def _plant_writable(p, tmp_path):
    os.chmod(p, 0o666)                       # contents intact


PLANTS = {
    "fifo": (_plant_fifo, "a FIFO"),
    "symlink": (_plant_symlink, "symbolic link"),
    "directory": (_plant_directory, "a directory"),
    "foreign": pytest.param((_plant_foreign, "another user"), marks=needs_root),
    "writable": (_plant_writable, "group or others may write"),
}


@pytest.mark.timeout(20)                     # today a FIFO hangs read_into forever
@pytest.mark.parametrize("plant", list(PLANTS.values()), ids=list(PLANTS))
def test_payload_that_is_not_our_regular_file_is_corrupt(root, tmp_path, plant):
    how, what = plant
    t = DiskTier(root)
    data = payload(100 * KIB, 1)
    gen = put(t, b"m", data)
    other = put(t, b"o", payload(100 * KIB, 2), key="other")
    p = payload_path(t, gen)
    how(p, tmp_path)
    start = time.monotonic()
    with pytest.raises(CorruptObjectError) as ei:
        t.read_into(gen, bytearray(100 * KIB))
    assert what in str(ei.value) and p in str(ei.value)
    with pytest.raises(CorruptObjectError, match=what):
        t.get(gen)
    assert time.monotonic() - start < 5
    assert t.get(other)[1] == payload(100 * KIB, 2)       # only that object
    assert t.delete(gen)                                   # the advised fix works
    gen = put(t, b"m", data)
    assert t.get(gen) == (b"m", bytearray(data))
    t.close()


# ------------------------------------------------- 3. one store per directory

PROBE = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(sys.argv[2]))
    except OSError:
        sys.exit(1)
    sys.exit(0)
""")


def byte_is_free(lock_file, byte: int) -> bool:
    """Ask another process (classic POSIX lock, packed by Python itself) whether
    it can write-lock ``byte`` of ``lock_file``."""
    rc = subprocess.run([sys.executable, "-c", PROBE, str(lock_file), str(byte)], timeout=30).returncode
    assert rc in (0, 1)
    return rc == 0


def test_flock_layout_and_lock_excludes_another_process(root):
    assert _diskutil.FLOCK.size == 32
    lock_file = root / "owner.lock"
    with closing(DiskTier(root, owner="a")):
        assert not byte_is_free(lock_file, 1)     # the claim
        assert byte_is_free(lock_file, 0)         # the opener gate is released
        assert byte_is_free(lock_file, 2)         # nothing else is locked
    assert byte_is_free(lock_file, 1)


def test_different_owners_exclude_each_other(root):
    a = DiskTier(root, owner="store-a")
    with pytest.raises(StoreInUseError) as ei:
        DiskTier(root, owner="store-b")
    msg = str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    assert str(root) in msg and "'store-a'" in msg and "'store-b'" in msg
    assert "one ssd= directory per store" in msg and "attach to the store that has it" in msg
    a.put(K, b"", b"still fine", key="k")
    a.close()
    with closing(DiskTier(root, owner="store-b")) as b:    # free once the owner closed
        assert b.get(K)[1] == b"still fine"
        with pytest.raises(StoreInUseError, match="'store-b'"):
            DiskTier(root, owner="store-a")


def test_same_owner_twice_and_takeover_after_the_last_closes(root):
    a1 = DiskTier(root, owner="a")
    a2 = DiskTier(root, owner="a")
    a1.put(K, b"", b"1", key="x")
    assert a2.get(K)[1] == b"1"
    a1.close()
    with pytest.raises(StoreInUseError):          # a2 still holds it
        DiskTier(root, owner="b")
    a2.close()
    DiskTier(root, owner="b").close()


def test_owner_id_survives_in_the_file(root):
    DiskTier(root, owner="first").close()
    assert (root / "owner.lock").read_text() == "first\n"
    with closing(DiskTier(root, owner="second")):
        assert (root / "owner.lock").read_text() == "second\n"
    assert (root / "owner.lock").read_text() == "second\n"


def test_owner_none_takes_no_lock(root):
    with closing(DiskTier(root)) as t:
        t.put(K, b"", b"v", key="k")
    assert not (root / "owner.lock").exists()
    with closing(DiskTier(root, owner="a")):
        with closing(DiskTier(root)) as tool:     # tools may look while a store holds it
            assert tool.get(K)[1] == b"v"
        with pytest.raises(StoreInUseError):
            DiskTier(root, owner="b")


def test_owner_argument_is_checked(root):
    with pytest.raises(TypeError, match="owner"):
        DiskTier(root, owner=b"bytes")
    for bad in ("", "two\nlines", "x" * 257):
        with pytest.raises(ValueError, match="owner"):
            DiskTier(root, owner=bad)
    with pytest.raises(TypeError):
        DiskTier(root, None, False, False, "positional")   # keyword-only


def _open_in_child(path: str, owner: str, other: str) -> str:
    t = DiskTier(path, owner=owner)
    t.put(CHILD, b"", b"hello", key="child")
    try:
        DiskTier(path, owner=other)
    except StoreInUseError as exc:
        msg = str(exc)
    else:
        raise AssertionError("another owner was let in")
    t.close()
    return msg


def test_same_owner_from_a_child_process(root, mp_context):
    with closing(DiskTier(root, owner="a")) as t:
        p, q = procs.start(mp_context, _open_in_child, str(root), "a", "b")
        msg = procs.finish(p, q)
        assert "'a'" in msg and "'b'" in msg
        assert t.get(CHILD)[1] == b"hello"
        with pytest.raises(StoreInUseError):      # the child's close left ours alone
            DiskTier(root, owner="b")


def _hold_until_killed(path: str, owner: str, ready) -> None:
    t = DiskTier(path, owner=owner)           # held (referenced) until killed
    ready.set()
    time.sleep(600)
    t.close()


def test_killed_holder_frees_the_directory(root, mp_context):
    DiskTier(root).close()
    ready = mp_context.Event()
    p = mp_context.Process(target=_hold_until_killed, args=(str(root), "dead", ready), daemon=True)
    p.start()
    try:
        procs.wait_or_die(ready, p)
        with pytest.raises(StoreInUseError, match="'dead'"):
            DiskTier(root, owner="alive")
    finally:
        procs.kill_and_join(p)
    assert p.exitcode == -signal.SIGKILL
    with closing(DiskTier(root, owner="alive")):
        assert (root / "owner.lock").read_text() == "alive\n"


def _forked_holder(t: DiskTier, ready, go, done) -> None:
    # Uses the handle inherited through fork, then waits to be told to close it.
    ready.set()
    assert go.wait(30)
    t.put(CHILD, b"", b"c", key="from-child")
    assert done.wait(30)
    t.close()


@pytest.mark.parametrize("first", ["parent", "child"])
def test_fork_child_keeps_its_own_claim(root, first):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    t = DiskTier(root, owner="a")
    p = ctx.Process(target=_forked_holder, args=(t, ready, go, done), daemon=True)
    p.start()
    try:
        procs.wait_or_die(ready, p)
        if first == "parent":
            t.close()
            go.set()
        else:
            go.set()
            done.set()
            p.join(30)
            assert p.exitcode == 0
        # Whichever side closed first, the other still holds the directory.
        with pytest.raises(StoreInUseError):
            DiskTier(root, owner="b")
        done.set()
        p.join(30)
        assert p.exitcode == 0
    finally:
        procs.kill_and_join(p)
        t.close()
    with closing(DiskTier(root, owner="b")) as b:
        assert b.get(CHILD)[1] == b"c"


# ------------------------------------------- 4. inline payload checksums (14a)

def test_inline_payload_checksum_is_verified(root):
    t = DiskTier(root)
    data = payload(1000, 3)
    gen = put(t, b"meta", data)
    raw = t._cache.get(gen)
    rec = disk._decode(raw)
    assert rec.kind == disk._INLINE and len(raw) == rec.tail + len(data)
    i = rec.tail + 500                           # a payload byte; the header stays intact
    t._cache.set(gen, raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    assert t.info(gen).nbytes == 1000            # the record still decodes
    with pytest.raises(CorruptObjectError, match="checksum"):
        t.read_into(gen, bytearray(1000))
    with pytest.raises(CorruptObjectError, match="checksum"):
        t.get(gen)
    t.close()
