/* _kernels.c, part: the file's block formats in portable C: the K-quants' (and IQ4_XS's)
 * unpacking, Q5_0's, Q5_1's and IQ4_NL's, fast mode's activation quantization, the exact and
 * fast dot products, axpy and dequantization. */

/* ---- blocks of 32 with 5-bit values or a codebook (ggml's layouts) ---------------------------
 * Q5_0 (22 bytes): f16 d, qh[4] (bit j of the little-endian word: value j's fifth bit), qs[16]
 *   (value j < 16 in qs[j]'s low nibble, value j + 16 in its high one); value = d (q - 16).
 * Q5_1 (24 bytes): f16 d, f16 m, qh[4], qs[16] as Q5_0; value = d q + m.
 * IQ4_NL (18 bytes): f16 d, qs[16] nibbles as Q4_0's, each an index into the int8 codebook
 *   kvalues; value = d kvalues[i].
 * IQ4_XS (136 bytes, 256 values): f16 d, u16 scales_h, scales_l[4], qs[128]; sub-block j of 32
 *   has the 6-bit scale ls = nibble j of scales_l | bits 2j..2j+1 of scales_h << 4, its values
 *   IQ4_NL's nibbles in qs[16 j ..+16]; value = (d (ls - 32)) kvalues[i]. */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* One Q5_0, Q5_1 or IQ4_NL block's 32 values as int8: Q5_0 q - 16, Q5_1 q (0..31), IQ4_NL the
 * codebook's */
