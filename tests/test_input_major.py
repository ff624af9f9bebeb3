"""Input-major twins (FileMatrix.with_input_major, _kernels.c L_COLS: TEAL's input sparsity):
lossless copies of a sub-matrix, one-token products over the inputs above a threshold read at
every call, the original path bit for bit where the twin does not apply, ffn_token's TEAL
branch and the attention step on twins. Every ISA level this CPU runs, exact and fast mode,
against float64 products of gguf-py's dequantized blocks."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from tests.fixtures.twin_checks import (check, check_active_sets, check_ffn_teal, check_fused_gate_up, check_fused_parts,
                                       check_fused_qkv, check_not_applied, rope_tables, threshold)
from tests.fixtures.kernel_files import deq, write_tensors

TYPES = (T.Q4_0, T.Q4_1, T.Q8_0)
ROWS, COLS = 300, 256  # 300 rows: not a multiple of 16, 64 or 128 (the twins pad to 128 / 64)


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    """Per type: the FileMatrix of a (ROWS, COLS) matrix and its float64 values"""
    rng = np.random.default_rng(7)
    arrays = {t.name: (rng.standard_normal((ROWS, COLS)).astype(np.float32), t) for t in TYPES}
    ts = write_tensors(tmp_path_factory.mktemp("twins") / "m.gguf", arrays)
    return {t: (K.FileMatrix(ts[t.name]), deq(ts[t.name])) for t in TYPES}


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_twin_is_lossless(mats, t):
    """The twin holds the file's values exactly, and the file's bytes (rows a multiple of 128)"""
    m, w = mats[t]
    tw = m.with_input_major(range(10, 300), range(64, 256), threshold())
    np.testing.assert_array_equal(tw.twin_dequantize(), w[10:300, 64:256].astype(np.float32))
    whole = m.with_input_major(range(0, 256), None, threshold())
    assert whole.twin_bytes == 256 * m.row_bytes
    assert tw.twin_channel_bytes * 32 + tw.twin_scale_bytes == tw.twin_bytes // 6  # 6 groups of 32 inputs


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_products(mats, t, fast, isa):
    """Active sets from none to all over sub-ranges, one group, odd row counts, on every level"""
    m, w = mats[t]
    rng = np.random.default_rng(int(t) * 10 + fast)
    for rows, cols in ((range(10, 300), range(64, 256)), (range(0, ROWS), None), (range(5, 53), range(32, 64)),
                       (range(128, 256), range(0, 128))):
        check_active_sets(m, w, rows, cols, fast, rng, 32)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_where_the_twin_does_not_apply(mats, t, isa):
    """A negative threshold, other ranges, row lists and batches run the original path, bit for bit"""
    m, _ = mats[t]
    check_not_applied(m, range(64, 256))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_threshold_read_at_every_call(mats, fast, isa):
    """The owner changes the threshold between calls of a prepared product (addresses fixed once)
    and every layout of the original keeps its twin (separate memory): keep_columns, X16, R16"""
    m, w = mats[T.Q4_0]
    rng = np.random.default_rng(5)
    thr = threshold(0.0)
    # name: (the original, the twin's columns (None: the columns held), the columns the calls ask for)
    bases = {"file": (m, range(64, 192), range(64, 192)),
             "keep_columns": (m.keep_columns(range(64, 192)), None, range(64, 192)),
             "x16": (m.keep_rows(range(0, 256)).interleave(), range(64, 192), range(64, 192)),
             "r16": (m.interleave_blocks(), None, None)}  # R16 takes whole rows only
    for name, (base, cols, ask) in bases.items():
        tw = base.with_input_major(range(0, 256), cols, thr)
        c = ask or range(COLS)
        x = rng.standard_normal(len(c)).astype(np.float32)
        ws = w[0:256, c.start:c.stop]
        f = fast or name in ("x16", "r16")  # the repacked layouts take fast-mode products only
        call = tw.prepare(range(0, 256), ask, fast=f)
        for v in (0.0, 1.0, 0.3, 2.5):
            thr[0] = v
            check(call(x), ws, x, v, f, f"{name} at {v}")
        thr[0] = -1.0  # the original's own product again
        assert np.array_equal(call(x), base.prepare(range(0, 256), ask, fast=f)(x)), name


def test_types_without_twins(tmp_path):
    ts = write_tensors(tmp_path / "f.gguf", {"blk.0.ffn_gate.weight": (np.ones((32, 32), np.float32), T.F16)})
    with pytest.raises(ValueError, match="blk.0.ffn_gate.weight"):
        K.FileMatrix(ts["blk.0.ffn_gate.weight"]).with_input_major(None, None, threshold())


# ---- the FFN step's TEAL branch ------------------------------------------------------------------

HIDDEN, N_FF = 128, 192


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    rng = np.random.default_rng(11)
    shapes = {"gate": (N_FF, HIDDEN), "up": (N_FF, HIDDEN), "down": (HIDDEN, N_FF)}
    arrays = {n: ((rng.standard_normal(s) * 0.3).astype(np.float32), T.Q4_0) for n, s in shapes.items()}
    ts = write_tensors(tmp_path_factory.mktemp("ffn") / "ffn.gguf", arrays)
    return {n: K.FileMatrix(ts[n]) for n in shapes}, {n: deq(ts[n]) for n in shapes}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("gate_mode", ["par", "sym"])
def test_ffn_token_teal(ffn, fast, gate_mode, isa):
    """down[:, own] @ (act(gate[own] x_g) * (up[own] x_u)) over |h| > t_down, each twin its own
    threshold; the count is the active neurons; a CATS threshold given beside the twins is
    ignored (the twins are the caller's method); negative twin thresholds: the dense step"""
    m, w = ffn
    check_ffn_teal(m, w, range(64, 192), fast, 13 + fast, "silu" if gate_mode == "par" else "relu", gate_mode, cats=0.5)


# ---- attention on twins --------------------------------------------------------------------------

def test_attention_on_twins(tmp_path, isa):
    """AttentionStep whose Q, K, V and output matrices carry twins: at threshold 0 the step without
    them (within the products' rounding), above 0 another result (the twins are what runs)"""
    n_heads, n_kv, hd, max_ctx = 4, 2, 32, 8
    hidden = n_heads * hd
    rng = np.random.default_rng(17)
    shapes = {"q": (hidden, hidden), "k": (n_kv * hd, hidden), "v": (n_kv * hd, hidden), "o": (hidden, hidden)}
    ts = write_tensors(tmp_path / "attn.gguf", {n: ((rng.standard_normal(s) * 0.2).astype(np.float32), T.Q4_0)
                                                for n, s in shapes.items()})
    plain = {n: K.FileMatrix(ts[n]) for n in shapes}
    thr = threshold(0.0)
    twins = {n: mm.with_input_major(None, None, thr) for n, mm in plain.items()}
    cos, sin = rope_tables(hd, max_ctx)
    norm = np.ones(hidden, np.float32)
    h0 = rng.standard_normal(hidden).astype(np.float32)
    for fast in (False, True):
        def run(ms):
            kc, vc = (np.zeros((n_kv, max_ctx, hd), np.float32) for _ in range(2))
            step = K.AttentionStep(ms["q"], np.arange(hidden), ms["k"], np.arange(n_kv * hd), ms["v"], ms["o"], norm,
                                   1e-6, n_heads, n_kv, hd, hd, cos, sin, kc, vc, fast)
            h = h0.copy()
            for pos in range(3):
                step(h, pos)
            return h
        thr[0] = 0.0
        for t in twins.values():
            t.reset_twin_counts()
        base, same = run(plain), run(twins)
        np.testing.assert_allclose(same, base, rtol=0, atol=1e-4 * np.abs(base).max())
        counts = {n: t.reset_twin_counts()[0] for n, t in twins.items()}
        assert counts == {"q": 3 * hidden, "k": 3 * hidden, "v": 3 * hidden, "o": 3 * hidden}, counts
        thr[0] = 0.5
        assert np.abs(run(twins) - base).max() > 1e-3
        counts = {n: t.reset_twin_counts()[0] for n, t in twins.items()}
        assert 0 < counts["q"] < 3 * hidden and counts["k"] == counts["v"] < 3 * hidden, counts


# ---- fused twins: matrices of one input in one twin ----------------------------------------------

@pytest.fixture(scope="module")
def ffn_types(tmp_path_factory):
    """gate, up (N_FF x HIDDEN) and down per twin type, with their float64 values"""
    rng = np.random.default_rng(23)
    shapes = {"gate": (N_FF, HIDDEN), "up": (N_FF, HIDDEN), "down": (HIDDEN, N_FF)}
    arrays = {f"{n}.{t.name}": ((rng.standard_normal(s) * 0.3).astype(np.float32), t)
              for t in TYPES for n, s in shapes.items()}
    ts = write_tensors(tmp_path_factory.mktemp("ffn_types") / "ffn.gguf", arrays)
    return {t: ({n: K.FileMatrix(ts[f"{n}.{t.name}"]) for n in shapes},
                {n: deq(ts[f"{n}.{t.name}"]) for n in shapes}) for t in TYPES}


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_fused_twin_is_lossless(mats, t):
    m, w = mats[t]
    check_fused_parts(m, w, range(64, 256))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_ffn_token_on_a_fused_gate_up_twin(ffn_types, t, fast, isa):
    m, w = ffn_types[t]
    check_fused_gate_up(m, w, range(32, 192), fast)  # 160 neurons: 320 fused rows, not a multiple of 128


def test_attention_on_a_fused_qkv_twin(tmp_path, isa):
    n_heads, n_kv, hd = 4, 2, 32
    hidden = n_heads * hd
    rng = np.random.default_rng(19)
    shapes = {"q": (hidden, hidden), "k": (n_kv * hd, hidden), "v": (n_kv * hd, hidden), "o": (hidden, hidden)}
    ts = write_tensors(tmp_path / "attn.gguf", {n: ((rng.standard_normal(s) * 0.2).astype(np.float32), T.Q4_0)
                                                for n, s in shapes.items()})
    check_fused_qkv(ts, n_heads, n_kv, hd, [(2, 4), (1, 2)])  # KV head 1's query heads; half of KV head 0's
