"""The native kernels on Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4 blocks (read natively: no conversion at
load) against float64 products of the blocks dequantized by gguf-py, at every ISA level the CPU
has, exact and fast mode: dense and chosen rows (odd counts, one row, none), column ranges, a
small batch against stacked single tokens (bit for bit), dequantization, and the fused FFN
step with these types as gate, up, down and down_t (empty active sets included). The blocks
come from round-to-nearest quantizers (gguf-py's for Q5_0 and Q5_1, tests/fixtures/quant_q5_iq4
for IQ4_NL and IQ4_XS, which gguf-py cannot quantize to) and from random bytes (every index,
high bit and sub-block scale)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures import quant_q5_iq4 as Q
from tests.fixtures.ffn_checks import assert_ffn_close, check_ffn_token
from tests.fixtures.kernel_checks import BATCHES, as_q8, exact_and_fast_errors, matvec_tol
from tests.fixtures.kernel_files import deq, ffn_matrices, ffn_shapes, write_tensors

TYPES = list(Q.TYPES)
ROWS = 37


def cols_of(t: T) -> int:
    """an odd number of blocks per row: 25 of 32, or 3 of 256"""
    return 768 if Q.block_values(t) == 256 else 800


# ---- the quantizers write what gguf-py reads ------------------------------------------------

@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantizer_round_trips_through_gguf(t):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 512)) * np.repeat(rng.uniform(0.05, 3, (5, 16)), 32, axis=1)
    a[1, :32] = 0  # an all-zero block
    blocks = Q.quantize(a, t)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, 512 // Q.block_values(t) * quants.GGML_QUANT_SIZES[t][1])
    back = quants.dequantize(blocks, t).reshape(a.shape)
    assert (back[1, :32] == 0).all()
    # per block the error is a fraction of the block's largest value: a step of 1/16 (Q5: the
    # clipped top), 14/127 (the codebook's clipped top, 113 of 127); IQ4_XS's 6-bit sub-block
    # scales add half a step of 1/32 of the 256 values' largest
    b = Q.block_values(t)
    err = np.abs(back - a).reshape(-1, b).max(axis=1) / (np.abs(a).reshape(-1, b).max(axis=1) + 1e-30)
    # MXFP4: E2M1's largest step (8 to 12) is a quarter of the block's power of two
    assert err.max() < {T.Q5_0: 0.07, T.Q5_1: 0.07, T.IQ4_NL: 0.12, T.IQ4_XS: 0.14, T.MXFP4: 0.26}[t]
    rel = np.linalg.norm(back - a) / np.linalg.norm(a)
    assert rel < (0.05 if t in (T.Q5_0, T.Q5_1) else 0.15 if t == T.MXFP4 else 0.1)


# ---- matrix products -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    """per type: "q" a quantized random normal matrix, "r" random valid blocks"""
    rng = np.random.default_rng(1)
    arrays = {}
    for t in TYPES:
        arrays[f"q.{t.name}"] = (Q.quantize(rng.standard_normal((ROWS, cols_of(t))), t), t)
        arrays[f"r.{t.name}"] = (Q.random_blocks(rng, ROWS, cols_of(t), t), t)
    return write_tensors(tmp_path_factory.mktemp("q5iq4") / "m.gguf", arrays)


SOURCES = ["q", "r"]


def col_ranges(t: T) -> list[range]:
    b, n = Q.block_values(t), cols_of(t)
    return [range(b, n), range(2 * b, 3 * b), range(0, b)]


def test_native_and_block_sizes(mats):
    for t in TYPES:
        assert K.supports(t)
        m = K.FileMatrix(mats[f"q.{t.name}"])
        b = Q.block_values(t)
        assert (m.block, m.rows, m.cols) == (b, ROWS, cols_of(t))
        assert m.row_bytes == cols_of(t) // b * quants.GGML_QUANT_SIZES[t][1]
        # X16 (tests/test_interleaved) where the level has interleaved tiles; no R16
        assert m.can_interleave == K.interleaving(t) and not m.can_interleave_blocks


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matvec_rows_and_columns(mats, isa, t, src, fast):
    m, w = K.FileMatrix(mats[f"{src}.{t.name}"]), deq(mats[f"{src}.{t.name}"])
    x = np.random.default_rng(2).standard_normal(m.cols).astype(np.float32)
    for rows in (None, range(5, 12), [36], [3, 0, 36, 17, 3], []):
        got = m.matvec(x, rows=rows, fast=fast)
        sel = w if rows is None else w[list(rows)]
        assert got.shape == (len(sel),)
        np.testing.assert_allclose(got, sel @ x.astype(np.float64), rtol=0, atol=matvec_tol(fast, x, w))
    for cols in col_ranges(t):
        xc = x[cols.start:cols.stop]
        got = m.matvec(xc, rows=[36, 0, 7], cols=cols, fast=fast)
        np.testing.assert_allclose(got, w[[36, 0, 7], cols.start:cols.stop] @ xc.astype(np.float64), rtol=0,
                                   atol=matvec_tol(fast, x, w))
    with pytest.raises(ValueError, match="whole blocks"):
        m.matvec(x[:16], cols=range(0, 16), fast=fast)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_exact_mode_is_the_dequantized_product(mats, isa, t):
    """Exact mode is float32 rounding away from float64, far below what 8-bit activations cost."""
    m, w = K.FileMatrix(mats[f"q.{t.name}"]), deq(mats[f"q.{t.name}"])
    x = np.random.default_rng(3).standard_normal(m.cols).astype(np.float32)
    exact, fast, scale = exact_and_fast_errors(m, w, x)
    assert exact < 1e-5 * scale < fast


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_fast_mode_error_is_the_activation_quantization(mats, isa, t, src):
    """With x exactly representable in q8 blocks (integers up to 127 in every block of 32, one
    of them 127), fast mode equals the float64 product up to float32 rounding: its integer
    sums, offsets (Q5_0's -16) and mins (Q5_1's) are right."""
    m, w = K.FileMatrix(mats[f"{src}.{t.name}"]), deq(mats[f"{src}.{t.name}"])
    x = np.random.default_rng(4).integers(-127, 128, m.cols).astype(np.float32)
    x[::32] = 127
    want = w @ x.astype(np.float64)
    for fast in (False, True):
        np.testing.assert_allclose(m.matvec(x, fast=fast), want, rtol=0, atol=1e-6 * np.abs(w).sum(1).max() * 127)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_dequantize_equals_gguf(mats, isa, t, src):
    m, w = K.FileMatrix(mats[f"{src}.{t.name}"]), deq(mats[f"{src}.{t.name}"])
    assert np.isfinite(w).all() and np.abs(w).max() > 0.05
    np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))
    b = Q.block_values(t)
    np.testing.assert_array_equal(m.dequantize(rows=[4, 1], cols=range(b, 2 * b)), w[[4, 1], b:2 * b].astype(np.float32))
    assert m.dequantize(rows=[]).shape == (0, m.cols)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matmul_equals_stacked_matvec(mats, isa, t, fast):
    """A token's products in a batch are its products alone, bit for bit."""
    m = K.FileMatrix(mats[f"r.{t.name}"])
    rng = np.random.default_rng(5)
    b = Q.block_values(t)
    for B in BATCHES:
        X = rng.standard_normal((B, m.cols)).astype(np.float32)
        for rows in (None, [3, 0, 36, 17, 3], []):
            for cols in (None, range(b, m.cols)):
                xc = X if cols is None else np.ascontiguousarray(X[:, cols.start:cols.stop])
                got = m.matmul(xc, rows=rows, cols=cols, fast=fast)
                want = np.stack([m.matvec(xc[i], rows=rows, cols=cols, fast=fast) for i in range(B)])
                assert got.shape == want.shape
                np.testing.assert_array_equal(got, want, err_msg=f"B={B} rows={rows} cols={cols}")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_levels_agree(mats, t):
    """Every ISA level computes the same products within rounding (exact: float32 summation
    order; fast: the same integer sums, scaled in another order)."""
    m = K.FileMatrix(mats[f"r.{t.name}"])
    x = np.random.default_rng(6).standard_normal(m.cols).astype(np.float32)
    from tests.conftest import runnable_isas
    default = K.isa()
    got = {}
    try:
        for level in runnable_isas():
            K.set_isa(level)
            got[level] = (m.matvec(x).copy(), m.matvec(x, fast=True).copy())
    finally:
        K.set_isa(default)
    ref = got["generic"]
    scale = np.abs(ref[0]).max()
    for level, (exact, fast) in got.items():
        np.testing.assert_allclose(exact, ref[0], rtol=0, atol=1e-5 * scale, err_msg=level)
        np.testing.assert_allclose(fast, ref[1], rtol=0, atol=1e-5 * scale, err_msg=level)


