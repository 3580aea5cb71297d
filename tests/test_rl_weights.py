"""Tests for yrcache.rl.weights: versioned weight publish/subscribe with resharding."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from yrcache import StoreClosedError
from yrcache.rl import Fused, Shard, WeightPublisher, WeightSubscriber
from yrcache.rl import subscribe as W

# --------------------------------------------------------------------------- helpers


def split_local(full, dim, sizes, rank):
    """Rank ``rank``'s slab of ``full`` cut along ``dim`` into ``sizes`` (uneven, may be 0)."""
    if isinstance(full, np.ndarray):
        return np.split(full, np.cumsum(sizes)[:-1], axis=dim)[rank]
    return torch.split(full, list(sizes), dim=dim)[rank]


def publish_all(pubs, fulls, pub_dims, sizes, version, dtype=None):
    """Every rank of ``pubs`` publishes its part of ``fulls``; returns the last publish's result."""
    done = None
    for r, pub in enumerate(pubs):
        state, layout = {}, {}
        for name, full in fulls.items():
            d = pub_dims.get(name)
            if d is None:
                state[name] = full
            else:
                state[name] = split_local(full, d, sizes[name], r)
                layout[name] = Shard(d, r, len(pubs))
        done = pub.publish(state, version=version, layout=layout, dtype=dtype)
    return done


def expect(full, shard):
    """The reference slice: numpy.array_split / torch.tensor_split of the full tensor."""
    if shard is None:
        return full
    if isinstance(full, np.ndarray):
        return np.array_split(full, shard.count, axis=shard.dim)[shard.index]
    return torch.tensor_split(full, shard.count, dim=shard.dim)[shard.index]


def same(a, b):
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def uneven(m, base):
    """Uneven per-rank sizes summing to something not divisible by common N; one empty for m == 3."""
    return {1: [base + 3], 2: [base, base + 3], 3: [base + 1, 0, base + 4]}[m]


def rl_keys(store, name="policy"):
    return sorted(store.keys(prefix=f"__rl__/{name}/"))


# --------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_reshard_matches_slicing(make_store, m, n):
    """M publishers x N subscribers: every fetched slice equals slicing the full tensor."""
    store = make_store(dram="32MiB")
    g = torch.Generator().manual_seed(m * 10 + n)
    s0, s1, s2 = uneven(m, 2), uneven(m, 3), uneven(m, 1)
    fulls = {
        "w0": torch.randn(sum(s0), 6, 5, generator=g),        # published dim 0, fetched dim 1
        "w1": torch.randn(5, sum(s1), generator=g),           # published dim 1, fetched dim 0
        "w2": torch.randn(3, 2, sum(s2), generator=g),        # published dim -1, fetched dim -1
        "emb": torch.randn(sum(s0), 4, generator=g),          # same dim on both sides
        "npw": np.random.default_rng(m).standard_normal((7, sum(s1))).astype(np.float32),
        "norm": torch.randn(9, generator=g),                  # replicated, fetched sharded
        "scale": torch.tensor(1.5),                           # replicated 0-d, fetched whole
        "steps": torch.arange(11, dtype=torch.int64),         # replicated, whole
    }
    pub_dims = {"w0": 0, "w1": 1, "w2": -1, "emb": 0, "npw": 1}
    sizes = {"w0": s0, "w1": s1, "w2": s2, "emb": s0, "npw": s1}
    pubs = [WeightPublisher(store, "policy", rank=r, world=m) for r in range(m)]
    assert publish_all(pubs, fulls, pub_dims, sizes, version=7) is True
    sub = WeightSubscriber(store, "policy")
    assert sub.latest() == 7
    for k in range(n):
        layout = {"w0": Shard(1, k, n), "w1": Shard(0, k, n), "w2": Shard(-1, k, n),
                  "emb": Shard(0, k, n), "npw": Shard(0, k, n), "norm": Shard(0, k, n)}
        got = sub.fetch(7, layout=layout)
        assert set(got) == set(fulls)
        for name, full in fulls.items():
            assert same(got[name], expect(full, layout.get(name))), (name, k)
        st = sub.last_fetch_stats
        assert st["bytes_copied"] == st["bytes_needed"]
        if n > 1:
            assert st["bytes_copied"] < st["bytes_version"]
    whole = sub.fetch(7)
    for name, full in fulls.items():
        assert same(whole[name], full), name
    # replicated tensors are stored once, by rank 0
    parts = [k for k in rl_keys(store) if "/p/" in k]
    assert len([k for k in parts if k.endswith("/norm")]) == 1
    assert len(parts) == 5 * m + 3


