"""Builds the native kernels (sparsecore/kernels/_kernels.c and the parts it includes) and the
tokenizer's merge loop (coordinator/text/bpe_merge.c) when pip installs the project.

Portable flags only: the AVX2 code paths carry their own target attributes and are chosen at
run time by CPU detection, so one build runs on any x86-64 machine (and the C fallback
elsewhere)."""
from pathlib import Path

from setuptools import Extension, setup

# _kernels.c #includes the other parts of the folder (one compilation unit): every one of them a
# dependency, so that editing any part rebuilds the extension
PARTS = sorted(str(p) for pattern in ("*.c", "*.h") for p in Path("sparsecore/kernels").glob(pattern))

setup(ext_modules=[Extension("sparsecore.kernels._kernels", ["sparsecore/kernels/_kernels.c"], depends=PARTS,
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"]),
                   Extension("coordinator.text._bpe", ["coordinator/text/bpe_merge.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall"])])
