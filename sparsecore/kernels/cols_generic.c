/* _kernels.c (and the SIMD units, for its helpers), part:
 * input-major twins (layout L_COLS, TEAL's input sparsity) in portable C: their
 * header and bytes, the repacking, the active channels, the products every level falls back
 * to (ARM runs these), dequantization and the prefetch cursor the SIMD loops share.
 *
 * A one-token product y = W x whose small inputs are skipped (|x_j| <= t, TEAL) needs column j
 * of W, which the file's rows scatter over every row's block. A twin holds the sub-matrix rows
 * [r0, r0 + R), columns [c0, c0 + C) input-major, so a skipped input skips contiguous bytes:
 *
 *   the header (cols_hdr, 64 bytes), then per group g of 32 columns (the file's block g), gb
 *   bytes each (cols_group_bytes):
 *     the scales: the Rp rows' f16 d in row order (Q4_1: then their Rp f16 mins m);
 *     32 channel rows, channel j's the Rp values of input c0 + 32 g + j (cols_chan_bytes:
 *       Rp / 2 bytes of nibbles for Q4_0 and Q4_1, Rp int8 bytes for Q8_0), in lines of 64
 *       bytes: line l holds rows [l K, l K + K) (K = cols_chunk: 128 for Q4, 64 for Q8_0),
 *       row l K + r at byte cols_byte(r) (its high nibble for r >= 64):
 *         byte 16 L + 4 k + m  <->  row 16 k + 4 L + m  (k, L, m < 4; Q4 high nibbles: + 64)
 *       which is where unpacking four channels' bytes with unpacklo/hi_epi8 then _epi16 puts
 *       them: in 128-bit lane L of the k-th result, dword m holds the four channels' values of
 *       row 16 k + 4 L + m, so a 512-bit vpdpbusd (or AVX2's half line: 8 rows a register)
 *       sums rows in order.
 *   Rp is R rounded up to K (rows past R are zeros: no bytes added where R is a multiple of
 *   K, as every layer matrix of the bench shapes is). The values are the file's (Q4: the
 *   nibble q of value d (q - 8), or d q + m; Q8_0: the int8), the scales its f16: the copy
 *   is lossless and exactly the source's bytes.
 *
 * A product on the twin (cols_products, dispatch.c) reads, per group with an active input,
 * its scales and the active channels' rows: y[i] = sum_g sum_{j active} W[r0 + i, c0 + 32 g + j] x_j.
 * The decision reads x alone (a 32-bit mask per group), never the weights: a group with no
 * active input costs nothing. Fast mode: x's q8 blocks (the caller's xq of the whole x), per
 * group and row the integer sum S = sum_{j active} xq_j u_ij of the unsigned stored values u
 * (Q4 nibbles; Q8_0 u = q + 128 at the SIMD levels), then y_i += (d_x d_i) (S + off) with off
 * = -8 sum xq_j (Q4_0) or -128 sum xq_j (Q8_0 as u), and Q4_1's y_i += m_i (d_x sum xq_j). */

#define COLS_MAGIC 0x4e495754u /* "TWIN" */
/* A fused twin ("TWNF"): the rows of several matrices that read the same input, stacked (gate's
 * owned rows then up's; Q's rows of some heads then K's then V's), one twin of R = their sum:
 * each channel row is their values for one input, so a product streams one longer row per active
 * input, makes one mask pass and one pass of prefetches. r0 is the first part's first row (the
 * caller checks it and R); no matrix's own product takes it (cols_take), only the caller that
 * knows the parts (ffn_teal: gate | up; attn_part: Q | K | V), through cols_take_fused. */
#define COLS_MAGIC_FUSED 0x464e5754u /* "TWNF" */
typedef struct {
    uint32_t magic;
    int32_t t;           /* the file's type */
    int64_t r0, R;       /* the matrix's rows it holds */
    int64_t c0, C;       /* and columns (inputs), on whole blocks of 32 */
    const float *thr;    /* ONE float, read at every product: |x_j| > *thr is active; < 0: the original path */
    int64_t n_active;    /* active channels, summed over the products (the owner reads and resets it) */
    int64_t n_groups;    /* groups with an active channel, likewise: bytes read = n_active cols_chan_bytes + n_groups cols_head_bytes */
} cols_hdr;
_Static_assert(sizeof(cols_hdr) == 64, "the twin's header is 64 bytes");

