"""cffi build script for the arena's C core (run by ``pip install``)."""

import os

from cffi import FFI

_here = os.path.dirname(os.path.abspath(__file__))
_csrc = os.path.join(_here, "_csrc")

with open(os.path.join(_csrc, "arena.h")) as f:
    _header = f.read()

ffibuilder = FFI()
ffibuilder.cdef("\n".join(line for line in _header.splitlines()
                          if not line.startswith("/*") and not line.startswith(" *")))
ffibuilder.set_source(
    "yrcache._arena",
    '#include "arena.h"',
    sources=[os.path.relpath(os.path.join(_csrc, f"{name}.c"))
             for name in ("arena", "heap", "index", "sorted", "procs", "objects", "iter", "recovery", "os")],
    include_dirs=[os.path.relpath(_csrc)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
