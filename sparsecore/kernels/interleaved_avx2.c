/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * the repacked layouts on 256-bit registers: X16's tiles and R16's runs and rows,
 * for CPUs without AVX-512 (AMD Zen 2/3, Intel 12th-14th gen). Included once per 256-bit level
 * by interleaved_256.c, which defines LV (the target attribute), NM(f) (f's name at that level)
 * and how a lane's integer sums are formed:
 *   AVX2 (DP256 0): maddubs (unsigned weight byte times signed x byte, pairs summed in int16)
 *     and madd (int16 pairs summed in int32): ACC16 adds into int16 lanes, FIN16 widens. The
 *     int16 sums cannot overflow: a Q4 nibble pair is at most 2 * 15 * 127, so a whole block's
 *     8 maddubs add in int16 (30480) before one madd; Q6_K's pairs (2 * 63 * 127) add two at a
 *     time; Q8_0's signed bytes go through the sign trick (|q| unsigned, x with q's sign:
 *     2 * 128 * 127), one madd each.
 *   AVX-VNNI (DP256 1): vpdpbusd on 256-bit registers (DPB: VEX-encoded on CPUs with AVX-VNNI,
 *     EVEX on CPUs with AVX-512 VNNI, where the tests run it): ACC16 is one vpdpbusd into int32
 *     lanes, FIN16 nothing; Q8_0 reads its stored q + 128 unsigned, as the 512-bit tile.
 * A group's value run j (64 bytes: 4 value bytes of each of 16 rows) is two registers: rows 0-7
 * and rows 8-15 ("halves"). The integer sums are exact, so every lane's floats are x16_lane_c's
 * and the 512-bit tile's, operation for operation: a token gets the same result on every level,
 * alone or in any batch. */

#if HAVE_X86

/* sum over the 8 runs of one half: each run's unsigned values times x's 4 bytes (broadcast),
 * ACC16 / FIN16 as the level forms them (maddubs in int16, then madd; or vpdpbusd) */
LV static INLINE __m256i NM(a2_sum_u4)(const __m256i *u, const int8_t *xq) {
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) s = ACC16(s, u[j], _mm256_set1_epi32(rd32(xq + 4 * j)));
    return FIN16(s);
}
/* Q5_0, Q5_1 (and MXFP4's codebook + 12): values up to 31, so maddubs pairs (2 x 31 x 127) add
 * four at a time in int16 */
LV static INLINE __m256i NM(a2_sum_u5)(const __m256i *u, const int8_t *xq) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        s0 = ACC16(s0, u[j], _mm256_set1_epi32(rd32(xq + 4 * j)));
        s1 = ACC16(s1, u[4 + j], _mm256_set1_epi32(rd32(xq + 16 + 4 * j)));
    }
    return _mm256_add_epi32(FIN16(s0), FIN16(s1));
}
#if !DP256
/* Q8_0: q signed (stored q + 128); aq = |q| (unsigned), q itself for the sign */
LV static INLINE __m256i NM(a2_sum_q8)(const __m256i *aq, const __m256i *q, const int8_t *xq) {
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(rd32(xq + 4 * j)), q[j]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aq[j], xs), _mm256_set1_epi16(1)));
    }
    return s;
}
#endif
/* IQ4_NL's and IQ4_XS's codebook in both 128-bit lanes, for pshufb on the nibbles: with
 * vpdpbusd the values + 128 (unsigned; the sums' offset -128 sum x), with maddubs the signed
 * values (the sign trick, as Q8_0's: a pair of products, 2 x 127 x 127, fits int16, two do not) */
LV static INLINE __m256i NM(iq4_book)(void) {
#if DP256
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_u8));
#else
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
#endif
}
/* a block's (IQ4_XS: a sub-block's) 4 runs of 8 rows' nibbles at v (64 bytes apart) looked up in
 * the codebook (iq4_book): u[j] values 4j.. (low nibbles), u[4 + j] values 16 + 4j.. (high);
 * AVX2: q the signed values, u their magnitudes */
LV static INLINE void NM(iq4_runs)(const uint8_t *v, __m256i kv, __m256i *u, __m256i *q) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        __m256i z = _mm256_loadu_si256((const __m256i *)(v + 64 * j));
        __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(z, m4));
        __m256i hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(z, 4), m4));
#if DP256
        (void)q;
        u[j] = lo, u[4 + j] = hi;
#else
        q[j] = lo, q[4 + j] = hi;
        u[j] = _mm256_abs_epi8(lo), u[4 + j] = _mm256_abs_epi8(hi);
