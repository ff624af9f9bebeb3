"""Rows interleaved 16 by 16 (FileMatrix.interleave, _kernels.c X16): fast mode's dense products
on Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K/IQ4_NL/IQ4_XS/MXFP4 against float64 products of gguf-py's dequantized blocks and the 8-bit activations
every fast kernel uses; a token alone equals it in any batch bit for bit, on every ISA level
(the portable loop is the VNNI kernel's lane, operation for operation); odd row counts, ranges
starting on any group, held columns, the fused FFN step, and what the layout refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from sparsecore.kernels.held_memory import unmap_file_pages
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures import quant_q5_iq4 as Q
from tests.fixtures.kernel_checks import BATCHES, check_product, interleaved_shard
from tests.fixtures.kernel_files import deq, ffn_file, random_kquant, write_tensors

X16_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
KTYPES = (T.Q4_K, T.Q6_K)
QTYPES = (T.IQ4_NL, T.IQ4_XS, T.MXFP4)  # random valid blocks of tests/fixtures/quant_q5_iq4: every codebook index,
# MXFP4's E8M0 scales 0 and 1 (float32 subnormals) too


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    """53 rows (three groups and 5 rows) per type, of 160 columns (5 blocks of 32), 512 for the
    K-quants (2 blocks of 256), 768 for IQ4_XS (3): random valid blocks, gguf-py cannot quantize
    to them (IQ4_NL's random too: every codebook index)"""
    rng = np.random.default_rng(40)
    arrays = {f"w.{t.name}": (rng.standard_normal((53, 160)), t) for t in X16_TYPES + [T.F16]
              if t not in KTYPES + QTYPES}
    arrays.update({f"w.{t.name}": (random_kquant(rng, 53, 512, t), t) for t in KTYPES})
    arrays.update({f"w.{t.name}": (Q.random_blocks(rng, 53, 768 if t == T.IQ4_XS else 160, t), t)
                   for t in QTYPES})
    return write_tensors(tmp_path_factory.mktemp("x16") / "m.gguf", arrays)


def col_ranges(m: K.FileMatrix) -> list[range]:
    """held column ranges on the type's blocks: from the second block on, and one block inside"""
    b = m.block
    return [range(b, m.cols), range(2 * b, 3 * b) if m.cols >= 3 * b else range(b, 2 * b)]


@pytest.mark.parametrize("t", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_products_are_the_dequantized_ones(mats, isa, t):
    m, w = K.FileMatrix(mats[f"w.{t.name}"]), deq(mats[f"w.{t.name}"])
    p = m.interleave()
    # per group block: Q4_K's scales and mins a byte each, IQ4_XS's scales
    extra = {T.Q4_K: 64, T.IQ4_XS: 32}.get(t, 0) * (m.cols // 256)
    assert p.interleaved and p.data.nbytes == 4 * (16 * m.row_bytes + extra)  # 4 groups of the file's bytes
    assert p.can_interleave is False and m.can_interleave == K.interleaving(t)
    rng = np.random.default_rng(41)
    x = rng.standard_normal(m.cols).astype(np.float32)
    for rows in (None, range(16, 53), range(0, 5), range(32, 48), range(48, 53), range(16, 16)):
        sel = w if rows is None else w[rows.start:rows.stop]
        got = p.matvec(x, rows=rows, fast=True)
        assert got.shape == (len(sel),)
        check_product(got, sel, x)
        # the file's layout computes the same integers; only the float order differs
        np.testing.assert_allclose(got, m.matvec(x, rows=rows, fast=True), rtol=1e-5, atol=1e-5)
    for cols in col_ranges(m):
        xc = np.ascontiguousarray(x[cols.start:cols.stop])
        check_product(p.matvec(xc, cols=cols, rows=range(0, 53), fast=True), w[:, cols.start:cols.stop], xc)


@pytest.mark.parametrize("t", X16_TYPES, ids=lambda t: t.name)
def test_a_token_alone_equals_it_in_any_batch_and_on_every_isa(mats, t):
    m = K.FileMatrix(mats[f"w.{t.name}"])
    p = m.interleave()
    rng = np.random.default_rng(42)
    default = K.isa()
    results = {}
    try:
        for level in ("generic", "avx2", "avxvnni", "avx512vnni"):
            if K.set_isa(level) != level:
                continue
            for B in BATCHES:
                X = (rng.standard_normal((B, m.cols)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
                for rows in (None, range(16, 53)):
                    got = p.matmul(X, rows=rows, fast=True).copy()
                    alone = np.stack([p.matvec(X[b], rows=rows, fast=True) for b in range(B)])
                    np.testing.assert_array_equal(got, alone, err_msg=f"{level} B={B} rows={rows}")
                    results.setdefault((B, rows), []).append((level, X, got))
            call = p.prepare_batch(rows=range(16, 53), fast=True)
            np.testing.assert_array_equal(call(X), p.matmul(X, rows=range(16, 53), fast=True))
    finally:
        K.set_isa(default)
    for (B, rows), runs in results.items():  # the same inputs on each level: the same floats
        for level, X, got in runs[1:]:
            np.testing.assert_array_equal(p.matmul(X, rows=rows, fast=True), got, err_msg=f"{level} B={B}")


@pytest.mark.parametrize("t", X16_TYPES, ids=lambda t: t.name)
def test_held_rows_and_columns_interleave_by_their_numbers(mats, isa, t):
    """keep_rows / keep_columns then interleave: a shard's own gate rows and down columns,
    asked for by the file's row and column numbers, give the whole matrix's products."""
    m = K.FileMatrix(mats[f"w.{t.name}"])
    whole = m.interleave()
    x = np.random.default_rng(43).standard_normal(m.cols).astype(np.float32)
    rows = m.keep_rows(range(16, 53)).interleave()
    np.testing.assert_array_equal(rows.matvec(x, rows=range(16, 53), fast=True),
                                  whole.matvec(x, rows=range(16, 53), fast=True))
    np.testing.assert_array_equal(rows.matvec(x, rows=range(32, 40), fast=True),
                                  whole.matvec(x, rows=range(32, 40), fast=True))
    held = col_ranges(m)[1]
    cols = m.keep_columns(held).interleave()
    xc = np.ascontiguousarray(x[held.start:held.stop])
    np.testing.assert_array_equal(cols.matvec(xc, cols=held, fast=True), whole.matvec(xc, cols=held, fast=True))
    np.testing.assert_array_equal(cols.dequantize(rows=range(0, 53), cols=held), m.dequantize(cols=held))
    with pytest.raises(ValueError, match="holds rows"):
        rows.matvec(x, rows=range(0, 16), fast=True)
    with pytest.raises(ValueError, match="start on a multiple of 16"):
        m.keep_rows(range(8, 53)).interleave()


@pytest.mark.parametrize("t", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_dequantize_is_the_files(mats, t):
    m = K.FileMatrix(mats[f"w.{t.name}"])
    p = m.interleave()
    np.testing.assert_array_equal(p.dequantize(rows=range(0, 53)), m.dequantize())
    cols = col_ranges(m)[0]
    np.testing.assert_array_equal(p.dequantize(rows=range(48, 53), cols=cols), m.dequantize(rows=range(48, 53), cols=cols))


def test_interleaved_memory_is_never_unmapped_as_a_files(tmp_path):
    """A large interleaved copy lives in anonymous huge-page memory, which MADV_DONTNEED would
    zero: what unmaps a file's pages leaves it alone, and its values stay."""
    big = np.random.default_rng(47).standard_normal((4096, 512))
    p = K.FileMatrix(write_tensors(tmp_path / "big.gguf", {"w": (big, T.Q8_0)})["w"]).interleave()
    assert p.data.nbytes >= 1 << 21
    before = p.data.copy()
    unmap_file_pages(p.data)
    np.testing.assert_array_equal(p.data, before)


def test_what_interleaved_rows_refuse(mats):
    p = K.FileMatrix(mats["w.Q4_0"]).interleave()
    with pytest.raises(ValueError, match="already interleaved"):
        p.interleave()
    with pytest.raises(ValueError, match="before interleaving"):
        p.keep_columns(range(32, 64))
    x = np.zeros(160, np.float32)
    for bad in ([3, 0], range(5, 20)):  # single rows in any order; a range off a group
        with pytest.raises(ValueError, match="ranges starting on 16 rows"):
            p.matvec(x, rows=bad, fast=True)
    with pytest.raises(ValueError, match="fast-mode"):  # no float path: exact mode keeps the file's layout
        p.matvec(x)
    with pytest.raises(ValueError, match="only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS, Q2_K, Q3_K and MXFP4"):
        K.FileMatrix(mats["w.F16"]).interleave()


# ---- the FFN step on interleaved gate, up and down ---------------------------------------------

HIDDEN, N_FF = 96, 160


@pytest.fixture(scope="module", params=[T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def ffn(request, tmp_path_factory):
    return ffn_file(tmp_path_factory.mktemp("xf"), request.param, HIDDEN, N_FF, 44, 0.3)


@pytest.mark.parametrize("own", [range(0, N_FF), range(32, 96), range(128, 160)], ids=str)
def test_interleaved_ffn_step_is_the_dense_ffn(ffn, isa, own):
    """ffn_token on interleaved rows against the float64 FFN of the dequantized blocks (fast
    mode's tolerance), and ffn_batch equal to it token for token, bit for bit."""
    m, w = ffn
    gate, up, down = interleaved_shard(m, own)
    rng = np.random.default_rng(45)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    owned = torch.zeros(N_FF, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for B in BATCHES:
        X = (rng.standard_normal((B, HIDDEN)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, fast=True)
        assert n == B * len(own)
        for b in range(B):
            alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", one, fast=True)
            np.testing.assert_array_equal(y[b], alone, err_msg=f"B={B} token {b}")
            assert nb == len(own)
            want = ffn_dense_reference(torch.from_numpy(X[b].astype(np.float64))[None], w["gate"], w["up"],
                                       w["down"], "silu", owned)[0].numpy()
            assert np.abs(alone - want).max() <= 0.05 * (np.abs(want).max() + 1e-3)
            # the file's layout: the same integers, another float order
            file_y, _ = K.ffn_token(m["gate"], m["up"], m["down"], X[b], own, "silu", one, fast=True)
            np.testing.assert_allclose(alone, file_y, rtol=1e-4, atol=1e-4 * np.abs(file_y).max())


@pytest.mark.parametrize("own", [range(0, N_FF), range(32, 96)], ids=str)
def test_threshold_steps_read_interleaved_gate_rows(ffn, isa, own):
    """Gate interleaved, up in the file's rows (an engine that may decode with thresholds):
    gate's products decide who is active, then only active neurons' up rows are read. The
    result is that composition of the separate products (to the last bit of the activation
    function), bit for bit the same alone and in a batch,
    with one threshold for all tokens or one each (negative: dense for that token)."""
    m, _ = ffn
    gate, _, down = interleaved_shard(m, own)
    up = m["up"]
    rng = np.random.default_rng(46)
    scratch, one = K.FfnScratch(HIDDEN, len(own)), K.FfnScratch(HIDDEN, len(own))
    silu = lambda v: v / (np.float32(1) + np.exp(-v))
    for B in (1, 3, 9):
        X = (rng.standard_normal((B, HIDDEN)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        g = np.stack([silu(gate.matvec(x, rows=own, fast=True)) for x in X])
        per_token = np.quantile(np.abs(g), 0.5, axis=1).astype(np.float32)
        per_token[::2] = -1
        for thr in (float(np.median(np.abs(g))), per_token):
            y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, threshold=thr, fast=True)
            total = 0
            for b in range(B):
                t = thr if np.isscalar(thr) else float(thr[b])
                t = None if t < 0 else t
                alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", one, threshold=t, fast=True)
                np.testing.assert_array_equal(y[b], alone, err_msg=f"B={B} token {b}")
                act = np.abs(g[b]) > t if t is not None else np.ones(len(own), bool)
                assert nb == act.sum()
                total += nb
                h = np.where(act, g[b], 0).astype(np.float32)
                rows = np.flatnonzero(act & (h != 0)) + own.start
                h[rows - own.start] *= up.matvec(X[b], rows=rows, fast=True)
                want = down.matvec(h, rows=range(0, HIDDEN), cols=own, fast=True)
                # numpy's silu may differ from the kernel's expf in the last bit
                np.testing.assert_allclose(alone, want, rtol=0, atol=1e-5 * np.abs(want).max())
            assert n == total


def test_interleaved_ffn_refuses_sparse_steps(ffn):
    """Rows interleaved 16 by 16 cannot be read one neuron at a time: a threshold or a mask is
    a caller's error, said so, not a wrong answer."""
    m, _ = ffn
    own = range(0, N_FF)
    gate, up, down = interleaved_shard(m, own)
    scratch = K.FfnScratch(HIDDEN, N_FF)
    x = np.ones((2, HIDDEN), np.float32)
    for kw in (dict(threshold=0.1), dict(mask=np.ones(N_FF, np.uint8))):
        with pytest.raises(ValueError, match="dense fast-mode steps only"):
            K.ffn_token(gate, up, down, x[0], own, "silu", scratch, fast=True, **kw)
        with pytest.raises(ValueError, match="dense fast-mode steps only"):
            K.ffn_batch(gate, up, down, x, own, "silu", scratch, fast=True, **kw)
    with pytest.raises(ValueError, match="dense fast-mode steps only"):
        K.ffn_token(gate, up, down, x[0], own, "silu", scratch, fast=False)


# ---- an engine that decodes densely in fast mode holds its rows interleaved ---------------------

@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_K"])
def test_a_fast_engine_interleaves_what_its_steps_read_whole(tiny_model_factory, tmp_path, tensor_type, no_leaks,
                                                             monkeypatch):
    """Coordinator and worker hold down interleaved, and gate too (dense and threshold steps
    read every gate row); up as well where the engine only decodes densely. The logits are
    the file layout's up to float order, prompt and decoded tokens; threshold steps run on
    interleaved gate rows and give the file layout's; a sparse step asked of a dense-only
    engine is refused in one clear line, and so are predictors where gate is interleaved."""
    from tests.conftest import runnable_isas

    # the engine's processes at the best SIMD level the CPU has, whatever the run's cap
    # (SPARSEINFER_ISA=generic tests the portable loops; this test needs interleaved tiles)
    simd = [level for level in runnable_isas() if level in K.SIMD_LEVELS]
    if not simd:
        pytest.skip("not an x86 CPU with AVX2: no level with interleaved tiles")
    default = K.isa()
    monkeypatch.setenv("SPARSEINFER_ISA", simd[-1])
    K.set_isa(simd[-1])
    try:
        _fast_engine_interleaves(tiny_model_factory, tmp_path, tensor_type)
    finally:
        K.set_isa(default)


def _fast_engine_interleaves(tiny_model_factory, tmp_path, tensor_type):
    import shutil

    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.runtime.model_files import save_thresholds
    from coordinator.tools import corpus
    from coordinator.tools.calibrate import calibrate
    from sparsecore.file_layer import FileLayer

    path = tmp_path / "m.gguf"  # its own copy: the thresholds file goes beside it
    shutil.copy(tiny_model_factory(tensor_type=tensor_type), path)
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf")) as eng:
        calib = list(range(3, 200))
        save_thresholds(path, calibrate(eng, corpus.token_chunks(calib, 64, 3), levels=(0.5,)))
    ids = [5, 17, 33, 80, 120, 7, 9]

    def logits(eng):
        eng.reset()
        prompt = eng.model.forward(ids[:4])
        return np.concatenate([prompt, np.stack([eng.model.forward([t])[-1] for t in ids[4:]])])

    got = {}
    for interleave in (None, False):
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=True,
                                        interleave=interleave, sparse_method="cats")) as eng:
            assert eng.interleaved == (interleave is None)
            assert eng.row_layout == ("gate+up" if interleave is None else "gate")
            own = [w for w in eng.ffn.own.layers.values() if isinstance(w, FileLayer)]
            assert own and all(w.down.interleaved and w.gate.interleaved for w in own)
            assert all(w.up.interleaved == (interleave is None) for w in own)
            # up's rows, picked by threshold steps, with their blocks interleaved where the type has that layout
            assert all(w.up.blocked == (interleave is False and tensor_type == "Q4_0" and K.blocked_rows()) for w in own)
            got[interleave] = logits(eng)
            if interleave is None:
                with pytest.raises(ValueError, match="interleaved for dense decoding"):
                    eng.set_sparsity(0.5)
            else:
                eng.set_sparsity(0.5)
                got["sparse"] = logits(eng)
            with pytest.raises(ValueError, match="predictors cannot pick"):
                eng.predictors = object()
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=True, sparsity=0.5, sparse_method="cats")) as eng:
        assert eng.row_layout == "gate"
        got["sparse again"] = logits(eng)
    scale = np.abs(got[False]).max()
    # the layouts sum a row's blocks in other orders: h differs in its last bits, and where one of
    # its 8-bit values rounds the other way, down's product moves by about one quantization step
    # (on AVX2 the tiny Q4_0 model's first token: 0.005 of 1.8); a wrong row moves far more
    np.testing.assert_allclose(got[None], got[False], rtol=0, atol=2e-2 * scale)
    # sparsity at load gives down an input-major twin (CATS's zeroed neurons skip its rows); a
    # Q4_0 twin's sums are the dense kernel's, float for float; a K-quant twin's per-block floats
    # come in another order (cols_kquants_generic.c): the last bits differ, and so, as above, a
    # later token's 8-bit value or a neuron at its threshold can fall the other way (measured:
    # 0.011 of the scale; the thresholds themselves move the logits by 0.1 of it)
    if tensor_type == "Q4_0":
        np.testing.assert_array_equal(got["sparse"], got["sparse again"])
    else:
        np.testing.assert_allclose(got["sparse"][:2], got["sparse again"][:2], rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(got["sparse"], got["sparse again"], rtol=0, atol=2e-2 * scale)
    assert np.abs(got["sparse"] - got[False]).max() > 1e-4 * scale  # the thresholds took effect
    with pytest.raises(ValueError, match="dense decoding only"):
        Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=True, interleave=True,
                                   sparsity=0.5, sparse_method="cats"))


# ---- a shard's predictor rows, read whole, interleaved -------------------------------------------

@pytest.mark.parametrize("own", [range(0, 100), range(5, 100), range(40, 77)], ids=str)
def test_shard_predictor_rows_interleave_and_score_their_own_neurons(tmp_path, own):
    """fc1 whole and fc2 from the group holding own.start: the mask is set within [own] only,
    and matches the file layout's scores except where a score is within rounding of the
    threshold."""
    from sparsecore.predictor_rows import PredictorRows

    rng = np.random.default_rng(48)
    ts = write_tensors(tmp_path / "p.gguf", {"fc1": (rng.standard_normal((64, 96)), T.Q4_0),
                                             "fc2": (rng.standard_normal((100, 64)), T.Q8_0)})
    fc1, fc2 = K.FileMatrix(ts["fc1"]), K.FileMatrix(ts["fc2"])
    rows = PredictorRows(fc1, fc2, own, 0.5, fast=True)
    x = rng.standard_normal(96).astype(np.float32)
    scores = fc2.matvec(np.maximum(fc1.matvec(x, fast=True), 0), fast=True)
    mask = rows.mask_for(x).copy()
    assert not mask[:own.start].any() and not mask[own.stop:].any()
    want = scores[own.start:own.stop] > 0.5
    clear = np.abs(scores[own.start:own.stop] - 0.5) > 1e-3 * np.abs(scores).max()
    assert 0 < want.sum() < len(own)
    np.testing.assert_array_equal(mask[own.start:own.stop][clear], want[clear])
    assert rows.fc2_rows == (range(own.start // 16 * 16, own.stop) if K.interleaving() else own)