def test_cast_on_publish_and_fetch(make_store):
    store = make_store()
    full = torch.randn(9, 10)
    npf = np.linspace(0, 1, 24, dtype=np.float32).reshape(4, 6)
    fulls = {"w": full, "ids": torch.arange(6), "npf": npf, "npi": np.arange(5, dtype=np.int32),
             "np0": np.array(3.5, dtype=np.float32)}
    pubs = [WeightPublisher(store, "policy", rank=r, world=2) for r in range(2)]
    publish_all(pubs, fulls, {"w": 0}, {"w": [4, 5]}, version=1, dtype=torch.bfloat16)
    sub = WeightSubscriber(store, "policy")
    for k in range(3):
        got = sub.fetch(1, layout={"w": Shard(1, k, 3)})
        assert same(got["w"], expect(full.to(torch.bfloat16), Shard(1, k, 3)))
        assert same(got["ids"], torch.arange(6))                          # ints are never cast
        assert same(got["npf"], torch.from_numpy(npf).to(torch.bfloat16))  # numpy + torch dtype -> tensor
        assert same(got["npi"], np.arange(5, dtype=np.int32))
        assert same(got["np0"], torch.tensor(3.5, dtype=torch.bfloat16))     # a 0-d array stays 0-d
        up = sub.fetch(1, layout={"w": Shard(1, k, 3)}, dtype=torch.float32)
        assert same(up["w"], expect(full.to(torch.bfloat16).float(), Shard(1, k, 3)))
        assert up["ids"].dtype == torch.int64
    # numpy arrays cast to numpy dtypes stay numpy
    pub = WeightPublisher(store, "np")
    pub.publish({"a": npf}, version=1, dtype=np.float16)
    got = WeightSubscriber(store, "np").fetch(1)["a"]
    assert same(got, npf.astype(np.float16))
    with pytest.raises(TypeError, match="numpy has no"):
        WeightSubscriber(store, "np").fetch(1, dtype=torch.bfloat16)


@pytest.mark.parametrize("m,n", [(1, 4), (2, 2), (3, 4)])
def test_fused_targets(make_store, m, n):
    store = make_store()
    g = torch.Generator().manual_seed(m + n)
    fulls = {"q": torch.randn(16, 6, generator=g), "k": torch.randn(4, 6, generator=g),
             "v": torch.randn(4, 6, generator=g), "gate": torch.randn(6, 10, generator=g),
             "up": torch.randn(6, 10, generator=g), "o": torch.randn(6, 7, generator=g)}
    sz = {2: [2, 2], 1: [4], 3: [1, 2, 1]}[m]
    gu = {1: [10], 2: [3, 7], 3: [5, 0, 5]}[m]
    sizes = {"q": [x * 4 for x in sz], "k": sz, "v": sz, "gate": gu, "up": gu}
    pubs = [WeightPublisher(store, "policy", rank=r, world=m) for r in range(m)]
    publish_all(pubs, fulls, {"q": 0, "k": 0, "v": 0, "gate": 1, "up": 1}, sizes, version=3)
    sub = WeightSubscriber(store, "policy")
    for k in range(n):
        layout = {"qkv": Fused(["q", "k", "v"], dim=0, shard=Shard(0, k, n)),
                  "gate_up": Fused(["gate", "up"], dim=1, shard=Shard(1, k, n)),
                  "o_t": None}
        with pytest.raises(KeyError, match="no tensor 'o_t'"):
            sub.fetch(3, layout=layout)
        del layout["o_t"]
        got = sub.fetch(3, layout=layout)
        assert set(got) == {"qkv", "gate_up", "o"}       # sources consumed; o whole
        qkv = torch.cat([expect(fulls[x], Shard(0, k, n)) for x in "qkv"], dim=0)
        gu = torch.cat([expect(fulls[x], Shard(1, k, n)) for x in ("gate", "up")], dim=1)
        assert same(got["qkv"], qkv) and same(got["gate_up"], gu) and same(got["o"], fulls["o"])
        assert sub.last_fetch_stats["bytes_copied"] == sub.last_fetch_stats["bytes_needed"]
    whole = sub.fetch(3, layout={"kv": Fused(["k", "v"], dim=1)})
    assert same(whole["kv"], torch.cat([fulls["k"], fulls["v"]], dim=1)) and "q" in whole


