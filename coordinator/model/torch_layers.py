"""The torch side of the forward pass (coordinator/model/transformer.py): attention of the layers
the native step does not take (float weights, prompts the quality tools watch) with its norms,
soft-capped logits and the float copies' products (--weights f32/f16), in transformers' float32
arithmetic (SDPA, rotate-half RoPE).

Imported only where a layer takes it: a plain llama model in the file's blocks decodes without
torch in the coordinator, which saves its import (about 1 s) at start-up. The arrays the model
passes are numpy; torch views them without copying.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sparsecore.ffn import Rows, quantize_rows, x_wt


def norm(x: torch.Tensor, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> torch.Tensor:
    """RMSNorm, or a LayerNorm where the norm has a bias (falcon), in torch's fused kernels."""
    w = torch.from_numpy(weight)
    if bias is not None:
        return F.layer_norm(x, w.shape, w, torch.from_numpy(bias), eps)
    return F.rms_norm(x, w.shape, w, eps)


def rope(x: torch.Tensor, cos: np.ndarray, sin_signed: np.ndarray, pos: slice, d: int) -> torch.Tensor:
    """Rotate-half RoPE on x (T, heads, head_dim), its first d dims: Q and K heads together.
    transformers' rotate_half(x) * sin is x with its halves swapped times (-sin, +sin), which
    the signed table holds: one flip per step instead of two slices, a neg and a cat."""
    cos, sin = torch.from_numpy(cos[pos])[:, None], torch.from_numpy(sin_signed[pos])[:, None]
    T, H, hd = x.shape
    if d == hd:
        return x * cos + x.view(T, H, 2, d // 2).flip(2).view(T, H, d) * sin
    xr, xp = x[..., :d], x[..., d:]
    swapped = xr.reshape(T, H, 2, d // 2).flip(2).reshape(T, H, d)
    return torch.cat((xr * cos + swapped * sin, xp), dim=-1)


@torch.inference_mode()
def attend(model, i: int, h: np.ndarray, cache) -> np.ndarray:
    """Layer i's attention of h (T, hidden) at `cache`'s position: h plus it (with gemma3's norm
    of the attention output; a parallel layer's FFN read h before: Transformer._ffn_input)."""
    cfg, L = model.cfg, model.layers[i]
    x = norm(torch.from_numpy(h), L.attn_norm.weight, L.attn_norm.bias, cfg.rms_eps)
    a = _attention(model, i, x, cache)
    if L.post_attn_norm is not None:
        a = norm(a, L.post_attn_norm.weight, None, cfg.rms_eps)
    if cfg.residual_scale is not None:
        a = a * cfg.residual_scale
    return (torch.from_numpy(h) + a).numpy()


def _attention(model, i: int, x: torch.Tensor, cache) -> torch.Tensor:
    cfg, L = model.cfg, model.layers[i]
    T = x.shape[0]
    start = cache.pos
    pos = slice(start, start + T)
    nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if model.input_filter is not None:
        x = model.input_filter(i, "attn_in", x)
    if isinstance(L.wqkv, list):  # Q, K, V in the file's blocks: three products
        qkv = torch.cat([x_wt(x, w) for w in L.wqkv], dim=1)
    else:
        qkv = x_wt(x, L.wqkv)
    if L.bias is not None:  # qwen2
        qkv = qkv + torch.from_numpy(L.bias)
    qkv = qkv.view(T, nq + 2 * nkv, hd)
    qk = qkv[:, : nq + nkv]
    if L.q_norm is not None and cfg.qk_norm_full:  # olmoe: one RMSNorm over all heads' Q, and K's
        qk = torch.cat((norm(qk[:, :nq].reshape(T, nq * hd), L.q_norm.weight, None, cfg.rms_eps).view(T, nq, hd),
                        norm(qk[:, nq:].reshape(T, nkv * hd), L.k_norm.weight, None, cfg.rms_eps).view(T, nkv, hd)), 1)
    elif L.q_norm is not None:  # qwen3, gemma3: RMSNorm of each head's Q and K before rope
        qk = torch.cat((norm(qk[:, :nq], L.q_norm.weight, None, cfg.rms_eps),
                        norm(qk[:, nq:], L.k_norm.weight, None, cfg.rms_eps)), 1)
    qk = rope(qk, *L.rope, pos, cfg.rope_dim)
    q = qk[:, :nq].transpose(0, 1)
    ks, vs = torch.from_numpy(cache.k[i]), torch.from_numpy(cache.v[i])  # views of the cache
    ks[:, pos], vs[:, pos] = qk[:, nq:].transpose(0, 1), qkv[:, nq + nkv:].transpose(0, 1)
    keys, vals = ks[:, : pos.stop], vs[:, : pos.stop]
    gqa = nq != nkv  # SDPA maps query heads onto shared K/V heads without copying the cache
    scale = cfg.attn_scale  # None: SDPA's 1/sqrt(head_dim)
    if L.sinks is not None:  # gpt-oss: SDPA has no sink logits
        out = _attend_with_sinks(q, keys, vals, L.sinks, start, L.window, scale)
    elif L.window is not None and start + T > L.window:
        # A query at position p sees keys p - window < k <= p (transformers' sliding window);
        # keys older than the first query's window are left out of the product.
        lo = max(0, start - L.window + 1)
        keys, vals = keys[:, lo:], vals[:, lo:]
        qpos = torch.arange(start, start + T)[:, None]
        kpos = torch.arange(lo, start + T)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - L.window)
        out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=mask, enable_gqa=gqa,
                                             scale=scale)[0]
    elif T == 1:
        out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], enable_gqa=gqa, scale=scale)[0]
    else:
        # Causal over the new block, full over the cached prefix.
        mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=mask, enable_gqa=gqa,
                                             scale=scale)[0]
    out = out.transpose(0, 1).reshape(T, nq * hd)
    if model.attn_observer is not None:
        model.attn_observer(i, x.numpy(), out.numpy())
    if model.input_filter is not None:
        out = model.input_filter(i, "attn_out", out)
    out = x_wt(out, L.wo)
    return out if L.out_bias is None else out + torch.from_numpy(L.out_bias)


