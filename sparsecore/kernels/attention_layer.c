/* _kernels.c, part: one layer's attention block (attn_token, attn_batch, attn_part): RMSNorm and
 * LayerNorm (also residual_norm's), the products, RoPE, the KV cache and attention at the level
 * in use. */

/* One decoded token's attention block for one layer, in place on the residual h (hidden):
 *   x = rmsnorm(h) * norm_w (a LayerNorm with bias where the record has one: falcon);
 *   q, k, v = Wq x, Wk x, Wv x (Q and K rows in un-permuted order)
 *   rotate-half RoPE on q and k at `pos` (cos, and sin with the first half negated, as the
 *   Python model's tables hold them); k, v into the layer's cache at pos;
 *   per query head: softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] (query head i reads KV head
 *   i / (n_heads / n_kv)); h += Wo (heads side by side).
 * The same arithmetic as coordinator/model/transformer.py's torch path in float32, in one call instead of
 * some twenty small torch operations (each 3-10 us, most of a small model's token). */
typedef struct {
    float *x, *q, *k, *v, *att, *out;
    q8blk *xq, *oq;
} attn_scratch;

/* A layer's attention variants beyond llama's (sparsecore/arch.py names whose), one record per
 * step. sparsecore/kernels/attention.py's ATTN_EXTRA mirrors this layout field by field
 * (attn_extra_layout reports it, and a test holds the two together); a zeroed record is llama's
 * attention. Where a share is summed across processes (attn_part), the sum's owner applies
 * post_norm and out_scale (residual_norm), since the norm is not linear in the shares. */
typedef struct {
    const float *bias;      /* Q | K | V biases in the file's row order (n_heads hd + 2 n_kv hd), or NULL */
    const float *q_norm;    /* RMSNorm weights (hd) applied to each query head before rope, or NULL */
    const float *k_norm;    /* and to each key head (n_heads hd and n_kv hd wide where qk_norm_full) */
    const float *post_norm; /* RMSNorm weights (hidden) of the attention output before the residual, or NULL */
    const float *norm_bias; /* the input norm's bias (hidden): it is then a LayerNorm (falcon), or NULL: RMSNorm */
    float scale;            /* the softmax scale; 0: 1/sqrt(hd) */
    float out_scale;        /* the attention output times this before the residual; 0: 1 */
    int32_t window;         /* a query at p sees keys p - window < k <= p; 0: every key */
    int32_t qk_norm_full;   /* 1: q_norm and k_norm are one RMSNorm over all heads' values (olmoe) */
    const float *sinks;     /* per query head a logit in the softmax's denominator only (gpt-oss), or NULL */
    const float *out_bias;  /* the output product's bias (hidden; gpt-oss), added by the share of head 0, or NULL */
} attn_extra;

static const attn_extra NO_EXTRA = {0};

/* x = RMSNorm(h) * w (the double sum keeps long rows exact enough to match torch's) */
static void rms_norm_into(const float *h, const float *w, float eps, int n, float *x) {
    double ss = 0.0;
    if (kern.sum_squares) ss = kern.sum_squares(h, n);
    else
        for (int i = 0; i < n; i++) ss += (double)h[i] * h[i];
    float r = 1.f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) x[i] = h[i] * r * w[i];
}

/* x = LayerNorm(h) * w + b (falcon's norms): mean and variance as double sums (as rms_norm_into,
 * close to torch's whatever n), then torch's own expression, (h * r + (-mean * r)) * w + b in
 * float, so that the rounding of each value is the one transformers' LayerNorm gives it. */
static void layer_norm_into(const float *h, const float *w, const float *b, float eps, int n, float *x) {
    double s = 0.0, ss = 0.0;
    for (int i = 0; i < n; i++) s += h[i];
    double mean = s / n;
    for (int i = 0; i < n; i++) {
        double d = h[i] - mean;
        ss += d * d;
    }
    float r = 1.f / sqrtf((float)(ss / n) + eps), c = -(float)mean * r;
    for (int i = 0; i < n; i++) x[i] = (h[i] * r + c) * w[i] + b[i];
}

