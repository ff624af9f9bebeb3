"""The native kernels (sparsecore/kernels) against float64 products of the blocks dequantized by
gguf-py (an implementation nobody here wrote), for every native type, in both ISAs, exact and
fast mode: dense and chosen rows (odd counts, one row, none), column ranges, the fused FFN step
dense, thresholded and masked (empty active sets included)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter, quants

from sparsecore import kernels as K
from tests.ffn_reference import ffn_dense_reference

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0]
ISAS = ["generic"] + (["avx2"] if K.set_isa("avx2") == "avx2" else [])


@pytest.fixture(params=ISAS)
def isa(request):
    assert K.set_isa(request.param) == request.param
    yield request.param
    K.set_isa("avx2")


def write_tensors(path, arrays: dict[str, tuple[np.ndarray, T]]):
    w = GGUFWriter(path, "llama")
    for name, (a, t) in arrays.items():
        if t == T.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif t == T.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(a.astype(np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = GGUFReader(path)
    return {t.name: t for t in r.tensors}


def deq(t) -> np.ndarray:
    return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(
        int(np.prod(t.shape[1:])), int(t.shape[0]))


@pytest.fixture(scope="module")
def mats(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {f"w.{t.name}": (rng.standard_normal((37, 96)), t) for t in TYPES}
    return write_tensors(tmp_path_factory.mktemp("k") / "m.gguf", arrays)


def tol(fast: bool, t: T, x, w) -> float:
    """Exact mode: float32 summation error. Fast mode: 8-bit activations (llama.cpp's error)."""
    scale = np.abs(w).sum(axis=1).max() * np.abs(x).max()
    quantized = fast and t in (T.Q4_0, T.Q4_1, T.Q8_0)
    return scale * (1 / 127 if quantized else 1e-6)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_matvec_rows_and_columns(mats, isa, t, fast):
    m = K.FileMatrix(mats[f"w.{t.name}"])
    w = deq(mats[f"w.{t.name}"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal(96).astype(np.float32)
    for rows in (None, range(5, 12), [36], [3, 0, 36, 17, 3], []):
        got = m.matvec(x, rows=rows, fast=fast)
        sel = w if rows is None else w[list(rows)]
        want = sel @ x.astype(np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=tol(fast, t, x, w))
    cols = range(32, 96)  # whole blocks of the columns (the FFN's down over owned neurons)
    got = m.matvec(x[32:], rows=range(0, 37), cols=cols, fast=fast)
    np.testing.assert_allclose(got, w[:, 32:] @ x[32:].astype(np.float64), rtol=0, atol=tol(fast, t, x, w))


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
    want = w @ x.astype(np.float64)
    exact = np.abs(m.matvec(x) - want).max()
    fast = np.abs(m.matvec(x, fast=True) - want).max()
    assert exact < 1e-4 * np.abs(want).max() < fast


def test_bad_arguments_are_refused(mats):
    m = K.FileMatrix(mats["w.Q8_0"])
    x = np.zeros(96, np.float32)
    with pytest.raises(ValueError, match="row index"):
        m.matvec(x, rows=[37])
    with pytest.raises(ValueError, match="whole blocks"):
        m.matvec(x[:16], cols=range(0, 16))
    with pytest.raises(ValueError, match="x has"):
        m.matvec(x[:64])


# ---- the fused FFN step ----------------------------------------------------------------------

HIDDEN, N_FF = 64, 128


@pytest.fixture(scope="module", params=[T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.F32], ids=lambda t: t.name)
def ffn(request, tmp_path_factory):
    t = request.param
    rng = np.random.default_rng(3)
    arrays = {"gate": (rng.standard_normal((N_FF, HIDDEN)) * 0.2, t), "up": (rng.standard_normal((N_FF, HIDDEN)) * 0.2, t),
              "down": (rng.standard_normal((HIDDEN, N_FF)) * 0.2, t),
              "down_t": (rng.standard_normal((N_FF, HIDDEN)) * 0.2, t)}
    ts = write_tensors(tmp_path_factory.mktemp("f") / "ffn.gguf", arrays)
    return t, {n: K.FileMatrix(ts[n]) for n in ts}, {n: torch.from_numpy(deq(ts[n])) for n in ts}


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("own", [range(0, 128), range(32, 96), range(96, 128)], ids=["all", "middle", "last"])
def test_ffn_token(ffn, isa, fast, own):
    t, m, w = ffn
    rng = np.random.default_rng(4)
    scratch = K.FfnScratch(HIDDEN, len(own))
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    x64 = torch.from_numpy(x.astype(np.float64))[None]
    owned = torch.zeros(N_FF, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    g = torch.nn.functional.silu(x64 @ w["gate"].T)[0]
    mags = np.sort(g[own.start:own.stop].abs().numpy())
    mid = mags[len(mags) // 4: 3 * len(mags) // 4]
    gap = int(np.argmax(np.diff(mid)))  # the widest gap in the middle half: no neuron on the edge
    cases = {"dense": (None, None, owned),
             "threshold": (float((mid[gap] + mid[gap + 1]) / 2), None, None),
             "mask": (None, (rng.random(N_FF) < 0.3).astype(np.uint8), None),
             "nothing active": (1e9, None, owned * 0)}
    for name, (thr, mask, active) in cases.items():
        if thr is not None and active is None:
            active = ((g.abs() > thr).double() * owned)
        if mask is not None:
            active = torch.from_numpy(mask.astype(np.float64)) * owned
        y, n = K.ffn_token(m["gate"], m["up"], m["down"], x, own, "silu", scratch, threshold=thr, mask=mask, fast=fast)
        want = ffn_dense_reference(x64, w["gate"], w["up"], w["down"], "silu", active)[0].numpy()
        assert n == int(active.sum()), name
        scale = np.abs(want).max() + 1e-3
        assert np.abs(y - want).max() <= (0.05 if fast and t in (T.Q4_0, T.Q4_1, T.Q8_0) else 1e-5) * scale, name


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("own", [range(0, 128), range(40, 77)], ids=["all", "unaligned"])
def test_ffn_token_down_transposed(ffn, isa, fast, own):
    """PowerInfer's layout: down stored transposed (a neuron's column is a row of blocks), read
    only for active neurons by an axpy each; any range of neurons, no alignment needed."""
    t, m, w = ffn
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
        assert np.abs(y - want).max() <= (0.05 if fast and t in (T.Q4_0, T.Q4_1, T.Q8_0) else 1e-5) * scale
