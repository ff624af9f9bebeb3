"""The torch attention's rope equals transformers' rotate-half RoPE exactly (the swapped halves
times (-sin, +sin) are the same products), for full and partial rotary dimensions; the tables
are within a float32 rounding of transformers' own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsecore.rope import rope_tables
from coordinator.model.torch_layers import rope


def textbook(x, cos, sin, d):
    """transformers' apply_rotary_pos_emb on the first d dims of each head, the rest untouched."""
    xr, xp = x[..., :d], x[..., d:]
    rotated = torch.cat((-xr[..., d // 2:], xr[..., : d // 2]), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


@pytest.mark.parametrize("head_dim,rope_dim,T", [(64, 64, 1), (64, 64, 5), (64, 32, 3), (16, 8, 1)])
def test_rope_matches_rotate_half(head_dim, rope_dim, T):
    max_ctx, heads, base = 40, 6, 10000.0
    cos, sin_signed = rope_tables(base, 1.0, rope_dim, max_ctx)
    x = torch.randn(T, heads, head_dim)
    pos = slice(7, 7 + T)
    got = rope(x, cos, sin_signed, pos, rope_dim)
    half = rope_dim // 2
    sin = torch.from_numpy(np.concatenate((-sin_signed[:, :half], sin_signed[:, half:]), 1))
    want = textbook(x, torch.from_numpy(cos)[pos][:, None], sin[pos][:, None], rope_dim)
    assert torch.equal(got, want)
    if rope_dim < head_dim:
        assert torch.equal(got[..., rope_dim:], x[..., rope_dim:])
    assert not torch.equal(got, x)  # the rotation did something


@pytest.mark.parametrize("base,d,scale", [(10000.0, 64, 1.0), (500000.0, 128, 1.0), (1e6, 128, 4.0), (10000.0, 80, 1.0)])
def test_tables_are_transformers_within_a_rounding(base, d, scale):
    """transformers' tables (torch, float32 angles): ours are the same angles' cosine and sine
    exactly rounded, so at most one float32 step apart, over 8192 positions."""
    n = 8192
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) / scale
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos().numpy(), torch.cat((angles, angles), -1).sin().numpy()
    got_cos, got_sin = rope_tables(base, scale, d, n)
    half = d // 2
    got_sin = np.concatenate((-got_sin[:, :half], got_sin[:, half:]), 1)  # back from the signed table
    for got, want in ((got_cos, cos), (got_sin, sin)):
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        assert ulps[np.sign(got) == np.sign(want)].max() <= 2
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-7)
