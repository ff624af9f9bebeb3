"""The engine a command runs on: the model (default: SmolLM2, pulled on first use), the level
generate, chat and serve decode at, and `open_engine`, which makes EngineOptions from the
command's options (those passed through the click context included)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import click

from ..runtime.model_fetch import default_model_path, pull
from .options import (arith_from_context, meta, placement_from_context, predictor_from_context,
                      sparse_method_from_context, weights_from_context)


def resolve_model(model: str | None) -> str:
    if model:
        return model
    path = default_model_path()
    return str(path if path.exists() else pull())


def decode_sparsity(path, sparsity) -> tuple[float | None, str]:
    """(the level generate, chat and serve decode at, the line that says which, or ""):
    --sparsity as given (0: dense), else the calibrated level within the quality budget
    (coordinator/runtime/sparsity_level.py). Exact arithmetic (transformers' tokens), predictors and float
    weights stay dense. The caller prints the line once the engine has loaded (a file it refuses
    gets its one error line only)."""
    if sparsity is not None:
        return (None if sparsity == 0 else sparsity), ""
    if arith_from_context() != "fast" or weights_from_context() != "gguf" or predictor_from_context():
        return None, ""
    from sparsecore.gguf_file import open_gguf

    from sparsecore.predictor_rows import has_predictors  # not coordinator.model.predictor's import of torch
    from ..runtime.sparsity_level import choose

    if has_predictors(open_gguf(path)):  # PowerInfer's files decode with their own predictors
        return None, ""
    return choose(Path(path), sparse_method_for(path), meta("sparseinfer.quality_budget", 0.02))


@lru_cache(maxsize=8)
def _routed(path: str) -> bool:
    """Whether the file's FFNs are routed experts; False where it cannot be read (the engine then
    says why in its one line)."""
    from sparsecore.config import read_config
    from sparsecore.errors import ModelFileError
    from sparsecore.gguf_file import open_gguf

    try:
        return read_config(Path(path), open_gguf(path)).routed
    except (ModelFileError, OSError, ValueError):
        return False


def sparse_method_for(path) -> str:
    """How a level skips weights on this model: --sparse-method, but CATS on a routed
    (mixture-of-experts) model, whose experts take per-expert CATS thresholds only (no
    input-major twins: coordinator/tools/calibrate.py)."""
    return "cats" if _routed(str(Path(path).resolve())) else sparse_method_from_context()


def say(line: str) -> None:
    if line:
        click.echo(line, err=True)


def open_engine(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity=None, kv_caches=2,
                interleave=None):
    """`interleave`: EngineOptions.interleave (False for a command that switches to sparse steps)."""
    from ..runtime.engine import Engine, EngineOptions

    model = resolve_model(model)
    return Engine(model, EngineOptions(cpu_workers=cpu_workers, threads=threads,
                                                      gpu_share=gpu_share, ctx=ctx, transport=transport,
                                                      sparsity=sparsity, predictor=predictor_from_context(),
                                                      sparse_method=sparse_method_for(model),
                                                      kv_caches=kv_caches, interleave=interleave,
                                                      weights=weights_from_context(),
                                                      fast=arith_from_context() == "fast",
                                                      spec=meta("sparseinfer.spec", "ngram"),
                                                      draft_model=meta("sparseinfer.draft_model", None),
                                                      **placement_from_context()))


def text_chunks(eng, corpus, part, chunks, chunk_len):
    """`chunks` windows of `chunk_len` tokens of the corpus's calibration or held-out half."""
    from ..tools import corpus as corpus_mod

    ids = eng.tokenizer.encode(corpus_mod.load(corpus, part))
    return corpus_mod.token_chunks(ids, chunk_len, chunks)
