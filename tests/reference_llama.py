"""An independent, deliberately plain Llama forward pass used as an oracle in tests.

It shares no code with the engine: it reads tensors with gguf-py directly, keeps Q/K in
llama.cpp's stored (permuted) row order and applies llama.cpp's adjacent-pair RoPE, computes
in float64 and recomputes the whole sequence every step (no KV cache).

PowerInfer files (magic PWRI) are read from a GGUF-magic temporary copy. Their FFN is
down(relu(gate x) * up x) with down stored transposed (ffn_down_t), and with predictor=True a
neuron counts only where fc2 @ relu(fc1 @ h) > powerinfer.sparse_threshold, h being the residual
stream before ffn_norm (PowerInfer feeds its predictor llama.cpp's ffn_inp).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _read(path) -> GGUFReader:
    with open(path, "rb") as f:
        if f.read(4) != b"PWRI":
            return GGUFReader(path)
    fd, tmp = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    shutil.copyfile(path, tmp)
    with open(tmp, "r+b") as f:
        f.write(b"GGUF")
    try:
        return GGUFReader(tmp)  # the map stays valid after the unlink
    finally:
        os.unlink(tmp)


class ReferenceLlama:
    def __init__(self, path):
        r = _read(path)
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
        for k in [k for k in self.w if k.endswith("ffn_down_t.weight")]:
            self.w[k.replace("ffn_down_t", "ffn_down")] = self.w.pop(k).T
        relu = "blk.0.fc1.weight" in self.w or (
            "sparseinfer.activation" in r.fields and f("sparseinfer.activation") == "relu")
        self.act = (lambda g: np.maximum(g, 0.0)) if relu else (lambda g: g / (1 + np.exp(-g)))
        thr = r.fields.get("powerinfer.sparse_threshold")
        self.pred_threshold = float(thr.contents()) if thr is not None else 0.0
        self.last_keep: list[np.ndarray] = []  # per layer, the (T, n_ff) mask of the last pass

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

    def logits(self, ids: list[int], thresholds: list[float] | None = None, predictor: bool = False) -> np.ndarray:
        """Logits (T, vocab) for every position of `ids`. With `thresholds`, a neuron whose
        |act(gate x)| is not above its layer's threshold is dropped (CATS sparsity); with
        `predictor`, a neuron the file's predictor does not predict active is dropped."""
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
            h = h + self._ffn(i, h, np.ones(T, bool), thresholds, predictor)
        return self._norm(h, w["output_norm.weight"]) @ self.out.T

    def predicted(self, i: int, h: np.ndarray) -> np.ndarray:
        """PowerInfer's predictor for layer i on pre-norm rows h: (T, n_ff) bool."""
        p = f"blk.{i}."
        score = np.maximum(h @ self.w[p + "fc1.weight"].T, 0.0) @ self.w[p + "fc2.weight"].T
        return score > self.pred_threshold

    def _ffn(self, i, h, sparse_rows, thresholds, predictor):
        """FFN of layer i on residual rows h; rows not in sparse_rows use every neuron."""
        w, p = self.w, f"blk.{i}."
        x = self._norm(h, w[p + "ffn_norm.weight"])
        act = self.act(x @ w[p + "ffn_gate.weight"].T)
        keep = np.ones(act.shape, bool)
        if thresholds is not None:
            keep &= np.abs(act) > thresholds[i]
        if predictor:
            keep &= self.predicted(i, h)
        keep |= ~sparse_rows[:, None]
        self.last_keep = self.last_keep[:i] + [keep]
        return (np.where(keep, act, 0.0) * (x @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T

    def greedy(self, ids: list[int], n: int, thresholds=None, dense_prompt: bool = True,
               predictor: bool = False) -> list[int]:
        """Greedy continuation; with thresholds or predictor, sparse for generated tokens only
        (the prompt is prefilled densely, as the engine does) unless dense_prompt is False.
        Afterwards last_keep holds each layer's mask over prompt + all but the last token."""
        ids = list(ids)
        out = []
        for _ in range(n):
            tok = int(np.argmax(self._mixed_logits(ids, len(ids) - len(out), thresholds, dense_prompt,
                                                   predictor)[-1]))
            out.append(tok)
            ids.append(tok)
        return out

    def _mixed_logits(self, ids, n_prompt, thresholds, dense_prompt, predictor=False):
        if thresholds is None and not predictor:
            return self.logits(ids)
        if not dense_prompt:
            return self.logits(ids, thresholds, predictor)
        # Prompt positions dense, later positions sparse: run per position, since a token's
        # FFN choice affects every later position through attention.
        return self._positionwise(ids, n_prompt, thresholds, predictor)

    def _positionwise(self, ids, n_prompt, thresholds, predictor=False):
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
            h = h + self._ffn(i, h, sparse_rows, thresholds, predictor)
        return self._norm(h, w["output_norm.weight"]) @ self.out.T
