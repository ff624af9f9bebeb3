"""Native kernels on the GGUF file's own blocks (_kernels.c), and the Python side that checks
what it hands them: the FFN step (ffn_token, ffn_batch), the attention step (AttentionStep),
the residual and RMSNorm kernel, fast mode's 8-bit quantization, and, re-exported from the
modules that hold them, every other public name:
    formats.py      block types, layouts per type, instruction set level (isa, interleaving...)
    file_matrix.py  FileMatrix: a tensor of the mapped file and its products
    layouts.py      conversions to a new matrix (keep_rows/columns, X16, R16, input-major twins)
    held_memory.py  memory a process holds of its own (anonymous maps, the twins' arena)

A `FileMatrix` is one 2-D tensor of the memory-mapped model file: rows of `stride` bytes in the
file's own type. Nothing is copied: a process that computes some rows only pages those in.

    FileMatrix.matvec(x, rows=..., cols=...)      rows . x   (decode: one token)
    FileMatrix.dequantize(rows=..., cols=...)     float32    (prefill: one layer at a time, then a GEMM)
    ffn_token(gate, up, down, x, own, ...)        one token's partial FFN in one call
    FileMatrix.matmul(X, ...) / prepare_batch     rows . x_b for a small batch (2..16 tokens)
    ffn_batch(gate, up, down, X, own, ...)        a small batch's partial FFN in one call

The small-batch kernels (continuous batching: several sequences decoded together) read each
row once for all tokens and give every token exactly what the one-token kernel gives it (the
same float operations in the same order), so a request decodes the same alone or in a batch.

`fast=False` (exact): float32 activations times the dequantized block values, what the
transformers oracle computes. `fast=True`: the activation quantized to 8 bits per block of 32,
integer block dot products (llama.cpp's arithmetic). Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL, and in blocks of 256 values (such a block spans 8 activation blocks) the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS and IQ3_S.
"""
from __future__ import annotations

import numpy as np

from . import _kernels
from .file_matrix import FileMatrix, check_batch, q8_scratch
from .formats import (COLS_HEADER, COLS_TYPES, FILE_LAYOUT, FUSED_TYPES, MAX_SMALL_BATCH, NATIVE_TYPES,  # noqa: F401
                      Q8_BLOCK_BYTES, R16, R16_TYPES, SIMD_LEVELS, X16, X16_TYPES, blocked_rows, input_major_bytes,
                      input_major_type, interleaving, isa, neuron_align, set_isa, supports)
from .held_memory import ptr

ACT_IDS = {"silu": 0, "relu": 1, "gelu_tanh": 2, "gelu": 3}  # act_fn in ffn_step.c
# How gate and up combine (ModelConfig.ffn_gate), or'ed into the activation id: "par"
# act(gate x) * (up x); "none" act(gate x) alone, with `gate` the up matrix (falcon: no second
# row is read); "sym" act(gate x) * act(up x) (bamboo). ACT_NOGATE, ACT_SYM in ffn_step.c.
GATE_BITS = {"par": 0, "none": 16, "sym": 32}


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fast mode's quantization of float32 x (a whole number of blocks of 32), as every kernel
    does it: per block (d, sum of q, q int8 values)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if len(x) % 32:
        raise ValueError(f"{len(x)} values is not a whole number of blocks of 32")
    out = q8_scratch(len(x))
    _kernels.quantize_q8(ptr(x), len(x), ptr(out))
    blocks = out.reshape(-1, Q8_BLOCK_BYTES)
    return blocks[:, :4].copy().view(np.float32)[:, 0], blocks[:, 4:8].copy().view(np.int32)[:, 0], \
        blocks[:, 8:].view(np.int8).copy()


def residual_norm_args(shares: list[np.ndarray]) -> np.ndarray:
    """The addresses of `shares` ((rows, hidden) float32, contiguous, the same shape) for
    residual_norm_into, resolved once: the arrays must outlive their use."""
    if not shares or any(s.dtype != np.float32 or s.shape != shares[0].shape or s.ndim != 2
                         or not s.flags.c_contiguous for s in shares):
        raise ValueError("residual shares must be (rows, hidden) float32, contiguous, of one shape")
    return np.array([ptr(s) for s in shares], np.int64)


