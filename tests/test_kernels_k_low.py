"""The native kernels for the 2- and 3-bit K-quants (Q2_K, Q3_K) against float64 products of the
blocks dequantized by gguf-py, on every ISA level this CPU runs, exact and fast mode; and the
numpy quantizers that make their test matrices (tests/fixtures/quant_k_low.py) against ggml's
block layout, decoded byte by byte here as ggml's dequantize_row_q2_K / _q3_K do.

Two kinds of matrices per type: quantized normal values (what a file holds) and random valid
blocks (every bit pattern: Q3_K's negative scales, any high-bit mask, Q2_K's large mins)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures.ffn_checks import check_ffn_token
from tests.fixtures.kernel_checks import exact_and_fast_errors, matvec_tol
from tests.fixtures.kernel_files import deq, ffn_matrices, ffn_shapes, k_low_matrices, write_tensors
from tests.fixtures.quant_k_low import QUANTIZE, quantize_q2_k, quantize_q3_k

TYPES = [T.Q2_K, T.Q3_K]
BATCHES = [1, 2, 3, 4, 5, 8, 9, 16]  # tiles of 4 tokens, and matmul's tiles of 8
ROW_SETS = (None, range(5, 12), [36], [3, 0, 36, 17, 3], [])
ROWS, COLS = 37, 768


# ---- the block layout, as ggml's C reads it ----------------------------------------------------

def ggml_q2_k(b: bytes) -> np.ndarray:
    """ggml's dequantize_row_q2_K, one block"""
    sc, q = b[:16], b[16:80]
    d, dmin = np.frombuffer(b[80:84], np.float16).astype(np.float32)
    y, i = [], 0
    for n in range(2):
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl, ml = d * np.float32(sc[i] & 15), dmin * np.float32(sc[i] >> 4)
                i += 1
                y += [dl * np.float32((q[32 * n + half + l] >> shift) & 3) - ml for l in range(16)]
    return np.array(y, np.float32)


def ggml_q3_k(b: bytes) -> np.ndarray:
    """ggml's dequantize_row_q3_K, one block: its 12 scale bytes unpacked as 4 words"""
    hm, q = b[:32], b[32:96]
    aux = list(np.frombuffer(b[96:108], np.uint32))
    d = np.frombuffer(b[108:110], np.float16).astype(np.float32)[0]
    k1, k2, tmp = 0x03030303, 0x0F0F0F0F, int(aux[2])
    a0, a1 = int(aux[0]), int(aux[1])
    words = [(a0 & k2) | (((tmp >> 0) & k1) << 4), (a1 & k2) | (((tmp >> 2) & k1) << 4),
             ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.array(words, np.uint32).view(np.int8)
    y, i, m = [], 0, 1
    for n in range(2):
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * np.float32(int(scales[i]) - 32)
                i += 1
                y += [dl * np.float32(((q[32 * n + half + l] >> shift) & 3) - (0 if hm[half + l] & m else 4))
                      for l in range(16)]
            m <<= 1
    return np.array(y, np.float32)


GGML = {T.Q2_K: ggml_q2_k, T.Q3_K: ggml_q3_k}
MAX_REL_ERR = {T.Q2_K: 0.4, T.Q3_K: 0.2}  # round to nearest on normal values, 2 and 3 bits


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantizer_writes_ggml_layout(t):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 512), dtype=np.float32) * 0.05
    x[1, :256] += 0.03  # blocks with an offset: Q2_K's mins, Q3_K's scales of one sign
    x[2, 256:] -= 0.03
    x[3, :256] = 0  # an all-zero block
    x[4, 256:272] *= 20  # one sub-block much larger than the rest
    q = QUANTIZE[t](x.reshape(-1, 256))
    size = quants.GGML_QUANT_SIZES[t][1]
    assert q.shape == (12, size) and q.dtype == np.uint8
    lib = quants.dequantize(q, t).reshape(-1, 256)
    for i, blk in enumerate(q):
        np.testing.assert_allclose(GGML[t](blk.tobytes()), lib[i], rtol=1e-6, atol=1e-7)
    y = lib.reshape(x.shape)
    assert (y[3, :256] == 0).all()
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < MAX_REL_ERR[t]
    for r in (0, 1, 2, 3, 5):  # each sub-block within half a step of its own range (Q3_K: one step,
        # where the side opposite its largest magnitude clips at 3); not next to a sub-block 20
        # times larger (row 4), whose scale leaves the 4-bit sub-block scales coarse
        sub, got = x[r].reshape(-1, 16), y[r].reshape(-1, 16)
        step = (sub.max(1) - np.minimum(sub.min(1), 0)) / 3 if t == T.Q2_K else np.abs(sub).max(1) / 4
        assert (np.abs(got - sub).max(1) <= (0.6 if t == T.Q2_K else 1.1) * step + 1e-6).all(), r


