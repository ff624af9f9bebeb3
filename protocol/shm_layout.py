"""The shared-memory segment of one run: a header, the FFN input, the active mask, output slots,
and the doorbell words that synchronize each layer without a system call.

    [header 64 B][x: f32 max_tokens*hidden][mask: u8 n_ff][out: f32 n_slots*max_tokens*hidden]
    [thresholds: f32 n_layers][input thresholds: f32 n_layers*INPUT_SITES + 1][seq: i64 max_tokens*2]
    [request: i64 x 8][slot 0: i64 x 8]...[expert thresholds: f32 n_layers*n_experts]
    [route counts: i64 n_slots*n_layers*n_experts]
Each region starts on a 64-byte boundary; the request line and every slot line fill a cache
line of their own, so a worker spinning on the request never shares a line another one writes.

Doorbell words: request (REQ_*) and one line per slot (SLOT_*). What they mean, in which order
each side writes them and when a side spins or sleeps: protocol/doorbell.py, which is the only
module that reads or writes them. request[REQ_WHAT] says what a step is: its `StepKind` and
its layer (`step_word`, `step_of`). An FFN step reads x[:T] and writes the worker's neurons'
share into its output slot. An lm_head step (StepKind.HEAD) reads x[:T] and writes the worker's
logits into the start of its output slot, flattened. An attention step (StepKind.ATTENTION)
reads the residuals x[:T] of T decoded sequences and their (position, KV cache index) in
seq[:T], and writes the worker's heads' share of their attention output into its output slot.
A lockstep step (StepKind.LOCKSTEP) runs every layer of T decoded tokens, whose residuals
entering layer 0 are in x[:T] and (position, cache) in seq[:T] (sparsecore/lockstep.py).
The coordinator creates and unlinks the segment; workers attach and refuse a header that does
not match what they were told.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .messages import PROTOCOL_VERSION

MAGIC = b"SPINFSHM"
_HEADER = struct.Struct("<8sIIIIIII")  # magic, version, hidden, n_ff, max_tokens, n_slots, n_layers, n_experts
HEADER_BYTES = 64
SHM_PREFIX = "sparseinfer_"

# Doorbell words (int64 indices into SharedBuffers.request and SharedBuffers.slots[slot]).
# REQ_WHAT: the step's kind and layer, one word (step_word).
REQ_STEP, REQ_WHAT, REQ_TOKENS, REQ_FLAGS, REQ_COORD_SLEEPING = 0, 1, 2, 3, 4
REQ_PARTS = 5  # a lockstep step's participants: one bit per output slot
SLOT_DONE, SLOT_ACTIVE, SLOT_COMPUTE_NS, SLOT_SLEEPING = 0, 1, 2, 3
SLOT_PHASE = 4  # a lockstep decode step's progress, written by the slot's process (sparsecore/lockstep.py)
# A step's flags: dense; CATS thresholds (in shared memory); else a predictor's mask, in shared
# memory, or with FLAG_PREDICT scored by each process for its own neurons from x[1], the token's
# residual before ffn_norm (x[0] is the normed input, as always).
FLAG_DENSE, FLAG_THRESHOLD, FLAG_PREDICT = 1, 2, 4
SLEEPING = 1  # value of a sleeping word: ring this side's wake pipe (0: it spins)
LINE_WORDS = 8  # int64 words in one 64-byte cache line
# Input sparsity (TEAL): per layer, the threshold on |input| of each group of matrices sharing an
# input: Q/K/V (the normed residual), O (the attention output), gate/up (the FFN's normed input),
# down (the FFN's hidden activation). A one-token product skips the inputs at or below it; a
# negative value: dense. Every process's input-major twins point at these words
# (sparsecore/kernels: FileMatrix.with_input_major), so the coordinator changes the level for all.
INPUT_SITES = ("attn_in", "attn_out", "ffn_in", "ffn_h")
# The lm_head's input (the final normed hidden state) has one more word after them: its twin
# scores every vocabulary row from the inputs above it, then the best candidates exactly
# (sparsecore/lm_head.py).


class StepKind(IntEnum):
    """What a posted step computes (request[REQ_WHAT], with the layer: step_word)."""
    FFN = 0  # the worker's neurons of one layer
    HEAD = 1  # logits of the worker's lm_head vocabulary rows (layer 0)
    ATTENTION = 2  # the worker's heads of one layer's attention of decoded tokens
    LOCKSTEP = 3  # every layer of decoded tokens in lockstep (layer 0)


KIND_SHIFT = 32  # request[REQ_WHAT] = kind << KIND_SHIFT | layer
_LAYER_MASK = (1 << KIND_SHIFT) - 1
_KINDS = tuple(StepKind)  # by value: decoding a word is an index, not an enum lookup (per step)


def step_word(kind: StepKind, layer: int = 0) -> int:
    """request[REQ_WHAT] of a step of `kind` on `layer` (0 for the steps of no one layer)."""
    if not 0 <= layer <= _LAYER_MASK:
        raise ValueError(f"layer {layer} outside 0..{_LAYER_MASK}")
    return int(kind) << KIND_SHIFT | layer


def step_of(word: int) -> tuple[StepKind, int]:
    """(kind, layer) of a request[REQ_WHAT] word; ValueError for a kind this process does not know."""
    kind = word >> KIND_SHIFT
    if not 0 <= kind < len(_KINDS):
        raise ValueError(f"request word {word:#x}: unknown step kind {kind}")
    return _KINDS[kind], word & _LAYER_MASK


class LayoutError(Exception):
    pass


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ShmLayout:
    hidden: int
    n_ff: int
    max_tokens: int
    n_slots: int
    n_layers: int = 1
    n_experts: int = 0  # a routed model's experts per layer (their CATS thresholds), else 0

    @property
    def x_offset(self) -> int:
        return HEADER_BYTES

    @property
    def mask_offset(self) -> int:
        return _align(self.x_offset + 4 * self.max_tokens * self.hidden)

    @property
    def out_offset(self) -> int:
        return _align(self.mask_offset + self.n_ff)

    @property
    def thresholds_offset(self) -> int:
        return _align(self.out_offset + 4 * self.n_slots * self.max_tokens * self.hidden)

    @property
    def input_thresholds_offset(self) -> int:
        return _align(self.thresholds_offset + 4 * self.n_layers)

    @property
    def seq_offset(self) -> int:
        return _align(self.input_thresholds_offset + 4 * (self.n_layers * len(INPUT_SITES) + 1))

    @property
    def request_offset(self) -> int:
        return _align(self.seq_offset + 8 * 2 * self.max_tokens)

    @property
    def slots_offset(self) -> int:
        return self.request_offset + 8 * LINE_WORDS

    @property
    def expert_thresholds_offset(self) -> int:
        return self.slots_offset + 8 * LINE_WORDS * self.n_slots

    @property
    def route_counts_offset(self) -> int:
        return _align(self.expert_thresholds_offset + 4 * self.n_layers * self.n_experts)

    @property
    def size(self) -> int:
        return _align(self.route_counts_offset + 8 * self.n_slots * self.n_layers * self.n_experts)

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, PROTOCOL_VERSION, self.hidden, self.n_ff, self.max_tokens, self.n_slots,
                            self.n_layers, self.n_experts)

    @classmethod
    def from_header(cls, buf) -> "ShmLayout":
        magic, version, hidden, n_ff, max_tokens, n_slots, n_layers, n_experts = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise LayoutError(f"shared memory has magic {magic!r}, expected {MAGIC!r}")
        if version != PROTOCOL_VERSION:
            raise LayoutError(f"shared memory layout version {version}, this process speaks {PROTOCOL_VERSION}")
        return cls(hidden, n_ff, max_tokens, n_slots, n_layers, n_experts)


class _Mapping:
    """A mapped segment: what SharedBuffers uses of it (buf, name, size, close)."""

    def __init__(self, mm: mmap.mmap, name: str):
        self._mm, self.name, self.size = mm, name, len(mm)
        self.buf = memoryview(mm)

    def close(self) -> None:
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes at exit
            pass


def new_segment_name() -> str:
    """A fresh segment name. The creator's pid in it lets a leak check tell orphans from live runs."""
    return f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


