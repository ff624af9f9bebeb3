"""`AttnShard`: the attention heads one process computes for decoded tokens, in every layer.

Decoding reads a layer's Q, K, V and output matrices once per token, and on a CPU-only machine
the coordinator used to do that alone while its workers' cores waited. Split by heads (whole KV
heads where there are enough, query heads of one KV head where not: split_heads), each
process reads only its heads' rows of Q, K and V (and their columns of the output matrix),
writes their keys and values into the shared caches (sparsecore/kv_pool.py) and computes its
share of the output; the coordinator sums the shares (coordinator/runtime/attention_split.py). The
coordinator computes its own share with the same step objects, so every process runs the same
kernel (_kernels.attn_part).

Every architecture whose attention the native step computes is split (ModelConfig.native_attention:
its biases, Q/K norms, output norms and scales, windows, per-layer rope bases, LayerNorms, gpt-oss's
sinks and output bias (added by the share of head 0) travel
with the step as `AttentionExtras`). Olmoe's Q/K norms span every head: each share then computes
every head's Q and K to normalize them exactly as the whole layer does, and keeps its own
(attention_layer.c full_qk_share): its V, attention and output product stay split. Falcon's parallel blocks split too: a share is attention alone,
and the model reads its FFN's input before the attention changes the residual
(coordinator/model/transformer.py Transformer._ffn_input, sparsecore/lockstep.py).
"""
from __future__ import annotations

import math
import time

import numpy as np

from protocol.doorbell import Request
from protocol.shm_layout import SharedBuffers

from .config import ModelConfig
from .kernels import MAX_SMALL_BATCH, AttentionExtras, AttentionStep, FileMatrix, supports
from .kv_pool import KvPool
from .rope import layer_tables
from .tensors import TensorStore, unpermute_qk

ATTN_NAMES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")


