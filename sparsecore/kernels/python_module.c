/* _kernels.c, part: the Python module: the entry points' argument parsing, the method table, the
 * instruction-set level (set_isa) and the module's init. */

/* ---- Python entry points: pointers travel as integers, checked by the Python side ------------ */

/* A matrix as FileMatrix.args hands it over: (ptr, stride, type, layout, twin|0), MAT_ARGS values;
 * twin: the address of its input-major twin's header (cols_hdr) or 0 */
#define MAT_ARGS 5
/* whether m is a matrix the kernels take: its type, a layout that type takes, its twin's header */
static int check_mat(const mat *m) {
    if (!type_bytes(m->t) || !(m->layout == L_FILE || (m->layout == L_X16 && x16_type(m->t))
                               || (m->layout == L_R16 && r16_type(m->t)))) {
        PyErr_Format(PyExc_ValueError, "unsupported tensor type %d in layout %d", m->t, m->layout);
        return -1;
    }
    const cols_hdr *h = m->cols;
    if (h && ((h->magic != COLS_MAGIC && h->magic != COLS_MAGIC_FUSED) || h->t != m->t || !h->thr)) {
        PyErr_SetString(PyExc_ValueError, "not an input-major twin of this matrix");
        return -1;
    }
    return 0;
}

static int get_mat(PyObject *const *a, mat *m) {
    m->base = (const uint8_t *)PyLong_AsVoidPtr(a[0]);
    m->stride = PyLong_AsLongLong(a[1]);
    m->t = (int)PyLong_AsLong(a[2]);
    m->layout = (int)PyLong_AsLong(a[3]);
    m->cols = PyLong_AsVoidPtr(a[4]);
    if (PyErr_Occurred()) return -1;
    return check_mat(m);
}

#define ARG_PTR(i) PyLong_AsVoidPtr(args[i])
#define ARG_LL(i) PyLong_AsLongLong(args[i])

