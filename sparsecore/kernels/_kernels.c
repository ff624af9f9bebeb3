/* Native kernels on the GGUF file's own blocks (the Python side, sparsecore/kernels/: file_matrix.py
 * for a matrix's products, layouts.py for its layouts, __init__.py for the fused steps, says what
 * each entry point is for).
 *
 * THE hot function is ffn_token: one process's partial FFN for one token, in one call, reading
 * only its own rows of the memory-mapped file (no copy, no gather):
 *     for each owned neuron n:  g = act(gate[n] . x); skip unless active; h[n] = g * (up[n] . x)
 *     y = down[:, owned] . h
 * Every matrix product is a row dot product on the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * IQ4_NL, F16, BF16, F32, and in blocks of 256 the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_XS, IQ3_XXS and IQ3_S). Two arithmetic modes:
 *   exact: float32 activations times each block's dequantized values (d * q, exact in float32),
 *          summed per block and scaled: the products transformers computes on the dequantized
 *          matrix, in another summation order;
 *   fast:  the activation quantized once to 8 bits in blocks of 32 (as llama.cpp does), integer
 *          dot products per block, one float multiply per block (per sub-block of a K block: a
 *          K block of 256 spans 8 activation blocks).
 * SIMD: AVX2 (+FMA, F16C) chosen at run time where the CPU has it, else portable C; both give
 * the same integer sums in fast mode and the same products up to summation order in exact mode.
 * Where the CPU has AVX-512 VNNI (ISA level "avx512vnni"), fast mode's quantized dots use
 * vpdpbusd instead (everything else stays AVX2): the same integer sums, another float order,
 * one and the same for a token alone and in any batch.
 */

/* The source, by concern first and instruction set second (as llama.cpp's ggml-cpu lays out
 * its block formats, repacked layouts and ops), in three compilation units linked into the one
 * extension (setup.py): this one, the portable kernels and everything that calls kernels (the
 * row loops, the fused steps, the Python module); simd_avx2.c, the AVX2 and 256-bit vpdpbusd
 * levels' kernels; simd_avx512.c, AVX-512's. Each unit #includes the parts it needs in this
 * order (each part uses only what comes before it), so inlining (always_inline included) and
 * the tiles' compile-time token counts work within a level as in a single file; between units
 * only the kernel table's pointers pass (kernel_table.h): each SIMD unit fills its level's
 * entries when python_module.c's set_isa chooses the level (tables.c fill_kernels), and
 * dispatch.c calls through the table. Splitting the one unit cost no speed (measured: one core,
 * the old and the new build alternating) and gave the same floats. */
#include "base.c"                /* platform, target attributes, type ids and their table, f16, mat, level flags */
#include "blocks_generic.c"      /* the file's block formats: K-quant, Q5 and IQ4 unpacking, quantize_q8, exact and fast dots, axpy, dequant */
#include "interleaved_generic.c" /* the repacked layouts X16 and R16: bytes, repacking, portable lanes, dequant, prefetch */
#include "cols_generic.c"        /* input-major twins (L_COLS): header, bytes, repacking, masks, portable products, prefetch */
#include "cols_kquants_generic.c" /* Q5_0, Q5_1 and K-quant twins: bytes, repacking, dequant, portable products, prefetch */
#include "kernel_table.h"        /* the kernel table's layout, shared with the instruction-set units */
#include "tables.c"              /* the table itself: the portable entries, fill_kernels (the units fill the rest) */
#include "dispatch.c"            /* each product through the table: dot_any, dots_any, pack_x, x16_products, r16_rows, cols_products, kq_products */
#include "row_loops.c"           /* matvec, matmul, dequant_rows */
#include "ffn_step.c"            /* the fused FFN step: ffn_token, ffn_batch */
#include "moe_step.c"            /* routed experts: moe_route, moe_token, moe_batch (a token's or a small batch's experts in one call) */
#include "attention_generic.c"   /* RoPE and softmax attention, portable */
#include "attention_layer.c"     /* RMSNorm, attend, attn_part / attn_batch / attn_token */
#include "python_module.c"       /* argument parsing, the method table, set_isa, the module */
