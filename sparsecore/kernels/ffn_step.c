/* _kernels.c, part: the fused FFN step: one token's (ffn_token) or a small batch's (ffn_batch)
 * partial FFN over a process's own neurons, in one call. */

/* The act argument of ffn_token/ffn_batch: the activation in its low 4 bits, how gate and up
 * combine above them (sparsecore.kernels.GATE_BITS): ACT_PAR act(gate x) * (up x); ACT_NOGATE
 * act(gate x) alone, gate being the up matrix (falcon: no up pass at all); ACT_SYM
 * act(gate x) * act(up x) (PowerInfer's bamboo). */
#define ACT_MASK 15
#define ACT_NOGATE 16
#define ACT_SYM 32
/* gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai, transformers' GptOssMLP), with the experts'
 * biases (ffn_call.bias) and clamp (ffn_call.limit):
 *     h = (clamp(u + bu, -L, L) + 1) * g' sigmoid(1.702 g'),   g' = min(g + bg, L)
 * then y = down h + bd: a gate activation and an up factor of their own, one neuron each */
#define ACT_OAI 4
#define OAI_ALPHA 1.702f
static inline float oai_gate(float g, float bias, float limit) {
    g = fminf(g + bias, limit);
    return g * (1.f / (1.f + expf(-(g * OAI_ALPHA))));
}
static inline float oai_up(float u, float bias, float limit) { return fminf(fmaxf(u + bias, -limit), limit) + 1.f; }
static float act_fn(int act, float g) {
    if (act == 1) return g > 0.f ? g : 0.f;                /* relu */
    if (act == 3) return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));  /* gelu (erf): falcon */
    if (act == 2)                                          /* gelu_tanh (GeGLU: gemma) */
        return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.f + expf(-g));                            /* silu */
}

/* One call of the fused FFN step (ffn_token, ffn_batch, moe_token): a record the Python side
 * fills by field name (sparsecore/kernels/ffn_call.py's FfnCall, its layout checked at import
 * against ffn_call_layout in python_module.c, which reads it: get_ffn_call), so that a field is
 * named in both languages rather than kept at the same position of an argument list. Fields
 * are laid out without padding (every 8-byte field on 8 bytes) but the size's, rounded to 8.
 * gate, up: (n_ff rows, hidden cols); down: (hidden rows, n_ff cols), or with down_t its
 * transpose (n_ff rows of hidden: PowerInfer's ffn_down_t, a neuron's down column as a row). */
typedef struct {
    mat gate, up, down;
    int down_t, hidden;
    int64_t own0, n_own;  /* the owned neurons, [own0, own0 + n_own) of the layer's */
    int act;              /* the activation and how gate and up combine (ACT_MASK, ACT_NOGATE, ACT_SYM) */
    float threshold;      /* ffn_token: active where |act(gate x)| > threshold; < 0: dense */
    const float *thr;     /* ffn_batch: B such thresholds, one per token, or NULL (all dense) */
    const uint8_t *mask;  /* a predictor's over all n_ff neurons, the same for every token, or NULL */
    const float *x;       /* B rows of hidden */
    int B, fast;          /* tokens (ffn_token: 1); fast mode's 8-bit activations or exact */
    float *h;             /* scratch: B n_own floats */
    uint8_t *any;         /* ffn_batch's scratch: n_own bytes (ffn_token: NULL) */
    q8blk *xq, *hq;       /* scratch: B hidden / 32 and B ceil(n_own / 32) q8 blocks */
    int64_t *counts;      /* ffn_batch: each token's active neurons (ffn_token: NULL) */
    float *y;             /* B rows of hidden */
    /* ACT_OAI: gate's biases of the owned neurons, then up's (n_own each), then down's (hidden;
     * zeros where another process adds them); moe_token and moe_batch: one such row per expert */
    const float *bias;
    float limit;          /* ACT_OAI's clamp */
} ffn_call;

