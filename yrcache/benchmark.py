"""``yrcache bench``: a micro-benchmark shipped with the package.

    yrcache bench [--quick] [--json] [--repeats N]
    python -m yrcache.benchmark [--quick] [--json] [--repeats N]

Measured in one run, each figure the median over ``--repeats`` samples:

* put of 1 KiB, 1 MiB and 64 MiB numpy arrays into a warm (pre-faulted)
  store, the same key overwritten, against ``np.copyto`` of the same bytes
  into a touched array: the floor for any put, which copies once;
* get of 4 KiB and 64 MiB values from a second process (spawned: it shares
  nothing but the store's name, and attaches by name), one timing per get,
  against ``np.copyto`` of the same bytes (what a copying transfer costs at
  the very least);
* 1 KiB puts per second and gets per second in one process, over distinct keys.

The speed ratio is ``np.copyto time / yrcache time``: above 1 yrcache is
faster than copying the bytes once.  Nothing is asserted about speed; the
figures depend on the machine and on what else runs on it (the report gives
the CPU count, the load and /dev/shm).  The benchmark creates one store,
``yrbench-<pid>-<random>``, and destroys it when it ends, also on Ctrl-C or
SIGTERM; after a SIGKILL, ``yrcache destroy`` removes it.  The full run takes
under a minute; ``--quick`` a few seconds.  The repository's ``bench/``
scripts compare yrcache with other baselines at larger sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .errors import YrcacheError
from .sizes import format_size

KiB, MiB = 1 << 10, 1 << 20
PUT_SIZES = (1 * KiB, 1 * MiB, 64 * MiB)
GET_SIZES = (4 * KiB, 64 * MiB)
SMALL_SIZE = 1 * KiB
_pc = time.perf_counter_ns


@dataclass(frozen=True)
class Plan:
    """How much to measure: ``--quick`` or the full run."""

    quick: bool
    repeats: int           # samples per put/copyto figure, rounds of the small-value loops
    get_n: int             # timed gets per size in the second process
    small_n: int           # 1 KiB keys per round

    @classmethod
    def make(cls, quick: bool, repeats: int | None = None) -> "Plan":
        r = repeats if repeats is not None else (5 if quick else 15)
        return cls(quick, r, 500 if quick else 5000, 10_000 if quick else 100_000)

    @property
    def dram(self) -> int:
        """Arena size: an overwrite of 64 MiB holds old and new, plus one round of small keys."""
        return 2 * max(PUT_SIZES) + 32 * MiB + self.small_n * 2 * KiB


def _inner(size: int) -> int:
    """Operations per timed sample: enough to make a sample last a few milliseconds."""
    return 1 if size >= 16 * MiB else max(1, min(2000, (4 * MiB) // size))


def _payload(size: int) -> np.ndarray:
    """A touched uint8 array (its page faults stay outside every clock)."""
    a = np.empty(size, dtype=np.uint8)
    a.fill(0x5A)
    a[: min(size, 256)] = np.arange(min(size, 256), dtype=np.uint8)
    return a


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ------------------------------------------------------------- the machine

def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    """What a reader needs to judge the figures: CPUs, memory, /dev/shm, load, versions."""
    from . import __version__

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    mem = _first_line("/proc/meminfo", "MemTotal")
    try:
        st = os.statvfs("/dev/shm")
        shm: int | None = st.f_blocks * st.f_frsize
        shm_free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        shm = shm_free = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(), "cpus_usable": usable,
        "cpu_model": _first_line("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "shm_bytes": shm, "shm_free_bytes": shm_free, "load_average": load,
        "platform": platform.platform(), "python": platform.python_version(),
        "numpy": np.__version__, "yrcache": __version__,
    }


# ------------------------------------------------------------ measurements

def _time_ops(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call of ``fn``, over ``inner`` calls."""
    t0 = _pc()
    for _ in range(inner):
        fn()
    return (_pc() - t0) / inner / 1e9


