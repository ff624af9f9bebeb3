"""One token's fast-mode matvec on the file's rows, per block type, from memory: GB/s and
values/s of one core.

    python scripts/bench_block_types.py [--rows 5632 --cols 2048 --matrices 8 --reps 5]
                                        [--types Q4_0 Q4_K Q5_0 Q5_1 IQ4_NL IQ4_XS IQ3_XXS IQ3_S MXFP4 F16 BF16]
                                        [--isa avx2]
                                        [--batches 1 4 8] [--x16]

Random valid blocks (random bits, small f16 scales) of each type (F32, F16, BF16: normal
values) in `--matrices` matrices of the 1.1B shape's up matrix, cycled so that the rows come
from memory, not the caches (8 of them are over 32 MB for every type here); prints the best of
`--reps` passes, per matrix.
`--batches`: also small batches of tokens (one matmul each); `--x16`: also each type's
interleaved rows (FileMatrix.interleave, where the type has them), their time over the file's.
`--isa` runs the kernels at that level on a better CPU (the level is printed)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as T, quants

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsecore import kernels as K  # noqa: E402

# where each type's f16 scales lie in its block (the rest of the bits random): offsets
SCALES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q8_0: (0,), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,),
          T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,)}


FLOAT_TYPES = (T.F32, T.F16, T.BF16)  # no blocks: the values themselves, every mode multiplies as floats


def random_matrix(rng, rows: int, cols: int, t: T) -> SimpleNamespace:
    if t in FLOAT_TYPES:  # normal values (random bits would hold NaNs and, for BF16, subnormals)
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        data = w if t == T.F32 else w.astype(np.float16) if t == T.F16 else (w.view(np.uint32) >> 16).astype(np.uint16)
        return SimpleNamespace(name=f"{t.name}", tensor_type=t, shape=np.array([cols, rows]), data=data)
    per, nbytes = quants.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    if t == T.MXFP4:  # E8M0 scales 2^-10 .. 2^-4 (times values up to 12)
        blocks[:, 0] = rng.integers(118, 125, len(blocks))
    for off in SCALES.get(t, ()):  # small normal f16 values (random bits could be NaN or subnormal)
        blocks[:, off:off + 2] = (rng.uniform(0.5, 1, len(blocks)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return SimpleNamespace(name=f"{t.name}", tensor_type=t, shape=np.array([cols, rows]),
                           data=blocks.reshape(rows, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--matrices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
    ap.add_argument("--isa", choices=["generic", "avx2", "avxvnni", "avx512vnni"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--x16", action="store_true", help="also the interleaved rows (X16) of the types that have them")
    a = ap.parse_args()
    if a.isa and K.set_isa(a.isa) != a.isa:
        raise SystemExit(f"this CPU cannot run the kernels at {a.isa}")
    rng = np.random.default_rng(1)
    X = rng.standard_normal((max(a.batches), a.cols)).astype(np.float32)
    print(f"{a.matrices} matrices of {a.rows} x {a.cols} per type, fast mode, one core, "
          f"best of {a.reps}, kernels at {K.isa()}")
    print(f"{'type':8s} {'layout':6s} {'B':>3s} {'MB':>6s} {'us':>8s} {'GB/s':>6s} {'Gvalues/s':>10s} {'x16/file':>8s}")

    def product(m, B):
        return (lambda: m.matvec(X[0], fast=True)) if B == 1 else (lambda: m.matmul(X[:B], fast=True))

    for name in a.types:
        t = T[name]
        files = [K.FileMatrix(random_matrix(rng, a.rows, a.cols, t)) for _ in range(a.matrices)]
        layouts = [("file", files)]
        if a.x16 and int(t) in K.X16_TYPES:
            layouts.append(("x16", [m.interleave() for m in files]))
        file_us = {}
        for layout, ms in layouts:
            for B in a.batches:
                calls = [product(m, B) for m in ms]
                for c in calls:  # fault the pages in
                    c()
                best = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    for c in calls:
                        c()
                    best = min(best, (time.perf_counter() - t0) / len(ms))
                file_us.setdefault(B, best)
                nbytes = ms[0].data.nbytes
                print(f"{name:8s} {layout:6s} {B:3d} {nbytes / 1e6:6.2f} {best * 1e6:8.0f} {nbytes / best / 1e9:6.2f} "
                      f"{a.rows * a.cols * B / best / 1e9:10.2f} {best / file_us[B]:8.2f}")
        del files, layouts


if __name__ == "__main__":
    main()
