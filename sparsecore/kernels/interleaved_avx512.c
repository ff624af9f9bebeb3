/* simd_avx512.c, part:
 * the repacked layouts with AVX-512 VNNI: X16's tiles and R16's runs and rows. */

#if HAVE_X86
/* ---- X16 --------------------------------------------------------------------------------------
 * Fast mode on interleaved rows (X16, see interleave): a 512-bit register holds 4 nibble bytes
 * of each of 16 rows, so per token and block 8 vpdpbusd against x's matching 4 bytes
 * (broadcast) give 16 rows' integer sums, and one conversion, one scale product and one
 * accumulation serve all 16 rows. A token then costs about 12 vector operations per 512
 * weights, against 32 on the file's own layout (4 per block pair of one row): what a batch
 * cannot share there (docs/KERNELS.md, Interleaved rows). Each lane's floats are the portable
 * x16_rows_c's, in the same order, so a token gets the same result alone or in any batch and
 * on either path. */

/* The value bytes of a run of L lanes at v (interleave_run's layout; L < 16, an R16 row's last
 * run: masked loads, lanes past L zero) as unsigned values: u[i] holds values 4i..4i+3 of
 * every lane (Q4: low nibbles in u[0..3], high ones in u[4..7]). X16's tiles and R16's runs. */
VNNI static INLINE void run_values(int q8, const uint8_t *v, int L, __m512i *u) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __mmask64 mv = L == 16 ? ~0ULL : (1ULL << (4 * L)) - 1;
    for (int j = 0; j < (q8 ? 8 : 4); j++) {
        __m512i z = L == 16 ? _mm512_loadu_si512(v + 64 * j) : _mm512_maskz_loadu_epi8(mv, v + 4 * L * j);
        if (q8) { u[j] = z; continue; }
        u[j] = _mm512_and_si512(z, m4);
        u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
    }
}
/* MXFP4's 16 E8M0 scale bytes at p as floats, e8m0_half's exactly (e8m0_half8's, 16 lanes) */
VNNI static INLINE __m512 e8m0_half16(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), one = _mm512_set1_epi32(1);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e, one), tiny, normal));
}
VNNI static INLINE void x16_tile_vnni(int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B,
                                      float *y, int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const int gb = 16 * type_bytes(t), q41 = t == T_Q4_1 || t == T_Q5_1, q8 = t == T_Q8_0;
    const int nl = t == T_IQ4_NL || t == T_MXFP4, q5 = is_q5(t);
    /* IQ4_NL's codebook + 128, MXFP4's + 12 (run_value) */
    const uint8_t *book = t == T_MXFP4 ? kvalues_mxfp4_u8 : kvalues_u8;
    const __m512i kv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)book));
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        x16_fetch(g, X16_AHEAD * gb, 0, gb);
        __m512 d = t == T_MXFP4 ? e8m0_half16(g) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m512 m = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32))) : d;
        __m512i u[8];  /* u[i]: values 4i..4i+3 of the 16 rows, unsigned */
        run_values(q8, g + run_head(t, 16), 16, u);
        if (nl)  /* IQ4_NL, MXFP4: the nibbles' codebook values, unsigned */
            for (int j = 0; j < 8; j++) u[j] = _mm512_shuffle_epi8(kv, u[j]);
        if (q5) {  /* Q5: the fifth bits (interleave_run) to bit 4, run j's low nibbles from bit j, its high from 4 + j */
            const __m512i hb = _mm512_loadu_si512(g + run_head(t, 16) - 64), m16 = _mm512_set1_epi8(16);
            for (int j = 0; j < 4; j++) {
                u[j] = _mm512_or_si512(u[j], _mm512_and_si512(_mm512_slli_epi16(hb, 4 - j), m16));
                u[4 + j] = _mm512_or_si512(u[4 + j], _mm512_and_si512(_mm512_srli_epi16(hb, j), m16));
            }
        }
        for (int b = 0; b < B; b++) {
            const q8blk *x = xq + b * ldq + k;
            __m512i s = _mm512_set1_epi32(x16_offset(t, x->s)), s2 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {  /* two chains: a token alone waits on vpdpbusd's latency */
                s = _mm512_dpbusd_epi32(s, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                s2 = _mm512_dpbusd_epi32(s2, u[j + 1], _mm512_set1_epi32(rd32(x->q + 4 * j + 4)));
            }
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s, s2));
            if (q41)  /* d sum u x + m sum x, times x's scale */
                acc[b] = _mm512_fmadd_ps(_mm512_fmadd_ps(f, d, _mm512_mul_ps(m, _mm512_set1_ps((float)x->s))),
                                         _mm512_set1_ps(x->d), acc[b]);
            else
                acc[b] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[b]);
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* Q6_K on interleaved rows (layout: interleave): per 256-value block the 16 rows' scales
 * widened once, then per activation block (two 16-value sub-blocks) the 6-bit values of 16 rows
 * unpacked once for every token: per token 8 vpdpbusd, the sub-blocks' -32 offsets (hs: each
 * token's sums of x over 16 values) in the accumulators' start, their int8 scales as two
 * 32-bit products, one conversion and one scaled accumulation. */
