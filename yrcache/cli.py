"""The ``yrcache`` command: inspect and manage stores on this node.

    yrcache list                      stores on this node
    yrcache stat NAME                 capacity, use and counters of a store
    yrcache ls NAME [PREFIX]          keys with tier, kind and size
    yrcache get NAME KEY [--out F]    a value's bytes (or a .npy file) to F or stdout
    yrcache put NAME KEY FILE         store a file's bytes (a .npy file as an array)
    yrcache rm NAME KEY [KEY...]      remove keys
    yrcache destroy NAME              unlink a store (e.g. one left by a crashed owner)
    yrcache bench [--quick]           a micro-benchmark of this machine
    yrcache demo [ARGS...]            the RL demo (yrcache.demo; needs yrcache[demo])
    yrcache example                   two processes sharing a tensor zero-copy

``--json`` gives scripts exact keys and numbers.  Exit status: 0 done; 1 the
command failed (no such store or key, store full, unreadable file); 2 the
command line itself is wrong (unknown option, missing argument, invalid store
name or key); 130 interrupted (Ctrl-C); 141 stdout closed early (``| head``).
Errors print one line on stderr, never a traceback.  docs/cli.md has the
reference.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ._cli_base import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_USAGE, CliError, Parser, display_key
from ._cli_io import _capacity, _load_npy, _put_file, _write_file, _writer
from .errors import StoreNotFoundError, YrcacheError
from .sizes import format_size

if TYPE_CHECKING:
    from .store import TieredStore

# ------------------------------------------------------------------ helpers

def _check_name(name: str) -> None:
    from .tiers import dram

    try:
        dram.check_name(name)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _check_key(key: str) -> None:
    from .validate import key_bytes

    try:
        key_bytes(key)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _open(name: str) -> TieredStore:
    """Attach to store ``name``; a missing store is a one-line error saying how to list stores."""
    from .store import TieredStore
    from .tiers import dram

    _check_name(name)
    try:
        return TieredStore.attach(name)
    except StoreNotFoundError:
        if os.path.lexists(dram.seg_path(name)):
            raise                         # there but unusable: its own message says what to do
        raise CliError(f"no store named {name!r} on this node; `yrcache list` shows the stores here") from None


def _no_key(name: str, key: str) -> CliError:
    return CliError(f"store {name!r} has no key '{display_key(key)}'; `yrcache ls {name}` lists its keys")


def _what(info: dict) -> str:
    """``ndarray <f4[2, 3]``, ``tensor bfloat16[4]`` or ``bytes``: the kind column of ``ls``."""
    return info["kind"] + (f" {info['dtype']}{list(info['shape'])}" if "dtype" in info else "")


def _meta(key: str, info: dict) -> dict:
    """``store.info(key)`` as JSON-ready metadata (tier as a lower-case name, shape as a list)."""
    d = {"key": key, "tier": info["tier"].name.lower(), "nbytes": info["nbytes"], "kind": info["kind"]}
    if "dtype" in info:
        d.update(dtype=info["dtype"], shape=list(info["shape"]))
    d.update(priority=info["priority"], expire_at=info["expire_at"])
    return d


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {s!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {s!r}")
    return v


def _int64(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not -(1 << 63) <= v < 1 << 63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits, got {s}")
    return v


# ------------------------------------------------------------ list / stat / ls / destroy

def cmd_list(args: argparse.Namespace) -> int:
    """Print the stores on this node, one (escaped) name a line; ``--json``: names and sizes."""
    from .tiers import dram, segment

    names = dram.list_stores()
    if args.json:
        rows = []
        for name in names:
            try:                          # the name may be no valid store name: no seg_path()
                size: int | None = os.lstat(segment.SHM_DIR + segment.PREFIX + name).st_size
            except OSError:
                size = None
            rows.append({"name": name, "bytes": size})
        _print_json(rows)
        return 0
    for name in names:
        print(display_key(name))        # anyone can create files in /dev/shm
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    """Print capacity, use and counters of a store (``--json``: the ``stats()`` dict)."""
    with _open(args.name) as s:
        st = s.stats()
        config = dict(s._config)
    if config.get("cluster_member"):           # a cluster member's store: show the cluster too
        st["cluster"] = _cluster_stats(config)
    if args.json:
        _print_json(st)
        return 0
    print(f"store {st['name']}  ({st['processes']} attached process(es))")
    print(f"{'tier':<6} {'capacity':>12} {'used':>12} {'objects':>10}")
    for tier, t in st["tiers"].items():
        print(f"{tier:<6} {format_size(t['capacity']):>12} {format_size(t['used']):>12} {t['objects']:>10}")
    for k in ("hits", "misses", "puts", "deletes", "spills", "promotions", "evictions", "recoveries"):
        print(f"{k:<12} {st[k]}")
    print(f"{'pinned':<12} {format_size(st['pinned_bytes'])}")
    c = st.get("cluster")
    if c:
        print(f"cluster {c['cluster']}: {len(c['members'])} member(s), this store is {config['cluster_member']}, "
              f"under-replicated {c['under_replicated']}")
        print(f"{'member':<32} {'objects':>10} {'bytes':>12} {'pending':>8}")
        for m in c["members"]:
            if "error" in m:
                print(f"{m['member']:<32} does not answer: {m['error']}")
            else:
                print(f"{m['member']:<32} {m['objects']:>10} {format_size(m['bytes']):>12} {m['pending']:>8}")
    return 0


def _cluster_stats(config: dict) -> dict:
    """The cluster view of a member's store, asked of the members as a pure client."""
    from .store import TieredStore

    url = f"etcd://{config['cluster_etcd']}/{config['cluster']}"
    with TieredStore(cluster=url, member=False) as c:
        st = c.stats()
    return {k: st[k] for k in ("cluster", "members", "under_replicated", "replicas")}