def test_fetch_into(make_store):
    store = make_store()
    full = torch.randn(8, 12)
    pubs = [WeightPublisher(store, "policy", rank=r, world=2) for r in range(2)]
    fulls = {"w": full, "b": np.arange(12, dtype=np.float64), "h": full.half()}
    publish_all(pubs, fulls, {"w": 0, "h": 0}, {"w": [3, 5], "h": [3, 5]}, version=1)
    sub = WeightSubscriber(store, "policy")
    lay = {"w": Shard(1, 1, 3), "h": Shard(1, 2, 3)}
    dst = {"w": torch.zeros(8, 4), "b": np.zeros(12), "h": torch.zeros(8, 4, dtype=torch.float32)}
    out = sub.fetch(1, layout=lay, into=dst)
    assert all(out[k] is dst[k] for k in dst)
    assert torch.equal(dst["w"], full[:, 4:8])
    assert np.array_equal(dst["b"], np.arange(12.0))
    assert torch.equal(dst["h"], full.half()[:, 8:].float())             # cast into the into dtype
    nb = np.zeros((8, 4), dtype=np.float32)                               # torch-stored into ndarray
    sub.fetch(1, layout=lay, into={"w": nb})
    assert np.array_equal(nb, full[:, 4:8].numpy())
    with pytest.raises(ValueError, match="shape"):
        sub.fetch(1, layout=lay, into={"w": torch.zeros(8, 5)})
    with pytest.raises(ValueError, match="does not return"):
        sub.fetch(1, layout=lay, into={"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="contiguous"):
        sub.fetch(1, layout=lay, into={"w": torch.zeros(4, 8).t()})
    with pytest.raises(ValueError, match="conflicts"):
        sub.fetch(1, layout=lay, into={"w": torch.zeros(8, 4)}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device meta"):
        sub.fetch(1, layout=lay, into={"w": torch.empty(8, 4, device="meta")})
    for wrong in (torch.zeros(8, 4, dtype=torch.int32), np.zeros((8, 4), np.int64), torch.zeros(8, 4).bool()):
        with pytest.raises(TypeError, match="would truncate"):           # floats into integers
            sub.fetch(1, layout=lay, into={"w": wrong})
        assert not wrong.any()
    # every destination is checked before any is written: "w" stays untouched
    w = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"into\['h'\] has shape"):
        sub.fetch(1, layout=lay, into={"w": w, "h": torch.zeros(8, 5)})
    assert not w.any()


def test_large_results_reuse_pooled_pages_and_stay_private(make_store):
    """A fetch's results of 1 MiB or more sit on pooled private buffers: dropping them
    hands the pages back (the next fetch takes them instead of faulting new ones);
    results held at once never share memory and writing one changes nothing stored."""
    from yrcache import buffers
    store = make_store(dram="64MiB")
    full = {"w": torch.arange(1024 * 512, dtype=torch.float32).view(1024, 512),   # 2 MiB
            "a": np.arange(1024 * 256, dtype=np.float64).reshape(256, 1024)}       # 2 MiB
    WeightPublisher(store, "policy").publish(full, version=1)
    sub = WeightSubscriber(store, "policy")
    before = buffers.POOL.pooled
    out = sub.fetch(1)
    assert torch.equal(out["w"], full["w"]) and np.array_equal(out["a"], full["a"])
    took = before - buffers.POOL.pooled                  # 0: the pool was empty, new mappings
    del out
    gc.collect()
    assert buffers.POOL.pooled == before - took + (4 << 20)   # both results' pages came back
    one, two = sub.fetch(1), sub.fetch(1)
    assert buffers.POOL.pooled <= before - took               # the first took the pooled pages
    one["w"].fill_(-1.0)
    one["a"][:] = -1.0
    assert torch.equal(two["w"], full["w"]) and np.array_equal(two["a"], full["a"])
    assert torch.equal(sub.fetch(1)["w"], full["w"])
    assert one["a"].flags.writeable and one["w"].is_contiguous()


def _forked_child_succeeds(check) -> bool:
    """Fork a child that exits 0 when ``check()`` is true; False if it fails or hangs (20 s)."""
    child = multiprocessing.get_context("fork").Process(target=lambda: os._exit(0 if check() else 1))
    child.start()
    child.join(20)
    if child.exitcode is None:
        child.kill()
        child.join()
    return child.exitcode == 0


def test_a_forked_child_takes_pooled_buffers_while_the_parent_holds_the_pool():
    """A child forked while another thread of the parent held the pool's lock (here the
    parent itself holds it across the fork) still gets buffers: a DataLoader worker forked
    mid-fetch must not hang in its first fetch."""
    from yrcache import buffers
    with buffers.POOL._lock:
        assert _forked_child_succeeds(lambda: len(buffers.POOL.take(3 << 20)) == 3 << 20)


def test_a_forked_child_runs_rl_work_on_threads_of_its_own():
    """rl's thread pool (a cluster publish's sends, a fetch's pulls) was the parent's in a
    forked child, whose copy has none of its threads: the child's first publish over a store
    it opened itself hung forever."""
    from yrcache.rl.remote import pool
    assert pool().submit(lambda: 1).result(timeout=10) == 1     # the parent's pool, with threads
    assert _forked_child_succeeds(lambda: pool().submit(lambda: 7).result(timeout=10) == 7)


def test_staging_buckets(make_store, monkeypatch):
    """Casting destinations are gathered through reused host buckets (small here: many refills)."""
    monkeypatch.setattr(W, "BUCKET_BYTES", 1024)
    store = make_store()
    fulls = {f"t{i}": torch.randn(6 + i, 40) for i in range(6)}            # 1-2 KiB slices
    pubs = [WeightPublisher(store, "policy", rank=r, world=2) for r in range(2)]
    publish_all(pubs, fulls, dict.fromkeys(fulls, 0), {k: [3, 3 + i] for i, k in enumerate(fulls)},
                version=1, dtype=torch.bfloat16)
    lay = {k: Shard(1, 1, 2) for k in fulls}
    into = {k: torch.zeros(6 + i, 20, dtype=torch.float64) for i, k in enumerate(fulls)}
    WeightSubscriber(store, "policy").fetch(1, layout=lay, into=into)
    for k, full in fulls.items():
        assert torch.equal(into[k], full.to(torch.bfloat16)[:, 20:].double()), k


def test_publish_validation_and_wait(make_store):
    store = make_store()
    for wrong in (None, "policy-store", {}):      # (an AttributeError later, at the first call)
        for cls in (WeightSubscriber, WeightPublisher):
            with pytest.raises(TypeError, match="must be a TieredStore"):
                cls(wrong, "policy")
    sub = WeightSubscriber(store, "policy")
    assert sub.latest() is None and sub.versions() == []
    with pytest.raises(ValueError, match="number of seconds"):
        sub.wait(timeout="1")
    with pytest.raises(TimeoutError) as ei:
        sub.wait(timeout=0.01)
    assert "in flight" not in str(ei.value)                     # nothing begun
    p0, p1 = (WeightPublisher(store, "policy", rank=r, world=2) for r in range(2))
    t = torch.ones(4, 2)
    with pytest.raises(ValueError, match="index=0, count=2"):
        p0.publish({"w": t}, version=1, layout={"w": Shard(0, 1, 2)})
    with pytest.raises(ValueError, match="not in the state dict"):
        p0.publish({"w": t}, version=1, layout={"x": Shard(0, 0, 2)})
    with pytest.raises(TypeError):
        p0.publish({"w": [1, 2]}, version=1)
    assert p0.publish({"w": t, "r": t}, version=1, layout={"w": Shard(0, 0, 2)}) is False
    assert sub.latest() is None                                  # rank 1 has not published yet
    with pytest.raises(KeyError, match="not complete"):
        sub.fetch(1)
    assert p1.publish({"w": t, "r": t}, version=1, layout={"w": Shard(0, 1, 2)}) is True
    assert sub.wait(timeout=1) == 1 and sub.wait(newer_than=0, timeout=1) == 1
    assert same(sub.fetch(1)["w"], torch.ones(8, 2)) and same(sub.fetch(1)["r"], t)
    with pytest.raises(ValueError, match="must increase"):
        p0.publish({"w": t}, version=1, layout={"w": Shard(0, 0, 2)})
    with pytest.raises(ValueError, match="not newer than the latest complete"):
        WeightPublisher(store, "policy", rank=1, world=2).publish({"w": t}, version=1)
    with pytest.raises(KeyError, match="no tensor 'x'"):
        sub.fetch(1, layout={"x": Shard(0, 0, 2)})
    with pytest.raises(ValueError, match=r"layout\['w'\] for shape \(8, 2\): dim 5 is out of range"):
        sub.fetch(1, layout={"w": Shard(5, 0, 2)})
    with pytest.raises(ValueError, match=r"layout\['w'\]: dim 5 is out of range"):
        p0.publish({"w": t}, version=2, layout={"w": Shard(5, 0, 2)})
    # staleness: v2 in flight (rank 0 only); a caller at v1 is 1 behind the trainer
    p0.publish({"w": t, "r": t}, version=2, layout={"w": Shard(0, 0, 2)})
    with pytest.raises(TimeoutError, match=r"version 2 is in flight, waiting for rank\(s\) 1 of world=2"):
        sub.wait(newer_than=1, timeout=0.02)
    with pytest.raises(TimeoutError):
        sub.wait(newer_than=1, timeout=0.02, max_staleness=0)
    assert sub.wait(newer_than=1, timeout=0.02, max_staleness=1) == 1
    timer = threading.Timer(0.05, p1.publish, ({"w": t, "r": t}, 2), {"layout": {"w": Shard(0, 1, 2)}})
    timer.start()
    assert sub.wait(newer_than=1, timeout=5) == 2
    timer.join()
    # inconsistent ranks: a version never becomes visible, the completing rank is told
    p0.publish({"w": t}, version=3, layout={"w": Shard(0, 0, 2)})
    with pytest.raises(ValueError, match="missing on rank"):
        p1.publish({"x": t}, version=3, layout={"x": Shard(0, 1, 2)})
    p0.publish({"w": t}, version=4, layout={"w": Shard(0, 0, 2)})
    with pytest.raises(ValueError, match="not on rank 0"):
        p1.publish({"w": t, "z": t}, version=4, layout={"w": Shard(0, 1, 2)})
    p0.publish({"w": t}, version=5, layout={"w": Shard(0, 0, 2)})
    with pytest.raises(ValueError, match=r"version 5 of 'policy': tensor 'w': rank 1 part \(4, 3\) differs"):
        p1.publish({"w": torch.ones(4, 3)}, version=5, layout={"w": Shard(0, 1, 2)})
    # the completing rank's part is withdrawn: it may publish the version again, fixed
    with pytest.raises(TimeoutError, match=r"version 5 is in flight, waiting for rank\(s\) 1 of world=2"):
        sub.wait(newer_than=2, timeout=0)
    assert sub.latest() == 2
    assert p1.publish({"w": t}, version=5, layout={"w": Shard(0, 1, 2)}) is True
    assert same(sub.fetch(5)["w"], torch.ones(8, 2))
    with pytest.raises(KeyError, match=r"version 3 of 'policy' never completed \(readable: \[2, 5\]\)"):
        sub.fetch(3)                        # (it said "reclaimed")
    with pytest.raises(KeyError, match="version 1 of 'policy' was reclaimed"):
        sub.fetch(1)


def test_publish_and_fetch_refuse_what_they_cannot_store_before_writing(make_store):
    """Bad arguments are refused up front, with the fix in the message, and leave no keys."""
    store = make_store()
    pub, sub = WeightPublisher(store, "policy"), WeightSubscriber(store, "policy")
    w = torch.tensor([0.4, 1.7, -2.6, 300.0])
    for dt in (torch.int8, torch.bool, np.int32, torch.complex64):   # would truncate or wrap
        with pytest.raises(TypeError, match="not a floating-point dtype"):
            pub.publish({"w": w}, version=1, dtype=dt)
    with pytest.raises(TypeError, match="floating-point dtype"):
        pub.publish({"w": w}, version=1, dtype="bfloat17")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch deprecates making quantized tensors
        q = torch.quantize_per_tensor(w, 0.1, 3, torch.quint8)
    with pytest.raises(TypeError, match="'q' is quantized"):
        pub.publish({"w": w, "q": q}, version=1)
    with pytest.raises(ValueError, match=r"0\.\.2\*\*63-1"):
        pub.publish({"w": w}, version=2 ** 63)
    with pytest.raises(ValueError, match=r"tensor name 'xxx.*may be at most \d+.*shorten"):
        pub.publish({"w": w, "x" * 1000: w}, version=1)
    assert list(store.keys()) == []                              # nothing begun, nothing written
    assert pub.publish({"w": w}, version=2 ** 63 - 1) is True    # the largest version
    assert sub.latest() == 2 ** 63 - 1
    assert same(sub.fetch(2 ** 63 - 1, dtype=torch.float16)["w"], w.half())
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        sub.fetch(2 ** 63 - 1, dtype=torch.int32)
    for bad in ("n" * 129, "\u00e9" * 65, "", "a/b"):             # 129 and 130 UTF-8 bytes
        for cls in (WeightPublisher, WeightSubscriber):
            with pytest.raises(ValueError, match="1-128 UTF-8 bytes without '/'"):
                cls(store, bad)
    longest = "\u00e9" * 64                                      # 128 bytes: its records fit
    WeightPublisher(store, longest).publish({"w": w}, version=1)
    assert WeightSubscriber(store, longest).wait(timeout=1) == 1


def test_a_closed_store_is_not_read(make_store):
    store = make_store()
    pub, sub = WeightPublisher(store, "policy"), WeightSubscriber(store, "policy")
    pub.publish({"w": torch.ones(3)}, version=1)
    got: list = []

    def waiter() -> None:                    # blocked in wait() when another thread closes the store
        try:
            sub.wait(newer_than=1)
        except StoreClosedError as e:
            got.append(e)
    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.3)
    store.close()
    th.join(5)
    assert not th.is_alive() and len(got) == 1      # it waited forever before
    for call in (sub.latest, sub.versions, lambda: sub.wait(timeout=0), lambda: sub.wait(newer_than=0),
                 pub.latest):
        with pytest.raises(StoreClosedError, match="closed"):
            call()


def test_failed_publish_leaves_nothing(make_store):
    store = make_store(dram="16MiB")
    pub = WeightPublisher(store, "policy")
    pub.publish({"a": torch.ones(10)}, version=1)
    before = set(store.keys())
    with pytest.raises(MemoryError):
        pub.publish({"a": torch.ones(10), "huge": torch.ones(8 << 20)}, version=2)
    assert not [k for k in set(store.keys()) - before if "/p/" in k or "/m/" in k]
    assert WeightSubscriber(store, "policy").latest() == 1


# --------------------------------------------------------------------------- reclamation


def test_keep_reclaims_memory(make_store, monkeypatch):
    store = make_store(dram="32MiB")
    pub = WeightPublisher(store, "policy", keep=2)
    sub = WeightSubscriber(store, "policy")
    mib = torch.zeros(1 << 18)   # 1 MiB
    used = []
    for v in range(1, 9):
        pub.publish({"w": mib + v, "b": torch.full((3,), float(v))}, version=v)
        used.append(store.stats()["tiers"]["dram"]["used"])
        assert sub.versions() == list(range(max(1, v - 1), v + 1))
    assert max(used[2:]) <= used[1] + 4096
    assert {k.split("/")[3] for k in rl_keys(store) if "/v/" in k} == {f"{7:020d}", f"{8:020d}"}
    with pytest.raises(KeyError, match=r"version 5 of 'policy' was reclaimed \(keep=2\)"):
        sub.fetch(5)
    # a fetch in progress holds its snapshot: retiring its version mid-copy disturbs nothing,
    # and the memory comes back once the fetch has returned
    real, calls = W._run_plan, []

    def publish_midway(*a, **kw):
        if not calls:
            for v in (9, 10):
                pub.publish({"w": mib + v, "b": torch.full((3,), float(v))}, version=v)
            calls.append(store.stats()["tiers"]["dram"]["used"])
        return real(*a, **kw)

    monkeypatch.setattr(W, "_run_plan", publish_midway)
    got = sub.fetch(8)
    assert torch.equal(got["w"], mib + 8) and torch.equal(got["b"], torch.full((3,), 8.0))
    assert calls[0] > used[1] + (1 << 20)      # v8's parts were pinned past their retirement
    del got
    gc.collect()
    assert store.stats()["tiers"]["dram"]["used"] <= used[1] + 4096
    assert sub.versions() == [9, 10]


# --------------------------------------------------------------------------- processes


K_TORN, ROWS_TORN = 150, 64      # versions; rows per rank (each part 64 x 2048 int64 = 1 MiB)


def _torn_publisher(store, rank, world, go):
    pub = WeightPublisher(store, "policy", rank=rank, world=world, keep=2)
    go.wait(60)
    for v in range(1, K_TORN + 1):
        part = np.full((ROWS_TORN, 2048), v * 1000 + rank, dtype=np.int64)
        pub.publish({"w": part, "r": np.full(33, v, dtype=np.int32)}, version=v,
                    layout={"w": Shard(0, rank, world)})
    store.close()


def _check_consistent(sub, v, k):
    got = sub.fetch(v, layout={"w": Shard(1, k, 2)})
    w, r = got["w"], got["r"]
    assert np.all(w // 1000 == v) and np.all(r == v), (v, np.unique(w // 1000), np.unique(r))
    assert np.array_equal(w[:, 0] % 1000, np.repeat([0, 1], ROWS_TORN))


def _torn_reader(sub, k):
    """Fetch the newest version over and over until the last one; return the versions verified."""
    verified = set()
    while K_TORN not in verified:
        v = sub.latest()
        if v is None:
            continue
        try:
            _check_consistent(sub, v, k)
            verified.add(v)
        except KeyError:          # reclaimed between latest() and fetch(): allowed, retry
            pass
    return verified


def _torn_subscriber(store, q, ready):
    try:
        ready.set()
        q.put(("ok", len(_torn_reader(WeightSubscriber(store, "policy"), 1))))
    except BaseException as e:  # noqa: BLE001 - report anything to the parent
        q.put(("error", repr(e)))
    store.close()


def test_no_torn_reads(make_store):
    """Publishers write versions 1..K in a tight loop while subscribers fetch: every fetched
    state belongs to exactly one version."""
    store = make_store(dram="96MiB")
    ctx = multiprocessing.get_context("fork")
    q, go, ready = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_torn_publisher, args=(store, r, 2, go)) for r in range(2)]
    procs.append(ctx.Process(target=_torn_subscriber, args=(store, q, ready)))
    for p in procs:
        p.start()
    try:
        assert ready.wait(30)
        go.set()
        sub = WeightSubscriber(store, "policy")
        mine = _torn_reader(sub, 0)
        status, theirs = q.get(timeout=60)
        assert status == "ok", theirs
        assert len(mine) >= 5 and theirs >= 5, (len(mine), theirs)   # they really overlapped
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert sub.versions() == [K_TORN - 1, K_TORN]


