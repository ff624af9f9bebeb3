"""The commands that make a model's sparsity files: `calibrate` (thresholds per level, their
held-out perplexity and decode speed here), `profile` (how often each neuron fires, for
--vram-budget) and `train-predictor` (low-rank predictors of the active neurons)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from . import reports
from .app import main
from .engine_args import open_engine, sparse_method_for, text_chunks
from .options import arith_from_context, arith_option, corpus_options, engine_options, weights_from_context
from .validation import OptionError, check_corpus, check_engine_args, check_range


@main.command()
@engine_options
@corpus_options
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
    check_corpus(corpus, chunks, chunk_len)
    path, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                     need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..runtime.model_files import level_key, save_thresholds
    from ..tools.calibrate import DEFAULT_LEVELS, calibrate as run_calibration, cats_quality, quality as run_quality

    grid = sorted(set(given) if given else set(DEFAULT_LEVELS))
    if sparsity is not None:
        grid = sorted(set(grid) | {sparsity})
    check_range("--quality-chunks", quality_chunks, 0, None, "cannot be negative")
    with open_engine(path, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport) as eng:
        data = text_chunks(eng, corpus, "calibration", chunks, chunk_len)
        table = run_calibration(eng, tqdm(data, desc="calibrating", unit="chunk"), grid)
        routed = "expert_levels" in table  # experts take CATS, measured on an engine at a level
        if quality_chunks and not routed:
            held = text_chunks(eng, corpus, "heldout", quality_chunks, chunk_len)
            with tqdm(total=len(grid) + 1, desc="held-out perplexity", unit="level") as bar:
                table["quality"] = run_quality(eng, held, table, bar.update)
        model_path, path = eng.path, save_thresholds(eng.path, table)
    if quality_chunks and routed:
        with open_engine(model_path, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport, grid[-1],
                         interleave=False) as eng:
            held = text_chunks(eng, corpus, "heldout", quality_chunks, chunk_len)
            with tqdm(total=len(grid) + 1, desc="held-out perplexity", unit="level") as bar:
                table["quality"] = cats_quality(eng, held, [level_key(s) for s in grid], bar.update)
        path = save_thresholds(model_path, table)
    for line in reports.calibration_lines(path, table):
        click.echo(line)
    if speed_check and arith_from_context() == "fast" and weights_from_context() == "gguf":
        _speed_check(model_path, threads, cpu_workers, gpu_share, transport, corpus)


def _speed_check(model_path, threads, cpu_workers, gpu_share, transport, corpus) -> None:
    """Decode speed at every stored level against dense, on an engine holding the twins
    (coordinator/tools/speed_check.py), written into the thresholds file beside the levels."""
    from tqdm import tqdm

    from ..runtime.model_files import calibration, level_keys, save_speed
    from ..tools import corpus as corpus_mod, speed_check

    levels = [float(k) for k in level_keys(calibration(model_path), sparse_method_for(model_path))]
    if not levels:
        return
    reps = 3
    with open_engine(model_path, threads, cpu_workers, gpu_share, 256, transport, levels[-1], interleave=False) as eng:
        prompt = eng.tokenizer.encode(corpus_mod.load(corpus, "heldout"))[:16]
        try:
            with tqdm(total=reps * (len(levels) + 1), desc="decode speed", unit="run") as bar:
                sp = speed_check.measure(eng, levels, prompt, reps=reps, progress=bar.update)
        except ValueError as e:  # e.g. the twins did not fit in memory: this engine decodes densely
            click.echo(f"note: no decode speed check: {e}", err=True)
            return
    save_speed(model_path, sp)
    click.echo(reports.speed_line(sp))


@main.command()
@engine_options
@corpus_options
@click.option("-o", "--out-dir", default=None,
              help="directory for <model>.profile.npz and .png (default: beside the model, where "
                   "--vram-budget looks)")
@click.option("--powerinfer-activations", default=None,
              help="convert PowerInfer's activation directory (activation_N.pt) instead of running the model")
def profile(model, threads, cpu_workers, gpu_share, ctx, transport, sparsity, corpus, chunks, chunk_len, out_dir,
            powerinfer_activations):
    """Measure how often each FFN neuron is active on calibration text (for --vram-budget)."""
    if not powerinfer_activations:
        check_corpus(corpus, chunks, chunk_len)
    model, _, ctx = check_engine_args(model, threads, cpu_workers, ctx, gpu_share, sparsity,
                                      need=None if powerinfer_activations else (f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..runtime import model_files
    from ..tools import profile as profiling

    path = Path(model)
    if powerinfer_activations:
        from sparsecore.config import read_config
        from sparsecore.gguf_file import open_gguf

        prof = profiling.profile_from_powerinfer(Path(powerinfer_activations), path,
                                                 read_config(path, open_gguf(path)))
    else:
        s = profiling.DEFAULT_SPARSITY if sparsity is None else sparsity
        with open_engine(model, threads, cpu_workers, gpu_share, max(ctx, chunk_len), transport) as eng:
            thresholds = None
            if eng.cfg.activation != "relu":
                try:
                    thresholds = model_files.load_thresholds(eng.path, s)
                except ValueError as e:
                    click.echo(f"note: {e}\nnote: using per-layer quantiles of |act(gate x)| on this text instead",
                               err=True)
            data = text_chunks(eng, corpus, "calibration", chunks, chunk_len)
            prof = profiling.collect(eng, tqdm(data, desc="profiling", unit="chunk"), s, thresholds)
    npz = model_files.save_profile(prof, model_files.profile_path(path, Path(out_dir) if out_dir else None))
    png = profiling.plot_profile(prof, model_files.plot_path(npz))
    for line in profiling.summary_lines(prof):
        click.echo(line)
    click.echo(reports.profile_written(prof, npz, png))


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
@arith_option
def train_predictor(model, sparsity, rank, recall, corpus, chunks, heldout_chunks, chunk_len, epochs, seed, dtype,
                    threads, output):
    """Train low-rank activation predictors per layer (PowerInfer-style fc1/fc2) on calibration text."""
    check_corpus(corpus, chunks, chunk_len)
    check_range("--heldout-chunks", heldout_chunks, 1, None, "evaluate on at least 1 window")
    check_range("--rank", rank, 1, None, "a predictor needs rank >= 1")
    check_range("--epochs", epochs, 1, None, "train at least 1 epoch")
    if not 0.0 < recall <= 1.0:
        raise OptionError("--recall", recall, "choose a fraction in (0, 1]")
    if not 0.0 < sparsity < 1.0:
        raise OptionError("--sparsity", sparsity, "choose a fraction in (0, 1)")
    check_range("--seed", seed, 0, None, "choose a seed >= 0")
    model, _, _ = check_engine_args(model, threads, None, None, need=(f"--chunk-len {chunk_len}", chunk_len))
    from tqdm import tqdm

    from ..runtime.model_files import load_thresholds, predictor_path, save_predictor
    from ..tools import train_predictor as pt

    t0 = time.perf_counter()
    with open_engine(model, threads, None, None, chunk_len, "ipc") as eng:
        relu = eng.cfg.activation == "relu"
        thr = None if relu else load_thresholds(eng.path, sparsity)
        calib = text_chunks(eng, corpus, "calibration", chunks, chunk_len)
        held = text_chunks(eng, corpus, "heldout", heldout_chunks, chunk_len)
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
    for line in reports.predictor_lines(p, out, rank, dtype, relu, sparsity, t1 - t0, t2 - t1):
        click.echo(line)
