/* _kernels.c (and the SIMD units, for its helpers), part:
 * input-major twins (L_COLS, cols_generic.c) of Q5_0, Q5_1 and the K-quants
 * Q4_K, Q5_K, Q6_K in portable C: their bytes, repacking, dequantization, the portable products
 * (ARM runs these; exact mode runs them at every level) and the prefetch cursor of the SIMD loops
 * (cols_kquants_avx2.c, cols_kquants_avx512.c). The header is cols_generic.c's cols_hdr.
 *
 * A "group" is what shares the rows' scales: a block of 32 inputs for Q5_0 and Q5_1, a
 * super-block of 256 inputs for the K-quants (kq_inputs). Per group, kq_group_bytes:
 *   the head, the Rp rows' scales as the file stores them, one array per field in row order:
 *     Q5_0: f16 d[Rp];  Q5_1: f16 d[Rp], f16 m[Rp];
 *     Q4_K, Q5_K: f16 d[Rp], f16 dmin[Rp], then the 6-bit scales and mins of the 8 sub-blocks
 *       unpacked (kscale_min, at repacking) into 16 planes of Rp bytes: plane s holds every
 *       row's scale of sub-block s, plane 8 + s its min (the file packs them into 12 bytes a
 *       row: unpacked, a product reads two bytes where it unpacked three with 9 operations per
 *       16 rows, for 4 more bytes a row and super-block, 2.8 % of Q4_K's);
 *     Q6_K: f16 d[Rp], then the 16 int8 scales as 16 planes of Rp bytes;
 *   then one channel row per input of the group (32 or 256), each Rp / 128 lines of kq_line
 *   bytes: line l holds rows [128 l, 128 l + 128) of that input:
 *     64 bytes of nibbles exactly as the Q4 twins (cols_byte: byte p holds row cols_byte(p)'s
 *       low 4 bits in its low nibble, row 64 + cols_byte(p)'s in its high one),
 *     then the high bits of those two rows, per nibble byte p:
 *       Q5_0, Q5_1, Q5_K (16 bytes): bits 2k (low nibble's row) and 2k + 1 (high nibble's) of
 *         byte p % 16, k = p / 16 (AVX-512 broadcasts the 16 bytes to 4 lanes and shifts lane k
 *         right by 2k; AVX2's half line, 2 lanes, likewise);
 *       Q6_K (32 bytes): bits 4k, 4k + 1 (the low nibble's row's 2 high bits) and 4k + 2, 4k + 3
 *         (the high nibble's) of byte p % 32, k = p / 32.
 * Rp is R rounded up to 128 (rows past R: zero values and scales). Each stored value is the
 * file's unsigned quant (Q5_0: value d (q - 16); Q5_1: d q + m; Q4_K, Q5_K: d sc q - dmin m;
 * Q6_K: d sc (q - 32)), each scale field the file's (Q4_K's, Q5_K's unpacked): the twin is
 * lossless, and where R is a multiple of 128 as many bytes as the sub-matrix in the file (Q5_0
 * 22 per 32 values and row, Q5_1 24, Q6_K 210 per 256) or 4 more a row per 256 (Q4_K 148 against
 * 144, Q5_K 180 against 176); only the order differs.
 *
 * Products (fast mode): per block of 32 inputs (the caller's q8 blocks of x: one scale d_x each)
 * and row the integer sums of the active channels' unsigned values times the int8 x, then
 *   Q5_0: y += (d_x d) (S - 16 sx);  Q5_1: y += (d_x d) S + m (d_x sx);
 *   Q4_K, Q5_K: y += (d_x (d sc)) S - (dmin m) (d_x sx)  (d sc: an f16 times a 6-bit integer,
 *     at most 11 + 6 significant bits: exact in float32, as is dmin m);
 *   Q6_K: per half block of 16 (one int8 scale each), T = sc_a (S_a - 32 sx_a) + sc_b (S_b - 32 sx_b)
 *     in int32 (|T| <= 2 x 128 x 16 x 127 x 63), y += (d_x d) T.
 * Exact mode: float x times the values, summed per (half) block, times the scale (less min sum x). */

