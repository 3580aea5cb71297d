"""``yrcache ls`` and ``yrcache list`` print keys and names escaped, one line each;
``ls --json`` gives the exact keys."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from yrcache.cli import display_key
from test_cli import ENTRY, yrcache  # noqa: E402

NASTY = {
    "tab\tkey": "tab\\tkey",
    "new\nline": "new\\nline",
    "carriage\rreturn": "carriage\\rreturn",
    "esc\x1b[31mred": "esc\\x1b[31mred",
    "bell\x07del\x7f": "bell\\x07del\\x7f",
    "c1\x9bcsi": "c1\\x9bcsi",
    "line\u2028sep": "line\\u2028sep",
    "back\\slash": "back\\\\slash",
    "模型/权重 ключ": "模型/权重 ключ",          # printable unicode (and a space) as is
    "plain/key": "plain/key",
}


@pytest.mark.parametrize("key", list(NASTY), ids=[repr(k) for k in NASTY])
def test_display_key(key):
    shown = display_key(key)
    assert shown == NASTY[key]
    assert shown.isprintable()


def test_display_key_keeps_distinct_keys_distinct():
    # a real tab and the two characters backslash-t must not print alike
    assert display_key("a\tb") != display_key("a\\tb")


def test_ls_escapes_control_characters(make_store):
    s = make_store(dram="1MiB")
    for i, k in enumerate(NASTY):
        s[k] = bytes(i + 1)
    # a key whose raw printing would forge a whole extra row
    forged = "x\nforged/key\tdram\t1 B\tbytes"
    s[forged] = b"!"
    r = subprocess.run([*ENTRY, "ls", s.name], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    lines = out.splitlines()
    assert len(lines) == len(NASTY) + 1, out            # one line per key, none broken
    assert "\x1b" not in out and "\r" not in out and "\x9b" not in out
    first = sorted(line.split("\t")[0] for line in lines)
    assert first == sorted([*NASTY.values(), display_key(forged)])
    for line in lines:
        assert len(line.split("\t")) == 4, line          # no key adds a column
    assert not any(line.startswith("forged/key") for line in lines)


def test_ls_json_has_exact_keys(make_store):
    s = make_store(dram="1MiB")
    for i, k in enumerate(NASTY):
        s[k] = bytes(i + 1)
    r = yrcache("ls", s.name, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["key"] for row in rows} == set(NASTY)
    for row in rows:
        assert row["nbytes"] == list(NASTY).index(row["key"]) + 1
        assert row["tier"] == "dram" and row["kind"] == "bytes"
    assert "\x1b" not in r.stdout and "\x9b" not in r.stdout


def test_list_escapes_store_names():
    """Anyone can create a file in /dev/shm: a forged segment name must not break `yrcache list`."""
    path = "/dev/shm/yrcache.evil\nyrcache-forged\x1b[2J"
    open(path, "w").close()
    try:
        r = yrcache("list")
    finally:
        os.unlink(path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    assert "evil\\nyrcache-forged\\x1b[2J" in r.stdout.splitlines()
    assert "yrcache-forged\x1b[2J" not in r.stdout.splitlines()
