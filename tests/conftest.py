"""Shared fixtures: unique store names, and a check that nothing is left behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import uuid

import pytest

# The shared suites are imported by the test modules: rewrite their asserts too.
pytest.register_assert_rewrite("store_suite", "tier_suite")

from yrcache.tiers import dram  # noqa: E402


@pytest.fixture
def store_name():
    """A fresh store name; any segment left under it fails the test."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    gc.collect()
    if dram.destroy(name):
        pytest.fail(f"test left shared memory behind: /dev/shm/yrcache.{name}")


@pytest.fixture
def make_store(store_name):
    """Factory: ``make_store(dram="16MiB", **kw)`` creates a store and closes it afterwards."""
    from yrcache import TieredStore

    made = []

    def make(**kw):
        kw.setdefault("dram", "16MiB")
        s = TieredStore(name=kw.pop("name", store_name), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(params=["fork", "spawn"])
def mp_context(request):
    """Both multiprocessing start methods."""
    return multiprocessing.get_context(request.param)


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    for p in multiprocessing.active_children():
        p.kill()
        p.join(5)
        pytest.fail(f"test left a child process running: {p}")


@pytest.fixture
def etcd(tmp_path):
    """A fresh etcd on free loopback ports for one cluster test (tests/cluster_util.py)."""
    from cluster_util import Etcd

    server = Etcd(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()
