"""When a segment disappears, and misuse around closing (docs/architecture.md,
"Ownership and lifetime"): no normal exit, DataLoader shutdown or worker kill
leaves a segment behind; a closed store raises, it never crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from yrcache import StoreClosedError, StoreFullError, StoreNotFoundError, TieredStore
from yrcache.tiers import dram
from procs import seg_exists, seg_path


def run_script(tmp_path, code: str, timeout: float = 120, prefix: list[str] | None = None):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([*(prefix or []), sys.executable, str(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


# ---------------------------------------------------------------- ownership


def test_store_in_a_module_global_is_removed_at_exit(store_name, tmp_path):
    r = run_script(tmp_path, f"""
        import numpy as np
        from yrcache import TieredStore
        s = TieredStore(name={store_name!r}, dram="4MiB")
        s["k"] = np.arange(10)
        v = s["k"]            # a live view at exit too
        """)
    assert r.returncode == 0, r.stderr
    assert not seg_exists(store_name), "a never-closed store leaked its segment at normal exit"


def test_persist_keeps_the_store_until_destroy(store_name, tmp_path):
    r = run_script(tmp_path, f"""
        from yrcache import TieredStore
        s = TieredStore(name={store_name!r}, dram="4MiB", persist=True)
        s["k"] = b"kept"
        s.close()
        """)
    assert r.returncode == 0, r.stderr
    try:
        assert seg_exists(store_name)
        s = TieredStore.attach(store_name)
        assert bytes(s["k"]) == b"kept"
        s.close()
        assert seg_exists(store_name)           # an attached close never removes it
        adopter = TieredStore(name=store_name)  # adopts it, persistence included
        adopter.close()
        assert seg_exists(store_name)
        cli = subprocess.run([sys.executable, "-m", "yrcache", "destroy", store_name],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert not seg_exists(store_name)
    finally:
        dram.destroy(store_name)


def test_adopter_may_turn_persistence_off(store_name):
    s = TieredStore(name=store_name, dram="4MiB", persist=True)
    s.close()
    try:
        adopter = TieredStore(name=store_name, persist=False)
        adopter.close()
        assert not seg_exists(store_name)
    finally:
        dram.destroy(store_name)


def test_sigkilled_owner_still_leaves_its_segment(store_name, tmp_path):
    r = run_script(tmp_path, f"""
        import os, signal
        from yrcache import TieredStore
        s = TieredStore(name={store_name!r}, dram="4MiB")
        s["k"] = b"survives"
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert r.returncode == -9
    try:
        s = TieredStore.attach(store_name)
        assert bytes(s["k"]) == b"survives"
        s.close()
    finally:
        dram.destroy(store_name)


STOPPED = """
    import os, signal, sys, threading, time
    from yrcache import TieredStore
    mode, sig = sys.argv[1], int(sys.argv[2])
    if mode == "own handler":
        signal.signal(sig, lambda *a: (print("mine", flush=True), os._exit(3)))
    s = TieredStore(name={name!r}, dram="4MiB", persist=mode == "persist")
    s["k"] = b"kept"
    def fork():                     # the child gets the default action, not the store's ownership
        pid = os.fork()
        if pid == 0:                # (a pending signal could be dropped by a child's Python)
            os._exit(7) if signal.getsignal(sig) is not signal.SIG_DFL else time.sleep(60)
            os._exit(0)
        os.kill(pid, sig)           # at once
        _, status = os.waitpid(pid, 0)
        print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
        assert os.path.exists({path!r}), "the child's stop removed its parent's store"
    if mode == "forked child":
        fork()
    if mode == "child forked by a thread":
        t = threading.Thread(target=fork)
        t.start()
        t.join()
    print("ready", flush=True)
    time.sleep(60)
    """


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("mode", ["owner", "persist", "forked child", "child forked by a thread", "own handler"])
def test_an_owner_asked_to_stop_removes_its_store(store_name, tmp_path, sig, mode):
    """`timeout`, Slurm and Kubernetes stop a job with SIGTERM (a closed terminal: SIGHUP),
    whose default action skips every cleanup: the owner's segment was left in /dev/shm."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(STOPPED.format(name=store_name, path=seg_path(store_name))))
    p = subprocess.Popen([sys.executable, str(script), mode, str(int(sig))], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        lines = [p.stdout.readline().strip()]
        if "child" in mode:
            lines.append(p.stdout.readline().strip())
        assert lines[-1] == "ready", (lines, p.stderr.read() if p.poll() is not None else "")
        reader = TieredStore.attach(store_name)     # a process still attached keeps its data
        p.send_signal(sig)
        assert p.wait(30) == (3 if mode == "own handler" else -sig)
        assert bytes(reader["k"]) == b"kept"
        reader.close()
        if "child" in mode:
            assert lines[0] == f"child {int(sig)}"   # it died of the signal as before
        if mode == "own handler":
            assert p.stdout.read().strip() == "mine"
        # the program's own handler is kept (it should close the store; this one does not)
        assert seg_exists(store_name) == (mode in ("persist", "own handler"))
    finally:
        p.kill()
        p.wait()
        dram.destroy(store_name)


DATALOADER = """
    import sys
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset
    from yrcache import TieredStore

    class Cached(Dataset):
        def __init__(self, store):
            self.store = store
        def __len__(self):
            return 16
        def __getitem__(self, i):
            key = f"s/{{i}}"
            if key not in self.store:
                self.store[key] = np.full(4, i, dtype=np.int64)
            return torch.from_numpy(self.store.get(key, copy=True))

    if __name__ == "__main__":
        with TieredStore(name={name!r}, dram="64MiB") as s:
            dl = DataLoader(Cached(s), batch_size=4, num_workers=2, persistent_workers=True,
                            multiprocessing_context={ctx!r})
            for epoch in range(2):
                total = sum(int(b.sum()) for b in dl)
            assert total == sum(range(16)) * 4, total
            assert len(s) == 16
        print("done", flush=True)
