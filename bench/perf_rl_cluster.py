#!/usr/bin/env python
"""Where bench_rl_cluster.py's CPU goes: ``perf`` over its timed yrcache versions.

    python bench/perf_rl_cluster.py [--reps 8] [--secs 8] [--out DIR]

Runs ``bench/bench_rl_cluster.py --skip gloo --skip latency --reps N``, and once its
timed versions have begun records every CPU of the machine with ``perf record -a -k
CLOCK_MONOTONIC`` (Linux ``perf`` must be installed; as root, or with
``kernel.perf_event_paranoid`` <= 0) for ``--secs`` seconds. Only the samples inside a
timed version's window (from the trainers' release to the last rollout holding its slice,
as the benchmark's JSON gives them, on the same clock) count. It prints the CPU-ms per
version by process role (trainer, rollout, node, etcd, other, idle) and by what ran
(copies, the Python interpreter, kernel networking, wake-ups and scheduling, ...), with the
top symbols of each: the figures of docs/benchmarks.md's "where a version's CPU goes".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HZ = 999                        # perf's sampling frequency: one sample ~ 1 ms of CPU

COPY = ("_copy_to_iter", "_copy_from_iter", "memmove", "memcpy", "reduced_float_copy", "raw_array_assign",
        "_contig_to_contig", "copy_mc", "clear_page")
NET = ("tcp", "skb", "ip_", "net_", "sock", "inet", "softirq", "napi", "netif", "dev_", "loopback", "__sys_send",
       "__sys_recv", "sk_", "release_sock", "lock_sock", "__local_bh")
SCHED = ("finish_task_switch", "schedule", "futex", "_raw_spin_unlock_irq", "try_to_wake", "pv_", "enqueue",
         "dequeue", "update_", "pick_next", "select_task", "ttwu", "irqentry", "syscall", "hrtimer", "__switch_to")
MM = ("page", "folio", "fault", "pte", "pmd", "slab", "kmem", "kfree", "alloc", "free")


def category(sym: str, dso: str) -> str:
    kernel = "kernel" in dso
    if any(k in sym for k in COPY):
        return "copies"
    for name, keys in (("kernel wake-ups, scheduling", SCHED), ("kernel networking", NET), ("kernel memory", MM)):
        if kernel and any(k in sym for k in keys):
            return name
    if kernel:
        return "kernel other"
    if "libpython" in dso or dso.endswith("/python") or "python3" in os.path.basename(dso):
        return "Python interpreter"
    for lib in ("torch", "numpy", "_fast", "_arena", "libc.so", "etcd"):
        if lib in dso:
            return {"_fast": "yrcache C", "_arena": "yrcache C", "libc.so": "libc"}.get(lib, lib)
    return "other"


def record(out: str, reps: int, secs: float) -> None:
    log = open(os.path.join(out, "log"), "w")
    bench = subprocess.Popen([sys.executable, os.path.join(HERE, "bench_rl_cluster.py"), "--skip", "gloo",
                              "--skip", "latency", "--reps", str(reps), "--json", os.path.join(out, "r.json")],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        while "(timed)" not in open(os.path.join(out, "log")).read():
            if bench.poll() is not None:
                raise SystemExit(f"bench_rl_cluster.py ended before its timed versions (see {out}/log)")
            time.sleep(0.2)
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        open(os.path.join(out, "ps"), "w").write(ps)
        subprocess.run(["perf", "record", "-a", "-k", "CLOCK_MONOTONIC", "-F", str(HZ), "-o",
                        os.path.join(out, "perf.data"), "--", "sleep", str(secs)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        if bench.wait() != 0:
            raise SystemExit(f"bench_rl_cluster.py failed (see {out}/log)")
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait()


def analyse(out: str) -> None:
    doc = json.load(open(os.path.join(out, "r.json")))
    wins = [(r["t0"], r["t0"] + r["seconds"]) for r in doc["raw"]["yrcache"]["rounds"] if r["timed"]]
    role = {s["pid"]: ("trainer" if i < 2 else "rollout") for i, s in enumerate(doc["raw"]["setup"])}
    for line in open(os.path.join(out, "ps")):
        pid, _, args = line.strip().partition(" ")
        if pid.isdigit() and "yrcache node" in args:
            role[int(pid)] = "node"
        elif pid.isdigit() and "etcd" in args.split(" ")[0]:
            role[int(pid)] = "etcd"
    text = subprocess.run(["perf", "script", "-i", os.path.join(out, "perf.data"), "-F", "pid,time,ip,sym,dso"],
                          capture_output=True, text=True, check=True).stdout
    by_role: collections.Counter = collections.Counter()
    by_cat: collections.Counter = collections.Counter()
    role_syms: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    cat_syms: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seen = set()
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*?)\s*\(([^)]*)\)\s*$", line)
        if not m:
            continue
        pid, t, sym, dso = int(m[1]), float(m[2]), m[3], m[4]
        w = next((i for i, (a, b) in enumerate(wins) if a <= t <= b), None)
        if w is None:
            continue
        seen.add(w)
        r = "idle" if pid == 0 else role.get(pid, "other")
        by_role[r] += 1
        if r != "idle":
            c = category(sym, dso)
            by_cat[c] += 1
            cat_syms[c][sym[:40]] += 1
            role_syms[r][sym[:40]] += 1
    n = len(seen)
    if not n:
        raise SystemExit("no sample fell inside a timed version: give perf more --secs")

    def ms(k: int) -> str:
        return f"{k / HZ * 1e3 / n:6.1f}"

    def top(syms: collections.Counter) -> str:
        return ", ".join(f"{s} {ms(k).strip()}" for s, k in syms.most_common(5))
    busy = sum(k for r, k in by_role.items() if r != "idle")
    print(f"{n} timed versions inside the perf window; CPU-ms per version ({ms(busy).strip()} busy):")
    print("by process:")
    for r, k in by_role.most_common():
        print(f"  {r:28s} {ms(k)}   {top(role_syms[r])}")
    print("by what ran:")
    for c, k in by_cat.most_common():
        print(f"  {c:28s} {ms(k)}   {top(cat_syms[c])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8, help="timed versions of bench_rl_cluster.py (default 8)")
    ap.add_argument("--secs", type=float, default=8.0, help="seconds perf records (default 8)")
    ap.add_argument("--out", help="keep perf.data, the benchmark's log and JSON here (default: a temporary folder)")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf)")
    out = args.out or tempfile.mkdtemp(prefix="yrperf-")
    os.makedirs(out, exist_ok=True)
    record(out, args.reps, args.secs)
    analyse(out)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
