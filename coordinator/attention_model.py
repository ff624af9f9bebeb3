"""The coordinator's part of the model: embeddings, norms, attention with its KV cache, lm_head.

The FFN of every layer is delegated to a callable (the worker pool), so this module reads like
a plain Llama forward pass. Arithmetic follows transformers' LlamaForCausalLM in float32
(RMSNorm, rotate-half RoPE on un-permuted Q/K, SDPA) so greedy decoding matches it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from sparsecore.config import ModelConfig
from sparsecore.ffn import HalfRows, x_wt
from sparsecore.tensors import TensorStore, unpermute_qk

from sparsecore.lm_head import Q8Head, head_tensor_name

FfnFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""ffn(layer, x_normed (T, hidden), x_before_norm (T, hidden)) -> FFN output (T, hidden)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel instead of five: per decoded token this runs twice in every layer.
    return F.rms_norm(x, weight.shape, weight, eps)


class AttentionLayer:
    def __init__(self, store: TensorStore, cfg: ModelConfig, i: int, weights: str = "f32"):
        p = f"blk.{i}."
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        # --weights f16 halves the bytes the coordinator reads per token here too (the matrices
        # are a quarter of all bytes a decoded token reads); other formats keep float32.
        mat = (lambda a: HalfRows.convert(t(a))) if weights == "f16" else t
        self.attn_norm = t(store.matrix(p + "attn_norm.weight"))
        self.ffn_norm = t(store.matrix(p + "ffn_norm.weight"))
        # Q, K and V as one matrix: one matmul per token instead of three (Python and torch
        # dispatch cost as much as the arithmetic at this size).
        self.wqkv = mat(np.concatenate([unpermute_qk(store.matrix(p + "attn_q.weight"), cfg.n_heads),
                                      unpermute_qk(store.matrix(p + "attn_k.weight"), cfg.n_kv_heads),
                                      store.matrix(p + "attn_v.weight")]))
        self.wo = mat(store.matrix(p + "attn_output.weight"))


class AttentionModel:
    def __init__(self, store: TensorStore, cfg: ModelConfig, max_ctx: int, weights: str = "f32"):
        self.cfg = cfg
        self.max_ctx = max_ctx
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        self.embed = t(store.matrix("token_embd.weight"))
        head_name = head_tensor_name(cfg.tied_embeddings)
        self.lm_head = self.embed if cfg.tied_embeddings else t(store.matrix(head_name))
        # One decoded token reads the lm_head in its Q8_0 blocks when the file has them (a
        # quarter of the bytes); batches (perplexity) use the float32 matrix's GEMM.
        self.head_q8 = Q8Head.from_tensor(store.info(head_name))
        # Set by the engine when the worker pool splits the head's rows across processes.
        self.one_token_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.out_norm = t(store.matrix("output_norm.weight"))
        self.layers = [AttentionLayer(store, cfg, i, weights) for i in range(cfg.n_layers)]
        shape = (cfg.n_layers, cfg.n_kv_heads, max_ctx, cfg.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self._rope_tables(store)
        self.pos = 0

    def _rope_tables(self, store: TensorStore) -> None:
        d = self.cfg.rope_dim
        inv_freq = 1.0 / (self.cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if store.has("rope_freqs.weight"):  # Llama 3.1-style per-frequency scaling factors
            inv_freq = inv_freq / torch.from_numpy(store.matrix("rope_freqs.weight"))
        freqs = torch.arange(self.max_ctx, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        # transformers' rotate_half(x) * sin is x with its halves swapped times (-sin, +sin):
        # one flip per step instead of two slices, a neg and a cat.
        half = d // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def reset(self) -> None:
        self.pos = 0

    def _rope(self, x: torch.Tensor, pos: slice) -> torch.Tensor:
        """Rotate-half RoPE on x (T, heads, head_dim): Q and K heads together, one pass."""
        d = self.cfg.rope_dim
        cos, sin = self.cos[pos][:, None], self.sin_signed[pos][:, None]
        T, H, hd = x.shape
        if d == hd:
            return x * cos + x.view(T, H, 2, d // 2).flip(2).view(T, H, d) * sin
        xr, xp = x[..., :d], x[..., d:]
        swapped = xr.reshape(T, H, 2, d // 2).flip(2).reshape(T, H, d)
        return torch.cat((xr * cos + swapped * sin, xp), dim=-1)

    def _attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg, L = self.cfg, self.layers[i]
        T = x.shape[0]
        start = self.pos
        pos = slice(start, start + T)
        nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = x_wt(x, L.wqkv).view(T, nq + 2 * nkv, hd)
        qk = self._rope(qkv[:, : nq + nkv], pos)
        q = qk[:, :nq].transpose(0, 1)
        self.k_cache[i, :, pos] = qk[:, nq:].transpose(0, 1)
        self.v_cache[i, :, pos] = qkv[:, nq + nkv:].transpose(0, 1)
        keys = self.k_cache[i, :, : start + T]
        vals = self.v_cache[i, :, : start + T]
        gqa = nq != nkv  # SDPA maps query heads onto shared K/V heads without copying the cache
        if T == 1:
            out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], enable_gqa=gqa)[0]
        else:
            # Causal over the new block, full over the cached prefix.
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
            out = F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=mask, enable_gqa=gqa)[0]
        return x_wt(out.transpose(0, 1).reshape(T, nq * hd), L.wo)

    @torch.inference_mode()
    def forward(self, ids: list[int], ffn: FfnFn, all_logits: bool = False) -> torch.Tensor:
        """Run `ids` at the current position; returns logits of the last (or every) token."""
        T = len(ids)
        if self.pos + T > self.max_ctx:
            raise ValueError(f"context full: {self.pos} + {T} tokens exceeds the context size {self.max_ctx}")
        h = self.embed[torch.tensor(ids, dtype=torch.long)]
        eps = self.cfg.rms_eps
        for i, L in enumerate(self.layers):
            h = h + self._attention(i, rms_norm(h, L.attn_norm, eps))
            h = h + ffn(i, rms_norm(h, L.ffn_norm, eps), h)
        self.pos += T
        h = rms_norm(h if all_logits else h[-1:], self.out_norm, eps)
        if h.shape[0] == 1 and self.one_token_head is not None:
            return self.one_token_head(h)
        if self.head_q8 is not None and h.shape[0] == 1:
            return self.head_q8(h)
        return h @ self.lm_head.T