/* The norm a record or a call names: a LayerNorm where it has a bias, else RMSNorm */
static void norm_into(const float *h, const float *w, const float *b, float eps, int n, float *x) {
    if (b) layer_norm_into(h, w, b, eps, n, x);
    else rms_norm_into(h, w, eps, n, x);
}

/* One sequence at position pos: rope on q and k, k and v into the cache, then per query head
 * softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] into out. n_heads query heads from the group
 * position `first` of the first of n_kv KV heads (query head i, counted from that KV head's
 * first, reads KV head i / group): a slice of the model's heads, kc and vc at its first KV head.
 * A slice may start or end inside a group (one KV head shared by processes): each process then
 * computes that KV head's keys and values and writes them to the cache, the same bytes from the
 * same rows by the same kernels, so every reader sees one value whichever write lands last. */
static void attend(float *q, float *k, const float *v, int n_heads, int n_kv, int group, int first, int hd, int d,
                   const float *cos_r, const float *sin_r, int pos, float *kc, float *vc, int max_ctx,
                   const attn_extra *ex, const float *sinks, float eps, float *att, float *out) {
    /* each head's RMSNorm over its hd values, before rope (qwen3, gemma3); over every head at once
     * (qk_norm_full: olmoe), attn_part applied it before */
    if (ex->q_norm && !ex->qk_norm_full)
        for (int j = 0; j < n_heads; j++) rms_norm_into(q + (int64_t)j * hd, ex->q_norm, eps, hd, q + (int64_t)j * hd);
    if (ex->k_norm && !ex->qk_norm_full)
        for (int j = 0; j < n_kv; j++) rms_norm_into(k + (int64_t)j * hd, ex->k_norm, eps, hd, k + (int64_t)j * hd);
    rope(q, n_heads, hd, d, cos_r, sin_r);
    rope(k, n_kv, hd, d, cos_r, sin_r);
    for (int j = 0; j < n_kv; j++) {
        memcpy(kc + ((int64_t)j * max_ctx + pos) * hd, k + j * hd, sizeof(float) * hd);
        memcpy(vc + ((int64_t)j * max_ctx + pos) * hd, v + j * hd, sizeof(float) * hd);
    }
    float scale = ex->scale > 0.f ? ex->scale : 1.f / sqrtf((float)hd);
    /* a sliding window: the keys of positions lo..pos (the cache keeps every position) */
    int lo = ex->window > 0 && pos >= ex->window ? pos - ex->window + 1 : 0, n = pos + 1 - lo;
    for (int j = 0; j < n_kv; j++) {
        const float *K = kc + ((int64_t)j * max_ctx + lo) * hd, *V = vc + ((int64_t)j * max_ctx + lo) * hd;
        int a = j * group - first, b = a + group;  /* this KV head's query heads, in q's numbering */
        if (a < 0) a = 0;
        if (b > n_heads) b = n_heads;
        float *qj = q + (int64_t)a * hd, *oj = out + (int64_t)a * hd;
        int heads = b - a;
        const float *sj = sinks ? sinks + a : NULL;  /* these query heads' sinks */
        if (kern.attend8 && hd % 8 == 0) {
            for (int h = 0; h < heads; h += MAXG) {
                int g = heads - h < MAXG ? heads - h : MAXG;
                const float *sh = sj ? sj + h : NULL;
                if (kern.attend16 && hd % 16 == 0) kern.attend16(qj + h * hd, g, K, V, n, hd, scale, sh, oj + h * hd);
                else kern.attend8(qj + h * hd, g, K, V, n, hd, scale, sh, oj + h * hd);
            }
            continue;
        }
        attend_heads_c(qj, heads, K, V, n, hd, scale, sj, att, oj);
    }
}

/* a fused Q|K|V twin's products (attn_part, one token), per thread, grown on demand */
static _Thread_local void *qkv_buf;
static _Thread_local int64_t qkv_cap;
static float *qkv_scratch(int64_t n) { return grown(&qkv_buf, &qkv_cap, sizeof(float) * n); }

