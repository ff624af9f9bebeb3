/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * RMSNorm's sum of squares and softmax attention with AVX2. */

#if HAVE_X86
/* rms_norm_into's sum of squares (attention_layer.c) */
AVX2 static double sum_squares_avx2(const float *h, int n) {  /* in double, 8 partial sums */
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(h + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0), a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double part[4], ss = 0.0;
    _mm256_storeu_pd(part, _mm256_add_pd(a0, a1));
    for (int j = 0; j < 4; j++) ss += part[j];
    for (; i < n; i++) ss += (double)h[i] * h[i];
    return ss;
}

/* ---- softmax attention (the method: attention_generic.c) -------------------------------------- */


/* e^x per lane for the softmax's x <= 0: Cephes' expf (x = n ln2 + r, |r| <= ln2/2, a degree-6
 * polynomial in r, times 2^n), within about 1 ulp of expf; x below -87.3 counts as -87.3
 * (e^x ~ 1e-38, nothing next to the max's 1); NaN stays NaN. */
AVX2 static INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* lane i = the sum of a[i]'s lanes: pairwise folds, of 128-bit halves, then within them; the
 * folds leave the lanes in the order P (an involution), so slot k takes a[P[k]] */
AVX2 static INLINE __m256 sums8(const __m256 *a) {
    static const int P[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[P[i]], a[P[i + 4]], 0x20),
                             _mm256_permute2f128_ps(a[P[i]], a[P[i + 4]], 0x31));
    for (int i = 0; i < 2; i++)
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[i], b[i + 2], 0x88), _mm256_shuffle_ps(b[i], b[i + 2], 0xdd));
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
}

AVX2 static INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* One chunk of c <= 8 positions (rows K, V) for the g heads of q, the online softmax step; m, l:
 * per head, the running max and the sums of e^(s - m) per lane. First every head's weights (g
 * independent chains for the CPU to overlap), then each head's weighted sum of the V rows.
 * Inlined with c = 8 for whole chunks (the 8 score accumulators then stay in registers) and
 * once with the remainder. */
AVX2 static INLINE void chunk8(const float *q, int g, const float *K, const float *V, int c, int hd, float scale,
                               float *m, __m256 *l, float *out) {
    __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)c), _CMP_LT_OQ);
    _Alignas(32) float e[MAXG][8];
    for (int h = 0; h < g; h++) {
        const float *qh = q + (int64_t)h * hd;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int s = 0; s < hd; s += 8) {
            __m256 qs = _mm256_loadu_ps(qh + s);
            for (int i = 0; i < c; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(K + (int64_t)i * hd + s), qs, acc[i]);
        }
        __m256 sc = _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale));
        if (c < 8) sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, live);
        if (_mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(m[h]), _CMP_GT_OQ))) {
            /* a new max: what is summed so far shrinks by e^(m_old - m_new) */
            float mx = hmax8(sc);
            __m256 f = _mm256_set1_ps(expf(m[h] - mx));
            float *o = out + (int64_t)h * hd;
            for (int s = 0; s < hd; s += 8) _mm256_storeu_ps(o + s, _mm256_mul_ps(_mm256_loadu_ps(o + s), f));
            l[h] = _mm256_mul_ps(l[h], f);
            m[h] = mx;
        }
        __m256 ev = exp8(_mm256_sub_ps(sc, _mm256_set1_ps(m[h])));
        if (c < 8) ev = _mm256_and_ps(ev, live);
        l[h] = _mm256_add_ps(l[h], ev);
        _mm256_store_ps(e[h], ev);
    }
    for (int h = 0; h < g; h++) {
        float *o = out + (int64_t)h * hd;
        int s = 0;
        for (; s + 32 <= hd; s += 32) {  /* 8 accumulators (even and odd rows): the FMA latency */
            __m256 a0[4], a1[4];
            for (int u = 0; u < 4; u++) a0[u] = _mm256_loadu_ps(o + s + 8 * u), a1[u] = _mm256_setzero_ps();
            for (int i = 0; i + 1 < c; i += 2) {
                __m256 w0 = _mm256_set1_ps(e[h][i]), w1 = _mm256_set1_ps(e[h][i + 1]);
                const float *v0 = V + (int64_t)i * hd + s, *v1 = v0 + hd;
                for (int u = 0; u < 4; u++) {
                    a0[u] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8 * u), a0[u]);
                    a1[u] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 8 * u), a1[u]);
                }
            }
            if (c & 1)
                for (int u = 0; u < 4; u++)
                    a0[u] = _mm256_fmadd_ps(_mm256_set1_ps(e[h][c - 1]), _mm256_loadu_ps(V + (int64_t)(c - 1) * hd + s + 8 * u), a0[u]);
            for (int u = 0; u < 4; u++) _mm256_storeu_ps(o + s + 8 * u, _mm256_add_ps(a0[u], a1[u]));
        }
        for (; s < hd; s += 8) {
            __m256 a = _mm256_loadu_ps(o + s);
            for (int i = 0; i < c; i++) a = _mm256_fmadd_ps(_mm256_set1_ps(e[h][i]), _mm256_loadu_ps(V + (int64_t)i * hd + s), a);
            _mm256_storeu_ps(o + s, a);
        }
    }
}

/* the next chunk's K and V rows (W positions) into L1 while this one computes (with the hardware
 * prefetcher alone, a long context's tokens take ~20% longer) */
static INLINE void prefetch_chunk(const float *K, const float *V, int W, int hd) {
    for (int b = 0; b < W * hd * 4; b += 64)
        _mm_prefetch((const char *)K + b, _MM_HINT_T0), _mm_prefetch((const char *)V + b, _MM_HINT_T0);
}

AVX2 static INLINE void heads8(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                               const float *sinks, float *out) {
    float m[MAXG];
    __m256 l[MAXG];
    for (int h = 0; h < g; h++) m[h] = -INFINITY, l[h] = _mm256_setzero_ps();
    memset(out, 0, sizeof(float) * g * hd);
    int p = 0;
    for (; p + 8 <= n; p += 8) {
        if (p + 16 <= n) prefetch_chunk(K + (int64_t)(p + 8) * hd, V + (int64_t)(p + 8) * hd, 8, hd);
        chunk8(q, g, K + (int64_t)p * hd, V + (int64_t)p * hd, 8, hd, scale, m, l, out);
    }
    if (p < n) chunk8(q, g, K + (int64_t)p * hd, V + (int64_t)p * hd, n - p, hd, scale, m, l, out);
    for (int h = 0; h < g; h++) {
        __m256 r = _mm256_set1_ps(1.f / (hsum8(l[h]) + (sinks ? expf(sinks[h] - m[h]) : 0.f)));
        for (int s = 0; s < hd; s += 8) _mm256_storeu_ps(out + h * hd + s, _mm256_mul_ps(_mm256_loadu_ps(out + h * hd + s), r));
    }
}

/* attend_heads_c for hd a multiple of 8 and g <= MAXG; hd a constant for the common sizes (the
 * loops unrolled, the rows addressed without multiplies: ~20% faster) */
AVX2 static void attend_heads_avx2(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                                   const float *sinks, float *out) {
    if (hd == 64) heads8(q, g, K, V, n, 64, scale, sinks, out);
    else if (hd == 128) heads8(q, g, K, V, n, 128, scale, sinks, out);
    else heads8(q, g, K, V, n, hd, scale, sinks, out);
}
#endif
