"""Hyper-parameters of a model, read from GGUF metadata as llama.cpp's convert_hf_to_gguf.py
writes them, for the architectures in SUPPORTED_ARCHS.

What differs between them, and where the engine handles it:

- llama, mistral: Q/K rows permuted by the converter (llama.cpp's "normal" rope); the model
  un-permutes them and applies rotate-half rope. `{arch}.attention.sliding_window`, where the
  file has it, limits attention to that many positions (Mistral v0.1).
- qwen2: Q/K/V biases (`blk.N.attn_{q,k,v}.bias`). Rope "neox": no permutation.
- qwen3: per-head RMSNorm of Q and K (`attn_q_norm`, `attn_k_norm`, head_dim wide) before rope.
- gemma3: embeddings scaled by sqrt(hidden); RMSNorm weights stored by the converter already as
  (1 + w) (Gemma3Model.norm_shift), so they are plain weights here; norms after attention
  (`post_attention_norm`) and after the FFN (`post_ffw_norm`); Q/K norms; GeGLU with tanh-GELU;
  every 6th layer global (llama.cpp's fixed pattern; `attention.sliding_window_pattern` if the
  file has one), the others attend within `attention.sliding_window` and use rope base 10000
  (`rope.freq_base_swa` if present); the global layers use `rope.freq_base` and, if present,
  the linear `rope.scaling.factor`. Attention scale 1/sqrt(head_dim) (query_pre_attn_scalar =
  head_dim; the 62-layer 27B uses hidden / n_heads, as llama.cpp does, since the file does not
  carry it). `final_logit_softcapping` if present.
- phi3: Q, K and V fused as `attn_qkv` and gate and up fused as `ffn_up` (gate rows first);
  sparsecore.tensors.TensorStore presents them under the llama names. `sliding_window` 0 = none.
- bamboo (PowerInfer's Bamboo, written by PowerInfer's convert.py for `model_type: bamboo`):
  llama's layout and keys under `bamboo.`, always ReLU, and PowerInfer's llama.cpp builds its
  FFN with LLM_FFN_SYM: relu(gate x) * relu(up x) (`ffn_gate = "sym"`).
- falcon (llama.cpp's and PowerInfer's converters): LayerNorms with bias
  (`attention.layer_norm_epsilon`), attention and FFN in parallel on the layer's input:
  h + attn(attn_norm_2(h) or attn_norm(h)) + ffn(attn_norm(h)) (attn_norm_2 only in the 40B
  "new decoder architecture"); Q, K, V fused as `attn_qkv` (the converter's "jploski" layout: all
  Q heads, then K, then V); neox rope; no gate: ffn = down(act(up x)) (`ffn_gate = "none"`), act
  ReLU in PowerInfer's ReluFalcon (predictors present), else GELU (transformers' exact erf
  GELU). PowerInfer's predictor input is the layer's input h.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader

from .errors import ModelFileError
from .gguf_check import check_model_metadata
from .gguf_file import field_value

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "bamboo", "falcon")
# Architectures whose converter permutes Q/K rows for llama.cpp's "normal" (adjacent pairs)
# rope; the others use "neox" rope (rotate-half, HF's own row order) and are stored as is.
PERMUTED_QK_ARCHS = ("llama", "mistral", "bamboo")
GEMMA3_SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
GEMMA3_ROPE_BASE_SWA = 10000.0  # llama.cpp: rope_freq_base_train_swa for LLM_ARCH_GEMMA3


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    activation: str  # "silu" for SwiGLU models, "relu" for ReLU-fied ones (PowerInfer)
    sparse_threshold: float | None = None  # powerinfer.sparse_threshold when the file has predictors
    # Per-architecture differences (defaults: plain llama).
    permuted_qk: bool = True  # Q/K rows in llama.cpp's permuted order (llama, mistral)
    qkv_bias: bool = False  # blk.N.attn_{q,k,v}.bias (qwen2)
    qk_norm: bool = False  # blk.N.attn_{q,k}_norm.weight, per head (qwen3, gemma3)
    post_norms: bool = False  # blk.N.post_attention_norm / post_ffw_norm (gemma3)
    embed_scale: float | None = None  # embeddings times this (gemma3: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim)
    sliding_window: int | None = None  # attend to the last this-many positions (sliding layers)
    sliding_layers: tuple[bool, ...] = ()  # per layer: uses the window (empty: every layer if any)
    rope_base_swa: float | None = None  # rope base of the sliding layers (gemma3); None = rope_base
    rope_scale: float = 1.0  # linear rope scaling factor of the global layers
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    # How the FFN combines gate and up (sparsecore.ffn.GATE_MODES): "par" act(gate x) * (up x);
    # "sym" act(gate x) * act(up x) (bamboo); "none": act(up x), no gate tensor (falcon).
    ffn_gate: str = "par"
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm (falcon)
    parallel: bool = False  # attention and FFN both read the layer's input (falcon)

    @property
    def plain_llama(self) -> bool:
        """Attention exactly as llama's (what the native one-call AttentionStep computes)."""
        return not (self.qkv_bias or self.qk_norm or self.post_norms or self.attn_scale is not None
                    or self.rope_base_swa is not None or self.rope_scale != 1.0 or self.layer_norm
                    or self.parallel)

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, or None where it attends to every position."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[i]):
            return None
        return self.sliding_window

    def layer_rope_base(self, i: int) -> tuple[float, float]:
        """(rope base, linear scale) of layer i: gemma3's sliding layers have their own base."""
        if self.rope_base_swa is not None and self.sliding_layers and self.sliding_layers[i]:
            return self.rope_base_swa, 1.0
        return self.rope_base, self.rope_scale