def cmd_ls(args: argparse.Namespace) -> int:
    """Print the keys of a store (under a prefix) with tier, size and kind."""
    rows = []
    with _open(args.name) as s:
        for key in sorted(s.keys(prefix=args.prefix or "")):
            info = s.info(key)
            if info is not None:         # else deleted since it was listed
                rows.append((key, info))
    if args.json:                        # exact keys: JSON escapes what needs escaping
        _print_json([{"key": k, "tier": i["tier"].name.lower(), "nbytes": i["nbytes"],
                      **{f: i[f] for f in ("kind", "dtype", "shape") if f in i}} for k, i in rows])
        return 0
    for key, info in rows:
        print(f"{display_key(key)}\t{info['tier'].name.lower()}\t{format_size(info['nbytes'])}\t{_what(info)}")
    return 0


def cmd_destroy(args: argparse.Namespace) -> int:
    """Unlink a store's shared memory; processes attached keep their mappings."""
    from .tiers import dram, segment

    try:
        dram.check_name(args.name)
    except ValueError as e:               # a file under /dev/shm that yrcache cannot have made
        path = segment.SHM_DIR + segment.PREFIX + args.name
        if "/" not in args.name and os.path.lexists(path):
            raise CliError(f"{e}; yrcache never made {display_key(path)}: if it is yours and nothing uses "
                           "it, remove it with rm", EXIT_USAGE) from None
        raise CliError(str(e), EXIT_USAGE) from None
    users = _mapped_by(dram.seg_path(args.name))
    if not dram.destroy(args.name):
        raise CliError(f"no store named {args.name!r} on this node; `yrcache list` shows the stores here")
    print(f"destroyed {args.name}")
    if users:
        print(f"yrcache: warning: {len(users)} running process(es) map {args.name!r} (pid {', '.join(users[:8])}): "
              "they keep using it, but a process started now makes a new, empty store of that name; to "
              "stop a `yrcache node`, send it SIGTERM instead (it hands its objects over)", file=sys.stderr)
    return 0


def _mapped_by(path: str) -> list[str]:
    """The pids of other processes that map ``path`` (those whose maps this user may read)."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    if any(line.rstrip().endswith(path) for line in f):
                        pids.append(pid)
            except OSError:
                continue
    return pids


# ------------------------------------------------------------------- get

def cmd_get(args: argparse.Namespace) -> int:
    """Write a value's bytes to ``--out FILE`` or to stdout; on a terminal describe it instead."""
    _check_key(args.key)
    to_stdout = args.out in (None, "-")
    if args.json and args.out == "-":
        raise CliError("--json prints the metadata on stdout; write the value to a file with --out FILE",
                       EXIT_USAGE)
    npy = args.npy or (not to_stdout and args.out.endswith(".npy"))
    with _open(args.name) as s:
        info = s.info(args.key)
        if info is None:
            raise _no_key(args.name, args.key)
        describe_only = args.out is None and (args.json or sys.stdout.isatty())
        if describe_only:
            if args.json:
                _print_json(_meta(args.key, info))
            else:
                print(_description(args.name, args.key, info))
            return 0
        if info["kind"] == "pickle":
            raise CliError(f"'{display_key(args.key)}' holds a pickled Python object, which the command line "
                           "does not read (unpickling runs code chosen by its writer); read it in Python "
                           "with TieredStore.attach(name, pickle=True) if you trust every writer")
        value = s.get(args.key)
        if value is None:
            raise _no_key(args.name, args.key)
        write = _writer(args.key, value, info, npy)
        if to_stdout:
            sys.stdout.flush()
            write(sys.stdout.buffer)
            sys.stdout.buffer.flush()
            return 0
        written = _write_file(args.out, write)
        del value, write
    if args.json:
        _print_json({**_meta(args.key, info), "out": args.out, "format": "npy" if npy else "raw",
                     "bytes_written": written})
    else:
        print(f"wrote '{display_key(args.key)}' ({_what(info)}, {format_size(info['nbytes'])}) to "
              f"{args.out}{' as .npy' if npy else ''}")
    return 0