def qk_order(rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (unpermute_qk applied to row numbers)."""
    return np.ascontiguousarray(unpermute_qk(np.arange(rows)[:, None], n_heads)[:, 0], dtype=np.int32)


def native_attention(store: TensorStore, cfg: ModelConfig) -> bool:
    """Whether every layer's attention runs in the native kernel: an attention it computes
    (ModelConfig.native_attention) on matrices of types the kernels read."""
    if not cfg.native_attention or cfg.rope_dim % 2 or cfg.n_heads % cfg.n_kv_heads:
        return False
    return all(supports(store.info(f"blk.{i}.{n}").tensor_type) for i in range(cfg.n_layers) for n in ATTN_NAMES)


def head_unit(store: TensorStore, cfg: ModelConfig) -> int:
    """Fewest query heads a share may hold: its output-matrix columns must start on whole blocks."""
    block = max(FileMatrix(store.info(f"blk.{i}.attn_output.weight")).block for i in range(cfg.n_layers))
    unit = 1
    while (unit * cfg.head_dim) % block:
        unit += 1
    return unit


def split_heads(n_heads: int, group: int, slots: list[int], unit: int) -> dict[int, tuple[int, int]]:
    """Query head ranges for `slots` (the coordinator's last), as even as `unit` allows; the
    coordinator, which also sums the shares, gets the smaller part of an uneven split. Whole KV
    heads (`group` query heads each) where there are at least two, so that no KV head's keys and
    values are computed twice; else a KV head's query heads split between processes, which then
    each compute it (Gemma 3 270M's one KV head: its prompts' attention on both cores, not the
    coordinator's alone). Slots left without a head are left out; {} when fewer than two
    processes get one."""
    whole = math.lcm(unit, group)
    if n_heads % whole == 0 and n_heads // whole >= 2:
        unit = whole
    units = n_heads // unit
    if n_heads % unit or units < 2 or len(slots) < 2:
        return {}
    n = min(len(slots), units)
    counts = [units // n + (1 if k < units % n else 0) for k in range(n)]  # larger parts first
    chosen = slots[:n - 1] + [slots[-1]]  # the coordinator (last) always takes part
    out, start = {}, 0
    for slot, c in zip(chosen, counts):
        out[slot] = (start * unit, (start + c) * unit)
        start += c
    return out


def attn_norm_name(store: TensorStore, i: int) -> str:
    """The name (less .weight / .bias) of layer i's attention input norm: falcon 40B's "new
    decoder" has two norms of the layer's input, attn_norm_2 for the attention and attn_norm for
    the FFN; every other layer's attention reads attn_norm."""
    two = f"blk.{i}.attn_norm_2"
    return two if store.has(two + ".weight") else f"blk.{i}.attn_norm"


def layer_extras(store: TensorStore, cfg: ModelConfig, i: int) -> AttentionExtras:
    """Layer i's attention variants (sparsecore/arch.py), read from the file."""
    p = f"blk.{i}."
    f32 = lambda name: np.ascontiguousarray(store.matrix(p + name), dtype=np.float32)  # noqa: E731
    norm_bias = None
    if cfg.layer_norm:  # falcon: LayerNorms with bias
        norm_bias = np.ascontiguousarray(store.matrix(attn_norm_name(store, i) + ".bias"), dtype=np.float32)
    return AttentionExtras(norm_bias=norm_bias,
        bias=np.concatenate([f32(f"attn_{n}.bias") for n in "qkv"]) if cfg.qkv_bias else None,
        q_norm=f32("attn_q_norm.weight") if cfg.qk_norm else None,
        k_norm=f32("attn_k_norm.weight") if cfg.qk_norm else None,
        post_norm=f32("post_attention_norm.weight") if cfg.post_norms else None, qk_norm_full=cfg.qk_norm_full,
        scale=cfg.attn_scale, out_scale=cfg.residual_scale, window=cfg.layer_window(i),
        sinks=f32("attn_sinks.weight") if cfg.attn_sinks else None,
        out_bias=f32("attn_output.bias") if cfg.attn_out_bias else None)


def attention_step(store: TensorStore, cfg: ModelConfig, i: int, cos: np.ndarray, sin: np.ndarray,
                   k_cache: np.ndarray, v_cache: np.ndarray, fast: bool) -> AttentionStep:
    """Layer i's native step over the file's blocks (Q and K rows in un-permuted order), with its
    rope tables (`cos`, `sin`: the layer's own) and keys and values of a default cache: the
    coordinator's model and a worker's shard build theirs here alike. Raises ValueError for a
    shape the kernel refuses."""
    p = f"blk.{i}."
    q, k, v, o = (FileMatrix(store.info(p + n)) for n in ATTN_NAMES)
    q_rows = qk_order(q.rows, cfg.n_heads) if cfg.permuted_qk else np.arange(q.rows, dtype=np.int32)
    k_rows = qk_order(k.rows, cfg.n_kv_heads) if cfg.permuted_qk else np.arange(k.rows, dtype=np.int32)
    norm = np.ascontiguousarray(store.matrix(attn_norm_name(store, i) + ".weight"), dtype=np.float32)
    return AttentionStep(q, q_rows, k, k_rows, v, o, norm, cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                         cfg.rope_dim, cos, sin, k_cache, v_cache, fast, layer_extras(store, cfg, i))


class AttnShard:
    """Query heads [h0, h1) of every layer, for a worker: `serve` computes a posted attention step."""

    def __init__(self, steps: list[AttentionStep], pool: KvPool, heads: tuple[int, int]):
        self.steps, self.pool, (self.h0, self.h1) = steps, pool, heads

    @classmethod
    def load(cls, store: TensorStore, cfg: ModelConfig, pool: KvPool, heads: tuple[int, int],
             fast: bool) -> "AttnShard":
        _, table = layer_tables(cfg)  # the coordinator filled the pool's rope tables in this order
        steps = [attention_step(store, cfg, i, *pool.tables[table[i]], pool.keys(0)[i], pool.values(0)[i], fast)
                 for i in range(cfg.n_layers)]
        for s in steps:
            s.keep_output_columns(*heads)
        return cls(steps, pool, heads)

    def serve(self, buf: SharedBuffers, slot: int, req: Request) -> tuple[int, int]:
        """x[:B] are B sequences' residuals, seq[:B] their (position, cache): this shard's share of
        their attention output goes into output slot `slot`. Returns (0, ns taken)."""
        t0 = time.perf_counter()
        layer, B = req.layer, req.n_tokens
        if not (0 <= layer < len(self.steps) and 1 <= B <= MAX_SMALL_BATCH):
            raise ValueError(f"attention step for layer {layer} with {B} tokens")
        pos, caches = buf.seq[:B, 0].copy(), buf.seq[:B, 1].copy()
        kp, vp = self.pool.addresses(layer, caches)
        self.steps[layer].part(buf.x[:B], pos, kp, vp, self.h0, self.h1, buf.out[slot, :B])
        return 0, int((time.perf_counter() - t0) * 1e9)
