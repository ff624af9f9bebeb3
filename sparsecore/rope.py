"""Rotary position tables: cos and signed sin per position, one pair per (base, scale) the
layers use (gemma3's sliding layers have their own base), computed the same way in every
process (the coordinator's model, a worker's attention shard) or shared through the KV pool."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig


def yarn_inv_freq(base: float, d: int, yarn: tuple) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies (float32) and its attention factor, as transformers'
    _compute_yarn_parameters: each frequency between the original one (extrapolation, fast
    rotations) and it over `factor` (interpolation, slow ones), by a linear ramp over the
    dimensions whose rotations in the original context lie between beta_fast and beta_slow
    (the range's ends floored and ceiled where `truncate`; gpt-oss's are not)."""
    factor, orig, beta_fast, beta_slow, attn, truncate = yarn

    def dim_of(rotations: float) -> float:
        return d * np.log(orig / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    e = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    pos_freqs = (np.float64(base) ** e.astype(np.float64)).astype(np.float32)
    extra = np.float32(1.0) / pos_freqs
    inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)  # the extrapolation's share
    return (inter * (np.float32(1) - keep) + extra * keep).astype(np.float32), attn


def rope_tables(base: float, scale: float, d: int, max_ctx: int,
                factors: np.ndarray | None = None, yarn: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin (max_ctx, d) of rotate-half RoPE, float32, as transformers computes
    them: the inverse frequencies and each position's angle in float32 (an angle's rounding at
    position p is what transformers' is), the cosine and sine of that float32 angle exactly
    rounded (torch's own differ from that in the last bit for a few percent of the entries).
    `factors`: Llama 3.1-style per-frequency scaling; scale: linear, positions / scale; `yarn`:
    ModelConfig.rope_yarn (yarn_inv_freq), cos and sin times its attention factor."""
    e = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = np.float32(1.0) / (np.float64(base) ** e.astype(np.float64)).astype(np.float32)
    mscale = None
    if yarn is not None:
        inv_freq, mscale = yarn_inv_freq(base, d, yarn)
    if factors is not None:
        inv_freq = inv_freq / factors.astype(np.float32)
    if scale != 1.0:
        inv_freq = inv_freq / np.float32(scale)
    angles = np.arange(max_ctx, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos = np.cos(angles.astype(np.float64)).astype(np.float32)
    sin = np.sin(angles.astype(np.float64)).astype(np.float32)
    if mscale is not None:  # transformers scales the float32 cos and sin by its attention factor
        cos, sin = cos * np.float32(mscale), sin * np.float32(mscale)
    # transformers' rotate_half(x) * sin is x with its halves swapped times (-sin, +sin)
    return np.concatenate((cos, cos), 1), np.concatenate((-sin, sin), 1)


# The key of a layer without rope (smallthinker's NoPE layers) in layer_tables: its table is
# cos 1, sin 0, so the rotation every attention path applies leaves Q and K exactly as they are
NO_ROPE = (0.0, 0.0)


def layer_rope_tables(key: tuple[float, float], d: int, max_ctx: int, factors: np.ndarray | None = None,
                      yarn: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tables of one of layer_tables' keys: rope_tables, or the identity for NO_ROPE."""
    if key == NO_ROPE:
        return np.ones((max_ctx, d), np.float32), np.zeros((max_ctx, d), np.float32)
    return rope_tables(*key, d, max_ctx, factors, yarn)


def layer_tables(cfg: ModelConfig) -> tuple[list[tuple[float, float]], list[int]]:
    """The distinct (base, scale) pairs of the layers' rope (NO_ROPE for a layer without), in
    order of first use, and each layer's index into them."""
    keys: list[tuple[float, float]] = []
    index = []
    for i in range(cfg.n_layers):
        key = cfg.layer_rope_base(i) if cfg.layer_has_rope(i) else NO_ROPE
        if key not in keys:
            keys.append(key)
        index.append(keys.index(key))
    return keys, index
