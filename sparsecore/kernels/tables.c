/* _kernels.c, part: the kernel table: every product's function at the instruction-set level in
 * use, per type where the kernel depends on the type (as ggml-cpu's type_traits_cpu), filled
 * once when the level is chosen (fill_kernels: the module's init and set_isa). dispatch.c calls
 * through it, so no product asks the level flags or compares type ids on its way to a kernel;
 * the choice of a kernel for a (level, type) is made here, in one place.
 *
 * Each per-type entry is the level's kernel with the type fixed (the *_T functions below, made
 * per type by FOR_TYPES): the kernels' bodies, which still switch on the type, are inlined into
 * them (always_inline) with the type a constant, so each entry holds its type's case alone and
 * no switch runs per row; the code of a case is what the level ran before, the same floats. A
 * type the level has no kernel of gets the portable one (the level's default case, or the
 * entry fill_kernels filled first: generic, then each level over it). */

/* every type the kernels read (base.c's TYPES) */
#define FOR_TYPES(X) X(F32) X(F16) X(BF16) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(IQ4_NL) X(Q2_K) X(Q3_K) \
                     X(Q4_K) X(Q5_K) X(Q6_K) X(IQ4_XS) X(IQ3_XXS) X(IQ3_S)

/* How a level's fast-mode products read the activations when not as q8 blocks: packed once per
 * product (pack_x) by `pack`, `ld` xpairs a token, `size` for B tokens. */
typedef struct {
    void (*pack)(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out);
    int64_t (*ld)(int nb);
    int64_t (*size)(int nb, int B);
} packer;

typedef float (*dot_exact_fn)(const uint8_t *w, const float *x, int n);
typedef void (*dots_exact_fn)(const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy);
typedef float (*dot_fast_fn)(const uint8_t *w, const q8blk *xq, int nb);
typedef void (*dots_fast_fn)(const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy);
/* on activations packed by the type's packer (xp), and for some kernels also their q8 blocks */
typedef float (*dot_packed_fn)(const uint8_t *w, const q8blk *xq, const xpair *xp, int nb);
typedef void (*dots_packed_fn)(const uint8_t *w, const q8blk *xq, int64_t ldq, const xpair *xp, int nb, int B,
                               int alone, float *y, int64_t ldy);
typedef void (*axpy_fn)(const uint8_t *w, float a, float *y, int n);
typedef int64_t (*cols_fast_fn)(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y);

typedef struct {
    /* per type (the file layout's rows); NULL where the type has no such kernel at this level */
    dot_exact_fn dot_exact[N_TYPES];
    dots_exact_fn dots_exact[N_TYPES];
    dot_fast_fn dot_fast[N_TYPES];            /* on q8 blocks */
    dots_fast_fn dots_fast[N_TYPES];
    const packer *pack[N_TYPES];              /* where fast products read packed activations, else NULL */
    dot_packed_fn dot_packed[N_TYPES];        /* ... and the kernels that read them */
    dots_packed_fn dots_packed[N_TYPES];
    axpy_fn axpy[N_TYPES];                    /* exact mode's axpy (down_t rows) */
    axpy_fn axpy_fast[N_TYPES];               /* fast mode's */
    /* per level */
    void (*quantize_q8)(const float *x, int n, q8blk *out);
    void (*x16_rows)(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq, int64_t ldq,
                     const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy);
    const packer *r16_pack;                   /* R16 rows' packed activations (NULL: r16_dot_c on q8 blocks) */
    float (*r16_dot)(int t, const uint8_t *w, const xpair *x, int nb);
    void (*r16_rows)(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y);
    uint32_t (*cols_mask)(const float *x, float thr);
    cols_fast_fn cols_fast;                   /* twins of Q4_0, Q4_1, Q8_0 (NULL: the portable loop) */
    cols_fast_fn kq_fast;                     /* twins of Q5_0, Q5_1 and the K-quants */
} kernel_table;

static kernel_table kern;

/* ---- the per-type entries: each level's kernel with the type fixed ----------------------- */

#define GENERIC_T(T)                                                                                            \
    static float dot_exact_c_##T(const uint8_t *w, const float *x, int n) { return dot_exact_of(T_##T, w, x, n); } \
    static void dots_exact_c_##T(const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) { \
        for (int b = 0; b < B; b++) y[b * ldy] = dot_exact_of(T_##T, w, x + b * ldx, n);                          \
    }                                                                                                           \
    static float dot_fast_c_##T(const uint8_t *w, const q8blk *xq, int nb) { return dot_fast_of(T_##T, w, xq, nb); } \
    static void dots_fast_c_##T(const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) { \
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_of(T_##T, w, xq + b * ldq, nb);                         \
    }                                                                                                           \
    static void axpy_c_##T(const uint8_t *w, float a, float *y, int n) { axpy_of(T_##T, w, a, y, n); }
