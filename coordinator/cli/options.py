"""The options commands share, as click decorators (`engine_options`, `sampling_options`,
`corpus_options`, and the single options some commands take alone), and the readers of the
options that reach the engine through the click context rather than as parameters."""
from __future__ import annotations

import click

from protocol.messages import WEIGHT_FORMATS


def _apply(f, opts):
    for o in reversed(opts):
        f = o(f)
    return f


def engine_options(f):
    """Options every command that starts an engine takes."""
    return _apply(f, [
        click.option("-m", "--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1, pulled on first use)"),
        click.option("-t", "--threads", type=int, default=None, help="cores to use in all (default: all)"),
        click.option("--cpu-workers", type=int, default=None, help="CPU worker processes (default: cores - 1, with CUDA cores - 2; at least 1)"),
        click.option("--gpu-share", type=float, default=None,
                     help="fraction of each layer's neurons on the GPU worker (default: 0.5 with CUDA, else 0)"),
        click.option("--ctx", type=int, default=2048, show_default=True, help="context size (KV cache length)"),
        click.option("--transport", type=click.Choice(["ipc", "tcp"]), default="ipc", show_default=True,
                     help="ZeroMQ transport between coordinator and workers"),
        click.option("--sparsity", type=float, default=None,
                     help="skip this fraction of each matrix's inputs per decoded token (calibrated thresholds; "
                          "see `calibrate`); 0: dense. generate, chat and serve default to the calibrated level "
                          "within --quality-budget"),
    ] + placement_options + [predictor_option, weights_option, arith_option, sparse_method_option,
                             quality_budget_option, spec_option, draft_model_option])


def sampling_options(f):
    return _apply(f, [
        click.option("-n", "--max-tokens", type=int, default=128, show_default=True, help="tokens to generate"),
        click.option("--temperature", "--temp", type=float, default=0.0, show_default=True, help="0 = greedy"),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off"),
        click.option("--seed", type=int, default=None, help="random seed for sampling"),
        click.option("--chat/--raw", default=False, show_default=True,
                     help="wrap the prompt in the model's chat template as a user message"),
        click.option("--ignore-eos", is_flag=True, help="keep generating past the end-of-sequence token"),
    ] + [click.option(name, type=kind, default=None, expose_value=False, callback=remember(f"sparseinfer.{key}"),
                      help=why) for name, key, kind, why in PENALTY_OPTIONS])


# Sampling options beyond the four every command spells out: (option, SamplingParams field, type, help)
PENALTY_OPTIONS = [
    ("--min-p", "min_p", float, "drop tokens below this fraction of the likeliest one's probability (0 = off)"),
    ("--repeat-penalty", "repeat_penalty", float, "divide the logits of recent tokens by this (1 = off)"),
    ("--presence-penalty", "presence_penalty", float, "subtract this from the logits of recent tokens (0 = off)"),
    ("--frequency-penalty", "frequency_penalty", float, "subtract this per occurrence of a recent token (0 = off)"),
    ("--repeat-last-n", "repeat_last_n", int, "how many recent tokens the penalties look at (default 64)"),
]


def corpus_options(f):
    return _apply(f, [
        click.option("--corpus", default=None,
                     help="UTF-8 text file (default: Python's pydoc_data.topics); split in halves, "
                          "the first calibrates, the second is held out"),
        click.option("--chunks", type=int, default=16, show_default=True, help="windows of text to use"),
        click.option("--chunk-len", type=int, default=256, show_default=True, help="tokens per window"),
    ])


def remember(key):
    """A click callback that keeps an option's value in the context's meta under `key` (options
    with expose_value=False, read where the engine is opened)."""
    def callback(ctx, param, value):
        ctx.meta[key] = value
        return value
    return callback


def _remember_placement(ctx, param, value):
    ctx.meta.setdefault("sparseinfer.placement", {})[param.name] = value
    return value


# Placement options reach open_engine through the click context rather than as parameters,
# so that adding them did not change the signature of every command.
placement_options = [
    click.option("--vram-budget", "vram_budget_gb", type=float, default=None, expose_value=False,
                 callback=_remember_placement,
                 help="GiB of FFN weights on the GPU worker: hot neurons chosen from `sparseinfer profile` "
                      "(overrides --gpu-share)"),
    click.option("--reset-gpu-index", is_flag=True, expose_value=False, callback=_remember_placement,
                 help="with --vram-budget: rebuild <model>.generated.gpuidx even if it matches"),
    click.option("--disable-gpu-index", is_flag=True, expose_value=False, callback=_remember_placement,
                 help="with --vram-budget: neither read nor write <model>.generated.gpuidx"),
    click.option("--layout-cache", "layout_cache", default=None, expose_value=False, callback=_remember_placement,
                 help="directory keeping the repacked weight layouts between runs (a warm start repacks "
                      "nothing; what does not fit in memory is mapped from it), or `off` "
                      "(default: $SPARSEINFER_LAYOUT_CACHE, else the cache's layouts/)"),
    click.option("--coordinator-share", type=float, default=None, expose_value=False, callback=_remember_placement,
                 help="fraction of the CPU side's FFN neurons the coordinator computes itself while the "
                      "workers compute theirs (default: its core's share without CUDA or --vram-budget, else 0)"),
]


