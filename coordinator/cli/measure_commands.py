"""The commands that report on a model and a run without changing any file but their caches:
`info` (configuration, tensor types, the memory plan, the placement under --vram-budget),
`perplexity` (quality on held-out text) and `bench` (prefill and decode speed, dense against
sparse)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..runtime.engine_options import check_values
from . import reports
from .app import main
from .engine_args import open_engine, sparse_method_for, text_chunks
from .options import (ENGINE_OPTION_NAMES, arith_from_context, corpus_options, engine_options, weights_from_context,
                      weights_option)
from .validation import check_corpus, check_engine_args, check_range


def _memory_report(path, threads, cpu_workers, ctx, parallel, vram_budget_gb=None):
    """(the memory plan an engine with these options makes, how many processes deal a routed
    model's experts (0: none)): Engine(plan_only=True), no process started, nothing loaded but
    the tensor table. `vram_budget_gb`: a routed model's, whose experts on a GPU worker's CUDA
    device leave RAM (a dense model's budget is not planned here: its plan writes the GPU index
    beside the model)."""
    from ..runtime.engine import Engine, EngineOptions
    from ..runtime.sparsity_level import choose

    # generate's and serve's default level, where the model is calibrated: its twins count
    level = choose(Path(path), "input", say=False)[0] if weights_from_context() == "gguf" else None
    opts = EngineOptions(threads=threads, cpu_workers=cpu_workers, ctx=ctx, weights=weights_from_context(),
                         kv_caches=parallel + 1 if parallel else 2, sparsity=level, vram_budget_gb=vram_budget_gb)
    eng = Engine(path, opts, plan_only=True)
    return eng.memory, len(eng.dealt)


def _expert_plan_report(path, cfg, vram_budget_gb) -> dict:
    """A routed model's placement: its most-routed experts, whole, by its profile, sized as the
    engine sizes them on the GPU worker (float16 copies on CUDA, the file's blocks on the CPU):
    the experts `generate --vram-budget` places (coordinator/runtime/placement.py)."""
    from sparsecore.gguf_file import open_gguf
    from sparsecore.tensors import TensorStore

    from ..runtime.engine_build import cuda_available
    from ..runtime.placement import experts_under_budget

    cuda = cuda_available()
    placed = experts_under_budget(path, TensorStore(path, open_gguf(path)), cfg, vram_budget_gb,
                                  weights_from_context(), cuda)
    return {**placed, "device": "cuda" if cuda else "cpu", "experts": [e.tolist() for e in placed["experts"]]}


def _plan_report(path, cfg, vram_budget_gb, threads, cpu_workers) -> dict:
    if cfg.routed:
        return _expert_plan_report(path, cfg, vram_budget_gb)
    import torch

    from ..runtime.placement import GIB, neuron_bytes, plan_summary, plan_under_budget, resolve_threads

    _, n_cpu, _ = resolve_threads(threads, cpu_workers, torch.cuda.is_available())
    weights = weights_from_context()
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
@weights_option
def info(model, as_json, vram_budget_gb, threads, cpu_workers, ctx, parallel):
    """Print the model's configuration and tensor types, the memory plan (what each kind of
    memory a run holds, against what is available), and the placement for --vram-budget."""
    from collections import Counter

    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf

    # the plan's context, as given (not capped at the trained one); the budget as generate checks it
    check_values(ENGINE_OPTION_NAMES, ctx=ctx, vram_budget_gb=vram_budget_gb)
    path, _, _ = check_engine_args(model, threads, cpu_workers, None)
    reader = open_gguf(path)
    cfg = read_config(path, reader)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    memory, dealers = _memory_report(path, threads, cpu_workers, ctx, parallel, vram_budget_gb if cfg.routed else None)
    plan = None if vram_budget_gb is None else _plan_report(path, cfg, vram_budget_gb, threads, cpu_workers)
    if as_json:
        click.echo(reports.info_json(cfg, types, memory, plan, dealers))
        return
    lines = reports.info_lines(cfg, types, memory, ctx, parallel, dealers)
    if plan is not None:
        lines += (reports.expert_placement_lines if cfg.routed else reports.placement_lines)(plan, vram_budget_gb)
    for line in lines:
        click.echo(line)


@main.command()
@engine_options
@corpus_options
def perplexity(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len):
    """Perplexity on held-out text, dense or with --sparsity (applied to every token)."""
    check_corpus(corpus, chunks, chunk_len)
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                     need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..tools.observe import predictors
    from ..tools.perplexity import perplexity as run_perplexity

    with open_engine(path, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport, sparsity) as eng:
        data = text_chunks(eng, corpus, "heldout", chunks, chunk_len)
        with tqdm(total=len(data), desc="perplexity", unit="chunk") as bar:
            r = run_perplexity(eng, data, bar.update)
        pred = predictors(eng)
    click.echo(reports.perplexity_line(r, sparsity, pred, weights_from_context(), arith_from_context(), len(data),
                                       chunk_len))


@main.command()
@engine_options
@click.option("-p", "--n-prompt", "pp", type=int, default=128, show_default=True, help="prompt tokens (ppN)")
@click.option("-n", "--n-gen", "tg", type=int, default=64, show_default=True, help="generated tokens (tgN)")
@click.option("-r", "--reps", type=int, default=3, show_default=True, help="timed runs of each mode (medians)")
@click.option("--warmup", type=int, default=1, show_default=True, help="untimed runs of each mode first")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
def bench(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, pp, tg, reps, warmup, as_json):
    """Prefill and decode speed, dense vs sparse, with sync latency and weight bytes per token.

    Sparse means the model's predictors (or --predictor) when there are any, else calibrated
    thresholds at --sparsity (default 0.2, calibrated first if needed) by --sparse-method."""
    check_range("-p/--n-prompt", pp, 1, None, "the prompt needs at least 1 token")
    check_range("-n/--n-gen", tg, 2, None, "decode at least 2 tokens (the first one is prefill's)")
    check_range("-r/--reps", reps, 1, None, "time at least 1 run")
    check_range("--warmup", warmup, 0, None, "cannot be negative")
    model, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                      need=(f"-p {pp} + -n {tg} + 1", pp + tg + 1))
    from ..runtime.model_files import (level_key, load_input_thresholds, load_thresholds, save_thresholds,
                                       thresholds_path)
    from ..tools import bench as b
    from ..tools.calibrate import DEFAULT_LEVELS, calibrate as run_calibration
    from ..tools.observe import predictors
    from ..tools.profile import DEFAULT_SPARSITY

    # dense and sparse decoding on one engine: the file's row layout (EngineOptions.interleave),
    # started at the sparse level where it is one (input sparsity's twins are made at load)
    n_ctx = max(ctx, pp + tg + 1)
    s = DEFAULT_SPARSITY if sparsity is None else sparsity
    level = None
    with open_engine(model, threads, cpu_workers, gpu_share, n_ctx, transport, interleave=False) as eng:
        if predictors(eng) is None:
            level = s
            try:
                load_thresholds(eng.path, s)
                if sparse_method_for(eng.path) == "input":  # a routed model: CATS
                    load_input_thresholds(eng.path, s)
            except ValueError:  # not calibrated yet: do it now, as `sparseinfer calibrate` would
                click.echo(f"no thresholds for sparsity {level_key(s)} in {thresholds_path(eng.path)}: "
                           f"calibrating first", err=True)
                data = text_chunks(eng, None, "calibration", 16, 256)
                save_thresholds(eng.path, run_calibration(eng, data, sorted(set(DEFAULT_LEVELS) | {s})))
        else:
            res, info = _bench_modes(eng, b, pp, tg, reps, warmup, as_json,
                                     [b.Mode("dense"), b.Mode("predictor", predictors=predictors(eng))])
    if level is not None:
        with open_engine(model, threads, cpu_workers, gpu_share, n_ctx, transport, level, interleave=False) as eng:
            res, info = _bench_modes(eng, b, pp, tg, reps, warmup, as_json,
                                     [b.Mode("dense"), b.Mode(f"sparse {level_key(level)}", sparsity=level)])
    bw = b.read_bandwidth_gbs(info["threads"] or os.cpu_count() or 1)
    summary = dict(**info, read_bandwidth_gb_s=bw, results=res, ratios_vs_dense=b.ratios(res, "dense"))
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    for line in reports.bench_lines(summary, b.format_table(res, info["pp"], tg), reps):
        click.echo(line)


def _bench_modes(eng, b, pp, tg, reps, warmup, as_json, modes):
    from tqdm import tqdm

    from ..tools import corpus as corpus_mod
    from ..tools.observe import worker_layout

    prompt = eng.tokenizer.encode(corpus_mod.load(None, "heldout"))[:pp]
    with tqdm(total=reps * len(modes), desc="bench", unit="run", disable=as_json, leave=False) as bar:
        res = b.bench(eng, prompt, tg, modes, reps, warmup, bar.update)
    return res, dict(model=str(eng.path), n_layers=eng.cfg.n_layers, **worker_layout(eng), pp=len(prompt), tg=tg,
                     reps=reps, decode_path=eng.decode_plan.describe())
