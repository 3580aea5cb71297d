#!/usr/bin/env python
"""The copying floor of bench_rl_cluster.py's workload on this machine, from measured costs.

    python bench/bench_floor.py [--reps 5] [--json out.json]

A version of bench_rl_cluster.py's default workload (512 MiB of fp32 published as
bf16 by 2 trainer nodes, pulled as dim-1 slices by 4 rollout nodes x 2 processes,
parts placed by the ring over all 6 members) has to move a fixed set of bytes
whatever the code around it does: the cast (256 MiB of bf16 out of 512 MiB of fp32),
every part to its owner over TCP (256 MiB), each slice byte held on another node
gathered there (its rows are strided in the part), sent and received (~213 MiB), and
the rows a node holds itself copied out of its arena (~43 MiB: a node owns ~1/6 of
the parts and wants 1/4 of each part's columns). This script measures what each of
those costs in CPU here (loopback TCP: a sender and a receiver process; the cast with
torch; the gather of 512-byte rows with numpy, from memory too large for the caches)
and adds them up. It is a floor for the copying only (no Python, etcd, wake-ups or
scheduling): on a machine that keeps every CPU busy through a version, the version
cannot end sooner than this CPU time over the CPU count, and the gloo baseline must
take 3x that for the 3x target of bench_rl_cluster.py to be reachable.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util as U  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from yrcache.cluster.wire import recv_exact  # noqa: E402

MiB = 1 << 20
MSG = 8 * MiB                    # a part of the workload (2048 x 2048 bf16)
ROW, STRIDE = 512, 4096          # a rollout's columns of a part's row, and the row's length


def _cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1e3


def _sender(port: int, n: int, out) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = np.ones(MSG, np.uint8)
    c0 = _cpu_ms()
    for _ in range(n):
        s.sendall(data)
        s.recv(1)                # one message in flight, as a part's PUT waits for its reply
    out.put(_cpu_ms() - c0)
    s.close()


def tcp_cost(n: int) -> tuple[float, float]:
    """CPU-ms per MiB of a loopback TCP stream: (sender, receiver), each its own process."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_sender, args=(ls.getsockname()[1], n, q))
    p.start()
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(MSG)
    c0 = _cpu_ms()
    for _ in range(n):
        recv_exact(c, buf)       # as a member takes a part (its receive low-water mark included)
        c.send(b"k")
    recv = _cpu_ms() - c0
    send = q.get(timeout=60)
    p.join(10)
    c.close()
    ls.close()
    mib = n * MSG / MiB
    return send / mib, recv / mib


class Copies:
    """CPU-ms per MiB written: the fp32 -> bf16 cast (torch) and a gather of 512-byte rows
    4 KiB apart (numpy), each reading memory too large for the caches into buffers
    faulted in beforehand."""

    def __init__(self, region_mib: int) -> None:
        import torch
        torch.set_num_threads(1)
        self.src = torch.randn(region_mib * MiB // 4)                       # fp32
        self.dst = torch.ones(region_mib * MiB // 4, dtype=torch.bfloat16)
        self.raw = np.frombuffer(self.src.numpy(), np.uint8)
        rows = region_mib * MiB // STRIDE
        self.strided = np.ndarray((rows, ROW), np.uint8, self.raw, 0, (STRIDE, 1))
        self.packed = np.ones((rows, ROW), np.uint8)
        self.measure()                                                     # warm: code, pages

    def measure(self) -> dict[str, float]:
        """One pass, tensor by tensor and part by part as the workload goes (16 MiB of fp32
        cast at a time, the rows of 8 MiB parts gathered)."""
        got = {}
        t = 4 * MiB                          # fp32 elements of a trainer's tensor (2048 x 2048)
        c0 = _cpu_ms()
        for a in range(0, self.src.numel(), t):
            self.dst[a:a + t].copy_(self.src[a:a + t])
        got["cast fp32 -> bf16"] = (_cpu_ms() - c0) / (self.dst.numel() * 2 / MiB)
        rows = 8 * MiB // STRIDE             # a part's rows
        c0 = _cpu_ms()
        for a in range(0, self.packed.shape[0], rows):
            np.copyto(self.packed[a:a + rows], self.strided[a:a + rows])
        got["gather 512 B rows"] = (_cpu_ms() - c0) / (self.packed.nbytes / MiB)
        return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="measurements of each cost (the median is used)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    args = ap.parse_args()
    env = U.environment()
    print("# The copying floor of bench_rl_cluster.py's workload\n")
    print(U.environment_header(env) + "\n")
    t_start = time.monotonic()
    foreign = U.ForeignLoad()
    samples: dict[str, list[float]] = {}
    for _ in range(args.reps):
        send, recv = tcp_cost(32)                    # 256 MiB
        samples.setdefault("tcp send", []).append(send)
        samples.setdefault("tcp receive", []).append(recv)
    copies = Copies(512)         # after the forks: pages shared with a child fault on every write after
    for _ in range(args.reps):
        for k, v in copies.measure().items():
            samples.setdefault(k, []).append(v)
    cost = {k: U.median(v) for k, v in samples.items()}
    for k, v in samples.items():
        print(f"{k:18s}: {cost[k]:.3f} CPU-ms per MiB (runs {', '.join(f'{x:.3f}' for x in v)})")

    need = 256.0                                     # MiB of bf16 the 8 rollouts need per version
    local = need * 4 / 6 / 4                         # held by their own node: ~43 MiB
    pulled = need - local
    tcp = cost["tcp send"] + cost["tcp receive"]
    parts = [("cast", 256, cost["cast fp32 -> bf16"]), ("parts to their owners over TCP", 256, tcp),
             ("members gather the pulled rows", pulled, cost["gather 512 B rows"]),
             ("pulled rows over TCP", pulled, tcp), ("rollouts copy their node's rows", local, cost["gather 512 B rows"])]
    total = sum(mib * c for _, mib, c in parts)
    own = 256 / 6 * tcp                             # a trainer's parts its own node owns
    cpus = os.cpu_count() or 1
    print("\nPer version (bytes x measured cost):")
    for what, mib, c in parts:
        print(f"  {what:32s} {mib:6.1f} MiB x {c:.3f} = {mib * c:6.1f} CPU-ms")
    print(f"  {'total':32s} {total:6.1f} CPU-ms: {total / cpus:.0f} ms on {cpus} CPUs kept busy; "
          f"the 3x target then needs gloo >= {3 * total / cpus:.0f} ms")
    print(f"  of it, a trainer's parts sent over loopback TCP to its own node's member: {own:.1f} CPU-ms")
    U.print_footer(env, [], foreign.cpus(), t_start, False, None)
    if args.json:
        U.write_json(args.json, {"env": env, "samples": samples, "cost": cost, "floor_cpu_ms": total,
                                 "floor_ms": total / cpus, "own_node_tcp_cpu_ms": own})


if __name__ == "__main__":
    main()
