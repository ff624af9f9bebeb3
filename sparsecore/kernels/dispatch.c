/* _kernels.c, part: the level dispatch: each product at the instruction-set level in use (use_avx2,
 * use_dp256, use_vnni), with the activations packed as that level's kernels read them. */

static void quantize_q8(const float *x, int n, q8blk *out) {
#if HAVE_X86
    if (use_avx2) { quantize_q8_avx2(x, n, out); return; }
#endif
    quantize_q8_c(x, n, out);
}

static inline void axpy(int t, const uint8_t *w, float a, float *y, int n) {
#if HAVE_X86
    if (use_avx2) { axpy_avx2(t, w, a, y, n); return; }
#endif
    axpy_c(t, w, a, y, n);
}

/* Fast mode's axpy (down_t rows of an active neuron): Q4_0 on VNNI CPUs in 512-bit steps,
 * (a d) (q - 8) added to y with one rounding; exact mode keeps axpy's arithmetic. */
static inline void axpy_any(int t, const uint8_t *w, float a, float *y, int n, int fast) {
#if HAVE_X86
    if (fast && use_vnni && t == T_Q4_0) { axpy_q4_0_vnni(w, a, y, n); return; }
#endif
    axpy(t, w, a, y, n);
}

static inline float dot_exact(int t, const uint8_t *w, const float *x, int n) {
#if HAVE_X86
    if (use_avx2) return dot_exact_avx2(t, w, x, n);
#endif
    return dot_exact_c(t, w, x, n);
}

/* VNNI's fast-mode products read the activations repacked (xpair), once per product, into a
 * buffer of the calling thread (calls release the GIL), grown as needed and kept: NULL where
 * the product takes another path (then xq is read), or if it cannot grow (then AVX2's path). */
static _Thread_local xpair *xp_buf;
static _Thread_local int64_t xp_cap;
static const xpair *pack_x(mat m, const q8blk *xq, int64_t ldq, int n, int B, int fast) {
#if HAVE_X86
    int t = m.t, nb = n / QK;
    int64_t need = is_r16(m) ? B * r16_ld(nb) : is_k23(t) ? B * k23_ld(nb) : xp_size(nb, B);
    /* AVX2 packs for R16 rows and Q2_K/Q3_K only (its other products read xq); VNNI for the
     * types it has steps for (vnni_type); Q2_K and Q3_K take AVX2's products at every level
     * (k23_pack: the tokens' sums over 16 values), the other types without VNNI steps read xq */
    if (!(fast && is_quant(t) && ((use_avx2 && (is_r16(m) || is_k23(t))) || (use_vnni && (is_r16(m) || vnni_type(t))))) ||
        need == 0)
        return NULL;
    if (need > xp_cap) {
        free(xp_buf);
        xp_buf = aligned_alloc(64, need * sizeof(xpair));
        xp_cap = xp_buf ? need : 0;
        if (!xp_buf) return NULL;
    }
    if (is_r16(m)) r16_pack(t, xq, ldq, nb, B, xp_buf);
    else if (is_k23(t)) k23_pack(xq, ldq, nb, B, xp_buf);
    else vnni_pack(t, xq, ldq, nb, B, xp_buf);
    return xp_buf;
#else
    return NULL;
#endif
}

/* whether b's products read the activations as a's do (pack_x): the same type and layout */
static inline int same_pack(mat a, mat b) { return a.t == b.t && a.layout == b.layout; }

static inline int64_t xp_ld_any(mat m, int n) {  /* one token's share of pack_x's buffer */
#if HAVE_X86
    return is_r16(m) ? r16_ld(n / QK) : is_k23(m.t) ? k23_ld(n / QK) : xp_ld(n / QK);
#else
    (void)m, (void)n;
    return 0;
#endif
}

