"""The SSD tier across restarts and crashes, with real processes and SIGKILL.

* An owner SIGKILLed with objects in DRAM and on SSD: the segment survives,
  ``TieredStore.attach(name)`` finds every object (it learns the SSD directory
  from the store's settings in the arena), and adopting the store keeps them.
* A new store over an old SSD directory (the old store fully gone) finds what
  had been spilled, and nothing that had been deleted, overwritten or promoted.
* SIGKILL in the middle of spills and promotions, several times: every put
  that returned before the kill is there, unchanged; a put in flight left the
  old or the new value, never a torn one; the arena is consistent, and after
  an adopt (which vacuums) the payload files on disk are exactly those of the
  SSD-resident objects.  The child marks, in shared memory, when it is inside
  a spill or a promotion; the parent kills it while a mark is up and reads
  the mark after the death, so the test knows that kills did land mid-move.

Children are module-level functions (``spawn`` imports this module) and write
what they did to a log file with ``os.write`` before and after every put, so
the parent knows what was committed when the kill landed.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time
from typing import Any, Callable

import numpy as np
import pytest

from yrcache import Tier, TieredStore
from yrcache.tiers import dram
from procs import get_report, kill_and_join, seg_exists, child_entry  # noqa: E402

MAGIC = np.uint64(0x5EEDC0DE12345678)
VAL = 200_000


# ------------------------------------------------------------------ helpers


def arr(i: int, n: int = VAL) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(i & 0xFFFF)).astype(np.uint8)


def payload_files(ssd) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(ssd, "data")):
        out += [os.path.join(root, f) for f in files]
    return out


def make_value(n_words: int, fill: int) -> np.ndarray:
    """Self-checking uint64 array ``[n, fill ^ MAGIC, fill, fill, ...]``."""
    a = np.full(n_words, np.uint64(fill), dtype=np.uint64)
    a[0] = n_words
    a[1] = np.uint64(fill) ^ MAGIC
    return a


def check_value(v) -> int:
    """Assert ``v`` is a complete self-checking value; return its fill word."""
    assert isinstance(v, np.ndarray) and v.dtype == np.uint64 and v.ndim == 1, type(v)
    n = len(v)
    assert n >= 3 and int(v[0]) == n, f"torn value: length word {int(v[0])} in an array of {n}"
    fill = v[1] ^ MAGIC
    bad = np.flatnonzero(v[2:] != fill)
    assert bad.size == 0, f"torn value: {bad.size} of {n - 2} words differ from the fill"
    return int(fill)


@pytest.fixture
def cleanup_name(store_name):
    """``store_name``, destroyed however the test ends (conftest then checks it is gone)."""
    yield store_name
    gc.collect()
    dram.destroy(store_name)


# ----------------------------------------------- owner killed, then re-attach


def _owner_fills_both_tiers(name, ssd, q):
    s = TieredStore(name=name, dram="1MiB", ssd=ssd, ssd_size="32MiB")
    for i in range(10):
        s.put(f"k{i}", arr(i))                       # later ones push earlier ones to SSD
    s.put("direct", arr(100), tier=Tier.SSD)
    s.put("small-ssd", b"inline on ssd", tier=Tier.SSD)
    s.put("small-dram", b"in the arena")
    s.put("vip", arr(101), priority=10)
    s.put("deleted", arr(102), tier=Tier.SSD)
    s.delete("deleted")
    s.put("over", arr(103), tier=Tier.SSD)
    s.put("over", arr(104), tier=Tier.SSD)           # the newest generation only
    s.get("k0")
    s.get("k0")                                      # promoted back to DRAM
    held = s["k1"]                                   # a pin the dead owner never releases  # noqa: F841
    tiers = {k: int(s.tier_of(k)) for k in s}
    q.put(("ok", tiers))
    time.sleep(300)


EXPECTED = {**{f"k{i}": arr(i) for i in range(10)}, "direct": arr(100), "vip": arr(101),
            "over": arr(104), "small-ssd": b"inline on ssd", "small-dram": b"in the arena"}


def check_value_of(s, k):
    got, want = s[k], EXPECTED[k]
    if isinstance(want, bytes):
        assert isinstance(got, memoryview) and got.tobytes() == want, k
    else:
        assert isinstance(got, np.ndarray), (k, type(got))
        np.testing.assert_array_equal(got, want, err_msg=k)


def check_all(s):
    assert sorted(s) == sorted(EXPECTED)
    for k in EXPECTED:
        check_value_of(s, k)
    assert "deleted" not in s


def test_owner_killed_with_dram_and_ssd_objects_is_reattached(mp_context, cleanup_name, tmp_path):
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    q = mp_context.Queue()
    p = mp_context.Process(target=child_entry, args=(q, _owner_fills_both_tiers, (name, ssd, q)), daemon=True)
    p.start()
    try:
        tiers = get_report(p, q)
    finally:
        kill_and_join(p)
    assert Tier.SSD in tiers.values() and Tier.DRAM in tiers.values(), tiers
    assert tiers["direct"] == tiers["small-ssd"] == tiers["over"] == Tier.SSD
    assert seg_exists(name), "a killed owner's segment must survive"

    s = TieredStore.attach(name)        # no ssd= given: the store's settings name it
    try:
        assert {k: int(s.tier_of(k)) for k in s} == tiers     # nothing moved by attaching
        check_all(s)                    # (reads may promote: k1 was read once before the kill)
        st = s.stats()
        now = [s.tier_of(k) for k in s]
        assert st["processes"] == 1, st                        # the dead owner was swept
        assert st["pinned_bytes"] == 0, st                     # and its pin released
        assert st["tiers"]["ssd"]["objects"] == now.count(Tier.SSD)
        assert st["tiers"]["dram"]["objects"] == now.count(Tier.DRAM)
        s.check()
        # the attached handle works on both tiers
        s.put("after", arr(200), tier=Tier.SSD)
        np.testing.assert_array_equal(s["after"], arr(200))
        s.delete("after")
    finally:
        s.close()
    assert seg_exists(name)

    # adopting it (a new owner by name) keeps everything and vacuums
    s = TieredStore(name=name, dram="1MiB")
    try:
        check_all(s)
        n_ssd = s.stats()["tiers"]["ssd"]["objects"]     # (stats flushes deferred removals)
        big_on_ssd = [k for k in s if s.tier_of(k) == Tier.SSD and not k.startswith("small")]
        assert len(payload_files(ssd)) == len(big_on_ssd) <= n_ssd
        s.check()
    finally:
        s.destroy()
    assert not seg_exists(name)


# ------------------------------------------------ new store, old SSD directory


def test_new_store_over_old_ssd_directory(store_name, tmp_path):
    ssd = str(tmp_path / "ssd")
    s = TieredStore(name=store_name, dram="1MiB", ssd=ssd, ssd_size="32MiB")
    try:
        for i in range(10):
            s.put(f"k{i}", arr(i))
        s.put("direct", arr(100), tier=Tier.SSD)
        s.put("small", b"inline", tier=Tier.SSD)
        s.put("gone", arr(101), tier=Tier.SSD)
        s.delete("gone")
        s.put("over", arr(102), tier=Tier.SSD)
        s.put("over", arr(103), tier=Tier.SSD)
        s.put("moved-up", arr(104), tier=Tier.SSD)
        s["moved-up"]
        s["moved-up"]
        s.put("expires", arr(105), tier=Tier.SSD, ttl=0.3)
        on_ssd = sorted(k for k in s if s.tier_of(k) == Tier.SSD and k != "expires")
        assert s.tier_of("moved-up") == Tier.DRAM
        assert {"direct", "small", "over"} <= set(on_ssd) and len(on_ssd) >= 8
    finally:
        s.destroy()
    assert not seg_exists(store_name)
    time.sleep(0.35)

    want = {**{f"k{i}": arr(i) for i in range(10)}, "direct": arr(100), "over": arr(103)}
    for name in (store_name, f"{store_name}-other"):    # the same name or another one
        s = TieredStore(name=name, dram="1MiB", ssd=ssd, ssd_size="32MiB")
        try:
            assert sorted(s) == on_ssd, "exactly what was on SSD comes back"
            assert len(s) == len(on_ssd)
            for k in on_ssd:
                assert s.tier_of(k) == Tier.SSD
                if k == "small":
                    assert s[k].tobytes() == b"inline"
                else:
                    np.testing.assert_array_equal(s[k], want[k], err_msg=k)
            st = s.stats()["tiers"]["ssd"]
            assert st["objects"] == len(on_ssd)
            s.flush()
            assert len(payload_files(ssd)) == len(on_ssd) - 1     # all but "small"
            s.check()
            if name == store_name:
                s["k1"]
                s["k1"]                 # promoted: its disk copy goes
                on_ssd.remove("k1")
        finally:
            s.destroy()


def test_killed_owner_segment_destroyed_then_new_store_over_its_ssd(mp_context, cleanup_name, tmp_path):
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    q = mp_context.Queue()
    p = mp_context.Process(target=child_entry, args=(q, _owner_fills_both_tiers, (name, ssd, q)), daemon=True)
    p.start()
    try:
        tiers = get_report(p, q)
    finally:
        kill_and_join(p)
    assert dram.destroy(name)            # like `yrcache destroy NAME`: the DRAM tier is gone
    on_ssd = sorted(k for k, t in tiers.items() if t == Tier.SSD)
    s = TieredStore(name=name, dram="1MiB", ssd=ssd)
    try:
        assert sorted(s) == on_ssd
        for k in on_ssd:
            check_value_of(s, k)
        s.check()
    finally:
        s.destroy()


# ------------------------------------------------------ SIGKILL mid-spill


KEYS = [f"w{i}" for i in range(14)]
IDLE, SPILL, PROMOTE = 0, 1, 2          # what the churn child is doing (its ``moving`` mark)


def _mark_moves(moving) -> None:
    """Make this process set ``moving.value`` to SPILL / PROMOTE for the whole of
    every spill / promotion (restoring the outer mark when they nest: a promotion
    may spill to make room), so whoever kills it can read what it died in."""
    from yrcache.mover import Mover

    def marked(fn, mark):
        def move(*a, **kw):
            outer = moving.value
            moving.value = mark
            try:
                return fn(*a, **kw)
            finally:
                moving.value = outer
        return move

    Mover.spill = marked(Mover.spill, SPILL)
    Mover.promote_ssd = marked(Mover.promote_ssd, PROMOTE)


def _churn(name, ssd, log_path, seed, ready, adopt, moving=None):
    """Owner (creates or adopts the store) that spills and promotes nonstop."""
    if moving is not None:
        _mark_moves(moving)
    if adopt:
        s = TieredStore(name=name, dram="1MiB")
    else:
        s = TieredStore(name=name, dram="1MiB", ssd=ssd, ssd_size="64MiB")
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    n = 0
    while True:
        k = rng.choice(KEYS)
        r = rng.random()
        if r < 0.6:
            fill = rng.getrandbits(62) | 1
            words = rng.randrange(9_000, 40_000)             # 72-320 kB
            tier = Tier.SSD if r < 0.15 else None
            os.write(fd, f"S {k} {fill}\n".encode())
            s.put(k, make_value(words, fill), tier=tier, priority=rng.randrange(3))
            os.write(fd, f"D {k} {fill}\n".encode())
            n += 1
            if n == 12:
                ready.set()
        elif r < 0.95:
            v = s.get(k)                                     # reads promote
            if v is not None:
                check_value(v)
            v = None
        else:
            os.write(fd, f"X {k} 0\n".encode())
            s.delete(k)
            os.write(fd, f"Y {k} 0\n".encode())


def allowed_values(log_path) -> dict[str, set]:
    """Per key: the values it may hold now (None = absent)."""
    state: dict[str, set] = {}
    with open(log_path) as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split()
        if len(parts) != 3:
            continue                     # a line cut by the kill (never happens with os.write)
        op, k, fill = parts[0], parts[1], int(parts[2])
        cur = state.get(k, {None})
        if op == "S":
            state[k] = set(cur) | {fill}          # in flight: old or new
        elif op == "D":
            state[k] = {fill}
        elif op == "X":
            state[k] = set(cur) | {None}
        elif op == "Y":
            state[k] = {None}
    return state


def verify_against_log(s, log_path) -> dict[str, int | None]:
    allowed = allowed_values(log_path)
    found = {}
    for k in KEYS:
        v = s.get(k)
        found[k] = None if v is None else check_value(v)
        del v
        ok = allowed.get(k, {None})
        assert found[k] in ok, (
            f"{k}: holds {found[k]}, but the log allows only {ok} (lost or resurrected value)")
    assert set(s) <= set(KEYS)
    return found


def test_sigkill_in_the_middle_of_spills(cleanup_name, tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    log_path = str(tmp_path / "log")
    rng = random.Random(1234)
    # the move each round's kill waits for (None: kill at the random moment, wherever it lands)
    wanted = [SPILL, PROMOTE, SPILL, PROMOTE, None]
    died_in = []
    for round_, want in enumerate(wanted):
        ready = ctx.Event()
        moving = ctx.RawValue("i", IDLE)
        p = ctx.Process(target=_churn, args=(name, ssd, log_path, round_, ready, round_ > 0, moving),
                        daemon=True)
        p.start()
        try:
            deadline = time.monotonic() + 60
            while not ready.wait(0.05):
                assert p.is_alive(), f"churn child died with code {p.exitcode}"
                assert time.monotonic() < deadline, "churn child made no progress"
            time.sleep(rng.uniform(0.0, 0.4))
            deadline = time.monotonic() + 3
            while want is not None and moving.value != want and time.monotonic() < deadline:
                pass                    # spin, not sleep: a move is over within about a millisecond
            p.kill()
        finally:
            kill_and_join(p)
        died_in.append(moving.value)    # frozen by the death: what the child was really doing
        assert seg_exists(name)
        s = TieredStore.attach(name)
        try:
            s.check()
            verify_against_log(s, log_path)
            st = s.stats()
            assert st["processes"] == 1 and st["pinned_bytes"] == 0, st
        finally:
            s.close()
        del s
        gc.collect()
    # measured, not assumed: some kills did land in the middle of a move
    assert died_in.count(SPILL) >= 1 and died_in.count(PROMOTE) >= 1, (
        f"kills landed in {died_in} (0 idle, 1 spill, 2 promotion): not mid-spill and mid-promotion")

    # adopt: the adopter vacuums (nobody else is attached); then the disk holds
    # exactly one payload file per SSD-resident object
    s = TieredStore(name=name, dram="1MiB")
    try:
        on_ssd = [k for k in s if s.tier_of(k) == Tier.SSD]     # looking does not promote
        s.flush()                       # file removals may be deferred; flush waits for them
        files = payload_files(ssd)
        st = s.stats()
        assert st["tiers"]["ssd"]["objects"] == len(on_ssd)
        assert (st["tiers"]["ssd"]["used"] > 0) == bool(on_ssd)
        assert len(files) == len(on_ssd), (
            f"{len(files)} payload files for {len(on_ssd)} SSD objects after vacuum: stray copies left")
        assert os.listdir(os.path.join(ssd, "tmp")) == []
        found = verify_against_log(s, log_path)
        s.check()
        # everything still readable, promotable and deletable
        for k in list(s):
            check_value(s[k])
            check_value(s[k])
        assert sum(v is not None for v in found.values()) == len(s)
        s.clear()
        s.flush()
        assert len(s) == 0 and payload_files(ssd) == []
        assert s.stats()["tiers"]["ssd"]["used"] == 0
        s.check()
    finally:
        s.destroy()


# ------------------------------------------- deterministic kill points


def _die_at(name, ssd, where, ready):
    """Owner that fills the store, then SIGKILLs itself at ``where`` during a move."""
    from yrcache.tiers import disk

    s = TieredStore(name=name, dram="1MiB", ssd=ssd, ssd_size="32MiB")
    for i in range(3):
        s.put(f"k{i}", arr(i))
    s.put("old", arr(50), tier=Tier.SSD)
    ready.set()

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "payload file renamed, index not committed":
        disk.DiskTier._commit = die
        s.put("new", arr(60), tier=Tier.SSD)
    elif where == "on disk, spill stub not committed":
        real = disk.DiskTier.put

        def put_then_die(self, *a, **k):
            real(self, *a, **k)
            die()

        disk.DiskTier.put = put_then_die
        for i in range(3, 8):
            s.put(f"k{i}", arr(i))                     # the first spill dies
    elif where == "index committed, old payload not unlinked":
        disk.DiskTier.delete = die
        s.put("old", arr(51), tier=Tier.SSD)           # the new stub retires the old copy
    time.sleep(300)                                    # not reached


def _kill_at(where: str, die: Callable, *args: Any) -> None:
    """Run ``die(*args, where, ready)`` in a forked child; check it was SIGKILLed at ``where``."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=die, args=(*args, where, ready), daemon=True)
    p.start()
    p.join(60)
    if p.is_alive():
        kill_and_join(p)
        pytest.fail(f"the child never reached {where!r}")
    assert p.exitcode == -signal.SIGKILL, f"the child did not die at {where!r} (exit code {p.exitcode})"
    assert ready.is_set()


