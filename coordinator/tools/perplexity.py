"""`sparseinfer perplexity`: how well the model predicts held-out text, dense or sparse.

The engine's sparsity (thresholds or predictors) is applied to every token of every chunk, as
decoding would apply it one token at a time, so the number measures the sparse model that
generates, not a dense prefill.
"""
from __future__ import annotations

import numpy as np
import torch

from . import observe


def perplexity(engine, chunks: list[list[int]], progress=None) -> dict:
    """Perplexity of next-token prediction over `chunks` (lists of token ids, each from a fresh
    KV cache), plus the fraction of FFN neurons computed (CATS, predictors) or, with input
    sparsity, of the matrices' inputs read (emulated: coordinator/tools/emulate.py).
    `progress(1)` after each chunk."""
    thresholds = observe.input_thresholds(engine)
    if thresholds is not None:
        from .emulate import input_sparsity

        with input_sparsity(engine, *thresholds) as masks:
            r = _perplexity(engine, chunks, progress)
        return {**r, "active_fraction": float(masks.kept_fraction().mean()), "unit": "inputs read"}
    return _perplexity(engine, chunks, progress)


def _perplexity(engine, chunks: list[list[int]], progress=None) -> dict:
    meter = observe.FfnMeter(engine)
    nll, n = 0.0, 0
    with observe.sparse_batches(engine):
        for c in chunks:
            logits = torch.from_numpy(observe.all_logits(engine, c)[:-1]).double()
            lp = torch.log_softmax(logits, dim=-1)
            nll -= float(lp[torch.arange(len(c) - 1), torch.tensor(c[1:])].sum())
            n += len(c) - 1
            if progress:
                progress(1)
    return {"ppl": float(np.exp(nll / n)), "nll": nll / n, "tokens": n, "active_fraction": meter.active_fraction(),
            "unit": "FFN neurons computed"}