VNNI static INLINE void x16_tile_q6k_vnni(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, const int32_t *hs,
                                          int64_t ldh, int B, float *y, int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += 16 * 210) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        for (int xb = 0; xb < 8; xb++) {  /* activation block xb: sub-blocks 2 xb, 2 xb + 1 */
            __m512i u[8], sc[2];
            for (int h = 0; h < 2; h++) {
                int n = 2 * xb + h;
                __m512i l0 = _mm512_loadu_si512(g + Q6_L(2 * n)), l1 = _mm512_loadu_si512(g + Q6_L(2 * n + 1));
                __m512i hh = _mm512_loadu_si512(g + Q6_H(n));
                u[4 * h + 0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hh, 4), m30));
                u[4 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                               _mm512_and_si512(_mm512_slli_epi16(hh, 2), m30));
                u[4 * h + 2] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(hh, m30));
                u[4 * h + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                               _mm512_and_si512(_mm512_srli_epi16(hh, 2), m30));
                sc[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(g + Q6_SC(n))));
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + 8 * k + xb;
                const int32_t *hb = hs + b * ldh + 2 * (8 * k + xb);
                __m512i sa = _mm512_set1_epi32(-32 * hb[0]), sb = _mm512_set1_epi32(-32 * hb[1]);
                for (int j = 0; j < 4; j++) {
                    sa = _mm512_dpbusd_epi32(sa, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                    sb = _mm512_dpbusd_epi32(sb, u[4 + j], _mm512_set1_epi32(rd32(x->q + 16 + 4 * j)));
                }
                __m512i si = _mm512_add_epi32(_mm512_mullo_epi32(sa, sc[0]), _mm512_mullo_epi32(sb, sc[1]));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[b]);
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* Q4_K on interleaved rows (layout: interleave_q4k): per sub-block of 32 values (one
 * activation block) the 16 rows' d sc and dmin m as float vectors, shared by every token; per
 * token 8 vpdpbusd and the Q4_1-like float steps: (d sc) sum q x - (dmin m) sum x, times x's
 * scale. */
VNNI static INLINE void x16_tile_q4k_vnni(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                          int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += 2368) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
        for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m512i u[2][8];
            for (int j = 0; j < 8; j++) {
                __m512i z = _mm512_loadu_si512(g + Q4K_V(p) + 64 * j);
                u[0][j] = _mm512_and_si512(z, m4);
                u[1][j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            }
            for (int h = 0; h < 2; h++) {
                int sb = 2 * p + h;
                __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                  _mm_loadu_si128((const __m128i *)(g + Q4K_SC(sb))))));
                __m512 dmm = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(g + Q4K_MN(sb))))));
                for (int b = 0; b < B; b++) {
                    const q8blk *x = xq + b * ldq + 8 * k + sb;
                    __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
                    for (int j = 0; j < 8; j += 2) {
                        s = _mm512_dpbusd_epi32(s, u[h][j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                        s2 = _mm512_dpbusd_epi32(s2, u[h][j + 1], _mm512_set1_epi32(rd32(x->q + 4 * j + 4)));
                    }
                    __m512 v = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s, s2)), dsc,
                                               _mm512_mul_ps(dmm, _mm512_set1_ps((float)x->s)));
                    acc[b] = _mm512_fmadd_ps(v, _mm512_set1_ps(x->d), acc[b]);
                }
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* IQ4_XS on interleaved rows (layout: interleave_iq4xs): per sub-block of 32 values the 16
 * rows' d (ls - 32) as floats and their nibbles looked up in the codebook + 128 (unsigned, for
 * vpdpbusd), shared by every token; per token 8 vpdpbusd from -128 sum x (the codebook's own
 * integer sums, exactly), one conversion, one scale product and one accumulation. */