/* matvec(<mat: MAT_ARGS>, rows_ptr|0, start, n_rows, col0, n, x_ptr, fast, xq_ptr, y_ptr) */
static PyObject *py_matvec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != MAT_ARGS + 9) { PyErr_Format(PyExc_TypeError, "matvec takes %d arguments", MAT_ARGS + 9); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    args += MAT_ARGS;
    const int32_t *rows = ARG_PTR(0);
    int64_t start = ARG_LL(1), n_rows = ARG_LL(2), col0 = ARG_LL(3);
    int n = (int)ARG_LL(4);
    const float *x = ARG_PTR(5);
    int fast = (int)ARG_LL(6);
    q8blk *xq = ARG_PTR(7);
    float *y = ARG_PTR(8);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (fast && is_quant(m.t)) quantize_q8(x, n, xq);
    matvec(m, rows, start, n_rows, col0, n, x, xq, fast, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ffn_token, ffn_batch and moe_token take the address of one ffn_call record (ffn_step.c),
 * which the Python side fills by field name (sparsecore/kernels/ffn_call.py's FfnCall, whose
 * layout is checked at import against ffn_call_layout): no positional mirror of the fields.
 * The record is copied, so a call reads one snapshot of it and moe_token may change its copy's
 * matrices; its matrices are checked as FileMatrix.args are (check_mat). */
static int get_ffn_call(const char *name, PyObject *addr, ffn_call *c) {
    const ffn_call *rec = PyLong_AsVoidPtr(addr);
    if (!rec) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: no ffn_call record", name);
        return -1;
    }
    *c = *rec;
    if (check_mat(&c->gate) || check_mat(&c->up) || check_mat(&c->down)) return -1;
    if (c->B < 1 || c->B > MAXB) { PyErr_Format(PyExc_ValueError, "%s: %d tokens, at most %d", name, c->B, MAXB); return -1; }
    if ((c->act & ACT_MASK) == ACT_OAI && !c->bias) {
        PyErr_Format(PyExc_ValueError, "%s: gpt-oss's activation reads the experts' biases: none given", name);
        return -1;
    }
    return 0;
}

static PyObject *ffn_result(int64_t n) {
    if (n == -1) return PyErr_NoMemory();
    if (n == -2) {
        PyErr_SetString(PyExc_ValueError, "interleaved gate/up rows take dense fast-mode steps only");
        return NULL;
    }
    return PyLong_FromLongLong(n);
}

/* ffn_token(ffn_call_ptr) -> n_active: one token, B 1 */
static PyObject *py_ffn_token(PyObject *self, PyObject *rec) {
    ffn_call c;
    if (get_ffn_call("ffn_token", rec, &c)) return NULL;
    if (c.B != 1) { PyErr_SetString(PyExc_ValueError, "ffn_token: one token"); return NULL; }
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_token(&c);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* moe_route(<router: MAT_ARGS>, router_bias_ptr (E floats) | 0, x_ptr, hidden, E, k, flags (moe_step.c MOE_*),
 *           probs_ptr, ids_ptr (k int32), w_ptr (k float)) */
static PyObject *py_moe_route(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != MAT_ARGS + 9) { PyErr_Format(PyExc_TypeError, "moe_route takes %d arguments", MAT_ARGS + 9); return NULL; }
    mat r;
    if (get_mat(args, &r)) return NULL;
    args += MAT_ARGS;
    const float *bias = ARG_PTR(0), *x = ARG_PTR(1);
    int hidden = (int)ARG_LL(2), E = (int)ARG_LL(3), k = (int)ARG_LL(4), flags = (int)ARG_LL(5) & ~MOE_ROUTED;
    float *probs = ARG_PTR(6), *w = ARG_PTR(8);
    int32_t *ids = ARG_PTR(7);
    if (PyErr_Occurred()) return NULL;
    if (E < 1 || k < 1 || k > E) { PyErr_SetString(PyExc_ValueError, "moe_route: bad expert counts"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    moe_route(r, bias, x, hidden, E, k, flags, probs, ids, w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* moe_token's and moe_batch's first arguments: table_ptr (E x 3 mat records: each expert's gate,
 * up, down; an empty row, gate.base NULL, is another process's expert, skipped), E, k, flags
 * (moe_step.c MOE_*), <router: MAT_ARGS>, router_bias_ptr (E floats) | 0, probs_ptr (E floats),
 * ids_ptr and w_ptr (k per token), thr_ptr (E per-expert thresholds of a CATS step, or 0: the
 * record's for all), counts_ptr (E int64 counts of the chosen experts computed here, or 0),
 * ffn_call_ptr (a record whose matrices are any expert's: moe_token's with B 1, y the one-expert
 * scratch, its threshold < 0 dense or >= 0 CATS; moe_batch's with scratch for MAXB tokens) */
typedef struct {
    const mat *table;
    int E, k, flags;
    mat router;
    const float *router_bias;
    float *probs, *w;
    int32_t *ids;
    const float *thr_e;
    int64_t *counts;
    ffn_call c;
} moe_args;
#define MOE_HEAD_ARGS (4 + MAT_ARGS + 7)
static int get_moe_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t more, moe_args *m) {
    if (nargs != MOE_HEAD_ARGS + more) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments", name, (int)(MOE_HEAD_ARGS + more));
        return -1;
    }
    m->table = ARG_PTR(0);
    m->E = (int)ARG_LL(1), m->k = (int)ARG_LL(2), m->flags = (int)ARG_LL(3);
    if (PyErr_Occurred() || get_mat(args + 4, &m->router)) return -1;
    args += 4 + MAT_ARGS;
    m->router_bias = ARG_PTR(0), m->probs = ARG_PTR(1), m->ids = ARG_PTR(2), m->w = ARG_PTR(3), m->thr_e = ARG_PTR(4);
    m->counts = ARG_PTR(5);
    if (PyErr_Occurred() || get_ffn_call(name, args[6], &m->c)) return -1;
    if (m->E < 1 || m->k < 1 || m->k > m->E || m->k > MOE_MAX_K || m->c.mask || !m->table || !m->probs || !m->ids
        || !m->w) {
        PyErr_Format(PyExc_ValueError, "%s: 1 <= k <= min(E, %d), no mask, every buffer", name, MOE_MAX_K);
        return -1;
    }
    return 0;
}

/* moe_token(<moe_args>, out_ptr (hidden)) -> active neurons: moe_step.c moe_token */
static PyObject *py_moe_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    moe_args m;
    if (get_moe_args("moe_token", args, nargs, 1, &m)) return NULL;
    float *out = ARG_PTR(MOE_HEAD_ARGS);
    if (PyErr_Occurred()) return NULL;
    if (m.c.B != 1 || !out) {
        PyErr_SetString(PyExc_ValueError, "moe_token: one token, into an output");
        return NULL;
    }
    int64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = moe_token(m.table, m.E, m.k, m.flags, m.router, m.router_bias, m.probs, m.ids, m.w, m.thr_e, m.counts, &m.c,
                  out);
    Py_END_ALLOW_THREADS
    return ffn_result(n);
}

/* moe_batch(<moe_args>, x_ptr (B hidden), B, xg_ptr, yg_ptr (MAXB hidden each), parts_ptr (B k hidden),
 * out_ptr (B hidden)) -> active (neuron, token) pairs: moe_step.c moe_batch */
static PyObject *py_moe_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    moe_args m;
    if (get_moe_args("moe_batch", args, nargs, 6, &m)) return NULL;
    args += MOE_HEAD_ARGS;
    const float *x = ARG_PTR(0);
    int B = (int)ARG_LL(1);
    float *xg = ARG_PTR(2), *yg = ARG_PTR(3), *parts = ARG_PTR(4), *out = ARG_PTR(5);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB || !x || !xg || !yg || !parts || !out) {
        PyErr_Format(PyExc_ValueError, "moe_batch: 1..%d tokens, every buffer", MAXB);
        return NULL;
    }
    int64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = moe_batch(m.table, m.E, m.k, m.flags, m.router, m.router_bias, m.probs, m.ids, m.w, m.thr_e, m.counts, &m.c, x,
                  B, xg, yg, parts, out);
    Py_END_ALLOW_THREADS
    return ffn_result(n);
}

/* matmul(<mat: MAT_ARGS>, rows_ptr|0, start, n_rows, col0, n, x_ptr, ldx, B, fast, xq_ptr, y_ptr, ldy):
 * xq: room for B (n/32 rounded up) q8 blocks */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != MAT_ARGS + 12) { PyErr_Format(PyExc_TypeError, "matmul takes %d arguments", MAT_ARGS + 12); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    args += MAT_ARGS;
    const int32_t *rows = ARG_PTR(0);
    int64_t start = ARG_LL(1), n_rows = ARG_LL(2), col0 = ARG_LL(3);
    int n = (int)ARG_LL(4);
    const float *x = ARG_PTR(5);
    int64_t ldx = ARG_LL(6);
    int B = (int)ARG_LL(7), fast = (int)ARG_LL(8);
    q8blk *xq = ARG_PTR(9);
    float *y = ARG_PTR(10);
    int64_t ldy = ARG_LL(11);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "matmul: %d tokens, at most %d", B, MAXB); return NULL; }
    int64_t ldq = (n + QK - 1) / QK;
    Py_BEGIN_ALLOW_THREADS
    if (fast && is_quant(m.t))
        for (int b = 0; b < B; b++) quantize_q8(x + b * ldx, n, xq + b * ldq);
    matmul(m, rows, start, n_rows, col0, n, x, ldx, xq, ldq, B, fast, y, ldy);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ffn_batch(ffn_call_ptr) -> active (neuron, token) pairs */
static PyObject *py_ffn_batch(PyObject *self, PyObject *rec) {
    ffn_call c;
    if (get_ffn_call("ffn_batch", rec, &c)) return NULL;
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_batch(&c);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* dequant(<mat: MAT_ARGS>, rows_ptr|0, start, n_rows, col0, n, out_ptr) */
static PyObject *py_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != MAT_ARGS + 6) { PyErr_Format(PyExc_TypeError, "dequant takes %d arguments", MAT_ARGS + 6); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    args += MAT_ARGS;
    const int32_t *rows = ARG_PTR(0);
    int64_t start = ARG_LL(1), n_rows = ARG_LL(2), col0 = ARG_LL(3);
    int n = (int)ARG_LL(4);
    float *out = ARG_PTR(5);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dequant_rows(m, rows, start, n_rows, col0, n, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* quantize_q8(x_ptr, n, out_ptr): fast mode's 8-bit activation blocks, for the tests */
static PyObject *py_quantize_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "quantize_q8 takes 3 arguments"); return NULL; }
    const float *x = ARG_PTR(0);
    int n = (int)ARG_LL(1);
    q8blk *out = ARG_PTR(2);
    if (PyErr_Occurred()) return NULL;
    quantize_q8(x, n, out);
    Py_RETURN_NONE;
}