#endif
    }
}
/* one token's exact integer sums of 8 rows' codebook values (iq4_runs) times x's 32 values */
LV static INLINE __m256i NM(iq4_sum)(const __m256i *u, const __m256i *q, const q8blk *x) {
#if DP256
    (void)q;
    return _mm256_add_epi32(NM(a2_sum_u4)(u, x->q), _mm256_set1_epi32(-128 * x->s));
#else
    return NM(a2_sum_q8)(u, q, x->q);
#endif
}

/* MXFP4's 8 E8M0 scale bytes at p as floats, e8m0_half's exactly: 2^(e - 128), the float32
 * subnormals 2^-128, 2^-127 for e 0 and 1 */
LV static INLINE __m256 NM(e8m0_half8)(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), one = _mm256_set1_epi32(1);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, one)));
}

/* the 8 lanes of acc (rows r0..r0+7) into y, the first nvalid - r0 of them */
LV static INLINE void NM(a2_store)(float *y, __m256 acc, int n) {
    if (n >= 8) { _mm256_storeu_ps(y, acc); return; }
    float t[8];
    _mm256_storeu_ps(t, acc);
    for (int i = 0; i < n; i++) y[i] = t[i];
}

/* a tile's accumulators acc[h][b] (rows 8 h .. 8 h + 7, token b) into y, the first nvalid rows
 * (a macro: acc stays a register array of the caller's) */
#define A2_STORE_TILE(y, ldy, acc, B, nvalid)                                              \
    for (int b_ = 0; b_ < (B); b_++) {                                                      \
        NM(a2_store)((y) + b_ * (ldy), (acc)[0][b_], (nvalid));                             \
        if ((nvalid) > 8) NM(a2_store)((y) + b_ * (ldy) + 8, (acc)[1][b_], (nvalid) - 8);   \
    }

/* IQ4_NL, MXFP4, Q5_0, Q5_1: per block and half, the values unpacked once for every token */
LV static INLINE void NM(x16_tile)(int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                      int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const int gb = 16 * type_bytes(t), q41 = t == T_Q5_1, nl = t == T_IQ4_NL, mx = t == T_MXFP4;
    const int hd = run_head(t, 16);
    const __m256i m4 = _mm256_set1_epi8(15), kv = NM(iq4_book)();
    const __m256i kmx = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_mxfp4_u8));
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        x16_fetch(g, X16_AHEAD * gb, 0, gb);
        for (int h = 0; h < 2; h++) {
            __m256 d = mx ? NM(e8m0_half8)(g + 8 * h) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h)));
            __m256 m = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * h))) : d;
            const uint8_t *v = g + hd + 32 * h;
            __m256i si[TILE_A];  /* each token's integer sums of the 8 rows */
            if (nl) {  /* the codebook's values, looked up once for every token */
                __m256i u[8], q[8];
                NM(iq4_runs)(v, kv, u, q);
                for (int b = 0; b < B; b++) si[b] = NM(iq4_sum)(u, q, xq + b * ldq + k);
            } else if (mx) {  /* the codebook's values + 12 (0..24), summed as Q5's, less 12 sum x */
                __m256i u[8];
                for (int j = 0; j < 4; j++) {
                    __m256i z = _mm256_loadu_si256((const __m256i *)(v + 64 * j));
                    u[j] = _mm256_shuffle_epi8(kmx, _mm256_and_si256(z, m4));
                    u[4 + j] = _mm256_shuffle_epi8(kmx, _mm256_and_si256(_mm256_srli_epi16(z, 4), m4));
                }
                for (int b = 0; b < B; b++) {
                    const q8blk *x = xq + b * ldq + k;
                    si[b] = _mm256_add_epi32(NM(a2_sum_u5)(u, x->q), _mm256_set1_epi32(x16_offset(t, x->s)));
                }
            } else {  /* Q5: unpacked once for every token (loading a run per token measured slower) */
                __m256i u[8];
                /* the fifth bits (interleave_run): bit j of a byte to bit 4 for run j's low nibbles, 4 + j for its high */
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(v - 64)), m16 = _mm256_set1_epi8(16);
                for (int j = 0; j < 4; j++) {
                    __m256i z = _mm256_loadu_si256((const __m256i *)(v + 64 * j));
                    u[j] = _mm256_or_si256(_mm256_and_si256(z, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4 - j), m16));
                    u[4 + j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(hb, j), m16));
                }
                for (int b = 0; b < B; b++) {
                    const q8blk *x = xq + b * ldq + k;
                    si[b] = _mm256_add_epi32(NM(a2_sum_u5)(u, x->q), _mm256_set1_epi32(x16_offset(t, x->s)));
                }
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + k;
                __m256 f = _mm256_cvtepi32_ps(si[b]);
                if (q41)  /* d sum u x + m sum x, times x's scale */
                    acc[h][b] = _mm256_fmadd_ps(_mm256_fmadd_ps(f, d, _mm256_mul_ps(m, _mm256_set1_ps((float)x->s))),
                                                _mm256_set1_ps(x->d), acc[h][b]);
                else
                    acc[h][b] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(x->d)), acc[h][b]);
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* Q4_0, Q4_1: both halves at once, run by run: each run's 4 x bytes broadcast once per token
 * for the 16 rows, each token's sums of both halves in int16 (a2_sum_u4's bound), the float
 * steps x16_tile's. The runs go outer and every sum is pinned in a register as it grows (an
 * empty asm), so the live values fit AVX2's 16 registers: left to itself the compiler hoisted
 * every token's broadcasts and the sums' additions and spilled them to the stack. */
