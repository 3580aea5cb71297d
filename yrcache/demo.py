"""``yrcache demo``: reinforcement learning whose every byte goes through one store.

A learner process trains a policy with PPO on gymnasium's CartPole-v1 and
publishes its weights through ``yrcache.rl`` after every update.  Actor
processes wait for each new version, fetch it straight into their policy's
parameters (``fetch(v, into=...)``), play episodes and put the trajectories
into the store, where the learner reads them back.  Nothing but the store's
name crosses a pipe.  The store has a small DRAM tier and an SSD tier in a
temporary directory: the policy (priority 0) stays in DRAM while replay
(priority -1, with a TTL) spills to the SSD and ages out.

This process only watches: it creates the store and the temporary directory,
starts the children (from a ``forkserver``), prints a status line from
what they put in the store, and cleans up, also on Ctrl-C (exit status 130).  The children's
code is ``yrcache/_demo_rl.py``; docs/demo.md describes the data flow.

The store's keys and words are listed in ``yrcache/_demo_layout.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, TextIO

from ._demo_layout import (LEARNER_STAT, STAT_WORD, STOP_WORD, WEIGHTS, DemoConfig, actor_stat_key)
from .errors import StoreNotFoundError, YrcacheError
from .sizes import format_size, parse_size
from .store import TieredStore

__all__ = ["DemoConfig", "main"]

QUICK: dict[str, Any] = {"updates": 5, "batch_steps": 4096, "ttl": 2.0, "dram": "1MiB", "epochs": 2}


# ---------------------------------------------------------------- children

def _child(role: str, store_name: str, cfg: DemoConfig, index: int) -> None:
    """Body of a child process (forked by the fork server): ignore Ctrl-C, attach, run ``role``.

    The child starts with SIGINT blocked (the parent blocks it while it
    starts the fork server and the children; the mask survives exec and
    fork): it ignores SIGINT before unblocking it, so a Ctrl-C on the
    terminal, which signals the whole process group, reaches only the
    parent, which stops the children itself.  SIGTERM keeps its default
    action: the parent's ``terminate()`` ends a child at once and silently.
    A child also stops when its parent (the fork server, which exits with
    this process) is gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()
    import torch

    torch.set_num_threads(1)      # a core or less per process: no intra-op thread pools
    from . import _demo_rl

    try:
        store = TieredStore.attach(store_name)
    except StoreNotFoundError:    # the demo was stopped before this child got going
        return
    try:
        if role == "learner":
            _demo_rl.run_learner(store, cfg, parent)
        else:
            _demo_rl.run_actor(store, cfg, index, parent)
    finally:
        store.close()


# ------------------------------------------------------------------ parent

class DemoError(Exception):
    """A child failed, or the demo could not start."""


class _Status:
    """The status line: rewritten in place (``\\r``) on a terminal, else one line a second."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every = 0.25 if self.tty else 1.0
        self.next = 0.0
        self.shown = False

    def due(self) -> bool:
        return time.monotonic() >= self.next

    def show(self, line: str) -> None:
        self.next = time.monotonic() + self.every
        if self.tty:            # one line, or \r would not get back to its start
            width = shutil.get_terminal_size().columns - 1
            self.out.write("\r" + line[:width] + "\x1b[K")
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self.shown = True

    def end(self) -> None:
        if self.tty and self.shown:
            self.out.write("\n")
            self.out.flush()
        self.shown = False

    def say(self, line: str) -> None:
        """A line of its own, whole (after the status line, if one is showing)."""
        self.end()
        self.out.write(line + "\n")
        self.out.flush()


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _tiers(store: TieredStore, keys: Iterable[str]) -> list[str]:
    """The tier of each key that still exists ("dram", "ssd"); keys may expire meanwhile."""
    infos = (store.info(k) for k in keys)
    return [i["tier"].name.lower() for i in infos if i is not None]


def _usage(used: int, capacity: int | None = None) -> str:
    """``"796/960 KiB"``, ``"1.1 MiB"``: sizes for the status line, short."""
    top = max(used, capacity or 0)
    unit, div, fmt = ("KiB", 1 << 10, ".0f") if top < 1 << 20 else ("MiB", 1 << 20, ".1f")
    cap = f"/{capacity / div:{fmt}}" if capacity is not None else ""
    return f"{used / div:{fmt}}{cap} {unit}"


def _mean_index(hist: list[int]) -> float:
    """The mean of a histogram given as counts per value 0, 1, 2, ..."""
    n = sum(hist)
    return sum(i * c for i, c in enumerate(hist)) / n if n else 0.0


class _Interrupts:
    """SIGINT and SIGTERM raise one KeyboardInterrupt, then are only recorded.

    A single interrupt means the clean-up it starts cannot itself be
    interrupted (a second Ctrl-C is recorded, not raised).  Inside
    ``deferred()`` the interrupt waits for the block's end: CPython runs
    signal handlers in the main thread whichever thread the kernel picked,
    so masking the signal in this thread alone would not hold it back.
    Only the main thread can install handlers; elsewhere this does nothing.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.armed = True
        self.defer = 0
        self.pending = False
        self.old: dict[int, Any] = {}

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.signum
        self.signum = self.signum or signum
        if first and self.armed:
            self.armed = False
            if self.defer:
                self.pending = True
            else:
                raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that an interrupt does not cut short; it is raised at the block's end."""
        self.defer += 1
        try:
            yield
        finally:
            self.defer -= 1
        if self.pending and not self.defer:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)