/* residual_norm(h, parts, n_parts, n, B, w, wb, eps, x, post, scale): per row b, h[b] += (parts[0][b] +
 * parts[1][b] + ...), summed in the order given, through the output norm `post` and times
 * `scale` where given (0: none: add_shares), then x[b] = norm(h[b]) with weights w: RMSNorm, or
 * a LayerNorm where wb (its bias) is given (w == 0: no norm).
 * The lockstep decode (sparsecore/lockstep.py) runs this in every process on the same shares in
 * the same order, so each gets the same floats without sending its residual to the others. */
static PyObject *py_residual_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) { PyErr_SetString(PyExc_TypeError, "residual_norm takes 11 arguments"); return NULL; }
    float *h = ARG_PTR(0);
    const float *const *parts = ARG_PTR(1);
    int n_parts = (int)ARG_LL(2), n = (int)ARG_LL(3), B = (int)ARG_LL(4);
    const float *w = ARG_PTR(5), *wb = ARG_PTR(6);
    float eps = (float)PyFloat_AsDouble(args[7]);
    float *x = ARG_PTR(8);
    const float *post = ARG_PTR(9);
    float scale = (float)PyFloat_AsDouble(args[10]);
    if (PyErr_Occurred()) return NULL;
    if (n_parts < 0 || n < 1 || B < 1) { PyErr_SetString(PyExc_ValueError, "residual_norm: empty"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    if (n_parts > 0) add_shares(h, parts, n_parts, n, B, post, eps, scale);  /* none: the norm alone (kernels.norm_rows) */
    if (w)
        for (int b = 0; b < B; b++) norm_into(h + (int64_t)b * n, w, wb, eps, n, x + (int64_t)b * n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ffn_call_layout() -> {"size": sizeof(ffn_call), field: offset, ..., "mat": {"size": sizeof(mat),
 * field: offset, ...}}: what sparsecore/kernels/ffn_call.py's FfnCall and Mat must match, by name */
#define OFF(s, f) #f, (Py_ssize_t)offsetof(s, f)
static PyObject *py_ffn_call_layout(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *m = Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n}", "size", (Py_ssize_t)sizeof(mat), OFF(mat, base),
                                OFF(mat, stride), OFF(mat, t), OFF(mat, layout), OFF(mat, cols));
    if (!m) return NULL;
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:N}",
                         "size", (Py_ssize_t)sizeof(ffn_call), OFF(ffn_call, gate), OFF(ffn_call, up),
                         OFF(ffn_call, down), OFF(ffn_call, down_t), OFF(ffn_call, hidden), OFF(ffn_call, own0),
                         OFF(ffn_call, n_own), OFF(ffn_call, act), OFF(ffn_call, threshold), OFF(ffn_call, thr),
                         OFF(ffn_call, mask), OFF(ffn_call, x), OFF(ffn_call, B), OFF(ffn_call, fast),
                         OFF(ffn_call, h), OFF(ffn_call, any), OFF(ffn_call, xq), OFF(ffn_call, hq),
                         OFF(ffn_call, counts), OFF(ffn_call, y), OFF(ffn_call, bias), OFF(ffn_call, limit), "mat", m);
}
#undef OFF

