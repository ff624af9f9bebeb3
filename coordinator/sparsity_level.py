"""Which sparsity level `generate`, `chat` and `serve` decode at when none is asked for.

`sparseinfer calibrate` stores, beside the thresholds, the held-out perplexity of the dense
model and of each level (coordinator/tools/calibrate.py: quality). The default is the highest
level whose perplexity, and every lower level's, stays within the quality budget (+2 % by
default, `--quality-budget`);
without a calibration the engine decodes densely and says how to calibrate, once per model file.
"""
from __future__ import annotations

from pathlib import Path

from .model_files import calibrated_levels

DEFAULT_QUALITY_BUDGET = 0.02
# Below this level the twins' work per input read costs more than the bytes they skip: decode
# on the 2-core Zen 4 EPYC (2026-11-25, docs/SPARSITY.md): SmolLM2 0.92x dense at 0.2 and 0.91x at
# 0.3, 1.11x at 0.5; the 1.1B Q4_0 shape 1.20-1.37x at 0.5. A default below it stays dense.
MIN_PAYING_LEVEL = 0.4


def choose(model: Path, method: str, budget: float = DEFAULT_QUALITY_BUDGET,
           say: bool = True) -> tuple[float | None, str]:
    """(the level to decode at, or None for dense; the one line that says so). `say` False: only
    the level (`info`'s plan), the hint to calibrate not counted as given."""
    q = calibrated_levels(model)
    name = Path(model).name
    if q is None or q.get("method") != method or not q.get("levels"):
        if not say or not _first_time(Path(model)):
            return None, ""
        return None, (f"note: decoding densely; `sparseinfer calibrate -m {model}` once (a few minutes) lets "
                      f"generate, chat and serve skip weights at a level within +{budget:.0%} perplexity")
    dense = float(q["dense"])
    # the highest level with it and every lower one within the budget: a small model's perplexity
    # is not monotonic in the level on a few thousand tokens (Gemma 3 270M: +5.4 % at 0.2, -3.8 %
    # at 0.3), and a level past one that failed is luck, not quality
    within = []
    for k, v in sorted(q["levels"].items(), key=lambda kv: float(kv[0])):
        if float(v["ppl"]) > dense * (1 + budget):
            break
        within.append((float(k), float(v["ppl"])))
    if not within:
        return None, (f"note: decoding densely: no calibrated level of {name} stays within +{budget:.0%} held-out "
                      f"perplexity (--quality-budget)")
    level, ppl = max(within)
    if level < MIN_PAYING_LEVEL:
        return None, (f"note: decoding densely: {name}'s highest level within +{budget:.0%} perplexity, "
                      f"{level:.2f}, is below {MIN_PAYING_LEVEL:.2f}, where skipping starts to pay "
                      f"(--sparsity {level:.2f} asks for it anyway)")
    return level, (f"sparsity {level:.2f} ({method} sparsity, calibrated: held-out perplexity "
                   f"{100 * (ppl / dense - 1):+.1f} % against dense, budget {budget:.0%}; --sparsity 0 for dense)")


def _first_time(model: Path) -> bool:
    """Whether the hint to calibrate `model` has not been given yet (it is given once per model
    file: the files told are listed in the cache directory); True where that list cannot be kept."""
    from .model_fetch import cache_dir

    told = cache_dir() / "calibrate-hints.txt"
    key = str(model.resolve())
    try:
        if told.exists() and key in told.read_text().splitlines():
            return False
        told.parent.mkdir(parents=True, exist_ok=True)
        with open(told, "a") as f:
            f.write(key + "\n")
    except OSError:
        pass
    return True
