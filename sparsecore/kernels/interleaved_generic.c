/* _kernels.c (and the SIMD units, for its helpers), part:
 * the repacked layouts, X16 (16 rows side by side) and R16 (each row's blocks 16
 * side by side), in portable C: their byte layouts, the repacking, the lanes every SIMD level
 * reproduces operation for operation, dequantization, the activations packed for R16, and the
 * prefetching the SIMD loops share. */

/* ---- the layouts' bytes ---------------------------------------------------------------------
 * Interleaved rows (X16) of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4, per group of 16 rows
 * and block of 32 columns (gb = 16 blocks' bytes: 288 for Q4_0 and IQ4_NL, 272 for MXFP4, 320 for
 * Q4_1, 352 for Q5_0, 384 for Q5_1, 544 for Q8_0): the 16 rows' f16 scales d (MXFP4: their E8M0
 * bytes, x16_scale), for Q4_1 and Q5_1 then their
 * 16 f16 mins, for Q5 then their fifth bits (64 bytes, run_value), then the values in runs of
 * 64 bytes (IQ4_NL, MXFP4: the codebook's indices as Q4's nibbles): run j holds bytes
 * 4j..4j+3 of each row's value bytes, row r at 4r. Q4: 4 runs of the 16 nibble bytes; a byte's
 * low nibble is value 4j + c of its row, its high nibble value 16 + 4j + c (GGUF's order), so
 * one run masked (and shifted) is 4 values of 16 rows. Q8_0: 8 runs of the 32 values, each
 * stored as q + 128 (unsigned, for vpdpbusd). Groups follow each other `stride` bytes apart,
 * blocks within a group gb apart; rows past the matrix's last are zeros. The same bytes as the
 * file's blocks: a token reads no more than it would there. R16 lays out every 16 blocks of
 * one row as X16 lays out 16 rows' block (interleave_run: a run of L lanes). */

/* bytes of an X16 (group, block): 16 of the file's blocks, and Q4_K's scales and mins unpacked
 * to a byte each (16 rows x 8 sub-blocks x 2 bytes, against 16 x 12 packed: 2.8 % more) */
static inline int x16_block_bytes(int t) {
    return t == T_Q4_K ? 2368 : t == T_IQ4_XS ? 2208 : t == T_Q3_K ? 1824 : 16 * type_bytes(t);
}
/* IQ4_NL's and IQ4_XS's codebook + 128: the unsigned values vpdpbusd multiplies (the lanes'
 * integer sums less 128 sum x: the codebook's own products, exactly) */
static const uint8_t kvalues_u8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
/* MXFP4's codebook (the E2M1 values doubled, -12..12) + 12: unsigned values that maddubs pairs
 * add four at a time in int16 as Q5's (4 x 2 x 24 x 127 < 2^15); the sums' offset -12 sum x */
static const uint8_t kvalues_mxfp4_u8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static inline int is_q5(int t) { return t == T_Q5_0 || t == T_Q5_1; }
/* a Q5 run's fifth bits (4 L bytes before its values): byte 4 r + c of lane r holds in bit j
 * (j < 4) value 4 j + c's, in bit 4 + j value 16 + 4 j + c's: run j's nibbles take theirs by
 * one shift and one mask */
/* A run of L lanes (interleave_run: X16's 16 rows' block, or R16's blocks of a row): bytes
 * before its values, its L f16 scales (and Q4_1's L f16 mins); t the file's type */
static inline int run_head(int t, int L) {
    return t == T_MXFP4 ? L : (t == T_Q4_1 || t == T_Q5_1 ? 4 : 2) * L + (is_q5(t) ? 4 * L : 0);
}
/* lane r's scale in a run at p: an f16, MXFP4's E8M0 byte as ggml reads it (e8m0_half) */
static inline float x16_scale(int t, const uint8_t *p, int r) {
    return t == T_MXFP4 ? e8m0_half(p[r]) : f16_to_f32(rd16(p + 2 * r));
}
/* the unsigned value i of lane r in a run of L lanes: Q4 a nibble, Q8_0 q + 128 (as stored),
 * IQ4_NL its nibble's codebook value + 128, MXFP4 its + 12 (both store the nibbles, as the file) */
