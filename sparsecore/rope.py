"""Rotary position tables: cos and signed sin per position, one pair per (base, scale) the
layers use (gemma3's sliding layers have their own base), computed the same way in every
process (the coordinator's model, a worker's attention shard) or shared through the KV pool."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig


def rope_tables(base: float, scale: float, d: int, max_ctx: int,
                factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin (max_ctx, d) of rotate-half RoPE, float32, as transformers computes
    them: the inverse frequencies and each position's angle in float32 (an angle's rounding at
    position p is what transformers' is), the cosine and sine of that float32 angle exactly
    rounded (torch's own differ from that in the last bit for a few percent of the entries).
    `factors`: Llama 3.1-style per-frequency scaling; scale: linear, positions / scale."""
    e = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = np.float32(1.0) / (np.float64(base) ** e.astype(np.float64)).astype(np.float32)
    if factors is not None:
        inv_freq = inv_freq / factors.astype(np.float32)
    if scale != 1.0:
        inv_freq = inv_freq / np.float32(scale)
    angles = np.arange(max_ctx, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos = np.cos(angles.astype(np.float64)).astype(np.float32)
    sin = np.sin(angles.astype(np.float64)).astype(np.float32)
    # transformers' rotate_half(x) * sin is x with its halves swapped times (-sin, +sin)
    return np.concatenate((cos, cos), 1), np.concatenate((-sin, sin), 1)


def layer_tables(cfg: ModelConfig) -> tuple[list[tuple[float, float]], list[int]]:
    """The distinct (base, scale) pairs of the layers' rope, in order of first use, and each
    layer's index into them."""
    keys: list[tuple[float, float]] = []
    index = []
    for i in range(cfg.n_layers):
        key = cfg.layer_rope_base(i)
        if key not in keys:
            keys.append(key)
        index.append(keys.index(key))
    return keys, index