def _require(path: Path, reader: GGUFReader, key: str):
    v = field_value(reader, key)
    if v is None:
        raise ModelFileError(f"{path}: metadata field {key} is missing")
    return v


def read_config(path: Path, reader: GGUFReader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch is None:
        raise ModelFileError(f"{path}: metadata field general.architecture is missing")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    check_model_metadata(path, reader, arch)  # bounds and shapes before any value sizes anything
    p = f"{arch}."
    hidden = int(_require(path, reader, p + "embedding_length"))
    n_heads = int(_require(path, reader, p + "attention.head_count"))
    n_kv = int(field_value(reader, p + "attention.head_count_kv", n_heads))
    head_dim = int(field_value(reader, p + "attention.key_length", hidden // n_heads))
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise ModelFileError(f"{path}: tensor token_embd.weight is missing")
    vocab = int(field_value(reader, p + "vocab_size", int(emb.shape[1])))
    act = "relu" if "blk.0.fc1.weight" in names or arch == "bamboo" else (
        {"gemma3": "gelu_tanh", "falcon": "gelu"}.get(arch, "silu"))
    act = str(field_value(reader, "sparseinfer.activation", act))
    thr = field_value(reader, "powerinfer.sparse_threshold")
    n_layers = int(_require(path, reader, p + "block_count"))
    window = field_value(reader, p + "attention.sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None  # phi3 writes 0 for none
    sliding: tuple[bool, ...] = ()
    extra: dict = {}
    if arch == "gemma3":
        pattern = field_value(reader, p + "attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):  # one bool per layer (newer converters)
            sliding = tuple(bool(b) for b in pattern)
        else:  # every n-th layer global
            n = int(pattern) if pattern is not None else GEMMA3_SWA_PATTERN
            sliding = tuple((i + 1) % n != 0 for i in range(n_layers)) if n > 0 else ()
        extra = dict(
            post_norms=True, embed_scale=float(hidden) ** 0.5,
            attn_scale=(hidden / n_heads) ** -0.5 if n_layers == 62 else None,  # llama.cpp: 27B
            rope_base_swa=float(field_value(reader, p + "rope.freq_base_swa", GEMMA3_ROPE_BASE_SWA)))
        if str(field_value(reader, p + "rope.scaling.type", "none")) == "linear":
            extra["rope_scale"] = float(field_value(reader, p + "rope.scaling.factor", 1.0))
    if arch == "bamboo":
        extra = dict(ffn_gate="sym")
    if arch == "falcon":
        extra = dict(ffn_gate="none", layer_norm=True, parallel=True)
    eps_key = "attention.layer_norm_epsilon" if arch == "falcon" else "attention.layer_norm_rms_epsilon"
    cap = field_value(reader, p + "final_logit_softcapping")
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_ff=int(_require(path, reader, p + "feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_dim=int(field_value(reader, p + "rope.dimension_count", head_dim)),
        rope_base=float(field_value(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(field_value(reader, p + eps_key, 1e-5)),  # falcon: its LayerNorm's eps
        context_length=int(field_value(reader, p + "context_length", 2048)),
        vocab_size=vocab,
        tied_embeddings="output.weight" not in names,
        activation=act,
        sparse_threshold=None if thr is None else float(thr),
        permuted_qk=arch in PERMUTED_QK_ARCHS,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=window,
        sliding_layers=sliding,
        final_logit_softcap=float(cap) if cap else None,
        **extra,
    )
