"""Architectures as data: one table entry per model family (`ARCHS`), in the spirit of llama.cpp's
llama-arch.cpp. An entry says how the family's GGUF file is laid out (which tensors, fused or
not, which are optional) and which shared pieces its math is built from (norm, rope style,
activation, how the FFN combines gate and up, attention variants, scalars). read_config
(sparsecore/config.py) turns an entry plus the file's metadata into a `ModelConfig`; nothing
outside this module asks which architecture a file is.

Adding a dense architecture whose math is made of the pieces below is one entry here. The facts
come from llama.cpp (its per-architecture flags are not in the file: e.g. gemma3's every-6th
global layer, its sliding layers' rope base) and from the converter (convert_hf_to_gguf.py),
which decides the tensors' layout:

- llama, mistral, bamboo, granite: the converter permutes Q/K rows for llama.cpp's "normal"
  rope; the model un-permutes them and applies rotate-half rope. The others use "neox" rope
  (HF's own row order). `{arch}.attention.sliding_window`, where present, limits attention
  (Mistral v0.1; phi3 writes 0 for none).
- qwen2: Q/K/V biases. qwen3: per-head RMSNorm of Q and K (head_dim wide) before rope.
- gemma3: embeddings times sqrt(hidden); RMSNorm weights stored as 1 + w by the converter (plain
  weights here); norms of the attention and FFN outputs; Q/K norms; GeGLU (tanh GELU); every
  6th layer global (`attention.sliding_window_pattern` where the file has it), the others
  attend within `attention.sliding_window` with rope base 10000 (`rope.freq_base_swa`); the
  global layers use `rope.freq_base` and the linear `rope.scaling.factor`. Scale 1/sqrt(head_dim)
  except the 62-layer 27B (hidden / n_heads, as llama.cpp); `final_logit_softcapping`.
- phi3: Q, K, V fused as `attn_qkv`, gate and up as `ffn_up` (gate rows first).
- bamboo (PowerInfer): llama's layout under `bamboo.`, ReLU, relu(gate x) * relu(up x).
- falcon: LayerNorms with bias (`attention.layer_norm_epsilon`), attention and FFN in parallel
  on the layer's input (attn_norm_2 for attention where present: the 40B layout), Q, K, V fused
  (all Q heads, then K, then V), no gate: down(act(up x)), GELU (ReLU with predictors).
- llama with experts (Mixtral, which its converter writes as `llama`): where the file carries
  `llama.expert_count`, every FFN is routed experts (the stacked tensors, the router), softmax,
  the top k renormalized (llama.cpp's flags for LLM_ARCH_LLAMA with experts); one expert's
  neurons are `feed_forward_length`.
- qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2's attention (Q/K/V biases); routed experts
  without renormalizing the top k (llama.cpp's flag), plus a shared expert every token runs
  (`ffn_{gate,up,down}_shexp`, `expert_shared_feed_forward_length` neurons) times
  sigmoid(`ffn_gate_inp_shexp` . x).
- qwen3moe (Qwen3-30B-A3B's layout): qwen3's attention; every layer's FFN routed experts: the
  router `ffn_gate_inp` (E x hidden) scores the FFN input, softmax, the top `expert_used_count`
  weights renormalized to sum 1, and the chosen experts' SwiGLU FFNs (slices of the 3-D
  `ffn_{gate,up,down}_exps`, `expert_feed_forward_length` neurons each) summed with those
  weights (llama.cpp's build_moe_ffn with its qwen3moe flags). `feed_forward_length` is unused.
- olmoe (OLMoE-1B-7B): llama's attention with neox rope (no permutation) and RMSNorms of Q and K
  over the whole projection (`attn_q_norm` n_heads x head_dim wide, `attn_k_norm` n_kv x
  head_dim: one RMS over every head, not per head as qwen3's), before rope; every FFN routed
  experts as qwen3moe's but the top k not renormalized (llama.cpp's build_moe_ffn flag for
  LLM_ARCH_OLMOE; transformers' norm_topk_prob defaults to False for it); one expert's neurons
  are `feed_forward_length` (the converter writes no expert length).
- gpt-oss (OpenAI's gpt-oss-20b/120b; llama.cpp's LLM_ARCH_OPENAI_MOE): Q/K/V and output biases,
  a learned sink logit per head in the softmax's denominator (`attn_sinks`; the native step's
  kernels add e^(sink - max) to each head's denominator), every other layer
  (the even ones) within `attention.sliding_window`, YaRN rope (`rope.scaling.*`; transformers'
  correction range not truncated, as gpt-oss's config says). The FFN norm is named
  `post_attention_norm` (shown as `ffn_norm`). Every FFN routed: the router with a bias, the top
  k of its logits and a softmax over those k (llama.cpp's "softmax_weight" gating); experts with
  biases and the clamped SwiGLU: g = min(gate, 7), u = clamp(up, -7, 7),
  (u + 1) * g * sigmoid(1.702 g). Experts in MXFP4, a native type (IQ4_NL-like).
- smallthinker (PowerInfer's SmallThinker-4B-A0.6B / 21B-A3B; llama.cpp's LLM_ARCH_SMALLTHINKER):
  llama's attention with neox rope (no permutation); every FFN routed: the router `ffn_gate_inp`
  scores the layer's INPUT (the residual before attn_norm, computed before the attention), not
  the FFN's normed input; `expert_gating_func` in the file says softmax (1) or sigmoid (2) of
  its logits; the top k renormalized to sum 1 (build_moe_ffn's norm_w, fixed true);
  `expert_weights_scale` is not read (llama.cpp's smallthinker ignores it); ReGLU experts,
  relu(gate x) * (up x), `expert_feed_forward_length` neurons each. Where the file has
  `attention.sliding_window` > 0, llama.cpp makes layers 0, n, 2n, ... (n:
  `attention.sliding_window_pattern`, default 4) global and WITHOUT rope (NoPE: every 4th
  layer, n_no_rope_layer_step's default, also when n is not 4), the others sliding within a
  window of 4096 whatever the file's value (it overwrites n_swa), rope base
  `rope.freq_base_swa` (default: rope.freq_base) on the sliding layers; without a window every
  layer is global with rope.
- granite (IBM Granite 3.x): llama plus four scalars: embeddings times `embedding_scale`, every
  block's attention and FFN outputs times `residual_scale` before the residual, softmax scale
  `attention.scale`, logits divided by `logit_scale`.
"""
from __future__ import annotations

