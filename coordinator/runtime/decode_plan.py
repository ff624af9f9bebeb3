"""Which path a decoded token takes, decided in one place: `plan_decode` makes a `DecodePlan`
once, when the engine starts, and the model is built with it (coordinator/model/transformer.py).

The paths, fastest first where the processes support them:
  - lockstep: every layer of the token in one post, each process summing the others' shares
    itself (coordinator/runtime/lockstep_decode.py, sparsecore/lockstep.py);
  - split attention: per layer, the attention's heads split across the coordinator and the
    CPU workers (coordinator/runtime/attention_split.py), then the FFN's exchange;
  - native: per layer, the whole attention block in one native call on the coordinator
    (`AttentionStep`), then the FFN's exchange;
  - torch: per layer, torch's attention on the coordinator (float weights, tensor types or
    shapes the kernel does not take), then the FFN's exchange.
The plan says which is the best a token can take and why; each step still checks that it pays
for its size, with the plan's thresholds (`LockstepDecode.usable`, `SplitAttention.pays`), and
falls back one path otherwise (a prompt, more rows than a lockstep step holds, contended cores,
a calibration observer, a layer's sliding window). EngineOptions.decode_path forces a path
whatever the size (tests: the tiny models' layers would never pay for an exchange).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from sparsecore.attn_shard import head_unit, native_attention, split_heads
from sparsecore.kv_pool import supported as shared_kv_supported

if TYPE_CHECKING:
    from .attention_split import SplitAttention
    from .lockstep_decode import LockstepDecode

# An attention step split across processes costs one more exchange a layer (a doorbell round
# trip and some Python, 20-40 us); it pays when the work it halves is larger: the layer's
# attention weights plus the keys and values the step reads. Measured on a 2-core EPYC with the
# vectorized attention kernel (paired in-process runs, fast arithmetic): SmolLM2 (0.55 MB of
# weights a layer) one sequence 0.95x at 8 positions, 0.97-0.99x at 128-256, 1.00x at 1024
# (2.1 MB with the cache); 4 sequences at 128 positions (1.3 MB) 1.04x; the 1.1B shape (5.3 MB
# a layer) one sequence 1.02-1.08x at 8-1024 positions, 4 sequences 1.13x.
MIN_SPLIT_BYTES = 2 << 20  # one sequence
MIN_SPLIT_BYTES_BATCH = 1 << 20  # several: their caches' share of the work splits too

# In lockstep, splitting a layer's attention costs one more exchange of shares (a spin on a
# shared word and a sum: 5-10 us), not a posted step; it pays when the attention's work is
# larger: SmolLM2 (0.55 MB of attention weights a layer) decodes 9 % faster in lockstep than
# layer by layer with its attention on the coordinator (paired in-process runs, 2-core EPYC).
MIN_LOCKSTEP_BYTES = 256 << 10

# EngineOptions.decode_path: "auto" (the best path the processes support, each step where it
# pays), "lockstep" or "split" (that path for every decoded token whatever its size, and prompts'
# attention split at every size; refused at start where the processes cannot take it).
DECODE_CHOICES = ("auto", "lockstep", "split")


class DecodePath(str, Enum):
    LOCKSTEP = "lockstep"
    SPLIT = "split attention"
    NATIVE = "native"
    TORCH = "torch"


@dataclass(frozen=True)
class DecodePlan:
    """The decode path of one engine: `path`, `reason` (in words), the query heads each process
    computes where attention is split (`heads`: worker slot -> [h0, h1), -1 the coordinator's;
    empty: none), the worker slots of a lockstep step, and the thresholds a step's work must
    reach for its path to pay (bytes: SplitAttention.pays, LockstepDecode.usable)."""
    path: DecodePath
    reason: str
    heads: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False)
    lockstep_slots: tuple[int, ...] = ()
    split_min_bytes: tuple[int, int] = (MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH)  # one sequence, several
    lockstep_min_bytes: int = MIN_LOCKSTEP_BYTES
    # split every decoded step's attention whatever it costs: under input sparsity (only the
    # shares carry twins), and wherever lockstep is the path, so a step that falls back to the
    # layers (contended cores, a size lockstep does not take) computes the same floats as a
    # lockstep step: which path ran must not change a greedy reply
    every_token: bool = False
    forced: bool = False  # EngineOptions.decode_path chose it: thresholds 0

    @property
    def split(self) -> bool:
        """Decoded tokens' attention heads are split across the processes (lockstep's too)."""
        return self.path in (DecodePath.LOCKSTEP, DecodePath.SPLIT)

    def describe(self) -> str:
        """One line: the path, why, and the shares (`sparseinfer bench` prints it)."""
        shares = ""
        if self.heads:
            shares = "; heads " + ", ".join(
                f"{'coordinator' if s < 0 else f'worker slot {s}'} {a}-{b}" for s, (a, b) in sorted(
                    self.heads.items(), key=lambda kv: (kv[0] < 0, kv[0])))
        when = " (forced: every size)" if self.forced else ""
        return f"{self.path.value}{when}: {self.reason}{shares}"


def attention_heads(split_attention: bool, weights: str, store, cfg, shards) -> tuple[dict[int, tuple[int, int]], str]:
    """Query heads per CPU worker slot and the coordinator's (key -1) for decoded tokens' attention,
    and "" ; or ({}, why they stay on the coordinator). `shards`: the placement plan's, by slot.
    Decided before any process starts: the KV caches then live in shared memory."""
    if not split_attention:
        return {}, "attention split turned off (split_attention)"
    if weights != "gguf":
        return {}, f"weights {weights}: only the file's blocks split by heads"
    if not shared_kv_supported():
        return {}, "no shared memory for the KV caches on this system"
    if not native_attention(store, cfg):
        return {}, "attention the native kernel does not compute (architecture or tensor types)"
    workers = [slot for slot, sh in enumerate(shards) if sh.role == "cpu" and any(len(n) for n in sh.neurons)]
    if not workers:
        return {}, "no CPU worker computes neurons"
    heads = split_heads(cfg.n_heads, cfg.n_heads // cfg.n_kv_heads, workers + [-1], head_unit(store, cfg))
    return heads, "" if heads else f"{cfg.n_heads} heads do not split into two shares on whole blocks"


def plan_decode(choice: str, heads: dict[int, tuple[int, int]], no_split: str, native: bool, no_native: str,
                no_lockstep: str, lockstep_slots: tuple[int, ...] = (), every_token: bool = False) -> DecodePlan:
    """THE decision. `choice`: EngineOptions.decode_path. What the processes support, each with
    why not ("" where it is supported): `heads`/`no_split` (attention_heads), `native` (every
    layer has a native attention step)/`no_native`, `no_lockstep` (the coordinator and every
    worker with neurons can each take a part of a lockstep step: engine_build.py)."""
    if choice not in DECODE_CHOICES:
        raise ValueError(f"decode path {choice!r}: one of {', '.join(DECODE_CHOICES)}")
    forced = choice != "auto"
    why_not_split = no_split or ("" if native else no_native)
    if forced and why_not_split:
        raise ValueError(f"decode path {choice}: attention cannot be split here: {why_not_split}")
    if choice == "lockstep" and no_lockstep:
        raise ValueError(f"decode path lockstep: not here: {no_lockstep}")
    thresholds = dict(split_min_bytes=(0, 0), lockstep_min_bytes=0) if forced else {}
    common = dict(heads=heads, every_token=every_token, forced=forced, **thresholds)
    if not why_not_split and choice != "split" and not no_lockstep:
        return DecodePlan(DecodePath.LOCKSTEP, "the coordinator and every worker with neurons hold attention heads "
                          "and neurons of every layer; per layer, attention still split, where a step is too "
                          "small, too large or the cores are contended", lockstep_slots=tuple(lockstep_slots),
                          **{**common, "every_token": True})
    if not why_not_split:
        why = "forced" if choice == "split" else f"not lockstep: {no_lockstep}"
        return DecodePlan(DecodePath.SPLIT, f"{why}; on the coordinator alone where a step's work does not pay "
                          "for the exchange", **common)
    if native:
        return DecodePlan(DecodePath.NATIVE, f"attention on the coordinator: {why_not_split}")
    return DecodePlan(DecodePath.TORCH, f"attention in torch on the coordinator: {no_native}")


def why_not_native(native: list, weights: str, cfg) -> str:
    """"" where every layer has a native attention step (`native`: the model's, None where a
    layer has none), else why not."""
    if native and all(s is not None for s in native):
        return ""
    if weights != "gguf":
        return f"weights {weights}: the native step reads the file's blocks"
    if not cfg.native_attention:
        return f"rope over {cfg.rope_dim} of {cfg.head_dim} values a head: wider than the head, not the native kernel's"
    return "a layer's tensor types or shape the native kernel does not take"


class DecodePaths(NamedTuple):
    """What a model is built with (Transformer's `decode`): the plan and the objects that run
    its paths (None where the plan does not take them)."""
    plan: DecodePlan
    split: "SplitAttention | None" = None
    lockstep: "LockstepDecode | None" = None


def local_paths(native: list, weights: str, cfg) -> DecodePaths:
    """A model without worker processes (tests, tools): attention on the coordinator."""
    no_native = why_not_native(native, weights, cfg)
    return DecodePaths(plan_decode("auto", {}, "no worker processes", not no_native, no_native, "no worker processes"))
