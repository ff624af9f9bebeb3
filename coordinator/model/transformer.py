"""The forward pass, gpt-fast style: embeddings, norms, attention with its `KVCache`, and the
FFN and the head as objects passed in (coordinator/runtime/sparse_ffn.py computes the FFN across the
processes; `LmHead` the logits).

Arithmetic follows transformers' LlamaForCausalLM in float32 (RMSNorm, rotate-half RoPE on
un-permuted Q/K, SDPA) so greedy decoding matches it token for token.

The hidden states are numpy arrays. A layer the native attention step takes (attention on the
file's blocks, every architecture's) never touches torch; the others go through
coordinator/model/torch_layers.py, imported on first use: a plain llama model in the file's
blocks starts and decodes without torch in the coordinator (its import is about 1 s).
"""
from __future__ import annotations

import mmap
import weakref
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from sparsecore.attn_shard import attention_step, qk_order
from sparsecore.config import ModelConfig
from sparsecore.file_rows import FileRows
from sparsecore.kernels import MAX_SMALL_BATCH, AttentionStep, FileMatrix, supports
from sparsecore.lm_head import HeadCandidates
from sparsecore.kernels import norm_rows
from sparsecore.kv_pool import KvPool
from sparsecore.lm_head import Q8Head, head_tensor_name
from sparsecore.rope import layer_rope_tables, layer_tables
from sparsecore.tensors import TensorStore, unpermute_qk

from ..runtime.decode_plan import DecodePaths, DecodePlan, local_paths

if TYPE_CHECKING:  # the split is passed in (coordinator/runtime/engine_build.py), like the FFN and the head
    from ..runtime.attention_split import SplitStep

Ffn = Callable[..., np.ndarray]
"""ffn(layer, x_normed (T, hidden), x_before_norm (T, hidden), decode=None[, router_in=]) -> FFN
output (T, hidden), numpy float32. `decode=True`: the T rows are decoded tokens of T sequences (a
continuous batch), so decoding's sparsity applies to each; None: one row is a decoded token,
several are a prompt. `router_in` (passed only where ModelConfig.router_reads_layer_input,
smallthinker): the layer's inputs, before its attention, which the router scores."""


def _torch():
    """coordinator/model/torch_layers.py, imported where a path first needs torch."""
    from . import torch_layers

    return torch_layers


class Norm:
    """A norm's weight (float32), and its bias where the file has one (falcon's LayerNorms)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None):
        self.weight, self.bias = weight, bias

    @classmethod
    def read(cls, store: TensorStore, name: str) -> "Norm":
        """The norm `name` (`*.weight`), with `*.bias` where the file has it."""
        bias = name[: -len("weight")] + "bias"
        return cls(_f32(store.matrix(name)), _f32(store.matrix(bias)) if store.has(bias) else None)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: np.ndarray, eps: float) -> np.ndarray:
        """x's rows normed, a new array. RMSNorm, or LayerNorm where there is a bias, in the
        native kernel lockstep steps normalize with (double sums): a decoded token's FFN input,
        and so its 8-bit activations, are then the same floats whether its layers are posted one
        by one or run in lockstep."""
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        return norm_rows(rows, self.weight, eps, self.bias).reshape(x.shape)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros in anonymous memory of 4 KB pages, each zeroed by the kernel when first
    written: a KV cache is sized for the whole context and filled a position at a time. (numpy's
    own zeros ask for transparent huge pages, and the first prompt then waited on 2 MB page
    faults, compaction included: gemma-3-270m's 6-token prompt took 70-230 ms instead of 35.)"""
    n = int(np.prod(shape)) * 4
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.float32, count=n // 4).reshape(shape)


class KVCache:
    """Keys and values of every layer for the positions decoded so far (`pos` of them): one per
    sequence (the engine's own, and one per slot of the HTTP server's continuous batch)."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_ctx: int, head_dim: int, pool: KvPool | None = None):
        shape = (n_layers, n_kv_heads, max_ctx, head_dim)
        # `index`: this cache's place in the shared pool (None: private memory), whose caches
        # workers can write too (split attention); the place is given back when the cache goes.
        self.index = pool.take() if pool is not None else None
        if self.index is None:
            self.k, self.v = _zeros(shape), _zeros(shape)
        else:
            self.k, self.v = pool.keys(self.index), pool.values(self.index)
            weakref.finalize(self, pool.give_back, self.index)
        # where the keys and values start in memory (the native batch steps take addresses)
        self.address = (self.k.ctypes.data, self.v.ctypes.data)
        self.max_ctx = max_ctx
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's (keys, values), for the native attention step."""
        return self.k[i], self.v[i]


