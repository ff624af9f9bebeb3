"""Write a Llama-shaped GGUF of a given shape and type with random weights, for benchmarks.

    python scripts/make_bench_model.py --shape 1.1b --type q4_0 -o /tmp/bench-1.1b-q4_0.gguf
    python scripts/make_bench_model.py --shape 7b --type q4_k_m -o /tmp/bench-7b-q4_k_m.gguf
    python scripts/make_bench_model.py --shape 1.1b --type q4_0 --relu --active 0.1 -o /tmp/b.pwri.gguf
    python scripts/make_bench_model.py --shape 1.1b --type q3_k_m   # by llama.cpp's quantizer
    python scripts/make_bench_model.py --shape 1.1b --type q4_k_m --arch qwen3
    python scripts/make_bench_model.py --shape 20b --type q8_0 --arch gpt-oss --layers 4
    python scripts/make_bench_model.py --shape 4b-a0.6b --type q4_0 --arch smallthinker

--arch writes the shape as another architecture's file (sparsecore/arch.py), with what its
attention adds: qwen2 Q/K/V biases (rope base 1e6); qwen3 per-head Q/K norms (rope base 1e6);
gemma3 Q/K norms, norms of the attention and FFN outputs, tied embeddings (no output.weight),
a sliding window of 512 on five layers of six (llama.cpp's pattern), GeGLU; qwen3moe qwen3's
attention and routed experts (--experts, --experts-used, --expert-ff; the 30b-a3b shape has
Qwen3-30B-A3B's) stacked as ffn_{gate,up,down}_exps with the router ffn_gate_inp (--router-skew:
some experts routed far more often than others, for placement to find); gpt-oss its attention
(Q/K/V/O biases, sinks, a window of 128 on the even layers, YaRN keys) and routed experts with
biases, the experts MXFP4 whatever --type (the 20b shape has gpt-oss-20b's); smallthinker llama's
attention (a window of 4096 in the file: llama.cpp's NoPE layer every 4th, the others sliding) and
ReGLU experts routed from the layer's input with sigmoid gating (the 4b-a0.6b shape has
SmallThinker-4B-A0.6B's: 32 experts of 768, 4 used). The extra tensors
(biases, norms, the router, sinks) are F32, as llama.cpp's quantizer leaves them.

Shapes: tiny (2 layers, hidden 256, for tests), 1.1b (TinyLlama), 3b (OpenLLaMA 3B), 7b
(Llama-2 7B); --hidden/--ff/--layers/--heads/--kv-heads override any of them. The vocabulary
and tokenizer are copied from --tokenizer-from (default: the SmolLM2 file `sparseinfer pull`
fetches; 49152 tokens, a gpt2 BPE llama.cpp accepts), so the token embedding and output
matrices have that many rows whatever the shape's usual vocabulary is.

Types follow what llama.cpp's quantizer (llama_tensor_get_type) gives each tensor:
  f16     every matrix F16.
  q8_0    every matrix Q8_0.
  q4_0    every matrix Q4_0, output.weight Q6_K.
  q4_k_m  Q4_K, with Q6_K for output.weight and for attn_v / ffn_down of the layers
          llama.cpp's use_more_bits picks (the first and last eighth, every third between).
          Rows not a multiple of 256 (e.g. the 3b shape) fall back as llama.cpp does:
          Q4_K -> Q5_0, Q6_K -> Q8_0.
Norms are F32. Q4_0/Q8_0/Q5_0 are quantized by gguf-py; Q4_K/Q6_K by the round-to-nearest
numpy quantizers of tests/fixtures/tiny_gguf.py (tested there against gguf-py's dequantizer).

Every other llama.cpp file type (q2_k, q3_k_m, q5_1, iq4_xs, iq3_m, tq1_0, ...: LLAMA_TYPES) is
made as llama.cpp's own users get it: this script writes the f16 file of the same weights, and
llama.cpp's quantizer (llama_model_quantize, from llama-cpp-python: scripts/setup-bench installs
it) turns it into the type, choosing each tensor's type by its own rules; the f16 file is
deleted. `--quantizer llama` does the same for the four types above. The i-quants of 1 and 2
bits (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s; also q2_k_s) need an importance matrix llama.cpp's
quantizer computes from text (llama-imatrix), which random weights have no use for: refused.

Weights: standard normal / sqrt(fan_in), attn_output and ffn_down also / sqrt(2 * layers) so
the residual stream stays O(1); norms 1; embeddings standard normal. Written tensor by tensor
(header and tensor table first, then each tensor's data generated, quantized and appended), so
memory stays at a few copies of the largest matrix: a 7B file needs ~2 GB, not 28.

--relu writes the ReLU variant in PowerInfer's layout (magic PWRI; blk.N.ffn_down_t.weight =
down.T in place of ffn_down; predictors blk.N.fc1.weight (rank, hidden) and blk.N.fc2.weight
(n_ff, rank); powerinfer.sparse_threshold = 0), see tests/fixtures/tiny_powerinfer.py. The
predictor score fc2 @ relu(fc1 @ h) has fc1 standard normal and fc2 = standard normal + c per
layer, c calibrated so that about --active of the neurons score above 0 for any h (the sign of
the score does not depend on |h|). Predictor tensors get PowerInfer's quantizer's types: F16 in
f16 files, Q4_0 in q4_0 files, Q5_0 otherwise. llama.cpp cannot load PWRI files: benchmark it
on the dense file of the same shape and type.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import LlamaFileType as FT  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from tests.fixtures.tiny_gguf import quantize_k  # noqa: E402  (K-quant quantizers, tested there)

DEFAULT_TOKENIZER = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"

SHAPES = {
    "tiny": dict(hidden=256, n_ff=512, n_layers=2, n_heads=4, n_kv_heads=2),
    "1.1b": dict(hidden=2048, n_ff=5632, n_layers=22, n_heads=32, n_kv_heads=4),   # TinyLlama 1.1B
    "3b": dict(hidden=3200, n_ff=8640, n_layers=26, n_heads=32, n_kv_heads=32),    # OpenLLaMA 3B
    "7b": dict(hidden=4096, n_ff=11008, n_layers=32, n_heads=32, n_kv_heads=32),   # Llama-2 7B
    # Qwen3-30B-A3B (--arch qwen3moe; --layers 8 for a file of its shape that fits anywhere)
    "30b-a3b": dict(hidden=2048, n_ff=6144, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128,
                    n_experts_used=8, expert_ff=768),
    # gpt-oss-20b (--arch gpt-oss: experts MXFP4 whatever --type, which the other matrices take, as
    # llama.cpp's MXFP4 files; --layers 4 for a file of its shape that fits anywhere)
    "20b": dict(hidden=2880, n_ff=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=32,
                n_experts_used=4, expert_ff=2880),
    # SmallThinker-4B-A0.6B (--arch smallthinker)
    "4b-a0.6b": dict(hidden=1536, n_ff=768, n_layers=32, n_heads=12, n_kv_heads=2, head_dim=128, n_experts=32,
                     n_experts_used=4, expert_ff=768),
}
MOE_ARCHS = ("qwen3moe", "gpt-oss", "smallthinker")
FILE_TYPES = {"f16": FT.MOSTLY_F16, "q8_0": FT.MOSTLY_Q8_0, "q4_0": FT.MOSTLY_Q4_0,
              "q4_k_m": FT.MOSTLY_Q4_K_M}
# llama.cpp's file types (llama_cpp.LLAMA_FTYPE_MOSTLY_<NAME>) made by its quantizer from an f16 file
LLAMA_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s",
               "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m", "iq4_nl",
               "iq4_xs", "tq1_0", "tq2_0", "bf16")
# the types llama.cpp's quantizer refuses to make without an importance matrix
NEEDS_IMATRIX = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "q2_k_s")
# llama.cpp's fallback when a row is not a multiple of a K-quant's 256 (llama-quant.cpp)
K_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}
PWRI_MAGIC = b"PWRI"


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits in Q4_K_M (attn_v, ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, ftype: str, layer: int | None, n_layers: int, row: int) -> QT:
    """The GGML type of a 2-D tensor `name` whose rows have `row` elements."""
    if ftype == "f16":
        t = QT.F16
    elif ftype == "q8_0":
        t = QT.Q8_0
    elif ftype == "q4_0":
        t = QT.Q6_K if name == "output.weight" else QT.Q4_0
    else:  # q4_k_m
        more = layer is not None and use_more_bits(layer, n_layers) and (
            name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")
            or name.endswith("ffn_down_t.weight") or name.endswith("ffn_down_exps.weight"))
        t = QT.Q6_K if name == "output.weight" or more else QT.Q4_K
    if t in K_FALLBACK and row % 256:
        t = K_FALLBACK[t]
    return t


def predictor_type(ftype: str) -> QT:
    """PowerInfer's quantizer: F16 files keep fc1/fc2 F16, Q4_0 files use Q4_0, others Q5_0."""
    return {"f16": QT.F16, "q4_0": QT.Q4_0}.get(ftype, QT.Q5_0)


