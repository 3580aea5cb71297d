"""A stateful model test of the tiered store: tiny tiers, checked against a dict.

Capacities are tiny (``dram="1MiB"``, ``ssd_size="4MiB"``, and in a second
variant ``hbm="256KiB", device="cpu"`` as well) and values are 1-300 KiB
numpy arrays and torch tensors, so nearly every put spills and every repeated
read promotes.  Whatever moves where, the store must hold exactly what the
dict holds: nothing lost, nothing changed, nothing resurrected.

Objects put with a TTL either expire before the next step (and must then be
gone from every tier: ``check()``, run after every step, verifies that no
SSD payload or device tensor outlives its stub and that each tier's ``used``
adds up) or outlive the run.

``StoreFullError`` is allowed only when the objects (plus, during the put, the
old and the new value of the key being replaced) could not all fit on SSD
alone; the failed put must leave the old value in place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import yrcache.store
from yrcache import StoreFullError, Tier, TieredStore
from yrcache.tiers import dram

torch = pytest.importorskip("torch")

KEYS = [f"k{i:02d}" for i in range(28)] + ["ключ/1", "键/🔑"]
SSD_SIZE = 4 * 1024 * 1024
KINDS = ["np_u8", "np_f32", "np_i64", "np_f16", "t_f32", "t_bf16", "t_i32"]
_DTYPES = {"np_u8": np.uint8, "np_f32": np.float32, "np_i64": np.int64, "np_f16": np.float16,
           "t_f32": np.float32, "t_bf16": np.uint16, "t_i32": np.int32}


def make_value(kind: str, nbytes: int, seed: int):
    """A value of about ``nbytes`` bytes; every byte depends on ``seed``."""
    dt = np.dtype(_DTYPES[kind])
    n = max(1, nbytes // dt.itemsize)
    raw = np.random.default_rng(seed).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    a = raw.view(dt)
    if kind == "np_f32":
        a = a.reshape(-1, 2) if n % 2 == 0 else a
    if not kind.startswith("t_"):
        return a
    t = torch.from_numpy(a.copy())
    return t.view(torch.bfloat16) if kind == "t_bf16" else t


def value_bytes(v) -> tuple[str, tuple, bytes]:
    """(type and dtype, shape, raw bytes) of a stored or model value."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        return (f"tensor:{t.dtype}", tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert isinstance(v, np.ndarray), type(v)
    return (f"ndarray:{v.dtype}", v.shape, v.tobytes())


