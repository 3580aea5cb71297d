"""RL weight sync with device tensors: publish from them, fetch straight into them.

Every test runs on "cpu" and, where CUDA is present, on "cuda:0".  On a machine
without a GPU the cuda cases are skipped; the cpu cases run the same publish and
fetch code (sources, casts, staging buckets, flushes, and the gather on a CUDA
destination's device, forced onto the CPU), minus the CUDA copies themselves: the D2H
of a device source, the asynchronous H2D copies, and ``cudaHostRegister`` of the
arena.  Those run where a GPU is lent (``bench/gpu_session.sh`` runs this file there,
with ``bench/gpu_check.py``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from yrcache.rl import Shard, WeightPublisher, WeightSubscriber  # noqa: E402
from yrcache.rl import staging, subscribe as W  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (the cpu case runs the same code)"))]


@pytest.fixture(params=["on-device", "staged"])
def gather(request, monkeypatch):
    """Both ways a destination that cannot be written in place is filled: rows picked on
    its device from whole source spans (CUDA; here on the CPU too), or gathered on the
    host into staging buckets first."""
    if request.param == "staged":
        monkeypatch.setattr(staging, "DEVICE_SPAN_MAX", 0)
    else:
        monkeypatch.setattr(staging, "DEVICE_TYPES", ("cuda", "cpu"))
    return request.param


def publish(store, fulls, version, device, dtype=torch.bfloat16):
    """Two ranks publish dim-0 halves of every tensor of ``fulls``, held on ``device``."""
    for r in range(2):
        state = {k: torch.tensor_split(v, 2, 0)[r].to(device) for k, v in fulls.items()}
        WeightPublisher(store, "p", rank=r, world=2).publish(
            state, version=version, layout={k: Shard(0, r, 2) for k in fulls}, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_publish_from_and_fetch_into_device_tensors(make_store, device, gather):
    store = make_store(dram="64MiB")
    gen = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 96, generator=gen), "u": torch.randn(30, 7, generator=gen)}
    sub = WeightSubscriber(store, "p")
    for version in (1, 2, 3):
        fulls = {k: v + version for k, v in base.items()}
        publish(store, fulls, version, device)
        ref = {k: v.to(torch.bfloat16) for k, v in fulls.items()}
        for k in range(3):
            lay = {"w": Shard(1, k, 3), "u": Shard(1, k, 3)}
            dst = {"w": torch.full((64, 32), 7.0, dtype=torch.bfloat16, device=device),
                   "u": torch.full(tuple(torch.tensor_split(ref["u"], 3, 1)[k].shape), 7.0, device=device)}
            out = sub.fetch(version, layout=lay, into=dst)
            assert out["w"] is dst["w"] and out["u"] is dst["u"]
            assert dst["w"].device == torch.device(device) and dst["u"].dtype == torch.float32
            assert torch.equal(dst["w"].cpu(), torch.tensor_split(ref["w"], 3, 1)[k])
            # stored as bf16, cast on the way into the fp32 destination
            assert torch.equal(dst["u"].cpu(), torch.tensor_split(ref["u"], 3, 1)[k].float())
        host = sub.fetch(version, layout={"w": Shard(1, 2, 3)})["w"]
        assert host.device.type == "cpu" and torch.equal(host, torch.tensor_split(ref["w"], 3, 1)[2])
    if device.startswith("cuda"):
        # publishing device tensors registered the arena as pinned memory, so the
        # subscriber's zero-copy views of it are pinned too
        store.put("probe", torch.zeros(1 << 20))      # (small values are read as copies)
        assert store.get("probe").is_pinned()


@pytest.mark.parametrize("device", DEVICES)
def test_staging_buckets_are_reused_only_after_their_copies_finish(make_store, device, gather, monkeypatch):
    """Destinations that need a cast, staged: with a bucket far smaller than the fetch,
    each one is refilled many times within one fetch and across fetches. On CUDA the
    copies out of a bucket are asynchronous: a bucket refilled before its copies finished
    would leave other tensors' bytes in a destination. Gathered on the device: many
    asynchronous span copies and casts in a row, all done when fetch returns."""
    monkeypatch.setattr(W, "BUCKET_BYTES", 256 << 10)
    store = make_store(dram="64MiB")
    fulls = {f"t{i}": torch.arange(i, i + 96 * 1000, dtype=torch.float32).reshape(96, 1000) * (i + 1)
             for i in range(12)}                     # 12 x 375 KiB fp32, stored as bf16
    publish(store, fulls, 1, device)
    sub = WeightSubscriber(store, "p")
    for k in range(2):                               # the 2nd fetch reuses the 1st one's bucket
        dst = {n: torch.zeros(96, 500, device=device) for n in fulls}          # fp32: a cast each
        sub.fetch(1, layout={n: Shard(1, k, 2) for n in fulls}, into=dst)
        for n, v in fulls.items():
            want = torch.tensor_split(v.to(torch.bfloat16), 2, 1)[k].float()
            assert torch.equal(dst[n].cpu(), want), f"{n}, slice {k}"
