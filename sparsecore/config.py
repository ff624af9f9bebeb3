"""Hyper-parameters of a Llama-architecture model, read from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader

from .errors import ModelFileError
from .gguf_check import check_model_metadata
from .gguf_file import field_value

# Architectures whose GGUF tensors follow llama.cpp's LLM_ARCH_LLAMA layout.
SUPPORTED_ARCHS = ("llama", "mistral")


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
    act = "relu" if "blk.0.fc1.weight" in names else "silu"
    act = str(field_value(reader, "sparseinfer.activation", act))
    thr = field_value(reader, "powerinfer.sparse_threshold")
    return ModelConfig(
        arch=arch,
        n_layers=int(_require(path, reader, p + "block_count")),
        hidden=hidden,
        n_ff=int(_require(path, reader, p + "feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_dim=int(field_value(reader, p + "rope.dimension_count", head_dim)),
        rope_base=float(field_value(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(field_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(field_value(reader, p + "context_length", 2048)),
        vocab_size=vocab,
        tied_embeddings="output.weight" not in names,
        activation=act,
        sparse_threshold=None if thr is None else float(thr),
    )
