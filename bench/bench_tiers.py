#!/usr/bin/env python
"""yrcache's SSD tier against raw file I/O and diskcache, measured in one run.

    python bench/bench_tiers.py [--quick] [--json out.json] [--dir PATH]

Everything goes through the public ``TieredStore`` API; the baselines are what a
user would otherwise write, run on the same filesystem, in the same run,
interleaved sample by sample (the order alternates between samples).  Timings
use ``time.perf_counter_ns``; the median of several samples is reported.

Workloads:

* **restore**: a 64 MiB object put with ``tier=Tier.SSD`` into a store created
  with ``promote_after=1``, then the timed ``get`` that promotes it into the
  DRAM arena (disk lookup, ``readinto`` into the arena block, checksum, commit,
  removal of the disk copy) and returns the zero-copy view; vs
  ``open(f, 'rb', buffering=0).readinto(preallocated)`` of a file of the same
  size in the same directory.  Both files were just written, so both reads come
  from the page cache ("hot").  A second, "cold" figure fsyncs and drops
  (``posix_fadvise(POSIX_FADV_DONTNEED)``) every file of the SSD tier and the
  baseline file before each read.
* **spill**: ``put(key, 64 MiB, tier=Tier.SSD)`` (payload file written, hashed,
  renamed, index committed, arena stub published) vs ``os.write`` of the same
  buffer into a new file (no fsync on either side); also a put into DRAM that
  forces the store to spill the previous 64 MiB object (spill + the put's own
  copy into the arena) vs ``os.write`` + ``np.copyto``.
* **SSD tier vs diskcache**: 64 MiB and 1 KiB puts (``tier=Tier.SSD``) and gets
  of SSD-resident objects (store with a huge ``promote_after`` so they stay on
  SSD: every get reads the disk copy into a new private buffer) vs
  ``diskcache.Cache`` with default settings (``set`` of ``bytes``; 64 MiB
  ``get(read=True)`` + ``readinto`` a preallocated buffer, and ``get`` as
  ``bytes``; 1 KiB ``set``/``get``).

The temporary directory (default: a fresh one under /tmp; with ``--dir PATH`` a
fresh one inside PATH) and every store are removed at the end, also on errors
and Ctrl-C.  The script reports PASS/FAIL per target and exits 0 either way.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util as U  # noqa: E402

import diskcache  # noqa: E402

from yrcache import Tier, TieredStore  # noqa: E402

KiB, MiB, GiB = U.KiB, U.MiB, U.GiB
pc = time.perf_counter_ns
RUN_ID = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
BIG = 64 * MiB
SMALL = 1 * KiB
NEVER_PROMOTE = 1 << 30

RESTORE_TARGET = 0.7
SPILL_TARGET = 0.7


# --------------------------------------------------------------------- config

@dataclass
class Config:
    quick: bool
    reps: int = 15           # timed samples per 64 MiB workload (page cache hot)
    cold_reps: int = 5       # timed samples of the cold-cache restore
    small_n: int = 3000      # distinct 1 KiB keys per round
    small_rounds: int = 5

    @classmethod
    def make(cls, quick: bool) -> "Config":
        if quick:
            return cls(quick=True, reps=5, cold_reps=3, small_n=1000, small_rounds=3)
        return cls(quick=False)


# -------------------------------------------------------------------- helpers

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def payload(size: int, seed: int = 0) -> np.ndarray:
    """A touched uint8 array with incompressible content (resident pages)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def touched(size: int) -> np.ndarray:
    a = np.empty(size, dtype=np.uint8)
    a.fill(0)
    return a


def new_store(cleanup: U.Cleanup, tag: str, **kw) -> TieredStore:
    name = f"ybench-tiers-{tag}-{RUN_ID}"
    cleanup.add(f"destroy store {name}", lambda: U.destroy_store(name))
    store = TieredStore(name=name, **kw)
    cleanup.add(f"close store {name}", store.destroy)
    return store