/* A share's Q and K (query heads from q0, nq values; KV heads from k0, nk) where the Q/K norms
 * span every head (qk_norm_full): every head's rows of Q and K for the B rows of sc.x (products
 * into out, then v, in the file's row order), reordered (q_rows, k_rows), normalized whole, and
 * the share's values moved to the front of each row: sc.q and sc.k as the share's own products
 * would leave them. Q's and K's biases are added here, before the norm (attn_part adds V's). */
static void full_qk_share(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, int hidden, int n_heads,
                          int n_kv, int hd, const attn_extra *ex, float eps, int B, int fast, attn_scratch sc,
                          int64_t q0, int64_t nq, int64_t k0, int64_t nk) {
    int64_t NQ = (int64_t)n_heads * hd, NK = (int64_t)n_kv * hd, ldxq = hidden / QK;
    products(wq, NULL, 0, NQ, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.out, NQ);
    products(wk, NULL, 0, NK, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.v, NK);
    for (int b = 0; b < B; b++) {  /* rows in order; a share's row b lies at or before the whole row b */
        float *q = sc.q + b * NQ, *k = sc.k + b * NK;
        for (int64_t i = 0; i < NQ; i++) q[i] = sc.out[b * NQ + q_rows[i]];
        for (int64_t i = 0; i < NK; i++) k[i] = sc.v[b * NK + k_rows[i]];
        if (ex->bias) {  /* the file's row order, as q_rows and k_rows index it */
            for (int64_t i = 0; i < NQ; i++) q[i] += ex->bias[q_rows[i]];
            for (int64_t i = 0; i < NK; i++) k[i] += ex->bias[NQ + k_rows[i]];
        }
        rms_norm_into(q, ex->q_norm, eps, (int)NQ, q);
        rms_norm_into(k, ex->k_norm, eps, (int)NK, k);
    }
    for (int b = 0; b < B; b++) {  /* ascending: the destination never passes a source yet unread */
        memmove(sc.q + b * nq, sc.q + b * NQ + q0, sizeof(float) * nq);
        memmove(sc.k + b * nk, sc.k + b * NK + k0, sizeof(float) * nk);
    }
}

/* The attention of query heads [h0, h1) (and their KV heads) for B sequences decoded together
 * (continuous batching), each at its own position with its own KV cache: the norm per row, the
 * Q, K, V rows of those heads read once for all B (matmul), rope, the cache write and softmax
 * attention per sequence, then those heads' columns of the output product: `part` (B rows of
 * hidden) gets their share of the attention output. The shares of disjoint head ranges summed
 * are the whole attention (what lets processes split a layer's heads: coordinator/
 * runtime/attention_split.py). Per sequence the same float operations whatever B, so a sequence decodes
 * the same alone or in a batch. cos_t, sin_t: the whole tables (max_ctx rows of d); kcs[b],
 * vcs[b]: the layer's caches of sequence b at KV head 0. Scratch: x (B hidden), q and out
 * (B n_heads hd), k and v (B n_kv hd), att (max_ctx), xq (B hidden/32 blocks), oq (B n_heads
 * hd/32 blocks). The heads' columns of wo must start on a block of wo's type. */