@pytest.mark.parametrize("where", ["payload file renamed, index not committed",
                                   "on disk, spill stub not committed",
                                   "index committed, old payload not unlinked"])
def test_kill_mid_move_leaves_no_stray_file_after_adopt(cleanup_name, tmp_path, where):
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    _kill_at(where, _die_at, name, ssd)
    s = TieredStore(name=name, dram="1MiB")           # adopt: vacuums
    try:
        s.check()
        for i in range(3):
            np.testing.assert_array_equal(s[f"k{i}"], arr(i))
        old = s["old"]
        assert np.array_equal(old, arr(50)) or np.array_equal(old, arr(51))
        del old
        assert "new" not in s
        on_ssd = [k for k in s if s.tier_of(k) == Tier.SSD]
        s.flush()
        files = payload_files(ssd)
        assert len(files) == len(on_ssd), (
            f"killed at {where!r}: {len(files)} payload files for {len(on_ssd)} SSD objects "
            "after the adopter's vacuum")
        assert s.stats()["tiers"]["ssd"]["used"] == VAL * len(on_ssd)
    finally:
        s.destroy()


def test_copies_of_retired_stubs_survive_a_killed_drainer_listed(cleanup_name, tmp_path):
    """A process killed while freeing the disk copies of retired stubs leaves
    those stubs on the retire list (they leave it only once their bytes are
    gone), so the next drain of any process deletes the copies: an attacher's
    ``check()`` finds no stray copy, with no vacuum."""
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    _kill_at("index committed, old payload not unlinked", _die_at, name, ssd)
    s = TieredStore.attach(name)                       # no adopt: no vacuum
    try:
        s.check()                                      # its drain deletes the old copy
        np.testing.assert_array_equal(s["old"], arr(51))
        on_ssd = [k for k in s if s.tier_of(k) == Tier.SSD]
        assert len(payload_files(ssd)) == len(on_ssd) == 1
    finally:
        s.close()


