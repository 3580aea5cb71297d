"""The ``yrcache`` console script: list, stat, ls, get, put, rm, destroy, bench, demo
(and their errors), run as a real process or through ``yrcache.cli.main``."""

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
    assert r.returncode == 0 and not r.stderr, r.stderr       # its owner is dead: nothing to warn of
    assert not os.path.exists(shm_path(store_name))
    r = yrcache("destroy", store_name)
    assert_one_line_error(r, store_name)


def test_destroy_live_store_keeps_mapping_valid(make_store, store_name):
    s = make_store(dram="1MiB")
    s["k"] = b"still here"
    v = s["k"]
    r = yrcache("destroy", store_name)
    assert r.returncode == 0, r.stderr
    assert f"warning: 1 running process(es) map '{store_name}' (pid {os.getpid()})" in r.stderr   # (silent)
    assert not os.path.exists(shm_path(store_name))
    assert v.tobytes() == b"still here"
    assert s["k"].tobytes() == b"still here"  # our mapping outlives the name
    del v


@pytest.mark.parametrize("cmd", [["stat"], ["stat", "--json"], ["ls"], ["ls", "prefix/"], ["ls", "--json"],
                                 ["destroy"], ["get", "k"], ["get", "k", "--json"], ["put", "k", "{file}"],
                                 ["rm", "k"], ["rm", "k", "--missing-ok"]])
def test_missing_store_one_line_error(store_name, cmd, tmp_path):
    (tmp_path / "v.bin").write_bytes(b"v")
    cmd = [c.replace("{file}", str(tmp_path / "v.bin")) for c in cmd]
    r = yrcache(cmd[0], store_name, *cmd[1:])
    assert_one_line_error(r, store_name, "yrcache list")
    assert r.returncode == 1
    assert r.stdout == ""
    assert not os.path.exists(shm_path(store_name))


@pytest.mark.parametrize("cmd", [["stat"], ["ls"], ["destroy"], ["get", "k"], ["put", "k", "-"], ["rm", "k"]])
def test_bad_store_name_one_line_error(cmd):
    r = yrcache(cmd[0], "bad/name", *cmd[1:])
    assert_one_line_error(r, "bad/name")
    assert r.returncode == 2


def test_destroy_of_a_listed_junk_name_says_to_remove_it_by_hand(store_name):
    """``yrcache list`` shows any file named /dev/shm/yrcache.*; for one whose name is no
    store name (another program's, a name with an escape character), ``destroy`` said only
    "invalid store name"."""
    name = f"{store_name}\x1b[31mred"
    path = shm_path(name)
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        assert "\\x1b[31mred" in yrcache("list").stdout            # shown escaped
        r = yrcache("destroy", name)
        assert r.returncode == 2
        assert_one_line_error(r, "invalid store name", "yrcache never made", "remove it with rm")
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_usage_errors():
    r = yrcache()
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "usage" in r.stderr.lower()
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = yrcache("no-such-command")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    r = yrcache("stat")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_help_lists_subcommands():
    r = yrcache("--help")
    assert r.returncode == 0
    for sub in COMMANDS + ["bench", "demo"]:
        assert re.search(rf"(?m)^\s+{sub}\s", r.stdout), f"{sub} not listed in {r.stdout}"
    assert "examples:" in r.stdout