static inline int cols_type(int t) { return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0; }
static inline int cols_nibbles(int t) { return t == T_Q4_0 || t == T_Q4_1; }
static inline int64_t cols_chunk(int t) { return cols_nibbles(t) ? 128 : 64; }  /* rows per 64-byte line */
static inline int64_t cols_rp(int t, int64_t R) { int64_t k = cols_chunk(t); return (R + k - 1) / k * k; }
static inline int64_t cols_head_bytes(int t, int64_t rp) { return (t == T_Q4_1 ? 4 : 2) * rp; }
static inline int64_t cols_chan_bytes(int t, int64_t rp) { return cols_nibbles(t) ? rp / 2 : rp; }
static inline int64_t cols_group_bytes(int t, int64_t rp) { return cols_head_bytes(t, rp) + QK * cols_chan_bytes(t, rp); }
static inline int64_t cols_bytes(int t, int64_t R, int64_t C) { return (C / QK) * cols_group_bytes(t, cols_rp(t, R)); }
static inline const uint8_t *cols_data(const cols_hdr *h) { return (const uint8_t *)(h + 1); }
/* the byte of a line holding row r of its chunk (r < 64; Q4's rows 64 + r: the same byte's high nibble) */
static inline int cols_byte(int r) { return 16 * ((r >> 2) & 3) + 4 * ((r >> 4) & 3) + (r & 3); }

/* Whether a one-token product over rows [start, start + n_rows), columns [col0, col0 + n) runs on
 * m's twin: rows not listed, the twin's ranges exactly, its threshold >= 0 now. */
static inline const cols_hdr *cols_take(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int64_t n) {
    const cols_hdr *h = m.cols;
    if (!h || h->magic != COLS_MAGIC || rows || start != h->r0 || n_rows != h->R || col0 != h->c0 || n != h->C)
        return NULL;
    return *h->thr >= 0.f ? h : NULL;
}

/* m's fused twin where it is the one of parts stacked from row r0 on, R rows in all, columns
 * [c0, c0 + C), with its threshold >= 0 now; else NULL (the caller computes the parts as before) */
static inline const cols_hdr *cols_take_fused(mat m, int64_t r0, int64_t R, int64_t c0, int64_t C) {
    const cols_hdr *h = m.cols;
    if (!h || h->magic != COLS_MAGIC_FUSED || h->r0 != r0 || h->R != R || h->c0 != c0 || h->C != C) return NULL;
    return *h->thr >= 0.f ? h : NULL;
}

/* The twin of rows [r0, r0 + R), columns [c0, c0 + C) of the file's rows at src (row 0, column 0;
 * rows `stride` bytes apart) into dst (64-byte aligned, cols_bytes + 64 bytes). Per group and
 * line, the line's K rows' blocks are unpacked into a tile of 32 channels x K values (in L1),
 * then each channel's 64 bytes written: a row-by-row pass per group with the channels' values
 * in 32 far-apart rows ran at 3.4 ns a value (the 1.1B shape: 150 ms a layer). */
static int cols_repack(int t, const uint8_t *src, int64_t stride, int64_t r0, int64_t R, int64_t c0, int64_t C,
                       const float *thr, uint8_t *dst) {
    int64_t rp = cols_rp(t, R), K = cols_chunk(t), gb = cols_group_bytes(t, rp), hb = cols_head_bytes(t, rp);
    int64_t cb = cols_chan_bytes(t, rp), tb = type_bytes(t);
    cols_hdr *h = (cols_hdr *)dst;
    *h = (cols_hdr){COLS_MAGIC, t, r0, R, c0, C, thr, 0, 0};
    uint8_t *data = dst + sizeof(cols_hdr);
    int off = t == T_Q4_1 ? 4 : 2;
    uint8_t tile[QK][128];
    for (int64_t g = 0; g < C / QK; g++) {
        uint8_t *grp = data + g * gb;
        memset(grp, 0, hb);  /* rows past R: zero scales */
        for (int64_t l = 0; l < rp / K; l++) {
            if ((l + 1) * K > R) memset(tile, 0, sizeof(tile));  /* rows past R: zero values */
            for (int64_t r = 0; r < K && l * K + r < R; r++) {
                int64_t i = l * K + r;
                const uint8_t *b = src + (r0 + i) * stride + (c0 / QK + g) * tb;
                memcpy(grp + 2 * i, b, 2);
                if (t == T_Q4_1) memcpy(grp + 2 * rp + 2 * i, b + 2, 2);
                if (t == T_Q8_0)
                    for (int j = 0; j < QK; j++) tile[j][r] = b[2 + j];
                else
                    for (int j = 0; j < 16; j++) tile[j][r] = b[off + j] & 15, tile[j + 16][r] = b[off + j] >> 4;
            }
            for (int j = 0; j < QK; j++) {
                uint8_t *line = grp + hb + j * cb + l * 64, p[64];  /* p: the line's bytes in row order */
                if (t == T_Q8_0)
                    memcpy(p, tile[j], 64);
                else
                    for (int r = 0; r < 64; r++) p[r] = (uint8_t)(tile[j][r] | tile[j][64 + r] << 4);
                /* line[cols_byte(r)] = p[r]: byte 16 L + 4 k + m holds row 16 k + 4 L + m, a 4 x 4
                 * transpose of dwords (a byte at a time, the index computed per byte, the whole
                 * repacking ran at 0.65 GB/s; 1.1 GB/s so: the 1.1B shape's twins at --sparsity 0.5) */
                for (int L = 0; L < 4; L++)
                    for (int k = 0; k < 4; k++) memcpy(line + 16 * L + 4 * k, p + 16 * k + 4 * L, 4);
            }
        }
    }
    return 0;
}

