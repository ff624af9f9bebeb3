/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * input-major twins' fast-mode products on 256-bit registers (cols_generic.c says
 * the layout; cols_256.c includes this source once per 256-bit level: AVX2, AVX-VNNI, and its
 * EVEX form). cols_avx512.c's scheme on half lines: four active channels' 32 bytes interleaved
 * into 4 registers of 8 rows' dwords, then per register ACC16: AVX2's maddubs summed in int16
 * (a Q4 group cannot overflow: 8 quads x 2 x 15 x 127 = 30480) and widened once per group line
 * by FIN16's madd, or vpdpbusd into int32. Q8_0's signed values take AVX2's sign trick
 * (maddubs of |w| and x signed by w, widened at once: two such sums may not share int16) and
 * vpdpbusd's w + 128 with its -128 sum(x). */
LV static inline uint32_t NM(cols_mask)(const float *x, float thr) {
    __m256 t = _mm256_set1_ps(thr), sgn = _mm256_set1_ps(-0.f);
    uint32_t m = 0;
    for (int i = 0; i < 4; i++)
        m |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sgn, _mm256_loadu_ps(x + 8 * i)), t, _CMP_GT_OQ))
             << (8 * i);
    return m;
}

/* the type t a constant of each copy: the accumulators stay in registers */
LV static INLINE int64_t NM(cols_fast_t)(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y, int t) {
    int q4 = cols_nibbles(t);
    int64_t rp = cols_rp(t, h->R), K = cols_chunk(t), gb = cols_group_bytes(t, rp), hb = cols_head_bytes(t, rp);
    int64_t cb = cols_chan_bytes(t, rp), lines = rp / K, n_active = 0;
    const __m256i lo4 = _mm256_set1_epi8(15);
    memset(y, 0, sizeof(float) * rp);
    cols_cursor cur;
    cols_cursor_start(&cur, h, masks);
    for (int64_t g = 0; g < h->C / QK; g++) {
        uint32_t mask = masks[g];
        if (!mask) continue;
        const uint8_t *grp = cols_data(h) + g * gb, *ch[QK];
        int8_t xb[QK];
        int n = 0;
        int32_t sx = 0;
        for (uint32_t m = mask; m; m &= m - 1, n++) {
            int j = __builtin_ctz(m);
            ch[n] = grp + hb + j * cb, xb[n] = xq[g].q[j], sx += xb[n];
        }
        n_active += n;
        for (; n % 4; n++) ch[n] = ch[0], xb[n] = 0;
        int32_t off = t == T_Q4_0 ? -8 * sx : (t == T_Q8_0 && DP256) ? -128 * sx : 0;
        __m256 vdx = _mm256_set1_ps(xq[g].d), vdsx = _mm256_set1_ps(xq[g].d * (float)sx);
        __m256i voff = _mm256_set1_epi32(off);
        for (int64_t l = 0; l < lines; l++) {
            if (cols_ahead) cols_fetch(&cur);
            for (int half = 0; half < 2; half++) {
                __m256i acc[8];
                for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
                int64_t o = 64 * l + 32 * half;
                #pragma GCC unroll 1  /* unrolled over a group's 8 quads, GCC spilled the loads */
                for (int q = 0; q < n; q += 4) {
                    __m256i X = _mm256_set1_epi32(rd32(xb + q));
                    __m256i A = _mm256_loadu_si256((const __m256i *)(ch[q] + o)), B = _mm256_loadu_si256((const __m256i *)(ch[q + 1] + o));
                    __m256i C = _mm256_loadu_si256((const __m256i *)(ch[q + 2] + o)), D = _mm256_loadu_si256((const __m256i *)(ch[q + 3] + o));
                    __m256i ab0 = _mm256_unpacklo_epi8(A, B), ab1 = _mm256_unpackhi_epi8(A, B);
                    __m256i cd0 = _mm256_unpacklo_epi8(C, D), cd1 = _mm256_unpackhi_epi8(C, D);
                    __m256i v[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                                    _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
                    if (q4)
                        for (int k = 0; k < 4; k++) {
                            acc[k] = ACC16(acc[k], _mm256_and_si256(v[k], lo4), X);
                            acc[4 + k] = ACC16(acc[4 + k], _mm256_and_si256(_mm256_srli_epi16(v[k], 4), lo4), X);
                        }
                    else
                        for (int k = 0; k < 4; k++) {
#if DP256
                            acc[k] = DPB(acc[k], _mm256_xor_si256(v[k], _mm256_set1_epi8((char)0x80)), X);
#else
                            acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v[k]),
                                                                                                     _mm256_sign_epi8(X, v[k])),
                                                                                _mm256_set1_epi16(1)));
#endif
                        }
                }
                for (int a = 0; a < K / 16; a++) {  /* register a: rows l K + 16 (a % 4) + 64 (a / 4) + 8 half .. + 8 */
                    int64_t r = l * K + 16 * (a % 4) + 64 * (a / 4) + 8 * half;
                    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * r)));
                    __m256i S = q4 ? FIN16(acc[a]) : acc[a];
                    __m256 yv = _mm256_fmadd_ps(_mm256_mul_ps(vdx, dw), _mm256_cvtepi32_ps(_mm256_add_epi32(S, voff)),
                                                _mm256_loadu_ps(y + r));
                    if (t == T_Q4_1)
                        yv = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * rp + 2 * r))), vdsx, yv);
                    _mm256_storeu_ps(y + r, yv);
                }
            }
        }
    }
    return n_active;
}

LV static int64_t NM(cols_fast)(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y) {
    switch (h->t) {
    case T_Q4_0: return NM(cols_fast_t)(h, xq, masks, y, T_Q4_0);
    case T_Q4_1: return NM(cols_fast_t)(h, xq, masks, y, T_Q4_1);
    default: return NM(cols_fast_t)(h, xq, masks, y, T_Q8_0);
    }
}
