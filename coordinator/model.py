"""The forward pass, gpt-fast style: embeddings, norms, attention with its `KVCache`, and the
FFN and the head as objects passed in (coordinator/sparse_ffn.py computes the FFN across the
processes; `LmHead` the logits).

Arithmetic follows transformers' LlamaForCausalLM in float32 (RMSNorm, rotate-half RoPE on
un-permuted Q/K, SDPA) so greedy decoding matches it token for token.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F

from sparsecore.attn_shard import attention_step, qk_order
from sparsecore.config import ModelConfig
from sparsecore.ffn import FileRows, HalfRows, rows_nbytes, x_wt
from sparsecore.kernels import MAX_SMALL_BATCH, AttentionStep, FileMatrix, supports
from sparsecore.lm_head import HeadCandidates
from sparsecore.kernels import rms_norm as native_rms_norm
from sparsecore.kv_pool import KvPool
from sparsecore.lm_head import Q8Head, head_tensor_name
from sparsecore.tensors import TensorStore, unpermute_qk

from .decode_plan import DecodePaths, DecodePlan, local_paths

if TYPE_CHECKING:  # the split is passed in (coordinator/engine_build.py), like the FFN and the head
    from .attention_split import SplitStep

Ffn = Callable[..., torch.Tensor]
"""ffn(layer, x_normed (T, hidden), x_before_norm (T, hidden), decode=None) -> FFN output (T, hidden).
`decode=True`: the T rows are decoded tokens of T sequences (a continuous batch), so decoding's
sparsity applies to each; None: one row is a decoded token, several are a prompt."""


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel instead of five: per decoded token this runs twice in every layer.
    bias = getattr(weight, "ln_bias", None)  # a LayerNorm's weight (falcon): see norm_weight
    if bias is not None:
        return F.layer_norm(x, weight.shape, weight, bias, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def ffn_input_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The FFN's RMSNorm, in the native kernel lockstep steps normalize with (double sums):
    a decoded token's FFN input, and so its 8-bit activations, are then the same floats
    whether its layers are posted one by one or run in lockstep (torch's float sums differ in
    the last bits, and a quantized activation can round the other way)."""
    if getattr(weight, "ln_bias", None) is not None or x.device.type != "cpu" or x.dtype != torch.float32 \
            or weight.dtype != torch.float32:
        return rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1]).numpy()
    return torch.from_numpy(native_rms_norm(rows, weight.numpy(), eps)).reshape(x.shape)


def norm_weight(store: TensorStore, name: str) -> torch.Tensor:
    """A norm's weight `name` (`*.weight`); where the file has its bias too (falcon's LayerNorms)
    the bias rides on the weight as `ln_bias`, and rms_norm computes a LayerNorm with them."""
    w = _tensor(store.matrix(name))
    bias = name[: -len("weight")] + "bias"
    if store.has(bias):
        w.ln_bias = _tensor(store.matrix(bias))
    return w


class KVCache:
    """Keys and values of every layer for the positions decoded so far (`pos` of them): one per
    sequence (the engine's own, and one per slot of the HTTP server's continuous batch)."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_ctx: int, head_dim: int, pool: KvPool | None = None):
        shape = (n_layers, n_kv_heads, max_ctx, head_dim)
        # `index`: this cache's place in the shared pool (None: private memory), whose caches
        # workers can write too (split attention); the place is given back when the cache goes.
        self.index = pool.take() if pool is not None else None
        if self.index is None:
            self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        else:
            self.k, self.v = torch.from_numpy(pool.keys(self.index)), torch.from_numpy(pool.values(self.index))
            weakref.finalize(self, pool.give_back, self.index)
        self.max_ctx = max_ctx
        self.pos = 0

    def update(self, layer: int, pos: slice, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (heads, T, head_dim) at `pos`; return every key and value up to its end."""
        self.k[layer, :, pos] = k
        self.v[layer, :, pos] = v
        return self.k[layer, :, : pos.stop], self.v[layer, :, : pos.stop]

    def reset(self) -> None:
        self.pos = 0

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's (keys, values) as arrays, for the native attention step."""
        return self.k[i].numpy(), self.v[i].numpy()


