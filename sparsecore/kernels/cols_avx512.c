/* simd_avx512.c, part: input-major twins' fast-mode products with AVX-512 VNNI (cols_generic.c says
 * the layout). Four active channels at a time: their line of 64 bytes each, interleaved by
 * unpacklo/hi_epi8 then _epi16 into 4 registers whose dword (row) holds the four channels'
 * bytes, so that one vpdpbusd against the four q8 values (one dword, broadcast) sums four
 * channels of 16 rows; Q4's registers give 2 (low and high nibbles), 8 accumulators a line of
 * 128 rows. A group's odd channels are padded to four with x = 0. */
#if HAVE_X86
VNNI static inline uint32_t cols_mask_vnni(const float *x, float thr) {
    __m512 t = _mm512_set1_ps(thr);
    uint32_t a = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x)), t, _CMP_GT_OQ);
    uint32_t b = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16)), t, _CMP_GT_OQ);
    return a | b << 16;
}

/* One line (at byte o) of the four channels ch[0..3] against their x bytes X: Q4's 8 registers
 * of 16 rows (low nibbles rows 16 k.., high 64 + 16 k..), Q8_0's 4 */
VNNI static INLINE void cols_quad_vnni(__m512i *acc, const uint8_t *const *ch, int64_t o, __m512i X, int t) {
    const __m512i lo4 = _mm512_set1_epi8(15), hi8 = _mm512_set1_epi8((char)0x80);
    __m512i A = _mm512_loadu_si512(ch[0] + o), B = _mm512_loadu_si512(ch[1] + o);
    __m512i C = _mm512_loadu_si512(ch[2] + o), D = _mm512_loadu_si512(ch[3] + o);
    __m512i ab0 = _mm512_unpacklo_epi8(A, B), ab1 = _mm512_unpackhi_epi8(A, B);
    __m512i cd0 = _mm512_unpacklo_epi8(C, D), cd1 = _mm512_unpackhi_epi8(C, D);
    __m512i v[4] = {_mm512_unpacklo_epi16(ab0, cd0), _mm512_unpackhi_epi16(ab0, cd0),
                    _mm512_unpacklo_epi16(ab1, cd1), _mm512_unpackhi_epi16(ab1, cd1)};
    if (cols_nibbles(t))  /* acc[4 + k] takes the whole bytes, 16 hi + lo: cols_hi_vnni splits it after */
        for (int k = 0; k < 4; k++) {
            acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_and_si512(v[k], lo4), X);
            acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], v[k], X);
        }
    else
        for (int k = 0; k < 4; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_xor_si512(v[k], hi8), X);
}

/* A Q4 line's high-nibble sums from the whole bytes' (acc[4 + k] = sum x (16 hi + lo), started at
 * 17 off when acc[k] started at off): (whole - low) / 16, exact in int32 (|sum| < 32 x 255 x 128).
 * The whole bytes cost one vpdpbusd a register, where the high nibbles cost a shift and a mask
 * more in every quad (8 of a quad's 32 instructions). */
VNNI static INLINE void cols_hi_vnni(__m512i *acc) {
    for (int k = 0; k < 4; k++) acc[4 + k] = _mm512_srai_epi32(_mm512_sub_epi32(acc[4 + k], acc[k]), 4);
}

/* y[r0 ..] += (d_x d) S (+ Q4_1's m d_x sum x) for a line's registers (S: the sums with their offset) */
VNNI static INLINE void cols_store_vnni(const __m512i *acc, const uint8_t *grp, int64_t rp, int64_t r0, __m512 vdx,
                                        __m512 vdsx, float *y, int t) {
    for (int a = 0; a < cols_chunk(t) / 16; a++) {  /* register a: rows r0 + 16 a .. + 16 */
        int64_t r = r0 + 16 * a;
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * r)));
        __m512 yv = _mm512_fmadd_ps(_mm512_mul_ps(vdx, dw), _mm512_cvtepi32_ps(acc[a]), _mm512_loadu_ps(y + r));
        if (t == T_Q4_1)
            yv = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * rp + 2 * r))), vdsx, yv);
        _mm512_storeu_ps(y + r, yv);
    }
}

/* y (Rp floats) = the product of the twin h with x's q8 blocks xq over the active channels of
 * masks; returns their number */
/* the type t a constant of each copy: the accumulators stay in registers */
VNNI static INLINE int64_t cols_fast_t_vnni(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y, int t) {
    int64_t rp = cols_rp(t, h->R), K = cols_chunk(t), gb = cols_group_bytes(t, rp), hb = cols_head_bytes(t, rp);
    int64_t cb = cols_chan_bytes(t, rp), lines = rp / K, n_active = 0;
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
        int32_t off = t == T_Q4_0 ? -8 * sx : t == T_Q8_0 ? -128 * sx : 0;
        float dx = xq[g].d;
        __m512 vdx = _mm512_set1_ps(dx), vdsx = _mm512_set1_ps(dx * (float)sx);
        __m512i voff = _mm512_set1_epi32(off), voff17 = _mm512_set1_epi32(17 * off);
        /* two lines at a time (256 rows of Q4): 16 accumulators, each quad's pointers and x once */
        int64_t l = 0;
        for (; l + 1 < lines; l += 2) {
            if (cols_ahead) cols_fetch(&cur), cols_fetch(&cur);
            __m512i acc[16];
            for (int a = 0; a < 16; a++) acc[a] = a % 8 >= 4 && cols_nibbles(t) ? voff17 : voff;
#pragma GCC unroll 1  /* unrolled over a group's 8 quads, GCC spilled the loads */
            for (int q = 0; q < n; q += 4) {
                __m512i X = _mm512_set1_epi32(rd32(xb + q));
                cols_quad_vnni(acc, ch + q, 64 * l, X, t);
                cols_quad_vnni(acc + 8, ch + q, 64 * l + 64, X, t);
            }
            if (cols_nibbles(t)) cols_hi_vnni(acc), cols_hi_vnni(acc + 8);
            cols_store_vnni(acc, grp, rp, l * K, vdx, vdsx, y, t);
            cols_store_vnni(acc + 8, grp, rp, l * K + K, vdx, vdsx, y, t);
        }
        if (l < lines) {  /* an odd last line */
            if (cols_ahead) cols_fetch(&cur);
            __m512i acc[8];
            for (int a = 0; a < 8; a++) acc[a] = a >= 4 && cols_nibbles(t) ? voff17 : voff;
#pragma GCC unroll 1
            for (int q = 0; q < n; q += 4) cols_quad_vnni(acc, ch + q, 64 * l, _mm512_set1_epi32(rd32(xb + q)), t);
            if (cols_nibbles(t)) cols_hi_vnni(acc);
            cols_store_vnni(acc, grp, rp, l * K, vdx, vdsx, y, t);
        }
    }
    return n_active;
}
VNNI static int64_t cols_fast_vnni(const cols_hdr *h, const q8blk *xq, const uint32_t *masks, float *y) {
    switch (h->t) {
    case T_Q4_0: return cols_fast_t_vnni(h, xq, masks, y, T_Q4_0);
    case T_Q4_1: return cols_fast_t_vnni(h, xq, masks, y, T_Q4_1);
    default: return cols_fast_t_vnni(h, xq, masks, y, T_Q8_0);
    }
}
#endif
