"""One token's products on input-major twins (TEAL's input sparsity) against the dense fast
product on the best layout today, from memory: the tables in docs/KERNELS.md under
"Input-major twins (input sparsity)".

    python scripts/bench_input_major.py [--layers 6 --reps 9 --isas avx512vnni,avx2]
    python scripts/bench_input_major.py --sweep      # prefetch distance and target per level
    python scripts/bench_input_major.py --shares [--type Q4_K]  # one process's share, separate and fused twins

Writes `--layers` layers of the 1.1B shape's matrices (q, o 2048 x 2048; k, v 256 x 2048; gate,
up 5632 x 2048; down 2048 x 5632; random Q4_0 blocks) to a temporary GGUF file, holds each
once for fast mode's dense products (FileMatrix.for_fast_products: X16) and once with a twin
(FileMatrix.with_input_major), and times one token through every layer's seven products,
dense and twin interleaved (dense, twin, twin, dense ...), medians of `--reps`; the layers
cycle so that every read comes from memory. Each matrix's input is random normal and its
threshold the quantile that leaves the asked fraction active (independent per input, as
TEAL's magnitudes nearly are). Prints, per level and active fraction, the twin's time as a
fraction of dense, per matrix kind and for the layer, and GB/s of the bytes each side read
(the twin's counted by its counters: active channels' rows and active groups' scales). One
core; nothing here is asserted anywhere.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsecore import kernels as K  # noqa: E402

SHAPES = {"q": (2048, 2048), "k": (256, 2048), "v": (256, 2048), "o": (2048, 2048),
          "gate": (5632, 2048), "up": (5632, 2048), "down": (2048, 5632)}


def random_q4_0(rng, rows: int, cols: int) -> np.ndarray:
    """Random valid Q4_0 blocks (rows, cols / 32 * 18): random nibbles, f16 scales about 0.01"""
    nb = rows * cols // 32
    b = rng.integers(0, 256, size=(nb, 18), dtype=np.uint8)
    b[:, :2] = (rng.uniform(0.005, 0.015, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


# --type: random valid blocks of the type, (bytes per block of 256 values or 32, values per block,
# where its f16 scales lie: (offset, scale)): values about +-0.1
TYPES = {"Q4_0": (18, 32, ((0, 0.01),)), "Q5_0": (22, 32, ((0, 0.005),)),
         "Q4_K": (144, 256, ((0, 0.0005), (2, 0.001))), "Q6_K": (210, 256, ((208, 0.00005),))}


def random_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random valid blocks of `kind` (rows, cols / block * bytes): random quants and packed
    scales, small positive f16 scales"""
    size, block, scales = TYPES[kind]
    nb = rows * cols // block
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off, v in scales:
        b[:, off:off + 2] = (rng.uniform(v / 2, v, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build(tmp: Path, layers: int, rng, kind: str = "Q4_0"):
    path = tmp / "layers.gguf"
    w = GGUFWriter(str(path), "llama")
    qt = GGMLQuantizationType[kind]
    for i in range(layers):
        for name, (r, c) in SHAPES.items():
            w.add_tensor(f"blk.{i}.{name}", random_q4_0(rng, r, c) if kind == "Q4_0" else random_blocks(rng, r, c, kind),
                         raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ts = {t.name: t for t in GGUFReader(path).tensors}
    out = []
    t0 = time.perf_counter()
    for i in range(layers):
        layer = {}
        for name in SHAPES:
            m = K.FileMatrix(ts[f"blk.{i}.{name}"])
            thr = np.zeros(1, np.float32)
            twin = m.with_input_major(None, None, thr)
            layer[name] = (m.for_fast_products(), twin, thr)
        out.append(layer)
    repack_s = time.perf_counter() - t0
    return out, repack_s


# One process's share of the 1.1B shape split over two (half the heads, half the neurons), as
# the engine holds it: Q, K, V rows of its heads, the output's columns of them, gate and up rows
# of its neurons, down's columns of them; fused, Q|K|V and gate|up stacked (one twin each)
SHARES = {"q": (1024, 2048), "k": (128, 2048), "v": (128, 2048), "o": (2048, 1024),
          "gate": (2816, 2048), "up": (2816, 2048), "down": (2048, 2816)}
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gateup": ("gate", "up"), "down": ("down",)}


def shares(tmp: Path, layers: int, reps: int, fractions: list[float], rng, kind: str = "Q4_0") -> None:
    """Per level and active fraction: the share's layer on separate twins and on fused ones,
    against dense X16, one token, every read from memory (the layers cycle), interleaved"""
    path = tmp / "shares.gguf"
    w = GGUFWriter(str(path), "llama")
    for i in range(layers):
        blocks = {name: random_q4_0(rng, r, c) if kind == "Q4_0" else random_blocks(rng, r, c, kind)
                  for name, (r, c) in SHARES.items()}
        for name, b in blocks.items():
            w.add_tensor(f"blk.{i}.{name}", b, raw_dtype=GGMLQuantizationType[kind])
        for name, parts in FUSED.items():  # a fused twin is the twin of its parts' rows stacked
            if len(parts) > 1:
                w.add_tensor(f"blk.{i}.{name}", np.concatenate([blocks[n] for n in parts]),
                             raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ts = {t.name: t for t in GGUFReader(path).tensors}
    thr = np.zeros(1, np.float32)
    sides = {"dense": [], "separate": [], "fused": []}
    for i in range(layers):
        x = {n: rng.standard_normal(c).astype(np.float32) for n, (_, c) in SHARES.items()}
        for n, (r, _) in SHARES.items():
            m = K.FileMatrix(ts[f"blk.{i}.{n}"])
            sides["dense"].append((m.for_fast_products().prepare(range(r), None, fast=True), x[n]))
            sides["separate"].append((m.with_input_major(None, None, thr).prepare(range(r), None, fast=True), x[n]))
        for name, parts in FUSED.items():
            m = K.FileMatrix(ts[f"blk.{i}.{name}"])
            sides["fused"].append((m.with_input_major(None, None, thr).prepare(range(m.rows), None, fast=True),
                                   x[parts[0]]))
    for level in ("avx512vnni", "avx2"):
        if K.set_isa(level) != level:
            continue
        print(f"\nlevel {level}: one process's share (two processes), {layers} layers of {kind}; layer time / dense X16 "
              f"(medians of {reps}, interleaved)")
        print("| active | dense µs | separate twins | fused twins |")
        print("|---|---|---|---|")
        for frac in fractions:
            thr[0] = np.quantile(np.abs(rng.standard_normal(1 << 16)), 1 - frac) if frac < 1 else 0.0
            times = {k: [] for k in sides}
            for rep in range(reps):
                for k in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                    t0 = time.perf_counter()
                    for f, xx in sides[k]:
                        f(xx)
                    times[k].append(time.perf_counter() - t0)
            med = {k: float(np.median(v)) for k, v in times.items()}
            print(f"| {frac:.0%} | {med['dense'] / layers * 1e6:.0f} | {med['separate'] / med['dense']:.2f} | "
                  f"**{med['fused'] / med['dense']:.2f}** |")


def measure(layers, frac: float, reps: int, rng):
    """(median dense s, median twin s per matrix kind and layer, bytes each side read per token)"""
    calls, dense_bytes, xs = [], {k: 0 for k in SHAPES}, []
    for layer in layers:
        dense_fns, twin_fns = [], []
        for name, (dense, twin, thr) in layer.items():
            r, c = SHAPES[name]
            x = rng.standard_normal(c).astype(np.float32)
            thr[0] = np.quantile(np.abs(x), 1 - frac) if frac < 1 else 0.0
            pd, pt = dense.prepare(range(r), None, fast=True), twin.prepare(range(r), None, fast=True)
            dense_fns.append((name, lambda p=pd, x=x: p(x)))
            twin_fns.append((name, lambda p=pt, x=x: p(x)))
            dense_bytes[name] += r * c // dense.block * dense.block_bytes
            xs.append(x)
        calls.append((dense_fns, twin_fns))
    per = {side: {k: [] for k in [*SHAPES, "layer"]} for side in (0, 1)}
    for layer in layers:
        for _, twin, _ in layer.values():
            twin.reset_twin_counts()
    for rep in range(reps):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for side in order:
            tot = {k: 0.0 for k in SHAPES}
            for fns in calls:
                for name, f in fns[side]:
                    t0 = time.perf_counter()
                    f()
                    tot[name] += time.perf_counter() - t0
            for k in SHAPES:
                per[side][k].append(tot[k])
            per[side]["layer"].append(sum(tot.values()))
    twin_bytes = {k: 0 for k in SHAPES}
    for layer in layers:
        for name, (_, twin, _) in layer.items():
            twin_bytes[name] += twin.twin_bytes_read(*twin.reset_twin_counts()) / reps
    n = len(layers)
    med = {side: {k: float(np.median(v)) / n for k, v in per[side].items()} for side in (0, 1)}
    return med, {k: v / n for k, v in dense_bytes.items()}, {k: v / n for k, v in twin_bytes.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--isas", default="avx512vnni,avx2")
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.7, 0.5, 0.3, 0.1])
    ap.add_argument("--sweep", action="store_true", help="prefetch distance (items ahead) and target, at 50 and 30 %%")
    ap.add_argument("--aheads", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--shares", action="store_true", help="one process's share: separate and fused twins")
    ap.add_argument("--type", default="Q4_0", choices=sorted(TYPES), help="the matrices' type (random valid blocks)")
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        if a.shares:
            print(f"{cpu_name()}, one core")
            shares(Path(tmp), a.layers, a.reps, [f for f in a.fractions if f < 1] or [0.5], rng, a.type)
            return
        layers, repack_s = build(Path(tmp), a.layers, rng, a.type)
        print(f"{cpu_name()}, one core; {a.layers} layers of the 1.1B shape ({a.type}), twins repacked in {repack_s:.2f} s "
              f"({repack_s / a.layers * 1000:.0f} ms a layer)")
        for level in a.isas.split(","):
            if K.set_isa(level) != level:
                print(f"this CPU cannot run {level}")
                continue
            if a.sweep:
                default = K._kernels.cols_tune(-1, 0)
                print(f"\nlevel {level}: twin time / dense (X16) time for the layer, by prefetch distance (items) and target")
                print("| ahead | " + " | ".join(f"{f:.0%} L2 | {f:.0%} L1" for f in (0.5, 0.3)) + " |")
                print("|---" * 5 + "|")
                for ahead in a.aheads:
                    cells = []
                    for frac in (0.5, 0.3):
                        for hint in (2, 3):
                            K._kernels.cols_tune(ahead, hint)
                            med, _, _ = measure(layers, frac, a.reps, rng)
                            cells.append(f"{med[1]['layer'] / med[0]['layer']:.3f}")
                    print(f"| {ahead} | " + " | ".join(cells) + " |")
                K._kernels.cols_tune(*default)
                continue
            print(f"\nlevel {level} ({cpu_name()}): twin time / dense X16 time (medians of {a.reps}, interleaved); "
                  f"GB/s of bytes read")
            print("| active | " + " | ".join(SHAPES) + " | layer | dense µs | twin µs | dense GB/s | twin GB/s |")
            print("|---" * (len(SHAPES) + 6) + "|")
            for frac in a.fractions:
                med, db, tb = measure(layers, frac, a.reps, rng)
                ratios = [f"{med[1][k] / med[0][k]:.2f}" for k in SHAPES]
                dgb = sum(db.values()) / med[0]["layer"] / 1e9
                tgb = sum(tb.values()) / med[1]["layer"] / 1e9
                print(f"| {frac:.0%} | " + " | ".join(ratios) + f" | **{med[1]['layer'] / med[0]['layer']:.2f}** | "
                      f"{med[0]['layer'] * 1e6:.0f} | {med[1]['layer'] * 1e6:.0f} | {dgb:.1f} | {tgb:.1f} |")


if __name__ == "__main__":
    main()
