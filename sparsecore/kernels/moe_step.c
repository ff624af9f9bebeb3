/* _kernels.c, part: routed experts (sparsecore/shard.py ExpertsLayer): a token's routing and its
 * chosen experts' shares in one call, instead of a Python loop of k FFN calls a layer. */

/* How moe_route scores and weighs (its `flags`, llama.cpp's per-architecture build_moe_ffn
 * arguments): MOE_RENORM, the top k's weights renormalized to sum 1 (floored at 6.1e-5 as
 * llama.cpp); MOE_SIGMOID, each expert's probability the sigmoid of its logit instead of the
 * softmax over all (smallthinker's expert_gating_func 2); MOE_SOFTMAX_WEIGHT, the k largest
 * logits chosen and their softmax over those k alone (gpt-oss: llama.cpp's
 * LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT); MOE_ROUTED (moe_token only): ids and w
 * already hold the token's routing, computed from another input than the FFN's (smallthinker's
 * router reads the layer's input), so moe_token does not route. Bits MOE_DEAL_SHIFT.. (moe_token
 * only): a dealt share, the phase (8 bits) then the dealers (8 bits; 0 or 1: not dealt): of the
 * token's chosen experts this process owns, it computes every dealers-th from phase, in order
 * of probability (the processes hold the experts whole: sparsecore/experts.py ExpertsLayer). */
#define MOE_RENORM 1
#define MOE_SIGMOID 2
#define MOE_ROUTED 4
#define MOE_SOFTMAX_WEIGHT 8
#define MOE_DEAL_SHIFT 8

/* The routing of x (hidden) as llama.cpp's build_moe_ffn computes it: the router's E logits
 * (exact arithmetic, so every process that routes the same x picks the same experts), plus the
 * router's bias where it has one (bias: E floats, or NULL), softmax (or sigmoid: MOE_SIGMOID),
 * the k most probable (ties to the lower index), their probabilities as weights, renormalized
 * where MOE_RENORM; MOE_SOFTMAX_WEIGHT: the k largest logits, weighed by their own softmax.
 * probs: scratch of E floats. */
static void moe_route(mat router, const float *bias, const float *x, int hidden, int E, int k, int flags, float *probs,
                      int32_t *ids, float *w) {
    matvec(router, NULL, 0, E, 0, hidden, x, NULL, 0, probs);
    if (bias)
        for (int e = 0; e < E; e++) probs[e] += bias[e];
    /* MOE_SOFTMAX_WEIGHT: probs keeps the logits, the selection below picks by them, then each
     * weight is its logit's softmax over the chosen k (the first, the largest, subtracted) */
    if (flags & MOE_SIGMOID) {
        for (int e = 0; e < E; e++) probs[e] = 1.f / (1.f + expf(-probs[e]));  /* ggml_sigmoid's */
    } else if (!(flags & MOE_SOFTMAX_WEIGHT)) {
        float mx = probs[0], sum = 0.f;
        for (int e = 1; e < E; e++) mx = probs[e] > mx ? probs[e] : mx;
        for (int e = 0; e < E; e++) { probs[e] = expf(probs[e] - mx); sum += probs[e]; }
        for (int e = 0; e < E; e++) probs[e] /= sum;
    }
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = best, w[j] = probs[best], total += probs[best];
    }
    if (flags & MOE_SOFTMAX_WEIGHT) {
        float mx = w[0], sum = 0.f;
        for (int j = 0; j < k; j++) { w[j] = expf(w[j] - mx); sum += w[j]; }
        for (int j = 0; j < k; j++) w[j] /= sum;
        return;
    }
    if (flags & MOE_RENORM) {
        total = total > 6.1e-5f ? total : 6.1e-5f;
        for (int j = 0; j < k; j++) w[j] /= total;
    }
}

/* out += w y (n values): one function for moe_token and moe_batch, so that a batch's row sums
 * exactly as the token alone does (never inlined: no call site contracts it otherwise) */
__attribute__((noinline)) static void moe_add(float *out, float w, const float *y, int n) {
    for (int i = 0; i < n; i++) out[i] += w * y[i];
}

/* Expert e's row of an ACT_OAI record's bias table (gate's and up's biases of the owned
 * neurons, then down's), or the record's own where the activation has none */
static inline const float *expert_bias(const ffn_call *c, const float *table, int e) {
    return (c->act & ACT_MASK) == ACT_OAI ? table + (int64_t)e * (2 * c->n_own + c->hidden) : table;
}

/* the most experts a token chooses that moe_batch takes */
#define MOE_MAX_K 64

/* One token's share of a routed layer: route c->x (unless MOE_ROUTED: ids and w hold it), then for each chosen expert e (in order of
 * probability) its FFN over the owned neurons (ffn_token on table row e's matrices, into c->y;
 * the table holds every expert's gate, up and down as mat records, so the experts a token picks
 * are looked up, not passed)
 * times its weight, summed into out (hidden). An expert this process owns no rows of has a row
 * of empty records (gate.base NULL: another process computes it) and is skipped; `counts` (E
 * int64, or NULL) counts each chosen expert that is computed here (the measured routed share:
 * coordinator/runtime/engine.py).  Sparse steps (c->threshold >= 0: CATS) take each
 * chosen expert's own threshold from thr_e (E floats, calibrated per expert: an expert's gate
 * activations have their own scale), or c->threshold for every expert where thr_e is NULL; a
 * dense step (c->threshold < 0) ignores thr_e, so it runs exactly as before thresholds existed.
 * Returns the active neurons, or ffn_token's error. */