from dataclasses import dataclass

# Per-layer tensors (blk.N.<name>.weight unless the name ends in .bias), by role.
ATTN_SPLIT = ("attn_q", "attn_k", "attn_v")
ATTN_FUSED = ("attn_qkv",)
FFN_SPLIT = ("ffn_gate", "ffn_up")
FFN_FUSED = ("ffn_up",)  # gate rows, then up rows
FFN_ROUTED = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # router, stacked experts
FFN_SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")  # its gate, a dense FFN

# FFN kinds: "dense", one set of neurons per layer; "routed", E experts of n_ff_expert neurons
# each, k chosen per token by a router (sparsecore/experts.py ExpertsLayer). Arch.ffn is one of
# them, or "dense|routed": routed where the file carries {arch}.expert_count (Mixtral as llama).
FFN_KINDS = ("dense", "routed")

# {arch}.expert_gating_func's values (llama.cpp's llama_expert_gating_func_type) that a file may
# name, and the gating each is
EXPERT_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class Arch:
    """One model family's layout and math pieces (module doc)."""
    name: str
    rope: str = "neox"  # "normal": Q/K rows permuted by the converter (llama.cpp's rope type NORM)
    norm: str = "rms"  # "layer": LayerNorm with bias
    eps_key: str = "attention.layer_norm_rms_epsilon"
    activation: str = "silu"  # with predictors in the file (blk.0.fc1): relu
    ffn_gate: str = "par"  # sparsecore.ffn.GATE_MODES: "par", "sym" (both activated), "none" (no gate)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    parallel: bool = False  # attention and FFN both read the layer's input
    post_norms: bool = False  # post_attention_norm, post_ffw_norm
    embed_scale: str | None = None  # "sqrt_hidden", or the metadata key of the factor
    sliding_pattern: int | None = None  # every n-th layer global; None: the window (if any) on every layer
    rope_base_swa: float | None = None  # the sliding layers' own rope base (default; the file may say)
    residual_scale_key: str | None = None  # outputs of attention and FFN times this before the residual
    attn_scale_key: str | None = None  # the softmax scale, from the file
    logit_scale_key: str | None = None  # logits divided by this
    # the 62-layer gemma3 (27B) scales by hidden / n_heads (llama.cpp), not 1/sqrt(head_dim)
    scale_by_hidden_at_layers: int | None = None
    ffn: str = "dense"  # FFN_KINDS, or "dense|routed"
    expert_gating: str = "softmax"  # routed: the router's probabilities
    expert_norm: bool = False  # routed: the top-k weights renormalized to sum 1
    shared_expert: bool = False  # routed: plus a dense FFN every token runs, times sigmoid(gate . x)
    qk_norm_full: bool = False  # attn_q_norm / attn_k_norm normalize all heads' values at once (olmoe)
    # gpt-oss: "softmax_weight" gating (the top k logits, then their softmax), experts with biases
    # and the clamped SwiGLU of this limit; sinks in the attention softmax; YaRN's range untruncated
    expert_bias: bool = False
    swiglu_limit: float | None = None
    attn_sinks: bool = False
    yarn_truncate: bool = True
    ffn_norm_name: str = "ffn_norm"  # what the file calls the FFN's input norm (shown as ffn_norm)
    # smallthinker: the gating named by the file's {arch}.expert_gating_func (EXPERT_GATING_FUNCS);
    # the router reads the layer's input; the sliding pattern's global layers come first in
    # each group of sliding_pattern (layer 0 global); sliding layers attend within this fixed
    # window whatever the file says; every no_rope_step-th layer (0 first) has no rope where the
    # file has a window; the sliding layers' rope base rope.freq_base_swa, default the global one
    gating_from_file: bool = False
    router_reads_layer_input: bool = False
    sliding_global_first: bool = False
    sliding_window_fixed: int | None = None
    no_rope_step: int | None = None
    rope_base_swa_key: bool = False
    expert_ff_required: bool = False  # routed: {arch}.expert_feed_forward_length must be in the file

    def routed(self, has_expert_count: bool) -> bool:
        """Whether a file of this family with (or without) {arch}.expert_count has routed FFNs."""
        return self.ffn == "routed" or (self.ffn == "dense|routed" and has_expert_count)

    def attn_tensors(self) -> tuple[str, ...]:
        return ATTN_FUSED if self.fused_qkv else ATTN_SPLIT

    def ffn_tensors(self, routed: bool = False) -> tuple[str, ...]:
        if routed:
            return FFN_ROUTED + (FFN_SHARED if self.shared_expert else ())
        if self.ffn_gate == "none" or self.fused_gate_up:
            return FFN_FUSED
        return FFN_SPLIT

    def required_tensors(self, n_layers: int, tied: bool, qkv_bias: bool, qk_norm: bool,
                         routed: bool = False) -> list[str]:
        """Every tensor a file of this family must hold, by the names the file uses (fused
        tensors whole; sparsecore.tensors.TensorStore shows their parts under llama's names)."""
        names = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
        if self.norm == "layer":
            names.append("output_norm.bias")
        per_layer = ["attn_norm", *self.attn_tensors(), "attn_output", *self.ffn_tensors(routed)]
        if not routed:
            per_layer.append("ffn_down")
        if self.norm == "layer":
            per_layer.append("attn_norm.bias")
        if not self.parallel:
            per_layer.append(self.ffn_norm_name)
        if qk_norm:
            per_layer += ["attn_q_norm", "attn_k_norm"]
        if self.post_norms:
            per_layer += ["post_attention_norm", "post_ffw_norm"]
        if qkv_bias:
            per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.attn_sinks:
            per_layer += ["attn_sinks", "attn_output.bias"]
        if routed and self.expert_bias:
            per_layer += ["ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"]
        return names + [f"blk.{i}.{n}" if n.endswith(".bias") else f"blk.{i}.{n}.weight"
                        for i in range(n_layers) for n in per_layer]