static inline int run_value(int t, const uint8_t *p, int L, int r, int i) {
    int h = run_head(t, L);
    if (t == T_Q8_0) return p[h + 4 * L * (i / 4) + 4 * r + i % 4];
    int l = i % 16, q = (p[h + 4 * L * (l / 4) + 4 * r + l % 4] >> (4 * (i / 16))) & 15;
    if (is_q5(t)) q |= ((p[h - 4 * L + 4 * r + l % 4] >> (l / 4 + 4 * (i / 16))) & 1) << 4;
    return t == T_IQ4_NL ? kvalues_u8[q] : t == T_MXFP4 ? kvalues_mxfp4_u8[q] : q;
}
/* x's offset in each lane's integer sum: Q4_0's values are u - 8, Q8_0's stored u = q + 128,
 * IQ4_NL's and IQ4_XS's u = codebook + 128, MXFP4's codebook + 12 */
static inline int32_t x16_offset(int t, int32_t sx) {
    return t == T_Q4_0 ? -8 * sx : t == T_Q5_0 ? -16 * sx : t == T_MXFP4 ? -12 * sx
         : t == T_Q8_0 || t == T_IQ4_NL || t == T_IQ4_XS ? -128 * sx : 0;
}
/* Q6_K's X16 block (16 rows x 256 values, 3360 bytes): the rows' f16 d, then per activation
 * block xb (32 values, sub-blocks 2 xb and 2 xb + 1) 416 bytes in the order the tile reads
 * them: the two sub-blocks' int8 scales (16 rows each), 4 runs of low nibbles, 2 runs of high
 * bits (interleave_q6k). One forward stream: with the scales, low and high bits in three
 * regions of the block, one core read it from memory at 11-13 GB/s, now 18.6-18.9 (Q4_0's
 * single stream: 25). */
#define Q6_SC(j) (32 + 416 * ((j) / 2) + 16 * ((j) % 2))       /* sub-block j's 16 scales */
#define Q6_L(m) (32 + 416 * ((m) / 4) + 32 + 64 * ((m) % 4))   /* low nibbles of values 8m..8m+7 */
#define Q6_H(n) (32 + 416 * ((n) / 2) + 288 + 64 * ((n) % 2))  /* high bits of values 16n..16n+15 */
/* Q4_K's (2368 bytes): the rows' f16 d, then dmin, then per sub-block pair p (576 bytes) the
 * two sub-blocks' scales and mins (a byte each, 16 rows), then their 8 runs of nibbles; the
 * same one stream (one core, from memory: 20 -> 22.6-25.1 GB/s) */
#define Q4K_SC(sb) (64 + 576 * ((sb) / 2) + 16 * ((sb) % 2))       /* sub-block sb's 16 scales */
#define Q4K_MN(sb) (64 + 576 * ((sb) / 2) + 32 + 16 * ((sb) % 2))  /* and mins */
#define Q4K_V(p) (64 + 576 * (p) + 64)                             /* sub-blocks 2p, 2p + 1's values */
/* IQ4_XS's (2208 bytes): the rows' f16 d, then per sub-block sb of 32 values (272 bytes) the
 * rows' scales ls - 32 (int8, 16 rows), then its 4 runs of 64 bytes: bytes 4 j .. 4 j + 3 of
 * each row's 16 nibble bytes of the sub-block (low nibbles values 4 j + c, high ones 16 + 4 j
 * + c: Q4_0's block), the codebook's indices as the file holds them */
#define IQ4XS_SC(sb) (32 + 272 * (sb))
#define IQ4XS_V(sb) (48 + 272 * (sb))
/* Q2_K's (1344 bytes, the file's 16 x 84): the rows' f16 d, then dmin, then per activation block
 * xb (160 bytes) the two sub-blocks' scale bytes (16 rows each, the file's: scale in the low
 * nibble, min in the high), then each sub-block's values in a run of 64 bytes: row r's 4 bytes
 * at 4r, byte c holding values 4s + c (s < 4) of the sub-block in bits 2s, so one run shifted
 * and masked 4 ways is the sub-block's 16 values of 16 rows, in the order x's 4-byte groups
 * come (interleave_k23). Q3_K's (1824 bytes: its 16 6-bit scales a byte each, 64 more than the
 * file's 16 x 110): the rows' f16 d, then per activation block (224 bytes) the two sub-blocks'
 * scales (int8, sc - 32), their low 2 bits of q + 4 as Q2_K's values, then the block's high
 * bits: byte c of row r holding in bit s value 4s + c's (of 32: sub-block 2 xb for s < 4). */
