"""Processes SIGKILLed at bad moments: the arena must stay consistent and
reclaim what the dead held.

Random kills (processes hammering the store) stop the child first and read
the arena mutex's owner word: a stopped child cannot release the lock, so the
test knows exactly which kills landed inside it, and checks that the store
counted one recovery for each of those (``stats()["recoveries"]``) and none
for the others.  Until the first kill has landed inside the lock, kills look
for one (stop, look, let it run a little, look again), so every run tests a
death inside the critical section.  Two deterministic tests take the arena's
robust mutex in a child (through libc, at the mutex's offset in the arena
header) and kill the child while it holds it, once with a consistent arena
and once emulating a death inside the allocator.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest

from yrcache import TieredStore
from yrcache.tiers import dram
from procs import finish, kill_and_join, seg_exists, sigstop, start, wait_or_die  # noqa: E402

MAGIC = np.uint64(0x5EEDC0DE12345678)

# White-box layout facts (x86_64, glibc, yrcache/_csrc/internal.h).  The mutex is
# found at run time by its kind word; the tests check the child really holds it.
HDR_BUCKETS_OFF = 32                # offsetof(hdr_t, buckets_off) = end of the header
MUTEX_KIND_WORD = 4                 # int index of __kind in glibc's pthread_mutex_t
MUTEX_LOCK_WORD = 0                 # int index of __lock: the owner's tid while the mutex is held
FUTEX_TID_MASK = 0x3FFFFFFF
MUTEX_ROBUST_PSHARED = 16 | 128     # PTHREAD_MUTEX_ROBUST_NORMAL_NP | PSHARED bit
BLK_STATE_OFFSET = 16               # offsetof(blk_t, state)
ST_FREE = 0x0F
EBUSY = 16


# ------------------------------------------------------------------ helpers


def make_value(rng: random.Random, lo: int = 7, hi: int = 18, fill: int | None = None) -> np.ndarray:
    """Self-checking uint64 array ``[n, fill ^ MAGIC, fill, ...]`` of 2**lo..2**hi words."""
    n = int(2 ** rng.uniform(lo, hi))
    f = np.uint64((rng.getrandbits(63) | 1) if fill is None else fill)
    arr = np.full(n, f, dtype=np.uint64)
    arr[0] = n
    arr[1] = f ^ MAGIC
    return arr


def check_value(v) -> int:
    """Assert ``v`` is a complete self-checking value; return its fill word."""
    assert isinstance(v, np.ndarray) and v.dtype == np.uint64 and v.ndim == 1, (type(v), getattr(v, "dtype", None))
    n = len(v)
    assert n >= 3 and int(v[0]) == n, f"torn value: length word {int(v[0])} in an array of {n}"
    fill = v[1] ^ MAGIC
    bad = np.flatnonzero(v[2:] != fill)
    assert bad.size == 0, f"torn value: {bad.size} of {n - 2} words differ from the fill, first at {bad[0] + 2}"
    return int(fill)


def raw_stats(s: TieredStore):
    """Arena counters without the sweep that ``stats()`` does first."""
    return s._arena.stats()


def assert_clean(s: TieredStore) -> None:
    """After every child is gone: nothing pinned, reserved or orphaned, and an
    emptied store gives all its space back in one block."""
    s.check()
    st = s.stats()
    assert st["processes"] == 1, st
    assert st["pinned_bytes"] == 0 and st["orphans"] == 0, st
    assert raw_stats(s).reserved == 0
    s.clear()
    st = s.stats()
    dram = st["tiers"]["dram"]
    assert dram["used"] == 0 and dram["largest_free"] == dram["capacity"], st
    s.check()


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.pthread_mutex_lock.argtypes = [ctypes.c_void_p]
    libc.pthread_mutex_trylock.argtypes = [ctypes.c_void_p]
    libc.pthread_mutex_unlock.argtypes = [ctypes.c_void_p]
    return libc


def _mutex_addr(s: TieredStore) -> int:
    """Address of the arena's robust mutex: the last 64-byte aligned
    ``pthread_mutex_t`` in the header whose kind word says robust and
    process-shared (the header ends where the bucket table starts)."""
    base = s._arena.addr
    hdr_end = ctypes.c_uint64.from_address(base + HDR_BUCKETS_OFF).value
    if not 1024 <= hdr_end <= (1 << 20):
        hdr_end = 1 << 16
    words = (ctypes.c_int * (hdr_end // 4)).from_address(base)
    found = [off for off in range(0, hdr_end - 40 + 1, 64)
             if words[off // 4 + MUTEX_KIND_WORD] == MUTEX_ROBUST_PSHARED]
    assert found, "no robust process-shared mutex in the arena header (layout changed?)"
    return base + found[-1]


def kill_child(p, lock_addr: int, rng: random.Random, find_lock: bool, budget: float = 3.0) -> bool:
    """SIGKILL child ``p``; True if it died holding the arena lock.

    The child is stopped first and the mutex's owner word read: a stopped
    child cannot take or release the lock, so the answer is measured, not
    guessed.  With ``find_lock``, a child found outside the lock is let run a
    little and stopped again, until it is found inside (for ``budget`` s).
    """
    word = ctypes.c_int.from_address(lock_addr + 4 * MUTEX_LOCK_WORD)
    deadline = time.monotonic() + budget
    while True:
        sigstop(p.pid)
        held = word.value & FUTEX_TID_MASK == p.pid
        if held or not find_lock or time.monotonic() > deadline:
            break
        os.kill(p.pid, signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.0002))
    kill_and_join(p)
    return held


# ------------------------------------------------- random kills, many times


def _hammer(name, seed, ready):
    s = TieredStore.attach(name)
    rng = random.Random(seed)
    keys = [f"h{i}" for i in range(8)]
    held = []
    ready.set()
    while True:
        r = rng.random()
        k = rng.choice(keys)
        if r < 0.45:
            s.put(k, make_value(rng, 4, 18))        # 128 B .. 2 MiB: both put paths
        elif r < 0.75:
            v = s.get(k)
            if v is not None:
                check_value(v)
                held.append(v)
                if len(held) > 3:
                    held.pop(0)
            v = None
        elif r < 0.85:
            for v in s.mget(rng.sample(keys, 3)):
                if v is not None:
                    check_value(v)
            v = None
        else:
            s.delete(k)


def test_kill_hammering_processes(mp_context, make_store, store_name):
    s = make_store(dram="48MiB")
    lock = _mutex_addr(s)
    rng = random.Random(7)
    kills = 16 if mp_context.get_start_method() == "fork" else 5
    in_lock = 0                                    # kills that landed inside the arena lock
    for i in range(kills):
        ready = mp_context.Event()
        p = mp_context.Process(target=_hammer, args=(store_name, i, ready), daemon=True)
        p.start()
        try:
            wait_or_die(ready, p)
            time.sleep(rng.uniform(0.002, 0.06))
            assert p.is_alive(), f"hammer child died on its own (exit code {p.exitcode})"
            in_lock += kill_child(p, lock, rng, find_lock=not in_lock)
        finally:
            kill_and_join(p)
        assert p.exitcode == -signal.SIGKILL
        # The survivor carries on: puts and gets work, invariants hold.
        s.put("probe", make_value(rng))            # (recovers here if the child died in the lock)
        check_value(s["probe"])
        assert s.stats()["recoveries"] == in_lock, (i, in_lock, s.stats())
        s.check()
        for k in s.keys(prefix="h"):
            v = s.get(k)
            if v is not None:
                check_value(v)
            v = None
        st = s.stats()
        assert st["pinned_bytes"] == 0 and st["processes"] == 1, (i, st)
        assert raw_stats(s).reserved == 0, i
    assert in_lock >= 1, f"no kill of {kills} landed inside the arena lock: nothing tested recovery"
    assert_clean(s)


def _c_put_small_loop(name, ready):
    """Tiny puts straight through the C core: most of the time is spent inside the lock."""
    s = TieredStore.attach(name)
    a = s._arena
    buf = bytearray(65536)
    keys = [f"c{i}".encode() for i in range(16)]
    i = 0
    ready.set()
    while True:
        k = keys[i % 16]
        n = 1024 + (i * 4099) % 64000
        buf[:n] = bytes([i % 251 + 1]) * n
        a.put(k, b"B", memoryview(buf)[:n], n, 0, 0.0)   # None (no room) is fine too
        if i % 3 == 0:
            a.delete(keys[(i * 7) % 16])
        i += 1


def test_kill_in_tight_put_small_loop(mp_context, make_store, store_name):
    s = make_store(dram="8MiB")
    lock = _mutex_addr(s)
    rng = random.Random(11)
    kills = 24 if mp_context.get_start_method() == "fork" else 5
    in_lock = 0                                    # kills that landed inside the arena lock
    for i in range(kills):
        ready = mp_context.Event()
        p = mp_context.Process(target=_c_put_small_loop, args=(store_name, ready), daemon=True)
        p.start()
        try:
            wait_or_die(ready, p)
            time.sleep(rng.uniform(0.001, 0.03))
            assert p.is_alive(), f"child died on its own (exit code {p.exitcode})"
            in_lock += kill_child(p, lock, rng, find_lock=not in_lock)
        finally:
            kill_and_join(p)
        # A kill inside the lock is recovered on our next call, exactly once; others never.
        s.check()
        assert s.stats()["recoveries"] == in_lock, (i, in_lock, s.stats())
        for k in list(s.keys(prefix="c")):
            v = s.get(k)
            if v is not None:
                b = np.frombuffer(v, dtype=np.uint8)
                assert 1024 <= len(b) <= 65024 and np.all(b == b[0]), f"torn small value under {k!r}"
                del b
            del v
        s.put("probe", b"x" * 5000)
        assert bytes(s["probe"]) == b"x" * 5000
        s.stats()                                  # sweeps a reservation the dead child left
        assert raw_stats(s).reserved == 0
    assert in_lock >= 1, f"no kill of {kills} landed inside the arena lock: nothing tested recovery"
    assert_clean(s)


# --------------------------------------------- deterministic lock-holder death


def _lock_and_hang(name, ready, corrupt_block):
    """Take the arena mutex (as a C call would) and hang; optionally emulate a
    death inside free_block(): the block's state already says FREE, nothing
    else has been done yet."""
    s = TieredStore.attach(name)
    libc = _libc()
    addr = _mutex_addr(s)
    assert libc.pthread_mutex_lock(addr) == 0
    if corrupt_block:
        state = ctypes.c_uint32.from_address(s._arena.addr + corrupt_block + BLK_STATE_OFFSET)
        assert state.value == 0x2D       # ST_LIVE
        state.value = ST_FREE
    ready.set()
    time.sleep(120)


def test_kill_while_holding_arena_lock(mp_context, make_store, store_name):
    s = make_store()
    rng = random.Random(3)
    vals = {f"k{i}": make_value(rng, 4, 16) for i in range(20)}
    vals["k0"] = make_value(rng, 10, 12)            # large enough to be read through a pin
    for k, v in vals.items():
        s.put(k, v)
    keep = s["k0"]                                  # a pin of ours must survive recovery
    assert s.stats()["pinned_bytes"] >= keep.nbytes
    assert s.stats()["recoveries"] == 0
    ready = mp_context.Event()
    p = mp_context.Process(target=_lock_and_hang, args=(store_name, ready, 0), daemon=True)
    p.start()
    try:
        wait_or_die(ready, p)
        libc = _libc()
        assert libc.pthread_mutex_trylock(_mutex_addr(s)) == EBUSY, "the child should hold the arena lock"
    finally:
        kill_and_join(p)
    # The next call inherits the lock with EOWNERDEAD and rebuilds the arena.
    s.put("after", b"ok")
    st = s.stats()
    assert st["recoveries"] == 1, st
    s.check()
    assert bytes(s["after"]) == b"ok"
    for k, v in vals.items():
        np.testing.assert_array_equal(s[k], v)
    assert st["pinned_bytes"] >= keep.nbytes
    np.testing.assert_array_equal(keep, vals["k0"])
    # Our pin survived the rebuild: the block stays ours after a delete.
    assert s.delete("k0")
    assert s.stats()["orphans"] == 1
    np.testing.assert_array_equal(keep, vals["k0"])
    del keep
    gc.collect()
    assert s.stats()["recoveries"] == 1
    assert_clean(s)


def test_recovery_after_death_inside_free_block(mp_context, make_store, store_name):
    """Heap ``[A free][B][C][rest free]``; a process deleting B dies inside
    free_block() right after it marked B free (before merging it with A).  The
    survivor's recovery must merge A and B and leave C's back link right."""
    s = make_store(dram="4MiB")
    s["a"] = b"a" * 1000
    s["b"] = b"b" * 1000
    s["c"] = b"c" * 1000
    assert s.delete("a")
    info = s._arena.get(b"b", 0)
    block_b = info.block_off
    s.check()
    ready = mp_context.Event()
    p = mp_context.Process(target=_lock_and_hang, args=(store_name, ready, block_b), daemon=True)
    p.start()
    try:
        wait_or_die(ready, p)
    finally:
        kill_and_join(p)
    assert "b" not in s            # recovery ran here
    assert s.stats()["recoveries"] == 1
    s.check()
    assert bytes(s["c"]) == b"c" * 1000
    # Keep using the heap around the rebuilt blocks.
    assert s.delete("c")
    s.check()
    for i in range(50):
        s.put(f"x{i}", bytes([i]) * (500 + 97 * i))
        if i % 3 == 0:
            s.delete(f"x{i // 2}")
    s.check()
    assert_clean(s)


# ------------------------------------------------------- views of the dead


def _hold_views(name, keys, ready):
    s = TieredStore.attach(name)
    views = [s[k] for k in keys]
    views.append(views[0][100:200])     # a derived view too
    for v in views[:-1]:
        check_value(v)
    ready.set()
    time.sleep(120)


def test_killed_process_pins_are_reclaimed(mp_context, make_store, store_name):
    s = make_store(dram="32MiB")
    rng = random.Random(5)
    keys = ["v0", "v1", "v2"]
    for k in keys:
        s.put(k, make_value(rng, 19.5, 19.5))            # 5.7 MiB each
    cap = s.stats()["tiers"]["dram"]["capacity"]
    ready = mp_context.Event()
    p = mp_context.Process(target=_hold_views, args=(store_name, keys, ready), daemon=True)
    p.start()
    try:
        wait_or_die(ready, p)
        st = s.stats()
        assert st["pinned_bytes"] >= 3 * 5 * 2**20 and st["processes"] >= 2, st
        for k in keys:
            assert s.delete(k)
        st = s.stats()
        assert st["orphans"] == 3, st
        big = np.ones(int(cap * 0.8), dtype=np.uint8)
        with pytest.raises(MemoryError):       # the live child's views still hold the space
            s.put("big", big)
    finally:
        kill_and_join(p)
    st = s.stats()                                  # sweeps the dead child
    assert st["pinned_bytes"] == 0 and st["orphans"] == 0 and st["processes"] == 1, st
    s.put("big", big)                               # needs the space the dead child pinned
    assert s["big"].nbytes == big.nbytes
    assert_clean(s)


# ------------------------------------------------------- death during a put


def _big_put(name, ready, nbytes, fill):
    s = TieredStore.attach(name)
    value = np.full(nbytes // 8, np.uint64(fill), dtype=np.uint64)
    value[0] = len(value)
    value[1] = np.uint64(fill) ^ MAGIC
    ready.set()
    s.put("big", value)
    time.sleep(120)


def test_kill_during_large_put(mp_context, make_store, store_name):
    s = make_store(dram="512MiB")
    old = np.full(8 << 20, np.uint64(1111), dtype=np.uint64)          # 64 MiB
    old[0] = len(old)
    old[1] = np.uint64(1111) ^ MAGIC
    s.put("big", old)
    cap = s.stats()["tiers"]["dram"]["capacity"]
    used_before = s.stats()["tiers"]["dram"]["used"]
    mid_put = 0
    delays = [0.004, 0.008, 0.012, 0.018] if mp_context.get_start_method() == "fork" else [0.006, 0.014]
    for i, delay in enumerate(delays):
        fill = 2000 + i
        ready = mp_context.Event()
        p = mp_context.Process(target=_big_put, args=(store_name, ready, 256 << 20, fill), daemon=True)
        p.start()
        try:
            wait_or_die(ready, p)
            # Kill `delay` after the copy started (its reservation shows), so on
            # a loaded machine the kills still land inside the copy, at varied depths.
            deadline = time.monotonic() + 10
            while not raw_stats(s).reserved and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(delay / 4)
        finally:
            kill_and_join(p)
        reserved = raw_stats(s).reserved
        mid_put += reserved
        v = s.get("big")
        got = check_value(v)             # never torn: the old value or (kill too late) the new one
        if reserved:
            assert got == 1111, "the key changed while its new value was still being written"
        assert got in (1111, fill)
        committed = got == fill
        del v
        st = s.stats()                   # sweep: the dead writer's reservation is freed
        assert raw_stats(s).reserved == 0
        assert st["pinned_bytes"] == 0 and st["processes"] == 1, st
        s.check()
        if committed:
            s.put("big", old)
        assert s.stats()["tiers"]["dram"]["used"] == used_before
    assert mid_put >= 1, "no kill landed during the copy; adjust the delays"
    np.testing.assert_array_equal(s["big"][:4], old[:4])
    assert s.delete("big")
    st = s.stats()
    assert st["tiers"]["dram"]["largest_free"] == cap, st
    whole = np.zeros(cap - 256, dtype=np.uint8)           # needs (nearly) every byte of the heap
    s.put("whole", whole)
    assert s["whole"].nbytes == cap - 256
    assert_clean(s)


# --------------------------------------------- atomic overwrite, killed writer


def _overwriter(name, seed, ready):
    s = TieredStore.attach(name)
    rng = random.Random(seed)
    ready.set()
    while True:
        s.put("hot", make_value(rng, 7, 20))            # 1 KiB .. 8 MiB


def _hot_reader(name, stop):
    s = TieredStore.attach(name)
    seen = set()
    reads = 0
    held = []
    while not stop.is_set():
        v = s["hot"]                 # the key never disappears
        seen.add(check_value(v))
        reads += 1
        held.append(v)
        if len(held) > 2:
            check_value(held.pop(0))  # a held view is still complete after overwrites
        v = None
    held.clear()
    gc.collect()
    s.close()
    return reads, len(seen)


def test_overwrite_is_atomic_when_writer_is_killed(mp_context, make_store, store_name):
    s = make_store(dram="96MiB")
    s.put("hot", make_value(random.Random(0), 7, 20))
    stop = mp_context.Event()
    rp, rq = start(mp_context, _hot_reader, store_name, stop)
    rng = random.Random(9)
    try:
        for i in range(3):
            ready = mp_context.Event()
            w = mp_context.Process(target=_overwriter, args=(store_name, 50 + i, ready), daemon=True)
            w.start()
            try:
                wait_or_die(ready, w)
                time.sleep(rng.uniform(0.15, 0.35))
                assert w.is_alive(), f"writer died on its own (exit code {w.exitcode})"
            finally:
                kill_and_join(w)
            check_value(s["hot"])
        time.sleep(0.1)
        stop.set()
        reads, distinct = finish(rp, rq)
    finally:
        stop.set()
        if rp.is_alive():
            rp.join(10)
        kill_and_join(rp)
    assert reads > 10 and distinct > 2, (reads, distinct)
    check_value(s["hot"])
    assert_clean(s)


# ------------------------------------------------------------ owner death


def _owner(name, ready):
    s = TieredStore(name=name, dram="16MiB")
    s["a"] = b"alpha"
    s.put("arr", np.arange(10000, dtype=np.int32))
    ready.set()
    time.sleep(120)


def test_owner_killed_segment_survives_and_can_be_adopted(mp_context, store_name):
    ready = mp_context.Event()
    p = mp_context.Process(target=_owner, args=(store_name, ready), daemon=True)
    p.start()
    try:
        try:
            wait_or_die(ready, p)
        finally:
            kill_and_join(p)
        assert seg_exists(store_name), "a crashed owner's segment must survive"
        s = TieredStore.attach(store_name)
        assert sorted(s.keys()) == ["a", "arr"]
        assert bytes(s["a"]) == b"alpha"
        np.testing.assert_array_equal(s["arr"], np.arange(10000))
        st = s.stats()
        assert st["processes"] == 1, st          # the dead owner's slot was swept
        s.check()
        s.close()
        gc.collect()
        assert seg_exists(store_name), "an attached process's close only detaches"

        adopter = TieredStore(name=store_name, dram="16MiB")
        assert bytes(adopter["a"]) == b"alpha"   # adopted as is, not recreated
        adopter["b"] = b"beta"
        other = TieredStore.attach(store_name)
        assert bytes(other["b"]) == b"beta"
        other.close()
        assert seg_exists(store_name)
        adopter.close()
        gc.collect()
        assert not seg_exists(store_name), "the adopter owns the store: its close unlinks it"
    finally:
        dram.destroy(store_name)


def _owner_with_forked_helper(name, ready):
    """Owner that forks a helper; the helper closes the store handle it inherited."""
    s = TieredStore(name=name, dram="4MiB")
    s["a"] = b"alpha"
    pid = os.fork()
    if pid == 0:
        try:
            s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(s["a"]) == b"alpha"
    ready.set()
    time.sleep(120)


def test_forked_helper_close_does_not_mark_owner_closed(store_name):
    """The owner forks a helper that closes its inherited handle, then the owner
    is SIGKILLed.  The owner never closed: an attached process's close must
    only detach and the crashed owner's store must survive."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_owner_with_forked_helper, args=(store_name, ready), daemon=True)
    p.start()
    try:
        try:
            wait_or_die(ready, p)
        finally:
            kill_and_join(p)
        assert seg_exists(store_name)
        s = TieredStore.attach(store_name)
        assert bytes(s["a"]) == b"alpha"
        s.close()
        gc.collect()
        survived = seg_exists(store_name)
    finally:
        dram.destroy(store_name)
    assert survived, "the attached process's close unlinked a crashed owner's store"


def _attach_and_hang(name, ready):
    s = TieredStore.attach(name)
    assert bytes(s["k"]) == b"v"
    ready.set()
    time.sleep(120)


def test_owner_close_with_a_killed_attacher_leaves_nothing(mp_context, store_name):
    """The owner closes while another process is attached: the name goes at
    once (the attacher keeps its mapping), so the attacher's SIGKILL leaves
    nothing behind, and the name is free for a fresh store."""
    owner = TieredStore(name=store_name, dram="4MiB")
    owner["k"] = b"v"
    ready = mp_context.Event()
    p = mp_context.Process(target=_attach_and_hang, args=(store_name, ready), daemon=True)
    p.start()
    try:
        try:
            wait_or_die(ready, p)
            owner.close()
            assert not seg_exists(store_name)
        finally:
            kill_and_join(p)
        assert not seg_exists(store_name)
        s = TieredStore(name=store_name, dram="4MiB")
        assert "k" not in s and len(s) == 0       # a fresh store, not the old one
        s["new"] = b"n"
        assert bytes(s["new"]) == b"n"
        s.check()
        s.close()
        gc.collect()
        assert not seg_exists(store_name), "the new owner's close unlinks the store"
    finally:
        dram.destroy(store_name)
