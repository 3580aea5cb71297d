"""Model-based test: the store against a plain dict (hypothesis state machine).

A small arena (dram="1MiB", the minimum: ~730 KiB of heap) and values up to
~200 KiB make StoreFullError a regular event.  A put that fails must leave
the old value (or the absence of one) exactly as it was; views held across
steps must never change; the arena's invariants hold after every step.
"""

from __future__ import annotations

import gc
import os
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from yrcache import StoreFullError, TieredStore

gc.freeze()  # conftest collects after every test; keep long-lived objects out of it

KEYS = ["a", "b", "c", "d", "kö", "k/🔑", "k" * 300]
key_st = st.sampled_from(KEYS)
size_st = st.one_of(
    # around the small/large put path, and big enough to fill the arena fast
    st.sampled_from([0, 1, 63, 65535, 65536, 65537, 120_000, 160_000, 190_000, 200 * 1024]),
    st.integers(0, 200 * 1024),
)
KINDS = ["bytes", "bytearray", "uint8", "float32", "int16x2"]


class Value:
    """A value to put, with what reading it back must give."""

    def __init__(self, kind: str, n: int, seed: int):
        raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        self.kind = kind
        if kind in ("bytes", "bytearray"):
            self.obj = bytes(raw) if kind == "bytes" else bytearray(raw)
            self.dtype, self.shape = None, None
        else:
            dtype = {"uint8": np.uint8, "float32": np.float32, "int16x2": np.int16}[kind]
            item = np.dtype(dtype).itemsize
            raw = raw[: n - n % (item * (2 if kind == "int16x2" else 1))]
            arr = raw.view(dtype)
            if kind == "int16x2":
                arr = arr.reshape(-1, 2)
            self.obj = arr
            self.dtype, self.shape = arr.dtype, arr.shape
        self.raw = raw.copy()  # the expected bytes, private

    def check(self, got, where: str) -> None:
        if self.dtype is None:
            assert isinstance(got, memoryview), f"{where}: {type(got)}"
            assert got.readonly
            data = np.frombuffer(got, dtype=np.uint8)
        else:
            assert isinstance(got, np.ndarray), f"{where}: {type(got)}"
            assert got.dtype == self.dtype and got.shape == self.shape, where
            assert not got.flags.writeable
            data = got.reshape(-1).view(np.uint8)
        assert data.nbytes == self.raw.nbytes, f"{where}: {data.nbytes} != {self.raw.nbytes} bytes"
        assert np.array_equal(data, self.raw), f"{where}: contents differ"

    def __repr__(self):
        return f"Value({self.kind}, {self.raw.nbytes} bytes)"


value_st = st.builds(Value, kind=st.sampled_from(KINDS), n=size_st, seed=st.integers(0, 2**16))


