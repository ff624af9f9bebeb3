"""The native kernels on IQ3_XXS and IQ3_S blocks (read natively since they have kernels: no
conversion to Q5_0 at load) against float64 products of the blocks dequantized by gguf-py, at
every ISA level the CPU has, exact and fast mode: dense and chosen rows (odd counts, one row,
none), column ranges, a small batch against stacked single tokens (bit for bit),
dequantization (bit for bit), and the fused FFN step with these types as gate, up, down and
down_t (empty active sets included). gguf-py cannot quantize to these types: the blocks are
random valid bytes (every grid index, sign and sub-block scale) with f16 scales of realistic
size (values up to about 0.3, as a model's weights), and a second set whose sub-block scales
are small and some blocks all zero."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from sparsecore import kernels as K
from sparsecore.tensors import conversion
from tests.fixtures.ffn_checks import assert_ffn_close, check_ffn_token
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures.kernel_checks import as_q8, exact_and_fast_errors, matvec_tol as tol
from tests.fixtures.kernel_files import deq, write_tensors

TYPES = [T.IQ3_XXS, T.IQ3_S]
ROWS = 37
COLS = 768  # 3 blocks of 256: an odd count
BATCHES = [1, 2, 3, 5, 8, 9, 16]
# largest |integer value| of a block (grid value times sub-block scale) per unit of its f16 d:
# IQ3_XXS 62 (0.5 + 15) 0.5, IQ3_S 15 (1 + 2 15)
QMAX = {T.IQ3_XXS: 62 * 15.5 * 0.5, T.IQ3_S: 15 * 31}


def random_blocks(rng, rows: int, cols: int, t: T, size: float = 0.3, small: bool = False) -> np.ndarray:
    """Random valid blocks of t (raw bytes), values up to about +-size: random grid indices,
    signs and sub-block scales, the f16 d of either sign. small: sub-block scales 0..3 and every
    fifth block's d zero."""
    per, nbytes = quants.GGML_QUANT_SIZES[t]
    nb = rows * cols // per
    b = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, nb) * size / QMAX[t] * rng.choice([-1.0, 1.0], nb)
    if small:
        d[::5] = 0
        if t == T.IQ3_XXS:  # the scale: the top 4 bits of each sub-block's word
            b[:, 66 + 3:98:4] &= 0x3f
        else:
            b[:, 106:110] &= 0x33
    b[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    """per type: "r" random valid blocks, "s" small sub-block scales and zero blocks"""
    rng = np.random.default_rng(1)
    arrays = {}
    for t in TYPES:
        arrays[f"r.{t.name}"] = (random_blocks(rng, ROWS, COLS, t), t)
        arrays[f"s.{t.name}"] = (random_blocks(rng, ROWS, COLS, t, small=True), t)
    return write_tensors(tmp_path_factory.mktemp("iq3") / "m.gguf", arrays)


SOURCES = ["r", "s"]
COL_RANGES = [range(256, COLS), range(512, 768), range(0, 256)]


def test_native_not_converted(mats):
    for t in TYPES:
        assert K.supports(t)
        assert K.NATIVE_TYPES[int(t)] == 256
        g = mats[f"r.{t.name}"]
        assert conversion(g) is None  # read as the file holds it
        m = K.FileMatrix(g)
        assert (m.block, m.rows, m.cols) == (256, ROWS, COLS)
        assert m.row_bytes == COLS // 256 * quants.GGML_QUANT_SIZES[t][1]
        assert not m.can_interleave and not m.can_interleave_blocks  # the file's rows only


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_dequantize_equals_gguf(mats, isa, t, src):
    m, w = K.FileMatrix(mats[f"{src}.{t.name}"]), deq(mats[f"{src}.{t.name}"])
    assert np.isfinite(w).all() and np.abs(w).max() > 0.05
    np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))
    np.testing.assert_array_equal(m.dequantize(rows=[4, 1], cols=range(256, 512)), w[[4, 1], 256:512].astype(np.float32))
    assert m.dequantize(rows=[]).shape == (0, m.cols)


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
        np.testing.assert_allclose(got, sel @ x.astype(np.float64), rtol=0, atol=tol(fast, x, w))
    for cols in COL_RANGES:
        xc = x[cols.start:cols.stop]
        got = m.matvec(xc, rows=[36, 0, 7], cols=cols, fast=fast)
        np.testing.assert_allclose(got, w[[36, 0, 7], cols.start:cols.stop] @ xc.astype(np.float64), rtol=0,
                                   atol=tol(fast, x, w))
    with pytest.raises(ValueError, match="whole blocks"):
        m.matvec(x[:128], cols=range(0, 128), fast=fast)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_exact_mode_is_the_dequantized_product(mats, isa, t):
    """Exact mode is float32 rounding away from float64, far below what 8-bit activations cost."""
    m, w = K.FileMatrix(mats[f"r.{t.name}"]), deq(mats[f"r.{t.name}"])
    x = np.random.default_rng(3).standard_normal(m.cols).astype(np.float32)
    exact, fast, scale = exact_and_fast_errors(m, w, x)
    assert exact < 1e-5 * scale < fast


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_fast_mode_error_is_the_activation_quantization(mats, isa, t, src):
    """With x exactly representable in q8 blocks (integers up to 127 in every block of 32, one
    of them 127), fast mode equals the float64 product up to float32 rounding: its grid values,
    signs and sub-block scales are right."""
    m, w = K.FileMatrix(mats[f"{src}.{t.name}"]), deq(mats[f"{src}.{t.name}"])
    x = np.random.default_rng(4).integers(-127, 128, m.cols).astype(np.float32)
    x[::32] = 127
    want = w @ x.astype(np.float64)
    for fast in (False, True):
        np.testing.assert_allclose(m.matvec(x, fast=fast), want, rtol=0, atol=1e-6 * np.abs(w).sum(1).max() * 127)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matmul_equals_stacked_matvec(mats, isa, t, fast):
    """A token's products in a batch are its products alone, bit for bit."""
    m = K.FileMatrix(mats[f"r.{t.name}"])
    rng = np.random.default_rng(5)
    for B in BATCHES:
        X = rng.standard_normal((B, m.cols)).astype(np.float32)
        for rows in (None, [3, 0, 36, 17, 3], []):
            for cols in (None, range(256, m.cols)):
                xc = X if cols is None else np.ascontiguousarray(X[:, cols.start:cols.stop])
                got = m.matmul(xc, rows=rows, cols=cols, fast=fast)
                want = np.stack([m.matvec(xc[i], rows=rows, cols=cols, fast=fast) for i in range(B)])
                assert got.shape == want.shape
                np.testing.assert_array_equal(got, want, err_msg=f"B={B} rows={rows} cols={cols}")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_levels_agree(mats, t):
    """Every ISA level computes the same products within rounding."""
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

