/* The AVX-512 compilation unit: the AVX-512 VNNI level's kernels (fast mode's dots with
 * vpdpbusd, the interleaved layouts' and twins' 512-bit tiles, softmax attention; AVX512_VBMI's
 * IQ3 steps) and fill_kernels_avx512, which writes them into the kernel table over the AVX2
 * level's entries (the level runs AVX2's kernels for everything else). Built as simd_avx2.c is:
 * the same flags, each function with its level's target attribute. */
#include "base.c"
#if HAVE_X86
/* the parts in _kernels.c's order (each uses only what comes before it); what this unit does not
 * call is not compiled into it */
#include "blocks_generic.c"
#include "blocks_avx2.c"
#include "blocks_avx512.c"
#include "interleaved_generic.c"
#include "interleaved_256.c"
#include "interleaved_avx512.c"
#include "cols_generic.c"
#include "cols_256.c"
#include "cols_avx512.c"
#include "cols_kquants_generic.c"
#include "cols_kquants_avx2.c"
#include "cols_kquants_avx512.c"
#include "attention_avx2.c"
#include "attention_avx512.c"
#include "kernel_table.h"

/* the types with AVX-512 VNNI steps (vnni_type; IQ3_XXS and IQ3_S taken only with AVX512_VBMI) */
#define VNNI_TYPES(X) X(Q4_0) X(Q4_1) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ3_XXS) X(IQ3_S)
#define VNNI_T(T)                                                                                               \
    VNNI static float dot_packed_vnni_##T(const uint8_t *w, const q8blk *xq, const xpair *xp, int nb) {         \
        (void)xq;                                                                                               \
        return dot_fast_vnni(T_##T, w, xp, nb);                                                                 \
    }                                                                                                           \
    VNNI static void dots_packed_vnni_##T(const uint8_t *w, const q8blk *xq, int64_t ldq, const xpair *xp, int nb, int B, \
                                          int alone, float *y, int64_t ldy) {                                   \
        (void)xq, (void)ldq;                                                                                    \
        dots_fast_vnni(T_##T, w, xp, nb, B, alone, y, ldy);                                                     \
    }
VNNI_TYPES(VNNI_T)
static const packer PACK_VNNI = {vnni_pack, xp_ld, xp_size};

void fill_kernels_avx512(kernel_table *k) {
#define SET_VNNI(T)                                                                                             \
    if (vnni_type(T_##T))                                                                                       \
        k->pack[T_##T] = &PACK_VNNI, k->dot_packed[T_##T] = dot_packed_vnni_##T, k->dots_packed[T_##T] = dots_packed_vnni_##T;
    VNNI_TYPES(SET_VNNI)
    k->axpy_fast[T_Q4_0] = axpy_q4_0_vnni;
    k->x16_rows = x16_rows_vnni;
    k->r16_dot = r16_dot_vnni, k->r16_rows = r16_rows_vnni;
    k->cols_mask = cols_mask_vnni;
    k->cols_fast = cols_fast_vnni, k->kq_fast = kq_fast_vnni;
    k->attend16 = attend_heads_avx512;
}
#endif