/* Owned neurons to visit, as offsets into the shard, per thread (grown on demand) */
static _Thread_local void *list_buf;
static _Thread_local int64_t list_cap;
static int32_t *neuron_list(int64_t n) { return grown(&list_buf, &list_cap, sizeof(int32_t) * n); }

/* up's products of a dense shard on X16 rows (B n_own floats), per thread, grown on demand */
static _Thread_local void *up_buf;
static _Thread_local int64_t up_cap;
static float *up_scratch(int64_t n) { return grown(&up_buf, &up_cap, sizeof(float) * n); }

/* Interleaved gate rows (X16: FileLayer, fast mode, down not transposed) serve dense and
 * threshold steps: gate's products for all B tokens in one pass over the groups, into h
 * (B n_own, raw). With up interleaved too (an engine that only decodes densely), dense steps
 * only: h = act(gate x) * (up x) in full (returns 1). Returns 0 when the caller goes on with
 * the raw gate values, -1 (no memory) or -2 (a step these rows cannot take: a caller's error,
 * a mask, or a threshold with up interleaved). xq: the tokens' q8 blocks, already made;
 * sparse: some token has a threshold. */
static int gate_x16(const ffn_call *c, int sparse) {
    mat gate = c->gate, up = c->up;
    int hidden = c->hidden, act = c->act, masked = c->mask != NULL, down_t = c->down_t, fast = c->fast, B = c->B;
    int64_t own0 = c->own0, n_own = c->n_own;
    const float *x = c->x;
    const q8blk *xq = c->xq;
    float *h = c->h;
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int up_x16 = mode != ACT_NOGATE && is_x16(up);
    if (masked || down_t || !fast || own0 % 16 || (up_x16 && sparse)) return -2;
    matmul(gate, NULL, own0, n_own, 0, hidden, x, hidden, xq, hidden / QK, B, fast, h, n_own);
    if (!up_x16) return 0;
    float *u = up_scratch((int64_t)B * n_own);
    if (!u) return -1;
    matmul(up, NULL, own0, n_own, 0, hidden, x, hidden, xq, hidden / QK, B, fast, u, n_own);
    if (act == ACT_OAI) {
        const float *bg = c->bias, *bu = c->bias + n_own;
        for (int64_t i = 0; i < (int64_t)B * n_own; i++) {
            int64_t j = i % n_own;
            h[i] = oai_gate(h[i], bg[j], c->limit) * oai_up(u[i], bu[j], c->limit);
        }
        return 1;
    }
    for (int64_t i = 0; i < (int64_t)B * n_own; i++) {
        float g = act_fn(act, h[i]);
        h[i] = g * (mode == ACT_SYM ? act_fn(act, u[i]) : u[i]);
    }
    return 1;
}

/* TEAL's branch of ffn_token (input sparsity): gate, up and down each carry an input-major twin
 * (mat.cols; gate's may be gate and up fused, up's then none) over the shard (gate's and up's rows [own0, own0 + n_own) of all hidden columns,
 * down's columns [own0, own0 + n_own) of all hidden rows) with a threshold >= 0. Then
 *     g = gate x, u = up x     over x's inputs above each twin's threshold
 *     h = act(g) * u           (act(g) * act(u) for ACT_SYM; act(g) for ACT_NOGATE)
 *     y = down h               over the neurons with |h| above down's threshold
 * so a skipped neuron skips its whole down row (PowerInfer's ffn_down_t, here from the file's
 * hidden-major down). Returns the active neurons (down's active inputs), or -3 where the twins
 * do not all apply (then ffn_token goes on as without them). */