# gate, up, down, down_t: one type for all, or a mix with a native type of blocks of 32 as down
FFN_CASES = {t.name: (t, t, t, t) for t in TYPES}
FFN_CASES["mixed"] = (T.IQ3_XXS, T.IQ3_S, T.Q8_0, T.IQ3_XXS)
HIDDEN = 256


def down_block(types) -> int:
    return 256 if types[2] in TYPES else 32


@pytest.fixture(scope="module", params=list(FFN_CASES), ids=list(FFN_CASES))
def ffn(request, tmp_path_factory):
    types = FFN_CASES[request.param]
    rng = np.random.default_rng(7)
    n_ff = 4 * 256
    shapes = {"gate": (n_ff, HIDDEN), "up": (n_ff, HIDDEN), "down": (HIDDEN, n_ff), "down_t": (n_ff, HIDDEN)}
    arrays = {}
    for (n, s), t in zip(shapes.items(), types):
        if t in TYPES:
            arrays[n] = (random_blocks(rng, *s, t, size=0.5), t)
        else:
            arrays[n] = (quants.quantize((rng.standard_normal(s) * 0.2).astype(np.float32), t), t)
    ts = write_tensors(tmp_path_factory.mktemp("f") / "ffn.gguf", arrays)
    return types, {n: K.FileMatrix(ts[n]) for n in ts}, {n: torch.from_numpy(deq(ts[n])) for n in ts}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "middle"])
def test_ffn_token(ffn, isa, fast, which):
    """fast: the reference takes x's 8-bit blocks; which neurons pass depends on the gate's
    product in the mode used: the kernel's own (check_ffn_token's kernel_inputs)"""
    types, m, w = ffn
    n_ff, b = 4 * 256, down_block(types)
    own = range(0, n_ff) if which == "all" else range(b, 3 * b)
    check_ffn_token(m, w, own, np.random.default_rng(8), fast, 0.02 if fast else 1e-5, kernel_inputs=True,
                    empty_mask=True)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_ffn_token_down_transposed(ffn, isa, fast):
    """down_t (a neuron's down column as a row of blocks, read by an axpy per active neuron)"""
    types, m, w = ffn
    n_ff = 4 * 256
    own = range(40, 77)
    rng = np.random.default_rng(9)
    scratch = K.FfnScratch(HIDDEN, len(own))
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    x64 = as_q8(x, fast)
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
    n_ff, b = 4 * 256, down_block(types)
    own = range(b, 3 * b) if down == "down" else range(40, 77)
    rng = np.random.default_rng(10)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    for B in (1, 3, 9, 16):
        X = (rng.standard_normal((B, HIDDEN)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
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