VNNI static INLINE void x16_tile_iq4xs_vnni(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                            int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const __m512i m4 = _mm512_set1_epi8(15), kv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kvalues_u8));
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += 2208) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        for (int sb = 0; sb < 8; sb++) {
            __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128((const __m128i *)(g + IQ4XS_SC(sb))))));
            __m512i u[8];
            for (int j = 0; j < 4; j++) {
                __m512i z = _mm512_loadu_si512(g + IQ4XS_V(sb) + 64 * j);
                u[j] = _mm512_shuffle_epi8(kv, _mm512_and_si512(z, m4));
                u[4 + j] = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + 8 * k + sb;
                __m512i s = _mm512_set1_epi32(-128 * x->s), s2 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    s = _mm512_dpbusd_epi32(s, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                    s2 = _mm512_dpbusd_epi32(s2, u[j + 1], _mm512_set1_epi32(rd32(x->q + 4 * j + 4)));
                }
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s, s2)), _mm512_mul_ps(dsc, _mm512_set1_ps(x->d)),
                                         acc[b]);
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* Q2_K and Q3_K on interleaved rows (layout: interleave_k23): per activation block the two
 * sub-blocks' values of 16 rows unpacked once for every token (2 bits shifted and masked; Q3_K's
 * third from the block's high bits, as q + 4), their scales as 32-bit integers and Q2_K's
 * dmin m as floats; per token Q6_K's steps (8 vpdpbusd, Q3_K's -4 offsets from hs in the
 * accumulators' start, two 32-bit scale products, one conversion, one scaled accumulation),
 * and Q2_K's mins: two FMAs with hs's float sums (x16_lane_c's order). */
VNNI static INLINE void x16_tile_k23_vnni(const int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq,
                                          const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const int q2 = t == T_Q2_K, gb = x16_block_bytes(t);
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m512 dm = q2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32))) : d;
        for (int xb = 0; xb < 8; xb++) {
            __m512i u[8], sc[2];
            __m512 dmm[2] = {d, d};
            const __m512i hh = q2 ? _mm512_setzero_si512() : _mm512_loadu_si512(g + Q3K_H(xb));
            for (int h = 0; h < 2; h++) {
                const int j = 2 * xb + h;
                const __m512i z = _mm512_loadu_si512(g + (q2 ? Q2K_V(j) : Q3K_L(j)));
                for (int s = 0; s < 4; s++) {
                    __m512i v = _mm512_and_si512(s ? _mm512_srli_epi16(z, 2 * s) : z, m3);
                    if (!q2) {  /* bit 4h + s of the high bits to bit 2 (16-bit shifts move no other byte's bit there) */
                        const int sh = 4 * h + s;
                        __m512i hb = sh < 2 ? _mm512_slli_epi16(hh, 2 - sh) : sh > 2 ? _mm512_srli_epi16(hh, sh - 2) : hh;
                        v = _mm512_or_si512(v, _mm512_and_si512(hb, m4));
                    }
                    u[4 * h + s] = v;
                }
                const __m128i sb = _mm_loadu_si128((const __m128i *)(g + (q2 ? Q2K_SC(j) : Q3K_SC(j))));
                if (q2) {
                    sc[h] = _mm512_cvtepu8_epi32(_mm_and_si128(sb, m15));
                    dmm[h] = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(sb, 4), m15))));
                } else
                    sc[h] = _mm512_cvtepi8_epi32(sb);
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + 8 * k + xb;
                const int32_t *hb = hs + b * ldh + 2 * (8 * k + xb);
                __m512i sa = q2 ? _mm512_setzero_si512() : _mm512_set1_epi32(-4 * hb[0]);
                __m512i sb = q2 ? _mm512_setzero_si512() : _mm512_set1_epi32(-4 * hb[1]);
                for (int j = 0; j < 4; j++) {
                    sa = _mm512_dpbusd_epi32(sa, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                    sb = _mm512_dpbusd_epi32(sb, u[4 + j], _mm512_set1_epi32(rd32(x->q + 16 + 4 * j)));
                }
                __m512i si = _mm512_add_epi32(_mm512_mullo_epi32(sa, sc[0]), _mm512_mullo_epi32(sb, sc[1]));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[b]);
                if (q2) {
                    const float *xs = (const float *)hb;
                    acc[b] = _mm512_fnmadd_ps(dmm[0], _mm512_set1_ps(xs[0]), acc[b]);
                    acc[b] = _mm512_fnmadd_ps(dmm[1], _mm512_set1_ps(xs[1]), acc[b]);
                }
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* one tile of nt tokens with the type and the count constant: each (type, count) its own
 * inlined copy; CALL(n) is the tile function's call for n tokens */