class LmHead:
    """Logits from the final normed hidden states. Decoded tokens (one, or one per sequence of a
    continuous batch) go to `split` when the rows are split across processes
    (sparse_ffn.SplitHead); otherwise the file's blocks through the native kernels (one token,
    small batches, a prompt's tiles), or, for float weights, the Q8_0 copy or torch's GEMM."""

    def __init__(self, store: TensorStore, cfg: ModelConfig, embed: "Embedding",
                 split: Callable[[np.ndarray], np.ndarray] | None = None, in_file: bool = False,
                 fast: bool = False):
        name = head_tensor_name(cfg.tied_embeddings)
        t = store.info(name)
        self.split = split
        # in_file (--weights gguf): the file's blocks through the native kernels, no float copy
        self.file = FileRows(FileMatrix(t), None, fast) if in_file and supports(t.tensor_type) else None
        self.fast, self.candidates = fast, None
        self.weight = self.q8 = None
        if self.file is None:
            w = embed.weight if cfg.tied_embeddings and embed.weight is not None else _f32(store.matrix(name))
            self.weight = _torch().float_matrix(w)
            self.q8 = Q8Head.from_tensor(t)

    def add_twin(self, add, word: np.ndarray) -> None:
        """Input sparsity for a token this head computes whole (not split): as HeadRows.add_twin."""
        if self.file is None or self.split is not None:
            return
        m = add(self.file.m, None, None)
        if m is not self.file.m:
            self.candidates = HeadCandidates(FileRows(m, None, self.fast), self.file.m, 0, word, self.fast)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of weights one decoded token reads here, across the processes if split."""
        if self.file is not None:
            return self.file.nbytes
        return self.q8.nbytes if self.q8 is not None else self.weight.nbytes

    def __call__(self, h: np.ndarray) -> np.ndarray:
        if self.split is not None and h.shape[0] <= MAX_SMALL_BATCH:
            return self.split(h)
        if self.file is not None:
            if h.shape[0] == 1 and self.candidates is not None:  # a copy: the buffer is reused next token
                return self.candidates(h[0]).copy()[None]
            return self.file.x_wt(h)
        return _torch().float_head(self, h)


class Embedding:
    """Token embedding rows: a float32 matrix, or (in_file) read from the file's blocks per token."""

    def __init__(self, store: TensorStore, in_file: bool = False, scale: float | None = None):
        t = store.info("token_embd.weight")
        # gemma3 scales the looked-up rows by sqrt(hidden) (in float32, as transformers); a tied
        # lm_head reads the unscaled weight.
        self.scale = None if scale is None else np.float32(scale)
        self.file = FileMatrix(t) if in_file and supports(t.tensor_type) else None
        self.weight = None if self.file is not None else _f32(store.matrix("token_embd.weight"))

    @property
    def row_bytes(self) -> int:
        return self.file.row_bytes if self.file is not None else self.weight.shape[1] * self.weight.itemsize

    def __call__(self, ids: list[int]) -> np.ndarray:
        """The rows of `ids`, a new (T, hidden) float32 array."""
        if self.file is not None:
            rows = self.file.dequantize(np.asarray(ids, dtype=np.int32))
        else:
            rows = self.weight[np.asarray(ids, dtype=np.int64)]
        return rows if self.scale is None else rows * self.scale


