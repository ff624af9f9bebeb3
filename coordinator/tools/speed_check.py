"""Whether skipping pays on this machine: decode speed at each calibrated level against dense,
measured by `sparseinfer calibrate` and stored beside the thresholds (`speed` in
`<model>.thresholds.json`), so that the default level (coordinator/runtime/sparsity_level.py) is one that
decodes faster here, not only one within the quality budget.

Whether skipped inputs pay depends on the CPU as much as on the model: the twins' kernels run
per group of 32 inputs, so a small model's matrices (SmolLM2: 576 inputs) gain nothing at 0.2-0.3
on the 2-core Zen 4 EPYC where the 1.1B shape gains 1.4x at 0.5 (docs/SPARSITY.md). A stored
measurement is used only on the CPU and instruction set level it was taken on
(coordinator/runtime/sparsity_level.py).
"""
from __future__ import annotations

import statistics

from ..runtime.model_files import level_key
from ..runtime.sparsity_level import machine


def measure(engine, levels: list[float], prompt: list[int], tokens: int = 16, reps: int = 3,
            progress=None) -> dict:
    """Decode tok/s of dense and of each level (engine started with input-major twins), `reps`
    interleaved rounds of `tokens` greedy tokens after `prompt`, medians; the ratios against
    dense, with the machine they were measured on."""
    from . import observe
    from .bench import Mode, timed_run

    modes = [Mode("dense")] + [Mode(level_key(s), sparsity=s) for s in levels]
    speeds: dict[str, list[float]] = {m.name: [] for m in modes}
    try:
        for m in modes:  # one warm-up each: the twins' and the rows' pages in memory
            m.apply(engine)
            timed_run(engine, prompt, 2)
        for rep in range(reps):
            for m in modes if rep % 2 == 0 else modes[::-1]:
                m.apply(engine)
                r = timed_run(engine, prompt, tokens + 1)
                speeds[m.name].append(r.decode_tokens / r.decode_s)
                if progress:
                    progress(1)
    finally:
        modes[0].apply(engine)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    dense = med.pop("dense")
    return {**machine(), "method": observe.sparse_method(engine), "threads": engine.opts.threads,
            "tokens": tokens, "reps": reps, "dense_tok_s": round(dense, 2),
            "levels": {k: round(v / dense, 3) for k, v in med.items()}}
