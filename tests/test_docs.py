"""The examples in the docstrings run and print what they say (they are what
the API reference shows), and every public name has a docstring."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

MODULES = ["yrcache.store", "yrcache.store_ops", "yrcache.config", "yrcache.errors", "yrcache.rl.layout",
           "yrcache.rl.publish", "yrcache.rl.subscribe", "yrcache.torch"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} examples in {name} failed (run doctest -v)"


def test_every_public_name_has_a_docstring():
    import yrcache
    import yrcache.rl
    import yrcache.torch

    missing = []
    for mod in (yrcache, yrcache.rl, yrcache.torch):
        for n in mod.__all__:
            obj = getattr(mod, n)
            if not (obj.__doc__ or "").strip():          # its own, not one inherited
                missing.append(f"{mod.__name__}.{n}")
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                for attr, v in inspect.getmembers(obj):
                    if attr.startswith("_") or not (inspect.isfunction(v) or isinstance(v, property)):
                        continue
                    if not (v.__doc__ or "").strip():
                        missing.append(f"{mod.__name__}.{n}.{attr}")
    assert not missing, missing
