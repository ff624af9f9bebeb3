"""An independent, deliberately plain Llama forward pass used as an oracle in tests.

It shares no code with the engine: it reads tensors with gguf-py directly, keeps Q/K in
llama.cpp's stored (permuted) row order and applies llama.cpp's adjacent-pair RoPE, computes
in float64 and recomputes the whole sequence every step (no KV cache).
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceLlama:
    def __init__(self, path):
        r = GGUFReader(path)
        f = lambda k: r.fields[k].contents()
        self.n_layers = f("llama.block_count")
        self.n_heads = f("llama.attention.head_count")
        self.n_kv = f("llama.attention.head_count_kv")
        self.eps = f("llama.attention.layer_norm_rms_epsilon")
        self.base = f("llama.rope.freq_base")
        self.w = {}
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            self.w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)

    def _rope(self, x):  # x: (heads, T, d); rotate pairs (2i, 2i+1)
        T, d = x.shape[1], x.shape[2]
        theta = self.base ** (-np.arange(0, d, 2) / d)
        ang = np.arange(T)[:, None] * theta[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def logits(self, ids: list[int], thresholds: list[float] | None = None) -> np.ndarray:
        """Logits (T, vocab) for every position of `ids`. With `thresholds`, a neuron whose
        |silu(gate x)| is not above its layer's threshold is dropped (CATS sparsity)."""
        w, T = self.w, len(ids)
        h = w["token_embd.weight"][ids]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            x = self._norm(h, w[p + "attn_norm.weight"])
            q = (x @ w[p + "attn_q.weight"].T).reshape(T, self.n_heads, -1).transpose(1, 0, 2)
            k = (x @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, -1).transpose(1, 0, 2)
            v = (x @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, -1).transpose(1, 0, 2)
            q, k = self._rope(q), self._rope(k)
            rep = self.n_heads // self.n_kv
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            o = (a @ v).transpose(1, 0, 2).reshape(T, -1)
            h = h + o @ w[p + "attn_output.weight"].T
            x = self._norm(h, w[p + "ffn_norm.weight"])
            g = x @ w[p + "ffn_gate.weight"].T
            act = g / (1 + np.exp(-g))
            if thresholds is not None:
                act = np.where(np.abs(act) > thresholds[i], act, 0.0)
            h = h + (act * (x @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return self._norm(h, w["output_norm.weight"]) @ self.out.T

    def greedy(self, ids: list[int], n: int, thresholds=None, dense_prompt: bool = True) -> list[int]:
        """Greedy continuation; with thresholds, sparse for generated tokens only (the prompt
        is prefilled densely, as the engine does) unless dense_prompt is False."""
        ids = list(ids)
        out = []
        for _ in range(n):
            tok = int(np.argmax(self._mixed_logits(ids, len(ids) - len(out), thresholds, dense_prompt)[-1]))
            out.append(tok)
            ids.append(tok)
        return out

    def _mixed_logits(self, ids, n_prompt, thresholds, dense_prompt):
        if thresholds is None:
            return self.logits(ids)
        if not dense_prompt:
            return self.logits(ids, thresholds)
        # Prompt positions dense, later positions sparse: run per position, since a token's
        # FFN choice affects every later position through attention.
        return self._positionwise(ids, n_prompt, thresholds)

    def _positionwise(self, ids, n_prompt, thresholds):
        w, T = self.w, len(ids)
        h = w["token_embd.weight"][ids]
        sparse_rows = np.arange(T) >= n_prompt
        for i in range(self.n_layers):
            p = f"blk.{i}."
            x = self._norm(h, w[p + "attn_norm.weight"])
            q = (x @ w[p + "attn_q.weight"].T).reshape(T, self.n_heads, -1).transpose(1, 0, 2)
            k = (x @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, -1).transpose(1, 0, 2)
            v = (x @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, -1).transpose(1, 0, 2)
            q, k = self._rope(q), self._rope(k)
            rep = self.n_heads // self.n_kv
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            h = h + (a @ v).transpose(1, 0, 2).reshape(T, -1) @ w[p + "attn_output.weight"].T
            x = self._norm(h, w[p + "ffn_norm.weight"])
            g = x @ w[p + "ffn_gate.weight"].T
            act = g / (1 + np.exp(-g))
            keep = (np.abs(act) > thresholds[i]) | ~sparse_rows[:, None]
            h = h + (np.where(keep, act, 0.0) * (x @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return self._norm(h, w["output_norm.weight"]) @ self.out.T
