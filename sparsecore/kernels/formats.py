"""The GGUF block types the native kernels read (NATIVE_TYPES: values per block), the layouts a
matrix's rows may take and the types each takes (the file's rows, X16, R16, input-major
twins), the sizes the Python side shares with the C side (q8 blocks, the small-batch limit, a
twin's header), and the instruction set level the kernels run at (isa, set_isa,
$SPARSEINFER_ISA) with what it makes worth holding (interleaving, blocked_rows).
"""
from __future__ import annotations

import os

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import _kernels

# gguf.GGMLQuantizationType values the kernels read, and the values per block of each
NATIVE_TYPES = {0: 1, 1: 1, 30: 1, 2: 32, 3: 32, 8: 32,  # F32, F16, BF16, Q4_0, Q4_1, Q8_0
                10: 256, 11: 256, 12: 256, 13: 256, 14: 256,  # Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
                6: 32, 7: 32, 20: 32, 23: 256,  # Q5_0, Q5_1, IQ4_NL, IQ4_XS
                18: 256, 21: 256,  # IQ3_XXS, IQ3_S
                39: 32}  # MXFP4 (IQ4_NL's code paths with its own codebook and E8M0 scale: blocks_generic.c, X16 too)
Q8_BLOCK_BYTES = 40  # struct q8blk: float d, int32 s, int8 q[32]
# Most tokens the small-batch kernels take at once (base.c MAXB); larger batches (prefill)
# dequantize tiles and run a GEMM instead.
MAX_SMALL_BATCH = 16
# How a matrix's rows lie in memory, handed to the kernels beside its type (FileMatrix.args;
# base.c's L_FILE, L_X16, L_R16): the file's rows; rows interleaved 16 by 16
# (FileMatrix.interleave); each row's blocks interleaved 16 by 16 (FileMatrix.interleave_blocks)
FILE_LAYOUT, X16, R16 = 0, 1, 2
# Input-major twins (FileMatrix.with_input_major, base.c's L_COLS): the types with their products
COLS_TYPES = (2, 3, 8, 6, 7, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
# those whose twins also fuse (FileMatrix.fuse_input_major: gate | up, Q | K | V in one twin): every
# twin type. A fused twin is its parts' rows stacked, and every twin product computes each row on
# its own, so the K-quants' fuse as the Q4/Q8 twins' do: on the 1.1B Q4_K_M shape a process's
# gate | up channel row is 44 lines where gate's alone is 22 (docs/KERNELS.md)
FUSED_TYPES = COLS_TYPES
COLS_HEADER = 64  # bytes of a twin's header (cols_generic.c cols_hdr): n_active at 48, n_groups at 56
X16_TYPES = (2, 3, 6, 7, 8, 12, 14, 20, 23, 10, 11, 39)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS,
#                                                        Q2_K, Q3_K, MXFP4
R16_TYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0


# The levels with SIMD kernels for the interleaved layouts (X16 and R16), where they beat the
# file's rows for every type that has them (measurements per level and type: docs/KERNELS.md);
# the portable loops are slower than the file's rows.
SIMD_LEVELS = ("avx2", "avxvnni", "avx512vnni")


def interleaving(tensor_type: int | None = None) -> bool:
    """Whether fast mode holds rows interleaved 16 by 16 (FileMatrix.interleave) at this ISA
    level: any X16 type (None) or `tensor_type`."""
    return isa() in SIMD_LEVELS and (tensor_type is None or int(tensor_type) in X16_TYPES)


def blocked_rows() -> bool:
    """Whether rows picked by activity hold their blocks interleaved (FileMatrix.interleave_blocks,
    R16) at this ISA level."""
    return isa() in SIMD_LEVELS


def input_major_type(tensor_type) -> bool:
    """Whether a matrix of this type can have an input-major twin (FileMatrix.with_input_major;
    sparsecore/input_sparsity.py)."""
    return int(tensor_type) in COLS_TYPES


def input_major_bytes(tensor_type, n_bytes: int) -> int:
    """The bytes twins of a whole matrix of `n_bytes` in the file hold (rows past a multiple of
    128 apart), for the memory plan's `twins` row: the file's bytes scaled as the kernels lay out
    128 rows x 256 columns (the same for every type but Q4_K and Q5_K, whose scales the twin
    holds unpacked: cols_kquants_generic.c)."""
    t = int(tensor_type)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    return n_bytes * _kernels.cols_bytes(t, 128, 256) // (128 * 256 // block * size)


def isa() -> str:
    """The instruction set the kernels use on this CPU: "avx512vnni" (fast mode's integer dots
    with AVX-512 VNNI, AVX2 for the rest), "avxvnni" (the interleaved layouts' integer sums with
    256-bit vpdpbusd, AVX2 for the rest), "avx2" or "generic"; import picks the best one."""
    return _kernels.isa()


def set_isa(name: str) -> str:
    """Force "generic" (portable C), "avx2", "avxvnni" or "avx512vnni", each where the CPU has it
    (else the next one down; "avxvnni" on an AVX-512 VNNI CPU runs its code EVEX-encoded: the
    tests' way to that level); returns what is in use. Fast mode's results differ between ISA levels within
    rounding; on one level a token's result is the same alone and in any batch."""
    return _kernels.set_isa(name)


# SPARSEINFER_ISA=generic|avx2|avxvnni|avx512vnni caps the level in every process of a run (workers
# inherit it): to measure or test a lower level on a better CPU, as a user of that CPU gets it.
if os.environ.get("SPARSEINFER_ISA"):
    set_isa(os.environ["SPARSEINFER_ISA"])


def supports(tensor_type: int) -> bool:
    return int(tensor_type) in NATIVE_TYPES


def neuron_align(down_type: int, down_t: bool = False) -> int:
    """Where a range of owned neurons may start for ffn_token: down's columns are read in whole
    blocks (32, or 256 for the K-quants); a transposed down_t has a row per neuron (any range)."""
    return 1 if down_t else max(32, NATIVE_TYPES.get(int(down_type), 32))
