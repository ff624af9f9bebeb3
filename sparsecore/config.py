"""Hyper-parameters of a model, read from GGUF metadata as llama.cpp's convert_hf_to_gguf.py
writes them: `read_config` turns the file's architecture entry (sparsecore/arch.py, where what
differs between the families is written down) and its metadata into a `ModelConfig`, the
resolved values the engine computes with. Nothing else asks which architecture a file is.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader

from .arch import ARCHS, EXPERT_GATING_FUNCS, SUPPORTED_ARCHS, Arch  # noqa: F401 (SUPPORTED_ARCHS: re-exported)
from .errors import ModelFileError
from .gguf_check import check_model_metadata
from .gguf_file import field_value


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
    # Per-architecture differences (defaults: plain llama; sparsecore/arch.py says which is whose).
    permuted_qk: bool = True  # Q/K rows in llama.cpp's permuted order (rope "normal")
    qkv_bias: bool = False  # blk.N.attn_{q,k,v}.bias
    qk_norm: bool = False  # blk.N.attn_{q,k}_norm.weight, per head
    qk_norm_full: bool = False  # ... over all heads' values at once (olmoe): n_heads hd and n_kv hd wide
    post_norms: bool = False  # blk.N.post_attention_norm / post_ffw_norm
    embed_scale: float | None = None  # embeddings times this
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim)
    sliding_window: int | None = None  # attend to the last this-many positions (sliding layers)
    sliding_layers: tuple[bool, ...] = ()  # per layer: uses the window (empty: every layer if any)
    rope_layers: tuple[bool, ...] = ()  # per layer: applies rope (empty: every layer; smallthinker's NoPE layers)
    rope_base_swa: float | None = None  # rope base of the sliding layers; None = rope_base
    rope_scale: float = 1.0  # linear rope scaling factor of the global layers
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    # How the FFN combines gate and up (sparsecore.ffn.GATE_MODES): "par" act(gate x) * (up x);
    # "sym" act(gate x) * act(up x); "none": act(up x), no gate tensor.
    ffn_gate: str = "par"
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm
    parallel: bool = False  # attention and FFN both read the layer's input
    residual_scale: float | None = None  # attention and FFN outputs times this before the residual
    logit_scale: float | None = None  # logits divided by this
    # Routed experts (sparsecore/arch.py FFN_KINDS): n_ff is then one expert's neurons, the unit
    # every process owns a range of in each expert.
    n_experts: int = 0  # 0: a dense FFN
    n_experts_used: int = 0
    expert_norm: bool = False  # the chosen experts' weights renormalized to sum 1
    n_ff_shared: int = 0  # the shared expert's neurons (a multiple of n_ff), 0: none
    # gpt-oss (sparsecore/arch.py): "softmax_weight", the top k router logits (router bias
    # included), then a softmax over those k; experts with biases and the clamped SwiGLU;
    # smallthinker: "softmax" or "sigmoid", as its file's expert_gating_func says
    expert_gating: str = "softmax"
    router_reads_layer_input: bool = False  # smallthinker: the router scores the layer's input, not the FFN's
    expert_bias: bool = False
    swiglu_limit: float | None = None  # the clamped SwiGLU's limit (alpha 1.702, as llama.cpp)
    attn_sinks: bool = False  # blk.N.attn_sinks: one logit per head in the softmax's denominator
    attn_out_bias: bool = False  # blk.N.attn_output.bias
    # YaRN rope: (factor, original context, beta_fast, beta_slow, attention factor, truncate)
    rope_yarn: tuple | None = None

    @property
    def routed(self) -> bool:
        return self.n_experts > 0

    @property
    def spec(self) -> Arch:
        """The architecture's table entry (sparsecore/arch.py)."""
        return ARCHS[self.arch]

    @property
    def native_attention(self) -> bool:
        """Whether the native attention step computes this model's attention (its variants: Q/K/V
        biases, Q/K norms, output norms, scales, sliding windows, per-layer rope bases,
        LayerNorms, gpt-oss's sinks and output bias; parallel blocks read the FFN's input before it): every architecture the
        table names, where rope fits in a head."""
        return self.rope_dim <= self.head_dim

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, or None where it attends to every position."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[i]):
            return None
        return self.sliding_window

    def layer_has_rope(self, i: int) -> bool:
        """Whether layer i rotates Q and K (smallthinker's NoPE layers do not)."""
        return not self.rope_layers or self.rope_layers[i]

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
    if arch not in ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    spec = ARCHS[arch]
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
    act = "relu" if "blk.0.fc1.weight" in names else spec.activation  # predictors: a ReLU-fied model
    act = str(field_value(reader, "sparseinfer.activation", act))
    thr = field_value(reader, "powerinfer.sparse_threshold")
    n_layers = int(_require(path, reader, p + "block_count"))
    window = field_value(reader, p + "attention.sliding_window")
    if window is None and spec.attn_sinks:  # gpt-oss: llama.cpp requires it (its even layers slide)
        _require(path, reader, p + "attention.sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None  # phi3 writes 0 for none
    sliding: tuple[bool, ...] = ()
    rope_layers: tuple[bool, ...] = ()
    if spec.sliding_global_first:  # smallthinker: as llama.cpp, only where the file has a window
        if window is not None:
            window = spec.sliding_window_fixed or window
            n = int(field_value(reader, p + "attention.sliding_window_pattern", spec.sliding_pattern))
            sliding = tuple(n == 0 or i % n != 0 for i in range(n_layers))  # set_swa_pattern(n, dense_first)
            step = spec.no_rope_step
            if step != n_layers:  # llama.cpp's use_rope: n_no_rope_layer_step == n_layer || il % step != 0
                rope_layers = tuple(i % step != 0 for i in range(n_layers))
    elif spec.sliding_pattern is not None:
        pattern = field_value(reader, p + "attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):  # one bool per layer (newer converters)
            sliding = tuple(bool(b) for b in pattern)
        else:  # every n-th layer global
            n = int(pattern) if pattern is not None else spec.sliding_pattern
            sliding = tuple((i + 1) % n != 0 for i in range(n_layers)) if n > 0 else ()
    rope_scale = 1.0
    if spec.rope_base_swa is not None and str(field_value(reader, p + "rope.scaling.type", "none")) == "linear":
        rope_scale = float(field_value(reader, p + "rope.scaling.factor", 1.0))  # the global layers'
    embed_scale = None
    if spec.embed_scale == "sqrt_hidden":
        embed_scale = float(hidden) ** 0.5
    elif spec.embed_scale is not None:
        embed_scale = _scalar(path, reader, p + spec.embed_scale)
    attn_scale = None
    if spec.attn_scale_key is not None:
        attn_scale = _scalar(path, reader, p + spec.attn_scale_key)
    elif spec.scale_by_hidden_at_layers == n_layers:
        attn_scale = (hidden / n_heads) ** -0.5
    cap = field_value(reader, p + "final_logit_softcapping")
    routed = spec.routed(p + "expert_count" in reader.fields)
    n_ff_key = "expert_feed_forward_length" if routed and p + "expert_feed_forward_length" in reader.fields \
        else "feed_forward_length"  # Mixtral (llama) has no expert length: its FFN length is one expert's
    experts = {}
    if routed:  # bounds and shapes checked by check_model_metadata
        experts = dict(n_experts=int(_require(path, reader, p + "expert_count")),
                       n_experts_used=int(_require(path, reader, p + "expert_used_count")),
                       expert_norm=spec.expert_norm)
        if spec.shared_expert:
            experts["n_ff_shared"] = int(_require(path, reader, p + "expert_shared_feed_forward_length"))
        gating = spec.expert_gating
        if spec.gating_from_file:  # checked by check_model_metadata
            gating = EXPERT_GATING_FUNCS[int(_require(path, reader, p + "expert_gating_func"))]
        experts.update(expert_gating=gating, expert_bias=spec.expert_bias, swiglu_limit=spec.swiglu_limit,
                       router_reads_layer_input=spec.router_reads_layer_input)
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_ff=int(_require(path, reader, p + n_ff_key)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_dim=int(field_value(reader, p + "rope.dimension_count", head_dim)),
        rope_base=float(field_value(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(field_value(reader, p + spec.eps_key, 1e-5)),  # a LayerNorm's eps where the norm is one
        context_length=int(field_value(reader, p + "context_length", 2048)),
        vocab_size=vocab,
        tied_embeddings="output.weight" not in names,
        activation=act,
        sparse_threshold=None if thr is None else float(thr),
        permuted_qk=spec.rope == "normal",
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names or spec.qk_norm_full,  # olmoe's: required
        qk_norm_full=spec.qk_norm_full,
        post_norms=spec.post_norms,
        embed_scale=embed_scale,
        attn_scale=attn_scale,
        sliding_window=window,
        sliding_layers=sliding,
        rope_layers=rope_layers,
        rope_base_swa=_rope_base_swa(reader, p, spec, bool(sliding)),
        rope_scale=rope_scale,
        final_logit_softcap=float(cap) if cap else None,
        ffn_gate=spec.ffn_gate,
        layer_norm=spec.norm == "layer",
        parallel=spec.parallel,
        residual_scale=_scalar(path, reader, p + spec.residual_scale_key) if spec.residual_scale_key else None,
        logit_scale=_scalar(path, reader, p + spec.logit_scale_key) if spec.logit_scale_key else None,
        attn_sinks=spec.attn_sinks,
        attn_out_bias="blk.0.attn_output.bias" in names,
        rope_yarn=_yarn(path, reader, p, spec),
        **experts,
    )


def _rope_base_swa(reader: GGUFReader, p: str, spec: Arch, sliding: bool) -> float | None:
    """The sliding layers' rope base: gemma3's own default, or (smallthinker, where layers slide)
    the global base unless the file says rope.freq_base_swa, as llama.cpp reads them."""
    if spec.rope_base_swa is not None:
        return float(field_value(reader, p + "rope.freq_base_swa", spec.rope_base_swa))
    if spec.rope_base_swa_key and sliding:
        return float(field_value(reader, p + "rope.freq_base_swa", field_value(reader, p + "rope.freq_base", 10000.0)))
    return None


def _yarn(path: Path, reader: GGUFReader, p: str, spec: Arch) -> tuple | None:
    """(factor, original context, beta_fast, beta_slow, attention factor, truncate) where the
    file's rope.scaling.type is yarn (gpt-oss), as llama.cpp reads them: the attention factor
    is rope.scaling.attn_factor (default 1) times 0.1 ln(factor) + 1 (transformers' get_mscale),
    the betas default to 32 and 1."""
    if str(field_value(reader, p + "rope.scaling.type", "none")) != "yarn":
        return None
    import math

    factor = _scalar(path, reader, p + "rope.scaling.factor")
    orig = _scalar(path, reader, p + "rope.scaling.original_context_length")
    fast = float(field_value(reader, p + "rope.scaling.yarn_beta_fast", 32.0))
    slow = float(field_value(reader, p + "rope.scaling.yarn_beta_slow", 1.0))
    attn = float(field_value(reader, p + "rope.scaling.attn_factor", 1.0)) * \
        (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return factor, orig, fast, slow, attn, spec.yarn_truncate


def _scalar(path: Path, reader: GGUFReader, key: str) -> float:
    """A required positive finite scalar of the architecture (granite's multipliers)."""
    v = _require(path, reader, key)
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ModelFileError(f"{path}: metadata {key} = {v!r}: must be a number") from None
    if not 0 < f < float("inf"):
        raise ModelFileError(f"{path}: metadata {key} = {f}: must be a finite positive number")
    return f
