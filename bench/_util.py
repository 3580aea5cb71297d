"""Shared helpers for the benchmarks in ``bench/``.

Nothing here times anything by itself: formatting, statistics, the
environment header, a cleanup registry that survives Ctrl-C, spawned helper
processes with a handshake, and an untracked ``SharedMemory`` for baselines.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import resource
import platform
import signal
import statistics
import sys
import time
import traceback
from importlib import metadata
from typing import Any, Callable, Sequence

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# ---------------------------------------------------------------- formatting

def fmt_size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_ns(ns: float) -> str:
    """A duration given in ns, with a unit that keeps 3 significant digits."""
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        v, u = ns / 1e3, "µs"
    elif ns < 1e9:
        v, u = ns / 1e6, "ms"
    else:
        v, u = ns / 1e9, "s"
    return f"{v:.3g} {u}" if v < 100 else f"{v:.0f} {u}"


def fmt_bw(nbytes: int, ns: float) -> str:
    gib_s = nbytes / (ns / 1e9) / GiB
    return f"{gib_s:.3g} GiB/s" if gib_s >= 0.1 else f"{gib_s * 1024:.3g} MiB/s"


def fmt_rate(per_s: float, what: str = "ops/s") -> str:
    if per_s >= 1e6:
        return f"{per_s / 1e6:.3g}M {what}"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.3g}k {what}"
    return f"{per_s:.3g} {what}"


def fmt_ratio(r: float | None) -> str:
    if r is None or not math.isfinite(r):
        return "n/a"
    if r >= 100:
        return f"{r:,.0f}x"
    return f"{r:.3g}x"


# ---------------------------------------------------------------- statistics

def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): a value that was measured."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return float(s[k])


def summary(xs: Sequence[float]) -> dict:
    return {"n": len(xs), "min": float(min(xs)), "median": median(xs),
            "p99": percentile(xs, 99), "max": float(max(xs)), "mean": float(statistics.fmean(xs))}


# -------------------------------------------------------------- environment

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _shm_size() -> str:
    try:
        st = os.statvfs("/dev/shm")
        size = f"{st.f_blocks * st.f_frsize / GiB:.1f} GiB total, {st.f_bavail * st.f_frsize / GiB:.1f} GiB free"
    except OSError:
        return "unknown"
    huge = "never"   # the mount option that decides whether huge_pages=True gets huge pages
    for line in _read("/proc/self/mounts").splitlines():
        f = line.split()
        if len(f) > 3 and f[1] == "/dev/shm":
            huge = next((o[5:] for o in f[3].split(",") if o.startswith("huge=")), "never")
    return f"{size}, huge={huge}"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def loadavg() -> str:
    """1/5/15-minute load averages and the CPU count: other work on the machine skews timings."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (on {os.cpu_count()} CPUs)"


class ForeignLoad:
    """CPU time used by *other* processes while the benchmark runs.

    Busy time of the whole machine (``/proc/stat``) minus this process's and its
    reaped children's (``getrusage``), as an average number of busy CPUs.  On a
    2-CPU machine anything above ~0.2 makes the timings pessimistic.
    """

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._busy0 = self._machine_busy()
        self._ours0 = self._ours()

    @staticmethod
    def _machine_busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...
        busy = sum(fields[:8]) - fields[3] - fields[4]
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        import resource
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def cpus(self) -> float | None:
        """Average CPUs busy with other processes since construction."""
        busy = self._machine_busy()
        if busy is None or self._busy0 is None:
            return None
        wall = max(time.monotonic() - self._t0, 1e-9)
        return max(0.0, (busy - self._busy0) - (self._ours() - self._ours0)) / wall


