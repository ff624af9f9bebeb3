/* The kernel table's layout, shared by the compilation units: _kernels.c (the portable kernels,
 * the table's owner: tables.c fills it) and each instruction-set unit (simd_avx2.c,
 * simd_avx512.c), whose fill function writes its level's kernels over the entries. Included after
 * the parts that define what it names (base.c's mat, q8blk, xpair; cols_generic.c's cols_hdr). */

/* every type the kernels read (base.c's TYPES) */
#define FOR_TYPES(X) X(F32) X(F16) X(BF16) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(IQ4_NL) X(Q2_K) X(Q3_K) \
                     X(Q4_K) X(Q5_K) X(Q6_K) X(IQ4_XS) X(IQ3_XXS) X(IQ3_S) X(MXFP4)

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
typedef void (*dequant_fn)(const uint8_t *w, int n, float *o);
/* sinks: per head a logit in the softmax's denominator only (gpt-oss), or NULL */
typedef void (*attend_fn)(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                          const float *sinks, float *out);
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
    dequant_fn dequant[N_TYPES];              /* a row's n values as float32 (a prompt's GEMM tiles) */
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
    double (*sum_squares)(const float *h, int n);  /* RMSNorm's sum (NULL: the portable loop) */
    attend_fn attend8, attend16;              /* softmax attention, head sizes a multiple of 8, of 16 (NULL: portable) */
} kernel_table;

#if HAVE_X86
/* each instruction-set unit's part of the table, written over what the levels below filled:
 * AVX2 and the 256-bit vpdpbusd levels (use_dp256), simd_avx2.c; AVX-512 VNNI, simd_avx512.c */
void fill_kernels_avx2(kernel_table *k);
void fill_kernels_avx512(kernel_table *k);
#endif