def nbytes_of(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes


values = st.builds(make_value, st.sampled_from(KINDS), st.integers(1024, 300 * 1024),
                   st.integers(0, 2**32 - 1))
big_values = st.builds(make_value, st.sampled_from(KINDS), st.integers(150 * 1024, 300 * 1024),
                       st.integers(0, 2**32 - 1))
keys = st.sampled_from(KEYS)
priorities = st.integers(-2, 10)


class TieredModel(RuleBasedStateMachine):
    """Operations on a tiny tiered store and on a dict, side by side."""

    store_kw: dict = {}
    hints = [None, Tier.DRAM, Tier.SSD]

    def __init__(self):
        super().__init__()
        # Every read here is in the owner process, which never waits for a
        # demotion; a read that loops ("it kept moving") is a bug, so fail it
        # after 2 s rather than the default 10 s.
        self._read_timeout = yrcache.store.HBM_READ_TIMEOUT
        yrcache.store.HBM_READ_TIMEOUT = 2.0
        self.dir = tempfile.mkdtemp(prefix="yrcache-model-")
        self.name = f"model-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.store = TieredStore(name=self.name, dram="1MiB", ssd=os.path.join(self.dir, "ssd"),
                                 ssd_size=SSD_SIZE, **self.store_kw)
        self.model: dict[str, object] = {}
        self.full_errors = 0

    def teardown(self):
        yrcache.store.HBM_READ_TIMEOUT = self._read_timeout
        try:
            if getattr(self, "store", None) is not None:
                self.store.destroy()
        finally:
            dram.destroy(self.name)
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers

    def bytes_without(self, key: str) -> int:
        return sum(nbytes_of(v) for k, v in self.model.items() if k != key)

    def may_be_full(self, key: str, new_nbytes: int) -> bool:
        old = nbytes_of(self.model[key]) if key in self.model else 0
        return self.bytes_without(key) + old + new_nbytes > SSD_SIZE

    def hint_for(self, value, hint):
        if hint == Tier.HBM and not isinstance(value, torch.Tensor):
            return None        # the HBM tier holds tensors only
        return hint

    def assert_same(self, key, got, want):
        assert got is not None, f"{key!r} is in the model but the store returned None"
        g, w = value_bytes(got), value_bytes(want)
        assert g[:2] == w[:2], f"{key!r}: stored {g[:2]}, expected {w[:2]}"
        assert g[2] == w[2], f"{key!r}: value changed (tier {self.store.tier_of(key)!r})"

    # -------------------------------------------------------------- rules

    @initialize(items=st.lists(st.tuples(keys, big_values, priorities), max_size=18), data=st.data())
    def prefill(self, items, data):
        """Start somewhere between empty and past full (18 x 225 KiB > 4 MiB + 1 MiB)."""
        for key, value, priority in items:
            self.put(key, value, data, priority)

    @rule(key=keys, value=values, hint=st.data(), priority=priorities)
    def put(self, key, value, hint, priority):
        tier = self.hint_for(value, hint.draw(st.sampled_from(self.hints), label="tier"))
        try:
            self.store.put(key, value, tier=tier, priority=priority)
        except StoreFullError:
            assert self.may_be_full(key, nbytes_of(value)), (
                f"StoreFullError for {key!r} ({nbytes_of(value)} bytes, tier={tier!r}) with only "
                f"{self.bytes_without(key)} bytes in other objects and a {SSD_SIZE}-byte SSD tier: "
                f"{self.store.stats()['tiers']}")
            self.full_errors += 1
            return
        self.model[key] = value

    @rule(key=keys, value=values, hint=st.data(), priority=priorities, short=st.booleans())
    def put_with_ttl(self, key, value, hint, priority, short):
        """A short TTL expires before the next step, wherever the object went; a long one never here."""
        tier = self.hint_for(value, hint.draw(st.sampled_from(self.hints), label="tier"))
        try:
            self.store.put(key, value, tier=tier, priority=priority, ttl=0.001 if short else 3600)
        except StoreFullError:
            assert self.may_be_full(key, nbytes_of(value)), self.store.stats()["tiers"]
            self.full_errors += 1
            return
        if short:
            time.sleep(0.002)
            self.model.pop(key, None)
        else:
            self.model[key] = value

    @rule(key=keys, value=big_values, hint=st.data(), priority=priorities)
    def put_big(self, key, value, hint, priority):
        """150-300 KiB: fills the 4 MiB SSD tier now and then."""
        self.put(key, value, hint, priority)

    @rule(items=st.lists(st.tuples(keys, big_values, priorities), min_size=2, max_size=4),
          data=st.data())
    def put_several_big(self, items, data):
        """Several large puts in a row: the tiers fill up and StoreFullError becomes possible."""
        for key, value, priority in items:
            self.put(key, value, data, priority)

    @rule(key=keys)
    def get(self, key):
        got = self.store.get(key)
        if key in self.model:
            self.assert_same(key, got, self.model[key])
        else:
            assert got is None

    @rule(key=keys, times=st.integers(2, 4))
    def get_many_times(self, key, times):
        """Repeated reads promote (SSD -> DRAM, a DRAM tensor -> HBM)."""
        for _ in range(times):
            self.get(key)

    @rule(key=keys)
    def get_copy(self, key):
        got = self.store.get(key, copy=True)
        if key in self.model:
            self.assert_same(key, got, self.model[key])
        else:
            assert got is None

    @rule(key=keys)
    def delete(self, key):
        assert self.store.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(ks=st.lists(keys, min_size=1, max_size=5))
    def mget(self, ks):
        got = self.store.mget(ks)
        assert len(got) == len(ks)
        for k, g in zip(ks, got):
            if k in self.model:
                self.assert_same(k, g, self.model[k])
            else:
                assert g is None, k

    @rule(items=st.dictionaries(keys, values, min_size=1, max_size=3), data=st.data(),
          priority=priorities)
    def mset(self, items, data, priority):
        hint = data.draw(st.sampled_from(self.hints), label="tier")
        if hint == Tier.HBM and not all(isinstance(v, torch.Tensor) for v in items.values()):
            hint = None
        try:
            self.store.mset(items, tier=hint, priority=priority)
        except StoreFullError:
            # each put is atomic, the batch is not: every key holds its old or its new value
            need = sum(nbytes_of(v) for v in items.values())
            assert self.bytes_without("") + need > SSD_SIZE, (
                f"StoreFullError for an mset of {need} bytes with {self.bytes_without('')} "
                f"bytes stored and a {SSD_SIZE}-byte SSD tier")
            self.full_errors += 1
            for k, new in items.items():
                got = self.store.get(k)
                if got is not None and value_bytes(got) == value_bytes(new):
                    self.model[k] = new
                elif k in self.model:
                    self.assert_same(k, got, self.model[k])
                else:
                    assert got is None, f"{k!r}: neither absent (old) nor the new value"
            return
        self.model.update(items)

    @rule(prefix=st.sampled_from(["", "k0", "k1", "ключ", "键", "zz"]))
    def keys_with_prefix(self, prefix):
        assert sorted(self.store.keys(prefix=prefix)) == sorted(k for k in self.model if k.startswith(prefix))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def tier_of_is_a_tier(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)), label="key")
        assert isinstance(self.store.tier_of(key), Tier)

    # --------------------------------------------------------- invariants

    @invariant()
    def arena_is_consistent(self):
        self.store.check()

    @invariant()
    def same_keys_and_len(self):
        assert len(self.store) == len(self.model)
        assert sorted(self.store) == sorted(self.model)

    @invariant()
    def every_value_is_intact(self):
        for k, want in self.model.items():
            assert k in self.store, f"{k!r} was lost"
            self.assert_same(k, self.store.get(k), want)

    @invariant()
    def stats_add_up(self):
        st_ = self.store.stats()
        tiers = st_["tiers"]
        assert sum(t["objects"] for t in tiers.values()) == len(self.model), tiers
        assert tiers["ssd"]["used"] <= SSD_SIZE
        assert st_["evictions"] == 0          # the default policy never drops anything
        if "hbm" in tiers:
            assert tiers["hbm"]["used"] <= tiers["hbm"]["capacity"]


class HbmTieredModel(TieredModel):
    store_kw = {"hbm": "256KiB", "device": "cpu"}
    hints = [None, Tier.DRAM, Tier.SSD, Tier.HBM]


# No shrinking: with a bug present, shrinking a 50-step run of a store costs
# minutes; the failing run is printed as is (and replayed first on the next
# run, from the example database).  YRCACHE_SHRINK=1 asks for a minimal one.
_phases = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("YRCACHE_SHRINK"):
    _phases.append(Phase.shrink)
_settings = settings(max_examples=int(os.environ.get("YRCACHE_MODEL_EXAMPLES", 40)),
                     stateful_step_count=50, deadline=None, phases=_phases,
                     report_multiple_bugs=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much])

TestDramSsdModel = TieredModel.TestCase
TestDramSsdModel.settings = _settings
TestHbmDramSsdModel = HbmTieredModel.TestCase
TestHbmDramSsdModel.settings = _settings