class LmHead:
    """Logits from the final normed hidden states. Decoded tokens (one, or one per sequence of a
    continuous batch) go to `split` when the rows are split across processes
    (sparse_ffn.SplitHead); otherwise one token reads the file's blocks (or the Q8_0 copy), and
    batches go through x_wt (small ones through the native small-batch kernel, prompts GEMM)."""

    def __init__(self, store: TensorStore, cfg: ModelConfig, embed: "Embedding",
                 split: Callable[[torch.Tensor], torch.Tensor] | None = None, in_file: bool = False,
                 fast: bool = False):
        name = head_tensor_name(cfg.tied_embeddings)
        t = store.info(name)
        self.split = split
        # in_file (--weights gguf): the file's blocks through the native kernels, no float copy
        self.file = FileRows(FileMatrix(t), None, fast) if in_file and supports(t.tensor_type) else None
        self.fast, self.candidates = fast, None
        self.weight = self.q8 = None
        if self.file is None:
            self.weight = embed.weight if cfg.tied_embeddings and embed.weight is not None else _tensor(store.matrix(name))
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
        return self.q8.nbytes if self.q8 is not None else self.weight.numel() * self.weight.element_size()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.split is not None and h.shape[0] <= MAX_SMALL_BATCH:
            return self.split(h)
        if h.shape[0] == 1:
            if self.file is not None:  # a copy: the kernel's output buffer is reused next token
                return torch.from_numpy((self.candidates or self.file.matvec)(h.numpy()[0]).copy())[None]
            if self.q8 is not None:
                return self.q8(h)
        return x_wt(h, self.file if self.file is not None else self.weight)


class Embedding:
    """Token embedding rows: a float32 matrix, or (in_file) read from the file's blocks per token."""

    def __init__(self, store: TensorStore, in_file: bool = False, scale: float | None = None):
        t = store.info("token_embd.weight")
        # gemma3 scales the looked-up rows by sqrt(hidden) (in float32, as transformers); a tied
        # lm_head reads the unscaled weight.
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        self.file = FileMatrix(t) if in_file and supports(t.tensor_type) else None
        self.weight = None if self.file is not None else _tensor(store.matrix("token_embd.weight"))

    @property
    def row_bytes(self) -> int:
        return self.file.row_bytes if self.file is not None else self.weight.shape[1] * self.weight.element_size()

    def __call__(self, ids: list[int]) -> torch.Tensor:
        if self.file is not None:
            rows = torch.from_numpy(self.file.dequantize(np.asarray(ids, dtype=np.int32)))
        else:
            rows = self.weight[torch.tensor(ids, dtype=torch.long)]
        return rows if self.scale is None else rows * self.scale