def _rank1_dies_mid_publish(store, ready):
    pub = WeightPublisher(store, "policy", rank=1, world=2)
    real = store.put_with

    def stall_after_first(*a, **kw):
        real(*a, **kw)
        ready.set()
        time.sleep(120)

    store.put_with = stall_after_first
    state = {f"w{i}": torch.full((4, 8), 2.0) for i in range(4)}
    pub.publish(state, version=2, layout={n: Shard(0, 1, 2) for n in state})


def test_publisher_killed_mid_publish(make_store, mp_context):
    store = make_store()
    p0, p1 = (WeightPublisher(store, "policy", rank=r, world=2) for r in range(2))
    names = [f"w{i}" for i in range(4)]
    for r, p in enumerate((p0, p1)):
        p.publish({n: torch.full((4, 8), 1.0) for n in names}, version=1,
                  layout={n: Shard(0, r, 2) for n in names})
    p0.publish({n: torch.full((4, 8), 2.0) for n in names}, version=2,
               layout={n: Shard(0, 0, 2) for n in names})
    ready = mp_context.Event()
    child = mp_context.Process(target=_rank1_dies_mid_publish, args=(store, ready))
    child.start()
    try:
        assert ready.wait(60), "rank 1 never started publishing"
        assert any(f"/{2:020d}/p/1/" in k for k in rl_keys(store))   # it wrote a part...
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert child.exitcode == -signal.SIGKILL
    sub = WeightSubscriber(store, "policy")
    assert sub.latest() == 1                                          # ...but v2 never appears
    with pytest.raises(TimeoutError):
        sub.wait(newer_than=1, timeout=0.05)
    with pytest.raises(KeyError):
        sub.fetch(2)
    got = sub.fetch(1, layout={"w0": Shard(1, 0, 2)})
    assert same(got["w0"], torch.ones(8, 4)) and same(got["w3"], torch.ones(8, 8))
    # a restarted rank 1 can finish v2; later versions reclaim the dead rank's leftovers
    p1b = WeightPublisher(store, "policy", rank=1, world=2)
    assert p1b.publish({n: torch.full((4, 8), 2.0) for n in names}, version=2,
                       layout={n: Shard(0, 1, 2) for n in names})
    assert same(sub.fetch(2)["w1"], torch.full((8, 8), 2.0))
    for v in (3, 4):
        for r, p in enumerate((p0, p1b)):
            p.publish({n: torch.full((4, 8), float(v)) for n in names}, version=v,
                      layout={n: Shard(0, r, 2) for n in names})
    assert not [k for k in rl_keys(store) if f"/{2:020d}/" in k]
    store.check()