static int64_t ffn_teal(const ffn_call *c) {
    mat gate = c->gate, up = c->up, down = c->down;
    int hidden = c->hidden, act = c->act & ACT_MASK, mode = c->act & ~ACT_MASK, fast = c->fast;
    int64_t own0 = c->own0, n_own = c->n_own;
    /* gate's rows then up's in one fused twin (cols_generic.c COLS_MAGIC_FUSED): one product of
     * 2 n_own rows, each active input's channel one stream of both matrices' values */
    const cols_hdr *tgu = mode == ACT_NOGATE ? NULL : cols_take_fused(gate, own0, 2 * n_own, 0, hidden);
    const cols_hdr *tg = tgu ? tgu : cols_take(gate, NULL, own0, n_own, 0, hidden);
    const cols_hdr *tu = tgu ? tgu : mode == ACT_NOGATE ? tg : cols_take(up, NULL, own0, n_own, 0, hidden);
    const cols_hdr *td = cols_take(down, NULL, 0, hidden, own0, n_own);
    if (c->down_t || c->mask || !tg || !tu || !td || n_own % QK || act == ACT_OAI) return -3;
    float *h = c->h, *u = up_scratch(tgu ? 2 * n_own : n_own);
    if (!u) return -1;
    if (fast) quantize_q8(c->x, hidden, c->xq);
    if (tgu) {  /* u: gate x, then up x */
        if (cols_products(tgu, c->x, c->xq, fast, u) < 0) return -1;
        memcpy(h, u, sizeof(float) * n_own);
        u += n_own;
    } else {
        if (cols_products(tg, c->x, c->xq, fast, h) < 0) return -1;
        if (mode != ACT_NOGATE && cols_products(tu, c->x, c->xq, fast, u) < 0) return -1;
    }
    for (int64_t i = 0; i < n_own; i++) {
        float g = act_fn(act, h[i]);
        h[i] = mode == ACT_NOGATE ? g : g * (mode == ACT_SYM ? act_fn(act, u[i]) : u[i]);
    }
    if (fast) quantize_q8(h, (int)n_own, c->hq);
    return cols_products(td, h, c->hq, fast, c->y);
}

/* THE hot function: one token's partial FFN over owned neurons [own0, own0 + n_own) of the layer
 * (a contiguous range on whole blocks of down's rows, 32 or 256, as the static plan hands them
 * out; any range with down_t). Active: dense (threshold < 0 and no mask), a predictor's mask
 * over all n_ff neurons, or |act(gate x)| > threshold. h: scratch of n_own floats; hq: scratch
 * of n_own / 32 q8 blocks; xq: scratch of hidden / 32 q8 blocks. Returns the number of active
 * neurons. With input-major twins on gate, up and down: ffn_teal. */
