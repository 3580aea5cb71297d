"""Helpers shared by the tests: real child processes (fork and spawn), cleanup.

Child functions run through ``child_entry``, which reports ``("ok", result)``
or ``("err", traceback)`` on a queue, so a failure in a child fails the test
with the child's traceback.  Module-level, so spawn children can import it.
"""

from __future__ import annotations

import os
import signal
import sys
import queue as queue_mod
import subprocess
import time
import traceback

import pytest

from yrcache.tiers import dram


def seg_path(name: str) -> str:
    return f"{dram.SHM_DIR}{dram.shm_name(name)}"


def seg_exists(name: str) -> bool:
    return os.path.exists(seg_path(name))


def child_entry(q, fn, args):
    """Child side: run ``fn(*args)`` and report ``("ok", result)`` or ``("err", traceback)``."""
    try:
        res = fn(*args)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(("err", traceback.format_exc()))
    else:
        q.put(("ok", res))


def start(ctx, fn, *args):
    """Start ``fn(*args)`` in a child of context ``ctx``; returns (process, queue)."""
    q = ctx.Queue()
    p = ctx.Process(target=child_entry, args=(q, fn, args), daemon=True)
    p.start()
    return p, q


def get_report(p, q, timeout: float = 60.0):
    """The child's first report (it may keep running afterwards, to be killed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, res = q.get(timeout=0.1)
            break
        except queue_mod.Empty:
            if not p.is_alive():
                try:
                    status, res = q.get(timeout=2)
                    break
                except queue_mod.Empty:
                    p.join()
                    pytest.fail(f"child {p.name} exited with code {p.exitcode} and no report")
            if time.monotonic() > deadline:
                p.kill()
                p.join(5)
                pytest.fail(f"child {p.name} gave no report within {timeout}s")
    if status == "err":
        p.join(5)
        pytest.fail(f"child {p.name} failed:\n{res}")
    return res


def finish(p, q, timeout: float = 60.0):
    """Wait for a child's report, join it, and fail with its traceback if it failed."""
    res = get_report(p, q, timeout)
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5)
    assert p.exitcode == 0, f"child {p.name} exit code {p.exitcode}"
    return res


def kill_and_join(p) -> None:
    """SIGKILL ``p`` (if still running) and reap it."""
    if p.is_alive():
        p.kill()
    p.join(10)
    assert not p.is_alive()


def kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def wait_or_die(event, p, timeout: float = 30.0) -> None:
    """Wait for ``event`` set by child ``p``; fail early if the child died."""
    deadline = time.monotonic() + timeout
    while not event.wait(0.05):
        if not p.is_alive():
            pytest.fail(f"child {p.name} died (exit code {p.exitcode}) before signalling")
        if time.monotonic() > deadline:
            pytest.fail(f"child {p.name} did not signal within {timeout}s")


def drop_failed_test_locals() -> None:
    """A failed test's traceback keeps its locals (views, store handles) alive;
    clear them so that a failure is not followed by a misleading "left shared
    memory behind" error."""
    tb = getattr(sys, "last_traceback", None)
    while tb is not None:
        try:
            tb.tb_frame.clear()
        except RuntimeError:
            pass
        else:
            tb.tb_frame.f_locals.clear()
        tb = tb.tb_next


def fresh_python(script: str, timeout: float = 120.0) -> str:
    """Run ``script`` in a new interpreter (nothing imported yet, so first-use costs show)
    and return what it printed; a failure there fails the test with its stderr."""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and wait until every one of its threads has stopped: the
    signal is acted on asynchronously, and a thread still running may answer a frame or
    take a lock meanwhile. (Read from /proc, not waitpid: multiprocessing reaps its own.)"""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat", "rb") as f:
                    states.append(f.read().rpartition(b")")[2].split()[0])
            except FileNotFoundError:          # a thread that just ended
                continue
        if all(s in (b"T", b"t") for s in states):
            return
        assert not {b"Z", b"X"} & set(states), f"process {pid} died on its own"
        assert time.monotonic() < deadline, f"process {pid} did not stop (thread states {states})"
        time.sleep(0.001)
