#!/usr/bin/env python
"""RL weight sync: yrcache.rl against gather-and-broadcast baselines, measured in one run.

    python bench/bench_rl_sync.py [--quick] [--size-mib 512] [--json out.json]
                                  [--reps 5] [--warmup 4] [--bucket-mib 256] [--threads N]
                                  [--methods yrcache,gloo,save] [--profile]

The workload is one weight update of a synthetic transformer whose fp32 master
weights total ``--size-mib`` MiB (512 by default, about 64 with ``--quick``):
an embedding (vocab x d, with an odd vocab so that every split is uneven), and
per layer q/k/v/o (d x d), gate/up (ff x d), down (d x ff) and two norms (d),
plus a final norm.  Weights are in torch's (out, in) layout.

* 2 trainer ranks hold FSDP dim-0 halves (``numpy.array_split``) of every matrix
  in fp32, and the norms whole.  The update is published as bf16.
* 4 rollout ranks each need a tensor-parallel slice: embedding vocab-parallel
  (dim 0), q/k/v/gate/up column-parallel (dim 0 of the output), o/down
  row-parallel (dim 1), norms replicated (whole).  Each rollout preallocates and
  touches bf16 destination buffers for its slice.

Every method runs in its own spawned set of 2 + 4 processes (so that the peak
RSS of a method is its own); all of them are started, attached, connected and
have built their state and buffers before any clock runs.  The sets coexist
and their rounds are interleaved, the order rotating every round, so that the
load of other work on this shared 2-CPU machine falls on every method alike;
every method first gets ``--warmup`` untimed rounds.  A round: every process arrives
at a barrier (trainers have regenerated their weights for the new version),
then the clock starts (``time.monotonic()``, CLOCK_MONOTONIC, comparable across
processes) when the trainers are released, and stops at the latest moment a
rollout rank reports that its slice is in its buffers.  Every round's slices
are then checked element by element against the expected values (outside the
clock).  Every process runs a full garbage collection before the barrier (one
that lands inside a clock costs ~80 ms of CPU in a process that imported
torch), and runs torch with ``--threads`` threads (default: 1 on this machine;
torch's default of one thread per CPU in each of 6 processes oversubscribes the
CPUs and slows every method several-fold).  Besides wall time, each process
reports its CPU time, its time spent runnable but waiting for a CPU
(schedstat), page faults and full GCs inside the clock, and the main process
measures the CPU used by other processes on the machine during each clocked
window: the machine is shared, and that load is the main source of noise.

Methods:

* yrcache: each trainer ``WeightPublisher.publish``es its fp32 halves with
  ``dtype=torch.bfloat16``; each rollout is blocked in
  ``WeightSubscriber.wait`` and then ``fetch(v, layout, into=buffers)``.  The
  store (pre-faulted arena) is created by a separate owner process.
* (a) torch.distributed gloo over TCP loopback, world 6 (the verl/OpenRLHF
  pattern): trainer rank 1 sends its fp32 halves to rank 0, which casts both
  halves into flat bf16 buckets (``--bucket-mib``) and broadcasts each bucket to
  the 4 rollouts; each rollout slices its part of every tensor into its buffers.
* (b) trainer rank 0 gathers the same way, casts into a preallocated full bf16
  state dict, ``torch.save``s it to /dev/shm and sets an event; each rollout
  ``torch.load(path, mmap=True)``s it and copies its slices into its buffers.

Also measured: read amplification of the yrcache fetches
(``last_fetch_stats``), publish -> wake latency of a 4 KiB state dict (the
median over ``--latency-n`` publishes of [``wait()`` returned in a rollout] -
[``publish()`` called in the trainer], over all 4 subscribers; baseline: a gloo
broadcast of 4 KiB), and the peak RSS of a rollout process per method
(``getrusage(RUSAGE_SELF).ru_maxrss``; shared-memory pages a process touches
count in its RSS).  The first version (every process of a fresh yrcache set
attached by name, no prefault, so every page of the arena it touches is mapped
then) is timed in ``--cold-starts`` fresh sets, the main one and more created
after the timed rounds; the row takes their median against the warm median.

The script prints PASS/FAIL per target and exits 0 either way (1 on an error).
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import multiprocessing as mp
import os
import resource
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait as mp_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util as U  # noqa: E402  (bench/_util.py, also importable in spawned children)

# Nothing heavy is imported at module level: the main process must stay small, because
# a spawned child's ru_maxrss starts at its parent's peak RSS (the exec inherits it).

KiB, MiB, GiB = U.KiB, U.MiB, U.GiB
RUN_ID = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
TRAINERS, ROLLOUTS = 2, 4
WORLD = TRAINERS + ROLLOUTS
BCAST_RANKS = [0] + list(range(TRAINERS, WORLD))   # trainer rank 0 and the rollouts
SHM_PREFIX = f"/dev/shm/ybench-rl-{RUN_ID}-"
METHODS = ("yrcache", "gloo", "save")
LABEL = {"yrcache": "yrcache", "gloo": "(a) gloo gather + bucketed broadcast",
         "save": "(b) gather + torch.save to /dev/shm + mmap load"}

BARRIER_TIMEOUT = 600.0      # trainers regenerate their weights before the barrier
ROUND_TIMEOUT = 600.0
SETTLE_S = 0.05              # after the barrier, let every process block in its wait/recv
LAT_SETTLE_S = 0.01          # latency: let the subscribers fall asleep before publishing
LAT_WARMUP = 5

FIRST_TARGET = 1.5     # the first (cold) version against warm ones
SYNC_TARGET = {"gloo": 5.0, "save": 3.0}
AMP_TARGET = 1.05
LAT_TARGET_S = 5e-3


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------- the model

@dataclass(frozen=True)
class Model:
    d: int
    ff: int
    vocab: int
    layers: int

    @classmethod
    def for_size(cls, size_mib: float) -> "Model":
        """A model whose fp32 weights are at least ``size_mib`` MiB (just above it)."""
        if size_mib >= 256:
            d, vocab = 1024, 32003
        elif size_mib >= 32:
            d, vocab = 512, 8003
        else:
            d, vocab = 256, 2003
        ff = int(round(2.75 * d / 64)) * 64
        per_layer = 4 * d * d + 3 * d * ff + 2 * d
        target = int(size_mib * MiB) // 4
        layers = max(1, math.ceil((target - vocab * d - d) / per_layer))
        return cls(d, ff, vocab, layers)

    def tensors(self) -> list[tuple[int, str, tuple, str]]:
        """(tensor id, name, global shape, kind); kind: vocab | col | row | norm."""
        d, ff = self.d, self.ff
        out = [("model.embed_tokens.weight", (self.vocab, d), "vocab")]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (d,), "norm"),
                    (p + "self_attn.q_proj.weight", (d, d), "col"),
                    (p + "self_attn.k_proj.weight", (d, d), "col"),
                    (p + "self_attn.v_proj.weight", (d, d), "col"),
                    (p + "self_attn.o_proj.weight", (d, d), "row"),
                    (p + "post_attention_layernorm.weight", (d,), "norm"),
                    (p + "mlp.gate_proj.weight", (ff, d), "col"),
                    (p + "mlp.up_proj.weight", (ff, d), "col"),
                    (p + "mlp.down_proj.weight", (d, ff), "row")]
        out.append(("model.norm.weight", (d,), "norm"))
        return [(tid, n, s, k) for tid, (n, s, k) in enumerate(out)]

    def numel(self) -> int:
        return sum(math.prod(s) for _, _, s, _ in self.tensors())


def split_bounds(n: int, count: int, index: int) -> tuple[int, int]:
    """numpy.array_split bounds (written here, independently of yrcache.rl.reshard)."""
    q, r = divmod(n, count)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def trainer_box(shape: tuple, kind: str, rank: int) -> tuple:
    """The FSDP dim-0 half of trainer ``rank`` (norms: whole)."""
    box = [(0, s) for s in shape]
    if kind != "norm":
        box[0] = split_bounds(shape[0], TRAINERS, rank)
    return tuple(box)


def rollout_dim(kind: str) -> int | None:
    return {"vocab": 0, "col": 0, "row": 1}.get(kind)


def rollout_box(shape: tuple, kind: str, k: int) -> tuple:
    box = [(0, s) for s in shape]
    dim = rollout_dim(kind)
    if dim is not None:
        box[dim] = split_bounds(shape[dim], ROLLOUTS, k)
    return tuple(box)


def box_shape(box: tuple) -> tuple:
    return tuple(b - a for a, b in box)


def box_index(box: tuple) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def pattern_chunks(box: tuple, tid: int, version: int, chunk: int = 1 << 20):
    """Expected values over ``box`` in row chunks: (local row start, stop, int32 tensor).

    value[row, col] = ((7 row + 3 col + 11 tid + 13 version) mod 251) - 125: small
    integers, exact in bf16, different for every tensor and version.
    """
    import torch
    (r0, r1) = box[0]
    base = tid * 11 + version * 13
    if len(box) == 2:
        c0, c1 = box[1]
        cols = torch.arange(c0, c1, dtype=torch.int32) * 3
        per = max(1, chunk // max(1, c1 - c0))
    else:
        cols, per = None, chunk
    for s in range(r0, r1, per):
        e = min(r1, s + per)
        v = torch.arange(s, e, dtype=torch.int32) * 7 + base
        if cols is not None:
            v = v[:, None] + cols[None, :]
        v = v.remainder_(251).sub_(125)
        yield s - r0, e - r0, v


# -------------------------------------------------------------- process stats



def run_delay() -> float:
    """Seconds this (main) thread has spent runnable but waiting for a CPU (schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


def mono() -> float:
    return time.monotonic()


# ------------------------------------------------------------------- workers

class Worker:
    """One trainer (rank 0, 1) or rollout (rank 2..5) process of one method."""

    def __init__(self, rank: int, cfg: dict, sync: dict):
        self.rank, self.cfg, self.sync = rank, cfg, sync
        self.method = cfg["method"]
        self.trainer = rank < TRAINERS
        self.k = rank - TRAINERS
        self.store = None
        self.dist = None

    # ------------------------------------------------------------- setup
    def setup(self) -> dict:
        t0 = time.perf_counter()
        import torch
        self.torch = torch
        if self.cfg["threads"]:
            torch.set_num_threads(self.cfg["threads"])
        self.specs = Model(**self.cfg["model"]).tensors()
        bf16 = torch.bfloat16
        if self.trainer:
            self.state = {}
            for _tid, name, shape, kind in self.specs:
                box = trainer_box(shape, kind, self.rank)
                self.state[name] = torch.empty(box_shape(box), dtype=torch.float32)
            self.regen(0)
        else:
            self.boxes = {name: rollout_box(shape, kind, self.k) for _, name, shape, kind in self.specs}
            self.bufs = {}
            for name, box in self.boxes.items():
                b = torch.empty(box_shape(box), dtype=bf16)
                b.zero_()                         # touched: no page faults inside the clock
                self.bufs[name] = b
        m = self.method
        if m == "yrcache":
            from yrcache import TieredStore
            from yrcache.rl import Shard, WeightPublisher, WeightSubscriber
            # As a user's multiprocessing code does: attached by name (as a pickled store
            # attaches), pages mapped on first touch; the first version pays for that.
            self.store = TieredStore.attach(self.cfg["store"], prefault=self.cfg.get("prefault", False))
            if self.trainer:
                self.pub = WeightPublisher(self.store, "policy", rank=self.rank, world=TRAINERS, keep=2)
                self.pub_layout = {name: Shard(0, self.rank, TRAINERS)
                                   for _, name, _, kind in self.specs if kind != "norm"}
            else:
                self.sub = WeightSubscriber(self.store, "policy")
                self.layout = {name: Shard(rollout_dim(kind), self.k, ROLLOUTS)
                               for _, name, _, kind in self.specs if kind != "norm"}
        else:
            self._init_dist()
        import gc
        gc.collect()
        self._gc = {"n": 0, "s": 0.0, "t": 0.0}
        gc.callbacks.append(self._gc_cb)
        info = {"pid": os.getpid(), "rss": U.rss_info(), "threads": torch.get_num_threads(),
                "setup_s": time.perf_counter() - t0}
        if not self.trainer:
            info["slice_bytes"] = sum(b.numel() * b.element_size() for b in self.bufs.values())
        return info

    def _gc_cb(self, phase: str, info: dict) -> None:
        """Count full (generation 2) collections and their CPU time."""
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc["t"] = time.process_time()
        else:
            self._gc["n"] += 1
            self._gc["s"] += time.process_time() - self._gc["t"]

    def _init_dist(self) -> None:
        import datetime
        import torch.distributed as dist
        torch = self.torch
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.cfg['port']}",
                                rank=self.rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=ROUND_TIMEOUT))
        self.dist = dist
        self.bgroup = dist.new_group(BCAST_RANKS)
        bf16 = torch.bfloat16
        # the gathered fp32 halves of trainer rank 1 land in one reused staging buffer
        half1 = max(math.prod(box_shape(trainer_box(s, k, 1))) for _, _, s, k in self.specs if k != "norm")
        if self.method == "gloo":
            cap = self.cfg["bucket_bytes"] // 2
            self.buckets = []                    # [(numel, [(tid, name, shape, kind, offset)])]
            cur, used = [], 0
            for tid, name, shape, kind in self.specs:
                n = math.prod(shape)
                if cur and used + n > cap:
                    self.buckets.append((used, cur))
                    cur, used = [], 0
                cur.append((tid, name, shape, kind, used))
                used += n
            if cur:
                self.buckets.append((used, cur))
            biggest = max(n for n, _ in self.buckets)
            if self.rank == 0:
                self.bucket = torch.zeros(biggest, dtype=bf16)
                self.stage = torch.zeros(half1, dtype=torch.float32)
            elif not self.trainer:
                self.bucket = torch.zeros(biggest, dtype=bf16)
        elif self.rank == 0:                      # save: the full bf16 state dict, preallocated
            self.full = {name: torch.zeros(shape, dtype=bf16) for _, name, shape, _ in self.specs}
            self.stage = torch.zeros(half1, dtype=torch.float32)
        # warm the connections (default group, broadcast group, the 1 -> 0 pair)
        dist.barrier()
        x = torch.zeros(1024)
        if self.rank in BCAST_RANKS:
            dist.broadcast(x, src=0, group=self.bgroup)
        if self.rank == 1:
            dist.send(x, dst=0)
        elif self.rank == 0:
            dist.recv(x, src=1)
        dist.barrier()

    def regen(self, version: int) -> None:
        """The trainer's fp32 halves for ``version`` (outside the clock)."""
        for tid, name, shape, kind in self.specs:
            t = self.state[name]
            for s, e, v in pattern_chunks(trainer_box(shape, kind, self.rank), tid, version):
                t[s:e].copy_(v)

    def prefault(self) -> float:
        """Map every page of the arena now (a long-lived worker, after its first version)."""
        t0 = time.perf_counter()
        if self.store is not None:
            self.store.prefault()
        return time.perf_counter() - t0

    def verify(self, version: int) -> list[str]:
        """Names whose slice differs from the expected bf16 values of ``version``."""
        torch = self.torch
        bad = []
        for tid, name, _shape, _kind in self.specs:
            buf = self.bufs[name]
            for s, e, v in pattern_chunks(self.boxes[name], tid, version):
                if not torch.equal(buf[s:e], v.to(torch.bfloat16)):
                    bad.append(name)
                    break
        return bad[:8]

    # ------------------------------------------------------------- rounds
    def round(self, version: int, profile: bool = False) -> dict:
        sync = self.sync
        try:
            if self.trainer:
                self.regen(version)
            # A full collection in a process that imported torch (~170k objects) costs ~80 ms of
            # CPU; left alone, one lands inside some round's clock of whichever method allocates
            # enough. Collect here, outside the clock, in every process of every method.
            import gc
            gc.collect()
            sync["barrier"].wait(BARRIER_TIMEOUT)
        except BaseException:
            sync["barrier"].abort()
            raise
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        self._mark()            # again by the method, just before it blocks for the release
        gc0 = dict(self._gc)
        out = getattr(self, f"_round_{self.method}_{'trainer' if self.trainer else 'rollout'}")(version)
        ru1, c1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), run_delay()
        ru0, c0, w0 = self._m0
        out["rq_wait_s"] = w1 - w0
        out["gc_full"] = self._gc["n"] - gc0["n"]      # full collections inside the round
        out["gc_full_s"] = self._gc["s"] - gc0["s"]
        # CPU time, page faults and involuntary switches of this process over the round
        out["cpu_s"] = c1 - c0
        out["minflt"] = ru1.ru_minflt - ru0.ru_minflt
        out["nivcsw"] = ru1.ru_nivcsw - ru0.ru_nivcsw
        if prof is not None:
            prof.disable()
            import pstats
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
            s2 = io.StringIO()
            pstats.Stats(prof, stream=s2).sort_stats("tottime").print_stats(15)
            out["profile"] = s.getvalue() + "\n" + s2.getvalue()
        out["rss"] = U.rss_info()
        return out

    def _mark(self) -> None:
        """Start of this process's part of the clocked window: it is about to block until the
        trainers are released (blocked time is neither CPU nor run-queue time)."""
        self._m0 = (resource.getrusage(resource.RUSAGE_SELF), time.process_time(), run_delay())

    # yrcache
    def _round_yrcache_trainer(self, version: int) -> dict:
        self._mark()
        self.sync["go"].wait(ROUND_TIMEOUT)
        t_go = mono()
        visible = self.pub.publish(self.state, version, layout=self.pub_layout, dtype=self.torch.bfloat16)
        t_done = mono()
        return {"t_go": t_go, "t_done": t_done, "completed": visible, "stats": dict(self.pub.last_publish_stats)}

    def _round_yrcache_rollout(self, version: int) -> dict:
        self._mark()
        v = self.sub.wait(newer_than=version - 1, timeout=ROUND_TIMEOUT)
        t_wake = mono()
        ru0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), run_delay()
        self.sub.fetch(v, layout=self.layout, into=self.bufs)
        t_done = mono()
        ru1, c1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), run_delay()
        self.fetch_cpu = {"fetch_cpu_s": c1 - c0, "fetch_rq_wait_s": w1 - w0,
                          "fetch_minflt": ru1.ru_minflt - ru0.ru_minflt,
                          "fetch_nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw}
        if v != version:
            raise RuntimeError(f"rollout {self.k}: wait() returned version {v}, expected {version}")
        return {"t_wake": t_wake, "t_done": t_done, "fetch": dict(self.sub.last_fetch_stats), **self.fetch_cpu}

    # shared by the baselines: trainer rank 0 gets one tensor's full fp32 value as bf16 in `dst`
    def _gather_cast(self, name: str, shape: tuple, kind: str, dst) -> None:
        own = self.state[name]
        if kind == "norm":
            dst.copy_(own)
            return
        n0 = own.shape[0]
        dst[:n0].copy_(own)                                     # cast rank 0's half
        rows1 = shape[0] - n0
        if rows1:
            stage = self.stage[:rows1 * math.prod(shape[1:])].view(rows1, *shape[1:])
            self.dist.recv(stage, src=1)                        # rank 1's fp32 half
            dst[n0:].copy_(stage)                               # cast it

    def _send_halves(self) -> None:
        for _, name, _, kind in self.specs:
            t = self.state[name]
            if kind != "norm" and t.numel():
                self.dist.send(t, dst=0)

    # (a) gloo
    def _round_gloo_trainer(self, version: int) -> dict:
        self._mark()
        self.sync["go"].wait(ROUND_TIMEOUT)
        t_go = mono()
        gather = bcast = 0.0
        if self.rank == 1:
            self._send_halves()
        else:
            for numel, items in self.buckets:
                t = mono()
                flat = self.bucket[:numel]
                for _tid, name, shape, kind, off in items:
                    self._gather_cast(name, shape, kind, flat[off:off + math.prod(shape)].view(shape))
                t1 = mono()
                self.dist.broadcast(flat, src=0, group=self.bgroup)
                gather += t1 - t
                bcast += mono() - t1
        return {"t_go": t_go, "t_done": mono(), "gather_s": gather, "bcast_s": bcast}

    def _round_gloo_rollout(self, version: int) -> dict:
        recv = slicing = 0.0
        received = 0
        self._mark()
        for numel, items in self.buckets:
            t = mono()
            flat = self.bucket[:numel]
            self.dist.broadcast(flat, src=0, group=self.bgroup)
            t1 = mono()
            for _tid, name, shape, _kind, off in items:
                full = flat[off:off + math.prod(shape)].view(shape)
                self.bufs[name].copy_(full[box_index(self.boxes[name])])
            recv += t1 - t
            slicing += mono() - t1
            received += numel * 2
        # recv_s includes the time blocked before the trainers were released; t_recv does not matter
        return {"t_done": mono(), "t_recv": t1, "recv_s": recv, "slice_s": slicing, "bytes_received": received}

    # (b) torch.save + mmap load
    def _path(self, version: int) -> str:
        return f"{self.cfg['shm_prefix']}v{version}.pt"   # RUN_ID differs in a spawned child

    def _round_save_trainer(self, version: int) -> dict:
        self._mark()
        self.sync["go"].wait(ROUND_TIMEOUT)
        t_go = mono()
        if self.rank == 1:
            self._send_halves()
            return {"t_go": t_go, "t_done": mono()}
        for _, name, shape, kind in self.specs:
            self._gather_cast(name, shape, kind, self.full[name])
        t1 = mono()
        path = self._path(version)
        self.torch.save(self.full, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.sync["file_ready"].set()
        t_done = mono()
        return {"t_go": t_go, "t_done": t_done, "gather_s": t1 - t_go, "save_s": t_done - t1,
                "file_bytes": os.path.getsize(path)}

    def _round_save_rollout(self, version: int) -> dict:
        self._mark()
        if not self.sync["file_ready"].wait(ROUND_TIMEOUT):
            raise TimeoutError("the checkpoint file was not announced")
        t_wake = mono()
        sd = self.torch.load(self._path(version), mmap=True, weights_only=True)
        t1 = mono()
        for name, buf in self.bufs.items():
            buf.copy_(sd[name][box_index(self.boxes[name])])
        del sd
        t_done = mono()
        return {"t_wake": t_wake, "t_done": t_done, "load_s": t1 - t_wake, "copy_s": t_done - t1}

    # ------------------------------------------------------------- latency
    def latency(self, n: int, warm: int) -> list[float]:
        """``warm`` + ``n`` tiny publishes (the first ``warm`` are not returned); trainer 0 returns
        when each publish() was called, rollouts when each wait() (or broadcast) returned.
        Called several times, interleaved with the other method's chunks."""
        torch = self.torch
        bar = self.sync["lat_barrier"]
        times = []
        if not hasattr(self, "_lat"):
            self._lat = {"v": 0}
            if self.method == "yrcache":
                from yrcache.rl import WeightPublisher, WeightSubscriber
                if self.trainer:
                    self._lat["pub"] = WeightPublisher(self.store, "latency", rank=0, world=1, keep=2)
                    self._lat["state"] = {"w": torch.randn(1024)}          # 4 KiB of fp32
                else:
                    self._lat["sub"] = WeightSubscriber(self.store, "latency")
            else:
                self._lat["x"] = torch.randn(1024) if self.trainer else torch.zeros(1024)
        L = self._lat
        try:
            for j in range(warm + n):
                L["v"] += 1
                v = L["v"]
                bar.wait(BARRIER_TIMEOUT)
                if self.trainer:
                    time.sleep(LAT_SETTLE_S)                     # the subscribers are asleep by now
                    t = mono()
                    if self.method == "yrcache":
                        L["pub"].publish(L["state"], version=v)
                    else:
                        self.dist.broadcast(L["x"], src=0, group=self.bgroup)
                    L.setdefault("call_s", []).append(mono() - t)   # how long the call itself took
                else:
                    if self.method == "yrcache":
                        got = L["sub"].wait(newer_than=v - 1, timeout=ROUND_TIMEOUT)
                        t = mono()
                        if got != v:
                            raise RuntimeError(f"latency: wait() returned {got}, expected {v}")
                    else:
                        self.dist.broadcast(L["x"], src=0, group=self.bgroup)
                        t = mono()
                if j >= warm:
                    times.append(t)
        except BaseException:
            bar.abort()
            raise
        if self.trainer:
            return times, L["call_s"][-n:]
        return times

    def rss(self) -> dict:
        return U.rss_info()

    def close(self) -> None:
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


def _worker_main(rank: int, cfg: dict, sync: dict, conn) -> None:
    w = Worker(rank, cfg, sync)
    U.serve(conn, {"setup": w.setup, "round": w.round, "verify": w.verify, "latency": w.latency,
                   "rss": w.rss, "prefault": w.prefault}, w.close)


def _owner_main(name: str, dram: int, huge_pages: bool, conn) -> None:
    """Creates (pre-faults) and owns the store, so that the main process stays small."""
    from yrcache import TieredStore
    U.child_init()
    try:
        t0 = time.perf_counter()
        store = TieredStore(name=name, dram=dram, huge_pages=huge_pages)
        created_s = time.perf_counter() - t0
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return

    def stats():
        return store.stats()

    def destroy():
        store.destroy()

    conn.send(("ready", {"created_s": created_s}))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "quit":
                break
            try:
                conn.send(("ok", {"stats": stats, "destroy": destroy}[msg[0]]()))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    finally:
        try:
            store.destroy()
        except Exception:
            pass


# ------------------------------------------------------------- main process

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(children: list, timeout: float = ROUND_TIMEOUT) -> list:
    """The replies of ``children`` to a request sent to all; fails fast on an error or a death."""
    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    while len(out) < len(children):
        pending = {c.conn: i for i, c in enumerate(children) if i not in out}
        for conn in mp_wait(list(pending), timeout=0.5):
            i = pending[conn]
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"{children[i].name} closed its pipe (exit code "
                                   f"{children[i].proc.exitcode})") from None
            if reply[0] == "err":
                raise RuntimeError(f"{children[i].name} failed:\n{reply[1]}")
            out[i] = reply[1]
        for i, c in enumerate(children):
            if i not in out and not c.proc.is_alive() and not c.conn.poll():
                raise RuntimeError(f"{c.name} (pid {c.proc.pid}) died with exit code {c.proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reply within {timeout:.0f} s from "
                               f"{[children[i].name for i in range(len(children)) if i not in out]}")
    return [out[i] for i in range(len(children))]


def call_all(children: list, *msg, timeout: float = ROUND_TIMEOUT) -> list:
    for c in children:
        c.conn.send(msg)
    return collect(children, timeout)


def remove_shm_files() -> None:
    d, prefix = os.path.dirname(SHM_PREFIX), os.path.basename(SHM_PREFIX)
    for f in os.listdir(d):
        if f.startswith(prefix):
            try:
                os.unlink(os.path.join(d, f))
            except FileNotFoundError:
                pass


def cpu_of(pids: list[int]) -> float:
    """CPU seconds used so far by ``pids`` (all threads) and by this process."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick     # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return total


def run_round(workers: list, sync: dict, version: int, profile: bool = False, others: tuple = ()) -> dict:
    sync["go"].clear()
    sync["file_ready"].clear()
    for w in workers:
        w.conn.send(("round", version, profile))
    try:
        sync["barrier"].wait(BARRIER_TIMEOUT)
    except threading.BrokenBarrierError:
        collect(workers, 30)        # raises the worker's error
        raise RuntimeError("the start barrier broke") from None
    time.sleep(SETTLE_S)
    pids = [w.proc.pid for w in workers] + [c.proc.pid for c in others]
    busy0, ours0 = U.ForeignLoad._machine_busy(), cpu_of(pids)
    t0 = mono()
    sync["go"].set()
    replies = collect(workers)
    t1 = mono()
    busy1, ours1 = U.ForeignLoad._machine_busy(), cpu_of(pids)
    trainers, rollouts = replies[:TRAINERS], replies[TRAINERS:]
    foreign = None
    if busy0 is not None and busy1 is not None:
        foreign = max(0.0, (busy1 - busy0) - (ours1 - ours0))   # CPU-seconds of other processes
    return {"t0": t0, "seconds": max(r["t_done"] for r in rollouts) - t0,
            "window_s": t1 - t0, "foreign_cpu_s": foreign, "trainers": trainers, "rollouts": rollouts}


class Group:
    """The processes of one method: 2 trainers + 4 rollouts (+ the store owner for yrcache)."""

    def __init__(self, method: str, args, model: Model, cleanup: U.Cleanup, res: dict, tag: str = ""):
        self.method, self.args = method, args
        ctx = mp.get_context("spawn")
        self.sync = {"barrier": ctx.Barrier(WORLD + 1), "go": ctx.Event(), "file_ready": ctx.Event(),
                     "lat_barrier": ctx.Barrier(1 + ROLLOUTS)}
        self.out = res.setdefault(method, {"rounds": []})
        self.version = 0
        self.owner = None
        self.workers: list = []
        cfg = {"method": method, "model": asdict(model), "threads": args.threads,
               "bucket_bytes": args.bucket_mib * MiB, "store": None, "port": None, "shm_prefix": SHM_PREFIX,
               "prefault": args.prefault}
        if method == "yrcache":
            cfg["store"] = f"ybench-rl-{RUN_ID}{tag}"
            dram = int(args.dram_factor * model.numel() * 2) + 64 * MiB   # keep=2 + one in flight + slack
            cleanup.add(f"destroy store {cfg['store']}", functools.partial(U.destroy_store, cfg["store"]))
            log(f"{method}: creating a {dram / GiB:.2f} GiB store in an owner process (pre-faulted)")
            self.owner = U.Child(functools.partial(_owner_main, cfg["store"], dram, args.huge_pages), "store-owner", cleanup)
            if self.owner.ready[0] != "ready":
                raise RuntimeError(f"the store owner failed:\n{self.owner.ready[1]}")
            self.out["store_dram"] = dram
            self.out["store_created_s"] = self.owner.ready[1]["created_s"]
        else:
            cfg["port"] = free_port()
        log(f"{method}: spawning {TRAINERS} trainers + {ROLLOUTS} rollouts")
        for r in range(WORLD):
            role = f"trainer{r}" if r < TRAINERS else f"rollout{r - TRAINERS}"
            self.workers.append(U.Child(functools.partial(_worker_main, r, cfg, self.sync),
                                        f"{method}-{role}", cleanup))

    def setup(self) -> None:
        setup = call_all(self.workers, "setup")
        self.out["setup"] = setup
        log(f"{self.method}: all processes ready (setup {max(s['setup_s'] for s in setup):.1f} s)")

    def round(self, timed: bool, profile: bool = False) -> dict:
        self.version += 1
        v = self.version
        r = run_round(self.workers, self.sync, v, profile,
                      others=(self.owner,) if self.owner is not None else ())
        r["timed"], r["version"] = timed, v
        bad = call_all(self.workers[TRAINERS:], "verify", v)
        if any(bad):
            raise RuntimeError(f"{self.method} v{v}: wrong slices: {bad}")
        if self.method == "save":
            try:
                os.unlink(f"{SHM_PREFIX}v{v}.pt")
            except FileNotFoundError:
                pass
        if not profile:
            self.out["rounds"].append(r)
        if v == 1 and self.method == "yrcache":
            self.out["first"] = r     # the first version: every process's first touch of the arena
            # ...then a long-lived worker maps the whole arena once (what attach(prefault=True)
            # does up front), so that the timed rounds are warm.
            self.out["prefault_s"] = call_all(self.workers, "prefault")
        log(f"{self.method}: round {v} ({'profiled' if profile else 'timed' if timed else 'warm-up'}): "
            f"{r['seconds'] * 1e3:.1f} ms, slices verified")
        return r

    def latency(self, n: int, warm: int) -> None:
        times = call_all([self.workers[0]] + self.workers[TRAINERS:], "latency", n, warm)
        (t_pub, call_s), subs = times[0], times[1:]
        lat = self.out.setdefault("latency", [[] for _ in range(ROLLOUTS)])
        for k, t in enumerate(subs):
            lat[k].extend(t[i] - t_pub[i] for i in range(n))
        self.out.setdefault("latency_call_s", []).extend(call_s)

    def close(self) -> None:
        U.stop_children(self.workers, 3.0)
        if self.owner is not None:
            try:
                self.out["store_stats"] = self.owner.call("stats", timeout=30)
                self.owner.call("destroy", timeout=30)
            except Exception as e:
                log(f"store destroy: {e}")
            self.owner.close()
        if self.method == "save":
            remove_shm_files()


def run_all(methods: list[str], args, model: Model, cleanup: U.Cleanup, res: dict) -> None:
    """All methods' processes coexist; their rounds are interleaved (the order rotates), so that
    the load of other work on the machine falls on every method alike."""
    groups: dict[str, Group] = {}
    try:
        for m in methods:
            groups[m] = Group(m, args, model, cleanup, res)
        for g in groups.values():
            g.setup()
        order = list(groups.values())
        for i in range(args.warmup + args.reps):
            k = i % len(order)
            for g in order[k:] + order[:k]:
                g.round(timed=i >= args.warmup)
        for g in order:
            g.out["rss"] = call_all(g.workers, "rss")      # before the latency runs
        lat = [g for g in order if g.method in ("yrcache", "gloo")]
        if lat:
            chunks = max(1, args.latency_n // 10)
            for c in range(chunks):
                n = args.latency_n // chunks + (1 if c < args.latency_n % chunks else 0)
                for g in (lat if c % 2 == 0 else lat[::-1]):
                    g.latency(n, LAT_WARMUP if c == 0 else 1)
            for g in lat:
                flat = [x for s in g.out["latency"] for x in s]
                log(f"{g.method}: publish -> wake median {U.median(flat) * 1e3:.3f} ms over {len(flat)}")
        if "yrcache" in groups:
            cold_starts(args, model, cleanup, res)
        if "yrcache" in groups and args.profile:
            res["yrcache"]["profiled_round"] = groups["yrcache"].round(timed=False, profile=True)
    finally:
        for g in groups.values():
            g.close()


def cold_starts(args, model: Model, cleanup: U.Cleanup, res: dict) -> None:
    """The first version of ``--cold-starts`` - 1 more fresh yrcache sets (new processes attached
    by name to a new store, no prefault), one after the other while the other methods' processes
    still exist, as they did for the first set: one cold sample is one noisy round."""
    firsts = res["yrcache"].setdefault("firsts", [res["yrcache"]["first"]["seconds"]])
    for i in range(1, args.cold_starts):
        scratch: dict = {}
        g = Group("yrcache", args, model, cleanup, scratch, tag=f"-cold{i}")
        try:
            g.setup()
            g.round(timed=False)
            firsts.append(scratch["yrcache"]["first"]["seconds"])
        finally:
            g.close()


# ------------------------------------------------------------------- report

def med(xs) -> float:
    return U.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x >= 0.01 else f"{x * 1e3:.3f} ms"


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < GiB else f"{n / GiB:.2f} GiB"


def timed(res: dict, method: str) -> list[dict]:
    return [r for r in res.get(method, {}).get("rounds", []) if r["timed"]]


def peak_rss(res: dict, method: str) -> tuple[int, dict] | None:
    rs = res.get(method, {}).get("rss")
    if not rs:
        return None
    rollouts = rs[TRAINERS:]
    i = max(range(len(rollouts)), key=lambda j: rollouts[j]["ru_maxrss"])
    return rollouts[i]["ru_maxrss"], rollouts[i]


def build_rows(res: dict, model: Model, size_desc: str) -> list[dict]:
    rows: list[dict] = []

    def row(workload, yr, base, ratio, target="", ok=None, **raw):
        rows.append({"workload": workload, "yrcache": yr, "baseline": base, "ratio": ratio,
                     "target": target, "ok": ok, **raw})

    yr = [r["seconds"] for r in timed(res, "yrcache")]
    yr_med = med(yr)
    for m in ("gloo", "save"):
        b = [r["seconds"] for r in timed(res, m)]
        if not yr or not b:
            continue
        ratio = med(b) / yr_med
        row(f"sync {size_desc} vs {LABEL[m]}",
            f"{ms(yr_med)} (runs {', '.join(f'{x * 1e3:.0f}' for x in yr)})",
            f"{ms(med(b))} (runs {', '.join(f'{x * 1e3:.0f}' for x in b)})",
            ratio, f"ratio >= {SYNC_TARGET[m]:g}x", ratio >= SYNC_TARGET[m],
            yr_s=yr, base_s=b)

    firsts = res.get("yrcache", {}).get("firsts") or (
        [res["yrcache"]["first"]["seconds"]] if res.get("yrcache", {}).get("first") else [])
    if yr and firsts:
        ratio = med(firsts) / yr_med
        row(f"first version (processes attached by name, no prefault), median of {len(firsts)} fresh "
            "sets, vs the warm median", f"{ms(med(firsts))} (runs {', '.join(f'{x * 1e3:.0f}' for x in firsts)})",
            ms(yr_med), ratio, f"ratio <= {FIRST_TARGET:g}x", ratio <= FIRST_TARGET, first_s=firsts)

    if yr:
        copied = needed = 0
        ours = 0
        for r in timed(res, "yrcache"):
            for ro in r["rollouts"]:
                copied += ro["fetch"]["bytes_copied"]
                needed += ro["fetch"]["bytes_needed"]
        reps = len(timed(res, "yrcache"))
        ours = reps * sum(s.get("slice_bytes", 0) for s in res["yrcache"]["setup"])
        amp = copied / needed if needed else float("nan")
        amp_ours = copied / ours if ours else float("nan")
        g = timed(res, "gloo")
        base, bamp = "n/a", None
        if g:
            rec = sum(ro["bytes_received"] for r in g for ro in r["rollouts"])
            bamp = rec / (len(g) * sum(s.get("slice_bytes", 0) for s in res["gloo"]["setup"]))
            base = f"{bamp:.3f} (gloo: whole buckets received)"
        row("read amplification, 4 rollouts (bytes copied / bytes needed)",
            f"{amp:.3f} ({fmt_bytes(copied / reps)} / {fmt_bytes(needed / reps)} per round; "
            f"vs own slice sizes {amp_ours:.3f})", base,
            (bamp / amp) if bamp else None, f"<= {AMP_TARGET}", amp <= AMP_TARGET and amp_ours <= AMP_TARGET,
            bytes_copied=copied, bytes_needed=needed, slice_bytes=ours)

    lat = res.get("yrcache", {}).get("latency")
    if lat:
        flat = [x for s in lat for x in s]
        worst = [max(s[i] for s in lat) for i in range(len(lat[0]))]
        yl = med(flat)
        base, ratio = "n/a", None
        gl = res.get("gloo", {}).get("latency")
        if gl:
            gflat = [x for s in gl for x in s]
            base = f"{ms(med(gflat))} (p90 {ms(U.percentile(gflat, 90))}; gloo broadcast 4 KiB)"
            ratio = med(gflat) / yl
        row(f"publish -> wait() returns, 4 KiB, median of {len(lat[0])} x {len(lat)} subscribers",
            f"{ms(yl)} (p90 {ms(U.percentile(flat, 90))}, slowest sub med {ms(med(worst))}, "
            f"publish() itself {ms(med(res['yrcache'].get('latency_call_s', [float('nan')])))})", base,
            ratio, f"median <= {LAT_TARGET_S * 1e3:g} ms", yl <= LAT_TARGET_S,
            yr_lat_s=flat)

    py = peak_rss(res, "yrcache")
    if py:
        slice_b = max(s.get("slice_bytes", 0) for s in res["yrcache"]["setup"])
        for m in ("gloo", "save"):
            pb = peak_rss(res, m)
            if not pb:
                continue
            row(f"peak RSS of a rollout (max of 4; own slice {fmt_bytes(slice_b)}) vs {m}",
                f"{fmt_bytes(py[0])} (now: anon {fmt_bytes(py[1].get('RssAnon', 0))}, "
                f"shmem {fmt_bytes(py[1].get('RssShmem', 0))})",
                f"{fmt_bytes(pb[0])} (now: anon {fmt_bytes(pb[1].get('RssAnon', 0))}, "
                f"shmem {fmt_bytes(pb[1].get('RssShmem', 0))})",
                pb[0] / py[0], yr_rss=py[1], base_rss=pb[1])
    return rows


def breakdown(res: dict) -> str:
    """Median per phase over the timed rounds, in ms from the release of the trainers."""
    lines = []

    def m(f, rounds):
        vals = [f(r) for r in rounds]
        return f"{med(vals) * 1e3:.1f}"

    R = timed(res, "yrcache")
    if R:
        lines.append(
            "yrcache: publish done rank0 +" + m(lambda r: r["trainers"][0]["t_done"] - r["t0"], R)
            + " / rank1 +" + m(lambda r: r["trainers"][1]["t_done"] - r["t0"], R)
            + "; rollouts woke +" + m(lambda r: min(x["t_wake"] for x in r["rollouts"]) - r["t0"], R)
            + "..+" + m(lambda r: max(x["t_wake"] for x in r["rollouts"]) - r["t0"], R)
            + "; fetch each " + "/".join(m(lambda r, k=k: r["rollouts"][k]["t_done"] - r["rollouts"][k]["t_wake"], R)
                                         for k in range(ROLLOUTS))
            + " (fetch's own 'seconds' " + "/".join(m(lambda r, k=k: r["rollouts"][k]["fetch"]["seconds"], R)
                                                    for k in range(ROLLOUTS))
            + "); all done +" + m(lambda r: r["seconds"], R))
        lines.append("         publish 'seconds' rank0/rank1 " + m(lambda r: r["trainers"][0]["stats"]["seconds"], R)
                     + "/" + m(lambda r: r["trainers"][1]["stats"]["seconds"], R)
                     + f"; bytes written per rank {fmt_bytes(R[0]['trainers'][0]['stats']['bytes_written'])}")
    G = timed(res, "gloo")
    if G:
        lines.append(
            "gloo:    rank1 sends done +" + m(lambda r: r["trainers"][1]["t_done"] - r["t0"], G)
            + "; rank0 gather+cast " + m(lambda r: r["trainers"][0]["gather_s"], G)
            + ", broadcast " + m(lambda r: r["trainers"][0]["bcast_s"], G)
            + "; rollouts got the last bucket +" + "/".join(m(lambda r, k=k: r["rollouts"][k]["t_recv"] - r["t0"], G)
                                                             for k in range(ROLLOUTS))
            + ", slice copies " + "/".join(m(lambda r, k=k: r["rollouts"][k]["slice_s"], G) for k in range(ROLLOUTS))
            + "; all done +" + m(lambda r: r["seconds"], G))
    S = timed(res, "save")
    if S:
        lines.append(
            "save:    rank0 gather+cast " + m(lambda r: r["trainers"][0]["gather_s"], S)
            + ", torch.save " + m(lambda r: r["trainers"][0]["save_s"], S)
            + f" ({fmt_bytes(S[0]['trainers'][0]['file_bytes'])})"
            + "; rollouts saw the file +" + "/".join(m(lambda r, k=k: r["rollouts"][k]["t_wake"] - r["t0"], S)
                                                     for k in range(ROLLOUTS))
            + ", load " + "/".join(m(lambda r, k=k: r["rollouts"][k]["load_s"], S) for k in range(ROLLOUTS))
            + ", copy " + "/".join(m(lambda r, k=k: r["rollouts"][k]["copy_s"], S) for k in range(ROLLOUTS))
            + "; all done +" + m(lambda r: r["seconds"], S))
    for meth, rounds in (("yrcache", R), ("gloo", G), ("save", S)):
        if rounds:
            lines.append(f"cpu {meth:7}: CPU ms during the round t0/t1/r0..r3 "
                         + "/".join(m(lambda r, i=i: (r["trainers"] + r["rollouts"])[i]["cpu_s"], rounds)
                                    for i in range(WORLD))
                         + "; waiting for a CPU " + "/".join(
                             m(lambda r, i=i: (r["trainers"] + r["rollouts"])[i]["rq_wait_s"], rounds)
                             for i in range(WORLD))
                         + "; minor faults " + "/".join(
                             f"{med([(r['trainers'] + r['rollouts'])[i]['minflt'] for r in rounds]):.0f}"
                             for i in range(WORLD))
                         + "; full GCs in the clock " + str(sum((r["trainers"] + r["rollouts"])[i].get("gc_full", 0)
                                                                for r in rounds for i in range(WORLD)))
                         + "; involuntary switches " + "/".join(
                             f"{med([(r['trainers'] + r['rollouts'])[i]['nivcsw'] for r in rounds]):.0f}"
                             for i in range(WORLD)))
    if R:
        lines.append("yrcache fetch only, r0..r3: CPU ms " + "/".join(
            m(lambda r, k=k: r["rollouts"][k]["fetch_cpu_s"], R) for k in range(ROLLOUTS))
            + ", waiting for a CPU " + "/".join(m(lambda r, k=k: r["rollouts"][k]["fetch_rq_wait_s"], R)
                                                for k in range(ROLLOUTS))
            + ", minor faults " + "/".join(f"{med([r['rollouts'][k]['fetch_minflt'] for r in R]):.0f}"
                                           for k in range(ROLLOUTS)))
    for meth, rounds in (("gloo", G), ("save", S)):
        if R and rounds:
            pr = [b["seconds"] / y["seconds"] for y, b in zip(R, rounds, strict=False)]
            lines.append(f"paired per-round ratios {meth}/yrcache (rounds run back to back): "
                         + ", ".join(f"{x:.2f}" for x in pr) + f"; median {med(pr):.2f}")
    fl = []
    for meth, rounds in (("yrcache", R), ("gloo", G), ("save", S)):
        ok = [r for r in rounds if r.get("foreign_cpu_s") is not None]
        if ok:
            fl.append(f"{meth} {sum(r['foreign_cpu_s'] for r in ok) / sum(r['window_s'] for r in ok):.2f}")
    if fl:
        lines.append(f"other processes' load inside the clocked windows (CPUs of {os.cpu_count()}, "
                     "10 ms tick resolution): " + ", ".join(fl))
    cold = []
    for meth in METHODS:
        w = [r for r in res.get(meth, {}).get("rounds", []) if not r["timed"]]
        if w:
            cold.append(f"{meth} " + ", ".join(f"{x['seconds'] * 1e3:.0f}" for x in w) + " ms")
    if cold:
        lines.append("warm-up (untimed) rounds: " + "; ".join(cold))
    for meth in METHODS:
        rs = res.get(meth, {}).get("rss")
        if rs:
            lines.append(f"rss {meth:7}: " + "; ".join(
                f"{'t' if i < TRAINERS else 'r'}{i if i < TRAINERS else i - TRAINERS} peak "
                f"{x['ru_maxrss'] / MiB:.0f} (HWM {x.get('VmHWM', 0) / MiB:.0f}, anon {x.get('RssAnon', 0) / MiB:.0f}, "
                f"shmem {x.get('RssShmem', 0) / MiB:.0f}, ready-peak "
                f"{res[meth]['setup'][i]['rss']['ru_maxrss'] / MiB:.0f})" for i, x in enumerate(rs)) + " MiB")
    return "\n".join(lines)


NOTES = """\
ratio = baseline / yrcache (time, bytes or RSS); > 1 means yrcache is better. Sync times: median of
{reps} timed rounds after {warmup} untimed warm-up rounds; each method has its own 6 processes, and the
methods' rounds are interleaved. Clock: from the release of the trainers (barrier passed, all 6
processes blocked in their wait/recv, a full GC done in each beforehand) to the last rollout holding
its slice; every round's slices are verified element by element afterwards (outside the clock).
read amplification: sum of last_fetch_stats bytes_copied / bytes_needed over the 4 rollouts (and
bytes_copied / the sizes of the preallocated slice buffers, computed here independently).
latency: trainer rank 0 publishes a 4 KiB fp32 state dict (world=1) {lat_n} times after all 4
subscribers are blocked in wait() ({settle:g} ms settle); each sample is wait() returned - publish()
called, both time.monotonic() in different processes. Baseline: dist.broadcast of 4 KiB in the
broadcast group (root called -> receiver returned); the two run in alternating chunks of ~10.
peak RSS: getrusage(RUSAGE_SELF).ru_maxrss after the timed rounds (max over the 4 rollouts);
touched pages of the yrcache arena / the mmap'd checkpoint count in it (see 'shmem' above).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~64 MiB model instead of 512 MiB")
    ap.add_argument("--size-mib", type=float, default=None, help="fp32 master weights, MiB (default 512; 64 with --quick)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per method (default 5)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed rounds per method first (default 4: a process attached to the yrcache "
                         "arena first-touches its pages during the first versions; shown in the report)")
    ap.add_argument("--bucket-mib", type=int, default=256, help="gloo broadcast bucket, MiB of bf16 (default 256)")
    ap.add_argument("--latency-n", type=int, default=50, help="publishes for the latency median (default 50)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // WORLD),
                    help="torch.set_num_threads in every process (default: CPUs // 6, at least 1; "
                         "0 keeps torch's default, which oversubscribes the CPUs 6 processes share)")
    ap.add_argument("--dram-factor", type=float, default=4.0,
                    help="yrcache arena size in bf16 versions (default 4: keep=2, one in flight, slack)")
    ap.add_argument("--methods", default=",".join(METHODS), help="subset of yrcache,gloo,save")
    ap.add_argument("--cold-starts", type=int, default=3,
                    help="fresh yrcache process sets whose first version is timed (default 3; the row "
                         "takes their median: one cold round is one noisy sample)")
    ap.add_argument("--prefault", action="store_true",
                    help="yrcache workers attach with prefault=True (default: as a pickled store attaches, "
                         "pages mapped on first touch)")
    ap.add_argument("--huge-pages", action="store_true",
                    help="create the store with huge_pages=True (takes effect where /dev/shm is mounted "
                         "with huge=advise: `mount -o remount,huge=advise /dev/shm`)")
    ap.add_argument("--profile", action="store_true",
                    help="one extra yrcache round under cProfile (trainer 0 and rollout 0 printed)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure and raw sample to this JSON file")
    args = ap.parse_args(argv)
    size = args.size_mib if args.size_mib is not None else (64 if args.quick else 512)
    model = Model.for_size(size)
    methods = [m for m in args.methods.split(",") if m]
    if not set(methods) <= set(METHODS) or args.reps < 1 or args.cold_starts < 1:
        ap.error(f"--methods must name some of {METHODS}; --reps >= 1; --cold-starts >= 1")
    U.raise_keyboard_interrupt_on_sigterm()
    U.untrack_shared_memory()

    fp32 = model.numel() * 4
    size_desc = f"{fp32 / MiB:.0f} MiB fp32 -> bf16, {TRAINERS} -> {ROLLOUTS} ranks"
    env = U.environment()
    print("# yrcache RL weight-sync benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    ntensors = len(model.tensors())
    print(f"- {'model'.ljust(9)} : d={model.d} ff={model.ff} vocab={model.vocab} layers={model.layers}: "
          f"{ntensors} tensors, {fp32 / MiB:.1f} MiB fp32 ({fp32 // 2 / MiB:.1f} MiB bf16)")
    print(f"- {'layout'.ljust(9)} : trainers {TRAINERS} x FSDP dim-0 halves; rollouts {ROLLOUTS} x TP "
          f"(embed/q/k/v/gate/up dim 0, o/down dim 1, norms whole); gloo bucket {args.bucket_mib} MiB")
    print(f"- {'threads'.ljust(9)} : torch.set_num_threads({args.threads}) in each of the {WORLD} processes"
          if args.threads else f"- {'threads'.ljust(9)} : torch's default in each of the {WORLD} processes")
    print(flush=True)

    res: dict = {}
    foreign = U.ForeignLoad()
    cleanup = U.Cleanup()
    cleanup.add("remove /dev/shm checkpoint files", remove_shm_files)
    interrupted, error = False, None
    t_start = time.monotonic()
    try:
        run_all(methods, args, model, cleanup, res)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up and reporting what was measured")
    except Exception as e:
        error = traceback.format_exc()
        log(f"error: {type(e).__name__}: {e}")
    finally:
        cleanup.run()

    threads = next((s["threads"] for m in methods for s in res.get(m, {}).get("setup", [])), "?")
    rows = build_rows(res, model, size_desc)
    print(U.render(rows))
    print()
    print("where the time goes (median ms over the timed rounds; + = since the trainers were released):")
    print(breakdown(res))
    print(f"torch threads per process (as reported by the workers): {threads}")
    print()
    print(NOTES.format(reps=args.reps, warmup=args.warmup, lat_n=args.latency_n, settle=LAT_SETTLE_S * 1e3))
    pr = res.get("yrcache", {}).get("profiled_round")
    if pr:
        print(f"## cProfile of one extra yrcache round ({pr['seconds'] * 1e3:.1f} ms)\n")
        print("### trainer 0 (publish)\n" + pr["trainers"][0].get("profile", ""))
        print("### rollout 0 (wait + fetch)\n" + pr["rollouts"][0].get("profile", ""))
    fc = foreign.cpus()
    end_load = U.print_footer(env, rows, fc, t_start, interrupted, error)
    if args.json:
        doc = {"env": env, "model": asdict(model), "args": vars(args), "loadavg_end": end_load,
               "foreign_cpus": fc, "rows": rows, "raw": res, "interrupted": interrupted, "error": error}
        U.write_json(args.json, doc)
    return 130 if interrupted else (1 if error else 0)


if __name__ == "__main__":
    sys.exit(main())