/* The stored value of row r (< Rp) of channel row ch, as the file has it (Q4: 0..15, Q8_0: -128..127) */
static inline int cols_value(int t, const uint8_t *ch, int64_t r) {
    int64_t K = cols_chunk(t);
    const uint8_t *line = ch + (r / K) * 64;
    int i = (int)(r % K);
    if (t == T_Q8_0) return (int8_t)line[cols_byte(i)];
    return (line[cols_byte(i & 63)] >> (i >= 64 ? 4 : 0)) & 15;
}

/* The twin as float32 (R rows of C), value for value what the file's blocks dequantize to */
static void cols_dequant(const cols_hdr *h, float *out) {
    int t = h->t;
    int64_t rp = cols_rp(t, h->R), gb = cols_group_bytes(t, rp), hb = cols_head_bytes(t, rp), cb = cols_chan_bytes(t, rp);
    for (int64_t g = 0; g < h->C / QK; g++) {
        const uint8_t *grp = cols_data(h) + g * gb;
        for (int64_t i = 0; i < h->R; i++) {
            float d = f16_to_f32(rd16(grp + 2 * i)), mn = t == T_Q4_1 ? f16_to_f32(rd16(grp + 2 * rp + 2 * i)) : 0.f;
            for (int j = 0; j < QK; j++) {
                int q = cols_value(t, grp + hb + j * cb, i);
                out[i * h->C + g * QK + j] = t == T_Q4_1 ? d * (float)q + mn : d * (float)(t == T_Q4_0 ? q - 8 : q);
            }
        }
    }
}

/* Group g's active channels: bit j where |x_j| > thr (x alone: never the weights) */
static inline uint32_t cols_mask_c(const float *x, float thr) {
    uint32_t m = 0;
    for (int j = 0; j < QK; j++) m |= (uint32_t)(fabsf(x[j]) > thr) << j;
    return m;
}

/* ---- prefetching: a cursor over the (group, line) items a product reads ----------------------
 * Each item is a line of every active channel of a group and that line's rows' scales; the
 * SIMD loops ask for the item cols_ahead items ahead (0: none), into L1 (cols_hint 3) or L2 (2).
 * Measured in docs/KERNELS.md (scripts/bench_input_major.py --ahead). */
extern int cols_ahead, cols_hint;  /* python_module.c defines them (16, 2): cols_tune sets them for every unit */
typedef struct {
    const uint8_t *data;
    const uint32_t *masks;
    int64_t G, lines, gb, hb, cb, hl;  /* groups, lines per channel, group/head/channel bytes, scale bytes per line */
    int64_t g, l;                      /* the next item to ask for (g == G: done) */
} cols_cursor;

