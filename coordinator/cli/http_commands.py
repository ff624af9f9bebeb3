"""The commands of the HTTP API: `serve` (the OpenAI-compatible server, coordinator/serve/) and
`prompt`, a small client of it (http_client.py)."""
from __future__ import annotations

import click

from .app import fail, main
from .engine_args import decode_sparsity, open_engine, say
from .options import PENALTY_OPTIONS, engine_options, meta, sampling_options
from .validation import check_engine_args, check_range, check_seed, check_text


@main.command()
@engine_options
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
@click.option("--reasoning-format", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="a reasoning model's thinking: apart, as reasoning_content (auto), or left in content (none)")
@click.option("--reasoning-budget", type=int, default=-1, show_default=True,
              help="tokens a reply may think before its thinking is closed (-1: no bound, 0: no thinking)")
def serve(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, host, port, api_key, parallel, queue,
          ready_file, no_api_key, header_timeout, body_timeout, shutdown_grace, on_worker_death, reasoning_format,
          reasoning_budget):
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
    if reasoning_budget < -1:
        raise click.BadParameter(f"{reasoning_budget}: choose -1 (no bound) or a number of tokens",
                                 param_hint="--reasoning-budget")
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("an empty key would refuse every request: give one, or none", param_hint="--api-key")
    if api_key is None and not no_api_key and host not in ("127.0.0.1", "localhost", "::1"):
        raise click.BadParameter(f"{host} is reachable from other machines: give a key ($SPARSEINFER_API_KEY keeps it "
                                 f"out of the process list), or --no-api-key to serve anyone", param_hint="--host")
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity)
    sparsity, line = decode_sparsity(path, sparsity)
    from ..serve.server import serve as serve_http  # after the checks: it imports the engine (torch)
    from ..serve.thinking import ReasoningDefaults

    # a shared KV cache for each slot (and the engine's own): every slot's attention splits
    opts = dict(threads=threads, cpu_workers=cpu_workers, gpu_share=gpu_share, ctx=ctx, transport=transport,
                sparsity=sparsity, kv_caches=parallel + 1)
    click_ctx = click.get_current_context()

    def load():  # on the loader thread: the click context is this thread's, so pass it along
        with click_ctx:
            eng = open_engine(path, **opts)
            say(line)
            return eng
    try:
        serve_http(load, path, host, port, api_key, parallel, queue, ready_file, header_timeout, shutdown_grace,
                   on_worker_death, body_timeout=body_timeout,
                   reasoning=ReasoningDefaults(reasoning_format, reasoning_budget))
    except OSError as e:
        fail(str(e))


@main.command()
@sampling_options
@click.option("-p", "--prompt", required=True, help="prompt text")
@click.option("--url", default=None, envvar="SPARSEINFER_URL",
              help="server URL (default: http://127.0.0.1:8080, or $SPARSEINFER_URL)")
@click.option("--api-key", default=None, envvar="SPARSEINFER_API_KEY", help="the server's API key")
@click.option("--system", default=None, help="with --chat: a system prompt")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds to wait for the reply")
def prompt(max_tokens, temperature, top_k, top_p, seed, chat, ignore_eos, prompt, url, api_key, system, timeout):
    """Send PROMPT to a running `sparseinfer serve` and stream its reply."""
    from .http_client import DEFAULT_URL, ClientError, chunk_text, stream_completion

    check_text("-p/--prompt", prompt)
    check_text("--system", system)
    check_range("-n/--max-tokens", max_tokens, 1, None, "generate at least 1 token")
    seed = check_seed(seed)
    url = url or DEFAULT_URL
    body = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                ignore_eos=ignore_eos)
    for _, key, _, _ in PENALTY_OPTIONS:
        if meta(f"sparseinfer.{key}", None) is not None:
            body[key] = meta(f"sparseinfer.{key}", None)
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
        fail(str(e))
    click.echo()