_LLAMA = dict(rope="normal")

ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("llama", ffn="dense|routed", expert_norm=True, **_LLAMA),
    Arch("mistral", **_LLAMA),
    Arch("qwen2"),
    Arch("qwen3"),
    Arch("qwen3moe", ffn="routed", expert_norm=True),
    Arch("qwen2moe", ffn="routed", shared_expert=True),
    Arch("olmoe", ffn="routed", qk_norm_full=True),
    Arch("gemma3", activation="gelu_tanh", post_norms=True, embed_scale="sqrt_hidden", sliding_pattern=6,
         rope_base_swa=10000.0, scale_by_hidden_at_layers=62),
    Arch("phi3", fused_qkv=True, fused_gate_up=True),
    Arch("bamboo", activation="relu", ffn_gate="sym", **_LLAMA),
    Arch("falcon", norm="layer", eps_key="attention.layer_norm_epsilon", activation="gelu", ffn_gate="none",
         fused_qkv=True, parallel=True),
    Arch("gpt-oss", ffn="routed", expert_gating="softmax_weight", expert_bias=True, swiglu_limit=7.0,
         attn_sinks=True, sliding_pattern=2, yarn_truncate=False, ffn_norm_name="post_attention_norm"),
    Arch("smallthinker", ffn="routed", activation="relu", expert_norm=True, gating_from_file=True,
         router_reads_layer_input=True, sliding_pattern=4, sliding_global_first=True, sliding_window_fixed=4096,
         no_rope_step=4, rope_base_swa_key=True, expert_ff_required=True),
    Arch("granite", embed_scale="embedding_scale", residual_scale_key="residual_scale",
         attn_scale_key="attention.scale", logit_scale_key="logit_scale", **_LLAMA),
)}

SUPPORTED_ARCHS = tuple(ARCHS)