class AttentionLayer:
    """One layer's attention matrices and norms. Beyond llama (sparsecore/config.py): Q/K/V
    biases (`bias`, qwen2), per-head Q/K norms (`q_norm`, `k_norm`: qwen3, gemma3), norms of the
    attention and FFN outputs (`post_attn_norm`, `post_ffn_norm`: gemma3), the layer's sliding
    `window` and its rope tables (set by Transformer)."""

    def __init__(self, store: TensorStore, cfg: ModelConfig, i: int, weights: str = "f32", fast: bool = False):
        p = f"blk.{i}."
        norm = lambda n: _tensor(store.matrix(p + n)) if store.has(p + n) else None  # noqa: E731
        self.attn_norm = norm_weight(store, p + "attn_norm.weight")
        # falcon (parallel): the FFN reads attn_norm(h); attention reads attn_norm_2(h) where the
        # layer has it (40B's new decoder architecture), else attn_norm(h) too
        self.parallel = cfg.parallel
        if cfg.parallel:
            self.ffn_norm = self.attn_norm
            if store.has(p + "attn_norm_2.weight"):
                self.attn_norm = norm_weight(store, p + "attn_norm_2.weight")
        else:
            self.ffn_norm = norm_weight(store, p + "ffn_norm.weight")
        self.q_norm, self.k_norm = norm("attn_q_norm.weight"), norm("attn_k_norm.weight")
        self.post_attn_norm, self.post_ffn_norm = norm("post_attention_norm.weight"), norm("post_ffw_norm.weight")
        self.bias = (_tensor(np.concatenate([store.matrix(p + f"attn_{n}.bias") for n in "qkv"]))
                     if cfg.qkv_bias else None)
        self.window = cfg.layer_window(i)
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
        # --weights f16 halves the bytes the coordinator reads per token here too (the matrices
        # are a quarter of all bytes a decoded token reads); other formats keep float32.
        mat = (lambda a: HalfRows.convert(_tensor(a))) if weights == "f16" else _tensor
        unperm = unpermute_qk if permuted else (lambda w, n: w)
        # Q, K and V as one matrix: one matmul per token instead of three (Python and torch
        # dispatch cost as much as the arithmetic at this size).
        self.wqkv = mat(np.concatenate([unperm(store.matrix(p + "attn_q.weight"), cfg.n_heads),
                                        unperm(store.matrix(p + "attn_k.weight"), cfg.n_kv_heads),
                                        store.matrix(p + "attn_v.weight")]))
        self.wo = mat(store.matrix(p + "attn_output.weight"))


class _SoftCapped:
    """A head whose logits are soft-capped: c * tanh(logits / c) (final_logit_softcapping)."""

    def __init__(self, head, cap: float):
        self.head, self.cap = head, cap

    @property
    def bytes_per_token(self) -> int:
        return self.head.bytes_per_token

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(h) / self.cap) * self.cap