def write_file(path: str, buf: np.ndarray) -> None:
    """Raw baseline write: a new file, ``os.write`` of the buffer, close (no fsync)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        mv = memoryview(buf).cast("B")
        off, n = 0, mv.nbytes
        while off < n:
            off += os.write(fd, mv[off:])
    finally:
        os.close(fd)


def read_file_into(path: str, buf: np.ndarray) -> int:
    """Raw baseline read: ``open(f, 'rb', buffering=0).readinto(preallocated)``."""
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(buf)
        if n != buf.nbytes:          # a short read (never seen for 64 MiB): finish it
            mv = memoryview(buf).cast("B")
            while n < buf.nbytes:
                got = f.readinto(mv[n:])
                if not got:
                    break
                n += got
    return n


def files_under(path: str) -> list[str]:
    out = []
    for d, _dirs, files in os.walk(path):
        out.extend(os.path.join(d, f) for f in files)
    return out


def drop_page_cache(paths: list[str]) -> None:
    """fsync, then drop the cached pages of each file (dirty pages cannot be dropped)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError):
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def same(a, b) -> bool:
    """Cheap equality check of two 64 MiB buffers (strided sample + both ends)."""
    a = np.frombuffer(a, dtype=np.uint8) if not isinstance(a, np.ndarray) else a.reshape(-1).view(np.uint8)
    b = np.frombuffer(b, dtype=np.uint8) if not isinstance(b, np.ndarray) else b.reshape(-1).view(np.uint8)
    return a.size == b.size and np.array_equal(a[::4093], b[::4093]) and \
        np.array_equal(a[-4096:], b[-4096:]) and np.array_equal(a[:4096], b[:4096])


def timed(fn) -> int:
    t0 = pc()
    fn()
    return pc() - t0


# -------------------------------------------------------------------- sections

def bench_restore(cfg: Config, cleanup: U.Cleanup, res: dict, root: str) -> None:
    """SSD -> DRAM: the first get of an SSD object promotes it (promote_after=1)."""
    d = os.path.join(root, "restore")
    os.mkdir(d)
    ssd = os.path.join(d, "ssd")
    store = new_store(cleanup, "restore", dram=4 * BIG, ssd=ssd, promote_after=1)
    src = payload(BIG, seed=1)
    buf = touched(BIG)
    out = res.setdefault("restore", {})
    try:
        orders = (("yr", "raw", "raw_unlink"), ("raw", "raw_unlink", "yr"), ("raw_unlink", "yr", "raw"))
        for mode, reps in (("hot", cfg.reps), ("cold", cfg.cold_reps)):
            e = out.setdefault(mode, {"yr": [], "raw": [], "raw_unlink": [], "promoted": []})
            warm = 1 if mode == "hot" else 0
            for r in range(reps + warm):
                key = f"restore/{mode}/{r}"
                store.put(key, src, tier=Tier.SSD)
                if store.tier_of(key) != Tier.SSD:
                    raise RuntimeError(f"{key}: put(tier=Tier.SSD) left it in {store.tier_of(key)!r}")
                bpath = os.path.join(d, f"raw-{mode}-{r}.bin")
                upath = os.path.join(d, f"raw-unlink-{mode}-{r}.bin")
                write_file(bpath, src)
                write_file(upath, src)
                if mode == "cold":
                    drop_page_cache(files_under(ssd) + [bpath, upath])
                gc.collect()
                t = {}
                for which in orders[r % 3]:
                    if which == "yr":
                        t0 = pc()
                        v = store.get(key)
                        t["yr"] = pc() - t0
                        promoted = store.tier_of(key) == Tier.DRAM
                        if not same(v, src):
                            raise RuntimeError(f"{key}: restored value differs from what was put")
                        del v
                        store.delete(key)
                    else:
                        p = bpath if which == "raw" else upath
                        t0 = pc()
                        n = read_file_into(p, buf)
                        if which == "raw_unlink":
                            os.unlink(p)          # the same work as a promotion: the disk copy goes
                        t[which] = pc() - t0
                        if n != BIG or not same(buf, src):
                            raise RuntimeError(f"{p}: read back {n} bytes / different content")
                        if which == "raw":
                            os.unlink(p)
                        buf.fill(0)
                if r >= warm:
                    for k, v in t.items():
                        e[k].append(v)
                    e["promoted"].append(promoted)
            log(f"restore 64 MiB ({mode} page cache): yrcache promote-on-get med "
                f"{U.fmt_ns(U.median(e['yr']))} ({U.fmt_bw(BIG, U.median(e['yr']))}), "
                f"raw readinto med {U.fmt_ns(U.median(e['raw']))} ({U.fmt_bw(BIG, U.median(e['raw']))}), "
                f"readinto+unlink med {U.fmt_ns(U.median(e['raw_unlink']))}; "
                f"promoted {sum(e['promoted'])}/{len(e['promoted'])}")
        out["stats"] = {k: store.stats()[k] for k in ("promotions", "spills", "hits", "misses")}
    finally:
        store.destroy()