# ------------------------------- kills mid-move while the owner lives (no adopt, no vacuum)


def _attach_and_die(name, where, ready):
    """Attacher that SIGKILLs itself at ``where`` in a spill, a delete or a promotion."""
    from yrcache.mover import Unlinker
    from yrcache.tiers import _diskio, disk

    s = TieredStore.attach(name)
    ready.set()

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "payload half written":
        def write_then_die(fd, data):
            os.write(fd, data[:4096])
            die()

        _diskio._os_write = write_then_die
        s.put("new", arr(60), tier=Tier.SSD)
    elif where == "payload file renamed, index not committed":
        disk.DiskTier._commit = die
        s.put("new", arr(60), tier=Tier.SSD)
    elif where == "index record removed, payload file not":
        real_unlink = os.unlink

        def unlink(path, *a, **k):
            if f"{os.sep}data{os.sep}" in os.fspath(path):
                die()
            return real_unlink(path, *a, **k)

        os.unlink = unlink
        s.put("old", arr(51), tier=Tier.SSD)     # retires the old copy: its delete dies
    elif where == "promoted, deferred removal not run":
        Unlinker.submit = lambda self, path: None   # the background thread never gets to it
        for _ in range(5):
            s["old"]
            if s.tier_of("old") == Tier.DRAM:
                die()
    time.sleep(300)                                  # not reached