def _description(name: str, key: str, info: dict) -> str:
    shown = display_key(key)
    cmd = (f"yrcache get {shlex.quote(name)} {shlex.quote(key)} --out FILE" if shown == key
           else "yrcache get NAME KEY --out FILE")
    return (f"{shown}: {_what(info)}, {format_size(info['nbytes'])} in {info['tier'].name.lower()}; "
            f"not printed on a terminal: `{cmd}` saves it (FILE.npy: as .npy), or redirect stdout")


# ------------------------------------------------------------------- put

def cmd_put(args: argparse.Namespace) -> int:
    """Store FILE (``-``: stdin) under KEY: its bytes, or the array of a .npy file."""
    _check_key(args.key)
    npy = args.npy or (not args.raw and args.file != "-" and args.file.endswith(".npy"))
    with _open(args.name) as s:
        if npy:
            arr = _load_npy(args.file, forced=args.npy, limit=_capacity(s) + 4096)   # (+ the .npy header)
            try:
                s.put(args.key, arr, ttl=args.ttl, priority=args.priority)
            except TypeError as e:        # a dtype the store does not hold (object, datetime...)
                raise CliError(f"cannot store {args.file}: {e}") from None
            del arr
        else:
            _put_file(s, args.key, args.file, args.ttl, args.priority)
        info = s.info(args.key)
    if info is None:                      # a very short TTL, or removed at once by someone else
        raise _no_key(args.name, args.key)
    if args.json:
        _print_json({**_meta(args.key, info), "source": args.file})
        return 0
    extra = f", expires in {args.ttl:g} s" if args.ttl is not None else ""
    extra += f", priority {args.priority}" if args.priority else ""
    print(f"stored '{display_key(args.key)}': {_what(info)}, {format_size(info['nbytes'])} "
          f"in {info['tier'].name.lower()}{extra}")
    return 0


# -------------------------------------------------------------------- rm

def cmd_rm(args: argparse.Namespace) -> int:
    """Remove keys; a missing key fails the command (exit 1) unless ``--missing-ok``."""
    keys = list(dict.fromkeys(args.keys))      # each once, in the order given
    for k in keys:
        _check_key(k)
    with _open(args.name) as s:
        done = [(k, s.delete(k)) for k in keys]
    removed = [k for k, ok in done if ok]
    missing = [k for k, ok in done if not ok]
    if args.json:
        _print_json({"removed": removed, "missing": missing})
    else:
        for k, ok in done:
            print(f"{'removed' if ok else 'missing'}\t{display_key(k)}")
    if missing and not args.missing_ok:
        shown = ", ".join(f"'{display_key(k)}'" for k in missing)
        raise CliError(f"store {args.name!r} has no key {shown}"
                       f"{' (the others were removed)' if removed else ''}; --missing-ok ignores missing keys")
    return 0


# --------------------------------------------------- forwarded: bench, demo, example

def run_bench(argv: list[str]) -> int:
    """``yrcache bench ARGS``: ``yrcache.benchmark.main(ARGS)``."""
    from .benchmark import main as bench_main

    return bench_main(argv)


def _demo_hint(e: ModuleNotFoundError) -> CliError:
    if e.name == "yrcache.demo":
        return CliError("this version of yrcache has no demo (no module yrcache.demo); "
                        "upgrade it with `pip install -U 'yrcache[demo]'`")
    missing = (e.name or "a module").split(".")[0]
    return CliError(f"the demo needs {missing}, which is not installed: pip install 'yrcache[demo]'")


