"""Input sparsity in one process: the input-major twins of the matrices it computes.

A one-token product on a matrix that carries a twin (sparsecore/kernels/layouts.py
with_input_major) reads only the twin's columns whose input exceeds the twin's threshold: the
inputs of a matrix skipped, their weights never read (TEAL). Each twin's threshold is a word of
shared memory (protocol.shm_layout.INPUT_SITES: per layer, Q/K/V's, O's, gate/up's and down's),
so the coordinator sets the level of every process at once and a negative word means dense;
prompts and batches of several sequences always read the original rows.

What gets a twin (`which`, protocol.messages.Assign.input_major):
  "all"   every matrix of the process's FFN neurons and attention heads (input sparsity);
  "down"  the FFN's down matrix only, neuron-major, threshold 0 on h: CATS steps (which zero
          the inactive neurons' h) then skip a neuron's whole down row instead of reading down
          hidden-major, where a block of 32 neurons is read if one of them is active.
A matrix whose type has no input-major kernel keeps its rows only (noted once per process).
"""
from __future__ import annotations

import sys

import numpy as np
from gguf import GGMLQuantizationType

from protocol.shm_layout import INPUT_SITES

from .kernels import FUSED_TYPES, input_major_type, layouts

TWIN_CHOICES = ("", "down", "all")
_SITE = {name: k for k, name in enumerate(INPUT_SITES)}


def threshold_word(thresholds: np.ndarray, layer: int, site: str) -> np.ndarray:
    """The one-float view of `site`'s threshold of `layer` (thresholds: the shared (layers,
    INPUT_SITES) array) that a twin reads at every product."""
    k = _SITE[site]
    return thresholds[layer, k:k + 1]


class Twins:
    """The twins one process made: their bytes, and what could not have one."""

    def __init__(self):
        self.skipped: dict[str, int] = {}  # type name -> matrices (of this process) left without a twin
        self.matrices: list = []  # every matrix carrying a twin (for the active-column counters)
        self.words: list[np.ndarray] = []  # the threshold word each of them reads (< 0: it reads its rows)

    def add(self, m, rows, cols, word: np.ndarray):
        """m with a twin over rows x cols reading `word`, or m itself where its type has none."""
        if not input_major_type(m.type):
            name = GGMLQuantizationType(m.type).name
            self.skipped[name] = self.skipped.get(name, 0) + 1
            return m
        twinned = layouts.with_input_major(m, rows, cols, word)
        self.matrices.append(twinned)
        self.words.append(word)
        return twinned

    def add_fused(self, parts: list, cols, word: np.ndarray) -> list:
        """The matrices of parts [(m, rows), ...] (one input, one threshold) with one fused twin
        (layouts.fuse_input_major: carried by the first, counted once), or each with its own
        (add) where their types or widths differ."""
        ms = [m for m, _ in parts]
        if not all(m.type in FUSED_TYPES and m.type == ms[0].type and m.cols == ms[0].cols for m in ms):
            return [self.add(m, rows, cols, word) for m, rows in parts]
        out = layouts.fuse_input_major(parts, cols, word)
        self.matrices.append(out[0])
        self.words.append(word)
        return out

    @property
    def bytes(self) -> int:
        """Bytes the twins hold (the file's bytes of what they copy, padding included)."""
        return sum(m.twin_bytes for m in self.matrices)

    def note(self) -> None:
        """One line on stderr naming the types whose matrices kept their rows only (the
        coordinator says it for every process: the workers' matrices are of the same types)."""
        if self.skipped:
            kinds = ", ".join(f"{n} {t}" for t, n in self.skipped.items())
            print(f"note: sparse decoding reads these matrices densely (no input-major kernels for their types): "
                  f"{kinds}", file=sys.stderr)


def _adder(twins: Twins, thresholds: np.ndarray, layer: int, sites: tuple[str, ...]):
    """add(matrix, rows, cols, site) for one layer's owner (FileLayer.add_twins,
    AttentionStep.add_twins); sites outside `sites` keep their rows only."""
    def add(m, rows, cols, site):
        return twins.add(m, rows, cols, threshold_word(thresholds, layer, site)) if site in sites else m

    def fused(parts, cols, site):
        """add's for matrices of one input (parts: [(m, rows), ...]): one fused twin"""
        if site not in sites:
            return [m for m, _ in parts]
        return twins.add_fused(parts, cols, threshold_word(thresholds, layer, site))
    add.fused = fused
    return add


def attach(thresholds: np.ndarray, which: str, ffn_layers: dict | None, attn_steps: list | None,
           head=None, head_word: np.ndarray | None = None, twins: Twins | None = None) -> Twins:
    """The twins of one process: its FFN layers' (FileLayer, as sparsecore/shard.py holds them:
    gate and up over the owned neurons' rows, down over their columns) and, with "all", its
    native attention steps' (the share of heads a step keeps, else all of them) and its lm_head
    rows' (`head`: sparsecore.lm_head.HeadRows or the coordinator's LmHead, reading `head_word`).
    `twins`: add to these (the coordinator makes its attention's after the rest)."""
    if which not in TWIN_CHOICES:
        raise ValueError(f"input-major twins {which!r}: one of {TWIN_CHOICES}")
    twins = Twins() if twins is None else twins
    if not which:
        return twins
    sites = INPUT_SITES if which == "all" else ("ffn_h",)
    for layer, w in (ffn_layers or {}).items():
        w.add_twins(_adder(twins, thresholds, layer, sites))
    if which == "all":
        for layer, step in enumerate(attn_steps or []):
            if step is not None:
                step.add_twins(_adder(twins, thresholds, layer, sites))
        if head is not None:
            head.add_twin(lambda m, rows, cols: twins.add(m, rows, cols, head_word), head_word)
    return twins