def _attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, sinks: np.ndarray, start: int,
                       window: int | None, scale: float | None) -> torch.Tensor:
    """q (heads, T, hd) at positions start.., keys and values (kv_heads, start + T, hd): causal
    attention (within `window` where the layer has one) whose softmax has one more logit per
    head, its sink, left out of the weighted sum, as transformers' gpt-oss eager attention:
    the scores minus their row's maximum (sink included), softmax, the sink's column dropped."""
    H, T, hd = q.shape
    rep = H // keys.shape[0]
    if rep > 1:
        keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
    s = torch.matmul(q, keys.transpose(1, 2)) * (hd ** -0.5 if scale is None else scale)
    qpos = torch.arange(start, start + T)[:, None]
    kpos = torch.arange(keys.shape[1])[None, :]
    allowed = kpos <= qpos
    if window is not None:  # a query at p sees keys p - window < k <= p (transformers' sliding window)
        allowed = allowed & (kpos > qpos - window)
    s = s.masked_fill(~allowed, float("-inf"))
    s = torch.cat((s, torch.from_numpy(sinks).view(H, 1, 1).expand(H, T, 1)), dim=-1)
    p = torch.softmax(s - s.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(p, vals)


def float_matrix(a: np.ndarray) -> torch.Tensor:
    """A float32 matrix the torch products read, sharing a's memory where it can."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def float_rows(a: np.ndarray, weights: str) -> Rows:
    """An attention matrix's float copy: float16 rows with --weights f16, else float32 (int8
    is the FFN's format only)."""
    return quantize_rows(float_matrix(a), "f16" if weights == "f16" else "f32")


@torch.inference_mode()
def float_head(head, h: np.ndarray) -> np.ndarray:
    """An lm_head of float copies (coordinator/model/transformer.py LmHead): one token through the Q8_0
    copy where there is one, else x @ W.T."""
    x = torch.from_numpy(h)
    if h.shape[0] == 1 and head.q8 is not None:
        return head.q8(x).numpy()
    return x_wt(x, head.weight).numpy()
