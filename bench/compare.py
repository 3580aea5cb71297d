#!/usr/bin/env python
"""yrcache side by side with what a user would pick instead, on the same workloads, in one run.

    python bench/compare.py [--quick] [--peers yrcache,redis,...] [--json OUT] [--out-dir DIR]

Peers (each skipped with a one-line message when it is not installed or does not start):

* ``yrcache``: one ``TieredStore`` (DRAM arena, pre-faulted before any clock); other
  processes ``TieredStore.attach`` it by name.
* ``redis``: a ``redis-server`` this script starts on a free 127.0.0.1 port, persistence off
  (``--save '' --appendonly no``), spoken to with redis-py over TCP; values are the raw bytes
  of the array (the reader is told dtype and shape: the least work Redis can be given).
* ``ray``: ``ray.init(num_cpus=<CPUs>)``, local only; ``ray.put`` / ``ray.get``; the other
  processes are Ray actors (``num_cpus=0``), which receive ``ObjectRef`` s from the driver.
* ``vineyard``: the ``vineyardd`` shipped with ``pip install vineyard``, on a unix socket in a
  temporary directory (``--meta=local --rpc=false``); ``client.put`` / ``client.get`` by ObjectID.
* ``shared_memory``: ``multiprocessing.shared_memory`` + pickle (protocol 5, in band): one
  named segment per object; get = open by name + ``pickle.loads`` (a copy) + close.
* ``diskcache``: ``diskcache.Cache`` in a temporary directory on the local disk; values are
  pickled by diskcache (large ones in files).
* ``torch_mp``: ``torch.multiprocessing`` ``SimpleQueue`` s, tensors shared through file
  descriptors (the default strategy on Linux): a put moves the tensor's storage into shared
  memory (one copy) and sends its fd; a get receives the fd and maps it (zero-copy).  A queue,
  not a store: every get consumes one put.

Workloads (``time.perf_counter_ns``; process start-up, server start, store creation and
connecting are outside every clock).  Peers are interleaved: every repetition runs each peer
once, in an order that rotates, so that load from other work on the machine falls on all alike.

* put / get of 1 KiB, 1 MiB, 64 MiB float64 arrays in one process: a sample puts ``inner``
  fresh keys then gets them (each get drops the previous value); keys are deleted outside the clock.
* get from a second process: the main process puts the value, a spawned process (a Ray actor
  for Ray) gets it repeatedly, one clock per get, dropping the value after each.
* 1 KiB ops/s in one process: distinct keys put for a time budget, then got (queues alternate
  batches of puts and gets, the pipe holds only so many).
* weight sync 2 -> 4 of a ~256 MiB fp32 state (16 tensors of 4096 x 1024): 2 trainer processes
  hold dim-0 halves, 4 readers each need a dim-1 quarter of every tensor in their own buffers.
  The clock runs from the driver releasing the trainers to the last reader done; the driver
  relays "version v is ready" to the readers for every peer (yrcache's own ``wait`` is not used).
  yrcache: ``WeightPublisher.publish(layout=Shard(0, r, 2))`` / ``WeightSubscriber.fetch(
  layout=Shard(1, k, 4), into=buffers)``.  Every other peer: each trainer puts each of its
  halves, every reader gets every half of every tensor and copies its columns into its
  buffers; the version two back is deleted by the trainer that wrote it (keep=2, as yrcache).

Medians over all samples; ``--json OUT`` keeps every raw sample.  Plots (matplotlib, log scale)
go to ``--out-dir`` (default ``docs/img``; with ``--quick`` only when ``--out-dir`` is given).
The script exits 0 unless a peer that started failed during the run (1) or it was interrupted.
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import _util as U  # noqa: E402  (bench/_util.py, importable in spawned children and Ray actors)

KiB, MiB, GiB = U.KiB, U.MiB, U.GiB
pc = time.perf_counter_ns
RUN_ID = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
ALL_PEERS = ("yrcache", "redis", "ray", "vineyard", "shared_memory", "diskcache", "torch_mp")
TRAINERS, READERS = 2, 4
WORKERS = TRAINERS + READERS
RGET_WORKER = TRAINERS          # the reader that also serves "get from a second process"
KEEP = 2                        # weight-sync versions kept readable (yrcache's keep=2)

U.untrack_shared_memory()       # shared_memory segments are unlinked by this script

LABEL = {"yrcache": "yrcache", "redis": "Redis", "ray": "Ray object store", "vineyard": "vineyard",
         "shared_memory": "shared_memory+pickle", "diskcache": "diskcache", "torch_mp": "torch.mp queue"}

RETURNS = {
    "yrcache": "read-only ndarray over the shared arena (zero-copy)",
    "redis": "bytes received over TCP (a copy), wrapped by np.frombuffer",
    "ray": "read-only ndarray over the plasma store (zero-copy) from 100 KiB; smaller objects are "
           "inlined and deserialized (a copy)",
    "vineyard": "read-only ndarray over vineyardd's shared memory (zero-copy)",
    "shared_memory": "pickle.loads from the segment (a copy)",
    "diskcache": "unpickled from SQLite / a file in the page cache (a copy)",
    "torch_mp": "a tensor mapping the sender's shared storage (zero-copy); the get consumes the item",
}

WS_METHOD = {
    "yrcache": "WeightPublisher.publish (one copy into the arena) / WeightSubscriber.fetch into the "
               "reader's buffers (copies only the reader's columns)",
    "redis": "SET of each half's raw bytes / GET of every half (the whole 256 MiB per reader) + "
             "column copy; old versions DEL'd",
    "ray": "ray.put of each half in the trainer actor, ObjectRefs returned through the driver / "
           "ray.get of every half in the reader actor (zero-copy) + column copy; old refs dropped",
    "vineyard": "client.put of each half, ObjectIDs through the driver / client.get of every half "
                "(zero-copy) + column copy; old versions deleted",
    "shared_memory": "one pickled segment per half / open + pickle.loads of every half (a copy) + "
                     "column copy; old segments unlinked",
    "diskcache": "cache.set of each half / cache.get of every half (a copy) + column copy; old keys "
                 "deleted",
    "torch_mp": "each trainer sends each half tensor to every reader's queue (the storage moves to "
                "shared memory once) / each reader receives every half (fd, zero-copy) + column copy",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- config

@dataclass
class Config:
    quick: bool
    sizes: list = field(default_factory=list)
    reps: int = 7
    inner: dict = field(default_factory=dict)
    rget_reps: int = 5
    rget_batch: dict = field(default_factory=dict)
    rget_warm: int = 5
    ops_rounds: int = 5
    ops_budget_s: float = 0.4
    ops_max: int = 100_000
    ops_batch: int = 1000
    ws_tensors: int = 16
    ws_shape: tuple = (4096, 1024)
    ws_rounds: int = 5
    ws_warmup: int = 1
    dram: int = 1536 * MiB
    ray_store: int = 2 * GiB
    vineyard_size: str = "2Gi"

    @classmethod
    def make(cls, quick: bool) -> "Config":
        c = cls(quick=quick)
        if quick:
            c.sizes = [1 * KiB, 1 * MiB]
            c.reps, c.inner = 3, {1 * KiB: 20, 1 * MiB: 2}
            c.rget_reps, c.rget_batch, c.rget_warm = 2, {1 * KiB: 20, 1 * MiB: 5}, 2
            c.ops_rounds, c.ops_budget_s, c.ops_max = 2, 0.05, 5000
            c.ws_tensors, c.ws_shape, c.ws_rounds = 4, (256, 512), 2
            c.dram, c.ray_store, c.vineyard_size = 192 * MiB, 256 * MiB, "512Mi"
        else:
            c.sizes = [1 * KiB, 1 * MiB, 64 * MiB]
            c.inner = {1 * KiB: 100, 1 * MiB: 8, 64 * MiB: 1}
            c.rget_batch = {1 * KiB: 100, 1 * MiB: 30, 64 * MiB: 3}
        return c

    @property
    def ws_bytes(self) -> int:
        return self.ws_tensors * self.ws_shape[0] * self.ws_shape[1] * 4


def split_bounds(n: int, count: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part *index* of ``numpy.array_split(range(n), count)``."""
    q, r = divmod(n, count)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def payload(size: int, seed: int) -> np.ndarray:
    """A float64 array of ``size`` bytes, touched (its page faults never reach a clock)."""
    return np.random.default_rng(seed).standard_normal(size // 8)


def as_array(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    if hasattr(v, "numpy"):          # a torch tensor
        return v.numpy()
    return np.asarray(v)


def nbytes_of(v: Any) -> int:
    if hasattr(v, "element_size"):   # a torch tensor
        return v.numel() * v.element_size()
    return int(v.nbytes)


def same(v: Any, src: np.ndarray) -> bool:
    a = as_array(v).reshape(-1)
    s = src.reshape(-1)
    step = max(1, s.size // 4096)
    return a.size == s.size and a.dtype == s.dtype and np.array_equal(a[::step], s[::step]) and a[-1] == s[-1]


# ------------------------------------------------------ clients (any process)

class Client:
    """One peer as seen by one process: put returns an opaque ref that get takes."""

    name = ""
    max_pending: int | None = None    # queues: puts that may wait unread in the pipe

    def put(self, key: str, arr: np.ndarray) -> Any:
        raise NotImplementedError

    def get(self, ref: Any) -> Any:
        raise NotImplementedError

    def delete(self, refs: list) -> None:
        raise NotImplementedError

    def export(self, ref: Any) -> Any:       # a ref as sent to another process
        return ref

    def adopt(self, ref: Any) -> Any:        # ... and as received there
        return ref

    def close(self) -> None:
        pass

    # weight sync, key-value style: what a user of the peer would write
    def ws_publish(self, version: int, rank: int, state: dict) -> Any:
        refs = {n: self.put(f"ws/v{version}/r{rank}/{n}", a) for n, a in state.items()}
        mine = self.__dict__.setdefault("_ws_refs", {})
        mine[version] = list(refs.values())
        old = mine.pop(version - KEEP, None)
        if old:
            self.delete(old)
        return {n: self.export(r) for n, r in refs.items()}

    def ws_fetch(self, version: int, refs: list, bufs: dict, plan: dict) -> None:
        c0, c1 = plan["cols"]
        for n, buf in bufs.items():
            for r, (r0, r1) in enumerate(plan["rows"]):
                v = as_array(self.get(self.adopt(refs[r][n])))
                buf[r0:r1] = v.reshape(r1 - r0, -1)[:, c0:c1]
                del v

    def ws_finish(self) -> None:
        mine = self.__dict__.pop("_ws_refs", {})
        for refs in mine.values():
            self.delete(refs)


class YrClient(Client):
    name = "yrcache"

    def __init__(self, info: dict, store=None):
        from yrcache import TieredStore
        self._owner = store is not None
        self.store = store if store is not None else TieredStore.attach(info["store"])
        self.pub = self.sub = None

    def put(self, key, arr):
        self.store.put(key, arr)
        return key

    def get(self, ref):
        return self.store.get(ref)

    def delete(self, refs):
        for k in refs:
            self.store.delete(k)

    def ws_publish(self, version, rank, state):
        from yrcache.rl import Shard, WeightPublisher
        if self.pub is None:
            self.pub = WeightPublisher(self.store, "ws", rank=rank, world=TRAINERS, keep=KEEP)
        self.pub.publish(state, version, layout={n: Shard(0, rank, TRAINERS) for n in state})
        return None

    def ws_fetch(self, version, refs, bufs, plan):
        from yrcache.rl import Shard, WeightSubscriber
        if self.sub is None:
            self.sub = WeightSubscriber(self.store, "ws")
        k = plan["k"]
        self.sub.fetch(version, layout={n: Shard(1, k, READERS) for n in bufs}, into=bufs)

    def ws_finish(self):
        self.pub = self.sub = None

    def close(self):
        if not self._owner:
            self.store.close()


class RedisClient(Client):
    name = "redis"

    def __init__(self, info: dict):
        import redis
        self.r = redis.Redis(host="127.0.0.1", port=info["port"])
        self.r.ping()

    def put(self, key, arr):
        self.r.set(key, memoryview(np.ascontiguousarray(arr)).cast("B"))
        return (key, arr.dtype.str, arr.shape)

    def get(self, ref):
        key, dt, shape = ref
        return np.frombuffer(self.r.get(key), dtype=dt).reshape(shape)

    def delete(self, refs):
        keys = [r[0] for r in refs]
        for i in range(0, len(keys), 1000):
            self.r.delete(*keys[i:i + 1000])

    def close(self):
        self.r.close()


class RayClient(Client):
    name = "ray"

    def __init__(self, info: dict):
        import ray
        self.ray = ray

    def put(self, key, arr):
        return self.ray.put(arr)

    def get(self, ref):
        return self.ray.get(ref)

    def delete(self, refs):
        refs.clear()                  # the object goes when its last ObjectRef does


class VineyardClient(Client):
    name = "vineyard"

    def __init__(self, info: dict):
        vineyard = import_vineyard()
        self.c = vineyard.connect(info["socket"])
        self.ObjectID = vineyard.ObjectID

    def put(self, key, arr):
        return self.c.put(arr)

    def get(self, ref):
        return self.c.get(ref)

    def delete(self, refs):
        if refs:
            self.c.delete(list(refs))

    def export(self, ref):
        return int(ref)

    def adopt(self, ref):
        return self.ObjectID(ref)

    def close(self):
        self.c.close()


class ShmClient(Client):
    name = "shared_memory"

    def __init__(self, info: dict):
        self.prefix = info["prefix"]

    def put(self, key, arr):
        name = self.prefix + key.replace("/", "_")
        data = pickle.dumps(arr, protocol=5)
        seg = shared_memory.SharedMemory(name=name, create=True, size=len(data))
        seg.buf[: len(data)] = data
        seg.close()
        return name

    def get(self, ref):
        seg = shared_memory.SharedMemory(name=ref)
        obj = pickle.loads(seg.buf)
        seg.close()
        return obj

    def delete(self, refs):
        for n in refs:
            U.unlink_segment(n)


class DiskcacheClient(Client):
    name = "diskcache"

    def __init__(self, info: dict):
        import diskcache
        self.c = diskcache.Cache(info["dir"])

    def put(self, key, arr):
        self.c.set(key, arr)
        return key

    def get(self, ref):
        return self.c.get(ref)

    def delete(self, refs):
        for k in refs:
            self.c.delete(k)

    def close(self):
        self.c.close()


class TorchMPClient(Client):
    """Queues, not a store: ``get`` takes the next item from this process's queue."""

    name = "torch_mp"
    max_pending = 48

    def __init__(self, info: dict, queues: dict, index: int | None):
        import torch
        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)
        self.torch = torch
        self.rx = queues["loop"] if index is None else queues["workers"][index]
        self.tx = queues["loop"]
        self.readers = queues["workers"][TRAINERS:]
        self._keep: dict = {}

    def put(self, key, arr):
        self.tx.put(self.torch.from_numpy(arr))   # a fresh tensor: its storage moves to shm
        return None

    def get(self, ref):
        return self.rx.get()

    def delete(self, refs):
        pass

    def ws_publish(self, version, rank, state):
        sent = []
        for n, a in state.items():
            t = self.torch.from_numpy(a)              # the first put moves it to shm, once
            for q in self.readers:
                q.put((version, rank, n, t))
            sent.append(t)
        self._keep[version] = sent
        self._keep.pop(version - KEEP, None)
        return None

    def ws_fetch(self, version, refs, bufs, plan):
        c0, c1 = plan["cols"]
        for _ in range(len(bufs) * TRAINERS):
            v, r, n, t = self.rx.get()
            if v != version:
                raise RuntimeError(f"torch_mp: got version {v} while fetching {version}")
            r0, r1 = plan["rows"][r]
            bufs[n][r0:r1] = t.numpy()[:, c0:c1]
            del t

    def ws_finish(self):
        self._keep.clear()


def import_vineyard():
    with warnings.catch_warnings():    # vineyard 0.24 imports pkg_resources (deprecated)
        warnings.simplefilter("ignore")
        import vineyard
    return vineyard


def make_client(peer: str, info: dict, queues: dict | None, index: int | None) -> Client:
    if peer == "yrcache":
        return YrClient(info)
    if peer == "torch_mp":
        if queues is None:
            raise RuntimeError("torch_mp needs the queues handed over at spawn")
        return TorchMPClient(info, queues, index)
    cls = {"redis": RedisClient, "ray": RayClient, "vineyard": VineyardClient,
           "shared_memory": ShmClient, "diskcache": DiskcacheClient}[peer]
    return cls(info)


# ---------------------------------------------------- worker side (children, actors)

class Handlers:
    """What a helper process does on request: worker ``index`` is trainer ``index`` (0, 1)
    or reader ``index - 2`` (the weight sync), and reader 0 also serves remote gets."""

    def __init__(self, index: int, queues: dict | None = None):
        self.index, self.queues = index, queues
        self.clients: dict[str, Client] = {}
        self.spec: dict | None = None
        self.state: dict = {}
        self.bufs: dict = {}

    def pid(self) -> int:
        return os.getpid()

    def open(self, peer: str, info: dict) -> str:
        self.clients[peer] = make_client(peer, info, self.queues, self.index)
        return peer

    def close(self, peer: str) -> None:
        c = self.clients.pop(peer, None)
        if c is not None:
            c.ws_finish()
            c.close()

    def rget(self, peer: str, ref: list, n: int, warm: int, nbytes: int) -> list:
        c = self.clients[peer]
        r = c.adopt(ref[0]) if ref else None
        get = c.get
        v = get(r)
        if nbytes_of(v) != nbytes:
            raise RuntimeError(f"{peer}: got {nbytes_of(v)} bytes, expected {nbytes}")
        del v
        for _ in range(warm):
            v = get(r)
            del v
        lat = [0] * n
        for i in range(n):
            t0 = pc()
            v = get(r)
            t1 = pc()
            del v
            lat[i] = t1 - t0
        return lat

    # weight sync
    def ws_setup(self, spec: dict) -> None:
        self.spec = spec
        rows, cols = spec["shape"]
        self.pattern = (np.arange(rows * cols, dtype=np.int64) % 4093).astype(np.float32).reshape(rows, cols)
        if self.index < TRAINERS:
            self.rows = split_bounds(rows, TRAINERS, self.index)
        else:
            k = self.index - TRAINERS
            self.plan = {"k": k, "cols": split_bounds(cols, READERS, k),
                         "rows": [split_bounds(rows, TRAINERS, r) for r in range(TRAINERS)]}
            c0, c1 = self.plan["cols"]
            self.bufs = {f"w{t:02d}": np.zeros((rows, c1 - c0), dtype=np.float32)
                         for t in range(spec["tensors"])}
        gc.collect()
        gc.freeze()

    @staticmethod
    def _offset(version: int, t: int) -> np.float32:
        return np.float32(4096 * ((version * 16 + t) % 1024))

    def ws_regen(self, peer: str, version: int) -> None:
        """Untimed: trainers make fresh (not shared) weights for ``version``; readers blank
        their buffers; everybody collects garbage so that no collection lands in a clock."""
        if self.index < TRAINERS:
            r0, r1 = self.rows
            self.state = {}
            for t in range(self.spec["tensors"]):
                self.state[f"w{t:02d}"] = self.pattern[r0:r1] + self._offset(version, t)
        else:
            for b in self.bufs.values():
                b.fill(np.nan)
        gc.collect()

    def ws_publish(self, peer: str, version: int) -> Any:
        return self.clients[peer].ws_publish(version, self.index, self.state)

    def ws_fetch(self, peer: str, version: int, refs: list) -> None:
        self.clients[peer].ws_fetch(version, refs, self.bufs, self.plan)

    def ws_check(self, peer: str, version: int) -> None:
        if self.index < TRAINERS:
            return
        c0, c1 = self.plan["cols"]
        for t in range(self.spec["tensors"]):
            want = self.pattern[:, c0:c1] + self._offset(version, t)
            if not np.array_equal(self.bufs[f"w{t:02d}"], want):
                raise RuntimeError(f"{peer}: reader {self.index - TRAINERS} holds wrong values in "
                                   f"w{t:02d} after version {version}")

    def ws_finish(self, peer: str) -> None:
        self.clients[peer].ws_finish()
        self.state = {}

    def shutdown(self) -> None:
        for p in list(self.clients):
            try:
                self.close(p)
            except Exception:
                pass


OPS = ("pid", "open", "close", "rget", "ws_setup", "ws_regen", "ws_publish", "ws_fetch",
       "ws_check", "ws_finish")


def _die_with_parent(parent: int) -> None:
    """SIGTERM this helper when the main process dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:          # it died before the prctl
        os._exit(1)


def _worker_main(index: int, queues: dict | None, parent: int, conn) -> None:
    _die_with_parent(parent)
    h = Handlers(index, queues)
    U.serve(conn, {op: getattr(h, op) for op in OPS}, h.shutdown)


class RayWorkerImpl:
    """The same handlers inside a Ray actor (the natural second process for Ray)."""

    def __init__(self, index: int):
        self.h = Handlers(index)

    def call(self, op: str, *args):
        return getattr(self.h, op)(*args)


class ChildW:
    """A spawned helper with one request in flight at a time."""

    def __init__(self, child: U.Child):
        self.child = child

    def submit(self, op: str, *args) -> None:
        self.child.conn.send((op, *args))

    def wait(self, timeout: float = 900.0) -> Any:
        reply = self.child.recv(timeout)
        if reply[0] == "err":
            raise RuntimeError(f"{self.child.name} failed:\n{reply[1]}")
        return reply[1]

    def call(self, op: str, *args) -> Any:
        self.submit(op, *args)
        return self.wait()


class RayW:
    def __init__(self, ray, actor):
        self.ray, self.actor, self._pending = ray, actor, None

    def submit(self, op: str, *args) -> None:
        self._pending = self.actor.call.remote(op, *args)

    def wait(self, timeout: float = 900.0) -> Any:
        p, self._pending = self._pending, None
        return self.ray.get(p, timeout=timeout)

    def call(self, op: str, *args) -> Any:
        self.submit(op, *args)
        return self.wait()


def wait_all(ws: list, timeout: float = 900.0) -> list:
    """Every reply of one request per helper; the first error is raised once all are in
    (so that no reply is left unread to answer the next request)."""
    out, err = [], None
    for w in ws:
        try:
            out.append(w.wait(timeout))
        except Exception as e:
            out.append(None)
            err = err or e
    if err is not None:
        raise err
    return out


# --------------------------------------------------------- peers (main process)

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(cmd: list[str]) -> list[str]:
    """The command, made to get SIGTERM when this process dies (even by SIGKILL), if setpriv exists."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] + cmd if setpriv else cmd


def stop_process(p: subprocess.Popen, what: str) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            log(f"{what} did not stop on SIGTERM: killing it")
            p.kill()
            p.wait(10)


class Peer:
    name = ""

    def __init__(self, cfg: Config, cleanup: U.Cleanup, tmp: str):
        self.cfg, self.cleanup, self.tmp = cfg, cleanup, tmp
        self.info: dict = {}
        self.client: Client | None = None

    def missing(self) -> str | None:
        """Why the peer cannot run here (None: it can)."""
        return None

    def start(self) -> None:
        raise NotImplementedError

    def version(self) -> str:
        return "?"


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class YrPeer(Peer):
    name = "yrcache"

    def start(self):
        from yrcache import TieredStore
        name = f"ybc-{RUN_ID}"
        self.cleanup.add(f"destroy store {name}", lambda: U.destroy_store(name))
        store = TieredStore(name=name, dram=self.cfg.dram)
        self.cleanup.add(f"close store {name}", store.destroy)
        self.info = {"store": name}
        self.client = YrClient(self.info, store=store)

    def version(self):
        import yrcache
        return f"{U._version('yrcache')} ({os.path.dirname(yrcache.__file__)})"


class RedisPeer(Peer):
    name = "redis"

    def missing(self):
        if not _have("redis"):
            return "redis-py is not installed (pip install redis)"
        if shutil.which("redis-server") is None:
            return "redis-server is not on PATH (apt-get install redis-server)"
        return None

    def start(self):
        import redis
        port = free_port()
        logf = open(os.path.join(self.tmp, "redis.log"), "wb")
        p = subprocess.Popen(server_cmd(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", self.tmp,
                                         "--protected-mode", "yes", "--daemonize", "no"]),
                             stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.cleanup.add("stop redis-server", lambda: (stop_process(p, "redis-server"), logf.close()))
        deadline = time.monotonic() + 15
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {p.returncode} (see its log)")
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5).ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer within 15 s") from None
                time.sleep(0.05)
        self.info = {"port": port}
        self.client = RedisClient(self.info)

    def version(self):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
        v = next((w[2:] for w in out.split() if w.startswith("v=")), "?")
        from redis.utils import HIREDIS_AVAILABLE
        return (f"redis-server {v}, redis-py {U._version('redis')} "
                f"({'hiredis' if HIREDIS_AVAILABLE else 'pure-Python parser, no hiredis'})")


class RayPeer(Peer):
    name = "ray"

    def missing(self):
        return None if _have("ray") else "ray is not installed (pip install ray)"

    def start(self):
        import logging

        import ray
        # Ray's workers inherit the raylet's environment: they import this module by name.
        os.environ["PYTHONPATH"] = os.pathsep.join([BENCH_DIR] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        self.cleanup.add("ray.shutdown", ray.shutdown)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=os.path.join(self.tmp, "ray"),
                 object_store_memory=self.cfg.ray_store, log_to_driver=False,
                 logging_level=logging.WARNING)
        # ray.init takes SIGTERM over (its handler exits at once): give it back to the cleanup
        U.raise_keyboard_interrupt_on_sigterm()
        self.ray = ray
        self.info = {}
        self.client = RayClient(self.info)

    def actors(self) -> list:
        mod = importlib.import_module("compare")     # by reference: the actors import it too
        cls = self.ray.remote(num_cpus=0)(mod.RayWorkerImpl)
        actors = [cls.remote(i) for i in range(WORKERS)]
        self.ray.get([a.call.remote("pid") for a in actors], timeout=300)
        return [RayW(self.ray, a) for a in actors]

    def version(self):
        return U._version("ray")


class VineyardPeer(Peer):
    name = "vineyard"

    def missing(self):
        if not _have("vineyard"):
            return "vineyard is not installed (pip install vineyard)"
        try:
            import_vineyard()
        except Exception as e:   # e.g. ModuleNotFoundError: pkg_resources (setuptools >= 81)
            return f"import vineyard failed: {type(e).__name__}: {e}"
        if self._binary() is None:
            return "vineyardd not found (in vineyard/bdist/ or on PATH)"
        return None

    @staticmethod
    def _binary() -> str | None:
        spec = importlib.util.find_spec("vineyard")
        if spec is not None and spec.submodule_search_locations:
            for d in spec.submodule_search_locations:
                p = os.path.join(d, "bdist", "vineyardd")
                if os.access(p, os.X_OK):
                    return p
        return shutil.which("vineyardd")

    def start(self):
        vineyard = import_vineyard()
        sock = os.path.join(self.tmp, "vineyard.sock")
        logf = open(os.path.join(self.tmp, "vineyardd.log"), "wb")
        # boolean flags need '=': "--rpc false" would leave RPC on, listening on 0.0.0.0:9600
        p = subprocess.Popen(server_cmd([self._binary(), f"--socket={sock}", f"--size={self.cfg.vineyard_size}",
                                         "--meta=local", "--rpc=false"]),
                             stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.cleanup.add("stop vineyardd", lambda: (stop_process(p, "vineyardd"), logf.close()))
        deadline = time.monotonic() + 30
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"vineyardd exited with code {p.returncode} (see its log)")
            if os.path.exists(sock):
                try:
                    vineyard.connect(sock).close()
                    break
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("vineyardd did not accept connections within 30 s")
            time.sleep(0.05)
        self.info = {"socket": sock}
        self.client = VineyardClient(self.info)

    def version(self):
        return U._version("vineyard")


class ShmPeer(Peer):
    name = "shared_memory"

    def start(self):
        prefix = f"ybc-{RUN_ID}-"
        self.cleanup.add(f"unlink /dev/shm/{prefix}*", lambda: [
            U.unlink_segment(os.path.basename(p)) for p in glob.glob(f"/dev/shm/{prefix}*")])
        self.info = {"prefix": prefix}
        self.client = ShmClient(self.info)

    def version(self):
        return f"Python {sys.version.split()[0]}"


class DiskcachePeer(Peer):
    name = "diskcache"

    def missing(self):
        return None if _have("diskcache") else "diskcache is not installed (pip install diskcache)"

    def start(self):
        d = os.path.join(self.tmp, "diskcache")
        self.info = {"dir": d}
        self.client = DiskcacheClient(self.info)
        self.cleanup.add("close diskcache", self.client.close)

    def version(self):
        return U._version("diskcache")


class TorchMPPeer(Peer):
    name = "torch_mp"

    def missing(self):
        return None if _have("torch") else "torch is not installed (pip install torch)"

    def start(self):
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("spawn")
        self.queues = {"loop": ctx.SimpleQueue(), "workers": [ctx.SimpleQueue() for _ in range(WORKERS)]}
        self.strategy = tmp.get_sharing_strategy()
        self.info = {}
        self.client = TorchMPClient(self.info, self.queues, None)

    def push(self, index: int, t: Any, n: int) -> None:
        for _ in range(n):
            self.queues["workers"][index].put(t)

    def version(self):
        return f"torch {U._version('torch')}, sharing strategy {self.strategy}"


PEER_CLASSES = {"yrcache": YrPeer, "redis": RedisPeer, "ray": RayPeer, "vineyard": VineyardPeer,
                "shared_memory": ShmPeer, "diskcache": DiskcachePeer, "torch_mp": TorchMPPeer}


# ------------------------------------------------------------- load accounting

def _descendants_cpu() -> float:
    """CPU seconds of this process's live descendants (with the children they reaped)."""
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        f = s[s.rfind(")") + 2:].split()
        pid, ppid = int(d), int(f[1])
        kids.setdefault(ppid, []).append(pid)
        cpu[pid] = sum(int(x) for x in f[11:15])
    total, todo = 0, list(kids.get(os.getpid(), []))
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0)
        todo.extend(kids.get(p, []))
    return total / os.sysconf("SC_CLK_TCK")


