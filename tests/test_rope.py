"""Transformer._rope equals transformers' rotate-half RoPE exactly (the swapped halves times
(-sin, +sin) are the same products), for full and partial rotary dimensions."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordinator.model import Transformer


def textbook(x, cos, sin, d):
    """transformers' apply_rotary_pos_emb on the first d dims of each head, the rest untouched."""
    xr, xp = x[..., :d], x[..., d:]
    rotated = torch.cat((-xr[..., d // 2:], xr[..., : d // 2]), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


@pytest.mark.parametrize("head_dim,rope_dim,T", [(64, 64, 1), (64, 64, 5), (64, 32, 3), (16, 8, 1)])
def test_rope_matches_rotate_half(head_dim, rope_dim, T):
    max_ctx, heads, base = 40, 6, 10000.0
    cfg = SimpleNamespace(rope_dim=rope_dim, rope_base=base, rope_scale=1.0, layer_rope_base=lambda i: (base, 1.0))
    m = SimpleNamespace(cfg=cfg, max_ctx=max_ctx, layers=[SimpleNamespace()])
    store = SimpleNamespace(has=lambda name: False)
    Transformer._rope_tables(m, store)
    x = torch.randn(T, heads, head_dim)
    pos = slice(7, 7 + T)
    got = Transformer._rope(m, x, pos)
    want = textbook(x, m.cos[pos][:, None], m.sin[pos][:, None], rope_dim)
    assert torch.equal(got, want)
    if rope_dim < head_dim:
        assert torch.equal(got[..., rope_dim:], x[..., rope_dim:])
    assert not torch.equal(got, x)  # the rotation did something
