"""What a store trusts and what it refuses (docs/architecture.md, "Security").

Another local user is simulated by chown-ing files to ``nobody`` (the tests
run as root); other containers sharing ``/dev/shm`` by ``unshare --pid``.
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from yrcache import TieredStore, Tier, UntrustedStoreError
from yrcache._arena import ffi, lib
from yrcache.tiers import dram
from procs import seg_path

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


class Boom:
    """Unpickling this runs a command: creates the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def run_py(code: str, timeout: float = 60, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------ foreign segments


@as_root
@pytest.mark.parametrize("how", ["create", "attach"])
def test_foreign_segment_is_refused_and_never_unpickled(store_name, tmp_path, how):
    """Another user's segment (mode 0666, holding a pickle whose loading runs a
    command) is neither adopted nor attached, so the command never runs."""
    marker = tmp_path / "pwned"
    s = TieredStore(name=store_name, dram="4MiB", pickle=True, persist=True)
    s["x"] = Boom(str(marker))
    s.close()
    del s
    gc.collect()
    os.chown(seg_path(store_name), NOBODY, NOBODY)
    os.chmod(seg_path(store_name), 0o666)
    try:
        with pytest.raises(UntrustedStoreError, match="owned by uid 65534"):
            if how == "create":
                TieredStore(name=store_name, dram="4MiB")
            else:
                TieredStore.attach(store_name, pickle=True)
        assert not marker.exists()
    finally:
        dram.destroy(store_name)


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o606, 0o666])
def test_own_segment_open_to_others_is_refused(store_name, mode):
    s = TieredStore(name=store_name, dram="4MiB", persist=True)
    s["k"] = b"v"
    s.close()
    os.chmod(seg_path(store_name), mode)
    try:
        with pytest.raises(UntrustedStoreError, match=f"mode {mode:o}"):
            TieredStore.attach(store_name)
        with pytest.raises(PermissionError):     # the builtin a caller may already catch
            TieredStore(name=store_name)
    finally:
        dram.destroy(store_name)


def test_segments_are_created_owner_only(make_store, store_name):
    make_store()
    st = os.stat(seg_path(store_name))
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600


def test_pickle_records_need_pickle_on_the_reading_handle(make_store, store_name, tmp_path):
    """A pickle=True process stores a pickled object; a pickle=False handle of
    the same store refuses to load it (and so never runs its code)."""
    marker = tmp_path / "pwned"
    writer = make_store(pickle=True)
    writer["obj"] = Boom(str(marker))
    writer["plain"] = b"bytes are fine"
    reader = TieredStore.attach(store_name)
    try:
        for read in (lambda: reader["obj"], lambda: reader.get("obj"),
                     lambda: reader.mget(["plain", "obj", "plain", "obj"]),
                     lambda: reader.get("obj", copy=True)):
            with pytest.raises(UntrustedStoreError, match="pickle=True"):
                read()
        assert not marker.exists()
        assert bytes(reader["plain"]) == b"bytes are fine"
        assert reader.stats()["pinned_bytes"] == 0      # the refused read left no pin behind
        trusting = TieredStore.attach(store_name, pickle=True)
        trusting["obj"]                                  # opted in: loads (and runs) it
        assert marker.exists()
        trusting.close()
    finally:
        reader.close()


def test_pickle_records_on_ssd_need_pickle_too(make_store, store_name, tmp_path):
    marker = tmp_path / "pwned"
    writer = make_store(pickle=True, ssd=tmp_path / "ssd")
    writer.put("obj", Boom(str(marker)), tier=Tier.SSD)
    reader = TieredStore.attach(store_name)
    try:
        with pytest.raises(UntrustedStoreError, match="pickle=True"):
            reader["obj"]
        assert not marker.exists()
    finally:
        reader.close()


# Offsets of hdr_t fields (yrcache/_csrc/internal.h): magic, layout, size,
# nbuckets, buckets_off, procs_off, pins_off, heap_off, heap_size.
HEADER_FIELDS = {"size": 16, "nbuckets": 24, "buckets_off": 32, "procs_off": 40, "pins_off": 48,
                 "heap_off": 56, "heap_size": 64}


@pytest.mark.parametrize("field", sorted(HEADER_FIELDS))
def test_forged_header_offsets_give_an_error_not_a_wild_read(store_name, field):
    s = TieredStore(name=store_name, dram="4MiB", persist=True)
    s["k"] = b"v"
    s.close()
    del s
    gc.collect()
    try:
        fd = os.open(seg_path(store_name), os.O_RDWR)
        with mmap.mmap(fd, 4096) as m:
            off = HEADER_FIELDS[field]
            old = int.from_bytes(m[off:off + 8], "little")
            m[off:off + 8] = (old + (1 << 40)).to_bytes(8, "little")
        os.close(fd)
        # In a child: a wild read would kill it with SIGSEGV, not raise.
        r = run_py(f"""
            from yrcache import TieredStore, StoreNotFoundError
            try:
                TieredStore.attach({store_name!r})
            except StoreNotFoundError as e:
                print("refused:", e)
            """)
        assert r.returncode == 0, r.stderr
        assert "refused:" in r.stdout and "not a usable yrcache store" in r.stdout
    finally:
        dram.destroy(store_name)


