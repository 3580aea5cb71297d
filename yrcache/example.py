"""Two processes share a tensor zero-copy (``yrcache example``).

The parent creates a store and puts a 256 MiB tensor; a second process
(started with ``spawn``, so it shares nothing but the store's name) attaches
and reads it.  The read takes microseconds whatever the size, because the
child maps the same pages: nothing is copied.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def _reader(store, q) -> None:
    import torch  # noqa: F401  (imported before the clock starts)

    w = store["policy/w"]              # the store arrived pickled: it attached by name
    times = []
    for _ in range(100):               # warm gets: a lock, a hash probe and a view each
        t0 = time.perf_counter_ns()
        w = store["policy/w"]
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    q.put({
        "pid": os.getpid(),
        "get_us": times[len(times) // 2] / 1000,
        "shape": tuple(w.shape),
        "dtype": str(w.dtype),
        "checksum": float(w[:1024].double().sum()),
        "pinned": store.stats()["pinned_bytes"],
    })
    store.close()


def main() -> int:
    import torch

    from .sizes import format_size
    from .store import TieredStore

    with TieredStore(dram="512MiB") as store:
        w = torch.arange(64 << 20, dtype=torch.float32).reshape(8192, 8192)  # 256 MiB
        t0 = time.perf_counter_ns()
        store.put("policy/w", w)
        t1 = time.perf_counter_ns()
        print(f"[pid {os.getpid()}] put {format_size(w.nbytes)} tensor {tuple(w.shape)} "
              f"into store {store.name!r} in {(t1 - t0) / 1e6:.1f} ms (one copy into shared memory)")
        q = mp.get_context("spawn").SimpleQueue()
        p = mp.get_context("spawn").Process(target=_reader, args=(store, q))
        p.start()
        r = q.get()
        p.join()
        expected = float(w[:1024].double().sum())
        print(f"[pid {r['pid']}] get {r['shape']} {r['dtype']} in {r['get_us']:.1f} µs (median of 100), "
              f"zero-copy: {format_size(r['pinned'])} pinned by the view, nothing copied; "
              f"checksum {'matches' if r['checksum'] == expected else 'DIFFERS'}")
        st = store.stats()
        print(f"store {store.name!r}: {st['tiers']['dram']['objects']} object(s), "
              f"{format_size(st['tiers']['dram']['used'])} of {format_size(st['tiers']['dram']['capacity'])} used")
        return 0 if r["checksum"] == expected and p.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