# ---- the fused FFN step ----------------------------------------------------------------------

# gate, up, down, down_t: one type for all, or a mix (IQ4_XS rows of 256 values, down in blocks of 32)
FFN_CASES = {t.name: (t, t, t, t) for t in TYPES}
FFN_CASES["mixed"] = (T.IQ4_XS, T.Q5_0, T.Q5_1, T.IQ4_NL)


def ffn_dims(types) -> tuple[int, int, int]:
    """(hidden, n_ff, block of down's columns): 4 blocks of down's row of neurons"""
    hidden = 256 if T.IQ4_XS in types else 64
    b = Q.block_values(types[2])
    return hidden, 4 * max(b, 32), b


@pytest.fixture(scope="module", params=list(FFN_CASES), ids=list(FFN_CASES))
def ffn(request, tmp_path_factory):
    types = FFN_CASES[request.param]
    rng = np.random.default_rng(7)
    hidden, n_ff, b = ffn_dims(types)
    shapes = ffn_shapes(hidden, n_ff, down_t=True)
    arrays = {n: (Q.quantize(rng.standard_normal(s) * 0.2, t), t) for (n, s), t in zip(shapes.items(), types)}
    return (types, *ffn_matrices(tmp_path_factory.mktemp("f") / "ffn.gguf", arrays))