static inline void unpack32(int t, const uint8_t *w, int8_t *q) {
    if (t == T_IQ4_NL) {
        for (int j = 0; j < 16; j++) { q[j] = kvalues_iq4nl[w[2 + j] & 15]; q[j + 16] = kvalues_iq4nl[w[2 + j] >> 4]; }
        return;
    }
    int off = t == T_Q5_1 ? 4 : 2, zero = t == T_Q5_0 ? 16 : 0;
    uint32_t qh = (uint32_t)rd32(w + off);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((w[off + 4 + j] & 15) | ((qh >> j) & 1) << 4) - zero);
        q[j + 16] = (int8_t)(((w[off + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - zero);
    }
}
static inline int is_q32x(int t) { return t == T_Q5_0 || t == T_Q5_1 || t == T_IQ4_NL; }  /* unpack32's types */

/* ---- K-quant blocks (ggml's layouts), 256 values each ----------------------------------------
 * Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] packed, 128
 *   bytes qs. Sub-block j (32 values) of q: nibbles of qs[32 (j/2) ..+32], low ones for even j,
 *   high ones for odd j. Value = d sc[j] q - dmin m[j].
 * Q5_K (176 bytes): d, dmin, the 12 scale bytes, 32 bytes qh, 128 bytes qs as Q4_K; value i of
 *   sub-block j gets bit j of qh[i] as its fifth bit (q in 0..31).
 * Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16] (one per
 *   16 values), f16 d. Half h (128 values): value 32 k + l (k < 4, l < 32) has low bits
 *   ql[64 h + 32 (k & 1) + l] >> 4 (k >> 1) and high bits qh[32 h + l] >> 2 k; value = d sc (q - 32).
 * Q2_K (84 bytes): 16 bytes sc (per 16 values: scale in the low nibble, min in the high), 64
 *   bytes qs, f16 d, f16 dmin. Value 128 h + 32 k + l: q = qs[32 h + l] >> 2 k & 3;
 *   value = d (sc & 15) q - dmin (sc >> 4).
 * Q3_K (110 bytes): 32 bytes hmask, 64 bytes qs (the low 2 bits, as Q2_K's), 12 bytes of 16
 *   6-bit scales packed, f16 d. Value 32 i + l (i < 8): high bit i of hmask[l], set meaning
 *   no offset: q = low - (bit ? 0 : 4) in -4..3; value = d (sc - 32) q. Scale j: low 4 bits
 *   from byte j % 8 (its high nibble for j >= 8), high 2 bits from byte 8 + j % 4 >> 2 (j / 4). */

/* 6-bit scale and min of sub-block j from Q4_K/Q5_K's 12 packed bytes */
static inline void kscale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* Q3_K's 6-bit scale j from its 12 packed bytes s, less 32 */
static inline int q3k_scale(const uint8_t *s, int j) {
    return (((s[j % 8] >> (4 * (j / 8))) & 15) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

/* One K block as int8 values (Q4_K/Q5_K: 0..31, Q6_K: q - 32, Q2_K: 0..3, Q3_K: -4..3, IQ4_XS:
 * the codebook's) and per sub-block float scale and min (value = scl q - mn); returns the
 * sub-block size (32, or 16 for Q6_K, Q2_K, Q3_K). */
static int kunpack(int t, const uint8_t *w, int8_t *q, float *scl, float *mn) {
    if (t == T_IQ4_XS) {  /* the codebook's values, scale d (ls - 32), no min */
        float d = f16_to_f32(rd16(w));
        int sh = rd16(w + 2);
        for (int j = 0; j < 8; j++) {
            int ls = ((w[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            scl[j] = d * (float)(ls - 32);
            mn[j] = 0.f;
            for (int l = 0; l < 16; l++) {
                q[32 * j + l] = kvalues_iq4nl[w[8 + 16 * j + l] & 15];
                q[32 * j + 16 + l] = kvalues_iq4nl[w[8 + 16 * j + l] >> 4];
            }
        }
        return 32;
    }
    if (t == T_Q2_K || t == T_Q3_K) {
        const uint8_t *qs = w + (t == T_Q2_K ? 16 : 32), *hm = w;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int v = (qs[32 * h + l] >> (2 * k)) & 3, i = 4 * h + k;
                    q[32 * i + l] = (int8_t)(t == T_Q2_K ? v : v - ((hm[l] >> i) & 1 ? 0 : 4));
                }
        if (t == T_Q2_K) {
            float d = f16_to_f32(rd16(w + 80)), dmin = f16_to_f32(rd16(w + 82));
            for (int j = 0; j < 16; j++) { scl[j] = d * (float)(w[j] & 15); mn[j] = dmin * (float)(w[j] >> 4); }
        } else {
            float d = f16_to_f32(rd16(w + 108));
            for (int j = 0; j < 16; j++) { scl[j] = d * (float)q3k_scale(w + 96, j); mn[j] = 0.f; }
        }
        return 16;
    }
    if (t == T_Q6_K) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = f16_to_f32(rd16(w + 208));
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int lo = (ql[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15, hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    q[128 * h + 32 * k + l] = (int8_t)((lo | (hi << 4)) - 32);
                }
        for (int j = 0; j < 16; j++) { scl[j] = d * (float)sc[j]; mn[j] = 0.f; }
        return 16;
    }
    float d = f16_to_f32(rd16(w)), dmin = f16_to_f32(rd16(w + 2));
    const uint8_t *qs = w + (t == T_Q5_K ? 48 : 16), *qh = w + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        kscale_min(w + 4, j, &sc, &m);
        scl[j] = d * (float)sc;
        mn[j] = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
            if (t == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            q[32 * j + l] = (int8_t)v;
        }
    }
    return 32;
}

static void quantize_q8_c(const float *x, int n, q8blk *out) {
    for (int b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)lrintf(xb[j] * id);
            out[b].q[j] = (int8_t)v;
            s += v;
        }
        out[b].d = d;
        out[b].s = s;
    }
}

/* ---- dot products, portable ---------------------------------------------------------------- */

/* exact: w (n values in type t) . x (float) */
static float dot_exact_c(int t, const uint8_t *w, const float *x, int n) {
    float acc = 0.f;
    switch (t) {
    case T_F32: { const float *f = (const float *)w; for (int i = 0; i < n; i++) acc += f[i] * x[i]; break; }
    case T_F16: for (int i = 0; i < n; i++) acc += f16_to_f32(rd16(w + 2 * i)) * x[i]; break;
    case T_BF16: for (int i = 0; i < n; i++) acc += bf16_to_f32(rd16(w + 2 * i)) * x[i]; break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, x += QK) {
            float s = 0.f;
            for (int j = 0; j < 16; j++) s += (float)((w[2 + j] & 15) - 8) * x[j] + (float)((w[2 + j] >> 4) - 8) * x[j + 16];
            acc += f16_to_f32(rd16(w)) * s;
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, x += QK) {
            float s = 0.f, sx = 0.f;
            for (int j = 0; j < 16; j++) {
                s += (float)(w[4 + j] & 15) * x[j] + (float)(w[4 + j] >> 4) * x[j + 16];
                sx += x[j] + x[j + 16];
            }
            acc += f16_to_f32(rd16(w)) * s + f16_to_f32(rd16(w + 2)) * sx;
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, x += QK) {
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += (float)(int8_t)w[2 + j] * x[j];
            acc += f16_to_f32(rd16(w)) * s;
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: {
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), x += QK) {
            float s = 0.f, sx = 0.f;
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) { s += (float)q[j] * x[j]; sx += x[j]; }
            acc += f16_to_f32(rd16(w)) * s + (t == T_Q5_1 ? f16_to_f32(rd16(w + 2)) * sx : 0.f);
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), x += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int j = 0; j < QKK / ss; j++) {  /* per sub-block: scale . (q . x) - min . sum(x) */
                float s = 0.f, sx = 0.f;
                for (int l = j * ss; l < (j + 1) * ss; l++) { s += (float)q[l] * x[l]; sx += x[l]; }
                acc += scl[j] * s - mn[j] * sx;
            }
        }
        break;
    }
    }
    return acc;
}