LV static INLINE void NM(x16_tile_q4)(int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                         int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const int gb = 16 * type_bytes(t), q41 = t == T_Q4_1, hd = run_head(t, 16);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        x16_fetch(g, X16_AHEAD * gb, 0, gb);
        __m256i s16[2][TILE_A];
        for (int j = 0; j < 4; j++) {
            const uint8_t *v = g + hd + 64 * j;
            __m256i z0 = _mm256_loadu_si256((const __m256i *)v), z1 = _mm256_loadu_si256((const __m256i *)(v + 32));
            __m256i lo0 = _mm256_and_si256(z0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(z0, 4), m4);
            __m256i lo1 = _mm256_and_si256(z1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(z1, 4), m4);
            for (int b = 0; b < B; b++) {
                const int8_t *xb = xq[b * ldq + k].q;
                __m256i xl = _mm256_set1_epi32(rd32(xb + 4 * j)), xh = _mm256_set1_epi32(rd32(xb + 16 + 4 * j));
                __m256i a0 = ACC16(j ? s16[0][b] : _mm256_setzero_si256(), lo0, xl);
                __m256i a1 = ACC16(j ? s16[1][b] : _mm256_setzero_si256(), lo1, xl);
                s16[0][b] = ACC16(a0, hi0, xh);
                s16[1][b] = ACC16(a1, hi1, xh);
                __asm__("" : "+x"(s16[0][b]), "+x"(s16[1][b]));
            }
        }
        for (int b = 0; b < B; b++) {
            const q8blk *x = xq + b * ldq + k;
            const __m256i off = _mm256_set1_epi32(x16_offset(t, x->s));
            const __m256 xd = _mm256_set1_ps(x->d);
            for (int h = 0; h < 2; h++) {
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h)));
                __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(FIN16(s16[h][b]), off));
                if (q41) {  /* d sum u x + m sum x, times x's scale */
                    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * h)));
                    acc[h][b] = _mm256_fmadd_ps(_mm256_fmadd_ps(f, d, _mm256_mul_ps(m, _mm256_set1_ps((float)x->s))), xd, acc[h][b]);
                } else
                    acc[h][b] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, xd), acc[h][b]);
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* Q8_0 as x16_tile_q4: both halves at once, each run's x bytes broadcast once per token for
 * the 16 rows, the sums pinned in registers as they grow. AVX2: the sign trick, a madd per
 * maddubs (a pair of products, 2 x 128 x 127, fills int16); vpdpbusd: the stored q + 128
 * unsigned and the offset -128 sum x, as the 512-bit tile */
LV static INLINE void NM(x16_tile_q8)(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                         int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const int gb = 16 * type_bytes(T_Q8_0), hd = run_head(T_Q8_0, 16);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        x16_fetch(g, X16_AHEAD * gb, 0, gb);
        __m256i s[2][TILE_A];
        for (int b = 0; b < B; b++) s[0][b] = s[1][b] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *v = g + hd + 64 * j;
            __m256i z0 = _mm256_loadu_si256((const __m256i *)v), z1 = _mm256_loadu_si256((const __m256i *)(v + 32));
#if !DP256
            const __m256i x80 = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi16(1);
            z0 = _mm256_xor_si256(z0, x80), z1 = _mm256_xor_si256(z1, x80);  /* q, signed */
            const __m256i u0 = _mm256_abs_epi8(z0), u1 = _mm256_abs_epi8(z1);
#endif
            for (int b = 0; b < B; b++) {
                __m256i xb = _mm256_set1_epi32(rd32(xq[b * ldq + k].q + 4 * j));
#if DP256
                s[0][b] = DPB(s[0][b], z0, xb);
                s[1][b] = DPB(s[1][b], z1, xb);
#else
                s[0][b] = _mm256_add_epi32(s[0][b], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(xb, z0)), one));
                s[1][b] = _mm256_add_epi32(s[1][b], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(xb, z1)), one));