def encode(a: np.ndarray, t: QT) -> np.ndarray:
    if t == QT.MXFP4:  # gguf-py's quantizer holds 16 floats per value: a few hundred rows at a time
        rows = a.reshape(-1, a.shape[-1])
        out = np.concatenate([gguf.quants.quantize(rows[r:r + 256], t) for r in range(0, len(rows), 256)])
        return out.reshape(*a.shape[:-1], -1)
    if t == QT.F32:
        return a.astype(np.float32, copy=False)
    if t == QT.F16:
        return a.astype(np.float16)
    if t in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        return quantize_k(a, t)
    return gguf.quants.quantize(a.astype(np.float32, copy=False), t)


def stored_shape(shape: tuple[int, ...], t: QT) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, nbytes) of encode(array of `shape`, t), without making it."""
    if t == QT.F32:
        return shape, np.dtype(np.float32), int(np.prod(shape)) * 4
    if t == QT.F16:
        return shape, np.dtype(np.float16), int(np.prod(shape)) * 2
    block, size = GGML_QUANT_SIZES[t]
    if shape[-1] % block:
        raise SystemExit(f"a row of {shape[-1]} elements is not a multiple of {t.name}'s block of {block}")
    s = (*shape[:-1], shape[-1] // block * size)
    return s, np.dtype(np.uint8), int(np.prod(s))


# ---- the tensors --------------------------------------------------------------------------------

class Spec:
    """One tensor: name, numpy shape (out, in), GGML type, and how to make its float values."""

    def __init__(self, name, shape, qtype, make):
        self.name, self.shape, self.qtype, self.make = name, tuple(shape), qtype, make


def calibrate_offset(fc1: np.ndarray, z: np.ndarray, active: float, seed: int, samples: int = 64) -> float:
    """c such that fc2 = z + c marks about `active` of the rows active: mean over random h of
    the fraction of j with (z_j + c) . relu(fc1 h) > 0. Bisection; monotone in c."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((samples, fc1.shape[1]), dtype=np.float32)
    r = np.maximum(h @ fc1.T, 0)                      # (samples, rank)
    s = r @ z.T                                       # (samples, n_ff)
    s1 = r.sum(axis=1, keepdims=True)                 # (samples, 1): d score / d c
    s1 = np.where(s1 > 0, s1, 1e-30)
    lo, hi = -10.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        frac = float(np.mean(s + mid * s1 > 0))
        lo, hi = (mid, hi) if frac < active else (lo, mid)
    return (lo + hi) / 2