def bench_spill(cfg: Config, cleanup: U.Cleanup, res: dict, root: str) -> None:
    """DRAM -> SSD: put(tier=SSD) vs os.write vs diskcache.set; and a forced spill."""
    d = os.path.join(root, "spill")
    os.mkdir(d)
    src = payload(BIG, seed=2)
    src_bytes = src.tobytes()            # diskcache stores bytes raw (anything else is pickled)
    out = res.setdefault("spill", {"yr": [], "raw": [], "dc": []})
    store = new_store(cleanup, "spill", dram=4 * BIG, ssd=os.path.join(d, "ssd"))
    dc = diskcache.Cache(os.path.join(d, "diskcache"))
    cleanup.add("close diskcache (spill)", dc.close)
    try:
        orders = (("yr", "raw", "dc"), ("raw", "dc", "yr"), ("dc", "yr", "raw"))
        for r in range(cfg.reps + 1):
            gc.collect()
            t = {}
            for which in orders[r % 3]:
                key = f"spill/{r}"
                if which == "yr":
                    t["yr"] = timed(lambda: store.put(key, src, tier=Tier.SSD))
                    if store.tier_of(key) != Tier.SSD:
                        raise RuntimeError(f"{key}: put(tier=Tier.SSD) left it in {store.tier_of(key)!r}")
                    if r == 0:
                        v = store.get(key)
                        if not same(v, src):
                            raise RuntimeError(f"{key}: value read back differs")
                        del v
                    store.delete(key)
                elif which == "raw":
                    p = os.path.join(d, f"raw-{r}.bin")
                    t["raw"] = timed(lambda: write_file(p, src))
                    if os.path.getsize(p) != BIG:
                        raise RuntimeError(f"{p}: wrong size")
                    os.unlink(p)
                else:
                    t["dc"] = timed(lambda: dc.set(key, src_bytes))
                    dc.delete(key)
            if r:                         # sample 0 is the warm-up
                for k, v in t.items():
                    out[k].append(v)
        log(f"spill 64 MiB: yrcache put(tier=SSD) med {U.fmt_ns(U.median(out['yr']))} "
            f"({U.fmt_bw(BIG, U.median(out['yr']))}), os.write med {U.fmt_ns(U.median(out['raw']))} "
            f"({U.fmt_bw(BIG, U.median(out['raw']))}), diskcache.set med {U.fmt_ns(U.median(out['dc']))} "
            f"({U.fmt_bw(BIG, U.median(out['dc']))})")
    finally:
        dc.close()
        store.destroy()

    # A put into DRAM that pushes the arena past its high watermark: the store
    # spills the previous 64 MiB object to SSD, then copies the new one in.
    f = res.setdefault("forced_spill", {"yr": [], "base": [], "spilled": []})
    store = new_store(cleanup, "forced", dram=3 * BIG, ssd=os.path.join(d, "ssd-forced"),
                      watermarks=(0.6, 0.3))
    dst = touched(BIG)
    try:
        store.put("forced/0", src)
        if store.tier_of("forced/0") != Tier.DRAM:
            raise RuntimeError("forced spill: the first 64 MiB put did not stay in DRAM")
        for r in range(1, cfg.reps + 2):
            gc.collect()
            key, prev = f"forced/{r}", f"forced/{r - 1}"
            t = {}
            for which in (("yr", "base") if r % 2 else ("base", "yr")):
                if which == "yr":
                    t["yr"] = timed(lambda: store.put(key, src))
                    spilled = store.tier_of(prev) == Tier.SSD and store.tier_of(key) == Tier.DRAM
                    store.delete(prev)
                else:
                    p = os.path.join(d, f"raw-forced-{r}.bin")

                    def base():
                        write_file(p, src)
                        np.copyto(dst, src)
                    t["base"] = timed(base)
                    os.unlink(p)
            if r > 1:
                f["yr"].append(t["yr"])
                f["base"].append(t["base"])
                f["spilled"].append(spilled)
        v = store.get(f"forced/{cfg.reps + 1}")
        if not same(v, src):
            raise RuntimeError("forced spill: value read back differs")
        del v
        f["stats"] = {k: store.stats()[k] for k in ("spills", "promotions")}
        log(f"forced spill 64 MiB: yrcache put(DRAM, spills the previous) med {U.fmt_ns(U.median(f['yr']))}, "
            f"os.write + np.copyto med {U.fmt_ns(U.median(f['base']))}; "
            f"spilled {sum(f['spilled'])}/{len(f['spilled'])}")
    finally:
        store.destroy()