#endif
                __asm__("" : "+x"(s[0][b]), "+x"(s[1][b]));
            }
        }
        for (int b = 0; b < B; b++) {
            const q8blk *x = xq + b * ldq + k;
            const __m256 xd = _mm256_set1_ps(x->d);
#if DP256
            const __m256i off = _mm256_set1_epi32(x16_offset(T_Q8_0, x->s));
#endif
            for (int h = 0; h < 2; h++) {
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h)));
#if DP256
                __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(s[h][b], off));
#else
                __m256 f = _mm256_cvtepi32_ps(s[h][b]);
#endif
                acc[h][b] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, xd), acc[h][b]);
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* Q4_K (layout: interleave_q4k): per sub-block (low nibbles of pair p's runs for 2p, high ones
 * for 2p + 1), as x16_tile_q4: both halves at once, each run's x bytes broadcast once per token
 * for the 16 rows, the sums pinned in registers; then per half the rows' d sc and dmin m as
 * floats and the Q4_1-like float steps (the VNNI tile's order: sub-block 0, 1, .., 7 per token) */
LV static INLINE void NM(x16_tile_q4k)(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                          int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += 2368) {
        for (int sb = 0; sb < 8; sb++) {
            if (B > 1)  /* batches only: one token ran faster on the hardware's prefetch (K_AHEAD) */
                x16_fetch(g, K_AHEAD * 2368, 2368 / 8 * sb, 2368 / 8 * (sb + 1));  /* a sub-block's share */
            const uint8_t *v = g + Q4K_V(sb / 2);
            const int e = sb % 2;
            const q8blk *x0 = xq + 8 * k + sb;  /* token b's: x0 + b ldq */
            __m256i s[2][TILE_A];
            for (int j = 0; j < 8; j++) {
                __m256i z0 = _mm256_loadu_si256((const __m256i *)(v + 64 * j)), z1 = _mm256_loadu_si256((const __m256i *)(v + 64 * j + 32));
                if (e) z0 = _mm256_srli_epi16(z0, 4), z1 = _mm256_srli_epi16(z1, 4);
                z0 = _mm256_and_si256(z0, m4), z1 = _mm256_and_si256(z1, m4);
                for (int b = 0; b < B; b++) {
                    __m256i xb = _mm256_set1_epi32(rd32(x0[b * ldq].q + 4 * j));
                    s[0][b] = ACC16(j ? s[0][b] : _mm256_setzero_si256(), z0, xb);
                    s[1][b] = ACC16(j ? s[1][b] : _mm256_setzero_si256(), z1, xb);
                    __asm__("" : "+x"(s[0][b]), "+x"(s[1][b]));
                }
            }
            for (int h = 0; h < 2; h++) {
                __m256 dsc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * h))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q4K_SC(sb) + 8 * h)))));
                __m256 dmm = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * h))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q4K_MN(sb) + 8 * h)))));
                for (int b = 0; b < B; b++) {
                    const q8blk *x = x0 + b * ldq;
                    __m256 v2 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(FIN16(s[h][b])), dsc, _mm256_mul_ps(dmm, _mm256_set1_ps((float)x->s)));
                    acc[h][b] = _mm256_fmadd_ps(v2, _mm256_set1_ps(x->d), acc[h][b]);
                }
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* Q6_K (layout: interleave_q6k): per activation block and sub-block (16 values), as
 * x16_tile_q4: both halves at once, each 4 x bytes broadcast once per token for the 16 rows, the
 * sums pinned in registers; a pair of runs' 6-bit values unpacked once for every token, their
 * maddubs pairs added in int16 (2 x 2 x 63 x 127 fits), then int32; per token and half the -32
 * offsets (hs) and the int8 scales as 32-bit products, summed over the block's two sub-blocks */