def tensor_specs(a) -> list[Spec]:
    h, ff, L = a.hidden, a.n_ff, a.n_layers
    hd = a.head_dim
    kv, nq = a.n_kv_heads * hd, a.n_heads * hd
    out_scale = 1 / np.sqrt(2 * L)

    def normal(shape, scale, idx):
        def make():
            rng = np.random.default_rng([a.seed, idx])
            x = rng.standard_normal(shape, dtype=np.float32)
            x *= np.float32(scale)
            return x
        return make

    def ones(n):
        return lambda: np.ones(n, np.float32)

    specs: list[Spec] = []

    def mat(name, shape, scale, layer=None):
        t = tensor_type(name, a.type, layer, L, shape[-1])
        specs.append(Spec(name, shape, t, normal(shape, scale, len(specs))))

    def f32(name, n, scale=0.1):
        specs.append(Spec(name, (n,), QT.F32, normal((n,), scale, len(specs))))

    mat("token_embd.weight", (a.vocab, h), 1.0)
    specs.append(Spec("output_norm.weight", (h,), QT.F32, ones(h)))
    if a.arch != "gemma3":  # gemma3 ties its head to the embeddings
        mat("output.weight", (a.vocab, h), 1 / np.sqrt(h))
    for i in range(L):
        p = f"blk.{i}."
        specs.append(Spec(p + "attn_norm.weight", (h,), QT.F32, ones(h)))
        mat(p + "attn_q.weight", (nq, h), 1 / np.sqrt(h), i)
        mat(p + "attn_k.weight", (kv, h), 1 / np.sqrt(h), i)
        mat(p + "attn_v.weight", (kv, h), 1 / np.sqrt(h), i)
        if a.arch == "gpt-oss":  # Q/K/V and output biases, sinks
            for n, size in (("q", nq), ("k", kv), ("v", kv)):
                f32(p + f"attn_{n}.bias", size)
            f32(p + "attn_output.bias", h, 0.01)
            f32(p + "attn_sinks.weight", a.n_heads, 1.0)
        if a.arch == "qwen2":
            for n, size in (("q", nq), ("k", kv), ("v", kv)):
                f32(p + f"attn_{n}.bias", size)
        if a.arch in ("qwen3", "gemma3", "qwen3moe"):
            specs.append(Spec(p + "attn_q_norm.weight", (hd,), QT.F32, ones(hd)))
            specs.append(Spec(p + "attn_k_norm.weight", (hd,), QT.F32, ones(hd)))
        mat(p + "attn_output.weight", (h, nq), out_scale / np.sqrt(nq), i)
        if a.arch == "gemma3":
            specs.append(Spec(p + "post_attention_norm.weight", (h,), QT.F32, ones(h)))
            specs.append(Spec(p + "post_ffw_norm.weight", (h,), QT.F32, ones(h)))
        specs.append(Spec(p + ("post_attention_norm" if a.arch == "gpt-oss" else "ffn_norm") + ".weight", (h,),
                          QT.F32, ones(h)))
        if a.arch == "gpt-oss":  # the router with its bias, MXFP4 experts with biases
            E, f = a.n_experts, a.expert_ff
            specs.append(Spec(p + "ffn_gate_inp.weight", (E, h), QT.F32,
                              _skewed(normal((E, h), 1 / np.sqrt(h), len(specs)), a.router_skew, a.seed, i)))
            f32(p + "ffn_gate_inp.bias", E)
            for n, shape, scale in (("gate", (E, f, h), 1 / np.sqrt(h)), ("up", (E, f, h), 1 / np.sqrt(h)),
                                    ("down", (E, h, f), out_scale / np.sqrt(f))):
                specs.append(Spec(p + f"ffn_{n}_exps.weight", shape, QT.MXFP4, normal(shape, scale, len(specs))))
            for n, shape, scale in (("gate", (E, f), 0.1), ("up", (E, f), 0.1), ("down", (E, h), 0.01)):
                specs.append(Spec(p + f"ffn_{n}_exps.bias", shape, QT.F32, normal(shape, scale, len(specs))))
            continue
        if a.arch in ("qwen3moe", "smallthinker"):  # the router, then the experts stacked on an outer axis
            E, f = a.n_experts, a.expert_ff
            specs.append(Spec(p + "ffn_gate_inp.weight", (E, h), QT.F32,
                              _skewed(normal((E, h), 1 / np.sqrt(h), len(specs)), a.router_skew, a.seed, i)))
            mat(p + "ffn_gate_exps.weight", (E, f, h), 1 / np.sqrt(h), i)
            mat(p + "ffn_up_exps.weight", (E, f, h), 1 / np.sqrt(h), i)
            mat(p + "ffn_down_exps.weight", (E, h, f), out_scale / np.sqrt(f), i)
            continue
        mat(p + "ffn_gate.weight", (ff, h), 1 / np.sqrt(h), i)
        mat(p + "ffn_up.weight", (ff, h), 1 / np.sqrt(h), i)
        if not a.relu:
            mat(p + "ffn_down.weight", (h, ff), out_scale / np.sqrt(ff), i)
            continue
        # PowerInfer: down stored transposed, numpy (n_ff, hidden); its values are down.T's
        mat(p + "ffn_down_t.weight", (ff, h), out_scale / np.sqrt(ff), i)
        pt = predictor_type(a.type)
        fc = _predictor_maker(a, i, len(specs))
        specs.append(Spec(p + "fc1.weight", (a.rank, h), pt, lambda fc=fc: fc()[0]))
        specs.append(Spec(p + "fc2.weight", (ff, a.rank), pt, lambda fc=fc: fc()[1]))
    return specs


