"""EngineOptions: everything one engine run takes (threads, context, weight format, sparsity,
decode path...), the choices its string fields allow, and `check`, which refuses a bad choice
before the model file is read. The engine (coordinator/engine.py) re-exports EngineOptions."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import WEIGHT_FORMATS

from .decode_plan import DECODE_CHOICES

SPARSE_METHODS = ("input", "cats")  # EngineOptions.sparse_method


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
    # Which path decoded tokens take (coordinator/decode_plan.py, DECODE_CHOICES): "auto", the
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


def check(opts: EngineOptions) -> None:
    """ValueError naming a weight format or decode path that does not exist (the sparse
    method is checked once the file's predictors are known: engine_build.py)."""
    if opts.weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {opts.weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    if opts.decode_path not in DECODE_CHOICES:
        raise ValueError(f"decode path {opts.decode_path!r}: one of {', '.join(DECODE_CHOICES)}")