LV static INLINE void NM(x16_tile_q6k)(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, const int32_t *hs,
                                          int64_t ldh, int B, float *y, int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += 16 * 210) {
        const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))};
        for (int xb = 0; xb < 8; xb++) {
            if (B > 1)  /* batches only (K_AHEAD) */
                x16_fetch(g, K_AHEAD * 3360, 3360 / 8 * xb, 3360 / 8 * (xb + 1));
            __m256i si[2][TILE_A];
            for (int e = 0; e < 2; e++) {  /* sub-block n = 2 xb + e: values 16 e .. 16 e + 15 of x */
                const int n = 2 * xb + e;
                __m256i s[2][TILE_A];
                for (int r = 0; r < 2; r++) {  /* runs 2r, 2r + 1: the low and high nibbles of Q6_L(2n + r) */
                    __m256i ua[2], ub[2];
                    for (int h = 0; h < 2; h++) {
                        __m256i l = _mm256_loadu_si256((const __m256i *)(g + Q6_L(2 * n + r) + 32 * h));
                        __m256i hh = _mm256_loadu_si256((const __m256i *)(g + Q6_H(n) + 32 * h));
                        ua[h] = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(r ? hh : _mm256_slli_epi16(hh, 4), m30));
                        ub[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                                _mm256_and_si256(r ? _mm256_srli_epi16(hh, 2) : _mm256_slli_epi16(hh, 2), m30));
                    }
                    for (int b = 0; b < B; b++) {
                        const int8_t *xe = xq[b * ldq + 8 * k + xb].q + 16 * e + 8 * r;
                        __m256i x0 = _mm256_set1_epi32(rd32(xe)), x1 = _mm256_set1_epi32(rd32(xe + 4));
                        for (int h = 0; h < 2; h++) {
                            __m256i p = FIN16(ACC16(ACC16(_mm256_setzero_si256(), ua[h], x0), ub[h], x1));
                            s[h][b] = r ? _mm256_add_epi32(s[h][b], p) : p;
                        }
                        __asm__("" : "+x"(s[0][b]), "+x"(s[1][b]));
                    }
                }
                for (int h = 0; h < 2; h++) {
                    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q6_SC(n) + 8 * h)));
                    for (int b = 0; b < B; b++) {
                        __m256i t = _mm256_mullo_epi32(_mm256_add_epi32(s[h][b], _mm256_set1_epi32(-32 * hs[b * ldh + 2 * (8 * k + xb) + e])), sc);
                        si[h][b] = e ? _mm256_add_epi32(si[h][b], t) : t;
                    }
                }
            }
            for (int b = 0; b < B; b++) {
                const __m256 xd = _mm256_set1_ps(xq[b * ldq + 8 * k + xb].d);
                for (int h = 0; h < 2; h++)
                    acc[h][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[h][b]), _mm256_mul_ps(d[h], xd), acc[h][b]);
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* IQ4_XS (layout: interleave_iq4xs): per sub-block, as x16_tile_q4: both halves at once, each
 * run's codebook values looked up once for every token and its x bytes broadcast once per token
 * for the 16 rows, the sums pinned in registers (iq4_sum's: AVX2's sign trick, vpdpbusd's
 * codebook + 128); then per half the rows' d (ls - 32) as floats, one conversion, one scale
 * product and one accumulation per token (x16_lane_c's order) */
LV static INLINE void NM(x16_tile_iq4xs)(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                            int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const __m256i kv = NM(iq4_book)(), m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += 2208) {
        for (int sb = 0; sb < 8; sb++) {
            const uint8_t *v = g + IQ4XS_V(sb);
            const q8blk *x0 = xq + 8 * k + sb;  /* token b's: x0 + b ldq */
            __m256i s[2][TILE_A];
            for (int b = 0; b < B; b++) s[0][b] = s[1][b] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {  /* run j: low nibbles of the bytes at 64 (j % 4) for j < 4, high ones after */
                __m256i qv[2];
                for (int hf = 0; hf < 2; hf++) {
                    __m256i z = _mm256_loadu_si256((const __m256i *)(v + 64 * (j % 4) + 32 * hf));
                    qv[hf] = _mm256_shuffle_epi8(kv, _mm256_and_si256(j < 4 ? z : _mm256_srli_epi16(z, 4), m4));
                }
#if !DP256
                const __m256i uv[2] = {_mm256_abs_epi8(qv[0]), _mm256_abs_epi8(qv[1])}, one = _mm256_set1_epi16(1);
#endif
                for (int b = 0; b < B; b++) {
                    const __m256i xb = _mm256_set1_epi32(rd32(x0[b * ldq].q + 4 * j));
                    for (int hf = 0; hf < 2; hf++)
#if DP256
                        s[hf][b] = DPB(s[hf][b], qv[hf], xb);
#else
                        s[hf][b] = _mm256_add_epi32(s[hf][b], _mm256_madd_epi16(_mm256_maddubs_epi16(uv[hf], _mm256_sign_epi8(xb, qv[hf])), one));
#endif
                    __asm__("" : "+x"(s[0][b]), "+x"(s[1][b]));
                }
            }
            for (int hf = 0; hf < 2; hf++) {
                __m256 dsc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * hf))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + IQ4XS_SC(sb) + 8 * hf)))));
                for (int b = 0; b < B; b++) {
                    const q8blk *x = x0 + b * ldq;
#if DP256
                    __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(s[hf][b], _mm256_set1_epi32(-128 * x->s)));
#else
                    __m256 f = _mm256_cvtepi32_ps(s[hf][b]);