class _Demo:
    """One run: the temporary directory, the store, the children, the status line.

    ``run()`` returns the summary; ``close()`` (idempotent, safe after any
    interruption) stops the children, destroys the store and removes the
    directory.
    """

    def __init__(self, cfg: DemoConfig, status_out: TextIO, intr: _Interrupts) -> None:
        self.cfg = cfg
        self.intr = intr
        self.status = _Status(status_out)
        self.tmp: str | None = None
        self.store: TieredStore | None = None
        self.procs: list[BaseProcess] = []
        self.t0 = time.monotonic()
        self.t_first: float | None = None     # when version 0 was seen
        self.ssd_peak = 0
        self.dram_peak = 0

    # --------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = os.path.join(tempfile.gettempdir(), f"yrcache-demo-{token}")
        self.tmp = path                       # recorded first: close() removes it whatever happens next
        os.mkdir(path, 0o700)
        self.store = TieredStore(name=f"demo-{token}", dram=cfg.dram,
                                 ssd=os.path.join(path, "ssd"), ssd_size=cfg.ssd_size)
        self.status.say(f"yrcache demo: PPO on CartPole-v1, 1 learner + {cfg.actors} actor processes, "
                        f"one store: {self.store.name!r}")
        self.status.say(f"  {format_size(parse_size(cfg.dram))} DRAM + {format_size(parse_size(cfg.ssd_size))} "
                        f"SSD (at {path})")
        self._start()
        self.status.show(f"learner pid {self.procs[0].pid}, actor pids "
                         f"{' '.join(str(p.pid) for p in self.procs[1:])}: starting (importing torch)")
        self._watch()
        self._stop_actors()
        return self._summary()

    def _start(self) -> None:
        """Start the learner and the actors from a fork server that has torch imported.

        ``forkserver``, not ``fork``: the server is a fresh interpreter that
        imports torch, gymnasium and the children's module once and runs no
        torch code, so each child is a fork of a process with no torch
        threads and nothing of this one, and it starts in milliseconds
        instead of importing torch again (seconds per process, as ``spawn``
        would).  (A fork server this process already runs, without that
        preload, only makes the children slower to start.)
        """
        assert self.store is not None
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["yrcache._demo_rl", "gymnasium"])
        roles = [("learner", 0)] + [("actor", k) for k in range(self.cfg.actors)]
        # No interrupt between asking the fork server for a child and knowing
        # its pid (start() waits while the server imports torch); a Ctrl-C
        # meanwhile is raised right after.  SIGINT is also masked in this
        # thread, the one that starts the fork server: the server and the
        # children it forks inherit the mask (see _child).
        with self.intr.deferred():
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                for role, k in roles:
                    p = ctx.Process(target=_child, args=(role, self.store.name, self.cfg, k),
                                    name=f"yrcache-demo-{role}{k if role == 'actor' else ''}", daemon=True)
                    self.procs.append(p)
                    p.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _check_children(self) -> bool:
        """True once the learner has finished; DemoError when any child failed.

        An actor exits with status 0 only after the stop word is set (by the
        learner, when it is done); before that, an exit is a failure."""
        assert self.store is not None
        stopping = bool(self.store.word(STOP_WORD).value)   # (a lookup: fine ten times a second)
        for i, p in enumerate(self.procs):
            code = p.exitcode
            if code not in (None, 0) or (i > 0 and code == 0 and not stopping):
                who = "the learner" if i == 0 else f"actor {i - 1}"
                raise DemoError(f"{who} (pid {p.pid}) exited with status {code} "
                                "(its traceback, if any, is above)")
        return self.procs[0].exitcode == 0

    def _watch(self) -> None:
        assert self.store is not None
        word = self.store.word(STAT_WORD)
        while True:
            seen = word.seq
            if self._check_children():
                break
            if self.status.due():
                self._show()
            word.wait(seen, 0.1)
        self._show(force=True)
        self.status.end()

    def _stop_actors(self) -> None:
        """Set the stop word (the learner did too) and wait for the actors' last counters."""
        assert self.store is not None
        stop = self.store.word(STOP_WORD)
        stop.cas(0, 1)
        deadline = time.monotonic() + 10.0
        for p in self.procs[1:]:
            p.join(max(0.0, deadline - time.monotonic()))
        self._check_children()
        late = [p.pid for p in self.procs if p.exitcode is None]
        if late:
            raise DemoError(f"actor processes {late} did not stop within 10 s of the stop word")

    # ------------------------------------------------------------ reading
    def _json(self, key: str) -> dict[str, Any]:
        assert self.store is not None
        v = self.store.get(key)
        return json.loads(bytes(v)) if v is not None else {}

    def _read(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        assert self.store is not None
        learner = self._json(LEARNER_STAT)
        actors = [self._json(actor_stat_key(k)) for k in range(self.cfg.actors)]
        st = self.store.stats()
        self.ssd_peak = max(self.ssd_peak, st["tiers"]["ssd"]["used"])
        self.dram_peak = max(self.dram_peak, st["tiers"]["dram"]["used"])
        return learner, actors, st

    def _show(self, force: bool = False) -> None:
        learner, actors, st = self._read()
        if not learner:
            if force:
                self.status.show("no version published")
            return
        if self.t_first is None:
            self.t_first = time.monotonic()
        med = _median([x[1] for a in actors for x in a.get("lat", [])[-8:]])
        hist: list[int] = learner.get("stale_hist", [])
        rets = learner.get("returns", [])
        dram, ssd = st["tiers"]["dram"], st["tiers"]["ssd"]
        self.status.show(
            f"v {learner['version']}/{self.cfg.updates} {time.monotonic() - self.t0:.1f} s | return "
            f"{f'{rets[0]:.1f} -> {rets[-1]:.1f}' if rets else '-'} | publish->actor "
            f"{'-' if med is None else f'{med:.1f} ms'} | stale {_mean_index(hist):.2f} | "
            f"DRAM {_usage(dram['used'], dram['capacity'])}, SSD {_usage(ssd['used'])}, {st['spills']} spills")

    def _summary(self) -> dict[str, Any]:
        """Final figures, read from the store before it is destroyed."""
        assert self.store is not None
        cfg = self.cfg
        learner, actors, st = self._read()
        s = self.store
        policy = _tiers(s, (k for k in s.keys(prefix=f"__rl__/{WEIGHTS}/")))
        replay = _tiers(s, (k for k in s.keys(prefix="exp/") if k.endswith("/meta")))
        rows = [x for a in actors for x in a.get("lat", [])]    # [version, ms, asleep in wait(), fetch ms]
        lat = [r[1] for r in rows]
        lat_wait = [r[1] for r in rows if r[2]]
        rets: list[float] = learner.get("returns", [])
        last = rets[-min(5, len(rets)):] if rets else []
        stale_hist: list[int] = learner.get("stale_hist", [])
        solved = learner.get("solved_t")
        written = sum(a.get("episodes", 0) for a in actors)
        return {
            "config": asdict(cfg),
            "store": s.name,
            "wall_s": round(time.monotonic() - self.t0, 2),
            "startup_s": _round(None if self.t_first is None else self.t_first - self.t0, 2),
            "updates": learner.get("updates", 0),
            "versions_published": learner.get("version", -1) + 1,
            "versions_fetched": sum(a.get("fetches", 0) for a in actors),
            "fetches_per_actor": [a.get("fetches", 0) for a in actors],
            "latency_ms": {
                "median": _round(_median(lat)), "p90": _round(_quantile(lat, 0.9)),
                "max": _round(max(lat) if lat else None), "n": len(lat),
                "median_waiting": _round(_median(lat_wait)), "n_waiting": len(lat_wait),
                "publish_median": _round(_median(learner.get("publish_ms", []))),   # CPU time
                "fetch_median": _round(_median([r[3] for r in rows]))},
            "staleness": {
                "actor_mean": round(sum(a.get("behind_sum", 0) for a in actors) / written, 3) if written else 0.0,
                "actor_max": max((a.get("behind_max", 0) for a in actors), default=0),
                "learner_mean": round(_mean_index(stale_hist), 3),
                "learner_max": max((i for i, c in enumerate(stale_hist) if c), default=0),
                "learner_hist": stale_hist},
            "experience": {
                "episodes_written": written,
                "steps_written": sum(a.get("steps", 0) for a in actors),
                "episodes_used": learner.get("episodes", 0),
                "steps_used": learner.get("steps", 0),
                "dropped_stale": learner.get("dropped_stale", 0),
                "expired_unread": learner.get("lost", 0),
                "store_full": sum(a.get("store_full", 0) for a in actors) + learner.get("store_full", 0),
                "left_dram": replay.count("dram"), "left_ssd": replay.count("ssd"),
                "aged_out": written - len(replay)},
            "tiers": {
                "spills": st["spills"], "promotions": st["promotions"],
                "dram_capacity": st["tiers"]["dram"]["capacity"], "dram_peak": self.dram_peak,
                "ssd_capacity": st["tiers"]["ssd"]["capacity"], "ssd_peak": self.ssd_peak,
                "policy_keys": {t: policy.count(t) for t in sorted(set(policy))}},
            "return": {
                "start": _round(rets[0] if rets else None, 1),
                "end": _round(sum(last) / len(last) if last else None, 1),
                "per_update": [round(r, 1) for r in rets],
                "solved_update": learner.get("solved_update"),
                "solved_s": _round(None if solved is None else solved - self.t0, 1)},
            "pids": [p.pid for p in self.procs],
        }

    # ------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Stop every child, destroy the store, remove the directory.  Idempotent."""
        self.status.end()
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()                 # SIGTERM: default action, no traceback
        for p in self.procs:
            if p.pid is not None:
                p.join(3.0)
                if p.exitcode is None:
                    p.kill()
                    p.join(3.0)
        self.procs = [p for p in self.procs if p.pid is not None and p.exitcode is None]
        if self.store is not None:
            self.store.destroy()
            self.store = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _close(demo: _Demo, intr: _Interrupts) -> None:
    """``demo.close()`` to the end, even if the one interrupt lands inside it.

    Disarms ``intr`` first: from here on a Ctrl-C only sets the exit status.
    """
    while True:
        try:
            intr.armed = False
            demo.close()
            return
        except KeyboardInterrupt:
            continue


# -------------------------------------------------------------- printing

def _print_summary(r: dict[str, Any], out: TextIO) -> None:
    """The summary of a run (``_Demo.run()``'s dict) as text, a line per topic."""
    cfg = r["config"]
    lat, stale, exp, tiers, ret = r["latency_ms"], r["staleness"], r["experience"], r["tiers"], r["return"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} ms"

    pol = " + ".join(f"{n} keys in {t.upper()}" for t, n in tiers["policy_keys"].items()) or "none"
    full = f", {exp['store_full']} puts found the store full" if exp["store_full"] else ""
    lines = [
        f"updates         {r['updates']} x {cfg['batch_steps']} steps: {r['versions_published']} versions published, "
        f"{r['versions_fetched']} fetched into the actors' parameters "
        f"({' + '.join(map(str, r['fetches_per_actor']))})",
        f"publish->actor  median {ms(lat['median'])}, p90 {ms(lat['p90'])} ({lat['n']} fetches); "
        f"medians: publish() {ms(lat['publish_median'])} of CPU, fetch() {ms(lat['fetch_median'])}",
        f"staleness       the learner trained on data {stale['learner_mean']:.2f} versions old "
        f"(max {stale['learner_max']}, limit {cfg['max_staleness']}); actors "
        f"{stale['actor_mean']:.2f} behind (max {stale['actor_max']})",
        f"experience      {exp['episodes_written']} episodes, {exp['steps_written']} steps through the store: "
        f"{exp['episodes_used']} used, {exp['dropped_stale']} too stale, {exp['expired_unread']} expired unread{full}",
        f"tiers           {tiers['spills']} spills to SSD (peak {format_size(tiers['ssd_peak'])}); at the end "
        f"policy: {pol}",
        f"                replay: {exp['left_dram']} episodes in DRAM, {exp['left_ssd']} on SSD, "
        f"{exp['aged_out']} aged out (TTL {cfg['ttl']:g} s)",
    ]
    if ret["start"] is not None:
        solved = (f"; solved (>= 475) at update {ret['solved_update']}, {ret['solved_s']:.1f} s in"
                  if ret["solved_update"] is not None else "")
        gain = f" (x{ret['end'] / ret['start']:.1f})" if ret["start"] else ""
        lines.append(f"average return  {ret['start']:.1f} at the start -> {ret['end']:.1f} at the end{gain}{solved}")
    lines.append(f"wall time       {r['wall_s']:.1f} s ({r['startup_s'] or 0:.1f} s starting the processes)")
    out.write("\n".join(lines) + "\n")
    out.flush()


# ---------------------------------------------------------------- the CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yrcache demo",
        description="PPO on CartPole-v1: a learner and actor processes exchange weights "
                    "(yrcache.rl) and experience through one tiered store (see docs/demo.md).")
    d = DemoConfig()
    p.add_argument("--actors", type=int, metavar="N", help=f"actor processes (default {d.actors})")
    p.add_argument("--updates", type=int, metavar="N", help=f"learner updates (default {d.updates})")
    p.add_argument("--batch-steps", type=int, metavar="N", help=f"environment steps per update (default {d.batch_steps})")
    p.add_argument("--max-staleness", type=int, metavar="K",
                   help=f"versions an actor's data may lag the learner (default {d.max_staleness})")
    p.add_argument("--ttl", type=float, metavar="SECONDS", help=f"seconds replay stays in the store (default {d.ttl:g})")
    p.add_argument("--dram", metavar="SIZE", help=f"DRAM tier size (default {d.dram})")
    p.add_argument("--ssd-size", metavar="SIZE", help=f"SSD tier size, in a temporary directory (default {d.ssd_size})")
    p.add_argument("--seed", type=int, metavar="N", help=f"random seed (default {d.seed})")
    p.add_argument("--quick", action="store_true",
                   help="a run of seconds for CI: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--json", action="store_true",
                   help="print the final summary as JSON on stdout (progress goes to stderr)")
    return p