/* attn_extra_layout() -> (sizeof(attn_extra), offsets of bias, q_norm, k_norm, post_norm,
 * norm_bias, scale, out_scale, window, qk_norm_full, sinks, out_bias): what sparsecore/kernels/attention.py's
 * ATTN_EXTRA must match */
static PyObject *py_attn_extra_layout(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return Py_BuildValue("(nnnnnnnnnnnn)", (Py_ssize_t)sizeof(attn_extra), (Py_ssize_t)offsetof(attn_extra, bias),
                         (Py_ssize_t)offsetof(attn_extra, q_norm), (Py_ssize_t)offsetof(attn_extra, k_norm),
                         (Py_ssize_t)offsetof(attn_extra, post_norm), (Py_ssize_t)offsetof(attn_extra, norm_bias),
                         (Py_ssize_t)offsetof(attn_extra, scale), (Py_ssize_t)offsetof(attn_extra, out_scale),
                         (Py_ssize_t)offsetof(attn_extra, window), (Py_ssize_t)offsetof(attn_extra, qk_norm_full),
                         (Py_ssize_t)offsetof(attn_extra, sinks), (Py_ssize_t)offsetof(attn_extra, out_bias));
}

/* interleave(src_ptr, stride, type, rows, n_blocks, dst_ptr): dst holds ceil(rows / 16) groups of
 * n_blocks blocks of 16 rows (x16_type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q6_K, IQ4_XS);
 * interleave_blocks, the same
 * arguments: dst holds the rows, each row's blocks in runs of 16 (Q4_0, Q4_1 or Q8_0) */