# ------------------------------------------------------- damaged segments


def _damage(name: str, how: str) -> None:
    """Leave a persisted store whose lists contradict its blocks, as only a writer
    other than yrcache can: an old copy of its first 4 KiB (the header's free lists)
    put back after a put ("stale-header"), or a key of the sorted index linked to
    itself ("cycle"), or an object count no heap can hold ("count": len() raised
    OverflowError)."""
    s = TieredStore(name=name, dram="4MiB", persist=True)
    s["a"] = np.arange(10)
    with open(seg_path(name), "rb") as f:
        old = f.read(4096)
    s["b"] = np.arange(1000)                 # 8 KB: taken from the head of the free block
    info = s._arena.get(b"b", 0)
    fwd = info.block_off + 128 + (1 + info.meta_len + 7) // 8 * 8   # its sorted-index links
    s.close()
    with open(seg_path(name), "r+b") as f:
        if how == "stale-header":
            f.write(old)                     # its free list offers b's block, which is in use
        elif how == "count":
            f.seek(96)                       # hdr_t.objects (yrcache/_csrc/internal.h)
            f.write((2**63 + 5).to_bytes(8, "little"))
        else:
            f.seek(fwd)
            f.write(info.block_off.to_bytes(8, "little"))   # b -> b -> b ...


@pytest.mark.parametrize("how", ["stale-header", "cycle", "count"])
def test_a_damaged_segment_gives_an_error_not_a_hang(store_name, how):
    _damage(store_name, how)
    try:
        # In a child with a timeout: the loop that went round forever is the failure.
        r = run_py(f"""
            import numpy as np
            from yrcache import TieredStore, CorruptObjectError, StoreNotFoundError
            try:
                s = TieredStore.attach({store_name!r})
            except CorruptObjectError as e:      # counts no heap can hold: seen at once
                print("open refused:", e)
                raise SystemExit
            for what, op in [("put", lambda: s.__setitem__("c", np.arange(1000))),
                             ("keys", lambda: sorted(s)), ("len", lambda: len(s))]:
                try:
                    op()
                    print(what, "ok")
                except CorruptObjectError as e:
                    print(what, "refused:", e)
            try:
                TieredStore.attach({store_name!r})
            except StoreNotFoundError as e:
                print("attach refused:", e)
            """, timeout=20)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        if how == "count":
            assert [ln.split(":")[0] for ln in lines] == ["open refused"]
        else:
            assert [ln.split(":")[0] for ln in lines] == ["put refused", "keys refused", "len refused",
                                                          "attach refused"]
            assert "not a usable yrcache store" in lines[3]
        assert "is damaged" in lines[0] and f"yrcache destroy {store_name}" in lines[0]
    finally:
        dram.destroy(store_name)