def _config(args: argparse.Namespace, p: argparse.ArgumentParser) -> DemoConfig:
    cfg = replace(DemoConfig(), **QUICK) if args.quick else DemoConfig()
    given = {k: getattr(args, k) for k in ("actors", "updates", "batch_steps", "max_staleness", "ttl",
                                           "dram", "ssd_size", "seed") if getattr(args, k) is not None}
    cfg = replace(cfg, **given)
    for name, low in (("actors", 1), ("updates", 1), ("batch_steps", 1), ("max_staleness", 0)):
        if getattr(cfg, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if not cfg.ttl > 0:
        p.error("--ttl must be a positive number of seconds")
    for name in ("dram", "ssd_size"):
        try:
            parse_size(getattr(cfg, name), name)
        except ValueError as e:
            p.error(str(e))
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the exit status (0, 1 on failure, 130 on Ctrl-C, 2 on bad usage)."""
    p = _parser()
    args = p.parse_args(argv)
    cfg = _config(args, p)
    missing = [m for m in ("torch", "gymnasium") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"yrcache demo: needs {' and '.join(missing)}: pip install 'yrcache[demo]'", file=sys.stderr)
        return 1
    out = sys.stdout
    summary: dict[str, Any] | None = None
    error: str | None = None
    with _Interrupts() as intr:
        demo = _Demo(cfg, sys.stderr if args.json else out, intr)
        try:
            try:
                summary = demo.run()
            except (DemoError, YrcacheError, OSError, ValueError) as e:
                error = str(e)
            finally:
                _close(demo, intr)
        except KeyboardInterrupt:            # raised at most once (see _Interrupts)
            _close(demo, intr)
        if intr.signum:
            print(f"yrcache demo: interrupted ({signal.Signals(intr.signum).name}); children stopped, "
                  "store destroyed, temporary directory removed", file=sys.stderr)
            return 128 + intr.signum
        if error is not None or summary is None:
            print(f"yrcache demo: {error or 'failed'}", file=sys.stderr)
            return 1
        if args.json:
            out.write(json.dumps(summary, indent=2) + "\n")
        else:
            _print_summary(summary, out)
        out.flush()
    return 0


if __name__ == "__main__":
    try:
        _rc = main()
    except KeyboardInterrupt:                # before main() took over the signals
        _rc = 130
    raise SystemExit(_rc)