#define BY_TILE(CALL)                                                                   \
    switch (nt) {                                                                       \
    case 8: CALL(8); break;                                                             \
    case 7: CALL(7); break;                                                             \
    case 6: CALL(6); break;                                                             \
    case 5: CALL(5); break;                                                             \
    case 4: CALL(4); break;                                                             \
    case 3: CALL(3); break;                                                             \
    case 2: CALL(2); break;                                                             \
    default: CALL(1);                                                                   \
    }
#define Q4_0_TILE(n) x16_tile_vnni(T_Q4_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_1_TILE(n) x16_tile_vnni(T_Q4_1, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q8_0_TILE(n) x16_tile_vnni(T_Q8_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_K_TILE(n) x16_tile_q4k_vnni(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q6_K_TILE(n) x16_tile_q6k_vnni(g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)
#define IQ4_NL_TILE(n) x16_tile_vnni(T_IQ4_NL, g, nb, xb, ldq, n, yb, ldy, nv)
#define MXFP4_TILE(n) x16_tile_vnni(T_MXFP4, g, nb, xb, ldq, n, yb, ldy, nv)
#define IQ4_XS_TILE(n) x16_tile_iq4xs_vnni(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q5_0_TILE(n) x16_tile_vnni(T_Q5_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q5_1_TILE(n) x16_tile_vnni(T_Q5_1, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q2_K_TILE(n) x16_tile_k23_vnni(T_Q2_K, g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)
#define Q3_K_TILE(n) x16_tile_k23_vnni(T_Q3_K, g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)

/* nb: blocks of the type per row (of 32 values, of 256 for the K-quants); hs: Q6_K's and Q3_K's
 * sums of x over each 16 values (Q2_K's times x's scale, floats), ldh per token */
VNNI static void x16_rows_vnni(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                               int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy) {
    for (int64_t r = 0; r < n_rows; r += 16, g += gstride) {
        int nv = n_rows - r < 16 ? (int)(n_rows - r) : 16;
        for (int b = 0; b < B; b += TILE_V) {
            const q8blk *xb = xq + b * ldq;
            float *yb = y + b * ldy + r;
            int nt = B - b < TILE_V ? B - b : TILE_V;
            if (t == T_Q6_K) BY_TILE(Q6_K_TILE)
            else if (t == T_Q2_K) BY_TILE(Q2_K_TILE)
            else if (t == T_Q3_K) BY_TILE(Q3_K_TILE)
            else if (t == T_Q4_K) BY_TILE(Q4_K_TILE)
            else if (t == T_Q4_0) BY_TILE(Q4_0_TILE)
            else if (t == T_Q4_1) BY_TILE(Q4_1_TILE)
            else if (t == T_IQ4_XS) BY_TILE(IQ4_XS_TILE)
            else if (t == T_IQ4_NL) BY_TILE(IQ4_NL_TILE)
            else if (t == T_MXFP4) BY_TILE(MXFP4_TILE)
            else if (t == T_Q5_0) BY_TILE(Q5_0_TILE)
            else if (t == T_Q5_1) BY_TILE(Q5_1_TILE)
            else BY_TILE(Q8_0_TILE)
        }
    }
}
#undef BY_TILE
#undef Q4_0_TILE
#undef Q4_1_TILE
#undef Q8_0_TILE
#undef Q4_K_TILE
#undef Q6_K_TILE
#undef IQ4_NL_TILE
#undef MXFP4_TILE
#undef IQ4_XS_TILE
#undef Q5_0_TILE
#undef Q5_1_TILE
#undef Q2_K_TILE
#undef Q3_K_TILE

/* ---- R16 --------------------------------------------------------------------------------------
 * Fast mode on R16 rows (rows picked by activity: threshold steps' up rows, predictors' gate and
 * up rows). On the file's layout a row's block pair costs about 16 vector operations (the
 * nibbles and two scales put in place per pair, one accumulation per 64 values); here 16 blocks
 * (512 values) cost about 27: 8 vpdpbusd against x's values packed to match (r16_pack), and one
 * conversion, one scale product and one accumulation for all 16 blocks. */

