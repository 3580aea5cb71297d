"""Tiers and placement (README "Tiers"; docs/architecture.md, "Tiers").

Spills (DRAM -> SSD) and promotions (SSD -> DRAM, DRAM -> HBM) with their
counters, watermarks, priorities, tier hints, capacity split by ratios, the
"cache" policy against the default "never drop anything" one, TTL on every
tier, batches across tiers, checksums of SSD payload files, access counts
shared by processes, the HBM tier seen from other processes, per-tier stats
and ``yrcache stat``.

The HBM tier runs with ``device="cpu"`` (the same code as on a GPU).  Child
functions live at module level so ``spawn`` can import them; torch is imported
lazily so spawned children that do not need it start quickly.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from yrcache import CorruptObjectError, StoreFullError, Tier, TieredStore
from procs import finish, kill_all, seg_exists, start, drop_failed_test_locals  # noqa: E402

KB = 1024
MB = 1024 * 1024
VAL = 200_000          # a "large" value: several fill a 1 MiB arena


# ------------------------------------------------------------------ helpers


def arr(i: int, n: int = VAL) -> np.ndarray:
    """A value whose every byte depends on ``i`` (any int, negative too)."""
    return (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(i & 0xFFFF)).astype(np.uint8)


def tensor(i: int, n: int = VAL):
    """A float32 tensor of ``n`` bytes (uint8 when ``n`` is not a multiple of 4)."""
    import torch

    t = torch.from_numpy(arr(i, n))
    return t.view(torch.float32) if n % 4 == 0 else t


def same(got, want) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))
    else:
        assert isinstance(got, np.ndarray), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def tiers_of(s, keys) -> dict:
    return {k: s.tier_of(k) for k in keys}


def payload_files(ssd) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(ssd, "data")):
        out += [os.path.join(root, f) for f in files]
    return sorted(out)


@pytest.fixture
def store_name(store_name):
    yield store_name
    drop_failed_test_locals()


def dram_capacity(s) -> int:
    return s.stats()["tiers"]["dram"]["capacity"]


@pytest.fixture
def ssd_store(make_store, tmp_path):
    """A 1 MiB arena over an SSD tier: a few VAL-sized values fill DRAM."""
    def make(**kw):
        kw.setdefault("dram", "1MiB")
        kw.setdefault("ssd", tmp_path / "ssd")
        kw.setdefault("ssd_size", "16MiB")
        return make_store(**kw)
    return make


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# ------------------------------------------------------ spills and promotions


def test_spill_and_promotion_counters(ssd_store):
    s = ssd_store()
    st0 = s.stats()
    assert (st0["spills"], st0["promotions"], st0["evictions"]) == (0, 0, 0)
    # promotion: an SSD object read twice moves up (one promotion, no spill)
    s.put("cold", arr(-1), tier=Tier.SSD)
    same(s["cold"], arr(-1))
    assert s.tier_of("cold") == Tier.SSD, "promote_after=2: one read leaves it on SSD"
    same(s["cold"], arr(-1))
    assert s.tier_of("cold") == Tier.DRAM
    st = s.stats()
    assert (st["spills"], st["promotions"]) == (0, 1)
    assert st["tiers"]["ssd"] == {**st["tiers"]["ssd"], "used": 0, "objects": 0}
    s.flush()
    assert payload_files(s.stats()["tiers"]["ssd"]["path"]) == []    # the disk copy is gone
    del s["cold"]
    # spills: 8 x 200 kB into a 1 MiB arena
    for i in range(8):
        s[f"k{i}"] = arr(i)
    st = s.stats()
    spilled = [k for k, t in tiers_of(s, s).items() if t == Tier.SSD]
    assert spilled, "8 x 200 kB in a 1 MiB arena: something must have moved to SSD"
    assert st["spills"] == len(spilled)
    assert st["promotions"] == 1
    assert st["tiers"]["ssd"]["objects"] == len(spilled)
    assert st["tiers"]["dram"]["objects"] == 8 - len(spilled)
    assert st["tiers"]["ssd"]["used"] == VAL * len(spilled)
    s.flush()
    assert len(payload_files(st["tiers"]["ssd"]["path"])) == len(spilled)
    assert st["evictions"] == 0
    assert len(s) == 8
    for i in range(8):
        same(s[f"k{i}"], arr(i))
    s.check()


def test_puts_counter_counts_puts_not_moves(ssd_store):
    """``puts`` counts the caller's puts; spills and promotions have their own counters."""
    s = ssd_store()
    for i in range(8):
        s[f"k{i}"] = arr(i)
    st = s.stats()
    assert st["spills"] > 0
    assert st["puts"] == 8, f"8 puts, {st['spills']} spills, but stats()['puts'] == {st['puts']}"


