"""The ``yrcache`` console script: stat, ls, destroy (and its errors)."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from yrcache.sizes import format_size

gc.freeze()  # conftest collects after every test; keep long-lived objects out of it

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "yrcache")
ENTRY = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "yrcache"]


def yrcache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=timeout, env=env)


def shm_path(name: str) -> str:
    return f"/dev/shm/yrcache.{name}"


def assert_one_line_error(r: subprocess.CompletedProcess, *mentions: str) -> None:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {r.stderr!r}"
    for m in mentions:
        assert m in lines[0], f"{m!r} not in {lines[0]!r}"


VALUES = {
    "policy/w1": np.arange(262144, dtype=np.float32),   # exactly 1 MiB
    "policy/w2": np.zeros((64, 16), dtype=np.int32),     # 4096 bytes
    "value/v1": b"x" * 10,                               # 10 bytes
}


def nbytes(v) -> int:
    return v.nbytes if isinstance(v, np.ndarray) else len(v)


@pytest.fixture
def populated(make_store):
    s = make_store(dram="8MiB")
    s.mset(VALUES)
    return s


def test_stat(populated):
    s = populated
    r = yrcache("stat", s.name)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert s.name in out
    st = s.stats()
    dram = [ln.split() for ln in out.splitlines() if ln.split()[:1] == ["dram"]]
    assert len(dram) == 1, out
    assert dram[0][-1] == "3", f"objects column of {dram[0]}"
    assert format_size(st["tiers"]["dram"]["capacity"]) in out
    assert re.search(r"(?m)^\s*puts\s*:?\s*3\s*$", out), out
    # the CLI only attached: the store is still there and ours
    assert s["value/v1"].tobytes() == b"x" * 10


def test_stat_json_matches_stats(populated):
    s = populated
    r = yrcache("stat", s.name, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    st = s.stats()
    assert got["tiers"]["dram"]["capacity"] == st["tiers"]["dram"]["capacity"]
    assert got["tiers"]["dram"]["objects"] == 3
    assert got["tiers"]["dram"]["used"] == st["tiers"]["dram"]["used"]
    assert got["puts"] == 3
    for k in ("hits", "misses", "spills", "promotions", "evictions", "pinned_bytes"):
        assert k in got


def _ls_lines(out: str) -> dict[str, str]:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return {ln.split("\t")[0].split()[0]: ln for ln in lines}


def test_ls_lists_keys_with_sizes(populated):
    r = yrcache("ls", populated.name)
    assert r.returncode == 0, r.stderr
    lines = _ls_lines(r.stdout)
    assert set(lines) == set(VALUES)
    for key, v in VALUES.items():
        line = lines[key]
        n = nbytes(v)
        assert str(n) in line or format_size(n) in line, f"size of {key} ({n} B) not in {line!r}"


def test_ls_prefix(populated):
    r = yrcache("ls", populated.name, "policy/")
    assert r.returncode == 0, r.stderr
    assert set(_ls_lines(r.stdout)) == {"policy/w1", "policy/w2"}
    r = yrcache("ls", populated.name, "nothing-here/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_ls_empty_store(make_store):
    s = make_store(dram="1MiB")
    r = yrcache("ls", s.name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_ls_unicode_keys(make_store):
    s = make_store(dram="1MiB")
    s["模型/权重"] = b"abc"
    s["ключ"] = b"de"
    r = subprocess.run([*ENTRY, "ls", s.name], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert set(_ls_lines(out)) == {"模型/权重", "ключ"}


def _leave_behind(name: str) -> None:
    """Create a store in a process that dies without closing it."""
    code = textwrap.dedent(f"""
        import os
        from yrcache import TieredStore
        s = TieredStore(name={name!r}, dram="1MiB")
        s["orphan"] = b"left behind"
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert os.path.exists(shm_path(name))


def test_destroy_store_of_crashed_owner(store_name):
    _leave_behind(store_name)
    r = yrcache("stat", store_name)
    assert r.returncode == 0, r.stderr   # a dead owner's store can still be inspected
    r = yrcache("ls", store_name)
    assert set(_ls_lines(r.stdout)) == {"orphan"}
    r = yrcache("destroy", store_name)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(shm_path(store_name))
    r = yrcache("destroy", store_name)
    assert_one_line_error(r, store_name)


def test_destroy_live_store_keeps_mapping_valid(make_store, store_name):
    s = make_store(dram="1MiB")
    s["k"] = b"still here"
    v = s["k"]
    r = yrcache("destroy", store_name)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(shm_path(store_name))
    assert v.tobytes() == b"still here"
    assert s["k"].tobytes() == b"still here"  # our mapping outlives the name
    del v


@pytest.mark.parametrize("cmd", [["stat"], ["stat", "--json"], ["ls"], ["ls", "prefix/"], ["destroy"]])
def test_missing_store_one_line_error(store_name, cmd):
    r = yrcache(cmd[0], store_name, *cmd[1:])
    assert_one_line_error(r, store_name)
    assert r.stdout == ""
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("cmd", ["stat", "ls", "destroy"])
def test_bad_store_name_one_line_error(cmd):
    r = yrcache(cmd, "bad/name")
    assert_one_line_error(r, "bad/name")


def test_usage_errors():
    r = yrcache()
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "usage" in r.stderr.lower()
    r = yrcache("no-such-command")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    r = yrcache("stat")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_help_lists_subcommands():
    r = yrcache("--help")
    assert r.returncode == 0
    for sub in ("stat", "ls", "destroy"):
        assert sub in r.stdout


def test_python_dash_m_yrcache(populated):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}
    r = subprocess.run([sys.executable, "-m", "yrcache", "ls", populated.name],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert set(_ls_lines(r.stdout)) == set(VALUES)