class AttentionLayer:
    """One layer's attention matrices and norms. Beyond llama (sparsecore/config.py): Q/K/V
    biases (`bias`, qwen2), per-head Q/K norms (`q_norm`, `k_norm`: qwen3, gemma3), norms of the
    attention and FFN outputs (`post_attn_norm`, `post_ffn_norm`: gemma3), the layer's sliding
    `window` and its rope tables (set by Transformer)."""

    def __init__(self, store: TensorStore, cfg: ModelConfig, i: int, weights: str = "f32", fast: bool = False):
        p = f"blk.{i}."
        norm = lambda n: Norm(_f32(store.matrix(p + n))) if store.has(p + n) else None  # noqa: E731
        self.attn_norm = Norm.read(store, p + "attn_norm.weight")
        # falcon (parallel): the FFN reads attn_norm(h); attention reads attn_norm_2(h) where the
        # layer has it (40B's new decoder architecture), else attn_norm(h) too
        self.parallel = cfg.parallel
        if cfg.parallel:
            self.ffn_norm = self.attn_norm
            if store.has(p + "attn_norm_2.weight"):
                self.attn_norm = Norm.read(store, p + "attn_norm_2.weight")
        else:
            self.ffn_norm = Norm.read(store, p + "ffn_norm.weight")
        self.q_norm, self.k_norm = norm("attn_q_norm.weight"), norm("attn_k_norm.weight")
        self.post_attn_norm, self.post_ffn_norm = norm("post_attention_norm.weight"), norm("post_ffw_norm.weight")
        self.bias = (_f32(np.concatenate([store.matrix(p + f"attn_{n}.bias") for n in "qkv"]))
                     if cfg.qkv_bias else None)
        self.window = cfg.layer_window(i)
        # gpt-oss: a sink logit per head in the softmax's denominator, and the output's bias
        self.sinks = _f32(store.matrix(p + "attn_sinks.weight")) if cfg.attn_sinks else None
        self.out_bias = _f32(store.matrix(p + "attn_output.bias")) if cfg.attn_out_bias else None
        self.rope: tuple[np.ndarray, np.ndarray] | None = None
        names = [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")]
        permuted = cfg.permuted_qk  # neox-rope architectures keep HF's row order: nothing to undo
        if weights == "gguf" and all(supports(store.info(n).tensor_type) for n in names):
            # The file's blocks, Q and K rows read in un-permuted order: nothing is copied.
            q, k, v, o = (FileMatrix(store.info(n)) for n in names)
            self.wqkv = [FileRows(q, qk_order(q.rows, cfg.n_heads) if permuted else None, fast),
                         FileRows(k, qk_order(k.rows, cfg.n_kv_heads) if permuted else None, fast),
                         FileRows(v, None, fast)]
            self.wo = FileRows(o, None, fast)
            return
        # Float copies for torch's products. --weights f16 halves the bytes the coordinator reads
        # per token here too (the matrices are a quarter of all bytes a decoded token reads);
        # other formats keep float32.
        unperm = unpermute_qk if permuted else (lambda w, n: w)
        # Q, K and V as one matrix: one matmul per token instead of three (Python and torch
        # dispatch cost as much as the arithmetic at this size).
        self.wqkv = _torch().float_rows(np.concatenate([unperm(store.matrix(p + "attn_q.weight"), cfg.n_heads),
                                                        unperm(store.matrix(p + "attn_k.weight"), cfg.n_kv_heads),
                                                        store.matrix(p + "attn_v.weight")]), weights)
        self.wo = _torch().float_rows(store.matrix(p + "attn_output.weight"), weights)

    @property
    def nbytes(self) -> int:
        """Bytes of weights one decoded token reads in this layer's attention and norms."""
        parts = [*(self.wqkv if isinstance(self.wqkv, list) else [self.wqkv]), self.wo, self.bias, self.sinks,
                 self.out_bias]
        norms = {id(n): n for n in (self.attn_norm, self.ffn_norm, self.q_norm, self.k_norm,
                                    self.post_attn_norm, self.post_ffn_norm) if n is not None}
        return sum(w.nbytes for w in parts if w is not None) + sum(n.nbytes for n in norms.values())


class _ScaledHead:
    """A head whose logits are divided by `scale` (granite's logit_scale) and then soft-capped,
    c * tanh(logits / c) (final_logit_softcapping), in float32 as transformers does."""

    def __init__(self, head, scale: float | None, cap: float | None):
        self.head, self.scale, self.cap = head, scale, cap

    @property
    def bytes_per_token(self) -> int:
        return self.head.bytes_per_token

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return self.finish(self.head(h))

    def finish(self, logits: np.ndarray) -> np.ndarray:
        """The scale and the cap on logits the head's rows gave (a lockstep step's too)."""
        if self.scale:
            logits = logits / np.float32(self.scale)
        if self.cap:
            logits = np.tanh(logits / np.float32(self.cap)) * np.float32(self.cap)
        return logits


class DecodeStep(NamedTuple):
    """How one decode step runs (Transformer._decode_step): every layer in one post (`lockstep`),
    or layer by layer with the heads split across the processes (`split` without lockstep), or
    layer by layer on the coordinator (neither). `split`: the step's positions and caches in the
    shared pool (SplitAttention.begin), which lockstep runs on too."""
    lockstep: bool
    split: SplitStep | None


LOCAL_STEP = DecodeStep(False, None)


class Transformer:
    def __init__(self, store: TensorStore, cfg: ModelConfig, max_ctx: int, embed: Embedding, ffn: Ffn,
                 head: Callable[[np.ndarray], np.ndarray], weights: str = "f32", fast: bool = False,
                 kv_pool: KvPool | None = None, decode: Callable[[list], DecodePaths] | None = None):
        """decode(native steps) -> DecodePaths: the decode plan (coordinator/runtime/decode_plan.py) and
        the objects that run its paths, made once from this model's native attention steps
        (coordinator/runtime/engine_build.py); None: attention on the coordinator alone."""
        # finish: what the logits of the head's rows go through (a lockstep step computes the rows)
        self.finish = lambda logits: logits  # noqa: E731
        if cfg.final_logit_softcap or cfg.logit_scale:
            head = _ScaledHead(head, cfg.logit_scale, cfg.final_logit_softcap)
            self.finish = head.finish
        self.cfg, self.max_ctx, self.embed, self.ffn, self.head = cfg, max_ctx, embed, ffn, head
        self.out_norm = Norm.read(store, "output_norm.weight")
        self.layers = [AttentionLayer(store, cfg, i, weights, fast) for i in range(cfg.n_layers)]
        self.kv_pool = kv_pool  # shared KV caches (sparsecore/kv_pool.py), or None: private ones
        self.cache = self.new_cache()
        self.kv_layer_bytes = self.cache.k[0].nbytes  # one layer of a cache
        self.rope = self._rope_tables(store)
        if kv_pool is not None:  # the workers' attention steps read the same tables; so do ours
            for (cos, sin), (shared_cos, shared_sin) in zip(self.rope, kv_pool.tables):
                shared_cos[:], shared_sin[:] = cos, sin
            self.rope = list(kv_pool.tables)  # not a private copy too (Gemma 3: 8 MB at 2048 positions)
            for L, t in zip(self.layers, layer_tables(cfg)[1]):
                L.rope = self.rope[t]
        # observer(layer, attention input after attn_norm (T, hidden), attention output before the
        # output matrix (T, heads x head_dim)): input-sparsity calibration watches both (coordinator/
        # tools/calibrate.py). While it is set, prompts take the torch attention, which has them.
        self.attn_observer: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        # input_filter(layer, site, x) -> x: what the attention's products read instead of x (torch
        # tensors), for the sites "attn_in" and "attn_out" (protocol.shm_layout.INPUT_SITES): the
        # quality tools emulate input sparsity through it (coordinator/tools/emulate.py). Prompts
        # take the torch attention while it is set, too.
        self.input_filter = None
        # One decoded token's attention block in one native call per layer, where the layer's
        # matrices stay in the file's blocks (a small model's token is mostly dispatch otherwise).
        self.native = [self._native_step(store, i, L, fast) for i, L in enumerate(self.layers)]
        if not all(self.native):
            _torch()  # a layer or the head computes in torch: its import (1 s) now, while the workers load
        # Which path a decoded token takes, decided once (DecodePlan): split_attn, decoded tokens'
        # attention split by KV heads across processes (coordinator/runtime/attention_split.py; None:
        # here alone); lockstep, every layer in one post (coordinator/runtime/lockstep_decode.py).
        paths = decode(self.native) if decode is not None else local_paths(self.native, weights, cfg)
        self.decode_plan: DecodePlan = paths.plan
        self.split_attn, self.lockstep = paths.split, paths.lockstep

    def _native_step(self, store: TensorStore, i: int, L: "AttentionLayer", fast: bool) -> AttentionStep | None:
        # The kernel computes every architecture's attention (its norm, LayerNorm included; a
        # parallel block's FFN input is read before it: _ffn_input) where rope fits in a head.
        if not isinstance(L.wqkv, list) or not self.cfg.native_attention:
            return None
        try:
            return attention_step(store, self.cfg, i, *L.rope, self.cache.k[i], self.cache.v[i], fast)
        except ValueError:  # a shape the kernel does not take: the torch path
            return None

    @property
    def pos(self) -> int:
        return self.cache.pos

    def close_split(self) -> None:
        """The worker processes are gone (Engine.close): no step goes to them any more."""
        self.split_attn = self.lockstep = None

    def new_cache(self) -> KVCache:
        """A KV cache for another sequence (continuous batching), as long as the model's context."""
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.max_ctx, self.cfg.head_dim, self.kv_pool)

    def bytes_per_token(self) -> int:
        """Weights one decoded token reads outside the FFN: attention and norms of every layer,
        the final norm, the lm_head, and one embedding row."""
        return (sum(L.nbytes for L in self.layers) + self.out_norm.nbytes + self.head.bytes_per_token
                + self.embed.row_bytes)

    def _rope_tables(self, store: TensorStore) -> list[tuple[np.ndarray, np.ndarray]]:
        """cos and signed sin per position for every (base, scale) the layers use, in
        sparsecore.rope.layer_tables' order (the KV pool's); each layer's `rope` is its pair."""
        factors = _f32(store.matrix("rope_freqs.weight")) if store.has("rope_freqs.weight") else None
        keys, index = layer_tables(self.cfg)
        tables = [layer_rope_tables(key, self.cfg.rope_dim, self.max_ctx, factors, self.cfg.rope_yarn) for key in keys]
        for L, t in zip(self.layers, index):
            L.rope = tables[t]
        return tables

    def _decode_step(self, caches: list[KVCache], pos: np.ndarray | None = None) -> DecodeStep:
        """How this decode step of `caches`' sequences runs, decided once for all its layers from
        the plan's paths (coordinator/runtime/decode_plan.py) and the step's size: in lockstep where it
        can (LockstepDecode.usable), else layer by layer with the heads split where that pays
        (SplitAttention.pays), else layer by layer on the coordinator."""
        sa, ls = self.split_attn, self.lockstep
        if sa is None or any(c.index is None for c in caches):  # a private cache: no process shares it
            return LOCAL_STEP
        pos = np.array([c.pos for c in caches], np.int64) if pos is None else pos  # a row per cache
        locked = ls is not None and self.ffn is ls.ffn and ls.usable(pos)
        if not (locked or sa.pays(pos)):
            return LOCAL_STEP
        return DecodeStep(locked, sa.begin(pos, np.array([c.index for c in caches], np.int64)))

    def _run_lockstep(self, step: DecodeStep, h: np.ndarray) -> np.ndarray:
        """Every layer of the step in one post (coordinator/runtime/lockstep_decode.py): its logits (the
        step's last phase computed them, or the head from the last layer's residuals)."""
        logits = self.lockstep(h, step.split)
        if logits is None:
            return self.head(self.out_norm(h, self.cfg.rms_eps))
        return self.finish(logits)

    def _native_prompt(self, i: int, cache: KVCache, T: int) -> bool:
        """Whether layer i's attention of a T-token prompt runs through the native step: a
        causal chunk is a batch of one sequence's tokens at consecutive positions (attn_part
        writes each token's key and value before the next token attends)."""
        return (self.native[i] is not None and self.attn_observer is None and self.input_filter is None
                and cache.k.shape == self.cache.k.shape)

    def _attend_prompt(self, i: int, h: np.ndarray, cache: KVCache) -> None:
        """h (T, hidden) float32, contiguous, plus its attention in place, MAX_SMALL_BATCH tokens a
        call: the heads split across the processes where the cache is in the shared pool, else
        here. (In torch, the prompt's products and softmax ran on the coordinator's core alone:
        SmolLM2, 128 tokens, half the prompt's time, while the worker waited.)"""
        sa, p0 = self.split_attn, cache.pos
        in_pool = sa is not None and cache.index is not None
        chunk = sa.max_tokens if in_pool else MAX_SMALL_BATCH
        k0, v0 = cache.address
        kv = self.kv_layer_bytes * i  # layer i in the cache
        for a in range(0, len(h), chunk):
            part = h[a:a + chunk]
            pos = np.arange(p0 + a, p0 + a + len(part), dtype=np.int64)
            if in_pool and sa.pays(pos, prompt=True):
                sa(i, part, sa.begin(pos, np.full(len(part), cache.index, np.int64)))
            else:
                self.native[i].batch(part, pos, np.full(len(part), k0 + kv, np.int64),
                                     np.full(len(part), v0 + kv, np.int64))

    def _attend(self, i: int, h: np.ndarray, cache: KVCache, split: SplitStep | None = None) -> np.ndarray:
        """h (T, hidden) of one sequence, contiguous, plus its attention at `cache`'s position
        (with gemma3's norm of the attention output where the layer has one). `split`: a decoded
        token's step when its heads are split across the processes (_decode_step)."""
        if h.shape[0] == 1 and self.native[i] is not None and self.input_filter is None:
            if split is not None:  # heads across the processes
                self.split_attn(i, h, split)
                return h
            # h += attention(h), in place; the step object was built over self.cache's arrays
            self.native[i](h[0], cache.pos, None if cache is self.cache else cache.layer(i))
            return h
        return _torch().attend(self, i, h, cache)

    def _ffn_input(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """A parallel layer's FFN input (falcon: attention and FFN both read the layer's input h,
        its output is h + attn + ffn), read before the attention adds to h (in place, on the
        native paths): (its norm, a copy of h, which a predictor reads as PowerInfer's falcon
        does). None for a sequential layer, whose FFN reads h after its attention."""
        L = self.layers[i]
        if not L.parallel:
            return None
        return L.ffn_norm(h, self.cfg.rms_eps), h.copy()

    def _router_input(self, h: np.ndarray) -> np.ndarray | None:
        """A copy of the layer's input h where the router scores it (smallthinker), taken before
        the attention adds to h in place; None elsewhere."""
        return h.copy() if self.cfg.router_reads_layer_input else None

    def _ffn(self, i: int, h: np.ndarray, decode: bool | None = None,
             pre: tuple[np.ndarray, np.ndarray] | None = None, router_in: np.ndarray | None = None) -> np.ndarray:
        """h plus the FFN of its rows (and gemma3's norm of the FFN output), a new array. `pre`:
        a parallel layer's input read before its attention (_ffn_input); h then holds the input
        plus attention, and the sum is (h + attn) + ffn on every path, lockstep's too (transformers
        adds (ffn + attn) + h: the same terms, rounded apart by an ulp). `router_in`: the layer's
        input where the router scores it (_router_input)."""
        L, eps = self.layers[i], self.cfg.rms_eps
        x, before = pre if pre is not None else (L.ffn_norm(h, eps), h)
        routing = {} if router_in is None else {"router_in": router_in}
        f = self.ffn(i, x, before, decode=decode, **routing)
        if L.post_ffn_norm is not None:
            f = L.post_ffn_norm(f, eps)
        return h + (f if self.cfg.residual_scale is None else f * np.float32(self.cfg.residual_scale))

    def forward(self, ids: list[int], all_logits: bool = False, cache: KVCache | None = None) -> np.ndarray:
        """Run `ids` at the cache's position (default: the model's own cache); returns logits of
        the last (or every) token, (1 or T, n_vocab) float32."""
        cache = self.cache if cache is None else cache
        T = len(ids)
        if cache.pos + T > self.max_ctx:
            raise ValueError(f"context full: {cache.pos} + {T} tokens exceeds the context size {self.max_ctx}")
        h = np.ascontiguousarray(self.embed(ids), dtype=np.float32)
        eps = self.cfg.rms_eps
        step = self._decode_step([cache]) if T == 1 else LOCAL_STEP  # the path, once for the step
        if step.lockstep:  # one post: every layer and the logits
            logits = self._run_lockstep(step, h)
            cache.pos += 1
            return logits
        for i in range(len(self.layers)):
            pre, router_in = self._ffn_input(i, h), self._router_input(h)
            if T > 1 and self._native_prompt(i, cache, T):
                self._attend_prompt(i, h, cache)
            else:
                h = self._attend(i, h, cache, step.split)
            h = self._ffn(i, h, pre=pre, router_in=router_in)
        cache.pos += T
        return self.head(self.out_norm(h if all_logits else h[-1:], eps))

    def hidden_states(self, texts: list[list[int]], caches: list[KVCache]) -> np.ndarray:
        """Every token's last hidden state, after the final norm, of several texts, each from
        position 0 of its own cache (embeddings, coordinator/runtime/embedding.py): attention per
        text as a prompt's, the FFN of all texts' rows in one pass, dense (each row's arithmetic
        its own, so a text gives the same states alone and beside others). (tokens, hidden)."""
        bounds = np.cumsum([0] + [len(t) for t in texts])
        for c in caches:
            c.pos = 0
        h = np.ascontiguousarray(self.embed([t for ids in texts for t in ids]), dtype=np.float32)
        for i in range(len(self.layers)):
            parts, router_in = [], self._router_input(h)
            for a, b, c in zip(bounds[:-1], bounds[1:], caches):
                x = np.ascontiguousarray(h[a:b])
                if self._native_prompt(i, c, b - a):
                    self._attend_prompt(i, x, c)
                else:
                    x = self._attend(i, x, c)
                parts.append(x)
            h = np.ascontiguousarray(self._ffn(i, np.concatenate(parts), decode=False, router_in=router_in))
        for c, ids in zip(caches, texts):
            c.pos = len(ids)
        return self.out_norm(h, self.cfg.rms_eps)

    def decode_batch(self, ids: list[int], caches: list[KVCache]) -> np.ndarray:
        """One decoded token for each of several sequences (continuous batching): ids[b] goes
        at caches[b].pos. Attention runs per sequence (each has its own cache and position);
        the FFN and the head take all rows together, so the weights are read once per step.
        Returns (B, n_vocab) logits. Each row equals what forward([ids[b]], cache=caches[b])
        gives: every product is per row."""
        if len(ids) != len(caches) or not ids:
            raise ValueError("decode_batch: one token per cache")
        return self.decode_runs([([t], c) for t, c in zip(ids, caches)])

    def decode_runs(self, runs: list[tuple[list[int], KVCache]]) -> np.ndarray:
        """decode_batch where a sequence may take several consecutive tokens (speculative
        decoding verifies a draft so, coordinator/runtime/speculative.py): runs[b] = (ids,
        cache), ids going at cache.pos, cache.pos + 1, ... Every row is computed as a decoded
        token (decoding's sparsity, lockstep where usable), so row for row the logits are what
        forward([id], cache) gives one token at a time. Returns (rows, n_vocab) in runs' order."""
        caches = [c for _, c in runs]
        if not runs or any(not ids for ids, _ in runs):
            raise ValueError("decode_batch: one token per cache")
        if len(set(map(id, caches))) != len(caches):
            raise ValueError("decode_batch: a sequence appears twice")
        for ids, c in runs:
            if c.pos + len(ids) > self.max_ctx:
                raise ValueError(f"context full: {c.pos} + {len(ids)} tokens exceeds the context size {self.max_ctx}")
        if len(runs) == 1 and len(runs[0][0]) == 1:
            return self.forward(runs[0][0], cache=caches[0])
        ids = [t for r, _ in runs for t in r]
        rows = [c for r, c in runs for _ in r]  # each row's cache
        pos = np.array([c.pos + j for r, c in runs for j in range(len(r))], dtype=np.int64)
        h = np.ascontiguousarray(self.embed(ids), dtype=np.float32)
        native_ok = len(ids) <= MAX_SMALL_BATCH and all(c.k.shape == self.cache.k.shape for c in caches)
        step = self._decode_step(rows, pos) if native_ok else LOCAL_STEP  # the path, once for the step
        if step.lockstep:
            logits = self._run_lockstep(step, h)
        else:
            if native_ok:  # checked here once per step, not per layer: positions and cache addresses
                k0 = np.array([c.address[0] for c in rows], dtype=np.int64)
                v0 = np.array([c.address[1] for c in rows], dtype=np.int64)
            bounds = np.cumsum([0] + [len(r) for r, _ in runs])
            for i, L in enumerate(self.layers):
                pre = self._ffn_input(i, h)  # parallel blocks: the FFN's input is the layer's input
                router_in = self._router_input(h)
                if native_ok and self.native[i] is not None:
                    if step.split is not None:
                        self.split_attn(i, h, step.split)
                    else:  # one native call: the attention weights read once for every row
                        self.native[i].batch(h, pos, k0 + i * self.kv_layer_bytes, v0 + i * self.kv_layer_bytes)
                else:
                    h = np.concatenate([self._attend(i, np.ascontiguousarray(h[a:b]), c)
                                        for a, b, c in zip(bounds[:-1], bounds[1:], caches)])
                h = np.ascontiguousarray(self._ffn(i, h, decode=True, pre=pre, router_in=router_in))
            logits = self.head(self.out_norm(h, self.cfg.rms_eps))
        for r, c in runs:
            c.pos += len(r)
        return logits
