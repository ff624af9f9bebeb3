"""Which sparsity level `generate`, `chat` and `serve` decode at when none is asked for.

`sparseinfer calibrate` stores, beside the thresholds, the held-out perplexity of the dense
model and of each level (coordinator/tools/calibrate.py: quality). The default is the highest
level whose perplexity, and every lower level's, stays within the quality budget (+2 % by
default, `--quality-budget`), and of those, where calibrate timed decoding on this CPU, the
fastest that is at least MIN_GAIN faster than dense;
without a calibration the engine decodes densely and says how to calibrate, once per model file.
"""
from __future__ import annotations

import platform
from pathlib import Path

from .model_files import calibration

DEFAULT_QUALITY_BUDGET = 0.02
# Without a speed check stored by `calibrate` for this machine (coordinator/tools/speed_check.py):
# below this level the twins' work per input read costs more than the bytes they skip: decode
# on the 2-core Zen 4 EPYC (2026-11-25, docs/SPARSITY.md): SmolLM2 0.92x dense at 0.2 and 0.91x at
# 0.3, 1.11x at 0.5; the 1.1B Q4_0 shape 1.20-1.37x at 0.5. A default below it stays dense.
MIN_PAYING_LEVEL = 0.4

# A level is the default only where it decodes at least this much faster than dense (the
# measurement's noise on a shared machine is a few per cent).
MIN_GAIN = 1.05


def machine() -> dict:
    """The CPU and the kernels' instruction set level a measurement belongs to."""
    from sparsecore import kernels

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "isa": kernels.isa()}


def choose(model: Path, method: str, budget: float = DEFAULT_QUALITY_BUDGET,
           say: bool = True) -> tuple[float | None, str]:
    """(the level to decode at, or None for dense; the one line that says so). `say` False: only
    the level (`info`'s plan), the hint to calibrate not counted as given."""
    table = calibration(model)
    q = table.get("quality")
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
    gains = ratios_here(table.get("speed"), method)
    if gains is not None:  # measured on this machine at calibration: the fastest level within the budget
        paying = [(gains[lv], lv, ppl) for lv, ppl in within if gains.get(lv, 0.0) >= MIN_GAIN]
        if not paying:
            best = max(((gains[lv], lv) for lv, _ in within if lv in gains), default=None)
            told = f" (best: {best[1]:.2f} at {best[0]:.2f}x)" if best else ""
            return None, (f"note: decoding densely: no level of {name} within +{budget:.0%} perplexity decoded "
                          f"at least {MIN_GAIN:.2f}x dense's speed on this machine when calibrated{told}")
        gain, level, ppl = max(paying)
        return level, (f"sparsity {level:.2f} ({method} sparsity, calibrated: held-out perplexity "
                       f"{100 * (ppl / dense - 1):+.1f} % against dense, budget {budget:.0%}; {gain:.2f}x dense's "
                       f"decode speed here; --sparsity 0 for dense)")
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


def ratios_here(speed: dict | None, method: str) -> dict[float, float] | None:
    """The stored ratios against dense by level, where they were measured on this CPU at this
    level with `method`; None otherwise (another machine, or no measurement)."""
    if not speed or speed.get("method") != method:
        return None
    here = machine()
    if speed.get("cpu") != here["cpu"] or speed.get("isa") != here["isa"]:
        return None
    try:
        return {float(k): float(v) for k, v in speed.get("levels", {}).items()}
    except (TypeError, ValueError):
        return None