def _late_subscriber(store, q, go):
    try:
        sub = WeightSubscriber(store, "policy")
        v = sub.latest()
        got = sub.fetch(v, layout={"w": Shard(1, 1, 4)})
        ok = torch.equal(got["w"], torch.full((10, 2), float(v), dtype=torch.bfloat16))
        q.put(("late", v, ok))
        go.wait(30)
        v2 = sub.wait(newer_than=v, timeout=30)
        got = sub.fetch(v2, layout={"w": Shard(1, 3, 4)})
        q.put(("late2", v2, torch.equal(got["w"], torch.full((10, 1), float(v2), dtype=torch.bfloat16))))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e), False))
    store.close()


def _holding_subscriber(store, q, go):
    try:
        sub = WeightSubscriber(store, "policy")
        v = sub.wait(timeout=30)
        held = sub.fetch(v, layout={"w": Shard(1, 0, 4)})
        q.put(("held", v, True))
        go.wait(30)
        newest = sub.wait(newer_than=v, timeout=30)
        try:
            sub.fetch(v)
            reclaimed = False
        except KeyError as e:
            reclaimed = "reclaimed" in str(e)
        ok = torch.equal(held["w"], torch.full((10, 2), float(v), dtype=torch.bfloat16))
        q.put(("held2", newest, ok and reclaimed))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e), False))
    store.close()