static PyObject *repack(PyObject *const *args, Py_ssize_t nargs, int blocks) {
    const char *name = blocks ? "interleave_blocks" : "interleave";
    if (nargs != 6) { PyErr_Format(PyExc_TypeError, "%s takes 6 arguments", name); return NULL; }
    const uint8_t *src = ARG_PTR(0);
    int64_t stride = ARG_LL(1), rows = ARG_LL(3);
    int t = (int)ARG_LL(2), nb = (int)ARG_LL(4);
    uint8_t *dst = ARG_PTR(5);
    if (PyErr_Occurred()) return NULL;
    if (!(blocks ? r16_type(t) : x16_type(t))) {
        PyErr_Format(PyExc_ValueError, "%s: %s only", name, blocks ? "Q4_0, Q4_1 or Q8_0" : "Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q2_K or Q3_K");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (blocks) interleave_blocks(t, src, stride, rows, nb, dst);
    else interleave(t, src, stride, rows, nb, dst);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
static PyObject *py_interleave(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return repack(args, nargs, 0); }
static PyObject *py_interleave_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return repack(args, nargs, 1); }

/* cols_bytes(type, R, C) -> the bytes of an input-major twin's data (its 64-byte header apart),
 * or 0 for a type without L_COLS products */
static PyObject *py_cols_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cols_bytes takes 3 arguments"); return NULL; }
    int t = (int)ARG_LL(0);
    int64_t R = ARG_LL(1), C = ARG_LL(2);
    if (PyErr_Occurred()) return NULL;
    if (kq_type(t)) return PyLong_FromLongLong(R > 0 && C > 0 && C % kq_inputs(t) == 0 ? kq_bytes(t, R, C) : 0);
    return PyLong_FromLongLong(cols_type(t) && R > 0 && C > 0 && C % QK == 0 ? cols_bytes(t, R, C) : 0);
}

/* skip_strings(buf_ptr, pos, size, count, big_endian): where GGUF's `count` strings (each a u64
 * length, then its bytes) that start at buf[pos] end, or -1 - (the offset of the first one that
 * does not fit in `size` bytes): a vocabulary is 32k-256k strings, which a Python loop walked at
 * 0.3 us each, in every process that opens the file (sparsecore/gguf_check.py) */
static PyObject *py_skip_strings(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "skip_strings takes 5 arguments"); return NULL; }
    const uint8_t *buf = ARG_PTR(0);
    int64_t pos = ARG_LL(1), size = ARG_LL(2), count = ARG_LL(3), big = ARG_LL(4);
    if (PyErr_Occurred()) return NULL;
    for (int64_t i = 0; i < count; i++) {
        if (pos < 0 || size - pos < 8) return PyLong_FromLongLong(-1 - pos);
        uint64_t n;
        memcpy(&n, buf + pos, 8);
        if (big) n = __builtin_bswap64(n);
        if (n > (uint64_t)(size - pos - 8)) return PyLong_FromLongLong(-1 - pos);
        pos += 8 + (int64_t)n;
    }
    return PyLong_FromLongLong(pos);
}

/* cols_repack(src_ptr, stride, type, r0, R, c0, C, thr_ptr, dst_ptr[, fused_r0]): the twin of the
 * file's rows at src (row 0, column 0) into dst (64-byte aligned: the header, then cols_bytes).
 * With fused_r0: a fused twin (COLS_MAGIC_FUSED) of the rows at src, which the caller stacked
 * (the parts' rows, one after the other), labelled with r0 = fused_r0 (its first part's row) */
static PyObject *py_cols_repack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 && nargs != 10) { PyErr_SetString(PyExc_TypeError, "cols_repack takes 9 or 10 arguments"); return NULL; }
    const uint8_t *src = ARG_PTR(0);
    int64_t stride = ARG_LL(1), r0 = ARG_LL(3), R = ARG_LL(4), c0 = ARG_LL(5), C = ARG_LL(6);
    int t = (int)ARG_LL(2);
    const float *thr = ARG_PTR(7);
    uint8_t *dst = ARG_PTR(8);
    if (PyErr_Occurred()) return NULL;
    int gi = kq_type(t) ? kq_inputs(t) : QK;  /* inputs per group: the twin's columns are whole groups */
    if (!(cols_type(t) || kq_type(t)) || R <= 0 || C <= 0 || C % gi || c0 % gi || !thr || ((uintptr_t)dst & 63)) {
        PyErr_SetString(PyExc_ValueError, "cols_repack: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K, whole blocks, "
                                          "a threshold, dst aligned");
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = kq_type(t) ? kq_repack(t, src, stride, r0, R, c0, C, thr, dst) : cols_repack(t, src, stride, r0, R, c0, C, thr, dst);
    Py_END_ALLOW_THREADS
    if (err) return PyErr_NoMemory();
    if (nargs == 10) {  /* every twin type fuses (formats.FUSED_TYPES): rows stacked, each computed alone */
        int64_t label = ARG_LL(9);
        if (PyErr_Occurred()) return NULL;
        cols_hdr *h = (cols_hdr *)dst;
        h->magic = COLS_MAGIC_FUSED, h->r0 = label;
    }
    Py_RETURN_NONE;
}

