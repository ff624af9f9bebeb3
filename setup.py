"""Builds the native kernels (sparsecore/kernels/_kernels.c) when pip installs the project.

Portable flags only: the AVX2 code paths carry their own target attributes and are chosen at
run time by CPU detection, so one build runs on any x86-64 machine (and the C fallback
elsewhere)."""
from pathlib import Path

from setuptools import Extension, setup

setup(ext_modules=[Extension("sparsecore.kernels._kernels", ["sparsecore/kernels/_kernels.c"],
                             depends=sorted(str(p) for p in Path("sparsecore/kernels").glob("*.c")),
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"])])