def test_spawned_subscribers(make_store):
    """Subscribers in spawned processes: one attaches late, one holds a version while newer arrive."""
    store = make_store()
    ctx = multiprocessing.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    pubs = [WeightPublisher(store, "policy", rank=r, world=2, keep=2) for r in range(2)]

    def publish(v):
        for r, p in enumerate(pubs):
            p.publish({"w": torch.full((5, 7), float(v))}, version=v, layout={"w": Shard(0, r, 2)},
                      dtype=torch.bfloat16)

    holder = ctx.Process(target=_holding_subscriber, args=(store, q, go))
    holder.start()
    try:
        publish(1)
        assert q.get(timeout=60) == ("held", 1, True)
        for v in (2, 3, 4):
            publish(v)
        late = ctx.Process(target=_late_subscriber, args=(store, q, go))
        late.start()
        try:
            assert q.get(timeout=60) == ("late", 4, True)
            go.set()
            assert q.get(timeout=60) == ("held2", 4, True)
            publish(5)
            assert q.get(timeout=60) == ("late2", 5, True)
        finally:
            late.join(30)
    finally:
        holder.join(30)
    assert holder.exitcode == 0 and late.exitcode == 0


def test_first_fetch_in_a_new_process_imports_nothing_heavy(make_store):
    """A new rollout process's first fetch is the cold sync users wait on: planning it
    must not pull in modules it does not use (``np.unique``'s first call imports
    ``numpy.ma``, ~20 ms here, which once made every new subscriber's first fetch that
    much slower). Row, column and whole-tensor plans are all exercised."""
    from procs import fresh_python
    store = make_store()
    pub = WeightPublisher(store, "policy", rank=0, world=1)
    pub.publish({"w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48),
                 "b": torch.ones(48)}, version=1)
    script = (
        "import sys, torch, numpy\n"
        "from yrcache import TieredStore\n"
        "from yrcache.rl import Shard, WeightSubscriber\n"
        f"s = TieredStore.attach({store.name!r}, prefault=False)\n"
        "sub = WeightSubscriber(s, 'policy')\n"
        "a = sub.fetch(1, layout={'w': Shard(1, 1, 3)})\n"
        "b = sub.fetch(1, layout={'w': Shard(0, 2, 3)})\n"
        "assert torch.equal(a['w'], torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)[:, 16:32])\n"
        "assert torch.equal(b['w'], torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)[43:])\n"
        "heavy = sorted(m for m in ('numpy.ma', 'numpy.lib.recfunctions', 'scipy') if m in sys.modules)\n"
        "del a, b\n"
        "s.close()\n"
        "print(heavy)\n")
    out = fresh_python(script)
    assert out.strip() == "[]", out
