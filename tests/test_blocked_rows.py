"""Rows with their blocks interleaved 16 by 16 (FileMatrix.interleave_blocks, _kernels.c R16): fast
mode's products of rows picked one by one, on Q4_0/Q4_1/Q8_0, against float64 products of
gguf-py's dequantized blocks and the 8-bit activations every fast kernel uses; rows of whole
runs of 16 blocks, with a shorter last run, and of a short run alone; any row list (empty, odd,
out of order, repeated); a token alone equals it in any batch and on every ISA level, bit for
bit; the FFN step's threshold and predictor paths on such rows; what the layout refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures.kernel_checks import check_product
from tests.fixtures.kernel_files import deq, ffn_file, write_tensors

R16_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
COLS = [32 * 16, 32 * 38, 32 * 8]  # whole runs; two runs and a run of 6; one run of 8
ROWS = 37


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    rng = np.random.default_rng(60)
    arrays = {f"w.{t.name}.{c}": (rng.standard_normal((ROWS, c)), t) for t in R16_TYPES for c in COLS}
    arrays["w.Q4_K"] = (rng.standard_normal((ROWS, 256)), T.F16)  # stands for a type without the layout
    return write_tensors(tmp_path_factory.mktemp("r16") / "m.gguf", arrays)


def row_lists(rng) -> list:
    return [None, range(0, ROWS), range(5, 22), np.array([], np.int32), np.array([36, 0, 7], np.int32),
            np.array([3, 3, 30], np.int32), rng.permutation(ROWS)[:19].astype(np.int32)]


def blocked(mats, key: str) -> K.FileMatrix:
    b = K.FileMatrix(mats[key]).interleave_blocks()
    assert b.blocked
    return b


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("t", R16_TYPES, ids=lambda t: t.name)
def test_blocked_products_are_the_dequantized_ones(mats, isa, t, cols):
    key = f"w.{t.name}.{cols}"
    m, w = K.FileMatrix(mats[key]), deq(mats[key])
    b = blocked(mats, key)
    assert b.data.nbytes == m.data.nbytes  # the file's bytes, moved within each row
    rng = np.random.default_rng(61)
    x = (rng.standard_normal(cols) * 3).astype(np.float32)
    for rows in row_lists(rng):
        sel = w if rows is None else w[rows] if not isinstance(rows, range) else w[rows.start:rows.stop]
        got = b.matvec(x, rows=rows, fast=True)
        assert got.shape == (len(sel),)
        check_product(got, sel, x)
        # the file's layout computes the same integers; only the float order differs
        file_y = m.matvec(x, rows=rows, fast=True)
        np.testing.assert_allclose(got, file_y, rtol=1e-5, atol=1e-6 * np.abs(file_y).max(initial=1))
    np.testing.assert_array_equal(b.dequantize(), m.dequantize())
    np.testing.assert_array_equal(b.dequantize(rows=[4, 1]), m.dequantize(rows=[4, 1]))


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("t", R16_TYPES, ids=lambda t: t.name)
def test_a_token_alone_equals_it_in_any_batch_and_on_every_isa(mats, t, cols):
    """The portable loop is the VNNI kernel's lanes and reduction, operation for operation; a
    batch runs each token's own product; so the floats never depend on either."""
    b = blocked(mats, f"w.{t.name}.{cols}")
    rng = np.random.default_rng(62)
    X = (rng.standard_normal((9, cols)) * rng.uniform(0.5, 2, (9, 1))).astype(np.float32)
    rows = rng.permutation(ROWS)[:21].astype(np.int32)
    default, seen = K.isa(), {}
    try:
        for level in ("generic", "avx2", "avxvnni", "avx512vnni"):
            if K.set_isa(level) != level:
                continue
            for B in (1, 2, 9):
                got = b.matmul(X[:B], rows=rows, fast=True).copy()
                alone = np.stack([b.matvec(X[i], rows=rows, fast=True) for i in range(B)])
                np.testing.assert_array_equal(got, alone, err_msg=f"{level} B={B}")
                if B in seen:
                    np.testing.assert_array_equal(got, seen[B], err_msg=f"{level} B={B} against another level")
                seen[B] = got
    finally:
        K.set_isa(default)


def test_held_rows_keep_their_numbers(mats):
    m = K.FileMatrix(mats["w.Q4_0.1216"])
    whole = m.interleave_blocks()
    part = m.keep_rows(range(9, 30)).interleave_blocks()
    x = np.random.default_rng(63).standard_normal(m.cols).astype(np.float32)
    rows = np.array([29, 9, 15], np.int32)
    np.testing.assert_array_equal(part.matvec(x, rows=rows, fast=True), whole.matvec(x, rows=rows, fast=True))
    with pytest.raises(ValueError, match="holds rows"):
        part.matvec(x, rows=range(0, 5), fast=True)