/* cols_dequant(hdr_ptr, out_ptr): the twin's values as float32 (R x C), for the tests */
static PyObject *py_cols_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "cols_dequant takes 2 arguments"); return NULL; }
    const cols_hdr *h = ARG_PTR(0);
    float *out = ARG_PTR(1);
    if (PyErr_Occurred()) return NULL;
    if (!h || (h->magic != COLS_MAGIC && h->magic != COLS_MAGIC_FUSED)) {
        PyErr_SetString(PyExc_ValueError, "not a twin");
        return NULL;
    }
    if (kq_type(h->t)) kq_dequant(h, out);
    else cols_dequant(h, out);
    Py_RETURN_NONE;
}

/* cols_sizes(type, R) -> (inputs per group, bytes of one active input's channel row, bytes of a
 * group's head: its rows' scales), or None for a type without twin products */
static PyObject *py_cols_sizes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "cols_sizes takes 2 arguments"); return NULL; }
    int t = (int)ARG_LL(0);
    int64_t R = ARG_LL(1);
    if (PyErr_Occurred()) return NULL;
    if (kq_type(t)) return Py_BuildValue("(iLL)", kq_inputs(t), (long long)kq_chan_bytes(t, kq_rp(R)), (long long)kq_head_bytes(t, kq_rp(R)));
    if (cols_type(t)) return Py_BuildValue("(iLL)", QK, (long long)cols_chan_bytes(t, cols_rp(t, R)), (long long)cols_head_bytes(t, cols_rp(t, R)));
    Py_RETURN_NONE;
}

/* cols_tune(ahead, hint) -> the previous (ahead, hint): the twins' prefetch distance in (group,
 * line) items (0: none) and where to (3: L1, 2: L2), for scripts/bench_input_major.py */
static PyObject *py_cols_tune(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "cols_tune takes 2 arguments"); return NULL; }
    int ahead = (int)ARG_LL(0), hint = (int)ARG_LL(1);
    if (PyErr_Occurred()) return NULL;
    PyObject *old = Py_BuildValue("(ii)", cols_ahead, cols_hint);
    if (ahead >= 0) cols_ahead = ahead;
    if (hint == 2 || hint == 3) cols_hint = hint;
    return old;
}

/* base.c's level flags and cols_generic.c's prefetch settings, one copy for every compilation unit */
int use_avx2 = 0, use_vnni = 0, use_vbmi = 0, use_dp256 = 0;
int cols_ahead = 16, cols_hint = 2;

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(use_vnni ? "avx512vnni" : use_dp256 ? "avxvnni" : use_avx2 ? "avx2" : "generic");
}

#if HAVE_X86
static int cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static int cpu_vnni(void) {  /* everything the VNNI target attribute enables */
    return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}
/* the 256-bit vpdpbusd of level "avxvnni": 1 VEX (AVX-VNNI), 2 its EVEX form (AVX-512 VNNI CPUs), 0 none */
static int cpu_dp256(void) {
    if (cpu_avx2() && __builtin_cpu_supports("avxvnni")) return 1;
    return cpu_vnni() ? 2 : 0;
}
#endif

/* "avx512vnni" (fast mode's integer dots with VNNI, AVX2 elsewhere), "avxvnni" (the interleaved
 * layouts' sums with 256-bit vpdpbusd, AVX2 elsewhere), "avx2" or "generic" (the portable path),
 * each where the CPU has it, else the next one down */
static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s) return NULL;
#if HAVE_X86
    int vnni = strcmp(s, "avx512vnni") == 0, dp = vnni || strcmp(s, "avxvnni") == 0;
    use_vnni = vnni && cpu_vnni();
    use_vbmi = use_vnni && __builtin_cpu_supports("avx512vbmi");
    use_dp256 = !use_vnni && dp ? cpu_dp256() : 0;
    use_avx2 = (dp || strcmp(s, "avx2") == 0) && cpu_avx2();
#endif
    fill_kernels();  /* the products' kernels at the level now in use */
    return py_isa(self, NULL);
}

/* The attention layer's arguments attn_token and attn_batch share, args[0..ATTN_ARGS):
 * q(MAT_ARGS), q_rows, k(MAT_ARGS), k_rows, v(MAT_ARGS), o(MAT_ARGS), norm_w, eps, hidden, n_heads,
 * n_kv, hd, d, extra_ptr (an attn_extra record), cos_ptr, sin_ptr */
#define ATTN_ARGS (4 * MAT_ARGS + 12)
typedef struct {
    mat wq, wk, wv, wo;
    const int32_t *q_rows, *k_rows;
    const attn_extra *ex;
    const float *norm_w, *cos_r, *sin_r;
    float eps;
    int hidden, n_heads, n_kv, hd, d;
} attn_layer;