class StoreVersusDict(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.name = f"model-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.store = TieredStore(name=self.name, dram="1MiB")
        self.model: dict[str, Value] = {}
        self.held: list[tuple[object, Value, str]] = []  # (view, what it showed, key)
        self.fulls = 0

    def teardown(self):
        # Runs after every example, failing ones included: always clean up.
        # A leftover is recorded, not raised here, so that it cannot mask the
        # error of a failing example; test_store_versus_dict reports it.
        self.held.clear()
        s = self.store
        s.close()
        del self.store, s
        gc.collect()
        path = f"/dev/shm/yrcache.{self.name}"
        if os.path.exists(path):
            LEAKS.append(path)
            TieredStore.attach(self.name).destroy()

    # ------------------------------------------------------------ writes

    def _expect_unchanged(self, key: str, where: str) -> None:
        got = self.store.get(key)
        if key in self.model:
            self.model[key].check(got, f"{where}: old value of {key!r} after a failed put")
        else:
            assert got is None, f"{where}: failed put of {key!r} left a value behind"

    @rule(key=key_st, value=value_st, how=st.sampled_from(["put", "setitem", "mset1"]))
    def put(self, key, value, how):
        try:
            if how == "put":
                self.store.put(key, value.obj)
            elif how == "setitem":
                self.store[key] = value.obj
            else:
                self.store.mset({key: value.obj})
        except StoreFullError as e:
            assert isinstance(e, MemoryError) and "dram=" in str(e)
            self.fulls += 1
            self._expect_unchanged(key, how)
        else:
            self.model[key] = value

    @rule(k1=key_st, k2=key_st, v1=value_st, v2=value_st)
    def mset(self, k1, k2, v1, v2):
        if k1 == k2:
            return
        try:
            self.store.mset([(k1, v1.obj), (k2, v2.obj)])
        except StoreFullError:
            # each put is atomic, the batch is not: every key holds old or new
            for k, v in ((k1, v1), (k2, v2)):
                got = self.store.get(k)
                try:
                    v.check(got, "mset")
                except AssertionError:
                    self._expect_unchanged(k, "mset")
                else:
                    self.model[k] = v
        else:
            self.model[k1] = v1
            self.model[k2] = v2

    @rule(key=key_st, how=st.sampled_from(["delete", "del"]))
    def delete(self, key, how):
        if how == "delete":
            assert self.store.delete(key) is (key in self.model)
        elif key in self.model:
            del self.store[key]
        else:
            with pytest.raises(KeyError):
                del self.store[key]
        self.model.pop(key, None)

    # ------------------------------------------------------------- reads

    @rule(key=key_st)
    def get(self, key):
        got = self.store.get(key)
        if key in self.model:
            self.model[key].check(got, "get")
            self.model[key].check(self.store[key], "getitem")
        else:
            assert got is None
            with pytest.raises(KeyError):
                self.store[key]

    @rule(key=key_st)
    def get_copy(self, key):
        got = self.store.get(key, copy=True)
        if key not in self.model:
            assert got is None
            return
        v = self.model[key]
        data = np.frombuffer(memoryview(got).cast("B"), np.uint8) if v.dtype is None \
            else got.reshape(-1).view(np.uint8)
        assert np.array_equal(data, v.raw)

    @rule(keys=st.lists(key_st, max_size=5))
    def mget(self, keys):
        got = self.store.mget(keys)
        assert len(got) == len(keys)
        for k, g in zip(keys, got):
            if k in self.model:
                self.model[k].check(g, "mget")
            else:
                assert g is None

    @rule(prefix=st.sampled_from(["", "k", "a", "kö", "zz"]))
    def keys(self, prefix):
        listed = list(self.store.keys(prefix=prefix))
        assert len(listed) == len(set(listed))
        assert set(listed) == {k for k in self.model if k.startswith(prefix)}

    # -------------------------------------------------------------- views

    @precondition(lambda self: len(self.held) < 3)
    @rule(key=key_st)
    def hold_view(self, key):
        if key in self.model:
            self.held.append((self.store[key], self.model[key], key))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2))
    def drop_view(self, i):
        self.held.pop(i % len(self.held))

    # ---------------------------------------------------------- invariants

    @invariant()
    def arena_is_consistent(self):
        self.store.check()

    @invariant()
    def same_keys_and_values(self):
        assert len(self.store) == len(self.model)
        assert set(self.store) == set(self.model)
        for k, v in self.model.items():
            v.check(self.store[k], f"value of {k!r}")

    @invariant()
    def held_views_never_change(self):
        for view, v, key in self.held:
            v.check(view, f"held view of {key!r}")


LEAKS: list[str] = []

MODEL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_store_versus_dict():
    LEAKS.clear()
    run_state_machine_as_test(StoreVersusDict, settings=MODEL_SETTINGS)
    assert not LEAKS, f"closing the store (and dropping every view) left segments behind: {LEAKS}"


def test_store_fills_up_in_this_model():
    """The machine is only useful if StoreFullError really happens with these sizes."""
    name = f"model-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    s = TieredStore(name=name, dram="1MiB")
    try:
        with pytest.raises(StoreFullError):
            for i in range(8):
                s[f"k{i}"] = np.zeros(200 * 1024, np.uint8)
    finally:
        s.close()
    assert not os.path.exists(f"/dev/shm/yrcache.{name}")
