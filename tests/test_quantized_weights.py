"""Workers that keep FFN weights as int8 rows (--weights int8) compute the FFN of the dequantized
int8 weights: the result equals a float64 reference built from those dequantized weights with
inactive neurons zeroed, to 1e-4 of the output's scale (float32 rounding, as for f32 weights), on
dense, mask and threshold steps; and the int8 weights are within half a step of the originals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.runtime.engine import Engine, EngineOptions
from tests.fixtures.ffn_reference import ffn_dense_reference
from sparsecore.ffn import ACTIVATIONS, Int8Rows, ffn_partial, ffn_partial_threshold, quantize_rows
from tests.fixtures.ffn_checks import (assert_close, check_float32_steps, ffn_rows, rows_reference, rows_rig,
                                       run_rig, threshold_with_gap)

TOL = 1e-4  # of the output's max |value|, as tests/test_ffn_exactness.py


def _q64(w: np.ndarray) -> np.ndarray:
    """Dequantized int8 rows as float64 (the rows of w are quantized independently)."""
    return Int8Rows.quantize(torch.from_numpy(w).float()).dequantize().double().numpy()


# ---- the format itself ----------------------------------------------------------------------

def test_quantization_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.rand(64, 1) * 0.2  # rows of very different scales
    w[5] = 0.0
    q = Int8Rows.quantize(w)
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float32
    assert q.nbytes == 64 * 96 + 4 * 64
    err = (q.dequantize() - w).abs().amax(1)
    row_max = w.abs().amax(1)
    assert torch.all(err <= row_max / 254 * (1 + 1e-5))  # half a step; a step is max|row| / 127
    assert torch.all(err[row_max > 0] / row_max[row_max > 0] < 1 / 127)
    assert torch.all(q.dequantize()[5] == 0)
    assert q.q.abs().amax(1)[row_max > 0].eq(127).all()  # the full int8 range is used


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        quantize_rows(torch.zeros(2, 2), "int3")
    with pytest.raises(ValueError, match="unknown weight format"):
        Engine("/nonexistent.gguf", EngineOptions(weights="fp8"))


# ---- the FFN kernels on int8 rows, in process ------------------------------------------------

@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(0)
    gate, up, down_t = ffn_rows(rng)
    q = [Int8Rows.quantize(torch.from_numpy(a).float()) for a in (gate, up, down_t)]
    deq = [w.dequantize().double() for w in q]
    return q, deq, rng, [torch.from_numpy(a) for a in (gate, up, down_t)]


@pytest.mark.parametrize("n_tokens", [1, 4])
def test_dense_and_masked_steps(rows, n_tokens):
    q, deq, rng, original = rows
    check_float32_steps(q, deq, rng, n_tokens, (1.0, 0.5, 0.2, 0.03))


def test_result_is_that_of_the_quantized_weights(rows):
    """Not vacuous: the int8 answer is measurably not the float one, and close to it."""
    q, deq, rng, original = rows
    x = rng.standard_normal((1, q[0].shape[1])).astype(np.float32)
    got = ffn_partial(torch.from_numpy(x), *q, "silu").numpy()
    assert_close(got, rows_reference(deq, x))
    orig = rows_reference(original, x)
    rel = np.abs(got - orig).max() / np.abs(orig).max()
    assert 1e-5 < rel < 0.05


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_threshold_steps(rows, n_tokens):
    q, deq, rng, original = rows
    x = rng.standard_normal((n_tokens, q[0].shape[1])).astype(np.float32)
    g = ACTIVATIONS["silu"](torch.from_numpy(x).double() @ deq[0].T).numpy()
    thr = threshold_with_gap(g)
    keep = np.abs(g) > thr
    got, n_active = ffn_partial_threshold(torch.from_numpy(x), *q, "silu", thr)
    assert n_active == int(keep.sum()) and 0 < n_active < keep.size
    gate, up, down_t = deq
    h = torch.from_numpy(g * keep) * (torch.from_numpy(x).double() @ up.T)
    assert_close(got.numpy(), (h @ down_t).numpy())


# ---- real worker processes -------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tiny_model_factory):
    with rows_rig(tiny_model_factory(tensor_type="Q8_0"), "int8") as (p, weights, activation):
        # the reference's int8 weights: gate/up rows and down columns (neurons) quantized one by one
        qweights = {l: (_q64(g), _q64(u), _q64(d.T).T) for l, (g, u, d) in weights.items()}
        yield p, weights, qweights, activation


def test_workers_hold_int8(pool):
    """Each worker reports int8 bytes: one byte a weight plus a float32 scale per row (f32 rows
    would be four times as large, so silently float weights fail here)."""
    p, weights, _, _ = pool
    hidden = p.buffers.layout.hidden
    for w in p.workers:
        assert w.weight_bytes == w.n_neurons * 3 * (hidden + 4), w.label


def test_worker_steps_match_dequantized_reference(pool):
    p, weights, qweights, act = pool
    n_ff, hidden = p.plan.n_ff, p.buffers.layout.hidden
    rng = np.random.default_rng(1)
    for layer in weights:
        gq, uq, dq = (torch.from_numpy(a) for a in qweights[layer])
        for n_tokens in (1, 3):
            x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
            x64 = torch.from_numpy(x).double()
            assert_close(run_rig(p, layer, x), ffn_dense_reference(x64, gq, uq, dq, act).numpy())
            for frac in (0.5, 0.2):
                mask = (rng.random(n_ff) < frac).astype(np.uint8)
                want = ffn_dense_reference(x64, gq, uq, dq, act, torch.from_numpy(mask.astype(np.float64)))
                assert_close(run_rig(p, layer, x, mask), want.numpy())
            g = ACTIVATIONS[act](x64 @ gq.T)
            thr = threshold_with_gap(g.numpy())
            keep = g.abs() > thr
            want = (g * keep * (x64 @ uq.T)) @ dq.T
            assert_close(run_rig(p, layer, x, threshold=thr), want.numpy())
        # against the original float weights the int8 answer is close but not identical
        x = rng.standard_normal((1, hidden)).astype(np.float32)
        orig = ffn_dense_reference(torch.from_numpy(x).double(), *(torch.from_numpy(a) for a in weights[layer]), act)
        got = run_rig(p, layer, x)
        rel = np.abs(got - orig.numpy()).max() / np.abs(orig.numpy()).max()
        assert 1e-6 < rel < 0.05


def test_engine_runs_int8(tiny_model):
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, weights="int8")) as eng:
        toks = list(eng.generate(eng.tokenizer.encode("Hello"), max_tokens=4, stop_at_eos=False))
        s = eng.stats()
    cfg = eng.cfg
    assert len(toks) == 4
    assert s["weights"] == "int8"
    assert sum(s["worker_weight_bytes"]) + s["coordinator_ffn_bytes"] == cfg.n_layers * cfg.n_ff * 3 * (cfg.hidden + 4)
