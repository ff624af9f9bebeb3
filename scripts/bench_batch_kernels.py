#!/usr/bin/env python3
"""What does decoding B sequences together cost per token? One layer's FFN (one process owning
every neuron, one thread) through the native kernels for B = 1 (ffn_token) and B = 2..16
(ffn_batch: each row read once for all B tokens), and, for comparison, the dequantize-tile +
torch GEMM path that batches took before (and prefill still takes).

The weights are random valid blocks in memory shaped like the model's (no file needed);
calls cycle through enough layers that the weights come from DRAM, as in the engine. All
methods run interleaved in a shuffled order on every repeat; the table gives each method's
per-token cost as a ratio to B=1 of the same shape and mode, measured in the same run (the
machines are shared: absolute figures are printed but only the ratios are comparable).
With --isas, the kernel methods run once per instruction set (set_isa before each call, all
interleaved): "vs first B=1" is the cost against the first ISA's B=1 of the same mode.

    PYTHONPATH=. python3 scripts/bench_batch_kernels.py [--reps 15] [--shapes smol-q4_1,smol-q8_0,1.1b-q4_0]
    PYTHONPATH=. python3 scripts/bench_batch_kernels.py --modes fast --isas avx2,avx512vnni --gemm ""
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from sparsecore import kernels as K
from sparsecore.ffn import ffn_partial

BLOCK = {2: (32, 18), 3: (32, 20), 8: (32, 34)}  # Q4_0, Q4_1, Q8_0: values, bytes per block
TYPE_ID = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
SHAPES = {"smol": (576, 1536), "1.1b": (2048, 5632)}  # hidden, n_ff


def random_matrix(rng, name: str, rows: int, cols: int, t: int) -> K.FileMatrix:
    """Random blocks with small positive f16 scales (|value| ~ 0.1), as a FileMatrix over memory."""
    vals, nbytes = BLOCK[t]
    nb = rows * cols // vals
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.5, 1, nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if t == 3:  # Q4_1's min
        raw[:, 2:4] = (-rng.uniform(0.5, 1, nb) * 0.08).astype(np.float16).view(np.uint8).reshape(nb, 2)
    tensor = SimpleNamespace(name=name, tensor_type=t, shape=[cols, rows], data=raw.reshape(rows, -1))
    return K.FileMatrix(tensor)


def gemm_step(layer, x: torch.Tensor, tiles, chunk: int = 512) -> torch.Tensor:
    """The tile path of sparsecore.shard.FileLayer.step (what T > 1 took before ffn_batch)."""
    gate, up, down = layer
    hidden = gate.cols
    y = torch.zeros(x.shape)
    for a in range(0, gate.rows, chunk):
        rows = range(a, min(a + chunk, gate.rows))
        n = len(rows) * hidden
        g = torch.from_numpy(gate.dequantize(rows, out=tiles[0][:n]))
        u = torch.from_numpy(up.dequantize(rows, out=tiles[1][:n]))
        d = torch.from_numpy(down.dequantize(cols=rows, out=tiles[2][:n])).T
        y += ffn_partial(x, g, u, d, "silu")
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smol-q4_1,smol-q8_0,1.1b-q4_0")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--gemm", default="4,16", help="batch sizes also timed on the dequantize+GEMM path")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--mbytes", type=int, default=64, help="weight bytes per shape, cycled (beyond the caches)")
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="per method over the repeats (min: less at the mercy of other load on a shared machine)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (time.thread_time), not counting time other processes take the core")
    ap.add_argument("--isas", default="", help="comma-separated ISAs to compare (default: the one import picked)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    gemms = [int(b) for b in args.gemm.split(",") if b]
    stat = statistics.median if args.stat == "median" else min
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    isas = [i for i in args.isas.split(",") if i] or [K.isa()]
    for i in isas:
        if K.set_isa(i) != i:
            raise SystemExit(f"this CPU has no {i}")
    print(f"isas {','.join(isas)}, 1 thread, reps {args.reps}, {args.stat} of the repeats, {args.clock} clock")
    for spec in args.shapes.split(","):
        shape, tname = spec.split("-")
        hidden, n_ff = SHAPES[shape]
        t = TYPE_ID[tname]
        per_layer = 3 * hidden * n_ff // BLOCK[t][0] * BLOCK[t][1]
        n_layers = max(2, args.mbytes * 2**20 // per_layer)
        layers = [(random_matrix(rng, "gate", n_ff, hidden, t), random_matrix(rng, "up", n_ff, hidden, t),
                   random_matrix(rng, "down", hidden, n_ff, t)) for _ in range(n_layers)]
        scratch = K.FfnScratch(hidden, n_ff)
        tiles = [np.empty(512 * hidden, np.float32) for _ in range(3)]
        xs = {b: (rng.standard_normal((b, hidden)) * 0.5).astype(np.float32) for b in set(batches) | set(gemms)}
        own = range(0, n_ff)
        methods = {}
        for isa in isas:
            for mode in args.modes.split(","):
                fast = mode == "fast"
                for b in batches:
                    if b == 1:
                        methods[(isa, mode, "kernel", b)] = lambda L, x=xs[1][0], f=fast: K.ffn_token(
                            *L, x, own, "silu", scratch, fast=f)
                    else:
                        methods[(isa, mode, "kernel", b)] = lambda L, x=xs[b], f=fast: K.ffn_batch(
                            *L, x, own, "silu", scratch, fast=f)
        for b in gemms:
            methods[(isas[0], "exact", "gemm", b)] = lambda L, x=torch.from_numpy(xs[b]): gemm_step(L, x, tiles)
        times = {k: [] for k in methods}
        keys = list(methods)
        for _ in range(args.reps):
            random.shuffle(keys)
            for k in keys:
                fn = methods[k]
                K.set_isa(k[0])
                t0 = clock()
                for L in layers:
                    fn(L)
                times[k].append((clock() - t0) / len(layers))
        print(f"\n{spec}: hidden {hidden}, n_ff {n_ff}, {per_layer / 2**20:.1f} MiB a layer, {n_layers} layers cycled")
        print(f"{'isa':10} {'mode':6} {'path':7} {'B':>3} {'us/call':>9} {'us/token':>9} {'per-token vs B=1':>17} "
              f"{'tok/s vs B=1':>13} {'tok/s vs first B=1':>19}")
        for mode in args.modes.split(","):
            first = stat(times[(isas[0], mode, "kernel", 1)])
            for isa in isas:
                base = stat(times[(isa, mode, "kernel", 1)])
                for k in sorted((k for k in methods if k[:2] == (isa, mode)), key=lambda k: (k[2], k[3])):
                    med = stat(times[k])
                    per_tok = med / k[3]
                    print(f"{isa:10} {mode:6} {k[2]:7} {k[3]:>3} {med * 1e6:9.0f} {per_tok * 1e6:9.1f} "
                          f"{per_tok / base:17.3f} {base / per_tok:13.2f} {first / per_tok:19.2f}")
    K.set_isa(isas[0] if len(isas) == 1 else K.isa())


if __name__ == "__main__":
    main()