def test_python_dash_m_yrcache(populated):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}
    r = subprocess.run([sys.executable, "-m", "yrcache", "ls", populated.name],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert set(_ls_lines(r.stdout)) == set(VALUES)


# ======================================================================
# The fuller CLI: help, get, put, rm, list --json, bench, demo
# ======================================================================

import io  # noqa: E402
import pty  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

from yrcache import _cli_io, cli  # noqa: E402

COMMANDS = ["list", "stat", "ls", "get", "put", "rm", "destroy", "example"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}


def run_bin(*args: str, input: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI as a real process, with binary stdin/stdout."""
    return subprocess.run([*ENTRY, *args], input=input, capture_output=True, timeout=timeout, env=_env())


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``yrcache.cli.main(args)`` in this process: (exit status, stdout, stderr)."""
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str, *mentions: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    for m in mentions:
        assert m in lines[0], f"{m!r} not in {lines[0]!r}"
    return lines[0]


# ------------------------------------------------------------------ help

@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help_has_examples(capsys, cmd):
    rc, out, err = run_main(capsys, cmd, "--help")
    assert rc == 0, err
    assert out.startswith(f"usage: yrcache {cmd}")
    assert "examples:" in out and f"  yrcache {cmd}" in out


def test_subcommand_help_real_process():
    r = yrcache("put", "--help")
    assert r.returncode == 0, r.stderr
    assert "--ttl SECONDS" in r.stdout and "--priority N" in r.stdout and "examples:" in r.stdout


@pytest.mark.parametrize("argv", [["get", "onlyname"], ["put", "n", "k"], ["rm", "n"], ["ls"], ["stat", "n", "--bogus"],
                                  ["nonsense"], ["list", "extra"]])
def test_bad_arguments_exit_2_one_line(capsys, argv):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2
    assert out == ""
    usage = f"usage: yrcache {argv[0]} " if argv[0] in COMMANDS else "usage: yrcache [-h] COMMAND"
    one_line(err, "error:", usage)            # the subcommand's own usage


@pytest.mark.parametrize("argv", [["get", "n", ""], ["get", "n", "k" * 1025], ["put", "n", "", "-"],
                                  ["rm", "n", "fine", ""], ["rm", "n", "k" * 1025]])
def test_bad_key_exit_2(capsys, argv):
    rc, out, err = run_main(capsys, *argv)           # checked before the store is looked up
    assert rc == 2 and out == ""
    one_line(err, "key")


def test_keyboard_interrupt_exits_130_quietly(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_list", interrupted)
    rc, out, err = run_main(capsys, "list")
    assert (rc, out, err) == (130, "", "")


# ------------------------------------------------------------------- get

def test_get_bytes_to_stdout(make_store):
    s = make_store(dram="1MiB")
    value = b'{"lr": 0.1}\x00\xff\n' * 3
    s["cfg/run.json"] = value
    r = run_bin("get", s.name, "cfg/run.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout == value
    assert r.stderr == b""


def test_get_array_raw_and_npy(make_store, tmp_path):
    s = make_store(dram="1MiB")
    arr = np.arange(15, dtype=np.float32).reshape(3, 5) / 7
    s["policy/w"] = arr
    raw, npy = tmp_path / "w.bin", tmp_path / "w.npy"
    r = yrcache("get", s.name, "policy/w", "--out", str(raw))
    assert r.returncode == 0, r.stderr
    assert raw.read_bytes() == arr.tobytes()           # raw: C-order elements, no header
    assert str(raw) in r.stdout and "as .npy" not in r.stdout
    r = yrcache("get", s.name, "policy/w", "--out", str(npy))
    assert r.returncode == 0, r.stderr
    back = np.load(npy)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)
    r = run_bin("get", s.name, "policy/w", "--npy")      # .npy to stdout
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(io.BytesIO(r.stdout)), arr)


def test_get_tensor(make_store, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    s = make_store(dram="1MiB")
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3) - 3
    s["t"] = t
    s["bf"] = torch.arange(4, dtype=torch.bfloat16)
    rc, out, err = run_main(capsys, "get", s.name, "t", "--out", str(tmp_path / "t.npy"))
    assert rc == 0, err
    back = np.load(tmp_path / "t.npy")
    assert back.dtype == np.int16 and back.shape == (2, 3)
    np.testing.assert_array_equal(back, t.numpy())
    rc, out, err = run_main(capsys, "get", s.name, "bf", "--out", str(tmp_path / "bf.bin"))
    assert rc == 0, err
    assert (tmp_path / "bf.bin").read_bytes() == s["bf"].view(torch.int16).numpy().tobytes()
    rc, out, err = run_main(capsys, "get", s.name, "bf", "--out", str(tmp_path / "bf.npy"))
    assert rc == 1
    one_line(err, "bfloat16", "raw bytes")
    assert not (tmp_path / "bf.npy").exists()           # no half-written file


def _read_pty(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            b = os.read(fd, 4096)
        except OSError:                                 # EIO: the other side is closed
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def test_get_on_a_terminal_describes_instead_of_printing(make_store):
    s = make_store(dram="1MiB")
    s["w"] = np.zeros((2, 3), np.float32)               # raw output would be 24 NUL bytes
    master, slave = pty.openpty()
    try:
        r = subprocess.run([*ENTRY, "get", s.name, "w"], stdout=slave, stderr=subprocess.PIPE,
                           timeout=60, env=_env())
    finally:
        os.close(slave)
    out = _read_pty(master)
    os.close(master)
    assert r.returncode == 0, r.stderr
    assert b"\x00" not in out
    text = out.decode()
    assert len(text.strip().splitlines()) == 1, text
    assert "ndarray" in text and "[2, 3]" in text and "24 B" in text and "--out FILE" in text


def test_get_failed_write_leaves_no_new_file(make_store, tmp_path, capsys, monkeypatch):
    s = make_store(dram="1MiB")
    s["w"] = np.ones(1000, np.float64)
    calls = []

    def disk_full(self, data):
        calls.append(len(memoryview(data)))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return self._f.write(data)
    monkeypatch.setattr(_cli_io._WriteAll, "write", disk_full)
    out = tmp_path / "w.npy"
    rc, _, err = run_main(capsys, "get", s.name, "w", "--out", str(out))   # header written, then the data fails
    assert rc == 1 and len(calls) == 2
    one_line(err, "No space left")
    assert not out.exists()                           # created by get: removed again
    out.write_bytes(b"precious")
    rc, _, err = run_main(capsys, "get", s.name, "w", "--out", str(out))
    assert rc == 1
    assert out.exists()                               # not ours to remove


def test_get_json_is_metadata(make_store, capsys):
    s = make_store(dram="1MiB")
    s.put("w", np.zeros((2, 3), np.int64), priority=7, ttl=100)
    rc, out, err = run_main(capsys, "get", s.name, "w", "--json")
    assert rc == 0, err
    meta = json.loads(out)
    assert meta["key"] == "w" and meta["tier"] == "dram" and meta["nbytes"] == 48
    assert meta["kind"] == "ndarray" and np.dtype(meta["dtype"]) == np.int64 and meta["shape"] == [2, 3]
    assert meta["priority"] == 7 and time.time() < meta["expire_at"] <= time.time() + 100


def test_get_json_with_out_file(make_store, tmp_path):
    s = make_store(dram="1MiB")
    s["w"] = np.ones(10, np.uint8)
    r = yrcache("get", s.name, "w", "--out", str(tmp_path / "w.npy"), "--json")
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)
    assert meta["format"] == "npy" and meta["out"] == str(tmp_path / "w.npy")
    assert meta["bytes_written"] == (tmp_path / "w.npy").stat().st_size > 10


def test_get_missing_key(make_store):
    s = make_store(dram="1MiB")
    s["there"] = b"x"
    r = yrcache("get", s.name, "not/there")
    assert r.returncode == 1
    assert r.stdout == ""
    assert_one_line_error(r, "not/there", f"yrcache ls {s.name}")


def test_get_what_cannot_be_written(make_store, tmp_path, capsys):
    s = make_store(dram="1MiB", pickle=True)
    s["b"] = b"bytes"
    s["p"] = {"a": 1}
    rc, out, err = run_main(capsys, "get", s.name, "b", "--out", str(tmp_path / "b.npy"))
    assert rc == 1
    one_line(err, "bytes, not an array")
    rc, out, err = run_main(capsys, "get", s.name, "p", "--out", str(tmp_path / "p.bin"))
    assert rc == 1
    one_line(err, "pickled")
    assert not list(tmp_path.iterdir())
    rc, out, err = run_main(capsys, "get", s.name, "p", "--json")     # metadata needs no unpickling
    assert rc == 0 and json.loads(out)["kind"] == "pickle"


def test_get_json_to_stdout_is_a_usage_error(make_store, capsys):
    s = make_store(dram="1MiB")
    s["b"] = b"x"
    rc, out, err = run_main(capsys, "get", s.name, "b", "--json", "--out", "-")
    assert rc == 2 and out == ""
    one_line(err, "--json")


def test_get_large_value_through_a_pipe_arrives_whole(make_store):
    s = make_store(dram="48MiB")
    arr = np.arange(8 << 20, dtype=np.uint32)          # 32 MiB: far more than a pipe holds
    s["big"] = arr
    for extra in ([], ["--npy"]):
        r = run_bin("get", s.name, "big", *extra)
        assert r.returncode == 0, r.stderr
        if extra:
            np.testing.assert_array_equal(np.load(io.BytesIO(r.stdout)), arr)
        else:
            assert len(r.stdout) == arr.nbytes and r.stdout == arr.tobytes()


def test_get_into_a_closed_pipe_is_quiet(make_store):
    """The reader leaves mid-value: exit 141, nothing on stderr.  (Python may report the
    write that the reader's exit cut short as a short count, not an error: get must go
    on writing, and so see the broken pipe, rather than exit 0.)"""
    s = make_store(dram="48MiB")
    s["big"] = np.ones(32 << 20, np.uint8)
    p = subprocess.Popen([*ENTRY, "get", s.name, "big"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env())
    assert p.stdout.read(10) == b"\x01" * 10
    p.stdout.close()                                    # like `| head -c 10`
    err = p.stderr.read()
    assert p.wait(60) == 141
    assert err == b"", err


# ------------------------------------------------------------------- put

def test_put_file_bytes(make_store, tmp_path):
    s = make_store(dram="1MiB")
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    (tmp_path / "blob").write_bytes(data)
    r = yrcache("put", s.name, "blobs/1", str(tmp_path / "blob"))
    assert r.returncode == 0, r.stderr
    assert "stored 'blobs/1'" in r.stdout and "bytes" in r.stdout
    assert s["blobs/1"].tobytes() == data
    assert s.info("blobs/1")["kind"] == "bytes"


def test_put_stdin(make_store):
    s = make_store(dram="1MiB")
    r = run_bin("put", s.name, "greeting", "-", input=b"hello\x00world")
    assert r.returncode == 0, r.stderr
    assert s["greeting"].tobytes() == b"hello\x00world"


@pytest.mark.parametrize("source", ["/dev/zero", "-"])
def test_put_of_an_endless_stream_stops_at_the_store_size(make_store, source):
    """``yrcache put NAME KEY /dev/zero`` (or an endless pipe on stdin) read until this
    machine ran out of memory (24 GB, then the OOM killer). The read now stops past the
    store's capacity. The CLI runs under a 2 GiB address-space limit here, so that the
    unbounded read fails fast instead."""
    s = make_store(dram="8MiB")
    cmd = " ".join([*ENTRY, "put", s.name, "big", source]) + (" < /dev/zero" if source == "-" else "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("YRCACHE_")}
    r = subprocess.run(["bash", "-c", f"ulimit -v {2 << 20}; exec {cmd}"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert_one_line_error(r, "gives more bytes than the store can hold", "nothing was stored")
    assert "big" not in s


def test_put_empty_file(make_store, tmp_path):
    s = make_store(dram="1MiB")
    (tmp_path / "empty").write_bytes(b"")
    r = yrcache("put", s.name, "e", str(tmp_path / "empty"))
    assert r.returncode == 0, r.stderr
    assert s["e"].tobytes() == b""


def test_put_get_npy_round_trip_real_process(make_store, tmp_path):
    s = make_store(dram="1MiB")
    arr = np.arange(24, dtype=np.float64).reshape(2, 3, 4) * 1.5
    np.save(tmp_path / "in.npy", arr)
    r = yrcache("put", s.name, "arr", str(tmp_path / "in.npy"))
    assert r.returncode == 0, r.stderr
    got = s["arr"]
    assert isinstance(got, np.ndarray) and got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)
    del got
    r = yrcache("get", s.name, "arr", "--out", str(tmp_path / "out.npy"))
    assert r.returncode == 0, r.stderr
    back = np.load(tmp_path / "out.npy")
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


NPY_CASES = {
    "int8-3d": np.arange(-12, 12, dtype=np.int8).reshape(2, 3, 4),
    "bool": np.array([True, False, True]),
    "big-endian": np.arange(5, dtype=">i4"),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    "scalar": np.array(3.25, dtype=np.float16),
    "empty": np.zeros((0, 3), dtype=np.uint16),
    "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
}


@pytest.mark.parametrize("case", list(NPY_CASES))
def test_put_get_npy_keeps_dtype_and_shape(make_store, tmp_path, capsys, case):
    s = make_store(dram="1MiB")
    arr = NPY_CASES[case]
    native = arr.dtype.newbyteorder("=")            # the store keeps values in native byte order
    np.save(tmp_path / "in.npy", arr)
    rc, out, err = run_main(capsys, "put", s.name, "a", str(tmp_path / "in.npy"))
    assert rc == 0, err
    got = s["a"]
    assert got.dtype == native and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)
    del got
    rc, out, err = run_main(capsys, "get", s.name, "a", "--out", str(tmp_path / "out.npy"))
    assert rc == 0, err
    back = np.load(tmp_path / "out.npy")
    assert back.dtype == native and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_put_npy_from_stdin_and_raw(make_store, tmp_path):
    s = make_store(dram="1MiB")
    arr = np.arange(6, dtype=np.int32).reshape(3, 2)
    buf = io.BytesIO()
    np.save(buf, arr)
    r = run_bin("put", s.name, "a", "-", "--npy", input=buf.getvalue())
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(s["a"], arr)
    assert s["a"].shape == (3, 2)
    np.save(tmp_path / "a.npy", arr)
    r = yrcache("put", s.name, "file-bytes", str(tmp_path / "a.npy"), "--raw")
    assert r.returncode == 0, r.stderr
    assert s.info("file-bytes")["kind"] == "bytes"
    assert s["file-bytes"].tobytes() == (tmp_path / "a.npy").read_bytes()


def test_put_ttl_and_priority(make_store, tmp_path, capsys):
    s = make_store(dram="1MiB")
    (tmp_path / "v").write_bytes(b"value")
    before = time.time()
    rc, out, err = run_main(capsys, "put", s.name, "k", str(tmp_path / "v"), "--ttl", "60", "--priority", "-5")
    assert rc == 0, err
    info = s.info("k")
    assert info["priority"] == -5
    assert before + 59 < info["expire_at"] <= time.time() + 60
    assert "expires in 60 s" in out and "priority -5" in out


def test_put_json(make_store, tmp_path, capsys):
    s = make_store(dram="1MiB")
    np.save(tmp_path / "a.npy", np.zeros((4, 2), np.float32))
    rc, out, err = run_main(capsys, "put", s.name, "a", str(tmp_path / "a.npy"), "--json", "--priority", "3")
    assert rc == 0, err
    meta = json.loads(out)
    assert meta == {"key": "a", "tier": "dram", "nbytes": 32, "kind": "ndarray", "dtype": "<f4",
                    "shape": [4, 2], "priority": 3, "expire_at": None, "source": str(tmp_path / "a.npy")}


@pytest.mark.parametrize("extra", [["--ttl", "0"], ["--ttl", "soon"], ["--priority", "1.5"],
                                   ["--priority", str(1 << 63)], ["--npy", "--raw"], ["--bogus"]])
def test_put_bad_arguments_exit_2(make_store, tmp_path, capsys, extra):
    s = make_store(dram="1MiB")
    (tmp_path / "v").write_bytes(b"v")
    rc, out, err = run_main(capsys, "put", s.name, "k", str(tmp_path / "v"), *extra)
    assert rc == 2
    one_line(err, "usage: yrcache put")
    assert "k" not in s


def test_put_bad_key_exit_2_real_process(make_store, tmp_path):
    s = make_store(dram="1MiB")
    (tmp_path / "v").write_bytes(b"v")
    r = yrcache("put", s.name, "", str(tmp_path / "v"))
    assert r.returncode == 2
    assert_one_line_error(r, "non-empty")
    r = yrcache("put", s.name, "x" * 1025, str(tmp_path / "v"))
    assert r.returncode == 2
    assert_one_line_error(r, "1024")


def test_put_failures_exit_1(make_store, tmp_path, capsys):
    s = make_store(dram="1MiB")
    (tmp_path / "not.npy").write_bytes(b"just bytes")
    np.save(tmp_path / "dates.npy", np.array(["2024-01-01"], dtype="datetime64[D]"))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "big").write_bytes(bytes(4 << 20))
    cases = [
        (str(tmp_path / "not.npy"), [], "not a .npy file"),
        (str(tmp_path / "big"), ["--npy"], "drop --npy"),
        (str(tmp_path / "dates.npy"), [], "dtype"),
        (str(tmp_path / "objects.npy"), [], "objects.npy"),
        (str(tmp_path / "missing"), [], "No such file"),
        (str(tmp_path / "big"), [], "full"),               # 4 MiB into a 1 MiB store
    ]
    for path, extra, mention in cases:
        rc, out, err = run_main(capsys, "put", s.name, "k", path, *extra)
        assert rc == 1, (path, out, err)
        one_line(err, mention)
        assert "k" not in s


# -------------------------------------------------------------------- rm

def test_rm_removes_keys(make_store):
    s = make_store(dram="1MiB")
    s.mset({"a": b"1", "b": b"2", "keep": b"3"})
    r = yrcache("rm", s.name, "a", "b")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["removed\ta", "removed\tb"]
    assert "a" not in s and "b" not in s and s["keep"].tobytes() == b"3"


def test_rm_missing_key(make_store):
    s = make_store(dram="1MiB")
    s.mset({"a": b"1", "b": b"2"})
    r = yrcache("rm", s.name, "a", "ghost")
    assert r.returncode == 1
    assert_one_line_error(r, "ghost", "--missing-ok")
    assert r.stdout.splitlines() == ["removed\ta", "missing\tghost"]
    assert "a" not in s                                  # the present keys are removed all the same
    r = yrcache("rm", s.name, "b", "ghost", "--missing-ok")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "b" not in s


def test_rm_json_and_escaped_keys(make_store, capsys):
    s = make_store(dram="1MiB")
    s["new\nline"] = b"1"
    rc, out, err = run_main(capsys, "rm", s.name, "new\nline", "nope", "--json", "--missing-ok")
    assert rc == 0, err
    assert json.loads(out) == {"removed": ["new\nline"], "missing": ["nope"]}
    s["new\nline"] = b"1"
    rc, out, err = run_main(capsys, "rm", s.name, "new\nline")
    assert rc == 0, err
    assert out == "removed\tnew\\nline\n"


# ------------------------------------------------------------------ list

def test_list_json(make_store):
    s = make_store(dram="2MiB")
    r = yrcache("list", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows[s.name]["bytes"] >= 2 << 20
    r = yrcache("list")
    assert s.name in r.stdout.splitlines()


# ----------------------------------------------------------------- bench

@pytest.fixture(scope="module")
def quick_bench() -> tuple[subprocess.CompletedProcess, int]:
    p = subprocess.Popen([*ENTRY, "bench", "--quick", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    out, err = p.communicate(timeout=180)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), p.pid


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and 0 < x < float("inf")


def test_bench_quick_json(quick_bench):
    r, pid = quick_bench
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["quick"] is True and res["repeats"] >= 1
    assert [row["size"] for row in res["put"]] == [1 << 10, 1 << 20, 64 << 20]
    assert [row["size"] for row in res["get"]] == [4 << 10, 64 << 20]
    for row in res["put"] + res["get"]:
        for k in ("yrcache_s", "copyto_s", "ratio"):
            assert _positive(row[k]), (k, row)
        assert row["ratio"] == pytest.approx(row["copyto_s"] / row["yrcache_s"])
    for row in res["get"]:
        assert row["n"] > 0 and _positive(row["p99_s"]) and row["min_s"] <= row["yrcache_s"] <= row["p99_s"]
    assert _positive(res["small"]["puts_per_s"]) and _positive(res["small"]["gets_per_s"])
    m = res["machine"]
    assert m["cpus"] >= 1 and _positive(m["shm_bytes"]) and m["yrcache"]
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"yrcache.yrbench-{pid}-")]


def test_bench_table(quick_bench):
    from yrcache.benchmark import format_report

    res = json.loads(quick_bench[0].stdout)
    table = format_report(res)
    for label in ("put 1 KiB", "put 1 MiB", "put 64 MiB", "get 4 KiB, second process",
                  "get 64 MiB, second process", "1 KiB puts, one process", "1 KiB gets, one process"):
        line = next((ln for ln in table.splitlines() if ln.startswith(label)), None)
        assert line is not None, f"{label!r} not in\n{table}"
        if label.startswith(("put", "get")):
            assert re.search(r"\d[\d,.]*x$", line), line     # the speed ratio column
    assert f"{res['machine']['cpus']} CPUs" in table and "/dev/shm" in table


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--repeats", "x"], ["--nope"], ["extra"]])
def test_bench_bad_arguments(capsys, argv):
    rc, out, err = run_main(capsys, "bench", *argv)
    assert rc == 2 and out == ""
    one_line(err, "usage: yrcache bench")


def test_bench_help_is_forwarded(capsys):
    rc, out, err = run_main(capsys, "bench", "--help")
    assert rc == 0, err
    assert out.startswith("usage: yrcache bench") and "--quick" in out and "--repeats" in out


def test_bench_main_returns_130_when_interrupted(monkeypatch, capsys):
    from yrcache import benchmark

    def interrupted(plan, progress):
        raise KeyboardInterrupt
    monkeypatch.setattr(benchmark, "run", interrupted)
    try:
        rc = benchmark.main(["--quick"])
    except KeyboardInterrupt:
        pytest.fail("benchmark.main let KeyboardInterrupt through")
    assert rc == 130
    assert capsys.readouterr() == ("", "")


def _reader_of(psutil, pid: int):
    """The benchmark's spawned reader process, once it runs."""
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                return c
        except psutil.Error:
            pass
    return None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_bench_interrupted_removes_its_store(sig):
    """Interrupted while the second process reads: exit 130, no traceback, no store and no
    process left."""
    psutil = pytest.importorskip("psutil")
    p = subprocess.Popen([sys.executable, "-m", "yrcache", "bench"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_env())
    prefix = f"yrcache.yrbench-{p.pid}-"
    try:
        deadline = time.monotonic() + 90
        while not (any(e.startswith(prefix) for e in os.listdir("/dev/shm")) and _reader_of(psutil, p.pid)):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the benchmark never got to its second process"
            time.sleep(0.02)
        children = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert b"Traceback" not in err, err
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


# ------------------------------------------------------------------ demo

def test_demo_forwards_every_argument(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("yrcache.demo")
    fake.main = lambda argv: calls.append(list(argv)) or 7
    monkeypatch.setitem(sys.modules, "yrcache.demo", fake)
    for argv in (["--help"], ["-h"], ["--episodes", "3", "-v", "x", "--", "--y"], []):
        assert cli.main(["demo", *argv]) == 7
        assert calls[-1] == argv


_FAKE_DEMO = """
import json, sys, types
fake = types.ModuleType("yrcache.demo")
def main(argv):
    print(json.dumps(argv))
    return 3
fake.main = main
sys.modules["yrcache.demo"] = fake
from yrcache.cli import main as cli_main
sys.exit(cli_main(sys.argv[1:]))
"""


def test_demo_forwarding_real_process():
    r = subprocess.run([sys.executable, "-c", _FAKE_DEMO, "demo", "--help", "--steps=5", "pos"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 3, r.stderr
    assert json.loads(r.stdout) == ["--help", "--steps=5", "pos"]


_BLOCKED_DEMO = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "yrcache.demo":
            raise ModuleNotFoundError(f"No module named {MISSING!r}", name=MISSING)
sys.meta_path.insert(0, Block())
from yrcache.cli import main
sys.exit(main(["demo", "--episodes", "1"]))
"""


@pytest.mark.parametrize("missing, mention", [("gymnasium", "gymnasium"), ("torch.nn", "torch"),
                                              ("yrcache.demo", "no demo")])
def test_demo_without_its_dependencies(missing, mention):
    code = f"MISSING = {missing!r}\n" + _BLOCKED_DEMO
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 1
    assert r.stdout == ""
    assert_one_line_error(r, mention, "pip install")
    if missing != "yrcache.demo":
        assert "pip install 'yrcache[demo]'" in r.stderr


def test_demo_dependency_imported_lazily(monkeypatch, capsys):
    fake = types.ModuleType("yrcache.demo")

    def main(argv):
        import gymnasium  # noqa: F401  (None in sys.modules: ModuleNotFoundError)
        return 0
    fake.main = main
    monkeypatch.setitem(sys.modules, "yrcache.demo", fake)
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    rc, out, err = run_main(capsys, "demo")
    assert rc == 1
    one_line(err, "gymnasium", "pip install 'yrcache[demo]'")


def test_real_demo_help():
    pytest.importorskip("yrcache.demo", reason="yrcache/demo.py is not there yet")
    r = yrcache("demo", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower()


def test_node_as_a_pure_client_says_why_it_cannot_serve(monkeypatch, capsys):
    """``YRCACHE_MEMBER=0 yrcache node`` said the store was "already served by another process"
    (after connecting to etcd), though nothing served it."""
    monkeypatch.setenv("YRCACHE_ETCD", "127.0.0.1:1")
    monkeypatch.setenv("YRCACHE_MEMBER", "0")
    rc, out, err = run_main(capsys, "node")
    assert rc == 2 and not out
    one_line(err, "YRCACHE_MEMBER='0'", "pure client", "unset YRCACHE_MEMBER")
