/* The AVX2 compilation unit: the kernels of the AVX2 level and of the two 256-bit vpdpbusd levels
 * (AVX-VNNI's VEX copy, and the EVEX copy AVX-512 VNNI CPUs run: interleaved_256.c, cols_256.c),
 * and fill_kernels_avx2, which writes them into the kernel table (kernel_table.h) over the
 * portable entries. A unit of its own, linked into the one extension with _kernels.c and
 * simd_avx512.c: each function carries its level's target attribute (base.c), as in one unit,
 * so every unit builds with the same portable flags and runs on any x86-64 CPU until a level is
 * chosen; on other machines the unit is empty. */
#include "base.c"
#if HAVE_X86
/* the parts in _kernels.c's order (each uses only what comes before it); what this unit does not
 * call is not compiled into it */
#include "blocks_generic.c"
#include "blocks_avx2.c"
#include "interleaved_generic.c"
#include "interleaved_256.c"
#include "cols_generic.c"
#include "cols_256.c"
#include "cols_kquants_generic.c"
#include "cols_kquants_avx2.c"
#include "attention_avx2.c"
#include "kernel_table.h"

/* the per-type entries: the level's kernel with the type a constant (tables.c says why) */
#define AVX2_T(T)                                                                                               \
    AVX2 static float dot_exact_avx2_##T(const uint8_t *w, const float *x, int n) { return dot_exact_avx2(T_##T, w, x, n); } \
    AVX2 static void dots_exact_avx2_##T(const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) { \
        dots_exact_avx2(T_##T, w, x, ldx, n, B, y, ldy);                                                       \
    }                                                                                                           \
    AVX2 static float dot_fast_avx2_##T(const uint8_t *w, const q8blk *xq, int nb) { return dot_fast_avx2(T_##T, w, xq, nb); } \
    AVX2 static void dots_fast_avx2_##T(const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) { \
        dots_fast_avx2(T_##T, w, xq, ldq, nb, B, y, ldy);                                                      \
    }                                                                                                           \
    AVX2 static void axpy_avx2_##T(const uint8_t *w, float a, float *y, int n) { axpy_avx2(T_##T, w, a, y, n); }
FOR_TYPES(AVX2_T)

/* Q2_K and Q3_K at every SIMD level: AVX2's kernels on the tokens' sums over 16 values (k23_pack) */
#define K23_T(T)                                                                                                \
    AVX2 static float dot_packed_k23_##T(const uint8_t *w, const q8blk *xq, const xpair *xp, int nb) {          \
        return dot_fast_k23(T_##T, w, xq, (const float *)xp, nb);                                               \
    }                                                                                                           \
    AVX2 static void dots_packed_k23_##T(const uint8_t *w, const q8blk *xq, int64_t ldq, const xpair *xp, int nb, int B, \
                                         int alone, float *y, int64_t ldy) {                                    \
        (void)alone;                                                                                            \
        dots_fast_k23(T_##T, w, xq, ldq, (const float *)xp, nb, B, y, ldy);                                     \
    }
K23_T(Q2_K) K23_T(Q3_K)

/* the float files' rows as float32 (a prompt's GEMM tiles): the vector conversions */
AVX2 static void dequant_avx2_F16(const uint8_t *w, int n, float *o) { half_row_avx2(T_F16, w, n, o); }
AVX2 static void dequant_avx2_BF16(const uint8_t *w, int n, float *o) { half_row_avx2(T_BF16, w, n, o); }

static void k23_pack_t(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    (void)t;
    k23_pack(xq, ldq, nb, B, out);
}
static int64_t k23_size(int nb, int B) { return B * k23_ld(nb); }
static int64_t r16_size(int nb, int B) { return B * r16_ld(nb); }
static const packer PACK_K23 = {k23_pack_t, k23_ld, k23_size};
static const packer PACK_R16 = {r16_pack, r16_ld, r16_size};

void fill_kernels_avx2(kernel_table *k) {
#define SET_AVX2(T)                                                                                             \
    k->dot_exact[T_##T] = dot_exact_avx2_##T, k->dots_exact[T_##T] = dots_exact_avx2_##T;                       \
    k->dot_fast[T_##T] = dot_fast_avx2_##T, k->dots_fast[T_##T] = dots_fast_avx2_##T;                           \
    k->axpy[T_##T] = k->axpy_fast[T_##T] = axpy_avx2_##T;
    FOR_TYPES(SET_AVX2)
#define SET_K23(T) k->pack[T_##T] = &PACK_K23, k->dot_packed[T_##T] = dot_packed_k23_##T, k->dots_packed[T_##T] = dots_packed_k23_##T;
    SET_K23(Q2_K) SET_K23(Q3_K)
    k->quantize_q8 = quantize_q8_avx2;
    k->x16_rows = x16_rows_avx2;
    k->r16_pack = &PACK_R16, k->r16_dot = r16_dot_avx2, k->r16_rows = r16_rows_avx2;
    k->cols_mask = cols_mask_avx2;
    k->cols_fast = cols_fast_avx2, k->kq_fast = kq_fast_avx2;
    k->sum_squares = sum_squares_avx2, k->attend8 = attend_heads_avx2;
    k->dequant[T_F16] = dequant_avx2_F16, k->dequant[T_BF16] = dequant_avx2_BF16;
    if (use_dp256 == 1) {  /* the interleaved layouts' and the twins' sums with VEX vpdpbusd */
        k->x16_rows = x16_rows_avxvnni, k->r16_dot = r16_dot_avxvnni, k->r16_rows = r16_rows_avxvnni;
        k->cols_fast = cols_fast_avxvnni;
    } else if (use_dp256 == 2) {  /* the same, EVEX-encoded */
        k->x16_rows = x16_rows_vnni256, k->r16_dot = r16_dot_vnni256, k->r16_rows = r16_rows_vnni256;
        k->cols_fast = cols_fast_vnni256;
    }
}
#endif
