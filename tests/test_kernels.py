"""The native kernels (sparsecore/kernels) against float64 products of the blocks dequantized by
gguf-py (an implementation nobody here wrote), for every native type, in both ISAs, exact and
fast mode: dense and chosen rows (odd counts, one row, none), column ranges, the fused FFN step
dense, thresholded and masked (empty active sets included). gguf-py cannot quantize to the
K-quants (Q4_K, Q5_K, Q6_K): their tensors are random valid blocks written raw, and gguf-py's
dequantizer is still the oracle."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures.ffn_checks import check_ffn_token
from tests.fixtures.kernel_checks import BATCHES, exact_and_fast_errors, matvec_tol
from tests.fixtures.kernel_files import deq, ffn_matrices, ffn_shapes, random_kquant, write_tensors

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0]
KTYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {f"w.{t.name}": (rng.standard_normal((37, 96)), t) for t in TYPES}
    return write_tensors(tmp_path_factory.mktemp("k") / "m.gguf", arrays)


def tol(fast: bool, t: T, x, w) -> float:
    """Exact mode: float32 summation error. Fast mode: 8-bit activations (llama.cpp's error)."""
    return matvec_tol(fast and t not in FLOAT_TYPES, x, w)


def check_matvec(m: K.FileMatrix, w: np.ndarray, x: np.ndarray, t: T, fast: bool, col_ranges) -> None:
    """Chosen rows (all, a range, one, repeated and out of order, none) and column ranges."""
    for rows in (None, range(5, 12), [36], [3, 0, 36, 17, 3], []):
        got = m.matvec(x, rows=rows, fast=fast)
        sel = w if rows is None else w[list(rows)]
        want = sel @ x.astype(np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=tol(fast, t, x, w))
    for cols in col_ranges:  # whole blocks of the columns (the FFN's down over owned neurons)
        xc = x[cols.start:cols.stop]
        got = m.matvec(xc, rows=range(0, 37), cols=cols, fast=fast)
        np.testing.assert_allclose(got, w[:, cols.start:cols.stop] @ xc.astype(np.float64), rtol=0,
                                   atol=tol(fast, t, x, w))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matvec_rows_and_columns(mats, isa, t, fast):
    x = np.random.default_rng(1).standard_normal(96).astype(np.float32)
    check_matvec(K.FileMatrix(mats[f"w.{t.name}"]), deq(mats[f"w.{t.name}"]), x, t, fast, [range(32, 96)])


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_rows_of_every_width_and_batch(tmp_path, isa, t):
    """F16 and BF16 rows are read in runs of 32 values (four chains), then 8, then one by one:
    widths that end in each of those loops, one token and batches (each row of a batch is the
    token alone, bit for bit), against float64; and converted to float32 for a prompt's GEMM
    (dequantize) as gguf-py converts them."""
    rng = np.random.default_rng(3)
    widths = (5, 8, 40, 100, 2053)
    tensors = write_tensors(tmp_path / "w.gguf", {f"w{n}": (rng.standard_normal((9, n)), t) for n in widths})
    for n in widths:
        m, w = K.FileMatrix(tensors[f"w{n}"]), deq(tensors[f"w{n}"])
        xs = rng.standard_normal((5, n)).astype(np.float32)
        alone = np.stack([m.matvec(x) for x in xs])
        np.testing.assert_allclose(alone, xs.astype(np.float64) @ w.T, rtol=0, atol=tol(False, t, xs[0], w))
        np.testing.assert_array_equal(m.matmul(xs), alone)
        np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))  # a prompt's GEMM tiles


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(mats, isa, t):
    m = K.FileMatrix(mats[f"w.{t.name}"])
    w = deq(mats[f"w.{t.name}"])
    np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))
    np.testing.assert_array_equal(m.dequantize(rows=[4, 1], cols=range(32, 64)), w[[4, 1], 32:64].astype(np.float32))


