/* simd_avx512.c, part: fast-mode products of the Q5_0, Q5_1, Q4_K, Q5_K and Q6_K twins with AVX-512
 * VNNI (cols_kquants_generic.c says the layout), then the level dispatch of these twins'
 * products (kq_products: cols_products hands them over). cols_avx512.c's scheme on whole lines
 * (128 rows): four active channels' 64 nibble bytes, Q4_K's interleaved raw and split after,
 * the 5- and 6-bit types' split into the low- and high-nibble rows' values first with their
 * high bits or'ed in (the 16 or 32 bytes of high bits broadcast and shifted per 128-bit lane),
 * each set interleaved by unpacklo/hi_epi8 then _epi16 into 4 registers of 16 rows' dwords, one
 * vpdpbusd each against the four x bytes: 8 accumulators a line (Q6_K: 8 per half block). */
#if HAVE_X86
VNNI static INLINE void kq_vals_vnni(int t, const uint8_t *line, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i A = _mm512_loadu_si512(line);
    *lo = _mm512_and_si512(A, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(A, 4), m4);
    if (kq_hbits(t) == 1) {  /* lane k: the 16 bytes shifted right by 2k */
        __m512i H = _mm512_srlv_epi64(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(line + 64))),
                                      _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0));
        const __m512i b4 = _mm512_set1_epi8(16);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(H, 4), b4));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi16(H, 3), b4));
    } else {  /* Q6_K: the 32 bytes, then the same shifted right by 4 */
        __m256i h = _mm256_loadu_si256((const __m256i *)(line + 64));
        __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
        const __m512i b45 = _mm512_set1_epi8(0x30);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(H, 4), b45));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi16(H, 2), b45));
    }
}

/* one line (at byte o) of four channels into acc[0..8] (register a: rows 16 a ..+ 16) */
VNNI static INLINE void kq_quad_vnni(int t, __m512i *acc, const uint8_t *const *ch, int64_t o, __m512i X) {
    if (kq_hbits(t) == 0) {  /* Q4_K: bare nibbles, as the Q4 twins' lines (cols_avx512.c) */
        cols_quad_vnni(acc, ch, o, X, T_Q4_1);
        return;
    }
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; c++) kq_vals_vnni(t, ch[c] + o, lo + c, hi + c);
    for (int s = 0; s < 2; s++) {
        const __m512i *v = s ? hi : lo;
        __m512i ab0 = _mm512_unpacklo_epi8(v[0], v[1]), ab1 = _mm512_unpackhi_epi8(v[0], v[1]);
        __m512i cd0 = _mm512_unpacklo_epi8(v[2], v[3]), cd1 = _mm512_unpackhi_epi8(v[2], v[3]);
        acc[4 * s + 0] = _mm512_dpbusd_epi32(acc[4 * s + 0], _mm512_unpacklo_epi16(ab0, cd0), X);
        acc[4 * s + 1] = _mm512_dpbusd_epi32(acc[4 * s + 1], _mm512_unpackhi_epi16(ab0, cd0), X);
        acc[4 * s + 2] = _mm512_dpbusd_epi32(acc[4 * s + 2], _mm512_unpacklo_epi16(ab1, cd1), X);
        acc[4 * s + 3] = _mm512_dpbusd_epi32(acc[4 * s + 3], _mm512_unpackhi_epi16(ab1, cd1), X);
    }
}

/* the type t a constant of each copy */
VNNI static INLINE int64_t kq_fast_t_vnni(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y, int t) {
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
        __m512 vdx = _mm512_set1_ps(dx), vdsx = _mm512_set1_ps(dx * (float)(sx[0] + sx[1]));
        for (int64_t l = 0; l < lines; l++) {
            if (cols_ahead) kq_fetch(&cur);
            __m512i acc[8], acc2[8];
            int64_t o = l * lb;
            for (int a = 0; a < 8; a++) acc[a] = _mm512_set1_epi32(off), acc2[a] = _mm512_set1_epi32(-32 * sx[1]);
#pragma GCC unroll 1
            for (int q = 0; q < na; q += 4) kq_quad_vnni(t, acc, ch + q, o, _mm512_set1_epi32(rd32(xb + q)));
            if (q6)
#pragma GCC unroll 1
                for (int q = na; q < n; q += 4) kq_quad_vnni(t, acc2, ch + q, o, _mm512_set1_epi32(rd32(xb + q)));
            if (t == T_Q4_K) cols_hi_vnni(acc);  /* its offset is 0: the whole bytes' sums start at 0 too */
            for (int a = 0; a < 8; a++) {
                int64_t r = l * 128 + 16 * a;
                __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * r))), yv = _mm512_loadu_ps(y + r);
                if (q6) {
                    __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(grp + 2 * rp + 2 * s * rp + r)));
                    __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(grp + 2 * rp + (2 * s + 1) * rp + r)));
                    __m512i T = _mm512_add_epi32(_mm512_mullo_epi32(acc[a], sa), _mm512_mullo_epi32(acc2[a], sb));
                    yv = _mm512_fmadd_ps(_mm512_mul_ps(vdx, dw), _mm512_cvtepi32_ps(T), yv);
                } else if (t == T_Q4_K || t == T_Q5_K) {
                    __m128i sc, mn;
                    kq_scmin16(grp + 4 * rp + r, rp, s, &sc, &mn);
                    __m512 fsc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), fmn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn));
                    __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * rp + 2 * r)));
                    yv = _mm512_fmadd_ps(_mm512_mul_ps(vdx, _mm512_mul_ps(dw, fsc)), _mm512_cvtepi32_ps(acc[a]), yv);
                    yv = _mm512_fnmadd_ps(_mm512_mul_ps(dm, fmn), vdsx, yv);
                } else {
                    yv = _mm512_fmadd_ps(_mm512_mul_ps(vdx, dw), _mm512_cvtepi32_ps(acc[a]), yv);
                    if (t == T_Q5_1)
                        yv = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * rp + 2 * r))), vdsx, yv);
                }
                _mm512_storeu_ps(y + r, yv);
            }
        }
    }
    return n_active;
}

VNNI static int64_t kq_fast_vnni(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y) {
    switch (h->t) {
    case T_Q5_0: return kq_fast_t_vnni(h, xq, masks, y, T_Q5_0);
    case T_Q5_1: return kq_fast_t_vnni(h, xq, masks, y, T_Q5_1);
    case T_Q4_K: return kq_fast_t_vnni(h, xq, masks, y, T_Q4_K);
    case T_Q5_K: return kq_fast_t_vnni(h, xq, masks, y, T_Q5_K);
    default: return kq_fast_t_vnni(h, xq, masks, y, T_Q6_K);
    }
}
#endif
