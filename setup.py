# Only here because cffi's build hook (cffi_modules) needs a setup() call;
# all metadata lives in setup.cfg.
from setuptools import setup

setup(cffi_modules=["yrcache/_build_arena.py:ffibuilder"])