FOR_TYPES(GENERIC_T)

#if HAVE_X86
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

static void k23_pack_t(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    (void)t;
    k23_pack(xq, ldq, nb, B, out);
}
static int64_t k23_size(int nb, int B) { return B * k23_ld(nb); }
static int64_t r16_size(int nb, int B) { return B * r16_ld(nb); }
static const packer PACK_K23 = {k23_pack_t, k23_ld, k23_size};
static const packer PACK_VNNI = {vnni_pack, xp_ld, xp_size};
static const packer PACK_R16 = {r16_pack, r16_ld, r16_size};
#endif

/* ---- filling the table for the level in use (use_avx2, use_dp256, use_vnni, use_vbmi) --------- */

static void fill_kernels(void) {
    kernel_table k;
    memset(&k, 0, sizeof k);
#define SET_GENERIC(T)                                                                                          \
    k.dot_exact[T_##T] = dot_exact_c_##T, k.dots_exact[T_##T] = dots_exact_c_##T;                               \
    k.dot_fast[T_##T] = dot_fast_c_##T, k.dots_fast[T_##T] = dots_fast_c_##T;                                   \
    k.axpy[T_##T] = k.axpy_fast[T_##T] = axpy_c_##T;
    FOR_TYPES(SET_GENERIC)
    k.quantize_q8 = quantize_q8_c;
    k.x16_rows = x16_rows_c;
    k.cols_mask = cols_mask_c;
#if HAVE_X86
    if (use_avx2) {
#define SET_AVX2(T)                                                                                             \
    k.dot_exact[T_##T] = dot_exact_avx2_##T, k.dots_exact[T_##T] = dots_exact_avx2_##T;                         \
    k.dot_fast[T_##T] = dot_fast_avx2_##T, k.dots_fast[T_##T] = dots_fast_avx2_##T;                             \
    k.axpy[T_##T] = k.axpy_fast[T_##T] = axpy_avx2_##T;
        FOR_TYPES(SET_AVX2)
#define SET_K23(T) k.pack[T_##T] = &PACK_K23, k.dot_packed[T_##T] = dot_packed_k23_##T, k.dots_packed[T_##T] = dots_packed_k23_##T;
        SET_K23(Q2_K) SET_K23(Q3_K)
        k.quantize_q8 = quantize_q8_avx2;
        k.x16_rows = x16_rows_avx2;
        k.r16_pack = &PACK_R16, k.r16_dot = r16_dot_avx2, k.r16_rows = r16_rows_avx2;
        k.cols_mask = cols_mask_avx2;
        k.cols_fast = cols_fast_avx2, k.kq_fast = kq_fast_avx2;
    }
    if (use_dp256 == 1) {  /* the interleaved layouts' and the twins' sums with VEX vpdpbusd */
        k.x16_rows = x16_rows_avxvnni, k.r16_dot = r16_dot_avxvnni, k.r16_rows = r16_rows_avxvnni;
        k.cols_fast = cols_fast_avxvnni;
    } else if (use_dp256 == 2) {  /* the same, EVEX-encoded */
        k.x16_rows = x16_rows_vnni256, k.r16_dot = r16_dot_vnni256, k.r16_rows = r16_rows_vnni256;
        k.cols_fast = cols_fast_vnni256;
    }
    if (use_vnni) {
#define SET_VNNI(T)                                                                                             \
    if (vnni_type(T_##T))                                                                                       \
        k.pack[T_##T] = &PACK_VNNI, k.dot_packed[T_##T] = dot_packed_vnni_##T, k.dots_packed[T_##T] = dots_packed_vnni_##T;
        VNNI_TYPES(SET_VNNI)
        k.axpy_fast[T_Q4_0] = axpy_q4_0_vnni;
        k.x16_rows = x16_rows_vnni;
        k.r16_dot = r16_dot_vnni, k.r16_rows = r16_rows_vnni;
        k.cols_mask = cols_mask_vnni;
        k.cols_fast = cols_fast_vnni, k.kq_fast = kq_fast_vnni;
    }
#endif
    kern = k;
}