def test_exact_mode_is_the_dequantized_product(mats, isa):
    """Exact mode differs from the float64 product of the dequantized values by float32 rounding
    only, far below what 8-bit activations cost."""
    m, w = K.FileMatrix(mats["w.Q4_0"]), deq(mats["w.Q4_0"])
    x = np.random.default_rng(2).standard_normal(96).astype(np.float32)
    exact, fast, scale = exact_and_fast_errors(m, w, x)
    assert exact < 1e-4 * scale < fast


def test_activation_quantization_is_the_same_on_every_isa(isa):
    """The 8-bit activation blocks (fast mode) equal numpy's round-half-even of x / d, d = max|x|
    / 127 per block of 32, on every ISA: ties, a zero block, tiny and huge values."""
    rng = np.random.default_rng(30)
    x = (rng.standard_normal(32 * 64) * np.repeat(10.0 ** rng.integers(-6, 6, 64), 32)).astype(np.float32)
    x[32:64] = 0
    x[64:96] = np.arange(-16, 16) * 0.5  # x / d lands on halves: ties round to even
    x[96] = 127 * 4
    d, s, q = K.quantize_q8(x)
    xb = x.reshape(-1, 32)
    want_d = np.abs(xb).max(axis=1) / np.float32(127)
    inv = np.where(want_d > 0, np.float32(1) / np.where(want_d > 0, want_d, 1), 0).astype(np.float32)
    want_q = np.rint(xb * inv[:, None]).astype(np.int8)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_q.astype(np.int32).sum(axis=1))


def test_bad_arguments_are_refused(mats):
    m = K.FileMatrix(mats["w.Q8_0"])
    x = np.zeros(96, np.float32)
    with pytest.raises(ValueError, match="row index"):
        m.matvec(x, rows=[37])
    with pytest.raises(ValueError, match="whole blocks"):
        m.matvec(x[:16], cols=range(0, 16))
    with pytest.raises(ValueError, match="x has"):
        m.matvec(x[:64])


@pytest.fixture(scope="module")
def kmats(tmp_path_factory):
    rng = np.random.default_rng(10)
    arrays = {f"w.{t.name}": (random_kquant(rng, 37, 768, t), t) for t in KTYPES}
    return write_tensors(tmp_path_factory.mktemp("kq") / "k.gguf", arrays)


def test_kquant_block_sizes(kmats):
    for t in KTYPES:
        m = K.FileMatrix(kmats[f"w.{t.name}"])
        assert (m.block, m.row_bytes) == (256, 3 * quants.GGML_QUANT_SIZES[t][1])
        assert (m.rows, m.cols) == (37, 768)


@pytest.mark.parametrize("t", KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_kquant_matvec_rows_and_columns(kmats, isa, t, fast):
    m = K.FileMatrix(kmats[f"w.{t.name}"])
    x = np.random.default_rng(11).standard_normal(768).astype(np.float32)
    check_matvec(m, deq(kmats[f"w.{t.name}"]), x, t, fast, [range(256, 768), range(256, 512)])
    with pytest.raises(ValueError, match="whole blocks of 256"):
        m.matvec(x[:32], cols=range(0, 32))


@pytest.mark.parametrize("t", KTYPES, ids=lambda t: t.name)
def test_kquant_fast_mode_error_is_the_activation_quantization(kmats, isa, t):
    """Fast mode's only error is x's 8-bit quantization: with x exactly representable in q8
    blocks (integers up to 127 in every block of 32, one of them 127), fast equals exact up to
    float rounding."""
    m, w = K.FileMatrix(kmats[f"w.{t.name}"]), deq(kmats[f"w.{t.name}"])
    rng = np.random.default_rng(12)
    x = rng.integers(-127, 128, 768).astype(np.float32)
    x[::32] = 127
    want = w @ x.astype(np.float64)
    for fast in (False, True):
        np.testing.assert_allclose(m.matvec(x, fast=fast), want, rtol=0, atol=1e-6 * np.abs(w).sum(1).max() * 127)


@pytest.mark.parametrize("t", KTYPES, ids=lambda t: t.name)
def test_kquant_dequantize_equals_gguf(kmats, isa, t):
    m = K.FileMatrix(kmats[f"w.{t.name}"])
    w = deq(kmats[f"w.{t.name}"])
    assert np.isfinite(w).all() and np.abs(w).max() > 0.05
    np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))
    np.testing.assert_array_equal(m.dequantize(rows=[4, 1], cols=range(256, 512)), w[[4, 1], 256:512].astype(np.float32))