def run_demo(argv: list[str]) -> int:
    """``yrcache demo ARGS``: ``yrcache.demo.main(ARGS)``, every argument (``--help`` too) forwarded."""
    try:
        demo = importlib.import_module("yrcache.demo")
    except ModuleNotFoundError as e:
        raise _demo_hint(e) from None
    try:
        rc = demo.main(argv)
    except ModuleNotFoundError as e:      # a dependency imported lazily by the demo
        if (e.name or "").split(".")[0] not in ("gymnasium", "torch"):
            raise
        raise _demo_hint(e) from None
    return int(rc or 0)


def cmd_example(args: argparse.Namespace) -> int:
    """Run the two-process zero-copy example (``yrcache.example``)."""
    from .example import main as example_main

    return example_main()


def run_node(argv: list[str]) -> int:
    """``yrcache node ARGS``: this machine's cluster member (``yrcache.cluster.node``)."""
    from .cluster.node import main as node_main

    return node_main(argv)


_FORWARDED: dict[str, Callable[[list[str]], int]] = {"bench": run_bench, "demo": run_demo, "node": run_node}


def _forward(args: argparse.Namespace) -> int:
    # main() forwards before parsing (argparse would stop at a leading option); this is
    # for callers of build_parser().parse_args().
    return _FORWARDED[args.cmd](list(args.args))


# ---------------------------------------------------------------- parser

_MAIN_EPILOG = """examples:
  yrcache list                             the stores on this node
  yrcache ls exp1 policy/                  keys, tiers, sizes
  yrcache get exp1 policy/w --out w.npy    a value to a file
  yrcache put exp1 policy/w w.npy          a file to a value
  yrcache bench --quick                    what this machine does

Exit status: 0 done; 1 failed (no such store or key, store full...); 2 bad
command line; 130 interrupted.  `yrcache COMMAND --help` shows each command's
examples; docs/cli.md is the reference."""

_EPILOGS = {
    "list": """examples:
  yrcache list                 one store name a line
  yrcache list --json          [{"name": ..., "bytes": ...}] (bytes: the arena's size)""",
    "stat": """examples:
  yrcache stat exp1
  yrcache stat exp1 --json | jq .tiers.dram.used""",
    "ls": """examples:
  yrcache ls exp1                  key, tier, size and kind, tab separated (keys escaped)
  yrcache ls exp1 policy/          keys starting with policy/
  yrcache ls exp1 --json           exact keys, nbytes, dtype and shape""",
    "get": """Raw bytes: a bytes value as stored; an array or a tensor as its elements in C
order and native byte order (what arr.tobytes() gives), without dtype or shape.
A .npy file (--out FILE.npy, or --npy) keeps dtype and shape; bfloat16 and
other dtypes numpy lacks have raw bytes only.  On a terminal, without --out,
get prints a one-line description instead of binary data.

examples:
  yrcache get exp1 config/run.json                 bytes to stdout (when piped)
  yrcache get exp1 policy/w --out w.npy            an array or tensor as a .npy file
  yrcache get exp1 policy/w --out w.bin            its raw bytes
  yrcache get exp1 policy/w --npy > w.npy          .npy to stdout
  yrcache get exp1 policy/w --json                 metadata only: tier, nbytes, kind, dtype, shape""",
    "put": """FILE's bytes are stored as a bytes value; a FILE ending in .npy (or any FILE
with --npy) is stored as a numpy array with its dtype and shape (--raw stores
a .npy file's bytes instead).  A regular file is read straight into the store.

examples:
  yrcache put exp1 config/run.json run.json
  yrcache put exp1 policy/w w.npy --priority 10    an array; kept longer under pressure
  echo hello | yrcache put exp1 greeting - --ttl 60
  yrcache put exp1 -- -odd-key value.bin           a key starting with '-' after --""",
    "rm": """examples:
  yrcache rm exp1 policy/w policy/b
  yrcache rm exp1 maybe/there --missing-ok
  yrcache rm exp1 a b --json                       {"removed": [...], "missing": [...]}""",
    "destroy": """Processes still attached keep working on their mappings; new attaches fail.

examples:
  yrcache destroy exp1""",
    "bench": """All arguments go to the benchmark; `yrcache bench --help` shows its options.

examples:
  yrcache bench --quick
  yrcache bench --json > bench.json""",
    "node": """`yrcache node --help` lists the YRCACHE_* variables it reads (docs/cluster.md).""",
    "demo": """All arguments go to the demo (yrcache.demo); `yrcache demo --help` shows its
options.  Needs gymnasium and torch: pip install 'yrcache[demo]'.""",
    "example": """examples:
  yrcache example""",
}


