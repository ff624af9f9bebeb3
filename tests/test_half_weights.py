"""--weights f16: workers keep FFN rows (and the coordinator its attention matrices) as float16.

What must hold: batches (prefill, perplexity) compute in float32 on the float16 weights, so they
match a float64 reference built from the float16-rounded weights to float32 rounding (1e-4 of
the output's scale, as f32 weights); one-token steps run the products in float16 (torch
accumulates in float32 and rounds the result), within 2e-3 of that reference and measurably not
float32; workers hold 2 bytes a weight (plus the down columns' transpose on a CPU, 4 bytes a
neuron value in all) rather than 4; and an engine with f16 weights decodes what f32 decodes
on the tiny model, greedily."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.tools.observe import coordinator_bytes_per_token
from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.placement import neuron_bytes
from coordinator.runtime.sampling import SamplingParams
from tests.fixtures.ffn_reference import ffn_dense_reference
from sparsecore.ffn import (ACTIVATIONS, HalfRows, ffn_partial, ffn_partial_threshold,
                            quantize_rows, x_wt)
from tests.fixtures.ffn_checks import (assert_close, check_float32_steps, ffn_rows, rows_reference, rows_rig,
                                       run_rig, threshold_with_gap)

ONE_TOKEN_TOL = 2e-3  # float16 rounding of x, of the products and of h: ~2**-11 each


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _h64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).half().double()


def test_half_rows_layout():
    w = torch.randn(6, 10)
    down = quantize_rows(w, "f16", for_h_w=True)
    gate = quantize_rows(w, "f16")
    assert isinstance(down, HalfRows) and down.rows.dtype == torch.float16
    assert torch.equal(down.cols, down.rows.T) and down.cols.is_contiguous()
    assert gate.cols is None and gate.nbytes == 6 * 10 * 2 and down.nbytes == 2 * 6 * 10 * 2
    assert torch.equal(gate.dequantize(), w.half().float())
    picked = down.index_select(0, torch.tensor([4, 1]))
    assert torch.equal(picked.rows, down.rows[[4, 1]]) and picked.cols is None
    with pytest.raises(ValueError, match="float16"):
        HalfRows(w)
    assert neuron_bytes(576, "f16") == 3 * 2 * 576  # what a GPU holds (no transposed copy there)


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(0)
    w = ffn_rows(rng)
    half = [quantize_rows(torch.from_numpy(a).float(), "f16", for_h_w=(i == 2)) for i, a in enumerate(w)]
    return half, [_h64(a) for a in w], [torch.from_numpy(a) for a in w], rng


def test_batches_are_float32_on_the_half_weights(rows):
    half, w64, _, rng = rows
    check_float32_steps(half, w64, rng, 4, (1.0, 0.5, 0.2))


def test_one_token_steps_run_in_float16(rows):
    half, w64, original, rng = rows
    for p in (1.0, 0.5, 0.2):  # dense (down's cols), gathered rows
        mask = rng.random(96) < p
        x = rng.standard_normal((1, 40)).astype(np.float32)
        active = None if p == 1.0 else torch.from_numpy(np.flatnonzero(mask))
        got = ffn_partial(torch.from_numpy(x), *half, "silu", active).numpy()
        want = rows_reference(w64, x, None if p == 1.0 else mask)
        assert got.dtype == np.float32
        assert 1e-6 < _rel(got, want) < ONE_TOKEN_TOL  # float16 products: not float32, but close
        assert np.array_equal(got.astype(np.float16).astype(np.float32), got)  # the last product's rounding
    # each product on its own: one token in float16, a batch in float32
    for t, in_half in ((1, True), (4, False)):
        y = x_wt(torch.randn(t, 40), half[0]).numpy()
        assert np.array_equal(y.astype(np.float16).astype(np.float32), y) == in_half
    thr = threshold_with_gap(ACTIVATIONS["silu"](torch.from_numpy(x).double() @ w64[0].T).numpy())
    got, n_active = ffn_partial_threshold(torch.from_numpy(x), *half, "silu", thr)
    g = ACTIVATIONS["silu"](torch.from_numpy(x).double() @ w64[0].T)
    keep = g.abs() > thr
    assert n_active == int(keep.sum())
    want = ((g * keep * (torch.from_numpy(x).double() @ w64[1].T)) @ w64[2]).numpy()
    assert _rel(got.numpy(), want) < ONE_TOKEN_TOL


@pytest.fixture(scope="module")
def pool(tiny_model_factory):
    with rows_rig(tiny_model_factory(tensor_type="Q8_0"), "f16") as (p, weights, activation):
        yield p, {l: tuple(_h64(a).numpy() for a in w) for l, w in weights.items()}, activation


def test_workers_hold_float16(pool):
    """2 bytes a gate and up value, 4 a down value (rows and columns) on a CPU worker: float32
    rows (12 bytes a neuron value) fail here."""
    p, _, _ = pool
    hidden = p.buffers.layout.hidden
    for w in p.workers:
        assert w.weight_bytes == w.n_neurons * hidden * (2 + 2 + 4), w.label
        assert w.weight_bytes == w.n_neurons * neuron_bytes(hidden, "f16", on_cpu=True)  # what `info` reports


def test_worker_steps_match_half_reference(pool):
    p, half, act = pool
    rng = np.random.default_rng(1)
    for layer, (g, u, d) in half.items():
        gq, uq, dq = (torch.from_numpy(a) for a in (g, u, d))
        for n_tokens, check in ((3, assert_close), (1, lambda a, b: _rel(a, b) < ONE_TOKEN_TOL or
                                                    pytest.fail(f"relative error {_rel(a, b):.2e}"))):
            x = rng.standard_normal((n_tokens, g.shape[1])).astype(np.float32)
            x64 = torch.from_numpy(x).double()
            check(run_rig(p, layer, x), ffn_dense_reference(x64, gq, uq, dq, act).numpy())
            mask = (rng.random(p.plan.n_ff) < 0.5).astype(np.uint8)
            want = ffn_dense_reference(x64, gq, uq, dq, act, torch.from_numpy(mask.astype(np.float64)))
            check(run_rig(p, layer, x, mask), want.numpy())


def test_engine_decodes_like_f32(tiny_model):
    """On the tiny model float16 rounding does not change greedy tokens; the attention matrices
    are float16 too, and the stats report the format."""
    ids = None
    out, coord_bytes = {}, {}
    for fmt in ("f32", "f16"):
        with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, weights=fmt)) as eng:
            ids = ids or eng.tokenizer.encode("Hello world")
            out[fmt] = list(eng.generate(ids, 8, SamplingParams(0.0), stop_at_eos=False))
            s = eng.stats()
            attn = eng.model.layers[0]
            assert isinstance(attn.wqkv, HalfRows) == (fmt == "f16")
            assert isinstance(attn.wo, HalfRows) == (fmt == "f16")
            per_value = {"f32": 12, "f16": 8}[fmt]
            assert s["weights"] == fmt
            held = sum(s["worker_weight_bytes"]) + s["coordinator_ffn_bytes"]
            assert held == eng.cfg.n_layers * eng.cfg.n_ff * eng.cfg.hidden * per_value
            coord_bytes[fmt] = coordinator_bytes_per_token(eng)
            attn_values = sum(l.wqkv.shape.numel() + l.wo.shape.numel() for l in eng.model.layers)
    assert out["f16"] == out["f32"]
    assert coord_bytes["f32"] - coord_bytes["f16"] == 2 * attn_values  # bench counts 2 bytes, not 0 or 4


def test_powerinfer_model_runs_f16_with_its_predictors(tmp_path):
    """PowerInfer's layout (down stored transposed as ffn_down_t, gpu share, predictor masks that
    gather rows) in float16: same greedy tokens as float32, fewer bytes, predictors in use."""
    from tests.fixtures.tiny_powerinfer import write_tiny_powerinfer

    path = write_tiny_powerinfer(tmp_path / "tiny.powerinfer.gguf")
    out, bytes_ = {}, {}
    for fmt in ("f32", "f16"):
        with Engine(path, EngineOptions(cpu_workers=2, threads=2, gpu_share=0.3, weights=fmt)) as eng:
            assert eng.predictors is not None
            ids = eng.tokenizer.encode("the quick brown fox")
            out[fmt] = list(eng.generate(ids, 10, SamplingParams(0.0), stop_at_eos=False))
            computed = sum(eng.ffn.stats.active.values())
            assert computed < sum(eng.ffn.stats.tokens.values()) * eng.cfg.n_ff  # masks applied
            bytes_[fmt] = sum(eng.stats()["worker_weight_bytes"]) + eng.stats()["coordinator_ffn_bytes"]
    assert out["f16"] == out["f32"]
    assert bytes_["f16"] * 12 == bytes_["f32"] * 8
