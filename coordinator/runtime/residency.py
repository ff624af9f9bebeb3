"""Which FFN units stay in memory when a model's repacked layouts do not all fit: the rest are
mapped from the layout cache (sparsecore/kernels/layout_cache.py) and read from disk when a
token needs them, instead of the run being refused or killed.

A unit is a layer's FFN (dense) or one expert of a layer (routed); every process holds its own
part of every unit (its neurons' rows), so one choice serves them all. Routed units are kept
by how often the profile (`sparseinfer profile`, <model>.profile.npz) saw them routed, the most
routed first (placement.expert_placement, the rule that places experts on a GPU); without a
profile, and for dense layers, where every token reads every unit, the first ones are kept (any
choice reads the same bytes a token).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .memory_plan import MIB, MemoryPlan
from .placement import expert_placement, routing_profile

# Memory left to the page cache for the units read from disk: room for the next layer's part to
# be read ahead while this one computes, and for the kernel's own readahead.
STREAM_RESERVE = 64 * MIB
STREAM_SHARE = 0.08


def ffn_unit_bytes(store, cfg) -> np.ndarray:
    """(n_layers, units per layer): the file bytes of each unit's FFN matrices."""
    if cfg.routed:
        out = np.zeros((cfg.n_layers, cfg.n_experts), np.int64)
        for i in range(cfg.n_layers):
            n = sum(int(store.by_name[f"blk.{i}.{m}.weight"].n_bytes) for m in
                    ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if store.has(f"blk.{i}.{m}.weight"))
            out[i] = n // cfg.n_experts
        return out
    out = np.zeros((cfg.n_layers, 1), np.int64)
    for i in range(cfg.n_layers):
        out[i, 0] = sum(int(store.by_name[f"blk.{i}.{m}.weight"].n_bytes) for m in
                        ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t") if store.has(f"blk.{i}.{m}.weight"))
    return out


def cold_units(plan: MemoryPlan, store, cfg, profile_file: Path | None = None) -> np.ndarray | None:
    """(n_layers, units per layer) uint8, 1 where the unit's layouts are mapped from the layout
    cache; None where everything fits (or nothing can be left out: MemoryPlan.check refuses).
    The plan's `cold` row is set to the layout bytes that leaves mapped."""
    if plan.available is None or plan.anonymous <= plan.available or plan.ffn_copied <= 0:
        return None
    sizes = ffn_unit_bytes(store, cfg)
    total = int(sizes.sum()) or 1
    # (a small model's units are read in a few pages: a quarter of its FFN is room enough)
    reserve = min(max(STREAM_RESERVE, int(STREAM_SHARE * plan.available)), plan.ffn_copied // 4)
    keep_bytes = max(0, plan.available - plan.must_stay - reserve)
    # the unit sizes are the file's; what a process holds of them is the plan's copied bytes
    keep_file = int(keep_bytes * total / plan.ffn_copied)
    cold = np.ones(sizes.shape, np.uint8)
    freqs = _routing(profile_file, sizes.shape) if cfg.routed else None
    if freqs is not None:
        kept = expert_placement(freqs, int(sizes.max()), keep_file)["experts"]
        for i, e in enumerate(kept):
            cold[i, e] = 0
    else:
        used = 0
        for flat in range(sizes.size):  # in order: the first layers (experts) kept
            n = int(sizes.flat[flat])
            if used + n > keep_file:
                break
            cold.flat[flat], used = 0, used + n
    plan.cold = int(plan.ffn_copied * float(sizes[cold.astype(bool)].sum()) / total)
    return cold


def _routing(profile_file: Path | None, shape) -> list[np.ndarray] | None:
    """The profile's routing counts per layer, if it is a routing profile of this shape
    (placement.routing_profile's check; none: the first experts are kept instead)."""
    if profile_file is None:
        return None
    try:
        return routing_profile(Path(profile_file), Path(profile_file), *shape).freqs
    except ValueError:
        return None