# Passed like the placement options, through the click context.
predictor_option = click.option(
    "--predictor", default=None, metavar="FILE", expose_value=False, callback=remember("sparseinfer.predictor"),
    help="activation predictor GGUF (default: the model's own fc1/fc2, if any; 'none': off)")


# Passed like the placement options, through the click context.
weights_option = click.option(
    "--weights", type=click.Choice(list(WEIGHT_FORMATS)), default="gguf", show_default=True, expose_value=False,
    callback=remember("sparseinfer.weights"),
    help="how processes keep weights in memory: float32 (exact), int8 with one scale per neuron row "
         "(a quarter of the memory), float16 (half the bytes read per token), or gguf: the file's "
         "own blocks, memory-mapped, computed on by the native kernels (no copy; see docs/KERNELS.md)")


# Passed like the placement options, through the click context.
# The default is fast (llama.cpp's arithmetic; SmolLM2's held-out perplexity +0.24 %, README);
# exact is for token-for-token comparisons with transformers. Other --weights ignore it.
DEFAULT_ARITH = "fast"
arith_option = click.option(
    "--arith", type=click.Choice(["exact", "fast"]), default=DEFAULT_ARITH, show_default=True, expose_value=False,
    callback=remember("sparseinfer.arith"),
    help="with --weights gguf: fast (activations quantized to 8 bits per block of 32, as llama.cpp) or "
         "exact (float32 activations times the dequantized blocks: what transformers computes, token for "
         "token); other --weights ignore it")


sparse_method_option = click.option(
    "--sparse-method", type=click.Choice(["input", "cats"]), default="input", show_default=True, expose_value=False,
    callback=remember("sparseinfer.sparse_method"),
    help="how a sparsity level skips weights: input (every matrix skips its small inputs' columns) or cats "
         "(FFN neurons with small gate activations)")
quality_budget_option = click.option(
    "--quality-budget", type=float, default=0.02, show_default=True, expose_value=False,
    callback=remember("sparseinfer.quality_budget"),
    help="the default sparsity level is the highest whose held-out perplexity stays within this fraction "
         "over dense (calibrated levels)")


# Passed like the placement options, through the click context.
spec_option = click.option(
    "--spec", type=click.Choice(["off", "ngram", "draft"]), default="ngram", show_default=True, expose_value=False,
    callback=remember("sparseinfer.spec"),
    help="speculative decoding: ngram (drafts from the text's own earlier tokens, taken where they measure "
         "faster), draft (a smaller model of the same vocabulary drafts: --draft-model) or off")
draft_model_option = click.option(
    "--draft-model", default=None, metavar="FILE", expose_value=False, callback=remember("sparseinfer.draft_model"),
    help="with --spec draft: the GGUF that drafts (the same vocabulary as the model)")


# How the command line spells the EngineOptions fields it checks (EngineOptions' rules name
# the option so in the one line that refuses it).
ENGINE_OPTION_NAMES = {"threads": "-t/--threads", "cpu_workers": "--cpu-workers", "ctx": "--ctx",
                       "gpu_share": "--gpu-share", "sparsity": "--sparsity", "vram_budget_gb": "--vram-budget",
                       "coordinator_share": "--coordinator-share", "spec": "--spec", "draft_model": "--draft-model"}


# ---- what the context holds -------------------------------------------------------------------

def meta(key, default):
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(key, default) if ctx is not None else default


def weights_from_context() -> str:
    return meta("sparseinfer.weights", "gguf")


def arith_from_context() -> str:
    return meta("sparseinfer.arith", DEFAULT_ARITH)


def predictor_from_context() -> str | None:
    return meta("sparseinfer.predictor", None)


def sparse_method_from_context() -> str:
    return meta("sparseinfer.sparse_method", "input")


def placement_from_context() -> dict:
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get("sparseinfer.placement", {})) if ctx is not None else {}


def explicit(name: str) -> bool:
    """Whether the user gave this parameter (rather than its default)."""
    from click.core import ParameterSource

    c = click.get_current_context(silent=True)
    return c is not None and c.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
