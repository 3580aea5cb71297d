"""``TieredStore(huge_pages=True)``: the arena asks for transparent huge pages.

The kernel gives them only where the tmpfs holding the segment is mounted with
``huge=advise`` (or ``within_size``/``always``), which /dev/shm is not by
default.  The test mounts such a tmpfs over /dev/shm in a private mount
namespace (``unshare --mount``, root), so the machine's /dev/shm is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from yrcache import TieredStore


def _mountns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private",
                               "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


CHILD = textwrap.dedent("""
    import json, multiprocessing as mp, sys
    import numpy as np
    from yrcache import TieredStore

    def pmd_kib():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("ShmemPmdMapped"):
                return int(line.split()[1])

    def attacher(name, q):
        s = TieredStore.attach(name)
        v = s["x"]
        q.put((int(v.sum()), pmd_kib()))
        s.close()

    if __name__ == "__main__":
        with TieredStore(dram="64MiB", huge_pages=sys.argv[1] == "1") as s:
            s["x"] = np.ones(16 << 20, np.uint8)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=attacher, args=(s.name, q))
            p.start()
            total, attached = q.get(timeout=60)
            p.join()
            print(json.dumps({"owner": pmd_kib(), "attacher": attached, "sum": total}))
""")


@pytest.mark.skipif(not _mountns_works(),
                    reason="needs root and `unshare --mount` to mount a huge=advise tmpfs over /dev/shm "
                           "privately; test_huge_pages_are_recorded_for_attachers covers the setting")
@pytest.mark.parametrize("huge", [False, True])
def test_huge_pages_back_the_arena_where_the_mount_allows(tmp_path, huge):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o huge=advise,size=256m tmpfs /dev/shm && "
         f"exec {sys.executable} {script} {int(huge)}"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["sum"] == 16 << 20
    if huge:   # the whole 64 MiB arena in 2 MiB pages, mapped so in both processes
        assert r["owner"] >= 32 << 10 and r["attacher"] >= 16 << 10, r
    else:
        assert r["owner"] == 0 and r["attacher"] == 0, r


def test_huge_pages_are_recorded_for_attachers(make_store, store_name):
    s = make_store(dram="8MiB", huge_pages=True)
    assert s._arena.huge_pages
    b = TieredStore.attach(s.name)
    try:
        assert b._config["huge_pages"] and b._arena.huge_pages   # the attacher advised its mapping
        with open("/proc/self/smaps") as f:
            flags = [line for line in f if line.startswith("VmFlags")]
        assert sum(" hg" in line for line in flags) >= 2          # both mappings carry MADV_HUGEPAGE
    finally:
        b.close()
    plain = make_store(dram="8MiB", name=store_name + "-plain")
    assert not plain._arena.huge_pages and not plain._config["huge_pages"]