#define Q2K_SC(j) (64 + 160 * ((j) / 2) + 16 * ((j) % 2))            /* sub-block j's 16 scale bytes */
#define Q2K_V(j) (64 + 160 * ((j) / 2) + 32 + 64 * ((j) % 2))         /* sub-block j's values */
#define Q3K_SC(j) (32 + 224 * ((j) / 2) + 16 * ((j) % 2))             /* sub-block j's 16 scales */
#define Q3K_L(j) (32 + 224 * ((j) / 2) + 32 + 64 * ((j) % 2))         /* sub-block j's low bits */
#define Q3K_H(xb) (32 + 224 * (xb) + 160)                             /* activation block xb's high bits */

/* ---- repacking ------------------------------------------------------------------------------ */

static void interleave_q6k(const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    uint8_t v[QKK];  /* a row's 256 stored 6-bit values (q + 32), in the values' order */
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * 16 * 210;
            if (rows - g * 16 < 16) memset(p, 0, 16 * 210);  /* a whole group writes every byte */
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * 210;
                q6k_values(w, v);
                memcpy(p + 2 * r, w + 208, 2);
                for (int j = 0; j < 16; j++) p[Q6_SC(j) + r] = w[192 + j];
                /* four lanes (c = 0..3) a 32-bit word: byte c of L(m) is value 8m + c's low
                 * nibble and 8m + 4 + c's high one; of H(n), values 16n + 4t + c's high 2 bits */
                for (int m = 0; m < 32; m++) {
                    uint32_t lo = (uint32_t)rd32(v + 8 * m) & 0x0F0F0F0Fu, hi = (uint32_t)rd32(v + 8 * m + 4) & 0x0F0F0F0Fu;
                    uint32_t word = lo | hi << 4;
                    memcpy(p + Q6_L(m) + 4 * r, &word, 4);
                }
                for (int n = 0; n < 16; n++) {
                    uint32_t word = 0;
                    for (int t4 = 0; t4 < 4; t4++)
                        word |= ((uint32_t)rd32(v + 16 * n + 4 * t4) >> 4 & 0x03030303u) << (2 * t4);
                    memcpy(p + Q6_H(n) + 4 * r, &word, 4);
                }
            }
        }
}

/* Q4_K (2368 bytes a group's block): the 16 rows' d, then dmin (f16), then per sub-block pair
 * p the rows' 6-bit scales (Q4K_SC) and mins (Q4K_MN) of sub-blocks 2p and 2p + 1 a byte each,
 * then 8 runs of 64 bytes (Q4K_V(p) + 64 j): bytes 32 p + 4 j .. + 3 of each row's qs, whose
 * low nibbles are sub-block 2p's values 4j.. and high ones 2p + 1's. */
static void interleave_q4k(const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * 2368;
            if (rows - g * 16 < 16) memset(p, 0, 2368);  /* a whole group writes every byte */
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * 144;
                memcpy(p + 2 * r, w, 2);
                memcpy(p + 32 + 2 * r, w + 2, 2);
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    kscale_min(w + 4, j, &sc, &m);
                    p[Q4K_SC(j) + r] = (uint8_t)sc;
                    p[Q4K_MN(j) + r] = (uint8_t)m;
                }
                for (int pp = 0; pp < 4; pp++)
                    for (int j = 0; j < 8; j++) memcpy(p + Q4K_V(pp) + 64 * j + 4 * r, w + 16 + 32 * pp + 4 * j, 4);
            }
        }
}

/* Q2_K and Q3_K (layouts above Q2K_SC): values unpacked by kunpack (Q2_K q, Q3_K q - 4 .. 3:
 * stored as q + 4), laid out per sub-block as 4 bytes a row */
static void interleave_k23(int t, const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    const int gb = x16_block_bytes(t), q2 = t == T_Q2_K;
    int8_t q[QKK];
    float scl[16], mn[16];
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * gb;
            memset(p, 0, gb);
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * type_bytes(t);
                kunpack(t, w, q, scl, mn);
                memcpy(p + 2 * r, w + (q2 ? 80 : 108), 2);
                if (q2) memcpy(p + 32 + 2 * r, w + 82, 2);
                for (int j = 0; j < 16; j++) {
                    p[(q2 ? Q2K_SC(j) : Q3K_SC(j)) + r] = q2 ? w[j] : (uint8_t)(int8_t)q3k_scale(w + 96, j);
                    for (int l = 0; l < 16; l++) {
                        int u = q[16 * j + l] + (q2 ? 0 : 4);
                        p[(q2 ? Q2K_V(j) : Q3K_L(j)) + 4 * r + l % 4] |= (uint8_t)((u & 3) << (2 * (l / 4)));
                        if (!q2) p[Q3K_H(j / 2) + 4 * r + l % 4] |= (uint8_t)((u >> 2) << (4 * (j % 2) + l / 4));
                    }
                }
            }
        }
}

