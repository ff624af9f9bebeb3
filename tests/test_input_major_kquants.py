"""Input-major twins of Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K (cols_kquants_*.c): lossless
copies (the file's values exactly, as many bytes as the file), one-token products over the
inputs above a threshold at every ISA level in exact and fast mode against float64 products of
gguf-py's dequantized blocks, the original path bit for bit where the twin does not apply, the
counters (a group: 32 inputs, a K-quant's super-block of 256), ffn_token's TEAL branch on
Q4_K gate and up with a Q6_K down, and fused twins (gate | up, Q | K | V) of every type."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from tests.fixtures.kernel_files import deq, random_kquant, write_tensors
from tests.fixtures.twin_checks import (check, check_active_sets, check_ffn_teal, check_fused_gate_up, check_fused_parts,
                                       check_fused_qkv, check_not_applied, threshold)

TYPES = (T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
ROWS, COLS = 300, 768  # 300 rows: not a multiple of 128 (the twins pad to 128); 3 super-blocks


def group(t) -> int:
    return 256 if t in (T.Q4_K, T.Q5_K, T.Q6_K) else 32


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    """Per type: the FileMatrix of a (ROWS, COLS) matrix and its float64 values (Q5_0, Q5_1:
    normal values quantized by gguf-py; K-quants: random valid blocks, every bit pattern)"""
    rng = np.random.default_rng(23)
    arrays = {}
    for t in TYPES:
        if group(t) == 32:
            arrays[t.name] = (rng.standard_normal((ROWS, COLS)).astype(np.float32), t)
        else:
            arrays[t.name] = (random_kquant(rng, ROWS, COLS, t), t)
    ts = write_tensors(tmp_path_factory.mktemp("kq_twins") / "m.gguf", arrays)
    return {t: (K.FileMatrix(ts[t.name]), deq(ts[t.name])) for t in TYPES}


def test_input_major_types():
    assert all(K.input_major_type(t) for t in TYPES)
    assert not K.input_major_type(T.Q3_K) and not K.input_major_type(T.IQ4_XS)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_twin_is_lossless(mats, t):
    """The twin holds the file's values exactly, in as many bytes as the file (rows a multiple
    of 128), but for Q4_K's and Q5_K's 12 bytes of packed 6-bit scales and mins a row and
    super-block, held unpacked in 16; the bytes per group are what twin_channel_bytes and
    twin_scale_bytes say"""
    m, w = mats[t]
    g = group(t)
    tw = m.with_input_major(range(10, 300), range(256, 768), threshold())
    np.testing.assert_array_equal(tw.twin_dequantize(), w[10:300, 256:768].astype(np.float32))
    whole = m.with_input_major(range(0, 256), None, threshold())
    np.testing.assert_array_equal(whole.twin_dequantize(), w[0:256].astype(np.float32))
    unpacked = 4 * (m.cols // 256) if t in (T.Q4_K, T.Q5_K) else 0
    assert whole.twin_bytes == 256 * (m.row_bytes + unpacked)
    assert tw.twin_group == g
    assert tw.twin_channel_bytes * g + tw.twin_scale_bytes == tw.twin_bytes // (512 // g)


@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_whole_super_blocks(mats, t):
    m, _ = mats[t]
    with pytest.raises(ValueError, match="whole blocks of 256"):
        m.with_input_major(None, range(0, 288), threshold())


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_products(mats, t, fast, isa):
    """Active sets from none to all over sub-ranges (r0, c0 != 0 on whole groups), odd row
    counts, one channel, one per block of 32, on every level; the counters"""
    m, w = mats[t]
    g = group(t)
    rng = np.random.default_rng(int(t) * 10 + fast)
    for rows, cols in ((range(10, 300), range(256, 768)), (range(0, ROWS), None), (range(5, 53), range(512, 768)),
                       (range(128, 256), range(0, 256))):
        check_active_sets(m, w, rows, cols, fast, rng, g)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_random_sets(mats, t, fast, isa):
    """Random active sets (13 %, 50 %, 90 % of the inputs picked at random, not by magnitude):
    Q6_K's half blocks of 16 with one side empty, super-blocks with few sub-blocks active"""
    m, w = mats[t]
    rng = np.random.default_rng(31 + fast)
    thr = threshold(0.5)
    tw = m.with_input_major(None, None, thr)
    for frac in (0.13, 0.5, 0.9):
        x = (rng.standard_normal(COLS) * 0.1).astype(np.float32)
        on = rng.random(COLS) < frac
        x[on] = np.sign(rng.standard_normal(on.sum())) * (1 + rng.random(on.sum()))
        x[:16] = 0.0  # the first half block empty
        check(tw.matvec(x, fast=fast), w, x, 0.5, fast, f"{frac}")
        assert tw.reset_twin_counts() == (int((np.abs(x) > 0.5).sum()), int((np.abs(x) > 0.5).reshape(-1, 256).any(1).sum()))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_where_the_twin_does_not_apply(mats, t, isa):
    """A negative threshold, other ranges, row lists and batches run the original path, bit for bit"""
    m, _ = mats[t]
    check_not_applied(m, range(256, 768))