"""


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_with_persistent_workers_leaves_no_segment(store_name, tmp_path, ctx):
    pytest.importorskip("torch")
    r = run_script(tmp_path, DATALOADER.format(name=store_name, ctx=ctx), timeout=180)
    try:
        assert r.returncode == 0 and "done" in r.stdout, r.stderr
        assert not seg_exists(store_name), "DataLoader workers kept the segment after the script ended"
    finally:
        dram.destroy(store_name)


# ------------------------------------------------------ tmpfs cannot back it


def _private_shm_works() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _private_shm_works(),
                    reason="needs `unshare --mount` and tmpfs mounts (root) for a private, small /dev/shm")
@pytest.mark.parametrize("prefault,shm_mib,store_mib", [(False, 16, 12), (True, 16, 12), (True, 800, 600)])
def test_overcommitted_store_fails_at_construction_not_with_sigbus(tmp_path, prefault, shm_mib, store_mib):
    """/dev/shm of 16 MiB: two 12 MiB stores both pass the free-space check
    (the first has not touched its pages yet); the second must fail at once
    with StoreFullError, and the first must be fully writable.  (600 MiB stores
    are populated by two threads, each of which may be the one that runs out.)"""
    script = tmp_path / "over.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from yrcache import TieredStore, StoreFullError
        from yrcache.tiers import dram
        a = TieredStore(name="a", dram="{store_mib}MiB", prefault={prefault})
        try:
            TieredStore(name="b", dram="{store_mib}MiB", prefault={prefault})
        except StoreFullError as e:
            print("refused:", e)
        try:    # below the free-space check: the segment itself must not over-commit
            dram.Arena("c", create=True, size={store_mib} << 20, prefault={prefault})
        except StoreFullError as e:
            print("refused:", e)
        a["x"] = np.ones(10 << 20, dtype=np.uint8)    # every page of a's heap is backed
        assert int(a["x"].sum()) == 10 << 20
        import os
        print("left:", sorted(os.listdir("/dev/shm")))
        a.close()
        print("ok")
        """))
    r = subprocess.run(["unshare", "--mount", "sh", "-c",
                        f"mount -t tmpfs -o size={shm_mib}M tmpfs /dev/shm && {sys.executable} {script}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS)\n{r.stderr}"
    assert r.stdout.count("refused:") == 2 and "has no room" in r.stdout, r.stdout
    assert "left: ['yrcache.a']" in r.stdout, r.stdout      # the refused store left nothing
    assert r.stdout.rstrip().endswith("ok")


def test_store_larger_than_free_shm_is_refused(store_name):
    free = os.statvfs(dram.SHM_DIR)
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises((StoreFullError, ValueError)):
        TieredStore(name=store_name, dram=too_big)
    assert not seg_exists(store_name)


# ------------------------------------------------------- use after close


def test_iterator_used_after_destroy_raises(tmp_path, store_name):
    """In a child, so that a crash shows up as a failed test, not a dead run."""
    r = run_script(tmp_path, f"""
        from yrcache import TieredStore, StoreClosedError
        s = TieredStore(name={store_name!r}, dram="16MiB")
        s.mset({{f"k{{i}}": b"x" for i in range(20000)}})   # more than one batch of keys
        it = s.keys()
        next(it)
        s.destroy()
        try:
            list(it)
        except StoreClosedError as e:
            print("closed:", e)
        """)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr}"
    assert "closed:" in r.stdout
    assert not seg_exists(store_name)


def test_methods_and_iterators_after_close_raise(make_store):
    s = make_store()
    s["k"] = np.arange(5)
    s["l"] = b""
    it, started = iter(s), iter(s)
    assert next(started) == "k"          # its batch is read: "l" is in hand
    s.close()
    for i in (it, started):
        with pytest.raises(StoreClosedError):
            list(i)
    for call in (lambda: s["k"], lambda: s.put("k", b"v"), lambda: s.keys(), lambda: s.stats(),
                 lambda: s.get_into("k", np.empty(5, dtype=np.int64)), lambda: len(s)):
        with pytest.raises(StoreClosedError):
            call()


CLOSE_RACE = """
    import threading
    import numpy as np
    from yrcache import TieredStore, StoreClosedError

    errors = []

    def hammer(s, i):
        out = np.empty(1 << 16, dtype=np.uint8)
        val = np.full(1 << 16, i, dtype=np.uint8)
        try:
            while True:
                s.put(f"k{{i}}", val)
                s.get_into(f"k{{i}}", out)
                assert (out == i).all()
                v = s[f"k{{i}}"]
                assert int(v[0]) == i
                list(s.keys())
        except StoreClosedError:
            pass
        except BaseException as e:
            errors.append(repr(e))

    for run in range({runs}):
        s = TieredStore(name=f"{name}-{{run}}", dram="8MiB")
        threads = [threading.Thread(target=hammer, args=(s, i)) for i in range(3)]
        for t in threads:
            t.start()
        import time
        time.sleep(0.01 * (run % 5))
        s.close()
        for t in threads:
            t.join(10)
    assert not errors, errors
    print("ok")
"""


def test_close_while_other_threads_put_and_get_never_crashes(tmp_path, store_name):
    r = run_script(tmp_path, CLOSE_RACE.format(name=store_name, runs=15))
    assert r.returncode == 0, f"exit {r.returncode} (-11 is SIGSEGV): {r.stderr[-2000:]}"
    assert r.stdout.strip() == "ok"
    for run in range(15):
        assert not seg_exists(f"{store_name}-{run}")


def test_view_taken_before_close_stays_valid_and_detach_follows_it(make_store, store_name):
    s = make_store()
    other = TieredStore.attach(store_name)
    other["k"] = np.arange(1000)
    v = other["k"]
    other.close()
    assert s.stats()["processes"] == 2        # the view keeps the attacher's slot (and pin)
    np.testing.assert_array_equal(v, np.arange(1000))
    del v
    import gc
    gc.collect()
    assert s.stats()["processes"] == 1


def test_attach_after_owner_close_is_not_found(make_store, store_name):
    s = make_store()
    keep = TieredStore.attach(store_name)
    s.close()
    with pytest.raises(StoreNotFoundError):
        TieredStore.attach(store_name)
    keep["still"] = b"works"
    assert bytes(keep["still"]) == b"works"
    keep.close()


_RACER = textwrap.dedent("""
    import sys, time
    from yrcache import TieredStore, StoreNotFoundError
    name, start = sys.argv[1], float(sys.argv[2])
    while time.time() < start:
        pass
    try:
        s = TieredStore(name=name, dram="32MiB")
    except FileExistsError:
        print("exists", flush=True)
    except StoreNotFoundError:
        print("being-created", flush=True)
    else:
        print("owner", flush=True)
        sys.stdin.readline()
        s.close()
""")


def test_a_segment_its_creator_has_not_sized_yet_is_looked_at_again(store_name):
    """A creator makes the segment (O_EXCL), then sizes it, then locks it; a process that
    opens it in between finds 0 bytes. Attaching then says the store is being created
    (StoreNotFoundError, which a cluster node's start-up retries), and creating looks
    again until the creator is done or gone (here: gone), instead of failing to map it.
    (test_cluster.py's four-process start met this in CI.)"""
    import threading
    import time

    path = f"/dev/shm/yrcache.{store_name}"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))   # made, not sized
    try:
        with pytest.raises(StoreNotFoundError, match="being created"):
            TieredStore.attach(store_name)
        gone = threading.Timer(0.3, os.unlink, (path,))                  # its creator gives up
        gone.start()
        t0 = time.monotonic()
        with TieredStore(name=store_name, dram="16MiB") as s:
            assert time.monotonic() - t0 >= 0.25 and len(s) == 0
            s["k"] = b"v"
            assert bytes(s["k"]) == b"v"
        gone.join()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_concurrent_creators_of_one_name_make_exactly_one_owner(store_name):
    import time

    for round_ in range(4):
        name = f"{store_name}-{round_}"
        start = time.time() + 1.0
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, name, str(start)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(6)]
        try:
            outcomes = sorted(p.stdout.readline().strip() for p in procs)
            # never two owners of one arena: the losers see it exists (or is still being created)
            assert outcomes.count("owner") == 1, outcomes
        finally:
            for p in procs:
                p.communicate("\n", timeout=30)
            dram.destroy(name)
