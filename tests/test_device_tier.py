"""The HBM tier (tiers/device.py) passes the BlobTier conformance suite.

On a machine without a GPU it runs on device="cpu": the same code, with host
memory standing in for device memory (the CUDA copies are covered by
bench/gpu_check.py when a GPU is lent).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tier_suite import TierTests  # noqa: E402
from yrcache import codec  # noqa: E402
from yrcache.tiers.base import new_gen  # noqa: E402
from yrcache.tiers.device import DeviceTier  # noqa: E402

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


class TestDeviceTierConformance(TierTests):
    __test__ = True

    @pytest.fixture
    def tier(self):
        t = DeviceTier(DEVICE, self.CAPACITY)
        yield t
        t.close()


def test_get_is_the_stored_tensor_and_a_private_copy():
    t = DeviceTier(DEVICE, 1 << 20)
    src = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(3, 4)
    gen = new_gen()
    t.put(gen, codec.tensor_meta(src.dtype, src.shape), src, key="w")
    got = t.get(gen)
    assert got.dtype == torch.float32 and tuple(got.shape) == (3, 4) and got.device == src.device
    assert t.get(gen) is got                     # zero-copy: the stored tensor itself
    src += 1                                     # the caller's tensor changes, the stored one does not
    assert got[0, 0].item() == 0.0


def test_host_bytes_with_a_tensor_header_come_back_typed():
    t = DeviceTier(DEVICE, 1 << 20)
    host = np.arange(6, dtype=np.int32)
    gen = new_gen()
    t.put(gen, codec.tensor_meta(torch.int32, (2, 3)), host, key="x")
    got = t.get(gen)
    assert got.dtype == torch.int32 and tuple(got.shape) == (2, 3)
    assert got.cpu().reshape(-1).tolist() == list(range(6))
