"""cffi API-mode build of ``ucm._native`` (used by setup.py through ``cffi_modules``).

The cdef is read from the block between ``CFFI-BEGIN`` and ``CFFI-END`` in
``native/ucm_native.h`` so the header stays the single source of truth. The
sha256 of the C sources is compiled in (``UCM_NATIVE_SOURCE_DIGEST``) so that
``ucm.fast.native`` can detect a stale extension next to newer sources.
"""
import hashlib
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("ucm_native.h", "ucm_native.c")


def source_digest(root=HERE):
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def cdef_from_header(path=os.path.join(HERE, "ucm_native.h")):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"/\* CFFI-BEGIN \*/(.*?)/\* CFFI-END \*/", text, re.S)
    if not m:
        raise RuntimeError(f"{path}: CFFI-BEGIN/CFFI-END markers not found")
    return m.group(1)


ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header())
ffibuilder.set_source(
    "ucm._native",
    '#include "ucm_native.h"',
    # setuptools wants paths relative to setup.py.
    sources=[os.path.relpath(os.path.join(HERE, "ucm_native.c"))],
    include_dirs=[os.path.relpath(HERE)],
    define_macros=[("UCM_NATIVE_SOURCE_DIGEST", '"%s"' % source_digest())],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-Wall", "-Wextra"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