def bench_ssd_vs_diskcache(cfg: Config, cleanup: U.Cleanup, res: dict, root: str) -> None:
    """Gets of SSD-resident 64 MiB objects and 1 KiB puts/gets, vs diskcache alone."""
    d = os.path.join(root, "ssdtier")
    os.mkdir(d)
    store = new_store(cleanup, "ssdtier", dram=4 * MiB, ssd=os.path.join(d, "ssd"),
                      promote_after=NEVER_PROMOTE)
    dc = diskcache.Cache(os.path.join(d, "diskcache"))
    cleanup.add("close diskcache (ssdtier)", dc.close)
    try:
        # ---- 64 MiB gets (the object stays on SSD: each get is a private copy)
        src = payload(BIG, seed=3)
        buf = touched(BIG)
        key = "big/64MiB"
        store.put(key, src, tier=Tier.SSD)
        dc.set(key, src.tobytes())
        g = res.setdefault("get64", {"yr": [], "dc_readinto": [], "dc_bytes": []})

        def dc_readinto():
            with dc.get(key, read=True) as fh:
                n = fh.readinto(buf)  # noqa: F821 - deleted only after the last call
            if n != BIG:
                raise RuntimeError(f"diskcache readinto got {n} bytes")

        orders = (("yr", "dc_readinto", "dc_bytes"), ("dc_readinto", "dc_bytes", "yr"),
                  ("dc_bytes", "yr", "dc_readinto"))
        for r in range(cfg.reps + 1):
            gc.collect()
            t = {}
            for which in orders[r % 3]:
                if which == "yr":
                    t0 = pc()
                    v = store.get(key)
                    t["yr"] = pc() - t0
                    if not same(v, src):
                        raise RuntimeError(f"{key}: value read from the SSD tier differs")
                    del v         # freeing the 64 MiB private copy: outside the clock
                elif which == "dc_readinto":
                    t["dc_readinto"] = timed(dc_readinto)
                    if not same(buf, src):
                        raise RuntimeError("diskcache readinto: value differs")
                    buf.fill(0)
                else:
                    t0 = pc()
                    b = dc.get(key)
                    t["dc_bytes"] = pc() - t0
                    if not same(b, src):
                        raise RuntimeError("diskcache get: value differs")
                    del b
            if r:
                for k, v in t.items():
                    g[k].append(v)
        g["stayed_on_ssd"] = store.tier_of(key) == Tier.SSD
        log(f"get 64 MiB SSD-resident: yrcache med {U.fmt_ns(U.median(g['yr']))} "
            f"({U.fmt_bw(BIG, U.median(g['yr']))}), diskcache read=True+readinto med "
            f"{U.fmt_ns(U.median(g['dc_readinto']))} ({U.fmt_bw(BIG, U.median(g['dc_readinto']))}), "
            f"diskcache get bytes med {U.fmt_ns(U.median(g['dc_bytes']))}; "
            f"stayed on SSD: {g['stayed_on_ssd']}")
        store.delete(key)
        dc.delete(key)
        del src, buf
        gc.collect()

        # ---- 1 KiB puts and gets over distinct keys
        s = res.setdefault("small", {"yr_put": [], "dc_put": [], "yr_get": [], "dc_get": []})
        val = os.urandom(SMALL)
        put, get, dset, dget = store.put, store.get, dc.set, dc.get
        ssd_tier = Tier.SSD
        for i in range(200):                    # warm-up on throwaway keys
            put(f"w/{i}", val, tier=ssd_tier)
            get(f"w/{i}")
            dset(f"w/{i}", val)
            dget(f"w/{i}")
        for r in range(cfg.small_rounds):
            keys = [f"s{r}/{i:07d}" for i in range(cfg.small_n)]
            n = len(keys)
            gc.collect()
            gc.disable()
            try:
                for which in (("yr", "dc") if r % 2 == 0 else ("dc", "yr")):
                    t0 = pc()
                    if which == "yr":
                        for k in keys:
                            put(k, val, tier=ssd_tier)
                    else:
                        for k in keys:
                            dset(k, val)
                    s[f"{which}_put"].append(n / ((pc() - t0) / 1e9))
                for which in (("dc", "yr") if r % 2 == 0 else ("yr", "dc")):
                    t0 = pc()
                    if which == "yr":
                        for k in keys:
                            v = get(k)
                    else:
                        for k in keys:
                            v = dget(k)
                    s[f"{which}_get"].append(n / ((pc() - t0) / 1e9))
            finally:
                gc.enable()
            if bytes(get(keys[-1])) != val or dget(keys[-1]) != val:
                raise RuntimeError("1 KiB: value read back differs")
            if store.tier_of(keys[0]) != Tier.SSD:
                raise RuntimeError(f"1 KiB: {keys[0]} is in {store.tier_of(keys[0])!r}, not on SSD")
            del v
            log(f"1 KiB x {n} round {r + 1}: yrcache {U.fmt_rate(s['yr_put'][-1], 'puts/s')}, "
                f"{U.fmt_rate(s['yr_get'][-1], 'gets/s')}; diskcache {U.fmt_rate(s['dc_put'][-1], 'sets/s')}, "
                f"{U.fmt_rate(s['dc_get'][-1], 'gets/s')}")
        s["n"] = cfg.small_n
    finally:
        dc.close()
        store.destroy()