/* fast: w (quantized type) . xq (q8 blocks); float types fall back to the exact product with x */
static float dot_fast_c(int t, const uint8_t *w, const q8blk *xq, int nb) {
    float acc = 0.f;
    if (is_kquant(t)) {  /* a K block of 256 spans 8 q8 blocks */
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < nb / 8; b++, w += type_bytes(t)) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int c = 0; c < 8; c++, xq++) {
                const int8_t *qc = q + QK * c;
                if (ss == QK) {  /* Q4_K, Q5_K: sub-block c is this q8 block; its min needs sum(qx) */
                    int32_t s = 0;
                    for (int l = 0; l < QK; l++) s += qc[l] * xq->q[l];
                    acc += scl[c] * xq->d * (float)s - mn[c] * xq->d * (float)xq->s;
                } else if (t == T_Q2_K) {  /* two sub-blocks of 16, each with its min: needs sum(qx) per 16 */
                    int32_t s0 = 0, s1 = 0, x0 = 0, x1 = 0;
                    for (int l = 0; l < 16; l++) {
                        s0 += qc[l] * xq->q[l], s1 += qc[16 + l] * xq->q[16 + l];
                        x0 += xq->q[l], x1 += xq->q[16 + l];
                    }
                    acc += xq->d * (scl[2 * c] * (float)s0 + scl[2 * c + 1] * (float)s1 - (mn[2 * c] * (float)x0 + mn[2 * c + 1] * (float)x1));
                } else {  /* Q6_K, Q3_K: two sub-blocks of 16, signed q, no min */
                    int32_t s0 = 0, s1 = 0;
                    for (int l = 0; l < 16; l++) { s0 += qc[l] * xq->q[l]; s1 += qc[16 + l] * xq->q[16 + l]; }
                    acc += xq->d * (scl[2 * c] * (float)s0 + scl[2 * c + 1] * (float)s1);
                }
            }
        }
        return acc;
    }
    for (int b = 0; b < nb; b++, xq++) {
        int32_t s = 0;
        switch (t) {
        case T_Q4_0:
            for (int j = 0; j < 16; j++) s += (w[2 + j] & 15) * xq->q[j] + (w[2 + j] >> 4) * xq->q[j + 16];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)(s - 8 * xq->s);
            w += 18;
            break;
        case T_Q4_1:
            for (int j = 0; j < 16; j++) s += (w[4 + j] & 15) * xq->q[j] + (w[4 + j] >> 4) * xq->q[j + 16];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)s + f16_to_f32(rd16(w + 2)) * xq->d * (float)xq->s;
            w += 20;
            break;
        case T_Q8_0:
            for (int j = 0; j < QK; j++) s += (int8_t)w[2 + j] * xq->q[j];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)s;
            w += 34;
            break;
        case T_Q5_0: case T_Q5_1: case T_IQ4_NL: {  /* Q5_1's min times sum(x) as Q4_1's */
            int8_t q[QK];
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) s += q[j] * xq->q[j];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)s + (t == T_Q5_1 ? f16_to_f32(rd16(w + 2)) * xq->d * (float)xq->s : 0.f);
            w += type_bytes(t);
            break;
        }
        }
    }
    return acc;
}

