"""Softmax attention over the KV cache (attend in _kernels.c), reached through AttentionStep with
float32 weights in exact mode, against float64 numpy: GQA groups of 1, 3, 8 and 20 query heads
(more than one SIMD call's worth), head sizes on the AVX-512 path (64, 128, 80), the AVX2 one
(72) and the portable one (36), partial RoPE, positions at and around the vector widths and
far past them, in every ISA this CPU runs. The caches are a slice of a larger array (the step
sees its first KV head at an offset, as a caller with a subset of heads does), and everything
the kernel must not read or write (other heads, positions past the token's) holds NaN."""
from __future__ import annotations


import numpy as np
import pytest

from tests.fixtures.attention_ref import MAX_CTX, Layer


SHAPES = [  # n_heads, n_kv, hd, rope dim
    (2, 2, 64, 64), (6, 2, 64, 64), (8, 1, 64, 64), (3, 1, 128, 128), (8, 2, 128, 64),
    (3, 3, 80, 80), (6, 2, 96, 32), (20, 1, 32, 32), (3, 1, 72, 72), (6, 2, 36, 36)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-hd{}-rope{}".format(*s))
@pytest.mark.parametrize("pos", [0, 1, 7, 8, 15, 16, 17, 300, MAX_CTX - 1])
def test_attend_against_float64(isa, shape, pos):
    L = Layer(*shape, seed=pos)
    big, kc, vc = L.caches(pos)
    before_k, before_v = kc.copy(), vc.copy()
    h = L.rng.standard_normal(L.hidden).astype(np.float32)
    want, k_new, v_new = L.reference(h, pos, kc, vc)
    h0 = h.copy()
    L.step(kc, vc)(h, pos)
    got = h.astype(np.float64) - h0
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
    np.testing.assert_allclose(kc[:, pos], k_new, rtol=0, atol=1e-5 * np.abs(k_new).max())
    np.testing.assert_allclose(vc[:, pos], v_new, rtol=0, atol=1e-5 * np.abs(v_new).max())
    # the step wrote its own position of its own heads, nothing else
    for cache, before in ((kc, before_k), (vc, before_v)):
        cache_rest, before_rest = np.delete(cache, pos, axis=1), np.delete(before, pos, axis=1)
        assert np.array_equal(cache_rest, before_rest, equal_nan=True)
    assert np.isnan(big[:, 0]).all() and np.isnan(big[:, -1]).all()


@pytest.mark.parametrize("shape", [(8, 1, 64, 64), (6, 2, 36, 36)], ids=str)
def test_a_layer_norm_is_the_input_norm_where_the_record_has_its_bias(isa, shape):
    """falcon: the attention's input centred on its mean, scaled by its variance, times the
    weights plus the bias; the same step without the bias (RMSNorm) is far from it."""
    L = Layer(*shape, seed=5, layer_norm=True)
    _, kc, vc = L.caches(17)
    h = (L.rng.standard_normal(L.hidden) + 2.0).astype(np.float32)  # a mean far from 0
    want = L.reference(h, 17, kc, vc)[0]
    got = h.copy()
    L.step(kc.copy(), vc.copy())(got, 17)
    scale = np.abs(want).max()
    assert np.abs(got.astype(np.float64) - h - want).max() <= 1e-4 * scale
    L.norm_bias = None
    rms = h.copy()
    L.step(kc.copy(), vc.copy())(rms, 17)
    assert np.abs(rms.astype(np.float64) - h - want).max() > 1e-2 * scale


@pytest.mark.parametrize("shape", [(6, 2, 64, 64), (8, 1, 128, 128), (6, 2, 36, 36)], ids=str)
def test_a_sequence_attends_the_same_alone_and_in_a_batch(isa, shape):
    """attn_batch: per sequence exactly the floats of the one-token step"""
    L = Layer(*shape, seed=1)
    positions = [3, 40, 17, 300]
    caches = [L.caches(p)[1:] for p in positions]
    alone_caches = [(k.copy(), v.copy()) for k, v in caches]
    h = L.rng.standard_normal((len(positions), L.hidden)).astype(np.float32)
    alone = h.copy()
    step = L.step(*caches[0])
    for b, p in enumerate(positions):
        step(alone[b], p, cache=alone_caches[b])
    step.batch(h, np.array(positions, np.int64), np.array([c[0].ctypes.data for c in caches], np.int64),
               np.array([c[1].ctypes.data for c in caches], np.int64))
    assert np.array_equal(h, alone)
    for (k, v), (ka, va) in zip(caches, alone_caches):
        assert np.array_equal(k, ka, equal_nan=True) and np.array_equal(v, va, equal_nan=True)


@pytest.mark.parametrize("which", ["q_rows", "k_rows"])
def test_query_and_key_rows_may_move_within_their_head_only(which):
    """attn_part reads Q's and K's rows in the file's order and reorders each head's outputs: an
    order that moves a row to another head is refused, not computed wrong."""
    L = Layer(2, 2, 64, 64, seed=3)
    _, kc, vc = L.caches(4)
    setattr(L, which, np.roll(getattr(L, which), 1))
    with pytest.raises(ValueError, match="within each head"):
        L.step(kc, vc)