@pytest.mark.parametrize("where", ["buckets", "pins"])
def test_wild_offsets_in_the_index_or_the_pin_table_give_errors_not_a_crash(store_name, where):
    """Random bytes over a persisted segment's bucket heads or pin records: attach, reads
    and the release of the process slot at close followed the offsets found there outside
    the heap (SIGSEGV in 8 of 8 seeds of a fuzzer). They are checked now: the arena is
    marked damaged."""
    s = TieredStore(name=store_name, dram="4MiB", persist=True)
    for i in range(50):
        s[f"k{i}"] = np.arange(i * 10, dtype=np.float32)
    s.close()
    try:
        with open(seg_path(store_name), "r+b") as f:
            head = f.read(4096)
            buckets, procs, pins, heap = (int.from_bytes(head[o:o + 8], "little") for o in (32, 40, 48, 56))
            wild = (0x4141414141414000).to_bytes(8, "little")
            if where == "buckets":
                f.seek(buckets)
                f.write(wild * ((procs - buckets) // 8))
            else:                                   # records (block_off, slot, next_free) for every slot
                f.seek(pins + 16)
                f.write(b"".join(wild + (1 + i % 8).to_bytes(4, "little") + bytes(4) for i in range((heap - pins) // 16 - 1)))
        r = run_py(f"""
            from yrcache import TieredStore, YrcacheError
            try:
                s = TieredStore.attach({store_name!r})
                print("got", sum(s.get(f"k{{i}}") is not None for i in range(50)))
                s.close()
            except YrcacheError as e:
                print("refused:", type(e).__name__, e)
            """, timeout=20)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert r.stdout.startswith("refused: CorruptObjectError" if where == "buckets" else ("got", "refused")), r.stdout
    finally:
        dram.destroy(store_name)


# ------------------------------------------------------- process liveness


def _fake_slot(s: TieredStore, pid: int, starttime: int) -> int:
    """Register a process slot through a descriptor that is then closed, as a
    process that died (or never existed) would leave it."""
    a = s._arena
    fd = os.open(a.path, os.O_RDWR)
    try:
        slot = lib.yr_proc_attach(a.base, fd, pid, starttime, 0)
        assert slot > 0
        kb = b"k"
        info = ffi.new("yr_objinfo *")
        assert lib.yr_get(a.base, slot, kb, 1, lib.YR_PIN, info) == 0    # the "dead" process pins k
    finally:
        os.close(fd)
    return slot


def test_a_live_pid_without_the_slot_lock_is_dead(make_store):
    """A slot recorded with a pid that is alive (ours: a reused pid) and even
    its start time is reclaimed: only the slot's lock says a process lives."""
    s = make_store(dram="4MiB")
    s["k"] = b"v" * 1000
    _fake_slot(s, os.getpid(), dram.proc_starttime())
    st = s.stats()                     # sweeps
    assert st["processes"] == 1, st
    assert st["pinned_bytes"] == 0, st


def test_zombie_and_exited_processes_are_swept(make_store, store_name):
    """A child that attached, pinned a view and exited without detaching (a
    zombie until reaped): its slot and pins are reclaimed before reaping."""
    s = make_store(dram="4MiB")
    s["k"] = np.arange(1000)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            c = TieredStore.attach(store_name)
            v = c["k"]               # pinned
            os.write(w, b"1")
            del v
        finally:
            os._exit(0)               # no detach, no exit hooks
    try:
        assert os.read(r, 1) == b"1"
        for _ in range(200):          # wait until it is a zombie (exited, not reaped)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        st = s.stats()
        assert st["processes"] == 1, st
        assert st["pinned_bytes"] == 0, st
    finally:
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_pidns = pytest.mark.skipif(
    not _unshare_works(),
    reason="needs `unshare --pid --fork --mount-proc` (root or user namespaces); the same lock-based "
           "liveness is covered without namespaces by test_a_live_pid_without_the_slot_lock_is_dead")

PIDNS = ["unshare", "--pid", "--fork", "--mount-proc"]


@needs_pidns
def test_processes_in_other_pid_namespaces_keep_their_views(make_store, store_name):
    """Containers sharing /dev/shm see each other's pids as dead.  Neither side
    may reclaim the other's slot or pins: a view held in the other namespace
    stays unchanged while this side overwrites, deletes and sweeps."""
    s = make_store(dram="8MiB")
    s["a"] = np.full(100_000, 7, dtype=np.int64)
    s["b"] = np.full(1000, 3, dtype=np.int64)
    mine = s["b"]                                     # our view, across its sweep
    child = subprocess.Popen(
        [*PIDNS, sys.executable, "-c", textwrap.dedent(f"""
            import sys
            import numpy as np
            from yrcache import TieredStore
            s = TieredStore.attach({store_name!r})
            v = s["a"]
            st = s.stats()           # sweeps from inside the namespace
            print(st["processes"], flush=True)
            sys.stdin.readline()
            print(int((v == 7).all()), int(v.sum()), flush=True)
            """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "2"      # it did not reclaim our slot
        assert s.stats()["processes"] == 2                 # we did not reclaim its slot
        np.testing.assert_array_equal(mine, 3)
        del s["a"]
        for i in range(20):                                # reuse the freed space
            s[f"junk{i}"] = np.full(10_000, -1, dtype=np.int64)
        s.stats()
        child.stdin.write("go\n")
        child.stdin.flush()
        ok, total = child.stdout.readline().split()
        assert ok == "1" and int(total) == 700_000, "the view in the other namespace changed"
        assert child.wait(30) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    del mine


@as_root
def test_node_lock_refuses_a_segment_that_became_another_users(store_name):
    """The node lock opens the segment again by name: a file that is no longer ours
    alone (replaced, or handed to another user) is refused, not locked and waited on."""
    s = TieredStore(name=store_name, dram="4MiB")
    try:
        os.chown(seg_path(store_name), NOBODY, NOBODY)
        with pytest.raises(UntrustedStoreError, match="owned by uid 65534"):
            with s.node_lock("k"):
                pass
        os.chown(seg_path(store_name), os.geteuid(), os.getegid())
        with s.node_lock("k"):
            pass
    finally:
        s.destroy()