/* y += a * w (n values in type t): the down projection of one active neuron when the file holds
 * down transposed (PowerInfer's ffn_down_t: a neuron's down column is a row of blocks) */
static void axpy_c(int t, const uint8_t *w, float a, float *y, int n) {
    switch (t) {
    case T_F32: { const float *f = (const float *)w; for (int i = 0; i < n; i++) y[i] += a * f[i]; break; }
    case T_F16: for (int i = 0; i < n; i++) y[i] += a * f16_to_f32(rd16(w + 2 * i)); break;
    case T_BF16: for (int i = 0; i < n; i++) y[i] += a * bf16_to_f32(rd16(w + 2 * i)); break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, y += QK) {
            float ad = a * f16_to_f32(rd16(w));
            for (int j = 0; j < 16; j++) { y[j] += ad * (float)((w[2 + j] & 15) - 8); y[j + 16] += ad * (float)((w[2 + j] >> 4) - 8); }
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, y += QK) {
            float ad = a * f16_to_f32(rd16(w)), am = a * f16_to_f32(rd16(w + 2));
            for (int j = 0; j < 16; j++) { y[j] += ad * (float)(w[4 + j] & 15) + am; y[j + 16] += ad * (float)(w[4 + j] >> 4) + am; }
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, y += QK) {
            float ad = a * f16_to_f32(rd16(w));
            for (int j = 0; j < QK; j++) y[j] += ad * (float)(int8_t)w[2 + j];
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: {
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), y += QK) {
            float ad = a * f16_to_f32(rd16(w)), am = t == T_Q5_1 ? a * f16_to_f32(rd16(w + 2)) : 0.f;
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) y[j] += ad * (float)q[j] + am;
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), y += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int l = 0; l < QKK; l++) y[l] += a * scl[l / ss] * (float)q[l] - a * mn[l / ss];
        }
        break;
    }
    }
}

/* One row's n values at w (type t, whole blocks) as float32 into o */
static void dequant_row(int t, const uint8_t *w, int n, float *o) {
    switch (t) {
    case T_F32: memcpy(o, w, sizeof(float) * n); break;
    case T_F16: for (int j = 0; j < n; j++) o[j] = f16_to_f32(rd16(w + 2 * j)); break;
    case T_BF16: for (int j = 0; j < n; j++) o[j] = bf16_to_f32(rd16(w + 2 * j)); break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, o += QK) {
            float d = f16_to_f32(rd16(w));
            for (int j = 0; j < 16; j++) { o[j] = d * (float)((w[2 + j] & 15) - 8); o[j + 16] = d * (float)((w[2 + j] >> 4) - 8); }
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, o += QK) {
            float d = f16_to_f32(rd16(w)), mn = f16_to_f32(rd16(w + 2));
            for (int j = 0; j < 16; j++) { o[j] = d * (float)(w[4 + j] & 15) + mn; o[j + 16] = d * (float)(w[4 + j] >> 4) + mn; }
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, o += QK) {
            float d = f16_to_f32(rd16(w));
            for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)w[2 + j];
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: {  /* as gguf-py: d q (+ m) */
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), o += QK) {
            float d = f16_to_f32(rd16(w));
            unpack32(t, w, q);
            if (t == T_Q5_1) {
                float mn = f16_to_f32(rd16(w + 2));
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j] + mn;
            } else
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), o += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int l = 0; l < QKK; l++) o[l] = scl[l / ss] * (float)q[l] - mn[l / ss];  /* as gguf-py: (d sc) q - dmin m */
        }
        break;
    }
    }
}