def _skewed(make, skew: float, seed: int, layer: int):
    """The router's rows scaled by (rank + 1)^-skew, the ranks a per-layer permutation of the
    experts: with isotropic inputs some experts are routed far more often than others (0.35: the
    most-routed quarter takes about 60 % of the routes), which placement by frequency can find."""
    if not skew:
        return make

    def skewed():
        w = make()
        rank = np.random.default_rng([seed, layer, 7]).permutation(len(w))
        return w * ((rank + 1.0) ** -skew).astype(np.float32)[:, None]
    return skewed


def _predictor_maker(a, layer: int, idx: int):
    """fc1, fc2 of one layer, made once and handed out one at a time (fc1 first)."""
    cache = {}

    def make():
        if "fc" not in cache:
            rng = np.random.default_rng([a.seed, idx, 7])
            fc1 = rng.standard_normal((a.rank, a.hidden), dtype=np.float32) / np.float32(np.sqrt(a.hidden))
            z = rng.standard_normal((a.n_ff, a.rank), dtype=np.float32)
            c = calibrate_offset(fc1, z, a.active, seed=a.seed * 1000 + layer)
            cache["fc"] = (fc1, z + np.float32(c))
            cache["left"] = 2
        fc = cache["fc"]
        cache["left"] -= 1
        if cache["left"] == 0:
            del cache["fc"]
        return fc
    return make