static int get_attn_layer(PyObject *const *args, attn_layer *L) {
    const int K = MAT_ARGS + 1;  /* a matrix and its row order */
    if (get_mat(args, &L->wq) || get_mat(args + K, &L->wk) || get_mat(args + 2 * K, &L->wv)
        || get_mat(args + 2 * K + MAT_ARGS, &L->wo))
        return -1;
    L->q_rows = ARG_PTR(MAT_ARGS), L->k_rows = ARG_PTR(K + MAT_ARGS);
    args += 4 * MAT_ARGS + 2;
    L->norm_w = ARG_PTR(0);
    L->eps = (float)PyFloat_AsDouble(args[1]);
    L->hidden = (int)ARG_LL(2), L->n_heads = (int)ARG_LL(3), L->n_kv = (int)ARG_LL(4);
    L->hd = (int)ARG_LL(5), L->d = (int)ARG_LL(6);
    L->ex = ARG_PTR(7);
    L->cos_r = ARG_PTR(8), L->sin_r = ARG_PTR(9);
    if (PyErr_Occurred()) return -1;
    if (!L->ex) L->ex = &NO_EXTRA;
    if (L->d > 1024 || L->d > L->hd || L->n_kv <= 0 || L->n_heads % L->n_kv) {
        PyErr_SetString(PyExc_ValueError, "attention: bad head or rope arguments");
        return -1;
    }
    return 0;
}

/* attn_token(<attn layer: ATTN_ARGS>, pos, k_cache_ptr, v_cache_ptr, max_ctx, fast,
 *            x, q, k, v, att, out, xq, oq, h): ATTN_ARGS + 14 arguments; cos/sin: the whole tables */
