"""Builds the native kernels and the tokenizer's merge loop (coordinator/text/bpe_merge.c) when
pip installs the project. The kernels: one extension of three compilation units,
sparsecore/kernels/_kernels.c (the portable kernels, the products' loops, the Python module),
simd_avx2.c and simd_avx512.c (each instruction set's kernels and its part of the kernel table),
each #including the parts it needs.

Portable flags only, the same for every unit: the SIMD functions carry their own target
attributes and are chosen at run time by CPU detection (the kernel table), so one build runs on
any x86-64 machine; elsewhere the SIMD units are empty and the portable kernels run.
-fvisibility=hidden: the units share the level flags and their fill functions, not the world."""
from pathlib import Path

from setuptools import Extension, setup

KERNELS = Path("sparsecore/kernels")
UNITS = [str(KERNELS / u) for u in ("_kernels.c", "simd_avx2.c", "simd_avx512.c")]
# every part of the folder is a dependency (the units #include them), so that editing any part
# rebuilds the extension
PARTS = sorted(str(p) for pattern in ("*.c", "*.h") for p in KERNELS.glob(pattern))

setup(ext_modules=[Extension("sparsecore.kernels._kernels", UNITS, depends=PARTS,
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function",
                                                 "-fvisibility=hidden"]),
                   Extension("coordinator.text._bpe", ["coordinator/text/bpe_merge.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall"])])