static int64_t moe_token(const mat *table, int E, int k, int flags, mat router, const float *router_bias,
                         float *probs, int32_t *ids, float *w, const float *thr_e, int64_t *counts, ffn_call *c,
                         float *out) {
    if (!(flags & MOE_ROUTED)) moe_route(router, router_bias, c->x, c->hidden, E, k, flags, probs, ids, w);
    const float *bias = c->bias;  /* ACT_OAI: every expert's row of biases (expert_bias) */
    memset(out, 0, sizeof(float) * c->hidden);
    int sparse = c->threshold >= 0.f;
    int64_t n = 0;
    int dealers = (flags >> (MOE_DEAL_SHIFT + 8)) & 0xff, phase = (flags >> MOE_DEAL_SHIFT) & 0xff, turn = 0;
    for (int j = 0; j < k; j++) {
        const mat *row = table + (int64_t)ids[j] * 3;
        if (!row[0].base) continue;  /* not owned here */
        if (dealers > 1 && turn++ % dealers != phase) continue;  /* dealt to another process */
        if (counts) counts[ids[j]]++;
        c->gate = row[0], c->up = row[1], c->down = row[2];
        c->bias = expert_bias(c, bias, ids[j]);
        if (sparse && thr_e) c->threshold = thr_e[ids[j]];
        int64_t a = ffn_token(c);
        if (a < 0) return a;
        n += a;
        moe_add(out, w[j], c->y, c->hidden);
    }
    return n;
}

/* A small batch's shares of a routed layer: B tokens (x: B rows of c->hidden, B <= MAXB), each
 * routed as moe_token routes it (unless MOE_ROUTED: ids and w hold B rows of k), the chosen
 * experts this process computes (owned, and dealt here) grouped by expert: an expert's tokens
 * gathered into xg and run in one ffn_batch (its rows read once for all of them; each token's
 * y is the one ffn_token gives it alone, bit for bit), into parts (B k rows of hidden), then each
 * token's shares summed into out in its own order of experts, as moe_token sums them: every row
 * of out is moe_token's for that token, bit for bit (continuous batching must not change a
 * reply). c: a batch record with scratch for MAXB tokens (its x, B, y, thr and matrices are set
 * here); xg, yg: MAXB rows of hidden; counts as moe_token's. Returns the active (neuron, token)
 * pairs, or ffn_batch's error. */
static int64_t moe_batch(const mat *table, int E, int k, int flags, mat router, const float *router_bias, float *probs,
                         int32_t *ids, float *w, const float *thr_e, int64_t *counts, ffn_call *c, const float *x, int B,
                         float *xg, float *yg, float *parts, float *out) {
    const int hidden = c->hidden, sparse = c->threshold >= 0.f;
    const float *bias = c->bias;
    int dealers = (flags >> (MOE_DEAL_SHIFT + 8)) & 0xff, phase = (flags >> MOE_DEAL_SHIFT) & 0xff;
    uint8_t pick[MAXB * MOE_MAX_K];  /* 1: computed here, not yet; 2: done */
    for (int t = 0; t < B; t++) {
        if (!(flags & MOE_ROUTED))
            moe_route(router, router_bias, x + (int64_t)t * hidden, hidden, E, k, flags, probs, ids + t * k, w + t * k);
        for (int j = 0, turn = 0; j < k; j++) {
            int own = table[(int64_t)ids[t * k + j] * 3].base != NULL;
            pick[t * k + j] = own && (dealers <= 1 || turn++ % dealers == phase);
        }
    }
    float thr[MAXB];
    int who[MAXB];  /* the gathered tokens' (t k + j) */
    int64_t n = 0;
    for (int tj = 0; tj < B * k; tj++) {
        if (pick[tj] != 1) continue;
        const int e = ids[tj];
        int m = 0;
        for (int u = tj; u < B * k; u++) {  /* a token chooses an expert once: one u per token */
            if (pick[u] != 1 || ids[u] != e) continue;
            pick[u] = 2, who[m] = u;
            memcpy(xg + (int64_t)m * hidden, x + (int64_t)(u / k) * hidden, sizeof(float) * hidden);
            thr[m++] = thr_e ? thr_e[e] : c->threshold;
        }
        const mat *row = table + (int64_t)e * 3;
        c->gate = row[0], c->up = row[1], c->down = row[2];
        c->x = xg, c->y = yg, c->B = m, c->thr = sparse ? thr : NULL, c->bias = expert_bias(c, bias, e);
        int64_t a = ffn_batch(c);
        if (a < 0) return a;
        n += a;
        if (counts) counts[e] += m;
        for (int i = 0; i < m; i++) memcpy(parts + (int64_t)who[i] * hidden, yg + (int64_t)i * hidden, sizeof(float) * hidden);
    }
    for (int t = 0; t < B; t++) {
        float *o = out + (int64_t)t * hidden;
        memset(o, 0, sizeof(float) * hidden);
        for (int j = 0; j < k; j++)
            if (pick[t * k + j]) moe_add(o, w[t * k + j], parts + (int64_t)(t * k + j) * hidden, hidden);
    }
    return n;
}