/* the 16 lanes' sum in hsum8's order after adding the high 8 lanes to the low (r16_dot_c) */
VNNI static INLINE float hsum16(__m512 v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* One run of L blocks of an R16 row (at w) times x's matching pack entries, into acc; lanes
 * past L load zeros (their scales too), so they add 0 */
VNNI static INLINE __m512 r16_run(const int t, const uint8_t *w, const int L, const xpair *x, __m512 acc) {
    const int q41 = t == T_Q4_1, q8 = t == T_Q8_0;
    const __mmask16 ms = (__mmask16)((1u << L) - 1);
    __m512i u[8];
    run_values(q8, w + run_head(t, L), L, u);
    /* two chains: a row waits on vpdpbusd's latency, not its throughput */
    __m512i s0 = q41 ? _mm512_setzero_si512() : _mm512_load_si512(x[8].q), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_load_si512(x[j].q));
        s1 = _mm512_dpbusd_epi32(s1, u[4 + j], _mm512_load_si512(x[4 + j].q));
    }
    __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), xd = _mm512_load_ps((const float *)x[9].q);
    __m512 d = _mm512_cvtph_ps(L == 16 ? _mm256_loadu_si256((const __m256i *)w) : _mm256_maskz_loadu_epi16(ms, w));
    if (q41) {
        const uint8_t *mp = w + 2 * L;
        __m512 m = _mm512_cvtph_ps(L == 16 ? _mm256_loadu_si256((const __m256i *)mp) : _mm256_maskz_loadu_epi16(ms, mp));
        return _mm512_fmadd_ps(_mm512_fmadd_ps(f, d, _mm512_mul_ps(m, _mm512_load_ps((const float *)x[8].q))), xd, acc);
    }
    return _mm512_fmadd_ps(f, _mm512_mul_ps(d, xd), acc);
}

/* one R16 row (nb blocks) times one token packed by r16_pack, into acc: its full runs, then
 * its last run of nb % 16 blocks */
VNNI static INLINE __m512 r16_row(const int t, const uint8_t *w, int nb, const xpair *x, __m512 acc) {
    const int gb = 16 * type_bytes(t);
    int c = 0;
    for (; c + 16 <= nb; c += 16, w += gb, x += 10) acc = r16_run(t, w, 16, x, acc);
    return c < nb ? r16_run(t, w, nb - c, x, acc) : acc;
}

VNNI static float r16_dot_vnni(int t, const uint8_t *w, const xpair *x, int nb) {
    __m512 z = _mm512_setzero_ps();
    return hsum16(t == T_Q4_0 ? r16_row(T_Q4_0, w, nb, x, z)
                  : t == T_Q4_1 ? r16_row(T_Q4_1, w, nb, x, z) : r16_row(T_Q8_0, w, nb, x, z));
}

VNNI static INLINE void r16_rows_t(const int t, mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x,
                                   int nb, float *y) {
    const int64_t gb = 16 * type_bytes(t);
    r16_cursor cur = r16_cursor_at(m, rows, start, n, nb);
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {  /* two rows at a time: their chains interleave */
        const uint8_t *w0 = row_at(m, rows ? rows[i] : start + i, 0), *w1 = row_at(m, rows ? rows[i + 1] : start + i + 1, 0);
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int c = 0;
        for (; c + 16 <= nb; c += 16) {
            r16_fetch(&cur);
            r16_fetch(&cur);
            a0 = r16_run(t, w0 + c / 16 * gb, 16, x + 10 * (c / 16), a0);
            a1 = r16_run(t, w1 + c / 16 * gb, 16, x + 10 * (c / 16), a1);
        }
        if (c < nb) {
            r16_fetch(&cur);
            r16_fetch(&cur);
            a0 = r16_run(t, w0 + c / 16 * gb, nb - c, x + 10 * (c / 16), a0);
            a1 = r16_run(t, w1 + c / 16 * gb, nb - c, x + 10 * (c / 16), a1);
        }
        y[i] = hsum16(a0);
        y[i + 1] = hsum16(a1);
    }
    if (i < n) y[i] = hsum16(r16_row(t, row_at(m, rows ? rows[i] : start + i, 0), nb, x, _mm512_setzero_ps()));
}
/* y[i] = row (rows[i], else start + i) . x for i < n (x: one token packed by r16_pack): every
 * picked row of a step in one call (called a row at a time through dot_any, with no cursor
 * and no pairs, a 4-run row cost some 60 ns in L2; 37 ns here) */
VNNI static void r16_rows_vnni(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    if (m.t == T_Q4_0) r16_rows_t(T_Q4_0, m, rows, start, n, x, nb, y);
    else if (m.t == T_Q4_1) r16_rows_t(T_Q4_1, m, rows, start, n, x, nb, y);
    else r16_rows_t(T_Q8_0, m, rows, start, n, x, nb, y);
}
#endif