def bench_put(store: Any, plan: Plan) -> list[dict]:
    """put of each PUT_SIZE vs np.copyto, sample by sample, alternating which goes first."""
    rows = []
    for size in PUT_SIZES:
        src, dst = _payload(size), np.zeros(size, dtype=np.uint8)
        key, inner = f"bench/put/{size}", _inner(size)

        def put(key: str = key, src: np.ndarray = src) -> None:
            store.put(key, src)

        def copy(dst: np.ndarray = dst, src: np.ndarray = src) -> None:
            np.copyto(dst, src)

        for _ in range(2):               # warm: both destinations resident, code paths hot
            put()
            copy()
        t_put: list[float] = []
        t_copy: list[float] = []
        for r in range(plan.repeats):
            for which in ((put, copy) if r % 2 == 0 else (copy, put)):
                (t_put if which is put else t_copy).append(_time_ops(which, inner))
        v = store.get(key)
        ok = v.nbytes == size and bool(np.array_equal(v[:256], src[:256])) and v[-1] == src[-1]
        del v
        if not ok:
            raise RuntimeError(f"put {format_size(size)}: the stored value differs from what was put")
        store.delete(key)
        rows.append(_row(size, t_put, t_copy))
        del src, dst
        gc.collect()
    return rows


def bench_copyto(size: int, plan: Plan) -> list[float]:
    """np.copyto of ``size`` bytes: the baseline of a get of that size."""
    src, dst = _payload(size), np.zeros(size, dtype=np.uint8)
    inner = _inner(size)
    np.copyto(dst, src)
    return [_time_ops(lambda: np.copyto(dst, src), inner) for _ in range(plan.repeats)]


def _row(size: int, yr: list[float], copy: list[float]) -> dict:
    med, base = _median(yr), _median(copy)
    return {"size": size, "yrcache_s": med, "copyto_s": base, "ratio": base / med if med > 0 else None,
            "samples_s": yr, "copyto_samples_s": copy}


def _reader(conn: Any, name: str, keys: list[tuple[str, int]], n: int) -> None:
    """Second process: attach by name, time ``n`` gets of each key (the view dropped after each)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent handles Ctrl-C and stops us
    try:
        from .store import TieredStore

        with TieredStore.attach(name) as s:
            out = {}
            for key, size in keys:
                v = s.get(key)
                if v is None or v.nbytes != size:
                    raise RuntimeError(f"{key}: expected {size} bytes, got {None if v is None else v.nbytes}")
                del v
                for _ in range(min(n, 200)):             # warm
                    v = s.get(key)
                    del v
                lat = [0] * n
                for i in range(n):
                    t0 = _pc()
                    v = s.get(key)
                    lat[i] = _pc() - t0
                    del v                                # unpins (outside the clock)
                out[key] = lat
        conn.send(("ok", out))
    except BaseException as e:                           # reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def bench_get(store: Any, plan: Plan, copy_times: dict[int, list[float]]) -> list[dict]:
    """get of each GET_SIZE from a spawned second process, against np.copyto of the same size."""
    keys = [(f"bench/get/{size}", size) for size in GET_SIZES]
    for key, size in keys:
        store.put(key, _payload(size))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reader, args=(child, store.name, keys, plan.get_n), daemon=True,
                       name="yrcache-bench-reader")
    proc.start()
    child.close()
    try:
        deadline = time.monotonic() + 300
        while not parent.poll(0.1):
            if not proc.is_alive() and not parent.poll(0):
                raise RuntimeError(f"the reader process died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the reader process did not answer within 300 s")
        status, got = parent.recv()
        if status != "ok":
            raise RuntimeError(f"the reader process failed: {got}")
        proc.join(30)
    finally:
        _stop(proc)
        parent.close()
    for key, _ in keys:
        store.delete(key)
    rows = []
    for key, size in keys:
        lat = [t / 1e9 for t in got[key]]
        row = _row(size, lat, copy_times[size])
        row["samples_s"] = None                  # thousands of them: summarised instead
        row.update(n=len(lat), min_s=min(lat), p99_s=sorted(lat)[max(0, math.ceil(len(lat) * 0.99) - 1)])
        rows.append(row)
    return rows


def _stop(proc: Any) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def bench_small(store: Any, plan: Plan) -> dict:
    """1 KiB values in one process: puts/s and gets/s over distinct keys, one round per repeat."""
    value = _payload(SMALL_SIZE)
    put, get = store.put, store.get
    for i in range(1000):                # warm, on throwaway keys
        put(f"bench/warm/{i}", value)
        v = get(f"bench/warm/{i}")
    del v
    for i in range(1000):
        store.delete(f"bench/warm/{i}")
    puts: list[float] = []
    gets: list[float] = []
    n = plan.small_n
    for r in range(plan.repeats):
        keys = [f"bench/small/{r}/{i:07d}" for i in range(n)]
        t0 = _pc()
        for k in keys:
            put(k, value)
        t1 = _pc()
        for k in keys:
            v = get(k)                   # the previous view is dropped here
        del v
        t2 = _pc()
        puts.append(n / ((t1 - t0) / 1e9))
        gets.append(n / ((t2 - t1) / 1e9))
        for k in keys:                   # outside the clock
            store.delete(k)
    return {"size": SMALL_SIZE, "n": n, "rounds": plan.repeats, "puts_per_s": _median(puts),
            "gets_per_s": _median(gets), "puts_per_s_rounds": puts, "gets_per_s_rounds": gets}


# ------------------------------------------------------------------- report

def _fmt_time(s: float) -> str:
    ns = s * 1e9
    for unit, div in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= div:
            v = ns / div
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{ns:.0f} ns"


def _fmt_size(n: int) -> str:
    """``1 KiB``, ``64 MiB``: the benchmark's sizes are exact."""
    for unit, div in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return format_size(n)


