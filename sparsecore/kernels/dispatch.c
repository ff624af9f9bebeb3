/* _kernels.c, part: the level dispatch: each product through the kernel table (tables.c: the
 * level in use's kernels, per type), with the activations packed as that level's kernels read
 * them. */

static inline void quantize_q8(const float *x, int n, q8blk *out) { kern.quantize_q8(x, n, out); }

/* a row of down_t times a, added to y (n): exact mode's arithmetic, or fast mode's (Q4_0 on VNNI
 * CPUs in 512-bit steps, (a d) (q - 8) added to y with one rounding) */
static inline void axpy_any(int t, const uint8_t *w, float a, float *y, int n, int fast) {
    (fast ? kern.axpy_fast : kern.axpy)[t](w, a, y, n);
}

/* The level's packer of m's activations in fast mode (R16 rows, or the type's), or NULL where its
 * products read the q8 blocks themselves. */
static inline const packer *packer_of(mat m) { return is_r16(m) ? kern.r16_pack : kern.pack[m.t]; }

/* Fast-mode products that read the activations packed (the table's pack) get them once per
 * product, into a buffer of the calling thread (calls release the GIL), grown as needed and
 * kept: NULL where the product takes another path (then xq is read), or if it cannot grow
 * (then the level's kernels on q8 blocks). */
static _Thread_local xpair *xp_buf;
static _Thread_local int64_t xp_cap;
static const xpair *pack_x(mat m, const q8blk *xq, int64_t ldq, int n, int B, int fast) {
    const packer *p = fast ? packer_of(m) : NULL;
    int64_t need = p ? p->size(n / QK, B) : 0;
    if (need == 0) return NULL;
    if (need > xp_cap) {
        free(xp_buf);
        xp_buf = aligned_alloc(64, need * sizeof(xpair));
        xp_cap = xp_buf ? need : 0;
        if (!xp_buf) return NULL;
    }
    p->pack(m.t, xq, ldq, n / QK, B, xp_buf);
    return xp_buf;
}

/* whether b's products read the activations as a's do (pack_x): the same type and layout */
static inline int same_pack(mat a, mat b) { return a.t == b.t && a.layout == b.layout; }

static inline int64_t xp_ld_any(mat m, int n) {  /* one token's share of pack_x's buffer */
    const packer *p = packer_of(m);
    return p ? p->ld(n / QK) : 0;
}

/* row w of m . x: fast mode for quantized types; float types have no integer path and use x
 * itself. xp: xq packed by pack_x, or NULL */
static inline float dot_any(mat m, const uint8_t *w, const float *x, const q8blk *xq, const xpair *xp, int n, int fast) {
    int t = m.t;
    if (is_r16(m))  /* fast mode only (FileMatrix._rows) */
        return xp ? kern.r16_dot(t, w, xp, n / QK) : r16_dot_c(t, w, xq, n / QK);
    if (fast && is_quant(t)) return xp ? kern.dot_packed[t](w, xq, xp, n / QK) : kern.dot_fast[t](w, xq, n / QK);
    return kern.dot_exact[t](w, x, n);
}

/* B tokens against row w of m (see dots_exact_avx2): the row is read from memory once; the
 * portable path calls the one-token dot per token while the row is in L1. */
static void dots_any(mat m, const uint8_t *w, const float *x, int64_t ldx, const q8blk *xq, int64_t ldq,
                     const xpair *xp, int n, int fast, int B, int alone, float *y, int64_t ldy) {
    int t = m.t;
    if (is_r16(m)) {  /* the row stays in L1 across the tokens */
        for (int b = 0; b < B; b++)
            y[b * ldy] = xp ? kern.r16_dot(t, w, xp + b * r16_ld(n / QK), n / QK) : r16_dot_c(t, w, xq + b * ldq, n / QK);
        return;
    }
    if (fast && is_quant(t)) {
        if (xp) kern.dots_packed[t](w, xq, ldq, xp, n / QK, B, alone, y, ldy);
        else kern.dots_fast[t](w, xq, ldq, n / QK, B, y, ldy);
        return;
    }
    kern.dots_exact[t](w, x, ldx, n, B, y, ldy);
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
    kern.x16_rows(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy);
}

/* every picked R16 row of a step in one call, at the level in use (x: r16_pack's, pack_x: only
 * where the level has kern.r16_rows) */
static inline void r16_rows(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    kern.r16_rows(m, rows, start, n, x, nb, y);
}

/* the twins' products' per-thread scratch: the groups' masks (C / 32) and the padded output (Rp floats) */
static _Thread_local void *cm_buf, *cy_buf;
static _Thread_local int64_t cm_cap, cy_cap;

/* One token's product on a Q5_0, Q5_1 or K-quant twin h (cols_products' contract: y the R rows,
 * the threshold read once, the counters added: n_groups counts the groups (blocks of 32, or
 * super-blocks of 256) with an active input, each of which reads its head). Exact mode: the
 * portable loop at every level. */
static int64_t kq_products(const cols_hdr *h, const float *x, const q8blk *xq, int fast, float *y) {
    int t = h->t, bpg = kq_inputs(t) / QK;
    float thr = *h->thr;
    int64_t B = h->C / QK, rp = kq_rp(h->R), n_groups = 0, n;
    uint32_t *masks = grown(&cm_buf, &cm_cap, sizeof(uint32_t) * B);
    float *acc = rp == h->R ? y : grown(&cy_buf, &cy_cap, sizeof(float) * rp);
    if (!masks || !acc) return -1;
    uint32_t any = 0;
    for (int64_t b = 0; b < B; b++) {
        masks[b] = kern.cols_mask(x + b * QK, thr);
        any |= masks[b];
        if (b % bpg == bpg - 1) n_groups += any != 0, any = 0;
    }
    if (fast && kern.kq_fast) n = kern.kq_fast(h, xq, masks, acc);
    else n = kq_products_c(h, x, xq, fast, masks, acc);
    if (acc != y) memcpy(y, acc, sizeof(float) * h->R);
    cols_hdr *counts = (cols_hdr *)h;
    __atomic_fetch_add(&counts->n_active, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(&counts->n_groups, n_groups, __ATOMIC_RELAXED);
    return n;
}

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
        masks[g] = kern.cols_mask(x + g * QK, thr);
        n_groups += masks[g] != 0;
    }
    if (fast && kern.cols_fast) n = kern.cols_fast(h, xq, masks, acc);
    else n = cols_products_c(h, x, xq, fast, thr, masks, acc);
    if (acc != y) memcpy(y, acc, sizeof(float) * h->R);
    cols_hdr *counts = (cols_hdr *)h;  /* the owner's memory: the counters are the header's only writable part */
    __atomic_fetch_add(&counts->n_active, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(&counts->n_groups, n_groups, __ATOMIC_RELAXED);
    return n;
}
