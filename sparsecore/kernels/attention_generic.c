/* _kernels.c, part: RoPE and softmax attention in portable C. */

/* rotate-half RoPE on the first d values of each of n_heads heads (hd apart), in place: value i
 * pairs with i + d/2 (sin_r carries the signs) */
static void rope(float *x, int n_heads, int hd, int d, const float *cos_r, const float *sin_r) {
    int half = d / 2;
    for (int hh = 0; hh < n_heads; hh++) {
        float *v = x + (int64_t)hh * hd;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_r[i] + b * sin_r[i];
            v[i + half] = b * cos_r[i + half] + a * sin_r[i + half];
        }
    }
}

/* ---- softmax attention over one KV head's n cached positions, for g query heads -------------
 * With sinks (gpt-oss: a learned logit per head), each head's denominator has e^(sink - max) too
 * (max over the scores: the ratio is the same as with the sink in the max, as transformers). 
 * Portable: per head, two passes (the scores into att, then the weighted sum of the V rows).
 * AVX2 / AVX-512: the positions in chunks of one vector width W (8 / 16). Per chunk and head, W
 * scores as one vector (W dot products side by side, one horizontal reduction for all W), then
 * an online softmax (FlashAttention's recurrence): the running max m, the sum l of e^(s - m) and
 * the unnormalized output in out, both rescaled when a chunk raises m; out / l at the end. The
 * chunk's K and V rows come from memory for the first head and from L1 for the group's others,
 * and no scratch grows with the context. Other float orders than the portable path, tested
 * against float64 (tests/test_attend_kernel.py). */
static void attend_heads_c(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                           const float *sinks, float *att, float *out) {
    for (int h = 0; h < g; h++) {
        const float *qh = q + (int64_t)h * hd;
        float mx = -INFINITY, sum = 0.f, *o = out + (int64_t)h * hd;
        for (int p = 0; p < n; p++) {
            const float *k = K + (int64_t)p * hd;
            float s = 0.f;
            for (int i = 0; i < hd; i++) s += k[i] * qh[i];
            att[p] = s * scale;
            if (att[p] > mx) mx = att[p];
        }
        for (int p = 0; p < n; p++) { att[p] = expf(att[p] - mx); sum += att[p]; }
        if (sinks) sum += expf(sinks[h] - mx);  /* the sink's share of the softmax, left out of the sum below */
        memset(o, 0, sizeof(float) * hd);
        for (int p = 0; p < n; p++) {
            const float *v = V + (int64_t)p * hd;
            float a = att[p] / sum;
            for (int i = 0; i < hd; i++) o[i] += a * v[i];
        }
    }
}
