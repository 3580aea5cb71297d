"""The store conformance suite (``store_suite.StoreSuite``) over the SSD and HBM tiers.

The DRAM-only store runs the suite in ``test_store.py``.  Here the same tests
run twice more:

* ``TestSsdTier``: a store with ``ssd=`` whose placement sends plain
  ``put``/``mset``/``[]=`` to SSD (``Placement.default_tier``), with ``promote_after`` so large
  that nothing moves back up during a test: every read goes through the SSD
  tier (diskcache index, payload files, checksums).  ``test_ssd_really_holds_values``
  asserts that with ``tier_of``.
* ``TestHbmTierOnCpu``: a store with ``hbm="4MiB", device="cpu"`` whose
  placement sends plain puts of torch tensors to HBM; other values go to
  DRAM (the HBM tier holds tensors only).

Where a suite test describes behaviour that differs by design for a tier
(zero-copy pinning views of DRAM objects), the subclass overrides it with the
tier's own correct behaviour, with a comment saying why.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest


from store_suite import LARGE, StoreSuite, assert_tensor_same, drop, sample_tensor  # noqa: E402

from yrcache import Tier, TieredStore  # noqa: E402
from procs import drop_failed_test_locals  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

gc.freeze()  # see test_store.py: keep the per-test gc.collect() cheap with torch loaded


def _is_tensor(v) -> bool:
    return torch is not None and isinstance(v, torch.Tensor)


def _factory(default_tier, store_name, extra):
    """Stores whose puts without ``tier=`` aim at ``default_tier`` (placement's
    default, so every put, mset and ``[]=`` of the suite goes there)."""
    made: list[TieredStore] = []

    def make(**kw):
        name = store_name if not made else f"{store_name}-{len(made)}"
        kw = {**extra(len(made)), **kw}
        s = TieredStore(name=name, **kw)
        s._placement.default_tier = default_tier
        made.append(s)
        return s

    def finish():
        drop_failed_test_locals()
        names = [s.name for s in made]
        for s in made:
            s.close()
        made.clear()
        if len(names) > 1:
            gc.collect()
            left = [n for n in names[1:] if os.path.exists(f"/dev/shm/yrcache.{n}")]
            for n in left:
                TieredStore.attach(n).destroy()
            assert not left, f"stores left behind in /dev/shm: {left}"

    return make, finish


# ===================================================================== SSD


class TestSsdTier(StoreSuite):
    """Every plain put lands on SSD and stays there (no promotion in a test)."""

    default_tier = Tier.SSD
    has_check = True
    local_views = False     # an SSD read is a private copy: it pins nothing

    @pytest.fixture
    def store_factory(self, store_name, tmp_path):
        make, finish = _factory(Tier.SSD, store_name, lambda i: {
            "dram": "16MiB", "ssd": tmp_path / f"ssd{i}", "ssd_size": "256MiB",
            "promote_after": 1 << 30})
        yield make
        finish()

    def test_ssd_really_holds_values(self, store, tmp_path):
        """Puts land on SSD (a stub in the arena, bytes in files/the index) and
        reads leave them there; the DRAM tier holds no payload bytes."""
        big = np.arange(LARGE, dtype=np.uint8)
        store["big"] = big
        store["small"] = b"tiny"
        store.mset({"m1": np.arange(10), "m2": b"x" * LARGE})
        for _ in range(5):
            np.testing.assert_array_equal(store["big"], big)
            assert store.mget(["m2"])[0].tobytes() == b"x" * LARGE
        for k in ("big", "small", "m1", "m2"):
            assert store.tier_of(k) == Tier.SSD, k
        st = store.stats()
        assert st["tiers"]["ssd"]["objects"] == 4
        assert st["tiers"]["dram"]["objects"] == 0
        assert st["tiers"]["ssd"]["used"] == LARGE + 4 + 80 + LARGE
        files = [f for _, _, fs in os.walk(tmp_path / "ssd0" / "data") for f in fs]
        assert len(files) == 2      # the two payloads at or above 64 KiB
        assert st["promotions"] == 0

    def test_stats_pinned_bytes_follow_views(self, store):
        # Overrides the suite: a DRAM view pins its arena block, but a value
        # read from SSD is a private copy (DESIGN: "an SSD object is read (one
        # copy)"), so holding it pins nothing and replacing the key does not
        # keep any arena bytes alive.
        store["a"] = np.zeros(LARGE, np.uint8)
        drop()
        base = store.stats()["pinned_bytes"]
        v = store["a"]
        assert store.tier_of("a") == Tier.SSD
        assert store.stats()["pinned_bytes"] == base
        store["a"] = b"replaced"
        assert store.stats()["pinned_bytes"] == base
        np.testing.assert_array_equal(v, np.zeros(LARGE, np.uint8))   # still the old value
        del v
        drop()
        assert store.stats()["pinned_bytes"] == base

    def test_stats_counters_move(self, store):
        # The suite's test, plus: the bytes are accounted on the SSD tier.
        super().test_stats_counters_move(store)
        st = store.stats()
        assert st["tiers"]["ssd"]["used"] == 0 and st["tiers"]["ssd"]["objects"] == 0


# ===================================================================== HBM


@pytest.mark.skipif(torch is None, reason="the HBM tier needs torch")
class TestHbmTierOnCpu(StoreSuite):
    """Torch tensors live in HBM (device="cpu"); bytes and arrays in DRAM."""

    default_tier = Tier.DRAM    # of a plain put of bytes (what test_tier_of stores)
    has_check = True
    local_views = True          # bytes and arrays are DRAM views

    @pytest.fixture
    def store_factory(self, store_name):
        make, finish = _factory(Tier.HBM, store_name, lambda i: {
            "dram": "16MiB", "hbm": "4MiB", "device": "cpu"})
        yield make
        finish()

    def test_hbm_really_holds_tensors(self, store):
        """A tensor put with room stays on the device: ``get`` returns the
        stored device tensor itself (no host copy), the DRAM tier holds none of
        its bytes, and overwriting/deleting frees HBM."""
        t = sample_tensor("float32", (64, 64), seed=3)
        store["t"] = t
        assert store.tier_of("t") == Tier.HBM
        got = store["t"]
        assert got.device == torch.device("cpu")
        assert got.data_ptr() == store["t"].data_ptr()   # the stored memory, not a copy per read
        assert got.data_ptr() != t.data_ptr()   # but a private copy of the input
        assert_tensor_same(got, t)
        st = store.stats()
        assert st["tiers"]["hbm"]["objects"] == 1
        assert st["tiers"]["hbm"]["used"] == t.numel() * 4
        assert st["tiers"]["dram"]["objects"] == 0
        store.mset({"a": torch.ones(10), "b": b"bytes"})
        assert store.tier_of("a") == Tier.HBM and store.tier_of("b") == Tier.DRAM
        del store["t"]
        store["a"] = torch.zeros(3)
        st = store.stats()
        assert st["tiers"]["hbm"]["objects"] == 1 and st["tiers"]["hbm"]["used"] == 12

    @pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "bool", "complex128", "uint64"])
    def test_torch_dtypes_in_hbm(self, store, dtype):
        if not hasattr(torch, dtype):
            pytest.skip(f"torch {torch.__version__} has no {dtype}")
        t = sample_tensor(dtype, (5, 8), seed=len(dtype))
        store["t"] = t
        assert store.tier_of("t") == Tier.HBM
        assert_tensor_same(store["t"], t)

    def test_get_copy_tensor_is_private(self, store):
        # The suite's test, plus: an HBM get returns the stored tensor, so only
        # copy=True (or get_into) gives a caller memory of its own.
        super().test_get_copy_tensor_is_private(store)
        assert store.tier_of("t") == Tier.HBM
        assert store.get("t", copy=True) is not store["t"]
