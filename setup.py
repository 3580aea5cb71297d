# Only here because cffi's build hook (cffi_modules) needs a setup() call;
# all metadata lives in setup.cfg.  Two extensions: the arena's C core (cffi)
# and the C hot paths of get and put (yrcache/_csrc/fast.c, fast_values.c, fast_wire.c, fast_own.c,
# fast_serve.c and fast_round.c, plain CPython API).
from setuptools import Extension, setup

setup(
    cffi_modules=["yrcache/_build_arena.py:ffibuilder"],
    ext_modules=[Extension("yrcache._fast", ["yrcache/_csrc/fast.c", "yrcache/_csrc/fast_values.c",
                                              "yrcache/_csrc/fast_wire.c", "yrcache/_csrc/fast_own.c",
                                              "yrcache/_csrc/fast_serve.c", "yrcache/_csrc/fast_round.c"],
                           include_dirs=["yrcache/_csrc"], depends=["yrcache/_csrc/arena.h", "yrcache/_csrc/fast.h"], extra_compile_args=["-O2", "-Wall"])],
)
