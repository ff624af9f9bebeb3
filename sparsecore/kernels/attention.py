"""`AttentionStep`: one layer's attention block in one native call (_kernels.attn_token,
attn_batch, attn_part), and `AttentionExtras`, the layer's variants beyond llama's
(sparsecore/arch.py says whose): Q/K/V biases, Q/K norms (per head, or over every head), the output's norm and scale,
the softmax scale, a sliding window, a LayerNorm (the input norm's bias) instead of RMSNorm. The extras travel to C as one record (ATTN_EXTRA, the
layout of attention_layer.c's attn_extra, checked against it at import)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _kernels
from .file_matrix import FileMatrix, q8_scratch
from .formats import MAX_SMALL_BATCH
from .held_memory import ptr
from .layouts import columns_for

ATTN_EXTRA = np.dtype([("bias", "<i8"), ("q_norm", "<i8"), ("k_norm", "<i8"), ("post_norm", "<i8"),
                       ("norm_bias", "<i8"), ("scale", "<f4"), ("out_scale", "<f4"), ("window", "<i4"), ("qk_norm_full", "<i4"),
                       ("sinks", "<i8"), ("out_bias", "<i8")])
_C_LAYOUT = _kernels.attn_extra_layout()
if (ATTN_EXTRA.itemsize, *(ATTN_EXTRA.fields[f][1] for f in ATTN_EXTRA.names)) != _C_LAYOUT:
    raise ImportError(f"attention_layer.c's attn_extra {_C_LAYOUT} and ATTN_EXTRA disagree: rebuild the kernels")


@dataclass
class AttentionExtras:
    """A layer's attention beyond llama's; None or 0 where the layer has no such part."""
    bias: np.ndarray | None = None  # Q | K | V biases, the file's row order (n_heads hd + 2 n_kv hd)
    q_norm: np.ndarray | None = None  # RMSNorm weights (head_dim) of each query head, before rope
    k_norm: np.ndarray | None = None  # and of each key head (both all heads wide: qk_norm_full)
    post_norm: np.ndarray | None = None  # RMSNorm weights (hidden) of the output before the residual
    norm_bias: np.ndarray | None = None  # the input norm's bias (hidden): a LayerNorm (falcon), else RMSNorm
    scale: float | None = None  # softmax scale (None: 1/sqrt(head_dim))
    out_scale: float | None = None  # the output times this before the residual (after post_norm)
    window: int | None = None  # a query at p sees keys p - window < k <= p
    # q_norm and k_norm are one RMSNorm over all heads' values (olmoe: n_heads x head_dim and
    # n_kv x head_dim wide), not each head's; a share of the heads then computes every head's Q
    # and K for it (attention_layer.c full_qk_share)
    qk_norm_full: bool = False
    sinks: np.ndarray | None = None  # per query head a logit in the softmax's denominator (gpt-oss)
    out_bias: np.ndarray | None = None  # the output product's bias (hidden; gpt-oss)

    def record(self, hidden: int, n_heads: int, n_kv: int, head_dim: int) -> tuple[np.ndarray, dict]:
        """(the ATTN_EXTRA record, by field the float32 arrays its addresses point into: keep them
        alive), checked."""
        rec = np.zeros(1, ATTN_EXTRA)
        keep = {}
        full = self.qk_norm_full
        if full and (self.q_norm is None or self.k_norm is None):
            raise ValueError("attention qk_norm_full without q_norm and k_norm")
        q_n, k_n = (n_heads * head_dim, n_kv * head_dim) if full else (head_dim, head_dim)
        for name, n in (("bias", (n_heads + 2 * n_kv) * head_dim), ("q_norm", q_n), ("k_norm", k_n),
                        ("post_norm", hidden), ("norm_bias", hidden), ("sinks", n_heads), ("out_bias", hidden)):
            a = getattr(self, name)
            if a is None:
                continue
            a = np.ascontiguousarray(a, dtype=np.float32)
            if a.shape != (n,):
                raise ValueError(f"attention {name}: {a.shape[0] if a.ndim == 1 else a.shape} values, expected {n}")
            keep[name] = a
            rec[name] = ptr(a)
        rec["scale"] = self.scale or 0.0
        rec["out_scale"] = self.out_scale or 0.0
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window {self.window}: must be at least 1")
        rec["window"] = self.window or 0
        rec["qk_norm_full"] = int(full)
        return rec, keep


class AttentionStep:
    """One decoded token's attention block of one layer in one native call (_kernels.attn_token):
    RMSNorm (or a LayerNorm: extras.norm_bias), Q/K/V products (`q_rows`, `k_rows`: the file's rows in un-permuted order), RoPE
    from the model's cos / signed-sin tables, the KV cache write, softmax attention (GQA) and
    the output product, added to the residual in place. Everything is checked here, once."""

    def __init__(self, q: FileMatrix, q_rows: np.ndarray, k: FileMatrix, k_rows: np.ndarray, v: FileMatrix,
                 o: FileMatrix, norm: np.ndarray, eps: float, n_heads: int, n_kv: int, head_dim: int,
                 rope_dim: int, cos: np.ndarray, sin_signed: np.ndarray, k_cache: np.ndarray,
                 v_cache: np.ndarray, fast: bool, extras: AttentionExtras | None = None):
        hidden, max_ctx = q.cols, k_cache.shape[1]
        if not (q.rows == len(q_rows) == n_heads * head_dim and k.rows == len(k_rows) == v.rows == n_kv * head_dim
                and k.cols == v.cols == hidden and o.cols == n_heads * head_dim and o.rows == hidden):
            raise ValueError("attention shapes disagree")
        for a, shape in ((norm, (hidden,)), (cos, (max_ctx, rope_dim)), (sin_signed, (max_ctx, rope_dim)),
                         (k_cache, (n_kv, max_ctx, head_dim)), (v_cache, (n_kv, max_ctx, head_dim))):
            if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(f"attention table of shape {a.shape} {a.dtype}, expected {shape} float32, contiguous")
        if rope_dim > min(head_dim, 1024) or rope_dim % 2 or n_heads % n_kv:
            raise ValueError("attention: rope dimension or head counts not supported natively")
        self.q_rows, self.k_rows = (np.ascontiguousarray(r, dtype=np.int32) for r in (q_rows, k_rows))
        for rows, n in ((self.q_rows, n_heads), (self.k_rows, n_kv)):  # attn_part reads Q and K in file order
            heads = rows.reshape(n, head_dim)
            if not (np.sort(heads, axis=1) == np.arange(n * head_dim).reshape(n, head_dim)).all():
                raise ValueError("attention: q_rows and k_rows must order rows within each head only")
        self.keep = (q, k, v, o, norm, cos, sin_signed, k_cache, v_cache)
        self.extras = extras or AttentionExtras()
        self.extra, self.extra_arrays = self.extras.record(hidden, n_heads, n_kv, head_dim)
        self.weight_bytes = sum(m.rows * m.row_bytes for m in (q, k, v, o))
        self.hidden, self.max_ctx, self.eps = hidden, max_ctx, float(eps)
        self.scratch = [np.empty(n, np.float32) for n in (hidden, n_heads * head_dim, n_kv * head_dim,
                                                          n_kv * head_dim, max_ctx, n_heads * head_dim)]
        self.scratch += [q8_scratch(hidden), q8_scratch(n_heads * head_dim)]
        self.cos, self.sin = ptr(cos), ptr(sin_signed)
        self._head = lambda q, k, v, o: (*q.args, ptr(self.q_rows), *k.args, ptr(self.k_rows), *v.args, *o.args,
                                         ptr(norm), float(eps), hidden, n_heads, n_kv, head_dim, rope_dim,
                                         ptr(self.extra))
        self.head = self._head(q, k, v, o)
        self.head_dim, self.group = head_dim, n_heads // n_kv
        self.part_heads, self.part_head = None, self.head  # keep_output_columns
        self.cache_shape = k_cache.shape
        self.tail = (ptr(k_cache), ptr(v_cache), max_ctx, int(fast), *(ptr(a) for a in self.scratch))
        self.sizes = (hidden, n_heads * head_dim, n_kv * head_dim)
        self.fast, self.batch_tail = int(fast), None

    def set_window(self, window: int | None) -> None:
        """Attend to every key (None) or the last `window` positions from the next call on (every
        call reads the record, prepared arguments included)."""
        if window is not None and window < 1:
            raise ValueError(f"attention window {window}: must be at least 1")
        self.extras.window = window
        self.extra["window"] = window or 0

    def _check_rows(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray) -> None:
        B = len(pos)
        if h.dtype != np.float32 or h.shape != (B, self.hidden) or not h.flags.c_contiguous or not (
                1 <= B <= MAX_SMALL_BATCH and len(kp) == len(vp) == B
                and pos.dtype == kp.dtype == vp.dtype == np.int64):
            raise ValueError(f"attention batch: h must be (B, {self.hidden}) float32 with one position and cache "
                             f"per row, 1 <= B <= {MAX_SMALL_BATCH}")
        if self.batch_tail is None:  # room for MAX_SMALL_BATCH rows, made on first use
            hidden, nq, nk = self.sizes
            n = MAX_SMALL_BATCH
            self.batch_scratch = [np.empty(m, np.float32) for m in (n * hidden, n * nq, n * nk, n * nk, self.max_ctx,
                                                                    n * nq)]
            self.batch_scratch += [q8_scratch(hidden, n), q8_scratch(nq, n)]
            self.batch_tail = tuple(ptr(a) for a in self.batch_scratch)

    def head_rows(self, h0: int, h1: int) -> tuple[range, range, range]:
        """Query heads [h0, h1)'s rows of Q, their KV heads' rows of K and V (every KV head one of
        them reads, whole), and their columns of the output matrix."""
        hd, g = self.head_dim, self.group
        return range(h0 * hd, h1 * hd), range(h0 // g * hd, -(-h1 // g) * hd), range(h0 * hd, h1 * hd)

    def keep_output_columns(self, h0: int, h1: int) -> None:
        """A process that computes the share of query heads [h0, h1) (`part`) keeps their columns
        of the output matrix in memory of their own (FileMatrix.keep_columns: read in part from
        the file, every row of it would stream whole). Other calls read the file as before."""
        q_rows, k_rows, cols = self.head_rows(h0, h1)
        q, k, v, o = self.keep[:4]
        self.o_part = columns_for(o, cols, self.fast)
        qkv = q, k, v
        # Fast mode: the share's rows of Q, K and V and its columns of the output interleaved
        # 16 by 16 where they can be (attn_part asks for them as ranges, in file order); every
        # row of Q and K where their norms span every head (the share computes them all)
        qk_rows = (range(q.rows), range(k.rows)) if self.extras.qk_norm_full else (q_rows, k_rows)
        if self.fast:
            qkv = tuple(m.for_fast_products(r) for m, r in ((q, qk_rows[0]), (k, qk_rows[1]), (v, k_rows)))
        self.qkv_part = qkv  # alive as long as the addresses in part_head
        self.part_heads, self.part_head = (h0, h1), self._head(*qkv, self.o_part)

    def add_twins(self, add) -> None:
        """Input-major twins (sparsecore/input_sparsity.py): add(matrix, rows, cols, site) gives
        the matrix carrying one, or the matrix itself. Q, K and V over the rows of the heads this
        step computes (input "attn_in"; one fused twin, Q's rows then K's then V's, where add has
        `fused`), the output matrix over their columns ("attn_out"): the
        share kept by keep_output_columns, else every head. A one-token product then reads the
        twin (the kernels' dispatch); prompts and batches the rows as before."""
        if self.part_heads is not None:
            q_rows, k_rows, cols = self.head_rows(*self.part_heads)
            q, k, v = self.qkv_part
            fused = getattr(add, "fused", None)
            if self.extras.qk_norm_full:  # the share reads every head's Q and K: twins on V and the output only
                self.qkv_part = (q, k, add(v, k_rows, None, "attn_in"))
            elif fused is not None:  # Q's rows, K's, V's: one twin (attn_part's one-token products)
                self.qkv_part = tuple(fused([(q, q_rows), (k, k_rows), (v, k_rows)], None, "attn_in"))
            else:
                self.qkv_part = (add(q, q_rows, None, "attn_in"), add(k, k_rows, None, "attn_in"),
                                 add(v, k_rows, None, "attn_in"))
            self.o_part = add(self.o_part, None, cols, "attn_out")
            self.part_head = self._head(*self.qkv_part, self.o_part)
            return
        q, k, v, o = self.keep[:4]
        fused = getattr(add, "fused", None)
        qkv = fused([(q, None), (k, None), (v, None)], None, "attn_in") if fused is not None else \
            [add(q, None, None, "attn_in"), add(k, None, None, "attn_in"), add(v, None, None, "attn_in")]
        whole = (*qkv, add(o, None, None, "attn_out"))
        self.keep = (*whole, *self.keep[4:])
        self.head = self.part_head = self._head(*whole)

    def part(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray, h0: int, h1: int,
             out: np.ndarray) -> None:
        """The share of query heads [h0, h1) in the attention output of each row of h
        (_kernels.attn_part): written to out (B, hidden), h left as it is. Their KV heads' keys
        and values go into the caches at kp, vp (addresses of head 0 of this layer's caches, as
        for `batch`; a KV head whose query heads two shares split is written by both, the same
        bytes). Shares of disjoint ranges summed are the whole attention: processes that split
        a layer's heads each compute one (coordinator/runtime/attention_split.py)."""
        self._check_rows(h, pos, kp, vp)
        if out.dtype != np.float32 or out.shape != h.shape or not out.flags.c_contiguous:
            raise ValueError(f"attention share: out must be {h.shape} float32, contiguous")
        held = self.part_heads
        head = self.part_head if held is not None and held[0] <= h0 <= h1 <= held[1] else self.head
        _kernels.attn_part(*head, self.cos, self.sin, len(pos), ptr(pos), ptr(kp), ptr(vp), self.max_ctx,
                           self.fast, *self.batch_tail, ptr(h), int(h0), int(h1), ptr(out))

    def part_args(self, h: np.ndarray, h0: int, h1: int, out: np.ndarray) -> tuple[list, int]:
        """The arguments of _kernels.attn_part for part(h, pos, kp, vp, h0, h1, out) with one row
        (h, out: the same (1, hidden) arrays at every call), resolved once, and the index of the
        position's address in them: the caller puts there the addresses of pos, kp and vp (one
        int64 each) before each call (sparsecore/lockstep.py: no per-layer checks and addresses).
        The step must keep its matrices (twins attached later make other arguments)."""
        one = np.zeros(1, np.int64)
        self._check_rows(h, one, one, one)
        if out.dtype != np.float32 or out.shape != h.shape or not out.flags.c_contiguous:
            raise ValueError(f"attention share: out must be {h.shape} float32, contiguous")
        held = self.part_heads
        head = self.part_head if held is not None and held[0] <= h0 <= h1 <= held[1] else self.head
        args = [*head, self.cos, self.sin, 1, 0, 0, 0, self.max_ctx, self.fast, *self.batch_tail, ptr(h), int(h0),
                int(h1), ptr(out)]
        return args, len(head) + 3

    def batch(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray) -> None:
        """Several sequences' decoded tokens (continuous batching) in one call, the weights read
        once for all B (_kernels.attn_batch); per row the arithmetic of a call of the step alone.
        h (B, hidden) float32 contiguous, updated in place; pos, kp, vp: B int64 (positions, and
        the addresses of this layer's key and value caches, each shaped like the constructor's).
        The caller (Transformer.decode_batch) checks the caches once per step, not per layer."""
        self._check_rows(h, pos, kp, vp)
        _kernels.attn_batch(*self.head, self.cos, self.sin, len(pos), ptr(pos), ptr(kp), ptr(vp), self.max_ctx,
                            self.fast, *self.batch_tail, ptr(h))

    def __call__(self, h: np.ndarray, pos: int, cache: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """h (hidden,) float32, contiguous: the residual, updated in place; pos: the token's position.
        `cache`: another sequence's (keys, values) of this layer, shaped like the ones given at
        construction (continuous batching: one step object, one cache per sequence)."""
        if h.dtype != np.float32 or h.shape != (self.hidden,) or not h.flags.c_contiguous or not 0 <= pos < self.max_ctx:
            raise ValueError("attention step: h must be the hidden-size float32 residual, pos within the cache")
        tail = self.tail
        if cache is not None:
            k, v = cache
            for a in (k, v):
                if a.dtype != np.float32 or a.shape != self.cache_shape or not a.flags.c_contiguous:
                    raise ValueError(f"attention step: cache of shape {a.shape} {a.dtype}, expected {self.cache_shape}")
            tail = (ptr(k), ptr(v), *tail[2:])
            self.keep_cache = cache  # alive until the next call, like the constructor's
        _kernels.attn_token(*self.head, self.cos, self.sin, pos,
                            *tail, ptr(h))
