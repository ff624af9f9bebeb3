"""Fast-mode products of picked rows on each row layout, from memory: the table in docs/KERNELS.md
under "Rows picked by activity, R16".

    python scripts/bench_row_layouts.py [--rows 5632 --cols 2048 --matrices 30 --reps 5]

Writes `--matrices` random Q4_0 matrices (the 1.1B shape's up matrix by default, 30 of them
cycling so that every read comes from memory, not the caches) to a temporary GGUF file, then
for each fraction of rows picked at random (sorted, as a step lists them) prints the best of
`--reps` per-matrix times: the file's layout, rows with their blocks interleaved (R16), and
X16 (16 rows side by side) reading every row. One core; run two at once to see two processes
share the memory system. Needs AVX2 or AVX-512 VNNI for the interleaved layouts; `--isa avx2`
runs the kernels at that level on a better CPU (the level is printed with the table).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsecore import kernels as K  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--matrices", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    ap.add_argument("--isa", choices=["avx2", "avxvnni", "avx512vnni"], help="kernel level (default: the best this CPU has)")
    a = ap.parse_args()
    if a.isa and K.set_isa(a.isa) != a.isa:
        raise SystemExit(f"this CPU cannot run the kernels at {a.isa}")
    if not (K.interleaving() and K.blocked_rows()):
        raise SystemExit(f"this CPU runs the kernels at {K.isa()}: the interleaved layouts need avx2 or avx512vnni")
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.gguf"
        w = GGUFWriter(str(path), "llama")
        q4_0 = GGMLQuantizationType.Q4_0
        for i in range(a.matrices):
            m = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
            w.add_tensor(f"w{i}", quants.quantize(m, q4_0), raw_dtype=q4_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tensors = GGUFReader(path).tensors
        layouts = {"file layout": [K.FileMatrix(t) for t in tensors],
                   "R16": [K.FileMatrix(t).interleave_blocks() for t in tensors],
                   "X16, every row": [K.FileMatrix(t).interleave() for t in tensors]}
        x = rng.standard_normal(a.cols).astype(np.float32)
        out = np.empty(a.rows, np.float32)
        print(f"{a.matrices} Q4_0 matrices of {a.rows} x {a.cols}, us per matrix, best of {a.reps}, kernels at {K.isa()}")
        print("| rows picked | " + " | ".join(layouts) + " |")
        print("|---" * (len(layouts) + 1) + "|")
        for frac in a.fractions:
            rows = np.sort(rng.permutation(a.rows)[:int(a.rows * frac)]).astype(np.int32)
            cells = []
            for name, ms in layouts.items():
                best = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    for m in ms:
                        if name.startswith("X16"):
                            m.matvec(x, fast=True, out=out)
                        else:
                            m.matvec(x, rows=rows, fast=True, out=out)
                    best = min(best, time.perf_counter() - t0)
                cells.append(f"{best / len(ms) * 1e6:.0f}")
            print(f"| {frac:.0%} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
