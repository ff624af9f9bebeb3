"""EngineOptions: everything one engine run takes (threads, context, weight format, sparsity,
decode path...), the choices its string fields allow, and the one set of rules every field's
value must follow (`check_values`, `EngineOptions.validate`), which refuses a bad value in one
line naming the option before the model file is read: the command line (with its option
names), the Python API and the engine itself (`check`) all ask here. The engine
(coordinator/runtime/engine.py) re-exports EngineOptions."""
from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Mapping

from protocol.messages import WEIGHT_FORMATS

SPARSE_METHODS = ("input", "cats")  # EngineOptions.sparse_method
TRANSPORTS = ("ipc", "tcp")  # EngineOptions.transport


@dataclass
class EngineOptions:
    cpu_workers: int | None = None  # default: one per core left after the GPU worker
    threads: int | None = None  # cores to use in all; default: all
    gpu_share: float | None = None  # static share of each layer's neurons on the GPU worker
    ctx: int = 2048  # KV cache length (capped at the model's context length)
    max_batch: int = 256  # tokens per FFN exchange during prefill
    gpu_device: str = "auto"
    transport: str = "ipc"
    sparsity: float | None = None  # calibrated sparsity level for decoding; None = dense
    # How decoded tokens skip weights at `sparsity` (coordinator/tools/calibrate.py): "input"
    # (TEAL: every matrix skips the columns of its small inputs, read from input-major twins),
    # or "cats" (FFN neurons with small |act(gate x)| skip their up row and down row).
    sparse_method: str = "input"
    thresholds_file: str | None = None  # default: <model>.thresholds.json
    vram_budget_gb: float | None = None  # GiB for hot neurons on the GPU worker (needs <model>.profile.npz)
    reset_gpu_index: bool = False  # rebuild <model>.generated.gpuidx even if it matches
    disable_gpu_index: bool = False  # neither read nor write <model>.generated.gpuidx
    # Where the repacked layouts are kept between runs (sparsecore/kernels/layout_cache.py): a
    # directory, "off", or None: $SPARSEINFER_LAYOUT_CACHE, else <cache>/layouts.
    layout_cache: str | None = None
    predictor: str | None = None  # predictor GGUF; default: the model's own fc1/fc2 if any; "none": off
    # How processes keep weights in memory: "gguf" (the default: the file's own blocks through
    # the native kernels, no float copy; fast arithmetic unless `fast` is False), "f32" (float32 copies,
    # torch ops), "int8" (per-row scales, a quarter of the bytes) or "f16" (half the bytes, for
    # the coordinator's attention matrices too; float16 products for one-token steps).
    weights: str = "gguf"
    # With weights "gguf": activations quantized to 8 bits per block of 32 (llama.cpp's
    # arithmetic; the default, as `--arith fast`) or, False, float32 times the dequantized
    # blocks (exact: transformers' tokens, what the reference tests compare). Other weight
    # formats ignore it.
    fast: bool = True
    # Per-layer exchange: spin on shared-memory doorbells (True), messages only (False), or
    # spin when the coordinator and every computing worker have a core each (None).
    spin: bool | None = None
    # Fraction of the CPU side's neurons (those not on the GPU worker) the coordinator computes
    # itself during each FFN step; None: default_coordinator_share.
    coordinator_share: float | None = None
    # With a coordinator share, split the lm_head's vocabulary rows across the same processes.
    split_lm_head: bool = True
    # Split decoded tokens' attention heads across the coordinator and the CPU workers (llama-
    # shaped attention in the file's blocks; the KV caches then live in shared memory).
    split_attention: bool = True
    # Which path decoded tokens take (coordinator/runtime/decode_plan.py, DECODE_CHOICES): "auto", the
    # best the processes support wherever a step's size pays for it; "lockstep" or "split",
    # that path at every size (and prompts' attention split at every size), refused at start
    # where the processes cannot take it (tests: a tiny model's layers never pay).
    decode_path: str = "auto"
    # The coordinator's spin governor backs off to sleeping when its spins are preempted
    # (protocol/doorbell.py SpinGovernor; steps then leave lockstep). False: it keeps spinning as
    # `spin` chose, whatever the machine's load (tests that must stay on one path); None: as
    # $SPARSEINFER_SYNC says (adaptive unless set).
    adaptive_spin: bool | None = None
    # KV caches in that shared memory: the engine's own, the chat REPL's, a server's slots
    # (`serve` asks for --parallel + 1). A sequence beyond them gets a private cache, and its
    # attention runs on the coordinator alone.
    kv_caches: int = 2
    # With `fast`, processes hold the FFN rows every step reads interleaved 16 by 16
    # (FileMatrix.interleave: a third of the vector work per token, shared by a batch): down
    # always, gate unless predictors pick rows, and up too if this says so, which then serves
    # dense steps only. None: up too when the engine starts dense (no `sparsity`, no
    # predictors) or with input sparsity (its sparse steps read twins); False: never up, for
    # tools that switch to CATS steps at run time.
    interleave: bool | None = None
    # Speculative decoding (coordinator/runtime/speculative.py): "ngram" (prompt lookup: drafts
    # from the sequence's own earlier text, taken only where they measure faster), "draft" (a
    # smaller model of the same vocabulary, `draft_model`, drafts) or "off". The command line
    # and the Python API (sparseinfer.LLM) default to "ngram"; an Engine made directly decodes
    # one token per step unless asked, as the tools and tests that count steps expect.
    spec: str = "off"
    draft_model: str | None = None

    def validate(self, spell: Mapping[str, str] | None = None) -> None:
        """OptionError (a ValueError) naming the first field whose value its rule refuses, in one
        line: `threads 64: this machine has 2 usable cores: choose 1..2`. `spell`: the names the
        caller knows the fields by (the command line's `-t/--threads`); the field's own name
        otherwise. A field whose default is None may be None; no other may."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            if values[f.name] is None and f.default is not None:
                raise OptionError((spell or {}).get(f.name, f.name), None, "give a value")
        check_values(spell, **values)
        if (self.spec == "draft") != (self.draft_model is not None):  # one needs the other
            name = (spell or {}).get("draft_model", "draft_model")
            raise OptionError((spell or {}).get("spec", "spec"), _shown(self.spec),
                              f"a draft model ({name}) goes with speculation 'draft' and only with it")


class OptionError(ValueError):
    """A value refused before anything loads, in one line: the option as the caller spells it
    (`threads` in Python, `-t/--threads` on the command line), its value, and why."""

    def __init__(self, option: str, value, why: str):
        super().__init__(f"{option} {value}: {why}")
        self.option, self.value, self.why = option, value, why


def _shown(value):
    """A value as a message shows it: a text quoted (`weights 'fp8'`), a number as it is."""
    return repr(value) if isinstance(value, (str, bytes)) else value


def check_range(option: str, value, lo=None, hi=None, why: str = "") -> None:
    """`value` within [lo, hi] (either end open when None); NaN is never within."""
    if value is None:
        return
    if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
        span = f"{lo if lo is not None else ''}..{hi if hi is not None else ''}"
        raise OptionError(option, value, why or f"choose {span}")


def usable_cores() -> int:
    from protocol.doorbell import usable_cores as cores

    return cores()


def _whole(name, value) -> None:
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise OptionError(name, _shown(value), "choose a whole number")


def _number(name, value) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise OptionError(name, _shown(value), "choose a number")


def _threads(name, value) -> None:
    _whole(name, value)
    cores = usable_cores()
    check_range(name, value, 1, cores, f"this machine has {cores} usable cores: choose 1..{cores}")


def _cpu_workers(name, value) -> None:
    # More workers than cores never helps (each wait becomes a scheduler wake-up) and each one maps
    # the model and imports torch: refuse rather than start dozens of processes.
    _whole(name, value)
    cores = usable_cores()
    check_range(name, value, 1, cores, f"at most one worker per usable core ({cores} here): choose 1..{cores}")


def _ctx(name, value) -> None:
    _whole(name, value)
    check_range(name, value, 1, None, "the context must hold at least one token")


def _gpu_share(name, value) -> None:
    _number(name, value)
    check_range(name, value, 0.0, 1.0)


def _sparsity(name, value) -> None:
    _number(name, value)
    if not 0.0 <= value < 1.0:
        raise OptionError(name, value, "choose a fraction in [0, 1)")


def _coordinator_share(name, value) -> None:
    _number(name, value)
    if not 0.0 <= value < 1.0:  # the placement's own words (placement.static_plan)
        raise ValueError(f"coordinator share must be within [0, 1), got {value}")


def _budget(name, value) -> None:
    _number(name, value)
    check_range(name, value, 0.0, None, "a budget cannot be negative")


def _max_batch(name, value) -> None:
    _whole(name, value)
    check_range(name, value, 1, None, "a prefill exchange carries at least 1 token")


def _one_of(choices, what=""):
    def rule(name, value) -> None:
        if value not in choices:
            raise OptionError(name, _shown(value), f"{what}choose one of {', '.join(choices)}")
    return rule


def _device(name, value) -> None:
    """The GPU worker's torch device: auto (CUDA where there is one), cpu, cuda or cuda:N."""
    ok = isinstance(value, str) and (value in ("auto", "cpu", "cuda") or
                                     (value.startswith("cuda:") and value[5:].isdigit()))
    if not ok:
        raise OptionError(name, _shown(value), "choose auto, cpu, cuda or cuda:N")