/* A run of L lanes of Q4_0, Q4_1 or Q8_0 blocks at p (L x the block's bytes): the n blocks at w,
 * `stride` apart, in lanes 0..n-1 (the rest left as they are: zeros): their f16 scales (MXFP4:
 * its scale bytes), for Q4_1
 * then their mins, then the values, run j holding bytes 4j..4j+3 of each lane's value bytes */
static inline __attribute__((always_inline)) void interleave_run(int t, const uint8_t *w, int64_t stride, int n, int L,
                                                                  uint8_t *p) {
    int q41 = t == T_Q4_1 || t == T_Q5_1, q8 = t == T_Q8_0, mx = t == T_MXFP4, h = run_head(t, L);
    int vo = mx ? 1 : (q41 ? 4 : 2) + (is_q5(t) ? 4 : 0);  /* the values' offset in the file's block (Q5: after qh) */
    for (int r = 0; r < n; r++, w += stride) {
        if (mx) p[r] = w[0];  /* the E8M0 scale byte */
        else memcpy(p + 2 * r, w, 2);
        if (q41) memcpy(p + 2 * L + 2 * r, w + 2, 2);
        if (is_q5(t)) {
            uint32_t qh = (uint32_t)rd32(w + vo - 4);
            for (int c = 0; c < 4; c++) {
                int v = 0;
                for (int j = 0; j < 4; j++) v |= (int)((qh >> (4 * j + c)) & 1) << j | (int)((qh >> (16 + 4 * j + c)) & 1) << (4 + j);
                p[h - 4 * L + 4 * r + c] = (uint8_t)v;
            }
        }
        for (int j = 0; j < (q8 ? 8 : 4); j++) {
            uint8_t *o = p + h + 4 * L * j + 4 * r;
            memcpy(o, w + vo + 4 * j, 4);
            if (q8)  /* signed q as unsigned q + 128 (vpdpbusd's unsigned side) */
                for (int c = 0; c < 4; c++) o[c] ^= 0x80;
        }
    }
}

/* Groups of 16 rows of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (or IQ4_NL, MXFP4) blocks, each block's run of 16
 * lanes; a whole group's run covers every byte of it, a last group of fewer rows is zeroed first */
static inline __attribute__((always_inline)) void interleave_runs(int t, const uint8_t *src, int64_t stride,
                                                                   int64_t rows, int nb, uint8_t *dst) {
    int tb = type_bytes(t), gb = 16 * tb;
    for (int64_t g = 0; g < (rows + 15) / 16; g++) {
        int n = rows - g * 16 < 16 ? (int)(rows - g * 16) : 16;
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * gb;
            if (n < 16) memset(p, 0, gb);
            interleave_run(t, src + g * 16 * stride + (int64_t)k * tb, stride, n, 16, p);
        }
    }
}

/* IQ4_XS (2208 bytes a group's block, IQ4XS_SC, IQ4XS_V) */
static void interleave_iq4xs(const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * 2208;
            memset(p, 0, 2208);
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * 136;
                int sh = rd16(w + 2);
                memcpy(p + 2 * r, w, 2);
                for (int sb = 0; sb < 8; sb++) {
                    int ls = ((w[4 + sb / 2] >> (4 * (sb & 1))) & 15) | (((sh >> (2 * sb)) & 3) << 4);
                    p[IQ4XS_SC(sb) + r] = (uint8_t)(int8_t)(ls - 32);
                    for (int j = 0; j < 4; j++) memcpy(p + IQ4XS_V(sb) + 64 * j + 4 * r, w + 8 + 16 * sb + 4 * j, 4);
                }
            }
        }
}

static void interleave(int t, const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    if (t == T_IQ4_XS) { interleave_iq4xs(src, stride, rows, nb, dst); return; }
    if (t == T_Q6_K) { interleave_q6k(src, stride, rows, nb, dst); return; }
    if (t == T_Q4_K) { interleave_q4k(src, stride, rows, nb, dst); return; }
    if (is_k23(t)) { interleave_k23(t, src, stride, rows, nb, dst); return; }
    switch (t) {  /* each type's copy with its offsets known at compile time: 2-3x the generic one's speed */
    case T_Q4_0: interleave_runs(T_Q4_0, src, stride, rows, nb, dst); break;
    case T_Q4_1: interleave_runs(T_Q4_1, src, stride, rows, nb, dst); break;
    case T_Q8_0: interleave_runs(T_Q8_0, src, stride, rows, nb, dst); break;
    case T_Q5_0: interleave_runs(T_Q5_0, src, stride, rows, nb, dst); break;
    case T_Q5_1: interleave_runs(T_Q5_1, src, stride, rows, nb, dst); break;
    case T_MXFP4: interleave_runs(T_MXFP4, src, stride, rows, nb, dst); break;
    default: interleave_runs(t, src, stride, rows, nb, dst);
    }
}

