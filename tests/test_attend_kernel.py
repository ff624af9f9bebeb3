"""Softmax attention over the KV cache (attend in _kernels.c), reached through AttentionStep with
float32 weights in exact mode, against float64 numpy: GQA groups of 1, 3, 8 and 20 query heads
(more than one SIMD call's worth), head sizes on the AVX-512 path (64, 128, 80), the AVX2 one
(72) and the portable one (36), partial RoPE, positions at and around the vector widths and
far past them, in every ISA this CPU runs. The caches are a slice of a larger array (the step
sees its first KV head at an offset, as a caller with a subset of heads does), and everything
the kernel must not read or write (other heads, positions past the token's) holds NaN."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K

MAX_CTX = 320


def f32_matrix(a: np.ndarray, name: str) -> K.FileMatrix:
    """A float32 (rows, cols) array as the GGUF reader's tensor would give it"""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return K.FileMatrix(SimpleNamespace(name=name, tensor_type=T.F32, shape=(a.shape[1], a.shape[0]), data=a))


def rope_tables(d: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin (the first half negated), MAX_CTX rows of d, as the Python model's"""
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    ang = np.arange(MAX_CTX)[:, None] * np.concatenate([inv, inv])[None, :]
    sign = np.concatenate([-np.ones(d // 2), np.ones(d // 2)])
    return np.cos(ang).astype(np.float32), (np.sin(ang) * sign).astype(np.float32)


def rope_ref(x: np.ndarray, d: int, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x (heads, hd): rotate-half on the first d values of each head"""
    y = x.copy()
    half = d // 2
    rot = np.concatenate([x[:, half:d], x[:, :half]], axis=1)
    y[:, :d] = x[:, :d] * c + rot * s
    return y


class Layer:
    """One attention layer with random weights (Wo the identity, so that the residual's change
    is the attention output itself) and its float64 reference."""

    def __init__(self, n_heads: int, n_kv: int, hd: int, d: int, seed: int, layer_norm: bool = False):
        rng = np.random.default_rng(seed)
        self.n_heads, self.n_kv, self.hd, self.d = n_heads, n_kv, hd, d
        hidden = self.hidden = n_heads * hd
        # scores of a few units: peaked softmaxes, and maxima that move from chunk to chunk
        self.wq = (rng.standard_normal((hidden, hidden)) * 3 / np.sqrt(hidden)).astype(np.float32)
        self.wk = (rng.standard_normal((n_kv * hd, hidden)) / np.sqrt(hidden)).astype(np.float32)
        self.wv = rng.standard_normal((n_kv * hd, hidden)).astype(np.float32)
        # rows reordered within each head, as llama.cpp's Q permutation is undone (qk_order)
        self.q_rows = np.concatenate([h * hd + rng.permutation(hd) for h in range(n_heads)]).astype(np.int32)
        self.k_rows = np.concatenate([h * hd + rng.permutation(hd) for h in range(n_kv)]).astype(np.int32)
        self.norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
        # falcon's LayerNorm: the bias is AttentionExtras.norm_bias (None: RMSNorm)
        self.norm_bias = rng.uniform(-0.5, 0.5, hidden).astype(np.float32) if layer_norm else None
        self.cos, self.sin = rope_tables(d)
        self.rng = rng

    def caches(self, pos: int):
        """(keys, values) for n_kv heads, a slice of a NaN array with a head either side;
        positions before pos random, keys growing with the position (later maxima)"""
        big = np.full((2, self.n_kv + 2, MAX_CTX, self.hd), np.nan, np.float32)
        grow = 1 + 2 * np.arange(pos) / max(pos, 1)
        big[0, 1:-1, :pos] = self.rng.standard_normal((self.n_kv, pos, self.hd)) * grow[None, :, None]
        big[1, 1:-1, :pos] = self.rng.standard_normal((self.n_kv, pos, self.hd))
        return big, big[0, 1:-1], big[1, 1:-1]

    def step(self, kc, vc) -> K.AttentionStep:
        return K.AttentionStep(f32_matrix(self.wq, "q"), self.q_rows, f32_matrix(self.wk, "k"), self.k_rows,
                               f32_matrix(self.wv, "v"), f32_matrix(np.eye(self.hidden), "o"), self.norm, 1e-6,
                               self.n_heads, self.n_kv, self.hd, self.d, self.cos, self.sin, kc, vc, fast=False,
                               extras=K.AttentionExtras(norm_bias=self.norm_bias))

    def reference(self, h: np.ndarray, pos: int, kc: np.ndarray, vc: np.ndarray):
        """(attention output, new key rows, new value rows) in float64 from the caches before the step"""
        hd, d = self.hd, self.d
        x = h.astype(np.float64)
        if self.norm_bias is None:
            x = x / np.sqrt(np.mean(x * x) + 1e-6) * self.norm
        else:
            x = (x - x.mean()) / np.sqrt(np.var(x) + 1e-6) * self.norm + self.norm_bias
        q = (self.wq[self.q_rows].astype(np.float64) @ x).reshape(self.n_heads, hd)
        k = (self.wk[self.k_rows].astype(np.float64) @ x).reshape(self.n_kv, hd)
        v = (self.wv.astype(np.float64) @ x).reshape(self.n_kv, hd)
        c, s = self.cos[pos].astype(np.float64), self.sin[pos].astype(np.float64)
        q, k = rope_ref(q, d, c, s), rope_ref(k, d, c, s)
        keys = np.concatenate([kc[:, :pos].astype(np.float64), k[:, None]], axis=1)
        vals = np.concatenate([vc[:, :pos].astype(np.float64), v[:, None]], axis=1)
        group = self.n_heads // self.n_kv
        out = np.empty((self.n_heads, hd))
        for i in range(self.n_heads):
            sc = keys[i // group] @ q[i] / np.sqrt(hd)
            a = np.exp(sc - sc.max())
            out[i] = (a / a.sum()) @ vals[i // group]
        return out.reshape(-1), k, v


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
