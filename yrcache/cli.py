"""The ``yrcache`` command: inspect and manage stores on this node.

    yrcache stat NAME          capacity, use and counters of a store
    yrcache ls NAME [PREFIX]   keys (with tier, kind and size; --json for exact keys)
    yrcache destroy NAME       unlink a store (e.g. one left by a crashed owner)
    yrcache list               stores on this node
    yrcache example            two processes sharing a tensor zero-copy

Errors print one line on stderr and exit with status 1 (2 for bad usage).
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import YrcacheError
from .sizes import format_size


def _open(name: str):
    from .store import TieredStore

    return TieredStore.attach(name)


def cmd_stat(args) -> int:
    s = _open(args.name)
    try:
        st = s.stats()
    finally:
        s.close()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"store {st['name']}  ({st['processes']} attached process(es))")
    print(f"{'tier':<6} {'capacity':>12} {'used':>12} {'objects':>10}")
    for tier, t in st["tiers"].items():
        print(f"{tier:<6} {format_size(t['capacity']):>12} {format_size(t['used']):>12} {t['objects']:>10}")
    for k in ("hits", "misses", "puts", "deletes", "spills", "promotions", "evictions", "recoveries"):
        print(f"{k:<12} {st[k]}")
    print(f"{'pinned':<12} {format_size(st['pinned_bytes'])}")
    return 0


def display_key(key: str) -> str:
    """``key`` safe to print in a table: control, other non-printable characters and
    backslashes as Python backslash escapes (``\\t``, ``\\x1b``, ``\\u200b``,
    ``\\\\``), printable unicode as is.  Distinct keys stay distinct, and no key
    can break a line or a column, or send terminal escape sequences."""
    if key.isprintable() and "\\" not in key:
        return key                       # the common case, unchanged
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in key)


def cmd_ls(args) -> int:
    s = _open(args.name)
    rows = []
    try:
        for key in sorted(s.keys(prefix=args.prefix or "")):
            info = s.info(key)
            if info is None:             # deleted since it was listed
                continue
            d = {k: info[k] for k in ("kind", "dtype", "shape") if k in info}
            rows.append((key, info["tier"].name.lower(), info["nbytes"], d))
    finally:
        s.close()
    if args.json:                        # exact keys: JSON escapes what needs escaping
        print(json.dumps([{"key": k, "tier": t, "nbytes": n, **d} for k, t, n, d in rows], indent=2))
        return 0
    for key, tier, nbytes, d in rows:
        what = d["kind"] + (f" {d['dtype']}{list(d['shape'])}" if "dtype" in d else "")
        print(f"{display_key(key)}\t{tier}\t{format_size(nbytes)}\t{what}")
    return 0


def cmd_destroy(args) -> int:
    from .tiers import dram

    dram.check_name(args.name)
    if not dram.destroy(args.name):
        print(f"yrcache: no store named {args.name!r} on this node", file=sys.stderr)
        return 1
    print(f"destroyed {args.name}")
    return 0


def cmd_list(args) -> int:
    from .tiers import dram

    for name in dram.list_stores():
        print(display_key(name))        # anyone can create files in /dev/shm
    return 0


def cmd_example(args) -> int:
    from .example import main as example_main

    return example_main()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="yrcache", description="Inspect and manage yrcache stores on this node.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("stat", help="capacity, use and counters of a store")
    sp.add_argument("name")
    sp.add_argument("--json", action="store_true", help="print the stats() dict as JSON")
    sp.set_defaults(fn=cmd_stat)
    sp = sub.add_parser("ls", help="list keys of a store")
    sp.add_argument("name")
    sp.add_argument("prefix", nargs="?", default="")
    sp.add_argument("--json", action="store_true",
                    help="print a JSON list of {key, tier, nbytes, kind, dtype, shape} with exact keys")
    sp.set_defaults(fn=cmd_ls)
    sp = sub.add_parser("destroy", help="unlink a store's shared memory")
    sp.add_argument("name")
    sp.set_defaults(fn=cmd_destroy)
    sp = sub.add_parser("list", help="stores on this node")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser("example", help="two processes share a tensor zero-copy")
    sp.set_defaults(fn=cmd_example)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (YrcacheError, ValueError, OSError) as e:
        print(f"yrcache: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