def _decode_path(name, value) -> None:
    # imported here: decode_plan imports the attention shards, which a command refusing its
    # --threads need not load
    from .decode_plan import DECODE_CHOICES

    _one_of(DECODE_CHOICES)(name, value)


def _flag(name, value) -> None:
    if not isinstance(value, bool):
        raise OptionError(name, _shown(value), "choose True or False")


def _path(name, value) -> None:
    if not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
        raise OptionError(name, _shown(value), "give a file path")


# Each field's rule (None, for a field whose default is None, is never checked).
_RULES = {
    "cpu_workers": _cpu_workers, "threads": _threads, "gpu_share": _gpu_share, "ctx": _ctx,
    "max_batch": _max_batch, "gpu_device": _device, "transport": _one_of(TRANSPORTS),
    "sparsity": _sparsity, "sparse_method": _one_of(SPARSE_METHODS), "thresholds_file": _path,
    "vram_budget_gb": _budget, "reset_gpu_index": _flag, "disable_gpu_index": _flag, "predictor": _path,
    "layout_cache": _path,
    "weights": _one_of(WEIGHT_FORMATS, "unknown weight format: "), "fast": _flag, "spin": _flag,
    "coordinator_share": _coordinator_share, "split_lm_head": _flag, "split_attention": _flag,
    "decode_path": _decode_path, "adaptive_spin": _flag, "kv_caches": _whole, "interleave": _flag,
    "spec": _one_of(("off", "ngram", "draft")), "draft_model": _path,
}


def check_values(spell: Mapping[str, str] | None = None, **values) -> None:
    """Refuse, in the order given, the first of these EngineOptions fields whose value its rule
    refuses (a value of None is left to the default, never refused here): OptionError in one
    line naming the option as `spell` maps the field (the field's own name otherwise), or, for
    the coordinator share, the placement's own ValueError. The command line checks its options
    with this before anything loads, the Python API before the model is fetched."""
    for field, value in values.items():
        if value is not None:
            _RULES[field]((spell or {}).get(field, field), value)


def check(opts: EngineOptions) -> None:
    """The engine's check of its options (engine_build.py), with the fields' own names."""
    opts.validate()
