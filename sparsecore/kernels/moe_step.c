/* _kernels.c, part: routed experts (sparsecore/shard.py ExpertsLayer): a token's routing and its
 * chosen experts' shares in one call, instead of a Python loop of k FFN calls a layer. */

/* How moe_route scores and weighs (its `flags`, llama.cpp's per-architecture build_moe_ffn
 * arguments): MOE_RENORM, the top k's weights renormalized to sum 1 (floored at 6.1e-5 as
 * llama.cpp); MOE_SIGMOID, each expert's probability the sigmoid of its logit instead of the
 * softmax over all (smallthinker's expert_gating_func 2); MOE_ROUTED (moe_token only): ids and w
 * already hold the token's routing, computed from another input than the FFN's (smallthinker's
 * router reads the layer's input), so moe_token does not route. Bits MOE_DEAL_SHIFT.. (moe_token
 * only): a dealt share, the phase (8 bits) then the dealers (8 bits; 0 or 1: not dealt): of the
 * token's chosen experts this process owns, it computes every dealers-th from phase, in order
 * of probability (the processes hold the experts whole: sparsecore/experts.py ExpertsLayer). */
#define MOE_RENORM 1
#define MOE_SIGMOID 2
#define MOE_ROUTED 4
#define MOE_DEAL_SHIFT 8

/* The routing of x (hidden) as llama.cpp's build_moe_ffn computes it: the router's E logits
 * (exact arithmetic, so every process that routes the same x picks the same experts), softmax
 * (or sigmoid: MOE_SIGMOID), the k most probable (ties to the lower index), their probabilities
 * as weights, renormalized where MOE_RENORM. probs: scratch of E floats. */
static void moe_route(mat router, const float *x, int hidden, int E, int k, int flags, float *probs, int32_t *ids,
                      float *w) {
    matvec(router, NULL, 0, E, 0, hidden, x, NULL, 0, probs);
    if (flags & MOE_SIGMOID) {
        for (int e = 0; e < E; e++) probs[e] = 1.f / (1.f + expf(-probs[e]));  /* ggml_sigmoid's */
    } else {
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
    if (flags & MOE_RENORM) {
        total = total > 6.1e-5f ? total : 6.1e-5f;
        for (int j = 0; j < k; j++) w[j] /= total;
    }
}

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
static int64_t moe_token(const mat *table, int E, int k, int flags, mat router, float *probs, int32_t *ids,
                         float *w, const float *thr_e, int64_t *counts, ffn_call *c, float *out) {
    if (!(flags & MOE_ROUTED)) moe_route(router, c->x, c->hidden, E, k, flags, probs, ids, w);
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
        if (sparse && thr_e) c->threshold = thr_e[ids[j]];
        int64_t a = ffn_token(c);
        if (a < 0) return a;
        n += a;
        for (int i = 0; i < c->hidden; i++) out[i] += w[j] * c->y[i];
    }
    return n;
}