class TreeLoad(U.ForeignLoad):
    """``ForeignLoad`` that also counts servers, Ray's daemons and helpers as ours."""

    @staticmethod
    def _ours() -> float:
        return U.ForeignLoad._ours() + _descendants_cpu()


# ------------------------------------------------------------------- the bench

class Bench:
    def __init__(self, cfg: Config, peers: dict[str, Peer], cleanup: U.Cleanup):
        self.cfg, self.peers, self.cleanup = cfg, peers, cleanup
        self.active = list(peers)
        self.errors: dict[str, str] = {}
        self.raw: dict = {"put": {}, "get": {}, "rget": {}, "ops_put": {}, "ops_get": {},
                          "ws_total": {}, "ws_publish": {}, "ws_fetch": {}}
        self.section_load: dict[str, float | None] = {}
        self.children: list[ChildW] = []
        self.ray_workers: list[RayW] = []
        self._seq = 0

    # -- bookkeeping
    def fail(self, peer: str, where: str, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        self.errors[peer] = f"{where}: {type(exc).__name__}: {lines[-1] if lines else ''}"
        log(f"{peer}: failed in {self.errors[peer]} -- left out of the rest of the run")
        log(traceback.format_exc())
        if peer in self.active:
            self.active.remove(peer)

    def order(self, rep: int) -> list[str]:
        a = list(self.active)
        k = rep % len(a) if a else 0
        return a[k:] + a[:k]

    def add(self, section: str, key: str, peer: str, values: list) -> None:
        self.raw[section].setdefault(key, {}).setdefault(peer, []).extend(values)

    def workers(self, peer: str) -> list:
        return self.ray_workers if peer == "ray" else self.children

    # -- helpers
    def spawn(self) -> None:
        need_children = [p for p in self.active if p != "ray"]
        queues = self.peers["torch_mp"].queues if "torch_mp" in self.active else None
        if need_children:
            log(f"starting {WORKERS} helper processes (spawn; outside every clock)")
            for i in range(WORKERS):
                child = U.Child(functools.partial(_worker_main, i, queues, os.getpid()), f"worker-{i}", self.cleanup)
                self.children.append(ChildW(child))
            for p in need_children:
                try:
                    for w in self.children:
                        w.submit("open", p, self.peers[p].info)
                    wait_all(self.children, 120)
                except Exception as e:
                    self.fail(p, "connecting helper processes", e)
        if "ray" in self.active:
            log(f"starting {WORKERS} Ray actors")
            try:
                self.ray_workers = self.peers["ray"].actors()
                for w in self.ray_workers:
                    w.call("open", "ray", {})
            except Exception as e:
                self.fail("ray", "starting actors", e)

    # -- workloads
    def local(self) -> None:
        cfg = self.cfg
        load = TreeLoad()
        for size in cfg.sizes:
            src = payload(size, seed=size)
            key = U.fmt_size(size)
            for rep in range(-1, cfg.reps):          # rep -1: warm-up, not recorded
                for peer in self.order(rep):
                    c = self.peers[peer].client
                    inner = min(cfg.inner[size], c.max_pending or cfg.inner[size])
                    try:
                        tp, tg = self._local_sample(c, src, inner)
                    except Exception as e:
                        self.fail(peer, f"put/get {key}", e)
                        continue
                    if rep >= 0:
                        self.add("put", key, peer, [tp])
                        self.add("get", key, peer, [tg])
            log(f"put/get {key}: " + ", ".join(
                f"{p} {U.fmt_ns(U.median(self.raw['put'][key][p]))}/{U.fmt_ns(U.median(self.raw['get'][key][p]))}"
                for p in self.active if p in self.raw["put"].get(key, {})))
            del src
            gc.collect()
        self.section_load["put/get"] = load.cpus()

    def _local_sample(self, c: Client, src: np.ndarray, inner: int) -> tuple[float, float]:
        self._seq += 1
        keys = [f"l/{self._seq}/{i}" for i in range(inner)]
        refs: list = [None] * inner
        put, get = c.put, c.get
        t0 = pc()
        for i, k in enumerate(keys):
            refs[i] = put(k, src)
        t1 = pc()
        v = None
        for r in refs:
            v = get(r)
        t2 = pc()
        ok = same(v, src)
        del v
        c.delete(refs)
        if not ok:
            raise RuntimeError("the value got differs from the value put")
        return (t1 - t0) / inner, (t2 - t1) / inner

    def remote(self) -> None:
        cfg = self.cfg
        load = TreeLoad()
        for size in cfg.sizes:
            src = payload(size, seed=size + 1)
            key = U.fmt_size(size)
            refs: dict[str, Any] = {}
            for peer in list(self.active):
                c = self.peers[peer].client
                try:
                    if peer == "torch_mp":
                        t = c.torch.from_numpy(src.copy())
                        t.share_memory_()          # shared once: every push sends the same storage
                        refs[peer] = t
                    else:
                        refs[peer] = c.put(f"r/{size}", src)
                except Exception as e:
                    self.fail(peer, f"get {key} from a 2nd process (put)", e)
            n = cfg.rget_batch[size]
            for rep in range(cfg.rget_reps):
                warm = cfg.rget_warm if rep == 0 else 1
                for peer in self.order(rep):
                    c = self.peers[peer].client
                    try:
                        w = self.workers(peer)[RGET_WORKER]
                        if peer == "torch_mp":   # all items queued first (the pipe holds ~100)
                            nq = min(n, c.max_pending)
                            self.peers[peer].push(RGET_WORKER, refs[peer], nq + warm + 1)
                            lat = w.call("rget", peer, [], nq, warm, size)
                        else:
                            lat = w.call("rget", peer, [c.export(refs[peer])], n, warm, size)
                    except Exception as e:
                        self.fail(peer, f"get {key} from a 2nd process", e)
                        continue
                    self.add("rget", key, peer, lat)
            log(f"get {key} from a 2nd process: " + ", ".join(
                f"{p} {U.fmt_ns(U.median(self.raw['rget'][key][p]))}" for p in self.active
                if p in self.raw["rget"].get(key, {})))
            for peer, r in refs.items():
                if peer != "torch_mp" and peer in self.peers:
                    try:
                        self.peers[peer].client.delete([r])
                    except Exception:
                        pass
            refs.clear()
            gc.collect()
        self.section_load["get, 2nd process"] = load.cpus()

    def ops(self) -> None:
        cfg = self.cfg
        load = TreeLoad()
        value = payload(1 * KiB, seed=7)
        for rnd in range(cfg.ops_rounds):
            for peer in self.order(rnd):
                c = self.peers[peer].client
                try:
                    p_rate, g_rate = self._ops_sample(c, value)
                except Exception as e:
                    self.fail(peer, "1 KiB ops/s", e)
                    continue
                self.add("ops_put", "1 KiB", peer, [p_rate])
                self.add("ops_get", "1 KiB", peer, [g_rate])
                gc.collect()
        log("1 KiB puts/s, gets/s: " + ", ".join(
            f"{p} {U.fmt_rate(U.median(self.raw['ops_put']['1 KiB'][p]), '')}/"
            f"{U.fmt_rate(U.median(self.raw['ops_get']['1 KiB'][p]), '')}".replace(" /", "/").rstrip()
            for p in self.active if p in self.raw["ops_put"].get("1 KiB", {})))
        self.section_load["1 KiB ops/s"] = load.cpus()

    def _ops_sample(self, c: Client, value: np.ndarray) -> tuple[float, float]:
        cfg = self.cfg
        batch = c.max_pending or cfg.ops_batch
        budget = cfg.ops_budget_s * 1e9
        put, get = c.put, c.get
        t_put = t_get = 0
        n = 0
        refs: list = []
        self._seq += 1
        seq = self._seq
        while t_put < budget and n < cfg.ops_max:
            keys = [f"o/{seq}/{n + i}" for i in range(batch)]
            out: list = [None] * batch
            t0 = pc()
            for i, k in enumerate(keys):
                out[i] = put(k, value)
            t_put += pc() - t0
            n += batch
            if c.max_pending:                 # a queue: take them out before the pipe fills
                t0 = pc()
                for r in out:
                    v = get(r)
                t_get += pc() - t0
                del v
            else:
                refs.extend(out)
        if not c.max_pending:
            t0 = pc()
            for r in refs:
                v = get(r)
            t_get = pc() - t0
            ok = same(v, value)
            del v
            if not ok:
                raise RuntimeError("the value got differs from the value put")
        c.delete(refs)
        return n / (t_put / 1e9), n / (t_get / 1e9)

    def weight_sync(self) -> None:
        cfg = self.cfg
        load = TreeLoad()
        spec = {"tensors": cfg.ws_tensors, "shape": cfg.ws_shape}
        key = f"{U.fmt_size(cfg.ws_bytes) if cfg.ws_bytes % MiB == 0 else cfg.ws_bytes}"
        ready = set()
        for group in ([self.children] if self.children else []) + ([self.ray_workers] if self.ray_workers else []):
            peers = [p for p in self.active if self.workers(p) is group]
            try:
                for w in group:
                    w.submit("ws_setup", spec)
                wait_all(group)
                ready.update(peers)
            except Exception as e:
                for p in peers:
                    self.fail(p, "weight sync set-up", e)
        version = {p: 0 for p in self.active}
        for rnd in range(-cfg.ws_warmup, cfg.ws_rounds):
            for peer in self.order(rnd):
                if peer not in ready:
                    continue
                version[peer] += 1
                try:
                    tot, pub, fet = self._ws_round(peer, version[peer])
                except Exception as e:
                    self.fail(peer, "weight sync", e)
                    continue
                if rnd >= 0:
                    self.add("ws_total", key, peer, [tot])
                    self.add("ws_publish", key, peer, [pub])
                    self.add("ws_fetch", key, peer, [fet])
        for peer in list(self.active):
            if peer in ready:
                try:
                    ws = self.workers(peer)
                    for w in ws:
                        w.submit("ws_finish", peer)
                    wait_all(ws)
                except Exception as e:
                    self.fail(peer, "weight sync clean-up", e)
        log(f"weight sync 2 -> 4 of {key}: " + ", ".join(
            f"{p} {U.fmt_ns(U.median(self.raw['ws_total'][key][p]))}" for p in self.active
            if p in self.raw["ws_total"].get(key, {})))
        self.section_load["weight sync"] = load.cpus()

    def _ws_round(self, peer: str, version: int) -> tuple[int, int, int]:
        ws = self.workers(peer)
        for w in ws:
            w.submit("ws_regen", peer, version)
        wait_all(ws)
        trainers, readers = ws[:TRAINERS], ws[TRAINERS:]
        t0 = pc()
        for w in trainers:
            w.submit("ws_publish", peer, version)
        refs = wait_all(trainers)
        t1 = pc()
        for w in readers:
            w.submit("ws_fetch", peer, version, refs)
        wait_all(readers)
        t2 = pc()
        del refs
        for w in readers:
            w.submit("ws_check", peer, version)
        wait_all(readers)
        return t2 - t0, t1 - t0, t2 - t1


# --------------------------------------------------------------------- report

def build_rows(cfg: Config, raw: dict, peers: list[str]) -> list[dict]:
    """One row per workload: the median per peer (ns for times, /s for rates) and the raw n."""
    rows = []

    def row(workload, section, key, kind, nbytes=None):
        d = raw.get(section, {}).get(key, {})
        if not d:
            return
        rows.append({"workload": workload, "section": section, "size": key, "kind": kind,
                     "unit": "ns" if kind == "latency" else "per_s", "bytes": nbytes,
                     "median": {p: U.median(d[p]) for p in peers if d.get(p)},
                     "min": {p: float(min(d[p])) for p in peers if d.get(p)},
                     "max": {p: float(max(d[p])) for p in peers if d.get(p)},
                     "n": {p: len(d[p]) for p in peers if d.get(p)}})

    for size in cfg.sizes:
        row(f"put {U.fmt_size(size)}", "put", U.fmt_size(size), "latency", size)
    for size in cfg.sizes:
        row(f"get {U.fmt_size(size)}, same process", "get", U.fmt_size(size), "latency", size)
    for size in cfg.sizes:
        row(f"get {U.fmt_size(size)}, 2nd process", "rget", U.fmt_size(size), "latency", size)
    row("1 KiB puts/s, one process", "ops_put", "1 KiB", "rate", KiB)
    row("1 KiB gets/s, one process", "ops_get", "1 KiB", "rate", KiB)
    wkey = U.fmt_size(cfg.ws_bytes) if cfg.ws_bytes % MiB == 0 else str(cfg.ws_bytes)
    row(f"weight sync 2 -> 4, {wkey}: total", "ws_total", wkey, "latency", cfg.ws_bytes)
    row("  of which publish (2 trainers)", "ws_publish", wkey, "latency", cfg.ws_bytes)
    row("  of which fetch (4 readers)", "ws_fetch", wkey, "latency", cfg.ws_bytes)
    return rows


def render_table(rows: list[dict], peers: list[str]) -> str:
    """Medians; in brackets how many times faster yrcache is (below 1: the peer is faster)."""
    header = ["workload"] + [LABEL[p] for p in peers]
    body = []
    for r in rows:
        yr = r["median"].get("yrcache")
        cells = [r["workload"]]
        for p in peers:
            v = r["median"].get(p)
            if v is None:
                cells.append("-")
                continue
            txt = U.fmt_ns(v) if r["kind"] == "latency" else U.fmt_rate(v, "/s")
            if p != "yrcache" and yr:
                ratio = v / yr if r["kind"] == "latency" else yr / v
                txt += f" ({U.fmt_ratio(ratio)})"
            cells.append(txt)
        body.append(cells)
    return U.markdown_table(header, body, ["l"] + ["r"] * len(peers))


COLORS = {"yrcache": "#d62728", "redis": "#1f77b4", "ray": "#ff7f0e", "vineyard": "#2ca02c",
          "shared_memory": "#9467bd", "diskcache": "#8c564b", "torch_mp": "#7f7f7f"}


def _bars(ax, groups: list[str], series: dict[str, list], unit: str, title: str) -> None:
    peers = list(series)
    width = 0.8 / max(1, len(peers))
    for i, p in enumerate(peers):
        xs = [g + (i - (len(peers) - 1) / 2) * width for g in range(len(groups))]
        ys = series[p]
        ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, label=LABEL[p],
               color=COLORS.get(p))
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", which="major", alpha=0.3)