/* R16 (FileMatrix.interleave_blocks): each row's blocks in runs of 16, a row's last run of
 * fewer (nb % 16) as a run of that many lanes; rows stay `nb` blocks' bytes apart in dst */
static void interleave_blocks(int t, const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    int tb = type_bytes(t);
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < nb; c += 16) {
            int L = nb - c < 16 ? nb - c : 16;
            interleave_run(t, src + r * stride + (int64_t)c * tb, tb, L, L, dst + (r * nb + c) * tb);
        }
}

/* ---- the lanes every SIMD level reproduces, in portable C -------------------------------------- */

/* The stored unsigned value i of row r in an X16 block p (interleave's layouts): Q4_0, Q4_1 and
 * Q4_K a nibble, Q8_0 q + 128, Q6_K 6 bits, Q2_K 2, Q3_K q + 4 in 3 */
static inline int x16_value(int t, const uint8_t *p, int r, int i) {
    if (t == T_Q6_K) {
        int quad = i / 4, c = i % 4;
        int lo = (p[Q6_L(quad / 2) + 4 * r + c] >> (4 * (quad & 1))) & 15;
        int hi = (p[Q6_H(i / 16) + 4 * r + c] >> (2 * (quad % 4))) & 3;
        return lo | (hi << 4);
    }
    if (is_k23(t)) {  /* Q2_K q, Q3_K q + 4 */
        int j = i / 16, l = i % 16, v = i % 32;
        int lo = (p[(t == T_Q2_K ? Q2K_V(j) : Q3K_L(j)) + 4 * r + l % 4] >> (2 * (l / 4))) & 3;
        return t == T_Q2_K ? lo : lo | ((p[Q3K_H(i / 32) + 4 * r + v % 4] >> (v / 4)) & 1) << 2;
    }
    if (t == T_Q4_K) {
        int sb = i / 32, l = i % 32;
        return (p[Q4K_V(sb / 2) + 64 * (l / 4) + 4 * r + l % 4] >> (4 * (sb & 1))) & 15;
    }
    if (t == T_IQ4_XS) {  /* the codebook's value + 128 */
        int sb = i / 32, l = i % 16;
        return kvalues_u8[(p[IQ4XS_V(sb) + 64 * (l / 4) + 4 * r + l % 4] >> (4 * ((i % 32) / 16))) & 15];
    }
    return run_value(t, p, 16, r, i);
}

/* One block (at p) of row r of an X16 Q4_0, Q4_1 or Q8_0 group times one token's q8 block x,
 * added to acc: the VNNI tile's lane, operation for operation (fmaf: its fused multiply-adds) */
static inline float x16_block_c(int t, const uint8_t *p, int L, int r, const q8blk *x, float acc) {
    int32_t s = x16_offset(t, x->s);
    for (int i = 0; i < QK; i++) s += run_value(t, p, L, r, i) * x->q[i];
    float d = x16_scale(t, p, r);
    if (t == T_Q4_1 || t == T_Q5_1) return fmaf(fmaf((float)s, d, f16_to_f32(rd16(p + 2 * L + 2 * r)) * (float)x->s), x->d, acc);
    return fmaf((float)s, d * x->d, acc);
}

/* Row r of the group at g (nb blocks) dotted with one token (its q8 blocks x; Q6_K and Q3_K: hs,
 * its sums over each 16 values; Q2_K: those sums times the block's x scale, floats): the VNNI tiles' lane for that row, operation for operation (fmaf: their
 * fused multiply-adds), so both paths give the same floats. */