def test_what_blocked_rows_refuse(mats):
    b = blocked(mats, "w.Q4_0.512")
    x = np.zeros(512, np.float32)
    with pytest.raises(ValueError, match="fast-mode products only"):  # no float path
        b.matvec(x, rows=[1])
    with pytest.raises(ValueError, match="before interleaving"):
        b.keep_columns(range(0, 256))
    with pytest.raises(ValueError, match="only whole rows of Q4_0, Q4_1 or Q8_0"):
        b.interleave_blocks()
    with pytest.raises(ValueError, match="only whole rows of Q4_0, Q4_1 or Q8_0"):
        K.FileMatrix(mats["w.Q4_K"]).interleave_blocks()
    m = K.FileMatrix(mats["w.Q4_K"])
    assert m.for_row_products() is m  # another type keeps the file's rows
    cols = K.FileMatrix(mats["w.Q8_0.512"]).keep_columns(range(0, 256))
    assert cols.for_row_products() is cols  # part of each row: the file's rows


# ---- the FFN step with rows picked by activity ---------------------------------------------------

HIDDEN, N_FF = 32 * 22, 160  # a run of 16 blocks and a run of 6


@pytest.fixture(scope="module", params=R16_TYPES, ids=lambda t: t.name)
def ffn(request, tmp_path_factory):
    return ffn_file(tmp_path_factory.mktemp("rf"), request.param, HIDDEN, N_FF, 64, 0.2)


def silu(v):
    return v / (np.float32(1) + np.exp(-v))