class SharedBuffers:
    """numpy views onto the segment: x (max_tokens, hidden), mask (n_ff,), out (slots, max_tokens,
    hidden), thresholds (n_layers,), input_thresholds (n_layers, INPUT_SITES), head_threshold (1,),
    seq (max_tokens, 2) int64, the doorbell: request (8,) and slots (n_slots, 8) int64, and a
    routed model's expert_thresholds (n_layers, n_experts): CATS's threshold of each expert,
    which a threshold step of a routed layer applies to each chosen expert (sparsecore/shard.py
    ExpertsLayer) in place of the layer's, and its route_counts (n_slots, n_layers, n_experts)
    int64: how many tokens chose each expert that the slot's process computes (its part of the
    routed work), counted by that process alone (sparsecore/experts.py ExpertsLayer.count_into)
    since the run began and read by the coordinator for the measured routed share."""

    def __init__(self, shm: "_Mapping", layout: ShmLayout, owner: bool):
        self.shm, self.layout, self.owner = shm, layout, owner
        buf = shm.buf
        L = layout
        self.x = np.ndarray((L.max_tokens, L.hidden), np.float32, buf, L.x_offset)
        self.mask = np.ndarray((L.n_ff,), np.uint8, buf, L.mask_offset)
        self.out = np.ndarray((L.n_slots, L.max_tokens, L.hidden), np.float32, buf, L.out_offset)
        self.thresholds = np.ndarray((L.n_layers,), np.float32, buf, L.thresholds_offset)
        self.input_thresholds = np.ndarray((L.n_layers, len(INPUT_SITES)), np.float32, buf,
                                           L.input_thresholds_offset)
        self.head_threshold = np.ndarray((1,), np.float32, buf,
                                         L.input_thresholds_offset + 4 * L.n_layers * len(INPUT_SITES))
        self.seq = np.ndarray((L.max_tokens, 2), np.int64, buf, L.seq_offset)
        self.request = np.ndarray((LINE_WORDS,), np.int64, buf, L.request_offset)
        self.slots = np.ndarray((L.n_slots, LINE_WORDS), np.int64, buf, L.slots_offset)
        self.expert_thresholds = np.ndarray((L.n_layers, L.n_experts), np.float32, buf, L.expert_thresholds_offset)
        self.route_counts = np.ndarray((L.n_slots, L.n_layers, L.n_experts), np.int64, buf, L.route_counts_offset)

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, layout: ShmLayout, name: str | None = None) -> "SharedBuffers":
        """A new segment, mode 0600 (the random name avoids collisions). Made directly, not
        through SharedMemory: that registers it with Python's resource tracker, a process of its
        own (14 MB resident, a third of what a 270M model's worker adds) whose one job, removing
        the name if the coordinator dies, the run's reaper does (coordinator/runtime/reaper.py)."""
        name = name or new_segment_name()
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.size)
            shm = _Mapping(mmap.mmap(fd, layout.size), name)
        except BaseException:
            os.close(fd)
            os.unlink(f"/dev/shm/{name}")
            raise
        os.close(fd)
        shm.buf[:HEADER_BYTES] = layout.header().ljust(HEADER_BYTES, b"\0")
        made = cls(shm, layout, owner=True)
        made.input_thresholds[:] = -1.0  # dense until a level is set
        made.head_threshold[:] = -1.0
        made.expert_thresholds[:] = -1.0
        return made

    @classmethod
    def attach(cls, name: str, expect: ShmLayout | None = None) -> "SharedBuffers":
        """Map an existing segment. Mapped directly (not through SharedMemory) so that Python's
        resource tracker never learns of it: only the creator may unlink the segment."""
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except FileNotFoundError:
            raise LayoutError(f"shared memory segment {name} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise LayoutError(f"shared memory segment {name} is {size} bytes, too small for a header")
            mapping = _Mapping(mmap.mmap(fd, size), name)
        finally:
            os.close(fd)
        try:
            layout = ShmLayout.from_header(mapping.buf)
            if expect is not None and layout != expect:
                raise LayoutError(f"shared memory layout {layout} does not match expected {expect}")
            if size < layout.size:
                raise LayoutError(f"shared memory segment is {size} bytes, layout needs {layout.size}")
        except BaseException:
            mapping.close()
            raise
        return cls(mapping, layout, owner=False)

    def unlink(self) -> None:
        """Remove the segment's name (creator only). Mappings already made stay valid, and the
        memory is freed when the last one goes, so nothing is left whoever is killed later."""
        if self.owner and not getattr(self, "_unlinked", False):
            self._unlinked = True
            try:
                os.unlink(f"/dev/shm/{self.shm.name}")
            except FileNotFoundError:
                pass

    def close(self) -> None:
        # Views must go before the mmap can close.
        self.x = self.mask = self.out = self.thresholds = self.input_thresholds = self.head_threshold = None
        self.seq = self.request = self.slots = self.expert_thresholds = None
        try:
            self.shm.close()
        except BufferError:
            pass
        self.unlink()