# ---- the fused FFN step ----------------------------------------------------------------------

def ffn_dims(t: T) -> tuple[int, int, int]:
    """(hidden, n_ff, block): 4 blocks of down's row of neurons, whole K blocks for the K types"""
    return (256, 1024, 256) if t in KTYPES else (64, 128, 32)


@pytest.fixture(scope="module", params=[T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.F32] + KTYPES, ids=lambda t: t.name)
def ffn(request, tmp_path_factory):
    t = request.param
    rng = np.random.default_rng(3)
    hidden, n_ff, _ = ffn_dims(t)
    shapes = ffn_shapes(hidden, n_ff, down_t=True)
    if t in KTYPES:
        arrays = {n: (random_kquant(rng, *s, t, size=0.2), t) for n, s in shapes.items()}
    else:
        arrays = {n: (rng.standard_normal(s) * 0.2, t) for n, s in shapes.items()}
    return (t, *ffn_matrices(tmp_path_factory.mktemp("f") / "ffn.gguf", arrays))


def own_range(t: T, which: str) -> range:
    """all neurons, the middle two blocks, the last block (blocks of 32, or 256 for K types)"""
    _, _, b = ffn_dims(t)
    return {"all": range(0, 4 * b), "middle": range(b, 3 * b), "last": range(3 * b, 4 * b)}[which]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "middle", "last"])
def test_ffn_token(ffn, isa, fast, which):
    t, m, w = ffn
    check_ffn_token(m, w, own_range(t, which), np.random.default_rng(4), fast,
                    0.05 if fast and t not in FLOAT_TYPES else 1e-5)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["middle", "last"])
def test_ffn_token_with_its_down_columns_held(ffn, isa, fast, which):
    """A shard holding its columns of down (FileLayer: FileMatrix.keep_columns) computes bit for
    bit what it computes on the file's down, alone and in a batch."""
    t, m, _ = ffn
    hidden, _, _ = ffn_dims(t)
    own = own_range(t, which)
    held = m["down"].keep_columns(own)
    x = np.random.default_rng(23).standard_normal((3, hidden)).astype(np.float32)
    for thr in (None, 0.05):
        a = K.ffn_token(m["gate"], m["up"], m["down"], x[0], own, "silu", K.FfnScratch(hidden, len(own)),
                        threshold=thr, fast=fast)
        b = K.ffn_token(m["gate"], m["up"], held, x[0], own, "silu", K.FfnScratch(hidden, len(own)),
                        threshold=thr, fast=fast)
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1] == b[1]
        a = K.ffn_batch(m["gate"], m["up"], m["down"], x, own, "silu", K.FfnScratch(hidden, len(own)),
                        threshold=thr, fast=fast)
        b = K.ffn_batch(m["gate"], m["up"], held, x, own, "silu", K.FfnScratch(hidden, len(own)),
                        threshold=thr, fast=fast)
        np.testing.assert_array_equal(a[0], b[0])


