"""Ranks of one weight set that disagree on ``world`` are told at publish time.

Without the check, a rank with world=2 waits for two manifests and a rank
with world=3 for three: neither completes the version, nobody errors.
"""

from __future__ import annotations

import multiprocessing
import warnings

import pytest
import torch

from yrcache.rl import Shard, WeightPublisher, WeightSubscriber
from procs import finish, start  # noqa: E402


def state(rank: int, world: int, value: float = 1.0):
    return {"w": torch.full((2, 4), value)}, {"w": Shard(0, rank, world)}


def publish(pub: WeightPublisher, version: int, value: float = 1.0) -> bool:
    st, layout = state(pub.rank, pub.world, value)
    return pub.publish(st, version=version, layout=layout)


def assert_names_both(err: pytest.ExceptionInfo, rank_a: int, world_a: int, rank_b: int, world_b: int):
    msg = str(err.value)
    for part in (f"rank {rank_a}", f"world={world_a}", f"rank {rank_b}", f"world={world_b}", "same world"):
        assert part in msg, f"{part!r} not in {msg!r}"


def parts_of(store, version: int, rank: int) -> list[str]:
    return [k for k in store.keys(prefix="__rl__/policy/") if f"/{version:020d}/p/{rank}/" in k]


def test_smaller_world_first(make_store):
    """The case that hung: world=2 publishes first, world=3 then waits for a third rank."""
    store = make_store()
    p2 = WeightPublisher(store, "policy", rank=0, world=2)
    p3 = WeightPublisher(store, "policy", rank=1, world=3)
    assert publish(p2, 1) is False
    with pytest.raises(ValueError) as err:
        publish(p3, 1)
    assert_names_both(err, 0, 2, 1, 3)
    assert parts_of(store, 1, 1) == []            # refused before writing anything
    assert WeightSubscriber(store, "policy").latest() is None
    # the misconfigured rank, restarted with the right world, completes the version
    p1 = WeightPublisher(store, "policy", rank=1, world=2)
    assert publish(p1, 1) is True
    assert torch.equal(WeightSubscriber(store, "policy").fetch(1)["w"], torch.ones(4, 4))


def test_larger_world_first(make_store):
    store = make_store()
    p3 = WeightPublisher(store, "policy", rank=1, world=3)
    p2 = WeightPublisher(store, "policy", rank=0, world=2)
    assert publish(p3, 1) is False
    with pytest.raises(ValueError) as err:
        publish(p2, 1)
    assert_names_both(err, 1, 3, 0, 2)
    assert WeightSubscriber(store, "policy").latest() is None


def test_rank_beyond_the_other_world(make_store):
    """A rank 2 of world 3 next to ranks of world 2: refused both ways round."""
    store = make_store()
    p0, p1 = (WeightPublisher(store, "policy", rank=r, world=2) for r in range(2))
    p2 = WeightPublisher(store, "policy", rank=2, world=3)
    assert publish(p0, 1) is False
    assert publish(p1, 1) is True                 # world 2 is complete on its own...
    assert publish(p0, 2) is False
    with pytest.raises(ValueError) as err:        # ...and the world-3 rank is told at once
        publish(p2, 2)
    assert_names_both(err, 0, 2, 2, 3)
    p2b = WeightPublisher(store, "policy", rank=2, world=3)
    assert publish(p2b, 3) is False
    with pytest.raises(ValueError) as err:
        publish(p1, 3)
    assert_names_both(err, 2, 3, 1, 2)


def test_racing_ranks_later_one_is_told(make_store, monkeypatch):
    """A rank that starts while another of a different world is mid-publish is
    told at once, by the begin record, before it writes anything."""
    store = make_store()
    p2 = WeightPublisher(store, "policy", rank=0, world=2)
    p3 = WeightPublisher(store, "policy", rank=1, world=3)
    real = type(store).put_with
    raced = []

    def put_with(self, *a, **kw):
        real(self, *a, **kw)
        if not raced:                             # p3 is writing its parts; now p2 publishes
            try:
                raced.append(publish(p2, 1))
            except ValueError as e:
                raced.append(str(e))

    monkeypatch.setattr(type(store), "put_with", put_with)
    assert publish(p3, 1) is False
    monkeypatch.undo()
    assert "rank 1 published it with world=3" in raced[0] and "rank 0 has world=2" in raced[0]
    assert parts_of(store, 1, 0) == []            # p2 wrote nothing
    assert WeightSubscriber(store, "policy").latest() is None
    # fixed, rank 1 republishes the version over its own stale manifest, and rank 0 completes it
    with pytest.warns(RuntimeWarning, match="rank 1 of version 1 .* was published by another process"):
        assert publish(WeightPublisher(store, "policy", rank=1, world=2), 1) is False
    assert publish(p2, 1) is True


def _publish_in_child(name, rank, world, go):
    from yrcache import TieredStore

    store = TieredStore.attach(name)
    try:
        pub = WeightPublisher(store, "policy", rank=rank, world=world)
        assert go.wait(60)
        try:
            return ("done", publish(pub, 1))
        except ValueError as e:
            return ("refused", str(e))
    finally:
        store.close()


def test_mismatched_worlds_in_processes(make_store):
    """Two processes publish the same version at the same moment with world=2 and
    world=3: at least one is refused, none completes, and both return.  (fork only:
    spawned children would spend seconds importing torch, for nothing more.)"""
    store = make_store()
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    children = [start(ctx, _publish_in_child, store.name, rank, world, go)
                for rank, world in ((0, 2), (1, 3))]
    go.set()
    results = [finish(p, q) for p, q in children]
    refused = [msg for status, msg in results if status == "refused"]
    assert refused, results
    for msg in refused:
        assert "world=2" in msg and "world=3" in msg, msg
    assert ("done", True) not in results
    assert WeightSubscriber(store, "policy").latest() is None


def test_a_second_publisher_of_one_rank_is_warned(make_store):
    """Two processes publishing as rank 0: the later one's parts silently replaced the first's."""
    store = make_store()
    a, b, one = (WeightPublisher(store, "policy", rank=r, world=2) for r in (0, 0, 1))
    assert publish(a, 1, value=1.0) is False
    with pytest.warns(RuntimeWarning, match="rank 0 of version 1 of 'policy' was published by another process"):
        assert publish(b, 1, value=7.0) is False
    assert publish(one, 1) is True
    got = WeightSubscriber(store, "policy").fetch(1)["w"]
    assert got[:2].eq(7.0).all() and got[2:].eq(1.0).all()      # the later parts are the version's
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # the same publisher again: no warning
        for p in (b, one):
            publish(p, 2)