def plot(rows: list[dict], peers: list[str], out_dir: str, subtitle: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install matplotlib)")
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    lat = [r for r in rows if r["kind"] == "latency" and not r["workload"].startswith("  ")]
    if lat:
        fig, ax = plt.subplots(figsize=(11, 5))
        _bars(ax, [r["workload"] for r in lat],
              {p: [r["median"].get(p, 0) / 1e9 for r in lat] for p in peers},
              "seconds (median, log scale; lower is better)", f"latency per operation\n{subtitle}")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 30)                   # room for the legend above the bars
        ax.legend(fontsize=8, ncol=7, loc="upper center")
        fig.tight_layout()
        path = os.path.join(out_dir, "compare-latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    rates = [r for r in rows if r["kind"] == "rate"]
    # bytes moved per second, for workloads that move every byte (a zero-copy get moves none)
    big = [r for r in lat if r["section"] in ("put", "ws_total") and r["bytes"] >= MiB]
    if rates or big:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 2]})
        if rates:
            _bars(axes[0], [r["workload"].replace(", one process", "") for r in rates],
                  {p: [r["median"].get(p, 0) for r in rates] for p in peers},
                  "operations/s (median, log; higher is better)", "1 KiB values, one process")
        if big:
            _bars(axes[1], [r["workload"].replace(": total", "") for r in big],
                  {p: [(r["bytes"] / (r["median"][p] / 1e9) / GiB) if r["median"].get(p) else 0
                       for r in big] for p in peers},
                  "GiB/s (bytes / median time, log; higher is better)",
                  "bandwidth of puts and of the weight sync (gets: see the latency plot)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
        fig.suptitle(subtitle, fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        path = os.path.join(out_dir, "compare-throughput.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------- main

def start_peers(names: list[str], cfg: Config, cleanup: U.Cleanup, tmp: str) -> tuple[dict, dict]:
    peers, status = {}, {}
    for name in names:
        p = PEER_CLASSES[name](cfg, cleanup, tmp)
        why = p.missing()
        if why is None:
            try:
                t0 = time.monotonic()
                p.start()
                log(f"{name}: started in {time.monotonic() - t0:.1f} s")
            except Exception as e:
                why = f"could not start: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if why is not None:
            print(f"skipping {name}: {why}", flush=True)
            status[name] = {"status": "skipped", "reason": why}
            continue
        peers[name] = p
        try:
            version = p.version()
        except Exception as e:
            version = f"? ({e})"
        status[name] = {"status": "ran", "version": version, "get_returns": RETURNS[name],
                        "weight_sync": WS_METHOD[name]}
    return peers, status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, few repeats, seconds")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help=f"comma-separated subset of {','.join(ALL_PEERS)} (default: all)")
    ap.add_argument("--json", metavar="OUT", help="write every figure and raw sample to this JSON file")
    ap.add_argument("--out-dir", metavar="DIR",
                    help="where the PNG plots go (default docs/img; with --quick: no plots unless given)")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in names if p not in ALL_PEERS]
    if bad:
        ap.error(f"unknown peer(s) {bad}; choose from {','.join(ALL_PEERS)}")
    names = [p for p in ALL_PEERS if p in names]
    out_dir = args.out_dir or (None if args.quick else os.path.join(os.path.dirname(BENCH_DIR), "docs", "img"))
    cfg = Config.make(args.quick)
    U.raise_keyboard_interrupt_on_sigterm()

    env = U.environment()
    print("# yrcache compared with its peers" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    print(flush=True)

    t_start = time.monotonic()
    load = TreeLoad()
    cleanup = U.Cleanup()
    tmp = tempfile.mkdtemp(prefix="ybc-")           # short: Ray's unix sockets live under it
    cleanup.add(f"remove {tmp}", lambda: shutil.rmtree(tmp, ignore_errors=True))
    interrupted, error = False, None
    status: dict = {}
    bench = None
    foreign = None
    try:
        peers, status = start_peers(names, cfg, cleanup, tmp)
        for name, st in status.items():
            if st["status"] == "ran":
                print(f"- {name:<13} : {st['version']}")
        print(flush=True)
        bench = Bench(cfg, peers, cleanup)
        if bench.active:
            bench.spawn()
            gc.collect()
            gc.freeze()
            for step in (bench.local, bench.remote, bench.ops, bench.weight_sync):
                if not bench.active:
                    break
                step()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up and reporting what was measured")
    except Exception as e:
        error = traceback.format_exc()
        log(f"error: {type(e).__name__}: {e}")
    finally:
        foreign = load.cpus()                          # before the servers stop
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        cleanup.run()
        signal.signal(signal.SIGINT, old)

    ran = [p for p in names if status.get(p, {}).get("status") == "ran"]
    raw = bench.raw if bench else {}
    rows = build_rows(cfg, raw, ran)
    print()
    print(render_table(rows, ran))
    print()
    print("Medians; in brackets: peer time / yrcache time (rates: yrcache rate / peer rate), i.e. how many")
    print("times faster yrcache is; below 1 the peer is faster.  What get returns:")
    for p in ran:
        print(f"- {LABEL[p]}: {RETURNS[p]}")
    for p, why in ((p, s["reason"]) for p, s in status.items() if s["status"] == "skipped"):
        print(f"- {p}: skipped ({why})")
    errors = bench.errors if bench else {}
    for p, e in errors.items():
        print(f"- {p}: FAILED during the run: {e}")
    end_load = U.loadavg()
    sections = bench.section_load if bench else {}
    print(f"\nload average at start: {env['loadavg']}; at end: {end_load}; other processes kept "
          + (f"{foreign:.2f} of {os.cpu_count()} CPUs busy during the run" if foreign is not None else "? CPUs busy")
          + (" (" + ", ".join(f"{k} {v:.2f}" for k, v in sections.items() if v is not None) + ")" if sections else "")
          + ("  -- timings are pessimistic: rerun on an idle machine" if foreign is not None and foreign > 0.2 else ""))
    print(f"total time {time.monotonic() - t_start:.0f} s"
          + ("  (run interrupted: partial results)" if interrupted else "")
          + ("  (run stopped by an error: partial results)" if error else ""))
    if error:
        print("\n" + error, file=sys.stderr)

    if out_dir and rows and not interrupted:
        subtitle = (f"{env['cpu']}, {env['cpus']} CPUs; other processes {foreign:.2f} CPUs busy"
                    if foreign is not None else env["cpu"])
        for path in plot(rows, ran, out_dir, subtitle):
            print(f"wrote {path}")
    if args.json:
        doc = {"env": env, "run_id": RUN_ID, "loadavg_end": end_load, "foreign_cpus": foreign, "section_foreign_cpus": sections,
               "quick": cfg.quick, "config": asdict(cfg), "peers": status, "errors": errors,
               "rows": rows, "raw": raw, "interrupted": interrupted, "error": error}
        U.write_json(args.json, doc)
    return 130 if interrupted else (1 if error or errors else 0)


if __name__ == "__main__":
    sys.exit(main())