#endif
                    acc[hf][b] = _mm256_fmadd_ps(f, _mm256_mul_ps(dsc, _mm256_set1_ps(x->d)), acc[hf][b]);
                }
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

/* Q2_K and Q3_K (layout: interleave_k23): the 512-bit tile's steps (x16_tile_k23_vnni), as
 * x16_tile_q6k: both halves at once, each 4 x bytes broadcast once per token for the 16 rows, a
 * pair of runs unpacked once for every token, a sub-block's 4 maddubs added in int16 (4 x 2 x 7
 * x 127 fits), the sums pinned in registers */
LV static INLINE void NM(x16_tile_k23)(const int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq,
                                          const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy, int nvalid) {
    __m256 acc[2][TILE_A];
    const int q2 = t == T_Q2_K, gb = x16_block_bytes(t);
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < B; b++) acc[h][b] = _mm256_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        __m256 d[2], dm[2];
        for (int hf = 0; hf < 2; hf++) {
            d[hf] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * hf)));
            dm[hf] = q2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * hf))) : d[hf];
        }
        for (int xb = 0; xb < 8; xb++) {
            __m256i si[2][TILE_A];
            __m256 dmm[2][2];
            for (int e = 0; e < 2; e++) {  /* sub-block j = 2 xb + e: values 16 e .. 16 e + 15 of x */
                const int j = 2 * xb + e;
                __m256i s[2][TILE_A];
                for (int r = 0; r < 2; r++) {  /* runs 2r, 2r + 1: bits 4r, 4r + 2 of the values' bytes */
                    __m256i ua[2], ub[2];
                    for (int hf = 0; hf < 2; hf++) {
                        const __m256i z = _mm256_loadu_si256((const __m256i *)(g + (q2 ? Q2K_V(j) : Q3K_L(j)) + 32 * hf));
                        __m256i va = _mm256_and_si256(r ? _mm256_srli_epi16(z, 4) : z, m3);
                        __m256i vb = _mm256_and_si256(_mm256_srli_epi16(z, 4 * r + 2), m3);
                        if (!q2) {  /* bit 4e + s of the high bits to bit 2, s = 2r, 2r + 1 */
                            const __m256i hh = _mm256_loadu_si256((const __m256i *)(g + Q3K_H(xb) + 32 * hf));
                            const int sa = 4 * e + 2 * r, sb2 = sa + 1;
                            __m256i ha = sa < 2 ? _mm256_slli_epi16(hh, 2 - sa) : sa > 2 ? _mm256_srli_epi16(hh, sa - 2) : hh;
                            __m256i hb = sb2 < 2 ? _mm256_slli_epi16(hh, 2 - sb2) : sb2 > 2 ? _mm256_srli_epi16(hh, sb2 - 2) : hh;
                            va = _mm256_or_si256(va, _mm256_and_si256(ha, m4));
                            vb = _mm256_or_si256(vb, _mm256_and_si256(hb, m4));
                        }
                        ua[hf] = va, ub[hf] = vb;
                    }
                    for (int b = 0; b < B; b++) {
                        const int8_t *xe = xq[b * ldq + 8 * k + xb].q + 16 * e + 8 * r;
                        __m256i x0 = _mm256_set1_epi32(rd32(xe)), x1 = _mm256_set1_epi32(rd32(xe + 4));
                        for (int hf = 0; hf < 2; hf++)
                            s[hf][b] = ACC16(ACC16(r ? s[hf][b] : _mm256_setzero_si256(), ua[hf], x0), ub[hf], x1);
                        __asm__("" : "+x"(s[0][b]), "+x"(s[1][b]));
                    }
                }
                for (int hf = 0; hf < 2; hf++) {
                    const __m128i sb = _mm_loadl_epi64((const __m128i *)(g + (q2 ? Q2K_SC(j) : Q3K_SC(j)) + 8 * hf));
                    __m256i sc;
                    if (q2) {
                        sc = _mm256_cvtepu8_epi32(_mm_and_si128(sb, m15));
                        dmm[hf][e] = _mm256_mul_ps(dm[hf], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(sb, 4), m15))));
                    } else
                        sc = _mm256_cvtepi8_epi32(sb);
                    for (int b = 0; b < B; b++) {
                        __m256i s32 = FIN16(s[hf][b]);
                        if (!q2) s32 = _mm256_add_epi32(s32, _mm256_set1_epi32(-4 * hs[b * ldh + 2 * (8 * k + xb) + e]));
                        __m256i tt = _mm256_mullo_epi32(s32, sc);
                        si[hf][b] = e ? _mm256_add_epi32(si[hf][b], tt) : tt;
                    }
                }
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + 8 * k + xb;
                const float *xs = (const float *)(hs + b * ldh + 2 * (8 * k + xb));
                const __m256 xd = _mm256_set1_ps(x->d);
                for (int hf = 0; hf < 2; hf++) {
                    acc[hf][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[hf][b]), _mm256_mul_ps(d[hf], xd), acc[hf][b]);
                    if (q2) {
                        acc[hf][b] = _mm256_fnmadd_ps(dmm[hf][0], _mm256_set1_ps(xs[0]), acc[hf][b]);
                        acc[hf][b] = _mm256_fnmadd_ps(dmm[hf][1], _mm256_set1_ps(xs[1]), acc[hf][b]);
                    }
                }
            }
        }
    }
    A2_STORE_TILE(y, ldy, acc, B, nvalid);
}