def test_ffn_token_alignment_is_down_blocks(ffn):
    """down's columns (the neurons) are read in whole blocks: a range must start on one"""
    t, m, _ = ffn
    hidden, n_ff, b = ffn_dims(t)
    scratch = K.FfnScratch(hidden, n_ff)
    x = np.zeros(hidden, np.float32)
    with pytest.raises(ValueError, match=f"{b}-aligned range"):
        K.ffn_token(m["gate"], m["up"], m["down"], x, range(b // 2, n_ff), "silu", scratch)
    if b > 32:
        with pytest.raises(ValueError, match=f"{b}-aligned range"):
            K.ffn_token(m["gate"], m["up"], m["down"], x, range(32, n_ff), "silu", scratch)
    K.ffn_token(m["gate"], m["up"], m["down_t"], x, range(b // 2, n_ff), "silu", scratch, down_t=True)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "unaligned"])
def test_ffn_token_down_transposed(ffn, isa, fast, which):
    """PowerInfer's layout: down stored transposed (a neuron's column is a row of blocks), read
    only for active neurons by an axpy each; any range of neurons, no alignment needed."""
    t, m, w = ffn
    HIDDEN, N_FF, _ = ffn_dims(t)
    own = range(0, N_FF) if which == "all" else range(40, 77)
    rng = np.random.default_rng(5)
    scratch = K.FfnScratch(HIDDEN, len(own))
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    x64 = torch.from_numpy(x.astype(np.float64))[None]
    owned = torch.zeros(N_FF, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for mask in (None, (rng.random(N_FF) < 0.1).astype(np.uint8), np.zeros(N_FF, np.uint8)):
        active = owned if mask is None else owned * torch.from_numpy(mask.astype(np.float64))
        y, n = K.ffn_token(m["gate"], m["up"], m["down_t"], x, own, "relu", scratch, mask=mask, fast=fast,
                           down_t=True)
        g = torch.relu(x64 @ w["gate"].T)
        want = ffn_dense_reference(x64, w["gate"], w["up"], w["down_t"].T, "relu", active)[0].numpy()
        assert n == int(active.sum())
        scale = np.abs(want).max() + 1e-3
        assert np.abs(y - want).max() <= (0.05 if fast and t not in FLOAT_TYPES else 1e-5) * scale


def test_fast_down_transposed_rows_of_odd_block_counts(tmp_path, isa):
    """Fast mode's down_t axpy (512-bit on VNNI CPUs: block pairs, then an odd last block)
    against float64, for 1, 2 and 3 blocks per row, alone and in a batch."""
    rng = np.random.default_rng(22)
    for hidden in (32, 64, 96):
        shapes = {"gate": (48, hidden), "up": (48, hidden), "down_t": (48, hidden)}
        ts = write_tensors(tmp_path / f"d{hidden}.gguf", {n: (rng.standard_normal(s) * 0.3, T.Q4_0)
                                                          for n, s in shapes.items()})
        m = {n: K.FileMatrix(ts[n]) for n in ts}
        w = {n: torch.from_numpy(deq(ts[n])) for n in ts}
        own, mask = range(0, 48), (rng.random(48) < 0.5).astype(np.uint8)
        scratch = K.FfnScratch(hidden, 48)
        X = rng.standard_normal((3, hidden)).astype(np.float32)
        y, _ = K.ffn_batch(m["gate"], m["up"], m["down_t"], X, own, "relu", scratch, mask=mask, fast=True,
                           down_t=True)
        for b in range(3):
            alone, n = K.ffn_token(m["gate"], m["up"], m["down_t"], X[b], own, "relu", scratch, mask=mask,
                                   fast=True, down_t=True)
            np.testing.assert_array_equal(y[b], alone)
            want = ffn_dense_reference(torch.from_numpy(X[b].astype(np.float64))[None], w["gate"], w["up"],
                                       w["down_t"].T, "relu", torch.from_numpy(mask.astype(np.float64)))[0].numpy()
            assert n == mask.sum()
            assert np.abs(alone - want).max() <= 0.05 * (np.abs(want).max() + 1e-3)


# ---- small batches (continuous batching): the batch kernels against stacked one-token calls ----
# They promise the one-token kernel's float operations in its order, per token: equality is exact.

@pytest.mark.parametrize("t", TYPES + KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matmul_equals_stacked_matvec(mats, kmats, isa, t, fast):
    tensor = (kmats if t in KTYPES else mats)[f"w.{t.name}"]
    m = K.FileMatrix(tensor)
    rng = np.random.default_rng(20)
    col_sets = [None, range(m.block * (m.cols // m.block // 2 or 1) if m.block > 1 else 32, m.cols)]
    for B in BATCHES:
        X = rng.standard_normal((B, m.cols)).astype(np.float32)
        for rows in (None, range(5, 12), [36], [3, 0, 36, 17, 3], []):
            for cols in col_sets:
                xc = X if cols is None else np.ascontiguousarray(X[:, cols.start:cols.stop])
                got = m.matmul(xc, rows=rows, cols=cols, fast=fast)
                want = np.stack([m.matvec(xc[b], rows=rows, cols=cols, fast=fast) for b in range(B)])
                assert got.shape == want.shape
                np.testing.assert_array_equal(got, want, err_msg=f"B={B} rows={rows} cols={cols}")
        call = m.prepare_batch(rows=[3, 0, 36], fast=fast)
        np.testing.assert_array_equal(call(X), np.stack([m.matvec(X[b], rows=[3, 0, 36], fast=fast) for b in range(B)]))


@pytest.mark.parametrize("t", TYPES + KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_kept_columns_read_as_the_file_does(mats, kmats, isa, t, fast):
    """A matrix holding some columns only (FileMatrix.keep_columns: a process's share of down
    or of the attention output) gives bit for bit what the file's matrix gives over them, by
    the same column numbers; the file's matrix still reads right after its pages were unmapped;
    columns it does not hold are refused."""
    tensor = (kmats if t in KTYPES else mats)[f"w.{t.name}"]
    m = K.FileMatrix(tensor)
    b = max(m.block, 32)
    rng = np.random.default_rng(21)
    x = rng.standard_normal(m.cols).astype(np.float32)
    whole = m.matvec(x, fast=fast).copy()
    for cols in (range(b, m.cols), range(0, b), range(b, 2 * b) if m.cols >= 3 * b else range(0, m.cols)):
        held = m.keep_columns(cols)
        assert held.data.nbytes == m.rows * len(cols) * m.row_bytes // m.cols
        xc = np.ascontiguousarray(x[cols.start:cols.stop])
        for sub in (cols, range(cols.start, cols.start + b)):
            xs = np.ascontiguousarray(x[sub.start:sub.stop])
            np.testing.assert_array_equal(held.matvec(xs, rows=[3, 0, 36], cols=sub, fast=fast),
                                          m.matvec(xs, rows=[3, 0, 36], cols=sub, fast=fast))
        X = rng.standard_normal((3, len(cols))).astype(np.float32)
        np.testing.assert_array_equal(held.matmul(X, cols=cols, fast=fast), m.matmul(X, cols=cols, fast=fast))
        np.testing.assert_array_equal(held.dequantize(rows=range(2, 9), cols=cols),
                                      m.dequantize(rows=range(2, 9), cols=cols))
        if len(cols) < m.cols:
            with pytest.raises(ValueError, match="holds columns|whole blocks"):
                held.matvec(x, fast=fast)
            outside = range(0, b) if cols.start else range(cols.stop, cols.stop + b)
            with pytest.raises(ValueError, match="within"):
                held.matvec(np.zeros(b, np.float32), cols=outside)
    np.testing.assert_array_equal(m.matvec(x, fast=fast), whole)


def test_kept_columns_leave_memory_that_is_not_a_file_alone(mats):
    """Unmapping a file's pages would zero anonymous memory (a tensor converted at load): a
    matrix whose blocks are not a view of a file keeps its values."""
    m = K.FileMatrix(mats["w.Q8_0"])
    anon = K.FileMatrix(mats["w.Q8_0"])
    anon.data = m.data.copy()
    before = anon.data.copy()
    held = anon.keep_columns(range(32, 96))
    np.testing.assert_array_equal(anon.data, before)
    x = np.random.default_rng(22).standard_normal(64).astype(np.float32)
    np.testing.assert_array_equal(held.matvec(x, cols=range(32, 96)), m.matvec(x, cols=range(32, 96)))


def test_matmul_refuses_bad_batches(mats):
    m = K.FileMatrix(mats["w.Q8_0"])
    with pytest.raises(ValueError, match="1..16"):
        m.matmul(np.zeros((17, 96), np.float32))
    call = m.prepare_batch()
    with pytest.raises(ValueError, match="contiguous float32"):
        call(np.zeros((4, 96), np.float64))
    with pytest.raises(ValueError, match="contiguous float32"):
        call(np.zeros((4, 64), np.float32))


def batch_cases(t, m, x_rows: np.ndarray, own: range, fast: bool, rng):
    """threshold (one for all tokens, one per token, some tokens dense), masks, nothing active"""
    _, n_ff, _ = ffn_dims(t)
    g = np.stack([torch.nn.functional.silu(torch.from_numpy(m["gate"].matvec(x, fast=fast))).numpy()
                  for x in x_rows])
    mags = np.abs(g[:, own.start:own.stop])
    B = len(x_rows)
    per_token = np.quantile(mags, rng.uniform(0.2, 0.9, B), axis=1).diagonal().astype(np.float32)
    some_dense = per_token.copy()
    some_dense[::2] = -1.0
    return {"dense": (None, None),
            "threshold": (float(np.median(mags)), None),
            "threshold per token": (per_token, None),
            "some tokens dense": (some_dense, None),
            "mask": (None, (rng.random(n_ff) < 0.3).astype(np.uint8)),
            "mask and threshold": (float(np.median(mags)), (rng.random(n_ff) < 0.5).astype(np.uint8)),
            "nothing active": (1e9, None),
            "one token active": (np.array([1e9] * (B - 1) + [0.0], np.float32), None)}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "middle", "last"])
@pytest.mark.parametrize("down", ["down", "down_t"])
def test_ffn_batch_equals_stacked_ffn_token(ffn, isa, fast, which, down):
    """Every token of a batch gets what ffn_token gives it alone, bit for bit, and the active
    pairs add up; thresholds per token, masks, down as in file or transposed (PowerInfer)."""
    t, m, _ = ffn
    hidden, n_ff, _ = ffn_dims(t)
    own = own_range(t, which) if down == "down" else range(40, 77 + (which == "all") * (n_ff - 77))
    rng = np.random.default_rng(21)
    scratch = K.FfnScratch(hidden, len(own))
    one = K.FfnScratch(hidden, len(own))
    for B in BATCHES:
        X = (rng.standard_normal((B, hidden)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        for name, (thr, mask) in batch_cases(t, m, X, own, fast, rng).items():
            y, n = K.ffn_batch(m["gate"], m["up"], m[down], X, own, "silu", scratch, threshold=thr, mask=mask,
                               fast=fast, down_t=down == "down_t")
            counts = scratch.small_batch()[4][:B].copy()
            for b in range(B):
                tb = thr if thr is None or np.isscalar(thr) else float(thr[b])
                tb = None if tb is not None and tb < 0 else tb
                want, nb = K.ffn_token(m["gate"], m["up"], m[down], X[b], own, "silu", one, threshold=tb, mask=mask,
                                       fast=fast, down_t=down == "down_t")
                np.testing.assert_array_equal(y[b], want, err_msg=f"{name} B={B} token {b}")
                assert counts[b] == nb, (name, B, b)
            assert n == counts.sum(), name


def test_ffn_batch_writes_into_out(ffn):
    t, m, _ = ffn
    hidden, n_ff, _ = ffn_dims(t)
    scratch = K.FfnScratch(hidden, n_ff)
    X = np.random.default_rng(22).standard_normal((4, hidden)).astype(np.float32)
    slot = np.full((8, hidden), 7.0, np.float32)
    y, _ = K.ffn_batch(m["gate"], m["up"], m["down"], X, range(0, n_ff), "silu", scratch, out=slot[:4])
    assert np.shares_memory(y, slot) and (slot[4:] == 7.0).all()
    np.testing.assert_array_equal(slot[:4], K.ffn_batch(m["gate"], m["up"], m["down"], X, range(0, n_ff), "silu",
                                                        scratch)[0])
    with pytest.raises(ValueError, match=r"\(4, "):
        K.ffn_batch(m["gate"], m["up"], m["down"], X, range(0, n_ff), "silu", scratch, out=slot[:3])


# ---- the small-batch kernels wired into a shard and the lm_head --------------------------------

@pytest.fixture(scope="module", params=["Q4_0", "Q4_K"])
def shard_model(request, tiny_model_factory):
    return tiny_model_factory(tensor_type=request.param, vocab_size=600)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_shard_batch_step_equals_token_steps(shard_model, fast):
    """FfnShard.step with T=4 (sequences decoded together) gives each token exactly what its own
    one-token step gives it, dense, thresholded and masked; serve writes the output slot."""
    from protocol.doorbell import FLAG_DENSE, FLAG_THRESHOLD, Request
    from sparsecore.shard import FfnShard
    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf
    cfg = read_config(shard_model, open_gguf(shard_model))
    n_ff, hidden, align = cfg.n_ff, cfg.hidden, 256 if "Q4_K" in shard_model.name else 32
    own = np.arange(align, n_ff)  # not the first block: a shard's range
    shard = FfnShard.load(shard_model, [own] * cfg.n_layers, weights="gguf", fast=fast, head_rows=(100, 600))
    rng = np.random.default_rng(30)
    x = torch.from_numpy(rng.standard_normal((4, hidden)).astype(np.float32))
    mask = (rng.random(n_ff) < 0.4).astype(np.uint8)
    for layer in range(cfg.n_layers):
        for active, thr in ((None, None), (mask, None), (None, 0.05)):
            y, n = shard.step(layer, x, active, thr)
            singles = [shard.step(layer, x[b:b + 1], active, thr) for b in range(4)]
            np.testing.assert_array_equal(y.numpy(), torch.cat([s[0] for s in singles]).numpy())
            assert n == sum(s[1] for s in singles)

    class Buf:  # the shared-memory views serve reads and writes
        def __init__(self):
            self.x = np.zeros((8, hidden), np.float32)
            self.x[:4] = x.numpy()
            self.out = np.full((2, 8, hidden), 9.0, np.float32)
            self.mask, self.thresholds = mask, np.full(cfg.n_layers, 0.05, np.float32)

    buf = Buf()
    for flags, active, thr in ((FLAG_DENSE, None, None), (FLAG_THRESHOLD, None, 0.05), (0, mask, None)):
        n, _ = shard.serve(buf, 1, Request(1, 1, 4, flags))
        want, n_want = shard.step(1, x, active, thr)
        np.testing.assert_array_equal(buf.out[1, :4], want.numpy())
        assert n == n_want and (buf.out[1, 4:] == 9.0).all() and (buf.out[0] == 9.0).all()
    # the head's vocabulary rows for 4 tokens at once: each token's logits as alone
    logits = shard.head(buf.x[:4])
    assert logits.shape == (4, 500)
    for b in range(4):
        np.testing.assert_array_equal(logits[b], shard.head(buf.x[b:b + 1]))


def test_fast_prefill_goes_through_the_small_batch_kernels_in_tiles(shard_model):
    """With fast arithmetic a prompt's tokens (more than MAX_SMALL_BATCH) take the integer
    kernels a tile at a time: each token's FFN output and products equal its one-token step
    exactly (exact arithmetic keeps the float32 GEMM for prompts)."""
    from sparsecore.config import read_config
    from sparsecore.ffn import FileRows, x_wt
    from sparsecore.gguf_file import open_gguf
    from sparsecore.shard import FfnShard
    from sparsecore.tensors import TensorStore
    store = TensorStore(shard_model, open_gguf(shard_model))
    cfg = read_config(shard_model, store.reader)
    T = K.MAX_SMALL_BATCH * 2 + 5
    x = torch.from_numpy(np.random.default_rng(31).standard_normal((T, cfg.hidden)).astype(np.float32))
    shard = FfnShard.load(shard_model, [np.arange(cfg.n_ff)] * cfg.n_layers, weights="gguf", fast=True, store=store)
    for thr in (None, 0.05):
        y, n = shard.step(0, x, None, thr)
        singles = [shard.step(0, x[t:t + 1], None, thr) for t in range(T)]
        np.testing.assert_array_equal(y.numpy(), torch.cat([s[0] for s in singles]).numpy())
        assert n == sum(s[1] for s in singles)
    q = FileRows(K.FileMatrix(store.info("blk.0.attn_q.weight")), None, fast=True)
    assert q.tiled_prefill and not FileRows(q.m, None, fast=False).tiled_prefill
    np.testing.assert_array_equal(x_wt(x, q).numpy(), np.stack([q.matvec(x[t].numpy()).copy() for t in range(T)]))
