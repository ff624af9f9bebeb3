/* _kernels.c, part: the Python module: the entry points' argument parsing, the method table, the
 * instruction-set level (set_isa) and the module's init. */

/* ---- Python entry points: pointers travel as integers, checked by the Python side ------------ */

/* A matrix as FileMatrix.args hands it over: (ptr, stride, type, layout), MAT_ARGS values */
#define MAT_ARGS 4
static int get_mat(PyObject *const *a, mat *m) {
    m->base = (const uint8_t *)PyLong_AsVoidPtr(a[0]);
    m->stride = PyLong_AsLongLong(a[1]);
    m->t = (int)PyLong_AsLong(a[2]);
    m->layout = (int)PyLong_AsLong(a[3]);
    if (PyErr_Occurred()) return -1;
    if (!type_bytes(m->t) || !(m->layout == L_FILE || (m->layout == L_X16 && x16_type(m->t))
                               || (m->layout == L_R16 && r16_type(m->t)))) {
        PyErr_Format(PyExc_ValueError, "unsupported tensor type %d in layout %d", m->t, m->layout);
        return -1;
    }
    return 0;
}

#define ARG_PTR(i) PyLong_AsVoidPtr(args[i])
#define ARG_LL(i) PyLong_AsLongLong(args[i])

/* matvec(ptr, stride, type, layout, rows_ptr|0, start, n_rows, col0, n, x_ptr, fast, xq_ptr, y_ptr) */
static PyObject *py_matvec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) { PyErr_SetString(PyExc_TypeError, "matvec takes 13 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(4);
    int64_t start = ARG_LL(5), n_rows = ARG_LL(6), col0 = ARG_LL(7);
    int n = (int)ARG_LL(8);
    const float *x = ARG_PTR(9);
    int fast = (int)ARG_LL(10);
    q8blk *xq = ARG_PTR(11);
    float *y = ARG_PTR(12);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (fast && is_quant(m.t)) quantize_q8(x, n, xq);
    matvec(m, rows, start, n_rows, col0, n, x, xq, fast, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ffn_token and ffn_batch take the same FFN_ARGS arguments, read into one ffn_call:
 *   gate(4), up(4), down(4), down_t, hidden, own0, n_own, act, threshold, thr_ptr|0, mask_ptr|0,
 *   x_ptr, B, fast, h_ptr, any_ptr|0, xq_ptr, hq_ptr, counts_ptr|0, y_ptr
 * ffn_token reads threshold and one token (B 1), ffn_batch thr, any and counts (ffn_step.c's
 * ffn_call says what each is). */
#define FFN_ARGS 29
static int get_ffn_call(const char *name, PyObject *const *args, Py_ssize_t nargs, ffn_call *c) {
    if (nargs != FFN_ARGS) { PyErr_Format(PyExc_TypeError, "%s takes %d arguments", name, FFN_ARGS); return -1; }
    if (get_mat(args, &c->gate) || get_mat(args + MAT_ARGS, &c->up) || get_mat(args + 2 * MAT_ARGS, &c->down)) return -1;
    args += 3 * MAT_ARGS;
    c->down_t = (int)ARG_LL(0), c->hidden = (int)ARG_LL(1);
    c->own0 = ARG_LL(2), c->n_own = ARG_LL(3);
    c->act = (int)ARG_LL(4);
    c->threshold = (float)PyFloat_AsDouble(args[5]);
    c->thr = ARG_PTR(6);
    c->mask = ARG_PTR(7);
    c->x = ARG_PTR(8);
    c->B = (int)ARG_LL(9), c->fast = (int)ARG_LL(10);
    c->h = ARG_PTR(11);
    c->any = ARG_PTR(12);
    c->xq = ARG_PTR(13), c->hq = ARG_PTR(14);
    c->counts = ARG_PTR(15);
    c->y = ARG_PTR(16);
    if (PyErr_Occurred()) return -1;
    if (c->B < 1 || c->B > MAXB) { PyErr_Format(PyExc_ValueError, "%s: %d tokens, at most %d", name, c->B, MAXB); return -1; }
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

/* ffn_token(<FFN_ARGS>) -> n_active: one token, B 1 */
static PyObject *py_ffn_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ffn_call c;
    if (get_ffn_call("ffn_token", args, nargs, &c)) return NULL;
    if (c.B != 1) { PyErr_SetString(PyExc_ValueError, "ffn_token: one token"); return NULL; }
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_token(&c);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* matmul(ptr, stride, type, layout, rows_ptr|0, start, n_rows, col0, n, x_ptr, ldx, B, fast, xq_ptr, y_ptr, ldy):
 * xq: room for B (n/32 rounded up) q8 blocks */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 16) { PyErr_SetString(PyExc_TypeError, "matmul takes 16 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(4);
    int64_t start = ARG_LL(5), n_rows = ARG_LL(6), col0 = ARG_LL(7);
    int n = (int)ARG_LL(8);
    const float *x = ARG_PTR(9);
    int64_t ldx = ARG_LL(10);
    int B = (int)ARG_LL(11), fast = (int)ARG_LL(12);
    q8blk *xq = ARG_PTR(13);
    float *y = ARG_PTR(14);
    int64_t ldy = ARG_LL(15);
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

/* ffn_batch(<FFN_ARGS>) -> active (neuron, token) pairs */
static PyObject *py_ffn_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ffn_call c;
    if (get_ffn_call("ffn_batch", args, nargs, &c)) return NULL;
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_batch(&c);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* dequant(ptr, stride, type, layout, rows_ptr|0, start, n_rows, col0, n, out_ptr) */
static PyObject *py_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) { PyErr_SetString(PyExc_TypeError, "dequant takes 10 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(4);
    int64_t start = ARG_LL(5), n_rows = ARG_LL(6), col0 = ARG_LL(7);
    int n = (int)ARG_LL(8);
    float *out = ARG_PTR(9);
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

/* residual_norm(h, parts, n_parts, n, B, w, eps, x): per row b, h[b] += (parts[0][b] + parts[1][b]
 * + ...), summed in the order given, then x[b] = rms_norm(h[b]) * w (w == 0: no norm). The
 * lockstep decode (sparsecore/lockstep.py) runs this in every process on the same shares in
 * the same order, so each gets the same floats without sending its residual to the others. */
static PyObject *py_residual_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) { PyErr_SetString(PyExc_TypeError, "residual_norm takes 8 arguments"); return NULL; }
    float *h = ARG_PTR(0);
    const float *const *parts = ARG_PTR(1);
    int n_parts = (int)ARG_LL(2), n = (int)ARG_LL(3), B = (int)ARG_LL(4);
    const float *w = ARG_PTR(5);
    float eps = (float)PyFloat_AsDouble(args[6]);
    float *x = ARG_PTR(7);
    if (PyErr_Occurred()) return NULL;
    if (n_parts < 0 || n < 1 || B < 1) { PyErr_SetString(PyExc_ValueError, "residual_norm: empty"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    for (int b = 0; b < B; b++) {
        float *hb = h + (int64_t)b * n;
        const int64_t off = (int64_t)b * n;
        for (int i = 0; i < n && n_parts > 0; i++) {  /* no parts: the norm alone (kernels.rms_norm) */
            float acc = parts[0][off + i];
            for (int p = 1; p < n_parts; p++) acc += parts[p][off + i];
            hb[i] += acc;
        }
        if (w) rms_norm_into(hb, w, eps, n, x + off);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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
    return py_isa(self, NULL);
}

/* The attention layer's arguments attn_token and attn_batch share, args[0..26]:
 * q(4), q_rows, k(4), k_rows, v(4), o(4), norm_w, eps, hidden, n_heads, n_kv, hd, d, cos_ptr, sin_ptr */
typedef struct {
    mat wq, wk, wv, wo;
    const int32_t *q_rows, *k_rows;
    const float *norm_w, *cos_r, *sin_r;
    float eps;
    int hidden, n_heads, n_kv, hd, d;
} attn_layer;

static int get_attn_layer(PyObject *const *args, attn_layer *L) {
    if (get_mat(args, &L->wq) || get_mat(args + 5, &L->wk) || get_mat(args + 10, &L->wv) || get_mat(args + 14, &L->wo))
        return -1;
    L->q_rows = ARG_PTR(4), L->k_rows = ARG_PTR(9);
    L->norm_w = ARG_PTR(18);
    L->eps = (float)PyFloat_AsDouble(args[19]);
    L->hidden = (int)ARG_LL(20), L->n_heads = (int)ARG_LL(21), L->n_kv = (int)ARG_LL(22);
    L->hd = (int)ARG_LL(23), L->d = (int)ARG_LL(24);
    L->cos_r = ARG_PTR(25), L->sin_r = ARG_PTR(26);
    if (PyErr_Occurred()) return -1;
    if (L->d > 1024 || L->d > L->hd || L->n_kv <= 0 || L->n_heads % L->n_kv) {
        PyErr_SetString(PyExc_ValueError, "attention: bad head or rope arguments");
        return -1;
    }
    return 0;
}

/* attn_token(<attn layer: 27>, pos, k_cache_ptr, v_cache_ptr, max_ctx, fast,
 *            x, q, k, v, att, out, xq, oq, h): 41 arguments; cos/sin: the whole tables */
static PyObject *py_attn_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 41) { PyErr_SetString(PyExc_TypeError, "attn_token takes 41 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int pos = (int)ARG_LL(27);
    float *kc = ARG_PTR(28), *vc = ARG_PTR(29);
    int max_ctx = (int)ARG_LL(30), fast = (int)ARG_LL(31);
    attn_scratch sc = {ARG_PTR(32), ARG_PTR(33), ARG_PTR(34), ARG_PTR(35), ARG_PTR(36), ARG_PTR(37), ARG_PTR(38), ARG_PTR(39)};
    float *h = ARG_PTR(40);
    if (PyErr_Occurred()) return NULL;
    if (pos < 0 || pos >= max_ctx) { PyErr_SetString(PyExc_ValueError, "attn_token: position outside the cache"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    attn_token(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
               L.cos_r, L.sin_r, pos, kc, vc, max_ctx, fast, sc, h);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_batch(<attn layer: 27, cos/sin: the whole tables>, B, pos_ptr (B int64), k_cache_ptrs (B int64),
 *            v_cache_ptrs, max_ctx, fast, x, q, k, v, att, out, xq, oq, h): 42 arguments */
static PyObject *py_attn_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 42) { PyErr_SetString(PyExc_TypeError, "attn_batch takes 42 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int B = (int)ARG_LL(27);
    const int64_t *pos = ARG_PTR(28);
    float *const *kcs = ARG_PTR(29), *const *vcs = ARG_PTR(30);
    int max_ctx = (int)ARG_LL(31), fast = (int)ARG_LL(32);
    attn_scratch sc = {ARG_PTR(33), ARG_PTR(34), ARG_PTR(35), ARG_PTR(36), ARG_PTR(37), ARG_PTR(38), ARG_PTR(39), ARG_PTR(40)};
    float *h = ARG_PTR(41);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "attn_batch: %d tokens, at most %d", B, MAXB); return NULL; }
    for (int b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_ctx) {
            PyErr_SetString(PyExc_ValueError, "attn_batch: a position outside the cache");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    attn_batch(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
               L.cos_r, L.sin_r, B, pos, kcs, vcs, max_ctx, fast, sc, h);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_part(<attn_batch's 42 arguments, h read only>, kv0, kv1, part_ptr (B x hidden)): 45 arguments */
static PyObject *py_attn_part(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 45) { PyErr_SetString(PyExc_TypeError, "attn_part takes 45 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int B = (int)ARG_LL(27);
    const int64_t *pos = ARG_PTR(28);
    float *const *kcs = ARG_PTR(29), *const *vcs = ARG_PTR(30);
    int max_ctx = (int)ARG_LL(31), fast = (int)ARG_LL(32);
    attn_scratch sc = {ARG_PTR(33), ARG_PTR(34), ARG_PTR(35), ARG_PTR(36), ARG_PTR(37), ARG_PTR(38), ARG_PTR(39), ARG_PTR(40)};
    const float *h = ARG_PTR(41);
    int kv0 = (int)ARG_LL(42), kv1 = (int)ARG_LL(43);
    float *part = ARG_PTR(44);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "attn_part: %d tokens, at most %d", B, MAXB); return NULL; }
    if (kv0 < 0 || kv1 <= kv0 || kv1 > L.n_kv
        || ((int64_t)kv0 * (L.n_heads / L.n_kv) * L.hd) % block_size(L.wo.t)) {
        PyErr_SetString(PyExc_ValueError, "attn_part: KV head range outside the layer or off the output's blocks");
        return NULL;
    }
    for (int b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_ctx) {
            PyErr_SetString(PyExc_ValueError, "attn_part: a position outside the cache");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    attn_part(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
              L.cos_r, L.sin_r, B, pos, kcs, vcs, max_ctx, fast, sc, h, kv0, kv1, part);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attn_token", (PyCFunction)(void (*)(void))py_attn_token, METH_FASTCALL, "one token's attention block"},
    {"attn_batch", (PyCFunction)(void (*)(void))py_attn_batch, METH_FASTCALL, "a small batch's attention blocks"},
    {"attn_part", (PyCFunction)(void (*)(void))py_attn_part, METH_FASTCALL, "some KV heads' share of attention"},
    {"matvec", (PyCFunction)(void (*)(void))py_matvec, METH_FASTCALL, "rows . x in the file's blocks"},
    {"ffn_token", (PyCFunction)(void (*)(void))py_ffn_token, METH_FASTCALL, "one token's partial FFN"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "rows . x for a small batch of tokens"},
    {"ffn_batch", (PyCFunction)(void (*)(void))py_ffn_batch, METH_FASTCALL, "a small batch's partial FFN"},
    {"dequant", (PyCFunction)(void (*)(void))py_dequant, METH_FASTCALL, "rows as float32"},
    {"interleave", (PyCFunction)(void (*)(void))py_interleave, METH_FASTCALL, "rows of the X16 types, 16 side by side"},
    {"interleave_blocks", (PyCFunction)(void (*)(void))py_interleave_blocks, METH_FASTCALL, "each row's blocks, 16 side by side"},
    {"quantize_q8", (PyCFunction)(void (*)(void))py_quantize_q8, METH_FASTCALL, "8-bit activation blocks"},
    {"residual_norm", (PyCFunction)(void (*)(void))py_residual_norm, METH_FASTCALL, "h += shares; x = norm(h)"},
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
    return PyModule_Create(&module);
}
