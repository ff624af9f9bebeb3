"""Every message that crosses a process boundary, one dataclass each, encoded with msgpack.

Wire format: a msgpack array [PROTOCOL_VERSION, kind, *fields in declaration order].
Arrays never travel here: per-layer data lives in shared memory (see shm_layout.py), and
per-layer steps go through the doorbell (doorbell.py), never through messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack

PROTOCOL_VERSION = 18  # 2: doorbell words; 3: wake pipes; 4: lm_head rows; 5: no Ffn/Done; 6: Assign.fast; 7: Hello.secret; 8: no prompt messages (HTTP); 9: attention heads (Assign.attn_heads, kv pool, shm seq); 10: predictors in the shards (Assign.predictor_path, Ready.predicts, FLAG_PREDICT); 11: lockstep decode steps (LOCKSTEP_LAYER, SLOT_PHASE, Ready.lockstep); 12: Assign.interleave; 13: input thresholds (INPUT_SITES), Assign.input_sparse; 14: typed steps (REQ_WHAT: StepKind and layer); 15: experts' CATS thresholds (ShmLayout.n_experts); 16: the layout cache (Assign.layout_cache, cold_units); 17: experts owned whole or not at all (Assign.experts, Ready.experts; the shared segment's route counts); 18: dealt experts (Assign.deal)


class ProtocolError(Exception):
    """A message that cannot be decoded: wrong version, unknown kind, wrong fields."""


# ---- coordinator <-> workers -------------------------------------------------------------

@dataclass
class Hello:
    """Worker -> coordinator, first thing after connecting."""
    worker_id: int
    role: str  # "gpu" or "cpu"
    pid: int
    secret: str = ""  # the run's secret (protocol.addresses.read_secret): proves it is our worker


# How a process keeps its weights in memory (sparsecore.ffn implements each): float32, int8
# with one scale per row, float16, or "gguf": the file's own blocks, memory-mapped, computed on
# by the native kernels (sparsecore/kernels). Here, beside the field that carries it, so the CLI can offer
# the choices without importing torch.
WEIGHT_FORMATS = ("f32", "int8", "f16", "gguf")


@dataclass
class Assign:
    """Coordinator -> worker: what to load. Neuron indices are int32 bytes, one entry a layer."""
    model_path: str
    shm_name: str
    slot: int
    layers: list[int]
    neurons: list[bytes]
    threads: int = 1
    device: str = "auto"
    weights: str = "f32"  # how the worker keeps its FFN rows: one of WEIGHT_FORMATS
    # Doorbell: how long to spin on shared memory for the next step before sleeping (0: never
    # spin).
    spin_us: int = 0
    # Wake pipes (protocol.doorbell.WakePipe): the worker's own, which it polls while it
    # sleeps, and the coordinator's, which it rings when a step is done.
    wake_pipe: str = ""
    coordinator_pipe: str = ""
    # [start, stop): vocabulary rows of the output projection this worker computes in lm_head
    # steps (shm_layout.StepKind.HEAD); empty: none.
    head_rows: list[int] = field(default_factory=list)
    # With weights "gguf": quantize activations to 8 bits (llama.cpp's arithmetic) instead of
    # multiplying float32 activations by the dequantized blocks (exact, the oracle's).
    fast: bool = False
    # [h0, h1): query heads of every layer whose share of decoded tokens' attention this worker
    # computes (shm_layout.StepKind.ATTENTION steps); empty: none. The KV caches are in
    # the pool the worker inherited as descriptor kv_fd, of kv_shape (sparsecore.kv_pool.KvShape's
    # fields in order).
    attn_heads: list[int] = field(default_factory=list)
    kv_fd: int = -1
    kv_shape: list[int] = field(default_factory=list)
    # A predictor file (blk.N.fc1/fc2, thresholds): the worker scores its own neurons in
    # FLAG_PREDICT steps (sparsecore/predictor_rows.py); empty: the coordinator sends masks.
    predictor_path: str = ""
    # Fast mode: which of this worker's FFN rows to hold interleaved 16 by 16
    # (FileMatrix.interleave): "" none (the engine picks rows by predictors), "gate" (dense and
    # threshold steps), "gate+up" (the engine only decodes densely). ROW_LAYOUTS.
    interleave: str = ""
    # Which matrices get input-major twins whose one-token products skip small inputs
    # (sparsecore/input_sparsity.py, thresholds in shared memory): "" none, "down", "all".
    input_major: str = ""
    # The layout cache's directory for this model (sparsecore/kernels/layout_cache.py): repacked
    # layouts are read from it, or made and written to it; "": made at every start.
    layout_cache: str = ""
    # uint8 (n_layers, units per layer: experts, or 1) C order, 1 where the unit's layouts stay
    # mapped from the layout cache (coordinator/runtime/residency.py); empty: all in memory.
    cold_units: bytes = b""
    # A routed model's experts this worker owns: uint8 (n_layers, experts [+ 1: the shared
    # expert, where the model has one]) C order, 1 where it holds its range `neurons[layer]` of
    # that expert (under --vram-budget the GPU worker all of the most-routed experts, the others
    # ranges of the rest: coordinator/runtime/placement.py expert_plan); empty: every expert.
    experts: bytes = b""
    # [phase, dealers]: its routed layers hold the owned experts whole, and of each token's chosen
    # experts it owns it computes every dealers-th from phase (sparsecore/experts.py ExpertsLayer);
    # empty: its range of each.
    deal: list[int] = field(default_factory=list)


ROW_LAYOUTS = ("", "gate", "gate+up")


@dataclass
class Ready:
    """Worker -> coordinator after its weights are loaded."""
    worker_id: int
    role: str
    pid: int
    n_neurons: int
    device: str
    load_s: float
    weight_bytes: int = 0  # FFN weights held in memory, in the Assign's weight format
    predicts: bool = False  # it loaded the Assign's predictor for every layer it owns neurons of
    lockstep: bool = False  # it can take part in lockstep decode steps (sparsecore/lockstep.py)
    # a routed model's experts it holds rows of: uint8 (n_layers, experts) C order; empty: a dense model
    experts: bytes = b""


@dataclass
class WorkerFailed:
    """Worker -> coordinator when it cannot go on (bad file, out of memory, ...)."""
    worker_id: int
    role: str
    reason: str


@dataclass
class Shutdown:
    """Coordinator -> worker: exit now."""


# Clients speak HTTP to the coordinator (coordinator/serve/); ZeroMQ is only between the
# coordinator and its workers.
MESSAGE_TYPES = [Hello, Assign, Ready, WorkerFailed, Shutdown]
_KIND = {cls: i for i, cls in enumerate(MESSAGE_TYPES)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in MESSAGE_TYPES}

# Field types as annotated (strings: `from __future__ import annotations`) -> check of a decoded
# value, so a message of the right shape with values of the wrong type is refused at decode,
# not as a TypeError somewhere later.
_CHECKS = {
    "int": lambda v: type(v) is int,
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "float": lambda v: type(v) in (int, float),
    "int | None": lambda v: v is None or type(v) is int,
    "list[int]": lambda v: type(v) is list and all(type(x) is int for x in v),
    "bytes": lambda v: type(v) is bytes,
    "list[bytes]": lambda v: type(v) is list and all(type(x) is bytes for x in v),
}
_TYPES = {cls: tuple(_CHECKS[f.type] for f in fields(cls)) for cls in MESSAGE_TYPES}


def encode(msg) -> bytes:
    cls = type(msg)
    kind = _KIND.get(cls)
    if kind is None:
        raise ProtocolError(f"not a protocol message: {cls.__name__}")
    return msgpack.packb([PROTOCOL_VERSION, kind, *(getattr(msg, n) for n in _FIELDS[cls])],
                         use_bin_type=True)


def decode(data: bytes):
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"undecodable message ({len(data)} bytes): {type(e).__name__} {e}".rstrip()) from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise ProtocolError("message is not a [version, kind, ...] array")
    version, kind, *values = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} received, this process speaks {PROTOCOL_VERSION}")
    if type(kind) is not int or not 0 <= kind < len(MESSAGE_TYPES):
        raise ProtocolError(f"unknown message kind {kind!r}")
    cls = MESSAGE_TYPES[kind]
    names = _FIELDS[cls]
    if len(values) != len(names):
        raise ProtocolError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    for name, check, v in zip(names, _TYPES[cls], values):
        if not check(v):
            raise ProtocolError(f"{cls.__name__}.{name}: wrong type {type(v).__name__}")
    return cls(*values)