@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_twin_beside_other_layouts(mats, t, isa):
    """X16 (fast mode's dense layout) and keep_columns keep their twin (separate memory); the
    threshold read at every call of a prepared product"""
    m, w = mats[t]
    rng = np.random.default_rng(5)
    thr = threshold(0.0)
    bases = {"keep_columns": (m.keep_columns(range(256, 768)), None, range(256, 768)),
             "x16": (m.keep_rows(range(0, 256)).interleave(), range(256, 768), range(256, 768))}
    for name, (base, cols, ask) in bases.items():
        tw = base.with_input_major(range(0, 256), cols, thr)
        x = rng.standard_normal(len(ask)).astype(np.float32)
        call = tw.prepare(range(0, 256), ask, fast=True)
        for v in (0.0, 1.0, 0.3):
            thr[0] = v
            check(call(x), w[0:256, ask.start:ask.stop], x, v, True, f"{name} at {v}")
        thr[0] = -1.0
        assert np.array_equal(call(x), base.prepare(range(0, 256), ask, fast=True)(x)), name


# ---- the FFN step's TEAL branch: Q4_K gate and up, Q6_K down ------------------------------------

HIDDEN, N_FF = 256, 512


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    rng = np.random.default_rng(11)
    shapes = {"gate": ((N_FF, HIDDEN), T.Q4_K), "up": ((N_FF, HIDDEN), T.Q4_K), "down": ((HIDDEN, N_FF), T.Q6_K)}
    arrays = {n: (random_kquant(rng, *s, t), t) for n, (s, t) in shapes.items()}
    ts = write_tensors(tmp_path_factory.mktemp("kq_ffn") / "ffn.gguf", arrays)
    return {n: K.FileMatrix(ts[n]) for n in shapes}, {n: deq(ts[n]) for n in shapes}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_ffn_token_teal(ffn, fast, isa):
    """down[:, own] @ (silu(gate[own] x_g) * (up[own] x_u)) over |h| > t_down on K-quant twins;
    the count is the active neurons; negative twin thresholds: the dense step, bit for bit"""
    m, w = ffn
    _, groups = check_ffn_teal(m, w, range(256, 512), fast, 13 + fast)
    assert groups == 2  # one super-block active at 0 and at the median, none at 1e9


# ---- fused twins (FileMatrix.fuse_input_major): gate | up and Q | K | V in one twin ---------------

@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_fused_twin_is_lossless(mats, t):
    m, w = mats[t]
    check_fused_parts(m, w, range(256, 768))


@pytest.fixture(scope="module")
def fused_ffn(tmp_path_factory):
    """Per type: gate and up (N_FF x HIDDEN) of that type, down a Q5_0 (HIDDEN x N_FF), so that a
    shard need not be whole super-blocks of down's columns"""
    rng = np.random.default_rng(31)
    arrays = {"down": ((rng.standard_normal((HIDDEN, N_FF)) * 0.3).astype(np.float32), T.Q5_0)}
    for t in TYPES:
        for n in ("gate", "up"):
            a = random_kquant(rng, N_FF, HIDDEN, t) if group(t) == 256 else \
                (rng.standard_normal((N_FF, HIDDEN)) * 0.3).astype(np.float32)
            arrays[f"{n}.{t.name}"] = (a, t)
    ts = write_tensors(tmp_path_factory.mktemp("kq_fused") / "ffn.gguf", arrays)
    mats = {n: K.FileMatrix(v) for n, v in ts.items()}
    vals = {n: deq(v) for n, v in ts.items()}
    return {t: ({"gate": mats[f"gate.{t.name}"], "up": mats[f"up.{t.name}"], "down": mats["down"]},
                {"gate": vals[f"gate.{t.name}"], "up": vals[f"up.{t.name}"], "down": vals["down"]}) for t in TYPES}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_ffn_token_on_a_fused_gate_up_twin(fused_ffn, t, fast, isa):
    m, w = fused_ffn[t]
    check_fused_gate_up(m, w, range(32, 192), fast)  # 160 neurons: 320 fused rows, not a multiple of 128


@pytest.mark.parametrize("t", (T.Q4_K, T.Q6_K, T.Q5_0), ids=lambda t: t.name)
def test_attention_on_a_fused_qkv_twin(tmp_path, t, isa):
    """8 heads of 64 (hidden 512: whole super-blocks), 2 KV heads; the share of KV head 1's
    query heads reads the output matrix's columns 256..512, the share of query heads 4..8 too"""
    n_heads, n_kv, hd = 8, 2, 64
    hidden = n_heads * hd
    rng = np.random.default_rng(7)
    shapes = {"q": (hidden, hidden), "k": (n_kv * hd, hidden), "v": (n_kv * hd, hidden), "o": (hidden, hidden)}
    arrays = {n: (random_kquant(rng, *s, t, size=0.05) if group(t) == 256 else
                  (rng.standard_normal(s) * 0.05).astype(np.float32), t) for n, s in shapes.items()}
    check_fused_qkv(write_tensors(tmp_path / "attn.gguf", arrays), n_heads, n_kv, hd, [(4, 8)])