def _fmt_rate(per_s: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if per_s >= div:
            return f"{per_s / div:.3g}{unit}/s"
    return f"{per_s:.3g}/s"


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "n/a"
    return f"{r:,.0f}x" if r >= 100 else f"{r:.3g}x"


def format_report(res: dict) -> str:
    """The human report of a result of ``run()``: the machine, then one table."""
    m = res["machine"]
    gib = 1 << 30

    def size(n: int | None) -> str:
        return "unknown" if n is None else f"{n / gib:.1f} GiB"

    load = " ".join(str(x) for x in m["load_average"]) if m["load_average"] else "unknown"
    lines = [
        f"yrcache bench{' --quick' if res['quick'] else ''}: medians of {res['repeats']} repeats "
        f"({res['seconds']:.1f} s)",
        f"machine: {m['cpus']} CPUs ({m['cpus_usable']} usable), {m['cpu_model']}; memory {size(m['memory_bytes'])}; "
        f"/dev/shm {size(m['shm_bytes'])} ({size(m['shm_free_bytes'])} free); load {load}",
        f"         Python {m['python']}, numpy {m['numpy']}, yrcache {m['yrcache']}, {m['platform']}",
        "",
    ]
    rows = [("operation", "yrcache", "np.copyto", "speed ratio")]
    for r in res["put"]:
        rows.append((f"put {_fmt_size(r['size'])}", _fmt_time(r["yrcache_s"]), _fmt_time(r["copyto_s"]),
                     _fmt_ratio(r["ratio"])))
    for r in res["get"]:
        rows.append((f"get {_fmt_size(r['size'])}, second process", _fmt_time(r["yrcache_s"]),
                     _fmt_time(r["copyto_s"]), _fmt_ratio(r["ratio"])))
    sm = res["small"]
    rows.append((f"{_fmt_size(sm['size'])} puts, one process", _fmt_rate(sm["puts_per_s"]), "-", "-"))
    rows.append((f"{_fmt_size(sm['size'])} gets, one process", _fmt_rate(sm["gets_per_s"]), "-", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "speed ratio: np.copyto time / yrcache time (above 1: faster than copying the bytes once).",
        "A get returns a zero-copy view: its time does not grow with the size.",
        "Other load on the machine slows every figure; compare runs on an idle machine.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------- the run

@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While running: SIGTERM raises KeyboardInterrupt, so cleanup runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(plan: Plan, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Run every measurement on a fresh store (destroyed at the end, whatever happens)."""
    from .store import TieredStore

    t_start = time.monotonic()
    info = machine()
    free = info["shm_free_bytes"]
    if free is not None and free < plan.dram + 64 * MiB:
        raise BenchError(f"/dev/shm has {format_size(free)} free; the benchmark needs "
                         f"{format_size(plan.dram + 64 * MiB)} (`yrcache list` shows the stores there)")
    name = f"yrbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = None
    try:
        progress(f"creating store {name} ({format_size(plan.dram)}, pre-faulted)")
        store = TieredStore(name=name, dram=plan.dram)
        progress("put vs np.copyto: " + ", ".join(format_size(s) for s in PUT_SIZES))
        put = bench_put(store, plan)
        copy_times = {r["size"]: r["copyto_samples_s"] for r in put}
        for size in GET_SIZES:
            if size not in copy_times:
                copy_times[size] = bench_copyto(size, plan)
        progress("get from a second process: " + ", ".join(format_size(s) for s in GET_SIZES))
        get = bench_get(store, plan, copy_times)
        progress(f"{format_size(SMALL_SIZE)} puts and gets, {plan.small_n} keys x {plan.repeats} rounds")
        small = bench_small(store, plan)
    finally:
        if store is not None:
            store.destroy()
        else:                            # interrupted inside the constructor
            from .tiers import dram

            dram.destroy(name)
    return {"quick": plan.quick, "repeats": plan.repeats, "store_bytes": plan.dram,
            "seconds": time.monotonic() - t_start, "machine": info, "put": put, "get": get, "small": small}


class BenchError(Exception):
    """The benchmark cannot run here (e.g. /dev/shm is too small)."""


_DESCRIPTION = """A micro-benchmark of yrcache on this machine, medians over repeats:
put of 1 KiB, 1 MiB and 64 MiB vs np.copyto of the same bytes; get of 4 KiB and
64 MiB from a second process (spawned, attached by name) vs np.copyto; 1 KiB
puts/s and gets/s in one process.  Speed ratio: np.copyto time / yrcache time
(above 1: faster than copying the bytes once).  It uses one store,
yrbench-<pid>-<random>, removed when it ends (also on Ctrl-C and SIGTERM)."""

_EPILOG = """examples:
  yrcache bench --quick            a few seconds; a table
  yrcache bench                    under a minute; more repeats and keys
  yrcache bench --quick --json     the same figures as JSON (seconds, sizes in bytes)

Exit status: 0 done (no figure is ever judged), 1 the benchmark could not run,
2 bad arguments, 130 interrupted (the store is removed in every case)."""


def _repeats(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not 1 <= v <= 1000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 1000, got {v}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark with command-line ``argv``; print a table (or ``--json``); return 0.

    Returns 1 (one line on stderr) when it cannot run, 2 for bad arguments and
    130 when interrupted; the store it made is destroyed in every case.
    """
    from ._cli_base import Parser

    p = Parser(prog="yrcache bench", description=_DESCRIPTION, epilog=_EPILOG)
    p.add_argument("--quick", action="store_true", help="fewer repeats and keys: a few seconds")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--repeats", type=_repeats, metavar="N",
                   help="samples per figure (default 5 with --quick, else 15)")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    plan = Plan.make(args.quick, args.repeats)
    verbose = sys.stderr.isatty() and not args.json

    def progress(msg: str) -> None:
        if verbose:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    try:
        with _sigterm_as_interrupt():
            res = run(plan, progress)
    except KeyboardInterrupt:
        return 130
    except (BenchError, YrcacheError, RuntimeError, MemoryError, OSError) as e:
        print(f"yrcache bench: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=2) if args.json else format_report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
