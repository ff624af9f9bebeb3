"""Fast-mode dense products on X16 rows (FileMatrix.interleave) against the file's rows, per
block type and batch size, from memory: docs/kernels.md's table of X16 over the file layout.

    python scripts/bench_x16_types.py [--types Q2_K Q3_K Q4_K] [--batches 1 4 8] [--isa avx2]
                                      [--rows 5632 --cols 2048 --matrices 8 --reps 7]

Random valid blocks of each type (scripts/bench_block_types.py's) in `--matrices` matrices of
the 1.1B shape's up matrix, cycled so that the rows come from memory; per batch size the two
layouts run alternately, `--reps` passes each, and the best pass per matrix is printed (us)
with X16's time over the file layout's. One core. `--isa` runs the kernels at that level on a
better CPU (printed with the table)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_block_types import SCALES, random_matrix  # noqa: E402
from sparsecore import kernels as K  # noqa: E402

SCALES.setdefault(T.Q2_K, (80, 82))
SCALES.setdefault(T.Q3_K, (108,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--matrices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--types", nargs="+", default=["Q2_K", "Q3_K", "Q4_K"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--isa", choices=["avx2", "avxvnni", "avx512vnni"])
    a = ap.parse_args()
    if a.isa and K.set_isa(a.isa) != a.isa:
        raise SystemExit(f"this CPU cannot run the kernels at {a.isa}")
    if not K.interleaving():
        raise SystemExit(f"the kernels run at {K.isa()}: no interleaved tiles")
    rng = np.random.default_rng(1)
    print(f"{a.matrices} matrices of {a.rows} x {a.cols} per type, fast mode, one core, us per matrix, "
          f"best of {a.reps}, kernels at {K.isa()}")
    print("| type | tokens | file layout | X16 | X16 / file |")
    print("|---|---|---|---|---|")
    for name in a.types:
        t = T[name]
        files = [K.FileMatrix(random_matrix(rng, a.rows, a.cols, t)) for _ in range(a.matrices)]
        layouts = {"file": files, "x16": [m.interleave() for m in files]}
        for B in a.batches:
            X = rng.standard_normal((B, a.cols)).astype(np.float32)
            best = dict.fromkeys(layouts, float("inf"))
            for _ in range(a.reps):
                for lay, ms in layouts.items():
                    t0 = time.perf_counter()
                    for m in ms:
                        if B == 1:
                            m.matvec(X[0], fast=True)
                        else:
                            m.matmul(X, fast=True)
                    best[lay] = min(best[lay], (time.perf_counter() - t0) / len(ms))
            print(f"| {name} | {B} | {best['file'] * 1e6:.0f} | {best['x16'] * 1e6:.0f} | "
                  f"{best['x16'] / best['file']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
