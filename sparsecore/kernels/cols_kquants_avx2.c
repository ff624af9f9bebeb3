/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * fast-mode products of the Q5_0, Q5_1, Q4_K, Q5_K and Q6_K twins
 * (cols_kquants_generic.c says the layout) on 256-bit registers: AVX2, and the AVX-VNNI level
 * runs the same code. cols_avx2.c's scheme per half line (64 rows): each of four active
 * channels' 32 nibble bytes split into the low-nibble rows' and the high-nibble rows' values,
 * their high bits or'ed in (kq_vals_avx2), each set interleaved by unpacklo/hi_epi8 then _epi16
 * into 4 registers of 8 rows' dwords, then maddubs against the four channels' x bytes (one
 * dword, broadcast) widened at once by madd (5- and 6-bit values: two quads' maddubs could
 * overflow int16). */
#if HAVE_X86
/* Row block r..r + 16 of Q4_K/Q5_K sub-block s's scales and mins, a byte each, from the head's
 * unpacked planes P (plane k at P + k rp: scales 0-7, then mins) */
AVX2 static INLINE void kq_scmin16(const uint8_t *P, int64_t rp, int s, __m128i *sc, __m128i *mn) {
    *sc = _mm_loadu_si128((const __m128i *)(P + s * rp));
    *mn = _mm_loadu_si128((const __m128i *)(P + (8 + s) * rp));
}

/* Half h of a line: the values of its 32 nibble bytes' low-nibble rows (*lo) and high-nibble
 * rows (*hi), the high bits added */
AVX2 static INLINE void kq_vals_avx2(int t, const uint8_t *line, int h, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i A = _mm256_loadu_si256((const __m256i *)(line + 32 * h));
    *lo = _mm256_and_si256(A, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(A, 4), m4);
    if (kq_hbits(t) == 1) {  /* byte p's bits 2k, 2k + 1 at byte p % 16, k = p / 16: lane L of half h is k = 2h + L */
        __m256i H = _mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(line + 64))),
                                      _mm256_set_epi64x(4 * h + 2, 4 * h + 2, 4 * h, 4 * h));
        const __m256i b4 = _mm256_set1_epi8(16);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(H, 4), b4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(H, 3), b4));
    } else if (kq_hbits(t) == 2) {  /* byte p's 4 bits at byte p % 32, shifted 4 (p / 32) */
        __m256i H = _mm256_loadu_si256((const __m256i *)(line + 64));
        if (h) H = _mm256_srli_epi16(H, 4);
        const __m256i b45 = _mm256_set1_epi8(0x30);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(H, 4), b45));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(H, 2), b45));
    }
}

/* one half line of four channels into acc[0..8] (register a: rows 16 (a % 4) + 64 (a / 4) + 8 h ..+ 8);
 * Q4_K's 4-bit values as the Q4 twins' (cols_avx2.c): maddubs summed in int16 over a block (8
 * quads x 2 x 15 x 127 = 30480 fits), which saves a madd and an int32 add per register and quad;
 * the 5- and 6-bit types' are widened at once (they could overflow int16 across quads) */
AVX2 static INLINE void kq_quad_avx2(int t, __m256i *acc, const uint8_t *const *ch, int64_t o, int h, __m256i X) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; c++) kq_vals_avx2(t, ch[c] + o, h, lo + c, hi + c);
    for (int s = 0; s < 2; s++) {
        const __m256i *v = s ? hi : lo;
        __m256i ab0 = _mm256_unpacklo_epi8(v[0], v[1]), ab1 = _mm256_unpackhi_epi8(v[0], v[1]);
        __m256i cd0 = _mm256_unpacklo_epi8(v[2], v[3]), cd1 = _mm256_unpackhi_epi8(v[2], v[3]);
        __m256i w[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                        _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
        if (kq_hbits(t) == 0)  /* Q4_K: int16 sums, widened once a half line (kq_fast_t_avx2) */
            for (int k = 0; k < 4; k++) acc[4 * s + k] = _mm256_add_epi16(acc[4 * s + k], _mm256_maddubs_epi16(w[k], X));
        else
            for (int k = 0; k < 4; k++)
                acc[4 * s + k] = _mm256_add_epi32(acc[4 * s + k], _mm256_madd_epi16(_mm256_maddubs_epi16(w[k], X), one));
    }
}