def build_parser() -> Parser:
    """The ``yrcache`` argument parser (``bench`` and ``demo`` are listed; main() forwards them)."""
    p = Parser(prog="yrcache", description="Inspect and manage yrcache stores on this node.",
               epilog=_MAIN_EPILOG)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], summary: str, **kw: Any) -> Parser:
        sp = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                            epilog=_EPILOGS[name], **kw)
        sp.set_defaults(fn=fn)
        return sp

    def json_flag(sp: Parser, what: str) -> None:
        sp.add_argument("--json", action="store_true", help=what)

    sp = add("list", cmd_list, "stores on this node")
    json_flag(sp, "print a JSON list of {name, bytes}")
    sp = add("stat", cmd_stat, "capacity, use and counters of a store")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    json_flag(sp, "print the stats() dict as JSON")
    sp = add("ls", cmd_ls, "list the keys of a store")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    sp.add_argument("prefix", nargs="?", default="", metavar="PREFIX", help="only keys starting with PREFIX")
    json_flag(sp, "print a JSON list of {key, tier, nbytes, kind, dtype, shape} with exact keys")
    sp = add("get", cmd_get, "write a value to a file or stdout")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    sp.add_argument("key", metavar="KEY")
    sp.add_argument("--out", "-o", metavar="FILE", help="write here (- for stdout); FILE.npy: a .npy file")
    sp.add_argument("--npy", action="store_true", help="write a .npy file whatever FILE's name")
    json_flag(sp, "print the metadata as JSON (and write the value only with --out FILE)")
    sp = add("put", cmd_put, "store a file's bytes, or a .npy file's array")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    sp.add_argument("key", metavar="KEY")
    sp.add_argument("file", metavar="FILE", help="the file to store; - reads stdin")
    fmt = sp.add_mutually_exclusive_group()
    fmt.add_argument("--npy", action="store_true", help="FILE is a .npy file: store its array")
    fmt.add_argument("--raw", action="store_true", help="store FILE's bytes even if it ends in .npy")
    sp.add_argument("--ttl", type=_positive_float, metavar="SECONDS", help="expire after SECONDS")
    sp.add_argument("--priority", type=_int64, default=0, metavar="N",
                    help="higher stays longer when the store spills or drops (default 0)")
    json_flag(sp, "print what was stored as JSON")
    sp = add("rm", cmd_rm, "remove keys from a store")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    sp.add_argument("keys", nargs="+", metavar="KEY")
    sp.add_argument("--missing-ok", action="store_true", help="exit 0 even if a key was missing")
    json_flag(sp, "print {removed, missing} as JSON")
    sp = add("destroy", cmd_destroy, "unlink a store's shared memory")
    sp.add_argument("name", metavar="NAME", help="the store (`yrcache list` shows them)")
    for name, what in (("bench", "a micro-benchmark of this machine (forwards its arguments)"),
                       ("demo", "the RL demo (forwards its arguments; needs yrcache[demo])"),
                       ("node", "run this machine's cluster member from YRCACHE_* (docs/cluster.md)")):
        sp = add(name, _forward, what, add_help=False, usage=f"yrcache {name} [ARGS...]")
        sp.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    add("example", cmd_example, "two processes share a tensor zero-copy")
    p.commands = dict(sub.choices)
    return p


def _exit_code(code: object) -> int:
    """A SystemExit code as an exit status (a message string is printed, as sys.exit does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return EXIT_FAILED


def _os_error(e: OSError) -> str:
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the exit flush stays quiet."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``yrcache`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    ``bench`` and ``demo`` hand every later argument (``--help`` too) to
    ``yrcache.benchmark.main`` and ``yrcache.demo.main``.  User errors print
    one line on stderr; nothing here exits the interpreter.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in _FORWARDED:
            return _FORWARDED[args_list[0]](args_list[1:])
        p = build_parser()
        args, extra = p.parse_known_args(args_list)
        if extra:                         # reported with the subcommand's usage, not the top level's
            p.commands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.fn(args))
    except SystemExit as e:              # argparse (--help: 0, usage errors: 2), or a forwarded main
        return _exit_code(e.code)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except CliError as e:
        print(f"yrcache: {e}", file=sys.stderr)
        return e.code
    except (YrcacheError, ValueError) as e:
        print(f"yrcache: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:
        print(f"yrcache: {_os_error(e)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
