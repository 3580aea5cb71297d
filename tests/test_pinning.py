"""The arena's CUDA registration (yrcache/pinning.py) is made once, undone before the
mapping goes, and a leftover registration at the mapping's address is replaced.

CUDA keys registrations by virtual address: a mapping unmapped while registered leaves
a registration behind, and a later mapping at that address then takes device copies
into the old pages (on an H200 a CUDA tensor put into a second store read back as
zeros).  These tests run everywhere against a fake CUDA runtime that keeps
registrations by address the same way; on a GPU the last test runs the case itself
(so do tests/store_suite.py's CUDA round trips and tests/test_rl_device.py, which make
and close many stores in one process).
"""

from __future__ import annotations

import gc
import logging
import os
from types import SimpleNamespace

import pytest

from yrcache import pinning


class FakeRuntime:
    """cudaHostRegister/cudaHostUnregister keyed by address, as CUDA keeps them."""

    def __init__(self, refuse: int = 0):
        self.regs: dict[int, int] = {}
        self.calls: list[str] = []
        self.refuse = refuse

    def cudaHostRegister(self, addr, size, flags):
        self.calls.append("register")
        if self.refuse:
            return self.refuse
        if any(a < addr + size and addr < a + s for a, s in self.regs.items()):
            return pinning.ALREADY_REGISTERED
        self.regs[addr] = size
        return 0

    def cudaHostUnregister(self, addr):
        self.calls.append("unregister")
        return 0 if self.regs.pop(addr, None) is not None else 713   # 713: not registered


@pytest.fixture
def cuda(monkeypatch):
    rt = FakeRuntime()
    fake = SimpleNamespace(cuda=SimpleNamespace(cudart=lambda: rt, synchronize=lambda *a: None),
                           empty=lambda *a, **k: SimpleNamespace(zero_=lambda: None))
    monkeypatch.setattr(pinning, "_cuda", lambda: fake)
    return rt


def test_registered_once_and_undone_when_the_store_closes(make_store, cuda):
    store = make_store()
    a = store._a
    store.pin_host_memory()
    store.pin_host_memory()
    assert cuda.regs == {a.addr: a.size} and cuda.calls == ["register"]
    store.close()
    del a
    gc.collect()
    assert cuda.regs == {}, "the registration outlived the mapping"


def test_a_leftover_registration_at_the_address_is_replaced(make_store, cuda):
    store = make_store()
    a = store._a
    cuda.regs[a.addr] = 4096                 # left by an earlier mapping at this address
    store.pin_host_memory()
    assert cuda.regs == {a.addr: a.size}
    assert cuda.calls == ["register", "unregister", "register"]


def test_a_refused_registration_warns_once_and_copies_go_on_unpinned(make_store, cuda, caplog):
    cuda.refuse = 2                          # cudaErrorMemoryAllocation
    store = make_store()
    with caplog.at_level(logging.WARNING, logger="yrcache"):
        store.pin_host_memory()
        store.pin_host_memory()
    assert [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()] != []
    assert len(caplog.records) == 1 and cuda.calls == ["register"]
    store.close()
    gc.collect()
    assert "unregister" not in cuda.calls    # nothing of ours to undo


def test_a_forked_child_leaves_its_parents_registration_alone(make_store, cuda):
    store = make_store()
    a = store._a
    store.pin_host_memory()
    pid = os.fork()
    if pid == 0:                             # the child's CUDA state is not the parent's
        pinning.unregister(a)
        os._exit(0 if cuda.regs == {a.addr: a.size} and "unregister" not in cuda.calls else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cuda.regs == {a.addr: a.size}


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device (the fake runtime above covers the same code)")
def test_on_a_gpu_a_store_made_after_a_pinned_one_keeps_device_copies(store_name):
    """The bug itself, on a real GPU: stores of one size made one after another in a process
    usually get the same address (mmap reuses the hole); each one's CUDA round trip must
    read back what was put (on an H200 the second read back zeros before the fix)."""
    import torch

    from yrcache import TieredStore

    for i in range(4):
        with TieredStore(name=f"{store_name}-{i}", dram="64MiB") as s:
            t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + i
            s.put("t", t)                                    # D2H straight into the pinned arena
            assert torch.equal(s.get("t").cuda(), t), f"store {i}: the device copy went elsewhere"
            out = torch.empty_like(t)
            s.get_into("t", out)                             # H2D out of it
            assert torch.equal(out, t)