static int64_t ffn_token_step(const ffn_call *c) {
    mat gate = c->gate, up = c->up, down = c->down;
    int down_t = c->down_t, hidden = c->hidden, act = c->act, fast = c->fast;
    int64_t own0 = c->own0, n_own = c->n_own;
    float threshold = c->threshold;
    const uint8_t *mask = c->mask;
    const float *x = c->x;
    float *h = c->h, *y = c->y;
    q8blk *xq = c->xq, *hq = c->hq;
    /* twins on gate, up and down with thresholds >= 0: TEAL's input sparsity, whatever the
     * CATS threshold says (the twins' thresholds are the caller's choice of method); a
     * predictor's mask picks rows, which a twin cannot, and keeps the paths below */
    int64_t teal = gate.cols ? ffn_teal(c) : -3;
    if (teal != -3) return teal;
    int32_t *live = neuron_list(n_own);
    if (!live) return -1;
    if (fast) quantize_q8(x, hidden, xq);
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int64_t n_active = 0, n_live = 0, n_gate = n_own;
    int64_t gbytes = (int64_t)hidden / block_size(gate.t) * type_bytes(gate.t);
    int64_t ubytes = (int64_t)hidden / block_size(up.t) * type_bytes(up.t);
    int x16 = is_x16(gate) ? gate_x16(c, threshold >= 0.f) : 0;
    if (x16 < 0) return x16;
    if (x16 == 1) {  /* dense, gate and up interleaved: h is complete */
        if (n_own == 0) { memset(y, 0, sizeof(float) * hidden); return 0; }
        quantize_q8(h, (int)n_own, hq);
        matvec(down, NULL, 0, hidden, own0, (int)n_own, h, hq, fast, y);
        return n_own;
    }
    int x16_gate = is_x16(gate);  /* then h holds gate x already (gate_x16; no mask there) */
    if (!x16_gate) memset(h, 0, sizeof(float) * n_own);
    /* A predictor's mask: the gate rows to read, listed first, so that the row PREFETCH_ROWS
     * active rows ahead is asked for (at 10 % active, 4 neurons ahead is under one row). */
    if (mask) {
        n_gate = 0;
        for (int64_t i = 0; i < n_own; i++)
            if (mask[own0 + i]) live[n_gate++] = (int32_t)i;
    }
    /* Passes over the rows in order: gate (deciding who is active), then up and down for the
     * neurons whose act(gate x) is not 0 (`live`, compacted in place: an active neuron whose
     * activation is 0 contributes 0 either way and needs no up or down row). */
    const xpair *xp = x16_gate ? NULL : pack_x(gate, xq, 0, hidden, 1, fast);
    float *picked = NULL;  /* R16 rows' products, all in one call (r16_rows), then used in turn */
#if HAVE_X86
    if (is_r16(gate) && xp) {
        if (!(picked = up_scratch(n_gate))) return -1;
        r16_rows(shifted(gate, own0), mask ? live : NULL, 0, n_gate, xp, hidden / QK, picked);
    }
#endif
    for (int64_t j = 0; j < n_gate; j++) {
        int64_t i = mask ? live[j] : j;
        float raw;
        if (x16_gate) {
            raw = h[i];
            h[i] = 0.f;
        } else if (picked) {
            raw = picked[j];
        } else {
            if (mask && j + PREFETCH_ROWS < n_gate) prefetch_row(row_at(gate, own0 + live[j + PREFETCH_ROWS], 0), gbytes);
            raw = dot_any(gate, row_at(gate, own0 + i, 0), x, xq, xp, hidden, fast);
        }
        float g = act == ACT_OAI ? oai_gate(raw, c->bias[i], c->limit) : act_fn(act, raw);
        if (threshold >= 0.f && !(fabsf(g) > threshold)) continue;  /* sparsecore.ffn.is_active */
        n_active++;
        if (g == 0.f) continue;
        h[i] = g;
        live[n_live++] = (int32_t)i;  /* n_live <= j: the gate list is read ahead of this */
    }
    /* up's pack: the gate's where up has gate's type and layout (the same bytes), else its own */
    if (mode != ACT_NOGATE && !(xp && same_pack(up, gate))) xp = pack_x(up, xq, 0, hidden, 1, fast);
    picked = NULL;
#if HAVE_X86
    if (mode != ACT_NOGATE && is_r16(up) && xp) {
        if (!(picked = up_scratch(n_live))) return -1;
        r16_rows(shifted(up, own0), live, 0, n_live, xp, hidden / QK, picked);
    }
#endif
    for (int64_t j = 0; j < n_live && mode != ACT_NOGATE; j++) {
        int64_t i = live[j];
        float u;
        if (picked) u = picked[j];
        else {
            if (j + PREFETCH_ROWS < n_live) prefetch_row(row_at(up, own0 + live[j + PREFETCH_ROWS], 0), ubytes);
            u = dot_any(up, row_at(up, own0 + i, 0), x, xq, xp, hidden, fast);
        }
        h[i] *= act == ACT_OAI ? oai_up(u, c->bias[n_own + i], c->limit) : mode == ACT_SYM ? act_fn(act, u) : u;
    }
    if (n_active == 0) { memset(y, 0, sizeof(float) * hidden); return 0; }
    if (down_t) {  /* down stored transposed (rows = neurons): an axpy per active neuron only */
        memset(y, 0, sizeof(float) * hidden);
        int64_t dbytes = (int64_t)hidden / block_size(down.t) * type_bytes(down.t);
        for (int64_t j = 0; j < n_live; j++) {
            int64_t i = live[j];
            if (j + PREFETCH_ROWS < n_live) prefetch_row_l2(row_at(down, own0 + live[j + PREFETCH_ROWS], 0), dbytes);
            if (h[i] != 0.f) axpy_any(down.t, row_at(down, own0 + i, 0), h[i], y, hidden, fast);
        }
        return n_active;
    }
    if (fast) quantize_q8(h, (int)n_own, hq);
    matvec(down, NULL, 0, hidden, own0, (int)n_own, h, hq, fast, y);
    return n_active;
}

