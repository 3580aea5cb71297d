#!/usr/bin/env python
"""Host<->device copies between yrcache's DRAM arena and a CUDA device vs torch pinned copies.

    python bench/gpu_check.py [--size MiB] [--reps N] [--json out.json] [--cpu-dry-run]

A store created with ``hbm=`` and ``device="cuda:0"`` registers its whole DRAM
arena as pinned host memory (``cudaHostRegister``), so copies between an
arena block and the device should run at pinned-memory speed.  Measured in one
run, interleaved sample by sample, each sample ``torch.cuda.synchronize()``d
before and after (wall clock, ``time.perf_counter_ns``), median reported:

* H2D (a1): ``v.to('cuda', non_blocking=True)`` of a CPU tensor ``v`` returned by
  ``store.get`` (a zero-copy view of the arena) vs ``pinned.to('cuda',
  non_blocking=True)`` of a ``pin_memory=True`` tensor of the same size (and a
  pageable tensor, for context).
* H2D (a2): promotion of a DRAM tensor into HBM by the store: a store with
  ``promote_after=2``; the first ``get`` is untimed, the second (timed)
  promotes the tensor (one H2D copy from the arena) and returns the device
  tensor; vs the pinned copy.
* D2H (b): demotion of a device tensor into the arena: ``put(k_i, t,
  tier=Tier.HBM)`` into an HBM tier sized so that it must first demote the
  previous 256 MiB tensor ``k_{i-1}`` (one D2H copy into an arena block), plus
  the put's own device-to-device copy of ``t`` (measured separately as
  "D2D clone"); vs ``pinned_buffer.copy_(cuda_tensor, non_blocking=True)``
  (and a pageable buffer, for context).
* RL (c): a ``WeightPublisher`` publishes 8 fp32 device tensors (2 x ``--size`` MiB)
  as bf16 vs ``t.to(bf16)`` + a pinned D2H copy of each; a ``WeightSubscriber``
  fetches every tensor's dim-1 half into device bf16 tensors vs one pinned H2D
  copy of as many bytes (the floor) and vs ``dst.copy_(pinned_host[:, :half])``.

Target: H2D from the arena >= 0.8x the pinned torch copy.  Without CUDA it
prints ``skipped: no CUDA device`` and exits 0.  ``--cpu-dry-run`` runs the same
sequence with ``device="cpu"`` and no pinning to check the script's logic on a
machine without a GPU (its figures mean nothing).  Exit status: 0 when every
step ran (PASS or FAIL alike), 1 on an error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util as U  # noqa: E402

MiB = U.MiB
pc = time.perf_counter_ns
H2D_TARGET = 0.8


def emit(doc: dict, path: str | None) -> None:
    print("JSON: " + json.dumps(doc, default=str))
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {path}")


def run(args, torch, doc: dict, cleanup: U.Cleanup) -> None:
    from yrcache import Tier, TieredStore

    cuda = not args.cpu_dry_run
    dev = torch.device("cuda:0" if cuda else "cpu")
    nbytes = args.size * MiB
    reps = args.reps
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = doc["results"]

    def timed(fn):
        sync()
        t0 = pc()
        out = fn()
        sync()
        return pc() - t0, out

    if cuda:
        torch.empty(1, device=dev)          # CUDA context outside every clock
        props = torch.cuda.get_device_properties(dev)
        doc["env"].update({"gpu": props.name, "gpu_memory_gib": round(props.total_memory / U.GiB, 1),
                           "cuda": torch.version.cuda})

    name = f"ybench-gpu-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cleanup.add(f"destroy store {name}", lambda: U.destroy_store(name))
    t0 = pc()
    # HBM holds one tensor below its 0.9 watermark, two pass it (so a 2nd put demotes the 1st)
    store = TieredStore(name=name, dram=4 * nbytes + 64 * MiB, hbm=nbytes * 3 // 2, device=str(dev),
                        promote_after=2)
    doc["env"]["store_create_s"] = round((pc() - t0) / 1e9, 3)
    cleanup.add(f"close store {name}", store.destroy)

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)       # pageable, touched
    src_dev = src.to(dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned.copy_(src)
    pinned_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned_out.fill_(0)
    pageable_out = torch.empty(nbytes, dtype=torch.uint8)
    pageable_out.fill_(0)
    check = torch.empty(nbytes, dtype=torch.uint8)

    # ---- (a1) H2D from an arena view (the view is taken once: a 2nd get would promote it)
    store.put("h2d/src", src)
    if store.tier_of("h2d/src") != Tier.DRAM:
        raise RuntimeError(f"h2d/src: a CPU tensor put went to {store.tier_of('h2d/src')!r}, not DRAM")
    view = store.get("h2d/src")
    try:
        doc["env"]["arena_view_is_pinned"] = bool(view.is_pinned()) if cuda else None
    except Exception as e:   # noqa: BLE001 - diagnostic only
        doc["env"]["arena_view_is_pinned"] = f"unknown ({type(e).__name__}: {e})"
    doc["env"]["pinned_baseline_is_pinned"] = bool(pinned.is_pinned()) if cuda else None
    a1 = res.setdefault("h2d_view", {"yr": [], "pinned": [], "pageable": []})
    sources = {"yr": view, "pinned": pinned, "pageable": src}
    orders = (("yr", "pinned", "pageable"), ("pinned", "pageable", "yr"), ("pageable", "yr", "pinned"))
    for r in range(reps + 1):
        for which in orders[r % 3]:
            dt, d = timed(lambda: sources[which].to(dev, non_blocking=True))  # noqa: F821,B023
            if r == 0 and not torch.equal(d, src_dev):
                raise RuntimeError(f"H2D from {which}: the device copy differs from the source")
            del d
            if r:
                a1[which].append(dt)
    if store.tier_of("h2d/src") != Tier.DRAM:
        raise RuntimeError("h2d/src left DRAM during the view-copy samples")
    del view, sources
    store.delete("h2d/src")
    gc.collect()

    # ---- (a2) H2D by promotion: the 2nd get of a DRAM tensor moves it into HBM
    a2 = res.setdefault("h2d_promote", {"yr": [], "pinned": [], "promoted": []})
    for r in range(reps + 1):
        key = f"h2d/p{r}"
        store.put(key, src)
        x = store.get(key)                  # 1st read: counted, not promoted
        del x
        if store.tier_of(key) != Tier.DRAM:
            raise RuntimeError(f"{key}: in {store.tier_of(key)!r} after the first read (promote_after=2)")
        t = {}
        for which in (("yr", "pinned") if r % 2 == 0 else ("pinned", "yr")):
            if which == "yr":
                t["yr"], d = timed(lambda: store.get(key))
                promoted = d.device == dev and store.tier_of(key) == Tier.HBM
                if r == 0 and not torch.equal(d.reshape(-1).view(torch.uint8), src_dev):
                    raise RuntimeError(f"{key}: the promoted tensor differs from the source")
                del d
                store.delete(key)
            else:
                t["pinned"], d = timed(lambda: pinned.to(dev, non_blocking=True))
                del d
        if r:
            a2["yr"].append(t["yr"])
            a2["pinned"].append(t["pinned"])
            a2["promoted"].append(promoted)
    gc.collect()

    # ---- (b) D2H by demotion: each put into a full HBM tier demotes the previous tensor
    b = res.setdefault("d2h_demote", {"yr": [], "pinned": [], "pageable": [], "d2d": [], "demoted": []})
    store.put("d2h/0", src_dev, tier=Tier.HBM)
    if store.tier_of("d2h/0") != Tier.HBM:
        raise RuntimeError(f"d2h/0: put(tier=HBM) went to {store.tier_of('d2h/0')!r}")
    orders = (("yr", "pinned", "pageable", "d2d"), ("pinned", "pageable", "d2d", "yr"),
              ("pageable", "d2d", "yr", "pinned"), ("d2d", "yr", "pinned", "pageable"))
    for r in range(1, reps + 2):
        key, prev = f"d2h/{r}", f"d2h/{r - 1}"
        t = {}
        for which in orders[r % 4]:
            if which == "yr":
                t["yr"], _ = timed(lambda: store.put(key, src_dev, tier=Tier.HBM))
                demoted = store.tier_of(prev) == Tier.DRAM and store.tier_of(key) == Tier.HBM
                if demoted and (r == 1 or r == reps + 1):
                    check.fill_(0)
                    store.get_into(prev, check)         # a copy out of the arena: no promotion
                    if not torch.equal(check, src):
                        raise RuntimeError(f"{prev}: the demoted tensor differs from the source")
                store.delete(prev)
            elif which == "pinned":
                t["pinned"], _ = timed(lambda: pinned_out.copy_(src_dev, non_blocking=True))
            elif which == "pageable":
                t["pageable"], _ = timed(lambda: pageable_out.copy_(src_dev))
            else:
                t["d2d"], d = timed(lambda: src_dev.clone())
                del d
        if r > 1:
            for k, v in t.items():
                b[k].append(v)
            b["demoted"].append(demoted)
    if not (torch.equal(pinned_out, src) and torch.equal(pageable_out, src)):
        raise RuntimeError("D2H baselines: the host copies differ from the source")
    st = store.stats()
    doc["store_stats"] = {k: st[k] for k in ("promotions", "spills", "pinned_bytes")}
    doc["store_stats"]["tiers"] = st["tiers"]
    store.destroy()


def run_rl(args, torch, doc: dict, cleanup: U.Cleanup) -> None:
    """(c) RL weight sync with device tensors, one process: publish fp32 device weights as
    bf16 (2 x --size MiB of fp32, --size MiB stored), fetch every tensor's dim-1 half into
    device bf16 tensors (--size/2 MiB)."""
    from yrcache import TieredStore
    from yrcache.rl import Shard, WeightPublisher, WeightSubscriber

    cuda = not args.cpu_dry_run
    dev = torch.device("cuda:0" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bf16 = torch.bfloat16

    def timed(fn):
        sync()
        t0 = pc()
        fn()
        sync()
        return pc() - t0

    n, rows = 8, 4096
    cols = max(2, args.size * MiB // 2 // n // rows // 2 * 2)
    half = cols // 2
    name = f"ybench-gpurl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cleanup.add(f"destroy store {name}", lambda: U.destroy_store(name))
    store = TieredStore(name=name, dram=4 * n * rows * cols * 2 + 64 * MiB)
    cleanup.add(f"close store {name}", store.destroy)
    t0 = pc()
    store.pin_host_memory()      # what the first publish or fetch with device tensors pays, once
    doc["env"]["rl_pin_host_memory"] = f"{(pc() - t0) / 1e6:.1f} ms for {U.fmt_size(store.stats()['tiers']['dram']['capacity'])}"
    gen = torch.Generator(device=dev).manual_seed(5)
    state = {f"w{i}": torch.randn(rows, cols, device=dev, generator=gen) for i in range(n)}
    pub, sub = WeightPublisher(store, "gpu-check"), WeightSubscriber(store, "gpu-check")
    lay = {k: Shard(1, 0, 2) for k in state}
    dst = {k: torch.empty(rows, half, dtype=bf16, device=dev) for k in state}
    naive = {k: torch.empty(rows, half, dtype=bf16, device=dev) for k in state}
    host = {k: torch.empty(rows, cols, dtype=bf16, pin_memory=cuda) for k in state}
    needed = torch.empty(n * rows * half, dtype=bf16, pin_memory=cuda)
    needed_dev = torch.empty(n * rows * half, dtype=bf16, device=dev)
    want = {k: t[:, :half].to(bf16) for k, t in state.items()}
    res = doc["results"].setdefault("rl", {k: [] for k in ("publish", "publish_base", "fetch", "fetch_floor",
                                                            "fetch_naive")})
    ops = {
        "publish": lambda v: pub.publish(state, version=v, dtype=bf16),
        "publish_base": lambda v: [host[k].copy_(t.to(bf16), non_blocking=True) for k, t in state.items()],
        "fetch": lambda v: sub.fetch(v, layout=lay, into=dst),
        "fetch_floor": lambda v: needed_dev.copy_(needed, non_blocking=True),
        "fetch_naive": lambda v: [naive[k].copy_(host[k][:, :half]) for k in state],
    }
    for r in range(args.reps + 1):
        v = r + 1
        for group in (("publish", "publish_base"), ("fetch", "fetch_floor", "fetch_naive")):
            order = group[r % len(group):] + group[:r % len(group)]
            for which in order:
                dt = timed(lambda: ops[which](v))  # noqa: B023
                if r:
                    res[which].append(dt)
        if r in (0, args.reps):
            for k in state:
                if not (torch.equal(dst[k], want[k]) and torch.equal(naive[k], want[k])):
                    raise RuntimeError(f"RL fetch of version {v}: {k} differs from the published slice")
    doc["env"]["rl_bytes"] = {"published_fp32": n * rows * cols * 4, "stored_bf16": n * rows * cols * 2,
                              "fetched_bf16": n * rows * half * 2}
    store.destroy()


def build_rows(res: dict, nbytes: int) -> list[dict]:
    rows = []

    def cell(ns, size):
        med = U.median(ns)
        return f"{U.fmt_ns(med)} = {U.fmt_bw(size, med)} (best {U.fmt_bw(size, min(ns))})"

    def row(workload, yr, base, base_label, target=None, nbytes=nbytes, **extra):
        ratio = U.median(base) / U.median(yr)
        rows.append({"workload": workload, "yrcache": cell(yr, nbytes), "baseline": f"{base_label}: {cell(base, nbytes)}",
                     "ratio": ratio, "target": f"ratio >= {target}" if target else "",
                     "ok": (ratio >= target) if target else None,
                     "yr_median_ns": U.median(yr), "base_median_ns": U.median(base),
                     "yr_best_ns": min(yr), "base_best_ns": min(base), "n": len(yr),
                     "yr_gib_s": nbytes / U.median(yr) * 1e9 / U.GiB,
                     "base_gib_s": nbytes / U.median(base) * 1e9 / U.GiB, **extra})

    size = U.fmt_size(nbytes)
    a1 = res.get("h2d_view", {})
    if a1.get("yr"):
        row(f"H2D {size}: arena view .to(cuda, non_blocking)", a1["yr"], a1["pinned"], "pinned .to(cuda)",
            H2D_TARGET)
        row(f"H2D {size}: arena view .to(cuda), context", a1["yr"], a1["pageable"], "pageable .to(cuda)")
    a2 = res.get("h2d_promote", {})
    if a2.get("yr"):
        n_ok = sum(a2["promoted"])
        note = "" if n_ok == len(a2["promoted"]) else f" [promoted only {n_ok}/{len(a2['promoted'])}]"
        row(f"H2D {size}: promotion DRAM->HBM (2nd get){note}", a2["yr"], a2["pinned"], "pinned .to(cuda)",
            H2D_TARGET, promoted=a2["promoted"])
    b = res.get("d2h_demote", {})
    if b.get("yr"):
        n_ok = sum(b["demoted"])
        note = "" if n_ok == len(b["demoted"]) else f" [demoted only {n_ok}/{len(b['demoted'])}]"
        row(f"D2H {size}: demotion HBM->DRAM (put forcing it){note}", b["yr"], b["pinned"],
            "pinned_buf.copy_(cuda)", demoted=b["demoted"])
        row(f"D2H {size}: same, context", b["yr"], b["pageable"], "pageable_buf.copy_(cuda)")
    rl = res.get("rl", {})
    if rl.get("fetch"):
        stored, fetched = nbytes, nbytes // 2     # bf16 bytes (fp32 published: 2 x --size)
        row(f"RL publish {U.fmt_size(2 * stored)} fp32 on the device as bf16", rl["publish"], rl["publish_base"],
            ".to(bf16) + pinned D2H", nbytes=stored)
        row(f"RL fetch dim-1 halves ({U.fmt_size(fetched)} bf16) into device tensors", rl["fetch"],
            rl["fetch_floor"], "pinned H2D of as many bytes (floor)", nbytes=fetched)
        row("RL fetch, same, context", rl["fetch"], rl["fetch_naive"],
            "dst.copy_(pinned_host[:, :half])", nbytes=fetched)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="tensor size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=10, help="timed samples per workload (default 10)")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the sequence with device='cpu' and no pinning (logic check only)")
    args = ap.parse_args(argv)
    if args.size < 1 or args.reps < 1:
        ap.error("--size and --reps must be positive")

    env = {"date": U.environment()["date"], "host": os.uname().nodename,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    doc = {"env": env, "size_bytes": args.size * MiB, "reps": args.reps, "results": {}, "rows": [],
           "skipped": False, "error": None, "dry_run": bool(args.cpu_dry_run)}
    try:
        import torch
    except ImportError:
        print("skipped: no CUDA device (torch is not installed)")
        doc.update(skipped=True, reason="torch is not installed")
        emit(doc, args.json)
        return 0
    env["torch"] = torch.__version__
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(f"skipped: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)")
        doc.update(skipped=True, reason="no CUDA device")
        emit(doc, args.json)
        return 0

    print("# yrcache arena <-> GPU copy check" + (" (CPU DRY RUN: figures are meaningless)"
                                                 if args.cpu_dry_run else ""))
    U.raise_keyboard_interrupt_on_sigterm()
    cleanup = U.Cleanup()
    t_start = time.monotonic()
    try:
        run(args, torch, doc, cleanup)
        run_rl(args, torch, doc, cleanup)
    except KeyboardInterrupt:
        doc["error"] = "interrupted"
    except Exception:
        doc["error"] = traceback.format_exc()
    finally:
        cleanup.run()
    for k, v in env.items():
        print(f"- {k} : {v}")
    print()
    rows = build_rows(doc["results"], args.size * MiB)
    doc["rows"] = rows
    body = [[r["workload"], r["yrcache"], r["baseline"], U.fmt_ratio(r["ratio"]), r["target"] or "-",
             "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")] for r in rows]
    print(U.markdown_table(["workload", "yrcache", "baseline", "ratio", "target", "ok"], body,
                           ["l", "r", "r", "r", "l", "l"]))
    print()
    print(f"ratio = yrcache speed / baseline speed; median of {args.reps} samples (best in brackets), each "
          "timed with torch.cuda.synchronize() before and after.")
    d2d = doc["results"].get("d2h_demote", {}).get("d2d")
    if d2d:
        doc["d2d_clone_median_ns"] = U.median(d2d)
        print(f"The demoting put also makes its own device copy of the new tensor: a D2D clone of "
              f"{U.fmt_size(args.size * MiB)} takes {U.fmt_ns(U.median(d2d))} (median), included in the D2H rows.")
    if env.get("arena_view_is_pinned") is False:
        print("WARNING: the arena view is not pinned memory (cudaHostRegister failed or was not done): "
              "H2D/D2H from the arena run at pageable speed")
    targets = [r for r in rows if r["ok"] is not None]
    passed = sum(1 for r in targets if r["ok"])
    print(f"targets: {passed} PASS, {len(targets) - passed} FAIL"
          + ("; STOPPED BY AN ERROR (partial results)" if doc["error"] else "")
          + f"; total time {time.monotonic() - t_start:.1f} s")
    if doc["error"]:
        print(doc["error"], file=sys.stderr)
    emit(doc, args.json)
    return 1 if doc["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