#define BY_TILE_A(CALL)       \
    switch (nt) {             \
    case 4: CALL(4); break;   \
    case 3: CALL(3); break;   \
    case 2: CALL(2); break;   \
    default: CALL(1);         \
    }
#define Q4_0_TILE_A(n) NM(x16_tile_q4)(T_Q4_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_1_TILE_A(n) NM(x16_tile_q4)(T_Q4_1, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q8_0_TILE_A(n) NM(x16_tile_q8)(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_K_TILE_A(n) NM(x16_tile_q4k)(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q6_K_TILE_A(n) NM(x16_tile_q6k)(g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)
#define IQ4_NL_TILE_A(n) NM(x16_tile)(T_IQ4_NL, g, nb, xb, ldq, n, yb, ldy, nv)
#define MXFP4_TILE_A(n) NM(x16_tile)(T_MXFP4, g, nb, xb, ldq, n, yb, ldy, nv)
#define IQ4_XS_TILE_A(n) NM(x16_tile_iq4xs)(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q5_0_TILE_A(n) NM(x16_tile)(T_Q5_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q5_1_TILE_A(n) NM(x16_tile)(T_Q5_1, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q2_K_TILE_A(n) NM(x16_tile_k23)(T_Q2_K, g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)
#define Q3_K_TILE_A(n) NM(x16_tile_k23)(T_Q3_K, g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)

/* x16_rows_vnni's contract on AVX2 */
LV static void NM(x16_rows)(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                               int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy) {
    for (int64_t r = 0; r < n_rows; r += 16, g += gstride) {
        int nv = n_rows - r < 16 ? (int)(n_rows - r) : 16;
        for (int b = 0; b < B; b += TILE_A) {
            const q8blk *xb = xq + b * ldq;
            float *yb = y + b * ldy + r;
            int nt = B - b < TILE_A ? B - b : TILE_A;
            if (t == T_Q6_K) BY_TILE_A(Q6_K_TILE_A)
            else if (t == T_Q2_K) BY_TILE_A(Q2_K_TILE_A)
            else if (t == T_Q3_K) BY_TILE_A(Q3_K_TILE_A)
            else if (t == T_Q4_K) BY_TILE_A(Q4_K_TILE_A)
            else if (t == T_Q4_0) BY_TILE_A(Q4_0_TILE_A)
            else if (t == T_Q4_1) BY_TILE_A(Q4_1_TILE_A)
            else if (t == T_IQ4_XS) BY_TILE_A(IQ4_XS_TILE_A)
            else if (t == T_IQ4_NL) BY_TILE_A(IQ4_NL_TILE_A)
            else if (t == T_MXFP4) BY_TILE_A(MXFP4_TILE_A)
            else if (t == T_Q5_0) BY_TILE_A(Q5_0_TILE_A)
            else if (t == T_Q5_1) BY_TILE_A(Q5_1_TILE_A)
            else BY_TILE_A(Q8_0_TILE_A)
        }
    }
}
#undef BY_TILE_A
#undef A2_STORE_TILE
#undef Q4_0_TILE_A
#undef Q4_1_TILE_A
#undef Q8_0_TILE_A
#undef Q4_K_TILE_A
#undef Q6_K_TILE_A
#undef IQ4_NL_TILE_A
#undef MXFP4_TILE_A
#undef IQ4_XS_TILE_A
#undef Q5_0_TILE_A
#undef Q5_1_TILE_A
#undef Q2_K_TILE_A
#undef Q3_K_TILE_A

/* ---- R16: rows picked by activity with their blocks interleaved -------------------------------
 * r16_run's lanes (the VNNI kernel's, and r16_dot_c's) on two halves of 8 blocks: per half 8
 * maddubs against x's packed values (r16_pack), added in int16, one madd, the offsets, one
 * conversion and one scaled accumulation for 8 blocks. A row's short last run (L < 16 blocks) is
 * read through masked loads, its scales from a zero-padded copy: lanes past L add 0, as there. */