# ---- metadata -----------------------------------------------------------------------------------

def copy_tokenizer(w: gguf.GGUFWriter, src: Path) -> int:
    """Copy every tokenizer.* field of `src` into `w`; return the vocabulary size."""
    from sparsecore.gguf_file import open_gguf

    r = open_gguf(src)
    n_vocab = None
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        val = f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, gguf.GGUFValueType.ARRAY, sub_type=f.types[-1])
        else:
            w.add_key_value(key, val, f.types[0])
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
    if n_vocab is None:
        raise SystemExit(f"{src}: has no tokenizer.ggml.tokens to copy")
    return n_vocab


def llama_quantize(src: Path, out: Path, ftype: str, threads: int) -> None:
    """llama.cpp's quantizer (llama-cpp-python's binding) from the f16 file `src` to `out`."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(f"--type {ftype} is made by llama.cpp's quantizer: install llama-cpp-python "
                         f"(scripts/setup-bench)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp's quantizer failed to make {ftype} from {src}")


def write_model(a) -> Path:
    if a.quantizer == "llama":
        return write_by_llama(a)
    return write_own(a)


def write_by_llama(a) -> Path:
    """The f16 file of the same weights, quantized to a.type by llama.cpp (the f16 file removed)."""
    t0 = time.perf_counter()
    out = Path(a.output)
    f16 = out.with_name(out.name + ".f16.tmp")
    own = argparse.Namespace(**{**vars(a), "type": "f16", "output": str(f16), "quiet": True})
    try:
        write_own(own, report=False)
        llama_quantize(f16, out, a.type, a.threads)
    finally:
        f16.unlink(missing_ok=True)
    a.vocab = own.vocab
    from sparsecore.gguf_file import open_gguf
    counts: dict[str, int] = {}
    for t in open_gguf(out).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    print_summary(a, out, counts, sum(counts.values()), t0, "by llama.cpp's quantizer")
    return out


def print_summary(a, out: Path, counts: dict, n: int, t0: float, how: str = "") -> None:
    size = out.stat().st_size
    print(f"wrote {out}: {size / 1e9:.3f} GB ({size} bytes), {n} tensors "
          f"({', '.join(f'{k} {c}' for k, c in sorted(counts.items()))}), "
          f"{a.n_layers} layers, hidden {a.hidden}, ff {a.n_ff}, heads {a.n_heads}/{a.n_kv_heads}, "
          f"vocab {a.vocab}, {how + ', ' if how else ''}in {time.perf_counter() - t0:.1f} s")


def write_own(a, report: bool = True) -> Path:
    t0 = time.perf_counter()
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, a.arch)
    a.vocab = copy_tokenizer(w, Path(a.tokenizer_from))
    hd = a.head_dim
    w.add_name(f"sparseinfer bench {a.shape} {a.type}{' relu' if a.relu else ''}{'' if a.arch == 'llama' else ' ' + a.arch}")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.n_layers)
    w.add_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base({"llama": 10000.0, "gpt-oss": 150000.0}.get(a.arch, 1e6))
    w.add_layer_norm_rms_eps(1e-5 if a.arch in ("llama", "gpt-oss") else 1e-6)
    if a.arch in ("qwen3", "gemma3", "qwen3moe", "gpt-oss"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if a.arch == "gpt-oss":  # GptOssModel's keys: the window, YaRN as gpt-oss-20b's config has it
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    if a.arch in MOE_ARCHS:
        w.add_expert_count(a.n_experts)
        w.add_expert_used_count(a.n_experts_used)
        w.add_expert_feed_forward_length(a.expert_ff)
    if a.arch == "smallthinker":  # SmallThinkerModel's keys: sigmoid routing (no router softmax), the window
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_sliding_window(4096)
    if a.arch == "gemma3":
        w.add_sliding_window(512)
    w.add_vocab_size(a.vocab)
    w.add_file_type(int(FILE_TYPES[a.type]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if a.relu:
        w.add_float32("powerinfer.sparse_threshold", 0.0)
    specs = tensor_specs(a)
    for s in specs:
        shape, dtype, nbytes = stored_shape(s.shape, s.qtype)
        w.add_tensor_info(s.name, shape, dtype, nbytes, raw_dtype=None if s.qtype in (QT.F32, QT.F16) else s.qtype)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    counts: dict[str, int] = {}
    for k, s in enumerate(specs):
        data = encode(s.make(), s.qtype)
        w.write_tensor_data(data)
        counts[s.qtype.name] = counts.get(s.qtype.name, 0) + 1
        if not a.quiet and (k + 1) % 20 == 0:
            print(f"  {k + 1}/{len(specs)} tensors, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    w.close()
    if a.relu:
        with open(out, "r+b") as f:
            f.write(PWRI_MAGIC)
    if report:
        print_summary(a, out, counts, len(specs), t0)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", choices=list(SHAPES), default="1.1b")
    ap.add_argument("--type", choices=sorted(set(FILE_TYPES) | set(LLAMA_TYPES) | set(NEEDS_IMATRIX)), default="q4_0",
                    metavar="TYPE", help="f16, q8_0, q4_0, q4_k_m (written here), or any llama.cpp file type "
                    "(made by its quantizer): " + ", ".join(t for t in LLAMA_TYPES if t not in FILE_TYPES))
    ap.add_argument("--quantizer", choices=["own", "llama"],
                    help="who quantizes: this script (f16, q8_0, q4_0, q4_k_m: the default) or llama.cpp "
                    "(every other type)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's quantizer threads")
    ap.add_argument("-o", "--output", help="default: ~/.cache/sparseinfer/models/bench-SHAPE-TYPE[-relu].gguf")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ff", dest="n_ff", type=int)
    ap.add_argument("--layers", dest="n_layers", type=int)
    ap.add_argument("--heads", dest="n_heads", type=int)
    ap.add_argument("--kv-heads", dest="n_kv_heads", type=int)
    ap.add_argument("--ctx", type=int, default=4096, help="context_length written to the file")
    ap.add_argument("--tokenizer-from", default=str(DEFAULT_TOKENIZER),
                    help="GGUF whose tokenizer.* metadata (and so vocabulary size) is copied")
    ap.add_argument("--relu", action="store_true", help="ReLU FFN in PowerInfer's PWRI layout, with predictors")
    ap.add_argument("--active", type=float, default=0.1, help="--relu: fraction of neurons predicted active")
    ap.add_argument("--rank", type=int, help="--relu: predictor rank (default hidden/4, a multiple of 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-dim", dest="head_dim", type=int, help="default hidden / heads")
    ap.add_argument("--experts", dest="n_experts", type=int, help="routed archs: experts per layer")
    ap.add_argument("--experts-used", dest="n_experts_used", type=int, help="routed archs: experts per token")
    ap.add_argument("--expert-ff", dest="expert_ff", type=int, help="routed archs: one expert's neurons")
    ap.add_argument("--router-skew", type=float, default=0.0,
                    help="routed archs: router rows scaled by (rank + 1)^-skew (0.35: the top quarter of experts takes "
                         "about 60%% of the routes); 0: uniform")
    ap.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss", "smallthinker"],
                    default="llama",
                    help="the file's architecture: what its attention adds to llama's (module doc)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    for k, v in SHAPES[a.shape].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.head_dim is None:
        a.head_dim = a.hidden // a.n_heads
    if a.arch in MOE_ARCHS:
        for k, v in dict(n_experts=8, n_experts_used=2, expert_ff=a.n_ff // 4).items():
            if getattr(a, k) is None:
                setattr(a, k, v)
        if not 1 <= a.n_experts_used <= a.n_experts:
            ap.error(f"--experts-used {a.n_experts_used}: between 1 and --experts {a.n_experts}")
    if a.n_heads % a.n_kv_heads or a.head_dim % 2 or (a.hidden % a.n_heads and a.head_dim == a.hidden // a.n_heads):
        ap.error(f"hidden {a.hidden}, heads {a.n_heads}, kv heads {a.n_kv_heads} do not divide (even head_dim)")
    if a.type in NEEDS_IMATRIX:
        ap.error(f"--type {a.type}: llama.cpp's quantizer makes it only with an importance matrix from "
                 f"text (llama-imatrix), which random weights have no use for")
    if a.quantizer is None:
        a.quantizer = "own" if a.type in FILE_TYPES else "llama"
    if a.quantizer == "own" and a.type not in FILE_TYPES:
        ap.error(f"--type {a.type} is made by llama.cpp's quantizer only (--quantizer llama)")
    if a.arch != "llama" and a.relu:
        ap.error("--relu writes PowerInfer's llama layout: not with --arch")
    if a.quantizer == "llama" and a.relu:
        ap.error("--relu writes PowerInfer's layout, which llama.cpp's quantizer does not know: "
                 f"use --type {' / '.join(FILE_TYPES)}")
    if a.rank is None:
        a.rank = max(32, a.hidden // 4 // 32 * 32)
    if a.relu and (a.rank % 32 or not 0 < a.active < 1):
        ap.error("--rank must be a multiple of 32 and --active in (0, 1)")
    if a.output is None:
        a.output = str(Path.home() / ".cache/sparseinfer/models" /
                       f"bench-{a.shape}-{a.type}{'-relu' if a.relu else ''}"
                       f"{'' if a.arch == 'llama' else '-' + a.arch}.gguf")
    return a


def main(argv=None):
    write_model(parse_args(argv))


if __name__ == "__main__":
    main()