static float x16_lane_c(int t, const uint8_t *g, int nb, int r, const q8blk *xq, const int32_t *hs) {
    float acc = 0.f;
    if (t == T_Q4_K) {
        for (int k = 0; k < nb; k++, g += 2368) {
            float d = f16_to_f32(rd16(g + 2 * r)), dm = f16_to_f32(rd16(g + 32 + 2 * r));
            for (int sb = 0; sb < 8; sb++) {
                const q8blk *x = xq + 8 * k + sb;
                int32_t sum = 0;
                for (int l = 0; l < QK; l++) sum += x16_value(t, g, r, 32 * sb + l) * x->q[l];
                float dsc = d * (float)g[Q4K_SC(sb) + r], dmm = dm * (float)g[Q4K_MN(sb) + r];
                acc = fmaf(fmaf((float)sum, dsc, -(dmm * (float)x->s)), x->d, acc);
            }
        }
        return acc;
    }
    if (t == T_IQ4_XS) {  /* per sub-block: (d sc) times x's scale, one fused multiply-add */
        for (int k = 0; k < nb; k++, g += 2208) {
            float d = f16_to_f32(rd16(g + 2 * r));
            for (int sb = 0; sb < 8; sb++) {
                const q8blk *x = xq + 8 * k + sb;
                int32_t sum = x16_offset(t, x->s);
                for (int l = 0; l < QK; l++) sum += x16_value(t, g, r, 32 * sb + l) * x->q[l];
                float dsc = d * (float)(int8_t)g[IQ4XS_SC(sb) + r];
                acc = fmaf((float)sum, dsc * x->d, acc);
            }
        }
        return acc;
    }
    if (is_k23(t)) {  /* per activation block: Q6_K's steps (Q3_K: sc - 32 and -4 offsets), and Q2_K's mins */
        const int gb = x16_block_bytes(t), q2 = t == T_Q2_K;
        for (int k = 0; k < nb; k++, g += gb) {
            float d = f16_to_f32(rd16(g + 2 * r)), dm = q2 ? f16_to_f32(rd16(g + 32 + 2 * r)) : 0.f;
            for (int xb = 0; xb < 8; xb++) {
                const q8blk *x = xq + 8 * k + xb;
                const int32_t *hb = hs + 2 * (8 * k + xb);
                int32_t si = 0;
                for (int h = 0; h < 2; h++) {
                    int j = 2 * xb + h;
                    int32_t s = q2 ? 0 : -4 * hb[h];
                    for (int i = 0; i < 16; i++) s += x16_value(t, g, r, 16 * j + i) * x->q[16 * h + i];
                    si += s * (q2 ? g[Q2K_SC(j) + r] & 15 : (int8_t)g[Q3K_SC(j) + r]);
                }
                acc = fmaf((float)si, d * x->d, acc);
                if (q2)  /* hs: Q2_K's x scale times the sums, as floats */
                    for (int h = 0; h < 2; h++) {
                        float xs;
                        memcpy(&xs, hb + h, 4);
                        acc = fmaf(-(dm * (float)(g[Q2K_SC(2 * xb + h) + r] >> 4)), xs, acc);
                    }
            }
        }
        return acc;
    }
    if (t == T_Q6_K) {
        for (int k = 0; k < nb; k++, g += 16 * 210) {
            float d = f16_to_f32(rd16(g + 2 * r));
            for (int xb = 0; xb < 8; xb++) {
                const q8blk *x = xq + 8 * k + xb;
                const int32_t *hb = hs + 2 * (8 * k + xb);
                int32_t sab[2];
                for (int h = 0; h < 2; h++) {
                    sab[h] = -32 * hb[h];
                    for (int i = 0; i < 16; i++) sab[h] += x16_value(t, g, r, 32 * xb + 16 * h + i) * x->q[16 * h + i];
                }
                int32_t si = sab[0] * (int8_t)g[Q6_SC(2 * xb) + r] + sab[1] * (int8_t)g[Q6_SC(2 * xb + 1) + r];
                acc = fmaf((float)si, d * x->d, acc);
            }
        }
        return acc;
    }
    int gb = 16 * type_bytes(t);
    for (int k = 0; k < nb; k++, g += gb) acc = x16_block_c(t, g, 16, r, xq + k, acc);
    return acc;
}

/* One row of an R16 matrix (nb blocks) dotted with one token's q8 blocks:
 * lane k of the VNNI kernel (r16_dot_vnni) accumulates blocks k, k + 16, ... as X16's lane
 * for its row does, then the 16 lanes are summed as hsum16 sums them: the same floats. */