# ---------------------------------------------------------------------- report

def _bw_cell(ns_list: list[int], size: int, ops: bool = False) -> str:
    med, best = U.median(ns_list), min(ns_list)
    cell = f"{U.fmt_ns(med)} = {U.fmt_bw(size, med)}"
    if ops:
        cell += f", {U.fmt_rate(1e9 / med)}"
    return cell + f" (best {U.fmt_bw(size, best)})"


def build_rows(cfg: Config, res: dict) -> list[dict]:
    rows: list[dict] = []

    def row(workload, yr, base, ratio, target="", ok=None, **raw):
        rows.append({"workload": workload, "yrcache": yr, "baseline": base, "ratio": ratio,
                     "target": target, "ok": ok, **raw})

    def big_row(name, yr_ns, base_ns, base_label, target_ratio=None, ops=False, **extra):
        yr_med, b_med = U.median(yr_ns), U.median(base_ns)
        ratio = b_med / yr_med
        target, ok = "", None
        if target_ratio is not None:
            target, ok = f"ratio >= {target_ratio}", ratio >= target_ratio
        row(name, _bw_cell(yr_ns, BIG, ops), f"{base_label}: {_bw_cell(base_ns, BIG, ops)}", ratio,
            target, ok, size=BIG, yr_median_ns=yr_med, base_median_ns=b_med,
            yr_best_ns=min(yr_ns), base_best_ns=min(base_ns), best_ratio=min(base_ns) / min(yr_ns),
            n=len(yr_ns), **extra)

    rs = res.get("restore", {})
    for mode, label, target in (("hot", "page cache hot", RESTORE_TARGET), ("cold", "cold: fadvise DONTNEED", None)):
        e = rs.get(mode)
        if e and e["yr"]:
            promoted = sum(e["promoted"])
            note = "" if promoted == len(e["promoted"]) else f" [promoted only {promoted}/{len(e['promoted'])}]"
            big_row(f"restore 64 MiB SSD->DRAM, promoting get ({label}){note}", e["yr"], e["raw"],
                    "open+readinto", target, promoted=e["promoted"])
            if e.get("raw_unlink"):
                big_row(f"  same, vs a baseline that also deletes the file ({label})", e["yr"],
                        e["raw_unlink"], "open+readinto+unlink")
    sp = res.get("spill", {})
    if sp.get("yr") and sp.get("raw"):
        big_row("spill 64 MiB DRAM->SSD: put(tier=SSD), no fsync", sp["yr"], sp["raw"],
                "os.write new file", SPILL_TARGET)
    fs = res.get("forced_spill", {})
    if fs.get("yr"):
        spilled = sum(fs["spilled"])
        note = "" if spilled == len(fs["spilled"]) else f" [spilled only {spilled}/{len(fs['spilled'])}]"
        big_row(f"put 64 MiB into DRAM forcing a 64 MiB spill{note}", fs["yr"], fs["base"],
                "os.write + np.copyto", spilled=fs["spilled"])
    if sp.get("yr") and sp.get("dc"):
        big_row("SSD tier: put 64 MiB (tier=SSD) vs diskcache.set(bytes)", sp["yr"], sp["dc"],
                "diskcache.set", ops=True)
    g = res.get("get64", {})
    if g.get("yr"):
        stay = "" if g.get("stayed_on_ssd", True) else " [object was promoted!]"
        big_row(f"SSD tier: get 64 MiB, stays on SSD (new buffer){stay}", g["yr"], g["dc_readinto"],
                "diskcache get(read=True)+readinto", ops=True)
        big_row(f"SSD tier: get 64 MiB, stays on SSD (new buffer){stay}", g["yr"], g["dc_bytes"],
                "diskcache get -> bytes", ops=True)
    s = res.get("small", {})
    for op, dc_op in (("put", "set"), ("get", "get")):
        if s.get(f"yr_{op}") and s.get(f"dc_{op}"):
            yr_med, dc_med = U.median(s[f"yr_{op}"]), U.median(s[f"dc_{op}"])
            row(f"SSD tier: 1 KiB {op}s (x{s['n']} keys) vs diskcache.{dc_op}",
                f"{U.fmt_rate(yr_med, op + 's/s')} = {U.fmt_bw(SMALL, 1e9 / yr_med)}",
                f"diskcache.{dc_op}: {U.fmt_rate(dc_med, op + 's/s')} = {U.fmt_bw(SMALL, 1e9 / dc_med)}",
                yr_med / dc_med, yr_per_s=yr_med, base_per_s=dc_med,
                yr_rounds=s[f"yr_{op}"], base_rounds=s[f"dc_{op}"])
    return rows