def own_range(types, which: str) -> range:
    _, _, b = ffn_dims(types)
    return {"all": range(0, 4 * b), "middle": range(b, 3 * b), "last": range(3 * b, 4 * b)}[which]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "middle", "last"])
def test_ffn_token(ffn, isa, fast, which):
    """fast: the reference takes x's 8-bit blocks (the error left is h's 8-bit blocks, down's
    products); which neurons pass depends on the gate's product in the mode used: the kernel's own"""
    types, m, w = ffn
    check_ffn_token(m, w, own_range(types, which), np.random.default_rng(8), fast, 0.02 if fast else 1e-5,
                    kernel_inputs=True, empty_mask=True)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "unaligned"])
def test_ffn_token_down_transposed(ffn, isa, fast, which):
    """down_t (a neuron's down column as a row of blocks, read by an axpy per active neuron)"""
    types, m, w = ffn
    hidden, n_ff, _ = ffn_dims(types)
    own = range(0, n_ff) if which == "all" else range(40, 77)
    rng = np.random.default_rng(9)
    scratch = K.FfnScratch(hidden, len(own))
    x = rng.standard_normal(hidden).astype(np.float32)
    x64 = as_q8(x, fast)  # down_t's axpy takes h as it is: fast mode's only error is x's 8 bits
    owned = torch.zeros(n_ff, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for mask in (None, (rng.random(n_ff) < 0.1).astype(np.uint8), np.zeros(n_ff, np.uint8)):
        active = owned if mask is None else owned * torch.from_numpy(mask.astype(np.float64))
        y, n = K.ffn_token(m["gate"], m["up"], m["down_t"], x, own, "relu", scratch, mask=mask, fast=fast,
                           down_t=True)
        want = ffn_dense_reference(x64, w["gate"], w["up"], w["down_t"].T, "relu", active)[0].numpy()
        assert n == int(active.sum())
        assert_ffn_close(y, want, 1e-5)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("down", ["down", "down_t"])
def test_ffn_batch_equals_stacked_ffn_token(ffn, isa, fast, down):
    """Every token of a batch gets what ffn_token gives it alone, bit for bit: dense, a
    threshold per token, a mask, nothing active."""
    types, m, _ = ffn
    hidden, n_ff, b = ffn_dims(types)
    own = range(b, 3 * b) if down == "down" else range(40, 77)
    rng = np.random.default_rng(10)
    scratch, one = K.FfnScratch(hidden, len(own)), K.FfnScratch(hidden, len(own))
    for B in (1, 3, 9, 16):
        X = (rng.standard_normal((B, hidden)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        per_token = rng.uniform(0.0, 0.1, B).astype(np.float32)
        per_token[::3] = -1.0  # those tokens dense
        cases = {"dense": (None, None), "threshold per token": (per_token, None),
                 "mask": (None, (rng.random(n_ff) < 0.3).astype(np.uint8)), "nothing active": (1e9, None)}
        for name, (thr, mask) in cases.items():
            y, n = K.ffn_batch(m["gate"], m["up"], m[down], X, own, "silu", scratch, threshold=thr, mask=mask,
                               fast=fast, down_t=down == "down_t")
            total = 0
            for i in range(B):
                tb = thr if thr is None or np.isscalar(thr) else float(thr[i])
                tb = None if tb is not None and tb < 0 else tb
                want, ni = K.ffn_token(m["gate"], m["up"], m[down], X[i], own, "silu", one, threshold=tb, mask=mask,
                                       fast=fast, down_t=down == "down_t")
                np.testing.assert_array_equal(y[i], want, err_msg=f"{name} B={B} token {i}")
                total += ni
            assert n == total, name
            if name == "nothing active":
                assert n == 0 and not y.any()