@pytest.mark.parametrize("where", ["payload half written",
                                   "payload file renamed, index not committed",
                                   "index record removed, payload file not",
                                   "promoted, deferred removal not run"])
def test_kill_mid_move_leaves_no_file_behind_while_the_owner_lives(cleanup_name, tmp_path, where):
    """No adopt and no vacuum here: what the dead attacher left is found
    through the stubs it left (swept to the retire list) and its temp files."""
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    s = TieredStore(name=name, dram="1MiB", ssd=ssd, ssd_size="32MiB")
    try:
        for i in range(3):
            s.put(f"k{i}", arr(i))
        s.put("old", arr(50), tier=Tier.SSD)
        _kill_at(where, _attach_and_die, name)
        s.check()                                    # sweeps the dead attacher and drains
        s.flush()
        on_ssd = [k for k in s if s.tier_of(k) == Tier.SSD]
        files = payload_files(ssd)
        assert len(files) == len(on_ssd), f"killed at {where!r}: stray payload files {files}"
        assert os.listdir(os.path.join(ssd, "tmp")) == [], f"killed at {where!r}: temp files left"
        assert s.stats()["tiers"]["ssd"]["used"] == VAL * len(on_ssd)
        for i in range(3):
            np.testing.assert_array_equal(s[f"k{i}"], arr(i))
        assert "new" not in s
    finally:
        s.destroy()


def test_new_store_over_the_directory_removes_what_dead_writers_left(cleanup_name, tmp_path):
    """The segment (and its retire list) is gone with the store; a new store
    over the directory removes the payload file a killed writer published
    without a record."""
    name, ssd = cleanup_name, str(tmp_path / "ssd")
    _kill_at("payload file renamed, index not committed", _die_at, name, ssd)
    assert dram.destroy(name)
    assert len(payload_files(ssd)) == 2              # "old" and the dead writer's stray
    s = TieredStore(name=name, dram="1MiB", ssd=ssd)
    try:
        assert sorted(s) == ["old"]
        assert len(payload_files(ssd)) == 1
        s.check()
    finally:
        s.destroy()