static PyObject *py_attn_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != ATTN_ARGS + 14) { PyErr_Format(PyExc_TypeError, "attn_token takes %d arguments", ATTN_ARGS + 14); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    args += ATTN_ARGS;
    int pos = (int)ARG_LL(0);
    float *kc = ARG_PTR(1), *vc = ARG_PTR(2);
    int max_ctx = (int)ARG_LL(3), fast = (int)ARG_LL(4);
    attn_scratch sc = {ARG_PTR(5), ARG_PTR(6), ARG_PTR(7), ARG_PTR(8), ARG_PTR(9), ARG_PTR(10), ARG_PTR(11), ARG_PTR(12)};
    float *h = ARG_PTR(13);
    if (PyErr_Occurred()) return NULL;
    if (pos < 0 || pos >= max_ctx) { PyErr_SetString(PyExc_ValueError, "attn_token: position outside the cache"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    attn_token(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
               L.ex, L.cos_r, L.sin_r, pos, kc, vc, max_ctx, fast, sc, h);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_batch(<attn layer: ATTN_ARGS, cos/sin: the whole tables>, B, pos_ptr (B int64), k_cache_ptrs (B int64),
 *            v_cache_ptrs, max_ctx, fast, x, q, k, v, att, out, xq, oq, h): ATTN_ARGS + 15 arguments */
static PyObject *py_attn_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != ATTN_ARGS + 15) { PyErr_Format(PyExc_TypeError, "attn_batch takes %d arguments", ATTN_ARGS + 15); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    args += ATTN_ARGS;
    int B = (int)ARG_LL(0);
    const int64_t *pos = ARG_PTR(1);
    float *const *kcs = ARG_PTR(2), *const *vcs = ARG_PTR(3);
    int max_ctx = (int)ARG_LL(4), fast = (int)ARG_LL(5);
    attn_scratch sc = {ARG_PTR(6), ARG_PTR(7), ARG_PTR(8), ARG_PTR(9), ARG_PTR(10), ARG_PTR(11), ARG_PTR(12), ARG_PTR(13)};
    float *h = ARG_PTR(14);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "attn_batch: %d tokens, at most %d", B, MAXB); return NULL; }
    for (int b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_ctx) {
            PyErr_SetString(PyExc_ValueError, "attn_batch: a position outside the cache");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    attn_batch(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
               L.ex, L.cos_r, L.sin_r, B, pos, kcs, vcs, max_ctx, fast, sc, h);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_part(<attn_batch's arguments, h read only>, h0, h1 (query heads), part_ptr (B x hidden)): ATTN_ARGS + 18 arguments */
static PyObject *py_attn_part(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != ATTN_ARGS + 18) { PyErr_Format(PyExc_TypeError, "attn_part takes %d arguments", ATTN_ARGS + 18); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    args += ATTN_ARGS;
    int B = (int)ARG_LL(0);
    const int64_t *pos = ARG_PTR(1);
    float *const *kcs = ARG_PTR(2), *const *vcs = ARG_PTR(3);
    int max_ctx = (int)ARG_LL(4), fast = (int)ARG_LL(5);
    attn_scratch sc = {ARG_PTR(6), ARG_PTR(7), ARG_PTR(8), ARG_PTR(9), ARG_PTR(10), ARG_PTR(11), ARG_PTR(12), ARG_PTR(13)};
    const float *h = ARG_PTR(14);
    int h0 = (int)ARG_LL(15), h1 = (int)ARG_LL(16);
    float *part = ARG_PTR(17);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "attn_part: %d tokens, at most %d", B, MAXB); return NULL; }
    if (h0 < 0 || h1 <= h0 || h1 > L.n_heads || ((int64_t)h0 * L.hd) % block_size(L.wo.t)
        || ((int64_t)(h1 - h0) * L.hd) % block_size(L.wo.t)) {
        PyErr_SetString(PyExc_ValueError, "attn_part: head range outside the layer or off the output's blocks");
        return NULL;
    }
    for (int b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_ctx) {
            PyErr_SetString(PyExc_ValueError, "attn_part: a position outside the cache");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    attn_part(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
              L.ex, L.cos_r, L.sin_r, B, pos, kcs, vcs, max_ctx, fast, sc, h, h0, h1, part);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attn_token", (PyCFunction)(void (*)(void))py_attn_token, METH_FASTCALL, "one token's attention block"},
    {"attn_batch", (PyCFunction)(void (*)(void))py_attn_batch, METH_FASTCALL, "a small batch's attention blocks"},
    {"attn_part", (PyCFunction)(void (*)(void))py_attn_part, METH_FASTCALL, "some heads' share of attention"},
    {"matvec", (PyCFunction)(void (*)(void))py_matvec, METH_FASTCALL, "rows . x in the file's blocks"},
    {"ffn_token", py_ffn_token, METH_O, "one token's partial FFN (an ffn_call record's address)"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "rows . x for a small batch of tokens"},
    {"ffn_batch", py_ffn_batch, METH_O, "a small batch's partial FFN (an ffn_call record's address)"},
    {"moe_route", (PyCFunction)(void (*)(void))py_moe_route, METH_FASTCALL, "a token's experts and weights"},
    {"moe_token", (PyCFunction)(void (*)(void))py_moe_token, METH_FASTCALL, "a token's share of its experts"},
    {"moe_batch", (PyCFunction)(void (*)(void))py_moe_batch, METH_FASTCALL, "a small batch's shares of their experts, grouped by expert"},
    {"dequant", (PyCFunction)(void (*)(void))py_dequant, METH_FASTCALL, "rows as float32"},
    {"interleave", (PyCFunction)(void (*)(void))py_interleave, METH_FASTCALL, "rows of the X16 types, 16 side by side"},
    {"interleave_blocks", (PyCFunction)(void (*)(void))py_interleave_blocks, METH_FASTCALL, "each row's blocks, 16 side by side"},
    {"quantize_q8", (PyCFunction)(void (*)(void))py_quantize_q8, METH_FASTCALL, "8-bit activation blocks"},
    {"residual_norm", (PyCFunction)(void (*)(void))py_residual_norm, METH_FASTCALL, "h += shares; x = norm(h)"},
    {"ffn_call_layout", py_ffn_call_layout, METH_NOARGS, "the FFN call's record layout, by field"},
    {"attn_extra_layout", py_attn_extra_layout, METH_NOARGS, "the attention variants' record layout"},
    {"cols_bytes", (PyCFunction)(void (*)(void))py_cols_bytes, METH_FASTCALL, "an input-major twin's bytes"},
    {"skip_strings", (PyCFunction)(void (*)(void))py_skip_strings, METH_FASTCALL, "where a GGUF string array ends"},
    {"cols_repack", (PyCFunction)(void (*)(void))py_cols_repack, METH_FASTCALL, "a sub-matrix's input-major twin"},
    {"cols_dequant", (PyCFunction)(void (*)(void))py_cols_dequant, METH_FASTCALL, "a twin's values as float32"},
    {"cols_sizes", (PyCFunction)(void (*)(void))py_cols_sizes, METH_FASTCALL, "a twin's group, channel and head bytes"},
    {"cols_tune", (PyCFunction)(void (*)(void))py_cols_tune, METH_FASTCALL, "the twins' prefetch distance and level"},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"set_isa", py_set_isa, METH_O, "use 'avx512vnni', 'avxvnni' or 'avx2' (where supported) or 'generic'"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#if HAVE_X86
    use_avx2 = cpu_avx2();
    use_vnni = cpu_vnni();
    use_vbmi = use_vnni && __builtin_cpu_supports("avx512vbmi");
    use_dp256 = !use_vnni && cpu_dp256() == 1;  /* the best level: AVX-VNNI's own encoding only */
#endif
    fill_kernels();
    return PyModule_Create(&module);
}
