"""Native kernels on the GGUF file's own blocks (_kernels.c), and the Python side that checks
what it hands them: the FFN step (ffn_token, ffn_batch), the attention step (AttentionStep),
the residual and norm kernel (RMSNorm, LayerNorm), fast mode's 8-bit quantization, and, re-exported from the
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
from .ffn_call import FfnCall, Mat, mat_record  # noqa: F401
from .formats import (COLS_HEADER, COLS_TYPES, FILE_LAYOUT, FUSED_TYPES, MAX_SMALL_BATCH, NATIVE_TYPES,  # noqa: F401
                      Q8_BLOCK_BYTES, R16, R16_TYPES, SIMD_LEVELS, X16, X16_TYPES, blocked_rows, input_major_bytes,
                      input_major_type, interleaving, isa, neuron_align, set_isa, supports)
from .held_memory import ptr

# act_fn in ffn_step.c; "swiglu_oai" gpt-oss's clamped SwiGLU with its experts' biases (ACT_OAI:
# the record's bias and limit, sparsecore/oai_experts.py)
ACT_IDS = {"silu": 0, "relu": 1, "gelu_tanh": 2, "gelu": 3, "swiglu_oai": 4}
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
                       x: np.ndarray, post: np.ndarray | None = None, scale: float | None = None,
                       norm_bias: np.ndarray | None = None) -> None:
    """Rows [0, B) of h += the sum of the shares (residual_norm_args), added in their order,
    through the output norm `post` (RMSNorm weights) and times `scale` where given; then
    x = RMSNorm(h) * norm (a LayerNorm with `norm_bias` where given), unless norm is None.
    h, x: (>= B, hidden) float32, contiguous; the shares hold at least B rows of the same width
    (checked by the callers, once)."""
    _kernels.residual_norm(ptr(h), ptr(shares), len(shares), h.shape[1], B,
                           0 if norm is None else ptr(norm), 0 if norm_bias is None else ptr(norm_bias), float(eps),
                           ptr(x), 0 if post is None else ptr(post), float(scale or 0.0))


def _check_norm(what: str, a: np.ndarray | None, hidden: int) -> None:
    if a is not None and (a.dtype != np.float32 or a.shape != (hidden,) or not a.flags.c_contiguous):
        raise ValueError(f"{what} must be ({hidden},) float32, contiguous")


def norm_rows(h: np.ndarray, norm: np.ndarray, eps: float, bias: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm(h) * norm for each row of h (B, hidden) float32, or a LayerNorm with `bias`
    (falcon): the kernel residual_norm_into normalizes with, so that a layer's FFN input is the
    same floats on every decode path."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    if h.ndim != 2:
        raise ValueError("norm_rows: h must be (B, hidden) float32")
    _check_norm("norm_rows: the weights", norm, h.shape[1])
    _check_norm("norm_rows: the bias", bias, h.shape[1])
    x = np.empty_like(h)
    if len(h):
        _kernels.residual_norm(ptr(h), 0, 0, h.shape[1], len(h), ptr(norm), 0 if bias is None else ptr(bias),
                               float(eps), ptr(x), 0, 0.0)
    return x


def residual_norm(h: np.ndarray, shares: list[np.ndarray], norm: np.ndarray | None, eps: float,
                  post: np.ndarray | None = None, scale: float | None = None,
                  norm_bias: np.ndarray | None = None) -> np.ndarray:
    """Checked form of residual_norm_into for the whole of h (B, hidden), in place; returns x."""
    B, hidden = h.shape
    if h.dtype != np.float32 or not h.flags.c_contiguous or any(s.shape != h.shape for s in shares) or (
            norm is not None and (norm.dtype != np.float32 or norm.shape != (hidden,))):
        raise ValueError("residual_norm: h and the shares must be (B, hidden) float32, norm (hidden,)")
    held = [np.ascontiguousarray(s) for s in shares]  # alive while the kernel reads them
    ptrs = residual_norm_args(held)
    x = np.empty_like(h)
    _check_norm("residual_norm: post", post, hidden)
    _check_norm("residual_norm: the norm's bias", norm_bias, hidden)
    residual_norm_into(h, ptrs, B, norm, eps, x, post, scale, norm_bias)
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
        # the scratch fields of ffn_token's record (it has no any or counts), looked up once
        self.token_ptrs = {"h": ptr(self.h), "xq": ptr(self.xq), "hq": ptr(self.hq)}
        # ffn_token's record, its other fields set at each call (building one a call cost ~8 us)
        self.token_call = FfnCall(**self.token_ptrs)
        self.token_address = self.token_call.address
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
            # the scratch fields of ffn_batch's record, set once: its other fields at each call
            self.batch_call = FfnCall(**dict(zip(("h", "any", "xq", "hq", "counts"), (ptr(a) for a in self.small[:5]))))
            self.batch_address = self.batch_call.address
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
              out: np.ndarray | None = None, gate_mode: str = "par", bias: np.ndarray | None = None,
              limit: float = 0.0) -> tuple[np.ndarray, int]:
    """One token's partial FFN over owned neurons `own` (a range of the layer's aligned to whole
    blocks of down's rows, 32 or 256 values, or any range when `down_t`): (y (hidden,) float32 in scratch.y, active neurons). Dense unless
    `threshold` (|act(gate x)| > threshold) or `mask` (uint8 over all the layer's neurons) says
    which are active. `down_t`: `down` is stored transposed (n_ff rows of hidden values, as
    PowerInfer's ffn_down_t), and only active neurons' rows are read. `gate_mode`: GATE_BITS.
    `bias`, `limit`: "swiglu_oai"'s (one expert's row of OaiExpertsLayer.expert_biases, the clamp)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    y = scratch.y if out is None else out  # out: e.g. the process's output slot in shared memory
    _check_token(gate, up, down, x, own, mask, down_t, y)
    call = _set_fields(scratch.token_call, gate, up, down, x, own, activation, fast, down_t, y, gate_mode, mask, 1,
                       bias, limit)
    call.threshold = -1.0 if threshold is None else float(threshold)
    return y, _kernels.ffn_token(scratch.token_address)


def _check_token(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range,
                 mask: np.ndarray | None, down_t: bool, out: np.ndarray) -> None:
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    if x.dtype != np.float32 or x.shape != (hidden,) or not x.flags.c_contiguous:
        raise ValueError(f"x has {x.size} values, the layer's hidden size is {hidden}")
    if out.dtype != np.float32 or out.shape != (hidden,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be {hidden} contiguous float32 values")


def _set_fields(call: FfnCall, gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range,
                activation: str, fast: bool, down_t: bool, out: np.ndarray, gate_mode: str,
                mask: np.ndarray | None, B: int, bias: np.ndarray | None = None, limit: float = 0.0) -> FfnCall:
    """Every field of an FFN step's record but its scratch's, by name; threshold -1 (dense), no
    per-token thresholds; `bias` (gate's and up's biases of the owned neurons, then down's) and
    `limit`: the ACT_OAI activation's, or none."""
    if bias is not None and (bias.dtype != np.float32 or bias.shape != (2 * len(own) + x.shape[-1],)
                             or not bias.flags.c_contiguous):
        raise ValueError(f"biases are {2 * len(own) + x.shape[-1]} contiguous float32 values: gate's and up's of "
                         f"the owned neurons, then down's")
    mats = (gate.args, up.args, down.args)
    held = call.__dict__.get("mats")  # the matrices' records are copied in only when they change (~3 us)
    if held is None or held[0] is not mats[0] or held[1] is not mats[1] or held[2] is not mats[2]:
        call.gate, call.up, call.down = mat_record(gate), mat_record(up), mat_record(down)
        call.mats = mats
    call.down_t, call.hidden, call.own0, call.n_own = int(down_t), x.shape[-1], own.start, len(own)
    call.act, call.threshold, call.thr = ACT_IDS[activation] | GATE_BITS[gate_mode], -1.0, None
    call.mask, call.x, call.B, call.fast, call.y = None if mask is None else ptr(mask), ptr(x), B, int(fast), ptr(out)
    call.bias, call.limit = None if bias is None else ptr(bias), limit
    return call


def ffn_token_call(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
                   scratch: FfnScratch, fast: bool, down_t: bool, out: np.ndarray, gate_mode: str = "par",
                   mask: np.ndarray | None = None) -> FfnCall:
    """A record _kernels.ffn_token reads (FfnCall, by its address) for ffn_token of this x into
    out, checked and resolved, its threshold -1 (dense), of its own (not the scratch's, which
    ffn_token reuses). ffn_token sets the threshold and calls the kernel; a caller that runs the
    same product every step (sparsecore/lockstep.py) keeps the record and does the same without
    the checks and addresses (about 10 us of Python a call). x, out: contiguous float32
    (hidden,), the same arrays at every call of a kept record; the matrices must stay what they
    are (a twin attached later makes others)."""
    _check_token(gate, up, down, x, own, mask, down_t, out)
    call = _set_fields(FfnCall(**scratch.token_ptrs), gate, up, down, x, own, activation, fast, down_t, out,
                       gate_mode, mask, 1)
    call.keep = (x, out, mask, scratch)  # the arrays its addresses point into live as long as the record
    return call


def ffn_batch_call(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
                   scratch: FfnScratch, fast: bool, out: np.ndarray, gate_mode: str = "par") -> FfnCall:
    """A batch record for ffn_batch's kernel over x (MAX_SMALL_BATCH, hidden) into out (the same
    shape), checked, with the scratch's small-batch buffers, of its own (FfnCall), as
    ffn_token_call's: moe_batch (sparsecore/experts.py) sets its matrices, token count and
    thresholds per expert."""
    hidden = _check_ffn(gate, up, down, own, None, False)
    if len(own) > scratch.n_own or scratch.hidden != hidden:
        raise ValueError(f"scratch sized for {scratch.n_own} neurons of {scratch.hidden}, not {len(own)} of {hidden}")
    for a in (x, out):
        if a.dtype != np.float32 or a.shape != (MAX_SMALL_BATCH, hidden) or not a.flags.c_contiguous:
            raise ValueError(f"a batch record's rows are ({MAX_SMALL_BATCH}, {hidden}) contiguous float32 values")
    small = scratch.small_batch()
    call = _set_fields(FfnCall(**dict(zip(("h", "any", "xq", "hq", "counts"), (ptr(a) for a in small[:5])))),
                       gate, up, down, x, own, activation, fast, False, out, gate_mode, None, MAX_SMALL_BATCH)
    call.keep = (x, out, scratch)
    return call


def ffn_batch(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
              scratch: FfnScratch, threshold=None, mask: np.ndarray | None = None, fast: bool = False,
              down_t: bool = False, out: np.ndarray | None = None, gate_mode: str = "par",
              bias: np.ndarray | None = None, limit: float = 0.0) -> tuple[np.ndarray, int]:
    """ffn_token for a small batch x (B, hidden), 1 <= B <= MAX_SMALL_BATCH, in one pass over the
    shard's rows: (y (B, hidden), active (neuron, token) pairs); scratch.small_batch()[4][:B]
    holds each token's count. `threshold`: one value for every token or B values (None, or a
    negative value: dense for that token), each token's neurons chosen by its own gate; `mask`
    is shared by all tokens. y[b] equals ffn_token(x[b]) bit for bit. `out`: (B, hidden)
    float32, contiguous (e.g. the first B rows of the process's output slot). `bias`, `limit`:
    as ffn_token's."""
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    B = check_batch(x, hidden, "ffn_batch")
    if len(own) > scratch.n_own or scratch.hidden != hidden:
        raise ValueError(f"scratch sized for {scratch.n_own} neurons of {scratch.hidden}, not {len(own)} of {hidden}")
    h, anyv, xq, hq, counts, ys, thr = scratch.small_batch()
    y = ys[:B] if out is None else out
    if y.dtype != np.float32 or y.shape != (B, hidden) or not y.flags.c_contiguous:
        raise ValueError(f"out must be ({B}, {hidden}) contiguous float32 values")
    call = _set_fields(scratch.batch_call, gate, up, down, x, own, activation, fast, down_t, y, gate_mode, mask, B,
                       bias, limit)
    if threshold is not None:
        thr[:B] = threshold  # a scalar or B values
        call.thr = ptr(thr)
    return y, _kernels.ffn_batch(scratch.batch_address)


from .attention import ATTN_EXTRA, AttentionExtras, AttentionStep  # noqa: E402,F401 (uses the names above)
