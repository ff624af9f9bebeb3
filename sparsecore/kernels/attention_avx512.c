/* simd_avx512.c, part: softmax attention with AVX-512. */

#if HAVE_X86
/* attention_avx2.c's softmax attention with AVX-512, W = 16 */
VNNI static INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

VNNI static INLINE __m512 sums16(const __m512 *a) {
    static const int P[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[P[i]], a[P[i + 8]], 0x44),
                             _mm512_shuffle_f32x4(a[P[i]], a[P[i + 8]], 0xee));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xdd));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x88), _mm512_shuffle_ps(c[i], c[i + 2], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

/* chunk8 with W = 16; its tail lanes masked instead of blended */
VNNI static INLINE void chunk16(const float *q, int g, const float *K, const float *V, int c, int hd, float scale,
                                float *m, __m512 *l, float *out) {
    __mmask16 live = (__mmask16)((1u << c) - 1);
    _Alignas(64) float e[MAXG][16];
    for (int h = 0; h < g; h++) {  /* first every head's weights: g independent chains to overlap */
        const float *qh = q + (int64_t)h * hd;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int s = 0; s < hd; s += 16) {
            __m512 qs = _mm512_loadu_ps(qh + s);
            for (int i = 0; i < c; i++) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(K + (int64_t)i * hd + s), qs, acc[i]);
        }
        __m512 sc = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale));
        if (_mm512_mask_cmp_ps_mask(live, sc, _mm512_set1_ps(m[h]), _CMP_GT_OQ)) {
            /* a new max: what is summed so far shrinks by e^(m_old - m_new) */
            float mx = _mm512_mask_reduce_max_ps(live, sc);
            __m512 f = _mm512_set1_ps(expf(m[h] - mx));
            float *o = out + (int64_t)h * hd;
            for (int s = 0; s < hd; s += 16) _mm512_storeu_ps(o + s, _mm512_mul_ps(_mm512_loadu_ps(o + s), f));
            l[h] = _mm512_mul_ps(l[h], f);
            m[h] = mx;
        }
        __m512 ev = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m[h]))));
        l[h] = _mm512_add_ps(l[h], ev);
        _mm512_store_ps(e[h], ev);
    }
    for (int h = 0; h < g; h++) {  /* then the weighted V rows into each head's output */
        float *o = out + (int64_t)h * hd;
        int s = 0;
        for (; s + 64 <= hd; s += 64) {  /* 8 accumulators (even and odd rows): the FMA latency */
            __m512 a0[4], a1[4];
            for (int u = 0; u < 4; u++) a0[u] = _mm512_loadu_ps(o + s + 16 * u), a1[u] = _mm512_setzero_ps();
            for (int i = 0; i + 1 < c; i += 2) {
                __m512 w0 = _mm512_set1_ps(e[h][i]), w1 = _mm512_set1_ps(e[h][i + 1]);
                const float *v0 = V + (int64_t)i * hd + s, *v1 = v0 + hd;
                for (int u = 0; u < 4; u++) {
                    a0[u] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * u), a0[u]);
                    a1[u] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * u), a1[u]);
                }
            }
            if (c & 1)
                for (int u = 0; u < 4; u++)
                    a0[u] = _mm512_fmadd_ps(_mm512_set1_ps(e[h][c - 1]), _mm512_loadu_ps(V + (int64_t)(c - 1) * hd + s + 16 * u), a0[u]);
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + s + 16 * u, _mm512_add_ps(a0[u], a1[u]));
        }
        for (; s < hd; s += 16) {
            __m512 a = _mm512_loadu_ps(o + s);
            for (int i = 0; i < c; i++) a = _mm512_fmadd_ps(_mm512_set1_ps(e[h][i]), _mm512_loadu_ps(V + (int64_t)i * hd + s), a);
            _mm512_storeu_ps(o + s, a);
        }
    }
}

VNNI static INLINE void heads16(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                                const float *sinks, float *out) {
    float m[MAXG];
    __m512 l[MAXG];
    for (int h = 0; h < g; h++) m[h] = -INFINITY, l[h] = _mm512_setzero_ps();
    memset(out, 0, sizeof(float) * g * hd);
    int p = 0;
    for (; p + 16 <= n; p += 16) {
        if (p + 32 <= n) prefetch_chunk(K + (int64_t)(p + 16) * hd, V + (int64_t)(p + 16) * hd, 16, hd);
        chunk16(q, g, K + (int64_t)p * hd, V + (int64_t)p * hd, 16, hd, scale, m, l, out);
    }
    if (p < n) chunk16(q, g, K + (int64_t)p * hd, V + (int64_t)p * hd, n - p, hd, scale, m, l, out);
    for (int h = 0; h < g; h++) {
        __m512 r = _mm512_set1_ps(1.f / (_mm512_reduce_add_ps(l[h]) + (sinks ? expf(sinks[h] - m[h]) : 0.f)));
        for (int s = 0; s < hd; s += 16) _mm512_storeu_ps(out + h * hd + s, _mm512_mul_ps(_mm512_loadu_ps(out + h * hd + s), r));
    }
}

VNNI static void attend_heads_avx512(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                                     const float *sinks, float *out) {
    if (hd == 64) heads16(q, g, K, V, n, 64, scale, sinks, out);
    else if (hd == 128) heads16(q, g, K, V, n, 128, scale, sinks, out);
    else heads16(q, g, K, V, n, hd, scale, sinks, out);
}
#endif
