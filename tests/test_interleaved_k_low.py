"""Q2_K and Q3_K rows interleaved 16 by 16 (FileMatrix.interleave, interleaved_generic.c
interleave_k23): fast mode's dense products against float64 products of gguf-py's dequantized
blocks and the 8-bit activations every fast kernel uses, and against the file layout's products;
a token alone equals it in any batch bit for bit, and every ISA level gives the portable lanes'
floats; odd row counts, ranges starting on any group, held rows and columns, dequantization,
and the fused FFN step with interleaved gate, up and down of these types (and a *_K_M mix).

Two kinds of matrices per type, as tests/test_kernels_k_low.py: quantized normal values and
random valid blocks (every bit pattern: Q3_K's negative scales, any high-bit mask, Q2_K's mins)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures.kernel_checks import check_product
from tests.fixtures.kernel_files import deq, ffn_matrices, ffn_shapes, k_low_matrices, write_tensors

TYPES = [T.Q2_K, T.Q3_K]
SOURCES = ["quantized", "random"]
BATCHES = [1, 2, 3, 4, 5, 8, 9, 16]  # the 256-bit tiles take 4 tokens, the 512-bit ones 8
ROWS, COLS = 53, 768  # three groups and 5 rows; 3 blocks of 256
LEVELS = ("generic", "avx2", "avxvnni", "avx512vnni")


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    arrays = k_low_matrices(np.random.default_rng(60), ROWS, COLS)
    return write_tensors(tmp_path_factory.mktemp("x16k") / "m.gguf", arrays)


def tokens(rng, B: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((B, cols)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_interleaved_products_are_the_dequantized_ones(mats, isa, t, src):
    tensor = mats[f"{t.name}.{src}"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    p = m.interleave()
    extra = 64 * (m.cols // 256) if t == T.Q3_K else 0  # its 6-bit scales a byte each, per group block
    assert p.interleaved and p.data.nbytes == 4 * (16 * m.row_bytes + extra)  # 4 groups
    assert m.can_interleave == K.interleaving(t) and K.interleaving(t) == (isa != "generic")
    x = np.random.default_rng(61).standard_normal(m.cols).astype(np.float32)
    for rows in (None, range(16, 53), range(0, 5), range(32, 48), range(48, 53), range(16, 16)):
        sel = w if rows is None else w[rows.start:rows.stop]
        got = p.matvec(x, rows=rows, fast=True)
        assert got.shape == (len(sel),)
        check_product(got, sel, x)
        # the file's layout computes the same integers; only the float order differs
        file_y = m.matvec(x, rows=rows, fast=True)
        np.testing.assert_allclose(got, file_y, rtol=0, atol=1e-5 * (np.abs(file_y).max(initial=0) + 1e-3))
    # fast mode's error is the activations' 8 bits against the float products
    want = w @ x.astype(np.float64)
    assert np.abs(p.matvec(x, fast=True) - want).max() <= np.abs(w).sum(axis=1).max() * np.abs(x).max() / 127
    for cols in (range(256, 768), range(512, 768)):
        xc = np.ascontiguousarray(x[cols.start:cols.stop])
        check_product(p.matvec(xc, cols=cols, rows=range(0, 53), fast=True), w[:, cols.start:cols.stop], xc)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_token_alone_equals_it_in_any_batch_and_on_every_isa(mats, t, src):
    """matmul's tiles (4 or 8 tokens) against matvec, bit for bit, on each level; then every
    level against the first one run (the portable lanes): the same floats."""
    m = K.FileMatrix(mats[f"{t.name}.{src}"])
    p = m.interleave()
    rng = np.random.default_rng(62)
    default = K.isa()
    results, levels = {}, []
    try:
        for level in LEVELS:
            if K.set_isa(level) != level:
                continue
            levels.append(level)
            for B in BATCHES:
                X = tokens(rng, B, m.cols)
                for rows in (None, range(16, 53), range(48, 53)):
                    got = p.matmul(X, rows=rows, fast=True).copy()
                    alone = np.stack([p.matvec(X[b], rows=rows, fast=True) for b in range(B)])
                    np.testing.assert_array_equal(got, alone, err_msg=f"{level} B={B} rows={rows}")
                    results.setdefault((B, rows), []).append((level, X, got))
            call = p.prepare_batch(rows=range(16, 53), fast=True)
            np.testing.assert_array_equal(call(X), p.matmul(X, rows=range(16, 53), fast=True))
        assert len(levels) > 1 or K.isa() == "generic"
        for (B, rows), runs in results.items():  # every level's inputs on every level: the same floats
            for level in levels:
                K.set_isa(level)
                for first, X, got in runs:
                    np.testing.assert_array_equal(p.matmul(X, rows=rows, fast=True), got,
                                                  err_msg=f"{level} against {first}, B={B} rows={rows}")
    finally:
        K.set_isa(default)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_held_rows_and_columns_interleave_by_their_numbers(mats, isa, t):
    m = K.FileMatrix(mats[f"{t.name}.random"])
    whole = m.interleave()
    x = np.random.default_rng(63).standard_normal(m.cols).astype(np.float32)
    rows = m.keep_rows(range(16, 53)).interleave()
    np.testing.assert_array_equal(rows.matvec(x, rows=range(16, 53), fast=True),
                                  whole.matvec(x, rows=range(16, 53), fast=True))
    np.testing.assert_array_equal(rows.matvec(x, rows=range(32, 40), fast=True),
                                  whole.matvec(x, rows=range(32, 40), fast=True))
    held = range(256, 512)
    cols = m.keep_columns(held).interleave()
    xc = np.ascontiguousarray(x[held.start:held.stop])
    np.testing.assert_array_equal(cols.matvec(xc, cols=held, fast=True), whole.matvec(xc, cols=held, fast=True))
    np.testing.assert_array_equal(cols.dequantize(rows=range(0, 53), cols=held), m.dequantize(cols=held))
    with pytest.raises(ValueError, match="start on a multiple of 16"):
        m.keep_rows(range(8, 53)).interleave()


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_interleaved_dequantize_is_the_files(mats, t, src):
    tensor = mats[f"{t.name}.{src}"]
    m = K.FileMatrix(tensor)
    p = m.interleave()
    got = p.dequantize(rows=range(0, 53))
    np.testing.assert_array_equal(got, m.dequantize())
    np.testing.assert_array_equal(got, deq(tensor).astype(np.float32))
    cols = range(256, 768)
    np.testing.assert_array_equal(p.dequantize(rows=range(48, 53), cols=cols), m.dequantize(rows=range(48, 53), cols=cols))


# ---- the FFN step on interleaved gate, up and down ---------------------------------------------

HIDDEN, N_FF = 512, 512  # down's rows are N_FF long: whole K blocks
MIXES = {"Q2_K": (T.Q2_K, T.Q2_K, T.Q2_K), "Q3_K": (T.Q3_K, T.Q3_K, T.Q3_K),
         # a *_K_M file's mix: gate, up and down of different types, each its own X16 layout
         "Q3_K-Q3_K-Q4_K": (T.Q3_K, T.Q3_K, T.Q4_K), "Q2_K-Q3_K-Q6_K": (T.Q2_K, T.Q3_K, T.Q6_K)}


@pytest.fixture(scope="module", params=list(MIXES))
def ffn(request, tmp_path_factory):
    """gate, up (N_FF, HIDDEN) and down (HIDDEN, N_FF) of the mix's types: FileMatrix each, and
    their dequantized values (float64 tensors)"""
    from tests.fixtures.tiny_gguf import quantize_k
    rng = np.random.default_rng(64)
    types = dict(zip(("gate", "up", "down"), MIXES[request.param]))
    arrays = {n: (quantize_k((rng.standard_normal(s) * 0.2).astype(np.float32), types[n]), types[n])
              for n, s in ffn_shapes(HIDDEN, N_FF).items()}
    return ffn_matrices(tmp_path_factory.mktemp("xf") / "ffn.gguf", arrays)


@pytest.mark.parametrize("own", [range(0, N_FF), range(256, N_FF)], ids=str)
def test_interleaved_ffn_step_is_the_dense_ffn(ffn, isa, own):
    """ffn_token on interleaved gate rows, up rows and down columns against the float64 FFN of
    the dequantized blocks (fast mode's tolerance) and the file layout's step; ffn_batch equal
    to it token for token, bit for bit."""
    m, w = ffn
    gate, up, down = (m["gate"].keep_rows(own).interleave(), m["up"].keep_rows(own).interleave(),
                      m["down"].keep_columns(own).interleave())
    rng = np.random.default_rng(65)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    owned = torch.zeros(N_FF, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for B in (1, 3, 8, 9):
        X = tokens(rng, B, HIDDEN)
        y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, fast=True)
        assert n == B * len(own)
        for b in range(B):
            alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", one, fast=True)
            np.testing.assert_array_equal(y[b], alone, err_msg=f"B={B} token {b}")
            assert nb == len(own)
            want = ffn_dense_reference(torch.from_numpy(X[b].astype(np.float64))[None], w["gate"], w["up"],
                                       w["down"], "silu", owned)[0].numpy()
            assert np.abs(alone - want).max() <= 0.05 * (np.abs(want).max() + 1e-3)
            file_y, _ = K.ffn_token(m["gate"], m["up"], m["down"], X[b], own, "silu", one, fast=True)
            np.testing.assert_allclose(alone, file_y, rtol=0, atol=2e-3 * np.abs(file_y).max())


def test_interleaved_q3_k_refuses_what_the_layout_cannot(mats):
    p = K.FileMatrix(mats["Q3_K.random"]).interleave()
    x = np.zeros(COLS, np.float32)
    with pytest.raises(ValueError, match="ranges starting on 16 rows"):
        p.matvec(x, rows=range(5, 20), fast=True)
    with pytest.raises(ValueError, match="fast-mode"):
        p.matvec(x)