#if HAVE_X86
/* one R16 row times one token packed by pack_x, at the level in use */
static inline float r16_dot(int t, const uint8_t *w, const xpair *x, int nb) {
    return use_vnni ? r16_dot_vnni(t, w, x, nb) : use_dp256 == 1 ? r16_dot_avxvnni(t, w, x, nb)
           : use_dp256 == 2 ? r16_dot_vnni256(t, w, x, nb) : r16_dot_avx2(t, w, x, nb);
}
#endif

/* row w of m . x: fast mode for quantized types; float types have no integer path and use x
 * itself. xp: xq packed by pack_x, or NULL */
static inline float dot_any(mat m, const uint8_t *w, const float *x, const q8blk *xq, const xpair *xp, int n, int fast) {
    int t = m.t;
    if (is_r16(m)) {  /* fast mode only (FileMatrix._rows) */
#if HAVE_X86
        if (xp) return r16_dot(t, w, xp, n / QK);
#endif
        return r16_dot_c(t, w, xq, n / QK);
    }
    if (fast && is_quant(t)) {
#if HAVE_X86
        if (xp && is_k23(t)) return dot_fast_k23(t, w, xq, (const float *)xp, n / QK);
        if (xp) return dot_fast_vnni(t, w, xp, n / QK);
        if (use_avx2) return dot_fast_avx2(t, w, xq, n / QK);
#endif
        return dot_fast_c(t, w, xq, n / QK);
    }
    return dot_exact(t, w, x, n);
}

/* B tokens against row w of m (see dots_exact_avx2): the row is read from memory once; the
 * portable path calls the one-token dot per token while the row is in L1. */
static void dots_any(mat m, const uint8_t *w, const float *x, int64_t ldx, const q8blk *xq, int64_t ldq,
                     const xpair *xp, int n, int fast, int B, int alone, float *y, int64_t ldy) {
    int t = m.t;
    if (is_r16(m)) {  /* the row stays in L1 across the tokens */
        for (int b = 0; b < B; b++) {
#if HAVE_X86
            if (xp) { y[b * ldy] = r16_dot(t, w, xp + b * r16_ld(n / QK), n / QK); continue; }
#endif
            y[b * ldy] = r16_dot_c(t, w, xq + b * ldq, n / QK);
        }
        return;
    }
    if (fast && is_quant(t)) {
#if HAVE_X86
        if (xp && is_k23(t)) { dots_fast_k23(t, w, xq, ldq, (const float *)xp, n / QK, B, y, ldy); return; }
        if (xp) { dots_fast_vnni(t, w, xp, n / QK, B, alone, y, ldy); return; }
        if (use_avx2) { dots_fast_avx2(t, w, xq, ldq, n / QK, B, y, ldy); return; }
#endif
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_c(t, w, xq + b * ldq, n / QK);
        return;
    }
#if HAVE_X86
    if (use_avx2) { dots_exact_avx2(t, w, x, ldx, n, B, y, ldy); return; }
#endif
    for (int b = 0; b < B; b++) y[b * ldy] = dot_exact_c(t, w, x + b * ldx, n);
}

/* Rows [start, start + n_rows) (start on a group) of an X16 matrix, columns [col0, col0 + n),
 * for B tokens' q8 blocks (fast mode only: the layout has no float path) */