/* the type t a constant of each copy */
AVX2 static INLINE int64_t kq_fast_t_avx2(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y, int t) {
    int bpg = kq_inputs(t) / QK, q6 = t == T_Q6_K;
    int64_t rp = kq_rp(h->R), gb = kq_group_bytes(t, rp), hb = kq_head_bytes(t, rp), cb = kq_chan_bytes(t, rp), lb = kq_line(t);
    int64_t lines = rp / 128, n_active = 0;
    memset(y, 0, sizeof(float) * rp);
    kq_cursor cur;
    kq_cursor_start(&cur, h, masks);
    for (int64_t b = 0; b < h->C / QK; b++) {
        uint32_t mask = masks[b];
        if (!mask) continue;
        int s = (int)(b % bpg);
        const uint8_t *grp = cols_data(h) + (b / bpg) * gb, *chans = grp + hb + s * QK * cb, *ch[QK + 8];
        int8_t xb[QK + 8];
        int n = 0, na;
        int32_t sx[2] = {0, 0};
        for (uint32_t m = q6 ? mask & 0xffff : mask; m; m &= m - 1, n++) {
            int j = __builtin_ctz(m);
            ch[n] = chans + j * cb, xb[n] = xq[b].q[j], sx[0] += xb[n];
        }
        for (; n % 4; n++) ch[n] = chans, xb[n] = 0;
        na = n;
        if (q6) {
            for (uint32_t m = mask >> 16; m; m &= m - 1, n++) {
                int j = 16 + __builtin_ctz(m);
                ch[n] = chans + j * cb, xb[n] = xq[b].q[j], sx[1] += xb[n];
            }
            for (; n % 4; n++) ch[n] = chans, xb[n] = 0;
        }
        n_active += __builtin_popcount(mask);
        float dx = xq[b].d;
        int32_t off = t == T_Q5_0 ? -16 * sx[0] : q6 ? -32 * sx[0] : 0;
        __m256 vdx = _mm256_set1_ps(dx), vdsx = _mm256_set1_ps(dx * (float)(sx[0] + sx[1]));
        for (int64_t l = 0; l < lines; l++) {
            if (cols_ahead) kq_fetch(&cur);
            for (int half = 0; half < 2; half++) {
                __m256i acc[8], acc2[8];
                int64_t o = l * lb;
                for (int a = 0; a < 8; a++) acc[a] = _mm256_set1_epi32(off), acc2[a] = _mm256_set1_epi32(-32 * sx[1]);
#pragma GCC unroll 1
                for (int q = 0; q < na; q += 4) kq_quad_avx2(t, acc, ch + q, o, half, _mm256_set1_epi32(rd32(xb + q)));
                if (kq_hbits(t) == 0)  /* Q4_K's int16 sums (started at 0: its offset is 0) to int32 */
                    for (int a = 0; a < 8; a++) acc[a] = _mm256_madd_epi16(acc[a], _mm256_set1_epi16(1));
                if (q6)
#pragma GCC unroll 1
                    for (int q = na; q < n; q += 4) kq_quad_avx2(t, acc2, ch + q, o, half, _mm256_set1_epi32(rd32(xb + q)));
                for (int a = 0; a < 8; a++) {
                    int64_t r = l * 128 + 16 * (a % 4) + 64 * (a / 4) + 8 * half;
                    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * r))), yv = _mm256_loadu_ps(y + r);
                    if (q6) {
                        __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(grp + 2 * rp + 2 * s * rp + r)));
                        __m256i sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(grp + 2 * rp + (2 * s + 1) * rp + r)));
                        __m256i T = _mm256_add_epi32(_mm256_mullo_epi32(acc[a], sa), _mm256_mullo_epi32(acc2[a], sb));
                        yv = _mm256_fmadd_ps(_mm256_mul_ps(vdx, dw), _mm256_cvtepi32_ps(T), yv);
                    } else if (t == T_Q4_K || t == T_Q5_K) {
                        __m128i sc, mn;
                        kq_scmin16(grp + 4 * rp + r, rp, s, &sc, &mn);
                        __m256 fsc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), fmn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn));
                        __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * rp + 2 * r)));
                        yv = _mm256_fmadd_ps(_mm256_mul_ps(vdx, _mm256_mul_ps(dw, fsc)), _mm256_cvtepi32_ps(acc[a]), yv);
                        yv = _mm256_fnmadd_ps(_mm256_mul_ps(dm, fmn), vdsx, yv);
                    } else {
                        yv = _mm256_fmadd_ps(_mm256_mul_ps(vdx, dw), _mm256_cvtepi32_ps(acc[a]), yv);
                        if (t == T_Q5_1)
                            yv = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * rp + 2 * r))), vdsx, yv);
                    }
                    _mm256_storeu_ps(y + r, yv);
                }
            }
        }
    }
    return n_active;
}

AVX2 static int64_t kq_fast_avx2(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y) {
    switch (h->t) {
    case T_Q5_0: return kq_fast_t_avx2(h, xq, masks, y, T_Q5_0);
    case T_Q5_1: return kq_fast_t_avx2(h, xq, masks, y, T_Q5_1);
    case T_Q4_K: return kq_fast_t_avx2(h, xq, masks, y, T_Q4_K);
    case T_Q5_K: return kq_fast_t_avx2(h, xq, masks, y, T_Q5_K);
    default: return kq_fast_t_avx2(h, xq, masks, y, T_Q6_K);
    }
}
#endif
