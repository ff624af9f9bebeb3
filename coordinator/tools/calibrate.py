"""Sparsity without training: per-layer magnitude thresholds, two ways, from one dense run.

- Input sparsity (TEAL, arXiv 2408.14690), the default: a one-token product skips the inputs of
  a matrix whose |value| is at or below its threshold, so their input-major columns are never
  read (sparsecore/input_sparsity.py). One threshold per layer for each group of matrices that
  share an input (protocol.shm_layout.INPUT_SITES): Q/K/V on the normed residual, O on the
  attention output, gate/up on the FFN's normed input, down on its hidden activation h.
- CATS (arXiv 2404.08763): an FFN neuron is skipped when |act(gate x)| is below its layer's
  threshold, so its up row and down column are never read; gate is read in full to decide. A
  routed (mixture-of-experts) model's experts take CATS only, with a threshold per layer and
  expert (`expert_levels`): each expert's gate activations have their own scale, so one layer
  threshold would leave some experts nearly dense and others nearly empty.

Calibration runs the dense model over calibration text and sets each threshold at the quantile
of the magnitudes equal to the target sparsity. Thresholds for a grid of sparsities are stored
beside the model in `<model>.thresholds.json` (coordinator.runtime.model_files), so any of them can be
chosen at run time; `quality` adds the held-out perplexity of each (coordinator/tools/perplexity.py).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from protocol.shm_layout import INPUT_SITES

from ..runtime.model_files import THRESHOLDS_FORMAT, level_key
from . import observe

DEFAULT_LEVELS = tuple(round(0.1 * i, 2) for i in range(1, 10))
# Token rows kept per layer for the input sites' quantiles (a seeded sample of every chunk's):
# each row gives `hidden` (or n_ff) magnitudes, so 1024 rows pin a quantile well, and the rows
# of a 1.1B model's four sites stay a few hundred MB.
SAMPLE_ROWS = 1024
# An expert chosen for fewer calibration tokens than this takes its layer's threshold: a quantile
# of a handful of tokens' activations is noise (each row gives n_ff magnitudes, but of one token).
MIN_EXPERT_ROWS = 16


class _RowSample:
    """Up to `rows` token rows per layer, the same tokens for every site of a layer, chosen
    uniformly (seeded) from the chunks as they come: each chunk keeps its share."""

    def __init__(self, n_layers: int, per_chunk: int):
        self.per_chunk = per_chunk
        self.rows: dict[tuple[int, str], list[np.ndarray]] = {}
        self.pick: dict[int, np.ndarray] = {}  # layer -> this chunk's rows (set by the first site)
        self.rng = np.random.default_rng(0)

    def take(self, layer: int, site: str, a: np.ndarray, first: bool) -> None:
        if first or layer not in self.pick or self.pick[layer].max(initial=-1) >= len(a):
            n = min(self.per_chunk, len(a))
            self.pick[layer] = np.sort(self.rng.choice(len(a), n, replace=False))
        self.rows.setdefault((layer, site), []).append(np.ascontiguousarray(a[self.pick[layer]]))

    def get(self, layer: int, site: str) -> np.ndarray | None:
        got = self.rows.pop((layer, site), None)
        return None if not got else np.concatenate(got)


def calibrate(engine, chunks: list[list[int]], levels=DEFAULT_LEVELS) -> dict:
    """Thresholds per level and layer from the dense model's activations on `chunks`: CATS's
    (`levels`) and input sparsity's (`input_levels`: per layer, one per INPUT_SITES)."""
    cfg = observe.config(engine)
    path = observe.model_path(engine)
    inputs: dict[int, list[np.ndarray]] = {i: [] for i in range(cfg.n_layers)}
    routed_by: dict[int, list[np.ndarray]] = {i: [] for i in range(cfg.n_layers)}  # the routers' inputs where not x
    sample = _RowSample(cfg.n_layers, max(1, SAMPLE_ROWS // max(1, len(chunks))))  # chunks: a list or tqdm over one

    def on_ffn(layer, x, pre_norm=None, router_in=None):
        inputs[layer].append(x.copy())
        if router_in is not None:  # smallthinker: its router scores the layer's input
            routed_by[layer].append(router_in.copy())
        sample.take(layer, "ffn_in", x, first=False)

    def on_attention(layer, x, out):
        sample.take(layer, "attn_in", x, first=True)
        sample.take(layer, "attn_out", out, first=False)

    heads: list[np.ndarray] = []
    per_chunk = sample.per_chunk

    def on_head(h):
        heads.append(h[sample.rng.choice(len(h), min(per_chunk, len(h)), replace=False)].copy())

    t0 = time.perf_counter()
    n_tokens = observe.dense_run(engine, chunks, on_ffn, attention_observer=on_attention, head_observer=on_head)
    if cfg.routed:
        return {**_header(path, cfg, n_tokens, t0), **_expert_levels(engine, inputs, levels, routed_by)}
    gates = observe.GateActivity(engine)
    table = {level_key(s): [] for s in levels}
    input_table = {level_key(s): [] for s in levels}
    for layer in range(cfg.n_layers):
        xs = np.concatenate(inputs.pop(layer))
        mags = gates(layer, xs)
        for s, q in zip(levels, observe.magnitude_quantiles(mags, levels).tolist()):
            table[level_key(s)].append(q)
        del mags
        per_site = []
        for site in INPUT_SITES:
            if site == "ffn_h":
                vals = gates.hidden(layer, sample.get(layer, "ffn_in"))
            else:
                got = sample.get(layer, site) if site != "ffn_in" else None
                vals = torch.from_numpy(got if got is not None else xs)
            per_site.append(observe.magnitude_quantiles(vals.abs(), levels).tolist())
        for k, s in enumerate(levels):
            input_table[level_key(s)].append([site[k] for site in per_site])
    head_q = observe.magnitude_quantiles(torch.from_numpy(np.concatenate(heads)).abs(), levels).tolist()
    return {
        **_header(path, cfg, n_tokens, t0),
        "levels": table,
        "sites": list(INPUT_SITES),
        "input_levels": input_table,
        "head_levels": {level_key(s): q for s, q in zip(levels, head_q)},
    }


def _header(path, cfg, n_tokens: int, t0: float) -> dict:
    return {"format": THRESHOLDS_FORMAT, "model": path.name, "model_bytes": path.stat().st_size,
            "activation": cfg.activation, "tokens": n_tokens, "seconds": round(time.perf_counter() - t0, 1)}


def _expert_levels(engine, inputs: dict[int, list[np.ndarray]], levels,
                   routed_by: dict[int, list[np.ndarray]] | None = None) -> dict:
    """A routed model's CATS thresholds: per level, the layer's (the quantile over every (token,
    chosen expert) pair's magnitudes) and each expert's (over the tokens routed to it, the layer's
    where fewer than MIN_EXPERT_ROWS were). routed_by: per layer the routers' inputs where they
    are not the FFN's (smallthinker's layer inputs), else empty."""
    acts = observe.ExpertActivity(engine)
    table = {level_key(s): [] for s in levels}
    experts = {level_key(s): [] for s in levels}
    for layer in range(len(inputs)):
        xs = np.concatenate(inputs.pop(layer))
        scored = routed_by.pop(layer, None) if routed_by else None
        ids = acts.route(layer, np.concatenate(scored) if scored else xs)
        per_expert: dict[int, list[float]] = {}
        mags = []
        for e in range(acts.n_experts):
            rows = np.flatnonzero((ids == e).any(axis=1))
            if not len(rows):
                continue
            m = acts(layer, e, xs[rows])
            if len(rows) >= MIN_EXPERT_ROWS:
                per_expert[e] = observe.magnitude_quantiles(m, levels).tolist()
            mags.append(m.flatten())
        pooled = observe.magnitude_quantiles(torch.cat(mags), levels).tolist()
        for k, s in enumerate(levels):
            table[level_key(s)].append(pooled[k])
            experts[level_key(s)].append([per_expert[e][k] if e in per_expert else pooled[k]
                                          for e in range(acts.n_experts)])
    return {"levels": table, "expert_levels": experts}


def quality(engine, chunks: list[list[int]], table: dict, progress=None) -> dict:
    """Held-out perplexity of the dense model and of input sparsity at each calibrated level of
    `table` (calibrate's), emulated over whole prompts (coordinator/tools/emulate.py), with the
    fraction of inputs each level reads: what the engine's default level is chosen from
    (coordinator/runtime/sparsity_level.py). `progress(1)` after each level."""
    from .emulate import input_sparsity
    from .perplexity import perplexity

    cfg = observe.config(engine)
    dense = [[-1.0] * len(INPUT_SITES)] * cfg.n_layers
    with input_sparsity(engine, dense):  # the same float arithmetic as the levels'
        base = perplexity(engine, chunks)
    if progress:
        progress(1)
    levels = {}
    for key in sorted(table["input_levels"]):
        with input_sparsity(engine, table["input_levels"][key], table.get("head_levels", {}).get(key)) as masks:
            r = perplexity(engine, chunks)
        kept = masks.kept_fraction().mean(axis=0)
        levels[key] = {"ppl": round(r["ppl"], 4), "kept": {s: round(float(k), 4) for s, k in zip(INPUT_SITES, kept)}}
        levels[key]["kept"]["head_in"] = round(masks.head_kept(), 4)
        if progress:
            progress(1)
    return {"method": "input", "tokens": base["tokens"], "dense": round(base["ppl"], 4), "levels": levels}


def cats_quality(engine, chunks: list[list[int]], keys: list[str], progress=None) -> dict:
    """Held-out perplexity of the dense model and of CATS at each level `keys` of the thresholds
    file, by the engine's own steps (every token of a prompt thresholded as decoding does it:
    coordinator/tools/perplexity.py), with the fraction of neurons computed: a routed model's
    quality, its experts taking CATS only. The engine must have been started with a level (rows
    laid out for threshold steps); its level is restored. `progress(1)` after each level."""
    from .perplexity import perplexity

    old = engine.sparsity
    try:
        observe.set_sparsity_source(engine, None)
        base = perplexity(engine, chunks)
        if progress:
            progress(1)
        levels = {}
        for key in sorted(keys, key=float):
            observe.set_sparsity_source(engine, float(key))
            r = perplexity(engine, chunks)
            levels[key] = {"ppl": round(r["ppl"], 4), "active": round(float(r["active_fraction"]), 4)}
            if progress:
                progress(1)
    finally:
        observe.set_sparsity_source(engine, old)
    return {"method": "cats", "tokens": base["tokens"], "dense": round(base["ppl"], 4), "levels": levels}