static float r16_dot_c(int t, const uint8_t *w, const q8blk *xq, int nb) {
    int gb = 16 * type_bytes(t);
    float acc[16] = {0};
    for (int c = 0; c < nb; c += 16, w += gb) {
        int L = nb - c < 16 ? nb - c : 16;  /* the last run's missing lanes add zeros, as r16_run's */
        for (int k = 0; k < 16; k++) acc[k] = k < L ? x16_block_c(t, w, L, k, xq + c + k, acc[k]) : acc[k] + 0.f;
    }
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
    for (int k = 0; k < 4; k++) acc[k] += acc[k + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

/* Portable fast-mode products on X16 rows (every ISA level below VNNI) */
static void x16_rows_c(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                       int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < n_rows; r0 += 16, g += gstride)
        for (int b = 0; b < B; b++)
            for (int r = 0; r < 16 && r0 + r < n_rows; r++)
                y[b * ldy + r0 + r] = x16_lane_c(t, g, nb, r, xq + b * ldq, hs ? hs + b * ldh : NULL);
}

/* ---- the activations as R16's kernels read them (pack_x) ---------------------------------------
 * per token and run of 16 blocks (a row's last run: lanes past its blocks zero): 8 runs of x's
 * values (run j, lane k: values 4j..4j+3 of block k), then per block the offset of its integer
 * sum (Q4_1: the float sum of x), then x's scales */
static inline int64_t r16_ld(int nb) { return 10 * (int64_t)((nb + 15) / 16); }
static void r16_pack(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    int q41 = t == T_Q4_1;
    for (int b = 0; b < B; b++, out += r16_ld(nb))
        for (int c = 0; c < nb; c += 16) {
            xpair *o = out + 10 * (c / 16);
            if (nb - c < 16) memset(o, 0, sizeof(xpair) * 10);  /* a short last run: its missing lanes add 0 */
            const q8blk *x = xq + b * ldq + c;
            for (int k = 0; k < 16 && c + k < nb; k++) {
                for (int j = 0; j < 8; j++) memcpy(o[j].q + 4 * k, x[k].q + 4 * j, 4);
                int32_t off = x16_offset(t, x[k].s);
                float sum = (float)x[k].s;
                memcpy(o[8].q + 4 * k, q41 ? (const void *)&sum : (const void *)&off, 4);
                memcpy(o[9].q + 4 * k, &x[k].d, 4);
            }
        }
}

/* ---- dequantization -------------------------------------------------------------------------- */

/* The file's values of row r's block in the X16 (group, block) at p, as the file's rows give them */
static void x16_dequant_block(int t, const uint8_t *p, int L, int r, float *o) {  /* L: lanes of p's run (16 but R16's tails) */
    float d = x16_scale(t, p, r), d2 = t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K ? f16_to_f32(rd16(p + 2 * L + 2 * r)) : 0.f;
    for (int v = 0; v < block_size(t); v++) {
        int q = is_kquant(t) ? x16_value(t, p, r, v) : run_value(t, p, L, r, v);
        switch (t) {
        case T_Q4_0: o[v] = d * (float)(q - 8); break;
        case T_Q4_1: case T_Q5_1: o[v] = d * (float)q + d2; break;  /* d2: the min */
        case T_Q5_0: o[v] = d * (float)(q - 16); break;
        case T_MXFP4: o[v] = d * (float)(q - 12); break;
        case T_Q8_0: case T_IQ4_NL: o[v] = d * (float)(q - 128); break;
        case T_IQ4_XS: o[v] = d * (float)(int8_t)p[IQ4XS_SC(v / 32) + r] * (float)(q - 128); break;  /* as kunpack */
        case T_Q2_K: {  /* as kunpack: (d sc) q - dmin m */
            int sc = p[Q2K_SC(v / 16) + r];
            o[v] = d * (float)(sc & 15) * (float)q - f16_to_f32(rd16(p + 32 + 2 * r)) * (float)(sc >> 4);
            break;
        }
        case T_Q3_K: o[v] = d * (float)(int8_t)p[Q3K_SC(v / 16) + r] * (float)(q - 4); break;
        case T_Q4_K:  /* as kunpack: (d sc) q - dmin m */
            o[v] = d * (float)p[Q4K_SC(v / 32) + r] * (float)q - d2 * (float)p[Q4K_MN(v / 32) + r];
            break;
        default:  /* Q6_K, as kunpack: (d sc) (q - 32) */
            o[v] = d * (float)(int8_t)p[Q6_SC(v / 16) + r] * (float)(q - 32);
        }
    }
}

/* Rows [start, start + n_rows) of an X16 matrix (ranges on groups only), columns [col0, col0 + n) */
static void x16_dequant_rows(mat m, int64_t start, int64_t n_rows, int64_t col0, int n, float *out) {
    int t = m.t, bs = block_size(t), gb = x16_block_bytes(t);
    for (int64_t i = 0; i < n_rows; i++) {
        int64_t row = start + i;
        const uint8_t *p = m.base + (row / 16) * m.stride + (col0 / bs) * gb;
        for (int k = 0; k < n / bs; k++, p += gb) x16_dequant_block(t, p, 16, (int)(row % 16), out + i * n + k * bs);
    }
}

/* Rows (rows[i], else start + i) of an R16 matrix, whole: block k of a row is lane k % 16 of its
 * run k / 16 */
static void r16_dequant_rows(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int n, float *out) {
    int gb = 16 * type_bytes(m.t), nb = n / QK;
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *w = row_at(m, rows ? rows[i] : start + i, 0);
        for (int k = 0; k < nb; k++)
            x16_dequant_block(m.t, w + (k / 16) * gb, nb - k / 16 * 16 < 16 ? nb - k / 16 * 16 : 16, k % 16,
                              out + i * n + k * QK);
    }
}