static inline void cols_skip(cols_cursor *c) {  /* to the next group with an active channel */
    while (c->g < c->G && !c->masks[c->g]) c->g++;
}
static inline void cols_fetch(cols_cursor *c) {
    if (c->g >= c->G) return;
    const uint8_t *grp = c->data + c->g * c->gb;
    for (int64_t o = 0; o < c->hl; o += 64) {  /* the scales (and mins) of this line's rows */
        if (cols_hint == 3) __builtin_prefetch(grp + c->l * c->hl + o, 0, 3);
        else __builtin_prefetch(grp + c->l * c->hl + o, 0, 2);
        if (c->hb != c->hl * c->lines) __builtin_prefetch(grp + c->hb / 2 + c->l * c->hl + o, 0, 2);  /* Q4_1's mins */
    }
    for (uint32_t m = c->masks[c->g]; m; m &= m - 1) {
        const uint8_t *p = grp + c->hb + __builtin_ctz(m) * c->cb + c->l * 64;
        if (cols_hint == 3) __builtin_prefetch(p, 0, 3);
        else __builtin_prefetch(p, 0, 2);
    }
    if (++c->l == c->lines) { c->l = 0; c->g++; cols_skip(c); }
}
static inline void cols_cursor_start(cols_cursor *c, const cols_hdr *h, const uint32_t *masks) {
    int t = h->t;
    int64_t rp = cols_rp(t, h->R);
    c->data = cols_data(h), c->masks = masks, c->G = h->C / QK, c->lines = rp / cols_chunk(t);
    c->gb = cols_group_bytes(t, rp), c->hb = cols_head_bytes(t, rp), c->cb = cols_chan_bytes(t, rp);
    c->hl = 2 * cols_chunk(t);  /* f16 scales of a line's rows */
    c->g = 0, c->l = 0;
    cols_skip(c);
    for (int i = 0; i < cols_ahead; i++) cols_fetch(c);
}

/* ---- the portable products ------------------------------------------------------------------
 * y (Rp floats, zeroed here) += the twin's product; returns the active channels. Fast: xq the
 * q8 blocks of the twin's inputs (xq[g]: group g's); exact: x the floats. */
static int64_t cols_products_c(const cols_hdr *h, const float *x, const q8blk *xq, int fast, float thr,
                               const uint32_t *masks, float *y) {
    int t = h->t;
    int64_t rp = cols_rp(t, h->R), K = cols_chunk(t), gb = cols_group_bytes(t, rp), hb = cols_head_bytes(t, rp);
    int64_t cb = cols_chan_bytes(t, rp), n_active = 0;
    memset(y, 0, sizeof(float) * rp);
    (void)thr;
    for (int64_t g = 0; g < h->C / QK; g++) {
        uint32_t mask = masks[g];
        if (!mask) continue;
        const uint8_t *grp = cols_data(h) + g * gb;
        n_active += __builtin_popcount(mask);
        for (int64_t l = 0; l < rp / K; l++) {
            int64_t r0 = l * K;
            if (fast) {
                int32_t S[128] = {0}, sx = 0;
                for (uint32_t m = mask; m; m &= m - 1) {
                    int j = __builtin_ctz(m);
                    int xj = xq[g].q[j];
                    const uint8_t *line = grp + hb + j * cb + l * 64;
                    sx += xj;
                    for (int r = 0; r < 64; r++) {
                        uint8_t b = line[cols_byte(r)];
                        if (t == T_Q8_0) S[r] += xj * (int8_t)b;
                        else { S[r] += xj * (b & 15); S[64 + r] += xj * (b >> 4); }
                    }
                }
                int32_t off = t == T_Q4_0 ? -8 * sx : 0;
                float dx = xq[g].d, dsx = dx * (float)sx;
                for (int64_t r = 0; r < K; r++) {
                    float dw = f16_to_f32(rd16(grp + 2 * (r0 + r)));
                    y[r0 + r] += (dx * dw) * (float)(S[r] + off);
                    if (t == T_Q4_1) y[r0 + r] += f16_to_f32(rd16(grp + 2 * rp + 2 * (r0 + r))) * dsx;
                }
            } else {
                float s[128] = {0}, sx = 0.f;
                const float *xg = x + g * QK;
                for (uint32_t m = mask; m; m &= m - 1) {
                    int j = __builtin_ctz(m);
                    float xj = xg[j];
                    const uint8_t *line = grp + hb + j * cb + l * 64;
                    sx += xj;
                    for (int r = 0; r < 64; r++) {
                        uint8_t b = line[cols_byte(r)];
                        if (t == T_Q8_0) s[r] += xj * (float)(int8_t)b;
                        else if (t == T_Q4_0) { s[r] += xj * (float)((b & 15) - 8); s[64 + r] += xj * (float)((b >> 4) - 8); }
                        else { s[r] += xj * (float)(b & 15); s[64 + r] += xj * (float)(b >> 4); }
                    }
                }
                for (int64_t r = 0; r < K; r++) {
                    y[r0 + r] += f16_to_f32(rd16(grp + 2 * (r0 + r))) * s[r];
                    if (t == T_Q4_1) y[r0 + r] += f16_to_f32(rd16(grp + 2 * rp + 2 * (r0 + r))) * sx;
                }
            }
        }
    }
    return n_active;
}