def environment() -> dict:
    """What a reader needs to judge the numbers (no imports of heavy packages)."""
    import numpy as np
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory": _mem_total(),
        "dev_shm": _shm_size(),
        "kernel": f"{platform.system()} {platform.release()}",
        "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": _version("torch"),
        "yrcache": _version("yrcache"),
        "cffi": _version("cffi"),
        "posix_ipc": _version("posix_ipc"),
        "loadavg": loadavg(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def environment_header(env: dict) -> str:
    keys = ("date", "cpu", "cpus", "memory", "dev_shm", "kernel", "thp", "thp_shmem",
            "python", "numpy", "torch", "yrcache", "cffi", "posix_ipc", "loadavg", "command")
    w = max(len(k) for k in keys)
    return "\n".join(f"- {k.ljust(w)} : {env[k]}" for k in keys if k in env)


# -------------------------------------------------------------------- table

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   align: Sequence[str] | None = None) -> str:
    """An aligned markdown table; ``align`` holds 'l' or 'r' per column."""
    align = list(align or ["l"] * len(header))
    cols = list(zip(*([list(header)] + [list(r) for r in rows])))
    widths = [max(len(str(c)) for c in col) for col in cols]

    def line(cells):
        out = []
        for c, w, a in zip(cells, widths, align):
            c = str(c)
            out.append(c.rjust(w) if a == "r" else c.ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


# ------------------------------------------------------------------ cleanup

class Cleanup:
    """LIFO registry of cleanup actions; each runs once, errors are reported, not raised."""

    def __init__(self) -> None:
        self._actions: dict[int, tuple[str, Callable[[], Any]]] = {}
        self._next = 0

    def add(self, what: str, fn: Callable[[], Any]) -> int:
        self._next += 1
        self._actions[self._next] = (what, fn)
        return self._next

    def run_one(self, handle: int) -> None:
        item = self._actions.pop(handle, None)
        if item is not None:
            self._call(*item)

    def run(self) -> None:
        for handle in sorted(self._actions, reverse=True):
            self.run_one(handle)

    @staticmethod
    def _call(what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # keep cleaning up the rest
            print(f"[cleanup] {what}: {type(e).__name__}: {e}", file=sys.stderr)


def raise_keyboard_interrupt_on_sigterm() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------- shared-memory helpers

class _NoTracker:
    """Stands in for ``resource_tracker`` inside ``multiprocessing.shared_memory``.

    On Python < 3.13 every ``SharedMemory(name)`` - even one that only opens an
    existing segment - registers it with the resource tracker, which unlinks it
    (with a warning) when that process exits.  3.13 added ``track=False``; this
    is the same for older versions.  The benchmark unlinks its segments itself.
    """

    @staticmethod
    def register(name, rtype):
        pass

    @staticmethod
    def unregister(name, rtype):
        pass


def untrack_shared_memory() -> None:
    from multiprocessing import shared_memory
    shared_memory.resource_tracker = _NoTracker  # type: ignore[attr-defined]


def unlink_segment(name: str) -> bool:
    """Unlink a ``SharedMemory`` segment by name; False when it does not exist."""
    import _posixshmem  # CPython's own helper behind multiprocessing.shared_memory
    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------ child processes

def child_init() -> None:
    """In a spawned helper: leave Ctrl-C to the parent, which stops us cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Child:
    """A helper process started with 'spawn' and a ready handshake.

    ``target(conn)`` must send one message (anything) once it is ready; the
    constructor returns only after that, so process start-up and imports are
    never inside a benchmark's clock.  ``call`` sends a request and returns the
    reply ``("ok", result)``, raising on ``("err", traceback)``.
    """

    def __init__(self, target: Callable, name: str, cleanup: Cleanup, start_timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=target, args=(child_conn,), name=name, daemon=True)
        self._handle = cleanup.add(f"stop {name}", self.stop)
        self._cleanup = cleanup
        self.proc.start()
        child_conn.close()
        self.ready = self.recv(start_timeout)

    def recv(self, timeout: float = 900.0) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name} (pid {self.proc.pid}) died with exit code {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer within {timeout:.0f} s")
        return self.conn.recv()

    def call(self, *msg: Any, timeout: float = 900.0) -> Any:
        self.conn.send(msg)
        reply = self.recv(timeout)
        if reply[0] == "err":
            raise RuntimeError(f"{self.name} failed:\n{reply[1]}")
        return reply[1]

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("quit",))
            except (OSError, EOFError, BrokenPipeError):
                pass
            self.proc.join(3)   # a helper busy with a long request, or one that got half a
                                # message when we were interrupted, is terminated instead
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        try:
            self.conn.close()
        except OSError:
            pass

    def close(self) -> None:
        """Stop now and forget the cleanup entry."""
        self._cleanup.run_one(self._handle)


def write_json(path: str, doc: dict) -> None:
    """Write a run's results (``--json``): indented, anything JSON lacks as ``str``."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {path}")


def rss_info() -> dict:
    """This process's peak and current memory (bytes): getrusage and /proc/self/status."""
    out = {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def stop_children(children: Sequence[Child], grace: float) -> None:
    """Ask every child to quit at once, give them ``grace`` seconds together, terminate the
    ones still busy (in a round after an error or an interrupt), then close them all: so
    stopping many processes takes seconds, not seconds each."""
    for c in children:
        try:
            c.conn.send(("quit",))
        except (OSError, EOFError, BrokenPipeError):
            pass
    deadline = time.monotonic() + grace
    for c in children:
        c.proc.join(max(0.0, deadline - time.monotonic()))
    for c in children:
        if c.proc.is_alive():
            c.proc.terminate()
    for c in children:
        c.close()           # joins; kills what is still alive; drops the cleanup entry


def serve(conn, handlers: dict[str, Callable[..., Any]], on_exit: Callable[[], Any] | None = None) -> None:
    """Request loop for a helper process: ``(op, *args)`` -> ``("ok", result)`` or ``("err", tb)``."""
    child_init()
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            op, args = msg[0], msg[1:]
            if op == "quit":
                break
            try:
                conn.send(("ok", handlers[op](*args)))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    finally:
        if on_exit is not None:
            on_exit()


def render(rows: list[dict]) -> str:
    """The results table every benchmark prints: figures, ratio, target, verdict."""
    header = ["workload", "yrcache", "baseline", "ratio", "target", "ok"]
    body = [[r["workload"], r["yrcache"], r["baseline"], fmt_ratio(r["ratio"]), r["target"] or "-",
             "" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")] for r in rows]
    return markdown_table(header, body, ["l", "r", "r", "r", "l", "l"])


def print_footer(env: dict, rows: list[dict], foreign_cpus: float | None, t_start: float,
                 interrupted: bool, error: str | None) -> str:
    """Print load, the PASS/FAIL count and any error; returns the end load average."""
    targets = [r for r in rows if r["ok"] is not None]
    passed = sum(1 for r in targets if r["ok"])
    end_load = loadavg()
    fc = foreign_cpus
    print(f"load average at start: {env['loadavg']}; at end: {end_load}; other processes kept "
          + (f"{fc:.2f} of {os.cpu_count()} CPUs busy during the run" if fc is not None else "? CPUs busy")
          + ("  -- timings are pessimistic: rerun on an idle machine" if fc is not None and fc > 0.2 else ""))
    print(f"targets: {passed} PASS, {len(targets) - passed} FAIL"
          + ("  (run interrupted: partial results)" if interrupted else "")
          + ("  (run stopped by an error: partial results)" if error else "")
          + f"; total time {time.monotonic() - t_start:.0f} s")
    if error:
        print("\n" + error, file=sys.stderr)
    return end_load


def destroy_store(name: str) -> None:
    """Remove a store's segment by name (cleanup after an interrupted run)."""
    from yrcache.tiers.dram import destroy

    destroy(name)
