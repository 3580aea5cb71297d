"""The conformance suite of ``yrcache.tiers.base.BlobTier``, written once.

Modelled on zarr's ``zarr/testing/store.py:StoreTests``: every tier gets a
test module with a subclass that sets ``__test__ = True`` and provides

* a ``tier`` fixture: a fresh, empty tier with a capacity of ``CAPACITY``
  (4 MiB), closed afterwards;
* ``payload(nbytes, seed)``, if the tier's ``put`` wants something other than
  a numpy uint8 array: it must hold the bytes ``pattern(nbytes, seed)``;
* ``read_back(tier, gen, nbytes)``, if reading into a numpy array does not
  suit the tier: the payload of blob ``gen`` as ``bytes``.

The tests speak the protocol only (``base.py``): no tier internals, no files.
This module collects no tests of its own.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from yrcache.errors import StoreFullError
from yrcache.tiers.base import BlobInfo, BlobTier, new_gen

KIB = 1024
MIB = 1024 * 1024

BAD_GENS = [0, -1, 2**63, "1", 1.5]


def pattern(nbytes: int, seed: int = 0) -> bytes:
    """The bytes of ``payload(nbytes, seed)``: random but reproducible."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class TierTests:
    """Every ``BlobTier`` passes these.  Subclass with ``__test__ = True``."""

    __test__ = False
    CAPACITY = 4 * MIB

    # ------------------------------------------------- what a subclass provides

    @pytest.fixture
    def tier(self) -> BlobTier:
        raise NotImplementedError("a TierTests subclass provides the tier fixture")

    def payload(self, nbytes: int, seed: int = 0):
        """Something ``tier.put`` accepts holding ``pattern(nbytes, seed)``."""
        return np.frombuffer(pattern(nbytes, seed), dtype=np.uint8).copy()

    def read_back(self, tier: BlobTier, gen: int, nbytes: int) -> bytes:
        """The payload of blob ``gen`` (``nbytes`` long), read through ``read_into``."""
        out = np.empty(nbytes, dtype=np.uint8)
        tier.read_into(gen, out)
        return out.tobytes()

    # ------------------------------------------------------------- helpers

    def put(self, tier: BlobTier, nbytes: int, seed: int = 0, *, key: str = "k", meta: bytes = b"m",
            **kw) -> int:
        gen = new_gen()
        tier.put(gen, meta, self.payload(nbytes, seed), key=key, **kw)
        return gen

    # --------------------------------------------------------------- tests

    def test_class_attributes(self, tier):
        cls = type(tier)
        assert isinstance(tier, BlobTier)
        assert cls.name in ("ssd", "hbm")
        assert type(cls.zero_copy) is bool and type(cls.shared) is bool
        assert tier.capacity == self.CAPACITY and tier.used == 0
        assert list(tier.entries()) == []

    @pytest.mark.parametrize("nbytes", [0, 1, 1000, 64 * KIB - 1, 64 * KIB, 64 * KIB + 1, MIB])
    def test_round_trip(self, tier, nbytes):
        meta = b"meta\x00\xff-" + str(nbytes).encode()
        gen = self.put(tier, nbytes, seed=nbytes, key=f"k/{nbytes}", meta=meta)
        assert gen in tier
        out = np.empty(nbytes, dtype=np.uint8)
        assert tier.read_into(gen, out) == meta
        assert out.tobytes() == pattern(nbytes, nbytes)
        assert self.read_back(tier, gen, nbytes) == pattern(nbytes, nbytes)
        assert tier.read_into(gen, out) == meta               # read again: unchanged
        info = tier.info(gen)
        assert (info.gen, info.key, info.meta, info.nbytes) == (gen, f"k/{nbytes}", meta, nbytes)
        assert tier.used == nbytes

    def test_info_and_entries(self, tier):
        t0 = time.time()
        a = self.put(tier, 1000, 1, key="alpha", meta=b"ma", priority=7)
        b = self.put(tier, 100 * KIB, 2, key="béta/ünï", meta=b"mb", priority=-3, expire_at=t0 + 1000.5)
        ia, ib = tier.info(a), tier.info(b)
        assert isinstance(ia, BlobInfo) and isinstance(ib, BlobInfo)
        assert ia[:6] == (a, "alpha", b"ma", 1000, 7, None)
        assert ib[:6] == (b, "béta/ünï", b"mb", 100 * KIB, -3, t0 + 1000.5)
        assert t0 - 1 <= ia.created <= ib.created <= time.time() + 1
        assert sorted(tier.entries()) == sorted([ia, ib])
        assert tier.info(new_gen()) is None

    def test_two_generations_of_one_key_coexist(self, tier):
        old = self.put(tier, 100 * KIB, 1, key="same", meta=b"old")
        new = self.put(tier, 2000, 2, key="same", meta=b"new")
        assert old in tier and new in tier and old != new
        assert self.read_back(tier, old, 100 * KIB) == pattern(100 * KIB, 1)
        assert self.read_back(tier, new, 2000) == pattern(2000, 2)
        assert {(e.gen, e.key, e.meta) for e in tier.entries()} == {(old, "same", b"old"), (new, "same", b"new")}
        assert tier.delete(old)
        assert self.read_back(tier, new, 2000) == pattern(2000, 2)

    @pytest.mark.parametrize("nbytes", [10, 100 * KIB])
    def test_delete(self, tier, nbytes):
        gen = self.put(tier, nbytes, 1)
        other = self.put(tier, 500, 2)
        assert tier.delete(gen) is True
        assert tier.delete(gen) is False
        assert gen not in tier and tier.info(gen) is None
        with pytest.raises(KeyError):
            tier.read_into(gen, np.empty(nbytes, dtype=np.uint8))
        assert [e.gen for e in tier.entries()] == [other]
        assert self.read_back(tier, other, 500) == pattern(500, 2)
        assert tier.delete(new_gen()) is False

    def test_used_and_fits(self, tier):
        cap = tier.capacity
        assert tier.fits(cap) and not tier.fits(cap + 1)
        a = self.put(tier, MIB, 1)
        b = self.put(tier, 10, 2)
        c = self.put(tier, 0, 3)
        assert tier.used == MIB + 10
        assert tier.fits(cap - MIB - 10) and not tier.fits(cap - MIB - 9)
        assert tier.delete(a) and tier.used == 10
        assert tier.delete(c) and tier.used == 10
        assert tier.delete(b) and tier.used == 0
        assert tier.capacity == cap

    def test_put_that_does_not_fit(self, tier):
        cap = tier.capacity
        first = self.put(tier, cap - 100 * KIB, 1)
        before = list(tier.entries())
        for nbytes in (100 * KIB + 1, 200 * KIB):
            gen = new_gen()
            with pytest.raises(StoreFullError) as ei:
                tier.put(gen, b"m", self.payload(nbytes, 2), key="too-big")
            assert isinstance(ei.value, MemoryError)
            assert gen not in tier and tier.info(gen) is None
            assert list(tier.entries()) == before and tier.used == cap - 100 * KIB
        self.put(tier, 100 * KIB, 3)                  # exactly full fits
        assert tier.used == cap and not tier.fits(1)
        gen = new_gen()
        with pytest.raises(StoreFullError):            # a small one does not
            tier.put(gen, b"m", self.payload(1, 4), key="k")
        assert gen not in tier and tier.used == cap
        assert self.put(tier, 0, 5) in tier            # an empty one does
        assert self.read_back(tier, first, cap - 100 * KIB) == pattern(cap - 100 * KIB, 1)

    def test_a_generation_is_written_once(self, tier):
        gen = self.put(tier, 100 * KIB, 1, meta=b"first")
        for nbytes in (100 * KIB, 10):
            with pytest.raises(ValueError, match="generation"):
                tier.put(gen, b"second", self.payload(nbytes, 2), key="k")
        assert tier.info(gen).meta == b"first" and tier.used == 100 * KIB
        assert self.read_back(tier, gen, 100 * KIB) == pattern(100 * KIB, 1)

    @pytest.mark.parametrize("nbytes", [10, 100 * KIB])
    def test_read_into_wrong_size(self, tier, nbytes):
        gen = self.put(tier, nbytes, 1)
        for wrong in (nbytes - 1, nbytes + 1, 0):
            with pytest.raises(ValueError):
                tier.read_into(gen, np.empty(wrong, dtype=np.uint8))
        assert self.read_back(tier, gen, nbytes) == pattern(nbytes, 1)

    @pytest.mark.parametrize("bad", BAD_GENS, ids=repr)
    def test_bad_generations(self, tier, bad):
        with pytest.raises((TypeError, ValueError)):
            tier.put(bad, b"m", self.payload(10), key="k")
        with pytest.raises((TypeError, ValueError)):
            tier.read_into(bad, np.empty(10, dtype=np.uint8))
        with pytest.raises((TypeError, ValueError)):
            tier.info(bad)
        with pytest.raises((TypeError, ValueError)):
            tier.delete(bad)
        assert bad not in tier
        assert tier.used == 0 and list(tier.entries()) == []

    def test_largest_generation(self, tier):
        gen = 2**63 - 1
        tier.put(gen, b"m", self.payload(10, 1), key="k")
        assert gen in tier and tier.info(gen).gen == gen
        assert self.read_back(tier, gen, 10) == pattern(10, 1)
        tier.put(1, b"m", self.payload(10, 2), key="k")
        assert {e.gen for e in tier.entries()} == {1, gen}

    def test_concurrent_puts_and_reads(self, tier):
        sizes = [10, 1000, 70 * KIB, 100 * KIB, 0]
        kept: dict[int, tuple[int, int]] = {}       # gen -> (nbytes, seed)
        lock = threading.Lock()
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def worker(w: int) -> None:
            try:
                start.wait(10)
                rng = np.random.default_rng(w)
                for i in range(15):
                    seed = w * 1000 + i
                    nbytes = sizes[(i + w) % len(sizes)]
                    gen = self.put(tier, nbytes, seed, key=f"w{w}/{i}", meta=str(seed).encode())
                    assert self.read_back(tier, gen, nbytes) == pattern(nbytes, seed)
                    if i % 3 == 2:
                        assert tier.delete(gen)
                    else:
                        with lock:
                            kept[gen] = (nbytes, seed)
                    with lock:
                        some = list(kept.items())
                    if some:                   # another thread's blob (never deleted)
                        g, (n, s) = some[rng.integers(len(some))]
                        assert self.read_back(tier, g, n) == pattern(n, s)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors[0]
        assert {e.gen for e in tier.entries()} == set(kept)
        for gen, (n, s) in kept.items():
            assert tier.info(gen).meta == str(s).encode()
            assert self.read_back(tier, gen, n) == pattern(n, s)
        assert tier.used == sum(n for n, _ in kept.values())
