#!/usr/bin/env python
"""RL weight sync at node scale: many subscribers, small states, big stores.

    python bench/bench_rl_scale.py [--quick] [--subs 64,256] [--json out.json]

Workloads (one run, medians; ``time.monotonic`` in every process):

* fan-out: 1 publisher (world=1) and N forked subscriber processes, each
  blocked in ``wait(newer_than=v-1)`` then ``fetch(v)`` of a 2-tensor 4 KiB
  state.  Per version: the time from ``publish()`` being called to the last
  subscriber woken and to the last fetch done; the first version separately
  (every subscriber's first fetch reads and caches its manifests).  The
  subscribers report through a shared array, no queues on the clock.
* the same fan-out with subscribers that only wake (no fetch): the floor the
  wake-ups alone set on this machine.
* ``publish()`` of a 4 KiB state with world=1 and no subscriber: the call.
* ``keys(prefix)`` in a 1 GiB store holding 200k keys: a prefix with 10
  matches, and the longest stall a concurrent process's ``get`` sees while
  100k matches are listed (its p99 and max latency, against the same get
  with no listing running).

Targets (issue "RL weight sync at node scale"): 64 subscribers all woken
<= 10 ms and all fetched <= 15 ms after publish() is called (the first version
<= 3x that); publish() <= 0.3 ms; keys(prefix) with 10 matches <= 100 us; the
longest lock hold during a listing of 100k matches <= 50 us (seen as the
concurrent get's worst latency over its idle baseline).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util as U  # noqa: E402

from yrcache import TieredStore  # noqa: E402
from yrcache.rl import WeightPublisher, WeightSubscriber  # noqa: E402

RUN_ID = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


def state(v: int) -> dict:
    return {"w": np.full(768, v, dtype=np.float32), "b": np.full(256, v, dtype=np.float32)}   # 4 KiB


# ----------------------------------------------------------------- fan-out

def _subscriber(name: str, i: int, rounds: int, woke, fetched, ready, fetch: bool) -> None:
    s = TieredStore.attach(name, prefault=True)
    sub = WeightSubscriber(s, "policy")
    cur = sub.latest()
    ready[i] = 1
    for r in range(rounds):
        v = sub.wait(newer_than=cur, timeout=60)
        woke[r * len(ready) + i] = time.monotonic()
        if fetch:
            got = sub.fetch(v)
            assert got["w"][0] == v
        fetched[r * len(ready) + i] = time.monotonic()
        cur = v
    s.close()


def fanout(nsubs: int, rounds: int, cleanup: U.Cleanup, fetch: bool = True) -> dict:
    """Per version: publish() called -> every subscriber woken / done fetching
    (``fetch=False``: the subscribers only wake, the floor of the fan-out)."""
    name = f"ybench-fan-{nsubs}-{int(fetch)}-{RUN_ID}"
    s = TieredStore(name=name, dram="256MiB")
    cleanup.add(f"destroy {s.name}", s.destroy)
    pub = WeightPublisher(s, "policy", keep=2)
    pub.publish(state(0), version=0)
    ctx = mp.get_context("fork")
    woke = ctx.RawArray("d", nsubs * rounds)
    fetched = ctx.RawArray("d", nsubs * rounds)
    ready = ctx.RawArray("b", nsubs)
    procs = [ctx.Process(target=_subscriber, args=(name, i, rounds, woke, fetched, ready, fetch), daemon=True)
             for i in range(nsubs)]
    for p in procs:
        p.start()
    t_end = time.monotonic() + 120
    while sum(ready) < nsubs and time.monotonic() < t_end:
        time.sleep(0.01)
    out = {"first": None, "steady": []}
    for r in range(rounds):
        time.sleep(0.05 if nsubs <= 64 else 0.2)    # every subscriber back in wait()
        t0 = time.monotonic()
        pub.publish(state(r + 1), version=r + 1)
        t_pub = time.monotonic() - t0
        deadline = time.monotonic() + 60
        row = slice(r * nsubs, (r + 1) * nsubs)
        while min(fetched[row]) == 0.0 and time.monotonic() < deadline:
            time.sleep(0.001)
        w = [x - t0 for x in woke[row]]
        f = [x - t0 for x in fetched[row]]
        rec = {"publish": t_pub, "woken_median": float(np.median(w)), "woken_last": max(w),
               "fetched_last": max(f)}
        if r == 0:
            out["first"] = rec
        else:
            out["steady"].append(rec)
    for p in procs:
        p.join(30)
    s.destroy()
    return out


# ----------------------------------------------------------------- publish

def publish_cost(n: int, cleanup: U.Cleanup) -> list[float]:
    s = TieredStore(name=f"ybench-pub-{RUN_ID}", dram="64MiB")
    cleanup.add(f"destroy {s.name}", s.destroy)
    pub = WeightPublisher(s, "policy", keep=2)
    st = state(0)
    for v in range(20):                      # warm-up
        pub.publish(st, version=v)
    ts = []
    for v in range(20, 20 + n):
        t0 = time.perf_counter()
        pub.publish(st, version=v)
        ts.append(time.perf_counter() - t0)
    s.destroy()
    return ts


# -------------------------------------------------------------- listings

def _getter(name: str, stop, lat, count) -> None:
    s = TieredStore.attach(name, prefault=True)
    i = 0
    while not stop.value:
        t0 = time.perf_counter_ns()
        v = s.get("probe")
        lat[i % len(lat)] = time.perf_counter_ns() - t0
        del v
        i += 1
    count.value = i
    s.close()


def listings(nkeys: int, cleanup: U.Cleanup) -> dict:
    name = f"ybench-keys-{RUN_ID}"
    s = TieredStore(name=name, dram="1GiB")
    cleanup.add(f"destroy {s.name}", s.destroy)
    half = nkeys // 2
    s.mset({f"bulk/{i:07d}": b"x" * 16 for i in range(half)})
    s.mset({f"other/{i:07d}": b"x" * 16 for i in range(nkeys - half)})
    s.mset({f"few/{i}": b"y" for i in range(10)})
    s["probe"] = b"p" * 64
    few = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        got = list(s.keys(prefix="few/"))
        few.append(time.perf_counter_ns() - t0)
    assert len(got) == 10
    ctx = mp.get_context("fork")
    res = {}
    for mode in ("idle", "listing"):
        stop, count = ctx.RawValue("b", 0), ctx.RawValue("q", 0)
        lat = ctx.RawArray("q", 1 << 20)
        p = ctx.Process(target=_getter, args=(name, stop, lat, count), daemon=True)
        p.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        listed = 0
        while time.perf_counter() - t0 < 2.0:
            if mode == "listing":
                listed += sum(1 for _ in s.keys(prefix="bulk/"))
            else:
                time.sleep(0.05)
        stop.value = 1
        p.join(10)
        n = min(count.value, len(lat))
        xs = np.asarray(lat[:n], dtype=np.float64)
        res[mode] = {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99)),
                     "p999": float(np.percentile(xs, 99.9)), "max": float(xs.max()), "n": n,
                     "listed_per_s": listed / (time.perf_counter() - t0)}
    s.destroy()
    return {"few_median_ns": float(np.median(few)), "concurrent_get": res, "matches": half}


# -------------------------------------------------------------------- main

def row(workload: str, yr: str, target: str | None = None, ok: bool | None = None, baseline: str = "-") -> dict:
    return {"workload": workload, "yrcache": yr, "baseline": baseline, "ratio": None, "target": target, "ok": ok}


def build_rows(doc: dict, nkeys: int) -> list[dict]:
    rows = []
    for n, f in doc.get("fanout", {}).items():
        steady = f["steady"]
        wl = float(np.median([r["woken_last"] for r in steady]))
        fl = float(np.median([r["fetched_last"] for r in steady]))
        wm = float(np.median([r["woken_median"] for r in steady]))
        at64 = n == 64
        rows.append(row(f"{n} subscribers, 4 KiB: last woken after publish() (median of {len(steady)})",
                        f"{wl * 1e3:.2f} ms (median subscriber {wm * 1e3:.2f} ms)",
                        "<= 10 ms" if at64 else None, wl <= 0.010 if at64 else None))
        rows.append(row(f"{n} subscribers, 4 KiB: last fetch done after publish()", f"{fl * 1e3:.2f} ms",
                        "<= 15 ms" if at64 else None, fl <= 0.015 if at64 else None))
        first = f["first"]
        rows.append(row(f"{n} subscribers: first version, last woken / last fetched",
                        f"{first['woken_last'] * 1e3:.2f} / {first['fetched_last'] * 1e3:.2f} ms",
                        "<= 30 / 45 ms (3x 10 / 15)" if at64 else None,
                        (first["woken_last"] <= 0.030 and first["fetched_last"] <= 0.045) if at64 else None))
    for n, f in doc.get("wake_only", {}).items():
        wl = float(np.median([r["woken_last"] for r in f["steady"]]))
        rows.append(row(f"{n} subscribers that only wake (no fetch): last woken, the floor of the rows above",
                        f"{wl * 1e3:.2f} ms"))
    if "publish" in doc:
        pub = doc["publish"]
        pm = float(np.median(pub))
        rows.append(row("publish() of a 4 KiB state, world=1, no subscriber",
                        f"{pm * 1e3:.3f} ms (p90 {np.percentile(pub, 90) * 1e3:.3f} ms)", "<= 0.3 ms", pm <= 0.0003))
    if "keys" in doc:
        k = doc["keys"]
        rows.append(row(f"keys(prefix) with 10 matches, {nkeys // 1000}k keys in a 1 GiB store",
                        U.fmt_ns(k["few_median_ns"]), "<= 100 us", k["few_median_ns"] <= 100_000))
        idle, busy = k["concurrent_get"]["idle"], k["concurrent_get"]["listing"]
        stall = busy["p999"] - idle["p999"]
        rows.append(row(f"another process's get while {k['matches'] // 1000}k matches are listed: p99 / p99.9 / max",
                        f"{U.fmt_ns(busy['p99'])} / {U.fmt_ns(busy['p999'])} / {U.fmt_ns(busy['max'])}",
                        "p99.9 stall <= 50 us", stall <= 50_000,
                        baseline=f"idle: {U.fmt_ns(idle['p99'])} / {U.fmt_ns(idle['p999'])} / {U.fmt_ns(idle['max'])}"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 16 subscribers, 20k keys")
    ap.add_argument("--subs", default=None, help="subscriber counts, comma separated (default 64,256)")
    ap.add_argument("--rounds", type=int, default=None, help="versions per fan-out (default 21)")
    ap.add_argument("--keys", type=int, default=None, help="keys in the listing store (default 200000)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    subs = [int(x) for x in (args.subs or ("16" if args.quick else "64,256")).split(",")]
    rounds = args.rounds or (6 if args.quick else 21)
    nkeys = args.keys or (20_000 if args.quick else 200_000)
    U.raise_keyboard_interrupt_on_sigterm()
    env = U.environment()
    print("# yrcache RL node-scale benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    print(flush=True)
    doc: dict = {"fanout": {}, "wake_only": {}}
    foreign_load = U.ForeignLoad()
    cleanup = U.Cleanup()
    interrupted, error = False, None
    t_start = time.monotonic()
    try:
        # publish() first: the teardown of hundreds of subscriber processes keeps the
        # kernel busy for a while after they exit
        doc["publish"] = publish_cost(50 if args.quick else 1000, cleanup)
        for n in subs:
            doc["fanout"][n] = fanout(n, rounds, cleanup)
            gc.collect()
        doc["wake_only"] = {subs[0]: fanout(subs[0], rounds, cleanup, fetch=False)}
        doc["keys"] = listings(nkeys, cleanup)
    except KeyboardInterrupt:
        interrupted = True
    except Exception:
        import traceback
        error = traceback.format_exc()
    finally:
        cleanup.run()
    rows = build_rows(doc, nkeys)
    print(U.render(rows))
    print()
    U.print_footer(env, rows, foreign_load.cpus(), t_start, interrupted, error)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "raw": doc}, f, indent=1, default=float)
    return 130 if interrupted else (1 if error else 0)


if __name__ == "__main__":
    sys.exit(main())