LV static INLINE void NM(r16_run)(const int t, const uint8_t *w, const int L, const xpair *x, __m256 *acc) {
    const int q41 = t == T_Q4_1, q8 = t == T_Q8_0, hd = run_head(t, L);
    const __m256i m4 = _mm256_set1_epi8(15);
    uint16_t pad[32];
    const uint8_t *dp = w;  /* the run's f16 scales (lanes 0..15), then Q4_1's mins */
    if (L < 16) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, w, 2 * L);
        if (q41) memcpy(pad + 16, w + 2 * L, 2 * L);
        dp = (const uint8_t *)pad;
    }
    for (int h = 0; h < 2; h++) {
        const int n = L - 8 * h;
        const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const uint8_t *v = w + hd + 32 * h;
#define RUN(j) (L == 16 ? _mm256_loadu_si256((const __m256i *)(v + 64 * (j))) : _mm256_maskload_epi32((const int *)(v + 4 * L * (j)), lm))
#define XR(j) _mm256_load_si256((const __m256i *)(x[j].q + 32 * h))
        __m256i s;
        if (q8) {
            s = _mm256_setzero_si256();
#if DP256  /* the stored q + 128 unsigned, plus the pack's offset -128 (sum of x) */
            for (int j = 0; j < 8; j++) s = DPB(s, RUN(j), XR(j));
            s = _mm256_add_epi32(s, XR(8));
#else
            for (int j = 0; j < 8; j++) {
                __m256i q = _mm256_xor_si256(RUN(j), _mm256_set1_epi8((char)0x80));
                __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(XR(j), q));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
#endif
        } else {
            __m256i s16 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i z = RUN(j);
                s16 = ACC16(s16, _mm256_and_si256(z, m4), XR(j));
                s16 = ACC16(s16, _mm256_and_si256(_mm256_srli_epi16(z, 4), m4), XR(4 + j));
            }
            s = FIN16(s16);
            if (!q41) s = _mm256_add_epi32(s, XR(8));
        }
#undef RUN
#undef XR
        __m256 f = _mm256_cvtepi32_ps(s), xd = _mm256_load_ps((const float *)(x[9].q + 32 * h));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + 16 * h)));
        if (q41) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + 32 + 16 * h)));
            __m256 sum = _mm256_load_ps((const float *)(x[8].q + 32 * h));
            acc[h] = _mm256_fmadd_ps(_mm256_fmadd_ps(f, d, _mm256_mul_ps(m, sum)), xd, acc[h]);
        } else {
            acc[h] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, xd), acc[h]);
        }
    }
}

/* one R16 row (nb blocks) times one token packed by r16_pack: hsum16's order (r16_dot_c) */
LV static INLINE float NM(r16_row)(const int t, const uint8_t *w, int nb, const xpair *x) {
    const int gb = 16 * type_bytes(t);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int c = 0;
    for (; c + 16 <= nb; c += 16, w += gb, x += 10) NM(r16_run)(t, w, 16, x, acc);
    if (c < nb) NM(r16_run)(t, w, nb - c, x, acc);
    return hsum8(_mm256_add_ps(acc[0], acc[1]));
}

LV static float NM(r16_dot)(int t, const uint8_t *w, const xpair *x, int nb) {
    return t == T_Q4_0 ? NM(r16_row)(T_Q4_0, w, nb, x)
           : t == T_Q4_1 ? NM(r16_row)(T_Q4_1, w, nb, x) : NM(r16_row)(T_Q8_0, w, nb, x);
}

/* y[i] = row (rows[i], else start + i) . x for i < n: r16_rows_vnni's contract, its L2 cursor */
LV static INLINE void NM(r16_rows_t)(const int t, mat m, const int32_t *rows, int64_t start, int64_t n,
                                        const xpair *x, int nb, float *y) {
    r16_cursor cur = r16_cursor_at(m, rows, start, n, nb);
    for (int64_t i = 0; i < n; i++) {
        for (int c = 0; c < cur.nc; c++) r16_fetch(&cur);
        y[i] = NM(r16_row)(t, row_at(m, rows ? rows[i] : start + i, 0), nb, x);
    }
}
LV static void NM(r16_rows)(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    if (m.t == T_Q4_0) NM(r16_rows_t)(T_Q4_0, m, rows, start, n, x, nb, y);
    else if (m.t == T_Q4_1) NM(r16_rows_t)(T_Q4_1, m, rows, start, n, x, nb, y);
    else NM(r16_rows_t)(T_Q8_0, m, rows, start, n, x, nb, y);
}
#endif