static void attn_part(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                      const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                      const attn_extra *ex, const float *cos_t, const float *sin_t, int B, const int64_t *pos,
                      float *const *kcs, float *const *vcs, int max_ctx, int fast, attn_scratch sc, const float *h,
                      int h0, int h1, float *part) {
    int group = n_heads / n_kv, kv0 = h0 / group, kv1 = (h1 + group - 1) / group, lq = h1 - h0, lk = kv1 - kv0;
    int64_t nq = (int64_t)lq * hd, nk = (int64_t)lk * hd, q0 = (int64_t)h0 * hd, k0 = (int64_t)kv0 * hd;
    int64_t ldxq = hidden / QK, ldoq = (nq + QK - 1) / QK, head_off = (int64_t)kv0 * max_ctx * hd;
    for (int b = 0; b < B; b++) {
        float *xb = sc.x + (int64_t)b * hidden;
        norm_into(h + (int64_t)b * hidden, norm_w, ex->norm_bias, eps, hidden, xb);
        if (fast) quantize_q8(xb, hidden, sc.xq + b * ldxq);
    }
    /* One token with Q, K and V of these heads in one fused twin (cols_generic.c
     * COLS_MAGIC_FUSED: their rows stacked, Q's then K's then V's): one product, each active
     * input's channel one stream of the three matrices' values (K's and V's alone: a line) */
    /* Q/K norms over every head (olmoe): one RMS over all heads' values, which a share of the heads
     * does not have. A share computes every head's Q and K (the same products the whole layer
     * would, so the same norms), normalizes them and keeps its own heads' (full_qk_share);
     * V, attention and the output product stay its heads' alone. */
    int share_of_full = ex->qk_norm_full && (h0 != 0 || h1 != n_heads);
    const cols_hdr *fused = B == 1 && !share_of_full ? cols_take_fused(wq, q0, nq + 2 * nk, 0, hidden) : NULL;
    float *qkv = fused ? qkv_scratch(nq + 2 * nk) : NULL;
    if (qkv && cols_products(fused, sc.x, sc.xq, fast, qkv) >= 0) {
        for (int64_t i = 0; i < nq; i++) sc.q[i] = qkv[q_rows[q0 + i] - q0];
        for (int64_t i = 0; i < nk; i++) sc.k[i] = qkv[nq + k_rows[k0 + i] - k0];
        memcpy(sc.v, qkv + nq + nk, sizeof(float) * nk);
    } else if (share_of_full) {
        full_qk_share(wq, q_rows, wk, k_rows, hidden, n_heads, n_kv, hd, ex, eps, B, fast, sc, q0, nq, k0, nk);
        products(wv, NULL, k0, nk, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.v, nk);
    } else {
    /* Q's rows in the file's order (one stream: rows visited out of order cost 15 % more), into
     * out for now, then reordered per head (q_rows permutes rows within each head only) */
    products(wq, NULL, q0, nq, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.out, nq);
    for (int b = 0; b < B; b++)
        for (int64_t i = 0; i < nq; i++) sc.q[b * nq + i] = sc.out[b * nq + q_rows[q0 + i] - q0];
    /* K's likewise (into v, free until V's products): ranges are what interleaved rows take */
    products(wk, NULL, k0, nk, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.v, nk);
    for (int b = 0; b < B; b++)
        for (int64_t i = 0; i < nk; i++) sc.k[b * nk + i] = sc.v[b * nk + k_rows[k0 + i] - k0];
    products(wv, NULL, k0, nk, 0, hidden, sc.x, hidden, sc.xq, ldxq, B, fast, sc.v, nk);
    }
    if (ex->bias) {  /* Q/K/V biases (qwen2): the file's row order, as q_rows and k_rows index it */
        const float *bq = ex->bias, *bk = bq + (int64_t)n_heads * hd, *bv = bk + (int64_t)n_kv * hd;
        for (int b = 0; b < B; b++) {
            if (!share_of_full) {  /* full_qk_share added Q's and K's before their norms */
                for (int64_t i = 0; i < nq; i++) sc.q[b * nq + i] += bq[q_rows[q0 + i]];
                for (int64_t i = 0; i < nk; i++) sc.k[b * nk + i] += bk[k_rows[k0 + i]];
            }
            for (int64_t i = 0; i < nk; i++) sc.v[b * nk + i] += bv[k0 + i];
        }
    }
    if (ex->qk_norm_full && !share_of_full)  /* every head here: one RMS over the row */
        for (int b = 0; b < B; b++) {
            rms_norm_into(sc.q + b * nq, ex->q_norm, eps, (int)nq, sc.q + b * nq);
            rms_norm_into(sc.k + b * nk, ex->k_norm, eps, (int)nk, sc.k + b * nk);
        }
    for (int b = 0; b < B; b++) {
        int p0 = (int)pos[b];
        attend(sc.q + b * nq, sc.k + b * nk, sc.v + b * nk, lq, lk, group, h0 - kv0 * group, hd, d, cos_t + (int64_t)p0 * d,
               sin_t + (int64_t)p0 * d, p0, kcs[b] + head_off, vcs[b] + head_off, max_ctx, ex,
               ex->sinks ? ex->sinks + h0 : NULL, eps, sc.att, sc.out + b * nq);
        if (fast) quantize_q8(sc.out + b * nq, (int)nq, sc.oq + b * ldoq);
    }
    products(wo, NULL, 0, hidden, q0, (int)nq, sc.out, nq, sc.oq, ldoq, B, fast, part, hidden);
    if (ex->out_bias && h0 == 0)  /* once across the processes' shares: by the one with head 0 */
        for (int b = 0; b < B; b++)
            for (int i = 0; i < hidden; i++) part[(int64_t)b * hidden + i] += ex->out_bias[i];
}

