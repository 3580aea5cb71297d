"""Smoke test of bench/compare.py: a real ``--quick`` run over the peers every install has.

No timing is asserted (benchmarks measure, tests do not): the run must finish, report a
positive figure for every workload and peer, and leave nothing in /dev/shm.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "compare.py")
PEERS = ("yrcache", "shared_memory", "diskcache")
SECTIONS = {"put", "get", "rget", "ops_put", "ops_get", "ws_total", "ws_publish", "ws_fetch"}


def _segments() -> set[str]:
    # compare.py names its store ybc-<run id> (/dev/shm/yrcache.ybc-*) and the shared_memory
    # peer's segments ybc-<run id>-*; other yrcache.* names belong to tests running alongside
    return set(glob.glob("/dev/shm/yrcache.ybc-*")) | set(glob.glob("/dev/shm/ybc-*"))


def test_quick_run_reports_every_peer_and_leaves_nothing(tmp_path):
    before = _segments()
    out = tmp_path / "compare.json"
    img = tmp_path / "img"
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--peers", ",".join(PEERS),
                        "--json", str(out), "--out-dir", str(img)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    doc = json.loads(out.read_text())
    left = _segments() - before
    assert not left, f"compare.py left shared memory behind: {left}"
    assert not glob.glob(f"/dev/shm/*ybc-{doc['run_id']}*")

    assert doc["quick"] is True
    assert not doc["errors"] and not doc["error"] and not doc["interrupted"], (doc["errors"], doc["error"])
    for p in PEERS:
        assert doc["peers"][p]["status"] == "ran", doc["peers"][p]
    assert {row["section"] for row in doc["rows"]} == SECTIONS
    for row in doc["rows"]:
        for p in PEERS:
            assert row["median"][p] > 0, (row["workload"], p)
            samples = doc["raw"][row["section"]][row["size"]][p]
            assert samples and all(x > 0 for x in samples), (row["workload"], p, samples)
    for p in PEERS:          # the table names every peer
        assert doc["peers"][p]["get_returns"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert {f.name for f in img.iterdir()} == {"compare-latency.png", "compare-throughput.png"}
    else:
        assert "plots skipped" in r.stdout