def residual_norm_into(h: np.ndarray, shares: np.ndarray, B: int, norm: np.ndarray | None, eps: float,
                       x: np.ndarray) -> None:
    """Rows [0, B) of h += the sum of the shares (residual_norm_args), added in their order;
    then x = RMSNorm(h) * norm, unless norm is None. h, x: (>= B, hidden) float32, contiguous;
    the shares hold at least B rows of the same width (checked by the callers, once)."""
    _kernels.residual_norm(ptr(h), ptr(shares), len(shares), h.shape[1], B,
                           0 if norm is None else ptr(norm), float(eps), ptr(x))


def rms_norm(h: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm(h) * norm for each row of h (B, hidden) float32: the kernel residual_norm_into
    normalizes with, so that a layer's FFN input is the same floats on every decode path."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    if h.ndim != 2 or norm.dtype != np.float32 or norm.shape != (h.shape[1],) or not norm.flags.c_contiguous:
        raise ValueError("rms_norm: h must be (B, hidden) float32, norm (hidden,) float32")
    x = np.empty_like(h)
    if len(h):
        _kernels.residual_norm(ptr(h), 0, 0, h.shape[1], len(h), ptr(norm), float(eps), ptr(x))
    return x


def residual_norm(h: np.ndarray, shares: list[np.ndarray], norm: np.ndarray | None, eps: float) -> np.ndarray:
    """Checked form of residual_norm_into for the whole of h (B, hidden), in place; returns x."""
    B, hidden = h.shape
    if h.dtype != np.float32 or not h.flags.c_contiguous or any(s.shape != h.shape for s in shares) or (
            norm is not None and (norm.dtype != np.float32 or norm.shape != (hidden,))):
        raise ValueError("residual_norm: h and the shares must be (B, hidden) float32, norm (hidden,)")
    held = [np.ascontiguousarray(s) for s in shares]  # alive while the kernel reads them
    ptrs = residual_norm_args(held)
    x = np.empty_like(h)
    residual_norm_into(h, ptrs, B, norm, eps, x)
    return x


_scratch = np.empty(0, np.float32)


def dequant_scratch(n: int) -> np.ndarray:
    """A float32 buffer of `n` values, reused from call to call (one per process): a batched
    product dequantizes one matrix into it and runs its GEMM before the next one needs it."""
    global _scratch
    if _scratch.size < n:
        _scratch = np.empty(n, np.float32)
    return _scratch[:n]


class FfnScratch:
    """Per-process buffers the FFN kernel writes into, sized once for the largest shard; and,
    made on the first batch, three float32 tiles of `chunk` neurons for batched (prefill) steps."""

    def __init__(self, hidden: int, n_own: int):
        self.hidden, self.n_own = hidden, n_own
        self.h = np.empty(max(1, n_own), np.float32)
        self.xq = q8_scratch(hidden)
        self.hq = q8_scratch(n_own)
        self.y = np.empty(hidden, np.float32)
        # h, any, xq, hq, counts as ffn_token takes them (it has no any or counts), looked up once
        self.token_ptrs = (ptr(self.h), 0, ptr(self.xq), ptr(self.hq), 0)
        self.tiles: list[np.ndarray] = []
        self.small: tuple[np.ndarray, ...] = ()

    def small_batch(self) -> tuple[np.ndarray, ...]:
        """ffn_batch's buffers for MAX_SMALL_BATCH tokens, made on the first small batch:
        h, any, xq, hq, counts (per token active neurons), y, thresholds."""
        if not self.small:
            B, n = MAX_SMALL_BATCH, max(1, self.n_own)
            self.small = (np.empty(B * n, np.float32), np.empty(n, np.uint8), q8_scratch(self.hidden, B),
                          q8_scratch(n, B), np.zeros(B, np.int64), np.empty((B, self.hidden), np.float32),
                          np.empty(B, np.float32))
            # h, any, xq, hq, counts as the kernel takes them: looked up once, not per layer and step
            self.small_ptrs = tuple(ptr(a) for a in self.small[:5])
        return self.small

    def batch_tiles(self, chunk: int) -> list[np.ndarray]:
        if not self.tiles:
            self.tiles = [np.empty(chunk * self.hidden, np.float32) for _ in range(3)]
        return self.tiles


def _check_ffn(gate: FileMatrix, up: FileMatrix, down: FileMatrix, own: range, mask: np.ndarray | None,
               down_t: bool) -> int:
    """The checks ffn_token and ffn_batch share; returns the hidden size."""
    hidden = gate.cols
    d_rows, d_cols = (down.cols, down.rows) if down_t else (down.rows, down.cols)
    if not (up.cols == hidden and d_rows == hidden and gate.rows == up.rows == d_cols):
        raise ValueError(f"FFN shapes disagree: gate {gate.rows}x{gate.cols}, up {up.rows}x{up.cols}, "
                         f"down{'_t' if down_t else ''} {down.rows}x{down.cols}")
    align = neuron_align(down.type)  # down's columns are read in whole blocks (and h quantized by 32)
    aligned = own.start % align == 0 and (len(own) % align == 0 or own.stop == gate.rows)
    if own.step != 1 or own.stop > gate.rows or not (aligned or down_t):
        raise ValueError(f"owned neurons {own} are not a {align}-aligned range of the layer's {gate.rows}")
    if mask is not None and (mask.dtype != np.uint8 or len(mask) < gate.rows or not mask.flags.c_contiguous):
        raise ValueError("mask must be a contiguous uint8 array over the layer's neurons")
    return hidden


def ffn_token(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
              scratch: FfnScratch, threshold: float | None = None, mask: np.ndarray | None = None,
              fast: bool = False, down_t: bool = False,
              out: np.ndarray | None = None, gate_mode: str = "par") -> tuple[np.ndarray, int]:
    """One token's partial FFN over owned neurons `own` (a range of the layer's aligned to whole
    blocks of down's rows, 32 or 256 values, or any range when `down_t`): (y (hidden,) float32 in scratch.y, active neurons). Dense unless
    `threshold` (|act(gate x)| > threshold) or `mask` (uint8 over all the layer's neurons) says
    which are active. `down_t`: `down` is stored transposed (n_ff rows of hidden values, as
    PowerInfer's ffn_down_t), and only active neurons' rows are read. `gate_mode`: GATE_BITS."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    y = scratch.y if out is None else out  # out: e.g. the process's output slot in shared memory
    args = ffn_token_args(gate, up, down, x, own, activation, scratch, fast, down_t, y, gate_mode, mask)
    args[FFN_TOKEN_THRESHOLD] = -1.0 if threshold is None else float(threshold)
    return y, _kernels.ffn_token(*args)


# Where ffn_token_args puts the threshold: after the three matrices' FileMatrix.args (5 each:
# base.c's MAT_ARGS) and five integers.
FFN_TOKEN_THRESHOLD = 3 * 5 + 5


def ffn_token_args(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
                   scratch: FfnScratch, fast: bool, down_t: bool, out: np.ndarray, gate_mode: str = "par",
                   mask: np.ndarray | None = None) -> list:
    """The arguments of _kernels.ffn_token for ffn_token of this x into out, checked and
    resolved, the threshold at FFN_TOKEN_THRESHOLD (negative: dense). ffn_token sets it and
    calls the kernel; a caller that runs the same product every step (sparsecore/lockstep.py)
    keeps them and does the same without the checks and addresses (about 10 us of Python a
    call). x, out: contiguous float32 (hidden,), the same arrays at every call of kept
    arguments; the matrices must stay what they are (a twin attached later makes others)."""
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    if x.dtype != np.float32 or x.shape != (hidden,) or not x.flags.c_contiguous:
        raise ValueError(f"x has {x.size} values, the layer's hidden size is {hidden}")
    if out.dtype != np.float32 or out.shape != (hidden,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be {hidden} contiguous float32 values")
    return [*gate.args, *up.args, *down.args, int(down_t), hidden, own.start, len(own),
            ACT_IDS[activation] | GATE_BITS[gate_mode], -1.0, 0, 0 if mask is None else ptr(mask), ptr(x), 1,
            int(fast), *scratch.token_ptrs, ptr(out)]


def ffn_batch(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
              scratch: FfnScratch, threshold=None, mask: np.ndarray | None = None, fast: bool = False,
              down_t: bool = False, out: np.ndarray | None = None, gate_mode: str = "par") -> tuple[np.ndarray, int]:
    """ffn_token for a small batch x (B, hidden), 1 <= B <= MAX_SMALL_BATCH, in one pass over the
    shard's rows: (y (B, hidden), active (neuron, token) pairs); scratch.small_batch()[4][:B]
    holds each token's count. `threshold`: one value for every token or B values (None, or a
    negative value: dense for that token), each token's neurons chosen by its own gate; `mask`
    is shared by all tokens. y[b] equals ffn_token(x[b]) bit for bit. `out`: (B, hidden)
    float32, contiguous (e.g. the first B rows of the process's output slot)."""
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    B = check_batch(x, hidden, "ffn_batch")
    if len(own) > scratch.n_own or scratch.hidden != hidden:
        raise ValueError(f"scratch sized for {scratch.n_own} neurons of {scratch.hidden}, not {len(own)} of {hidden}")
    h, anyv, xq, hq, counts, ys, thr = scratch.small_batch()
    y = ys[:B] if out is None else out
    if y.dtype != np.float32 or y.shape != (B, hidden) or not y.flags.c_contiguous:
        raise ValueError(f"out must be ({B}, {hidden}) contiguous float32 values")
    if threshold is None:
        thr_ptr = 0
    else:
        thr[:B] = threshold  # a scalar or B values
        thr_ptr = ptr(thr)
    n = _kernels.ffn_batch(*gate.args, *up.args, *down.args, int(down_t), hidden, own.start, len(own),
                           ACT_IDS[activation] | GATE_BITS[gate_mode], -1.0, thr_ptr, 0 if mask is None else ptr(mask),
                           ptr(x), B, int(fast), *scratch.small_ptrs, ptr(y))
    return y, n


class AttentionStep:
    """One decoded token's attention block of one layer in one native call (_kernels.attn_token):
    RMSNorm, Q/K/V products (`q_rows`, `k_rows`: the file's rows in un-permuted order), RoPE
    from the model's cos / signed-sin tables, the KV cache write, softmax attention (GQA) and
    the output product, added to the residual in place. Everything is checked here, once."""

    def __init__(self, q: FileMatrix, q_rows: np.ndarray, k: FileMatrix, k_rows: np.ndarray, v: FileMatrix,
                 o: FileMatrix, norm: np.ndarray, eps: float, n_heads: int, n_kv: int, head_dim: int,
                 rope_dim: int, cos: np.ndarray, sin_signed: np.ndarray, k_cache: np.ndarray,
                 v_cache: np.ndarray, fast: bool):
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
        self.weight_bytes = sum(m.rows * m.row_bytes for m in (q, k, v, o))
        self.hidden, self.max_ctx = hidden, max_ctx
        self.scratch = [np.empty(n, np.float32) for n in (hidden, n_heads * head_dim, n_kv * head_dim,
                                                          n_kv * head_dim, max_ctx, n_heads * head_dim)]
        self.scratch += [q8_scratch(hidden), q8_scratch(n_heads * head_dim)]
        self.cos, self.sin = ptr(cos), ptr(sin_signed)
        self._head = lambda q, k, v, o: (*q.args, ptr(self.q_rows), *k.args, ptr(self.k_rows), *v.args, *o.args,
                                         ptr(norm), float(eps), hidden, n_heads, n_kv, head_dim, rope_dim)
        self.head = self._head(q, k, v, o)
        self.head_dim, self.group = head_dim, n_heads // n_kv
        self.o_cols_per_kv = n_heads // n_kv * head_dim
        self.part_heads, self.part_head = None, self.head  # keep_output_columns
        self.cache_shape = k_cache.shape
        self.tail = (ptr(k_cache), ptr(v_cache), max_ctx, int(fast), *(ptr(a) for a in self.scratch))
        self.sizes = (hidden, n_heads * head_dim, n_kv * head_dim)
        self.fast, self.batch_tail = int(fast), None

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

    def keep_output_columns(self, kv0: int, kv1: int) -> None:
        """A process that computes the share of KV heads [kv0, kv1) (`part`) keeps their columns
        of the output matrix in memory of their own (FileMatrix.keep_columns: read in part from
        the file, every row of it would stream whole). Other calls read the file as before."""
        cols = self.o_cols_per_kv
        q, k, v, o = self.keep[:4]
        self.o_part = o.keep_columns(range(kv0 * cols, kv1 * cols))
        qkv = q, k, v
        # Fast mode: the share's rows of Q, K and V and its columns of the output interleaved
        # 16 by 16 where they can be (attn_part asks for them as ranges, in file order)
        if self.fast:
            q_rows = range(kv0 * self.group * self.head_dim, kv1 * self.group * self.head_dim)
            k_rows = range(kv0 * self.head_dim, kv1 * self.head_dim)
            qkv = tuple(m.for_fast_products(r) for m, r in ((q, q_rows), (k, k_rows), (v, k_rows)))
            self.o_part = self.o_part.for_fast_products()
        self.qkv_part = qkv  # alive as long as the addresses in part_head
        self.part_heads, self.part_head = (kv0, kv1), self._head(*qkv, self.o_part)

    def add_twins(self, add) -> None:
        """Input-major twins (sparsecore/input_sparsity.py): add(matrix, rows, cols, site) gives
        the matrix carrying one, or the matrix itself. Q, K and V over the rows of the heads this
        step computes (input "attn_in"; one fused twin, Q's rows then K's then V's, where add has
        `fused`), the output matrix over their columns ("attn_out"): the
        share kept by keep_output_columns, else every head. A one-token product then reads the
        twin (the kernels' dispatch); prompts and batches the rows as before."""
        if self.part_heads is not None:
            kv0, kv1 = self.part_heads
            q_rows = range(kv0 * self.group * self.head_dim, kv1 * self.group * self.head_dim)
            k_rows = range(kv0 * self.head_dim, kv1 * self.head_dim)
            cols = range(kv0 * self.o_cols_per_kv, kv1 * self.o_cols_per_kv)
            q, k, v = self.qkv_part
            fused = getattr(add, "fused", None)
            if fused is not None:  # Q's rows, K's, V's: one twin (attn_part's one-token products)
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

    def part(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray, kv0: int, kv1: int,
             out: np.ndarray) -> None:
        """The share of KV heads [kv0, kv1) (and their query heads) in the attention output of
        each row of h (_kernels.attn_part): written to out (B, hidden), h left as it is. Their
        keys and values go into the caches at kp, vp (addresses of head 0 of this layer's caches,
        as for `batch`). Shares of disjoint ranges summed are the whole attention: processes
        that split a layer's heads each compute one (coordinator/attention_split.py)."""
        self._check_rows(h, pos, kp, vp)
        if out.dtype != np.float32 or out.shape != h.shape or not out.flags.c_contiguous:
            raise ValueError(f"attention share: out must be {h.shape} float32, contiguous")
        held = self.part_heads
        head = self.part_head if held is not None and held[0] <= kv0 <= kv1 <= held[1] else self.head
        _kernels.attn_part(*head, self.cos, self.sin, len(pos), ptr(pos), ptr(kp), ptr(vp), self.max_ctx,
                           self.fast, *self.batch_tail, ptr(h), int(kv0), int(kv1), ptr(out))

    def part_args(self, h: np.ndarray, kv0: int, kv1: int, out: np.ndarray) -> tuple[list, int]:
        """The arguments of _kernels.attn_part for part(h, pos, kp, vp, kv0, kv1, out) with one row
        (h, out: the same (1, hidden) arrays at every call), resolved once, and the index of the
        position's address in them: the caller puts there the addresses of pos, kp and vp (one
        int64 each) before each call (sparsecore/lockstep.py: no per-layer checks and addresses).
        The step must keep its matrices (twins attached later make other arguments)."""
        one = np.zeros(1, np.int64)
        self._check_rows(h, one, one, one)
        if out.dtype != np.float32 or out.shape != h.shape or not out.flags.c_contiguous:
            raise ValueError(f"attention share: out must be {h.shape} float32, contiguous")
        held = self.part_heads
        head = self.part_head if held is not None and held[0] <= kv0 <= kv1 <= held[1] else self.head
        args = [*head, self.cos, self.sin, 1, 0, 0, 0, self.max_ctx, self.fast, *self.batch_tail, ptr(h), int(kv0),
                int(kv1), ptr(out)]
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
