/* _kernels.c, part: the kernel table: every product's function at the instruction-set level in
 * use, per type where the kernel depends on the type (as ggml-cpu's type_traits_cpu), filled
 * once when the level is chosen (fill_kernels: the module's init and set_isa). dispatch.c calls
 * through it, so no product asks the level flags or compares type ids on its way to a kernel;
 * the choice of a kernel for a (level, type) is made here, in one place.
 *
 * Each per-type entry of a SIMD level is its kernel with the type fixed (the *_T functions the
 * SIMD units make per type by FOR_TYPES): the kernels' bodies, which still switch on the type,
 * are inlined into them (always_inline) with the type a constant, so each entry holds its type's
 * case alone and no switch runs per row; the code of a case is what the level ran before, the
 * same floats. The generic level's entries call the portable kernels out of line, one switch a
 * row, as before (blocks_generic.c says why). A type a level has no kernel of gets the portable
 * one (the level's default case, or the entry filled below it: generic first, then each level
 * over it). */

static kernel_table kern;

/* ---- the generic level's per-type entries -------------------------------------------------- */

#define GENERIC_T(T)                                                                                            \
    static float dot_exact_c_##T(const uint8_t *w, const float *x, int n) { return dot_exact_c(T_##T, w, x, n); } \
    static void dots_exact_c_##T(const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) { \
        for (int b = 0; b < B; b++) y[b * ldy] = dot_exact_c(T_##T, w, x + b * ldx, n);                          \
    }                                                                                                           \
    static float dot_fast_c_##T(const uint8_t *w, const q8blk *xq, int nb) { return dot_fast_c(T_##T, w, xq, nb); } \
    static void dots_fast_c_##T(const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) { \
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_c(T_##T, w, xq + b * ldq, nb);                         \
    }                                                                                                           \
    static void axpy_c_##T(const uint8_t *w, float a, float *y, int n) { axpy_c(T_##T, w, a, y, n); }           \
    static void dequant_c_##T(const uint8_t *w, int n, float *o) { dequant_row(T_##T, w, n, o); }
FOR_TYPES(GENERIC_T)


/* ---- filling the table for the level in use (use_avx2, use_dp256, use_vnni, use_vbmi) --------- */

static void fill_kernels(void) {
    kernel_table k;
    memset(&k, 0, sizeof k);
#define SET_GENERIC(T)                                                                                          \
    k.dot_exact[T_##T] = dot_exact_c_##T, k.dots_exact[T_##T] = dots_exact_c_##T;                               \
    k.dot_fast[T_##T] = dot_fast_c_##T, k.dots_fast[T_##T] = dots_fast_c_##T;                                   \
    k.axpy[T_##T] = k.axpy_fast[T_##T] = axpy_c_##T;                                                           \
    k.dequant[T_##T] = dequant_c_##T;
    FOR_TYPES(SET_GENERIC)
    k.quantize_q8 = quantize_q8_c;
    k.x16_rows = x16_rows_c;
    k.cols_mask = cols_mask_c;
#if HAVE_X86
    if (use_avx2) fill_kernels_avx2(&k);
    if (use_vnni) fill_kernels_avx512(&k);
#endif
    kern = k;
}
