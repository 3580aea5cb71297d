"""``yrcache demo`` run for real: a learner and actor processes over one store.

Each test starts the demo as a subprocess (``python -m yrcache.demo``), so
the fork server, the children, the signals and the clean-up are the real
ones.  ``--quick`` runs in seconds (most of it importing torch).  Whether
the full default run learns CartPole takes 20-60 s on 2 cores: that test
runs only with ``YRCACHE_DEMO_LEARN=1`` (figures by hand in docs/demo.md).
"""

from __future__ import annotations

import glob
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")
psutil = pytest.importorskip("psutil")

from yrcache import demo  # noqa: E402

DEMO = [sys.executable, "-m", "yrcache.demo"]
QUICK_UPDATES = demo.QUICK["updates"]


def _segments() -> set[str]:
    """The demo's store segments in /dev/shm (other tests may create and remove theirs meanwhile)."""
    return set(glob.glob("/dev/shm/yrcache.demo-*"))


def _descendants(pid: int) -> set[psutil.Process]:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _assert_gone(procs: set[psutil.Process], timeout: float = 15.0) -> None:
    """Every process in ``procs`` has exited (the fork server exits shortly after the demo)."""
    _, alive = psutil.wait_procs(list(procs), timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"the demo left processes running: {alive}"


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


@pytest.mark.timeout(180)
def test_quick_json_exchanges_versions_and_experience():
    before = _segments()
    p = subprocess.Popen(DEMO + ["--quick", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[psutil.Process] = set()
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 150
    while p.poll() is None:                      # who the demo starts: fork server, learner, actors
        seen |= _descendants(p.pid)
        assert time.monotonic() < deadline, "the quick demo did not finish within 150 s"
        time.sleep(0.1)
    for t in readers:
        t.join(30)
    stderr = "".join(err)
    assert p.returncode == 0, stderr
    assert "Traceback" not in stderr
    r = json.loads("".join(out))

    # Weights: several versions published, and every actor fetched several of them.
    assert r["updates"] == QUICK_UPDATES
    assert r["versions_published"] == QUICK_UPDATES + 1
    assert r["versions_fetched"] >= 3
    assert len(r["fetches_per_actor"]) == 2 and min(r["fetches_per_actor"]) >= 3
    lat = r["latency_ms"]
    assert lat["n"] >= 2 and 0 < lat["median"] <= lat["max"] < 60_000
    assert lat["publish_median"] > 0 and lat["fetch_median"] > 0

    # Staleness: the learner never trains on data older than the limit.
    st, limit = r["staleness"], r["config"]["max_staleness"]
    assert 0 <= st["learner_mean"] <= st["learner_max"] <= limit
    assert 0 <= st["actor_mean"] <= st["actor_max"] <= QUICK_UPDATES
    assert sum(st["learner_hist"]) == r["experience"]["episodes_used"]

    # Experience went through the store, replay spilled to SSD, the policy stayed in DRAM.
    exp = r["experience"]
    assert exp["episodes_written"] > 0 and exp["episodes_used"] > 0
    assert exp["steps_used"] >= QUICK_UPDATES * r["config"]["batch_steps"]
    assert exp["episodes_used"] + exp["dropped_stale"] + exp["expired_unread"] <= exp["episodes_written"]
    assert exp["left_dram"] + exp["left_ssd"] + exp["aged_out"] == exp["episodes_written"]
    tiers = r["tiers"]
    assert tiers["spills"] > 0 and tiers["ssd_peak"] > 0
    assert set(tiers["policy_keys"]) == {"dram"}, tiers      # (failed once under load: says why next time)
    assert r["return"]["start"] is not None and len(r["return"]["per_update"]) == QUICK_UPDATES

    # Nothing left behind: segments, temporary directory, processes.
    assert not os.path.exists(f"/dev/shm/yrcache.{r['store']}")
    assert _segments() == before
    assert not os.path.exists(os.path.join("/tmp", f"yrcache-demo-{r['store'][len('demo-'):]}"))
    assert set(r["pids"]) <= {q.pid for q in seen}
    _assert_gone(seen)

    # The text summary renders from the same figures.
    buf = io.StringIO()
    demo._print_summary(r, buf)
    text = buf.getvalue()
    assert "publish->actor" in text and "average return" in text and "spills to SSD" in text


@pytest.mark.timeout(180)
def test_sigint_stops_children_and_cleans_up():
    before = _segments()
    p = subprocess.Popen(DEMO + ["--quick", "--updates", "1000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(p.stdout, q), daemon=True).start()
    tmp = None
    deadline = time.monotonic() + 150
    try:
        while True:                              # until the learner has published an update
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"the demo ended early: {p.wait()} {p.stderr.read()}"
            m = re.search(r"\(at (/\S+/yrcache-demo-[^)]+)\)", line)
            tmp = m.group(1) if m else tmp
            m = re.match(r"v (\d+)/", line)
            if m and int(m.group(1)) >= 1:
                break
        assert tmp is not None and os.path.isdir(tmp)
        children = _descendants(p.pid)
        assert len(children) >= 3                # fork server, learner, actors (and resource tracker)
        segs = _segments() - before
        assert len(segs) == 1                    # the demo's own store
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=15)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    stderr = p.stderr.read()
    assert rc == 130, stderr
    assert took < 10, f"took {took:.1f} s to stop"
    assert "Traceback" not in stderr and "interrupted (SIGINT)" in stderr
    assert _segments() == before
    assert not os.path.exists(tmp)
    _assert_gone(children)


def test_bad_options_exit_2(capsys):
    for argv in (["--actors", "0"], ["--dram", "lots"], ["--ttl", "0"], ["--max-staleness", "-1"]):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == 2
    assert "must be" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("YRCACHE_DEMO_LEARN"), reason="slow (20-60 s): set YRCACHE_DEMO_LEARN=1")
@pytest.mark.timeout(600)
def test_default_run_learns_cartpole():
    p = subprocess.run(DEMO + ["--json"], capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr
    ret = json.loads(p.stdout)["return"]
    assert ret["end"] >= 400 and ret["end"] >= 5 * ret["start"], ret
    assert ret["solved_update"] is not None