static inline int kq_type(int t) { return t == T_Q5_0 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
static inline int kq_inputs(int t) { return t == T_Q5_0 || t == T_Q5_1 ? QK : QKK; }  /* inputs per group */
static inline int kq_hbits(int t) { return t == T_Q4_K ? 0 : t == T_Q6_K ? 2 : 1; }  /* bits above the nibble */
static inline int64_t kq_line(int t) { return 64 + 16 * kq_hbits(t); }                 /* bytes per 128 rows */
static inline int64_t kq_rp(int64_t R) { return (R + 127) / 128 * 128; }
static inline int64_t kq_chan_bytes(int t, int64_t rp) { return rp / 128 * kq_line(t); }
static inline int64_t kq_head_bytes(int t, int64_t rp) {
    return rp * (t == T_Q5_0 ? 2 : t == T_Q5_1 ? 4 : t == T_Q6_K ? 18 : 20);
}
static inline int64_t kq_group_bytes(int t, int64_t rp) { return kq_head_bytes(t, rp) + kq_inputs(t) * kq_chan_bytes(t, rp); }
static inline int64_t kq_bytes(int t, int64_t R, int64_t C) { return C / kq_inputs(t) * kq_group_bytes(t, kq_rp(R)); }

/* The stored (unsigned) value of row r (< 128) in one line of a channel row */
static inline int kq_value(int t, const uint8_t *line, int r) {
    int p = cols_byte(r & 63), hi = r >= 64;
    int v = (line[p] >> (4 * hi)) & 15;
    if (kq_hbits(t) == 1) v |= ((line[64 + (p & 15)] >> (2 * (p >> 4) + hi)) & 1) << 4;
    else if (kq_hbits(t) == 2) v |= ((line[64 + (p & 31)] >> (4 * (p >> 5) + 2 * hi)) & 3) << 4;
    return v;
}

/* Row i's scale and min of sub-block s (of 32 inputs; Q6_K: of 16) of the group at grp, as the
 * integers and f16 the file has: value = d * sc * q - dm * m (Q5_0, Q5_1, Q6_K: sc = 1 or the
 * int8 scale, dm = m's f16 or 0). */
static inline void kq_row_scales(int t, const uint8_t *grp, int64_t rp, int s, int64_t i, float *d, int *sc, float *dm, int *m) {
    *d = f16_to_f32(rd16(grp + 2 * i)), *sc = 1, *dm = 0.f, *m = 0;
    if (t == T_Q5_1) *dm = f16_to_f32(rd16(grp + 2 * rp + 2 * i)), *m = 1;
    else if (t == T_Q6_K) *sc = (int8_t)grp[2 * rp + s * rp + i];
    else if (t == T_Q4_K || t == T_Q5_K) {
        const uint8_t *P = grp + 4 * rp + i;  /* plane k at P[k rp]: scales 0-7, then mins */
        *dm = f16_to_f32(rd16(grp + 2 * rp + 2 * i));
        *sc = P[s * rp], *m = P[(8 + s) * rp];
    }
}

/* The stored unsigned values of one block of the file (kq_inputs values), read from its bytes in
 * ggml's orders: Q4_K/Q5_K per 64 values c, qs[32 c + l]'s low nibble is value 64 c + l, its
 * high one 64 c + 32 + l (Q5_K: plus qh[l]'s bit 2 c, 2 c + 1 as 16); Q6_K q6k_values */
static inline __attribute__((always_inline)) void kq_block_values(int t, const uint8_t *b, uint8_t *v) {
    if (t == T_Q5_0 || t == T_Q5_1) {
        int off = t == T_Q5_1 ? 4 : 2;
        uint32_t qh = (uint32_t)rd32(b + off);
        for (int j = 0; j < 16; j++) {
            v[j] = (uint8_t)((b[off + 4 + j] & 15) | ((qh >> j) & 1) << 4);
            v[j + 16] = (uint8_t)((b[off + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
    } else if (t == T_Q6_K) {
        q6k_values(b, v);
    } else {  /* Q4_K, Q5_K */
        const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16), *qh = b + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                if (t == T_Q5_K) lo |= ((qh[l] >> (2 * c)) & 1) << 4, hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                v[64 * c + l] = (uint8_t)lo, v[64 * c + 32 + l] = (uint8_t)hi;
            }
    }
}

/* A line's 64 bytes from 64 row-order bytes q: byte 16 L + 4 k + m holds row 16 k + 4 L + m
 * (cols_byte), a 4 x 4 transpose of dwords */
static inline void kq_place(const uint8_t *q, uint8_t *line) {
    for (int L = 0; L < 4; L++)
        for (int k = 0; k < 4; k++) memcpy(line + 16 * L + 4 * k, q + 16 * k + 4 * L, 4);
}

/* The twin of rows [r0, r0 + R), columns [c0, c0 + C) (whole groups) of the file's rows at src into
 * dst (64-byte aligned, 64 + kq_bytes bytes). Per group and line, the line's 128 rows' blocks
 * are unpacked into a tile (inputs x 128 rows), then each channel's line written. One copy per
 * type (kq_repack), its offsets and branches known at compile time. */
static inline __attribute__((always_inline)) void kq_repack_t(int t, const uint8_t *src, int64_t stride, int64_t r0,
                                                               int64_t R, int64_t c0, int64_t C, uint8_t *data,
                                                               uint8_t *tile) {
    int64_t rp = kq_rp(R), gb = kq_group_bytes(t, rp), hb = kq_head_bytes(t, rp), cb = kq_chan_bytes(t, rp);
    int64_t tb = type_bytes(t), lb = kq_line(t);
    int ni = kq_inputs(t);
    for (int64_t g = 0; g < C / ni; g++) {
        uint8_t *grp = data + g * gb;
        memset(grp, 0, hb);  /* rows past R: zero scales */
        for (int64_t l = 0; l < rp / 128; l++) {
            if ((l + 1) * 128 > R) memset(tile, 0, (size_t)ni * 128);  /* rows past R: zero values */
            uint8_t v[QKK];
            for (int64_t r = 0; r < 128 && l * 128 + r < R; r++) {
                int64_t i = l * 128 + r;
                const uint8_t *b = src + (r0 + i) * stride + (c0 / ni + g) * tb;
                switch (t) {
                case T_Q5_0: memcpy(grp + 2 * i, b, 2); break;
                case T_Q5_1: memcpy(grp + 2 * i, b, 2), memcpy(grp + 2 * rp + 2 * i, b + 2, 2); break;
                case T_Q6_K:
                    memcpy(grp + 2 * i, b + 208, 2);
                    for (int k = 0; k < 16; k++) grp[2 * rp + k * rp + i] = b[192 + k];
                    break;
                default:  /* Q4_K, Q5_K: the 6-bit scales and mins unpacked, a byte each */
                    memcpy(grp + 2 * i, b, 2), memcpy(grp + 2 * rp + 2 * i, b + 2, 2);
                    for (int k = 0; k < 8; k++) {
                        int sc, mn;
                        kscale_min(b + 4, k, &sc, &mn);
                        grp[4 * rp + k * rp + i] = (uint8_t)sc, grp[4 * rp + (8 + k) * rp + i] = (uint8_t)mn;
                    }
                }
                kq_block_values(t, b, v);
                for (int j = 0; j < ni; j++) tile[j * 128 + r] = v[j];
            }
            for (int j = 0; j < ni; j++) {
                uint8_t *line = grp + hb + j * cb + l * lb;
                const uint8_t *tv = tile + j * 128;
                uint8_t q[64], hv[64], ht[64];  /* row order: rows r and 64 + r's nibbles, their high bits */
                for (int r = 0; r < 64; r++) q[r] = (uint8_t)((tv[r] & 15) | (tv[64 + r] & 15) << 4);
                kq_place(q, line);
                if (kq_hbits(t) == 0) continue;
                /* the high bits of the rows whose nibbles byte p holds, 2 or 4 bits a byte p, packed
                 * as the products read them (kq_value): Q5_K line[64 + p % 16] bits 2 (p / 16),
                 * Q6_K line[64 + p % 32] bits 4 (p / 32) */
                int hs = kq_hbits(t);
                for (int r = 0; r < 64; r++)
                    hv[r] = (uint8_t)(((tv[r] >> 4) & (hs == 1 ? 1 : 3)) | ((tv[64 + r] >> 4) & (hs == 1 ? 1 : 3)) << hs);
                kq_place(hv, ht);
                if (hs == 1)
                    for (int p = 0; p < 16; p++)
                        line[64 + p] = (uint8_t)(ht[p] | ht[16 + p] << 2 | ht[32 + p] << 4 | ht[48 + p] << 6);
                else
                    for (int p = 0; p < 32; p++) line[64 + p] = (uint8_t)(ht[p] | ht[32 + p] << 4);
            }
        }
    }
}

static int kq_repack(int t, const uint8_t *src, int64_t stride, int64_t r0, int64_t R, int64_t c0, int64_t C,
                     const float *thr, uint8_t *dst) {
    cols_hdr *h = (cols_hdr *)dst;
    *h = (cols_hdr){COLS_MAGIC, t, r0, R, c0, C, thr, 0, 0};
    uint8_t *data = dst + sizeof(cols_hdr);
    uint8_t *tile = malloc((size_t)kq_inputs(t) * 128);
    if (!tile) return -1;
    switch (t) {
    case T_Q4_K: kq_repack_t(T_Q4_K, src, stride, r0, R, c0, C, data, tile); break;
    case T_Q5_K: kq_repack_t(T_Q5_K, src, stride, r0, R, c0, C, data, tile); break;
    case T_Q6_K: kq_repack_t(T_Q6_K, src, stride, r0, R, c0, C, data, tile); break;
    default: kq_repack_t(t, src, stride, r0, R, c0, C, data, tile);
    }
    free(tile);
    return 0;
}

/* The twin as float32 (R rows of C): each value computed in double from the file's integers and
 * f16 (every one of them exact), rounded once, as a float64 dequantization rounded to float32 */
static void kq_dequant(const cols_hdr *h, float *out) {
    int t = h->t, ni = kq_inputs(t), sub = t == T_Q6_K ? 16 : QK;
    int64_t rp = kq_rp(h->R), gb = kq_group_bytes(t, rp), hb = kq_head_bytes(t, rp), cb = kq_chan_bytes(t, rp), lb = kq_line(t);
    for (int64_t g = 0; g < h->C / ni; g++) {
        const uint8_t *grp = cols_data(h) + g * gb;
        for (int64_t i = 0; i < h->R; i++)
            for (int j = 0; j < ni; j++) {
                float d, dm;
                int sc, m;
                kq_row_scales(t, grp, rp, j / sub, i, &d, &sc, &dm, &m);
                int q = kq_value(t, grp + hb + j * cb + (i / 128) * lb, (int)(i % 128));
                q -= t == T_Q5_0 ? 16 : t == T_Q6_K ? 32 : 0;
                out[i * h->C + g * ni + j] = (float)((double)d * sc * q + (t == T_Q5_1 ? 1 : -1) * (double)dm * m);
            }
    }
}

/* ---- the portable products ------------------------------------------------------------------
 * y (Rp floats, zeroed here) += the twin's product over the active channels of masks (one per
 * block of 32 inputs); returns the active channels. Fast: xq the q8 blocks of the twin's inputs. */
static int64_t kq_products_c(const cols_hdr *h, const float *x, const q8blk *xq, int fast, const uint32_t *masks, float *y) {
    int t = h->t, ni = kq_inputs(t), bpg = ni / QK;  /* blocks of 32 per group */
    int64_t rp = kq_rp(h->R), gb = kq_group_bytes(t, rp), hb = kq_head_bytes(t, rp), cb = kq_chan_bytes(t, rp), lb = kq_line(t);
    int64_t n_active = 0;
    memset(y, 0, sizeof(float) * rp);
    for (int64_t b = 0; b < h->C / QK; b++) {
        uint32_t mask = masks[b];
        if (!mask) continue;
        n_active += __builtin_popcount(mask);
        const uint8_t *grp = cols_data(h) + (b / bpg) * gb, *chans = grp + hb + (b % bpg) * QK * cb;
        int s = (int)(b % bpg);  /* sub-block of 32 within the group */
        for (int64_t l = 0; l < rp / 128; l++) {
            int32_t S[2][128] = {{0}}, sx[2] = {0, 0};  /* per half block of 16 (Q6_K's scales); the others add them */
            float f[2][128] = {{0}}, fx[2] = {0.f, 0.f};
            for (uint32_t m = mask; m; m &= m - 1) {
                int j = __builtin_ctz(m), half = j >> 4;
                const uint8_t *line = chans + j * cb + l * lb;
                if (fast) {
                    int xj = xq[b].q[j];
                    sx[half] += xj;
                    for (int r = 0; r < 128; r++) S[half][r] += xj * kq_value(t, line, r);
                } else {
                    float xj = x[b * QK + j];
                    fx[half] += xj;
                    for (int r = 0; r < 128; r++) f[half][r] += xj * (float)kq_value(t, line, r);
                }
            }
            for (int r = 0; r < 128; r++) {
                int64_t i = l * 128 + r;
                float d, dm, d2, dm2;
                int sc, mn, sc2, mn2;
                if (t == T_Q6_K) {
                    kq_row_scales(t, grp, rp, 2 * s, i, &d, &sc, &dm, &mn);
                    kq_row_scales(t, grp, rp, 2 * s + 1, i, &d2, &sc2, &dm2, &mn2);
                    if (fast) y[i] += (xq[b].d * d) * (float)(sc * (S[0][r] - 32 * sx[0]) + sc2 * (S[1][r] - 32 * sx[1]));
                    else y[i] += d * ((float)sc * (f[0][r] - 32.f * fx[0]) + (float)sc2 * (f[1][r] - 32.f * fx[1]));
                    continue;
                }
                kq_row_scales(t, grp, rp, s, i, &d, &sc, &dm, &mn);
                float a = d * (float)sc, c = dm * (float)mn;  /* exact in float32 (see above) */
                if (fast) {
                    int32_t Si = S[0][r] + S[1][r], sxi = sx[0] + sx[1];
                    if (t == T_Q5_0) Si -= 16 * sxi;
                    y[i] += (xq[b].d * a) * (float)Si - c * (xq[b].d * (float)sxi) * (t == T_Q5_1 ? -1.f : 1.f);
                } else {
                    float fi = f[0][r] + f[1][r], fxi = fx[0] + fx[1];
                    if (t == T_Q5_0) fi -= 16.f * fxi;
                    y[i] += a * fi - c * fxi * (t == T_Q5_1 ? -1.f : 1.f);
                }
            }
        }
    }
    return n_active;
}

/* ---- prefetching: a cursor over the (block of 32, line) items a product reads -----------------
 * Each item: one line of every active channel of a block of 32 inputs, and (where the block is
 * the first active one of its group) that line's rows' head fields. cols_ahead, cols_hint as
 * the Q4 twins'. */
typedef struct {
    const uint8_t *data;
    const uint32_t *masks;
    int64_t B, lines, gb, hb, cb, lb, rp;
    int t, bpg;
    int64_t b, l, first;  /* the next item; the first active block of the item's group */
} kq_cursor;

static inline void kq_skip(kq_cursor *c) {
    while (c->b < c->B && !c->masks[c->b]) c->b++;
    if (c->b < c->B && (c->first < 0 || c->first / c->bpg != c->b / c->bpg)) c->first = c->b;
}
static inline void kq_pf(const void *p) {
    if (cols_hint == 3) __builtin_prefetch(p, 0, 3);
    else __builtin_prefetch(p, 0, 2);
}
static inline void kq_fetch(kq_cursor *c) {
    if (c->b >= c->B) return;
    const uint8_t *grp = c->data + (c->b / c->bpg) * c->gb;
    if (c->b == c->first) {  /* the head: this line's rows of every field (f16 arrays, then byte planes) */
        int n16 = c->t == T_Q5_1 || c->t == T_Q4_K || c->t == T_Q5_K ? 2 : 1;
        int64_t n8 = (c->hb - 2 * n16 * c->rp) / c->rp;
        for (int k = 0; k < n16; k++)
            for (int o = 0; o < 256; o += 64) kq_pf(grp + 2 * k * c->rp + 256 * c->l + o);
        for (int64_t k = 0; k < n8; k++)
            for (int o = 0; o < 128; o += 64) kq_pf(grp + 2 * n16 * c->rp + k * c->rp + 128 * c->l + o);
    }
    const uint8_t *chans = grp + c->hb + (c->b % c->bpg) * QK * c->cb + c->l * c->lb;
    for (uint32_t m = c->masks[c->b]; m; m &= m - 1) {
        const uint8_t *p = chans + __builtin_ctz(m) * c->cb;
        kq_pf(p);
        kq_pf(p + c->lb - 1);
    }
    if (++c->l == c->lines) { c->l = 0; c->b++; kq_skip(c); }
}
static inline void kq_cursor_start(kq_cursor *c, const cols_hdr *h, const uint32_t *masks) {
    int t = h->t;
    c->rp = kq_rp(h->R), c->t = t, c->bpg = kq_inputs(t) / QK;
    c->data = cols_data(h), c->masks = masks, c->B = h->C / QK, c->lines = c->rp / 128;
    c->gb = kq_group_bytes(t, c->rp), c->hb = kq_head_bytes(t, c->rp), c->cb = kq_chan_bytes(t, c->rp), c->lb = kq_line(t);
    c->b = 0, c->l = 0, c->first = -1;
    kq_skip(c);
    for (int i = 0; i < cols_ahead; i++) kq_fetch(c);
}