def test_promotion_after_many_spills(ssd_store):
    """A hot SSD object moves up after spills have churned DRAM: it is smaller
    than the high watermark and everything in DRAM is colder and of the same
    priority, so the mover makes room (the stubs that spills leave behind must
    not fragment the arena so that no 200 kB block can be found)."""
    s = ssd_store()
    for i in range(2 * dram_capacity(s) // VAL + 2):
        s[f"k{i}"] = arr(i)
    ssd_keys = [k for k, t in tiers_of(s, s).items() if t == Tier.SSD]
    for k in ssd_keys[:3]:
        for _ in range(4):
            same(s[k], arr(int(k[1:])))
        dram = s.stats()["tiers"]["dram"]
        assert s.tier_of(k) == Tier.DRAM, f"read 4 times, {k} stays on SSD; DRAM: {dram}"
    assert s.stats()["promotions"] >= 3
    s.check()


def test_watermark_after_each_put(ssd_store):
    s = ssd_store()
    cap = s.stats()["tiers"]["dram"]["capacity"]
    for i in range(30):
        s.put(f"k{i}", arr(i, 40_000 + 9_000 * (i % 7)))
        used = s.stats()["tiers"]["dram"]["used"]
        assert used <= 0.9 * cap, f"after put {i}: DRAM {used} of {cap} (> high watermark)"
    assert s.stats()["spills"] > 0
    for i in range(30):
        same(s[f"k{i}"], arr(i, 40_000 + 9_000 * (i % 7)))
    s.check()


def test_custom_watermarks_and_promote_after(ssd_store):
    s = ssd_store(watermarks=(0.5, 0.3), promote_after=3)
    cap = s.stats()["tiers"]["dram"]["capacity"]
    for i in range(6):
        s.put(f"k{i}", arr(i, 60_000))
        assert s.stats()["tiers"]["dram"]["used"] <= 0.5 * cap
    s.put("cold", arr(99, 60_000), tier=Tier.SSD)
    for n in range(1, 3):
        s["cold"]
        assert s.tier_of("cold") == Tier.SSD, f"promote_after=3, read {n} times"
    s["cold"]
    assert s.tier_of("cold") == Tier.DRAM
    with pytest.raises(ValueError):
        TieredStore(dram="1MiB", watermarks=(0.5, 0.8))


# ------------------------------------------------------------- priorities


@pytest.mark.parametrize("n", [20_000, VAL])
def test_priority_outlives_lower_ones_in_full_dram(ssd_store, n):
    """priority=10 stays in DRAM while twice DRAM's worth of priority-0 values
    of the same size pass through a 1 MiB arena."""
    s = ssd_store()
    count = 2 * dram_capacity(s) // n + 5          # twice what DRAM holds
    s.put("vip", arr(-1, n), priority=10)      # the oldest, so LRU alone would pick it
    for i in range(count):
        s.put(f"k{i}", arr(i, n))
        assert s.tier_of("vip") == Tier.DRAM, (
            f"vip spilled at put {i}; DRAM now {s.stats()['tiers']['dram']}")
    assert s.stats()["spills"] >= count // 3
    same(s["vip"], arr(-1, n))
    for i in range(count):
        same(s[f"k{i}"], arr(i, n))


def test_dram_stays_in_use_while_spilling(ssd_store):
    """Spills bring DRAM down to the low watermark, not far below it: with
    same-size values, after every put DRAM holds at least what fits under the
    low watermark less two values (the stubs of spilled objects must not
    fragment the arena so that it can hold almost nothing)."""
    s = ssd_store()
    n = 50_000
    cap = s.stats()["tiers"]["dram"]["capacity"]
    worst = cap
    for i in range(60):
        s.put(f"k{i}", arr(i, n))
        if i >= 20:
            worst = min(worst, s.stats()["tiers"]["dram"]["used"])
    assert worst >= 0.8 * cap - 2 * (n + 1024), (
        f"DRAM fell to {worst} of {cap} bytes used while spilling "
        f"(low watermark {int(0.8 * cap)}); spills: {s.stats()['spills']}")


def test_negative_priority_leaves_first(ssd_store):
    s = ssd_store()
    n = 20_000
    s.put("scratch", arr(-1, n), priority=-5)
    for i in range(2 * dram_capacity(s) // n + 5):
        s.put(f"k{i}", arr(i, n))
        if s.stats()["spills"]:
            break
        s["scratch"]                           # the most recently used, but lowest priority
    assert s.stats()["spills"], "twice DRAM's capacity never spilled"
    assert s.tier_of("scratch") == Tier.SSD, "the first spill must take the priority -5 object"


def test_priority_in_full_hbm(make_store, tmp_path, torch):
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu", ssd=tmp_path / "ssd")
    s.put("policy", tensor(-1), tier=Tier.HBM, priority=10)
    for i in range(8):
        s.put(f"value{i}", tensor(i), tier=Tier.HBM)
        assert s.tier_of("policy") == Tier.HBM, f"policy demoted at put {i}"
    st = s.stats()
    assert st["tiers"]["hbm"]["used"] <= 0.9 * st["tiers"]["hbm"]["capacity"]
    lower = [k for k in s if s.tier_of(k) == Tier.DRAM]
    assert len(lower) >= 4
    same(s["policy"], tensor(-1))
    for i in range(8):
        same(s[f"value{i}"], tensor(i))


def test_promotion_never_displaces_a_higher_priority_object(ssd_store):
    """Reading a priority-0 SSD object twice must not push a priority-10 one
    out of DRAM: demotion order is priority first, whoever asks for room."""
    s = ssd_store()
    cap = dram_capacity(s)
    big, small = int(0.55 * cap), int(0.4 * cap)      # together past the high watermark
    s.put("vip", arr(-1, big), priority=10)
    s.put("x", arr(1, small), tier=Tier.SSD)
    same(s["x"], arr(1, small))
    same(s["x"], arr(1, small))
    assert s.tier_of("vip") == Tier.DRAM, (
        f"the priority-10 object was spilled to promote a priority-0 one: {tiers_of(s, s)}")


def test_hbm_promotion_never_displaces_a_higher_priority_tensor(make_store, torch):
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    s.put("vip", tensor(-1, 600_000), tier=Tier.HBM, priority=10)
    s.put("x", tensor(1, 400_000))                     # DRAM, priority 0
    same(s["x"], tensor(1, 400_000))
    same(s["x"], tensor(1, 400_000))
    assert s.tier_of("vip") == Tier.HBM, (
        f"the priority-10 tensor left HBM to promote a priority-0 one: {tiers_of(s, s)}")


# ------------------------------------------------------------- tier hints


def test_ssd_hint_stays_until_read_twice(ssd_store):
    s = ssd_store()
    s.put("a", arr(1), tier=Tier.SSD)
    s.put("small", b"tiny", tier=Tier.SSD)
    s.mset({"m": arr(2), "n": b"n"}, tier=Tier.SSD)
    for k in ("a", "small", "m", "n"):
        assert s.tier_of(k) == Tier.SSD
    assert s.stats()["tiers"]["dram"]["objects"] == 0
    for _ in range(5):                     # looking is not reading
        assert "a" in s and s.tier_of("a") == Tier.SSD
    assert sorted(s) == ["a", "m", "n", "small"]
    same(s["a"], arr(1))
    assert s.tier_of("a") == Tier.SSD
    same(s.get("a"), arr(1))
    assert s.tier_of("a") == Tier.DRAM
    assert s["small"].tobytes() == b"tiny" and s.get("small").tobytes() == b"tiny"
    assert s.tier_of("small") == Tier.DRAM
    assert s.stats()["promotions"] == 2
    # a DRAM hint on an SSD object moves it back
    s.put("m", arr(3), tier=Tier.DRAM)
    assert s.tier_of("m") == Tier.DRAM
    same(s["m"], arr(3))


def test_hint_validation(make_store, tmp_path, torch):
    s = make_store(dram="1MiB")
    with pytest.raises(ValueError, match="ssd"):
        s.put("a", b"x", tier=Tier.SSD)
    with pytest.raises(ValueError, match="hbm"):
        s.put("a", torch.ones(3), tier=Tier.HBM)
    with pytest.raises(TypeError):
        s.put("a", b"x", tier="ssd")
    assert len(s) == 0


def test_hbm_hint_on_cpu_device(make_store, torch):
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    t = tensor(1)
    s.put("t", t, tier=Tier.HBM)
    assert s.tier_of("t") == Tier.HBM
    got = s["t"]
    assert got.device.type == "cpu"
    same(got, t)
    t.zero_()                                    # the store kept a copy, not the caller's tensor
    same(s["t"], tensor(1))
    st = s.stats()["tiers"]
    assert st["hbm"] == {**st["hbm"], "objects": 1, "used": VAL}
    assert st["dram"]["objects"] == 0
    # a hot DRAM tensor moves up
    s.put("plain", tensor(2), tier=Tier.DRAM)
    assert s.tier_of("plain") == Tier.DRAM
    s["plain"]
    s["plain"]
    assert s.tier_of("plain") == Tier.HBM
    same(s["plain"], tensor(2))
    # bytes/arrays cannot live in HBM
    with pytest.raises(TypeError):
        s.put("b", b"bytes", tier=Tier.HBM)
    # too large for HBM: stored in DRAM instead, never lost
    big = tensor(3, 2 * MB)
    s.put("big", big, tier=Tier.HBM)
    assert s.tier_of("big") == Tier.DRAM
    same(s["big"], big)
    assert s.stats()["promotions"] == 1


def test_hbm_cold_tensors_move_down_to_dram_then_ssd(make_store, tmp_path, torch):
    s = make_store(dram="1MiB", hbm="512KiB", device="cpu", ssd=tmp_path / "ssd")
    for i in range(10):
        s.put(f"t{i}", tensor(i), tier=Tier.HBM)
    tiers = tiers_of(s, [f"t{i}" for i in range(10)])
    assert set(tiers.values()) == {Tier.HBM, Tier.DRAM, Tier.SSD}, tiers
    assert tiers["t9"] == Tier.HBM and tiers["t0"] == Tier.SSD
    for i in range(10):
        same(s[f"t{i}"], tensor(i))
    s.check()


# ------------------------------------------------------- capacity + ratios


def test_capacity_split_by_ratios(make_store, tmp_path, torch):
    s = make_store(dram=None, capacity="20MiB", ratios=(0.2, 0.5, 0.3), device="cpu",
                   ssd=tmp_path / "ssd")
    tiers = s.stats()["tiers"]
    assert set(tiers) == {"hbm", "dram", "ssd"}
    assert tiers["hbm"]["capacity"] == int(20 * MB * 0.2)
    assert tiers["ssd"]["capacity"] == int(20 * MB * 0.3)
    # the DRAM share is the arena's size; its capacity is what is left for objects
    assert 0.9 * 10 * MB <= tiers["dram"]["capacity"] <= 10 * MB
    s.put("t", tensor(1, MB), tier=Tier.HBM)
    s.put("a", arr(2, MB))
    s.put("d", arr(3, MB), tier=Tier.SSD)
    assert tiers_of(s, ["t", "a", "d"]) == {"t": Tier.HBM, "a": Tier.DRAM, "d": Tier.SSD}
    with pytest.raises(ValueError):
        TieredStore(capacity="20MiB", ratios=(0.2, 0.5, 0.3), device="cpu")   # no ssd=
    with pytest.raises(ValueError):
        TieredStore(capacity="20MiB", ratios=(0.5, 0.6, 0.3), ssd=tmp_path / "x", device="cpu")
    with pytest.raises(ValueError):
        TieredStore(dram="1MiB", ratios=(0.0, 1.0, 0.0))                   # ratios without capacity


def test_capacity_without_ratios_is_all_dram(make_store):
    s = make_store(dram=None, capacity="2MiB")
    assert set(s.stats()["tiers"]) == {"dram"}
    assert 0.8 * 2 * MB <= s.stats()["tiers"]["dram"]["capacity"] <= 2 * MB


# --------------------------------------------------- full stores and policy


def test_default_policy_raises_when_everything_is_full_and_drops_nothing(ssd_store):
    s = ssd_store(ssd_size="1MiB")
    stored = {}
    with pytest.raises(StoreFullError) as ei:
        for i in range(40):
            s[f"k{i}"] = arr(i)
            stored[f"k{i}"] = arr(i)
    assert isinstance(ei.value, MemoryError)
    assert 5 <= len(stored) < 40
    # a failed put leaves nothing behind and drops nothing
    assert len(s) == len(stored) and set(s) == set(stored)
    for k, v in stored.items():
        same(s[k], v)
    st = s.stats()
    assert st["evictions"] == 0
    # an overwrite that does not fit keeps the old value
    with pytest.raises(StoreFullError):
        s["k0"] = arr(1000, 3 * MB)
    same(s["k0"], arr(0))
    with pytest.raises(StoreFullError):
        s.mset({"new1": arr(7), "new2": arr(8), "new3": arr(9)})
    for k, v in stored.items():
        same(s[k], v)
    # deleting makes room again
    for k in list(stored)[:3]:
        del s[k]
    s["again"] = arr(77)
    same(s["again"], arr(77))
    s.check()


def test_dram_only_store_full(make_store):
    s = make_store(dram="1MiB")
    with pytest.raises(StoreFullError):
        for i in range(10):
            s[f"k{i}"] = arr(i)
    assert s.stats()["evictions"] == 0 and s.stats()["spills"] == 0
    assert len(s) >= 3
    for k in s:
        same(s[k], arr(int(k[1:])))


def test_cache_policy_drops_cold_objects_and_never_raises(ssd_store):
    s = ssd_store(ssd_size="1MiB", policy="cache")
    for i in range(40):
        s[f"k{i}"] = arr(i)                        # never StoreFullError
        same(s[f"k{i}"], arr(i))
    st = s.stats()
    assert st["evictions"] > 0
    assert len(s) == 40 - st["evictions"]
    assert "k39" in s and "k0" not in s           # the coldest went first
    for k in s:
        same(s[k], arr(int(k[1:])))
    s.check()


def test_cache_policy_keeps_high_priority(make_store):
    s = make_store(dram="1MiB", policy="cache")
    s.put("vip", arr(-1), priority=10)
    count = 3 * dram_capacity(s) // VAL + 2
    for i in range(count):
        s[f"k{i}"] = arr(i)
    assert s.stats()["evictions"] >= count - dram_capacity(s) // VAL
    assert len(s) == count + 1 - s.stats()["evictions"]
    same(s["vip"], arr(-1))


def test_cache_policy_drops_nothing_for_a_value_no_tier_can_hold(make_store):
    s = make_store(dram="1MiB", policy="cache")           # no SSD tier
    for i in range(3):
        s[f"k{i}"] = arr(i)
    with pytest.raises(StoreFullError, match="no SSD tier"):
        s["huge"] = arr(9, dram_capacity(s) + 1)          # larger than all of DRAM: fails at once
    assert s.stats()["evictions"] == 0 and sorted(s) == ["k0", "k1", "k2"]
    s["big"] = arr(8, dram_capacity(s) - 4 * KB)          # fits an empty DRAM: the rest makes room
    assert sorted(s) == ["big"] and s.stats()["evictions"] == 3
    same(s["big"], arr(8, dram_capacity(s) - 4 * KB))
    s.check()


# ---------------------------------------------------------------------- TTL


def test_ttl_dram_invisible_at_once_and_space_reclaimed(ssd_store):
    s = ssd_store()
    base = s.stats()["tiers"]["dram"]["used"]
    s.put("t", arr(1), ttl=0.3)
    s.put("keep", arr(2))
    used = s.stats()["tiers"]["dram"]["used"]
    assert used >= base + 2 * VAL
    time.sleep(0.4)
    assert "t" not in s and s.get("t") is None and s.mget(["t"]) == [None]
    assert sorted(s) == ["keep"]
    assert len(s) == 1
    assert s.stats()["tiers"]["dram"]["used"] <= used - VAL


def test_ttl_ssd_invisible_at_once_and_space_reclaimed(ssd_store):
    s = ssd_store(ssd_size="1MiB")
    for i in range(4):
        s.put(f"t{i}", arr(i), tier=Tier.SSD, ttl=0.3)
    assert s.stats()["tiers"]["ssd"]["used"] == 4 * VAL
    time.sleep(0.4)
    assert "t0" not in s and s.get("t1") is None and s.mget(["t2", "t3"]) == [None, None]
    assert len(s) == 0
    s.put("trigger", b"x")
    assert s.stats()["tiers"]["ssd"]["used"] == 0, "expired SSD objects still count as used"
    # the space is really usable again: 4 more fill what the expired ones held
    for i in range(4):
        s.put(f"n{i}", arr(10 + i), tier=Tier.SSD)
    for i in range(4):
        same(s[f"n{i}"], arr(10 + i))


def test_ttl_survives_spill_and_promotion(ssd_store):
    s = ssd_store()
    s.put("up", arr(1), tier=Tier.SSD, ttl=0.6)
    same(s["up"], arr(1))
    same(s["up"], arr(1))
    assert s.tier_of("up") == Tier.DRAM          # promoted with its expiry
    s.put("down", arr(2), ttl=0.6)
    for i in range(8):
        s.put(f"k{i}", arr(i))
    assert s.tier_of("down") == Tier.SSD         # spilled with its expiry
    same(s["down"], arr(2))
    time.sleep(0.7)
    assert "up" not in s and s.get("up") is None
    assert "down" not in s and s.get("down") is None
    assert len(s) == 8


def test_ttl_hbm_invisible_at_once_and_space_reclaimed(make_store, torch):
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    s.put("t", tensor(1), tier=Tier.HBM, ttl=0.3)
    s.put("keep", tensor(2), tier=Tier.HBM)
    assert s.stats()["tiers"]["hbm"]["used"] == 2 * VAL
    time.sleep(0.4)
    assert "t" not in s and s.get("t") is None and s.mget(["t"]) == [None]
    assert sorted(s) == ["keep"] and len(s) == 1
    s.put("trigger", b"x")
    hbm = s.stats()["tiers"]["hbm"]
    assert hbm["objects"] == 1 and hbm["used"] == VAL, hbm
    # the room is really there: 3 more tensors fit in HBM next to "keep"
    for i in range(3):
        s.put(f"n{i}", tensor(10 + i), tier=Tier.HBM)
        assert s.tier_of(f"n{i}") == Tier.HBM
    same(s["keep"], tensor(2))


# -------------------------------------------------------------- batches


def test_mset_mget_across_tiers(make_store, tmp_path, torch):
    s = make_store(dram="1MiB", hbm="1MiB", device="cpu", ssd=tmp_path / "ssd")
    s.put("h", tensor(1), tier=Tier.HBM)
    s.put("d", arr(2))
    s.put("s", arr(3), tier=Tier.SSD)
    s.put("sb", b"small on ssd", tier=Tier.SSD)
    assert tiers_of(s, ["h", "d", "s", "sb"]) == {"h": Tier.HBM, "d": Tier.DRAM, "s": Tier.SSD,
                                                 "sb": Tier.SSD}
    got = s.mget(["h", "missing", "d", "s", "sb", "s"])
    same(got[0], tensor(1))
    assert got[1] is None
    same(got[2], arr(2))
    same(got[3], arr(3))
    assert got[4].tobytes() == b"small on ssd"
    same(got[5], arr(3))
    copies = s.mget(["d", "s"], copy=True)
    assert all(c.flags.writeable for c in copies)
    s.mset({"h2": tensor(4), "x": arr(5), "y": b"y"}, tier=Tier.SSD)
    assert tiers_of(s, ["h2", "x", "y"]) == {"h2": Tier.SSD, "x": Tier.SSD, "y": Tier.SSD}
    s.mset({"h3": tensor(6), "z": b"z"}, tier=Tier.HBM)   # HBM takes the tensors, DRAM the rest
    assert s.tier_of("h3") == Tier.HBM and s.tier_of("z") == Tier.DRAM
    # mset over existing keys in other tiers replaces them wherever they were
    s.mset({"h": arr(7), "s": arr(8), "d": tensor(9)})
    same(s["h"], arr(7))
    same(s["s"], arr(8))
    same(s["d"], tensor(9))
    assert s.stats()["tiers"]["hbm"]["objects"] == 1      # only h3 left in HBM
    s.check()


def test_mset_spills_when_batch_exceeds_dram(ssd_store):
    s = ssd_store()
    batch = {f"b{i}": arr(i) for i in range(12)}
    s.mset(batch)
    assert len(s) == 12
    assert s.stats()["spills"] > 0 or any(t == Tier.SSD for t in tiers_of(s, batch).values())
    for k, v in zip(batch, s.mget(list(batch))):
        same(v, batch[k])


def test_mget_of_the_same_hot_tensor_twice(make_store, torch, monkeypatch):
    """mget(["t", "t"]) of a DRAM tensor due for promotion: the value stays
    readable (the second, failing promotion must not drop the first one's
    HBM copy while the index says HBM)."""
    import yrcache.store

    monkeypatch.setattr(yrcache.store, "HBM_READ_TIMEOUT", 2.0)   # a read here never needs to wait
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    t = torch.arange(1000.0)
    s.put("t", t)
    s.get("t")                                          # read 1
    a, b = s.mget(["t", "t"])                           # reads 2 and 3: both due for promotion
    same(a, t)
    same(b, t)
    same(s["t"], t)
    same(s.mget(["t"])[0], t)
    s.check()


def test_get_never_raises_store_full(make_store, torch):
    """A read whose promotion finds no room just reads (StoreFullError is for puts)."""
    s = make_store(dram="1MiB", hbm="256KiB", device="cpu")
    s.put("hot", torch.ones(10_000))                    # 40 kB tensor in DRAM
    s.put("h", torch.zeros(50_000), tier=Tier.HBM)      # 200 kB tensor in HBM
    with pytest.raises(StoreFullError):
        for i in range(100):
            s.put(f"fill{i}", np.zeros(50_000, np.uint8))   # DRAM full, no SSD
    same(s.get("hot"), torch.ones(10_000))
    same(s.get("hot"), torch.ones(10_000))             # promote_after=2: wants HBM room
    same(s["h"], torch.zeros(50_000))
    s.check()


# ------------------------------------------------------------- checksums


def test_flipped_byte_in_payload_file_is_corrupt_for_that_object_only(ssd_store, tmp_path):
    ssd = tmp_path / "ssd"
    s = ssd_store()
    s.put("bad", arr(1), tier=Tier.SSD)
    (bad_file,) = payload_files(ssd)
    s.put("good", arr(2), tier=Tier.SSD)
    s.put("small", b"inline", tier=Tier.SSD)
    assert len(payload_files(ssd)) == 2
    with open(bad_file, "r+b") as f:
        f.seek(VAL // 2)
        b = f.read(1)
        f.seek(VAL // 2)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptObjectError) as ei:
        s["bad"]
    assert isinstance(ei.value, ValueError)
    # the second read is the promotion path (readinto straight into the arena)
    with pytest.raises(CorruptObjectError):
        s.get("bad")
    with pytest.raises(CorruptObjectError):
        s.get("bad", copy=True)
    with pytest.raises(CorruptObjectError):
        s.get_into("bad", np.empty(VAL, np.uint8))
    with pytest.raises(CorruptObjectError):
        s.mget(["good", "bad"])
    assert s.tier_of("bad") == Tier.SSD            # a failed promotion leaves it where it was
    same(s["good"], arr(2))
    same(s["good"], arr(2))
    assert s["small"].tobytes() == b"inline"
    assert "bad" in s and len(s) == 3
    s.check()
    # the key can be deleted or rewritten
    s["bad"] = arr(3)
    same(s["bad"], arr(3))
    assert s.delete("bad")
    s.check()


def test_truncated_payload_file_is_corrupt(ssd_store, tmp_path):
    s = ssd_store()
    s.put("a", arr(1), tier=Tier.SSD)
    (f,) = payload_files(tmp_path / "ssd")
    os.truncate(f, VAL - 10)
    with pytest.raises(CorruptObjectError):
        s["a"]
    with pytest.raises(CorruptObjectError):
        s["a"]


# ---------------------------------------------- access counts across processes


def _read_n(name, key, n):
    s = TieredStore.attach(name)
    try:
        for _ in range(n):
            v = s[key]
        return int(v[0]), int(s.tier_of(key))
    finally:
        del v
        s.close()


def test_reads_in_other_processes_count_toward_promotion(mp_context, ssd_store, store_name):
    s = ssd_store(promote_after=3)
    s.put("x", arr(5), tier=Tier.SSD)
    s.put("y", arr(6), tier=Tier.SSD)
    p, q = start(mp_context, _read_n, store_name, "x", 2)
    first, tier = finish(p, q)
    assert first == arr(5)[0] and tier == Tier.SSD      # 2 reads < promote_after
    same(s["x"], arr(5))                                # the 3rd read, here
    assert s.tier_of("x") == Tier.DRAM
    # and the other way round: the child's read is the one that promotes
    s["y"]
    s["y"]
    assert s.tier_of("y") == Tier.SSD
    p, q = start(mp_context, _read_n, store_name, "y", 1)
    _, tier = finish(p, q)
    assert tier == Tier.DRAM
    same(s["y"], arr(6))
    assert s.stats()["promotions"] == 2


# ------------------------------------------------------ HBM across processes


def _read_hbm(name, key):
    import torch

    s = TieredStore.attach(name)
    try:
        v = s[key]
        assert isinstance(v, torch.Tensor) and v.device.type == "cpu"
        out = v.clone()
        tier = int(s.tier_of(key))
        del v
        return out.view(torch.uint8).numpy().tobytes(), tier
    finally:
        s.close()


def test_hbm_object_read_from_another_process(store_name, torch):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    s = TieredStore(name=store_name, dram="4MiB", hbm="1MiB", device="cpu")
    try:
        t = tensor(7)
        s.put("w", t, tier=Tier.HBM)
        s.put("stay", tensor(8), tier=Tier.HBM)
        assert s.tier_of("w") == Tier.HBM
        p, q = start(ctx, _read_hbm, store_name, "w")
        data, tier = finish(p, q)
        assert data == t.view(torch.uint8).numpy().tobytes()
        assert tier == Tier.DRAM
        assert s.tier_of("w") == Tier.DRAM                  # demoted for the reader
        assert s.tier_of("stay") == Tier.HBM                # the others stay
        hbm = s.stats()["tiers"]["hbm"]
        assert hbm["objects"] == 1 and hbm["used"] == VAL
        same(s["w"], t)
        s.check()
    finally:
        s.close()


def _attach_then_read_later(name, attached, go, keys):
    import torch

    s = TieredStore.attach(name)
    attached.set()
    assert go.wait(30)
    out = {}
    for k in keys:
        v = s[k]
        raw = v.view(torch.uint8).numpy() if isinstance(v, torch.Tensor) else v
        out[k] = (raw.tobytes(), int(s.tier_of(k)))
        del v, raw
    s.check()
    s.close()
    return out


def test_hbm_objects_of_closing_owner_move_to_dram(store_name, torch):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    s = TieredStore(name=store_name, dram="4MiB", hbm="1MiB", device="cpu")
    attached, go = ctx.Event(), ctx.Event()
    p, q = start(ctx, _attach_then_read_later, store_name, attached, go, ["a", "b", "d"])
    try:
        assert attached.wait(60)
        s.put("a", tensor(1), tier=Tier.HBM)
        s.put("b", tensor(2, 1000), tier=Tier.HBM)
        s.put("d", arr(3))
        assert s.tier_of("a") == Tier.HBM
        s.close()
        assert not seg_exists(store_name)    # the owner's close removes the name at once
        go.set()
        got = finish(p, q)
    finally:
        kill_all([p])
    assert got["a"] == (tensor(1).view(torch.uint8).numpy().tobytes(), Tier.DRAM)
    assert got["b"] == (tensor(2, 1000).view(torch.uint8).numpy().tobytes(), Tier.DRAM)
    assert got["d"] == (arr(3).tobytes(), Tier.DRAM)
    gc.collect()
    assert not seg_exists(store_name)


def _put_hbm_and_wait(name, ready, go):
    import torch

    s = TieredStore.attach(name)
    s.put("w", torch.ones(1000), tier=Tier.DRAM)
    ready.set()
    go.wait(30)
    s.close()


def test_hbm_owner_reads_other_processes_dram_tensor(store_name, torch):
    """The HBM owner promotes a tensor another process put in DRAM once it is hot."""
    s = TieredStore(name=store_name, dram="4MiB", hbm="1MiB", device="cpu")
    try:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        ready, go = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_put_hbm_and_wait, args=(store_name, ready, go), daemon=True)
        p.start()
        try:
            assert ready.wait(30)
            s["w"]
            s["w"]
            assert s.tier_of("w") == Tier.HBM
            go.set()
            p.join(30)
            assert p.exitcode == 0
        finally:
            kill_all([p])
        same(s["w"], torch.ones(1000))
    finally:
        s.close()


# ---------------------------------------------------------- stats and CLI


def test_stats_per_tier(make_store, tmp_path, torch):
    s = make_store(dram="2MiB", hbm="1MiB", device="cpu", ssd=tmp_path / "ssd", ssd_size="8MiB")
    st = s.stats()
    assert set(st["tiers"]) == {"hbm", "dram", "ssd"}
    for name, t in st["tiers"].items():
        for k in ("capacity", "used", "objects"):
            assert isinstance(t[k], int) and t[k] >= 0, (name, k)
    assert st["tiers"]["hbm"]["capacity"] == MB
    assert st["tiers"]["ssd"]["capacity"] == 8 * MB
    for k in ("hits", "misses", "puts", "spills", "promotions", "evictions", "pinned_bytes"):
        assert isinstance(st[k], int), k
    s.put("h", tensor(1), tier=Tier.HBM)
    s.put("d", arr(2))
    s.put("s", arr(3), tier=Tier.SSD)
    t = s.stats()["tiers"]
    assert (t["hbm"]["objects"], t["dram"]["objects"], t["ssd"]["objects"]) == (1, 1, 1)
    assert t["hbm"]["used"] == VAL and t["ssd"]["used"] == VAL
    assert VAL <= t["dram"]["used"] < VAL + 4096
    assert sum(x["objects"] for x in t.values()) == len(s) == 3
    # only configured tiers appear
    s2 = TieredStore(dram="1MiB")
    try:
        assert set(s2.stats()["tiers"]) == {"dram"}
    finally:
        s2.destroy()


def test_yrcache_stat_prints_a_tier_table(make_store, store_name, tmp_path, torch):
    s = make_store(dram="2MiB", hbm="1MiB", device="cpu", ssd=tmp_path / "ssd", ssd_size="8MiB")
    s.put("h", tensor(1), tier=Tier.HBM)
    s.put("d", arr(2))
    s.put("s1", arr(3), tier=Tier.SSD)
    s.put("s2", arr(4), tier=Tier.SSD)
    s["s1"]
    s["s1"]                                    # one promotion
    r = subprocess.run([sys.executable, "-m", "yrcache", "stat", store_name],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    header = rows["tier"]
    assert header[:4] == ["tier", "capacity", "used", "objects"]
    assert rows["hbm"][-1] == "1" and rows["dram"][-1] == "2" and rows["ssd"][-1] == "1"
    assert "MiB" in " ".join(rows["hbm"])
    assert rows["promotions"][1] == "1"
    for k in ("spills", "evictions", "hits", "misses", "puts"):
        assert k in rows, k
    r = subprocess.run([sys.executable, "-m", "yrcache", "stat", store_name, "--json"],
                       capture_output=True, text=True, timeout=60)
    import json

    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["tiers"]["ssd"]["objects"] == 1 and st["promotions"] == 1
    assert st["tiers"]["dram"]["objects"] == 2
    assert st["tiers"]["hbm"]["objects"] == 1       # the owner's HBM objects, seen from outside


def test_view_stays_pinned_when_a_promotion_to_hbm_is_refused(make_store, torch):
    """A hot DRAM tensor whose promotion is refused (HBM is full of a tensor of
    higher priority) comes back as a DRAM view that still pins its block: the
    key's deletion and new puts over the freed space must not change it."""
    s = make_store(dram="4MiB", hbm="1MiB", device="cpu")
    s.put("vip", torch.zeros(200_000, dtype=torch.float32), tier=Tier.HBM, priority=10)   # 800 kB
    want = torch.arange(100_000, dtype=torch.float32)                                      # 400 kB
    s.put("t", want)
    s["t"]                                        # the first read: no promotion asked
    views = [s["t"] for _ in range(2)]            # reads 2 and 3 ask for one: refused
    assert s.tier_of("t") == Tier.DRAM and s.tier_of("vip") == Tier.HBM
    assert s.stats()["pinned_bytes"] > 0
    assert s.delete("t")
    for i in range(6):                            # reuse every free byte of DRAM
        try:
            s.put(f"junk{i}", torch.full((100_000,), -1.0))
        except StoreFullError:
            break
    for v in views:
        assert torch.equal(v, want), "a view lost its pin: its bytes were reused"
    del views, v
    gc.collect()
    s.check()
    assert s.stats()["pinned_bytes"] == 0


def test_failed_constructor_leaves_no_segment(store_name, tmp_path):
    """An SSD path that is a file: a clear error, and no shared memory left behind."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        TieredStore(name=store_name, dram="2MiB", ssd=not_a_dir)
    assert not seg_exists(store_name)


def test_mget_raw_across_tiers_counts_each_key_once_and_keeps_no_pin(ssd_store):
    """``mget_raw`` over DRAM and SSD objects (the path that reads key by key where
    not everything is in DRAM): one hit per object found, one miss per key missing,
    the bytes as stored, and no pin left once the views go (a pinned object's read
    used to be dropped and made again, counting it twice)."""
    s = ssd_store(dram="8MiB")                     # room for "big" in DRAM: read pinned
    big = np.arange(1 << 20, dtype=np.uint8)
    s.put("big", big)
    s.put("cold", b"x" * 100, tier=Tier.SSD)
    s.put("small", b"y" * 100)
    before = s.stats()
    got = s.mget_raw(["big", "cold", "small", "missing"])
    after = s.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (3, 1)
    assert got[3] is None and bytes(got[1][1]) == b"x" * 100 and bytes(got[2][1]) == b"y" * 100
    assert np.array_equal(np.frombuffer(got[0][1], np.uint8), big)
    assert after["pinned_bytes"] >= big.nbytes
    del got
    gc.collect()
    assert s.stats()["pinned_bytes"] == 0
