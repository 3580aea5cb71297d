"""Named words (``TieredStore.word``) and ``TieredStore.info``."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from yrcache import Tier, TieredStore
from procs import finish, start


def _wait_for_value(name, word, seen, want):
    s = TieredStore.attach(name)
    w = s.word(word)
    deadline = time.monotonic() + 30
    while w.value != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"value {w.value}, wanted {want}")
        w.wait(seen, 1.0)
        seen = w.seq
    s.close()
    return w.value


def test_a_word_wakes_another_process(make_store, store_name, mp_context):
    s = make_store()
    w = s.word("go")
    seen = w.seq
    p, q = start(mp_context, _wait_for_value, store_name, "go", seen, 42)
    time.sleep(0.2)
    assert w.cas(0, 42) and not w.cas(0, 7)      # compare-and-set: only the first succeeds
    w.wake()
    assert finish(p, q) == 42
    assert w.seq > seen


def test_words_are_per_name_and_persist_per_store(make_store, store_name):
    s = make_store()
    a, b = s.word("a"), s.word("b")
    a.cas(0, 1)
    b.cas(0, 2)
    seen_b = b.seq
    a.wake()
    assert b.seq == seen_b                       # waking one name wakes nobody else
    other = TieredStore.attach(store_name)
    assert other.word("a").value == 1 and other.word("b").value == 2
    other.close()
    assert not b.wait(seen_b, 0.05)               # timed out: nobody woke b
    assert len(s) == 0 and list(s.keys()) == []   # words are not keys


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\x00b", 5, None])
def test_word_names_are_checked(make_store, bad):
    s = make_store()
    with pytest.raises(ValueError, match="word names"):
        s.word(bad)


@pytest.mark.parametrize("bad", [2 ** 64, -1, 1.5, "1"])
def test_word_values_are_unsigned_64_bit(make_store, bad):
    w = make_store().word("w")
    for args in ((0, bad), (bad, 0)):
        with pytest.raises(ValueError, match=r"unsigned 64-bit value: (expected|desired) must be an int in 0\.\.2\*\*64-1"):
            w.cas(*args)
    assert w.cas(0, 2 ** 64 - 1) and w.value == 2 ** 64 - 1 and w.cas(2 ** 64 - 1, 0)


def test_info_describes_without_reading(make_store, tmp_path):
    s = make_store(ssd=tmp_path / "ssd")
    s.put("a", np.zeros((2, 3), np.float32), priority=5, ttl=60)
    s.put("b", b"xyz", tier=Tier.SSD)
    hits = s.stats()["hits"]
    a, b = s.info("a"), s.info("b")
    assert (a["tier"], a["nbytes"], a["kind"], a["dtype"], a["shape"], a["priority"]) == \
        (Tier.DRAM, 24, "ndarray", "<f4", (2, 3), 5)
    assert a["expire_at"] is not None and a["expire_at"] > time.time()
    assert (b["tier"], b["nbytes"], b["kind"], b["expire_at"]) == (Tier.SSD, 3, "bytes", None)
    assert s.info("missing") is None
    assert s.stats()["hits"] == hits                   # no read counted
    assert s.stats()["pinned_bytes"] == 0


# ---- node locks ------------------------------------------------------------------------
def _hold_lock(name, key, hold):
    """Hold ``node_lock(key)`` (a str) or ``node_locks(key)`` (a list) for ``hold`` seconds."""
    s = TieredStore.attach(name)
    with s.node_lock(key) if isinstance(key, str) else s.node_locks(key):
        s.word("locked").cas(0, 1)
        s.word("locked").wake()
        time.sleep(hold)
    s.close()
    return "released"


def _start_holder(mp_context, s, store_name, key, hold):
    """Start a ``_hold_lock`` child and return ``(process, queue)`` once it holds the lock."""
    w = s.word("locked")
    seen = w.seq
    p, q = start(mp_context, _hold_lock, store_name, key, hold)
    while w.value != 1:
        assert w.wait(seen, 30)
        seen = w.seq
    return p, q


def test_node_lock_excludes_other_processes_and_dies_with_its_holder(make_store, store_name, mp_context):
    import signal

    from procs import get_report

    s = make_store()
    w = s.word("locked")
    p, q = _start_holder(mp_context, s, store_name, "part-7", 0.8)
    t = time.monotonic()
    with s.node_lock("part-7"):                  # waits for the child to let go
        waited = time.monotonic() - t
    assert waited > 0.3, waited
    assert get_report(p, q) == "released"
    p.join(10)
    with s.node_lock("other"):                   # unrelated keys do not wait (threads may nest)
        pass
    # a holder killed while it holds the lock frees it: the kernel drops an OFD lock with its file
    w.cas(1, 0)
    p, q = _start_holder(mp_context, s, store_name, "part-8", 600)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    t = time.monotonic()
    with s.node_lock("part-8"):
        pass
    assert time.monotonic() - t < 5


def test_node_lock_timeout_gives_up_and_holds_nothing(make_store, store_name, mp_context):
    """With ``timeout``, a node lock held by another process raises ``TimeoutError`` once
    the time is up; ``node_locks`` then holds none of its keys (the free one included);
    the lock is taken as soon as its holder lets go; bad timeouts are refused."""
    import threading

    from procs import get_report

    s = make_store()
    p, q = _start_holder(mp_context, s, store_name, "held", 2.0)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="still held"):
        with s.node_lock("held", timeout=0.3):
            pass
    assert 0.25 < time.monotonic() - t < 1.5
    with pytest.raises(TimeoutError):
        with s.node_locks(["free-1", "held"], timeout=0.1):
            pass
    took = []                       # nothing kept: another thread takes the free key at once,

    def take():
        with s.node_lock("free-1", timeout=0.5):
            took.append(True)
    th = threading.Thread(target=take)
    th.start()
    th.join(5)
    assert took == [True]
    p2, q2 = start(mp_context, _hold_lock, store_name, "free-1", 0)      # and so does another process
    assert get_report(p2, q2) == "released"
    p2.join(10)
    with s.node_lock("held", timeout=30):           # waits for the child, no longer
        pass
    assert get_report(p, q) == "released"
    p.join(10)
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="timeout must be"):
            s.node_lock("k", timeout=bad)


def _churn_locks(name, seed, rounds):
    """Take random overlapping sets of node locks, each in a random order, from 3 threads."""
    import random
    import threading

    s = TieredStore.attach(name)
    pool = [f"shared-{i}" for i in range(24)]
    errors = []

    def one(t):
        rng = random.Random(seed * 10 + t)
        try:
            for _ in range(rounds):
                keys = rng.sample(pool, rng.randint(1, 12))
                with s.node_locks(keys):
                    w = s.word("inside")
                    w.cas(w.value, w.value + 1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=one, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    return errors or "done"


def test_node_locks_hold_a_set_and_overlapping_sets_never_deadlock(make_store, store_name, mp_context):
    from procs import get_report

    s = make_store()
    p, q = _start_holder(mp_context, s, store_name, ["a-1", "a-2", "a-3"], 0.8)
    t = time.monotonic()
    with s.node_locks(["zz", "a-3"]):              # one key in common: waits for the child
        waited = time.monotonic() - t
    assert waited > 0.3, waited
    with s.node_lock("a-2"):                        # the child let go of all of them
        pass
    assert get_report(p, q) == "released"
    p.join(10)
    with s.node_locks([]):                          # nothing to hold
        pass
    with pytest.raises(TypeError, match="for one key use node_lock"):
        s.node_locks("a-1")                         # a str is not a list of keys
    with pytest.raises(TypeError, match="str keys"):
        s.node_locks(["a-1", 7])
    with pytest.raises(TypeError, match="a str key"):
        s.node_lock(b"a-1")
    # two processes x 3 threads, random overlapping sets taken in random orders: the locks
    # are always taken in one global order, so nobody waits for anybody in a circle
    kids = [start(mp_context, _churn_locks, store_name, seed, 150) for seed in (1, 2)]
    for p, q in kids:
        assert finish(p, q, timeout=120) == "done"


def test_a_store_without_room_for_another_word_says_it_is_full(make_store):
    """It raised a bare YrcacheError ("word 'user/w3840' failed: no space")."""
    from yrcache import StoreFullError

    s = make_store(dram="1MiB")
    with pytest.raises(StoreFullError, match="the store is full"):
        for i in range(100_000):
            s.word(f"w{i}")


@pytest.mark.parametrize("client", [False, True], ids=["arena", "process"])
def test_a_word_wait_takes_any_timeout(make_store, client):
    """A huge or infinite timeout waits for the wake (1e300 overflowed the C call's time_t:
    the wait returned True at once, as if woken); a negative one has passed; NaN and a
    string are refused. ``process``: a pure client's words, in its own memory."""
    from yrcache.cluster.records import ProcessWord

    w = ProcessWord() if client else make_store().word("w")
    for big in (1e300, float("inf"), 2e9):
        seen = w.seq
        t = threading.Timer(0.3, w.wake)
        t.start()
        start = time.monotonic()
        assert w.wait(seen, big) is True and time.monotonic() - start >= 0.25, big
        t.join()
    assert w.wait(w.seq, -1) is False and w.wait(w.seq, 0) is False
    assert w.wait(w.seq, np.float32(0.01)) is False and w.wait(w.seq, np.int64(0)) is False   # numpy scalars
    with pytest.raises(ValueError, match="NaN"):
        w.wait(w.seq, float("nan"))
    with pytest.raises(TypeError, match="number of seconds"):
        w.wait(w.seq, "1")