static _Thread_local void *hs_buf;
static _Thread_local int64_t hs_cap;
static void x16_products(mat m, int64_t start, int64_t n_rows, int64_t col0, int n, const q8blk *xq, int64_t ldq,
                         int B, float *y, int64_t ldy) {
    int bs = block_size(m.t), nb = n / bs;
    const uint8_t *g = m.base + (start / 16) * m.stride + (col0 / bs) * x16_block_bytes(m.t);
    int64_t ldh = 2 * (n / QK);
    int32_t *hs = NULL;
    if (m.t == T_Q6_K || is_k23(m.t)) {  /* each token's sums of x over 16 values: the sub-blocks' offsets */
        hs = grown(&hs_buf, &hs_cap, sizeof(int32_t) * B * ldh);
        if (!hs) {  /* out of memory for a few KB: zeros rather than garbage */
            for (int b = 0; b < B; b++) memset(y + b * ldy, 0, sizeof(float) * n_rows);
            return;
        }
        for (int b = 0; b < B; b++)
            for (int64_t i = 0; i < ldh; i++) {
                int32_t sum = 0;
                for (int j = 0; j < 16; j++) sum += xq[b * ldq + i / 2].q[16 * (i % 2) + j];
                if (m.t == T_Q2_K) {  /* times x's scale, as a float (k23_pack's): the mins' factors */
                    float xs = xq[b * ldq + i / 2].d * (float)sum;
                    memcpy(hs + b * ldh + i, &xs, 4);
                } else
                    hs[b * ldh + i] = sum;
            }
    }
#if HAVE_X86
    if (use_vnni) { x16_rows_vnni(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
    if (use_dp256 == 1) { x16_rows_avxvnni(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
    if (use_dp256 == 2) { x16_rows_vnni256(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
    if (use_avx2) { x16_rows_avx2(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
#endif
    x16_rows_c(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy);
}

#if HAVE_X86
/* every picked R16 row of a step in one call, at the level in use (x: r16_pack's, pack_x) */
static void r16_rows(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    if (use_vnni) r16_rows_vnni(m, rows, start, n, x, nb, y);
    else if (use_dp256 == 1) r16_rows_avxvnni(m, rows, start, n, x, nb, y);
    else if (use_dp256 == 2) r16_rows_vnni256(m, rows, start, n, x, nb, y);
    else r16_rows_avx2(m, rows, start, n, x, nb, y);
}
#endif

/* One token's product on the twin h (cols_take said it applies), at the level in use: y (R
 * floats) for the twin's rows, x (its C inputs) and, fast, their q8 blocks xq. The threshold is
 * read once here (its owner may change it between calls); the active channels and groups are
 * added to the header's counters. Returns the active channels, or -1 (no memory for a few KB:
 * the caller takes the original path). Exact mode runs the portable loop at every level. */
static int64_t cols_products(const cols_hdr *h, const float *x, const q8blk *xq, int fast, float *y) {
    if (kq_type(h->t)) return kq_products(h, x, xq, fast, y);  /* Q5_0, Q5_1, the K-quants: cols_kquants_*.c */
    int t = h->t;
    float thr = *h->thr;
    int64_t G = h->C / QK, rp = cols_rp(t, h->R), n_groups = 0, n;
    uint32_t *masks = grown(&cm_buf, &cm_cap, sizeof(uint32_t) * G);
    float *acc = rp == h->R ? y : grown(&cy_buf, &cy_cap, sizeof(float) * rp);
    if (!masks || !acc) return -1;
    for (int64_t g = 0; g < G; g++) {
#if HAVE_X86
        if (use_vnni) masks[g] = cols_mask_vnni(x + g * QK, thr);
        else if (use_avx2) masks[g] = cols_mask_avx2(x + g * QK, thr);
        else
#endif
        masks[g] = cols_mask_c(x + g * QK, thr);
        n_groups += masks[g] != 0;
    }
#if HAVE_X86
    if (fast && use_vnni) n = cols_fast_vnni(h, xq, masks, acc);
    else if (fast && use_dp256 == 1) n = cols_fast_avxvnni(h, xq, masks, acc);
    else if (fast && use_dp256 == 2) n = cols_fast_vnni256(h, xq, masks, acc);
    else if (fast && use_avx2) n = cols_fast_avx2(h, xq, masks, acc);
    else
#endif
    n = cols_products_c(h, x, xq, fast, thr, masks, acc);
    if (acc != y) memcpy(y, acc, sizeof(float) * h->R);
    cols_hdr *counts = (cols_hdr *)h;  /* the owner's memory: the counters are the header's only writable part */
    __atomic_fetch_add(&counts->n_active, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(&counts->n_groups, n_groups, __ATOMIC_RELAXED);
    return n;
}
