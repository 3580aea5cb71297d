"""The package's layers (docs/architecture.md): data flows down only.

facade (store.py) -> placement.py -> mover.py / hbm.py -> tiers/ -> C core,
with one Python module, tiers/dram.py, calling the C core; rl/, torch.py and
cli.py sit on the public API.  Checked on the source, imports inside
functions included (only ``if TYPE_CHECKING:`` blocks are left out).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "yrcache"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, node: ast.ImportFrom, is_pkg: bool) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_pkg else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    names = [f"{base}.{a.name}" for a in node.names]
    return [base] + names


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    skip: set[int] = set()
    for node in ast.walk(tree):   # typing-only imports create no runtime edge
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.update(_resolve(module, node, path.name == "__init__.py"))
    return {m for m in out if m == "yrcache" or m.startswith("yrcache.")}


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}
KNOWN = set(MODULES) | {"yrcache._arena"}


def graph() -> dict[str, set[str]]:
    g = {}
    for name, path in MODULES.items():
        deps = set()
        for imp in _imports(path):
            while imp not in KNOWN and "." in imp:   # `from pkg import name` names a member
                imp = imp.rsplit(".", 1)[0]
            if imp != name and imp in KNOWN:
                deps.add(imp)
        g[name] = deps
    return g


def test_no_import_cycles():
    g = graph()
    g = {m: {d for d in deps if d != "yrcache"} for m, deps in g.items()}   # the package root re-exports
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_only_the_arena_interface_calls_the_c_core():
    users = sorted(m for m, deps in graph().items() if "yrcache._arena" in deps)
    assert users == ["yrcache.tiers.dram"], users
    callers = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "lib.yr_" in p.read_text())
    assert callers == ["tiers/dram.py"], callers


def test_tiers_never_reach_up():
    up = {"yrcache.store", "yrcache.placement", "yrcache.mover", "yrcache.hbm", "yrcache.rl", "yrcache.cli"}
    for m, deps in graph().items():
        if m.startswith("yrcache.tiers"):
            assert not {d for d in deps if any(d == u or d.startswith(u + ".") for u in up)}, (m, deps)


def test_rl_uses_only_the_public_api():
    internal = {"yrcache.store", "yrcache.placement", "yrcache.mover", "yrcache.hbm", "yrcache.tiers",
                "yrcache._arena"}
    for m, deps in graph().items():
        if m.startswith("yrcache.rl"):
            bad = {d for d in deps if any(d == i or d.startswith(i + ".") for i in internal)}
            assert not bad, (m, bad)
    for p in (PKG / "rl").rglob("*.py"):
        src = p.read_text()
        assert "._a." not in src and "store._" not in src, f"{p.name} reaches into the store's privates"


def test_no_module_is_over_about_600_lines():
    sources = list(PKG.rglob("*.py")) + list((PKG / "_csrc").glob("*.[ch]"))   # not cffi's generated _arena.c
    big = {str(p.relative_to(PKG)): n for p in sources if (n := len(p.read_text().splitlines())) > 640}
    assert not big, big


def test_importing_the_package_loads_nothing_it_does_not_need():
    """``import yrcache`` (every DataLoader and rollout worker pays it) loads neither
    torch (imported on first use) nor cffi's C parser (``cffi.FFI()`` would load
    pycparser, ~30 ms; the compiled core's ``ffi`` serves) nor ``numpy.ma``."""
    from procs import fresh_python
    script = ("import sys, yrcache, yrcache.rl, yrcache.cluster.store\n"
              "print(sorted(m for m in ('torch', 'pycparser', 'numpy.ma') if m in sys.modules))")
    out = fresh_python(script)
    assert out.strip() == "[]", out