/* ---- prefetching, for the SIMD loops (interleaved_avx2.c, interleaved_avx512.c) -------------- */

/* Blocks ahead each block asks the caches for (a group's blocks follow each other): a batch's
 * tiles compute long enough per block that the hardware prefetchers fell behind (the 1.1B
 * shape in lockstep: 4 tokens 33-36 -> 27-30 ms a step, 8 tokens 61-65 -> 42-46 ms; one
 * token unchanged). Q4_0, Q4_1 and Q8_0's tiles, a block's lines at a time. The 512-bit Q4_K
 * and Q6_K tiles (2368 and 3360 bytes a block) ran faster with none (one core, the 1.1B shape's
 * 5632 x 2048 rows from DRAM, one token / 4 tokens, two blocks ahead -> none: VNNI Q4_K 291 ->
 * 256 / 536 -> 404 us, Q6_K 521 -> 304 / 807 -> 643), and so did the 256-bit ones while they
 * walked a block once per half of 8 rows. Since those take both halves at once (a sub-block's
 * lines once), K_AHEAD = 2 blocks ahead, a sub-block's share of lines at a time, pays for
 * batches at AVX2: the 1.1B Q4_K_M shape in lockstep, 4 tokens 40.6-41.5 -> 33.2-33.4 ms a
 * step (1 and 4 blocks ahead no better). One token ran faster without (22.5-23.2 against
 * 23.7-24.6 ms, interleaved), so only batches prefetch. */
#define X16_AHEAD 8
#define K_AHEAD 2
#if HAVE_X86
/* bytes [from, to) of the block `ahead` bytes past g into L1, a cache line at a time */
static INLINE void x16_fetch(const uint8_t *g, int64_t ahead, int from, int to) {
    for (int o = from; o < to; o += 64) _mm_prefetch((const char *)g + ahead + o, _MM_HINT_T0);
}
#endif

#if HAVE_X86
/* A cursor runs R16_AHEAD runs ahead over the (row, run) sequence an R16 loop reads, asking for
 * each into L2 (prefetcht1): rows picked at random, 1.1 KB each, came at 9-11 GB/s on one core
 * with no prefetch or prefetches into L1 (too few misses in flight), 21-23 GB/s with these (the
 * 1.1B shape's up rows, DRAM, half of them: 212 us, all of X16's 237). The loop fetches one run
 * ahead per run it reads. */
#define R16_AHEAD 128
typedef struct {
    mat m;
    const int32_t *rows;  /* the rows picked, or NULL: start, start + 1, .. */
    int64_t start, n, i, gb;
    int c, nc;  /* the next run to fetch: run c of the cursor's row i, of nc a row */
} r16_cursor;
static inline void r16_fetch(r16_cursor *k) {
    if (k->i >= k->n) return;
    const char *p = (const char *)row_at(k->m, k->rows ? k->rows[k->i] : k->start + k->i, 0) + k->c * k->gb;
    for (int o = 0; o < k->gb; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
    if (++k->c == k->nc) { k->c = 0; k->i++; }
}
static inline r16_cursor r16_cursor_at(mat m, const int32_t *rows, int64_t start, int64_t n, int nb) {
    r16_cursor k = {m, rows, start, n, 0, 16 * (int64_t)type_bytes(m.t), 0, (nb + 15) / 16};
    for (int j = 0; j < R16_AHEAD; j++) r16_fetch(&k);
    return k;
}
#endif
