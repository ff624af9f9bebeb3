"""What the commands refuse before anything loads: one line naming the option (`OptionError`),
exit 1. The engine's options follow EngineOptions' own rules (coordinator/runtime/engine_options.py,
the Python API's too), spelled as the command line spells them, then the model's header is
read (`check_engine_args`: fast; the engine's load is the slow part); the sampling options
become checked SamplingParams."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..runtime.engine_options import OptionError, check_range, check_values
from .engine_args import resolve_model
from .options import ENGINE_OPTION_NAMES, PENALTY_OPTIONS, explicit, meta, placement_from_context


def check_text(option: str, text: str | None) -> None:
    """Refuse an empty text and one that is not valid Unicode: bytes the terminal's encoding could
    not decode reach Python as lone surrogates, which no tokenizer can encode."""
    if text is None:
        return
    if text == "":
        raise OptionError(option, "''", "empty: give some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise OptionError(option, "(text)", f"{byte} at character {e.start} is not valid in the terminal's "
                                            f"encoding ({sys.getfilesystemencoding()}); pass UTF-8 text") from None


def check_seed(seed: int | None) -> int | None:
    """llama.cpp's convention: --seed -1 means a random seed (as no --seed does)."""
    if seed is not None and seed < -1:
        raise OptionError("--seed", seed, "choose -1 (random) or a seed >= 0")
    return None if seed == -1 else seed


def sampling_params(temperature, top_k, top_p, seed, defaults: dict | None = None):
    """SamplingParams from the options; `defaults` (chat's: the model's recommended sampling)
    replace the options the user did not give."""
    from ..runtime.sampling import SamplingParams

    d = defaults or {}
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    kw = {k: (v if explicit(k) or k not in d else d[k]) for k, v in given.items()}
    for _, key, _, _ in PENALTY_OPTIONS:
        v = meta(f"sparseinfer.{key}", None)
        if v is not None or key in d:
            kw[key] = v if v is not None else d[key]
    params = SamplingParams(seed=check_seed(seed), **kw)
    params.validate()
    return params


def check_engine_args(model, threads, cpu_workers, ctx, gpu_share=None, sparsity=None,
                      need: tuple[str, int] | None = None):
    """What an engine's options must satisfy, checked before anything heavy loads: the cores, then
    the model's header (read_config: fast; the engine's load is the slow part). Returns (model path,
    config, the context size to use): --ctx beyond the model's trained context is capped, saying so.
    `need`: (the options, tokens) a command needs in one window, which must fit the trained context
    (the command raises --ctx to it, as it always did)."""
    check_values(ENGINE_OPTION_NAMES, threads=threads, cpu_workers=cpu_workers, ctx=ctx, gpu_share=gpu_share,
                 sparsity=sparsity)
    check_range("--quality-budget", meta("sparseinfer.quality_budget", None), 0.0, None,
                "a budget cannot be negative")
    placement = placement_from_context()
    check_values(ENGINE_OPTION_NAMES, coordinator_share=placement.get("coordinator_share"),
                 vram_budget_gb=placement.get("vram_budget_gb"))
    spec, draft = meta("sparseinfer.spec", "ngram"), meta("sparseinfer.draft_model", None)
    if (spec == "draft") != (draft is not None):  # the engine refuses it too, after loading the model
        raise OptionError("--spec", spec, "--draft-model FILE goes with --spec draft, and only with it")
    if draft is not None and not Path(draft).is_file():
        raise OptionError("--draft-model", draft, "no such file")
    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf

    path = resolve_model(model)
    cfg = read_config(path, open_gguf(path))
    trained = cfg.context_length
    if ctx is not None and ctx > trained:
        if explicit("ctx"):
            click.echo(f"note: --ctx {ctx} capped at the model's trained context, {trained} tokens", err=True)
        ctx = trained
    if need is not None and need[1] > trained:
        raise ValueError(f"{need[0]}: {need[1]} tokens do not fit the model's trained context of {trained}")
    return path, cfg, ctx


def check_tokens(option: str, n: int, ctx: int, least: int = 1) -> None:
    check_range(option, n, least, None, f"generate at least {least} token{'s' if least > 1 else ''}")
    if n + 1 > ctx:  # a prompt has at least one token
        raise OptionError(option, n, f"does not fit the context of {ctx} tokens with a prompt (raise --ctx "
                                     f"up to the model's trained context, or lower {option.split('/')[-1]})")


def count_prompt_tokens(path, text: str, max_tokens: int, ctx: int) -> int | None:
    """The prompt's tokens as the engine will count them, where they might not leave room for
    `max_tokens` in `ctx`; None where they surely do, or where the tokenizer cannot be built
    (the engine then reports it). Building the tokenizer here costs its whole build before any
    worker starts (0.2-0.3 s for a 49k vocabulary: a fifth of a warm start), where the engine
    builds it while the workers load: so a prompt is tokenized here only when its UTF-8 bytes
    and a BOS, an EOS and a leading space (no token spells less than a byte) may not fit. The
    engine checks the count again (Engine.generate), whatever this says."""
    if len(text.encode("utf-8", "surrogatepass")) + 3 + max_tokens <= ctx:
        return None
    from sparsecore.gguf_file import open_gguf

    from ..text.tokenizer import GGUFTokenizer

    try:
        return len(GGUFTokenizer.from_reader(open_gguf(path)).encode(text))
    except Exception:  # noqa: BLE001 - the engine's load names the problem
        return None


def check_corpus(corpus, chunks, chunk_len) -> None:
    check_range("--chunks", chunks, 1, None, "use at least 1 window")
    check_range("--chunk-len", chunk_len, 2, None, "a window needs at least 2 tokens")
    if corpus is not None and not Path(corpus).is_file():
        raise OptionError("--corpus", corpus, "no such file")