@pytest.mark.parametrize("own", [range(0, N_FF), range(32, 96)], ids=str)
def test_threshold_steps_on_blocked_up_rows(ffn, isa, own):
    """Gate interleaved 16 rows by 16, up's rows with their blocks interleaved (FileLayer's
    threshold layout on VNNI): the step is the composition of the separate products, the same
    alone and in a batch, and within fast mode's tolerance of the float64 FFN when dense."""
    m, w = ffn
    gate, down = m["gate"].keep_rows(own).interleave(), m["down"].keep_columns(own).interleave()
    up = m["up"].keep_rows(own).interleave_blocks()
    rng = np.random.default_rng(65)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    owned = torch.zeros(N_FF, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for B in (1, 3, 9):
        X = (rng.standard_normal((B, HIDDEN)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        g = np.stack([silu(gate.matvec(x, rows=own, fast=True)) for x in X])
        thr = float(np.median(np.abs(g)))
        y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, threshold=thr, fast=True)
        total = 0
        for b in range(B):
            alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", one, threshold=thr, fast=True)
            np.testing.assert_array_equal(y[b], alone, err_msg=f"B={B} token {b}")
            act = np.abs(g[b]) > thr
            assert nb == act.sum() and 0 < nb < len(own)
            total += nb
            h = np.where(act, g[b], 0).astype(np.float32)
            rows = np.flatnonzero(act) + own.start
            h[rows - own.start] *= up.matvec(X[b], rows=rows, fast=True)
            want = down.matvec(h, rows=range(0, HIDDEN), cols=own, fast=True)
            np.testing.assert_allclose(alone, want, rtol=0, atol=1e-5 * np.abs(want).max())
            dense, _ = K.ffn_token(gate, up, down, X[b], own, "silu", one, fast=True)
            ref = ffn_dense_reference(torch.from_numpy(X[b].astype(np.float64))[None], w["gate"], w["up"],
                                      w["down"], "silu", owned)[0].numpy()
            assert np.abs(dense - ref).max() <= 0.05 * (np.abs(ref).max() + 1e-3)
        assert n == total


@pytest.mark.parametrize("own", [range(0, N_FF), range(32, 96)], ids=str)
def test_predictor_steps_on_blocked_gate_and_up_rows(ffn, isa, own):
    """A predictor's mask picks gate rows, the active ones' up rows follow (both with their
    blocks interleaved): the file's layout's result up to float order; an empty mask gives
    exact zeros; a batch gives each token its own result."""
    m, _ = ffn
    down = m["down"].keep_columns(own).interleave()
    gate, up = (m[n].keep_rows(own).interleave_blocks() for n in ("gate", "up"))
    rng = np.random.default_rng(66)
    scratch = K.FfnScratch(HIDDEN, len(own))
    X = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    for frac in (0.0, 0.1, 0.6, 1.0):
        mask = (rng.random(N_FF) < frac).astype(np.uint8)
        y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, mask=mask, fast=True)
        for b in range(4):
            alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", scratch, mask=mask, fast=True)
            np.testing.assert_array_equal(y[b], alone)
            assert nb == mask[own.start:own.stop].sum()
            file_y, _ = K.ffn_token(m["gate"], m["up"], down, X[b], own, "silu", scratch, mask=mask, fast=True)
            np.testing.assert_allclose(alone, file_y, rtol=0, atol=1e-4 * (np.abs(file_y).max() + 1e-6))
            if nb == 0:
                assert not alone.any()


def test_held_copy_is_the_files_rows_in_memory_of_its_own(mats):
    """FileMatrix.held_copy: the same products and values, in memory the file's page cache
    cannot drop; interleaved rows are not copied as they are."""
    m = K.FileMatrix(mats["w.Q4_0.1216"])
    part = m.keep_rows(range(4, 30))
    held = part.held_copy()
    assert not np.shares_memory(held.data, m.data)
    x = np.random.default_rng(67).standard_normal(m.cols).astype(np.float32)
    rows = np.array([29, 4, 11], np.int32)
    for fast in (False, True):
        np.testing.assert_array_equal(held.matvec(x, rows=rows, fast=fast), m.matvec(x, rows=rows, fast=fast))
    np.testing.assert_array_equal(held.dequantize(rows=range(4, 30)), m.dequantize(rows=range(4, 30)))
    with pytest.raises(ValueError, match="copied as they are"):
        m.interleave_blocks().held_copy()


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0"])
def test_a_fast_powerinfer_engine_holds_every_row_it_reads(tmp_path, tensor_type, no_leaks):
    """Fast mode on a PowerInfer file: every process holds its gate and up rows with their
    blocks interleaved (where the CPU has VNNI) and its ffn_down_t rows copied as they are, none
    of them the file's pages; its logits stay within fast mode's tolerance of exact mode's."""
    from coordinator.runtime.engine import Engine, EngineOptions
    from sparsecore.file_layer import FileLayer
    from tests.fixtures.tiny_powerinfer import write_tiny_powerinfer

    path = write_tiny_powerinfer(tmp_path / "tiny.powerinfer.gguf", tensor_type=tensor_type, rank=32)
    ids = [5, 17, 33, 80, 120, 7]
    got = {}
    for fast in (False, True):
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=fast)) as eng:
            assert eng.predictors is not None
            own = [w for w in eng.ffn.own.layers.values() if isinstance(w, FileLayer)]
            assert own and all(w.down_t for w in own)
            file_down = [K.FileMatrix(eng.store.info(FileLayer.down_name(eng.store, i))) for i in range(len(own))]
            for w, f in zip(own, file_down):
                assert np.shares_memory(w.down.data, f.data) != fast
                assert w.gate.blocked == w.up.blocked == (fast and K.blocked_rows())
            eng.reset()
            got[fast] = np.concatenate([eng.model.forward(ids[:3]),
                                        np.stack([eng.model.forward([t])[-1] for t in ids[3:]])])
    scale = np.abs(got[False]).max()
    assert np.abs(got[True] - got[False]).max() <= 0.05 * scale


def test_conversions_copy_piece_by_piece_to_the_same_bytes(mats, monkeypatch):
    """interleave, interleave_blocks, held_copy and keep_columns copy the file's rows a piece of
    CHUNK_BYTES at a time (so that the source's pages go as they are copied): pieces of one to a
    few rows give the bytes one piece gives, a last partial group of 16 included (37 rows)."""
    from sparsecore.kernels import layouts

    def convert(m):
        out = {"blocks": m.interleave_blocks().data, "held": m.keep_rows(range(3, 37)).held_copy().data,
               "columns": m.keep_columns(range(64, 32 * 30)).data}
        if m.can_interleave:  # X16: levels with interleaved tiles
            out["interleave"] = m.interleave().data
        return out

    m = K.FileMatrix(mats["w.Q8_0.1216"])
    whole = {k: v.copy() for k, v in convert(m).items()}
    for chunk in (1, m.row_bytes + 1, 3 * m.row_bytes):
        monkeypatch.setattr(layouts, "CHUNK_BYTES", chunk)
        for k, v in convert(K.FileMatrix(mats["w.Q8_0.1216"])).items():
            np.testing.assert_array_equal(v, whole[k], err_msg=f"{k}, pieces of {chunk} bytes")
