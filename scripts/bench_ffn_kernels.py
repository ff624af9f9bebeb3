#!/usr/bin/env python3
"""Which weight format and kernel should a worker use for its FFN rows? Measure, do not guess.

One call = one decode token through one layer of one worker: gate and up rows (n x hidden),
down columns stored as rows (down_t, n x hidden), for all owned neurons (dense) or a random
active subset gathered by index (mask steps; threshold steps gather the same way for up/down).
The calls cycle through --layers distinct layers so the weights come from memory, not cache,
as they do in the engine. Methods run interleaved in a shuffled order on every repeat; the
table gives median microseconds per call, the ratio to float32 and the weight bytes touched.

    PYTHONPATH=. python3 scripts/bench_ffn_kernels.py --rows 768,1536 --threads 1,2
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

mm8 = torch.ops.aten._weight_int8pack_mm


def q8_rows(w: torch.Tensor):
    """int8 with one float32 scale per row (symmetric, max |w| -> 127)."""
    s = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / s[:, None]).to(torch.int8), s


# Each method: prep(gate, up, down_t) -> layer state; run(state, x, active or None) -> y (1, hidden).

def f32_prep(g, u, d):
    return g, u, d


def f32_run(st, x, a):
    g, u, d = st
    if a is not None:
        g, u, d = g.index_select(0, a), u.index_select(0, a), d.index_select(0, a)
    return (F.silu(x @ g.T) * (x @ u.T)) @ d


def bf16_prep(g, u, d):
    return g.bfloat16(), u.bfloat16(), d.bfloat16()


def bf16_run(st, x, a):  # bf16 weights and bf16 compute (AMX/avx512_bf16 through oneDNN)
    g, u, d = st
    if a is not None:
        g, u, d = g.index_select(0, a), u.index_select(0, a), d.index_select(0, a)
    xb = x.bfloat16()
    return ((F.silu(xb @ g.T) * (xb @ u.T)) @ d).float()


def bf16up_run(st, x, a):  # bf16 weights, upcast the gathered rows, float32 compute
    g, u, d = st
    if a is not None:
        g, u, d = g.index_select(0, a), u.index_select(0, a), d.index_select(0, a)
    return (F.silu(x @ g.float().T) * (x @ u.float().T)) @ d.float()


def bf16mv_prep(g, u, d):
    return g.bfloat16(), u.bfloat16(), d.T.contiguous().bfloat16()


def bf16mv_run(st, x, a):
    """bf16 weights through torch.mv (a gemv path, unlike matmul's 1-row gemm); down kept as
    (hidden x n) so it is a gemv too, sparse steps gather its columns."""
    g, u, d = st
    if a is not None:
        g, u, d = g.index_select(0, a), u.index_select(0, a), d.index_select(1, a)
    xb = x[0].bfloat16()
    h = F.silu(torch.mv(g, xb)) * torch.mv(u, xb)
    return torch.mv(d, h).float()[None]


def i8cast_prep(g, u, d):
    return q8_rows(g), q8_rows(u), q8_rows(d)


def i8cast_run(st, x, a):  # gather int8 rows, .float(), matmul, times the row scales
    (g, gs), (u, us), (d, ds) = st
    if a is not None:
        g, gs, u, us = g.index_select(0, a), gs.index_select(0, a), u.index_select(0, a), us.index_select(0, a)
        d, ds = d.index_select(0, a), ds.index_select(0, a)
    h = F.silu((x @ g.float().T) * gs) * ((x @ u.float().T) * us)
    return (h * ds) @ d.float()


def i8pack_prep(g, u, d):
    return q8_rows(g), q8_rows(u), q8_rows(d)


def i8pack_run(st, x, a):
    """gate/up: _weight_int8pack_mm on the gathered int8 rows. down: the neuron scales fold into
    h, then the gathered down_t rows transposed (hidden x n_active) go through the same kernel."""
    (g, gs), (u, us), (d, ds) = st
    if a is not None:
        g, gs, u, us = g.index_select(0, a), gs.index_select(0, a), u.index_select(0, a), us.index_select(0, a)
        d, ds = d.index_select(0, a), ds.index_select(0, a)
    h = F.silu(mm8(x, g, gs)) * mm8(x, u, us)
    return mm8(h * ds, d.T.contiguous(), torch.ones(d.shape[1]))


def i8packdn_prep(g, u, d):
    """As i8pack, but down kept as (hidden x n) int8 with one scale per hidden row, so dense
    steps need no transpose; sparse steps gather columns."""
    dq, ds = q8_rows(d.T.contiguous())
    return q8_rows(g), q8_rows(u), (dq, ds)


def i8packdn_run(st, x, a):
    (g, gs), (u, us), (d, ds) = st
    if a is not None:
        g, gs, u, us = g.index_select(0, a), gs.index_select(0, a), u.index_select(0, a), us.index_select(0, a)
        d = d.index_select(1, a)
    h = F.silu(mm8(x, g, gs)) * mm8(x, u, us)
    return mm8(h, d, ds)


def i8fused_prep(g, u, d):
    """int8pack with gate and up interleaved in one matrix: one gather and one kernel call."""
    (gq, gs), (uq, us) = q8_rows(g), q8_rows(u)
    n = g.shape[0]
    return torch.stack([gq, uq], 1).reshape(2 * n, -1), torch.stack([gs, us], 1).reshape(-1), q8_rows(d)


def i8fused_run(st, x, a):
    gu, gus, (d, ds) = st
    if a is not None:
        a2 = torch.stack([2 * a, 2 * a + 1], 1).reshape(-1)
        gu, gus = gu.index_select(0, a2), gus.index_select(0, a2)
        d, ds = d.index_select(0, a), ds.index_select(0, a)
    gu = mm8(x, gu, gus).view(1, -1, 2)
    h = F.silu(gu[..., 0]) * gu[..., 1]
    return mm8(h * ds, d.T.contiguous(), torch.ones(d.shape[1]))


def _blocks_rows(w):
    """Affine codes in blocks of 32 along each row, as GGUF's Q4_1/Q5_1/Q8_0 gate/up rows are
    (w = code * d + m per block): the shape an exact copy of the file's blocks would have."""
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    mn, mx = wg.amin(-1), wg.amax(-1)
    d = ((mx - mn) / 15).clamp(min=1e-12)
    return torch.round((wg - mn[..., None]) / d[..., None]).to(torch.int8).reshape(n, k), d, mn


def _blocks_cols(w):
    """down_t rows (neurons): the file's blocks run across 32 neighbouring neurons, so the
    (d, m) tables have one row per block of neurons, gathered by neuron // 32."""
    q, d, m = _blocks_rows(w.T.contiguous())
    return q.T.contiguous(), d.T.contiguous(), m.T.contiguous()


def blocks_prep(g, u, d):
    return _blocks_rows(g), _blocks_rows(u), _blocks_cols(d)


def _deq_rows(q, d, m):
    n, k = q.shape
    return torch.addcmul(m[..., None], q.view(n, -1, GROUP).float(), d[..., None]).view(n, k)


def blocks_run(st, x, a):
    (gq, gd, gm), (uq, ud, um), (dq, dd, dm) = st
    if a is not None:
        gq, gd, gm = gq.index_select(0, a), gd.index_select(0, a), gm.index_select(0, a)
        uq, ud, um = uq.index_select(0, a), ud.index_select(0, a), um.index_select(0, a)
        b = a // GROUP
        dq, dd, dm = dq.index_select(0, a), dd.index_select(0, b), dm.index_select(0, b)
    else:
        b = torch.arange(dq.shape[0]) // GROUP
        dd, dm = dd.index_select(0, b), dm.index_select(0, b)
    h = F.silu(x @ _deq_rows(gq, gd, gm).T) * (x @ _deq_rows(uq, ud, um).T)
    return h @ torch.addcmul(dm, dq.float(), dd)


def w8a8_prep(g, u, d):
    return q8_rows(g), q8_rows(u), q8_rows(d.T.contiguous())


def _qx(x):
    s = (x.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(x / s).to(torch.int8), s


def w8a8_run(st, x, a):
    """int8 activations too (per-token scale), torch._int_mm (VNNI/AMX int8): not exact vs the
    dequantized weights, listed to see whether it would pay."""
    (g, gs), (u, us), (d, ds) = st
    if a is not None:
        g, gs, u, us = g.index_select(0, a), gs.index_select(0, a), u.index_select(0, a), us.index_select(0, a)
        d = d.index_select(1, a)
    xq, xs = _qx(x)
    h = F.silu(torch._int_mm(xq, g.T) * (xs * gs)) * (torch._int_mm(xq, u.T) * (xs * us))
    hq, hs = _qx(h)
    return torch._int_mm(hq, d.T) * (hs * ds)


GROUP = 32


def _q4(w):
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    sc = ((mx - mn) / 15).clamp(min=1e-12)
    q = torch.round((wg - mn) / sc).clamp(0, 15).to(torch.int32).reshape(n, k)
    # the kernel computes (q - 8) * scale + zero, so zero is the group minimum plus 8 steps
    sz = torch.stack([sc.squeeze(-1).T, (mn + 8 * sc).squeeze(-1).T], -1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def i4_prep(g, u, d):
    return _q4(g), _q4(u), _q4(d.T.contiguous())


def i4_run(st, x, a):
    """int4 groupwise (torch's tinygemm CPU kernel). Its packing interleaves blocks of 64 rows,
    so a row subset cannot be gathered from it: dense only."""
    assert a is None
    (g, gz), (u, uz), (d, dz) = st
    h = F.silu(torch.ops.aten._weight_int4pack_mm_for_cpu(x, g, GROUP, gz)) * \
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, u, GROUP, uz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(h, d, GROUP, dz)


def i4nib_prep(g, u, d):
    out = []
    for w in (g, u, d):
        q, s = q8_rows(w)
        q = (torch.round(w / (s[:, None] * 127 / 7)).clamp(-8, 7).to(torch.int8) + 8).to(torch.uint8)
        out.append(((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), s * 127 / 7))
    return out


def _unpack4(p):
    lo = (p & 15).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(p.shape[0], -1)


def i4nib_run(st, x, a):
    """int4 per-row, two nibbles a byte in plain row order (gatherable), unpacked in torch."""
    (g, gs), (u, us), (d, ds) = st
    if a is not None:
        g, gs, u, us = g.index_select(0, a), gs.index_select(0, a), u.index_select(0, a), us.index_select(0, a)
        d, ds = d.index_select(0, a), ds.index_select(0, a)
    h = F.silu(mm8(x, _unpack4(g), gs)) * mm8(x, _unpack4(u), us)
    return mm8(h * ds, _unpack4(d).T.contiguous(), torch.ones(x.shape[1]))


METHODS = {
    "f32": (f32_prep, f32_run),
    "bf16": (bf16_prep, bf16_run),
    "bf16->f32": (bf16_prep, bf16up_run),
    "bf16 mv": (bf16mv_prep, bf16mv_run),
    "i8 cast": (i8cast_prep, i8cast_run),
    "i8 pack": (i8pack_prep, i8pack_run),
    "q4 blocks": (blocks_prep, blocks_run),
    "i8 pack dn-cols": (i8packdn_prep, i8packdn_run),
    "i8 pack fused": (i8fused_prep, i8fused_run),
    "w8a8 int_mm": (w8a8_prep, w8a8_run),
    "i4 tinygemm": (i4_prep, i4_run),
    "i4 nibble": (i4nib_prep, i4nib_run),
}


def state_bytes(st) -> int:
    if isinstance(st, torch.Tensor):
        return st.numel() * st.element_size()
    return sum(state_bytes(s) for s in st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="768,1536", help="owned neurons per worker (comma list)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30, help="distinct layers cycled through per call set")
    ap.add_argument("--fracs", default="1,0.5,0.2", help="active fractions; 1 = dense step, no gather")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    names = args.methods.split(",")
    torch.manual_seed(0)
    random.seed(0)
    x = torch.randn(1, args.hidden)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"hidden {args.hidden}, {args.layers} layers cycled, median of {args.repeats} interleaved repeats")
    for n in map(int, args.rows.split(",")):
        # weights with roughly the spread of a real FFN (SmolLM2 rows have std ~0.03-0.1)
        raw = [[torch.randn(n, args.hidden) * 0.05 for _ in range(3)] for _ in range(args.layers)]
        states = {m: [METHODS[m][0](*w) for w in raw] for m in names}
        ref_y = f32_run(raw[0], x, None)
        for m in names:  # a correctness glance: relative error of a dense step vs float32
            y = METHODS[m][1](states[m][0], x, None)
            err = float((y - ref_y).norm() / ref_y.norm())
            print(f"  rows {n}: {m:16s} weight MB/layer {state_bytes(states[m][0]) / 1e6:6.2f}  rel err {err:.1e}")
        for t in map(int, args.threads.split(",")):
            torch.set_num_threads(t)
            for frac in map(float, args.fracs.split(",")):
                k = round(n * frac)
                usable = [m for m in names if frac == 1 or m != "i4 tinygemm"]
                times = {m: [] for m in usable}
                warm = [None if frac == 1 else torch.arange(k) for _ in range(args.layers)]
                for m in usable:  # first calls pay for oneDNN primitive creation and page faults
                    for layer in range(args.layers):
                        METHODS[m][1](states[m][layer], x, warm[layer])
                for _ in range(args.repeats):
                    actives = [None if frac == 1 else torch.randperm(n)[:k].sort().values for _ in range(args.layers)]
                    for m in random.sample(usable, len(usable)):
                        run, st = METHODS[m][1], states[m]
                        t0 = time.perf_counter()
                        for layer in range(args.layers):
                            run(st[layer], x, actives[layer])
                        times[m].append((time.perf_counter() - t0) / args.layers * 1e6)
                base = statistics.median(times["f32"]) if "f32" in times else None
                print(f"\nrows {n}, active {frac:.0%} ({k}), {t} thread(s)")
                print(f"  {'method':16s} {'median us':>10s} {'vs f32':>7s} {'weight KB touched':>18s}")
                for m in usable:
                    med = statistics.median(times[m])
                    touched = state_bytes(states[m][0]) * frac / 1e3
                    print(f"  {m:16s} {med:10.1f} {med / base if base else float('nan'):7.2f} {touched:18.0f}")


if __name__ == "__main__":
    main()