def test_quantizers_use_every_level():
    """Q2_K's q reaches 0 and 3 and its mins are used; Q3_K's q reaches -4 and 3, with scales
    of both signs: the kernels' tests below see every kind of value the quantizers write."""
    x = np.random.default_rng(6).standard_normal((8, 256), dtype=np.float32)
    x[:4] += 1.5
    x[4:] -= 1.5
    b2, b3 = quantize_q2_k(x), quantize_q3_k(x)
    q2 = np.concatenate([(b2[:, 16:80] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
    assert q2.min() == 0 and q2.max() == 3 and (b2[:, :16] >> 4).max() > 0
    j = np.arange(16)
    sc3 = (((b3[:, 96 + j % 8] >> (4 * (j // 8))) & 15) | (((b3[:, 104 + j % 4] >> (2 * (j // 4))) & 3) << 4)).astype(int) - 32
    assert (sc3[:4] < 0).all() and (sc3[4:] > 0).all()  # the largest magnitude (of x's sign) on q = -4
    low = np.concatenate([(b3[:, 32:96] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
    high = np.concatenate([(b3[:, :32] >> i) & 1 for i in range(8)], axis=1)
    u = low | (high << 2)
    assert u.min() == 0 and u.max() == 7


# ---- matrices for the kernels -------------------------------------------------------------------

SOURCES = ["quantized", "random"]


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    arrays = k_low_matrices(np.random.default_rng(10), ROWS, COLS)
    return write_tensors(tmp_path_factory.mktemp("klow") / "k.gguf", arrays)


def test_block_sizes(mats):
    for t in TYPES:
        m = K.FileMatrix(mats[f"{t.name}.random"])
        assert (m.block, m.row_bytes) == (256, 3 * quants.GGML_QUANT_SIZES[t][1])
        assert (m.rows, m.cols) == (ROWS, COLS)
        assert K.supports(t) and K.neuron_align(t) == 256


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matvec_rows_and_columns(mats, isa, t, src, fast):
    """Chosen rows (all, a range, one, repeated and out of order, none) and column ranges on
    whole blocks of 256 (the FFN's down over owned neurons)."""
    tensor = mats[f"{t.name}.{src}"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    x = np.random.default_rng(11).standard_normal(COLS).astype(np.float32)
    for rows in ROW_SETS:
        got = m.matvec(x, rows=rows, fast=fast)
        want = (w if rows is None else w[list(rows)]) @ x.astype(np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=matvec_tol(fast, x, w), err_msg=str(rows))
    for cols in (range(256, 768), range(256, 512), range(0, 256)):
        xc = x[cols.start:cols.stop]
        got = m.matvec(xc, rows=[0, 36, 7], cols=cols, fast=fast)
        want = w[[0, 36, 7], cols.start:cols.stop] @ xc.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=matvec_tol(fast, x, w), err_msg=str(cols))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        m.matvec(x[:32], cols=range(0, 32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_exact_mode_is_the_dequantized_product(mats, isa, t, src):
    """Exact mode is off the float64 product by float32 rounding only, far below what 8-bit
    activations cost (so fast mode really is another arithmetic)."""
    tensor = mats[f"{t.name}.{src}"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    x = np.random.default_rng(2).standard_normal(COLS).astype(np.float32)
    exact, fast, scale = exact_and_fast_errors(m, w, x)
    assert exact < 1e-5 * scale < fast


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_fast_mode_error_is_the_activation_quantization(mats, isa, t, src):
    """Fast mode's only error is x's 8-bit quantization: with x exactly representable in q8
    blocks (integers up to 127 in every block of 32, one of them 127), fast equals exact up to
    float rounding. A wrong sub-block's min or offset (per 16 values) fails this by far."""
    tensor = mats[f"{t.name}.{src}"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    rng = np.random.default_rng(12)
    x = rng.integers(-127, 128, COLS).astype(np.float32)
    x[::32] = 127
    x[64:80] = 100  # a half of a q8 block far from the other half: the sums per 16 matter
    want = w @ x.astype(np.float64)
    for fast in (False, True):
        np.testing.assert_allclose(m.matvec(x, fast=fast), want, rtol=0, atol=1e-6 * np.abs(w).sum(1).max() * 127)
        np.testing.assert_allclose(m.matvec(x[256:], cols=range(256, COLS), fast=fast), w[:, 256:] @ x[256:],
                                   rtol=0, atol=1e-6 * np.abs(w).sum(1).max() * 127)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("src", SOURCES)
def test_dequantize_equals_gguf(mats, isa, t, src):
    tensor = mats[f"{t.name}.{src}"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    assert np.isfinite(w).all() and np.abs(w).max() > 0.05
    np.testing.assert_array_equal(m.dequantize(), w.astype(np.float32))
    np.testing.assert_array_equal(m.dequantize(rows=[4, 1], cols=range(256, 512)), w[[4, 1], 256:512].astype(np.float32))
    assert m.dequantize(rows=[]).shape == (0, COLS)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matmul_equals_stacked_matvec(mats, isa, t, fast):
    """A token's products are the same floats alone and in any batch (tiles of 4 tokens, the
    rows in blocks for more than 8), for any rows and columns; and close to float64."""
    tensor = mats[f"{t.name}.random"]
    m, w = K.FileMatrix(tensor), deq(tensor)
    rng = np.random.default_rng(20)
    for B in BATCHES:
        X = rng.standard_normal((B, COLS)).astype(np.float32)
        for rows in ROW_SETS:
            for cols in (None, range(256, COLS)):
                xc = X if cols is None else np.ascontiguousarray(X[:, cols.start:cols.stop])
                got = m.matmul(xc, rows=rows, cols=cols, fast=fast)
                want = np.stack([m.matvec(xc[b], rows=rows, cols=cols, fast=fast) for b in range(B)])
                assert got.shape == want.shape
                np.testing.assert_array_equal(got, want, err_msg=f"B={B} rows={rows} cols={cols}")
        ref = X.astype(np.float64) @ w.T
        np.testing.assert_allclose(m.matmul(X, fast=fast), ref, rtol=0, atol=matvec_tol(fast, X, w))
        call = m.prepare_batch(rows=[3, 0, 36], fast=fast)
        np.testing.assert_array_equal(call(X), np.stack([m.matvec(X[b], rows=[3, 0, 36], fast=fast) for b in range(B)]))


# ---- the fused FFN step --------------------------------------------------------------------------

HIDDEN, N_FF = 256, 1024  # 4 blocks of 256 neurons in down's rows
MIXES = {"Q2_K": (T.Q2_K, T.Q2_K, T.Q2_K), "Q3_K": (T.Q3_K, T.Q3_K, T.Q3_K),
         # a *_K_M file's mix: gate, up and down of different types (each its packed activations)
         "Q4_K-Q3_K-Q2_K": (T.Q4_K, T.Q3_K, T.Q2_K), "Q3_K-Q2_K-Q6_K": (T.Q3_K, T.Q2_K, T.Q6_K)}


@pytest.fixture(scope="module", params=list(MIXES))
def ffn(request, tmp_path_factory):
    from tests.fixtures.tiny_gguf import quantize_k
    rng = np.random.default_rng(3)
    tg, tu, td = MIXES[request.param]
    types = {"gate": tg, "up": tu, "down": td, "down_t": td}
    arrays = {n: (quantize_k((rng.standard_normal(s) * 0.2).astype(np.float32), types[n]), types[n])
              for n, s in ffn_shapes(HIDDEN, N_FF, down_t=True).items()}
    return ffn_matrices(tmp_path_factory.mktemp("f") / "ffn.gguf", arrays)


OWN = {"all": range(0, N_FF), "middle": range(256, 768), "last": range(768, N_FF)}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", list(OWN))
def test_ffn_token(ffn, isa, fast, which):
    """Dense, thresholded, masked and nothing active, against the dense float64 FFN with the
    inactive neurons zeroed."""
    m, w = ffn
    check_ffn_token(m, w, OWN[which], np.random.default_rng(4), fast, 0.05 if fast else 1e-5)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "unaligned"])
def test_ffn_token_down_transposed(ffn, isa, fast, which):
    """PowerInfer's layout: down stored transposed, a row of blocks per neuron added by an axpy
    for each active one; any range of neurons; masks with some, few and no neurons active."""
    m, w = ffn
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
        want = ffn_dense_reference(x64, w["gate"], w["up"], w["down_t"].T, "relu", active)[0].numpy()
        assert n == int(active.sum())
        scale = np.abs(want).max() + 1e-3
        assert np.abs(y - want).max() <= (0.05 if fast else 1e-5) * scale


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("which", ["all", "middle"])
@pytest.mark.parametrize("down", ["down", "down_t"])
def test_ffn_batch_equals_stacked_ffn_token(ffn, isa, fast, which, down):
    """Every token of a batch gets what ffn_token gives it alone, bit for bit: dense, one
    threshold, thresholds per token (some dense), masks, nothing active, one token active."""
    m, _ = ffn
    own = OWN[which] if down == "down" else range(40, 77 + (which == "all") * (N_FF - 77))
    rng = np.random.default_rng(21)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    for B in (1, 2, 5, 9, 16):
        X = (rng.standard_normal((B, HIDDEN)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        g = np.stack([m["gate"].matvec(x, fast=fast) for x in X])
        mags = np.abs(g[:, own.start:own.stop] / (1 + np.exp(-g[:, own.start:own.stop])))
        per_token = np.quantile(mags, rng.uniform(0.2, 0.9, B), axis=1).diagonal().astype(np.float32)
        some_dense = per_token.copy()
        some_dense[::2] = -1.0
        cases = {"dense": (None, None), "threshold": (float(np.median(mags)), None),
                 "threshold per token": (per_token, None), "some tokens dense": (some_dense, None),
                 "mask": (None, (rng.random(N_FF) < 0.3).astype(np.uint8)), "nothing active": (1e9, None),
                 "one token active": (np.array([1e9] * (B - 1) + [0.0], np.float32), None)}
        for name, (thr, mask) in cases.items():
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


# ---- a model's layers run on the file's blocks -------------------------------------------------

@pytest.mark.parametrize("tensor_type", ["Q2_K", "Q3_K"])
def test_layers_run_in_place(tiny_model_factory, tensor_type):
    """A Q2_K / Q3_K model's FFN layers and attention matrices are read from the file's blocks
    (no float32 copy at load): the kernels take every one of them."""
    from sparsecore.attn_shard import native_attention
    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf
    from sparsecore.file_layer import FileLayer
    from sparsecore.tensors import TensorStore
    path = tiny_model_factory(tensor_type=tensor_type)
    store = TensorStore(path, open_gguf(path))
    cfg = read_config(path, store.reader)
    assert store.info("blk.0.ffn_gate.weight").tensor_type == T[tensor_type]
    for layer in range(cfg.n_layers):
        assert FileLayer.fits(store, layer, range(0, cfg.n_ff))
        assert FileLayer.align(store, layer) == 256
    assert native_attention(store, cfg)