class Transformer:
    def __init__(self, store: TensorStore, cfg: ModelConfig, max_ctx: int, embed: Embedding, ffn: Ffn,
                 head: Callable[[torch.Tensor], torch.Tensor], weights: str = "f32", fast: bool = False,
                 kv_pool: KvPool | None = None, decode: Callable[[list], DecodePaths] | None = None):
        """decode(native steps) -> DecodePaths: the decode plan (coordinator/decode_plan.py) and
        the objects that run its paths, made once from this model's native attention steps
        (coordinator/engine_build.py); None: attention on the coordinator alone."""
        if cfg.final_logit_softcap:
            head = _SoftCapped(head, cfg.final_logit_softcap)
        self.cfg, self.max_ctx, self.embed, self.ffn, self.head = cfg, max_ctx, embed, ffn, head
        self.out_norm = norm_weight(store, "output_norm.weight")
        self._parallel_attn: list[tuple[int, torch.Tensor]] = []  # see _attend_parallel
        self.layers = [AttentionLayer(store, cfg, i, weights, fast) for i in range(cfg.n_layers)]
        self.kv_pool = kv_pool  # shared KV caches (sparsecore/kv_pool.py), or None: private ones
        self.cache = self.new_cache()
        self.kv_layer_bytes = self.cache.k[0].numel() * self.cache.k.element_size()  # one layer of a cache
        self._rope_tables(store)
        if kv_pool is not None:  # the workers' attention steps read the same tables
            kv_pool.cos[:], kv_pool.sin[:] = self.cos.numpy(), self.sin_signed.numpy()
        # observer(layer, attention input after attn_norm (T, hidden), attention output before the
        # output matrix (T, heads x head_dim)): input-sparsity calibration watches both (coordinator/
        # tools/calibrate.py). While it is set, prompts take the torch attention below, which has them.
        self.attn_observer: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        # input_filter(layer, site, x) -> x: what the attention's products read instead of x,
        # for the sites "attn_in" and "attn_out" (protocol.shm_layout.INPUT_SITES): the quality
        # tools emulate input sparsity through it (coordinator/tools/emulate.py). Prompts take
        # the torch attention while it is set, too.
        self.input_filter: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None
        # One decoded token's attention block in one native call per layer, where the layer's
        # matrices stay in the file's blocks (a small model's token is mostly torch dispatch).
        self.native = [self._native_step(store, i, L, fast) for i, L in enumerate(self.layers)]
        # Which path a decoded token takes, decided once (DecodePlan): split_attn, decoded tokens'
        # attention split by KV heads across processes (coordinator/attention_split.py; None:
        # here alone); lockstep, every layer in one post (coordinator/lockstep_decode.py).
        paths = decode(self.native) if decode is not None else local_paths(self.native, weights, cfg)
        self.decode_plan: DecodePlan = paths.plan
        self.split_attn, self.lockstep = paths.split, paths.lockstep

    def _native_step(self, store: TensorStore, i: int, L: "AttentionLayer", fast: bool) -> AttentionStep | None:
        # The kernel computes llama's attention: none of the other architectures' extras.
        if not isinstance(L.wqkv, list) or self.cfg.rope_dim > self.cfg.head_dim or not self.cfg.plain_llama:
            return None
        try:
            return attention_step(store, self.cfg, i, self.cos.numpy(), self.sin_signed.numpy(),
                                  self.cache.k[i].numpy(), self.cache.v[i].numpy(), fast)
        except ValueError:  # a shape the kernel does not take: the torch path below
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
        def nbytes(t) -> int:
            return sum(rows_nbytes(w) for w in t) if isinstance(t, list) else rows_nbytes(t)
        layers = sum(nbytes(t) for layer in self.layers for t in vars(layer).values()
                     if isinstance(t, (list, torch.Tensor, HalfRows, FileRows)))
        return layers + nbytes(self.out_norm) + self.head.bytes_per_token + self.embed.row_bytes

    def _rope_tables(self, store: TensorStore) -> None:
        """cos and signed sin per position for every (base, scale) the layers use; `cos`,
        `sin_signed` are the global layers' (and every layer's but gemma3's sliding ones)."""
        d = self.cfg.rope_dim
        tables: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] = {}
        for i, L in enumerate(self.layers):
            key = self.cfg.layer_rope_base(i)
            if key not in tables:
                base, scale = key
                inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
                if store.has("rope_freqs.weight"):  # Llama 3.1-style per-frequency scaling factors
                    inv_freq = inv_freq / torch.from_numpy(store.matrix("rope_freqs.weight"))
                if scale != 1.0:  # linear scaling: positions divided by the factor
                    inv_freq = inv_freq / scale
                freqs = torch.arange(self.max_ctx, dtype=torch.float32)[:, None] * inv_freq[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos(), emb.sin()
                # transformers' rotate_half(x) * sin is x with its halves swapped times (-sin, +sin):
                # one flip per step instead of two slices, a neg and a cat.
                half = d // 2
                tables[key] = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
            L.rope = tables[key]
        self.cos, self.sin_signed = tables[(self.cfg.rope_base, self.cfg.rope_scale)] if (
            (self.cfg.rope_base, self.cfg.rope_scale) in tables) else next(iter(tables.values()))
        self.sin = torch.cat((-self.sin_signed[:, : d // 2], self.sin_signed[:, d // 2:]), dim=-1)

    def _rope(self, x: torch.Tensor, pos: slice, tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate-half RoPE on x (T, heads, head_dim): Q and K heads together, one pass."""
        d = self.cfg.rope_dim
        cos, sin = tables if tables is not None else (self.cos, self.sin_signed)
        cos, sin = cos[pos][:, None], sin[pos][:, None]
        T, H, hd = x.shape
        if d == hd:
            return x * cos + x.view(T, H, 2, d // 2).flip(2).view(T, H, d) * sin
        xr, xp = x[..., :d], x[..., d:]
        swapped = xr.reshape(T, H, 2, d // 2).flip(2).reshape(T, H, d)
        return torch.cat((xr * cos + swapped * sin, xp), dim=-1)

    def _attention(self, i: int, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cfg, L = self.cfg, self.layers[i]
        T = x.shape[0]
        start = cache.pos
        pos = slice(start, start + T)
        nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if self.input_filter is not None:
            x = self.input_filter(i, "attn_in", x)
        if isinstance(L.wqkv, list):  # Q, K, V in the file's blocks: three products
            qkv = torch.cat([x_wt(x, w) for w in L.wqkv], dim=1)
        else:
            qkv = x_wt(x, L.wqkv)
        if L.bias is not None:  # qwen2
            qkv = qkv + L.bias
        qkv = qkv.view(T, nq + 2 * nkv, hd)
        qk = qkv[:, : nq + nkv]
        if L.q_norm is not None:  # qwen3, gemma3: RMSNorm of each head's Q and K before rope
            qk = torch.cat((rms_norm(qk[:, :nq], L.q_norm, cfg.rms_eps), rms_norm(qk[:, nq:], L.k_norm, cfg.rms_eps)), 1)
        qk = self._rope(qk, pos, getattr(L, "rope", None))
        q = qk[:, :nq].transpose(0, 1)
        keys, vals = cache.update(i, pos, qk[:, nq:].transpose(0, 1), qkv[:, nq + nkv:].transpose(0, 1))
        gqa = nq != nkv  # SDPA maps query heads onto shared K/V heads without copying the cache
        scale = cfg.attn_scale  # None: SDPA's 1/sqrt(head_dim)
        if L.window is not None and start + T > L.window:
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
        if self.attn_observer is not None:
            self.attn_observer(i, x.numpy(), out.numpy())
        if self.input_filter is not None:
            out = self.input_filter(i, "attn_out", out)
        return x_wt(out, L.wo)

    def _split_for(self, caches: list[KVCache]) -> SplitStep | None:
        """This decode step of `caches`' sequences when their attention is split across the
        processes, or None: not splittable (a private cache), or too little work for an extra
        exchange a layer to pay (SplitAttention.pays)."""
        sa = self.split_attn
        if sa is None or any(c.index is None for c in caches):
            return None
        pos = np.array([c.pos for c in caches], np.int64)
        return sa.begin(pos, np.array([c.index for c in caches], np.int64)) if sa.pays(pos) else None

    def _lockstep(self, caches: list[KVCache], h: torch.Tensor) -> torch.Tensor | None:
        """This decode step (h: the caches' tokens' embeddings, (B, hidden)) through every layer
        in lockstep (coordinator/lockstep_decode.py): the last layer's residuals, or None where
        it cannot run so (the per-layer path then)."""
        ls = self.lockstep
        if ls is None or self.ffn is not ls.ffn or any(c.index is None for c in caches):
            return None
        pos = np.array([c.pos for c in caches], np.int64)
        if not ls.usable(pos):
            return None
        h = h.contiguous()
        ls(h.numpy(), self.split_attn.begin(pos, np.array([c.index for c in caches], np.int64)))
        return h

    def _native_prompt(self, i: int, cache: KVCache, T: int) -> bool:
        """Whether layer i's attention of a T-token prompt runs through the native step: a
        causal chunk is a batch of one sequence's tokens at consecutive positions (attn_part
        writes each token's key and value before the next token attends)."""
        L = self.layers[i]
        return (self.native[i] is not None and self.attn_observer is None and self.input_filter is None
                and (L.window is None or cache.pos + T <= L.window)
                and cache.k.shape == self.cache.k.shape)

    def _attend_prompt(self, i: int, h: np.ndarray, cache: KVCache) -> None:
        """h (T, hidden) float32, contiguous, plus its attention in place, MAX_SMALL_BATCH tokens a
        call: the heads split across the processes where the cache is in the shared pool, else
        here. In torch, the prompt's products and softmax ran on the coordinator's core alone
        (SmolLM2, 128 tokens: half the prompt's time, while the worker waited)."""
        sa, p0 = self.split_attn, cache.pos
        in_pool = sa is not None and cache.index is not None
        chunk = sa.max_tokens if in_pool else MAX_SMALL_BATCH
        for a in range(0, len(h), chunk):
            part = h[a:a + chunk]
            pos = np.arange(p0 + a, p0 + a + len(part), dtype=np.int64)
            if in_pool and sa.pays(pos, prompt=True):
                sa(i, part, sa.begin(pos, np.full(len(part), cache.index, np.int64)))
            else:
                kv = self.kv_layer_bytes * i  # layer i in the cache
                k0, v0 = cache.k.data_ptr() + kv, cache.v.data_ptr() + kv
                self.native[i].batch(part, pos, np.full(len(part), k0, np.int64), np.full(len(part), v0, np.int64))

    def _attend(self, i: int, h: torch.Tensor, cache: KVCache,
                split: SplitStep | None = None) -> torch.Tensor:
        """h (T, hidden) of one sequence plus its attention at `cache`'s position (with gemma3's
        norm of the attention output where the layer has one). `split`: a decoded token's step
        when its heads are split across the processes (_split_for)."""
        L, eps = self.layers[i], self.cfg.rms_eps
        if L.parallel:
            return self._attend_parallel(i, h, cache)
        if (h.shape[0] == 1 and self.native[i] is not None and self.input_filter is None
                and (L.window is None or cache.pos < L.window)):  # the window still covers every key
            h = h.contiguous()
            if split is not None:  # heads across the processes
                self.split_attn(i, h.numpy(), split)
                return h
            # h += attention(h), in place; the step object was built over self.cache's arrays
            self.native[i](h.numpy()[0], cache.pos, None if cache is self.cache else cache.layer(i))
            return h
        a = self._attention(i, rms_norm(h, L.attn_norm, eps), cache)
        return h + (a if L.post_attn_norm is None else rms_norm(a, L.post_attn_norm, eps))

    def _ffn(self, i: int, h: torch.Tensor, decode: bool | None = None) -> torch.Tensor:
        """h plus the FFN of its rows (and gemma3's norm of the FFN output)."""
        L, eps = self.layers[i], self.cfg.rms_eps
        if L.parallel:
            return self._ffn_parallel(i, h, decode)
        f = self.ffn(i, ffn_input_norm(h, L.ffn_norm, eps), h, decode=decode)
        return h + (f if L.post_ffn_norm is None else rms_norm(f, L.post_ffn_norm, eps))

    # Falcon: attention and FFN in parallel, both on the layer's input h (its output is
    # h + attn + ffn). forward and decode_batch call _attend (per sequence) and then _ffn (all
    # rows): _attend_parallel keeps h as it is and leaves the attention output here, in row order,
    # for _ffn_parallel to add; the FFN (and a predictor, which reads h as PowerInfer's falcon
    # does) sees the layer's input.
    def _attend_parallel(self, i: int, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self._parallel_attn and self._parallel_attn[-1][0] != i:
            self._parallel_attn.clear()  # left by a step that failed midway
        a = self._attention(i, rms_norm(h, self.layers[i].attn_norm, self.cfg.rms_eps), cache)
        self._parallel_attn.append((i, a))
        return h

    def _ffn_parallel(self, i: int, h: torch.Tensor, decode: bool | None) -> torch.Tensor:
        parts = [a for j, a in self._parallel_attn if j == i]
        self._parallel_attn.clear()
        a = (parts[0] if len(parts) == 1 else torch.cat(parts))[-h.shape[0]:]  # the latest rows: this step's
        if a.shape != h.shape:
            raise RuntimeError(f"layer {i}: the FFN of {h.shape[0]} rows has attention outputs for {a.shape[0]}")
        f = self.ffn(i, ffn_input_norm(h, self.layers[i].ffn_norm, self.cfg.rms_eps), h, decode=decode)
        return h + (f + a)  # transformers' order: (mlp + attention) + residual

    @torch.inference_mode()
    def forward(self, ids: list[int], all_logits: bool = False, cache: KVCache | None = None) -> torch.Tensor:
        """Run `ids` at the cache's position (default: the model's own cache); returns logits of
        the last (or every) token."""
        cache = self.cache if cache is None else cache
        T = len(ids)
        if cache.pos + T > self.max_ctx:
            raise ValueError(f"context full: {cache.pos} + {T} tokens exceeds the context size {self.max_ctx}")
        h = self.embed(ids)
        eps = self.cfg.rms_eps
        done = self._lockstep([cache], h) if T == 1 else None
        if done is not None:
            cache.pos += 1
            return self.head(rms_norm(done, self.out_norm, eps))
        split = self._split_for([cache]) if T == 1 else None  # once a step, not per layer
        if T > 1:
            h = h.contiguous()
        for i in range(len(self.layers)):
            if T > 1 and self._native_prompt(i, cache, T):
                self._attend_prompt(i, h.numpy(), cache)
                h = self._ffn(i, h)
            else:
                h = self._ffn(i, self._attend(i, h, cache, split))
        cache.pos += T
        return self.head(rms_norm(h if all_logits else h[-1:], self.out_norm, eps))

    @torch.inference_mode()
    def decode_batch(self, ids: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decoded token for each of several sequences (continuous batching): ids[b] goes
        at caches[b].pos. Attention runs per sequence (each has its own cache and position);
        the FFN and the head take all rows together, so the weights are read once per step.
        Returns (B, n_vocab) logits. Each row equals what forward([ids[b]], cache=caches[b])
        gives: every product is per row."""
        if len(ids) != len(caches) or not ids:
            raise ValueError("decode_batch: one token per cache")
        if len(set(map(id, caches))) != len(caches):
            raise ValueError("decode_batch: a sequence appears twice")
        for c in caches:
            if c.pos + 1 > self.max_ctx:
                raise ValueError(f"context full: {c.pos} + 1 tokens exceeds the context size {self.max_ctx}")
        if len(ids) == 1:
            return self.forward(ids, cache=caches[0])
        h = self.embed(ids).contiguous()
        done = self._lockstep(caches, h)
        if done is not None:
            for c in caches:
                c.pos += 1
            return self.head(rms_norm(done, self.out_norm, self.cfg.rms_eps))
        positions = [c.pos for c in caches]
        native_ok = len(ids) <= MAX_SMALL_BATCH and all(c.k.shape == self.cache.k.shape for c in caches)
        if native_ok:  # checked here once per step, not per layer: positions and cache addresses
            pos = np.asarray(positions, dtype=np.int64)
            k0 = np.array([c.k.data_ptr() for c in caches], dtype=np.int64)
            v0 = np.array([c.v.data_ptr() for c in caches], dtype=np.int64)
        split = self._split_for(caches) if native_ok else None  # the heads across the processes
        for i, L in enumerate(self.layers):
            if native_ok and self.native[i] is not None and (L.window is None or max(positions) < L.window):
                if split is not None:
                    self.split_attn(i, h.numpy(), split)
                else:  # one native call: the attention weights read once for every sequence
                    self.native[i].batch(h.numpy(), pos, k0 + i * self.kv_layer_bytes, v0 + i * self.kv_layer_bytes)
            else:
                h = torch.cat([self._attend(i, h[b:b + 1], c) for b, c in enumerate(caches)])
            h = self._ffn(i, h, decode=True).contiguous()
        for c in caches:
            c.pos += 1
        return self.head(rms_norm(h, self.out_norm, self.cfg.rms_eps))