/* ffn_token for B tokens (x: B rows of hidden) in one pass over the shard's rows: each gate row
 * is read once for all B; a neuron's up row and down column are read when it is active for at
 * least one token (a neuron inactive for every token is skipped as ffn_token skips it). Per
 * token the same decisions and float operations as ffn_token, so a token gets the same output
 * alone or in a batch. thr: B thresholds (< 0: dense for that token) or NULL (all dense); mask
 * (a predictor's, over all n_ff neurons) is the same for every token. Scratch: h (B n_own),
 * any (n_own), xq (B hidden/32 blocks), hq (B ceil(n_own/32) blocks). counts[b]: token b's
 * active neurons; returns their sum. y: B rows of hidden. */
static int64_t ffn_batch_step(const ffn_call *c) {
    mat gate = c->gate, up = c->up, down = c->down;
    int down_t = c->down_t, hidden = c->hidden, act = c->act, B = c->B, fast = c->fast;
    int64_t own0 = c->own0, n_own = c->n_own, *counts = c->counts;
    const float *thr = c->thr, *x = c->x;
    const uint8_t *mask = c->mask;
    float *h = c->h, *y = c->y;
    uint8_t *any = c->any;
    q8blk *xq = c->xq, *hq = c->hq;
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int64_t ldq = hidden / QK, ldhq = (n_own + QK - 1) / QK, total = 0;
    if (fast)
        for (int b = 0; b < B; b++) quantize_q8(x + (int64_t)b * hidden, hidden, xq + b * ldq);
    int64_t gbytes = (int64_t)hidden / block_size(gate.t) * type_bytes(gate.t);
    int64_t ubytes = (int64_t)hidden / block_size(up.t) * type_bytes(up.t);
    float g[MAXB];
    int x16 = 0;
    if (is_x16(gate)) {
        int sparse = 0;
        for (int b = 0; thr && b < B; b++) sparse |= thr[b] >= 0.f;
        x16 = gate_x16(c, sparse);
        if (x16 < 0) return x16;
    }
    if (x16 == 1) {  /* dense, gate and up interleaved: h is complete */
        for (int b = 0; b < B; b++) counts[b] = n_own;
        if (n_own == 0) { memset(y, 0, sizeof(float) * hidden * B); return 0; }
        for (int b = 0; b < B; b++) quantize_q8(h + b * n_own, (int)n_own, hq + b * ldhq);
        matmul(down, NULL, 0, hidden, own0, (int)n_own, h, n_own, hq, ldhq, B, fast, y, hidden);
        return (int64_t)B * n_own;
    }
    const xpair *xp = is_x16(gate) ? NULL : pack_x(gate, xq, ldq, hidden, B, fast);  /* x16: gate x is in h */
    for (int b = 0; b < B; b++) counts[b] = 0;
    for (int64_t i = 0; i < n_own; i++) {  /* gate: who is active, per token */
        int64_t n = own0 + i;
        any[i] = 0;
        if (is_x16(gate))  /* gate_x16 left gate x in h */
            for (int b = 0; b < B; b++) g[b] = h[b * n_own + i];
        for (int b = 0; b < B; b++) h[b * n_own + i] = 0.f;
        if (mask) {
            if (i + PREFETCH_ROWS < n_own && mask[n + PREFETCH_ROWS]) prefetch_row(row_at(gate, n + PREFETCH_ROWS, 0), gbytes);
            if (!mask[n]) continue;
        }
        if (!is_x16(gate)) dots_any(gate, row_at(gate, n, 0), x, hidden, xq, ldq, xp, hidden, fast, B, B == 1, g, 1);
        for (int b = 0; b < B; b++) {
            float v = act == ACT_OAI ? oai_gate(g[b], c->bias[i], c->limit) : act_fn(act, g[b]);
            if (thr && thr[b] >= 0.f && !(fabsf(v) > thr[b])) continue;  /* sparsecore.ffn.is_active */
            h[b * n_own + i] = v;
            counts[b]++;
            if (v != 0.f) any[i] = 1;
        }
    }
    if (mode != ACT_NOGATE && !(xp && same_pack(up, gate))) xp = pack_x(up, xq, ldq, hidden, B, fast);  /* as ffn_token */
    for (int64_t i = 0; i < n_own && mode != ACT_NOGATE; i++) {  /* up, for neurons some token needs */
        if (i + PREFETCH_ROWS < n_own && any[i + PREFETCH_ROWS])
            prefetch_row(row_at(up, own0 + i + PREFETCH_ROWS, 0), ubytes);
        if (!any[i]) continue;
        dots_any(up, row_at(up, own0 + i, 0), x, hidden, xq, ldq, xp, hidden, fast, B, B == 1, g, 1);
        for (int b = 0; b < B; b++)
            if (h[b * n_own + i] != 0.f)
                h[b * n_own + i] *= act == ACT_OAI ? oai_up(g[b], c->bias[n_own + i], c->limit)
                                    : mode == ACT_SYM ? act_fn(act, g[b]) : g[b];
    }
    for (int b = 0; b < B; b++) total += counts[b];
    if (total == 0 || down_t) memset(y, 0, sizeof(float) * hidden * B);
    if (total == 0) return 0;
    if (down_t) {  /* an axpy per (active neuron, token); the row stays in cache across the tokens */
        int64_t dbytes = (int64_t)hidden / block_size(down.t) * type_bytes(down.t);
        for (int64_t i = 0; i < n_own; i++) {
            if (i + PREFETCH_ROWS < n_own && any[i + PREFETCH_ROWS])
                prefetch_row(row_at(down, own0 + i + PREFETCH_ROWS, 0), dbytes);
            if (!any[i]) continue;
            const uint8_t *w = row_at(down, own0 + i, 0);
            for (int b = 0; b < B; b++)
                if (h[b * n_own + i] != 0.f) axpy_any(down.t, w, h[b * n_own + i], y + (int64_t)b * hidden, hidden, fast);
        }
        return total;
    }
    if (fast)
        for (int b = 0; b < B; b++) quantize_q8(h + b * n_own, (int)n_own, hq + b * ldhq);
    matmul(down, NULL, 0, hidden, own0, (int)n_own, h, n_own, hq, ldhq, B, fast, y, hidden);
    for (int b = 0; b < B; b++)  /* as ffn_token: a token with nothing active gets exact zeros */
        if (counts[b] == 0) memset(y + (int64_t)b * hidden, 0, sizeof(float) * hidden);
    return total;
}

/* ACT_OAI's down bias (the record's, after gate's and up's) added to each of the B rows of y */
static void add_down_bias(const ffn_call *c, int B) {
    const float *bd = c->bias + 2 * c->n_own;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < c->hidden; j++) c->y[(int64_t)b * c->hidden + j] += bd[j];
}

/* THE hot function's entry (ffn_token_step), gpt-oss's down bias added (ACT_OAI) */
static int64_t ffn_token(const ffn_call *c) {
    int64_t n = ffn_token_step(c);
    if (n >= 0 && (c->act & ACT_MASK) == ACT_OAI) add_down_bias(c, 1);
    return n;
}

/* ffn_batch_step, gpt-oss's down bias added to every token's row (ACT_OAI) */
static int64_t ffn_batch(const ffn_call *c) {
    int64_t n = ffn_batch_step(c);
    if (n >= 0 && (c->act & ACT_MASK) == ACT_OAI) add_down_bias(c, c->B);
    return n;
}