/* attn_token for B sequences: every head's share (attn_part), through the output norm and scale
 * where the layer has them (ex), added to the residual h in place. */
static void attn_batch(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                       const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                       const attn_extra *ex, const float *cos_t, const float *sin_t, int B, const int64_t *pos,
                       float *const *kcs, float *const *vcs, int max_ctx, int fast, attn_scratch sc, float *h) {
    float *part = sc.x;  /* x: free once the products have read it (attn_part's last matmul reads out) */
    attn_part(wq, q_rows, wk, k_rows, wv, wo, norm_w, eps, hidden, n_heads, n_kv, hd, d, ex, cos_t, sin_t, B, pos,
              kcs, vcs, max_ctx, fast, sc, h, 0, n_heads, part);
    for (int b = 0; b < B; b++) {
        float *pb = part + (int64_t)b * hidden, *hb = h + (int64_t)b * hidden;
        if (ex->post_norm) rms_norm_into(pb, ex->post_norm, eps, hidden, pb);
        if (ex->out_scale != 0.f)
            for (int i = 0; i < hidden; i++) hb[i] += pb[i] * ex->out_scale;
        else
            for (int i = 0; i < hidden; i++) hb[i] += pb[i];
    }
}

/* One sequence's decoded token: attn_batch of one row (one token's products go through matvec) */
static void attn_token(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                       const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                       const attn_extra *ex, const float *cos_t, const float *sin_t, int pos, float *kc, float *vc,
                       int max_ctx, int fast, attn_scratch sc, float *h) {
    int64_t p = pos;
    float *kcs[1] = {kc}, *vcs[1] = {vc};
    attn_batch(wq, q_rows, wk, k_rows, wv, wo, norm_w, eps, hidden, n_heads, n_kv, hd, d, ex, cos_t, sin_t, 1, &p,
               kcs, vcs, max_ctx, fast, sc, h);
}

/* h[b] += the sum of B rows of shares, after the attention's (or FFN's) output norm `post` and
 * `scale` where given (0: none): the step that sums a layer's shares across processes
 * (residual_norm) applies what attn_batch applies to a whole layer, on the same floats. */
static void add_shares(float *h, const float *const *parts, int n_parts, int n, int B, const float *post,
                       float eps, float scale) {
    float *acc = qkv_scratch(n);
    for (int b = 0; b < B; b++) {
        float *hb = h + (int64_t)b * n;
        const int64_t off = (int64_t)b * n;
        if (!post && scale == 0.f) {  /* the common case: no row buffer */
            for (int i = 0; i < n; i++) {
                float a = parts[0][off + i];
                for (int p = 1; p < n_parts; p++) a += parts[p][off + i];
                hb[i] += a;
            }
            continue;
        }
        for (int i = 0; i < n; i++) {
            float a = parts[0][off + i];
            for (int p = 1; p < n_parts; p++) a += parts[p][off + i];
            acc[i] = a;
        }
        if (post) rms_norm_into(acc, post, eps, n, acc);
        if (scale != 0.f)
            for (int i = 0; i < n; i++) hb[i] += acc[i] * scale;
        else
            for (int i = 0; i < n; i++) hb[i] += acc[i];
    }
}