NOTES = """\
ratio = yrcache speed / baseline speed (baseline time / yrcache time); > 1 means yrcache is faster.
Every 64 MiB figure is the median (best in brackets) of {reps} samples ({cold_reps} cold), interleaved with
the baselines, order alternating, after an untimed warm-up sample; 1 KiB: median of {rounds} rounds of
{small_n} distinct keys. All files live in one directory tree on the filesystem of {root_fs}.
PAGE CACHE: every "hot" read happens right after its file was written, so yrcache and the raw/diskcache
  baselines all read from the page cache (memory copy speed, not device speed). The "cold" restore fsyncs
  and drops (posix_fadvise DONTNEED) every file of the SSD tier (payload, SQLite index) and the baseline
  file before each read, so both read from the device. No write is fsynced (page cache write speed).
restore: get() of an object on SSD in a store with promote_after=1: SQLite index lookup, readinto the
  arena block + xxh3 checksum, commit in the arena, removal of the disk copy (index transaction + unlink),
  then the zero-copy view. Baseline: open(f, 'rb', buffering=0).readinto(preallocated touched buffer);
  the second baseline also unlinks the file it read, as a promotion removes the object's disk copy
  (a just-written file's unlink frees its dirty page cache; an fsynced one's also frees its extents).
spill: put(key, array, tier=Tier.SSD) of a fresh key: temp file write + xxh3 + rename + index commit +
  arena stub; the baseline writes a new file with os.write; both are deleted after each sample (outside
  the clock). The forced spill is a put into a DRAM arena (3 x 64 MiB, watermarks 0.6/0.3) holding the
  previous 64 MiB object: the store spills that one to SSD, then copies the new one into the arena.
diskcache: Cache(dir) with default settings (64 MiB values in files, 1 KiB inline in SQLite), values are
  bytes. yrcache gets of SSD-resident objects (promote_after=2**30) return a private copy in a newly
  allocated buffer (page faults included); the diskcache get(read=True)+readinto fills a preallocated one.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and keys")
    ap.add_argument("--json", metavar="OUT", help="also write every figure and raw sample to this JSON file")
    ap.add_argument("--dir", metavar="PATH",
                    help="make the fresh working directory inside PATH (default: under /tmp); removed at the end")
    args = ap.parse_args(argv)
    cfg = Config.make(args.quick)
    U.raise_keyboard_interrupt_on_sigterm()

    env = U.environment()
    env["diskcache"] = U._version("diskcache")
    print("# yrcache SSD-tier benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    print(f"- diskcache : {env['diskcache']}")

    res: dict = {}
    foreign_load = U.ForeignLoad()
    cleanup = U.Cleanup()
    interrupted = False
    error = None
    t_start = time.monotonic()
    root = None
    try:
        parent = args.dir if args.dir else "/tmp"
        os.makedirs(parent, exist_ok=True)
        root = tempfile.mkdtemp(prefix="yrbench-tiers-", dir=parent)
        cleanup.add(f"remove {root}", lambda: shutil.rmtree(root, ignore_errors=False))
        env["dir"] = root
        st = os.statvfs(root)
        env["dir_free"] = f"{st.f_bavail * st.f_frsize / GiB:.1f} GiB free"
        print(f"- dir       : {root} ({env['dir_free']})")
        print(flush=True)
        bench_restore(cfg, cleanup, res, root)
        bench_spill(cfg, cleanup, res, root)
        bench_ssd_vs_diskcache(cfg, cleanup, res, root)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up and reporting what was measured")
    except Exception as e:  # report what we have, then the error
        import traceback
        error = traceback.format_exc()
        log(f"error: {type(e).__name__}: {e}")
    finally:
        cleanup.run()
    if root is not None and os.path.exists(root):
        log(f"warning: {root} could not be removed")

    rows = build_rows(cfg, res)
    print(U.render(rows))
    print()
    fs = "?"
    try:
        with open("/proc/mounts") as f:
            mounts = [ln.split() for ln in f]
        best = max((m for m in mounts if (root or "/tmp").startswith(m[1].rstrip("/") + "/") or m[1] == "/"),
                   key=lambda m: len(m[1]))
        fs = f"{best[1]} ({best[2]} on {best[0]})"
    except (OSError, ValueError, IndexError):
        pass
    print(NOTES.format(reps=cfg.reps, cold_reps=cfg.cold_reps, rounds=cfg.small_rounds,
                       small_n=cfg.small_n, root_fs=fs))
    foreign = foreign_load.cpus()
    end_load = U.print_footer(env, rows, foreign, t_start, interrupted, error)

    if args.json:
        doc = {"env": env, "loadavg_end": end_load, "foreign_cpus": foreign, "quick": cfg.quick,
               "config": vars(cfg), "rows": rows, "raw": res, "interrupted": interrupted, "error": error}
        U.write_json(args.json, doc)
    return 130 if interrupted else (1 if error else 0)


if __name__ == "__main__":
    sys.exit(main())
